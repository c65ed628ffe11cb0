"""MaxText 0.2.5's llama4 decoder block -> Hugging Face ``Llama4ForCausalLM`` names and layouts.

MaxText 0.2.5's ``checkpoint_conversion/utils/param_mapping.py`` has no llama4 mapping; its facts are in
``checkpoint_conversion/standalone_scripts/llama4_ckpt_unscanned.py`` (``_hf_to_maxtext_mapping`` and
``_convert_huggingface_to_jax_weights``: HF's Llama 4 -> MaxText), read here in the other direction:

  HF (language model, text-only names)               MaxText layer ``layers_<i>``           layout
  model.layers.<i>.self_attn.{q,k,v}_proj.weight     self_attention-{query,key,value}-kernel [emb, H, D] -> [H*D, emb]
  model.layers.<i>.self_attn.o_proj.weight           self_attention-out-kernel              [H, D, emb] -> [emb, H*D]
  model.layers.<i>.input_layernorm.weight            pre_self_attention_layer_norm-scale    as is
  model.layers.<i>.post_attention_layernorm.weight   post_self_attention_layer_norm-scale   as is
  model.layers.<i>.feed_forward.{gate,up,down}_proj  mlp-{wi_0,wi_1,wo}-kernel (dense layers) transposed
  model.layers.<i>.feed_forward.router.weight        Llama4MoEBlock_0-MoeBlock_0-gate-kernel [emb, E] -> [E, emb]
  ...feed_forward.experts.<e>.{gate,up,down}_proj    Llama4MoEBlock_0-MoeBlock_0-{wi_0,wi_1,wo}[e]  transposed
  ...feed_forward.shared_expert.{gate,up,down}_proj  Llama4MoEBlock_0-shared_experts-{wi_0,wi_1,wo}-kernel
  model.embed_tokens / model.norm / lm_head          token_embedder-embedding / decoder_norm-scale /
                                                     logits_dense-kernel (transposed)

The script's facts this relies on: q/k rows are not permuted ("this is where the RoPE permutation would
occur, but we do not need to do this": MaxText's LLaMARotaryEmbedding and HF's Llama 4 both rotate
interleaved pairs); the query is not scaled (``scale_query: False`` for llama4: the block multiplies the
query by head_dim ** -0.5 in its forward, as HF's attention does); HF's fused ``experts.gate_up_proj``
[E, emb, 2I] is MaxText's [wi_0 | wi_1] and ``experts.down_proj`` [E, I, emb] its wo, so expert e's
gate_proj.weight is wi_0[e]^T -- the per-expert names the export writes are those of vLLM's llama4 loader
(``fused_moe_make_expert_params_mapping`` with gate_proj / up_proj / down_proj) and of NVIDIA's ModelOpt
NVFP4 Llama 4 checkpoints.

Scanned checkpoints (``Llama4ScannableBlock``): ``layers-layers_<k>-...`` stacks sub-layer k of every block
of ``inhomogeneous_layer_cycle_interval`` layers at ``param_scan_axis``: HF layer ``b * cycle + k``.

The functions take and return what ``param_mapping``'s do (``(hf_config, maxtext_config, scan_layers)``;
names: MaxText key -> HF name, or a list over stacked layers, or [expert][layer] lists; hooks: key -> chain of
``fn(array, hf_shape)``), so :mod:`maxtext_nvfp4.integration.hf_conversion` applies them unchanged. The HF
config they read is the export's: ``num_hidden_layers``, ``num_local_experts`` and ``moe_layers`` (the MoE
layers, from MaxText's ``determine_is_moe_layer``).
"""

from __future__ import annotations

import numpy as np

# the per-layer parameters: MaxText name under the layer -> HF name under model.layers.<i>.
_ATTENTION = {
    "self_attention-query-kernel": "self_attn.q_proj.weight",
    "self_attention-key-kernel": "self_attn.k_proj.weight",
    "self_attention-value-kernel": "self_attn.v_proj.weight",
    "self_attention-out-kernel": "self_attn.o_proj.weight",
    "pre_self_attention_layer_norm-scale": "input_layernorm.weight",
    "post_self_attention_layer_norm-scale": "post_attention_layernorm.weight",
}
_DENSE = {"mlp-wi_0-kernel": "feed_forward.gate_proj.weight", "mlp-wi_1-kernel": "feed_forward.up_proj.weight",
          "mlp-wo-kernel": "feed_forward.down_proj.weight"}
