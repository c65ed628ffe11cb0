"""A MaxText checkpoint as Hugging Face tensors, one layer at a time, through MaxText's own conversion.

MaxText's ``param_mapping`` functions for the block (the adapter's ``hf_conversions``; what
``checkpoint_conversion/to_huggingface.py`` calls; for a block param_mapping lacks, llama4, the adapter's own
functions of the same form, ``HfConversion.module``) give, per MaxText parameter, its HF name(s) in one of
four forms, which :func:`plan` flattens into :class:`Item` rows (``to_huggingface``'s
``process_maxtext_param`` cases):

  "hf.name"                      the whole parameter
  ["l0.name", "l1.name", ...]    scanned: slice ``param_scan_axis``; per-layer MoE: slice the expert axis 0
  [[e0l0, e0l1, ...], ...]       scanned MoE: experts and layers leading (``tensor_handling.stacked_axes``)

then its hook chain (reshape/transpose to ``[out, in]``, the query's ``sqrt(head_dim)``; the adapter names
the hooks the export drops, e.g. Llama's ``adjust_rope``) maps each slice to the HF layout, checked
against the HF shape the checkpoint's dimensions imply. Memory: :meth:`Converter.tensors` reads one
MaxText parameter at a time (Orbax partial restore), keeps only the requested layer's slices of it, and
drops it before the next: the peak is one parameter (a scanned one holds every layer) plus one layer.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np

from maxtext_nvfp4.core import hf_forward
from maxtext_nvfp4.core import plan as plan_lib
from maxtext_nvfp4.core import settings as settings_lib
from maxtext_nvfp4.integration import checkpoint
from maxtext_nvfp4.integration import export_arch
from maxtext_nvfp4.integration import touchpoints

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# HF linear leaf -> plan role (dense MLP / attention; experts: expert_* by position in expert_linears)
_ROLES = {"q_proj": "query", "k_proj": "key", "v_proj": "value", "o_proj": "out", "gate_proj": "wi_0",
          "up_proj": "wi_1", "down_proj": "wo", "q_a_proj": "q_a", "q_b_proj": "q_b", "kv_a_proj_with_mqa": "kv_a",
          "kv_b_proj": "kv_b"}  # MLA: MaxText's wq_a, wq_b, wkv_a, wkv_b; shared experts: the MLP roles


@dataclasses.dataclass(frozen=True, kw_only=True)
class Item:
  """One HF tensor and where it comes from."""

  # the MaxText parameter (flattened checkpoint name, "params-decoder-...")
  mt_key: str
  # (axis, index) slices taken in order from that parameter (stacked layers / experts)
  index: tuple[tuple[int, int], ...]
  # the HF state-dict name, and its decoder layer (None: embeddings, final norm, lm_head)
  hf_name: str
  layer: int | None


def _flatten(key: str, value, scan: bool, scan_axis: int, expert_axes: tuple[int, int]) -> list[Item]:
  def item(name, index):
    m = _LAYER.match(name)
    return Item(mt_key=key, index=tuple(index), hf_name=name, layer=int(m.group(1)) if m else None)

  if isinstance(key, tuple) or isinstance(value, tuple):
    raise checkpoint.CheckpointError(f"MaxText's mapping fuses several tensors ({key}): not exportable here")
  if isinstance(value, str):
    return [item(value, ())]
  if value and isinstance(value[0], list):  # [expert][layer], both leading
    a0, a1 = expert_axes
    return [item(n, ((a0, e), (a1 - 1, l))) for e, per_layer in enumerate(value) for l, n in enumerate(per_layer)]
  axis = scan_axis if scan else 0
  return [item(n, ((axis, i),)) for i, n in enumerate(value)]


def _renamed(value, old: str, new: str):
  """A mapping value (a name, or nested lists of names) with the prefix ``old`` replaced by ``new``."""
  if isinstance(value, str):
    return new + value[len(old):] if value.startswith(old) else value
  return [_renamed(v, old, new) for v in value] if isinstance(value, list) else value


def hf_shape(name: str, dims: dict, qk_norm_full: bool = False) -> tuple[int, ...] | None:
  """The HF shape of tensor ``name`` implied by the checkpoint's dimensions (None: not a known leaf);
  ``qk_norm_full``: q_norm / k_norm over all heads (Olmo 3: [heads * head_dim]), else per head."""
  parts = name.split(".")
  leaf, kind = parts[-2], parts[-1]
  e, hd = dims["emb_dim"], dims.get("head_dim") or 0  # MLA (DeepSeek): no single head_dim
  nh, nkv = dims.get("num_query_heads"), dims.get("num_kv_heads")
  shared = ".shared_experts." in name or ".shared_expert." in name  # DeepSeek's / Llama 4's
  inter = (dims.get("moe_mlp_dim") if ".experts." in name else dims.get("shared_mlp_dim") if shared
           else dims.get("mlp_dim"))
  if kind == "bias":
    return {"q_proj": (nh * hd,), "k_proj": (nkv * hd,), "v_proj": (nkv * hd,)}.get(leaf)
  if kind == "e_score_correction_bias":
    return (dims.get("num_experts"),)
  if leaf in ("q_norm", "k_norm"):
    return ((nh if leaf == "q_norm" else nkv) * hd,) if qk_norm_full else (hd,)
  if "kv_lora_rank" in dims:  # MLA (DeepSeek)
    ql, kvl = dims.get("q_lora_rank", 0), dims["kv_lora_rank"]
    qk = dims["qk_nope_head_dim"] + dims["qk_rope_head_dim"]
    mla = {"q_a_layernorm": (ql,), "kv_a_layernorm": (kvl,), "q_a_proj": (ql, e), "q_b_proj": (nh * qk, ql),
           "q_proj": (nh * qk, e), "kv_a_proj_with_mqa": (kvl + dims["qk_rope_head_dim"], e),
           "kv_b_proj": (nh * (dims["qk_nope_head_dim"] + dims["v_head_dim"]), kvl),
           "o_proj": (e, nh * dims["v_head_dim"])}
    if leaf in mla:
      return mla[leaf]
  if leaf.endswith("layernorm") or leaf == "norm":
    return (e,)
  return {"q_proj": (nh * hd, e), "k_proj": (nkv * hd, e), "v_proj": (nkv * hd, e), "o_proj": (e, nh * hd),
          "gate_proj": (inter, e), "up_proj": (inter, e), "w1": (inter, e), "w3": (inter, e),
          "down_proj": (e, inter), "w2": (e, inter), "lm_head": (dims["vocab_size"], e),
          "embed_tokens": (dims["vocab_size"], e), "gate": (dims.get("num_experts"), e),
          "router": (dims.get("num_experts"), e)}.get(leaf)


class Converter:
  """The checkpoint's HF tensors by layer (module docstring)."""

  def __init__(self, items_dir: str, config, dims: dict, hf_cfg: dict):
    facts = touchpoints.adapter()
    block = export_arch.decoder_block(config)
    conv = facts.hf_conversions[block]
    if conv.module:  # the adapter's own mapping of a block MaxText's param_mapping lacks
      import importlib  # pylint: disable=import-outside-toplevel

      module = importlib.import_module(conv.module)
    else:
      module = checkpoint.maxtext_module(facts.hf_param_mapping_module)
    scan = bool(config.scan_layers)
    view = {"text_config": hf_cfg, "vision_config": {"num_hidden_layers": 0}} if conv.multimodal_config else hf_cfg
    names = getattr(module, conv.names_fn)(view, config, scan_layers=scan)
    hooks = getattr(module, conv.hooks_fn)(view, config, scan_layers=scan, saving_to_hf=True)
    old, new = conv.hf_prefix
    if old:
      names = {k: _renamed(v, old, new) for k, v in names.items()}
    self.items_dir, self.dims = items_dir, dims
    self.qk_norm_full = export_arch.family(config).olmo
    self.reader = checkpoint.ParamReader(items_dir)
    real = {}  # the mapping's name of each checkpoint parameter -> its checkpoint key
    for key in self.reader.shapes:
      alias = next((to + key[len(frm):] for frm, to in conv.aliases if key.startswith(frm)), key)
      for frm, to in conv.renames:
        alias = alias.replace(frm, to)
      real[alias] = key
    present = set(real)
    unmapped = sorted(present - set(names))
    if unmapped:
      raise checkpoint.CheckpointError(f"checkpoint {items_dir}: {unmapped[0]} ({len(unmapped)} parameters) has no"
                                       f" Hugging Face name in MaxText's {block} conversion: not exportable")
    if conv.borrowed_hooks_fn:
      lent = getattr(module, conv.borrowed_hooks_fn)(view, config, scan_layers=scan, saving_to_hf=True)
      hooks = {k: (v if isinstance(v, list) else [v]) for k, v in hooks.items()}
      for key in names:
        for suffix, src in conv.borrowed_hooks:
          if key.endswith(suffix):
            hooks[key] = hooks.get(key, []) + (lent[src] if isinstance(lent[src], list) else [lent[src]])
    self.hooks = {}
    for key, chain in hooks.items():
      if key not in present:  # e.g. gemma3's vision-tower hooks for a text-only checkpoint
        continue
      chain = chain if isinstance(chain, list) else [chain]
      unknown = [fn.__name__ for fn in chain if fn.__name__ not in conv.hooks]
      if unknown:
        raise checkpoint.CheckpointError(f"MaxText's {block} conversion hooks changed ({unknown}): the export supports"
                                         f" MaxText {facts.version}'s")
      self.hooks[real[key]] = [fn for fn in chain if fn.__name__ not in conv.dropped]
    self.items = [it for key, value in names.items() if key in present
                  for it in _flatten(real[key], value, scan, int(config.param_scan_axis), facts.scanned_expert_axes)]

  def check_complete(self, shape: hf_forward.DecoderShape, hf_cfg: dict) -> None:
    """:class:`checkpoint.CheckpointError` (one line) when the checkpoint lacks a tensor the written architecture
    needs (:func:`required_names`): MaxText's conversion maps what the checkpoint has, so a checkpoint of another
    block (a Llama run under ``model_name=qwen3-0.6b``) would otherwise export without its q/k norms or biases."""
    have = {it.hf_name for it in self.items}
    arch = hf_cfg["architectures"][0]
    missing = [n for n in required_names(shape, hf_cfg) if n not in have]
    extra = sorted(n for n in have if unused_by(n, shape, hf_cfg))
    if missing or extra:
      what = (f"has nothing for {missing[0]} ({len(missing)} tensor(s) that {arch} needs are missing)" if missing
              else f"has {extra[0]} ({len(extra)} tensor(s) that {arch} does not load: a server would drop them)")
      raise checkpoint.CheckpointError(
          f"checkpoint {self.items_dir}: {what}: it was not trained as this model; pass the --config"
          " (model_name, decoder_block) the run trained with")

  def names(self, layer: int | None) -> list[str]:
    return [it.hf_name for it in self.items if it.layer == layer]

  def tensors(self, layer: int | None, only: frozenset | None = None) -> dict[str, np.ndarray]:
    """``{HF name: fp32 [out, in] array}`` of ``layer`` (None: embeddings, final norm, lm_head); ``only``:
    just these HF names."""
    out: dict[str, np.ndarray] = {}
    by_key: dict[str, list[Item]] = {}
    for it in self.items:
      if it.layer == layer and (only is None or it.hf_name in only):
        by_key.setdefault(it.mt_key, []).append(it)
    for key, items in by_key.items():
      arr = self.reader.read(key)
      for it in items:
        a = arr
        for axis, i in it.index:
          a = np.take(a, i, axis=axis)
        target = hf_shape(it.hf_name, self.dims, self.qk_norm_full)
        for fn in self.hooks.get(key, []):
          a = fn(a, target)
        a = np.asarray(a, np.float32)
        if target is not None and tuple(a.shape) != tuple(target):
          raise checkpoint.CheckpointError(
              f"checkpoint {self.items_dir}: {key} gives {it.hf_name} shape {a.shape}, not {target}: pass the"
              " --config the run trained with")
        out[it.hf_name] = np.ascontiguousarray(a)
      del arr
    return out


