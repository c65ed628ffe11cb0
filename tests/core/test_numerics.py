"""Tests of the NVFP4 quantizer (maxtext_nvfp4.core.nvfp4) beyond the shared suite: the XLA form's own paths,
rounding, SR statistics, bad input, non-finite input and exact division.

The shared bitwise suite every implementation runs (TE's golden vectors and the INDEPENDENT numpy + ml_dtypes
reference, tests/core/nvfp4_reference.py, on every input kind): test_quantizer_implementations.py. Here the
reference checks the XLA form on larger, mixed and fp32 inputs, and the golden vectors under a division as
inexact as XLA:GPU's.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from maxtext_nvfp4.core import formats
from maxtext_nvfp4.core import nvfp4 as nv
from maxtext_nvfp4.core.quantizer import api, formulas, hadamard, random_bits, xla
from nvfp4_reference import (  # the independent oracle and its inputs (tests/core/nvfp4_reference.py)
    f32, FLT_MAX, MODE_KW, MODES, assert_bits_equal, input_for, load_golden, make_input, quantize_ref, to_bf16)

# ================================================================================================
# Helpers
# ================================================================================================
E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def quantize_mode(x, mode, **kw):
  return nv.quantize(jnp.asarray(x).astype(jnp.bfloat16), **MODE_KW[mode], **kw)


def check_against(t, q, s8, amax, name):
  d = nv.as_numpy(t)
  assert_bits_equal(d["data"], q, f"{name} q")
  assert_bits_equal(d["scale"], s8, f"{name} scale")
  assert_bits_equal(np.float32(d["amax"]).reshape(1), np.float32(amax).reshape(1), f"{name} amax")


# ================================================================================================
# Beyond the shared suite (test_quantizer_implementations.py: the golden vectors and the reference on every
# input kind, for every implementation), the XLA form's own paths
# ================================================================================================
@pytest.fixture(scope="module")
def golden():
  return load_golden()


@pytest.mark.parametrize("sr", [False, True], ids=["rne", "sr"])
@pytest.mark.parametrize("mode", MODES)
def test_quantize_values_equals_block_values_of_quantize(mode, sr):
  """The fused GEMM-side path (no 4-bit packing) gives block_values(quantize(x)) and amax bit for bit, on
  every input kind side by side (subnormal, tiny, huge, ties, zero blocks) and with non-finite input."""
  kinds = ("normal", "wide_elem", "wide_tile", "zero_blocks", "tiny_clamped", "subnormal", "huge", "ties")
  x = np.concatenate([input_for(k, mode) for k in kinds], 0)
  xb = jnp.asarray(x, jnp.bfloat16)
  key = jax.random.key(3) if sr else None
  kw = dict(MODE_KW[mode], stochastic_key=key)
  for what, inp in (("finite", xb), ("nan", xb.at[70, 5].set(jnp.nan)), ("inf", xb.at[3, 100].set(-jnp.inf))):
    t = nv.quantize(inp, **kw)
    for dtype in (jnp.bfloat16, jnp.float32):
      v, amax = nv.quantize_values(inp, dtype=dtype, **kw)
      assert v.dtype == dtype
      assert_bits_equal(np.asarray(v, np.float32), np.asarray(nv.block_values(t, dtype), np.float32), f"{mode}/{what} values")
      assert_bits_equal(np.float32(amax).reshape(1), np.float32(t.amax).reshape(1), f"{mode}/{what} amax")
    assert float(nv.global_decode_scale(amax)) == float(nv.global_decode_scale(t)) or what != "finite"


def test_reference_inputs_hit_the_edge_paths():
  """The generated kinds really exercise the edge paths they are named for (guards the generators)."""
  q, s8, amax = quantize_ref(make_input("tiny_clamped", (64, 128), 11), "row")
  assert np.float64(2688) / amax > np.finfo(np.float32).max  # S_enc clamped to FLT_MAX
  x = make_input("subnormal", (64, 128), 11)
  assert 0 < np.abs(x).max() < np.finfo(np.float32).tiny  # fp32-subnormal tensor
  q, s8, amax = quantize_ref(make_input("wide_tile", (64, 128), 11), "row")
  assert ((s8 == 0) & (np.abs(q).reshape(64, 8, 16).max(-1) == 6)).any()  # zero scale, saturated q
  assert ((s8 > 0) & (s8 < 2.0**-6)).any()  # E4M3-subnormal scales
  _, s8, _ = quantize_ref(make_input("huge", (64, 128), 11), "row")
  assert (s8 == 0).any()  # the ~1e28 block's scale underflows
  _, s8, _ = quantize_ref(input_for("huge", "rht_col"), "rht_col")
  assert (s8 == 0).any()  # also after the RHT
  x = make_input("ties", (64, 128), 11)
  assert np.abs(x).max() == 2688
  enc_q = x.reshape(64, 8, 16)
  ties = np.isin(np.abs(enc_q) / (np.abs(enc_q).max(-1, keepdims=True) / 6), [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
  assert ties.sum() > 500  # exact E2M1 ties under power-of-two scales


@pytest.mark.parametrize("mode", MODES)
def test_larger_shapes_and_fp32_input(mode):
  """A bigger tensor with several kinds side by side, and fp32 (non-bf16) input for 1D/2D."""
  x = np.concatenate([make_input(k, (64, 128), 3) for k in ("normal", "wide_elem", "spikes", "wide_tile")], 0)
  if mode == "rht_col":
    x = input_for("wide_elem", mode, (256, 128), 5)
  check_against(quantize_mode(x, mode), *quantize_ref(x, mode), f"stack/{mode}")
  if mode != "rht_col":
    rng = np.random.default_rng(5)
    for lo, hi in ((-30, 30), (-45, -36)):  # wide range; fp32 subnormals with 24-bit (non-bf16) values
      xf = (rng.standard_normal((64, 128)) * 10.0 ** rng.uniform(lo, hi, (64, 128))).astype(np.float32)
      t = nv.quantize(jnp.asarray(xf), block_2d=True) if mode == "2d" else nv.quantize(jnp.asarray(xf), axis=1 if mode == "row" else 0)
      check_against(t, *quantize_ref(xf, mode), f"fp32 1e{lo}..1e{hi}/{mode}")


@pytest.mark.parametrize("mode", MODES)
def test_tiny_pow2_same_q_and_scales_as_normal(mode):
  x = input_for("normal", mode, seed=21)
  tiny = (x * np.float32(2.0**-100)).astype(np.float32)  # exact: every value stays normal
  assert np.array_equal(to_bf16(tiny), tiny)
  a, b = nv.as_numpy(quantize_mode(x, mode)), nv.as_numpy(quantize_mode(tiny, mode))
  assert_bits_equal(b["data"], a["data"], "tiny_pow2 q")
  assert_bits_equal(b["scale"], a["scale"], "tiny_pow2 scale")
  assert b["amax"] == a["amax"] * np.float32(2.0**-100)


def test_2d_columnwise_is_transpose_of_rowwise():
  x = make_input("student_t", (64, 128), 4)
  a = nv.as_numpy(nv.quantize(jnp.asarray(x, jnp.bfloat16), block_2d=True))
  b = nv.as_numpy(nv.quantize(jnp.asarray(x.T, jnp.bfloat16), block_2d=True))
  assert_bits_equal(b["data"], a["data"].T, "2d transpose q")
  assert_bits_equal(b["scale"], a["scale"].T, "2d transpose scale")


def test_batched_leading_dims_and_negative_axis():
  x = make_input("normal", (64, 128), 8)
  x3 = x.reshape(4, 16, 128)
  t = nv.quantize(jnp.asarray(x3, jnp.bfloat16), axis=-1)
  assert t.scale.shape == (4, 16, 8) and t.axis == 2
  q, s8, amax = quantize_ref(x, "row")
  check_against(t, q.reshape(4, 16, 128), s8.reshape(4, 16, 8), amax, "3d row")


# ================================================================================================
# 3. Element rounding vs ml_dtypes casts (millions of values)
# ================================================================================================
_e2m1_jit = jax.jit(lambda v: formats.round_to_format(v, formats.E2M1))
_e4m3_jit = jax.jit(lambda v: formats.round_to_format(v, formats.E4M3))


def _e2m1_inputs(n=2_000_000, seed=0):
  rng = np.random.default_rng(seed)
  ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
  parts = [
      rng.uniform(-6, 6, n // 2).astype(np.float32),
      (rng.choice([-1, 1], n // 4) * 10.0 ** rng.uniform(-45, 0.78, n // 4)).astype(np.float32),  # incl. subnormals
      np.concatenate([ties, -ties, np.nextafter(ties, 0), np.nextafter(ties, 7), E2M1_GRID, -E2M1_GRID]),
      np.array([0.0, -0.0, 6.0, -6.0, 1e-45, -1e-45], np.float32),
  ]
  grid_ties = rng.choice(np.concatenate([ties, -ties]), n // 4)  # many exact ties
  return np.concatenate(parts + [grid_ties.astype(np.float32)])


def test_round_to_e2m1_matches_ml_dtypes():
  v = _e2m1_inputs()
  ours = np.asarray(_e2m1_jit(jnp.asarray(v)))
  ref = v.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
  assert_bits_equal(ours, ref, "round_to_format(E2M1) vs ml_dtypes")  # bitwise: includes the sign of zero
  assert np.signbit(ours[v == -0.0][np.signbit(v[v == -0.0])]).all()


@pytest.mark.parametrize("fmt", [formats.E2M1, formats.E4M3, formats.E5M2], ids=lambda f: f.name)
def test_format_grid_is_ml_dtypes_value_table(fmt):
  """formats.grid (derived from the format's parameters) is the dtype's non-negative finite values in
  code order: code k (bit pattern without the sign) decodes to grid[k]."""
  nbits = 4 if fmt is formats.E2M1 else 8
  codes = np.arange(2 ** (nbits - 1), dtype=np.uint8)
  vals = np.asarray(jnp.asarray(codes).view(fmt.dtype) if nbits == 8 else
                    jax.lax.bitcast_convert_type(jnp.asarray(codes[::2] | (codes[1::2] << 4)), fmt.dtype).reshape(-1))
  vals = vals.astype(np.float32)
  finite = np.isfinite(vals)
  assert_bits_equal(formats.grid(fmt), vals[finite], f"{fmt.name} grid")
  assert formats.grid(fmt)[-1] == fmt.max


def test_e2m1_grid_index_is_round_to_format():
  """The element path's rounding as codes (grid_index, grid_value) equals the ml_dtypes cast magnitude."""
  v = _e2m1_inputs(n=200_000)
  a = jnp.minimum(jnp.abs(jnp.asarray(v)), 6.0)
  k = jax.jit(lambda a: formats.grid_index(a, formats.E2M1))(a)
  ref = np.abs(v.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))
  assert_bits_equal(np.asarray(jax.jit(lambda k: formats.grid_value(k, formats.E2M1))(k)), ref, "grid_value(grid_index)")
  assert_bits_equal(formats.grid(formats.E2M1)[np.asarray(k).astype(np.int32)], ref, "grid[grid_index]")


