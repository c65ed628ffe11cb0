"""The NVFP4 quantizer's formulas, as Transformer Engine computes them: every implementation calls these.

They reproduce what TE's CUDA kernels (``transformer_engine/common/cast/nvfp4/*.cuh``) and TE's bit-exact
PyTorch reference (``pytorch/custom_recipes/reference_nvfp4.py``) compute; TE's own pure-JAX quantizer is
*not* the reference (it uses another operation order and its ``reduce_precision`` line produces NaN scales).

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
             (stochastic rounding instead of RNE when a key is given: random_bits.py)

``rnd(v, F)`` is :func:`maxtext_nvfp4.core.formats.round_to_format` (RNE onto format F's grid). The
element path computes ``q``'s E2M1 code directly with :func:`~maxtext_nvfp4.core.formats.grid_index`,
the same rounding expressed as grid indices (tests check both against ``ml_dtypes`` casts).

Scale rules (:class:`ScaleRule`, one per quantized tensor, recorded on the result). The formulas above are
:data:`STANDARD_RULE`: TE's standard recipe, selection ``"max"`` (the block's amax maps to E2M1's 6), E4M3
bound 448, one amax per tensor. The other rules are TE 2.20.2's PyTorch recipe variants, as its bit-exact
reference computes them (``_quantize_blockwise_reference`` and ``_quantize_blockwise_4over6_reference``):

  * ``e4m3_bound`` B in {448, 256}: ``S_enc = min(6B / amax, FLT_MAX)`` (TE ``nvfp4_e4m3_max``; 256 only
    with 4over6), and ``amax / 6B`` wherever ``amax / 2688`` appears (dequantization, GEMM alpha);
  * ``row_scaled``: one amax per row of the operand (the slice along the block axis: rows of x for the
    fprop copy, columns of x for the wgrad copy); every formula above then runs per row;
  * ``selection="4over6"`` (Four Over Six, arXiv 2512.02010), per block (the XLA form, ``xla.py``)::

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
since the tensor-core MMA order is unspecified), on every backend, including inputs whose fp32
intermediates are subnormal (XLA:CPU flushes fp32 subnormals to zero; every step here that can meet one is
exact integer/exponent arithmetic instead). Stochastic rounding matches TE only in distribution
(random_bits.py).

Every quotient is integer arithmetic on significands (:func:`formats.divide_significands`) or
:func:`formats.div_rn`, never ``/``: XLA:GPU divides with PTX ``div.full.f32`` (1 ulp off for about a
quarter of all quotients) and XLA's algebraic simplifier rewrites ``x / constant`` as ``x * fl(1/constant)``.
Rounding never relies on float converts (XLA on GPU folds ``f32 -> e2m1 -> f32`` round trips): E2M1 and
E4M3 rounding are explicit arithmetic, so the values survive every XLA pass.

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

import jax.numpy as jnp
import numpy as np
from jax import lax

from maxtext_nvfp4.core import formats
from maxtext_nvfp4.core.formats import E2M1, E4M3, FLT_MAX
from maxtext_nvfp4.core.formats import F32_ABS_MASK as _F32_ABS_MASK
from maxtext_nvfp4.core.formats import F32_EXP_MASK as _F32_EXP_MASK
from maxtext_nvfp4.core.formats import F32_MANT_MASK as _F32_MANT_MASK
from maxtext_nvfp4.core.formats import bits as _bits
from maxtext_nvfp4.core.formats import from_bits as _from_bits
from maxtext_nvfp4.core.formats import pow2 as _pow2

BLOCK = 16
E2M1_MAX = E2M1.max  # 6
E4M3_MAX = E4M3.max  # 448: the largest E4M3 value (the per-block scale's saturation bound)
# The 127 finite non-negative E4M3 values, in code order (the block decode scales' value table).
E4M3_GRID = formats.grid(E4M3)


# ----------------------------------------------------------------------------------------------
# The scale rule
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


# TE's standard recipe: the only way the package says it (the public API's ``scale_rule=None`` means this).
STANDARD_RULE = ScaleRule()
# fl32(1 / (6 * bound)) per E4M3 bound: host constants (1/2688 for 448, 1/1536 for 256), each rounded once.
RECIP_GLOBAL_DENOMINATOR = {b: np.float32(1.0) / np.float32(E2M1_MAX * b) for b in E4M3_BOUNDS}


def global_denominator(bound: int = E4M3_MAX) -> int:
  """``6 * bound``: what a tensor's amax is divided by for its global decode scale (2688 for 448)."""
  return E2M1_MAX * int(bound)


