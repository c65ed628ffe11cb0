"""The Pallas (Triton) NVFP4 GEMM (core/gemm_kernels) against XLA's dot of the block values (``gemm._scaled_dot``),
run by Pallas's interpreter on this CPU.

Exact operands: small-integer values times E2M1 codes times power-of-two-ish E4M3 scales, K small, so every partial
sum is a multiple of 2**-3 below 2**14: exact in fp32 in any order, so the kernel must equal the reference bit for
bit. Random operands: within ``gamma_K * sum|products| * alpha`` (+ the output rounding) of an fp64 reference. The
operands discriminate: a wrong nibble order or a wrong scale index changes the result (checked, so the equality
can fail).
"""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from maxtext_nvfp4.core import gemm
from maxtext_nvfp4.core import gemm_kernels
from maxtext_nvfp4.core import nvfp4 as nv
from maxtext_nvfp4.core.gemm_kernels import dispatch, triton_dot

# E4M3 bytes of scales whose products with E2M1 values and the values below stay multiples of 2**-3:
# 0.5, 1, 1.5, 2, 3, 4
_SCALE_BYTES = np.array([0x30, 0x38, 0x3C, 0x40, 0x44, 0x48], np.uint8)
_E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)

# (name, tensor blocks: "2d" | axis, tensor's contracting axis, values' contracting axis, values first)
#   fprop  y  = x · W       W (K, N) 16x16 tiles or 1x16 along K
#   dgrad  dx = dy · Wᵀ     W (K, N) tiles, contracted along N
#   wgrad  dW = xᵀ · dy     xᵀ's copy (T, K) 1x16 along tokens, contracted along T
_LAYOUTS = {
    "fprop_tiles": ("2d", 0, 1, True),
    "fprop_1x16": (0, 0, 1, True),
    "dgrad_tiles": ("2d", 1, 1, True),
    "wgrad_1x16": (0, 0, 0, False),
}
_M, _K, _N = 32, 128, 48  # output (M, N), contraction K: tiles 32 x 16, two K slices of 64


def _tensor_shape(layout):
  _, t_axis, _, values_first = _LAYOUTS[layout]
  free = _N if values_first else _M
  return (_K, free) if t_axis == 0 else (free, _K)


def _values_shape(layout):
  _, _, v_axis, values_first = _LAYOUTS[layout]
  free = _M if values_first else _N
  return (_K, free) if v_axis == 0 else (free, _K)


def _tensor(codes, scale_bytes, blocks, amax=3.7):
  data = jnp.asarray(_E2M1[codes]).astype(jnp.float4_e2m1fn)
  scale = lax.bitcast_convert_type(jnp.asarray(scale_bytes, jnp.uint8), jnp.float8_e4m3fn)
  return nv.NVFP4Tensor(data=data, scale=scale, amax=jnp.float32(amax), axis=None if blocks == "2d" else blocks,
                        block_2d=blocks == "2d")


