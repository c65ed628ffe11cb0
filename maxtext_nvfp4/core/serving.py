"""NVFP4 serving tensors (ModelOpt's unified HF checkpoint, what vLLM / SGLang / TensorRT-LLM load) and the
serving modes of ``eval-quantized``. Pure math: no MaxText, no file I/O. The reference forward in HF's
layout is :mod:`maxtext_nvfp4.core.hf_forward`; the two checkpoint formats' names and JSON are
:mod:`maxtext_nvfp4.core.serving_formats`.

Per quantized linear ``W`` (HF layout ``[out, in]``; sources and commits in docs/export.md):

    t              = nvfp4.quantize(W, axis=-1)          1x16 blocks along the input dim, RNE, no RHT
    weight         = nvfp4.pack(t.data)                  uint8 [out, in/2]; element 2i in the low nibble,
                                                         code = sign << 3 | index into (0,.5,1,1.5,2,3,4,6)
    weight_scale   = t.scale                             float8_e4m3fn [out, in/16], row-major (unswizzled)
    weight_scale_2 = amax(W) / 2688                      float32 scalar (= nvfp4.global_decode_scale(t))
    input_scale    = amax(activation into W) / 2688      float32 scalar (calibration)

    decoded W      = e2m1(weight nibble) * (float(weight_scale) * weight_scale_2)      (fp32, this order)

which is bit for bit :func:`maxtext_nvfp4.core.nvfp4.dequantize` of ``t``: the exported weights are TE's
NVFP4 quantization of ``W``. Linears that serving engines fuse (q/k/v -> qkv_proj, gate/up ->
gate_up_proj) must share ``weight_scale_2`` and ``input_scale`` (vLLM keeps one global scale per fused
layer, the max, and only warns otherwise; ModelOpt's export equalizes them the same way), so a fused
group is quantized as one tensor: ``quantize(concat(W_q, W_k, W_v))`` split back by rows -- exact,
because 1x16 blocks never cross rows, and equal to what TE computes for the fused weight.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from maxtext_nvfp4.core import fp8
from maxtext_nvfp4.core import hf_forward
from maxtext_nvfp4.core import nvfp4

GROUP_SIZE = nvfp4.BLOCK  # 16: ModelOpt's group_size / vLLM's NVFP4 group size
# HF projections that serving engines fuse into one GEMM (they share one input and one global scale):
# attention q/k/v (qkv_proj), the MLP's or an expert's gate/up (gate_up_proj; Mixtral's experts: w1/w3 = w13)
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"),
                ("q_a_proj", "kv_a_proj_with_mqa"))  # MLA: vLLM's fused_qkv_a_proj (DeepSeek with q_lora)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServingLinear:
  """One linear in ModelOpt's NVFP4 tensors (numpy, the dtypes written to safetensors)."""

  # uint8 [out, in/2]: two E2M1 codes per byte, element 2i in the low nibble
  weight: np.ndarray
  # float8_e4m3fn [out, in/16]: block decode scales, row-major (engines swizzle at load)
  weight_scale: np.ndarray
  # float32 scalar: amax / 2688 of the (fused) weight
  weight_scale_2: np.ndarray


def _quantize_rows(weights):
  """TE's 1x16 NVFP4 of the row concatenation of ``weights`` and the row offsets splitting it back."""
  t = nvfp4.quantize(jnp.asarray(np.concatenate([np.asarray(w, np.float32) for w in weights], axis=0)), axis=-1)
  return t, np.cumsum([w.shape[0] for w in weights])[:-1]


def quantize_linears(weights: list[np.ndarray]) -> list[ServingLinear]:
  """ModelOpt NVFP4 tensors of HF-layout ``[out, in]`` weights that share one global scale.

  One weight: TE's 1x16 NVFP4 of it. Several (a fused group): TE's NVFP4 of their row concatenation,
  split back (exact: blocks never cross rows). Raises ValueError when ``in`` is not a multiple of 16.
  """
  t, cuts = _quantize_rows(weights)
  packed = np.asarray(nvfp4.pack(t.data))
  scale = np.asarray(t.scale)
  ws2 = np.asarray(nvfp4.global_decode_scale(t), np.float32)
  return [ServingLinear(weight=p, weight_scale=s, weight_scale_2=ws2)
          for p, s in zip(np.split(packed, cuts), np.split(scale, cuts))]