def test_round_to_e4m3_matches_ml_dtypes():
  rng = np.random.default_rng(1)
  n = 1_000_000
  e4m3_vals = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
  grid = np.unique(np.abs(e4m3_vals[np.isfinite(e4m3_vals)]))
  mids = (grid[:-1] + grid[1:]) / 2  # exact ties (including the subnormal range and 2**-10)
  v = np.concatenate([
      rng.uniform(0, 448, n).astype(np.float32),
      (10.0 ** rng.uniform(-6, np.log10(448), n)).astype(np.float32),
      rng.uniform(0, 2.0**-6, n // 4).astype(np.float32),  # E4M3 subnormal range
      (10.0 ** rng.uniform(-45, -6, n // 4)).astype(np.float32),  # underflow, incl. fp32 subnormals
      mids, np.nextafter(mids, 0), np.nextafter(mids, 500), grid,
  ]).astype(np.float32)
  v = np.concatenate([v, -v, np.array([0.0, -0.0], np.float32)])
  ours = np.asarray(_e4m3_jit(jnp.asarray(v)))
  ref = v.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
  assert_bits_equal(ours, ref, "round_to_format(E4M3) vs ml_dtypes")


def test_round_to_bf16_matches_ml_dtypes():
  rng = np.random.default_rng(2)
  v = (rng.standard_normal(1_000_000) * 10.0 ** rng.uniform(-40, 37, 1_000_000)).astype(np.float32)
  ours = np.asarray(jax.jit(formats.round_to_bf16)(jnp.asarray(v)))
  ref = v.astype(ml_dtypes.bfloat16).astype(np.float32)
  assert_bits_equal(ours, ref, "round_to_bf16 vs ml_dtypes")


# ================================================================================================
# 4. Robust to XLA: jitted quantize -> dequantize stays on the E2M1 grid
# ================================================================================================
def test_jit_qdq_on_grid_and_equal_to_eager():
  x = jnp.asarray(make_input("student_t", (64, 128), 9), jnp.bfloat16)  # shape of the kinds tests: eager cached
  for kw in (dict(axis=1), dict(axis=0), dict(block_2d=True), dict(axis=0, rht=True)):
    f = jax.jit(lambda v, kw=kw: (nv.dequantize(nv.quantize(v, **kw)), nv.quantize(v, **kw).data.astype(jnp.float32)))
    deq, q_f32 = f(x)
    t = nv.quantize(x, **kw)
    assert_bits_equal(deq, nv.dequantize(t), f"jit vs eager dequantize {kw}")
    assert np.isin(np.abs(np.asarray(q_f32)), E2M1_GRID).all()
    g = np.asarray(nv.dequantize(nv.NVFP4Tensor(data=jnp.ones_like(t.data), scale=t.scale, amax=t.amax,
                                                axis=t.axis, block_2d=t.block_2d, rht=t.rht)))
    cand = E2M1_GRID[None, :] * g.reshape(-1, 1)  # fl(k * g) for every grid value k
    on_grid = (cand == np.abs(np.asarray(deq)).reshape(-1, 1)).any(axis=1)
    assert on_grid.all(), f"dequantized values off the E2M1 grid x scale {kw}: {np.asarray(deq).ravel()[~on_grid][:4]}"
    assert_bits_equal(q_f32, t.data.astype(jnp.float32), f"jit vs eager data {kw}")


def test_explicit_rounding_under_jit():
  """The rounding helpers are arithmetic, not converts, so no XLA convert folding can remove them."""
  v = jnp.asarray(np.linspace(-7, 7, 4097, dtype=np.float32))
  r = np.asarray(_e2m1_jit(v))
  assert np.isin(np.abs(r), E2M1_GRID).all()
  hlo = _e2m1_jit.lower(v).as_text()
  assert "f4E2M1" not in hlo and "f8E4M3" not in _e4m3_jit.lower(v).as_text()
  b = np.asarray(jax.jit(formats.round_to_bf16)(v * np.float32(1.001)))
  assert np.array_equal(b, b.astype(ml_dtypes.bfloat16).astype(np.float32))


# ================================================================================================
# 5. Stochastic rounding
# ================================================================================================
def _scaled_ref(x, mode):
  """y = clip(x * enc, -6, 6) per the reference (what SR rounds), numpy float32."""
  x = np.asarray(x, np.float32)
  _, s8, amax = quantize_ref(x, mode)
  s_enc = np.float32(np.fmin(np.float32(2688) / amax, np.finfo(np.float32).max)) if amax > 0 else np.float32(1)
  s_dec = np.float32(1) / s_enc
  with np.errstate(divide="ignore", over="ignore"):
    enc = np.fmin(np.float32(1) / (s8 * s_dec), np.finfo(np.float32).max)
  enc_full = np.repeat(enc, 16, axis=1) if mode == "row" else np.repeat(enc, 16, axis=0)
  return np.clip(x * enc_full, -6, 6)


def _neighbours(y):
  a = np.abs(y)
  step = np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0)).astype(np.float32)
  lo = np.floor(a / step) * step
  hi = np.minimum(np.where(lo == a, lo, lo + step), 6)
  return np.copysign(lo, y), np.copysign(hi, y), step


@pytest.fixture(scope="module")
def sr_draws():
  x = make_input("normal", (64, 128), 12)
  n = 256
  keys = jax.random.split(jax.random.key(0), n)
  f = jax.jit(jax.vmap(lambda k: nv.quantize(jnp.asarray(x, jnp.bfloat16), axis=1, stochastic_key=k).data.astype(jnp.float32)))
  return x, np.asarray(f(keys)), n


def test_sr_draws_are_neighbours_and_bounded(sr_draws):
  x, q, n = sr_draws
  y = _scaled_ref(x, "row")
  lo, hi, _ = _neighbours(y)
  assert ((q == lo) | (q == hi)).all(), "SR produced a value that is not one of the two neighbours"
  assert np.abs(q).max() <= 6
  t = nv.quantize(jnp.asarray(x, jnp.bfloat16), axis=1, stochastic_key=jax.random.key(3))
  r = nv.quantize(jnp.asarray(x, jnp.bfloat16), axis=1)
  assert_bits_equal(t.scale.astype(jnp.float32), r.scale.astype(jnp.float32), "SR leaves the scales alone")
  deq, lim = np.asarray(nv.dequantize(t)), np.repeat(np.asarray(r.scale, np.float32), 16, 1) * (float(r.amax) / 2688)
  assert (np.abs(deq) <= 6 * lim * (1 + 1e-6)).all()


def test_sr_unbiased(sr_draws):
  """E[q] = lo + step * P(up); with 8 random bits P(up) is frac floored to 1/256, so the bias is in
  [-step/256, 0] (towards zero). Bound: |mean - y| <= step/256 + 6 sigma, sigma = step*sqrt(p(1-p)/n)."""
  x, q, n = sr_draws
  y = _scaled_ref(x, "row")
  lo, hi, step = _neighbours(y)
  p = np.where(hi != lo, (np.abs(y) - np.abs(lo)) / step, 0)
  sigma = step * np.sqrt(p * (1 - p) / n)
  err = np.abs(q.mean(0) - y)
  bound = step / 256 + 6 * sigma + 1e-7
  assert (err <= bound).all(), f"max excess {np.max(err - bound)}"
  assert (p > 0.05).sum() > 1000 and 0 < q.std(0).max()  # the test has teeth: many random elements


def test_sr_mean_mae_not_worse_than_rne(sr_draws):
  """TE's SR test: MAE(mean of SR dequants, x) < MAE(RNE dequant, x) (here with 16 draws)."""
  x, q, n = sr_draws
  r = nv.quantize(jnp.asarray(x, jnp.bfloat16), axis=1)
  g = np.repeat(np.asarray(r.scale, np.float32), 16, 1) * (np.float32(r.amax) / np.float32(2688))
  mae_sr = np.abs(q[:16].mean(0) * g - x).mean()
  mae_rn = np.abs(np.asarray(nv.dequantize(r)) - x).mean()
  assert mae_sr < mae_rn, (mae_sr, mae_rn)


def test_sr_keys():
  x = jnp.asarray(make_input("normal", (64, 128), 13), jnp.bfloat16)
  a = nv.quantize(x, stochastic_key=jax.random.key(1)).data.astype(jnp.float32)
  b = nv.quantize(x, stochastic_key=jax.random.key(1)).data.astype(jnp.float32)
  c = nv.quantize(x, stochastic_key=jax.random.key(2)).data.astype(jnp.float32)
  assert_bits_equal(a, b, "same key same draws")
  assert (np.asarray(a) != np.asarray(c)).sum() > 50
  for kw in (dict(axis=0, rht=True), dict(block_2d=True)):  # SR works in the other modes too
    t = nv.quantize(x, stochastic_key=jax.random.key(1), **kw)
    assert np.isin(np.abs(np.asarray(t.data, np.float32)), E2M1_GRID).all()


@pytest.mark.parametrize("shape", [(512, 1024), (64, 16, 36), (4096, 7)])
def test_sr_random_bytes_uniform_and_uncorrelated(shape):
  """The SR bits (keyed counter hash): every byte value equally likely, every bit balanced, no serial
  correlation between neighbouring elements (within and across the 4 bytes of a word, and along rows),
  and no correlation between two keys (fold_in 1 / 2: the dgrad and wgrad copies) or two steps."""
  key = jax.random.key(7)
  u = np.asarray(random_bits.random_bytes(key, shape)).astype(np.float64)
  assert u.shape == shape
  n = u.size
  hist = np.bincount(u.astype(np.int64).ravel(), minlength=256)
  chi2 = ((hist - n / 256) ** 2 / (n / 256)).sum()
  assert chi2 < 255 + 6 * np.sqrt(2 * 255), chi2  # ~6 sigma of the chi-square(255) null
  bits_ = (u.astype(np.uint8)[..., None] >> np.arange(8)) & 1
  assert np.abs(bits_.reshape(-1, 8).mean(0) - 0.5).max() < 6 * 0.5 / np.sqrt(n)
  tol = 6 / np.sqrt(n)  # correlation of independent uniforms: ~N(0, 1/n)

  def corr(a, b):
    return np.corrcoef(a.ravel(), b.ravel())[0, 1]

  flat = u.reshape(-1)
  for lag in (1, 2, 3, 4, 5, 16):
    assert abs(corr(flat[:-lag], flat[lag:])) < tol * 1.01, lag
  if len(shape) >= 2 and shape[-2] > 1:
    assert abs(corr(u[..., :-1, :], u[..., 1:, :])) < tol * 1.01
  others = [jax.random.fold_in(key, 1), jax.random.fold_in(key, 2), jax.random.key(8)]
  draws = [np.asarray(random_bits.random_bytes(k, shape)).astype(np.float64) for k in others]
  for i, a in enumerate([u] + draws):
    for b in draws[i:]:
      if a is not b:
        assert abs(corr(a, b)) < tol, "two keys gave correlated SR bits"
  # Same key, same bits (determinism); a different key changes nearly every byte.
  assert np.array_equal(u, np.asarray(random_bits.random_bytes(key, shape)))
  assert (u != draws[2]).mean() > 0.99


# ================================================================================================
# 6. Bad and extreme input
# ================================================================================================
def test_length_not_multiple_of_16():
  with pytest.raises(ValueError, match=r"axis 1 has size 20"):
    nv.quantize(jnp.ones((32, 20)))
  with pytest.raises(ValueError, match=r"axis 0 has size 24"):
    nv.quantize(jnp.ones((24, 32)), axis=0)
  with pytest.raises(ValueError, match=r"axis 0 has size 8"):
    nv.quantize(jnp.ones((8, 32)), block_2d=True)
  with pytest.raises(ValueError, match=r"axis 0 has size 40"):
    nv.rht(jnp.ones((40, 16)), axis=0)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.uint8, jnp.bool_])