def required_names(shape: hf_forward.DecoderShape, hf_cfg: dict) -> list[str]:
  """HF tensors (``.weight`` / ``.bias`` names) the architecture cannot be served without: the embedding, the
  final norm, ``lm_head`` unless ``tie_word_embeddings``; per layer every linear (:func:`hf_forward.layer_names`),
  the router of an MoE layer, the q/k norms (``qk_norm``) and the q/k/v biases (``attention_bias``)."""
  out = ["model.embed_tokens.weight", "model.norm.weight"]
  if not hf_cfg.get("tie_word_embeddings"):
    out.append("lm_head.weight")
  for layer in range(shape.num_layers):
    p = f"model.layers.{layer}.self_attn."
    out += [n + ".weight" for n in hf_forward.layer_names(shape, layer)]
    if hf_forward.is_moe_layer(shape, layer):
      out.append(f"model.layers.{layer}.{shape.moe.block}.{shape.moe.router}.weight")
    if shape.qk_norm:
      out += [p + "q_norm.weight", p + "k_norm.weight"]
    if shape.attention_bias:
      out += [p + f"{n}.bias" for n in ("q_proj", "k_proj", "v_proj")]
  return out


def unused_by(name: str, shape: hf_forward.DecoderShape, hf_cfg: dict) -> bool:
  """Whether the architecture has no place for HF tensor ``name`` that MaxText's shared conversion of related
  blocks maps anyway: ``lm_head`` with tied embeddings, q/k norms without ``qk_norm``, attention biases without
  ``attention_bias``."""
  if name == "lm_head.weight":
    return bool(hf_cfg.get("tie_word_embeddings"))
  if not _LAYER.match(name):
    return False
  if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
    return not shape.qk_norm
  if name.endswith(("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")):
    return not shape.attention_bias
  return False


