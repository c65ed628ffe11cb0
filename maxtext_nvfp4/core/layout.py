"""The decoder of one model config, built once: layers, the roles of each layer, dimensions, TP sizes (pure).

:func:`from_config` reads a MaxText config object or a mapping of its keys (a recipe's effective values,
``base_*`` model keys accepted). Which layers carry routed experts is a fact of the MaxText version
(``moe_layer_rules``, from the integration layer's adapter): ``{"deepseek": ("from",
"first_num_dense_layers")}`` means layers ``k..n-1`` with ``k = config.first_num_dense_layers``;
``("every", key)`` every layer ``l`` with ``(l + 1) % config.<key> == 0``; a decoder block not listed, with
``num_experts > 1``, has routed experts in every layer.

The roles of layer ``l`` (:meth:`ModelLayout.roles`, :func:`maxtext_nvfp4.core.plan.decoder_roles`):
attention (MHA/GQA: query, key, value | qkv_proj; MLA: q_a, q_b | query, kv_a, kv_b), out, then on an MoE
layer router + expert_wi_0/1 + expert_wo, then the dense MLP (dense layers, and MoE layers with shared
experts). The plan, the TE limits, the MoE refusals and the precision table all read these roles.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from maxtext_nvfp4.core import plan as plan_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class Dims:
  """The decoder's GEMM dimensions (global; TP-split where MaxText's rules shard them)."""

  # emb_dim
  emb: int
  # mlp_dim (dense layers' MLP)
  mlp: int
  # moe_mlp_dim (one routed expert's hidden size; 0 for a dense model)
  moe_mlp: int
  # num_query_heads, num_kv_heads, head_dim
  q_heads: int
  kv_heads: int
  head_dim: int
  # MLA ranks and head dims (0 when attention is not MLA or q_lora is off)
  q_lora_rank: int = 0
  kv_lora_rank: int = 0
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelLayout:
  """One config's decoder, as every user of its roles needs it."""

  # config.num_decoder_layers
  num_layers: int
  # config.scan_layers: one module stands for every layer (layer index None)
  scan_layers: bool
  # len(config.mlp_activations): wi_0..wi_{n-1} (or one wi)
  num_activations: int
  # config.fused_mlp / config.fused_qkv
  fused_mlp: bool
  fused_qkv: bool
  # attention_type == "mla"; q_lora: MLA with a low-rank query (q_lora_rank > 0)
  mla: bool
  q_lora: bool
  # the decoder layers with routed experts, in order (() for a dense model)
  moe_layers: tuple[int, ...]
  # config.shared_experts > 0: MoE layers also run a dense MLP (the shared experts)
  shared_experts: int
  # config.num_experts
  num_experts: int
  # ici_tensor_parallelism * dcn_tensor_parallelism
  tensor_parallel: int
  # per_device_batch_size * max_target_length (tokens per device: the wgrad contraction)
  tokens_per_device: int
  # activation dtype name ("bfloat16")
  dtype: str
  # GEMM dimensions, or None when the config does not give the model's sizes (a recipe fragment)
  dims: Dims | None

  def is_moe(self, layer: int | None) -> bool:
    """Whether ``layer`` has routed experts (None: scanned layers, which are the MoE layers of an MoE model)."""
    return bool(self.moe_layers) and (layer is None or layer in self.moe_layers)

  def roles(self, layer: int | None) -> tuple[str, ...]:
    """The projection roles of decoder layer ``layer``, in MaxText's construction order."""
    moe = self.is_moe(layer)
    return plan_lib.decoder_roles(num_activations=self.num_activations, fused_mlp=self.fused_mlp,
                                  fused_qkv=self.fused_qkv, mla=self.mla, q_lora=self.q_lora,
                                  dense_mlp=not moe or self.shared_experts > 0, moe=moe)

  def layers(self) -> list[int | None]:
    """The layer indices of the plan: ``[None]`` when scanned, else ``0..num_layers-1``."""
    return [None] if self.scan_layers else list(range(self.num_layers))

  def mlp_dim(self, layer: int | None) -> int:
    """The dense MLP's hidden size in ``layer``: ``mlp_dim``, or ``shared_experts * moe_mlp_dim`` on an MoE
    layer (MaxText builds the shared experts as one MlpBlock of that width)."""
    assert self.dims is not None
    return self.shared_experts * self.dims.moe_mlp if self.is_moe(layer) else self.dims.mlp


