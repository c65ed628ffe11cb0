"""What each MaxText decoder block exports as: one table keyed by ``decoder_block``.

Per family: the Hugging Face architecture (the class transformers builds and vLLM serves), its
``model_type``, the config keys it adds, and the forward's shape (``core.hf_forward.DecoderShape``: QK-norm,
attention biases, routed experts and their HF names). The MaxText -> HF names and layouts are MaxText's own
conversion functions (the adapter's ``hf_conversions``, applied by :mod:`.hf_conversion`).

  decoder_block  HF architecture        notes
  llama2         LlamaForCausalLM       Llama 2/3 dense; MaxText's Llama 3.1 mapping minus adjust_rope
  mistral        MistralForCausalLM     llama2's parameters (MaxText has no mistral mapping); no sliding window
  qwen2          Qwen2ForCausalLM       q/k/v biases
  qwen3          Qwen3ForCausalLM       per-head q/k RMSNorm
  qwen3_moe      Qwen3MoeForCausalLM    experts mlp.experts.<e>.{gate,up,down}_proj, router mlp.gate;
                                        norm_topk_prob true (MaxText softmaxes over the top-k)
  mixtral        MixtralForCausalLM     experts block_sparse_moe.experts.<e>.{w1,w3,w2}, router block_sparse_moe.gate

Every other block (gemma*, deepseek, gpt_oss, llama4, olmo3, gpt3, ...) is refused in one line naming
the supported ones. Excluded from NVFP4 (written bf16, listed in the configs' ignore list): embeddings,
norms, routers, ``lm_head``, and every linear that did not train in NVFP4.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from maxtext_nvfp4.core import hf_forward
from maxtext_nvfp4.integration import touchpoints


class UnsupportedModel(ValueError):
  """A model the export cannot write (one line: the key, the value, what is supported)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExportFamily:
  """How one MaxText decoder block is exported."""

  # the HF class and model_type config.json names
  architecture: str
  model_type: str
  # per-head q/k RMSNorm (self_attn.q_norm / k_norm) and q/k/v biases
  qk_norm: bool = False
  attention_bias: bool = False
  # routed experts: the HF module under the layer holding router + experts, and the expert linears' names
  moe_block: str | None = None
  expert_linears: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
  # config.json keys this architecture adds (from the MaxText config and the checkpoint's dimensions)
  extra_config: Callable[[Any, dict], dict] = lambda config, dims: {}


def _get(config, key, default=None):
  value = getattr(config, key, default)
  return getattr(value, "value", value)


def _no_window(config, dims):
  return {"sliding_window": None}


def _qwen2(config, dims):
  return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": dims["num_decoder_layers"]}


def _qwen3(config, dims):
  return {"attention_bias": False, "use_sliding_window": False, "sliding_window": None}


def _qwen3_moe(config, dims):
  return {**_qwen3(config, dims), "num_experts": dims["num_experts"], "num_experts_per_tok": int(config.num_experts_per_tok),
          "moe_intermediate_size": dims["moe_mlp_dim"], "norm_topk_prob": True, "decoder_sparse_step": 1,
          "mlp_only_layers": [], "output_router_logits": False}


def _mixtral(config, dims):
  return {"num_local_experts": dims["num_experts"], "num_experts_per_tok": int(config.num_experts_per_tok),
          "intermediate_size": dims["moe_mlp_dim"], "sliding_window": None, "output_router_logits": False}


def _llama(config, dims):
  return {"attention_bias": False, "mlp_bias": False}


FAMILIES: dict[str, ExportFamily] = {
    "llama2": ExportFamily(architecture="LlamaForCausalLM", model_type="llama", extra_config=_llama),
    "mistral": ExportFamily(architecture="MistralForCausalLM", model_type="mistral", extra_config=_no_window),
    "qwen2": ExportFamily(architecture="Qwen2ForCausalLM", model_type="qwen2", attention_bias=True, extra_config=_qwen2),
    "qwen3": ExportFamily(architecture="Qwen3ForCausalLM", model_type="qwen3", qk_norm=True, extra_config=_qwen3),
    "qwen3_moe": ExportFamily(architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", qk_norm=True, moe_block="mlp",
                              extra_config=_qwen3_moe),
    "mixtral": ExportFamily(architecture="MixtralForCausalLM", model_type="mixtral", moe_block="block_sparse_moe",
                            expert_linears=("w1", "w3", "w2"), extra_config=_mixtral),
}


def decoder_block(config) -> str:
  return str(_get(config, "decoder_block")).lower().split(".")[-1]


def family(config) -> ExportFamily:
  """The export family of ``config``'s decoder block; :class:`UnsupportedModel` for any other block."""
  block = decoder_block(config)
  if block not in FAMILIES or block not in touchpoints.adapter().hf_conversions:
    raise UnsupportedModel(f"unsupported model for the export: decoder_block={block} (exports: {', '.join(FAMILIES)})")
  return FAMILIES[block]