def linear_role(name: str, shape: hf_forward.DecoderShape) -> str:
  """The plan role (core/plan.py) of HF linear ``name`` (``model.layers.<i>.<...>.<leaf>``)."""
  leaf = name.rsplit(".", 1)[-1]
  if ".experts." in name and shape.moe is not None:
    return plan_lib.EXPERT_ROLES[shape.moe.expert_linears.index(leaf)]
  return _ROLES[leaf]


def trained_nvfp4(config, shape: hf_forward.DecoderShape) -> dict[str, bool]:
  """HF linear name (no ``.weight``) -> whether its forward trained in NVFP4 (before any late switch);
  False everywhere for runs that did not train in NVFP4. HF layer ``i`` is MaxText layer ``i //
  layers_per_block`` of the plan."""
  settings = settings_lib.from_config(config)
  nvfp4_run = str(getattr(config.quantization, "value", config.quantization)) == "nvfp4"
  scan = bool(config.scan_layers)
  per = export_arch.family(config).layers_per_block  # the plan counts MaxText's layers (gemma2: 2 HF layers each)
  out = {}
  for layer in range(shape.num_layers):
    for name in hf_forward.layer_names(shape, layer):
      p, _ = plan_lib.precisions(settings, layer=None if scan else layer // per, role=linear_role(name, shape),
                                 num_layers=shape.num_layers // per)
      out[name] = nvfp4_run and p.fprop == "nvfp4"
  return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class HfModel:
  """A whole MaxText checkpoint in Hugging Face terms (eval-quantized and the tests; export streams)."""

  # HF state-dict name -> fp32 numpy array in HF layout ([out, in] for linears)
  tensors: dict[str, np.ndarray]
  # HF config.json contents (no quantization_config, no token ids)
  hf_config: dict[str, Any]
  # the reference forward's shape
  shape: hf_forward.DecoderShape
  # HF linear name (no ".weight") -> True when it trained in NVFP4 (fprop before any late switch)
  trained_nvfp4: dict[str, bool]
  # the checkpoint's ``items`` directory and the MaxText config it was read with
  items_dir: str
  config: Any


def to_hf(items_dir: str, config, dims: dict) -> HfModel:
  """The whole checkpoint in HF names and layouts (every layer in memory); ``dims``: the checkpoint's
  dimensions (``tools/model_shapes.check``)."""
  export_arch.check_supported(config)
  cfg = export_arch.hf_config(config, dims)
  conv = Converter(items_dir, config, dims, cfg)
  shape = export_arch.forward_shape(config, dims)
  conv.check_complete(shape, cfg)
  tensors = conv.tensors(None)
  for layer in range(shape.num_layers):
    tensors.update(conv.tensors(layer))
  return HfModel(tensors=tensors, hf_config=cfg, shape=shape, trained_nvfp4=trained_nvfp4(config, shape),
                 items_dir=items_dir, config=config)
