"""TE's 16-point random Hadamard transform (RHT) of the wgrad operands, with its one bf16 rounding:

    y[16g + c] = bf16_rne( sum_r x[16g + r] * m[r, c] )      m = diag(RHT_SIGNS) @ H16 / 4   (entries ±0.25)

fp32 products (each exact: a sign and a power of two) and an fp32 16-term sum. Bit-checkable wherever the
sum does not depend on its order (TE's tensor-core MMA order is unspecified), including fp32-subnormal inputs
and outputs on flush-to-zero backends: a group whose max |x| is below 2**-60 is transformed at 2**64 scale
and rounded back exactly (:func:`round_back`). Only a subnormal element sharing a group with an element above
2**-60 is flushed -- more than 2**66 below the group max, it cannot change an fp32-accumulated result except
through exact cancellation.

Two sum orders, each used by one implementation: :func:`rht16` (XLA's reduce over the group axis) and
:func:`rht16_column` (left to right, elementwise: the kernels'). They agree wherever the RHT's contract holds.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from maxtext_nvfp4.core.formats import F32_ABS_MASK as _F32_ABS_MASK
from maxtext_nvfp4.core.formats import bits as _bits
from maxtext_nvfp4.core.formats import from_bits as _from_bits
from maxtext_nvfp4.core.formats import pow2 as _pow2
from maxtext_nvfp4.core.formats import round_to_bf16
from maxtext_nvfp4.core.formats import to_f32_exact as _to_f32_exact
from maxtext_nvfp4.core.quantizer.formulas import BLOCK, blocked, check_block_dim, split_subnormal

# TE's fixed wgrad RHT sign vector (hadamard.py get_wgrad_sign_vector; bitmask 0xD7E8).
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def _rht_matrix_np() -> np.ndarray:
  h = np.array([[1.0]])
  for _ in range(4):
    h = np.block([[h, h], [h, -h]])
  return (np.diag(np.array(RHT_SIGNS, np.float64)) @ h / 4.0).astype(np.float32)


# The matrix as numpy fp32 scalars: the RHT's sums multiply by these literals (a Triton kernel cannot capture
# an array constant, and takes the same sums).
_RHT_M = _rht_matrix_np()


def rht_matrix(dtype=jnp.float32):
  """TE's wgrad RHT matrix ``diag(RHT_SIGNS) @ H16 / 4`` (entries exactly ±0.25)."""
  return jnp.asarray(_RHT_M, dtype)


# Groups whose max |x| is below 2**-60 are transformed at 2**64 times their size (exact: a power of two),
# so that no operand or partial sum of the fp32 transform is an fp32 subnormal (XLA:CPU would flush it).
TINY = 2.0**-60
_UP = 64


def rht_entry(r: int, c):
  """``rht_matrix()[r, c]``: a literal for a Python int ``c``; for a traced int32 ``c`` (a kernel's loop index)
  from its bits, ``s_r * (-1)**popcount(r & c) / 4``."""
  if isinstance(c, int):
    return _RHT_M[r, c]
  neg = (lax.population_count(c & np.int32(r)) & 1) == (0 if RHT_SIGNS[r] < 0 else 1)
  return jnp.where(neg, np.float32(-0.25), np.float32(0.25))


def rht16_column(rows, c):
  """``y[c] = (...((x[0] m[0, c] + x[1] m[1, c]) + x[2] m[2, c]) + ...) + x[15] m[15, c]`` with ``m =
  rht_matrix()``: column ``c`` of the RHT of 16 fp32 arrays of one shape (a group's 16 elements, elementwise),
  the sums left to right: the Triton kernels' RHT. Equal to :func:`rht16` wherever the result does not depend
  on the order of the sums (the RHT's contract)."""
  return sum((x * rht_entry(r, c) for r, x in enumerate(rows[1:], 1)), rows[0] * rht_entry(0, c))


