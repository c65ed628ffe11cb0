"""``nvfp4_backend=te``: our NVFP4 recipe on Transformer Engine JAX's FP4 kernels (Blackwell).

This adapter reuses MaxText's own TE machinery rather than re-deriving it: MaxText 0.2.5's
``quantizations.TransformerEngineQuantization`` (passed in as ``base_cls`` by the MaxText plugin; this
module never imports MaxText) already wraps ``transformer_engine.jax.dense.dense`` in a Linen module,
routes quantizer state through ``_overwrite_with_gradient`` with checkpoint name ``"quantization"``, and
picks TE's collective-GEMM ops from the kernel's mesh axes. We subclass it and change three things:

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

TE is imported lazily, inside functions, only when this backend builds a GEMM. Nothing here was run
against real TE (no Blackwell machine or TE install was available while writing it); the wiring is
tested on CPU against a fake of the TE names it touches (tests/test_te_backend.py), and the
``@pytest.mark.blackwell`` tests plus ``maxtext-nvfp4 verify-hardware`` are the real-hardware checks.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

from maxtext_nvfp4.capability import BackendError

PRECISIONS = ("nvfp4", "bf16", "fp8")
# The rng stream TE JAX's NVFP4 quantizer asks its Flax module for.
TE_SR_RNG_STREAM = "sr_rng"
# The MaxText rng stream we serve it from: ``maxtext_utils_nnx.create_nnx_rngs`` builds
# ``nnx.Rngs(params, dropout, aqt)`` in train mode; ``aqt`` exists for quantization randomness.
SR_RNG_SOURCE_STREAM = "aqt"


def recipe_kwargs(settings) -> dict[str, bool]:
  """Our toggles as ``NVFP4BlockScaling`` keyword arguments (pure; no TE import)."""
  return {
      "disable_rht": not settings.rht,
      "disable_stochastic_rounding": not settings.stochastic_rounding,
      "disable_2d_quantization": not settings.two_d_weights,
  }


def check_te_settings(settings) -> None:
  """Raise :class:`BackendError` (one line) for settings the TE backend does not map (yet).

  The late precision switch (``nvfp4_switch_at_step``) needs the current step inside every GEMM and a
  ``lax.cond`` between two TE paths; that is implemented for the emulation only.
  """
  if float(settings.switch_at_step) > 0:
    raise BackendError(
        f"nvfp4_switch_at_step={settings.switch_at_step} is emulate-only for now: the late precision switch is"
        " not mapped to Transformer Engine; set nvfp4_backend=emulate, or nvfp4_switch_at_step=-1 to train"
        " with TE without the switch"
    )


def rng_streams_needed(settings) -> tuple[str, ...]:
  """Rng streams TE's modules draw at apply time: ``("sr_rng",)`` when stochastic rounding is on.

  What the MaxText plugin must do to supply ``sr_rng`` inside MaxText 0.2.5's train step (checked in
  the 0.2.5 sources; the TE side was read, not run):

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


_PLAIN_CLS: list[Any] = []


def plain_dot_general_cls():
  """A Linen module computing ``lax.dot_general`` unchanged: the ``bf16`` GEMMs (no TE involved).

  Called like every MaxText quantized dot_general: ``module(lhs, rhs, dimension_numbers,
  precision=None, preferred_element_type=None)``.
  """
  if not _PLAIN_CLS:
    import flax.linen as nn  # pylint: disable=import-outside-toplevel
    import jax  # pylint: disable=import-outside-toplevel

    class PlainDotGeneral(nn.Module):
      """Unquantized GEMM for projections the plan keeps in high precision."""

      @nn.compact
      def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
        del kwargs  # MaxText may pass extra keywords (e.g. for AQT); none apply here
        return jax.lax.dot_general(
            lhs, rhs, dimension_numbers, precision=precision, preferred_element_type=preferred_element_type
        )

    _PLAIN_CLS.append(PlainDotGeneral)
  return _PLAIN_CLS[0]


def _te_recipe(precision: str, settings):
  from transformer_engine.common import recipe  # pylint: disable=import-outside-toplevel # pytype: disable=import-error

  if precision == "nvfp4":
    return recipe.NVFP4BlockScaling(**recipe_kwargs(settings))  # pytype: disable=module-attr
  if precision == "fp8":
    return recipe.Float8CurrentScaling()
  raise ValueError(f"no TE recipe for precision {precision!r}")


