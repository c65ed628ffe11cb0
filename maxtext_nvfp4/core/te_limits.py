"""What Transformer Engine refuses to run in NVFP4: the shape and dtype limits of its GEMMs (pure).

The single source for the three uses: the TE backend refuses such a GEMM before compiling
(``backends/te.py``), the emulation (which zero-pads instead) logs it once at start-up with a line
beginning ``Transformer Engine would refuse:``, and ``maxtext-nvfp4 doctor --recipe`` reports it.

TE never pads. For a linear layer ``y = x·W`` with, per device, ``x`` (M tokens, K), ``W`` (K, N) and
``dy`` (M, N), each NVFP4 pass asks (TE commit d0067d0; shapes are those the kernels see, i.e. per
device -- a size that divides on every device also divides globally):

  pass   operand quantized             block axes % 16 (scale shape)   cuBLAS contraction % 32   RHT cast fusion
  fprop  x 1x16 along K; W 16x16       K; K and N (1D W: K)            K
  dgrad  dy 1x16 along N; W 16x16      N; K and N (1D W: N)            N
  wgrad  xᵀ, dyᵀ 1x16 along M          M                               M                         bf16, M % 64, K % 128
                                                                                                 (x); N % 128 (dy)

Sources: block axes -- ``transformer_engine/jax/quantize/scaling_modes.py``
(``_BlockScalingModeMetadataImpl.get_scale_shape``: "should be divisible by block_x/block_y");
contraction -- ``transformer_engine/jax/cpp_extensions/gemm.py`` ``assert_cublas_requirements``
(alignment 32 for NVFP4, called from ``GemmPrimitive.abstract`` for both operands); RHT --
``transformer_engine/jax/cpp_extensions/quantization.py`` (``QuantizePrimitive.abstract``: x must be
bfloat16, rows % 64 and cols % 128 of the 2D-flattened input, rows = tokens) and
``transformer_engine/jax/csrc/extensions/quantization.cpp`` (``eligible_for_rht_cast_fusion``, the same
rule checked again in C++). TE quantizes x once, row- and column-wise, so the RHT rule on x applies
whenever its wgrad is NVFP4 with RHT on.

Shapes come from the model's :class:`~maxtext_nvfp4.core.layout.ModelLayout` (the roles of each layer;
MLA: ``q_a`` K = emb, N = q_lora_rank; ``q_b``/MLA ``query`` N = heads * (qk_nope + qk_rope); ``kv_a`` N =
kv_lora_rank + qk_rope; ``kv_b`` K = kv_lora_rank, N = heads * (qk_nope + v_head); ``out`` K = heads *
v_head; shared experts' ``wi*``/``wo`` use shared_experts * moe_mlp_dim; the router and routed experts never
run on TE). Dense:
``query/key/value/qkv_proj``: K = emb, N = heads * head_dim; ``out``: K = q_heads * head_dim, N = emb;
``wi*``: K = emb, N = mlp; ``wo``: K = mlp, N = emb; M = per_device_batch_size * max_target_length.
Under tensor parallelism (``ici_tensor_parallelism`` t) the heads and mlp axes are split t ways
(MaxText's logical rules put ``heads`` and ``mlp`` on ``tensor``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from maxtext_nvfp4.core import layout as layout_lib
from maxtext_nvfp4.core import plan as plan_lib
from maxtext_nvfp4.core import settings as settings_lib

# What each rule protects, with the TE source that asserts it.
_BLOCK_RULE = "NVFP4 block axis, TE never pads: quantize/scaling_modes.py"
_CUBLAS_RULE = "cuBLAS NVFP4 contraction: cpp_extensions/gemm.py assert_cublas_requirements"
_RHT_RULE = "RHT cast fusion: cpp_extensions/quantization.py"

REFUSAL_PREFIX = "Transformer Engine would refuse:"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmDims:
  """One decoder projection's GEMM as TE would see it on one device."""

  # decoder layers it stands for, as text ("every layer", "layer 3", "layers 0-1")
  layers: str
  # projection role (query, key, value, qkv_proj, out, wi_0, wi_1, wi, wo)
  role: str
  # M: tokens per device (the wgrad contraction)
  tokens: int
  # K: input features per device (the fprop contraction)
  k: int
  # N: output features per device (the dgrad contraction)
  n: int
  # activation dtype (x and dy), e.g. "bfloat16"
  dtype: str
  # passes that run NVFP4 before or after the late switch, a subset of ("fprop", "dgrad", "wgrad")
  nvfp4_passes: tuple[str, ...]
  # the config keys that set M, K and N: {"M": (...), "K": (...), "N": (...)} (empty: not known)
  keys: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Refusal:
  """One limit a GEMM breaks."""

  # decoder layers ("every layer", "layers 0-1", ...)
  layers: str
  # projection role
  role: str
  # the pass: fprop | dgrad | wgrad
  gemm: str
  # which size, e.g. "K (fprop contraction)"; for the dtype rule the operands' dtype
  dimension: str
  # its value per device (0 for the dtype rule)
  size: int
  # the multiple TE needs (0 for the dtype rule: bfloat16 needed)
  multiple: int
  # the limit broken, with its TE source
  rule: str
  # the config keys that set this size (the fix); empty when not known
  keys: tuple[str, ...] = ()

  def text(self) -> str:
    if not self.multiple:
      return f"{self.layers} {self.role} {self.gemm}: {self.dimension}, not bfloat16 ({self.rule})"
    return (f"{self.layers} {self.role} {self.gemm}: {self.dimension} = {self.size} is not a multiple of"
            f" {self.multiple} ({self.rule})")

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def _checks(g: GemmDims, *, rht: bool, two_d_weights: bool):
  """(pass, dimension label, size, multiple, rule) for every limit of the NVFP4 passes of ``g``."""
  out = []
  if "fprop" in g.nvfp4_passes:
    out += [("fprop", "K (fprop contraction)", g.k, 16, _BLOCK_RULE),
            ("fprop", "K (fprop contraction)", g.k, 32, _CUBLAS_RULE)]
    if two_d_weights:
      out.append(("fprop", "N (W 16x16 tiles)", g.n, 16, _BLOCK_RULE))
  if "dgrad" in g.nvfp4_passes:
    out += [("dgrad", "N (dgrad contraction)", g.n, 16, _BLOCK_RULE),
            ("dgrad", "N (dgrad contraction)", g.n, 32, _CUBLAS_RULE)]
    if two_d_weights:
      out.append(("dgrad", "K (W 16x16 tiles)", g.k, 16, _BLOCK_RULE))
  if "wgrad" in g.nvfp4_passes:
    out += [("wgrad", "M tokens (wgrad contraction)", g.tokens, 16, _BLOCK_RULE),
            ("wgrad", "M tokens (wgrad contraction)", g.tokens, 32, _CUBLAS_RULE)]
    if rht:
      out += [("wgrad", "M tokens (RHT rows of x and dy)", g.tokens, 64, _RHT_RULE),
              ("wgrad", "K (RHT columns of x)", g.k, 128, _RHT_RULE),
              ("wgrad", "N (RHT columns of dy)", g.n, 128, _RHT_RULE)]
  return out


