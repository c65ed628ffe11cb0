"""Peer side of the serving oracles: ModelOpt, vLLM, transformers and compressed-tensors on our exports.

Usage: serving_run.py JOBS.json OUT_DIR

JOBS.json: a list of ``{"family", "modelopt": dir, "compressed_tensors": dir or null, "trained": fp32
safetensors of the trained weights in HF names (the main side converts the checkpoint), "tokens": .npy}``.
Per job, OUT_DIR/<family>.safetensors holds, for each NVFP4 linear ``<n>`` (one with ``<n>.weight_scale``)
of the ModelOpt export:

  modelopt.<n>.weight / .weight_scale   ModelOpt 0.47 ``NVFP4QTensor.quantize(trained W, 16,
                                        weights_scaling_factor_2=<the export's weight_scale_2>)``: packed
                                        codes (uint8) and E4M3 block-scale bytes (uint8)
  modelopt_global.<prefix>|<a>+<b>...   ``NVFP4QTensor.get_weights_scaling_factor_2`` of a fused group's
                                        concatenated trained weights (ModelOpt's own global scale)
  vllm_f32.<n> / vllm_bf16.<n>          vLLM's ``dequantize_to_dtype(weight, weight_scale, weight_scale_2,
                                        dtype, 16, swizzle=False)`` (the file from the vLLM wheel)
  hf.logits                             transformers: ``AutoModelForCausalLM.from_pretrained`` (fp32, eager) of
                                        a folder holding the export's config (no quantization_config) and its
                                        tensors with vLLM's fp32 decode for the NVFP4 linears -- transformers'
                                        own loader maps the names (MoE experts merged by its conversion mapping;
                                        Llama 4's, which it has no mapping for, by ``fuse_llama4_experts``)
  hf_bf16.logits                        the same with vLLM's bf16 decode (what transformers' dequantization gives)
  ct.logits / ct_w.<n>                  (compressed-tensors export) ``from_pretrained`` with
                                        ``CompressedTensorsConfig(dequantize=True)`` on CPU, fp32: logits, and
                                        the dequantized weight of every NVFP4 linear that is a module of its own
  ct_converted.<tensor>                 compressed-tensors' ``convert_checkpoint(<modelopt export>,
                                        ModelOptNvfp4Converter(ignore=<its exclude list>, targets=["Linear"]))``:
                                        every tensor it wrote (the main side compares them with our
                                        compressed-tensors export)

and OUT_DIR/<family>.json: the loaders' reports (missing/unexpected keys, the converter's quantization_config).
"""

import json
import pathlib
import re
import sys
import tempfile

import numpy as np
import torch
from safetensors.torch import load_file, save_file

import peers_env

# HF linear leaves that engines fuse and ModelOpt gives one global scale
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"), ("q_a_proj", "kv_a_proj_with_mqa"))


def load_dir(d: pathlib.Path) -> dict:
  out = {}
  for f in sorted(d.glob("*.safetensors")):
    out.update(load_file(f))
  return out


def modelopt_and_vllm(exported: dict, trained: dict, out: dict) -> list[str]:
  from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor  # pylint: disable=import-outside-toplevel

  vllm = peers_env.load_vllm_nvfp4()
  linears = sorted(k[: -len(".weight_scale")] for k in exported if k.endswith(".weight_scale"))
  for n in linears:
    q, scale, _ = NVFP4QTensor.quantize(trained[n + ".weight"].float(), 16,
                                        weights_scaling_factor_2=exported[n + ".weight_scale_2"].float())
    out[f"modelopt.{n}.weight"] = q._quantized_data.contiguous()  # pylint: disable=protected-access
    out[f"modelopt.{n}.weight_scale"] = scale.contiguous().view(torch.uint8)
    args = (exported[n + ".weight"], exported[n + ".weight_scale"], exported[n + ".weight_scale_2"])
    out[f"vllm_f32.{n}"] = vllm.dequantize_to_dtype(*args, torch.float32, 16, swizzle=False).contiguous()
    out[f"vllm_bf16.{n}"] = vllm.dequantize_to_dtype(*args, torch.bfloat16, 16, swizzle=False).contiguous()
    prefix, leaf = n.rsplit(".", 1)
    group = next((g for g in FUSED if leaf in g), (leaf,))
    if leaf == group[0]:
      w = torch.cat([trained[f"{prefix}.{g}.weight"].float() for g in group], dim=0)
      out[f"modelopt_global.{prefix}|{'+'.join(group)}"] = NVFP4QTensor.get_weights_scaling_factor_2(w).reshape(())
  return linears


