"""NVFP4 quantization in pure ``jax.numpy``, bit-identical to Transformer Engine's quantizer.

This module imports nothing from MaxText or Transformer Engine. It reproduces what TE's CUDA kernels
(``transformer_engine/common/cast/nvfp4/*.cuh``) and TE's bit-exact PyTorch reference
(``pytorch/custom_recipes/reference_nvfp4.py``) compute; TE's own pure-JAX quantizer is *not* the
reference (it uses another operation order and its ``reduce_precision`` line produces NaN scales).

Format
------
NVFP4 stores a tensor ``x`` as E2M1 elements ``q`` (values 0, ±0.5, ±1, ±1.5, ±2, ±3, ±4, ±6), one E4M3
decode scale ``s8`` per block of 16 consecutive elements (1x16 along the GEMM contraction axis, or a
16x16 tile for weights), and one FP32 per-tensor amax that sets the global scale. All arithmetic is
IEEE fp32 with round-to-nearest-even (RNE) and, like the CUDA kernels, *with* subnormals:

    amax   = max |x|                                            (exact, fp32)
    S_enc  = min(2688 / amax, FLT_MAX);  S_enc = 1 if amax == 0 or S_enc == 0     (2688 = 448 * 6)
    S_dec  = fl(1 / S_enc)
    bamax  = max |x| over the block                             (exact)
    s8     = rnd(min(fl(bamax * fl(S_enc * fl(1/6))), 448), E4M3)         # this operation order
    enc    = min(fl(1 / fl(s8 * S_dec)), FLT_MAX)               # 0-scale blocks: enc = FLT_MAX
    q      = rnd(clip(fl(x * enc), -6, 6), E2M1)                # RNE; saturates to ±6
             (stochastic rounding instead of RNE when a key is given, see below)

``rnd(v, F)`` is :func:`maxtext_nvfp4.core.formats.round_to_format` (RNE onto format F's grid). The
element path computes ``q``'s E2M1 code directly with :func:`~maxtext_nvfp4.core.formats.grid_index`,
the same rounding expressed as grid indices (tests check both against ``ml_dtypes`` casts).

Dequantization follows TE JAX's ``NVFP4Dequantizer`` (finite where the CUDA dequant kernel overflows):

    x_hat = float(q) * (float(s8) * (amax / 2688))

What is bit-checkable: ``data``, ``scale`` and ``amax`` for round-to-nearest (all shapes, 1D along any
axis, 2D, RHT -- the latter wherever the 16-term fp32 RHT sums do not depend on accumulation order,
since the tensor-core MMA order is unspecified), on every backend, including inputs whose fp32 intermediates are subnormal (XLA:CPU
flushes fp32 subnormals to zero; every step that can meet one is computed with exact integer/exponent
arithmetic instead). Stochastic rounding matches TE only in distribution: the hardware uses Philox bits
tied to the CUDA thread mapping, which cannot be reproduced; we draw 8 bits per element from a keyed
counter hash (``_random_bytes``) and apply TE's SR formula to them exactly.

Cost (why the code looks the way it does): the element path is ~15 fp32/int ops per element with no
division (E2M1 codes straight from ``fl(x * enc)``); the tensor amax comes from the block maxima; the
block scales touch 1/16 of the data; a GEMM operand used once (``quantize_values``) never goes through
the 4-bit packing. ``benchmarks/profile_notes.md`` has the measurements.

XLA pitfalls handled here (each one changed golden bits before it was fixed): XLA:CPU compares with
denormals-are-zero (a subnormal amax tests ``== 0``; zero tests use the bits), flushes subnormal
operands of arithmetic and dots (exact integer/exponent paths, RHT of tiny groups at 2**64 scale), and
its algebraic simplifier rewrites ``x / constant`` as ``x * fl(1/constant)``; XLA:GPU divides with PTX
``div.full.f32``, 1 ulp off for about a quarter of all quotients (found on the H200). So every quotient
here, ``amax / 2688`` included, is :func:`formats.div_rn`: the IEEE quotient on every backend. ``dequantize`` is bit-exact with TE JAX's under jit.
Where fp32 arithmetic keeps subnormals (XLA:GPU, ``lax.platform_dependent`` branch ``cuda``) the element product
and the RHT's tiny-group upscale are plain products, and off CPU the SR bytes are hashed per element: the same
bits with fewer passes over memory (``tests/core/test_nvfp4_gpu_paths.py`` checks each against its other form).

Rounding never relies on float converts (XLA on GPU folds ``f32 -> e2m1 -> f32`` and ``f32 -> bf16 ->
f32`` round trips): E2M1, E4M3 and the bf16 rounding of the RHT output are explicit arithmetic/bit
rounding, so the values survive every XLA pass.

Non-finite input (TE's kernels turn NaN into ±6 and would hand finite numbers downstream; we do not):
  * a NaN anywhere makes ``amax`` NaN, hence every scale NaN and the whole dequantized tensor NaN
    (and every GEMM using it). ``data`` is then meaningless: every element is +6 (the encode scales are
    NaN, and NaN converts to +6 as in TE's ``cvt.rn.satfinite``); the NaN amax/scales carry the poison;
  * an Inf makes ``amax`` Inf: ``data``/``scale`` are exactly TE's (±6 at scale 448 for the Inf's
    block), and the dequantized tensor is ±Inf/NaN everywhere (``amax / 2688`` is Inf).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from maxtext_nvfp4.core import formats
from maxtext_nvfp4.core.formats import E2M1, E4M3, FLT_MAX, round_to_bf16, round_to_format
from maxtext_nvfp4.core.formats import F32_ABS_MASK as _F32_ABS_MASK
from maxtext_nvfp4.core.formats import F32_EXP_MASK as _F32_EXP_MASK
from maxtext_nvfp4.core.formats import F32_MANT_MASK as _F32_MANT_MASK
from maxtext_nvfp4.core.formats import bits as _bits
from maxtext_nvfp4.core.formats import from_bits as _from_bits
from maxtext_nvfp4.core.formats import pow2 as _pow2
from maxtext_nvfp4.core.formats import to_f32_exact as _to_f32_exact

__all__ = [
    "BLOCK",
    "E2M1_MAX",
    "E4M3_MAX",
    "NVFP4Tensor",
    "RHT_SIGNS",
    "as_numpy",
    "block_values",
    "dequantize",
    "global_decode_scale",
    "pack",
    "quantize",
    "quantize_values",
    "rht",
    "rht_matrix",
    "unpack",
]

BLOCK = 16
E2M1_MAX = E2M1.max  # 6
E4M3_MAX = E4M3.max  # 448
GLOBAL_DENOM = E4M3_MAX * E2M1_MAX  # 2688
# TE's fixed wgrad RHT sign vector (hadamard.py get_wgrad_sign_vector; bitmask 0xD7E8).
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
# E2M1 value of each 4-bit code (bit 3 sign, bits 0-2 magnitude index): the decode table of float4_e2m1fn.
_E2M1_TABLE = np.concatenate([formats.grid(E2M1), -formats.grid(E2M1)])
# The 127 finite non-negative E4M3 values, in code order (the block decode scales' value table).
_E4M3_GRID = formats.grid(E4M3)


# ----------------------------------------------------------------------------------------------
# Blocks
# ----------------------------------------------------------------------------------------------
def _check_block_dim(shape, axis):
  n = shape[axis]
  if n % BLOCK:
    raise ValueError(
        f"NVFP4 quantization needs the block axis to be a multiple of {BLOCK}: axis {axis} has size {n}"
        f" (shape {tuple(shape)}); pad it with zeros first"
    )


def _blocked(x, axis, block_2d):
  """Reshape so each block is contiguous along the returned reduction axes (no transposes)."""
  if block_2d:
    r, c = x.shape[-2:]
    return x.reshape(x.shape[:-2] + (r // BLOCK, BLOCK, c // BLOCK, BLOCK)), (x.ndim - 1, x.ndim + 1)
  n = x.shape[axis]
  return x.reshape(x.shape[:axis] + (n // BLOCK, BLOCK) + x.shape[axis + 1 :]), (axis + 1,)


# ----------------------------------------------------------------------------------------------
# Exact fp32 arithmetic (immune to flush-to-zero; the bit helpers are in formats.py)
# ----------------------------------------------------------------------------------------------
def _split_subnormal(v):
  """v == m * 2**k exactly, with m a normal fp32 (or zero) and k in {0, -126}.

  A subnormal v = M * 2**-149 becomes m = M * 2**-23 (normal) and k = -126, so arithmetic on m never
  meets an fp32 subnormal operand.
  """
  b = _bits(v)
  is_sub = (b & _F32_EXP_MASK) == 0
  mant = (b & _F32_MANT_MASK).astype(jnp.int32).astype(jnp.float32) * np.float32(2.0**-23)
  m = jnp.where(is_sub, jnp.where((b >> 31) == 1, -mant, mant), v)
  k = jnp.where(is_sub, jnp.int32(-126), jnp.int32(0))
  return m, k


def _mul_exact(a, b_normal):
  """fl(a * b) for fp32 ``a`` possibly subnormal and ``b_normal`` normal, when the result is normal.

  Results in the subnormal range may come back flushed to ±0; callers only use this where such a
  result rounds to zero anyway (E4M3 scales below 2**-10, E2M1 values below 0.25).
  """
  m, k = _split_subnormal(a)
  prod = m * b_normal
  return jnp.where(k == 0, prod, prod * _pow2(-126))


def _recip_exact(s):
  """Correctly rounded ``fl(1 / s)`` for fp32 ``s > 0``, subnormal results included (``formats.div_rn``).

  Not ``1.0 / s``: XLA:GPU's fp32 division is 1 ulp off for about a quarter of all inputs.
  """
  return formats.div_rn(np.float32(1.0), s)


def _mul_e4m3_by_f32_exact(s8, d):
  """Correctly rounded fl(s8 * d) for an E4M3 value ``s8 >= 0`` and an fp32 ``d > 0`` (scalar).

  Exact even when the product (or ``d``) is an fp32 subnormal: s8 has at most 4 significant bits, so
  the integer product of both significands fits in int32 and is rounded with RNE by integer shifts.
  """
  # s8 = k8 * 2**j8 with a 4-bit integer k8.
  sb = _bits(s8)
  se = ((sb >> 23) & 0xFF).astype(jnp.int32)
  k8 = (((sb & _F32_MANT_MASK) | 0x00800000) >> 20).astype(jnp.int32)  # 1.xxx -> 4-bit integer
  j8 = se - 127 - 3
  # d = md * 2**jd with an integer md < 2**24.
  db = _bits(d)
  de = ((db >> 23) & 0xFF).astype(jnp.int32)
  md = jnp.where(de == 0, db & _F32_MANT_MASK, (db & _F32_MANT_MASK) | 0x00800000).astype(jnp.int32)
  jd = jnp.where(de == 0, jnp.int32(-149), de - 150)
  prod = k8 * md  # < 2**28
  exp = j8 + jd
  nbits = 32 - lax.clz(prod)
  shift = jnp.maximum(jnp.maximum(nbits - 24, -149 - exp), 0)
  shift_c = jnp.minimum(shift, 31)
  kept = prod >> shift_c
  rem = prod - (kept << shift_c)
  half = jnp.where(shift_c > 0, jnp.int32(1) << jnp.maximum(shift_c - 1, 0), 0)
  up = (shift_c > 0) & ((rem > half) | ((rem == half) & ((kept & 1) == 1)))
  kept = jnp.where(shift > 30, 0, kept + up.astype(jnp.int32))
  exp = exp + shift
  # Compose kept * 2**exp (kept <= 2**24). Subnormal range: exp == -149 and bits == kept.
  as_sub = _from_bits(kept.astype(jnp.uint32))
  as_norm = (kept.astype(jnp.float32) * np.float32(2.0**-23)) * _pow2(jnp.clip(exp + 23, -126, 127))
  out = jnp.where(exp <= -149, as_sub, as_norm)
  return jnp.where((prod == 0) | (s8 == 0), jnp.float32(0), out)


# ----------------------------------------------------------------------------------------------
# Stochastic-rounding bits
# ----------------------------------------------------------------------------------------------
def _lowbias32(h):
  """A 32-bit integer hash with near-ideal avalanche (C. Wellons' "lowbias32": xorshift-multiply, 2 rounds)."""
  h = h ^ (h >> 16)
  h = h * np.uint32(0x7FEB352D)
  h = h ^ (h >> 15)
  h = h * np.uint32(0x846CA68B)
  return h ^ (h >> 16)


def _random_bytes(key, shape, per_element: bool | None = None):
  """Uniform random ``uint8`` of ``shape`` for stochastic rounding: a keyed counter-based hash.

  ``word[i] = H(H(i + k0) ^ k1)`` with ``H`` = :func:`_lowbias32`, ``i`` the word's position in the
  tensor and ``(k0, k1) = jax.random.bits(key, (2,), uint32)`` (one threefry evaluation per tensor);
  each 32-bit word gives the bytes of 4 consecutive elements along the last axis (one word per element,
  its low byte, when that axis is not a multiple of 4). About 12 integer ops per word, against ~100 and
  a loop for a threefry2x32 word (``jax.random.bits``): on XLA:CPU the SR bits of a tensor cost ~4x less.
  The position comes from iotas over the tensor's own shape, so a sharded tensor computes its bits
  shard-locally. SR matches TE in distribution only either way: TE draws Philox bits tied to its CUDA
  thread mapping, which cannot be reproduced. The bytes are uniform and, for practical purposes,
  independent across elements, tensors and keys (``tests/test_numerics.py`` checks histograms and
  correlations). ``per_element`` chooses how the words become bytes (same bits either way; default: by word
  on CPU, per element elsewhere).
  """
  shape = tuple(shape)
  k = jax.random.bits(key, (2,), jnp.uint32)
  per_word = 4 if shape and shape[-1] % 4 == 0 else 1
  wshape = shape[:-1] + (shape[-1] // per_word,) if shape else ()
  hash_words = lambda idx: _lowbias32(_lowbias32(idx + k[0]) ^ k[1])  # noqa: E731
  if per_word == 1:
    return (hash_words(_word_index(wshape, wshape, 1)) & np.uint32(0xFF)).astype(jnp.uint8)

  def by_word():  # one hash per word, split into its 4 bytes: least work (XLA:CPU)
    return lax.bitcast_convert_type(hash_words(_word_index(wshape, wshape, 1)), jnp.uint8).reshape(shape)

  def by_element():
    # The same bytes: each element hashes its own word and takes byte (c mod 4) of it, little-endian like
    # the bitcast. 4x the integer work, but elementwise, so XLA:GPU fuses it into the quantizer's element
    # pass (it wrote the words' u32 -> u8 bitcast out in full: 2 B/element; H200 compile, 2026-12-01).
    byte = lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1) % np.uint32(4)
    return ((hash_words(_word_index(shape, wshape, 4)) >> (byte * np.uint32(8))) & np.uint32(0xFF)).astype(jnp.uint8)

  if per_element is None:
    return lax.platform_dependent(cpu=by_word, default=by_element)
  return by_element() if per_element else by_word()


def _word_index(ishape, wshape, last_div):
  """Row-major index into ``wshape`` of every position of ``ishape`` (its last axis divided by ``last_div``)."""
  idx = jnp.zeros(ishape, jnp.uint32)
  stride = 1
  for d in range(len(wshape) - 1, -1, -1):
    i = lax.broadcasted_iota(jnp.uint32, ishape, d)
    i = i // np.uint32(last_div) if d == len(wshape) - 1 and last_div > 1 else i
    idx = idx + i * np.uint32(stride % 2**32)
    stride *= wshape[d]
  return idx


# ----------------------------------------------------------------------------------------------
# Random Hadamard transform
# ----------------------------------------------------------------------------------------------
def rht_matrix(dtype=jnp.float32):
  """TE's wgrad RHT matrix ``diag(RHT_SIGNS) @ H16 / 4`` (entries exactly ±0.25)."""
  h = np.array([[1.0]])
  for _ in range(4):
    h = np.block([[h, h], [h, -h]])
  m = np.diag(np.array(RHT_SIGNS, np.float64)) @ h / 4.0
  return jnp.asarray(m, dtype)


# Groups whose max |x| is below 2**-60 are transformed at 2**64 times their size (exact: a power of two),
# so that no operand or partial sum of the fp32 transform is an fp32 subnormal (XLA:CPU would flush it).
_RHT_TINY = 2.0**-60
_RHT_UP = 64


def _rht16(xb, axis):
  """``y[c] = sum_r x[r] * s_r H16[r, c] / 4`` along the 16-long ``axis`` of the blocked fp32 ``xb``.

  Written as a broadcast product and a 16-term sum (an XLA reduce over ``axis``): one fused pass, no
  transposes. Each product is exact (a sign and a power of two), as with the ±0.25 matrix entries,
  so nothing can overflow where the result does not; the 16-term fp32 sum runs in XLA's reduction order.
  On XLA:CPU this is ~2x faster than 4 add/subtract butterfly stages (each one a materialized pass) and
  than a K=16 matmul plus the transpose back. The golden contract is unaffected: RHT cases use inputs
  whose bf16 result does not depend on the fp32 accumulation order (the tensor-core MMA's is unspecified).
  """
  m = rht_matrix(jnp.float32)  # (r, c)
  shape = [1] * (xb.ndim + 1)
  shape[axis], shape[axis + 1] = BLOCK, BLOCK
  return jnp.sum(jnp.expand_dims(xb, axis + 1) * m.reshape(shape), axis=axis)


def _rht_plain(xb, g):
  """RHT of the blocked ``xb`` (16-axis ``g``) when no group is tiny, with its one bf16 rounding."""
  y = _rht16(xb, g)
  return round_to_bf16(y)


def _rht_upscale_flush_to_zero_safe(xb, tiny):
  """``xb * 2**64`` in the tiny groups, ``xb`` elsewhere, exact on a flush-to-zero backend."""
  m, k = _split_subnormal(xb)  # xb == m * 2**k, m normal or zero
  return jnp.where(tiny, m * _pow2(jnp.where(k == 0, _RHT_UP, _RHT_UP - 126)), xb)


def _rht_upscale_ieee(xb, tiny):
  """The same where fp32 arithmetic keeps subnormals (XLA:GPU: ``xla_gpu_ftz`` is off by default)."""
  return xb * jnp.where(tiny, _pow2(_RHT_UP), np.float32(1.0))


def _rht_exact(xb, g, tiny):
  """RHT when some group's max |x| is below 2**-60: those groups are transformed at 2**64 scale."""
  # A multiply by a per-group power of two where the backend keeps subnormals (XLA:GPU): cheap enough for
  # XLA:GPU to fuse into the transform (the exact split was written out as a full-size fp32 array there:
  # 8 B/element; H200 compile, 2026-12-01). Same values: both are the exact xb * 2**64.
  xs = lax.platform_dependent(xb, tiny, cuda=_rht_upscale_ieee, default=_rht_upscale_flush_to_zero_safe)
  return _rht_round_back(_rht16(xs, g), tiny)


def _rht_round_back(y, tiny):
  """The RHT sums ``y`` (tiny groups at 2**64 scale) rounded once to bf16 at their true size."""
  # Back to the true size with ONE bf16 rounding. Normal results: bf16 rounding commutes with the
  # power-of-two scale. Results below 2**-126: the bf16 subnormal grid is N * 2**-133 (fp32 bits N << 16),
  # i.e. N = RNE(|y'| * 2**(133 - 64)) in the scaled domain, composed from bits (no subnormal arithmetic).
  y_norm = round_to_bf16(y)
  y_norm = jnp.where(tiny, y_norm * np.float32(2.0**-_RHT_UP), y_norm)
  n_sub = jnp.round(jnp.abs(y) * np.float32(2.0 ** (133 - _RHT_UP))).astype(jnp.uint32)
  y_sub = _from_bits((n_sub << 16) | (jnp.signbit(y).astype(jnp.uint32) << 31))
  is_sub = tiny & (jnp.abs(y) < np.float32(2.0 ** (-126 + _RHT_UP)))
  return jnp.where(is_sub, y_sub, y_norm)


def _bf16_grid_to_bf16(y):
  """fp32 values on the bf16 grid -> bf16, from the bits (a convert could flush bf16 subnormals)."""
  b = jnp.where(jnp.isnan(y), np.uint32(0x7FC00000), _bits(y))
  return lax.bitcast_convert_type((b >> 16).astype(jnp.uint16), jnp.bfloat16)


def _rht_bf16(x, axis, branchless=None):
  """The RHT of ``x`` along ``axis`` as a bf16 array (its values are on the bf16 grid by definition).

  bf16 halves what the quantizer materializes between the transform and its two consumers (block amax,
  element path). Tiny groups (max |x| < 2**-60) are rare and their exact path costs ~2x the plain one:
  on CPU a ``lax.cond`` skips it when no group is tiny (the cond operand is ``x`` itself, so the fp32
  widening fuses into each branch); elsewhere (``branchless``; default: every non-CPU platform) the
  exact path always runs -- it is exact for every group, and on a GPU a conditional would read its
  predicate back to the host, stalling the stream. Both give the same bits.
  """
  blocked = lambda: _blocked(_to_f32_exact(x), axis, False)[0]
  xb = blocked()
  gmax = jnp.max((_bits(xb) & _F32_ABS_MASK).astype(jnp.int32), axis=axis + 1, keepdims=True)
  tiny = gmax < int(np.float32(_RHT_TINY).view(np.int32))
  # The exact path reads ``tiny`` as a materialized per-group flag (1/16 of the data): otherwise XLA:GPU
  # fuses the tiny-group select into the group-max reduce and writes its result as a full-size fp32 array
  # for the transform to read back (8 B/element; H200 compile, 2026-12-01).
  exact = lambda: _bf16_grid_to_bf16(_rht_exact(blocked(), axis + 1, lax.optimization_barrier(tiny)))
  plain = lambda: _bf16_grid_to_bf16(_rht_plain(blocked(), axis + 1))
  branchy = lambda: lax.cond(jnp.any(tiny), exact, plain)
  if branchless is None:
    y = lax.platform_dependent(cpu=branchy, default=exact)
  else:
    y = exact() if branchless else branchy()
  return y.reshape(x.shape)


def _rht_impl(x, axis):
  return _to_f32_exact(_rht_bf16(x, axis))


def rht(x, axis=-1):
  """TE's 16-point RHT along ``axis``: ``y = bf16(x16 @ (diag(s) H16 / 4))``, fp32 accumulate.

  Returns fp32 values on the bf16 grid (``y[16g + c] = bf16_rne(sum_r s_r x[16g + r] H16[r, c] / 4)``).
  The kernels round the RHT output to bf16 before both the amax and the quantization; so do we.
  Bit-checkable wherever the fp32 sum is insensitive to accumulation order (the tensor-core MMA order is
  unspecified), including fp32-subnormal inputs and outputs on flush-to-zero backends: a group whose
  max |x| is below 2**-60 is transformed at 2**64 scale and rounded back exactly. (Only a subnormal
  element sharing a group with an element above 2**-60 is flushed -- more than 2**66 below the group
  max, it cannot change an fp32-accumulated result except through exact cancellation.)
  """
  x = jnp.asarray(x)
  axis = axis % x.ndim
  _check_block_dim(x.shape, axis)
  return _rht_jit(x, axis)


_rht_jit = jax.jit(_rht_impl, static_argnums=(1,))


# ----------------------------------------------------------------------------------------------
# Tensor container
# ----------------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Tensor:
  """A quantized NVFP4 tensor (TE's data / scale_inv / amax triple).

  data:     ``float4_e2m1fn``, same shape and layout as the input.
  scale:    ``float8_e4m3fn`` block decode scales; the block axis (both last axes for 2D) divided by 16.
  amax:     fp32 scalar: the per-tensor amax that sets the global scale (post-RHT when ``rht``).
  axis:     the 1x16 block axis (non-negative), or None for 16x16 tiles over the last two axes.
  block_2d: True for 16x16 tiles.
  rht:      True when the values are in the RHT domain along ``axis``.
  """

  data: jax.Array
  scale: jax.Array
  amax: jax.Array
  axis: int | None = dataclasses.field(default=None, metadata=dict(static=True))
  block_2d: bool = dataclasses.field(default=False, metadata=dict(static=True))
  rht: bool = dataclasses.field(default=False, metadata=dict(static=True))

  @property
  def shape(self):
    return self.data.shape

  def pack(self):
    return pack(self.data)


def quantize(x, *, axis: int = -1, block_2d: bool = False, rht: bool = False, stochastic_key=None) -> NVFP4Tensor:
  """Quantize ``x`` to NVFP4 exactly as TE's kernels do (see the module docstring for the formulas).

  Args:
    x: bf16 or fp32 array. fp32 values are used as given (TE's fallback kernel); bf16 is what the
      optimized kernels take.
    axis: the 1x16 block axis (the GEMM contraction axis). Ignored when ``block_2d``.
    block_2d: 16x16 tiles over the last two axes (TE's weight path, ``NVFP4_2D_SCALING``).
    rht: apply TE's 16-point RHT along ``axis`` first (the wgrad operands); the amax is then the
      post-RHT amax and the result stays in the RHT domain.
    stochastic_key: a ``jax.random`` key for stochastic rounding of the elements (gradients);
      ``None`` means RNE.

  Raises:
    TypeError: non-floating input.
    ValueError: a block axis whose length is not a multiple of 16.
  """
  x, axis_n = _validate(x, axis, block_2d, rht)
  return _quantize_jit(x, stochastic_key, axis_n, block_2d, rht)


def _e4m3_code(s8):
  """Index into ``formats.grid(E4M3)`` of a non-negative fp32 ``s8`` on the E4M3 grid (NaN: 0), from its bits.

  Normal E4M3 values (``s8 >= 2**-6``) have code ``(e + 7) * 8 + m3`` (``e`` the exponent, ``m3`` the top
  three fraction bits); subnormal ones ``s8 * 2**9`` (0..7, an exact product).
  """
  b = _bits(s8)
  e = ((b >> 23) & 0xFF).astype(jnp.int32) - 127
  normal = ((e + 7) << 3) | ((b >> 20) & 7).astype(jnp.int32)
  sub = (s8 * np.float32(2.0**9)).astype(jnp.int32)
  code = jnp.where(e >= -6, normal, sub)
  return jnp.where(jnp.isnan(s8), 0, jnp.clip(code, 0, len(_E4M3_GRID) - 1))


def _block_scales(xb, red):
  """(amax, s8, enc) of the blocked fp32 ``xb`` (blocks along the axes ``red``; s8/enc keep those dims)."""
  abs_bits = (_bits(xb) & _F32_ABS_MASK).astype(jnp.int32)  # integer max: exact, NaN-propagating
  bamax_bits = jnp.max(abs_bits, axis=red, keepdims=True)
  # The tensor amax from the block maxima (1/16 of the data). Without the barrier XLA merges the two
  # reductions into one over the whole tensor, which XLA:CPU runs as a reduce-window tree over a
  # materialized int32 copy of it (an extra read and write of 4 bytes per element).
  amax = _from_bits(jnp.max(lax.optimization_barrier(bamax_bits)))
  bamax = _from_bits(bamax_bits)

  # Per-tensor scales (CUDA compute_global_encode_scaling_factor_FP4).
  # IEEE quotient (div_rn takes subnormal amaxes too: 2688 / subnormal overflows to inf, then FLT_MAX).
  s_enc = jnp.minimum(formats.div_rn(np.float32(GLOBAL_DENOM), amax), np.float32(FLT_MAX))
  # Bitwise zero test: XLA:CPU compares with denormals-are-zero, so `amax == 0` is True for a subnormal
  # amax (whose S_enc must be FLT_MAX, not 1).
  amax_is_zero = (_bits(amax) & _F32_ABS_MASK) == 0
  s_enc = jnp.where(amax_is_zero | (s_enc == 0), np.float32(1.0), s_enc)
  s_enc = jnp.where(jnp.isnan(amax), amax, s_enc)  # NaN input poisons every scale (documented)
  s_dec = _recip_exact(jnp.where(jnp.isnan(s_enc), 1.0, s_enc))
  s_dec = jnp.where(jnp.isnan(s_enc), s_enc, s_dec)

  # Per-block decode scale, E4M3: fl(bamax * fl(S_enc * fl(1/6))), saturated to 448, RNE.
  c = s_enc * np.float32(np.float32(1.0) / np.float32(6.0))
  dec = jnp.minimum(_mul_exact(bamax, c), np.float32(E4M3_MAX))
  s8 = round_to_format(dec, E4M3)
  # Per-block encode scale: min(1 / fl(s8 * S_dec), FLT_MAX). s8 is one of E4M3's 127 finite values and
  # S_dec one scalar per tensor, so the exact quotient is taken once per E4M3 value (a 127-entry table,
  # formats.div_rn) and looked up by s8's code: no per-block division. (IEEE 1/0 = inf for a zero-scale
  # block, and 1/subnormal overflows: both end at FLT_MAX.)
  table = formats.div_rn(np.float32(1.0), _mul_e4m3_by_f32_exact(jnp.asarray(_E4M3_GRID), s_dec))
  table = jnp.where(jnp.isnan(table), table, jnp.minimum(table, np.float32(FLT_MAX)))
  enc = table[_e4m3_code(s8)]
  enc = jnp.where(jnp.isnan(s8), s8, enc)
  return amax, s8, enc


def _abs_times_enc_flush_to_zero_safe(b, enc):
  """``fl(|x| * enc)`` from x's bits ``b``, exact on flush-to-zero backends (a subnormal x times an enc below
  2**23 gives 0 here instead of a product below 2**-103: the same E2M1 code, 0)."""
  ab = b & np.uint32(_F32_ABS_MASK)
  is_sub = ((b >> 23) & np.uint32(0xFF)) == 0  # zero or subnormal x, from the exponent field
  # enc * 2**-149 from the bits (the constant 2**-149 is itself subnormal: XLA:CPU would read it as 0).
  enc_bits = _bits(enc)
  enc_lo = jnp.where(enc_bits >= np.uint32(150 << 23), _from_bits(enc_bits - np.uint32(149 << 23)), np.float32(0))
  enc_lo = jnp.where(jnp.isnan(enc), enc, enc_lo)
  return jnp.where(is_sub, ab.astype(jnp.int32).astype(jnp.float32) * enc_lo, _from_bits(ab) * enc)


def _abs_times_enc_ieee(b, enc):
  """``fl(|x| * enc)`` where fp32 arithmetic keeps subnormals (XLA:GPU: ``xla_gpu_ftz`` is off by default)."""
  return _from_bits(b & np.uint32(_F32_ABS_MASK)) * enc


def _e2m1_code_of_product(xb, enc, u=None):
  """E2M1 code of ``q = e2m1(clip(fl(x * enc), -6, 6))``: (magnitude index k in 0..7 as fp32, sign).

  ``k`` is the index into ``formats.grid(E2M1)``; the sign is x's (zeros keep theirs, NaN gives +6 as
  ``cvt.rn.satfinite`` does). Exact on flush-to-zero backends with ~15 fp32/int ops per element and no
  division:

    |y| = fl(|x| * enc)                 x normal (a product below 2**-126 only ever rounds to 0)
        = fl(M * fl(enc * 2**-149))     x = M * 2**-149 subnormal: exact when enc >= 2**23 (the scaled
                                        enc is then normal); for a smaller enc |y| < 2**-103 -> 0 either way
    k = grid_index(min(|y|, 6), E2M1, u)          RNE without u; SR with u = rbits / 256

  SR there is TE's emulated ``cvt.rs`` formula ``floor((a + u * step) / step) * step``; the RNE form
  reproduces the threshold table (ties 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4).
  """
  b = _bits(xb)
  # Where fp32 keeps subnormals (XLA:GPU) the plain product is the same fl(|x| * enc); the flush-to-zero
  # select cost the GPU a full-size pred array (XLA fused it into the block-amax reduce as a second output:
  # 1 B/element written and read back; H200 compile, 2026-12-01).
  y = lax.platform_dependent(b, enc, cuda=_abs_times_enc_ieee, default=_abs_times_enc_flush_to_zero_safe)
  a = jnp.minimum(y, np.float32(E2M1_MAX))  # NaN stays NaN
  k = formats.grid_index(a, E2M1, u)
  nan = jnp.isnan(a)
  k = jnp.where(nan, np.float32(7.0), k)
  neg = ((b >> 31) == 1) & ~nan
  return k, neg


def _quantize_parts(x, stochastic_key, axis_n, block_2d, rht):
  """(k, neg, s8, amax, red): the blocked E2M1 codes and block scales of x (arguments validated)."""
  if rht:
    # Materialize the RHT output once: otherwise XLA:CPU fuses its elementwise tail into both consumers
    # (block amax and element path) and recomputes it there, 4x slower overall.
    xf = _to_f32_exact(lax.optimization_barrier(_rht_bf16(x, axis_n)))
  else:
    xf = _to_f32_exact(x)
  xb, red = _blocked(xf, axis_n, block_2d)
  amax, s8, enc = _block_scales(xb, red)
  u = None
  if stochastic_key is not None:
    # Bits drawn over the unblocked shape (its last axis is long): a blocked shape ending in 16 would
    # make the uint32 words' axis 4 long, ~4x slower on XLA:CPU for the same bits.
    u = _random_bytes(stochastic_key, xf.shape).reshape(xb.shape).astype(jnp.float32) * np.float32(1.0 / 256.0)
  k, neg = _e2m1_code_of_product(xb, enc, u)
  return k, neg, s8, amax, red


def _quantize_impl(x, stochastic_key, axis_n, block_2d, rht):
  """The traced body of :func:`quantize` (arguments already validated; ``axis_n`` non-negative)."""
  k, neg, s8, amax, red = _quantize_parts(x, stochastic_key, axis_n, block_2d, rht)
  codes = (k.astype(jnp.uint8) | (neg.astype(jnp.uint8) << 3)).reshape(x.shape)
  data = _codes_to_e2m1(codes)
  scale = jnp.squeeze(s8, axis=red).astype(jnp.float8_e4m3fn)
  return NVFP4Tensor(data=data, scale=scale, amax=amax, axis=axis_n, block_2d=block_2d, rht=rht)


def _quantize_values_impl(x, stochastic_key, axis_n, block_2d, rht, dtype):
  k, neg, s8, amax, _ = _quantize_parts(x, stochastic_key, axis_n, block_2d, rht)
  mag = formats.grid_value(k, E2M1)
  v = jnp.where(neg, -mag, mag) * s8
  return v.astype(dtype).reshape(x.shape), amax


# One compiled program per (shape, dtype, mode): eager op-by-op dispatch of the ~100 small ops above
# costs seconds of compilation per new shape. Inside an outer jit this simply inlines.
_quantize_jit = jax.jit(_quantize_impl, static_argnums=(2, 3, 4))
_quantize_values_jit = jax.jit(_quantize_values_impl, static_argnums=(2, 3, 4, 5))


def _validate(x, axis, block_2d, rht):
  """Checks shared by :func:`quantize` and :func:`quantize_values`; returns (x, axis_n)."""
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"NVFP4 quantize needs a floating-point array (bf16 or fp32), got dtype {x.dtype}")
  if block_2d:
    if x.ndim < 2:
      raise ValueError(f"2D (16x16) NVFP4 blocks need at least 2 dims, got shape {x.shape}")
    if rht:
      raise ValueError("RHT applies to 1x16 (column-wise) quantization only, not to 16x16 blocks")
    _check_block_dim(x.shape, x.ndim - 2)
    _check_block_dim(x.shape, x.ndim - 1)
    return x, None
  if x.ndim == 0:
    raise ValueError("cannot quantize a scalar")
  axis_n = axis % x.ndim
  _check_block_dim(x.shape, axis_n)
  return x, axis_n