_MOE = "Llama4MoEBlock_0-"
_ROUTED = {f"{_MOE}MoeBlock_0-wi_0": "gate_proj.weight", f"{_MOE}MoeBlock_0-wi_1": "up_proj.weight",
           f"{_MOE}MoeBlock_0-wo": "down_proj.weight"}
_SHARED = {f"{_MOE}MoeBlock_0-gate-kernel": "feed_forward.router.weight",
           f"{_MOE}shared_experts-wi_0-kernel": "feed_forward.shared_expert.gate_proj.weight",
           f"{_MOE}shared_experts-wi_1-kernel": "feed_forward.shared_expert.up_proj.weight",
           f"{_MOE}shared_experts-wo-kernel": "feed_forward.shared_expert.down_proj.weight"}
_KERNELS = (*_ATTENTION, *_DENSE, *_ROUTED, *_SHARED)


def _layer_params(moe: bool) -> dict[str, str]:
  return {**_ATTENTION, **({**_SHARED, **dict.fromkeys(_ROUTED)} if moe else _DENSE)}


def LLAMA4_MAXTEXT_TO_HF_PARAM_MAPPING(config, maxtext_config, scan_layers=False):  # pylint: disable=invalid-name
  """MaxText key -> HF name(s) of a llama4 text decoder (module docstring)."""
  n, experts = int(config["num_hidden_layers"]), int(config["num_local_experts"])
  moe_layers = set(config["moe_layers"])
  out = {"params-token_embedder-embedding": "model.embed_tokens.weight",
         "params-decoder-decoder_norm-scale": "model.norm.weight",
         "params-decoder-logits_dense-kernel": "lm_head.weight"}

  def names(layers: list[int], key: str, hf: str | None):
    if hf is not None:  # one HF tensor per layer
      return [f"model.layers.{i}.{hf}" for i in layers]
    leaf = _ROUTED[key]  # routed experts: [expert][layer]
    return [[f"model.layers.{i}.feed_forward.experts.{e}.{leaf}" for i in layers] for e in range(experts)]

  if not scan_layers:
    for i in range(n):
      for key, hf in _layer_params(i in moe_layers).items():
        value = names([i], key, hf)
        out[f"params-decoder-layers_{i}-{key}"] = value[0] if hf is not None else [v[0] for v in value]
    return out
  cycle = int(maxtext_config.inhomogeneous_layer_cycle_interval)
  for k in range(cycle):
    layers = list(range(k, n, cycle))
    for key, hf in _layer_params(k in moe_layers).items():
      out[f"params-decoder-layers-layers_{k}-{key}"] = names(layers, key, hf)
  return out


def reshape_kernel(x, target_shape):
  """A MaxText kernel ``[in..., out...]`` as HF's ``[out, in]`` (``target_shape``): reshaped to the reversed
  target shape, then transposed."""
  return np.asarray(x).reshape(tuple(target_shape)[::-1]).T


def LLAMA4_MAXTEXT_TO_HF_PARAM_HOOK_FN(config, maxtext_config, scan_layers=False,  # pylint: disable=invalid-name
                                       saving_to_hf=True):
  """MaxText key -> [hook] of a llama4 text decoder: every kernel (attention, dense and expert MLPs,
  router, lm_head) transposed to ``[out, in]``; norms and the embedding as they are."""
  if not saving_to_hf:
    raise ValueError("the llama4 hooks convert MaxText -> HF only")
  names = LLAMA4_MAXTEXT_TO_HF_PARAM_MAPPING(config, maxtext_config, scan_layers)
  return {key: [reshape_kernel] for key in names
          if key == "params-decoder-logits_dense-kernel" or key.endswith(_KERNELS) and not key.endswith("-scale")}
