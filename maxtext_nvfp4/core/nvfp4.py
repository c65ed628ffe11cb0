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

Scale selection (the seam: :class:`ScaleRule`, one per quantized tensor, recorded on the result). The
formulas above are ``ScaleRule()``: TE's standard recipe, selection ``"max"`` (the block's amax maps to
E2M1's 6), E4M3 bound 448, one amax per tensor. The other rules are TE 2.20.2's PyTorch recipe variants,
as its bit-exact reference ``reference_nvfp4.py`` computes them (``_quantize_blockwise_reference`` and
``_quantize_blockwise_4over6_reference``):

  * ``e4m3_bound`` B in {448, 256}: ``S_enc = min(6B / amax, FLT_MAX)`` (TE ``nvfp4_e4m3_max``; 256 only
    with 4over6), and ``amax / 6B`` wherever ``amax / 2688`` appears (dequantization, GEMM alpha);
  * ``row_scaled``: one amax per row of the operand (the slice along the block axis: rows of x for the
    fprop copy, columns of x for the wgrad copy); every formula above then runs per row;
  * ``selection="4over6"`` (Four Over Six, arXiv 2512.02010), per block, in this order::

        base  = fl(fl(bamax / 6) * S_enc)                    # TE reference's order (not the 1/6 fold)
        s8_6  = rnd(min(base, 448), E4M3)     s8_4 = rnd(min(fl(base * 1.5), 448), E4M3)
        enc_c = min(fl(1 / fl(s8_c * S_dec)), FLT_MAX);  q_c = rnd(clip(fl(x * enc_c), -6, 6), E2M1)
        v_c   = fl(fl(fl(q_c * s8_c) * amax) / (6B))       # the candidate's value in x's units
        d_c   = fl(v_c - x);  e_c = |d_c| (MAE) or fl(d_c * d_c) (MSE)
        err_c = (((e_c[0] + e_c[1]) + e_c[2]) + ... + e_c[15])     # sequential, from 0, in fp32
        16x16 tiles: each row's err_c as above (along ``axis``), then the 16 rows summed as a tree
        ((r0..7 + r8..15) -> 4 -> 2 -> 1), as TE's CUDA warp reduction
        keep map-to-4 iff err_4 < err_6 (ties keep map-to-6)

    Bit-checkable against TE's reference wherever its fp32 error terms are normal numbers (XLA:GPU keeps
    subnormals: everywhere). On a flush-to-zero backend (XLA:CPU) a block whose error terms are fp32
    subnormals (|d_c| below ~1e-19 for MSE, or tiny tensors) may choose as TE's reference does on a
    flush-to-zero CPU (``torch.set_flush_denormal``) instead; for tensors with amax < 2**-100 (where TE's
    global decode scale is itself subnormal) the choice is not bit-checked on XLA:CPU. tests/peers counts
    both classes (``ftz``, ``ftz_tiny``).

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
the 4-bit packing. The per-tensor chain (S_enc, S_dec and the 127-entry encode table) costs nothing at run
time but is most of what XLA compiles per quantized tensor: its three quotients are integer arithmetic on
significands (:func:`formats.divide_significands`), with the constants' side folded on the host. ``benchmarks/profile_notes.md`` has the measurements.

