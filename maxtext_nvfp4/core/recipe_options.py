"""The NVFP4 recipe options: one frozen type shared by the settings (``nvfp4_*`` keys) and the GEMM recipe.

Pure Python (no JAX, no MaxText, no TE). :class:`RecipeOptions` is the single home of every option of
Transformer Engine's ``NVFP4BlockScaling`` recipe that changes how an NVFP4 GEMM is computed.
``settings.Nvfp4Settings`` (the run's config keys) and ``gemm.GemmRecipe`` (one linear layer) both
inherit it, so an option is declared once: its field here carries its config key, its TE name, its
choices and its help text (``dataclasses.field(metadata=...)``), and everything else is derived from the
fields -- the config schema, the patch series' schema/base.yml hunks, ``doctor``, the precision table
header, the late switch's pass signature (``GemmRecipe._pass_signature``) and the TE backend's refusals.

Which tensor gets which quantizer (TE 2.20.2, ``pytorch/quantization.py``
``NVFP4BlockScalingRecipeState.make_quantizers``; the per-tensor numbers are
:class:`maxtext_nvfp4.core.nvfp4.ScaleRule`):

  4over6      = nvfp4_4over6 covers the tensor: "weights" -> W; "activations" -> x (both of its copies:
                fprop's 1x16 along K and wgrad's 1x16 along tokens); "all" -> both. Gradients (dy) never.
  e4m3_bound  = 256 when the tensor uses 4over6 AND nvfp4_4over6_e4m3_use_256 covers it, else 448
                (TE: ``nvfp4_e4m3_max``, the E4M3 bound in the global scale S_enc = 6 * bound / amax)
  row_scaled  = nvfp4_row_scaled_activation and the tensor is x (TE: forward, non-weight quantizers)

TE refuses (``make_quantizers`` raises ValueError): 4over6 on a tensor quantized with RHT ("NVFP4 4over6
quantization does not support RHT") or stochastic rounding. Weights never get either and gradients never
get 4over6, so the one refused combination is 4over6 on activations with RHT on (the activation
quantizer's RHT flag covers its wgrad copy): :func:`refusal`.

Backward override (TE ``backward_override``, PyTorch ``Linear``): ``none`` keeps NVFP4 dgrad/wgrad;
``high_precision`` computes them on the original operands (``dy`` unquantized, W and x as saved in high
precision); ``dequantized`` on the forward's quantized W and x, dequantized to the activation dtype, with
``dy`` unquantized. :func:`backward_precision` maps a pass's planned precision accordingly.
"""

from __future__ import annotations

import dataclasses

# TE's NVFP4BlockScaling choices (transformer_engine/common/recipe/__init__.py, 2.20.2).
FOUR_OVER_SIX_SCOPES = ("none", "weights", "activations", "all")
FOUR_OVER_SIX_ERR_MODES = ("MAE", "MSE")
# TE: None | "high_precision" | "dequantized"; a YAML key spells None as "none".
BACKWARD_OVERRIDES = ("none", "high_precision", "dequantized")
# The tensors of one linear layer, as the scopes name them.
TENSORS = ("weight", "activation", "gradient")
# The E4M3 bound of the global scale: TE's standard 448, or 256 for 4over6 tensors (headroom for map-to-4).
E4M3_BOUNDS = (448, 256)


