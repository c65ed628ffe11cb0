"""NVFP4 serving format (ModelOpt's unified HF checkpoint, what vLLM / SGLang / TensorRT-LLM load) and a
reference Llama forward in Hugging Face's layout. Pure math: no MaxText, no file I/O.

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
from maxtext_nvfp4.core import nvfp4

GROUP_SIZE = nvfp4.BLOCK  # 16: ModelOpt's group_size / vLLM's NVFP4 group size
# HF projections that serving engines fuse into one GEMM (they share one input and one global scale).
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


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
  return np.asarray(np.float32(amax) / np.float32(nvfp4.GLOBAL_DENOM), np.float32)


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


# ----------------------------------------------------------------------------------------------
# Reference Llama forward in Hugging Face's layout (modeling_llama's order of operations)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaShape:
  """The HF ``LlamaConfig`` fields the forward needs."""

  # decoder layers
  num_layers: int
  # query heads / key-value heads / per-head dim
  num_heads: int
  num_kv_heads: int
  head_dim: int
  # RMSNorm epsilon and RoPE base (rope_theta; default RoPE only)
  rms_norm_eps: float
  rope_theta: float


def _rms_norm(x, w, eps):
  var = jnp.mean(x * x, axis=-1, keepdims=True)
  return w * (x * jax.lax.rsqrt(var + eps))


def _rope(x, positions, theta):
  """HF's default RoPE on ``[B, T, H, D]``: ``x * cos + rotate_half(x) * sin``, halves layout."""
  d = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  freqs = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, D/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  x1, x2 = x[..., : d // 2], x[..., d // 2 :]
  return x * jnp.cos(emb) + jnp.concatenate([-x2, x1], axis=-1) * jnp.sin(emb)


def llama_forward(weights: dict, shape: LlamaShape, tokens, positions=None, segment_ids=None, act=None,
                  served: frozenset = frozenset()):
  """``(logits [B, T, V], {linear name: amax of its input})`` of an HF-layout Llama in fp32.

  ``weights``: HF state-dict names -> ``[out, in]`` arrays (``lm_head.weight`` absent = tied embeddings).
  ``segment_ids``: packed sequences attend within their segment only (0 = padding); None = one segment.
  The amax dict is what a calibration pass records (every linear's input, fused groups separately).
  ``act``: applied to the inputs of the linears named in ``served`` (see :func:`served_activations`).
  """
  w = {k: jnp.asarray(v, jnp.float32) for k, v in weights.items()}
  tokens = jnp.asarray(tokens)
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t), (b, t)) if positions is None else jnp.asarray(positions)
  seg = jnp.ones((b, t), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids)
  mask = (jnp.tril(jnp.ones((t, t), bool))[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0))
  amax = {}

  def linear(name, x):
    amax[name] = jnp.max(jnp.abs(x))
    return (act(x) if act is not None and name in served else x) @ w[name + ".weight"].T

  h = w["model.embed_tokens.weight"][tokens]
  nh, nkv, hd = shape.num_heads, shape.num_kv_heads, shape.head_dim
  for i in range(shape.num_layers):
    p = f"model.layers.{i}."
    x = _rms_norm(h, w[p + "input_layernorm.weight"], shape.rms_norm_eps)
    q = linear(p + "self_attn.q_proj", x).reshape(b, t, nh, hd)
    k = linear(p + "self_attn.k_proj", x).reshape(b, t, nkv, hd)
    v = linear(p + "self_attn.v_proj", x).reshape(b, t, nkv, hd)
    q, k = _rope(q, positions, shape.rope_theta), _rope(k, positions, shape.rope_theta)
    k, v = jnp.repeat(k, nh // nkv, axis=2), jnp.repeat(v, nh // nkv, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.float32(np.sqrt(hd))
    scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v).reshape(b, t, nh * hd)
    h = h + linear(p + "self_attn.o_proj", o)
    x = _rms_norm(h, w[p + "post_attention_layernorm.weight"], shape.rms_norm_eps)
    gate, up = linear(p + "mlp.gate_proj", x), linear(p + "mlp.up_proj", x)
    h = h + linear(p + "mlp.down_proj", jax.nn.silu(gate) * up)
  h = _rms_norm(h, w["model.norm.weight"], shape.rms_norm_eps)
  head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
  return h @ head.T, amax