def _exact_operands(layout, seed=0):
  blocks = _LAYOUTS[layout][0]
  rng = np.random.default_rng(seed)
  r, c = _tensor_shape(layout)
  sshape = (r // 16, c // 16) if blocks == "2d" else ((r // 16, c) if blocks == 0 else (r, c // 16))
  t = _tensor(rng.integers(0, 16, (r, c)), rng.choice(_SCALE_BYTES, sshape), blocks)
  values = jnp.asarray(rng.integers(-8, 9, _values_shape(layout)) * 0.5, jnp.bfloat16)
  return values, t


def _call(layout, values, t, implementation, out_dtype=jnp.float32):
  _, t_axis, v_axis, values_first = _LAYOUTS[layout]
  qv = (values, jnp.float32(5.0), 448)
  qa, qb = (qv, t) if values_first else (t, qv)
  contract = (v_axis, t_axis) if values_first else (t_axis, v_axis)
  alpha = gemm.gemm_alpha(jnp.float32(5.0), t.amax)
  va, vb = (values, nv.block_values(t)) if values_first else (nv.block_values(t), values)
  reference = lambda: gemm._scaled_dot(va, vb, contract, alpha, out_dtype)  # noqa: E731
  return np.asarray(gemm_kernels.scaled_dot(qa, qb, contract, alpha, out_dtype, reference,
                                            implementation=implementation))


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_kernel_equals_the_xla_dot_bit_for_bit_where_sums_are_exact(layout):
  values, t = _exact_operands(layout)
  for out_dtype in (jnp.float32, jnp.bfloat16):
    got = _call(layout, values, t, "triton", out_dtype)
    want = _call(layout, values, t, "xla", out_dtype)
    assert got.shape == want.shape == (_M, _N)
    np.testing.assert_array_equal(got.view(np.uint16 if out_dtype == jnp.bfloat16 else np.uint32),
                                  want.view(np.uint16 if out_dtype == jnp.bfloat16 else np.uint32))
  assert np.count_nonzero(want) > 0.9 * want.size


def _exact_tensor(shape, blocks, rng):
  r, c = shape
  sshape = (r // 16, c // 16) if blocks == "2d" else ((r // 16, c) if blocks == 0 else (r, c // 16))
  return _tensor(rng.integers(0, 16, (r, c)), rng.choice(_SCALE_BYTES, sshape), blocks)


# Both operands as codes and scales (the kernel takes them; ``gemm`` passes block values for its single-use ones):
# (a's stored shape, blocks, contraction axis), the same for b. Partial sums: multiples of 2**-4 below 2**17, exact.
_BOTH = {
    "fprop_x1x16_wtiles": (((_M, _K), 1, 1), ((_K, _N), "2d", 0)),
    "wgrad_tokens_1x16": (((_K, _M), 0, 0), ((_K, _N), 0, 0)),
}


@pytest.mark.parametrize("case", sorted(_BOTH))
def test_both_operands_as_codes_bit_for_bit(case):
  (sa, ba, ca), (sb, bb, cb) = _BOTH[case]
  rng = np.random.default_rng(4)
  ta, tb = _exact_tensor(sa, ba, rng), _exact_tensor(sb, bb, rng)
  alpha = gemm.gemm_alpha(ta.amax, tb.amax)
  ref = lambda ta=ta, tb=tb: gemm._scaled_dot(nv.block_values(ta), nv.block_values(tb), (ca, cb), alpha,  # noqa: E731
                                              jnp.float32)
  run = lambda ta, tb, impl: np.asarray(gemm_kernels.scaled_dot(  # noqa: E731
      ta, tb, (ca, cb), alpha, jnp.float32, lambda: ref(ta, tb), implementation=impl))
  want = run(ta, tb, "xla")
  assert want.shape == (_M, _N) and np.count_nonzero(want) > 0.9 * want.size
  np.testing.assert_array_equal(run(ta, tb, "triton").view(np.uint32), want.view(np.uint32))
  assert not np.array_equal(run(_swap_nibbles(ta), tb, "triton"), want)
  assert not np.array_equal(run(ta, _swap_nibbles(tb), "triton"), want)


def _swap_nibbles(t):
  r, c = t.data.shape
  return t.__class__(data=t.data.reshape(r, c // 2, 2)[..., ::-1].reshape(r, c), scale=t.scale, amax=t.amax,
                     axis=t.axis, block_2d=t.block_2d)


@pytest.mark.parametrize("layout", ["fprop_tiles", "wgrad_1x16"])
def test_a_wrong_nibble_order_or_scale_index_fails_the_equality(layout, monkeypatch):
  """Mutations the exact test must catch: the kernel reading the other nibble of each byte (the operand's
  pairs swapped), and each tile taking its neighbour's scale (``_expand`` shifted by one block)."""
  values, t = _exact_operands(layout)
  want = _call(layout, values, t, "xla")
  assert not np.array_equal(_call(layout, values, _swap_nibbles(t), "triton"), want)
  shifted = triton_dot._expand

  def wrong_scale_index(s, rows, cols, row_blocks, col_blocks):
    return shifted(jnp.roll(s, 1, axis=0), rows, cols, row_blocks, col_blocks)

  monkeypatch.setattr(triton_dot, "_expand", wrong_scale_index)
  triton_dot.dot.clear_cache()  # the kernel is traced again with the mutation
  try:
    assert not np.array_equal(_call(layout, values, t, "triton"), want)
  finally:
    monkeypatch.undo()
    triton_dot.dot.clear_cache()
  np.testing.assert_array_equal(_call(layout, values, t, "triton"), want)


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_kernel_on_random_operands_within_the_fp32_accumulation_bound(layout):
  """Quantized random operands (``nv.quantize`` / ``quantize_values``): within gamma_K * sum|a||b| * alpha of
  the fp64 product, plus the fp32 output's own rounding."""
  blocks, t_axis, v_axis, _ = _LAYOUTS[layout]
  rng = np.random.default_rng(1)
  t = nv.quantize(jnp.asarray(rng.standard_normal(_tensor_shape(layout)) * 3, jnp.bfloat16), axis=t_axis,
                  block_2d=blocks == "2d")
  values, _ = nv.quantize_values(jnp.asarray(rng.standard_normal(_values_shape(layout)), jnp.bfloat16), axis=v_axis)
  got = _call(layout, values, t, "triton").astype(np.float64)
  tv = np.asarray(nv.block_values(t), np.float64)
  vv = np.asarray(values, np.float64)
  t_kf = tv if t_axis == 0 else tv.T
  v_kf = vv if v_axis == 0 else vv.T
  a, b = (v_kf.T, t_kf) if _LAYOUTS[layout][3] else (t_kf.T, v_kf)
  alpha = float(gemm.gemm_alpha(jnp.float32(5.0), t.amax))
  exact, mags = a @ b * alpha, np.abs(a) @ np.abs(b) * alpha
  gamma = _K * 2.0**-24 / (1 - _K * 2.0**-24)
  err = np.abs(got - exact)
  assert np.all(err <= gamma * mags + 2.0**-23 * np.abs(exact) + 1e-30), err.max()
  assert err.max() > 0 or np.abs(exact).max() > 0


def test_default_is_the_xla_dot_and_auto_logs_the_calls_it_leaves(monkeypatch, caplog):
  monkeypatch.delenv(gemm_kernels.IMPLEMENTATION_ENV, raising=False)
  values, t = _exact_operands("fprop_tiles")
  jaxpr = str(jax.make_jaxpr(lambda v: _call_traced("fprop_tiles", v, t, None))(values))
  assert "pallas_call" not in jaxpr and "dot_general" in jaxpr
  odd = values[:24]  # 24 rows: no power-of-two tile >= 16
  with pytest.raises(dispatch.GemmImplementationUnavailableError, match="power-of-two tile"):
    _call_traced("fprop_tiles", odd, t, "triton")
  monkeypatch.setattr(dispatch, "_logged", set())
  with caplog.at_level(logging.INFO, logger="maxtext_nvfp4"):
    out = _call_traced("fprop_tiles", odd, t, "auto")
  assert out.shape == (24, _N)
  assert any("not the Triton GEMM" in r.message and "power-of-two tile" in r.message for r in caplog.records)
  with pytest.raises(ValueError, match="choose one of"):
    _call_traced("fprop_tiles", values, t, "cublas")
  with pytest.raises(dispatch.GemmImplementationUnavailableError, match="without an NVFP4Tensor"):
    gemm_kernels.scaled_dot((values, None, 448), (nv.block_values(t), None, 448), (1, 0), jnp.float32(1),
                            jnp.float32, lambda: None, implementation="triton")
  alpha = gemm.gemm_alpha(jnp.float32(5.0), t.amax)
  qv = (values, jnp.float32(5.0), 448)
  assert dispatch.refusal(qv, t, (1, 0), alpha, jnp.float32) is None
  with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2,), ("d",))):
    assert "mesh of several devices" in dispatch.refusal(qv, t, (1, 0), alpha, jnp.float32)
  assert "row-scaled" in dispatch.refusal(qv, t, (1, 0), jnp.ones((_M, 1), jnp.float32), jnp.float32)
  assert "bf16" in dispatch.refusal((values.astype(jnp.float32), None, 448), t, (1, 0), alpha, jnp.float32)


