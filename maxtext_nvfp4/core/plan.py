"""Selective precision: which decoder GEMM runs in which precision, before and after the late switch.

Pure Python (no JAX, no MaxText). For every decoder layer ``l`` (0-based) and projection role ``r`` the
plan gives the precision of the three GEMMs of a linear layer (fprop ``y = x·W``, dgrad ``dx = dy·Wᵀ``,
wgrad ``dW = xᵀ·dy``), each one of ``"nvfp4" | "bf16" | "fp8"``:

* ``r`` is NVFP4 at layer ``l`` iff ``r``'s group (attention, mlp, experts) is in ``nvfp4_targets`` AND
  ``nvfp4_keep_first_layers <= l < num_layers - nvfp4_keep_last_layers``; then all three passes are
  ``"nvfp4"``. Otherwise all three passes run in ``nvfp4_fallback``.
* The MoE router (gate logits) is always BF16 (high precision, as in TE/Megatron, where only the expert
  linears are quantized); MoE dispatch and combine are not GEMMs of the plan (MaxText's own einsums).
* Late switch (``nvfp4_switch_at_step`` -> step ``S``): for steps ``>= S`` every pass in
  ``nvfp4_switch_scope`` (``forward`` = fprop only, ``all`` = fprop, dgrad, wgrad) that ran in NVFP4
  runs in ``nvfp4_switch_to`` instead. Passes already in the fallback are left alone (the switch only
  ever raises precision of NVFP4 passes; it never lowers a BF16 kept layer to FP8).

With ``scan_layers=true`` the layer index is unknown (``layer=None``): keep-first/last are rejected by
``settings.validate`` and every layer follows the targets.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Mapping

from maxtext_nvfp4.core import settings as settings_lib

# Decoder projection roles, in the order MaxText constructs them inside one layer (Attention, then MLP).
# q_a/q_b/kv_a/kv_b: multi-head latent attention's low-rank projections (wq_a, wq_b, wkv_a, wkv_b).
ATTENTION_ROLES = ("query", "key", "value", "qkv_proj", "q_a", "q_b", "kv_a", "kv_b", "out")
# Dense MLPs, and the shared experts of MoE layers (MaxText builds them as an MlpBlock).
MLP_ROLES = ("wi_0", "wi_1", "wi", "wo")
# The routed experts' linears (RoutedMoE's wi_0/wi_1/wo einsums, one GEMM per expert).
EXPERT_ROLES = ("expert_wi_0", "expert_wi_1", "expert_wo")
# The MoE gate (router logits): never quantized.
ROUTER_ROLES = ("router",)
# Stable small integers folded into the stochastic-rounding key (never renumber: it would change
# the SR stream of existing runs).
ROLE_IDS = {"query": 1, "key": 2, "value": 3, "qkv_proj": 4, "out": 5, "wi_0": 6, "wi_1": 7, "wi": 8, "wo": 9,
            "q_a": 10, "q_b": 11, "kv_a": 12, "kv_b": 13, "router": 14, "expert_wi_0": 15, "expert_wi_1": 16,
            "expert_wo": 17}

PASSES = ("fprop", "dgrad", "wgrad")


def decoder_roles(*, num_activations: int = 2, fused_mlp: bool = False, fused_qkv: bool = False,
                  mla: bool = False, q_lora: bool = False, dense_mlp: bool = True,
                  moe: bool = False) -> tuple[str, ...]:
  """The projection roles of one MaxText decoder layer, in construction order.

  ``mla``: multi-head latent attention (``q_lora``: with the low-rank query, ``q_lora_rank > 0``).
  ``dense_mlp``: the layer has a dense MLP or shared experts; ``moe``: routed experts (router first).
  """
  if mla:
    attn = ("q_a", "q_b") if q_lora else ("query",)
    attn += ("kv_a", "kv_b")
  else:
    attn = ("qkv_proj",) if fused_qkv else ("query", "key", "value")
  if not dense_mlp:
    mlp = ()
  elif fused_mlp or num_activations == 1:
    mlp = ("wi", "wo")
  else:
    mlp = tuple(f"wi_{i}" for i in range(num_activations)) + ("wo",)
  return attn + ("out",) + (ROUTER_ROLES + EXPERT_ROLES if moe else ()) + mlp


def role_group(role: str) -> str:
  """``"attention"``, ``"mlp"``, ``"experts"`` or ``"router"``."""
  for group, roles in (("attention", ATTENTION_ROLES), ("mlp", MLP_ROLES), ("experts", EXPERT_ROLES),
                       ("router", ROUTER_ROLES)):
    if role in roles:
      return group
  raise ValueError(f"unknown decoder GEMM role {role!r}")


def is_targeted(role: str, targets: str) -> bool:
  """Whether ``nvfp4_targets`` selects ``role`` (``all``: every group but the router, which is never)."""
  group = role_group(role)
  return group != "router" and (targets == "all" or group == targets)


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
  p = "bf16" if role_group(role) == "router" else s.fallback if not nvfp4 else "nvfp4"
  before = Precisions(fprop=p, dgrad=p, wgrad=p)
  if float(s.switch_at_step) <= 0:
    return before, None
  scope = ("fprop",) if s.switch_scope == "forward" else PASSES
  after = dataclasses.replace(
      before, **{ps: s.switch_to for ps in scope if getattr(before, ps) == "nvfp4"})
  return before, after


def gemm_recipes(s: settings_lib.Nvfp4Settings, *, layer: int | None, role: str, num_layers: int):
  """``(recipe, switched recipe or None)`` as :class:`maxtext_nvfp4.core.gemm.GemmRecipe` for one GEMM.

  The recipe options (RHT, stochastic rounding, 2D weight blocks, 4over6, row-scaled x, backward override)
  are the settings' own :class:`~maxtext_nvfp4.core.recipe_options.RecipeOptions` fields, copied whole
  (``Nvfp4Settings.gemm_options``: with ``nvfp4_qat=forward|serving``, ``backward_override=high_precision``).
  """
  from maxtext_nvfp4.core import gemm  # pylint: disable=import-outside-toplevel  (JAX; keep plan import pure)

  before, after = precisions(s, layer=layer, role=role, num_layers=num_layers)
  options = dataclasses.asdict(s.gemm_options())

  def recipe(p: Precisions):
    return gemm.GemmRecipe(fprop=p.fprop, dgrad=p.dgrad, wgrad=p.wgrad, **options)

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
                    roles: Iterable[str] | Callable[[int | None], Iterable[str]] | None = None,
                    scan_layers: bool = False) -> list[PrecisionRow]:
  """Every decoder GEMM (layer-major, roles in construction order) with its per-pass precisions.

  ``roles``: the roles of every layer, or ``roles(layer)`` when layers differ (MoE and dense layers).
  The passes are shown as computed: ``nvfp4_backward_override`` (and ``nvfp4_qat=forward|serving``) turns an
  nvfp4 dgrad/wgrad into ``bf16`` (high_precision) or ``dequantized`` (bf16 GEMM on the dequantized forward
  operands); ``nvfp4_qat=serving`` shows an nvfp4 fprop as ``serve`` (the export's W4A4 forward).
  """
  roles_of = roles if callable(roles) else (lambda _, r=tuple(roles or decoder_roles()): r)
  layers: list[int | None] = [None] if scan_layers else list(range(num_layers))
  rows = []
  for layer in layers:
    for role in roles_of(layer):
      before, after = precisions(s, layer=layer, role=role, num_layers=num_layers)
      after = after or before
      bwd, fwd = s.backward_precision, s.forward_precision
      rows.append(PrecisionRow(layer=layer, role=role, fprop=fwd(before.fprop), dgrad=bwd(before.dgrad),
                               wgrad=bwd(before.wgrad), fprop_after=fwd(after.fprop), dgrad_after=bwd(after.dgrad),
                               wgrad_after=bwd(after.wgrad)))
  return rows


def format_precision_table(rows: list[PrecisionRow], *, switch_step: int | None = None) -> str:
  """A fixed-width text table of :func:`precision_table` rows (one line per GEMM: the full table; the
  start-up log shows :func:`format_precision_runs`)."""
  head = ["layer", "role", "fprop", "dgrad", "wgrad"]
  if switch_step is not None:
    head += [f"fprop@{switch_step}+", f"dgrad@{switch_step}+", f"wgrad@{switch_step}+"]
  body = []
  for r in rows:
    line = ["all (scanned)" if r.layer is None else str(r.layer), r.role, r.fprop, r.dgrad, r.wgrad]
    if switch_step is not None:
      line += [r.fprop_after, r.dgrad_after, r.wgrad_after]
    body.append(line)
  return _fixed_width(head, body)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionRun:
  """Consecutive decoder layers ``first..last`` whose GEMMs run in the same precisions, role by role."""

  # first and last decoder layer of the run (None: scanned layers, one run stands for every layer)
  first: int | None
  last: int | None
  # (roles, precisions): the roles sharing one precision tuple (fprop, dgrad, wgrad, then the three after
  # the switch), in construction order of each group's first role
  groups: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...]

  def layers(self) -> str:
    """``"all (scanned)"``, ``"5"`` or ``"2-123"``."""
    if self.first is None:
      return "all (scanned)"
    return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"


def _precisions_of(r: PrecisionRow) -> tuple[str, ...]:
  return (r.fprop, r.dgrad, r.wgrad, r.fprop_after, r.dgrad_after, r.wgrad_after)


def precision_runs(rows: list[PrecisionRow]) -> list[PrecisionRun]:
  """:func:`precision_table` rows as runs of identical layers: layers ``l`` and ``l+1`` share a run iff
  their (role, precisions) sequences are equal; inside a run, roles with equal precisions are one group.

  A 126-layer model with 2 kept layers at each end is 3 runs (0-1, 2-123, 124-125) whatever its size.
  """
  layers: list[tuple[int | None, tuple]] = []
  for r in rows:
    if not layers or layers[-1][0] != r.layer:
      layers.append((r.layer, ()))
    layers[-1] = (r.layer, layers[-1][1] + ((r.role, _precisions_of(r)),))
  runs: list[tuple[int | None, int | None, tuple]] = []
  for layer, signature in layers:
    if runs and runs[-1][2] == signature and layer is not None and runs[-1][1] == layer - 1:
      runs[-1] = (runs[-1][0], layer, signature)
    else:
      runs.append((layer, layer, signature))
  out = []
  for first, last, signature in runs:
    groups: dict[tuple[str, ...], list[str]] = {}
    for role, precs in signature:
      groups.setdefault(precs, []).append(role)
    out.append(PrecisionRun(first=first, last=last,
                            groups=tuple((tuple(roles), precs) for precs, roles in groups.items())))
  return out


def format_precision_runs(runs: list[PrecisionRun], *, switch_step: int | None = None) -> str:
  """A fixed-width text table of :func:`precision_runs`: one line per (run, group of roles)."""
  head = ["layers", "roles", "fprop", "dgrad", "wgrad"]
  if switch_step is not None:
    head += [f"fprop@{switch_step}+", f"dgrad@{switch_step}+", f"wgrad@{switch_step}+"]
  body = []
  for run in runs:
    for i, (roles, precs) in enumerate(run.groups):
      body.append([run.layers() if i == 0 else "", ",".join(roles), *precs[:len(head) - 2]])
  return _fixed_width(head, body)


def _fixed_width(head: list[str], body: list[list[str]]) -> str:
  widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
  fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
  return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body])


# ---------------------------------------------------------------------------------------------------
# Which GEMM is being built: (layer, role) from the order of MaxText's projection constructions
# ---------------------------------------------------------------------------------------------------

# Which roles share a kernel-axes signature, and in which order MaxText builds them, is a fact of the
# MaxText version: the integration layer's adapter (``MaxTextVersion.kernel_signatures``) passes it in.


def signature_roles(mesh_axes, num_activations: int, signatures: Mapping[tuple, tuple[str, ...]],
                    up_projection_axes: tuple = ("embed", "mlp")) -> tuple[str, ...]:
  """The roles built with kernel axes ``mesh_axes`` inside one decoder layer, in construction order.

  ``signatures``: kernel axes -> roles (the MaxText version's); ``up_projection_axes``: the dense
  up-projections' axes, shared by wi_0..wi_{n-1} (one ``wi`` with a single activation).
  """
  axes = tuple(mesh_axes)
  if axes == tuple(up_projection_axes):
    return ("wi",) if num_activations == 1 else tuple(f"wi_{i}" for i in range(num_activations))
  if axes in signatures:
    return tuple(signatures[axes])
  raise settings_lib.SettingsError(
      f"quantization=nvfp4 cannot identify the decoder projection with kernel axes {axes!r} (supported: the"
      " query/key/value/qkv_proj/out, MLA q_a/q_b/kv_a/kv_b, MLP wi/wo, MoE router and expert projections"
      " listed in the MaxText adapter's kernel_signatures; ici_context_autoregressive_parallelism=1)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmLocator:
  """Names the decoder GEMM being built from the order of MaxText's ``dot_general_cls`` calls.

  MaxText builds each decoder layer's projections in order (layers_0..N-1 when ``scan_layers=false``)
  and asks for one dot_general per projection with its kernel axes. The axes name the projection up to
  repeats inside a layer (key/value and wi_0/wi_1 share axes), so the k-th call with a given signature
  is role ``roles[k % m]`` of layer ``(k // m) % num_layers`` (``m`` = roles with that signature). Router
  and expert roles exist in MoE layers only: their layer is ``moe_layers[(k // m) % len(moe_layers)]``.
  The expert einsums are asked for at call time, once per traced forward: every trace runs every MoE
  layer in order, so the count stays aligned across traces. With ``scan_layers=true`` one module stands
  for every layer: layer is None. Equal across MaxText's repeated quantization-object builds (the counter
  is not compared).
  """

  # config.num_decoder_layers
  num_layers: int
  # len(config.mlp_activations): how many up-projections (wi_0, wi_1, ...) share ("embed", "mlp")
  num_activations: int = 2
  # config.scan_layers
  scan_layers: bool = False
  # the decoder layers with routed experts, in order (None: every layer)
  moe_layers: tuple[int, ...] | None = None
  # kernel axes -> roles sharing them, in build order (the MaxText adapter's kernel_signatures)
  signatures: Mapping[tuple, tuple[str, ...]] = dataclasses.field(hash=False)
  # the dense up-projections' kernel axes (the adapter's up_projection_axes)
  up_projection_axes: tuple = ("embed", "mlp")
  # calls so far per kernel-axes signature
  counts: dict = dataclasses.field(default_factory=dict, compare=False, hash=False, repr=False)

  def locate(self, mesh_axes) -> tuple[int | None, str]:
    """(layer, role) of the next projection built with ``mesh_axes`` (advances the counter)."""
    roles = signature_roles(mesh_axes, self.num_activations, self.signatures, self.up_projection_axes)
    sig = tuple(mesh_axes)
    k = self.counts.get(sig, 0)
    self.counts[sig] = k + 1
    role = roles[k % len(roles)]
    if self.scan_layers:
      return None, role
    if role_group(role) in ("experts", "router") and self.moe_layers:
      return self.moe_layers[(k // len(roles)) % len(self.moe_layers)], role
    return (k // len(roles)) % self.num_layers, role


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
  """``fold_in(fold_in(fold_in(key(seed), step), layer), ROLE_IDS[role])`` (threefry; no layer fold if None),
  as a ``prng.FoldedKey``: the folds are applied where the bits are drawn.

  Depends on nothing but the step in the (restored) train state, so a resumed run draws the same bits.
  """
  import jax  # pylint: disable=import-outside-toplevel  (keep the plan importable without JAX)
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.core import prng  # pylint: disable=import-outside-toplevel

  key = jax.random.key(seed, impl="threefry2x32")
  key = prng.fold_in(key, jnp.asarray(step, jnp.uint32))
  if layer is not None:
    key = prng.fold_in(key, layer)
  return prng.fold_in(key, ROLE_IDS[role])