def rht16(xb, axis):
  """``y[c] = sum_r x[r] * s_r H16[r, c] / 4`` along the 16-long ``axis`` of the blocked fp32 ``xb``.

  Written as a broadcast product and a 16-term sum (an XLA reduce over ``axis``): one fused pass, no
  transposes. Each product is exact (a sign and a power of two), as with the ±0.25 matrix entries,
  so nothing can overflow where the result does not; the 16-term fp32 sum runs in XLA's reduction order.
  Not 4 add/subtract butterfly stages (each one a materialized pass on XLA:CPU), nor a K=16 matmul and the
  transpose back, nor 16 explicit left-to-right sums stacked back (3x the kernels on XLA:CPU, whose fusion
  of them overflowed to Inf on finite sums: test_numerics' extreme magnitudes).
  """
  m = rht_matrix(jnp.float32)  # (r, c)
  shape = [1] * (xb.ndim + 1)
  shape[axis], shape[axis + 1] = BLOCK, BLOCK
  return jnp.sum(jnp.expand_dims(xb, axis + 1) * m.reshape(shape), axis=axis)


def _rht_plain(xb, g):
  """RHT of the blocked ``xb`` (16-axis ``g``) when no group is tiny, with its one bf16 rounding."""
  y = rht16(xb, g)
  return round_to_bf16(y)


def upscale_flush_to_zero_safe(xb, tiny):
  """``xb * 2**64`` in the tiny groups, ``xb`` elsewhere, exact on a flush-to-zero backend."""
  m, k = split_subnormal(xb)  # xb == m * 2**k, m normal or zero
  return jnp.where(tiny, m * _pow2(jnp.where(k == 0, _UP, _UP - 126)), xb)


def upscale_ieee(xb, tiny):
  """The same where fp32 arithmetic keeps subnormals (XLA:GPU: ``xla_gpu_ftz`` is off by default)."""
  return xb * jnp.where(tiny, _pow2(_UP), np.float32(1.0))


# The subnormal-free form (the Mosaic TPU kernels): every group whose max |x| is below 2**59 is transformed at
# 2**64 scale, so no operand, product or partial sum of its fp32 transform is subnormal (its elements are
# multiples of 2**-85 there, its sums below 2**125) and its bits are IEEE arithmetic's, with or without
# flush-to-zero. A group at or above 2**59 keeps its scale, with its elements below 2**-124 (whose products
# x * ±0.25 would be subnormal) as ±0: what flush-to-zero makes of them.
SCALED_BELOW = 2.0**59
_TERM_NORMAL = int(np.float32(2.0**-124).view(np.int32))


def upscale_normal(x, scaled, ab):
  """``x * 2**64`` in the ``scaled`` groups (exact), ``x`` elsewhere with ``|x| < 2**-124`` as ±0; ``ab``: |x|'s
  bits (int32). No fp32 operation here reads or makes a subnormal number."""
  m, k = split_subnormal(x)  # x == m * 2**k, m normal or zero
  up = m * _pow2(jnp.where(k == 0, _UP, _UP - 126))
  kept = jnp.where(ab < _TERM_NORMAL, _from_bits(_bits(x) & np.uint32(0x80000000)), x)
  return jnp.where(scaled, up, kept)


def round_back_normal(y, scaled, rint=jnp.round):
  """:func:`round_back` of sums ``y`` (the ``scaled`` groups at 2**64), with no subnormal operand or result in its
  fp32 arithmetic (the results below 2**-126 are composed from bits only)."""
  y_norm = round_to_bf16(y)
  is_sub = scaled & (jnp.abs(y) < np.float32(2.0 ** (-126 + _UP)))
  y_norm = jnp.where(scaled, jnp.where(is_sub, np.float32(0.0), y_norm) * np.float32(2.0**-_UP), y_norm)
  n_sub = rint(jnp.where(is_sub, jnp.abs(y), np.float32(0.0)) * np.float32(2.0 ** (133 - _UP))).astype(jnp.uint32)
  y_sub = _from_bits((n_sub << 16) | (jnp.signbit(y).astype(jnp.uint32) << 31))
  return jnp.where(is_sub, y_sub, y_norm)


def _rht_exact(xb, g, tiny):
  """RHT when some group's max |x| is below 2**-60: those groups are transformed at 2**64 scale."""
  # A multiply by a per-group power of two where the backend keeps subnormals (XLA:GPU): cheap enough for
  # XLA:GPU to fuse into the transform (it writes the exact split out as a full-size fp32 array). Same values:
  # both are the exact xb * 2**64.
  xs = lax.platform_dependent(xb, tiny, cuda=upscale_ieee, default=upscale_flush_to_zero_safe)
  return round_back(rht16(xs, g), tiny)


