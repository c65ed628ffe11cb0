"""Peer side of the vLLM config oracle: vLLM 0.33.0's own config parsing and per-layer quantization dispatch of
our exports, on CPU (vLLM has no CPU NVFP4 kernel; nothing here runs a GEMM or loads a weight).

Usage: vllm_config_run.py JOBS.json OUT.json     (or --warm: import vLLM and inspect every architecture we export;
       or --gpt-oss-routes OUT.json: where vLLM's gpt_oss loader sends NVFP4 expert tensors, ``gpt_oss_routes``)

Runs with ``PYTHONPATH=.peers/vllm_site`` (peers_env.VLLM_ENV, set by the main side before the interpreter starts:
vLLM's model registry inspects an architecture in a subprocess that must import the same vLLM). Per job
``{"name", "dir"}`` (an export folder), vLLM's own code, in the order ``vllm serve DIR`` runs it:

  1. ``vllm.config.ModelConfig(model=DIR)``: ``transformers_utils/config.py`` reads config.json's
     ``quantization_config`` (else hf_quant_config.json), the registry resolves the architecture, and
     ``ModelConfig._verify_quantization`` picks the quantization method (each method's
     ``override_quantization_method``, e.g. ModelOpt's NVFP4 -> ``modelopt_fp4``);
  2. ``VllmConfig(model_config, device_config=cpu)``: ``VllmConfig._get_quantization_config`` ->
     ``model_loader/weight_utils.py get_quant_config`` -> the method's ``from_config`` (quant_algo, group_size,
     exclude_modules / ignore, config_groups validated by compressed-tensors 0.17.0's pydantic models);
  3. ``model_loader/utils.py initialize_model`` on the meta device: vLLM builds its own model class, and every
     layer asks ``quant_config.get_quant_method(layer, prefix)`` with vLLM's prefixes and fused layers
     (qkv_proj, gate_up_proj, experts) -- the exclusion and scheme matching under test.

Each ``get_quant_method`` answer is recorded: the method class, and for ModelOpt's linear method its QuantSpec
(named by vLLM's ``quant_utils`` keys, e.g. ``kNvfp4Static`` / ``kNvfp4Dynamic``). Where the chosen method's
``__init__`` then asks for a kernel and the CPU has none (``init_nvfp4_linear_kernel``: no W4A4 kernel, or the
W4A16 Marlin kernel it forces is CUDA-only; ``select_nvfp4_moe_backend``: no MoE backend; all raise), the choice is read from that ``__init__`` frame in the traceback (its class and ``use_a16``) and the error
is recorded. The recorder then hands the layer an unquantized method (linears) or ``None`` so the meta-device
construction can go on -- a stand-in only for building the module tree; its weights are never created on a device
nor loaded. A refusal in steps 1-2 (or a ValueError in 3 that is not a missing kernel) is the job's ``error``.

OUT.json: ``{name: {"error", "quantization", "quant_config", "fields", "model_class", "packed_modules_mapping",
"layers": {prefix: {"layer", "method", "use_a16", "weight", "activation", "kernel_error"}}, "versions"}}``.
"""

import json
import os
import pathlib
import sys
import tempfile
import traceback

# the CPU kernels vLLM lacks: the only errors a layer may report (main side checks the text)
NO_KERNEL = ("Failed to find a kernel that can implement the NVFP4 linear layer",  # W4A4 linear
             "Forced NVFP4 kernel MarlinNvFp4LinearKernel is not supported",  # W4A16 linear (Marlin: CUDA only)
             "No NvFp4 MoE backend supports the deployment configuration")  # MoE experts, either
# the architectures test_serving_oracles.py exports (its FAMILIES), inspected by --warm (tiny config.json, no weights)
WARM_ARCHS = {"LlamaForCausalLM": "llama", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
              "MixtralForCausalLM": "mixtral"}


def _one_line(e: BaseException) -> str:
  """``Type: first line``; for pydantic's ValidationError (VllmConfig wraps a from_config ValueError in one) the
  first error's own message."""
  text = str(e).strip().splitlines()
  try:
    text = e.errors()[0]["msg"].strip().splitlines() or text  # pydantic
  except (AttributeError, IndexError, KeyError, TypeError):
    pass
  return f"{type(e).__name__}: {text[0] if text else ''}"