def input_scale(amax) -> np.ndarray:
  """ModelOpt's activation global scale ``amax / (6 * 448)`` (fp32; vLLM quantizes with its inverse)."""
  return np.asarray(np.float32(amax) / np.float32(nvfp4.global_denominator()), np.float32)


def linear_units(names: list[str]) -> list[list[str]]:
  """HF linear names grouped into what engines run as one GEMM (fused groups), in first-seen order."""
  units, seen = [], set()
  for name in names:
    if name in seen:
      continue
    prefix, leaf = name.rsplit(".", 1)
    group = next((g for g in FUSED_GROUPS if leaf in g), (leaf,))
    unit = [f"{prefix}.{g}" for g in group]
    seen.update(unit)
    units.append(unit)
  return units


# ----------------------------------------------------------------------------------------------
# Serving modes: what a linear's GEMM sees (forward only)
# ----------------------------------------------------------------------------------------------
# mode -> (weights, activations):
#   bf16         bf16 weights, bf16 activations
#   nvfp4-w4a16  NVFP4 weights (1x16 along the input dim, fused groups share the global scale), bf16 acts
#   nvfp4-w4a4   NVFP4 weights as above; activations NVFP4 per token on the fly (each token row its own
#                global scale from its amax, 1x16 E4M3 block scales along K)
#   fp8          FP8 E4M3 per-tensor current scaling for weights (per fused group) and activations
SERVING_MODES = ("bf16", "nvfp4-w4a16", "nvfp4-w4a4", "fp8")


def _bf16(x):
  return jnp.asarray(x, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)


def served_weights(tensors: dict, names: list[str], mode: str) -> dict:
  """``tensors`` with the weights of ``names`` replaced (fp32) by what the GEMM multiplies in ``mode``."""
  if mode not in SERVING_MODES:
    raise ValueError(f"unknown serving mode {mode!r}; choose one of {', '.join(SERVING_MODES)}")
  out = dict(tensors)
  for unit in linear_units(names):
    ws = [np.asarray(tensors[n + ".weight"], np.float32) for n in unit]
    if mode == "bf16":
      vals = [np.asarray(_bf16(w)) for w in ws]
    elif mode in ("nvfp4-w4a16", "nvfp4-w4a4"):  # exactly what the export decodes to
      t, cuts = _quantize_rows(ws)
      vals = np.split(np.asarray(nvfp4.dequantize(t)), cuts)
    elif mode == "fp8":
      deq = np.asarray(fp8.dequantize(fp8.quantize(jnp.asarray(np.concatenate(ws, axis=0)), "e4m3")))
      vals = np.split(deq, np.cumsum([w.shape[0] for w in ws])[:-1])
    out.update({n + ".weight": v for n, v in zip(unit, vals)})
  return out


def served_activations(mode: str):
  """``x -> x as the GEMM sees it`` (fp32 values) for ``mode``."""
  if mode in ("bf16", "nvfp4-w4a16"):
    return _bf16
  if mode == "nvfp4-w4a4":
    def per_token(x):
      rows = x.reshape(-1, x.shape[-1])
      deq = jax.vmap(lambda r: nvfp4.dequantize(nvfp4.quantize(r[None], axis=-1))[0])(rows)
      return deq.reshape(x.shape)
    return per_token
  if mode == "fp8":
    return lambda x: fp8.dequantize(fp8.quantize(x, "e4m3"))
  raise ValueError(f"unknown serving mode {mode!r}; choose one of {', '.join(SERVING_MODES)}")


def token_losses(logits, targets, mask):
  """``(sum of next-token cross-entropy over mask, number of masked tokens)``: MaxText's eval loss is
  their ratio (``targets_segmentation != 0`` as the mask)."""
  logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, jnp.asarray(targets)[..., None], axis=-1)[..., 0]
  m = (jnp.asarray(mask) != 0).astype(jnp.float32)
  return jnp.sum(nll * m), jnp.sum(m)


# The reference forward lives in core/hf_forward.py (every exported family); the Llama names stay here.
LlamaShape = hf_forward.DecoderShape
llama_forward = hf_forward.decoder_forward
