"""The Pallas (Triton) NVFP4 GEMM: an operand read as packed E2M1 codes and E4M3 block scales is dequantized in
registers, an operand of bf16 block values is read as it is::

    out[i, j] = cast( (sum_k  a[i, k] * (q[k, j] * s8[k, j]))  * alpha ,  out_dtype )    fp32 accumulation

``q * s8`` is formed per tile as ``fl32(e2m1(code) * e4m3(byte))`` and cast to bf16 -- exact (at most 6 significant
bits, ``tensor.block_values``), so the tile is the same bf16 operand ``gemm._scaled_dot`` reads from memory, and each
product of the GEMM is exact in fp32; only the order of the fp32 sums is the kernel's (Triton's ``tl.dot`` over
``block_k`` slices, slices in order). ``alpha`` (``gemm.gemm_alpha``) multiplies the fp32 accumulator once, at the end.

Operands, each in its stored layout (no transposed copy is made; :class:`Operand`): a 2D array contracted along
its axis 0 or 1, either bf16 block values (``quantize_values``' output: x for fprop, dy for dgrad / wgrad) or an
NVFP4Tensor as its uint4 view of the float4_e2m1fn data and the uint8 view of its E4M3 scales (the data's shape
with the block axis -- both, for 16x16 tiles -- divided by 16): W for fprop / dgrad, x's copy for wgrad, or both
operands. ``gemm`` passes one of each today (its single-use operands are block values).
E2M1 decode: magnitude index ``m = code & 7`` -> ``0.5 m`` (m < 4), ``m - 2`` (4, 5), ``2 m - 8``
(6, 7), the sign from bit 3 by the sign bit (``formats.negate_where``: Triton's lowering negates as ``0 - x``).
E4M3 decode of a scale byte ``b``: ``e = b >> 3``, ``t = b & 7``: ``t * 2**-9`` (e = 0), ``(8 + t) * 2**(e - 10)``,
NaN for 0x7F. No gather, no float min/max.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Operand:
  """How one operand is stored (static: part of the kernel's trace)."""

  # True: packed E2M1 codes (uint4) + E4M3 scale bytes (uint8); False: bf16 values
  quantized: bool
  # the contraction axis of the stored 2D array: 0 (stored (K, free)) or 1 (stored (free, K))
  contract_axis: int
  # quantized: the scales run in 16-element blocks along the stored rows / columns (both: 16x16 tiles)
  scale_rows: bool = False
  scale_cols: bool = False


def _tile(refs, op: Operand, off, size: int, k0, block_k: int):
  """The operand's (block_k, size) tile at (k0, off) as bf16 (K, free), dequantized in registers when quantized."""
  k_major = op.contract_axis == 0
  rows, cols = (block_k, size) if k_major else (size, block_k)
  r0, c0 = (k0, off) if k_major else (off, k0)
  if op.quantized:
    codes_ref, scales_ref = refs
    codes = codes_ref[pl.ds(r0, rows), pl.ds(c0, cols)].astype(jnp.int32)
    sr, sc = (rows // BLOCK if op.scale_rows else rows), (cols // BLOCK if op.scale_cols else cols)
    sr0, sc0 = (r0 // BLOCK if op.scale_rows else r0), (c0 // BLOCK if op.scale_cols else c0)
    s = decode_e4m3(scales_ref[pl.ds(sr0, sr), pl.ds(sc0, sc)].astype(jnp.int32))
    t = (decode_e2m1(codes) * _expand(s, rows, cols, op.scale_rows, op.scale_cols)).astype(jnp.bfloat16)
  else:
    t = refs[0][pl.ds(r0, rows), pl.ds(c0, cols)]
  return t if k_major else t.T


def _b_first(a: Operand, b: Operand) -> bool:
  """The kernel's arguments put a bf16 operand before a quantized one (a's first otherwise): one argument order
  for fprop, dgrad and wgrad (XLA:GPU's buffer assignment of the SwiGLU MLP depends on it: benchmarks/RESULTS.md,
  "Pallas NVFP4 GEMM")."""
  return a.quantized and not b.quantized


def _kernel(*refs, a: Operand, b: Operand, block_m, block_n, block_k, k_total):
  na, nb = 1 + a.quantized, 1 + b.quantized
  if _b_first(a, b):
    b_refs, a_refs = refs[:nb], refs[nb:na + nb]
  else:
    a_refs, b_refs = refs[:na], refs[na:na + nb]
  alpha_ref, out_ref = refs[na + nb], refs[na + nb + 1]
  i, j = pl.program_id(0), pl.program_id(1)

  def body(kk, acc):
    k0 = pl.multiple_of(kk * block_k, block_k)
    a_kf = _tile(a_refs, a, i * block_m, block_m, k0, block_k)
    b_kf = _tile(b_refs, b, j * block_n, block_n, k0, block_k)
    return acc + jnp.dot(a_kf.T, b_kf, preferred_element_type=jnp.float32)

  acc = lax.fori_loop(0, k_total // block_k, body, jnp.zeros((block_m, block_n), jnp.float32))
  out_ref[...] = (acc * alpha_ref[0]).astype(out_ref.dtype)


def blocks(m: int, n: int, k: int) -> tuple[int, int, int] | None:
  """(block_m, block_n, block_k) of an (M, N, K) GEMM, or None when a dimension has no power-of-two tile >= 16."""
  b = (tile(m, _MAX_BLOCK_M), tile(n, _MAX_BLOCK_N), tile(k, _MAX_BLOCK_K))
  return b if all(b) else None


@functools.partial(jax.jit, static_argnames=("a", "b", "out_dtype", "interpret"))
def dot(a_parts, b_parts, alpha, *, a: Operand, b: Operand, out_dtype, interpret: bool = False):
  """``cast((a · b, fp32 accumulation) * alpha)``: ``a_parts`` / ``b_parts`` the operands' arrays, ``(values,)`` or
  ``(codes uint4, scales uint8)`` as ``a`` / ``b`` say; ``alpha`` an fp32 scalar. The caller checked
  :func:`blocks` (every dimension tiles)."""
  a0, b0 = a_parts[0], b_parts[0]
  k, m = (a0.shape if a.contract_axis == 0 else a0.shape[::-1])
  kb, n = (b0.shape if b.contract_axis == 0 else b0.shape[::-1])
  assert k == kb, (a0.shape, b0.shape)
  block_m, block_n, block_k = blocks(m, n, k)
  kernel = functools.partial(_kernel, a=a, b=b, block_m=block_m, block_n=block_n, block_k=block_k, k_total=k)
  whole = lambda x: pl.BlockSpec(x.shape, lambda i, j: (0,) * x.ndim)  # noqa: E731
  alpha = jnp.reshape(jnp.asarray(alpha, jnp.float32), (1,))
  operands = (*b_parts, *a_parts, alpha) if _b_first(a, b) else (*a_parts, *b_parts, alpha)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(m // block_m, n // block_n),
      in_specs=[whole(x) for x in operands],
      out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
      compiler_params=pl_triton.CompilerParams(num_warps=_NUM_WARPS, num_stages=_NUM_STAGES),
      interpret=interpret,
      name="nvfp4_dequant_dot",
  )(*operands)