XLA pitfalls handled here (each one changed golden bits before it was fixed): XLA:CPU compares with
denormals-are-zero (a subnormal amax tests ``== 0``; zero tests use the bits), flushes subnormal
operands of arithmetic and dots (exact integer/exponent paths, RHT of tiny groups at 2**64 scale), and
its algebraic simplifier rewrites ``x / constant`` as ``x * fl(1/constant)``; XLA:GPU divides with PTX
``div.full.f32``, 1 ulp off for about a quarter of all quotients (found on the H200). So every quotient
here, ``amax / 2688`` included, is :func:`formats.div_rn`: the IEEE quotient on every backend. ``dequantize`` is bit-exact with TE JAX's under jit.
Where fp32 arithmetic keeps subnormals (XLA:GPU, ``lax.platform_dependent`` branch ``cuda``) the element product
and the RHT's tiny-group upscale are plain products, and off CPU the SR bytes are hashed per element: the same
bits with fewer passes over memory (``tests/core/test_nvfp4_gpu_paths.py`` checks each against its other form).
There, too, the GEMM operands x, dy and W (``quantize_values`` 1x16 along the last axis, or with RHT along axis
0; ``quantize`` with RHT along axis 0 or in 16x16 tiles) are quantized by Pallas (Triton) kernels computing these formulas with these
helpers (:mod:`maxtext_nvfp4.core.nvfp4_triton`), under one ``vmap`` (MoE's experts) as one kernel over the
batch; under a second ``vmap`` and on other platforms, the code below.

Rounding never relies on float converts (XLA on GPU folds ``f32 -> e2m1 -> f32`` and ``f32 -> bf16 ->
f32`` round trips): E2M1, E4M3 and the bf16 rounding of the RHT output are explicit arithmetic/bit
rounding, so the values survive every XLA pass.

Non-finite input (TE's kernels turn NaN into ±6 and would hand finite numbers downstream; we do not):
  * a NaN anywhere makes ``amax`` the quiet NaN 0x7FC00000 on every path, hence every scale NaN and the whole
    dequantized tensor NaN (and every GEMM using it). ``data`` is then meaningless: every element is +6 (the
    encode scales are NaN, and NaN converts to +6 as in TE's ``cvt.rn.satfinite``); the NaN amax/scales carry
    the poison;
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

from maxtext_nvfp4.core import formats, nvfp4_triton, prng
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
    "ScaleRule",
    "STANDARD_RULE",
    "global_denominator",
    "E2M1_MAX",
    "E4M3_MAX",
    "NVFP4Tensor",
    "RHT_SIGNS",
    "as_numpy",
    "block_values",
    "dequantize",
    "dequantize_kernel_order",
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
E4M3_MAX = E4M3.max  # 448: the largest E4M3 value (the per-block scale's saturation bound)
# TE's fixed wgrad RHT sign vector (hadamard.py get_wgrad_sign_vector; bitmask 0xD7E8).
RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
# E2M1 value of each 4-bit code (bit 3 sign, bits 0-2 magnitude index): the decode table of float4_e2m1fn.
_E2M1_TABLE = np.concatenate([formats.grid(E2M1), -formats.grid(E2M1)])
# The 127 finite non-negative E4M3 values, in code order (the block decode scales' value table).
_E4M3_GRID = formats.grid(E4M3)


# ----------------------------------------------------------------------------------------------
# Scale selection (the seam)
# ----------------------------------------------------------------------------------------------
# Block-scale selections (cf. torchao mx_formats' ScaleCalculationMode): "max" -- TE's standard, the block
# amax maps to E2M1's 6; "4over6" -- the better of map-to-6 and map-to-4 per block (module docstring).
SELECTIONS = ("max", "4over6")
ERR_MODES = ("MAE", "MSE")
E4M3_BOUNDS = (448, 256)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScaleRule:
  """How one tensor's scales are chosen (hashable: a static argument of the jitted quantizer).

  Validated like TE's ``NVFP4QuantizerRef`` / ``make_quantizers``: ValueError for anything else.
  """

  # "max" (TE's standard) | "4over6" (per block, the lower-error of map-to-6 and map-to-4)
  selection: str = "max"
  # 4over6's block error: "MAE" | "MSE"
  err_mode: str = "MAE"
  # The E4M3 bound in S_enc = 6 * bound / amax: 448, or 256 (4over6 only; TE forces 448 otherwise)
  e4m3_bound: int = 448
  # One amax per row of the operand (along the block axis) instead of one per tensor (1x16 only)
  row_scaled: bool = False

  def __post_init__(self):
    if self.selection not in SELECTIONS:
      raise ValueError(f"ScaleRule.selection={self.selection!r}: choose one of {SELECTIONS}")
    if self.err_mode not in ERR_MODES:
      raise ValueError(f"ScaleRule.err_mode={self.err_mode!r}: choose one of {ERR_MODES}")
    if self.e4m3_bound not in E4M3_BOUNDS:
      raise ValueError(f"ScaleRule.e4m3_bound={self.e4m3_bound!r}: choose one of {E4M3_BOUNDS}")
    if self.e4m3_bound != 448 and self.selection != "4over6":
      raise ValueError("ScaleRule.e4m3_bound=256 needs selection='4over6' (TE uses 448 for every other tensor)")


STANDARD_RULE = ScaleRule()
# fl32(1 / (6 * bound)) per E4M3 bound: host constants (1/2688 for 448, 1/1536 for 256), each rounded once.
RECIP_GLOBAL_DENOMINATOR = {b: np.float32(1.0) / np.float32(E2M1_MAX * b) for b in E4M3_BOUNDS}


def global_denominator(bound: int = E4M3_MAX) -> int:
  """``6 * bound``: what a tensor's amax is divided by for its global decode scale (2688 for 448)."""
  return E2M1_MAX * int(bound)


def _check_rule(rule: ScaleRule, block_2d: bool, rht: bool, stochastic: bool) -> None:
  """TE's refusals for a rule on one quantization (``NVFP4QuantizerRef.__init__`` / ``_quantize``)."""
  if rule.selection == "4over6" and rht:
    raise ValueError("4over6 quantization does not support RHT (TE: 'NVFP4 4over6 quantization does not support RHT')")
  if rule.selection == "4over6" and stochastic:
    raise ValueError("4over6 quantization does not support stochastic rounding (as in TE)")
  if rule.row_scaled and block_2d:
    raise ValueError("row-scaled NVFP4 supports 1x16 blocks only (as in TE), not 16x16 tiles")


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
  m = jnp.where(is_sub, formats.copysign(mant, v), v)
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


def _recip_normal(s):
  """Correctly rounded ``fl(1 / s)`` for a positive normal fp32 ``s`` (or NaN: NaN), subnormal results included:
  ``s``'s significand and exponent straight from its bits into :func:`formats.divide_significands`.

  Not ``1.0 / s``: XLA:GPU's fp32 division is 1 ulp off for about a quarter of all inputs.
  """
  sb = _bits(s)
  ms = ((sb & _F32_MANT_MASK) | 0x00800000).astype(jnp.int32)
  q, r, k = formats.divide_significands(1 << 23, ms)
  recip = _from_bits(formats.quotient_bits(q, r, ms, 150 - ((sb >> 23) & 0xFF).astype(jnp.int32) - k))
  return jnp.where(jnp.isnan(s), s, recip)


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
  k = jax.random.bits(prng.resolve(key), (2,), jnp.uint32)
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
_RHT_TINY = 2.0**-60
_RHT_UP = 64


def _rht_entry(r: int, c):
  """``rht_matrix()[r, c]``: a literal for a Python int ``c``; for a traced int32 ``c`` (a kernel's loop index)
  from its bits, ``s_r * (-1)**popcount(r & c) / 4``."""
  if isinstance(c, int):
    return _RHT_M[r, c]
  neg = (lax.population_count(c & np.int32(r)) & 1) == (0 if RHT_SIGNS[r] < 0 else 1)
  return jnp.where(neg, np.float32(-0.25), np.float32(0.25))


def _rht16_column(rows, c):
  """``y[c] = (...((x[0] m[0, c] + x[1] m[1, c]) + x[2] m[2, c]) + ...) + x[15] m[15, c]`` with ``m =
  rht_matrix()``: column ``c`` of the RHT of 16 fp32 arrays of one shape (a group's 16 elements, elementwise),
  the sums left to right: the Triton kernels' RHT (:mod:`nvfp4_triton`). Equal to :func:`_rht16` wherever the
  result does not depend on the order of the sums (the RHT's contract, below)."""
  return sum((x * _rht_entry(r, c) for r, x in enumerate(rows[1:], 1)), rows[0] * _rht_entry(0, c))


def _rht16(xb, axis):
  """``y[c] = sum_r x[r] * s_r H16[r, c] / 4`` along the 16-long ``axis`` of the blocked fp32 ``xb``.

  Written as a broadcast product and a 16-term sum (an XLA reduce over ``axis``): one fused pass, no
  transposes. Each product is exact (a sign and a power of two), as with the ±0.25 matrix entries,
  so nothing can overflow where the result does not; the 16-term fp32 sum runs in XLA's reduction order.
  On XLA:CPU this is ~2x faster than 4 add/subtract butterfly stages (each one a materialized pass) and
  than a K=16 matmul plus the transpose back; 16 explicit left-to-right sums stacked back compile to 3x the
  kernels on XLA:CPU and gave Inf there for test_extreme_magnitudes' input, whose sums are finite
  (2026-12-04). The golden contract is unaffected: RHT cases use inputs whose bf16 result does not depend on the
  fp32 accumulation order (the tensor-core MMA's is unspecified).
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


def _rht_round_back(y, tiny, rint=jnp.round):
  """The RHT sums ``y`` (tiny groups at 2**64 scale) rounded once to bf16 at their true size (``rint``: round
  half to even, a Triton kernel's own form)."""
  # Back to the true size with ONE bf16 rounding. Normal results: bf16 rounding commutes with the
  # power-of-two scale. Results below 2**-126: the bf16 subnormal grid is N * 2**-133 (fp32 bits N << 16),
  # i.e. N = RNE(|y'| * 2**(133 - 64)) in the scaled domain, composed from bits (no subnormal arithmetic).
  y_norm = round_to_bf16(y)
  y_norm = jnp.where(tiny, y_norm * np.float32(2.0**-_RHT_UP), y_norm)
  n_sub = rint(jnp.abs(y) * np.float32(2.0 ** (133 - _RHT_UP))).astype(jnp.uint32)
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


def quantize(x, *, axis: int = -1, block_2d: bool = False, rht: bool = False, stochastic_key=None,
             scale_rule: ScaleRule | None = None) -> NVFP4Tensor:
  """Quantize ``x`` to NVFP4 exactly as TE's kernels do (see the module docstring for the formulas).

  Args:
    x: bf16 or fp32 array. fp32 values are used as given (TE's fallback kernel); bf16 is what the
      optimized kernels take.
    axis: the 1x16 block axis (the GEMM contraction axis). Ignored when ``block_2d``.
    block_2d: 16x16 tiles over the last two axes (TE's weight path, ``NVFP4_2D_SCALING``).
    rht: apply TE's 16-point RHT along ``axis`` first (the wgrad operands); the amax is then the
      post-RHT amax and the result stays in the RHT domain.
    stochastic_key: a ``jax.random`` key (or a :class:`prng.FoldedKey`) for stochastic rounding of the
      elements (gradients); ``None`` means RNE.
    scale_rule: how the scales are chosen (:class:`ScaleRule`; None: TE's standard rule). With 16x16
      tiles and 4over6, ``axis`` is the axis along which each tile row's error is summed (TE's rowwise
      copy of a matrix: the last axis; its columnwise copy: axis 0).

  Raises:
    TypeError: non-floating input.
    ValueError: a block axis whose length is not a multiple of 16; a rule TE refuses here (4over6 with
      RHT or SR, row-scaled 16x16 tiles).
  """
  x, axis_n, rule = _validate(x, axis, block_2d, rht, scale_rule, stochastic_key is not None)
  if rule is None:
    return _quantize_jit(x, stochastic_key, axis_n, block_2d, rht)
  return _quantize_jit(x, stochastic_key, axis_n, block_2d, rht, rule)


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


def _block_amaxes(xb, red, rule: ScaleRule = STANDARD_RULE, nb_axis: int | None = None):
  """(amax, bamax) of the blocked fp32 ``xb``: block maxima (keeping the block dims) and the amax that sets
  the global scale (a scalar; row-scaled: per row, the max over the blocks axis ``nb_axis``, kept)."""
  abs_bits = (_bits(xb) & _F32_ABS_MASK).astype(jnp.int32)  # integer max: exact, NaN-propagating
  bamax_bits = jnp.max(abs_bits, axis=red, keepdims=True)
  # The tensor amax from the block maxima (1/16 of the data). Without the barrier XLA merges the two
  # reductions into one over the whole tensor, which XLA:CPU runs as a reduce-window tree over a
  # materialized int32 copy of it (an extra read and write of 4 bytes per element).
  if rule.row_scaled:
    amax = _from_bits(jnp.max(formats.canonical_nan_bits(lax.optimization_barrier(bamax_bits)), axis=nb_axis,
                               keepdims=True))
  else:
    amax = _from_bits(jnp.max(formats.canonical_nan_bits(lax.optimization_barrier(bamax_bits))))
  return amax, _from_bits(bamax_bits)


def _global_scales(amax, bound: int = E4M3_MAX):
  """(S_enc, S_dec) for ``amax`` (CUDA compute_global_encode_scaling_factor_FP4, with 6 * bound).

  Both quotients exact from integer significands (:func:`formats.divide_significands`): S_enc = 6B / amax is
  normal or overflows (to FLT_MAX: amax subnormal or tiny), never subnormal (amax <= FLT_MAX); S_dec = 1 / S_enc
  may be subnormal (S_enc > 2**126).
  """
  mb, eb = formats.significand(amax)
  amax_is_zero = mb == 0  # a subnormal amax is not zero (its S_enc is FLT_MAX, not 1): from the significand
  ma, ea = formats.host_significand(global_denominator(bound))
  # amax == 0 is answered below; the division gets mb >= 1 to stay defined. (quotient_bits takes the raw mb: with
  # the clamped one XLA:CPU fused the chain into more consumers, 560 -> 820 compiled instructions.)
  q, r, k = formats.divide_significands(ma, jnp.maximum(mb, 1))
  s_enc = _from_bits(formats.quotient_bits(q, r, mb, ea - eb - k + 23, subnormals=False, saturate=True))
  s_enc = jnp.where(amax_is_zero | jnp.isinf(amax), np.float32(1.0), s_enc)  # 6B / inf = 0: 1 as well
  s_enc = jnp.where(jnp.isnan(amax), amax, s_enc)  # NaN input poisons every scale (documented)
  return s_enc, _recip_normal(s_enc)  # S_enc is a positive normal number here (or NaN)


def _block_scale_factor(s_enc):
  """``fl(S_enc * fl(1/6))``: what a block's amax is multiplied by for its E4M3 decode scale (TE's order)."""
  return s_enc * np.float32(np.float32(1.0) / np.float32(6.0))


def _encode_from_e4m3_parts(k8, j8, s_dec):
  """``min(fl(1 / fl(s8 * S_dec)), FLT_MAX)`` for ``s8 = k8 * 2**j8`` (``k8`` a 4-bit integer: E4M3 has 4
  significant bits; 0 for s8 = 0) and a non-NaN ``S_dec > 0``, from integers (exact for subnormal S_dec and
  products):

      S_dec = Md * 2**jd                      (Md < 2**24)
      p = fl(k8 * Md * 2**(j8 + jd))          RNE to 24 bits, or onto fp32's subnormal grid 2**-149
      enc = fl(1 / p)                         p's significand straight into divide_significands; a zero
                                              product (s8 = 0, or p below 2**-150) or 1/p > FLT_MAX: FLT_MAX
  """
  db = _bits(s_dec)
  de = ((db >> 23) & 0xFF).astype(jnp.int32)
  frac = (db & _F32_MANT_MASK).astype(jnp.int32)
  md = jnp.where(de == 0, frac, frac | 0x00800000)
  prod = k8 * md  # < 2**28
  exp = j8 + jnp.where(de == 0, -149, de - 150)
  shift = jnp.clip(jnp.maximum(8 - lax.clz(prod), -149 - exp), 0, 31)  # 32 - clz = the product's bit count
  kept = prod >> shift
  rem = prod - (kept << shift)
  half = (jnp.int32(1) << shift) >> 1
  kept = kept + ((rem > half) | ((rem == half) & (shift > 0) & ((kept & 1) == 1))).astype(jnp.int32)
  # p = kept * 2**(exp + shift), kept <= 2**24; its significand normalized to [2**23, 2**24): mp * 2**(ep - 23).
  n = 32 - lax.clz(kept)
  mp = jnp.where(n > 24, kept >> 1, kept << jnp.maximum(24 - n, 0))
  ep = exp + shift + n - 1
  q, r, k = formats.divide_significands(1 << 23, jnp.maximum(mp, 1))  # p == 0: answered below (as mb above)
  enc = _from_bits(formats.quotient_bits(q, r, mp, -ep - k + 23, saturate=True))
  return jnp.where(kept == 0, np.float32(FLT_MAX), enc)


def _e4m3_parts(s8):
  """(k8, j8) with ``s8 = k8 * 2**j8`` for a non-negative fp32 ``s8`` on the E4M3 grid (k8 = 0 for 0)."""
  sb = _bits(s8)
  se = ((sb >> 23) & 0xFF).astype(jnp.int32)
  k8 = (((sb & _F32_MANT_MASK) | 0x00800000) >> 20).astype(jnp.int32)
  return jnp.where(se == 0, 0, k8), se - 130


# E4M3 grid as (k8, j8) host constants: the encode table's products need no bit work on s8.
_E4M3_K8 = np.array([int(v * 2.0 ** (3 - np.floor(np.log2(v)))) if v else 0 for v in _E4M3_GRID], np.int32)
_E4M3_J8 = np.array([int(np.floor(np.log2(v))) - 3 if v else 0 for v in _E4M3_GRID], np.int32)


def _encode_scales(s8, s_dec):
  """``min(fl(1 / fl(s8 * S_dec)), FLT_MAX)`` per block (IEEE 1/0 = inf for a zero-scale block, and
  1/subnormal overflows: both end at FLT_MAX). A scalar S_dec: the exact quotient is taken once per E4M3
  value (a 127-entry table) and looked up by s8's code, so no per-block division; a per-row S_dec
  (row-scaled): one exact quotient per block (1/16 of the data)."""
  if jnp.ndim(s_dec) == 0:
    table = _encode_from_e4m3_parts(_E4M3_K8, _E4M3_J8, jnp.where(jnp.isnan(s_dec), 1.0, s_dec))
    enc = jnp.where(jnp.isnan(s_dec), s_dec, table)[_e4m3_code(s8)]
  else:
    k8, j8 = _e4m3_parts(jnp.where(jnp.isnan(s8), 0.0, s8))
    enc = _encode_from_e4m3_parts(k8, j8, jnp.where(jnp.isnan(s_dec), 1.0, s_dec))
    enc = jnp.where(jnp.isnan(s_dec), s_dec, enc)
  return jnp.where(jnp.isnan(s8), s8, enc)


def _block_scales(xb, red, rule: ScaleRule = STANDARD_RULE, nb_axis: int | None = None):
  """(amax, s8, enc) of the blocked fp32 ``xb`` under TE's standard selection (blocks along the axes
  ``red``; s8/enc keep those dims)."""
  amax, bamax = _block_amaxes(xb, red, rule, nb_axis)
  s_enc, s_dec = _global_scales(amax, rule.e4m3_bound)
  # Per-block decode scale, E4M3: fl(bamax * fl(S_enc * fl(1/6))), saturated to 448, RNE.
  dec = jnp.minimum(_mul_exact(bamax, _block_scale_factor(s_enc)), np.float32(E4M3_MAX))
  s8 = round_to_format(dec, E4M3)
  return amax, s8, _encode_scales(s8, s_dec)


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


def _e2m1_code_of_product(xb, enc, u=None, *, product=None, rint=jnp.round):
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
  ``product`` (x's bits, enc) -> ``fl(|x| * enc)`` and ``rint``: a Triton kernel's forms (default: per platform).
  """
  b = _bits(xb)
  # Where fp32 keeps subnormals (XLA:GPU) the plain product is the same fl(|x| * enc); the flush-to-zero
  # select cost the GPU a full-size pred array (XLA fused it into the block-amax reduce as a second output:
  # 1 B/element written and read back; H200 compile, 2026-12-01).
  if product is None:
    y = lax.platform_dependent(b, enc, cuda=_abs_times_enc_ieee, default=_abs_times_enc_flush_to_zero_safe)
  else:
    y = product(b, enc)
  a = formats.min_nan(y, np.float32(E2M1_MAX))  # NaN stays NaN
  k = formats.grid_index(a, E2M1, u, rint=rint)
  nan = jnp.isnan(a)
  k = jnp.where(nan, np.float32(7.0), k)
  neg = ((b >> 31) == 1) & ~nan
  return k, neg


def _select_max(xb, red, u, rule: ScaleRule, nb_axis, err_axis):
  """TE's standard selection: (k, neg, s8, amax) with s8 from the block amax (module docstring)."""
  del err_axis
  amax, s8, enc = _block_scales(xb, red, rule, nb_axis)
  k, neg = _e2m1_code_of_product(xb, enc, u)
  return k, neg, s8, amax


# 4over6's map-to-4 scale factor (TE reference: decode_scale_base * 1.5).
_MAP4_FACTOR = np.float32(1.5)


def _four_over_six_element_error(xb, k, neg, s8, amax, rule: ScaleRule):
  """Per-element error of one 4over6 candidate (codes ``k``/``neg``, scales ``s8``), in TE's order:
  ``d = fl(fl(fl(fl(q * s8) * amax) / 6B) - x)``, then ``|d|`` (MAE) or ``fl(d * d)`` (MSE)."""
  q = formats.grid_value(k, E2M1)
  q = jnp.where(neg, -q, q)
  w = (q * s8) * amax  # q * s8 is exact (2 x 4 significant bits)
  val = formats.div_rn(jnp.abs(w), np.float32(global_denominator(rule.e4m3_bound)))
  val = jnp.where(jnp.signbit(w), -val, val)
  d = val - xb
  return d * d if rule.err_mode == "MSE" else jnp.abs(d)


def _four_over_six_block_error(e, red, err_axis):
  """Block sums of the element errors ``e``: sequential over the 16 elements along ``err_axis`` (a blocked
  axis of ``red``), from 0; with 16x16 tiles the 16 row sums then added as TE's warp-reduction tree
  ((r0..7 + r8..15) -> 4 -> 2 -> 1). Keeps the block dims (size 1)."""
  err = jnp.zeros_like(lax.index_in_dim(e, 0, err_axis, keepdims=True))
  for i in range(BLOCK):  # sequential: fl(...fl(fl(0 + e0) + e1)... + e15), no reassociation
    err = err + lax.index_in_dim(e, i, err_axis, keepdims=True)
  other = [r for r in red if r != err_axis]
  if other:  # 16x16 tiles: the tree over the 16 rows (8 + 8 -> 4 + 4 -> 2 + 2 -> 1 + 1)
    ax = other[0]
    n = BLOCK
    while n > 1:
      n //= 2
      err = lax.slice_in_dim(err, 0, n, axis=ax) + lax.slice_in_dim(err, n, 2 * n, axis=ax)
  return err


def _select_four_over_six(xb, red, u, rule: ScaleRule, nb_axis, err_axis):
  """4over6 (TE reference ``_quantize_blockwise_4over6_reference``): (k, neg, s8, amax), see the module docstring."""
  del u  # RNE only (SR is refused)
  amax, bamax = _block_amaxes(xb, red, rule, nb_axis)
  s_enc, s_dec = _global_scales(amax, rule.e4m3_bound)
  # base = fl(fl(bamax / 6) * S_enc): the reference's order. bamax / 6 may be subnormal (exact quotient);
  # _mul_exact takes it, and results below 2**-126 round to E4M3 zero either way.
  base = _mul_exact(formats.div_rn(bamax, np.float32(E2M1_MAX)), s_enc)
  cands = []
  for dec in (base, base * _MAP4_FACTOR):  # map-to-6, map-to-4
    s8 = round_to_format(jnp.minimum(dec, np.float32(E4M3_MAX)), E4M3)
    k, neg = _e2m1_code_of_product(xb, _encode_scales(s8, s_dec))
    e = _four_over_six_element_error(xb, k, neg, s8, amax, rule)
    cands.append((k, neg, s8, _four_over_six_block_error(e, red, err_axis)))
  (k6, n6, s6, e6), (k4, n4, s4, e4) = cands
  pick4 = e4 < e6  # ties keep map-to-6
  pick4_elems = jnp.broadcast_to(pick4, xb.shape) if pick4.shape != xb.shape else pick4
  # With 16x16 tiles the error reduced every tile axis; s8 has the same kept dims.
  return (jnp.where(pick4_elems, k4, k6), jnp.where(pick4_elems, n4, n6),
          jnp.where(pick4, s4, s6), amax)


# The scale-selection seam: ScaleRule.selection -> (xb, red, u, rule, nb_axis, err_axis) -> (k, neg, s8, amax).
_SCALE_SELECTIONS = {"max": _select_max, "4over6": _select_four_over_six}


def _quantize_parts(x, stochastic_key, axis_n, block_2d, rht, rule: ScaleRule | None = None):
  """(k, neg, s8, amax, red): the blocked E2M1 codes and block scales of x (arguments validated).

  ``axis_n`` with ``block_2d``: None, or (4over6) the axis along which each tile row's error is summed.
  """
  rule = STANDARD_RULE if rule is None else rule
  if rht:
    # Materialize the RHT output once: otherwise XLA:CPU fuses its elementwise tail into both consumers
    # (block amax and element path) and recomputes it there, 4x slower overall.
    xf = _to_f32_exact(lax.optimization_barrier(_rht_bf16(x, axis_n)))
  else:
    xf = _to_f32_exact(x)
  xb, red = _blocked(xf, None if block_2d else axis_n, block_2d)
  u = None
  if stochastic_key is not None:
    # Bits drawn over the unblocked shape (its last axis is long): a blocked shape ending in 16 would
    # make the uint32 words' axis 4 long, ~4x slower on XLA:CPU for the same bits.
    u = _random_bytes(stochastic_key, xf.shape).reshape(xb.shape).astype(jnp.float32) * np.float32(1.0 / 256.0)
  nb_axis = None if block_2d else axis_n  # the blocks axis of a 1x16 layout (row-scaled amax)
  if block_2d:  # 4over6: error summed along the tile's row axis (last axis by default)
    err_axis = red[0] if axis_n == x.ndim - 2 else red[1]
  else:
    err_axis = red[0]
  k, neg, s8, amax = _SCALE_SELECTIONS[rule.selection](xb, red, u, rule, nb_axis, err_axis)
  return k, neg, s8, amax, red


def _quantize_impl(x, stochastic_key, axis_n, block_2d, rht, rule: ScaleRule | None = None):
  """The traced body of :func:`quantize` (arguments already validated; ``axis_n`` non-negative)."""
  xla = lambda x: _quantize_xla(x, stochastic_key, axis_n, block_2d, rht, rule)  # noqa: E731
  layout = nvfp4_triton.codes_layout_of(x, axis_n, block_2d, rht, rule) if stochastic_key is None else None
  if layout is not None:
    # XLA:GPU: the RHT x operand of wgrad and W's 16x16 tiles as Triton kernels, the same bits (nvfp4_triton).
    kernel = lambda x, **kw: _quantize_triton(x, layout, **kw)  # noqa: E731
    return lax.platform_dependent(x, cuda=lambda x: _kernel_unless_vmapped(kernel, xla, x), default=xla)
  return xla(x)


def _quantize_xla(x, stochastic_key, axis_n, block_2d, rht, rule: ScaleRule | None = None):
  k, neg, s8, amax, red = _quantize_parts(x, stochastic_key, axis_n, block_2d, rht, rule)
  codes = (k.astype(jnp.uint8) | (neg.astype(jnp.uint8) << 3)).reshape(x.shape)
  data = _codes_to_e2m1(codes)
  scale = jnp.squeeze(s8, axis=red).astype(jnp.float8_e4m3fn)
  rule = STANDARD_RULE if rule is None else rule
  if rule.row_scaled:  # one amax per row: x's shape with the block axis reduced to 1
    amax = amax.reshape(x.shape[:axis_n] + (1,) + x.shape[axis_n + 1:])
  return NVFP4Tensor(data=data, scale=scale, amax=amax, axis=None if block_2d else axis_n, block_2d=block_2d,
                     rht=rht, e4m3_bound=rule.e4m3_bound)


def _quantize_values_impl(x, stochastic_key, axis_n, block_2d, rht, dtype, rule: ScaleRule | None = None):
  xla = lambda x, key=stochastic_key: _quantize_values_xla(x, key, axis_n, block_2d, rht, dtype, rule)  # noqa: E731
  layout = nvfp4_triton.layout_of(x, axis_n, block_2d, rht, rule)
  if layout is not None:
    # XLA:GPU: Pallas (Triton) kernels after the amax, the same bits (nvfp4_triton's docstring).
    kernel = lambda x, *key, **kw: _quantize_values_triton(x, dtype, layout, *key, **kw)  # noqa: E731
    keys = () if stochastic_key is None else (stochastic_key,)
    return lax.platform_dependent(x, cuda=lambda x: _kernel_unless_vmapped(kernel, xla, x, *keys), default=xla)
  return xla(x)


def _kernel_unless_vmapped(kernel, xla, *args):
  """``kernel(x, *key)``; under one ``vmap`` of x (batched GEMMs: MoE experts) ``kernel(..., batched=True)``,
  one amax and one SR key per slice, as ``vmap(xla)`` has them; under a second ``vmap`` (per-block amaxes:
  TE's amax scope) or one of the key alone, ``xla`` vmapped: the XLA form of the same quantization."""

  def rule(in_batched, x, *key):
    vxla = _vmapped(xla, in_batched)
    if not in_batched[0] or nvfp4_triton.explicitly_sharded(x):  # the key alone batched; a sharded batch type
      return vxla(x, *key)
    key_leaves = jax.tree_util.tree_leaves(in_batched[1:])
    key_batched = any(key_leaves)
    if key_batched and not all(key_leaves):  # a FoldedKey's start key shared, its fold data per slice
      key = jax.tree_util.tree_map(lambda a, b: a if b else jnp.broadcast_to(a, x.shape[:1] + a.shape), key,
                                   tuple(in_batched[1:]))
    once = lambda x, *key: kernel(x, *key, batched=True, key_batched=key_batched)  # noqa: E731
    return _with_vmap_rule(once, lambda inner, *a: _vmapped(vxla, inner)(*a), x, *key)

  return _with_vmap_rule(kernel, rule, *args)


def _vmapped(fn, in_batched):
  return jax.vmap(fn, in_axes=tuple(jax.tree_util.tree_map(lambda b: 0 if b else None, b) for b in in_batched))


def _with_vmap_rule(fn, rule, *args):
  """``fn(*args)`` whose ``vmap`` is ``rule(in_batched, *batched_args)`` (every output batched)."""
  wrapped = jax.custom_batching.custom_vmap(fn)

  @wrapped.def_vmap
  def _batched(axis_size, in_batched, *batched_args):  # pylint: disable=unused-variable
    del axis_size
    out = rule(in_batched, *batched_args)
    return out, jax.tree_util.tree_map(lambda _: True, out)

  return wrapped(*args)


def _triton_formulas():
  return nvfp4_triton.Formulas(
      global_scales=_global_scales, block_scale_factor=_block_scale_factor, mul_exact=_mul_exact,
      e4m3_parts=_e4m3_parts,
      encode_from_e4m3_parts=_encode_from_e4m3_parts, e2m1_code=_e2m1_code_of_product,
      plain_product=_abs_times_enc_ieee, safe_product=_abs_times_enc_flush_to_zero_safe,
      rht_upscale_ieee=_rht_upscale_ieee, rht_upscale_safe=_rht_upscale_flush_to_zero_safe,
      rht_round_back=_rht_round_back, rht16_column=_rht16_column, rht_tiny=_RHT_TINY, hash32=_lowbias32,
      e4m3_max=E4M3_MAX, e4m3_code=_e4m3_code)


def _quantize_values_triton(x, dtype, layout, stochastic_key=None, **kw):
  """:func:`nvfp4_triton.quantize_values` with this module's formulas (``kw``: flush_to_zero_safe, interpret)."""
  return nvfp4_triton.quantize_values(x, dtype, layout, stochastic_key, formulas=_triton_formulas(), **kw)


def _quantize_triton(x, layout=nvfp4_triton.COLS_RHT, *, key_batched: bool = False, **kw):
  """:func:`quantize`'s NVFP4Tensor from :func:`nvfp4_triton.quantize_codes` (``kw``: batched, as above; RNE:
  no key)."""
  del key_batched
  packed, scale_bytes, amax = nvfp4_triton.quantize_codes(x, layout, formulas=_triton_formulas(), **kw)
  data = lax.bitcast_convert_type(packed, jnp.float4_e2m1fn).reshape(x.shape)
  scale = lax.bitcast_convert_type(scale_bytes, jnp.float8_e4m3fn)
  tiles = layout == nvfp4_triton.TILES_2D
  return NVFP4Tensor(data=data, scale=scale, amax=amax, axis=None if tiles else 0, block_2d=tiles, rht=not tiles,
                     e4m3_bound=E4M3_MAX)


def _quantize_values_xla(x, stochastic_key, axis_n, block_2d, rht, dtype, rule: ScaleRule | None = None):
  k, neg, s8, amax, _ = _quantize_parts(x, stochastic_key, axis_n, block_2d, rht, rule)
  mag = formats.grid_value(k, E2M1)
  v = formats.negate_where(mag, neg) * s8
  if rule is not None and rule.row_scaled:
    amax = amax.reshape(x.shape[:axis_n] + (1,) + x.shape[axis_n + 1:])
  return v.astype(dtype).reshape(x.shape), amax


# One compiled program per (shape, dtype, mode): eager op-by-op dispatch of the ~100 small ops above
# costs seconds of compilation per new shape. Inside an outer jit this simply inlines.
_quantize_jit = jax.jit(_quantize_impl, static_argnums=(2, 3, 4, 5))
_quantize_values_jit = jax.jit(_quantize_values_impl, static_argnums=(2, 3, 4, 5, 6))


def _validate(x, axis, block_2d, rht, rule: ScaleRule | None = None, stochastic: bool = False):
  """Checks shared by :func:`quantize` and :func:`quantize_values`; returns (x, axis_n, rule).

  ``rule`` comes back None for TE's standard rule (the jitted functions' default: same cache entries and
  programs as before rules existed). ``axis_n`` is None for 16x16 tiles unless the rule is 4over6.
  """
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"NVFP4 quantize needs a floating-point array (bf16 or fp32), got dtype {x.dtype}")
  if rule is not None:
    if not isinstance(rule, ScaleRule):
      raise TypeError(f"scale_rule must be a ScaleRule, got {type(rule).__name__}")
    _check_rule(rule, block_2d, rht, stochastic)
    if rule == STANDARD_RULE:
      rule = None
  if block_2d:
    if x.ndim < 2:
      raise ValueError(f"2D (16x16) NVFP4 blocks need at least 2 dims, got shape {x.shape}")
    if rht:
      raise ValueError("RHT applies to 1x16 (column-wise) quantization only, not to 16x16 blocks")
    _check_block_dim(x.shape, x.ndim - 2)
    _check_block_dim(x.shape, x.ndim - 1)
    if rule is not None and rule.selection == "4over6":
      axis_n = axis % x.ndim
      if axis_n < x.ndim - 2:
        raise ValueError(f"4over6 with 16x16 tiles sums the error along one of the last two axes, got axis {axis}")
      return x, axis_n, rule
    return x, None, rule
  if x.ndim == 0:
    raise ValueError("cannot quantize a scalar")
  axis_n = axis % x.ndim
  _check_block_dim(x.shape, axis_n)
  return x, axis_n, rule


def quantize_values(
    x, *, axis: int = -1, block_2d: bool = False, rht: bool = False, stochastic_key=None, dtype=jnp.bfloat16,
    scale_rule: ScaleRule | None = None,
):
  """``(block_values(t, dtype), t.amax)`` for ``t = quantize(x, ...)``, bit for bit, in one pass.

  The GEMM-side view of an operand that is used once: the E2M1 value times its block's E4M3 scale,
  computed from the codes directly, without the 4-bit packing and the ``float4 -> fp32`` decode
  (a software convert on XLA:CPU). Same arguments and errors as :func:`quantize`.
  """
  x, axis_n, rule = _validate(x, axis, block_2d, rht, scale_rule, stochastic_key is not None)
  if rule is None:
    return _quantize_values_jit(x, stochastic_key, axis_n, block_2d, rht, jnp.dtype(dtype))
  return _quantize_values_jit(x, stochastic_key, axis_n, block_2d, rht, jnp.dtype(dtype), rule)


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

  ``t``: an NVFP4Tensor (its own bound is used), or its amax (as returned by :func:`quantize_values`).
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
  v = t.data.astype(jnp.float32) * _expand_scale(t, t.scale.astype(jnp.float32))
  return v.astype(dtype)


@jax.jit(static_argnames=("dtype",))
def dequantize(t: NVFP4Tensor, dtype=jnp.float32):
  """TE JAX's dequantizer: ``float(q) * (float(s8) * (amax / 2688))``, in that order, cast to ``dtype``.

  Values stay in the RHT domain when ``t.rht`` (TE applies the inverse RHT separately; for a GEMM the
  two RHTs cancel, H being orthogonal). Exact in fp32 except where ``amax / 2688`` or the products fall
  in the fp32 subnormal range on a flush-to-zero backend (tensors with amax below ~1e-34).
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
