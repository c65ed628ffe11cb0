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
  gemma          GemmaForCausalLM       (1 + w) norms, sqrt(d)-scaled tied embeddings, gelu-tanh; no sandwich norms,
                                        soft-caps or window (MaxText has no gemma conversion: llama's names and
                                        hooks with gemma's norm names, plus gemma2's norm and embedding hooks)
  gemma2         Gemma2ForCausalLM      one MaxText layer = HF layers 2i (sliding window) and 2i+1 (global)
  gemma3         Gemma3ForCausalLM      text-only (model_type gemma3_text); MaxText's layer types (5 sliding, 1
                                        global), its query_pre_attn_scalar, local RoPE base, linear RoPE factor
  deepseek       DeepseekV3ForCausalLM  MLA (q_a/q_b, kv_a_proj_with_mqa, kv_b, their layernorms), YaRN RoPE on
                                        interleaved pairs; first_k_dense_replace dense layers; experts
                                        mlp.experts.<e>, mlp.shared_experts, router mlp.gate (+ its
                                        e_score_correction_bias: sigmoid routing, groups, routed_scaling_factor)
  olmo3          Olmo3ForCausalLM       post-norm-only layers (post_attention_layernorm, post_feedforward_layernorm;
                                        no input norm); q_norm / k_norm over all heads at once ([H * D]); MaxText's
                                        layer types (3 sliding, 1 global, per models/olmo3.py) as layer_types;
                                        default or YaRN RoPE, written for both layer types (below)
  llama4         Llama4ForCausalLM      text-only (model_type llama4_text); MaxText's NoPE layers (no_rope_layers),
                                        chunked attention on the RoPE layers (attention_chunk_size), L2 q/k norm
                                        after RoPE, NoPE temperature tuning, MoE layers (moe_layers) with experts
                                        feed_forward.experts.<e>.{gate,up,down}_proj, router feed_forward.router,
                                        feed_forward.shared_expert; dense layers feed_forward.{gate,up,down}_proj
                                        (names and layouts: the adapter's llama4 mapping, from MaxText's own llama4
                                        conversion script)

Llama 4: MaxText's llama4 block (models/llama4.py, layers/attentions.py, layers/moe.py) computes what HF's
Llama4ForCausalLM does given: RoPE by MaxText's LLaMARotaryEmbedding (rope_type llama3.1), which rotates
interleaved pairs as HF's complex apply_rotary_emb does (no q/k row permutation), with its hard-coded
llama3 scaling (factor 8, low/high frequency factors 1 and 4, original context 8192; rope_use_scale) as
``rope_parameters`` llama3; the query scaled by head_dim ** -0.5 in the forward (HF's scaling); top-1
routing whose sigmoid score multiplies the expert's input and whose expert outputs are summed, plus one
shared expert of the experts' width (HF's Llama4TextMoe); the temperature tuning constants MaxText hard-codes
(scale 0.1, floor 8192) as ``attn_scale`` / ``floor_scale``, and ``attn_temperature_tuning`` also in
generation_config.json (vLLM's Llama4ForCausalLM takes it from there, else turns it on only past 32K
context). Which layers are NoPE / MoE is MaxText's ``determine_is_nope_layer`` / ``determine_is_moe_layer``
of the layer (of its place in the block of inhomogeneous_layer_cycle_interval layers when scanned).

Olmo 3's RoPE: MaxText's olmo3 block builds one rotary embedding for every layer (models/olmo3.py: YaRN on the
sliding layers too, with rope_type yarn), while HF's Olmo3Config reads a legacy ``rope_scaling`` into
``rope_parameters["full_attention"]`` only. The export writes ``rope_parameters`` per layer type, both equal
to MaxText's (YaRN: factor, original_max_position_embeddings, beta_fast/slow, truncate, and its cos/sin
scale as an explicit ``attention_factor``: 0.1 ln(factor) + 1 with rope_attention_scaling, else 1), so HF
and vLLM (its Transformers backend runs HF's Olmo3 modeling) compute what MaxText trained. Default RoPE:
the sliding layers' base is local_rope_max_timescale when positive (MaxText's RotaryEmbedding for
LOCAL_SLIDING layers). MaxText picks the full-width q/k norm by ``model_name`` (olmo3*; any other name builds
per-head norms, which Olmo3ForCausalLM does not have: refused).

Gemma (all three): MaxText stores RMSNorm scales s where HF stores w = s - 1 (HF applies 1 + w) and the
embedding table E pre-multiplied by sqrt(d) (HF multiplies at lookup): MaxText's conversion hooks do
both. Tied logits: MaxText h @ bf16(E)^T / sqrt(d) (normalize_embedding_logits) = HF's h @ E_hf^T when
E_hf = E / sqrt(d) -- exact when sqrt(d) is a power of two; otherwise the hook's divisor (gemma3: bf16
sqrt(d), what HF/vLLM multiply by in bf16; gemma2: fp32 sqrt(d)) leaves the inputs or the logits off by
at most the bf16 rounding of sqrt(d), |1 - sqrt(d) / bf16(sqrt(d))| <= 2^-9.

