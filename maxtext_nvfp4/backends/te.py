"""``nvfp4_backend=te``: our NVFP4 recipe expressed in Transformer Engine JAX's terms (Blackwell).

What TE is asked to do, independent of MaxText (the MaxText side, a subclass of MaxText's
``TransformerEngineQuantization``, is :mod:`maxtext_nvfp4.integration.te_quantization`):

1. **Recipe toggles.** ``transformer_engine.common.recipe.NVFP4BlockScaling(**recipe_kwargs(settings))``:

     disable_rht                 = not settings.rht
     disable_stochastic_rounding = not settings.stochastic_rounding
     disable_2d_quantization     = not settings.two_d_weights

   TE JAX reads exactly these three fields (``NVFP4ScalingQuantizeConfig.initialize_from_recipe``);
   the per-GEMM treatment (fprop x 1x16 RNE / W 16x16; dgrad dy 1x16 SR; wgrad xT, dyT RHT16, dy SR)
   is TE's and matches our emulation's ``GemmRecipe`` defaults.
2. **Per-GEMM precision.** ``plan(mesh_axes) -> "nvfp4" | "bf16" | "fp8"`` is asked once per projection
   (``DenseGeneral.__init__`` calls ``quant.dot_general_cls(mesh_axes=kernel_axes)``): ``nvfp4`` -> the
   TE NVFP4 path above; ``fp8`` -> the same MaxText/TE machinery with ``recipe.Float8CurrentScaling()``;
   ``bf16`` -> a plain ``lax.dot_general`` Linen module (TE is not involved at all).
3. **The stochastic-rounding rng stream.** TE draws it in ``NVFP4ScalingQuantizeConfig.
   _make_stochastic_rounding_rng_state`` as ``module.make_rng("sr_rng")`` on the Linen wrapper, folds in
   ``sha256("grad")``, and turns it into ``(num_devices, 4)`` uint32 Philox seeds, for the DGRAD quantizer
   only, and only when SR is on. See :func:`rng_streams_needed` for how it is supplied in MaxText.

TE is imported lazily, inside functions, only when this backend builds a GEMM. The wiring is checked with real TE
JAX 2.20.2 traced and compiled for compile-only B200s on a CPU (the te test stage, tests/te/: calls, their
configuration, partitioning, refusals) and against a fake of the TE names it touches in the CPU suite
(tests/backends/test_te_backend.py); no TE kernel has run (the ``@pytest.mark.blackwell`` tests and
``maxtext-nvfp4 verify-hardware`` are the checks on a Blackwell GPU).
"""

from __future__ import annotations

from typing import Any, Callable

from maxtext_nvfp4.backends.capability import BackendError, te_jax_option_problem
from maxtext_nvfp4.core import implementations
from maxtext_nvfp4.core import layout as layout_lib
from maxtext_nvfp4.core import settings
from maxtext_nvfp4.core import te_limits

PRECISIONS = settings.PRECISIONS
# The rng stream TE JAX's NVFP4 quantizer asks its Flax module for. (The MaxText stream it is served
# from is a fact of the MaxText version: the adapter's ``te_sr_source_stream``.)
TE_SR_RNG_STREAM = "sr_rng"


def recipe_kwargs(settings) -> dict[str, bool]:
  """Our toggles as ``NVFP4BlockScaling`` keyword arguments (pure; no TE import)."""
  return {
      "disable_rht": not settings.rht,
      "disable_stochastic_rounding": not settings.stochastic_rounding,
      "disable_2d_quantization": not settings.two_d_weights,
  }


def check_te_settings(settings) -> None:
  """Raise :class:`BackendError` (one line) for settings the TE backend does not map (yet).

  * ``nvfp4_2d_weights=false`` with ``nvfp4_rht=true``: TE JAX quantizes a 1D (``NVFP4_1D_SCALING``)
    kernel ``ROWWISE_COLWISE`` with ``use_rht=True`` (``transformer_engine/jax/quantize/helper.py``,
    ``NVFP4ScalingQuantizeConfig._make_rht_quantize_meta``: every 1D tensor quantized column-wise gets
    RHT, the kernel included). The kernel's column-wise copy is the fprop RHS, so the fprop would pair an
    RHT kernel with a non-RHT x, which ``_quantize_gemm_operands`` (``cpp_extensions/gemm.py``) rejects
    ("if one operand is quantized with RHT, the other must be ... as well"). ``NVFP4BlockScaling`` has no
    per-tensor RHT toggle (only ``disable_rht``, global), so nothing maps the emulation's variant (RHT on
    the wgrad operands x and dy only, 1x16 W without RHT) onto TE: refused.

  * any recipe option TE JAX (2.20.2) does not have -- ``nvfp4_4over6``, ``nvfp4_row_scaled_activation``,
    ``nvfp4_backward_override`` (``RecipeOptions`` fields with ``te_jax=False``): TE JAX's
    ``NVFP4ScalingQuantizeConfig`` reads only disable_rht / disable_stochastic_rounding /
    disable_2d_quantization of the recipe, so TE would silently run the standard recipe. Refused, naming
    the option (``nvfp4_backend=auto`` runs such a recipe emulated instead, see ``capability.choose_backend``).

  * ``nvfp4_fp4_weight_gather=off`` with ``nvfp4_backend=te`` (the key is the emulation's): TE gathers the kernel
    it quantized and nothing makes it gather bf16 instead; when ``auto`` picks TE, the start-up line of
    :mod:`maxtext_nvfp4.integration.te_weight_gather` says so instead (the MoE experts, emulated, follow the key).

  The late precision switch is mapped (a ``lax.cond`` between TE's NVFP4 ``dense`` and the FP8 / BF16 one,
  :mod:`maxtext_nvfp4.integration.te_quantization`).
  """
  problem = te_jax_option_problem(settings)
  if problem:
    raise BackendError(f"nvfp4_backend=te cannot run {problem}; set nvfp4_backend=emulate (or auto, which runs it"
                       " emulated), or drop the option")
  insisted = implementations.insisted(settings.backend)  # None under auto: explained at start-up instead
  if settings.fp4_weight_gather == "off" and insisted is not None and not insisted.fp4_weight_gather_key:
    raise BackendError("nvfp4_fp4_weight_gather=off cannot run on Transformer Engine: TE all-gathers each NVFP4"
                       " kernel already quantized (E2M1 + E4M3 scales) and has no bf16 weight gather; drop the key"
                       " (auto), or set nvfp4_backend=emulate")
  if settings.rht and not settings.two_d_weights:
    raise BackendError(
        "nvfp4_2d_weights=false with nvfp4_rht=true cannot run on Transformer Engine: TE applies RHT to the"
        " 1D kernel's column-wise copy (the fprop operand) and then refuses the fprop GEMM; set"
        " nvfp4_2d_weights=true, or nvfp4_rht=false, or nvfp4_backend=emulate"
    )


