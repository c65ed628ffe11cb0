"""The two NVFP4 checkpoint formats an export writes, from the same quantized tensors (pure: names, values, JSON).

Per quantized linear ``<n>`` with :class:`maxtext_nvfp4.core.serving.ServingLinear` ``(weight, weight_scale,
weight_scale_2)`` and, for W4A4, the calibrated ``input_scale = amax / 2688``:

  format               tensors (dtype)                                        config.json quantization_config
  modelopt             <n>.weight (uint8 [out, in/2])                         quant_method "modelopt",
  (ModelOpt unified    <n>.weight_scale (float8_e4m3fn [out, in/16])          quant_algo "NVFP4" (W4A4) or
   HF checkpoint)      <n>.weight_scale_2 (float32 [])                        "W4A16_NVFP4" (weights only),
                       <n>.input_scale (float32 [], W4A4 only)                + hf_quant_config.json
  compressed-tensors   <n>.weight_packed (uint8, = weight)                    quant_method "compressed-tensors",
  (nvfp4-pack-         <n>.weight_scale (float8_e4m3fn, = weight_scale)       format "nvfp4-pack-quantized",
   quantized)          <n>.weight_global_scale (float32 [], 1 / weight_scale_2)   scheme NVFP4 or NVFP4A16
                       <n>.input_global_scale (float32 [1], 1 / input_scale; W4A4 only)

The compressed-tensors names and reciprocals are exactly what compressed-tensors' own converter
(``entrypoints/convert/converters/modelopt_nvfp4.py``, ``ModelOptNvfp4Converter.process``: ``1 / x`` in
fp32) makes of the ModelOpt tensors, the global scales shaped ``[1]`` as compressed-tensors' own writer
shapes them (the converter keeps ModelOpt's ``[]``; transformers' dequantization of ``[]``-shaped global
scales rounds 1 bf16 ulp differently in ~15% of the weights, measured, while ``[1]`` gives the bf16 of our
decode bit for bit); its config is that converter's ``QuantizationConfig.model_dump()`` (compressed-tensors
0.20.1). ModelOpt's producer name must be ``modelopt``: vLLM and TensorRT-LLM apply
``hf_quant_config.json`` only for that producer (``exporter`` says who wrote it).
"""

from __future__ import annotations

import numpy as np

FORMATS = ("modelopt", "compressed-tensors")
GROUP_SIZE = 16
# the compressed-tensors release whose layout and config this follows (its "version" key)
COMPRESSED_TENSORS_VERSION = "0.20.1"
# ModelOpt's per-tensor fields; the compressed-tensors names of the same values
MODELOPT_FIELDS = ("weight", "weight_scale", "weight_scale_2", "input_scale")


def linear_tensors(fmt: str, name: str, weight, weight_scale, weight_scale_2, input_scale=None) -> dict:
  """``{tensor name: numpy array}`` of one quantized linear ``name`` in format ``fmt`` (module docstring).
  ``input_scale`` None: weights only (no activation scale is written)."""
  ws2 = np.asarray(weight_scale_2, np.float32)
  if fmt == "modelopt":
    out = {f"{name}.weight": weight, f"{name}.weight_scale": weight_scale, f"{name}.weight_scale_2": ws2}
    if input_scale is not None:
      out[f"{name}.input_scale"] = np.asarray(input_scale, np.float32)
    return out
  if fmt == "compressed-tensors":
    out = {f"{name}.weight_packed": weight, f"{name}.weight_scale": weight_scale,
           f"{name}.weight_global_scale": np.asarray(np.float32(1) / ws2, np.float32).reshape(1)}
    if input_scale is not None:
      inv = np.float32(1) / np.asarray(input_scale, np.float32)
      out[f"{name}.input_global_scale"] = np.asarray(inv, np.float32).reshape(1)
    return out
  raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


def _ct_args(dynamic) -> dict:
  args = {"dynamic": dynamic, "group_size": GROUP_SIZE, "num_bits": 4, "scale_dtype": "torch.float8_e4m3fn",
          "strategy": "tensor_group", "symmetric": True, "type": "float"}
  if dynamic == "local":
    args["observer"] = "static_minmax"
  return args


def quantization_config(fmt: str, excluded: list[str], *, weights_only: bool, producer_version: str) -> dict:
  """config.json's ``quantization_config`` for ``fmt`` (module docstring)."""
  if fmt == "modelopt":
    group = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": GROUP_SIZE}
    cfg = {"weights": dict(group), "targets": ["Linear"]}
    if not weights_only:
      cfg["input_activations"] = dict(group)
    return {"config_groups": {"group_0": cfg}, "ignore": list(excluded),
            "quant_algo": "W4A16_NVFP4" if weights_only else "NVFP4", "producer": producer(producer_version),
            "quant_method": "modelopt"}
  if fmt == "compressed-tensors":
    group = {"format": "nvfp4-pack-quantized", "input_activations": None if weights_only else _ct_args("local"),
             "output_activations": None, "targets": ["Linear"], "weights": _ct_args(False)}
    return {"config_groups": {"config_group_0": group}, "format": "nvfp4-pack-quantized",
            "global_compression_ratio": None, "ignore": list(excluded), "kv_cache_scheme": None,
            "moe_sparsity_config": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "version": COMPRESSED_TENSORS_VERSION}
  raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


def producer(version: str) -> dict:
  """ModelOpt's producer record: name ``modelopt`` (what loaders require), the exporter named beside it."""
  return {"name": "modelopt", "version": "0.47.0", "exporter": f"maxtext-nvfp4 {version}"}


def hf_quant_config(excluded: list[str], *, weights_only: bool, producer_version: str) -> dict:
  """ModelOpt's ``hf_quant_config.json`` (the modelopt format only)."""
  return {"producer": producer(producer_version), "quantization": {
      "quant_algo": "W4A16_NVFP4" if weights_only else "NVFP4", "kv_cache_quant_algo": None,
      "group_size": GROUP_SIZE, "exclude_modules": list(excluded)}}
