"""Exact FP8 (E4M3 / E5M2) per-tensor current scaling, like TE's ``Float8CurrentScaling``, in pure jnp.

Used for the ``fp8`` precision of a GEMM pass (the fallback for GEMMs that are not NVFP4, and a late
precision switch target). TE's HYBRID format: E4M3 for the forward operands (activations, weights),
E5M2 for the output gradient.

Per tensor ``x`` (all arithmetic IEEE fp32, RNE):

    amax      = max |x|                                      (exact; NaN wins over Inf, Inf over finite)
    scale     = fp8_max / amax                               (448 for E4M3, 57344 for E5M2)
    scale     = FLT_MAX   if scale is Inf   (amax subnormal)
    scale     = 1         if amax == 0 or amax is not finite
    scale_inv = fl(1 / scale)
    q         = fp8_rne_satfinite(fl(x * scale))             (RNE with saturation to ±fp8_max)
    x_hat     = q * scale_inv

This is TE's ``compute_scale_from_amax`` with ``amax_epsilon = 0``, margin 0 and no power-of-two
rounding (the CUDA kernel's ``value_for_inf = FLT_MAX``; TE JAX's jnp fallback would leave an Inf
scale there), and the saturating conversion (TE JAX clips to ±fp8_max, then casts with RNE). A GEMM of two such tensors is
``(q_a @ q_b accumulated in fp32) * fl(scale_inv_a * scale_inv_b)``; the products of two FP8 values
have at most 8 significant bits, so ``q`` fed as bf16 into an ordinary GEMM with fp32 accumulation is
the FP8 Tensor-Core GEMM up to accumulation order.

Non-finite input (deliberately unlike TE, whose saturating cast would hand finite numbers on): when
``amax`` is NaN or Inf, ``scale_inv`` is set to ``amax`` so the dequantized tensor, and every GEMM
using it, is NaN/Inf. ``q`` is TE's (scale 1, saturated) in that case.

Rounding never relies on float converts (XLA may fold ``f32 -> f8 -> f32`` round trips): it is
explicit exponent/step arithmetic, checked bit for bit against ``ml_dtypes`` casts in the tests.
Limitation: on flush-to-zero backends (XLA:CPU), fp32-subnormal inputs (|x| < 2**-126) read as zero;
this only matters for tensors whose amax is itself below ~1e-36.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["E4M3", "E5M2", "FP8Tensor", "Fp8Format", "dequantize", "quantize", "round_to_format", "scale_from_amax"]

FLT_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Fp8Format:
  """An FP8 element format (OCP / NVIDIA names)."""

  # "e4m3" or "e5m2".
  name: str
  # Explicit mantissa bits (3 for E4M3, 2 for E5M2).
  mantissa_bits: int
  # Exponent of the smallest normal number (-6 for E4M3, -14 for E5M2); below it the step is constant.
  min_normal_exp: int
  # Largest finite value; the conversion saturates to it (448, 57344).
  max: float
  # The ml_dtypes/JAX storage dtype (float8_e4m3fn, float8_e5m2).
  dtype: object


E4M3 = Fp8Format(name="e4m3", mantissa_bits=3, min_normal_exp=-6, max=448.0, dtype=jnp.float8_e4m3fn)
E5M2 = Fp8Format(name="e5m2", mantissa_bits=2, min_normal_exp=-14, max=57344.0, dtype=jnp.float8_e5m2)
_FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def _fmt(fmt) -> Fp8Format:
  if isinstance(fmt, Fp8Format):
    return fmt
  if fmt not in _FORMATS:
    raise ValueError(f"unknown FP8 format {fmt!r}; choose one of {sorted(_FORMATS)}")
  return _FORMATS[fmt]


def _bits(v):
  return lax.bitcast_convert_type(v, jnp.uint32)


def _pow2(e):
  """2**e as fp32 for integer e in [-126, 127], built from the exponent bits (exact)."""
  e = jnp.asarray(e, jnp.int32)
  return lax.bitcast_convert_type(((e + 127) << 23).astype(jnp.uint32), jnp.float32)


def _to_f32(x):
  """Widen to fp32; bf16 goes through its bits (a convert may flush bf16 subnormals)."""
  if x.dtype == jnp.bfloat16:
    b16 = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    return lax.bitcast_convert_type(b16 << 16, jnp.float32)
  return x.astype(jnp.float32)


def round_to_format(v, fmt) -> jax.Array:
  """RNE of fp32 ``v`` onto the FP8 grid of ``fmt``, saturating to ±max (satfinite); fp32 result.

  ``step = 2**(max(floor(log2|v|), min_normal_exp) - mantissa_bits)``; ``q = round_half_even(|v| / step)
  * step``, clipped to ``max``, with the sign of ``v`` (signed zeros kept). ``|v| / step`` divides by a
  power of two, so it is exact. NaN stays NaN; ±Inf saturates to ±max (like ``cvt.satfinite``).
  """
  f = _fmt(fmt)
  v = jnp.asarray(v, jnp.float32)
  a = jnp.abs(v)
  e = ((_bits(a) >> 23) & 0xFF).astype(jnp.int32) - 127
  e = jnp.maximum(e, f.min_normal_exp)
  step = _pow2(jnp.minimum(e, 127) - f.mantissa_bits)
  r = jnp.minimum(jnp.round(a / step) * step, np.float32(f.max))
  return jnp.copysign(r, v)


def scale_from_amax(amax, fmt) -> jax.Array:
  """TE current scaling: ``fp8_max / amax``; FLT_MAX if that overflows; 1 if amax is 0 or non-finite."""
  f = _fmt(fmt)
  amax = jnp.asarray(amax, jnp.float32)
  scale = np.float32(f.max) / amax
  scale = jnp.where(jnp.isinf(scale), np.float32(FLT_MAX), scale)
  # amax == 0 tested on the bits: a flush-to-zero compare would also catch subnormal amaxes.
  return jnp.where((_bits(amax) == 0) | ~jnp.isfinite(amax), np.float32(1.0), scale)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FP8Tensor:
  """A per-tensor-scaled FP8 tensor.

  data:      FP8 values (``fmt.dtype``), the scaled and rounded input, same shape.
  scale_inv: fp32 scalar decode factor ``1 / scale`` (poisoned to ``amax`` when amax is NaN/Inf).
  amax:      fp32 scalar ``max |x|``.
  fmt:       format name, "e4m3" or "e5m2".
  """

  data: jax.Array
  scale_inv: jax.Array
  amax: jax.Array
  fmt: str = dataclasses.field(default="e4m3", metadata=dict(static=True))

  @property
  def shape(self):
    return self.data.shape

  def values(self, dtype=jnp.bfloat16) -> jax.Array:
    """The FP8 values ``q`` (without ``scale_inv``) in ``dtype``; exact in bf16 and fp32."""
    return self.data.astype(dtype)


def quantize(x, fmt="e4m3") -> FP8Tensor:
  """Quantize ``x`` (bf16/fp32) with per-tensor current scaling (formulas in the module docstring)."""
  f = _fmt(fmt)
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"FP8 quantize needs a floating-point array, got dtype {x.dtype}")
  xf = _to_f32(x)
  # Integer max of the magnitude bits: exact and NaN-propagating (NaN bit patterns sort above Inf).
  amax_bits = jnp.max((_bits(xf) & np.uint32(0x7FFFFFFF)).astype(jnp.int32)) if xf.size else jnp.int32(0)
  amax = lax.bitcast_convert_type(amax_bits.astype(jnp.uint32), jnp.float32)
  scale = scale_from_amax(amax, f)
  scale_inv = np.float32(1.0) / scale
  scale_inv = jnp.where(jnp.isfinite(amax), scale_inv, amax)
  q = round_to_format(xf * scale, f)
  return FP8Tensor(data=q.astype(f.dtype), scale_inv=scale_inv, amax=amax, fmt=f.name)


def dequantize(t: FP8Tensor, dtype=jnp.float32) -> jax.Array:
  """``q * scale_inv`` in fp32, cast to ``dtype``."""
  return (t.data.astype(jnp.float32) * t.scale_inv).astype(dtype)