def quantize_values(
    x, *, axis: int = -1, block_2d: bool = False, rht: bool = False, stochastic_key=None, dtype=jnp.bfloat16
):
  """``(block_values(t, dtype), t.amax)`` for ``t = quantize(x, ...)``, bit for bit, in one pass.

  The GEMM-side view of an operand that is used once: the E2M1 value times its block's E4M3 scale,
  computed from the codes directly, without the 4-bit packing and the ``float4 -> fp32`` decode
  (a software convert on XLA:CPU). Same arguments and errors as :func:`quantize`.
  """
  x, axis_n = _validate(x, axis, block_2d, rht)
  return _quantize_values_jit(x, stochastic_key, axis_n, block_2d, rht, jnp.dtype(dtype))


# ----------------------------------------------------------------------------------------------
# Dequantization and GEMM-side views
# ----------------------------------------------------------------------------------------------
def _expand_scale(t: NVFP4Tensor, s):
  if t.block_2d:
    return jnp.repeat(jnp.repeat(s, BLOCK, axis=-2), BLOCK, axis=-1)
  return jnp.repeat(s, BLOCK, axis=t.axis)


def global_decode_scale(t):
  """``amax / 2688`` in fp32: TE JAX's per-operand GEMM factor (``alpha`` is the product of two).

  ``t``: an NVFP4Tensor, or its amax (as returned by :func:`quantize_values`).
  """
  amax = t.amax if isinstance(t, NVFP4Tensor) else jnp.asarray(t, jnp.float32)
  # The true IEEE quotient. Not ``amax / 2688``: XLA's algebraic simplifier rewrites a division by a
  # constant as ``x * fl(1/constant)`` (1 ulp off for amax = 4.125), and XLA:GPU's division is itself
  # 1 ulp off for about a quarter of all quotients.
  return formats.div_rn(amax, np.float32(GLOBAL_DENOM))