def _opt(default, *, key: str, te: str, help: str, choices: tuple | None = None, te_jax: bool = True):
  """A recipe option field: its config key, TE's name for it, help, choices, and whether TE JAX has it."""
  return dataclasses.field(default=default, metadata=dict(key=key, te=te, help=help, choices=choices, te_jax=te_jax))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecipeOptions:
  """TE ``NVFP4BlockScaling`` options that change the NVFP4 GEMMs' numbers (see the module docstring)."""

  # 16-point random Hadamard transform on the wgrad operands x and dy (TE: not disable_rht).
  rht: bool = _opt(True, key="nvfp4_rht", te="disable_rht (negated)", help="bool: RHT16 on wgrad operands")
  # Stochastic rounding of dy, both copies (TE: not disable_stochastic_rounding).
  stochastic_rounding: bool = _opt(True, key="nvfp4_stochastic_rounding", te="disable_stochastic_rounding (negated)",
                                   help="bool: SR on output gradients")
  # 16x16 weight tiles shared by fprop and dgrad; False: 1x16 along each GEMM's contraction
  # (TE: not disable_2d_quantization).
  two_d_weights: bool = _opt(True, key="nvfp4_2d_weights", te="disable_2d_quantization (negated)",
                             help="bool: 16x16 weight blocks")
  # Four Over Six (arXiv 2512.02010): per block, quantize with the map-to-6 and the map-to-4 (1.5x) scale
  # and keep the one with the lower error, for these tensors (TE: nvfp4_4over6).
  four_over_six: str = _opt("none", key="nvfp4_4over6", te="nvfp4_4over6", choices=FOUR_OVER_SIX_SCOPES,
                            help="none | weights | activations | all: 4over6 block scales", te_jax=False)
  # Of the 4over6 tensors, those whose global scale uses the E4M3 bound 256 instead of 448
  # (TE: nvfp4_4over6_e4m3_use_256; ignored for tensors without 4over6, as in TE).
  four_over_six_e4m3_use_256: str = _opt("all", key="nvfp4_4over6_e4m3_use_256", te="nvfp4_4over6_e4m3_use_256",
                                         choices=FOUR_OVER_SIX_SCOPES,
                                         help="none | weights | activations | all: 4over6 tensors with bound 256",
                                         te_jax=False)
  # 4over6's block error: sum of |error| (MAE) or of error**2 (MSE) over the block (TE: nvfp4_4over6_err_mode).
  four_over_six_err_mode: str = _opt("MAE", key="nvfp4_4over6_err_mode", te="nvfp4_4over6_err_mode",
                                     choices=FOUR_OVER_SIX_ERR_MODES, help="MAE | MSE: 4over6 block error",
                                     te_jax=False)
  # x with one fp32 amax per row of each copy instead of one per tensor (TE: row_scaled_activation).
  row_scaled_activation: bool = _opt(False, key="nvfp4_row_scaled_activation", te="row_scaled_activation",
                                     help="bool: one amax per row of x", te_jax=False)
  # dgrad/wgrad: NVFP4 (none), on the original operands (high_precision), or on the dequantized forward
  # operands with dy unquantized (dequantized) (TE: backward_override).
  backward_override: str = _opt("none", key="nvfp4_backward_override", te="backward_override",
                                choices=BACKWARD_OVERRIDES, help="none | high_precision | dequantized", te_jax=False)

  def covers(self, scope: str, tensor: str) -> bool:
    """Whether a scope value (``none|weights|activations|all``) covers ``tensor`` (weight|activation|gradient)."""
    if tensor == "gradient":
      return False
    return scope == "all" or scope == f"{tensor}s"

  def uses_4over6(self, tensor: str) -> bool:
    return self.covers(self.four_over_six, tensor)

  def e4m3_bound(self, tensor: str) -> int:
    """The E4M3 bound of ``tensor``'s global scale: 256 for covered 4over6 tensors, else 448."""
    return 256 if self.uses_4over6(tensor) and self.covers(self.four_over_six_e4m3_use_256, tensor) else 448

  def row_scaled(self, tensor: str) -> bool:
    return self.row_scaled_activation and tensor == "activation"

  def backward_precision(self, planned: str) -> str:
    """A backward pass's precision after the override: nvfp4 -> bf16 / dequantized; others unchanged."""
    if planned != "nvfp4" or self.backward_override == "none":
      return planned
    return "bf16" if self.backward_override == "high_precision" else "dequantized"

  def te_pytorch_only(self) -> list[str]:
    """``key=value`` of every option set off its default that TE JAX (2.20.2) does not have."""
    out = []
    for f in dataclasses.fields(RecipeOptions):
      v = getattr(self, f.name)
      if not f.metadata["te_jax"] and v != f.default:
        # 4over6's bound/err mode change nothing without 4over6.
        if f.name.startswith("four_over_six_") and self.four_over_six == "none":
          continue
        out.append(f"{f.metadata['key']}={_text(v)}")
    return out

  def describe(self) -> str:
    """One line of every option off its default (``standard recipe`` when none): the precision table header."""
    changed = [f"{f.metadata['key']}={_text(getattr(self, f.name))}" for f in dataclasses.fields(RecipeOptions)
               if getattr(self, f.name) != f.default]
    return ", ".join(changed) if changed else "TE's standard NVFP4 recipe options"


def _text(v) -> str:
  return ("true" if v else "false") if isinstance(v, bool) else str(v)


def option_fields() -> tuple[dataclasses.Field, ...]:
  return dataclasses.fields(RecipeOptions)


def options_of(obj) -> RecipeOptions:
  """The :class:`RecipeOptions` part of any object that has its fields (settings, a GEMM recipe)."""
  return RecipeOptions(**{f.name: getattr(obj, f.name) for f in option_fields()})


def refusal(o: RecipeOptions) -> str | None:
  """The one-line reason TE refuses this combination (key, value, fix), or None.

  Choices are checked by ``settings.validate``. TE 2.20.2 ``make_quantizers`` raises for 4over6 on a
  tensor whose quantizer has RHT (the activation quantizer's RHT flag is ``not disable_rht``) or SR (only
  gradients, which 4over6 never covers).
  """
  if o.uses_4over6("activation") and o.rht:
    return (f"nvfp4_4over6={o.four_over_six} with nvfp4_rht=true: Transformer Engine refuses 4over6 on a tensor"
            " quantized with RHT (the activations' wgrad copy; 'NVFP4 4over6 quantization does not support RHT');"
            " set nvfp4_rht=false, or nvfp4_4over6=weights")
  return None
