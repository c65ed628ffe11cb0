"""The single-use GEMM operands as codes + scales (issue 51): the Triton codes kernels for 1x16 rows (RNE and SR,
``triton_kernels.rows_codes_call``) and the SR form of the COLS_RHT codes kernel give the XLA form's codes and
scales bit for bit, and their ``block_values`` are the values kernels' output bit for bit; ``gemm`` passes them to
the Pallas GEMM where it reads codes (``gemm_kernels.reads_codes``), with the same GEMM results as block values,
and never under the default "xla". CPU, Pallas's interpreter."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_nvfp4.core import gemm
from maxtext_nvfp4.core import gemm_kernels
from maxtext_nvfp4.core.gemm_kernels import dispatch
from maxtext_nvfp4.core.quantizer import api
from maxtext_nvfp4.core.quantizer import triton_kernels

_SPECIALS = [0.0, -0.0, 1e-30, -3e-39, 3.0e4, -2.5, 0.75, 448.0, -6.0, 2.0**-20]


def _operand(shape, seed):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal(shape) * np.exp(rng.uniform(-4, 4, shape))
  x.flat[: len(_SPECIALS)] = _SPECIALS
  x[1, :16] = 1e-33  # a block of subnormal-size values (fp32 operand) next to normal ones
  return x


def _u4(d):
  return np.asarray(jax.lax.bitcast_convert_type(d, jnp.uint4)).astype(np.uint8)


def _u8(d):
  return np.asarray(jax.lax.bitcast_convert_type(d, jnp.uint8))


def _bits(v):
  return np.asarray(v).view(np.uint16 if v.dtype == jnp.bfloat16 else np.uint32)


_CASES = {  # name: (quantize kwargs, dtype)
    "rows_rne_bf16": (dict(axis=-1), jnp.bfloat16),
    "rows_sr_bf16": (dict(axis=-1, stochastic_key=True), jnp.bfloat16),
    "rows_sr_fp32": (dict(axis=-1, stochastic_key=True), jnp.float32),
    "cols_rht_sr_bf16": (dict(axis=0, rht=True, stochastic_key=True), jnp.bfloat16),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_codes_kernels_equal_the_xla_form_and_the_values_kernels(case):
  kw, dtype = _CASES[case]
  kw = dict(kw)
  if kw.get("stochastic_key"):
    kw["stochastic_key"] = jax.random.key(11)
  x = jnp.asarray(_operand((32, 32) if kw.get("rht") else (48, 64), 5), dtype)
  t = api.quantize(x, implementation="triton", **kw)
  want = api.quantize(x, implementation="xla", **kw)
  assert (t.axis, t.rht, t.block_2d) == (want.axis, want.rht, want.block_2d)
  np.testing.assert_array_equal(_u4(t.data), _u4(want.data))
  np.testing.assert_array_equal(_u8(t.scale), _u8(want.scale))
  assert _bits(t.amax) == _bits(want.amax)
  values, amax = api.quantize_values(x, implementation="triton", **kw)
  np.testing.assert_array_equal(_bits(api.block_values(t, jnp.bfloat16)), _bits(values))
  assert _bits(amax) == _bits(t.amax)
  assert len(np.unique(_u4(t.data))) >= 10  # the codes exercise most of the grid


def test_rows_codes_under_vmap_one_key_and_amax_per_slice():
  x = jnp.asarray(np.stack([_operand((16, 32), s) for s in (1, 2)]), jnp.bfloat16)
  keys = jax.random.split(jax.random.key(3), 2)
  run = lambda impl: jax.vmap(lambda a, k: api.quantize(a, stochastic_key=k, implementation=impl))(x, keys)  # noqa: E731
  got, want = run("triton"), run("xla")
  assert got.axis == 1 and got.data.shape == x.shape
  np.testing.assert_array_equal(_u4(got.data), _u4(want.data))
  np.testing.assert_array_equal(_u8(got.scale), _u8(want.scale))


def test_a_wrong_sr_position_or_nibble_order_fails_the_equality(monkeypatch):
  x = jnp.asarray(_operand((16, 64), 7), jnp.bfloat16)
  key = jax.random.key(2)
  want = api.quantize(x, stochastic_key=key, implementation="xla")
  right = triton_kernels.random_bits.word_fraction

  def swapped_pairs(words, word, byte):  # the two elements of a pair draw each other's random byte
    return right(words, word, byte ^ np.uint32(1))

  monkeypatch.setattr(triton_kernels.random_bits, "word_fraction", swapped_pairs)
  jax.clear_caches()
  got = api.quantize(x, stochastic_key=key, implementation="triton")
  assert not np.array_equal(_u4(got.data), _u4(want.data))
  monkeypatch.undo()
  right_pack = triton_kernels._packed_codes
  monkeypatch.setattr(triton_kernels, "_packed_codes",
                      lambda k, neg, *, pair_axis: right_pack(jnp.flip(k, pair_axis), jnp.flip(neg, pair_axis),
                                                              pair_axis=pair_axis))
  jax.clear_caches()
  got = api.quantize(x, implementation="triton")
  assert not np.array_equal(_u4(got.data), _u4(api.quantize(x, implementation="xla").data))
  monkeypatch.undo()
  jax.clear_caches()


def _fwd_bwd(x, w, key):
  recipe = gemm.GemmRecipe(stochastic_rounding=True)

  def loss(x, w):
    y = gemm.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=recipe, key=key, preferred_element_type=jnp.float32)
    return jnp.sum(y * jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape) / y.size), y

  return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def test_gemm_with_codes_operands_equals_the_block_values_path(monkeypatch):
  """fprop (x 1x16 RNE), dgrad (dy 1x16 SR) and wgrad (dy RHT SR) with their single-use operands as codes give
  the results of the same Pallas GEMM fed bf16 block values (h12's path) bit for bit: the same products in the
  same order. (The quantizer's XLA form computes the operands here -- the codes kernels' bits are checked above;
  the Triton quantizer's codes kernels appear in the traced program.)"""
  monkeypatch.setenv(gemm_kernels.IMPLEMENTATION_ENV, "triton")
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((32, 32)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((32, 32)) * 0.05, jnp.bfloat16)
  fn = _fwd_bwd(x, w, jax.random.key(5))
  monkeypatch.setenv(api.IMPLEMENTATION_ENV, "triton")
  jaxpr = str(jax.make_jaxpr(fn)(x, w))
  for name in ("nvfp4_codes_rows ", "nvfp4_codes_rows_sr", "nvfp4_codes_cols_rht_sr"):
    assert name in jaxpr, name
  assert "nvfp4_values_" not in jaxpr  # no single-use operand is written as bf16 values
  monkeypatch.setenv(api.IMPLEMENTATION_ENV, "xla")

  def run():  # (results, 4-bit arrays in the program): one trace
    jax.clear_caches()  # the custom_vjp's traced backward
    lowered = jax.jit(fn).lower(x, w)
    (_, y), grads = lowered.compile()(x, w)
    return [np.asarray(a, np.float32) for a in (y, *grads)], lowered.as_text().count("xui4>")

  got, codes_arrays = run()
  monkeypatch.setattr(gemm.gemm_kernels, "reads_codes", lambda *a, **k: False)
  want, fewer = run()  # h12's path: single-use operands as bf16 block values
  assert codes_arrays > fewer > 0, (codes_arrays, fewer)
  for name, g, wnt in zip(("y", "dx", "dw"), got, want):
    assert np.abs(wnt).max() > 0, name
    np.testing.assert_array_equal(g.view(np.uint32), wnt.view(np.uint32), err_msg=name)
  jax.clear_caches()


def test_default_xla_never_reads_codes_and_a_refused_call_logs(monkeypatch, caplog):
  monkeypatch.delenv(gemm_kernels.IMPLEMENTATION_ENV, raising=False)
  x = jnp.zeros((32, 64), jnp.bfloat16)
  qw = api.quantize(jnp.ones((64, 48), jnp.bfloat16), block_2d=True, implementation="xla")
  args = (x, 1, qw, 0, True, jnp.float32)
  kw = dict(rht=False, stochastic=False, rule=api.STANDARD_RULE)
  assert not gemm_kernels.reads_codes(*args, **kw)
  jaxpr = str(jax.make_jaxpr(_fwd_bwd(x, qw.data.astype(jnp.bfloat16), jax.random.key(0)))(
      x, jnp.ones((64, 48), jnp.bfloat16)))
  assert "pallas_call" not in jaxpr
  assert gemm_kernels.reads_codes(*args, implementation="triton", **kw)
  monkeypatch.setattr(dispatch, "_logged", set())
  with caplog.at_level(logging.INFO, logger="maxtext_nvfp4"):
    assert not gemm_kernels.reads_codes(x[:24], 1, qw, 0, True, jnp.float32, implementation="triton", **kw)
    assert not gemm_kernels.reads_codes(x, 0, qw, 0, True, jnp.float32, implementation="triton", **kw)
  messages = [r.message for r in caplog.records]
  assert any("not codes" in m and "power-of-two tile" in m for m in messages), messages
  assert any("not codes" in m and "other than the last" in m for m in messages), messages