def test_integer_dtype_type_error(dtype):
  with pytest.raises(TypeError, match="floating"):
    nv.quantize(jnp.ones((16, 16), dtype))


def test_nan_poisons_everything():
  x = np.asarray(make_input("normal", (32, 64), 14))
  x[5, 7] = np.nan
  for kw in (dict(axis=1), dict(axis=0), dict(block_2d=True), dict(axis=0, rht=True)):
    t = nv.quantize(jnp.asarray(x, jnp.bfloat16), **kw)
    assert np.isnan(float(t.amax))
    assert np.isnan(np.asarray(t.scale, np.float32)).all()
    assert np.isnan(np.asarray(nv.dequantize(t))).all(), kw
    assert (np.asarray(t.data, np.float32) == 6).all()  # documented: data is +6 everywhere


def test_inf_matches_te_and_dequantizes_nonfinite():
  x = np.asarray(make_input("normal", (32, 64), 15))
  x[3, 20] = np.inf
  x[9, 40] = -np.inf
  for mode in ("row", "col", "2d"):
    t = quantize_mode(x, mode)
    check_against(t, *quantize_ref(x, mode), f"inf/{mode}")
    assert not np.isfinite(np.asarray(nv.dequantize(t))).any()
  t = quantize_mode(x, "row")
  assert float(t.amax) == np.inf and np.asarray(t.scale, np.float32)[3, 1] == 448
  assert np.asarray(t.data, np.float32)[3, 20] == 6 and np.asarray(t.data, np.float32)[9, 40] == -6