Every other block (gpt_oss, gpt3, ...) is refused in one line naming the supported
ones; gpt_oss with its reason (``REFUSED``), for both formats: HF's GptOssForCausalLM holds each layer's experts
as fused 3-D tensors (``mlp.experts.gate_up_proj`` [E, H, 2I], gate/up interleaved, ``down_proj``, and their
biases: what MaxText's mapping builds), which transformers 5.24 loads in bf16 or MXFP4 only; vLLM 0.33.0's
gpt_oss loader (models/gpt_oss.py ``_load_weights_other``) streams an expert's NVFP4 packed weight and block
scale per expert, but no checkpoint name reaches the per-tensor scales its NVFP4 MoE methods need
(compressed-tensors' weight/input global scales, ModelOpt's weight_scale_2 / input_scale): an export would
load with those uninitialized or fail. tests/peers checks this against vLLM's own loader functions.

Excluded from NVFP4 (written bf16, listed in the configs' ignore list): embeddings, norms, routers,
``lm_head``, and every linear that did not train in NVFP4 (DeepSeek's e_score_correction_bias: fp32).
"""

from __future__ import annotations

import dataclasses
import math
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
  # the block builds its q/k norms whatever the config's use_qk_norm says (gemma3)
  qk_norm_fixed: bool = False
  # HF decoder layers per MaxText decoder layer (gemma2: a local and a global layer)
  layers_per_block: int = 1
  # Gemma: (1 + w) norms, sqrt(d)-scaled tied embeddings, sandwich norms, gelu-tanh MLP, soft-capping,
  # sliding-window layers (hf_forward.DecoderShape); its settings are checked by _gemma_problems
  gemma: bool = False
  # DeepSeek-V3: MLA attention, sigmoid routing with a correction bias, shared experts, dense first layers
  # (hf_forward.MlaShape / MoeShape); its settings are checked by _deepseek_problems
  deepseek: bool = False
  # Olmo 3: post-norm-only layers, full-width q/k norms, sliding/global layer types, default or YaRN RoPE on
  # every layer (hf_forward.DecoderShape post_norms, qk_norm_full, rope_yarn); checked by _olmo3_problems
  olmo: bool = False
  # Llama 4: NoPE / chunked RoPE layers, L2 q/k norm, temperature tuning, interleaved dense and MoE layers with
  # input-scaled top-1 routing and a shared expert (hf_forward.DecoderShape nope_layers, ...); checked by
  # _llama4_problems
  llama4: bool = False


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


def _cap(value) -> float | None:
  return float(value) if float(value or 0) > 0 else None


def _gemma(config, dims):
  return {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False}


def _gemma2(config, dims):
  return {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": dims["head_dim"],
          "sliding_window": int(config.sliding_window_size), "layer_types": layer_types(config, dims),
          "attn_logit_softcapping": _cap(config.attn_logits_soft_cap),
          "final_logit_softcapping": _cap(config.final_logits_soft_cap), "attention_bias": False}


def _gemma3(config, dims):
  local, full = _thetas(config)
  factor = float(_get(config, "rope_linear_scaling_factor") or 1.0)
  rope_full = {"rope_type": "default", "rope_theta": full} if factor == 1.0 else {
      "rope_type": "linear", "factor": factor, "rope_theta": full}
  return {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": _gemma3_query_pre_attn_scalar(config),
          "sliding_window": int(config.sliding_window_size), "layer_types": layer_types(config, dims),
          "attn_logit_softcapping": _cap(config.attn_logits_soft_cap),
          "final_logit_softcapping": _cap(config.final_logits_soft_cap), "attention_bias": False,
          "use_bidirectional_attention": False, "rope_local_base_freq": local,
          "rope_parameters": {"full_attention": rope_full, "sliding_attention": {"rope_type": "default",
                                                                                 "rope_theta": local}}}


def _groups(config) -> tuple[int, int]:
  """(n_group, topk_group): MaxText's n_routing_groups / topk_routing_group (-1: one group of all experts)."""
  n = int(_get(config, "n_routing_groups") or -1)
  return (1, 1) if n <= 0 else (n, int(config.topk_routing_group))


def _deepseek(config, dims):
  n_group, topk_group = _groups(config)
  rope = {"rope_type": "yarn", "rope_theta": float(config.rope_max_timescale), "factor": float(config.rope_factor),
          "original_max_position_embeddings": int(config.original_max_position_embeddings),
          "beta_fast": float(config.beta_fast), "beta_slow": float(config.beta_slow), "mscale": float(config.mscale),
          "mscale_all_dim": float(config.mscale), "truncate": True}
  return {"intermediate_size": dims["mlp_dim"], "moe_intermediate_size": dims["moe_mlp_dim"],
          "n_routed_experts": dims["num_experts"], "n_shared_experts": int(config.shared_experts),
          "num_experts_per_tok": int(config.num_experts_per_tok),
          "routed_scaling_factor": float(config.routed_scaling_factor),
          "n_group": n_group, "topk_group": topk_group, "norm_topk_prob": True,
          "first_k_dense_replace": dims["first_num_dense_layers"], "q_lora_rank": dims["q_lora_rank"],
          "kv_lora_rank": dims["kv_lora_rank"], "qk_nope_head_dim": dims["qk_nope_head_dim"],
          "qk_rope_head_dim": dims["qk_rope_head_dim"], "v_head_dim": dims["v_head_dim"],
          "head_dim": dims["qk_rope_head_dim"], "rope_interleave": True, "attention_bias": False,
          "max_position_embeddings": int(config.max_position_embeddings), "rope_parameters": rope,
          "num_nextn_predict_layers": 0}


def _olmo3_attention_factor(config) -> float:
  """MaxText's YaRN cos/sin scale (layers/embeddings.py YarnRotaryEmbedding): 0.1 ln(factor) + 1 when
  rope_attention_scaling and factor > 1, else 1 -- HF's yarn ``attention_factor``."""
  factor = float(config.rope_factor)
  return 0.1 * math.log(factor) + 1.0 if _get(config, "rope_attention_scaling") and factor > 1 else 1.0


def _olmo3_rope(config) -> tuple[dict, dict]:
  """(full_attention's, sliding_attention's) ``rope_parameters`` of an olmo3 block (module docstring)."""
  local, full = _thetas(config)
  if str(_get(config, "rope_type")) != "yarn":
    return {"rope_type": "default", "rope_theta": full}, {"rope_type": "default", "rope_theta": local}
  yarn = {"rope_type": "yarn", "rope_theta": full, "factor": float(config.rope_factor),
          "original_max_position_embeddings": int(config.original_max_position_embeddings),
          "beta_fast": float(config.beta_fast), "beta_slow": float(config.beta_slow),
          "attention_factor": _olmo3_attention_factor(config), "truncate": True}
  return yarn, dict(yarn)


def _olmo3(config, dims):
  full, sliding = _olmo3_rope(config)
  out = {"attention_bias": False, "attention_dropout": 0.0, "sliding_window": int(config.sliding_window_size),
         "layer_types": layer_types(config, dims),
         "rope_parameters": {"full_attention": full, "sliding_attention": sliding}}
  if full["rope_type"] == "yarn":  # YaRN's context (vLLM's max_model_len; HF's check of factor against it)
    out["max_position_embeddings"] = int(config.max_position_embeddings)
  return out


def _llama4_constants() -> dict[str, float]:
  """What MaxText's llama4 block hard-codes (the adapter's ``constants``): temperature tuning's attn_scale and
  floor_scale, LLaMARotaryEmbedding's llama3 scaling."""
  return dict(touchpoints.adapter().hf_conversions["llama4"].constants)


def llama4_layers(config, n: int) -> tuple[list[int], list[int]]:
  """(NoPE layers, MoE layers) of an ``n``-layer llama4 model: MaxText's ``determine_is_nope_layer`` /
  ``determine_is_moe_layer`` of layer i, or of its place i % cycle in a scanned block (Llama4ScannableBlock)."""
  mod = _model_module("llama4")
  cycle = int(config.inhomogeneous_layer_cycle_interval) if _get(config, "scan_layers") else n
  nope = [i for i in range(n) if mod.determine_is_nope_layer(i % cycle, _get(config, "nope_layer_interval"))]
  moe = [i for i in range(n) if mod.determine_is_moe_layer(i % cycle, _get(config, "interleave_moe_layer_step"))]
  return nope, moe


def _llama4_rope(config) -> dict:
  theta = float(config.rope_max_timescale)
  if not _get(config, "rope_use_scale"):
    return {"rope_type": "default", "rope_theta": theta}
  c = _llama4_constants()
  return {"rope_type": "llama3", "rope_theta": theta, "factor": c["rope_factor"],
          "low_freq_factor": c["low_freq_factor"], "high_freq_factor": c["high_freq_factor"],
          "original_max_position_embeddings": int(c["original_max_position_embeddings"])}


def _llama4(config, dims):
  n = dims["num_decoder_layers"]
  nope, moe = llama4_layers(config, n)
  c = _llama4_constants()
  chunk = int(config.chunk_attn_window_size)
  return {"intermediate_size": dims["moe_mlp_dim"], "intermediate_size_mlp": dims.get("mlp_dim", int(config.mlp_dim)),
          "num_local_experts": dims["num_experts"], "num_experts_per_tok": int(config.num_experts_per_tok),
          "interleave_moe_layer_step": int(config.interleave_moe_layer_step), "moe_layers": moe,
          "no_rope_layers": [0 if i in nope else 1 for i in range(n)],
          "no_rope_layer_interval": int(_get(config, "nope_layer_interval") or 0),
          "attention_chunk_size": chunk,
          "layer_types": ["full_attention" if i in nope else "chunked_attention" for i in range(n)],
          "use_qk_norm": bool(_get(config, "use_qk_norm")),
          "attn_temperature_tuning": bool(_get(config, "temperature_tuning")),
          "attn_scale": c["attn_scale"], "floor_scale": int(c["floor_scale"]), "attention_bias": False,
          "rope_parameters": _llama4_rope(config), "output_router_logits": False, "router_aux_loss_coef": 0.0,
          "router_jitter_noise": 0.0, "attention_dropout": 0.0}


def generation_config(config) -> dict:
  """Keys the family adds to generation_config.json: Llama 4's ``attn_temperature_tuning`` (vLLM's
  Llama4ForCausalLM reads it there; without it, it tunes only when max_model_len > 32768)."""
  if decoder_block(config) != "llama4":
    return {}
  return {"attn_temperature_tuning": bool(_get(config, "temperature_tuning"))}


def _model_module(block: str):
  """MaxText's ``models/<block>.py`` (gemma3, olmo3, llama4), checked against the adapter's touches."""
  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel

  return checkpoint.maxtext_module(f"maxtext.models.{block}")


def _gemma3_query_pre_attn_scalar(config) -> int:
  """HF's ``query_pre_attn_scalar`` q (scores * q ** -0.5) of MaxText's ``get_query_pre_attn_scalar`` s
  (queries * s): q = s ** -2 (256 for head_dim 256; gemma3-27b: emb_dim / heads = 168)."""
  s = float(_model_module("gemma3").get_query_pre_attn_scalar(config))
  return int(round(s ** -2))


def _thetas(config) -> tuple[float, float]:
  """(sliding layers' RoPE base, global layers'): MaxText's local_rope_max_timescale when positive."""
  full = float(config.rope_max_timescale)
  local = float(_get(config, "local_rope_max_timescale") or -1)
  return (local if local > 0 else full), full


def layer_types(config, dims) -> list[str]:
  """HF's ``layer_types`` of a Gemma or Olmo 3 model: gemma2 alternates (MaxText's layer i = local 2i, global
  2i+1); gemma3 follows MaxText's ``gemma3.get_attention_type`` of each layer; olmo3 its
  ``olmo3.get_attention_type`` -- of layer i unscanned, of i's place in its block of
  inhomogeneous_layer_cycle_interval layers when scanned (Olmo3ScannableBlock's layers_<k>)."""
  n, block = dims["num_decoder_layers"], decoder_block(config)
  if block == "gemma2":
    return ["sliding_attention", "full_attention"] * n
  get = _model_module(block).get_attention_type
  cycle = int(config.inhomogeneous_layer_cycle_interval) if block == "olmo3" and _get(config, "scan_layers") else n
  types = [get(i % cycle) for i in range(n)]
  return ["sliding_attention" if getattr(t, "value", "") == "local_sliding" else "full_attention" for t in types]


FAMILIES: dict[str, ExportFamily] = {
    "llama2": ExportFamily(architecture="LlamaForCausalLM", model_type="llama", extra_config=_llama),
    "mistral": ExportFamily(architecture="MistralForCausalLM", model_type="mistral", extra_config=_no_window),
    "qwen2": ExportFamily(architecture="Qwen2ForCausalLM", model_type="qwen2", attention_bias=True, extra_config=_qwen2),
    "qwen3": ExportFamily(architecture="Qwen3ForCausalLM", model_type="qwen3", qk_norm=True, extra_config=_qwen3),
    "qwen3_moe": ExportFamily(architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", qk_norm=True, moe_block="mlp",
                              extra_config=_qwen3_moe),
    "mixtral": ExportFamily(architecture="MixtralForCausalLM", model_type="mixtral", moe_block="block_sparse_moe",
                            expert_linears=("w1", "w3", "w2"), extra_config=_mixtral),
    "gemma": ExportFamily(architecture="GemmaForCausalLM", model_type="gemma", gemma=True, extra_config=_gemma),
    "gemma2": ExportFamily(architecture="Gemma2ForCausalLM", model_type="gemma2", layers_per_block=2, gemma=True,
                           extra_config=_gemma2),
    "gemma3": ExportFamily(architecture="Gemma3ForCausalLM", model_type="gemma3_text", qk_norm=True,
                           qk_norm_fixed=True, gemma=True, extra_config=_gemma3),
    "deepseek": ExportFamily(architecture="DeepseekV3ForCausalLM", model_type="deepseek_v3", moe_block="mlp",
                             deepseek=True, extra_config=_deepseek),
    "olmo3": ExportFamily(architecture="Olmo3ForCausalLM", model_type="olmo3", qk_norm=True, olmo=True,
                          extra_config=_olmo3),
    "llama4": ExportFamily(architecture="Llama4ForCausalLM", model_type="llama4_text", moe_block="feed_forward",
                           llama4=True, extra_config=_llama4),
}

# blocks refused with a reason of their own (a fact of the HF format, not a missing row)
REFUSED = {
    "gpt_oss": "no NVFP4 layout of its experts loads in vLLM 0.33 or transformers 5.24, in either format:"
               " GptOssForCausalLM holds them as fused 3-D tensors (mlp.experts.gate_up_proj [E, H, 2I], gate/up"
               " interleaved, + biases; transformers' GptOssExperts loads bf16 or MXFP4 only), and vLLM's gpt_oss"
               " loader streams per-expert packed weights and block scales but no name into the experts'"
               " per-tensor scales (compressed-tensors *_weight_global_scale / *_input_global_scale, ModelOpt"
               " *_weight_scale_2 / *_input_scale; docs/export.md)",
}


def decoder_block(config) -> str:
  return str(_get(config, "decoder_block")).lower().split(".")[-1]


def family(config) -> ExportFamily:
  """The export family of ``config``'s decoder block; :class:`UnsupportedModel` for any other block."""
  block = decoder_block(config)
  if block not in FAMILIES or block not in touchpoints.adapter().hf_conversions:
    why = f"; {REFUSED[block]}" if block in REFUSED else ""
    raise UnsupportedModel(f"unsupported model for the export: decoder_block={block} (exports: {', '.join(FAMILIES)})"
                           f"{why}")
  return FAMILIES[block]


def _gemma_problems(config) -> list[str]:
  """What a Gemma block's HF architecture cannot express (MaxText: models/gemma.py, gemma2.py, gemma3.py)."""
  problems = []
  v1 = decoder_block(config) == "gemma"
  if not (_get(config, "logits_via_embedding") and _get(config, "normalize_embedding_logits")):
    # MaxText's Gemma conversions map no lm_head, and its table holds E * sqrt(d): only h @ E^T / sqrt(d) is HF's
    problems.append("logits_via_embedding=false or normalize_embedding_logits=false (Gemma's tied logits are"
                    " h @ E^T / sqrt(emb_dim))")
  for key in ("use_post_attn_norm", "use_post_ffw_norm"):
    if not v1 and not _get(config, key):
      problems.append(f"{key}=false (HF's Gemma layers always have it)")
  if float(config.normalization_layer_epsilon) != 1e-6:
    # the layers' norms are RMSNorm(...) without epsilon (its default 1e-6); HF uses rms_norm_eps for all
    problems.append(f"normalization_layer_epsilon={config.normalization_layer_epsilon} (the Gemma layers' norms"
                    " use 1e-6)")
  if v1 and float(_get(config, "final_logits_soft_cap") or 0) != 0:
    # (gemma.py's layers pass no attn_logits_soft_cap to their Attention: that key does nothing there)
    problems.append(f"final_logits_soft_cap={_get(config, 'final_logits_soft_cap')} (GemmaForCausalLM has no"
                    " soft-capping)")
  if not v1 and int(_get(config, "sliding_window_size") or 0) <= 0:
    problems.append(f"sliding_window_size={_get(config, 'sliding_window_size')} (the local layers need a window)")
  local, full = _thetas(config)
  if decoder_block(config) == "gemma2" and local != full:
    problems.append(f"local_rope_max_timescale={_get(config, 'local_rope_max_timescale')} (Gemma2ForCausalLM has one"
                    " rope_theta)")
  if decoder_block(config) == "gemma3" and _get(config, "scan_layers"):
    problems.append("scan_layers=true (gemma3's scanned blocks of 6 layers are not read by the export: train or"
                    " convert with scan_layers=false)")
  return problems


def _deepseek_problems(config) -> list[str]:
  """What DeepseekV3ForCausalLM cannot express of a MaxText deepseek block (models/deepseek.py,
  layers/attention_mla.py, layers/moe.py get_topk / deepseek_routing)."""
  problems = []
  if str(_get(config, "attention_type")) != "mla" or int(_get(config, "q_lora_rank") or 0) <= 0:
    problems.append(f"attention_type={_get(config, 'attention_type')}, q_lora_rank={_get(config, 'q_lora_rank')}"
                    " (DeepSeek-V3's MLA with a low-rank query only)")
  if not str(_get(config, "model_name")).startswith("deepseek3"):
    # MaxText routes the deepseek3* models only by DeepSeek-V3's rule (choice with the bias, weights without)
    problems.append(f"model_name={_get(config, 'model_name')} (MaxText routes DeepSeek-V3's way for deepseek3-* only)")
  if str(_get(config, "routed_score_func")) != "sigmoid" or not _get(config, "routed_bias"):
    problems.append(f"routed_score_func={_get(config, 'routed_score_func')}, routed_bias={_get(config, 'routed_bias')}"
                    " (needs sigmoid with a bias: e_score_correction_bias)")
  if int(_get(config, "shared_experts") or 0) < 1:
    problems.append("shared_experts=0 (DeepseekV3ForCausalLM's MoE layers have shared experts)")
  n_group, _ = _groups(config)
  if int(config.num_experts) % n_group:
    problems.append(f"num_experts={config.num_experts} not divisible by n_routing_groups={n_group}")
  if (str(_get(config, "rope_type")) != "yarn" or not _get(config, "rope_interleave")
      or not _get(config, "rope_truncate")
      or _get(config, "rope_attention_scaling") or float(_get(config, "mscale") or 0) <= 0
      or int(config.max_position_embeddings) <= int(config.original_max_position_embeddings)):
    # HF/vLLM's yarn with mscale = mscale_all_dim: cos/sin unscaled, softmax scale * mscale^2, which MaxText
    # applies when max_position_embeddings > original_max_position_embeddings
    problems.append(f"rope_type={_get(config, 'rope_type')}, rope_interleave={_get(config, 'rope_interleave')},"
                    f" rope_truncate={_get(config, 'rope_truncate')}, rope_attention_scaling="
                    f"{_get(config, 'rope_attention_scaling')}, mscale={_get(config, 'mscale')},"
                    f" max_position_embeddings={config.max_position_embeddings} (exports YaRN on interleaved pairs,"
                    " truncated, mscale > 0 applied to the softmax scale: max_position_embeddings >"
                    " original_max_position_embeddings)")
  for key, off in (("use_indexer", False), ("engram_layers", []), ("mhc_expansion_rate", 1), ("mtp_num_layers", 0)):
    value = _get(config, key)
    if value is not None and (list(value) if isinstance(value, (list, tuple)) else value) != off:
      problems.append(f"{key}={value} (not part of DeepseekV3ForCausalLM)")
  if _get(config, "logits_via_embedding"):
    problems.append("logits_via_embedding=true (DeepseekV3ForCausalLM has an lm_head)")
  return problems


def _scanned_cycle_problems(config, block: str) -> list[str]:
  """A scanned block of inhomogeneous_layer_cycle_interval layers (olmo3, llama4) needs a whole number of them."""
  if _get(config, "scan_layers") and int(config.num_decoder_layers) % int(config.inhomogeneous_layer_cycle_interval):
    return [f"scan_layers=true with num_decoder_layers={config.num_decoder_layers} not a multiple of"
            f" inhomogeneous_layer_cycle_interval={config.inhomogeneous_layer_cycle_interval} (MaxText's"
            f" scanned {block} builds whole blocks only)"]
  return []


def _olmo3_problems(config) -> list[str]:
  """What Olmo3ForCausalLM cannot express of a MaxText olmo3 block (models/olmo3.py, layers/attentions.py
  init_rotary_embedding and its q/k norms, layers/embeddings.py YarnRotaryEmbedding)."""
  problems = []
  if not str(_get(config, "model_name")).startswith("olmo3"):
    # attentions.py: GlobalRMSNorm (over all heads) only when model_name starts with olmo3, else per head
    problems.append(f"model_name={_get(config, 'model_name')} (MaxText builds Olmo 3's full-width q/k norms for"
                    " olmo3* model names only; others get per-head norms, which Olmo3ForCausalLM does not have)")
  if not _get(config, "qk_norm_with_scale", True):
    problems.append("qk_norm_with_scale=false (Olmo3ForCausalLM's q/k norms have weights)")
  if _get(config, "attention_bias"):
    problems.append("attention_bias=true (MaxText's olmo3 conversion maps no attention bias)")
  if int(_get(config, "sliding_window_size") or 0) <= 0:
    problems.append(f"sliding_window_size={_get(config, 'sliding_window_size')} (the sliding layers need a window)")
  problems += _scanned_cycle_problems(config, "olmo3")
  if str(_get(config, "rope_type")) == "yarn":
    if _get(config, "rope_interleave") or _get(config, "rope_pairwise") or not _get(config, "rope_truncate"):
      # interleaved pairs would need q/k rows permuted (MaxText's olmo3 conversion does not); HF reads truncate
      # only at the top of rope_parameters, so per-layer-type YaRN is always truncated
      problems.append(f"rope_interleave={_get(config, 'rope_interleave')},"
                      f" rope_pairwise={_get(config, 'rope_pairwise')},"
                      f" rope_truncate={_get(config, 'rope_truncate')} (exports YaRN in HF's halves layout,"
                      " truncated: rope_interleave=false, rope_truncate=true)")
    if float(config.rope_factor) < 1:
      problems.append(f"rope_factor={config.rope_factor} (YaRN needs a factor >= 1)")
  return problems


def _llama4_problems(config) -> list[str]:
  """What Llama4ForCausalLM cannot express of a MaxText llama4 block (models/llama4.py, layers/attentions.py,
  layers/moe.py get_topk and the llama4 branches of its dense and sparse paths). Top-1 routing, which the
  forward assumes, is MaxText's own rule (its config validation refuses llama4 with num_experts_per_tok > 1)."""
  problems = []
  if str(_get(config, "rope_type")) != "llama3.1":
    # any other rope_type is MaxText's RotaryEmbedding (halves layout): HF's Llama 4 rotates interleaved pairs
    problems.append(f"rope_type={_get(config, 'rope_type')} (Llama4ForCausalLM rotates interleaved pairs: MaxText's"
                    " LLaMARotaryEmbedding, rope_type llama3.1)")
  if int(_get(config, "shared_experts") or 0) != 1:
    problems.append(f"shared_experts={_get(config, 'shared_experts')} (Llama4TextMoe has one shared expert)")
  if _get(config, "routed_score_func") or _get(config, "routed_bias") or _get(config, "use_random_routing"):
    problems.append(f"routed_score_func={_get(config, 'routed_score_func')!r},"
                    f" routed_bias={_get(config, 'routed_bias')},"
                    f" use_random_routing={_get(config, 'use_random_routing')} (Llama 4 routes by the sigmoid of"
                    " the raw top-1 logit: '', false, false)")
  if float(_get(config, "routed_scaling_factor") or 1.0) != 1.0:
    problems.append(f"routed_scaling_factor={_get(config, 'routed_scaling_factor')} (Llama4TextMoe has none)")
  for key in ("attention_bias", "mlp_bias"):
    if _get(config, key):
      problems.append(f"{key}=true (Llama4ForCausalLM's linears have no biases)")
  if int(_get(config, "chunk_attn_window_size") or 0) <= 0:
    problems.append(f"chunk_attn_window_size={_get(config, 'chunk_attn_window_size')} (the RoPE layers attend in"
                    " chunks: a positive size)")
  if int(_get(config, "interleave_moe_layer_step") or 0) <= 0:
    problems.append(f"interleave_moe_layer_step={_get(config, 'interleave_moe_layer_step')} (a positive step)")
  problems += _scanned_cycle_problems(config, "llama4")
  return problems


def check_supported(config) -> ExportFamily:
  """The family, after every config setting the HF architecture cannot express is refused (one line)."""
  fam = family(config)
  problems = []
  act = "gelu" if fam.gemma else "silu"
  if list(_get(config, "mlp_activations") or []) != [act, "linear"]:
    problems.append(f"mlp_activations={_get(config, 'mlp_activations')} (needs [{act}, linear])")
  # gemma3: MaxText's linear factor applies to its global layers only (attentions.py), as HF's full_attention
  linear_ok = decoder_block(config) == "gemma3"
  yarn_ok = fam.olmo and str(_get(config, "rope_type")) == "yarn"  # olmo3's YaRN: _olmo3_problems
  if fam.deepseek or fam.llama4:
    pass  # YaRN: _deepseek_problems; llama3.1: _llama4_problems
  elif ((str(_get(config, "rope_type")) != "default" and not yarn_ok)
      or str(_get(config, "model_name")).startswith("llama3.1")
      or (float(_get(config, "rope_linear_scaling_factor") or 1.0) != 1.0 and not linear_ok)):
    problems.append(f"rope_type={_get(config, 'rope_type')}, model_name={_get(config, 'model_name')},"
                    f" rope_linear_scaling_factor={_get(config, 'rope_linear_scaling_factor')} (only default RoPE"
                    " exports)")
  for key in ("fused_qkv", "fused_mlp"):
    if _get(config, key):
      problems.append(f"{key}=true")
  if not (fam.qk_norm_fixed or fam.llama4) and bool(_get(config, "use_qk_norm")) != fam.qk_norm:
    problems.append(f"use_qk_norm={str(bool(_get(config, 'use_qk_norm'))).lower()} ({fam.architecture} has"
                    f"{'' if fam.qk_norm else ' no'} q/k norm)")
  if not fam.gemma:
    for key in ("final_logits_soft_cap", "attn_logits_soft_cap"):
      if float(_get(config, key) or 0) != 0:
        problems.append(f"{key}={_get(config, key)} ({fam.architecture} has no soft-capping)")
  if float(_get(config, "rope_min_timescale") or 1) != 1:
    problems.append(f"rope_min_timescale={_get(config, 'rope_min_timescale')} (HF's RoPE has 1)")
  if fam.gemma:
    problems += _gemma_problems(config)
  elif _get(config, "logits_via_embedding") and _get(config, "normalize_embedding_logits"):
    # MaxText divides tied-embedding logits by sqrt(emb_dim) (nnx_decoders.py); HF's tied lm_head does not
    problems.append("logits_via_embedding with normalize_embedding_logits (logits / sqrt(emb_dim))")
  if decoder_block(config) == "mixtral" and int(config.num_query_heads) * int(config.head_dim) != int(config.emb_dim):
    # MaxText's Mixtral hook reshapes every attention kernel to (hidden_size, -1): right only in this case
    problems.append(f"num_query_heads x head_dim = {int(config.num_query_heads) * int(config.head_dim)} != emb_dim"
                    f" {int(config.emb_dim)} (MaxText's mixtral conversion assumes them equal)")
  if fam.olmo:
    problems += _olmo3_problems(config)
  if fam.llama4:
    problems += _llama4_problems(config)
  elif fam.deepseek:
    problems += _deepseek_problems(config)
  elif fam.moe_block is not None:
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
  moe = mla = None
  if fam.moe_block is not None:
    moe = hf_forward.MoeShape(num_experts=dims["num_experts"], top_k=int(config.num_experts_per_tok),
                              block=fam.moe_block, expert_linears=fam.expert_linears)
  if fam.deepseek:
    n_group, topk_group = _groups(config)
    moe = dataclasses.replace(moe, scoring="sigmoid", n_group=n_group, topk_group=topk_group, shared_experts=True,
                              routed_scaling_factor=float(config.routed_scaling_factor),
                              first_dense=dims["first_num_dense_layers"])
    yarn = hf_forward.YarnShape(factor=float(config.rope_factor), beta_fast=float(config.beta_fast),
                                original_max_position_embeddings=int(config.original_max_position_embeddings),
                                beta_slow=float(config.beta_slow), mscale=float(config.mscale))
    mla = hf_forward.MlaShape(q_lora_rank=dims["q_lora_rank"], kv_lora_rank=dims["kv_lora_rank"], yarn=yarn,
                              qk_nope_head_dim=dims["qk_nope_head_dim"], qk_rope_head_dim=dims["qk_rope_head_dim"],
                              v_head_dim=dims["v_head_dim"])
  shape = hf_forward.DecoderShape(
      num_layers=dims["num_decoder_layers"] * fam.layers_per_block, num_heads=dims["num_query_heads"],
      num_kv_heads=dims["num_kv_heads"], head_dim=dims.get("head_dim", 0),
      rms_norm_eps=float(config.normalization_layer_epsilon), rope_theta=float(config.rope_max_timescale),
      qk_norm=fam.qk_norm, attention_bias=fam.attention_bias, moe=moe, mla=mla)
  if fam.llama4:
    extra = fam.extra_config(config, dims)
    rope = extra["rope_parameters"]
    llama3 = None if rope["rope_type"] != "llama3" else hf_forward.Llama3Rope(
        factor=rope["factor"], low_freq_factor=rope["low_freq_factor"], high_freq_factor=rope["high_freq_factor"],
        original_max_position_embeddings=rope["original_max_position_embeddings"])
    moe = dataclasses.replace(
        moe, scoring="sigmoid_input", shared_experts=True, router="router", shared_name="shared_expert",
        layers=tuple(extra["moe_layers"]))
    return dataclasses.replace(
        shape, moe=moe, mlp_block="feed_forward", nope_layers=tuple(i for i, r in enumerate(extra["no_rope_layers"])
                                                                     if not r),
        rope_interleaved=True, rope_llama3=llama3, qk_l2_norm=extra["use_qk_norm"],
        attention_chunk_size=extra["attention_chunk_size"],
        attn_temperature=(extra["attn_scale"], float(extra["floor_scale"])) if extra["attn_temperature_tuning"]
        else None)
  if fam.olmo:
    extra = fam.extra_config(config, dims)
    full, sliding = extra["rope_parameters"]["full_attention"], extra["rope_parameters"]["sliding_attention"]
    yarn = None if full["rope_type"] != "yarn" else hf_forward.YarnShape(
        factor=full["factor"], original_max_position_embeddings=full["original_max_position_embeddings"],
        beta_fast=full["beta_fast"], beta_slow=full["beta_slow"])
    return dataclasses.replace(
        shape, post_norms=True, qk_norm_full=True, sliding_window=extra["sliding_window"],
        sliding_layers=tuple(i for i, t in enumerate(extra["layer_types"]) if t == "sliding_attention"),
        local_rope_theta=sliding["rope_theta"], rope_yarn=yarn,
        rope_attention_factor=full.get("attention_factor", 1.0))
  if not fam.gemma:
    return shape
  if decoder_block(config) == "gemma":  # no sandwich norms, soft-caps, window; 1 / sqrt(head_dim)
    return dataclasses.replace(shape, norm_plus_one=True, scale_embeddings=True, activation="gelu_tanh")
  extra = fam.extra_config(config, dims)
  types = extra["layer_types"]
  return dataclasses.replace(
      shape, norm_plus_one=True, scale_embeddings=True, sandwich_norms=True, activation="gelu_tanh",
      attn_scale=float(extra["query_pre_attn_scalar"]) ** -0.5, attn_softcap=extra["attn_logit_softcapping"],
      final_softcap=extra["final_logit_softcapping"], sliding_window=extra["sliding_window"],
      sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
      local_rope_theta=_thetas(config)[0],
      rope_linear_factor=float(_get(config, "rope_linear_scaling_factor") or 1.0))  # gemma2: 1 (checked)


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
      "num_hidden_layers": dims["num_decoder_layers"] * fam.layers_per_block,
      "num_attention_heads": dims["num_query_heads"], "num_key_value_heads": dims["num_kv_heads"],
      "head_dim": dims.get("head_dim"), "vocab_size": dims["vocab_size"],
      "hidden_act": "gelu_pytorch_tanh" if fam.gemma else "silu",
      "rms_norm_eps": float(config.normalization_layer_epsilon),
      "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "rope_theta": theta,
      "max_position_embeddings": int(config.max_target_length),
      "tie_word_embeddings": bool(_get(config, "logits_via_embedding")), "dtype": "bfloat16",
  }
  out.update(fam.extra_config(config, dims))
  return out