def _key_name(key):
  """vLLM's own name of a QuantKey (``quant_utils.kNvfp4Static`` ...), else its repr."""
  if key is None:
    return None
  from vllm.model_executor.layers.quantization.utils import quant_utils  # pylint: disable=import-outside-toplevel
  return next((n for n, v in vars(quant_utils).items() if n.startswith("k") and v is key), repr(key))


def _choice_from_traceback(tb):
  """(class name, use_a16) of the outermost quantization ``__init__`` on the failing stack."""
  from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase  # pylint: disable=import-outside-toplevel
  from vllm.model_executor.layers.quantization.compressed_tensors.schemes import CompressedTensorsScheme  # pylint: disable=import-outside-toplevel
  for frame, _ in traceback.walk_tb(tb):
    me = frame.f_locals.get("self")
    if frame.f_code.co_name == "__init__" and isinstance(me, (QuantizeMethodBase, CompressedTensorsScheme)):
      return type(me).__name__, getattr(me, "use_a16", frame.f_locals.get("use_a16"))
  return None, None


def _recorder(quant_config, layers: dict):
  from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod  # pylint: disable=import-outside-toplevel

  real = quant_config.get_quant_method

  def get_quant_method(layer, prefix):
    rec = {"layer": type(layer).__name__, "method": None, "use_a16": None, "weight": None, "activation": None,
           "kernel_error": None}
    try:
      method = real(layer, prefix)
      rec["method"] = None if method is None else type(method).__name__
      rec["use_a16"] = getattr(method, "use_a16", None)
      scheme = getattr(layer, "scheme", None)  # compressed-tensors puts its linear scheme on the layer
      if scheme is not None:
        rec["method"], rec["use_a16"] = type(scheme).__name__, getattr(scheme, "use_a16", None)
      spec = getattr(method, "spec", None)  # ModelOpt's generic linear method
      if spec is not None:
        rec["weight"], rec["activation"] = _key_name(spec.weight), _key_name(spec.activation)
    except (ValueError, NotImplementedError) as e:
      if not any(s in str(e) for s in NO_KERNEL):
        raise
      rec["method"], rec["use_a16"] = _choice_from_traceback(e.__traceback__)
      rec["kernel_error"] = _one_line(e)
    layers[prefix] = rec
    return UnquantizedLinearMethod() if isinstance(layer, LinearBase) else None

  quant_config.get_quant_method = get_quant_method


def _fields(qc) -> dict:
  keys = ("quant_method", "group_size", "exclude_modules", "kv_cache_quant_algo", "is_checkpoint_nvfp4_serialized",
          "ignore", "quant_format")
  out = {k: getattr(qc, k) for k in keys if hasattr(qc, k)}
  if hasattr(qc, "target_scheme_map"):
    out["targets"] = sorted(qc.target_scheme_map)
  return json.loads(json.dumps(out, default=str))


def parse(export_dir: str, port: int) -> dict:
  """vLLM's steps 1-3 (module docstring) on one folder."""
  import torch  # pylint: disable=import-outside-toplevel
  from vllm.config import DeviceConfig, LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config  # pylint: disable=import-outside-toplevel
  from vllm.distributed import parallel_state  # pylint: disable=import-outside-toplevel
  from vllm.model_executor.model_loader.utils import initialize_model  # pylint: disable=import-outside-toplevel

  report = {"error": None, "layers": {}}
  step = "ModelConfig"
  try:
    mc = ModelConfig(model=export_dir, tokenizer=export_dir, skip_tokenizer_init=True, dtype="bfloat16")
    report["quantization"] = mc.quantization
    step = "VllmConfig (get_quant_config)"
    vc = VllmConfig(model_config=mc, load_config=LoadConfig(), device_config=DeviceConfig(device="cpu"))
    qc = vc.quant_config
    report["quant_config"] = type(qc).__name__ if qc is not None else None
    if qc is None:
      return report
    report["fields"] = _fields(qc)
    step = "initialize_model"
    _recorder(qc, report["layers"])
    with set_current_vllm_config(vc):
      # one process, world size 1 (gloo on loopback); the model-parallel groups are remade per model: vLLM creates
      # the expert-parallel group only when the current config is an MoE model
      parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                  distributed_init_method=f"tcp://127.0.0.1:{port}")
      if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
      parallel_state.initialize_model_parallel(1, 1)
      with torch.device("meta"):
        model = initialize_model(vc)
    report["model_class"] = f"{type(model).__module__}.{type(model).__name__}"
    report["packed_modules_mapping"] = {k: list(v) for k, v in qc.packed_modules_mapping.items()}
  except Exception as e:  # pylint: disable=broad-exception-caught
    report["error"] = f"{step}: {_one_line(e)}"
  return report