def test_all_zero_exact():
  for mode in MODES:
    t = quantize_mode(np.zeros((32, 64), np.float32), mode)
    assert float(t.amax) == 0
    assert not np.asarray(t.scale, np.float32).any()
    deq = np.asarray(nv.dequantize(t))
    assert not np.isnan(deq).any() and not deq.any() and not np.signbit(deq).any()


@pytest.mark.parametrize("v", [1e-30, 1e30, float(ml_dtypes.finfo(ml_dtypes.bfloat16).max), 1e-40])
def test_extreme_magnitudes(v):
  rng = np.random.default_rng(16)
  x = to_bf16(rng.uniform(-1, 1, (32, 64)) * (v / 64))  # / 64: the RHT sums must not overflow
  x[0, 0] = to_bf16(np.array([v]))[0]
  for mode in MODES:
    check_against(quantize_mode(x, mode), *quantize_ref(x, mode), f"{v}/{mode}")
  t = quantize_mode(x, "row")
  deq = np.asarray(nv.dequantize(t))
  assert np.isfinite(deq).all()
  if v >= 1e-30:  # amax / 2688 and the products stay normal: relative error of NVFP4 (< 1/3 per block)
    big = np.abs(x) >= np.repeat(np.abs(x).reshape(32, 4, 16).max(-1), 16, 1) / 2
    assert (np.abs(deq - x)[big] <= np.abs(x)[big] / 3).all()


