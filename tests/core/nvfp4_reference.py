"""An INDEPENDENT numpy + ml_dtypes implementation of TE's NVFP4 quantizer (the oracle of test_numerics.py).

Written from TE's CUDA kernels at commit d0067d0 (transformer_engine/common/cast/nvfp4/core_nvfp4.cuh:
compute_global_encode_scaling_factor_FP4 and the block-scale order; quantize_transpose_nvfp4.cuh: the element
path; hadamard_transform/ for the RHT); shares no code with maxtext_nvfp4 (numpy float32 keeps subnormals, as
TE's kernels do).
"""

import ml_dtypes
import numpy as np

f32 = np.float32
FLT_MAX = np.finfo(f32).max
BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
RHT_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float64)


def hadamard16():
  """Sylvester H16[r, c] = (-1)**popcount(r & c)."""
  r = np.arange(16)
  pop = np.vectorize(lambda v: bin(v).count("1"))(r[:, None] & r[None, :])
  return np.where(pop % 2 == 0, 1.0, -1.0)


def bf16_round_f64(v):
  """Single RNE rounding of float64 ``v`` to bf16 (8 significant bits, subnormal step 2**-133)."""
  v = np.asarray(v, np.float64)
  _, e = np.frexp(v)  # v = m * 2**e, 0.5 <= |m| < 1  ->  ulp = 2**(e - 8)
  ulp = np.ldexp(1.0, np.maximum(e - 8, -133))
  r = np.round(v / ulp) * ulp  # exact scaling, np.round is half-to-even
  r = np.where(np.abs(r) > BF16_MAX, np.copysign(np.inf, v), r)
  return r.astype(f32)  # exactly representable


def rht_ref(x, axis=0):
  """TE's wgrad RHT along ``axis`` (groups of 16): exact float64 sum, one bf16 rounding.

  ``y[16g + c] = bf16(sum_r s_r * x[16g + r] * H16[r, c] / 4)``. float64 holds the sum exactly whenever
  the 16 inputs span fewer than ~45 binary orders of magnitude (true for every input kind here).
  """
  m = np.diag(RHT_SIGNS) @ hadamard16() / 4.0
  xm = np.moveaxis(np.asarray(x, np.float64), axis, -1)
  g = xm.reshape(xm.shape[:-1] + (xm.shape[-1] // 16, 16))
  y = np.einsum("...r,rc->...c", g, m).reshape(xm.shape)
  return np.moveaxis(bf16_round_f64(y), -1, axis)


def rht_order_sensitive(x, axis=0):
  """True if some RHT output changes when the fp32 sum runs sequentially, reversed or pairwise.

  TE's kernel accumulates the 16 products in an fp32 tensor-core MMA (order unspecified); like the golden
  generator, RHT cases use inputs whose bf16 result does not depend on the order.
  """
  m = (np.diag(RHT_SIGNS) @ hadamard16() / 4.0).astype(f32)
  xm = np.moveaxis(np.asarray(x, f32), axis, -1)
  g = xm.reshape(xm.shape[:-1] + (xm.shape[-1] // 16, 16))
  terms = g[..., :, None] * m  # exact (x * ±0.25), shape (..., r, c)
  exact = np.moveaxis(rht_ref(x, axis), axis, -1).reshape(g.shape)

  def tree(t):
    while t.shape[-2] > 1:
      t = t[..., 0::2, :] + t[..., 1::2, :]
    return t[..., 0, :]

  seq = np.zeros_like(terms[..., 0, :])
  rev = np.zeros_like(seq)
  for r in range(16):
    seq = seq + terms[..., r, :]
    rev = rev + terms[..., 15 - r, :]
  for s in (seq, rev, tree(terms)):
    b = s.astype(ml_dtypes.bfloat16).astype(f32)
    if not np.array_equal(b, exact):
      return True
  return False


def quantize_ref(x, mode):
  """q, s8, amax (float32) of the 2-D float32 array ``x`` for mode row | col | 2d | rht_col.

      amax  = max|xq|;  S_enc = min(2688/amax, FLT_MAX), 1 if amax == 0 or S_enc == 0;  S_dec = 1/S_enc
      s8    = e4m3(min(bamax * fl(S_enc * fl(1/6)), 448));  enc = min(1/(s8 * S_dec), FLT_MAX)
      q     = e2m1(clip(xq * enc, -6, 6))
  """
  x = np.asarray(x, f32)
  if mode == "rht_col":
    x = rht_ref(x, axis=0)
  amax = f32(np.abs(x).max())
  with np.errstate(divide="ignore", over="ignore"):
    s_enc = f32(np.fmin(f32(2688) / amax, FLT_MAX))
  if amax == 0 or s_enc == 0:
    s_enc = f32(1)
  s_dec = f32(f32(1) / s_enc)
  m, n = x.shape
  if mode == "2d":
    xb, red = x.reshape(m // 16, 16, n // 16, 16), (1, 3)
  elif mode == "row":
    xb, red = x.reshape(m, n // 16, 16), (2,)
  else:
    xb, red = x.reshape(m // 16, 16, n), (1,)
  bamax = np.abs(xb).max(axis=red, keepdims=True)
  c = f32(s_enc * f32(f32(1) / f32(6)))
  s8 = np.minimum(bamax * c, f32(448)).astype(ml_dtypes.float8_e4m3fn).astype(f32)
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    enc = np.fmin(f32(1) / (s8 * s_dec), FLT_MAX)
    q = np.clip(xb * enc, -6, 6).astype(ml_dtypes.float4_e2m1fn).astype(f32)
  return q.reshape(m, n), s8.squeeze(red), amax
