"""The ``nvfp4_*`` config keys: names, types, defaults, allowed values and cross-key validation.

Pure Python (no JAX, no MaxText import). This is the single source of truth for our keys: the MaxText
plugin registers them from here, the patch set's schema/base.yml hunks are checked against them, and
``doctor`` prints them. Defaults follow TE's ``NVFP4BlockScaling`` recipe (RHT on, stochastic
rounding on, 2D weights on, no 4over6, per-tensor amax, no backward override) and MaxText's ``te_nvfp4``
(every projection of every decoder layer). The recipe options themselves (the keys that change an NVFP4
GEMM's numbers) are declared once, in :class:`maxtext_nvfp4.core.recipe_options.RecipeOptions`, which
:class:`Nvfp4Settings` inherits; their key, help and choices come from that field's metadata.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from maxtext_nvfp4.core import implementations
from maxtext_nvfp4.core import recipe_options

# nvfp4_backend: auto, then every implementation of the table (core/implementations.py)
BACKENDS = (implementations.AUTO, *implementations.IMPLEMENTATIONS)
# The precision of one GEMM pass (fprop, dgrad or wgrad).
PRECISIONS = ("nvfp4", "bf16", "fp8")
TARGETS = ("all", "mlp", "attention", "experts")
FALLBACKS = ("bf16", "fp8")
SWITCH_SCOPES = ("forward", "all")
# Over which part of a sharded operand an NVFP4 amax is taken (core/amax_scope.py).
AMAX_SCOPES = ("te", "global")
# What an NVFP4 GEMM computes when fine-tuning for NVFP4 serving (quantization-aware training, nvfp4_qat):
#   full     TE's training recipe in all three passes (what pre-training uses)
#   forward  the recipe's forward; dgrad/wgrad in bf16 on the original operands (straight-through): the same GEMMs
#            as nvfp4_backward_override=high_precision (TE's backward_override), named for QAT; with
#            nvfp4_backward_override=dequantized, that backward instead
#   serving  the forward the export serves (core/serving_gemm.py: W4A4 with 1x16 weight blocks and fused-group
#            global scales as exported, per-token activation scales), high-precision backward as `forward`
QAT_MODES = ("full", "forward", "serving")
# How an FSDP-sharded NVFP4 weight is all-gathered (core/weight_gather.py).
FP4_WEIGHT_GATHERS = ("auto", "off")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Nvfp4Settings(recipe_options.RecipeOptions):
  """Effective NVFP4 recipe settings (one per run). Field ``f`` is config key ``nvfp4_<f>`` (the recipe
  options, inherited from :class:`~maxtext_nvfp4.core.recipe_options.RecipeOptions`, name theirs in their
  metadata: ``four_over_six`` is ``nvfp4_4over6``)."""

  # Where NVFP4 GEMMs run: auto (TE on Blackwell, else emulate), emulate (exact pure JAX), te.
  backend: str = "auto"
  # Which decoder projections run in NVFP4: all (attention + MLP + MoE experts; te_nvfp4 has no experts),
  # mlp (dense MLPs and shared experts), attention, experts (routed experts). The MoE router never does.
  targets: str = "all"
  # te: each operand's amax as TE's dense scopes it on the run's mesh (x, dy per device, W per tensor-parallel
  # shard); global: one amax per tensor, results independent of the mesh (compare runs across meshes).
  amax_scope: str = "te"
  # auto: under FSDP each NVFP4 weight is quantized where its shards live and all-gathered as E2M1 codes + E4M3
  # tile scales (0.504 B/weight instead of 2; the same bits) wherever every shard is whole 16x16 tiles, else in
  # the activation dtype with a start-up line saying why; off: always in the activation dtype (emulation only).
  fp4_weight_gather: str = "auto"
  # Number of first / last decoder layers whose GEMMs are not NVFP4 (they run in `fallback`).
  keep_first_layers: int = 0
  keep_last_layers: int = 0
  # Precision of every GEMM that is not NVFP4 (untargeted projections, kept layers): bf16 or fp8.
  fallback: str = "bf16"
  # Late precision switch: from this step on, `switch_scope` passes run in `switch_to`.
  # <= 0: off; 0 < v < 1: fraction of `steps`; >= 1: the step number.
  switch_at_step: float = -1.0
  switch_to: str = "bf16"
  # forward: only fprop switches (the paper's cheap fix); all: fprop, dgrad and wgrad.
  switch_scope: str = "forward"
  # Seed mixed with (step, layer, role) for stochastic-rounding randomness.
  seed: int = 0
  # Per-GEMM-role quantization statistics in MaxText's metrics, every `diagnostics_interval` steps.
  diagnostics: bool = False
  diagnostics_interval: int = 10
  # Quantization-aware training mode (QAT_MODES): full | forward | serving.
  qat: str = "full"
  # On diagnostic steps also the high-precision gradient of the same batch and its cosine / norm ratio per GEMM
  # role, layer and routed expert (one extra forward and backward pass on those steps; docs/diagnostics.md).
  diagnostics_grad: bool = False

  def gemm_options(self) -> recipe_options.RecipeOptions:
    """The recipe options an NVFP4 GEMM runs with: the ``nvfp4_*`` options, with ``backward_override =
    high_precision`` under ``nvfp4_qat=forward|serving`` unless ``nvfp4_backward_override`` names a backward
    (``forward`` + ``dequantized``: the bf16 backward on the forward's dequantized operands)."""
    o = recipe_options.options_of(self)
    if self.qat == "full" or o.backward_override != "none":  # forward keeps an explicit override (dequantized)
      return o
    return dataclasses.replace(o, backward_override="high_precision")

  def backward_precision(self, planned: str) -> str:
    """A backward pass's precision as computed (``gemm_options``' override: see RecipeOptions)."""
    return self.gemm_options().backward_precision(planned)

  def forward_precision(self, planned: str) -> str:
    """The fprop as computed: ``nvfp4`` is ``serve`` (the export's W4A4) under ``nvfp4_qat=serving``."""
    return "serve" if planned == "nvfp4" and self.qat == "serving" else planned

  def switch_step(self, total_steps: int | None) -> int | None:
    """The first step that runs in ``switch_to``, or None when the switch is off."""
    v = float(self.switch_at_step)
    if v <= 0:
      return None
    if v < 1:
      if not total_steps:
        raise ValueError("nvfp4_switch_at_step given as a fraction needs `steps`")
      return int(round(v * total_steps))
    return int(v)


# field name -> one-line help (the recipe options' come from their field metadata)
KEY_HELP: dict[str, str] = {
    **{f.name: f.metadata["help"] for f in recipe_options.option_fields()},
    "backend": " | ".join(BACKENDS),
    "targets": "all | mlp | attention | experts",
    "amax_scope": "te | global",
    "fp4_weight_gather": "auto | off",
    "keep_first_layers": "int >= 0",
    "keep_last_layers": "int >= 0",
    "fallback": "bf16 | fp8",
    "switch_at_step": "<=0 off, (0,1) fraction of steps, >=1 step",
    "switch_to": "bf16 | fp8",
    "switch_scope": "forward | all",
    "seed": "int",
    "diagnostics": "bool",
    "diagnostics_interval": "int >= 1",
    "qat": "full | forward | serving",
    "diagnostics_grad": "bool (needs nvfp4_diagnostics)",
}

CHOICES: dict[str, tuple[str, ...]] = {
    **{f.name: f.metadata["choices"] for f in recipe_options.option_fields() if f.metadata["choices"]},
    "backend": BACKENDS,
    "targets": TARGETS,
    "fallback": FALLBACKS,
    "switch_to": FALLBACKS,
    "switch_scope": SWITCH_SCOPES,
    "amax_scope": AMAX_SCOPES,
    "qat": QAT_MODES,
    "fp4_weight_gather": FP4_WEIGHT_GATHERS,
}


# The recipe options' keys are in their metadata (``two_d_weights`` is ``nvfp4_2d_weights``, ``four_over_six``
# ``nvfp4_4over6``); every other field ``f`` is ``nvfp4_<f>``.
_OPTION_KEYS = {f.name: f.metadata["key"] for f in recipe_options.option_fields()}
_OPTION_FIELDS = {k: f for f, k in _OPTION_KEYS.items()}


def config_key(field: str) -> str:
  """Config key of a settings field."""
  return _OPTION_KEYS.get(field, f"nvfp4_{field}")


def field_of_key(key: str) -> str:
  return _OPTION_FIELDS.get(key, key[len("nvfp4_") :])


def schema_choices(field: str) -> tuple:
  """The values MaxText's config schema accepts for an enumerated key: its choices, plus None where "none" is a
  choice (MaxText's pyconfig turns any string "none" from YAML or the command line into None before pydantic
  validates it; :func:`from_config` reads None back as "none")."""
  choices = CHOICES[field]
  return choices + (None,) if "none" in choices else choices


def config_keys() -> dict[str, Any]:
  """``{config key: default}`` for every ``nvfp4_*`` key, in declaration order."""
  return {config_key(f.name): f.default for f in dataclasses.fields(Nvfp4Settings)}


def field_types() -> dict[str, type]:
  return {config_key(f.name): type(f.default) for f in dataclasses.fields(Nvfp4Settings)}


class SettingsError(ValueError):
  """An invalid ``nvfp4_*`` value or combination. The message is one line naming key, value, fix."""


def from_config(cfg: Any) -> Nvfp4Settings:
  """Build settings from a MaxText config (attribute access) or a mapping of config keys."""
  get = cfg.get if isinstance(cfg, Mapping) else (lambda k, d: getattr(cfg, k, d))
  values = {}
  for f in dataclasses.fields(Nvfp4Settings):
    v = get(config_key(f.name), f.default)
    v = getattr(v, "value", v)  # enum members -> plain values
    if v is None and "none" in CHOICES.get(f.name, ()):
      v = "none"  # MaxText's pyconfig reads the string "none" as None
    values[f.name] = v
  return Nvfp4Settings(**values)


def validate(s: Nvfp4Settings, *, num_layers: int | None = None, steps: int | None = None,
             scan_layers: bool | None = None) -> None:
  """Raise :class:`SettingsError` (one line: key, value, allowed) for an invalid value or combination."""
  for field, allowed in CHOICES.items():
    v = getattr(s, field)
    if v not in allowed:
      raise SettingsError(f"{config_key(field)}={v!r} is not allowed; choose one of: {', '.join(allowed)}")
  refused = recipe_options.refusal(s)
  if refused:
    raise SettingsError(refused)
  qat = qat_refusal(s)
  if qat:
    raise SettingsError(qat)
  for field in ("keep_first_layers", "keep_last_layers"):
    v = getattr(s, field)
    if int(v) != v or v < 0:
      raise SettingsError(f"{config_key(field)}={v!r} must be an integer >= 0")
  if s.diagnostics_interval < 1:
    raise SettingsError(f"nvfp4_diagnostics_interval={s.diagnostics_interval!r} must be >= 1")
  if s.diagnostics_grad and not s.diagnostics:
    raise SettingsError("nvfp4_diagnostics_grad=true needs nvfp4_diagnostics=true (it runs on the diagnostic"
                        " steps); set both")
  kept = s.keep_first_layers + s.keep_last_layers
  if num_layers is not None and kept and kept >= num_layers:
    raise SettingsError(
        f"nvfp4_keep_first_layers={s.keep_first_layers} + nvfp4_keep_last_layers={s.keep_last_layers} keeps"
        f" all {num_layers} decoder layers out of NVFP4; keep fewer than {num_layers} in total"
    )
  if scan_layers and kept:
    raise SettingsError(
        f"nvfp4_keep_first_layers/nvfp4_keep_last_layers ({s.keep_first_layers}/{s.keep_last_layers}) need"
        " per-layer modules; set scan_layers=false"
    )
  sw = float(s.switch_at_step)
  if sw > 0:
    if sw >= 1 and sw != int(sw):
      raise SettingsError(f"nvfp4_switch_at_step={s.switch_at_step!r}: use a step number (>= 1) or a fraction in (0, 1)")
    if steps is not None and sw >= 1 and sw >= steps:
      raise SettingsError(
          f"nvfp4_switch_at_step={int(sw)} is not before the last step (steps={steps}); use a step < {steps}"
          " or a fraction in (0, 1)"
      )


def qat_refusal(s: Nvfp4Settings) -> str | None:
  """One line when ``nvfp4_qat`` contradicts another key (key, value, fix), else None.

  ``serving`` computes dgrad/wgrad in bf16 on the original operands: ``nvfp4_backward_override=dequantized`` says
  otherwise (``forward`` takes it: the bf16 backward on its forward's dequantized operands). ``serving`` computes the forward exactly as the export serves it, so the options that change the
  training recipe's forward quantizers (4over6, row-scaled activations) cannot apply; the others (RHT, stochastic
  rounding, 16x16 weight tiles) belong to the NVFP4 backward and the training forward, which it does not run.
  """
  if s.qat == "full":
    return None
  insisted = implementations.insisted(s.backend)
  what = insisted.qat_refusals.get(s.qat) if insisted is not None else None
  if what:  # decided from the keys alone: before any device check
    return (f"nvfp4_backend={insisted.name} cannot run nvfp4_qat={s.qat}: {what}; set nvfp4_backend=auto (on Blackwell"
            f" it runs the mode emulated and says so) or emulate, or nvfp4_qat=full")
  if s.qat == "serving" and s.backward_override == "dequantized":
    return ("nvfp4_qat=serving computes dgrad/wgrad in bf16 on the original operands (straight-through);"
            " nvfp4_backward_override=dequantized (on the training recipe's dequantized operands) does not apply to its"
            " forward: set nvfp4_backward_override=none, or nvfp4_qat=forward")
  if s.qat == "serving":
    for key, value, off in (("nvfp4_4over6", s.four_over_six, "none"),
                            ("nvfp4_row_scaled_activation", s.row_scaled_activation, False)):
      if value != off:
        shown = str(value).lower() if isinstance(value, bool) else value
        return (f"nvfp4_qat=serving computes the forward exactly as the export serves it (1x16 weight blocks, per-token"
                f" activation scales); {key}={shown} changes the training recipe's quantizers, which it does not run:"
                f" unset {key}, or use nvfp4_qat=full|forward")
  return None