# ================================================================================================
# 7. pack / unpack: TE's byte layout
# ================================================================================================
def test_pack_unpack_round_trip_and_nibble_order():
  rng = np.random.default_rng(17)
  vals = np.concatenate([E2M1_GRID, -E2M1_GRID])  # includes -0.0
  data = rng.choice(vals, size=(8, 64)).astype(np.float32)
  packed = np.asarray(nv.pack(jnp.asarray(data, jnp.float4_e2m1fn)))
  codes = data.astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF  # ml_dtypes' own bit encoding
  assert packed.dtype == np.uint8 and packed.shape == (8, 32)
  assert np.array_equal(packed, codes[:, 0::2] | (codes[:, 1::2] << 4))  # element 2i in the low nibble
  back = np.asarray(nv.unpack(jnp.asarray(packed)).astype(jnp.float32))
  assert_bits_equal(back, data, "unpack(pack(x))")
  assert nv.pack(jnp.asarray([0.5, -6.0], jnp.float4_e2m1fn)).tolist() == [0xF1]
  t = nv.quantize(jnp.asarray(make_input("normal", (32, 64), 1), jnp.bfloat16))  # golden case01's shape: eager-cached
  assert_bits_equal(np.asarray(nv.unpack(t.pack()), np.float32), np.asarray(t.data, np.float32), "tensor pack")
  with pytest.raises(ValueError):
    nv.pack(jnp.zeros((3,), jnp.float4_e2m1fn))


