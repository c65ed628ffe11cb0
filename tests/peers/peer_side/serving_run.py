"""Peer side of the serving oracles: ModelOpt, vLLM and transformers on an exported NVFP4 checkpoint.

Usage: serving_run.py EXPORT_DIR FAMILY TRAINED.safetensors TOKENS.npy OUT.safetensors

EXPORT_DIR: what ``maxtext-nvfp4 export`` wrote (model.safetensors, config.json). TRAINED: the trained
fp32 weights in HF names and layouts (the main side converts the checkpoint). For each NVFP4 linear
``<n>`` (one with ``<n>.weight_scale``) OUT holds

  modelopt.<n>.weight / .weight_scale   ModelOpt 0.47 ``NVFP4QTensor.quantize(trained W, 16,
                                        weights_scaling_factor_2=<the export's weight_scale_2>)``: packed
                                        codes (uint8) and E4M3 block-scale bytes (uint8)
  modelopt_global.<layer>|<a>+<b>...    ``NVFP4QTensor.get_weights_scaling_factor_2`` of the fused
                                        group's concatenated trained weights (ModelOpt's own global scale)
  vllm_f32.<n> / vllm_bf16.<n>          vLLM's ``dequantize_to_dtype(weight, weight_scale,
                                        weight_scale_2, dtype, 16, swizzle=False)`` (file from the wheel)

and ``hf.logits``: transformers' model class for FAMILY (config.json without its quantization_config,
fp32, eager attention) with vLLM's fp32 decode for the NVFP4 linears and the export's bf16 tensors
(as fp32) for the rest, on TOKENS.
"""

import json
import pathlib
import sys

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import peers_env

# family -> (transformers class, fused groups sharing one global scale: HF linear suffixes)
FAMILIES = {
    "llama": ("LlamaForCausalLM", (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                                   ("mlp.gate_proj", "mlp.up_proj"))),
}


def main(export_dir, family, trained_path, tokens_path, out_path):
  from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel

  vllm = peers_env.load_vllm_nvfp4()
  cls_name, fused = FAMILIES[family]
  export_dir = pathlib.Path(export_dir)
  exported = load_file(export_dir / "model.safetensors")
  trained = load_file(trained_path)
  linears = sorted(k[: -len(".weight_scale")] for k in exported if k.endswith(".weight_scale"))
  out = {}
  for n in linears:
    q, scale, _ = NVFP4QTensor.quantize(trained[n + ".weight"].float(), 16,
                                        weights_scaling_factor_2=exported[n + ".weight_scale_2"].float())
    out[f"modelopt.{n}.weight"] = q._quantized_data.contiguous()  # pylint: disable=protected-access
    out[f"modelopt.{n}.weight_scale"] = scale.contiguous().view(torch.uint8)
    args = (exported[n + ".weight"], exported[n + ".weight_scale"], exported[n + ".weight_scale_2"])
    out[f"vllm_f32.{n}"] = vllm.dequantize_to_dtype(*args, torch.float32, 16, swizzle=False).contiguous()
    out[f"vllm_bf16.{n}"] = vllm.dequantize_to_dtype(*args, torch.bfloat16, 16, swizzle=False).contiguous()
  for n in linears:
    prefix, suffix = n.rsplit(".", 2)[0], ".".join(n.rsplit(".", 2)[1:])
    group = next((g for g in fused if suffix in g), (suffix,))
    if suffix == group[0]:
      w = torch.cat([trained[f"{prefix}.{g}.weight"].float() for g in group], dim=0)
      out[f"modelopt_global.{prefix}|{'+'.join(group)}"] = NVFP4QTensor.get_weights_scaling_factor_2(w).reshape(())

  config = json.loads((export_dir / "config.json").read_text())
  config.pop("quantization_config", None)
  # Built in fp32 (the config says bf16): nothing of the model, buffers included, in a lower precision.
  config["torch_dtype"] = config["dtype"] = "float32"
  assert config["architectures"] == [cls_name], (config["architectures"], cls_name)
  hf_config = transformers.AutoConfig.for_model(**config)
  hf_config._attn_implementation = "eager"  # pylint: disable=protected-access
  torch.manual_seed(0)
  model = getattr(transformers, cls_name)(hf_config).float().eval()
  state = {k: v.float() for k, v in exported.items() if k.endswith(".weight") and v.dtype == torch.bfloat16}
  state.update({f"{n}.weight": out[f"vllm_f32.{n}"] for n in linears})
  missing, unexpected = model.load_state_dict(state, strict=False)
  assert not unexpected and not [m for m in missing if "rotary" not in m], (missing, unexpected)
  tokens = torch.from_numpy(np.load(tokens_path)).long()
  with torch.no_grad():
    out["hf.logits"] = model(input_ids=tokens).logits.float().contiguous()
  save_file(out, out_path)
  print(json.dumps({"linears": len(linears), "transformers": transformers.__version__}))


if __name__ == "__main__":
  main(*sys.argv[1:])