def _getter(cfg):
  get = cfg.get if isinstance(cfg, Mapping) else (lambda k, d=None: getattr(cfg, k, d))
  return lambda *keys, default=None: next((get(k) for k in keys if get(k) is not None), default)


def _value(x) -> str:
  """A config value as a plain string (MaxText keeps some as enums)."""
  return str(getattr(x, "value", x))


def moe_layers(get, num_layers: int, moe_layer_rules: Mapping[str, tuple[str, str]]) -> tuple[int, ...]:
  """The decoder layers with routed experts (see the module docstring), or () for a dense model."""
  if int(get("num_experts", default=1) or 1) <= 1:
    return ()
  rule = moe_layer_rules.get(_value(get("decoder_block", default="")).lower())
  if rule is None:
    return tuple(range(num_layers))
  kind, key = rule
  k = int(get(key, default=0) or 0)
  if kind == "from":
    return tuple(range(k, num_layers))
  if kind == "every":
    return tuple(l for l in range(num_layers) if k > 0 and (l + 1) % k == 0)
  raise ValueError(f"unknown MoE layer rule {rule!r} (expected ('from' | 'every', config key))")


def _dtype_name(dtype: Any) -> str:
  dtype = getattr(dtype, "value", dtype)  # MaxText's config: an enum member (name BFLOAT16) or a jnp type
  return str(getattr(dtype, "__name__", None) or getattr(dtype, "name", None) or dtype).lower()


def from_config(cfg, *, moe_layer_rules: Mapping[str, tuple[str, str]]) -> ModelLayout:
  """The :class:`ModelLayout` of a MaxText config object or a mapping of its keys."""
  get = _getter(cfg)
  num_layers = int(get("num_decoder_layers", "base_num_decoder_layers", default=1))
  sizes = (get("emb_dim", "base_emb_dim"), get("mlp_dim", "base_mlp_dim"),
           get("num_query_heads", "base_num_query_heads"), get("num_kv_heads", "base_num_kv_heads"), get("head_dim"))
  dims = None
  if None not in sizes:
    emb, mlp, q_heads, kv_heads, head_dim = (int(v) for v in sizes)
    dims = Dims(emb=emb, mlp=mlp, moe_mlp=int(get("moe_mlp_dim", "base_moe_mlp_dim", default=0) or 0),
                q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim,
                q_lora_rank=int(get("q_lora_rank", default=0) or 0),
                kv_lora_rank=int(get("kv_lora_rank", default=0) or 0),
                qk_nope_head_dim=int(get("qk_nope_head_dim", default=0) or 0),
                qk_rope_head_dim=int(get("qk_rope_head_dim", default=0) or 0),
                v_head_dim=int(get("v_head_dim", default=0) or 0))
  tp = (max(int(get("ici_tensor_parallelism", default=1) or 1), 1)
        * max(int(get("dcn_tensor_parallelism", default=1) or 1), 1))
  return ModelLayout(
      num_layers=num_layers, scan_layers=bool(get("scan_layers", default=True)),
      num_activations=len(get("mlp_activations", default=("silu", "linear"))),
      fused_mlp=bool(get("fused_mlp", default=False)), fused_qkv=bool(get("fused_qkv", default=False)),
      mla=_value(get("attention_type", default="")) == "mla", q_lora=int(get("q_lora_rank", default=0) or 0) > 0,
      moe_layers=moe_layers(get, num_layers, moe_layer_rules),
      shared_experts=int(get("shared_experts", default=0) or 0), num_experts=int(get("num_experts", default=1) or 1),
      tensor_parallel=tp,
      tokens_per_device=int(float(get("per_device_batch_size", default=1)) * int(get("max_target_length", default=1))),
      dtype=_dtype_name(get("dtype", default="bfloat16")), dims=dims)