def test_block_values_and_global_scale():
  x = jnp.asarray(make_input("spikes", (64, 128), 18), jnp.bfloat16)
  t = nv.quantize(x, block_2d=True)
  bv = np.asarray(nv.block_values(t, jnp.float32))
  q, s8 = np.asarray(t.data, np.float32), np.asarray(t.scale, np.float32)
  assert_bits_equal(bv, q * np.repeat(np.repeat(s8, 16, 0), 16, 1), "block_values")
  assert_bits_equal(np.asarray(nv.block_values(t), np.float32), bv, "block_values exact in bf16")
  assert float(nv.global_decode_scale(t)) == np.float32(t.amax) / np.float32(2688)
  leaves = jax.tree_util.tree_leaves(t)
  assert len(leaves) == 3  # data, scale, amax are the pytree children; axis/2d/rht are static


# Jitted once for the module (a fresh jax.jit(lambda) per call would recompile for every kind).
_RHT_BRANCHY = jax.jit(lambda v: hadamard.rht_bf16(v, 0, branchless=False))
_RHT_BRANCHLESS = jax.jit(lambda v: hadamard.rht_bf16(v, 0, branchless=True))


@pytest.mark.parametrize("kind", ["normal", "tiny_pow2", "tiny_clamped", "subnormal", "wide_elem", "huge", "zero_blocks"])
def test_rht_branchless_path_equals_branchy(kind):
  """The RHT's GPU form (exact path for every group, no conditional) gives the CPU form's bits, with and
  without tiny groups in the tensor; a mix of tiny and normal groups takes both paths in one tensor."""
  x = make_input(kind, (64, 128), 21, tiny_block_axis=0)
  mixed = np.concatenate([x, make_input("tiny_pow2", (64, 128), 22)], 0)
  for arr in (x, mixed):
    xb = jnp.asarray(arr, jnp.bfloat16)
    a = _RHT_BRANCHY(xb)
    b = _RHT_BRANCHLESS(xb)
    assert_bits_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), f"{kind} rht branchless")
    assert_bits_equal(np.asarray(a, np.float32), np.asarray(nv.rht(xb, axis=0)), f"{kind} rht default")


def test_recip_normal_matches_ieee_including_subnormal_results():
  """S_dec's fl(1/s), from integers: every s above 2**126 (subnormal results; numpy keeps subnormals) and normal s."""
  rng = np.random.default_rng(0)
  lo, hi = np.float32(2.0**126).view(np.uint32), np.finfo(np.float32).max.view(np.uint32)
  b = np.concatenate([rng.integers(lo, hi, 100_000, dtype=np.uint64).astype(np.uint32),
                      np.arange(lo - 20, lo + 2000, dtype=np.uint32), np.arange(hi - 2000, hi + 1, dtype=np.uint32),
                      rng.integers(0x00800000, lo, 50_000, dtype=np.uint64).astype(np.uint32)])
  s = b.view(np.float32)
  assert_bits_equal(np.asarray(jax.jit(formulas.recip_normal)(s)), np.float32(1) / s, "1/s")
  assert np.isnan(np.asarray(jax.jit(formulas.recip_normal)(np.float32(np.nan))))


def test_is_zero_tells_subnormals_from_zero():
  """formats.is_zero: +-0 only; every subnormal, normal, inf and NaN is nonzero (XLA:CPU's compares treat
  subnormals as zero), on its own and fused with a float compare of the same values."""
  rng = np.random.default_rng(7)
  v = np.concatenate([np.array([0.0, -0.0, np.inf, -np.inf, np.nan, FLT_MAX, 2.0**-149, -(2.0**-149)], f32),
                      rng.integers(1, 0x00800000, 2000, dtype=np.uint64).astype(np.uint32).view(f32),
                      rng.integers(0x00800000, 0x7F800000, 2000, dtype=np.uint64).astype(np.uint32).view(f32)])
  want = np.zeros(v.shape, bool)
  want[:2] = True
  assert np.array_equal(np.asarray(jax.jit(formats.is_zero)(v)), want)
  both = jax.jit(lambda a: (formats.is_zero(a), a == 0))(v)
  assert np.array_equal(np.asarray(both[0]), want)


def _amaxes_over_the_whole_range(seed):
  rng = np.random.default_rng(seed)
  return np.concatenate([
      rng.integers(1, 0x7F800000, 3000, dtype=np.uint64).astype(np.uint32).view(f32),  # every exponent
      rng.integers(1, 0x00800000, 300, dtype=np.uint64).astype(np.uint32).view(f32),  # subnormal
      np.arange(0x7F7FFF00, 0x7F800000, dtype=np.uint32).view(f32),  # the largest: the smallest S_enc
      np.array([0.0, -0.0, 1.0, 2688.0, 1536.0, FLT_MAX, np.inf, np.nan, 2.0**-126, 2688.0 * 2.0**-126], f32)])


def _ieee_global_scales(amax, bound):
  """numpy's IEEE chain (subnormals kept): S_enc = min(6B / amax, FLT_MAX), 1 for a zero amax or a zero
  quotient (amax inf), NaN for NaN, as TE's compute_global_encode_scaling_factor_FP4; S_dec = 1 / S_enc."""
  with np.errstate(over="ignore", divide="ignore", invalid="ignore", under="ignore"):
    s_enc = np.minimum(f32(6 * bound) / np.abs(amax), FLT_MAX).astype(f32)
    s_enc = np.where((amax == 0) | (s_enc == 0), f32(1.0), s_enc)  # numpy compares subnormals as nonzero
    s_enc = np.where(np.isnan(amax), amax, s_enc).astype(f32)
    return s_enc, (f32(1.0) / s_enc).astype(f32)