def round_back(y, tiny, rint=jnp.round):
  """The RHT sums ``y`` (tiny groups at 2**64 scale) rounded once to bf16 at their true size (``rint``: round
  half to even, a Triton kernel's own form)."""
  # Back to the true size with ONE bf16 rounding. Normal results: bf16 rounding commutes with the
  # power-of-two scale. Results below 2**-126: the bf16 subnormal grid is N * 2**-133 (fp32 bits N << 16),
  # i.e. N = RNE(|y'| * 2**(133 - 64)) in the scaled domain, composed from bits (no subnormal arithmetic).
  y_norm = round_to_bf16(y)
  y_norm = jnp.where(tiny, y_norm * np.float32(2.0**-_UP), y_norm)
  n_sub = rint(jnp.abs(y) * np.float32(2.0 ** (133 - _UP))).astype(jnp.uint32)
  y_sub = _from_bits((n_sub << 16) | (jnp.signbit(y).astype(jnp.uint32) << 31))
  is_sub = tiny & (jnp.abs(y) < np.float32(2.0 ** (-126 + _UP)))
  return jnp.where(is_sub, y_sub, y_norm)


def _bf16_grid_to_bf16(y):
  """fp32 values on the bf16 grid -> bf16, from the bits (a convert could flush bf16 subnormals)."""
  b = jnp.where(jnp.isnan(y), np.uint32(0x7FC00000), _bits(y))
  return lax.bitcast_convert_type((b >> 16).astype(jnp.uint16), jnp.bfloat16)


def rht_bf16(x, axis, branchless=None):
  """The RHT of ``x`` along ``axis`` as a bf16 array (its values are on the bf16 grid by definition).

  bf16 halves what the quantizer materializes between the transform and its two consumers (block amax,
  element path). Tiny groups (max |x| < 2**-60) are rare and their exact path costs ~2x the plain one:
  on CPU a ``lax.cond`` skips it when no group is tiny (the cond operand is ``x`` itself, so the fp32
  widening fuses into each branch); elsewhere (``branchless``; default: every non-CPU platform) the
  exact path always runs -- it is exact for every group, and on a GPU a conditional would read its
  predicate back to the host, stalling the stream. Both give the same bits.
  """
  blocks = lambda: blocked(_to_f32_exact(x), axis, False)[0]  # noqa: E731
  xb = blocks()
  gmax = jnp.max((_bits(xb) & _F32_ABS_MASK).astype(jnp.int32), axis=axis + 1, keepdims=True)
  tiny = gmax < int(np.float32(TINY).view(np.int32))
  # The exact path reads ``tiny`` as a materialized per-group flag (1/16 of the data): otherwise XLA:GPU
  # fuses the tiny-group select into the group-max reduce and writes its result as a full-size fp32 array
  # for the transform to read back.
  exact = lambda: _bf16_grid_to_bf16(_rht_exact(blocks(), axis + 1, lax.optimization_barrier(tiny)))  # noqa: E731
  plain = lambda: _bf16_grid_to_bf16(_rht_plain(blocks(), axis + 1))  # noqa: E731
  branchy = lambda: lax.cond(jnp.any(tiny), exact, plain)  # noqa: E731
  if branchless is None:
    y = lax.platform_dependent(cpu=branchy, default=exact)
  else:
    y = exact() if branchless else branchy()
  return y.reshape(x.shape)


def _rht_impl(x, axis):
  return _to_f32_exact(rht_bf16(x, axis))


def rht(x, axis=-1):
  """TE's 16-point RHT along ``axis``: ``y = bf16(x16 @ (diag(s) H16 / 4))``, fp32 accumulate.

  Returns fp32 values on the bf16 grid (``y[16g + c] = bf16_rne(sum_r s_r x[16g + r] H16[r, c] / 4)``).
  The kernels round the RHT output to bf16 before both the amax and the quantization; so do we.
  Bit-checkable as the module docstring says.
  """
  x = jnp.asarray(x)
  axis = axis % x.ndim
  check_block_dim(x.shape, axis)
  return _rht_jit(x, axis)


_rht_jit = jax.jit(_rht_impl, static_argnums=(1,))