def check_rule(rule: ScaleRule, block_2d: bool, rht: bool, stochastic: bool) -> None:
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
def check_block_dim(shape, axis):
  n = shape[axis]
  if n % BLOCK:
    raise ValueError(
        f"NVFP4 quantization needs the block axis to be a multiple of {BLOCK}: axis {axis} has size {n}"
        f" (shape {tuple(shape)}); pad it with zeros first"
    )


def blocked(x, axis, block_2d):
  """Reshape so each block is contiguous along the returned reduction axes (no transposes)."""
  if block_2d:
    r, c = x.shape[-2:]
    return x.reshape(x.shape[:-2] + (r // BLOCK, BLOCK, c // BLOCK, BLOCK)), (x.ndim - 1, x.ndim + 1)
  n = x.shape[axis]
  return x.reshape(x.shape[:axis] + (n // BLOCK, BLOCK) + x.shape[axis + 1 :]), (axis + 1,)


# ----------------------------------------------------------------------------------------------
# Exact fp32 arithmetic (immune to flush-to-zero; the bit helpers are in formats.py)
# ----------------------------------------------------------------------------------------------
def split_subnormal(v):
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


def mul_exact(a, b_normal):
  """fl(a * b) for fp32 ``a`` possibly subnormal and ``b_normal`` normal, when the result is normal.

  Results in the subnormal range may come back flushed to ±0; callers only use this where such a
  result rounds to zero anyway (E4M3 scales below 2**-10, E2M1 values below 0.25).
  """
  m, k = split_subnormal(a)
  prod = m * b_normal
  return jnp.where(k == 0, prod, prod * _pow2(-126))


def scale_product_normal(a, c):
  """``fl(a * c)`` for a non-negative fp32 ``a`` (subnormal, NaN or Inf included) and a normal ``c > 0`` (or NaN)
  wherever it is at least 2**-126, and 0 where it is below 2**-125 (a block scale's ``fl(bamax * c)``: E4M3
  rounds anything below 2**-10 to 0). No operand or result of its fp32 arithmetic is subnormal, so it gives the
  same bits with and without flush-to-zero (:func:`mul_exact` reads a subnormal ``a`` exactly but may make a
  subnormal product)::

      a normal:      a * c                  computed where ea + ec >= 128 (then >= 2**-126), else 0
      a = M 2**-149: fl(m * c) * 2**-126    m = M * 2**-23 (normal); computed where em + ec >= 254
                                            (then fl(m * c) >= 1 and the result >= 2**-126), else 0

  (``ea``, ``em``, ``ec``: biased exponent fields, so ``a < 2**(ea - 126)``.)
  """
  ab = _bits(a)
  ea = ((ab >> 23) & 0xFF).astype(jnp.int32)
  ec = ((_bits(c) >> 23) & 0xFF).astype(jnp.int32)
  is_sub = ea == 0  # subnormal or zero
  m = (ab & _F32_MANT_MASK).astype(jnp.int32).astype(jnp.float32) * np.float32(2.0**-23)
  em = ((_bits(m) >> 23) & 0xFF).astype(jnp.int32)
  sub = jnp.where(is_sub & (em + ec >= 254), m, np.float32(0.0)) * c * np.float32(2.0**-126)
  normal = jnp.where(~is_sub & (ea + ec >= 128), a, np.float32(0.0)) * c
  return jnp.where(is_sub, sub, normal)


def recip_normal(s):
  """Correctly rounded ``fl(1 / s)`` for a positive normal fp32 ``s`` (or NaN: NaN), subnormal results included:
  ``s``'s significand and exponent straight from its bits into :func:`formats.divide_significands`."""
  sb = _bits(s)
  ms = ((sb & _F32_MANT_MASK) | 0x00800000).astype(jnp.int32)
  q, r, k = formats.divide_significands(1 << 23, ms)
  recip = _from_bits(formats.quotient_bits(q, r, ms, 150 - ((sb >> 23) & 0xFF).astype(jnp.int32) - k))
  return jnp.where(jnp.isnan(s), s, recip)


# ----------------------------------------------------------------------------------------------
# The per-tensor chain and the block scales
# ----------------------------------------------------------------------------------------------
def global_scales(amax, bound: int = E4M3_MAX):
  """(S_enc, S_dec) for ``amax`` (CUDA compute_global_encode_scaling_factor_FP4, with 6 * bound).

  Both quotients exact from integer significands (:func:`formats.divide_significands`): S_enc = 6B / amax is
  normal or overflows (to FLT_MAX: amax subnormal or tiny), never subnormal (amax <= FLT_MAX); S_dec = 1 / S_enc
  may be subnormal (S_enc > 2**126).
  """
  mb, eb = formats.significand(amax)
  amax_is_zero = mb == 0  # a subnormal amax is not zero (its S_enc is FLT_MAX, not 1): from the significand
  ma, ea = formats.host_significand(global_denominator(bound))
  # amax == 0 is answered below; the division gets mb >= 1 to stay defined. quotient_bits takes the raw mb:
  # with the clamped one XLA:CPU fuses the chain into more of its consumers.
  q, r, k = formats.divide_significands(ma, jnp.maximum(mb, 1))
  s_enc = _from_bits(formats.quotient_bits(q, r, mb, ea - eb - k + 23, subnormals=False, saturate=True))
  # the Inf and NaN tests from the bits: a float compare would read a subnormal amax (flush-to-zero backends)
  s_enc = jnp.where(amax_is_zero | formats.is_inf_bits(amax), np.float32(1.0), s_enc)  # 6B / inf = 0: 1 as well
  s_enc = jnp.where(formats.is_nan_bits(amax), amax, s_enc)  # NaN input poisons every scale (documented)
  return s_enc, recip_normal(s_enc)  # S_enc is a positive normal number here (or NaN)


def block_scale_factor(s_enc):
  """``fl(S_enc * fl(1/6))``: what a block's amax is multiplied by for its E4M3 decode scale (TE's order)."""
  return s_enc * np.float32(np.float32(1.0) / np.float32(6.0))


def e4m3_code(s8):
  """Index into ``formats.grid(E4M3)`` of a non-negative fp32 ``s8`` on the E4M3 grid (NaN: 0), from its bits.

  Normal E4M3 values (``s8 >= 2**-6``) have code ``(e + 7) * 8 + m3`` (``e`` the exponent, ``m3`` the top
  three fraction bits); subnormal ones ``s8 * 2**9`` (0..7, an exact product).
  """
  b = _bits(s8)
  e = ((b >> 23) & 0xFF).astype(jnp.int32) - 127
  normal = ((e + 7) << 3) | ((b >> 20) & 7).astype(jnp.int32)
  sub = (s8 * np.float32(2.0**9)).astype(jnp.int32)
  code = jnp.where(e >= -6, normal, sub)
  return jnp.where(jnp.isnan(s8), 0, jnp.clip(code, 0, len(E4M3_GRID) - 1))


def e4m3_parts(s8):
  """(k8, j8) with ``s8 = k8 * 2**j8`` for a non-negative fp32 ``s8`` on the E4M3 grid (k8 = 0 for 0)."""
  sb = _bits(s8)
  se = ((sb >> 23) & 0xFF).astype(jnp.int32)
  k8 = (((sb & _F32_MANT_MASK) | 0x00800000) >> 20).astype(jnp.int32)
  return jnp.where(se == 0, 0, k8), se - 130


# E4M3 grid as (k8, j8) host constants: the encode table's products need no bit work on s8.
E4M3_K8 = np.array([int(v * 2.0 ** (3 - np.floor(np.log2(v)))) if v else 0 for v in E4M3_GRID], np.int32)
E4M3_J8 = np.array([int(np.floor(np.log2(v))) - 3 if v else 0 for v in E4M3_GRID], np.int32)


def encode_from_e4m3_parts(k8, j8, s_dec):
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


# ----------------------------------------------------------------------------------------------
# The element path: E2M1 codes
# ----------------------------------------------------------------------------------------------
def abs_times_enc_flush_to_zero_safe(b, enc):
  """``fl(|x| * enc)`` from x's bits ``b``, exact on flush-to-zero backends (a subnormal x times an enc below
  2**23 gives 0 here instead of a product below 2**-103: the same E2M1 code, 0)."""
  ab = b & np.uint32(_F32_ABS_MASK)
  is_sub = ((b >> 23) & np.uint32(0xFF)) == 0  # zero or subnormal x, from the exponent field
  # enc * 2**-149 from the bits (the constant 2**-149 is itself subnormal: XLA:CPU would read it as 0).
  enc_bits = _bits(enc)
  enc_lo = jnp.where(enc_bits >= np.uint32(150 << 23), _from_bits(enc_bits - np.uint32(149 << 23)), np.float32(0))
  enc_lo = jnp.where(jnp.isnan(enc), enc, enc_lo)
  return jnp.where(is_sub, ab.astype(jnp.int32).astype(jnp.float32) * enc_lo, _from_bits(ab) * enc)


def abs_times_enc_normal(b, enc):
  """``fl(|x| * enc)`` from x's bits ``b`` wherever the product is at least 2**-126, and 0 where it is below
  2**-125 (an E2M1 code of 0 either way, round to nearest or stochastic), for ``enc`` a positive normal number,
  FLT_MAX or NaN. No operand or result of its fp32 arithmetic is subnormal: the same bits with and without
  flush-to-zero (a TPU's arithmetic; :func:`abs_times_enc_flush_to_zero_safe` makes subnormal products that
  flush-to-zero may keep or drop, with the same code)::

      x normal:      |x| * enc              computed where ex + ee >= 128, else 0 (biased exponent fields)
      x = M 2**-149: M * fl(enc * 2**-149)  the scaled enc from the bits, normal when enc >= 2**23; a smaller
                                            enc makes the product < 2**-103: 0
  """
  ab = b & np.uint32(_F32_ABS_MASK)
  ex = (ab >> 23).astype(jnp.int32)
  is_sub = ex == 0  # zero or subnormal x
  enc_bits = _bits(enc)
  ee = ((enc_bits >> 23) & np.uint32(0xFF)).astype(jnp.int32)
  normal = jnp.where(~is_sub & (ex + ee >= 128), _from_bits(ab), np.float32(0.0)) * enc
  enc_lo = jnp.where(enc_bits >= np.uint32(150 << 23), _from_bits(enc_bits - np.uint32(149 << 23)), np.float32(0))
  enc_lo = jnp.where(formats.is_nan_bits(enc), enc, enc_lo)
  sub = jnp.where(is_sub, ab, np.uint32(0)).astype(jnp.int32).astype(jnp.float32) * enc_lo
  return jnp.where(is_sub, sub, normal)


def abs_times_enc_ieee(b, enc):
  """``fl(|x| * enc)`` where fp32 arithmetic keeps subnormals (XLA:GPU: ``xla_gpu_ftz`` is off by default)."""
  return _from_bits(b & np.uint32(_F32_ABS_MASK)) * enc


def e2m1_code_of_product(xb, enc, u=None, *, product=None, rint=jnp.round):
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
  # Where fp32 keeps subnormals (XLA:GPU) the plain product is the same fl(|x| * enc): the flush-to-zero
  # form's select would cost the GPU a full-size pred array (XLA fuses it into the block-amax reduce as a
  # second output, written and read back).
  if product is None:
    y = lax.platform_dependent(b, enc, cuda=abs_times_enc_ieee, default=abs_times_enc_flush_to_zero_safe)
  else:
    y = product(b, enc)
  a = formats.min_nan(y, np.float32(E2M1_MAX))  # NaN stays NaN
  k = formats.grid_index(a, E2M1, u, rint=rint)
  nan = jnp.isnan(a)
  k = jnp.where(nan, np.float32(7.0), k)
  neg = ((b >> 31) == 1) & ~nan
  return k, neg
