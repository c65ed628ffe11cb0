"""The checkpoint decides the model's shape: dimensions read from a MaxText checkpoint's own parameter
shapes (Orbax metadata: no array is read), compared with the config a command was given.

A wrong ``--config`` or override (``base_num_decoder_layers=2`` for a 4-layer run, ``base_num_query_heads=2
head_dim=64`` for 4x32 heads) would otherwise export or evaluate a different model that happens to fit
the arrays. :func:`check` refuses every disagreement in one line naming both values.

Dimensions, from the parameters named as MaxText's checkpoint conversion names them (``params-decoder-...``;
``layers_<i>`` per layer, or ``layers`` with the layer axis at ``param_scan_axis`` when scanned):

  vocab_size, emb_dim        ``token_embedder-embedding``           [vocab, emb]
  num_decoder_layers         the ``layers_<i>`` count, or the query kernel's scan axis (a scanned block of
                             sub-layers, ``layers-layers_<k>-``: that axis times the sub-layer count)
  num_query_heads, head_dim  ``self_attention-query-kernel``        [emb, heads, head_dim]
  num_kv_heads               ``self_attention-key-kernel``          [emb, kv_heads, head_dim]
  mlp_dim                    ``mlp-wi_0-kernel``                    [emb, mlp]
                             (gemma2: ``self_attention_local-`` / ``mlp_local-``; its layer is 2 HF layers;
                             olmo3: ``attention-``)
  num_experts, moe_mlp_dim   ``<moe>-gate-kernel`` [emb, experts], ``<moe>-wi_0`` [experts, emb, mlp]
                             (<moe>: ``MoeBlock_0`` in mixtral's layers, ``moe_block`` in qwen3_moe's,
                             ``Llama4MoEBlock_0-MoeBlock_0`` in llama4's; the first layer that has one)
  shared_mlp_dim             llama4's ``Llama4MoEBlock_0-shared_experts-wi_0-kernel`` [emb, shared]
  scan_layers                whether the parameters are stacked (``layers``) or per layer (``layers_<i>``)
  deepseek                   ``dense_layers_<i>`` + ``moe_layers_<j>``: num_decoder_layers,
                             first_num_dense_layers, the MLA ranks and head dims, mlp_dim, num_experts,
                             moe_mlp_dim, shared_mlp_dim (:func:`_deepseek_dimensions`)

A dimension whose parameter the checkpoint does not have (another block type) is not compared.
"""

from __future__ import annotations

import re
from typing import Any

# dimension -> the user-facing key that sets it (MaxText scales base_* by global_parameter_scale)
CONFIG_KEY = {"vocab_size": "vocab_size", "emb_dim": "base_emb_dim", "num_decoder_layers": "base_num_decoder_layers",
              "num_query_heads": "base_num_query_heads", "num_kv_heads": "base_num_kv_heads", "head_dim": "head_dim",
              "mlp_dim": "base_mlp_dim", "num_experts": "num_experts", "moe_mlp_dim": "base_moe_mlp_dim",
              "scan_layers": "scan_layers", "first_num_dense_layers": "first_num_dense_layers",
              "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
              "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim"}


# the routed-experts module's parameter names: mixtral's decoder layer (MoeBlock_0), qwen3_moe's (moe_block),
# llama4's (Llama4MoEBlock_0-MoeBlock_0, beside its Llama4MoEBlock_0-shared_experts)
MOE_BLOCKS = ("MoeBlock_0", "moe_block", "Llama4MoEBlock_0-MoeBlock_0")
SHARED_EXPERTS = "Llama4MoEBlock_0-shared_experts"

# the attention and MLP modules' names in a decoder layer (gemma2's layer holds a local and a global pair of
# equal shapes: the local one is read)
ATTENTION_MODULES = ("self_attention", "self_attention_local", "attention")
MLP_MODULES = ("mlp", "mlp_local")


class ShapeMismatch(ValueError):
  """The config does not describe the checkpoint (one line: every dimension with both values)."""