def check_te_shapes(config, settings, *, layout=None) -> None:
  """Raise :class:`BackendError` (one line) when TE would refuse a decoder NVFP4 GEMM of ``config``.

  The limits (block axes, cuBLAS contraction, RHT cast fusion) are :mod:`maxtext_nvfp4.core.te_limits`;
  they are decided from the config alone, so this runs before any device check. The line names layer,
  role, pass, dimension, size (per device shard) and the rule of the first refusal, how many more there
  are, and the config keys that set the refused sizes.
  """
  check_te_gemms(settings, layout or layout_lib.from_config(config, moe_layer_rules={}))


def check_te_gemms(settings, layout) -> None:
  """:func:`check_te_shapes` of a config already read: its settings and its decoder (``ModelLayout``)."""
  refs = te_limits.refusals_of(settings, layout)
  if refs:
    more = f" (and {len(refs) - 1} more: maxtext-nvfp4 doctor --recipe lists them)" if len(refs) > 1 else ""
    keys = te_limits.fix_keys(refs)
    change = f"change {', '.join(keys)} (sizes are per device shard)" if keys else "change that size"
    raise BackendError(
        f"nvfp4_backend=te: Transformer Engine would refuse {refs[0].text()}{more}; {change}, or keep"
        " the projection out of NVFP4 (nvfp4_targets), or set nvfp4_backend=emulate (which zero-pads)"
    )


def rng_streams_needed(settings) -> tuple[str, ...]:
  """Rng streams TE's modules draw at apply time: ``("sr_rng",)`` when stochastic rounding is on.

  What the MaxText plugin must do to supply ``sr_rng`` inside MaxText's train step (checked in the
  sources of the MaxText version the adapter names; the TE side was read, not run):

  * Keep ``needs_apply_rngs`` True whenever this returns a non-empty tuple (the quantization object
    from :func:`make_te_quantization` does this itself). ``DenseGeneral.__init__`` (linears.py:350)
    otherwise calls ``ToNNX.release_rngs()`` and the Linen wrapper would have no rngs at apply time.
  * Nothing else: ``ToNNX`` keeps a fork of DenseGeneral's ``nnx.Rngs(params, dropout, aqt)`` and, at
    every call, passes one fresh key per stream to ``linen.apply(..., rngs=...)``. Our wrapper answers
    ``make_rng("sr_rng")`` with ``fold_in(make_rng("aqt"), nvfp4_seed)``, so each projection gets its
    own key (distinct forks). The streams' counters are NNX state that ``train_step`` carries out of
    ``value_and_grad`` in ``non_param_rest`` and writes back with ``nnx.update``, so the key changes
    every step. (Without our override Linen would silently fall back to the ``params`` stream, which
    is what MaxText's own ``te_nvfp4`` relies on.)
  * Rng streams do not exist outside train mode (``create_nnx_rngs`` gives only ``params`` for
    inference); Linen's fallback to ``params`` then applies, which is harmless for a forward pass
    (SR touches only the output gradient).
  """
  return (TE_SR_RNG_STREAM,) if settings.stochastic_rounding else ()


def te_recipe(precision: str, settings):
  """TE's recipe object for one GEMM precision: ``NVFP4BlockScaling(**recipe_kwargs)`` or FP8 current scaling."""
  from transformer_engine.common import recipe  # pylint: disable=import-outside-toplevel # pytype: disable=import-error

  if precision == "nvfp4":
    return recipe.NVFP4BlockScaling(**recipe_kwargs(settings))  # pytype: disable=module-attr
  if precision == "fp8":
    return recipe.Float8CurrentScaling()
  raise ValueError(f"no TE recipe for precision {precision!r}")
