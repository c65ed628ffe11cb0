"""Selective precision: which decoder GEMM runs in which precision, before and after the late switch.

Pure Python (no JAX, no MaxText). For every decoder layer ``l`` (0-based) and projection role ``r`` the
plan gives the precision of the three GEMMs of a linear layer (fprop ``y = x·W``, dgrad ``dx = dy·Wᵀ``,
wgrad ``dW = xᵀ·dy``), each one of ``"nvfp4" | "bf16" | "fp8"``:

* ``r`` is NVFP4 at layer ``l`` iff ``r`` is in ``nvfp4_targets`` AND
  ``nvfp4_keep_first_layers <= l < num_layers - nvfp4_keep_last_layers``; then all three passes are
  ``"nvfp4"``. Otherwise all three passes run in ``nvfp4_fallback``.
* Late switch (``nvfp4_switch_at_step`` -> step ``S``): for steps ``>= S`` every pass in
  ``nvfp4_switch_scope`` (``forward`` = fprop only, ``all`` = fprop, dgrad, wgrad) that ran in NVFP4
  runs in ``nvfp4_switch_to`` instead. Passes already in the fallback are left alone (the switch only
  ever raises precision of NVFP4 passes; it never lowers a BF16 kept layer to FP8).

With ``scan_layers=true`` the layer index is unknown (``layer=None``): keep-first/last are rejected by
``settings.validate`` and every layer follows the targets.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

from maxtext_nvfp4.core import settings as settings_lib

# Decoder projection roles, in the order MaxText constructs them inside one layer (Attention, then MLP).
ATTENTION_ROLES = ("query", "key", "value", "qkv_proj", "out")
MLP_ROLES = ("wi_0", "wi_1", "wi", "wo")
# Stable small integers folded into the stochastic-rounding key (never renumber: it would change
# the SR stream of existing runs).
ROLE_IDS = {"query": 1, "key": 2, "value": 3, "qkv_proj": 4, "out": 5, "wi_0": 6, "wi_1": 7, "wi": 8, "wo": 9}

PASSES = ("fprop", "dgrad", "wgrad")


def decoder_roles(*, num_activations: int = 2, fused_mlp: bool = False, fused_qkv: bool = False) -> tuple[str, ...]:
  """The projection roles of one MaxText Llama-style decoder layer, in construction order."""
  attn = ("qkv_proj",) if fused_qkv else ("query", "key", "value")
  if fused_mlp:
    mlp = ("wi",)
  elif num_activations == 1:
    mlp = ("wi",)
  else:
    mlp = tuple(f"wi_{i}" for i in range(num_activations))
  return attn + ("out",) + mlp + ("wo",)


def role_group(role: str) -> str:
  """``"attention"`` or ``"mlp"``."""
  if role in ATTENTION_ROLES:
    return "attention"
  if role in MLP_ROLES:
    return "mlp"
  raise ValueError(f"unknown decoder GEMM role {role!r}")


def is_targeted(role: str, targets: str) -> bool:
  """Whether ``nvfp4_targets`` selects ``role``."""
  return targets == "all" or role_group(role) == targets


def is_kept(layer: int | None, num_layers: int, s: settings_lib.Nvfp4Settings) -> bool:
  """Whether decoder layer ``layer`` is one of the first/last kept out of NVFP4 (None: unknown, never)."""
  if layer is None:
    return False
  return layer < s.keep_first_layers or layer >= num_layers - s.keep_last_layers


@dataclasses.dataclass(frozen=True, kw_only=True)
class Precisions:
  """Precision of the three GEMMs of one projection."""

  # y = x·W
  fprop: str
  # dx = dy·Wᵀ
  dgrad: str
  # dW = xᵀ·dy
  wgrad: str

  def as_tuple(self) -> tuple[str, str, str]:
    return (self.fprop, self.dgrad, self.wgrad)


def precisions(s: settings_lib.Nvfp4Settings, *, layer: int | None, role: str,
               num_layers: int) -> tuple[Precisions, Precisions | None]:
  """``(before the switch, after the switch or None when the switch is off)`` for one GEMM."""
  nvfp4 = is_targeted(role, s.targets) and not is_kept(layer, num_layers, s)
  p = s.fallback if not nvfp4 else "nvfp4"
  before = Precisions(fprop=p, dgrad=p, wgrad=p)
  if float(s.switch_at_step) <= 0:
    return before, None
  scope = ("fprop",) if s.switch_scope == "forward" else PASSES
  after = dataclasses.replace(
      before, **{ps: s.switch_to for ps in scope if getattr(before, ps) == "nvfp4"})
  return before, after


def gemm_recipes(s: settings_lib.Nvfp4Settings, *, layer: int | None, role: str, num_layers: int):
  """``(recipe, switched recipe or None)`` as :class:`maxtext_nvfp4.core.gemm.GemmRecipe` for one GEMM.

  RHT / stochastic rounding / 2D weight blocks come from the settings (they only affect NVFP4 passes).
  """
  from maxtext_nvfp4.core import gemm  # pylint: disable=import-outside-toplevel  (JAX; keep plan import pure)

  before, after = precisions(s, layer=layer, role=role, num_layers=num_layers)

  def recipe(p: Precisions):
    return gemm.GemmRecipe(fprop=p.fprop, dgrad=p.dgrad, wgrad=p.wgrad, rht=s.rht,
                           stochastic_rounding=s.stochastic_rounding, two_d_weights=s.two_d_weights)

  return recipe(before), (recipe(after) if after is not None else None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionRow:
  """One decoder GEMM of the precision table."""

  # decoder layer index (None: scanned layers, one row stands for every layer)
  layer: int | None
  # projection role (query, key, value, out, wi_0, wi_1, wo, ...)
  role: str
  # precisions before the switch
  fprop: str
  dgrad: str
  wgrad: str
  # precisions from the switch step on (equal to the above when the switch is off)
  fprop_after: str
  dgrad_after: str
  wgrad_after: str


def precision_table(s: settings_lib.Nvfp4Settings, *, num_layers: int,
                    roles: Iterable[str] | None = None, scan_layers: bool = False) -> list[PrecisionRow]:
  """Every decoder GEMM (layer-major, roles in construction order) with its per-pass precisions."""
  roles = tuple(roles) if roles is not None else decoder_roles()
  layers: list[int | None] = [None] if scan_layers else list(range(num_layers))
  rows = []
  for layer in layers:
    for role in roles:
      before, after = precisions(s, layer=layer, role=role, num_layers=num_layers)
      after = after or before
      rows.append(PrecisionRow(layer=layer, role=role, fprop=before.fprop, dgrad=before.dgrad,
                               wgrad=before.wgrad, fprop_after=after.fprop, dgrad_after=after.dgrad,
                               wgrad_after=after.wgrad))
  return rows


def format_precision_table(rows: list[PrecisionRow], *, switch_step: int | None = None) -> str:
  """A fixed-width text table of :func:`precision_table` rows (one line per GEMM)."""
  head = ["layer", "role", "fprop", "dgrad", "wgrad"]
  if switch_step is not None:
    head += [f"fprop@{switch_step}+", f"dgrad@{switch_step}+", f"wgrad@{switch_step}+"]
  body = []
  for r in rows:
    line = ["all (scanned)" if r.layer is None else str(r.layer), r.role, r.fprop, r.dgrad, r.wgrad]
    if switch_step is not None:
      line += [r.fprop_after, r.dgrad_after, r.wgrad_after]
    body.append(line)
  widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
  fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
  return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body])


# ---------------------------------------------------------------------------------------------------
# Which GEMM is being built: (layer, role) from the order of MaxText's projection constructions
# ---------------------------------------------------------------------------------------------------

# kernel axes of a decoder projection -> the roles sharing that signature inside one layer, in
# construction order (MaxText 0.2.5 ``layers/attentions.py`` and ``layers/linears.py``: Attention builds
# query, key, value, out; MlpBlock builds wi_0, wi_1, wo). ("embed", "mlp") is resolved per config.
SIGNATURES = {
    ("embed_attn", "q_heads", "kv"): ("query",),
    ("embed_attn", "kv_heads", "kv_head_dim"): ("key", "value"),
    ("embed_attn", "heads", "kv"): ("qkv_proj",),
    ("heads", "kv", "embed_attn"): ("out",),
    ("embed", "num_activations", "mlp"): ("wi",),
    ("mlp", "embed"): ("wo",),
}


def signature_roles(mesh_axes, num_activations: int) -> tuple[str, ...]:
  """The roles built with kernel axes ``mesh_axes`` inside one decoder layer, in construction order."""
  axes = tuple(mesh_axes)
  if axes == ("embed", "mlp"):
    return ("wi",) if num_activations == 1 else tuple(f"wi_{i}" for i in range(num_activations))
  if axes in SIGNATURES:
    return SIGNATURES[axes]
  raise settings_lib.SettingsError(
      f"quantization=nvfp4 cannot identify the decoder projection with kernel axes {axes!r} (supported: the"
      " llama2/default decoder blocks' query/key/value/out/wi/wo; ici_context_autoregressive_parallelism=1)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmLocator:
  """Names the decoder GEMM being built from the order of MaxText's ``dot_general_cls`` calls.

  MaxText builds each decoder layer's projections in order (layers_0..N-1 when ``scan_layers=false``)
  and asks for one dot_general per projection with its kernel axes. The axes name the projection up to
  repeats inside a layer (key/value and wi_0/wi_1 share axes), so the k-th call with a given signature
  is role ``roles[k % m]`` of layer ``(k // m) % num_layers`` (``m`` = roles with that signature). With
  ``scan_layers=true`` one module stands for every layer: layer is None. Equal across MaxText's repeated
  quantization-object builds (the counter is not compared).
  """

  # config.num_decoder_layers
  num_layers: int
  # len(config.mlp_activations): how many up-projections (wi_0, wi_1, ...) share ("embed", "mlp")
  num_activations: int = 2
  # config.scan_layers
  scan_layers: bool = False
  # calls so far per kernel-axes signature
  counts: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

  def locate(self, mesh_axes) -> tuple[int | None, str]:
    """(layer, role) of the next projection built with ``mesh_axes`` (advances the counter)."""
    roles = signature_roles(mesh_axes, self.num_activations)
    sig = tuple(mesh_axes)
    k = self.counts.get(sig, 0)
    self.counts[sig] = k + 1
    layer = None if self.scan_layers else (k // len(roles)) % self.num_layers
    return layer, roles[k % len(roles)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FpropPlan:
  """``plan(mesh_axes) -> "nvfp4" | "bf16" | "fp8"``: the fprop precision of the next projection built.

  What the TE backend asks per projection (TE runs one recipe for all three GEMMs of a layer).
  """

  # the run's NVFP4 settings
  settings: settings_lib.Nvfp4Settings
  # names the projection being built
  locator: GemmLocator

  def __call__(self, mesh_axes) -> str:
    layer, role = self.locator.locate(mesh_axes)
    before, _ = precisions(self.settings, layer=layer, role=role, num_layers=self.locator.num_layers)
    return before.fprop


def sr_key(seed: int, step, layer: int | None, role: str):
  """``fold_in(fold_in(fold_in(key(seed), step), layer), ROLE_IDS[role])`` (threefry; no layer fold if None).

  Depends on nothing but the step in the (restored) train state, so a resumed run draws the same bits.
  """
  import jax  # pylint: disable=import-outside-toplevel  (keep the plan importable without JAX)
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  key = jax.random.key(seed, impl="threefry2x32")
  key = jax.random.fold_in(key, jnp.asarray(step, jnp.uint32))
  if layer is not None:
    key = jax.random.fold_in(key, layer)
  return jax.random.fold_in(key, ROLE_IDS[role])