def fuse_llama4_experts(state: dict) -> dict:
  """Llama 4's per-expert linears (the names vLLM's llama4 loader and ModelOpt's NVFP4 Llama 4 checkpoints use)
  as transformers' Llama4TextExperts holds them: ``experts.gate_up_proj`` [E, hidden, 2I] = [gate^T | up^T] and
  ``experts.down_proj`` [E, I, hidden] = down^T per expert. transformers 5.24 has no conversion mapping for these
  names (conversion_mapping.py has none for llama4), so this oracle fuses them itself, in Llama4TextExperts'
  layout (its forward: ``bmm(x, gate_up_proj)``, ``gate, up = chunk(2)``)."""
  out, experts = {}, {}
  for k, v in state.items():
    m = re.match(r"^(.*\.feed_forward\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", k)
    if m:
      experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = v
    else:
      out[k] = v
  for prefix, w in experts.items():
    n = 1 + max(e for e, _ in w)
    out[prefix + ".gate_up_proj"] = torch.stack([torch.cat([w[(e, "gate")].T, w[(e, "up")].T], dim=1)
                                                 for e in range(n)])
    out[prefix + ".down_proj"] = torch.stack([w[(e, "down")].T for e in range(n)])
  return out


def hf_logits(export_dir: pathlib.Path, exported: dict, decoded: dict, tokens, report: dict) -> torch.Tensor:
  import transformers  # pylint: disable=import-outside-toplevel

  config = json.loads((export_dir / "config.json").read_text())
  config.pop("quantization_config", None)
  config["dtype"] = "float32"
  state = {k: v.float() for k, v in exported.items() if k.endswith((".weight", "bias")) and v.dtype != torch.uint8}
  state.update({f"{n}.weight": w for n, w in decoded.items()})
  if config["model_type"] == "llama4_text":
    state = fuse_llama4_experts(state)
  with tempfile.TemporaryDirectory() as tmp:
    (pathlib.Path(tmp) / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(pathlib.Path(tmp) / "model.safetensors"),
              metadata={"format": "pt"})
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
  report["hf_loading"] = {k: sorted(map(str, v)) for k, v in info.items()}
  report["hf_class"] = type(model).__name__
  with torch.no_grad():
    return model.eval()(input_ids=tokens).logits.float().contiguous()


def ct_logits(ct_dir: pathlib.Path, linears: list[str], tokens, out: dict, report: dict) -> torch.Tensor:
  import transformers  # pylint: disable=import-outside-toplevel

  model, info = transformers.AutoModelForCausalLM.from_pretrained(
      str(ct_dir), dtype=torch.float32, attn_implementation="eager", output_loading_info=True,
      quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
  report["ct_loading"] = {k: sorted(map(str, v)) for k, v in info.items()}
  state = model.state_dict()
  for n in linears:  # the dense modules' dequantized weights (fused MoE experts are not per-linear modules)
    if n + ".weight" in state:
      out[f"ct_w.{n}"] = state[n + ".weight"].float().contiguous()
  with torch.no_grad():
    return model.eval()(input_ids=tokens).logits.float().contiguous()


def ct_convert(modelopt_dir: pathlib.Path, out: dict, report: dict) -> None:
  from compressed_tensors.entrypoints.convert import convert_checkpoint  # pylint: disable=import-outside-toplevel
  from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter  # pylint: disable=import-outside-toplevel

  ignore = json.loads((modelopt_dir / "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
  with tempfile.TemporaryDirectory() as tmp:
    convert_checkpoint(str(modelopt_dir), tmp, ModelOptNvfp4Converter(ignore=ignore, targets=["Linear"]),
                       max_workers=1, device="cpu")
    for k, v in load_dir(pathlib.Path(tmp)).items():
      out[f"ct_converted.{k}"] = v.contiguous()
    report["ct_converted_config"] = json.loads((pathlib.Path(tmp) / "config.json").read_text())["quantization_config"]


def main(jobs_path, out_dir):
  import transformers  # pylint: disable=import-outside-toplevel

  out_dir = pathlib.Path(out_dir)
  for job in json.loads(pathlib.Path(jobs_path).read_text()):
    family, export_dir = job["family"], pathlib.Path(job["modelopt"])
    exported, trained = load_dir(export_dir), load_file(job["trained"])
    tokens = torch.from_numpy(np.load(job["tokens"])).long()
    out, report = {}, {"transformers": transformers.__version__}
    linears = modelopt_and_vllm(exported, trained, out)
    torch.manual_seed(0)
    out["hf.logits"] = hf_logits(export_dir, exported, {n: out[f"vllm_f32.{n}"] for n in linears}, tokens, report)
    if job.get("compressed_tensors"):
      # transformers dequantizes compressed-tensors weights to bf16: the reference is the bf16 decode
      bf16 = {n: out[f"vllm_bf16.{n}"].float() for n in linears}
      out["hf_bf16.logits"] = hf_logits(export_dir, exported, bf16, tokens, {})
      out["ct.logits"] = ct_logits(pathlib.Path(job["compressed_tensors"]), linears, tokens, out, report)
      ct_convert(export_dir, out, report)
    save_file(out, str(out_dir / f"{family}.safetensors"))
    (out_dir / f"{family}.json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({"family": family, "linears": len(linears)}), flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:])