def _call_traced(layout, values, t, implementation):
  _, t_axis, v_axis, _ = _LAYOUTS[layout]
  alpha = gemm.gemm_alpha(jnp.float32(5.0), t.amax)
  ref = lambda: gemm._scaled_dot(values, nv.block_values(t), (v_axis, t_axis), alpha, jnp.float32)  # noqa: E731
  return gemm_kernels.scaled_dot((values, jnp.float32(5.0), 448), t, (v_axis, t_axis), alpha, jnp.float32, ref,
                                 implementation=implementation)


def test_dot_general_fwd_bwd_with_the_triton_gemm(monkeypatch):
  """The full recipe's fprop, dgrad and wgrad through ``gemm.dot_general`` with MAXTEXT_NVFP4_GEMM_IMPL=triton:
  the same quantized operands, so the results agree with the XLA dot's up to the fp32 accumulation order and
  one rounding to bf16."""
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((32, 64)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((64, 48)) * 0.05, jnp.bfloat16)
  key = jax.random.key(3)
  recipe = gemm.GemmRecipe(stochastic_rounding=True)

  def run():
    def loss(x, w):
      y = gemm.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=recipe, key=key, preferred_element_type=jnp.float32)
      return jnp.sum(y * jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape) / y.size), y
    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
    return [np.asarray(a, np.float32) for a in (y, *grads)]

  monkeypatch.setenv(gemm_kernels.IMPLEMENTATION_ENV, "xla")
  want = run()
  monkeypatch.setenv(gemm_kernels.IMPLEMENTATION_ENV, "triton")
  got = run()
  for name, g, wnt in zip(("y", "dx", "dw"), got, want):
    scale = np.abs(wnt).max()
    assert scale > 0, name
    np.testing.assert_allclose(g, wnt, rtol=2**-7, atol=2**-12 * scale, err_msg=name)
