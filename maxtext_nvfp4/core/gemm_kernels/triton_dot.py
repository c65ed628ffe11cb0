"""The Pallas (Triton) NVFP4 GEMM: one operand read as packed E2M1 codes and E4M3 block scales, dequantized in
registers, the other as bf16 block values::

    out[i, j] = cast( (sum_k  a[i, k] * (q[k, j] * s8[k, j]))  * alpha ,  out_dtype )    fp32 accumulation

``q * s8`` is formed per tile as ``fl32(e2m1(code) * e4m3(byte))`` and cast to bf16 -- exact (at most 6 significant
bits, ``tensor.block_values``), so the tile is the same bf16 operand ``gemm._scaled_dot`` reads from memory, and each
product of the GEMM is exact in fp32; only the order of the fp32 sums is the kernel's (Triton's ``tl.dot`` over
``block_k`` slices, slices in order). ``alpha`` (``gemm.gemm_alpha``) multiplies the fp32 accumulator once, at the end.

Operands, in their stored layouts (no transposed copy is made):

    values  bf16, (M, K) or, ``values_t``, (K, M)                         (x for fprop, dy for dgrad / wgrad)
    codes   uint4 view of the tensor's float4_e2m1fn data, (K, N) or, ``tensor_t``, (N, K)      (W, or x for wgrad)
    scales  uint8 view of its E4M3 scales: the data's shape with the block axis (both for 16x16 tiles) / 16

``values_first``: the values are the left operand (fprop, dgrad: ``values · W``); else the tensor is (wgrad:
``xᵀ · dy``). E2M1 decode: magnitude index ``m = code & 7`` -> ``0.5 m`` (m < 4), ``m - 2`` (4, 5), ``2 m - 8``
(6, 7), the sign from bit 3 by the sign bit (``formats.negate_where``: Triton's lowering negates as ``0 - x``).
E4M3 decode of a scale byte ``b``: ``e = b >> 3``, ``t = b & 7``: ``t * 2**-9`` (e = 0), ``(8 + t) * 2**(e - 10)``,
NaN for 0x7F. No gather, no float min/max.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from maxtext_nvfp4.core import formats

BLOCK = 16
# Tile caps (powers of two): a 128 x 128 output tile, K in slices of 64 -- Triton's usual bf16 Hopper/Ampere GEMM
# tile; each dimension takes the largest power of two <= its cap that divides it (at least 16: tl.dot's minimum).
_MAX_BLOCK_M = 128
_MAX_BLOCK_N = 128
_MAX_BLOCK_K = 64
_NUM_WARPS = 8
_NUM_STAGES = 3


def tile(n: int, cap: int) -> int:
  """The largest power of two <= ``cap`` that divides ``n`` (0 when that is below 16: no kernel)."""
  t = math.gcd(n, cap)
  return t if t >= BLOCK else 0


def decode_e2m1(codes):
  """int32 4-bit codes -> fp32 E2M1 values (bit 3 the sign)."""
  m = codes & 7
  mf = m.astype(jnp.float32)
  mag = jnp.where(m < 4, mf * np.float32(0.5), jnp.where(m < 6, mf - np.float32(2), mf * np.float32(2) - np.float32(8)))
  return formats.negate_where(mag, (codes & 8) != 0)


def decode_e4m3(byte):
  """int32 E4M3 bytes of non-negative scales -> fp32 (0x7F: NaN)."""
  e = (byte >> 3) & 15
  t = (byte & 7).astype(jnp.float32)
  normal = (t + np.float32(8)) * formats.pow2(jnp.maximum(e, 1) - 10)
  v = jnp.where(e == 0, t * np.float32(2.0**-9), normal)
  return jnp.where((byte & 0x7F) == 0x7F, np.float32(np.nan), v)


def _expand(s, rows: int, cols: int, row_blocks: bool, col_blocks: bool):
  """A scale tile (rows or rows/16, cols or cols/16) broadcast to the (rows, cols) elements it covers."""
  r, c = s.shape
  s4 = s.reshape(r, 1, c, 1)
  s4 = jnp.broadcast_to(s4, (r, BLOCK if row_blocks else 1, c, BLOCK if col_blocks else 1))
  return s4.reshape(rows, cols)


def _kernel(values_ref, codes_ref, scales_ref, alpha_ref, out_ref, *, block_m, block_n, block_k, k_total,
            values_t, tensor_t, values_first, scale_rows, scale_cols):
  i, j = pl.program_id(0), pl.program_id(1)
  # The values operand's free index is the output's rows when it comes first, else its columns.
  v_off = (i * block_m) if values_first else (j * block_n)
  v_size = block_m if values_first else block_n
  t_off = (j * block_n) if values_first else (i * block_m)
  t_size = block_n if values_first else block_m

  def body(kk, acc):
    k0 = pl.multiple_of(kk * block_k, block_k)
    # both operands' tiles as (K, free)
    if values_t:  # stored (K, free)
      v = values_ref[pl.ds(k0, block_k), pl.ds(v_off, v_size)]
    else:
      v = values_ref[pl.ds(v_off, v_size), pl.ds(k0, block_k)].T
    rows, cols = (t_size, block_k) if tensor_t else (block_k, t_size)
    r0, c0 = (t_off, k0) if tensor_t else (k0, t_off)
    codes = codes_ref[pl.ds(r0, rows), pl.ds(c0, cols)].astype(jnp.int32)
    sr, sc = (rows // BLOCK if scale_rows else rows), (cols // BLOCK if scale_cols else cols)
    sr0, sc0 = (r0 // BLOCK if scale_rows else r0), (c0 // BLOCK if scale_cols else c0)
    s = decode_e4m3(scales_ref[pl.ds(sr0, sr), pl.ds(sc0, sc)].astype(jnp.int32))
    w = (decode_e2m1(codes) * _expand(s, rows, cols, scale_rows, scale_cols)).astype(jnp.bfloat16)
    if tensor_t:
      w = w.T
    lhs, rhs = (v.T, w) if values_first else (w.T, v)
    return acc + jnp.dot(lhs, rhs, preferred_element_type=jnp.float32)

  acc = lax.fori_loop(0, k_total // block_k, body, jnp.zeros((block_m, block_n), jnp.float32))
  out_ref[...] = (acc * alpha_ref[0]).astype(out_ref.dtype)


def blocks(m: int, n: int, k: int) -> tuple[int, int, int] | None:
  """(block_m, block_n, block_k) of an (M, N, K) GEMM, or None when a dimension has no power-of-two tile >= 16."""
  b = (tile(m, _MAX_BLOCK_M), tile(n, _MAX_BLOCK_N), tile(k, _MAX_BLOCK_K))
  return b if all(b) else None


@functools.partial(jax.jit, static_argnames=("values_t", "tensor_t", "values_first", "scale_rows", "scale_cols",
                                             "out_dtype", "interpret"))
def dot(values, codes, scales, alpha, *, values_t: bool, tensor_t: bool, values_first: bool, scale_rows: bool,
        scale_cols: bool, out_dtype, interpret: bool = False):
  """The GEMM of the module docstring. ``codes`` uint4, ``scales`` uint8, ``alpha`` an fp32 scalar; the caller
  checked :func:`blocks` (every dimension tiles)."""
  vk, vf = (values.shape if values_t else values.shape[::-1])
  tf, tk = (codes.shape if tensor_t else codes.shape[::-1])
  assert vk == tk, (values.shape, codes.shape)
  m, n = (vf, tf) if values_first else (tf, vf)
  block_m, block_n, block_k = blocks(m, n, vk)
  kernel = functools.partial(
      _kernel, block_m=block_m, block_n=block_n, block_k=block_k, k_total=vk, values_t=values_t,
      tensor_t=tensor_t, values_first=values_first, scale_rows=scale_rows, scale_cols=scale_cols)
  whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,) * a.ndim)  # noqa: E731
  alpha = jnp.reshape(jnp.asarray(alpha, jnp.float32), (1,))
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(m // block_m, n // block_n),
      in_specs=[whole(values), whole(codes), whole(scales), whole(alpha)],
      out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
      compiler_params=pl_triton.CompilerParams(num_warps=_NUM_WARPS, num_stages=_NUM_STAGES),
      interpret=interpret,
      name="nvfp4_dequant_dot",
  )(values, codes, scales, alpha)
