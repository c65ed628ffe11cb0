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

``fp8_rne_satfinite`` is :func:`maxtext_nvfp4.core.formats.round_to_format` (explicit exponent/step
arithmetic, never a float convert that XLA could fold; checked bit for bit against ``ml_dtypes`` casts).
Limitation: on flush-to-zero backends (XLA:CPU), fp32-subnormal inputs (|x| < 2**-126) read as zero;
this only matters for tensors whose amax is itself below ~1e-36.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from maxtext_nvfp4.core.formats import E4M3, E5M2, F32_ABS_MASK, FLT_MAX, FloatFormat, bits, from_bits
from maxtext_nvfp4.core.formats import canonical_nan_bits, round_to_format
from maxtext_nvfp4.core.formats import div_rn, is_zero, to_f32_exact

__all__ = ["E4M3", "E5M2", "FP8Tensor", "dequantize", "quantize", "scale_from_amax"]

_FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def _fmt(fmt) -> FloatFormat:
  """The FP8 format named ``fmt`` ("e4m3" | "e5m2"), or ``fmt`` itself when it is one of them."""
  if fmt in (E4M3, E5M2):
    return fmt
  if fmt not in _FORMATS:
    raise ValueError(f"unknown FP8 format {fmt!r}; choose one of {sorted(_FORMATS)}")
  return _FORMATS[fmt]


def scale_from_amax(amax, fmt) -> jax.Array:
  """TE current scaling: ``fp8_max / amax``; FLT_MAX if that overflows; 1 if amax is 0 or non-finite."""
  f = _fmt(fmt)
  amax = jnp.asarray(amax, jnp.float32)
  scale = div_rn(np.float32(f.max), amax)  # IEEE quotient on every backend (XLA:GPU divides 1 ulp off)
  scale = jnp.where(jnp.isinf(scale), np.float32(FLT_MAX), scale)
  # amax == ±0 from the significand (formats.is_zero): a flush-to-zero compare would also catch subnormal amaxes.
  return jnp.where(is_zero(amax) | ~jnp.isfinite(amax), np.float32(1.0), scale)


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
  xf = to_f32_exact(x)
  # Integer max of the magnitude bits: exact and NaN-propagating (NaN bit patterns sort above Inf).
  abs_bits = canonical_nan_bits((bits(xf) & np.uint32(F32_ABS_MASK)).astype(jnp.int32))  # a NaN: the quiet NaN
  amax = from_bits(jnp.max(abs_bits) if xf.size else jnp.int32(0))
  scale = scale_from_amax(amax, f)
  scale_inv = div_rn(np.float32(1.0), scale)
  scale_inv = jnp.where(jnp.isfinite(amax), scale_inv, amax)
  q = round_to_format(xf * scale, f)
  return FP8Tensor(data=q.astype(f.dtype), scale_inv=scale_inv, amax=amax, fmt=f.name)


def dequantize(t: FP8Tensor, dtype=jnp.float32) -> jax.Array:
  """``q * scale_inv`` in fp32, cast to ``dtype``."""
  return (t.data.astype(jnp.float32) * t.scale_inv).astype(dtype)