@pytest.mark.parametrize("bound", [448, 256])
def test_global_scales_are_ieee_for_every_amax_in_any_fusion(bound):
  """(S_enc, S_dec) of a tensor amax == numpy's IEEE chain bit for bit over the whole fp32 range, compiled on
  its own rather than inside a quantizer. A subnormal amax is not zero: S_enc saturates at FLT_MAX and S_dec
  is subnormal. (With the zero test written as a masked-bits compare, LLVM folded it into a float compare here
  and XLA:CPU's denormals-are-zero gave S_enc = 1 for 316 of these amaxes; inside the quantizer's fusions it
  did not.)"""
  amax = _amaxes_over_the_whole_range(5)
  s_enc, s_dec = _ieee_global_scales(amax, bound)
  ours = jax.jit(jax.vmap(lambda a: formulas.global_scales(a, bound)))(np.abs(amax))
  assert_bits_equal(np.asarray(ours[0]), s_enc, "S_enc")
  assert_bits_equal(np.asarray(ours[1]), s_dec, "S_dec")


def _ieee_encode(s8, s_dec):
  with np.errstate(over="ignore", divide="ignore", invalid="ignore", under="ignore"):
    enc = (f32(1.0) / (s8.astype(f32) * s_dec).astype(f32)).astype(f32)
  return np.where(np.isnan(enc), enc, np.minimum(enc, FLT_MAX)).astype(f32)


def test_e4m3_grid_parts_are_its_values():
  """The encode table's host constants: every E4M3 value is k8 * 2**j8 with a 4-bit k8 (0 for 0)."""
  k8, j8 = formulas.E4M3_K8, formulas.E4M3_J8
  assert np.array_equal(k8 * np.exp2(j8.astype(np.float64)), formulas.E4M3_GRID.astype(np.float64))
  assert k8[0] == 0 and np.all((k8[1:] >= 1) & (k8[1:] < 16))


@pytest.mark.parametrize("seed_fn", ["backend", "sloppy"])
@pytest.mark.parametrize("bound", [448, 256])
def test_encode_scales_are_ieee_for_every_amax(monkeypatch, seed_fn, bound):
  """enc = min(fl(1 / fl(s8 * S_dec)), FLT_MAX) == numpy's IEEE quotient bit for bit, for every E4M3 value s8
  (the 127-entry table of a scalar S_dec) and per block (a per-row S_dec, row-scaled), over S_dec of amaxes
  across the whole fp32 range: subnormal S_dec and products (1/p overflows: FLT_MAX), zero s8, the largest
  S_dec (bound 256: 1/p near 2**-126), NaN; with the backend's division and one up to 2 ulps off as the seed."""
  if seed_fn == "sloppy":
    monkeypatch.setattr(formats, "_seed_quotient", _sloppy_seed)
  amax = _amaxes_over_the_whole_range(9)
  _, s_dec = _ieee_global_scales(amax, bound)
  grid = formulas.E4M3_GRID
  table = jax.jit(jax.vmap(lambda d: xla.encode_scales(jnp.asarray(grid), d)))(s_dec)
  assert_bits_equal(np.asarray(table), _ieee_encode(grid[None, :], s_dec[:, None]), "encode table")
  rows = np.random.default_rng(4).choice(grid, (s_dec.size, 8))
  per_row = jax.jit(xla.encode_scales)(rows, s_dec[:, None])
  assert_bits_equal(np.asarray(per_row), _ieee_encode(rows, s_dec[:, None]), "encode per block")


def test_gpu_lowering_of_the_quantizer_has_no_loop():
  """On GPU a while loop costs kernel launches and a host round trip per iteration: the quantizer, lowered
  for CUDA (lowering only, no GPU needed), has none -- not in the exact reciprocal, the RHT, or SR."""
  x = jnp.ones((64, 128), jnp.bfloat16)
  key = jax.random.key(0)
  fns = {
      # the XLA form (on XLA:GPU a Triton kernel takes unbatched calls: tests/core/test_quantizer_hlo.py)
      "rht+sr values": lambda x, k: xla.quantize_values(x, k, 0, False, True, jnp.bfloat16),
      "1d sr": lambda x, k: api._quantize_impl(x, k, None, 1, False, False, nv.STANDARD_RULE, "auto", ""),
      "2d": lambda x, k: xla.quantize(x, None, None, True, False),
  }
  for name, fn in fns.items():
    text = jax.jit(fn).trace(x, key).lower(lowering_platforms=("cuda",)).as_text()
    assert "stablehlo.while" not in text, name
    assert "stablehlo.reduce" in text, name  # sanity: it is the quantizer's program


