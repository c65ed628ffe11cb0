"""Tests of the exact FP8 current-scaling emulation (maxtext_nvfp4/core/fp8.py, its rounding in core/formats.py)
against ml_dtypes casts."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from maxtext_nvfp4.core import formats, fp8

_ML = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
_FMT = {"e4m3": formats.E4M3, "e5m2": formats.E5M2}
_round_jit = jax.jit(formats.round_to_format, static_argnums=1)


def _test_values(fmt, n=200_000, seed=0):
  """Random fp32 magnitudes over the whole format range (subnormals included), plus every grid
  point and every midpoint between neighbours (the ties RNE must send to the even neighbour)."""
  rng = np.random.default_rng(seed)
  mx = _MAX[fmt]
  exps = rng.uniform(np.log2(mx) - 30, np.log2(mx), n)
  v = (2.0**exps * rng.choice([-1, 1], n)).astype(np.float32)
  grid = np.unique(np.abs(np.arange(256, dtype=np.uint8).view(_ML[fmt]).astype(np.float32)))
  grid = grid[np.isfinite(grid)]
  mids = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(np.float32)
  special = np.concatenate([grid, mids, -grid, -mids, [0.0, -0.0]]).astype(np.float32)
  return np.concatenate([v, special])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_rounding_matches_ml_dtypes_bit_for_bit(fmt):
  v = _test_values(fmt)
  want = v.astype(_ML[fmt]).astype(np.float32)
  for got in (np.asarray(formats.round_to_format(jnp.asarray(v), _FMT[fmt])), np.asarray(_round_jit(jnp.asarray(v), _FMT[fmt]))):
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # signed zeros too


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_rounding_saturates_and_keeps_nan(fmt):
  mx = _MAX[fmt]
  v = jnp.asarray([mx * 1.03, -mx * 1.2, 1e30, -np.inf, np.inf, np.nan], jnp.float32)
  got = np.asarray(formats.round_to_format(v, _FMT[fmt]))
  np.testing.assert_array_equal(got[:5], [mx, -mx, mx, -mx, mx])
  assert np.isnan(got[5])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantize_current_scaling(fmt, dtype):
  x = (jax.random.normal(jax.random.key(1), (64, 48)) * 7.0).astype(dtype)
  t = fp8.quantize(x, fmt)
  xf = np.asarray(x, np.float32)
  amax = np.float32(np.abs(xf).max())
  scale = np.float32(_MAX[fmt]) / amax
  assert t.data.dtype == _ML[fmt] and t.fmt == fmt
  assert np.float32(t.amax) == amax
  assert np.float32(t.scale_inv) == np.float32(1.0) / scale
  # Data: the saturating RNE cast of fl(x * scale), per ml_dtypes (in range: |x*scale| <= max + 1ulp).
  scaled = np.clip(xf * scale, -_MAX[fmt], _MAX[fmt])
  np.testing.assert_array_equal(np.asarray(t.data.astype(jnp.float32)), scaled.astype(_ML[fmt]).astype(np.float32))
  assert np.abs(np.asarray(t.data.astype(jnp.float32))).max() == _MAX[fmt]  # the amax element maps to max
  deq = np.asarray(fp8.dequantize(t))
  np.testing.assert_array_equal(deq, np.asarray(t.data.astype(jnp.float32)) * np.float32(t.scale_inv))
  # Relative error of a normal-range element is at most half an ulp (2**-4 for E4M3, 2**-3 for E5M2).
  half_ulp = 2.0 ** -(4 if fmt == "e4m3" else 3)
  big = np.abs(xf) > amax * 2.0**-5
  assert np.all(np.abs(deq - xf)[big] <= half_ulp * np.abs(xf)[big] * (1 + 1e-6))


def test_quantize_zero_tiny_and_non_finite():
  t = fp8.quantize(jnp.zeros((4, 4)), "e4m3")
  assert float(t.scale_inv) == 1.0 and not np.any(np.asarray(t.data.astype(jnp.float32)))
  # Tiny amax: the scale is fp8_max / amax (large but finite).
  t = fp8.quantize(jnp.full((4,), 1e-30, jnp.float32), "e4m3")
  assert np.isfinite(float(t.scale_inv)) and np.allclose(np.asarray(fp8.dequantize(t)), 1e-30, rtol=1e-6)
  for bad in (np.nan, np.inf, -np.inf):
    x = jnp.ones((4, 4)).at[1, 2].set(bad)
    for fmt in ("e4m3", "e5m2"):
      t = fp8.quantize(x, fmt)
      deq = np.asarray(fp8.dequantize(t))
      assert not np.any(np.isfinite(deq[np.asarray(x) != 0])), (bad, fmt)
      assert np.isnan(float(t.amax)) if np.isnan(bad) else np.isinf(float(t.amax))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_scale_from_amax_is_tes_for_every_amax(fmt):
  """scale_from_amax == TE's compute_scale_from_amax (common/recipe/recipe_common.cuh: 1 for an Inf or zero amax,
  ``__fdiv_rn(max, amax)``, FLT_MAX where that overflows, 1 where it is NaN) bit for bit, compiled on its own, over
  the whole fp32 range: a subnormal amax is not zero (FLT_MAX: TE's GPU compare keeps subnormals), -0.0 is (1)."""
  rng = np.random.default_rng(11)
  amax = np.concatenate([rng.integers(1, 0x7F800000, 3000, dtype=np.uint64).astype(np.uint32).view(np.float32),
                         rng.integers(1, 0x00800000, 300, dtype=np.uint64).astype(np.uint32).view(np.float32),
                         np.array([0.0, -0.0, np.inf, np.nan, 1.0, _MAX[fmt], 2.0**-126], np.float32)])
  with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
    want = (np.float32(_MAX[fmt]) / amax).astype(np.float32)
  want = np.where(np.isinf(want), np.float32(formats.FLT_MAX), want)
  want = np.where(np.isnan(want), np.float32(1.0), want)
  want = np.where(np.isinf(amax) | (amax == 0), np.float32(1.0), want).astype(np.float32)  # numpy: -0.0 == 0
  got = np.asarray(jax.jit(lambda a: fp8.scale_from_amax(a, fmt))(amax))
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_errors():
  with pytest.raises(ValueError, match="unknown FP8 format"):
    fp8.quantize(jnp.ones(3), "e3m4")
  with pytest.raises(TypeError):
    fp8.quantize(jnp.ones(3, jnp.int32))