_SUBCLASSES: dict[type, type] = {}


def _subclass_of(base_cls: type) -> type:
  """One adapter class per MaxText base class (stable identity: MaxText compares quant objects)."""
  if base_cls in _SUBCLASSES:
    return _SUBCLASSES[base_cls]

  class Nvfp4TransformerEngineQuantization(base_cls):  # type: ignore[misc, valid-type]
    """MaxText's TE quantization with our NVFP4 toggles, per-GEMM plan and seeded ``sr_rng``."""

    # pylint: disable=super-init-not-called
    def __init__(self, config, settings, plan: Callable[[tuple], str]):
      # Not calling base_cls.__init__: it insists on config.quantization == "te_*" and a named recipe.
      self.quant_mode = "train"
      self._settings = settings
      self._plan = plan
      self._recipe = _te_recipe("nvfp4", settings)
      # MaxText's TeCommGemmOverlapPolicy is a str enum; "disabled" compares equal to DISABLED.
      self._te_comm_gemm_overlap_policy = getattr(config, "te_comm_gemm_overlap", "disabled")

    def __hash__(self):
      return hash((type(self).__name__, self.quant_mode, self._settings, self._plan))

    def __eq__(self, other):
      return (
          type(other) is type(self)
          and (self.quant_mode, self._settings, self._plan) == (other.quant_mode, other._settings, other._plan)
      )

    @property
    def needs_apply_rngs(self) -> bool:
      return bool(rng_streams_needed(self._settings))

    @property
    def settings(self):
      return self._settings

    def precision_for(self, mesh_axes=()) -> str:
      p = self._plan(tuple(mesh_axes))
      if p not in PRECISIONS:
        raise ValueError(f"plan({tuple(mesh_axes)!r}) returned {p!r}; expected one of {', '.join(PRECISIONS)}")
      return p

    def _wrap(self, f, name=None):
      wrapper = super()._wrap(f, name)
      seed = int(self._settings.seed)

      class SeededSrRngWrapper(wrapper):  # type: ignore[misc, valid-type]
        """Serves TE's ``sr_rng`` from MaxText's ``aqt`` stream, folded with ``nvfp4_seed``."""

        def make_rng(self, name: str = "params"):
          if name == TE_SR_RNG_STREAM:
            import jax  # pylint: disable=import-outside-toplevel

            return jax.random.fold_in(super().make_rng(SR_RNG_SOURCE_STREAM), seed)
          return super().make_rng(name)

      SeededSrRngWrapper.__name__ = wrapper.__name__
      SeededSrRngWrapper.__qualname__ = wrapper.__qualname__
      return SeededSrRngWrapper

    def dot_general_cls(self, mesh_axes=()):
      precision = self.precision_for(mesh_axes)
      if precision == "bf16":
        return plain_dot_general_cls()
      routed = self
      if precision != "nvfp4":
        routed = copy.copy(self)
        routed._recipe = _te_recipe(precision, self._settings)  # pylint: disable=protected-access
      # MaxText's implementation: TEWrapper(dense(x, kernel, contracting_dims, quantizer_set, ...)).
      return base_cls.dot_general_cls(routed, mesh_axes)

  Nvfp4TransformerEngineQuantization.__qualname__ = f"Nvfp4TransformerEngineQuantization[{base_cls.__name__}]"
  _SUBCLASSES[base_cls] = Nvfp4TransformerEngineQuantization
  return Nvfp4TransformerEngineQuantization


def make_te_quantization(base_cls: type, config: Any, settings, plan: Callable[[tuple], str]):
  """An instance of a subclass of ``base_cls`` running our recipe through TE (see module docstring).

  Args:
    base_cls: MaxText's ``maxtext.layers.quantizations.TransformerEngineQuantization``.
    config: the MaxText config (only ``te_comm_gemm_overlap`` is read).
    settings: :class:`maxtext_nvfp4.settings.Nvfp4Settings`.
    plan: ``plan(mesh_axes) -> "nvfp4" | "bf16" | "fp8"`` for the projection being built. It is part
      of the object's equality/hash (MaxText builds the quantization object several times per run),
      so pass something that compares equal across calls (e.g. a frozen dataclass with ``__call__``).

  Raises:
    BackendError: settings the TE backend does not map (see :func:`check_te_settings`).
  """
  check_te_settings(settings)
  return _subclass_of(base_cls)(config, settings, plan)