def block_values(t: NVFP4Tensor, dtype=jnp.bfloat16):
  """``q * s8`` expanded to the data's shape, without the global scale.

  Exact in bf16: an E2M1 value (2 significant bits) times an E4M3 scale (4 bits) has at most 6
  significant bits and lies in [2**-10, 2688]. Feeding these to an ordinary GEMM with fp32 accumulation
  and multiplying the result by ``global_decode_scale(a) * global_decode_scale(b)`` is the Tensor-Core
  NVFP4 GEMM up to accumulation order.
  """
  v = t.data.astype(jnp.float32) * _expand_scale(t, t.scale.astype(jnp.float32))
  return v.astype(dtype)


@jax.jit(static_argnames=("dtype",))
def dequantize(t: NVFP4Tensor, dtype=jnp.float32):
  """TE JAX's dequantizer: ``float(q) * (float(s8) * (amax / 2688))``, in that order, cast to ``dtype``.

  Values stay in the RHT domain when ``t.rht`` (TE applies the inverse RHT separately; for a GEMM the
  two RHTs cancel, H being orthogonal). Exact in fp32 except where ``amax / 2688`` or the products fall
  in the fp32 subnormal range on a flush-to-zero backend (tensors with amax below ~1e-34).
  """
  g = _expand_scale(t, t.scale.astype(jnp.float32) * global_decode_scale(t))
  return (t.data.astype(jnp.float32) * g).astype(dtype)


# ----------------------------------------------------------------------------------------------
# TE byte layout
# ----------------------------------------------------------------------------------------------
def _e2m1_codes(data):
  """uint8 codes (bit 3 sign, bits 0-2 magnitude index) of E2M1 values."""
  v = data.astype(jnp.float32)
  idx = formats.grid_index(jnp.abs(v), E2M1).astype(jnp.uint8)
  sign = jnp.signbit(v).astype(jnp.uint8)
  return idx | (sign << 3)


def _codes_to_e2m1(codes):
  """uint8 codes (bit 3 sign, bits 0-2 magnitude index) -> ``float4_e2m1fn``, bit for bit.

  XLA:CPU converts f32 -> f4 in software (~40 ns/element on a loaded 2-core EPYC, 15x the rest of the
  quantizer). Packing the 4-bit codes two per byte and bitcasting uint8 -> f4 (XLA splits a byte
  low nibble first: even element in the low nibble, as TE's fp4x2) is exact and ~15x faster. The pair
  is combined as a tiny reduction (``c0 * 1 + c1 * 16``): strided ``[..., 0]``/``[..., 1]`` slices
  of a fused producer are ~8x slower on XLA:CPU. Odd last dimensions fall back to the convert.
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