def parameter_shapes(items_dir: str) -> dict[str, tuple[int, ...]]:
  """``{"params-decoder-layers_0-...": shape}`` from the checkpoint's metadata (no array is read)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  import logging  # pylint: disable=import-outside-toplevel

  absl_log = logging.getLogger("absl")
  level = absl_log.level
  absl_log.setLevel(logging.ERROR)  # Orbax warns "Metadata file does not exist" for MaxText's checkpoints
  try:
    meta = ocp.PyTreeCheckpointer().metadata(items_dir)
  except Exception as e:  # pylint: disable=broad-exception-caught  (Orbax/tensorstore raise many kinds)
    raise ShapeMismatch(f"checkpoint {items_dir}: cannot read its metadata ({' '.join(str(e).split())[:200]})") from None
  finally:
    absl_log.setLevel(level)
  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel

  tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
  found = checkpoint.params_of(tree)
  if found is None:
    return {}
  # MaxText's TrainState: tree["params"] = {"params": {...}}; a Tunix NNX state: {"decoder": {... "value"}}.
  # Flattened as read_params names them.
  sub, nnx_state = found
  return {name: tuple(int(d) for d in getattr(v, "shape", ()) or ()) for name, _, v in checkpoint.named_leaves(sub, nnx_state)}


def _drop(shape: tuple[int, ...], axis: int | None) -> tuple[int, ...]:
  return shape if axis is None else shape[:axis] + shape[axis + 1:]


def dimensions(shapes: dict[str, tuple[int, ...]], *, param_scan_axis: int = 1) -> dict[str, Any]:
  """The model dimensions the parameter ``shapes`` imply (see the module docstring); only those found."""
  dims: dict[str, Any] = {}
  emb = shapes.get("params-token_embedder-embedding")
  if emb is not None and len(emb) == 2:
    dims["vocab_size"], dims["emb_dim"] = emb
  if any(k.startswith(("params-decoder-dense_layers", "params-decoder-moe_layers")) for k in shapes):
    return {**dims, **_deepseek_dimensions(shapes, param_scan_axis)}
  per_layer = {int(m.group(1)) for k in shapes for m in [re.match(r"params-decoder-layers_(\d+)-", k)] if m}
  scanned = any(k.startswith("params-decoder-layers-") for k in shapes)
  if per_layer and not scanned:
    dims["scan_layers"] = False
    dims["num_decoder_layers"] = max(per_layer) + 1
    prefix, axis = "params-decoder-layers_0-", None
  elif scanned and not per_layer:
    dims["scan_layers"] = True
    prefix, axis = "params-decoder-layers-", param_scan_axis
  else:
    return dims
  # a scanned block of sub-layers (olmo3's Olmo3ScannableBlock: layers-layers_<k>-, one per layer of its cycle)
  subs = {int(m.group(1)) for k in shapes for m in [re.match(r"params-decoder-layers-layers_(\d+)-", k)] if m}
  if axis is not None and subs:
    prefix = "params-decoder-layers-layers_0-"
  attn = next((a for a in ATTENTION_MODULES if prefix + a + "-query-kernel" in shapes), ATTENTION_MODULES[0])
  mlp = next((m for m in MLP_MODULES if prefix + m + "-wi_0-kernel" in shapes), MLP_MODULES[0])
  # llama4 interleaves dense and MoE layers: the MLP and the experts are read from the first layer (or
  # sub-layer of a scanned block) that has them
  layer_prefixes = ([f"params-decoder-layers-layers_{k}-" for k in sorted(subs)] if axis is not None and subs
                    else [f"params-decoder-layers_{i}-" for i in sorted(per_layer)] if axis is None else [prefix])
  mlp_prefix = next((lp for lp in layer_prefixes if lp + mlp + "-wi_0-kernel" in shapes), prefix)
  moe_prefix = next((lp for lp in layer_prefixes for m in MOE_BLOCKS if lp + m + "-gate-kernel" in shapes), prefix)
  q = shapes.get(prefix + attn + "-query-kernel")
  if q is not None and len(q) == 3 + (axis is not None):
    if axis is not None:
      # (a remainder block past the last whole cycle, gemma3's layers_remainder, is not counted: left out)
      remainder = any(k.startswith("params-decoder-layers_remainder") for k in shapes)
      if not (subs and remainder):
        dims["num_decoder_layers"] = q[axis] * max(1, len(subs))
    _, dims["num_query_heads"], dims["head_dim"] = _drop(q, axis)
  k = shapes.get(prefix + attn + "-key-kernel")
  if k is not None and len(k) == 3 + (axis is not None):
    dims["num_kv_heads"] = _drop(k, axis)[1]
  wi = shapes.get(mlp_prefix + mlp + "-wi_0-kernel")
  if wi is not None and len(wi) == 2 + (axis is not None):
    dims["mlp_dim"] = _drop(wi, axis)[1]
  moe = next((m for m in MOE_BLOCKS if moe_prefix + m + "-gate-kernel" in shapes), MOE_BLOCKS[0])
  gate = shapes.get(moe_prefix + moe + "-gate-kernel")
  if gate is not None and len(gate) == 2 + (axis is not None):
    dims["num_experts"] = _drop(gate, axis)[1]
  ewi = shapes.get(moe_prefix + moe + "-wi_0")
  if ewi is not None and len(ewi) == 3 + (axis is not None):
    dims["moe_mlp_dim"] = _drop(ewi, axis)[2]
  swi = shapes.get(moe_prefix + SHARED_EXPERTS + "-wi_0-kernel")
  if swi is not None and len(swi) == 2 + (axis is not None):
    dims["shared_mlp_dim"] = _drop(swi, axis)[1]
  return dims


def _deepseek_dimensions(shapes: dict[str, tuple[int, ...]], param_scan_axis: int) -> dict[str, Any]:
  """A deepseek block's dimensions: ``dense_layers_<i>`` then ``moe_layers_<j>`` (scanned: ``dense_layers`` /
  ``moe_layers`` stacked at ``param_scan_axis``); MLA kernels wq_a [emb, q_lora], wkv_a [emb, kv_lora + rope],
  wkv_b [kv_lora, heads, nope + v], out [heads, v, emb], wq_b [q_lora, heads, nope + rope]."""
  dims: dict[str, Any] = {}
  count = {}
  for part in ("dense_layers", "moe_layers"):
    idx = {int(m.group(1)) for k in shapes for m in [re.match(rf"params-decoder-{part}_(\d+)-", k)] if m}
    stacked = [v for k, v in shapes.items() if k.startswith(f"params-decoder-{part}-")]
    dims["scan_layers"] = bool(stacked) or dims.get("scan_layers", False)
    count[part] = max(idx) + 1 if idx else (stacked[0][param_scan_axis] if stacked else 0)

  def get(part, name):
    axis = param_scan_axis if dims["scan_layers"] else None
    shape = shapes.get(f"params-decoder-{part}{'-' if axis is not None else '_0-'}{name}")
    return None if shape is None else _drop(shape, axis)

  dims["first_num_dense_layers"] = count["dense_layers"]
  dims["num_decoder_layers"] = count["dense_layers"] + count["moe_layers"]
  part = "dense_layers" if count["dense_layers"] else "moe_layers"
  wkv_b, out = get(part, "self_attention-wkv_b-kernel"), get(part, "self_attention-out-kernel")
  wkv_a, wq_a = get(part, "self_attention-wkv_a-kernel"), get(part, "self_attention-wq_a-kernel")
  if wkv_b is not None and out is not None and wkv_a is not None:
    dims["kv_lora_rank"], dims["num_query_heads"], nope_v = wkv_b
    dims["num_kv_heads"] = dims["num_query_heads"]
    dims["v_head_dim"] = out[1]
    dims["qk_nope_head_dim"] = nope_v - out[1]
    dims["qk_rope_head_dim"] = wkv_a[1] - dims["kv_lora_rank"]
    dims["q_lora_rank"] = wq_a[1] if wq_a is not None else 0
  # dimension <- (part, kernel, axis of that kernel's unscanned shape)
  for key, (part, name, axis) in {
      "mlp_dim": ("dense_layers", "mlp-wi_0-kernel", 1),
      "num_experts": ("moe_layers", "DeepSeekMoeBlock_0-MoeBlock_0-gate-kernel", 1),
      "moe_mlp_dim": ("moe_layers", "DeepSeekMoeBlock_0-MoeBlock_0-wi_0", 2),
      "shared_mlp_dim": ("moe_layers", "DeepSeekMoeBlock_0-shared_experts-wi_0-kernel", 1),
  }.items():
    shape = get(part, name)
    if shape is not None:
      dims[key] = shape[axis]
  return dims


def config_dimensions(config) -> dict[str, Any]:
  """The same dimensions as MaxText's config object states them."""
  out = {}
  for dim in CONFIG_KEY:
    value = getattr(config, dim, None)
    if value is not None:
      out[dim] = bool(value) if dim == "scan_layers" else int(value)
  return out


