"""Peer side of the vLLM config oracle: vLLM 0.33.0's own config parsing and per-layer quantization dispatch of
our exports, on CPU (vLLM has no CPU NVFP4 kernel; nothing here runs a GEMM or loads an export's weight; only
``--gpt-oss-routes`` loads tiny made-up tensors, through vLLM's gpt_oss loader).

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


def _gpt_oss_candidates(prefix: str, num_experts: int, hidden: int, inter: int) -> dict:
  """``{checkpoint name: shape}`` of every expert tensor an NVFP4 export of gpt_oss could write: vLLM's own
  per-expert (the streamed table's form) and fused ``w13`` / ``w2`` names with each format's leaves, HF's fused
  ``gate_up_proj`` / ``down_proj`` in ModelOpt's (``<name>_weight_scale_2``, ModelOpt 0.47's GptOssExperts export)
  and quark's dotted forms, and the other MoE families' per-expert ``gate_proj`` / ``up_proj`` / ``down_proj``.
  Shapes: packed weights [out, in / 2], block scales [out, in / 16], per-expert scales [1] (compressed-tensors
  writes [1]) -- per expert; fused ones with a leading [E] (w13's per-tensor scales [E, 2], vLLM's own layout)."""
  e = num_experts
  rows = {"w13": (2 * inter, hidden), "w2": (hidden, inter)}
  out = {}
  for w, (o, i) in rows.items():
    per = {"weight_packed": (o, i // 2), "weight": (o, i // 2), "weight_scale": (o, i // 16), "bias": (o,),
           "weight_global_scale": (1,), "input_global_scale": (1,), "weight_scale_2": (1,), "input_scale": (1,)}
    two = (e, 2) if w == "w13" else (e,)
    fused = {**{k: (e, *v) for k, v in per.items()}, "weight_global_scale": two, "input_global_scale": two,
             "weight_scale_2": two, "input_scale": two}
    out.update({f"{prefix}0.{w}_{k}": v for k, v in per.items()})
    out.update({f"{prefix}{w}_{k}": v for k, v in fused.items()})
  for hf, w in (("gate_up_proj", "w13"), ("down_proj", "w2")):
    o, i = rows[w]
    out[f"{prefix}{hf}"] = (e, i // 2, o)  # HF's [E, in, out] layout, packed along in
    out[f"{prefix}{hf}_bias"] = (e, o)
    for leaf, shape in (("weight_scale", (e, i // 16, o)), ("weight_scale_2", (e,)), ("input_scale", (e,))):
      out[f"{prefix}{hf}_{leaf}"] = shape
      out[f"{prefix}{hf}.{leaf}"] = shape
  for g, w in (("gate_proj", "w13"), ("up_proj", "w13"), ("down_proj", "w2")):
    o, i = rows[w]
    o = o // 2 if w == "w13" else o
    for leaf, shape in (("weight_packed", (o, i // 2)), ("weight", (o, i // 2)), ("weight_scale", (o, i // 16)),
                        ("weight_global_scale", (1,)), ("input_global_scale", (1,)), ("weight_scale_2", (1,)),
                        ("input_scale", (1,))):
      out[f"{prefix}0.{g}.{leaf}"] = shape
  return out


def gpt_oss_routes() -> dict:
  """What vLLM 0.33.0's gpt_oss loader (``models/gpt_oss.py``) does with each expert tensor an NVFP4 export could
  write (``_gpt_oss_candidates``), for both NVFP4 MoE methods: the real ``create_weights`` of
  ``CompressedTensorsW4A4Nvfp4MoEMethod`` / ``ModelOptNvFp4FusedMoE`` builds the parameters of one gpt_oss expert
  layer (2 experts, hidden 64, intermediate 32) under ``model.layers.0.mlp.experts.routed_experts.`` (their
  ``__init__``, which asks for a CUDA MoE kernel, is skipped; ModelOpt's parameters need a world-size-1 process
  group), with ``GptOssRoutedExperts.weight_loader`` as their loader (on a stand-in holding what it reads: rank 0,
  the method, experts mapped to themselves). Per candidate, as ``GptOssForCausalLM.load_weights`` does:
  ``hf_to_vllm_mapper``, then ``GptOssModel._load_weights_other`` (which applies
  ``maybe_remap_moe_expert_param_name`` and tries ``_try_load_streamed_expert`` first) on that one tensor, the
  parameters filled with a sentinel beforehand. Returns ``{"params": {format: [parameter names]}, "names":
  {format: {candidate: {"mapped", "streamed": [parameter, shard] or None, "filled": [parameters it changed],
  "error": "Type: message" or None}}}}``."""
  import functools  # pylint: disable=import-outside-toplevel
  import types  # pylint: disable=import-outside-toplevel
  import torch  # pylint: disable=import-outside-toplevel
  from vllm.config import VllmConfig, set_current_vllm_config  # pylint: disable=import-outside-toplevel
  from vllm.distributed import parallel_state  # pylint: disable=import-outside-toplevel
  from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (  # pylint: disable=import-outside-toplevel
      compressed_tensors_moe_w4a4_nvfp4 as ct_moe)
  from vllm.model_executor.layers.quantization import modelopt  # pylint: disable=import-outside-toplevel
  from vllm.model_executor.model_loader.weight_utils import maybe_remap_moe_expert_param_name  # pylint: disable=import-outside-toplevel
  from vllm.model_executor.models import gpt_oss  # pylint: disable=import-outside-toplevel

  with set_current_vllm_config(VllmConfig()):
    parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                                distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
    parallel_state.initialize_model_parallel(1, 1)
  num_experts, hidden, inter = 2, 64, 32
  moe = types.SimpleNamespace(is_act_and_mul=True)
  ct = object.__new__(ct_moe.CompressedTensorsW4A4Nvfp4MoEMethod)
  ct.moe, ct.group_size = moe, 16
  mo = object.__new__(modelopt.ModelOptNvFp4FusedMoE)
  mo.moe, mo.use_global_sf = moe, False
  mo.quant_config = types.SimpleNamespace(is_checkpoint_nvfp4_serialized=True, group_size=16)
  prefix = "model.layers.0.mlp.experts."
  candidates = _gpt_oss_candidates(prefix, num_experts, hidden, inter)
  stacked = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v")]
  out = {"params": {}, "names": {}}
  for fmt, method in (("compressed-tensors", ct), ("modelopt", mo)):
    R = gpt_oss.GptOssRoutedExperts  # pylint: disable=invalid-name
    experts = types.SimpleNamespace(
        moe_config=types.SimpleNamespace(moe_parallel_config=types.SimpleNamespace(tp_rank=0)), quant_method=method,
        _map_global_expert_id_to_local_expert_id=lambda e: e, _narrow_for_rank=R._narrow_for_rank,  # pylint: disable=protected-access
        _copy_to_expert=R._copy_to_expert)  # pylint: disable=protected-access
    for f in ("_load_expert_bias", "_load_unquantized_expert", "_load_packed_expert"):
      setattr(experts, f, functools.partial(getattr(R, f), experts))
    layer = torch.nn.Module()
    method.create_weights(layer, num_experts=num_experts, hidden_size=hidden, intermediate_size_per_partition=inter,
                          params_dtype=torch.bfloat16, weight_loader=functools.partial(R.weight_loader, experts),
                          global_num_experts=num_experts)
    root = torch.nn.Module()  # model.layers.0.mlp.experts.routed_experts = layer
    node = root
    for part in prefix.strip(".").split("."):
      node.add_module(part, torch.nn.Module())
      node = getattr(node, part)
    node.add_module("routed_experts", layer)
    root.parallel_config = types.SimpleNamespace(enable_expert_parallel=False)
    root.config = types.SimpleNamespace(intermediate_size=inter)
    root._try_load_streamed_expert = gpt_oss.GptOssModel._try_load_streamed_expert  # pylint: disable=protected-access
    params = dict(root.named_parameters())
    out["params"][fmt] = sorted(n for n, _ in layer.named_parameters())
    names = out["names"][fmt] = {}
    for name, shape in candidates.items():
      with torch.no_grad():
        for p in params.values():
          p.data.fill_(7 if p.dtype == torch.uint8 else -1.0)
        before = {n: p.detach().clone() for n, p in params.items()}
      mapped = gpt_oss.GptOssForCausalLM.hf_to_vllm_mapper._map_name(name)  # pylint: disable=protected-access
      rec = {"mapped": mapped, "streamed": None, "filled": [], "error": None}
      if mapped is not None:
        info = gpt_oss.GptOssModel._get_streamed_expert_info(  # pylint: disable=protected-access
            maybe_remap_moe_expert_param_name(mapped, params), params)
        rec["streamed"] = None if info is None else [info[1].rsplit(".", 1)[1], info[2]]
        tensor = torch.full(shape, 3, dtype=torch.uint8) if "weight_packed" in name or name.endswith(
            ("_weight", "proj", ".weight")) else torch.full(shape, 2.0)
        try:
          with torch.no_grad():
            gpt_oss.GptOssModel._load_weights_other(root, num_experts, 0, [(mapped, tensor)], stacked)  # pylint: disable=protected-access
        except Exception as e:  # pylint: disable=broad-exception-caught
          rec["error"] = _one_line(e)
        rec["filled"] = sorted(n.rsplit(".", 1)[1] for n, p in params.items() if not torch.equal(p, before[n]))
      names[name] = rec
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
