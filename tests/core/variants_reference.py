"""An INDEPENDENT numpy + ml_dtypes reference of TE 2.20.2's NVFP4 recipe variants (for test_recipe_variants.py).

Written from TE's PyTorch reference ``pytorch/custom_recipes/reference_nvfp4.py`` (``_quantize_blockwise_reference``,
``_quantize_blockwise_4over6_reference``, ``_sum_4over6_2d_error``, ``qgemm``); shares no code with
maxtext_nvfp4. numpy float32 is IEEE with subnormals, like torch on CPU. Works on a 2D matrix quantized
"rowwise" (1x16 along the last axis, or 16x16 tiles with the error summed along the last axis).
"""

import ml_dtypes
import numpy as np

f32 = np.float32
FLT_MAX = np.finfo(f32).max
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def e4m3(v):
  """RNE cast to float8_e4m3fn (saturation is done by the caller's clamp), back to fp32."""
  return np.asarray(v, f32).astype(ml_dtypes.float8_e4m3fn).astype(f32)


def e2m1_rne(v):
  """TE's ``cast_to_fp4x2`` thresholds on |v| <= 6, as values (sign kept)."""
  a = np.abs(v)
  idx = np.select([a <= .25, a < .75, a <= 1.25, a < 1.75, a <= 2.5, a < 3.5, a <= 5.0], range(7), 7)
  return np.where(v < 0, -E2M1_VALUES[idx], E2M1_VALUES[idx]).astype(f32)


def quantize(x, *, tile=(1, 16), four_over_six=False, bound=448, err_mode="MAE", row_scaled=False, picks=None):
  """(q values, s8, amax) of ``x`` (m, n) fp32: q (m, n), s8 (m, n // 16) per row-block (2D: repeated per
  tile row, as TE stores it), amax scalar or (m,) for row-scaled. ``picks``: a list that receives the
  4over6 choice (True: map-to-4) per row-block."""
  x = np.asarray(x, f32)
  m, n = x.shape
  ty, tx = tile
  if ty == 16:
    vmax = np.abs(x).reshape(m // 16, 16, n // 16, 16).max(axis=(1, 3))
    vec_max = np.repeat(vmax, 16, axis=0)[..., None]  # (m, n/16, 1)
  else:
    vec_max = np.abs(x).reshape(m, n // 16, 16).max(axis=-1, keepdims=True)
  xb = x.reshape(m, n // 16, 16)
  gmax_bound = f32(bound if four_over_six else 448)
  amax = np.abs(x).max(axis=1).astype(f32) if row_scaled else f32(np.abs(x).max())
  ga = amax.reshape(m, 1, 1) if row_scaled else amax
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    s_enc = np.minimum(f32(gmax_bound * f32(6)) / ga, FLT_MAX).astype(f32)
    s_enc = np.where(s_enc == 0, f32(1), s_enc).astype(f32)
    s_dec = (f32(1) / s_enc).astype(f32)
    if not four_over_six:
      dec = np.minimum(vec_max * (s_enc * (f32(1) / f32(6))), FLT_MAX).astype(f32)
      s8 = e4m3(np.clip(dec, -448, 448))
      enc = np.minimum(f32(1) / (s8 * s_dec), FLT_MAX).astype(f32)
      q = e2m1_rne(np.clip(xb * enc, -6, 6))
      return q.reshape(m, n), s8[..., 0], amax
    base = ((vec_max / f32(6)).astype(f32) * s_enc).astype(f32)
    cands = []
    for dec in (base, (base * f32(1.5)).astype(f32)):  # map-to-6, map-to-4
      s8 = e4m3(np.clip(dec, -448, 448))
      enc = np.minimum(f32(1) / (s8 * s_dec), FLT_MAX).astype(f32)
      q = e2m1_rne(np.clip((xb * enc).astype(f32), -6, 6))
      err = np.zeros(vec_max.shape, f32)
      g = ga[..., 0] if row_scaled else ga
      for i in range(16):
        val = ((q[:, :, i] * s8[..., 0]).astype(f32) * g).astype(f32)
        val = (val / f32(6 * bound)).astype(f32)
        d = (val - xb[:, :, i]).astype(f32)
        e = (d * d).astype(f32) if err_mode == "MSE" else np.abs(d)
        err = (err + e[..., None]).astype(f32)
      cands.append((q, s8, err))
  (q6, s6, e6), (q4, s4, e4) = cands
  if ty == 16:  # tree over the tile's 16 rows
    def tree(e):
      r = e[..., 0].reshape(m // 16, 16, n // 16)
      for h in (8, 4, 2, 1):
        r = (r[:, :h] + r[:, h:2 * h]).astype(f32)
      return np.repeat(r, 16, axis=0).reshape(m, n // 16, 1)
    e4, e6 = tree(e4), tree(e6)
  pick = e4 < e6
  if picks is not None:
    picks.append(pick[..., 0])
  q = np.where(pick, q4, q6)
  s8 = np.where(pick, s4, s6)
  return q.reshape(m, n), s8[..., 0], amax