def refusals(g: GemmDims, *, rht: bool, two_d_weights: bool) -> list[Refusal]:
  """Every TE limit ``g`` breaks: per (pass, size) the strictest broken multiple, plus the RHT dtype."""
  worst: dict[tuple[str, str, int], tuple[int, str, str]] = {}
  for gemm, label, size, multiple, rule in _checks(g, rht=rht, two_d_weights=two_d_weights):
    if size % multiple:
      key = (gemm, label.split(" (")[0], size)
      if key not in worst or multiple > worst[key][0]:
        worst[key] = (multiple, label, rule)
  out = [Refusal(layers=g.layers, role=g.role, gemm=gemm, dimension=label, size=size, multiple=multiple, rule=rule,
                 keys=g.keys.get(axis.split()[0], ()))
         for (gemm, axis, size), (multiple, label, rule) in worst.items()]
  if rht and "wgrad" in g.nvfp4_passes and g.dtype != "bfloat16":
    out.append(Refusal(layers=g.layers, role=g.role, gemm="wgrad", dimension=f"x and dy are {g.dtype}", size=0,
                       multiple=0, rule=_RHT_RULE, keys=("dtype",)))
  return out


def _layer_ranges(layers: list[int]) -> str:
  parts, start = [], None
  for i, l in enumerate(layers):
    if start is None:
      start = l
    if i + 1 == len(layers) or layers[i + 1] != l + 1:
      parts.append(str(start) if start == l else f"{start}-{l}")
      start = None
  return ("layer " if len(layers) == 1 else "layers ") + ",".join(parts)