def mismatches(checkpoint_dims: dict[str, Any], config_dims: dict[str, Any]) -> list[str]:
  """``["num_query_heads: checkpoint 4, config 2 (base_num_query_heads)", ...]`` for every disagreement."""
  out = []
  for dim, have in checkpoint_dims.items():
    if dim == "num_experts" and int(config_dims.get(dim, 1) or 1) <= 1:
      out.append(f"num_experts: checkpoint {have} (an MoE model), config {config_dims.get(dim, 1)} (num_experts)")
    elif dim in config_dims and config_dims[dim] != have:
      show = lambda v: str(v).lower() if isinstance(v, bool) else str(v)  # noqa: E731
      out.append(f"{dim}: checkpoint {show(have)}, config {show(config_dims[dim])} ({CONFIG_KEY[dim]})")
  return out


def check(items_dir: str, config) -> dict[str, Any]:
  """The checkpoint's dimensions; :class:`ShapeMismatch` when ``config`` states any of them differently."""
  dims = dimensions(parameter_shapes(items_dir), param_scan_axis=int(getattr(config, "param_scan_axis", 1) or 1))
  bad = mismatches(dims, config_dimensions(config))
  if bad:
    raise ShapeMismatch(f"checkpoint {items_dir} does not have the config's shape: {'; '.join(bad)}; pass the"
                        " --config and key=value overrides the run trained with (a run started with maxtext-nvfp4"
                        " train records them: then give neither)")
  return dims