def _free_port() -> int:
  import socket  # pylint: disable=import-outside-toplevel
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def gpt_oss_routes() -> dict:
  """Where vLLM 0.33.0's gpt_oss loader (``models/gpt_oss.py``) sends each expert tensor an NVFP4 export could
  write, for both NVFP4 MoE methods (the real ``create_weights`` of ``CompressedTensorsW4A4Nvfp4MoEMethod`` and
  ``ModelOptNvFp4FusedMoE`` on a bare module: the parameters a gpt_oss expert layer holds under
  ``model.layers.0.mlp.experts.routed_experts.``; their ``__init__``, which asks for a CUDA MoE kernel, is skipped).

  Per candidate checkpoint name: ``GptOssForCausalLM.hf_to_vllm_mapper`` (the model's own renaming), then
  ``weight_utils.maybe_remap_moe_expert_param_name`` and ``GptOssModel._get_streamed_expert_info`` (the per-expert
  "streamed" route of ``_load_weights_other``), as ``load_weights`` applies them. Returns ``{"params": {method:
  [parameter names]}, "names": {candidate: {"mapped", "remapped", "streamed": [parameter, shard] or None,
  "is_param"}}}``."""
  import types  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (  # pylint: disable=import-outside-toplevel
      compressed_tensors_moe_w4a4_nvfp4 as ct_moe)
  from vllm.model_executor.layers.quantization import modelopt  # pylint: disable=import-outside-toplevel
  from vllm.model_executor.model_loader.weight_utils import maybe_remap_moe_expert_param_name  # pylint: disable=import-outside-toplevel
  from vllm.model_executor.models.gpt_oss import GptOssForCausalLM, GptOssModel  # pylint: disable=import-outside-toplevel

  from vllm.config import VllmConfig, set_current_vllm_config  # pylint: disable=import-outside-toplevel
  from vllm.distributed import parallel_state  # pylint: disable=import-outside-toplevel

  # ModelOpt's parameters read the tensor-parallel rank: one process, world size 1, a default config
  with set_current_vllm_config(VllmConfig()):
    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
    parallel_state.initialize_model_parallel(1, 1)
  moe = types.SimpleNamespace(is_act_and_mul=True)
  ct = object.__new__(ct_moe.CompressedTensorsW4A4Nvfp4MoEMethod)
  ct.moe, ct.group_size = moe, 16
  mo = object.__new__(modelopt.ModelOptNvFp4FusedMoE)
  mo.moe, mo.use_global_sf = moe, False
  mo.quant_config = types.SimpleNamespace(is_checkpoint_nvfp4_serialized=True, group_size=16)
  prefix = "model.layers.0.mlp.experts."
  params, out = {}, {"params": {}, "names": {}}
  for name, method in (("compressed-tensors", ct), ("modelopt", mo)):
    layer = torch.nn.Module()
    method.create_weights(layer, num_experts=2, hidden_size=64, intermediate_size_per_partition=32,
                          params_dtype=torch.bfloat16, weight_loader=None, global_num_experts=2)
    out["params"][name] = sorted(n for n, _ in layer.named_parameters())
    params.update({prefix + "routed_experts." + n: p for n, p in layer.named_parameters()})
  ct_leaves = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale", "bias")
  mo_leaves = ("weight", "weight_scale", "weight_scale_2", "input_scale", "bias")
  candidates = []
  for w in ("w13", "w2"):  # vLLM's own per-expert names (the streamed table's form) and fused names
    candidates += [f"{prefix}0.{w}_{leaf}" for leaf in ct_leaves + mo_leaves]
    candidates += [f"{prefix}{w}_{leaf}" for leaf in ct_leaves + mo_leaves]
  for hf in ("gate_up_proj", "down_proj"):  # HF's fused names: ModelOpt's GptOssExperts export, and dotted (quark)
    candidates += [f"{prefix}{hf}", f"{prefix}{hf}_bias"]
    candidates += [f"{prefix}{hf}_{leaf}" for leaf in ("weight_scale", "weight_scale_2", "input_scale")]
    candidates += [f"{prefix}{hf}.{leaf}" for leaf in ("weight", "weight_scale", "weight_scale_2", "input_scale")]
  for g in ("gate_proj", "up_proj", "down_proj"):  # per-expert HF linears (the other MoE families' layout)
    candidates += [f"{prefix}0.{g}.{leaf}" for leaf in ct_leaves + mo_leaves]
  for c in dict.fromkeys(candidates):
    mapped = GptOssForCausalLM.hf_to_vllm_mapper._map_name(c)  # pylint: disable=protected-access
    remapped = None if mapped is None else maybe_remap_moe_expert_param_name(mapped, params)
    info = None if remapped is None else GptOssModel._get_streamed_expert_info(remapped, params)  # pylint: disable=protected-access
    out["names"][c] = {"mapped": mapped, "remapped": remapped, "is_param": remapped in params,
                       "streamed": None if info is None else [info[1].rsplit(".", 1)[1], info[2]]}
  return out