def _kn(layout: layout_lib.ModelLayout, layer: int | None, role: str) -> tuple[int, int] | None:
  """(K, N) per device of ``role`` in ``layer``, or None for a GEMM TE never runs here (router: always
  bf16; routed experts: TE JAX has no NVFP4 grouped GEMM, the MoE refusal keeps them off TE)."""
  d, tp = layout.dims, layout.tensor_parallel
  assert d is not None
  if role in ("router",) or role.startswith("expert_"):
    return None
  emb = d.emb
  if layout.mla:
    qk = d.qk_nope_head_dim + d.qk_rope_head_dim
    mla = {"query": (emb, d.q_heads * qk // tp), "q_a": (emb, d.q_lora_rank),
           "q_b": (d.q_lora_rank, d.q_heads * qk // tp), "kv_a": (emb, d.kv_lora_rank + d.qk_rope_head_dim),
           "kv_b": (d.kv_lora_rank, d.q_heads * (d.qk_nope_head_dim + d.v_head_dim) // tp),
           "out": (d.q_heads * d.v_head_dim // tp, emb)}
    if role in mla:
      return mla[role]
  q, kv = d.q_heads * d.head_dim // tp, d.kv_heads * d.head_dim // tp
  mlp = layout.mlp_dim(layer) // tp
  kn = {"query": (emb, q), "key": (emb, kv), "value": (emb, kv), "qkv_proj": (emb, q + 2 * kv), "out": (q, emb),
        "wi": (emb, mlp * (layout.num_activations if layout.fused_mlp else 1)), "wo": (mlp, emb)}
  return kn["wi" if role.startswith("wi") else role]


def _kn_keys(layout: layout_lib.ModelLayout, layer: int | None, role: str) -> dict[str, tuple[str, ...]]:
  """The config keys that set M, K and N of ``role`` (as :func:`_kn` computes them) in ``layer``."""
  emb, tp = ("base_emb_dim",), (("ici_tensor_parallelism",) if layout.tensor_parallel > 1 else ())
  mlp = (("shared_experts", "base_moe_mlp_dim") if layout.is_moe(layer) else ("base_mlp_dim",)) + tp
  q, kv = ("base_num_query_heads", "head_dim") + tp, ("base_num_kv_heads", "head_dim") + tp
  kn = {"query": (emb, q), "key": (emb, kv), "value": (emb, kv), "qkv_proj": (emb, q + kv[:1]), "out": (q, emb),
        "wi": (emb, mlp), "wo": (mlp, emb)}
  if layout.mla:
    qk = ("base_num_query_heads", "qk_nope_head_dim", "qk_rope_head_dim") + tp
    kn.update({"query": (emb, qk), "q_a": (emb, ("q_lora_rank",)), "q_b": (("q_lora_rank",), qk),
               "kv_a": (emb, ("kv_lora_rank", "qk_rope_head_dim")),
               "kv_b": (("kv_lora_rank",), ("base_num_query_heads", "qk_nope_head_dim", "v_head_dim") + tp),
               "out": (("base_num_query_heads", "v_head_dim") + tp, emb)})
  k, n = kn["wi" if role.startswith("wi") else role]
  return {"M": ("per_device_batch_size", "max_target_length"), "K": k, "N": n}


def decoder_gemms(cfg, s: settings_lib.Nvfp4Settings | None = None, *,
                  layout: layout_lib.ModelLayout | None = None) -> list[GemmDims]:
  """The decoder projections of a MaxText config (object or mapping of keys) that have an NVFP4 pass.

  ``layout``: the config's :class:`~maxtext_nvfp4.core.layout.ModelLayout` (the integration layer builds
  it with the MaxText version's MoE layer rules); without it every layer of an MoE config counts as MoE.
  Empty when ``cfg`` does not give the model's dimensions.
  """
  return gemms_of(s or settings_lib.from_config(cfg), layout or layout_lib.from_config(cfg, moe_layer_rules={}))


def gemms_of(s: settings_lib.Nvfp4Settings, layout: layout_lib.ModelLayout) -> list[GemmDims]:
  """:func:`decoder_gemms` of a config already read: its settings and its decoder."""
  if layout.dims is None:
    return []  # not a model config (e.g. a recipe fragment without base_config): nothing to decide
  roles: list[str] = []
  for layer in layout.layers():
    roles += [r for r in layout.roles(layer) if r not in roles]
  out = []
  for role in roles:
    by_shape: dict[tuple, list[int | None]] = {}
    for layer in layout.layers():
      kn = _kn(layout, layer, role) if role in layout.roles(layer) else None
      if kn is None:
        continue
      before, after = plan_lib.precisions(s, layer=layer, role=role, num_layers=layout.num_layers)
      passes = tuple(p for p in plan_lib.PASSES
                     if "nvfp4" in {getattr(before, p), getattr(after or before, p)})
      if passes:
        by_shape.setdefault((passes, kn), []).append(layer)
    for (passes, (k, n)), layers in by_shape.items():
      text = "every layer" if layers == [None] else _layer_ranges(layers)
      out.append(GemmDims(layers=text, role=role, tokens=layout.tokens_per_device, k=k, n=n, dtype=layout.dtype,
                          nvfp4_passes=passes, keys=_kn_keys(layout, layers[0], role)))
  return out


def check(cfg, s: settings_lib.Nvfp4Settings | None = None, *,
          layout: layout_lib.ModelLayout | None = None) -> list[Refusal]:
  """Every TE refusal of the decoder NVFP4 GEMMs of ``cfg`` (empty: TE runs every one of them)."""
  return refusals_of(s or settings_lib.from_config(cfg), layout or layout_lib.from_config(cfg, moe_layer_rules={}))


def refusals_of(s: settings_lib.Nvfp4Settings, layout: layout_lib.ModelLayout) -> list[Refusal]:
  """:func:`check` of a config already read: its settings and its decoder."""
  return [r for g in gemms_of(s, layout) for r in refusals(g, rht=s.rht, two_d_weights=s.two_d_weights)]


def grouped(refs: list[Refusal]) -> list[tuple[Refusal, dict[str, list[str]]]]:
  """``refs`` with identical limits merged: ``(one refusal of the kind, {layers: [roles]})`` per
  (pass, dimension, size, multiple, rule), in first-seen order. Every role and layer range that breaks the
  same limit with the same size is one entry (a 126-layer model's seven projections: one entry, not 7)."""
  out: dict[tuple, tuple[Refusal, dict[str, list[str]]]] = {}
  for r in refs:
    first, where = out.setdefault((r.gemm, r.dimension, r.size, r.multiple, r.rule), (r, {}))
    roles = where.setdefault(r.layers, [])
    if r.role not in roles:
      roles.append(r.role)
  return list(out.values())


def fix_keys(refs: list[Refusal]) -> list[str]:
  """The config keys that set the refused sizes, in first-seen order (what to change to run on TE)."""
  return list(dict.fromkeys(k for r in refs for k in r.keys))


def summary(refs: list[Refusal], *, max_lines: int = 4) -> str:
  """The start-up text for ``refs`` ("" when none): a line beginning ``Transformer Engine would refuse:``
  with the count, then one line per distinct limit (roles and layers that break it merged: :func:`grouped`;
  at most ``max_lines``, then how many more and where all are listed), then the keys to change.

  Sizes are per device shard (what TE's kernels see), and the first line says so.
  """
  if not refs:
    return ""
  groups = grouped(refs)
  lines = [f"{REFUSAL_PREFIX} {len(groups)} NVFP4 GEMM limit(s) broken (sizes per device shard; the emulation"
           " zero-pads them, nvfp4_backend=te stops at start-up):"]
  for r, where in groups[:max_lines]:
    what = (f"{r.dimension}, not bfloat16" if not r.multiple
            else f"{r.dimension} = {r.size}, not a multiple of {r.multiple}")
    places = "; ".join(f"{','.join(roles)} in {layers}" for layers, roles in where.items())
    lines.append(f"  {what}: {r.gemm} of {places} ({r.rule.split(':')[0]})")
  if len(groups) > max_lines:
    lines.append(f"  ... and {len(groups) - max_lines} more (maxtext-nvfp4 doctor --recipe RECIPE lists every one)")
  keys = fix_keys(refs)
  change = f"change {', '.join(keys)}; or " if keys else ""
  rht = ", or nvfp4_rht=false (the RHT limits)" if any(r.rule == _RHT_RULE for r in refs) else ""
  lines.append(f"  to run on TE: {change}keep these projections out of NVFP4 (nvfp4_targets){rht}")
  return "\n".join(lines)
