"""The small float formats of NVFP4 and FP8 (E2M1, E4M3, E5M2), one rounding routine for all of them,
and the exact fp32 bit helpers both quantizers build on.

A format ``f`` (no Inf; ``fn`` formats, OCP MX / NVIDIA naming) has, for each sign, the grid

    subnormal:  k * 2**(f.min_normal_exp - f.mantissa_bits)          k = 0 .. 2**mantissa_bits - 1
    normal:     (1 + j / 2**mantissa_bits) * 2**e                    e >= min_normal_exp, up to f.max

(:func:`grid` enumerates it from these parameters; the tests check it against ``ml_dtypes``). A value's
grid index equals its bit pattern without the sign bit, so index = code.

Rounding (:func:`round_to_format`, RNE with saturation, IEEE fp32 throughout):

    e    = max(floor(log2 |v|), f.min_normal_exp)                   (from the exponent bits)
    step = 2**(e - f.mantissa_bits)
    q    = copysign(min(round_half_even(|v| / step) * step, f.max), v)

``|v| / step`` divides by a power of two, so it is exact. Signed zeros are kept; NaN stays NaN; ±Inf
saturates to ±max (``cvt.rn.satfinite``). The same rounding expressed as grid indices, for a quantizer
that wants codes (NVFP4's element path): :func:`grid_index` / :func:`grid_value`, exact piecewise-linear
maps over the format's constant-step segments (checked equal to :func:`round_to_format` in the tests).

Rounding never relies on float converts (XLA folds ``f32 -> f8/f4 -> f32`` round trips): it is exponent
and step arithmetic, so the values survive every XLA pass. The fp32 helpers below never produce or read
an fp32 subnormal through arithmetic (XLA:CPU flushes them to zero): they work on the bits.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = [
    "E2M1",
    "E4M3",
    "E5M2",
    "F32_ABS_MASK",
    "F32_EXP_MASK",
    "F32_MANT_MASK",
    "F32_SIGN_MASK",
    "FLT_MAX",
    "FloatFormat",
    "bits",
    "copysign",
    "div_rn",
    "divide_significands",
    "from_bits",
    "grid",
    "grid_index",
    "grid_value",
    "host_significand",
    "is_inf_bits",
    "is_nan_bits",
    "is_zero",
    "min_nan",
    "negate_where",
    "pow2",
    "quotient_bits",
    "round_to_bf16",
    "round_to_format",
    "significand",
    "to_f32_exact",
]

FLT_MAX = float(np.finfo(np.float32).max)
# fp32 bit fields: exponent, mantissa, everything but the sign.
F32_EXP_MASK = 0x7F800000
F32_MANT_MASK = 0x007FFFFF
F32_ABS_MASK = 0x7FFFFFFF
F32_SIGN_MASK = 0x80000000


@dataclasses.dataclass(frozen=True, kw_only=True)
class FloatFormat:
  """A small float element format without Inf (E2M1, E4M3 ``fn``, E5M2 -- the latter's Inf is never produced)."""

  # "e2m1", "e4m3" or "e5m2".
  name: str
  # Explicit mantissa bits (1 for E2M1, 3 for E4M3, 2 for E5M2).
  mantissa_bits: int
  # Exponent of the smallest normal number (0 for E2M1, -6 for E4M3, -14 for E5M2); below it the step
  # is constant (subnormals).
  min_normal_exp: int
  # Largest finite value; rounding saturates to it (6, 448, 57344).
  max: float
  # The ml_dtypes/JAX storage dtype (float4_e2m1fn, float8_e4m3fn, float8_e5m2).
  dtype: object


E2M1 = FloatFormat(name="e2m1", mantissa_bits=1, min_normal_exp=0, max=6.0, dtype=jnp.float4_e2m1fn)
E4M3 = FloatFormat(name="e4m3", mantissa_bits=3, min_normal_exp=-6, max=448.0, dtype=jnp.float8_e4m3fn)
E5M2 = FloatFormat(name="e5m2", mantissa_bits=2, min_normal_exp=-14, max=57344.0, dtype=jnp.float8_e5m2)


# ----------------------------------------------------------------------------------------------
# Exact fp32 bit helpers (immune to flush-to-zero)
# ----------------------------------------------------------------------------------------------
def bits(v):
  """The uint32 bit pattern of fp32 ``v``."""
  return lax.bitcast_convert_type(v, jnp.uint32)


def from_bits(b):
  """The fp32 value of the bit pattern ``b`` (any integer dtype, taken as uint32)."""
  return lax.bitcast_convert_type(b.astype(jnp.uint32), jnp.float32)


F32_QUIET_NAN = 0x7FC00000


def canonical_nan_bits(abs_bits):
  """``|x|``'s bits (int32 or uint32: :func:`bits` ``& F32_ABS_MASK``) with every NaN as the quiet NaN
  ``F32_QUIET_NAN``, so that an amax (their max) is the same NaN whatever arithmetic made it (on the H200, XLA's
  RHT and a Triton kernel's give different payloads). Elementwise before the max: XLA fuses it into that reduce
  (a select on the reduced scalar is a kernel of its own)."""
  t = abs_bits.dtype.type
  return jnp.where(abs_bits > t(F32_EXP_MASK), t(F32_QUIET_NAN), abs_bits)


# Sign and NaN forms that give the same bits under every lowering: Pallas's Triton lowering (the quantizer's
# kernels, quantizer/triton_kernels.py) negates a float as ``0 - x`` (-0.0 becomes +0.0) and takes min as
# ``minnum`` (a NaN operand yields the other one), where XLA flips the sign bit and propagates NaN.
def copysign(mag, sign_of):
  """``jnp.copysign(mag, sign_of)`` for fp32 (NaN included), by bits."""
  return from_bits((bits(mag) & np.uint32(F32_ABS_MASK)) | (bits(sign_of) & np.uint32(F32_SIGN_MASK)))


def negate_where(v, neg):
  """``where(neg, -v, v)`` for fp32, by flipping the sign bit (exact for ±0)."""
  return from_bits(bits(v) ^ jnp.where(neg, np.uint32(F32_SIGN_MASK), np.uint32(0)))


def min_nan(a, bound):
  """``jnp.minimum(a, bound)`` for a non-NaN, nonzero ``bound``: a compare and a select (``NaN >= bound`` is
  false, so a NaN ``a`` stays)."""
  return jnp.where(a >= bound, bound, a)


def pow2(e):
  """2**e as fp32 for integer e in [-126, 127], built from the exponent bits (exact)."""
  e = jnp.asarray(e, jnp.int32)
  return from_bits(((e + 127) << 23).astype(jnp.uint32))


def significand(v):
  """``v = m * 2**(e - 23)`` for a finite ``v > 0`` (subnormals too): int32 ``m`` in [2**23, 2**24), int32 ``e``."""
  b = bits(v)
  e_field = ((b >> 23) & 0xFF).astype(jnp.int32)
  frac = (b & F32_MANT_MASK).astype(jnp.int32)
  sub = e_field == 0
  shift = jnp.where(sub, lax.clz(frac) - 8, 0)  # a subnormal's fraction, normalized to 24 bits
  m = jnp.where(sub, frac << shift, frac | 0x00800000)
  return m, jnp.where(sub, -126 - shift, e_field - 127)


def is_nan_bits(v):
  """``isnan(v)`` for fp32 ``v`` from its bits (no float compare: a flush-to-zero backend's compare reads a
  subnormal as zero, and the bit test keeps every fp32 operation away from subnormal operands)."""
  return (bits(v) & np.uint32(F32_ABS_MASK)) > np.uint32(F32_EXP_MASK)


def is_inf_bits(v):
  """``isinf(v)`` for fp32 ``v`` from its bits (as :func:`is_nan_bits`)."""
  return (bits(v) & np.uint32(F32_ABS_MASK)) == np.uint32(F32_EXP_MASK)


def is_zero(v):
  """``v == ±0`` for fp32 ``v`` with subnormals nonzero, from its significand (as :func:`div_rn`'s zero tests).

  Not ``v == 0`` (XLA:CPU compares with denormals-are-zero) and not ``(bits(v) & 0x7FFFFFFF) == 0``: LLVM folds
  that masked test back into a float compare (seen: a subnormal amax taken for zero in one fusion and not in
  another)."""
  return significand(jnp.asarray(v, jnp.float32))[0] == 0


def _seed_quotient(n, d):
  """The backend's fp32 division: only a seed for :func:`divide_significands` (tests replace it with a worse one)."""
  return n / d


def host_significand(v) -> tuple[int, int] | None:
  """``(m, e)`` as :func:`significand`, on the host, for a positive normal fp32 host scalar; None otherwise."""
  if not (isinstance(v, (int, float, np.floating, np.integer)) or (isinstance(v, np.ndarray) and v.shape == ())):
    return None
  b = int(np.asarray(v, np.float32).view(np.uint32))
  field = (b >> 23) & 0xFF
  if b >> 31 or field in (0, 0xFF):
    return None
  return (b & F32_MANT_MASK) | 0x00800000, field - 127


def divide_significands(ma, mb):
  """``(q, r, k)`` with ``q = floor(ma * 2**k / mb)``, ``r = ma * 2**k - q * mb`` (exact, int32) and
  ``k = 24 if ma < mb else 23``, for 24-bit significands ``ma, mb`` in [2**23, 2**24), so that ``q`` is in
  [2**23, 2**24). ``ma`` may be a host int (then its side is folded on the host).

      seed = fl(fl(ma * 2**k) / mb)          the backend's division: a few ulps off at most
      r    = ma * 2**k - seed * mb             exact in wrap-around uint32 arithmetic (the true |r| < 2**26)
      d    = (r + 8 mb) div mb  (>= 0)          one exact integer division corrects the seed
      q, r = seed + d - 8, r + 8 mb - d * mb

  Integer operations only after the seed, whose operands and result are normal fp32 numbers, so this is
  exact on flush-to-zero backends (XLA:CPU) and with XLA:GPU's approximate division alike.
  """
  k24 = mb > ma
  if isinstance(ma, int):
    num = jnp.where(k24, np.float32(ma * 2**24), np.float32(ma * 2**23))  # exact: 24 bits times a power of two
    n_mod = jnp.where(k24, np.uint32((ma << 24) & 0xFFFFFFFF), np.uint32((ma << 23) & 0xFFFFFFFF))
  else:
    num = ma.astype(jnp.float32) * jnp.where(k24, np.float32(2.0**24), np.float32(2.0**23))
    n_mod = ma.astype(jnp.uint32) << jnp.where(k24, np.uint32(24), np.uint32(23))
  seed = _seed_quotient(num, mb.astype(jnp.float32)).astype(jnp.int32)
  r = lax.bitcast_convert_type(n_mod - seed.astype(jnp.uint32) * mb.astype(jnp.uint32), jnp.int32) + 8 * mb
  d = lax.div(r, mb)  # r >= 0: truncation is the floor
  # int32 constants, not Python ints: Pallas's Triton lowering types a weak-int select as i1 (the kernels
  # compute this chain, quantizer/triton_kernels._scalars)
  return seed + d - 8, r - d * mb, jnp.where(k24, np.int32(24), np.int32(23))


def quotient_bits(q, r, mb, e, *, subnormals: bool = True, saturate: bool = False):
  """The uint32 bits of ``RNE((q + r / mb) * 2**(e - 23))`` for ``q`` in [2**23, 2**24) and ``0 <= r < mb``
  (:func:`divide_significands`' result): the IEEE fp32 quotient, built from integers.

      normal (e >= -126):   bits = ((e + 126) << 23) + q + up      up: 2r > mb, or 2r == mb and q odd
                            (q + up == 2**24 carries into the exponent; past FLT_MAX: the bits of inf)
      subnormal (e < -126): q's low s = -126 - e bits rounded away, half to even, r > 0 as the sticky bit

  ``subnormals=False`` leaves the second out where the caller knows the quotient is normal or overflows;
  ``saturate=True`` gives FLT_MAX's bits instead of inf's (``min(q, FLT_MAX)``, as integers).
  """
  up = (2 * r > mb) | ((2 * r == mb) & ((q & 1) == 1))
  # int32 arithmetic only (Mosaic TPU has no unsigned min): a field of 254 or more overflows (to ``limit``); below
  # it the bits stay under 2**31
  limit = np.int32(0x7F7FFFFF if saturate else F32_EXP_MASK)
  field = e + 126
  below = (jnp.minimum(field, 253) << 23) + q + up.astype(jnp.int32)
  normal = jnp.where(field >= 254, limit, jnp.minimum(below, limit)).astype(jnp.uint32)
  if not subnormals:
    return normal
  s = jnp.clip(-126 - e, 1, 25)
  kept = q >> s
  rem = q - (kept << s)
  half = jnp.int32(1) << (s - 1)
  up_s = (rem > half) | ((rem == half) & ((r > 0) | ((kept & 1) == 1)))
  return jnp.where(e < -126, (kept + up_s.astype(jnp.int32)).astype(jnp.uint32), normal)


def _div_operand(v):
  """``(v, m, e, zero, nan, special)`` of one :func:`div_rn` operand. A positive normal host scalar is split on
  the host (``m`` a Python int) and needs no test (``np.False_``); a traced one gets its zero test from its
  significand: XLA:CPU compares subnormals as zero, and LLVM folds a masked-bits test
  ``(bits(v) & 0x7FFFFFFF) == 0`` back into such a float compare (seen here: a subnormal ``a`` came out as 0)."""
  host = host_significand(v)
  if host:
    no = np.bool_(False)
    return v, host[0], host[1], no, no, no
  v = jnp.asarray(v, jnp.float32)
  m, e = significand(v)
  zero = m == 0
  return v, m, e, zero, jnp.isnan(v), zero | ~jnp.isfinite(v)


def div_rn(a, b):
  """``fl(a / b)``: the correctly rounded (IEEE RNE) fp32 quotient, subnormal results included.

  For ``a >= 0`` and ``b > 0`` finite (subnormals allowed); zeros, Inf and NaN give IEEE's answers
  (``a / 0 = inf`` for ``a > 0``). Why not ``a / b``: XLA:GPU lowers an fp32 division to PTX
  ``div.full.f32`` (``-nvptx-prec-divf32=1``), which is 1 ulp off for about a quarter of all quotients
  (openxla/xla#37181, #46400); TE's CUDA kernels divide with IEEE ``div.rn`` (no fast-math). This is
  exact on every backend, with the division only as a seed:

      a = Ma * 2**(ea - 23),  b = Mb * 2**(eb - 23)        24-bit integer significands
      Q, r, k = divide_significands(Ma, Mb)                  Q = floor(Ma * 2**k / Mb) in [2**23, 2**24)
      a / b = (Q + r / Mb) * 2**(E - 23),  E = ea - eb - k + 23
      fl(a / b) = quotient_bits(Q, r, Mb, E)                 RNE, subnormal results included

  A positive normal host scalar (``np.float32(2688)``) is split on the host, and its zero/Inf/NaN tests
  vanish: a quotient by or of a constant costs fewer traced operations (the quantizer's scale chain).
  Costs ~40 integer ops per quotient: callers use it on per-block and per-tensor scales.
  """
  if host_significand(a) and host_significand(b):
    return jnp.float32(np.float32(a) / np.float32(b))  # numpy's quotient: IEEE
  a, ma, ea, a_zero, a_nan, a_special = _div_operand(a)
  b, mb, eb, b_zero, b_nan, b_special = _div_operand(b)
  # b == 0 is answered below; keep the integer division defined (a host mb is a positive int).
  mb = jnp.int32(mb) if isinstance(mb, int) else jnp.maximum(mb, 1)
  q, r, k = divide_significands(ma, mb)
  out = from_bits(quotient_bits(q, r, mb, ea - eb - k + 23))
  # Zero, Inf and NaN operands: the backend's division gives IEEE's answer there, except where a
  # flush-to-zero compare would take a subnormal for zero (the zero cases are set from the significands).
  plain = jnp.asarray(a, jnp.float32) / jnp.where(b_zero, np.float32(1.0), b)
  plain = jnp.where(b_zero & ~a_zero & ~a_nan, np.float32(np.inf), plain)
  plain = jnp.where(a_zero & ~b_zero & ~b_nan, np.float32(0.0), plain)
  plain = jnp.where(a_zero & b_zero, np.float32(np.nan), plain)
  return jnp.where(a_special | b_special, plain, out)


def to_f32_exact(x):
  """Widen to fp32 without touching subnormals (a bf16 -> f32 convert may flush them)."""
  if x.dtype == jnp.bfloat16:
    b16 = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    return from_bits(b16 << 16)
  return x.astype(jnp.float32)


# ----------------------------------------------------------------------------------------------
# Rounding
# ----------------------------------------------------------------------------------------------
def round_to_format(v, fmt: FloatFormat, *, rint=jnp.round) -> jax.Array:
  """RNE of fp32 ``v`` onto the grid of ``fmt``, saturating to ±max; fp32 result (formula: module docstring).

  ``rint``: round half to even of a non-negative fp32 (``jnp.round``; a Triton kernel passes its own form)."""
  v = jnp.asarray(v, jnp.float32)
  a = jnp.abs(v)
  e = ((bits(a) >> 23) & 0xFF).astype(jnp.int32) - 127
  e = jnp.maximum(e, fmt.min_normal_exp)
  e = jnp.minimum(e, 127)
  # a * 2**-k instead of a / 2**k: both exact, but only the product is exact by contract on XLA:GPU
  # (its fp32 division is the approximate div.full; see div_rn).
  r = min_nan(rint(a * pow2(fmt.mantissa_bits - e)) * pow2(e - fmt.mantissa_bits), np.float32(fmt.max))
  return copysign(r, v)


def round_to_bf16(v):
  """RNE rounding of fp32 ``v`` to bf16 precision, kept in fp32 (bit arithmetic, never folded).

  ``bits + 0x7FFF + lsb`` truncated to the upper 16 bits (round half to even on the dropped half word);
  Inf and NaN pass unchanged; overflow carries into the exponent and gives ±Inf, as a bf16 cast does.
  """
  b = bits(v)
  rounded = (b + np.uint32(0x7FFF) + ((b >> 16) & 1)) & np.uint32(0xFFFF0000)
  finite = (b & F32_EXP_MASK) != F32_EXP_MASK
  return from_bits(jnp.where(finite, rounded, b))


# ----------------------------------------------------------------------------------------------
# The grid, and rounding as grid indices
# ----------------------------------------------------------------------------------------------
def grid(fmt: FloatFormat) -> np.ndarray:
  """The non-negative finite values of ``fmt`` in increasing order (fp32); ``grid(fmt)[k]`` has code k."""
  m = 2**fmt.mantissa_bits
  sub = [k * 2.0 ** (fmt.min_normal_exp - fmt.mantissa_bits) for k in range(m)]
  normal = []
  e = fmt.min_normal_exp
  while (1.0 * 2.0**e) <= fmt.max:
    normal += [(1 + j / m) * 2.0**e for j in range(m) if (1 + j / m) * 2.0**e <= fmt.max]
    e += 1
  return np.array(sub + normal, np.float32)


@functools.lru_cache(maxsize=None)
def _segments(fmt: FloatFormat) -> tuple[tuple[float, float, int], ...]:
  """``(lower bound, step, first code)`` of each maximal run of the grid with a constant step.

  E2M1: ``((0, 0.5, 0), (2, 1, 4), (4, 2, 6))`` -- the subnormals and the first binade share a step.
  """
  g = grid(fmt).astype(np.float64)
  steps = np.diff(g)
  out = []
  for k in range(len(steps)):
    if k == 0 or steps[k] != steps[k - 1]:
      out.append((float(g[k]), float(steps[k]), k))
  return tuple(out)


def _piecewise(x, bounds, values):
  """``values[i]`` (fp32 constants) where ``bounds[i-1] <= x < bounds[i]``, as a chain of selects."""
  out = np.float32(values[-1])
  for b, v in zip(reversed(bounds), reversed(values[:-1])):
    out = jnp.where(x < b, np.float32(v), out)
  return out


def grid_index(a, fmt: FloatFormat, u=None, *, rint=jnp.round):
  """Code (as fp32) of ``a`` in ``[0, fmt.max]`` (or NaN) rounded onto the grid: RNE, or SR given ``u``.

  Per constant-step segment ``[lo, ...)`` with step ``s`` and first code ``c`` (``m = 1/s``,
  ``o = c - lo/s``, both exact):  RNE ``k = round_half_even(a * m) + o``;  SR ``k = floor(fl(a * m + u)) + o``
  with ``u`` in [0, 1). ``a * m`` is exact (a power of two), so RNE is :func:`round_to_format`'s rounding
  and ``fl(a * m + u) = fl(a + u * s) / s`` is the emulated ``cvt.rs`` formula ``floor((a + u*s) / s) * s``.
  One compare per segment boundary; meant for formats with few segments (E2M1: three). ``rint``: as in
  :func:`round_to_format`.
  """
  segs = _segments(fmt)
  bounds = [lo for lo, _, _ in segs[1:]]
  m = _piecewise(a, bounds, [1.0 / s for _, s, _ in segs])
  o = _piecewise(a, bounds, [c - lo / s for lo, s, c in segs])
  k = rint(a * m) if u is None else jnp.floor(a * m + u)
  return k + o


def grid_value(k, fmt: FloatFormat):
  """``grid(fmt)[k]`` for fp32 codes ``k`` (exact arithmetic: ``k * s + (lo - c * s)`` in k's segment)."""
  segs = _segments(fmt)
  bounds = [c for _, _, c in segs[1:]]
  step = _piecewise(k, bounds, [s for _, s, _ in segs])
  offset = _piecewise(k, bounds, [lo - c * s for lo, s, c in segs])
  return k * step + offset
