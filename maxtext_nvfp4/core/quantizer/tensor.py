"""The quantized tensor, TE's byte layout, and the ways back to numbers:

    dequantize               x_hat = float(q) * (float(s8) * (amax / (6 * bound)))           TE JAX's order
    dequantize_kernel_order  x_hat = fl(q * fl(fl(s8 * amax) * fl(1 / (6 * bound))))          TE's CUDA kernel
    block_values             q * s8                          (exact in bf16: at most 6 significant bits)
    global_decode_scale      amax / (6 * bound)              (the GEMM's per-operand factor)
    pack / unpack            E2M1 codes two per byte, element 2i in the low nibble (TE's fp4x2)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from maxtext_nvfp4.core import formats
from maxtext_nvfp4.core.formats import E2M1
from maxtext_nvfp4.core.quantizer.formulas import BLOCK, E4M3_MAX, RECIP_GLOBAL_DENOMINATOR, global_denominator

# E2M1 value of each 4-bit code (bit 3 sign, bits 0-2 magnitude index): the decode table of float4_e2m1fn.
_E2M1_TABLE = np.concatenate([formats.grid(E2M1), -formats.grid(E2M1)])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
  """A quantized NVFP4 tensor (TE's data / scale_inv / amax triple).

  data:     ``float4_e2m1fn``, same shape and layout as the input.
  scale:    ``float8_e4m3fn`` block decode scales; the block axis (both last axes for 2D) divided by 16.
  amax:     fp32: the amax that sets the global scale (post-RHT when ``rht``): a scalar, or for a
            row-scaled tensor one per row (``data``'s shape with ``axis`` reduced to 1).
  axis:     the 1x16 block axis (non-negative), or None for 16x16 tiles over the last two axes.
  block_2d: True for 16x16 tiles.
  rht:      True when the values are in the RHT domain along ``axis``.
  e4m3_bound: the E4M3 bound of the global scale (448; 256 for TE's 4over6 variant): the global
            decode scale is ``amax / (6 * e4m3_bound)``.
  """

  data: jax.Array
  scale: jax.Array
  amax: jax.Array
  axis: int | None = dataclasses.field(default=None, metadata=dict(static=True))
  block_2d: bool = dataclasses.field(default=False, metadata=dict(static=True))
  rht: bool = dataclasses.field(default=False, metadata=dict(static=True))
  e4m3_bound: int = dataclasses.field(default=448, metadata=dict(static=True))

  @property
  def shape(self):
    return self.data.shape

  def pack(self):
    return pack(self.data)


# ----------------------------------------------------------------------------------------------
# Dequantization and GEMM-side views
# ----------------------------------------------------------------------------------------------
def _expand_scale(t: NVFP4Tensor, s):
  if t.block_2d:
    return jnp.repeat(jnp.repeat(s, BLOCK, axis=-2), BLOCK, axis=-1)
  return jnp.repeat(s, BLOCK, axis=t.axis)


def global_decode_scale(t, e4m3_bound: int = E4M3_MAX):
  """``amax / (6 * e4m3_bound)`` in fp32 (``amax / 2688`` for TE's standard bound): TE JAX's per-operand
  GEMM factor (``alpha`` is the product of two).

  ``t``: an NVFP4Tensor (its own bound is used), or its amax (as returned by ``quantize_values``).
  """
  if isinstance(t, NVFP4Tensor):
    amax, e4m3_bound = t.amax, t.e4m3_bound
  else:
    amax = jnp.asarray(t, jnp.float32)
  # The true IEEE quotient. Not ``amax / 2688``: XLA's algebraic simplifier rewrites a division by a
  # constant as ``x * fl(1/constant)`` (1 ulp off for amax = 4.125), and XLA:GPU's division is itself
  # 1 ulp off for about a quarter of all quotients.
  return formats.div_rn(amax, np.float32(global_denominator(e4m3_bound)))


def block_values(t: NVFP4Tensor, dtype=jnp.bfloat16):
  """``q * s8`` expanded to the data's shape, without the global scale.

  Exact in bf16: an E2M1 value (2 significant bits) times an E4M3 scale (4 bits) has at most 6
  significant bits and lies in [2**-10, 2688]. Feeding these to an ordinary GEMM with fp32 accumulation
  and multiplying the result by ``global_decode_scale(a) * global_decode_scale(b)`` is the Tensor-Core
  NVFP4 GEMM up to accumulation order.
  """
  if _blocked_view(t) is None:
    return _block_values_repeat(t, dtype)
  return lax.platform_dependent(t, tpu=lambda t: _block_values_blocked(t, dtype),
                                default=lambda t: _block_values_repeat(t, dtype))


def _block_values_repeat(t: NVFP4Tensor, dtype):
  v = t.data.astype(jnp.float32) * _expand_scale(t, t.scale.astype(jnp.float32))
  return v.astype(dtype)


def _blocked_view(t: NVFP4Tensor):
  """(K, N) of a 2D tensor whose blocks run along axis 0 (16x16 tiles, or 1x16 along axis 0), else None."""
  if t.data.ndim != 2 or not (t.block_2d or t.axis == 0) or t.data.shape[0] % BLOCK:
    return None
  return t.data.shape


def _block_values_blocked(t: NVFP4Tensor, dtype):
  """:func:`block_values` on a TPU: the data as (K/16, 16, N), each block row's scales broadcast over its 16 rows
  along the sublanes (a (..., 16) minor dimension would pad to 128 lanes on XLA:TPU), the same products."""
  k, n = _blocked_view(t)
  s = t.scale.astype(jnp.float32)
  if t.block_2d:
    s = jnp.repeat(s, BLOCK, axis=-1)  # (K/16, N): the lane expansion on 1/16 of the data
  v = t.data.astype(jnp.float32).reshape(k // BLOCK, BLOCK, n) * s[:, None, :]
  return v.reshape(k, n).astype(dtype)


@jax.jit(static_argnames=("dtype",))
def dequantize(t: NVFP4Tensor, dtype=jnp.float32):
  """TE JAX's dequantizer: ``float(q) * (float(s8) * (amax / 2688))``, in that order, cast to ``dtype``.

  Values stay in the RHT domain when ``t.rht`` (TE applies the inverse RHT separately; for a GEMM the
  two RHTs cancel, H being orthogonal). Exact in fp32 except where ``amax / 2688`` or the products fall
  in the fp32 subnormal range on a flush-to-zero backend (tensors with amax below ~1e-34). Bit-exact with
  TE JAX's under jit.
  """
  gds = global_decode_scale(t)
  if jnp.ndim(gds):  # row-scaled: one factor per row, broadcast over that row's blocks
    return (t.data.astype(jnp.float32) * (_expand_scale(t, t.scale.astype(jnp.float32)) * gds)).astype(dtype)
  g = _expand_scale(t, t.scale.astype(jnp.float32) * gds)
  return (t.data.astype(jnp.float32) * g).astype(dtype)


@jax.jit(static_argnames=("dtype",))
def dequantize_kernel_order(t: NVFP4Tensor, dtype=jnp.bfloat16):
  """TE's CUDA dequantize kernel (what TE PyTorch's ``backward_override="dequantized"`` feeds its backward
  GEMMs): ``fl(q * fl(fl(s8 * amax) * fl(1 / (6 * e4m3_bound))))``, cast to ``dtype``.

  ``transformer_engine/common/cast/nvfp4/dequantize_nvfp4.cuh`` (and the 4over6 group kernel, whose
  ``factor_inv = 1.0f / (6.0f * E4M3_MAX)`` takes the tensor's bound). Not :func:`dequantize`'s order
  (TE JAX's). Row-scaled: each row with its own amax.
  """
  inv = RECIP_GLOBAL_DENOMINATOR[t.e4m3_bound]  # a constant, rounded once
  s = t.scale.astype(jnp.float32)
  amax = jnp.asarray(t.amax, jnp.float32)
  if jnp.ndim(amax):  # row-scaled: expand the scales first, then one factor per row
    final = (_expand_scale(t, s) * amax) * inv
  else:
    final = _expand_scale(t, (s * amax) * inv)
  return (t.data.astype(jnp.float32) * final).astype(dtype)


# ----------------------------------------------------------------------------------------------
# TE byte layout
# ----------------------------------------------------------------------------------------------
def _e2m1_codes(data):
  """uint8 codes (bit 3 sign, bits 0-2 magnitude index) of E2M1 values."""
  v = data.astype(jnp.float32)
  idx = formats.grid_index(jnp.abs(v), E2M1).astype(jnp.uint8)
  sign = jnp.signbit(v).astype(jnp.uint8)
  return idx | (sign << 3)


def codes_to_e2m1(codes):
  """uint8 codes (bit 3 sign, bits 0-2 magnitude index) -> ``float4_e2m1fn``, bit for bit.

  Not a convert: XLA:CPU converts f32 -> f4 in software, an order of magnitude slower than the rest of the
  quantizer. Packing the 4-bit codes two per byte and bitcasting uint8 -> f4 (XLA splits a byte low nibble
  first: even element in the low nibble, as TE's fp4x2) is exact. The pair is combined as a tiny reduction
  (``c0 * 1 + c1 * 16``): strided ``[..., 0]``/``[..., 1]`` slices of a fused producer are several times
  slower on XLA:CPU. Odd last dimensions fall back to the convert.
  """
  if codes.shape[-1] % 2:
    return jnp.asarray(_E2M1_TABLE)[codes.astype(jnp.int32)].astype(jnp.float4_e2m1fn)
  return lax.bitcast_convert_type(_pack_codes(codes), jnp.float4_e2m1fn).reshape(codes.shape)


def _pack_codes(codes):
  """uint8 4-bit codes (..., n) -> bytes (..., n/2), element 2i in the low nibble."""
  pairs = codes.reshape(codes.shape[:-1] + (codes.shape[-1] // 2, 2))
  return (pairs * jnp.array([1, 16], jnp.uint8)).sum(axis=-1, dtype=jnp.uint8)


def pack(data) -> jax.Array:
  """Pack E2M1 values two per uint8 along the last axis (TE's fp4x2: element 2i in the low nibble)."""
  codes = _e2m1_codes(jnp.asarray(data))
  if codes.shape[-1] % 2:
    raise ValueError(f"pack needs an even last dimension, got shape {codes.shape}")
  return _pack_codes(codes)


@jax.jit
def unpack(packed) -> jax.Array:
  """Inverse of :func:`pack`: uint8 (..., n/2) -> ``float4_e2m1fn`` (..., n)."""
  packed = jnp.asarray(packed, jnp.uint8)
  codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[:-1] + (packed.shape[-1] * 2,))
  return jnp.asarray(_E2M1_TABLE)[codes.astype(jnp.int32)].astype(jnp.float4_e2m1fn)


def as_numpy(t: NVFP4Tensor) -> dict[str, Any]:
  """fp32 numpy copies of data, scale and amax (for comparisons and serialization)."""
  return dict(
      data=np.asarray(t.data.astype(jnp.float32)),
      scale=np.asarray(t.scale.astype(jnp.float32)),
      amax=np.float32(t.amax),
  )