# ================================================================================================
# Division: XLA:GPU's fp32 division is not IEEE (div.full.f32, 1 ulp off for ~1/4 of quotients;
# first seen on the H200: benchmarks/RESULTS.md). Every quotient in the quantizer goes
# through formats.div_rn, which uses the backend's division only as a seed.
# ================================================================================================
def _positive_finite_pairs(n, seed):
  rng = np.random.default_rng(seed)
  a = rng.integers(0, 0x7F800000, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
  b = rng.integers(1, 0x7F800000, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
  # Quotients near 1, at the overflow and subnormal edges, and exact ones.
  c = rng.integers(0x3F800000, 0x40000000, n // 4, dtype=np.uint64).astype(np.uint32).view(np.float32)
  a = np.concatenate([a, c, c * f32(3), np.full(16, FLT_MAX, f32), np.float32(2.0) ** np.arange(-149, -133, dtype=f32)])
  b = np.concatenate([b, c[::-1], c, np.float32(2.0) ** np.arange(-149, -133, dtype=f32), np.full(16, FLT_MAX, f32)])
  return a, b


def _sloppy_seed(n, d):
  """A division as bad as div.full.f32 and worse: the IEEE quotient moved by -2..+2 ulps."""
  q = n / d
  steps = (formats.bits(n) ^ formats.bits(d)) % 5  # deterministic per element, 0..4
  return formats.from_bits((formats.bits(q).astype(jnp.int32) + steps.astype(jnp.int32) - 2).astype(jnp.uint32))


@pytest.mark.parametrize("seed_fn", ["backend", "sloppy"])
def test_div_rn_is_the_ieee_quotient(monkeypatch, seed_fn):
  """div_rn == numpy's IEEE fp32 a / b bit for bit: full range, subnormal operands and results, overflow,
  and with a seed division up to 2 ulps off (what XLA:GPU gives), so it is exact on a GPU too."""
  if seed_fn == "sloppy":
    monkeypatch.setattr(formats, "_seed_quotient", _sloppy_seed)
  a, b = _positive_finite_pairs(400_000, 3)
  with np.errstate(over="ignore", under="ignore"):
    ref = a / b
  assert_bits_equal(np.asarray(jax.jit(formats.div_rn)(a, b)), ref, f"div_rn ({seed_fn} seed)")
  sa = np.array([0, 0, 1, np.inf, np.nan, 1, 2688, 1e-45, 3e38, np.inf, 0], f32)
  sb = np.array([1, 0, 0, 2, 1, np.inf, 1e-45, 3e38, 1e-45, np.inf, np.nan], f32)
  with np.errstate(all="ignore"):
    ref = sa / sb
  got = np.asarray(formats.div_rn(sa, sb))
  assert np.array_equal(np.isnan(got), np.isnan(ref))  # NaN payloads and signs may differ
  assert_bits_equal(got[~np.isnan(ref)], ref[~np.isnan(ref)], "div_rn special values")


def test_quantizer_and_fp8_exact_with_a_gpu_like_division(monkeypatch, golden):
  """The whole quantizer (and the FP8 scales) on a backend whose division is up to 2 ulps off: golden
  vectors still bit for bit (before div_rn, golden checks failed on the H200 this way)."""
  from maxtext_nvfp4.core import fp8

  monkeypatch.setattr(formats, "_seed_quotient", _sloppy_seed)
  jax.clear_caches()  # the jitted quantizer was traced with the backend's division
  try:
    z, idx = golden
    for name in ("case01_row_normal_32x64", "case17_col_normal_128x256", "case31_2d_normal_32x64",
                 "case45_rht_col_normal_64x128"):
      c = idx[name]
      x = jnp.asarray(z[name + "_x"]).astype(jnp.bfloat16)
      t = nv.quantize(x, block_2d=True) if c["mode"] == "2d" else nv.quantize(x, axis=c["axis"], rht=c["rht"])
      check_against(t, z[name + "_q"], z[name + "_scale"], z[name + "_amax"], f"{name} (sloppy division)")
      assert_bits_equal(nv.dequantize(t), z[name + "_deq_jaxte"], f"{name} dequantize (sloppy division)")
    amax = make_input("wide_elem", (64, 64), 5).astype(f32).ravel()
    amax = np.abs(amax[amax != 0])
    for fmt in ("e4m3", "e5m2"):
      fmax = f32(448.0 if fmt == "e4m3" else 57344.0)
      with np.errstate(over="ignore"):
        ref = np.where(np.isinf(fmax / amax), f32(FLT_MAX), fmax / amax)
      assert_bits_equal(np.asarray(jax.jit(lambda v: fp8.scale_from_amax(v, fmt))(amax)), ref, f"fp8 {fmt} scale")
  finally:
    monkeypatch.undo()
    jax.clear_caches()


# The bit-exact modules, and the divisions in them that are not by a constant (each with its reason).
_DIVISION_ALLOWED = {
    ("formats.py", "_seed_quotient"): "the seed of div_rn, corrected exactly",
    ("formats.py", "div_rn"): "only for zero/Inf/NaN operands, where any division gives IEEE's answer",
    ("formats.py", "grid"): "host Python floats",
    ("formats.py", "grid_index"): "host Python floats (constants of the traced code)",
}


def test_no_traced_division_in_the_bit_exact_modules():
  """A ``/`` by a traced value in the quantizer would be 1 ulp off on GPU: quotients go through div_rn.

  Divisions by literals and module constants stay (XLA turns them into multiplications by the rounded
  reciprocal, identically on every backend -- gemm_alpha relies on that).
  """
  import ast

  root = pathlib.Path(formats.__file__).parent
  quantizer = sorted(str(p.relative_to(root)) for p in (root / "quantizer").glob("*.py"))
  assert "quantizer/xla.py" in quantizer and "quantizer/triton_kernels.py" in quantizer, quantizer
  found = []
  for fname in ("fp8.py", "formats.py", "gemm.py", "grouped_gemm.py", *quantizer):
    tree = ast.parse((root / fname).read_text())
    for fn in ast.walk(tree):
      if not isinstance(fn, ast.FunctionDef):
        continue
      for node in ast.walk(fn):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
          names = {n.id for n in ast.walk(node.right) if isinstance(n, ast.Name)} - {"np", "math"}
          if any(not n.lstrip("_").isupper() for n in names) and (fname, fn.name) not in _DIVISION_ALLOWED:
            found.append(f"{fname}:{node.lineno} {fn.name}: {ast.unparse(node)}")
  assert not found, "divisions by a traced value (use formats.div_rn):\n" + "\n".join(found)