def check_supported(config) -> ExportFamily:
  """The family, after every config setting the HF architecture cannot express is refused (one line)."""
  fam = family(config)
  problems = []
  if list(_get(config, "mlp_activations") or []) != ["silu", "linear"]:
    problems.append(f"mlp_activations={_get(config, 'mlp_activations')} (needs [silu, linear])")
  if (str(_get(config, "rope_type")) != "default" or float(_get(config, "rope_linear_scaling_factor") or 1.0) != 1.0
      or str(_get(config, "model_name")).startswith("llama3.1")):
    problems.append(f"rope_type={_get(config, 'rope_type')}, model_name={_get(config, 'model_name')} (only default RoPE"
                    " exports)")
  for key in ("fused_qkv", "fused_mlp"):
    if _get(config, key):
      problems.append(f"{key}=true")
  if bool(_get(config, "use_qk_norm")) != fam.qk_norm:
    problems.append(f"use_qk_norm={str(bool(_get(config, 'use_qk_norm'))).lower()} ({fam.architecture} has"
                    f"{'' if fam.qk_norm else ' no'} q/k norm)")
  if float(_get(config, "final_logits_soft_cap") or 0) != 0:
    problems.append("final_logits_soft_cap")
  if float(_get(config, "rope_min_timescale") or 1) != 1:
    problems.append(f"rope_min_timescale={_get(config, 'rope_min_timescale')} (HF's RoPE has 1)")
  if _get(config, "logits_via_embedding") and _get(config, "normalize_embedding_logits"):
    # MaxText divides tied-embedding logits by sqrt(emb_dim) (nnx_decoders.py); HF's tied lm_head does not
    problems.append("logits_via_embedding with normalize_embedding_logits (logits / sqrt(emb_dim))")
  if decoder_block(config) == "mixtral" and int(config.num_query_heads) * int(config.head_dim) != int(config.emb_dim):
    # MaxText's Mixtral hook reshapes every attention kernel to (hidden_size, -1): right only in this case
    problems.append(f"num_query_heads x head_dim = {int(config.num_query_heads) * int(config.head_dim)} != emb_dim"
                    f" {int(config.emb_dim)} (MaxText's mixtral conversion assumes them equal)")
  if fam.moe_block is not None:
    if str(_get(config, "routed_score_func") or "softmax") != "softmax":
      problems.append(f"routed_score_func={_get(config, 'routed_score_func')} (softmax routing only)")
    if float(_get(config, "routed_scaling_factor") or 1.0) != 1.0:
      problems.append(f"routed_scaling_factor={_get(config, 'routed_scaling_factor')}")
    if _get(config, "use_random_routing"):
      problems.append("use_random_routing=true")
    if int(_get(config, "shared_experts") or 0) > 0:
      problems.append(f"shared_experts={_get(config, 'shared_experts')} ({fam.architecture} has none)")
  if problems:
    raise UnsupportedModel(f"unsupported model for the {decoder_block(config)} export: {'; '.join(problems)}")
  return fam


def forward_shape(config, dims: dict) -> hf_forward.DecoderShape:
  """The reference forward's shape of a checked ``config`` whose checkpoint has dimensions ``dims``."""
  fam = family(config)
  moe = None
  if fam.moe_block is not None:
    moe = hf_forward.MoeShape(num_experts=dims["num_experts"], top_k=int(config.num_experts_per_tok),
                              block=fam.moe_block, expert_linears=fam.expert_linears)
  return hf_forward.DecoderShape(
      num_layers=dims["num_decoder_layers"], num_heads=dims["num_query_heads"], num_kv_heads=dims["num_kv_heads"],
      head_dim=dims["head_dim"], rms_norm_eps=float(config.normalization_layer_epsilon),
      rope_theta=float(config.rope_max_timescale), qk_norm=fam.qk_norm, attention_bias=fam.attention_bias, moe=moe)


def hf_config(config, dims: dict) -> dict:
  """config.json (without quantization_config and token ids) of the exported model.

  transformers 5 / ModelOpt keys: ``rope_parameters`` and ``dtype``; ``rope_theta`` is kept beside them
  for readers built on transformers 4 (which ignore ``rope_parameters`` and would fall back to 10000).
  """
  fam = family(config)
  theta = float(config.rope_max_timescale)
  out = {
      "architectures": [fam.architecture], "model_type": fam.model_type,
      "hidden_size": dims["emb_dim"], "intermediate_size": dims.get("mlp_dim", dims.get("moe_mlp_dim")),
      "num_hidden_layers": dims["num_decoder_layers"], "num_attention_heads": dims["num_query_heads"],
      "num_key_value_heads": dims["num_kv_heads"], "head_dim": dims["head_dim"], "vocab_size": dims["vocab_size"],
      "hidden_act": "silu", "rms_norm_eps": float(config.normalization_layer_epsilon),
      "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "rope_theta": theta,
      "max_position_embeddings": int(config.max_target_length),
      "tie_word_embeddings": bool(_get(config, "logits_via_embedding")), "dtype": "bfloat16",
  }
  out.update(fam.extra_config(config, dims))
  return out