def warm() -> None:
  """Import vLLM and let its registry inspect every architecture we export (cached under VLLM_CACHE_ROOT)."""
  from vllm.config import ModelConfig  # pylint: disable=import-outside-toplevel
  base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
          "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 256, "max_position_embeddings": 32,
          "num_experts": 2, "num_local_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 64}
  with tempfile.TemporaryDirectory() as tmp:
    for arch, model_type in WARM_ARCHS.items():
      d = pathlib.Path(tmp) / model_type
      d.mkdir()
      (d / "config.json").write_text(json.dumps({**base, "architectures": [arch], "model_type": model_type}))
      ModelConfig(model=str(d), tokenizer=str(d), skip_tokenizer_init=True, dtype="bfloat16")
  print("[peers] vLLM config parsing ok:", ", ".join(WARM_ARCHS), flush=True)


def main(argv) -> None:
  if os.environ.get("VLLM_TARGET_DEVICE") != "cpu" or "vllm_site" not in os.environ.get("PYTHONPATH", ""):
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import peers_env  # pylint: disable=import-outside-toplevel
    env = {**os.environ, **peers_env.vllm_env()}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # any value disables .pyc writing; vllm_site's are written once
    os.execve(sys.executable, [sys.executable, __file__, *argv], env)
  if argv == ["--warm"]:
    warm()
    return
  if argv[:1] == ["--gpt-oss-routes"]:
    pathlib.Path(argv[1]).write_text(json.dumps(gpt_oss_routes(), indent=1))
    return
  jobs_path, out_path = argv
  import transformers  # pylint: disable=import-outside-toplevel
  import compressed_tensors  # pylint: disable=import-outside-toplevel
  import vllm  # pylint: disable=import-outside-toplevel
  versions = {"vllm": vllm.__version__, "transformers": transformers.__version__,
              "compressed_tensors": compressed_tensors.__version__}
  port, out = _free_port(), {}
  for job in json.loads(pathlib.Path(jobs_path).read_text()):
    out[job["name"]] = {**parse(job["dir"], port), "versions": versions}
    print(json.dumps({"name": job["name"], "error": out[job["name"]]["error"]}), flush=True)
  pathlib.Path(out_path).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
  main(sys.argv[1:])
