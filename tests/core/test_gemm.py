"""Tests of the emulated NVFP4 GEMM recipe (maxtext_nvfp4/core/gemm.py) against independent constructions.

References are built from the numerics module's public API: quantize both operands as TE does for that
GEMM, ``dequantize`` them, and multiply in float64. The recipe's fp32 result must agree to fp32
rounding of the accumulation: |y - ref| <= (K + 4) * 2**-24 * (|A| @ |B|) elementwise.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_nvfp4.core import fp8
from maxtext_nvfp4.core import gemm
from maxtext_nvfp4.core import nvfp4 as numerics

# Jitted entry points: eager op-by-op dispatch of the quantizer is far slower than compiling it once.
_quantize = jax.jit(numerics.quantize, static_argnames=("axis", "block_2d", "rht"))

F32_EPS = 2.0**-24
NO_SR = gemm.GemmRecipe(stochastic_rounding=False)


# The jax that pyproject pins: tests of XLA's compiled HLO hold for its XLA (the H200 image's 0.11.2 differs).
_PINNED_JAX = "0.12.0.1"
# TE JAX's GEMM alpha, written as in transformer_engine/jax/cpp_extensions/gemm.py and compiled by XLA.
_TE_ALPHA_COMPILED = jax.jit(lambda a, b: (a / jnp.float32(2688.0)) * (b / jnp.float32(2688.0)))


def _rand(seed, shape, dtype=jnp.float32, scale=1.0):
  """Gaussian test operands from numpy (no XLA compile per shape, unlike jax.random.normal)."""
  a = np.random.default_rng(seed).standard_normal(shape, np.float32) * np.float32(scale)
  return jnp.asarray(a.astype(dtype))  # numpy's (ml_dtypes') f32 -> bf16 cast rounds to nearest even, as XLA's


def _rand_jax(seed, shape, dtype=jnp.float32, scale=1.0):
  """jax.random operands, for the test whose seeds were picked on these exact values."""
  return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale).astype(dtype)


def _pad(a, shape):
  a = np.asarray(a)
  return np.pad(a, [(0, t - s) for s, t in zip(a.shape, shape)])


def _up(n):
  return -(-n // 16) * 16


def _deq64(t):
  return np.asarray(numerics.dequantize(t, jnp.float32), np.float64)


def _assert_gemm_close(got, a64, b64):
  """got == a64 @ b64 up to fp32 accumulation rounding (rigorous sequential-sum bound)."""
  ref = a64 @ b64
  bound = (a64.shape[1] + 4) * F32_EPS * (np.abs(a64) @ np.abs(b64)) + 1e-30
  got = np.asarray(got, np.float64)
  assert got.shape == ref.shape
  err = np.abs(got - ref)
  assert np.all(err <= bound), f"max err {err.max()} (bound there {bound.flat[err.argmax()]})"
  return ref


@functools.partial(jax.jit, static_argnames=("recipe", "dn"))
def _vjp_jit(recipe, x, w, dy, key, dn):
  f = lambda x, w: gemm.dot_general(x, w, dn, recipe=recipe, key=key)
  y, vjp = jax.vjp(f, x, w)
  return (y, *vjp(dy.astype(y.dtype)))


_DN = (((1,), (0,)), ((), ()))


@functools.partial(jax.jit, static_argnames=("recipe", "dn", "preferred_element_type"))
def _fwd(recipe, x, w, key=None, dn=_DN, preferred_element_type=None):
  """Jitted forward gemm.dot_general."""
  return gemm.dot_general(x, w, dn, recipe=recipe, key=key, preferred_element_type=preferred_element_type)


def _fwd_and_grads(recipe, x, w, dy, key=None, dn=None):
  """(y, dx, dw) of gemm.dot_general with cotangent dy, jitted."""
  dn = dn or (((x.ndim - 1,), (0,)), ((), ()))
  return _vjp_jit(recipe, x, w, dy, key, dn)


# ----------------------------------------------------------------------------------------------
# fprop / dgrad / wgrad against the numerics construction
# ----------------------------------------------------------------------------------------------
# (stochastic_rounding, rht, two_d_weights, (M, K, N)): SR and RHT each on and off, 2D and 1D weights,
# aligned and unaligned (zero-padded) contraction lengths for all three GEMMs.
_PASS_CASES = [
    (True, True, True, (32, 48, 32)),
    (False, False, False, (32, 48, 32)),
    (True, False, True, (24, 40, 20)),
    (False, True, False, (24, 40, 20)),
]


@pytest.mark.parametrize("sr,rht,two_d,mkn", _PASS_CASES)
def test_three_passes_match_quantize_dequantize_f64(sr, rht, two_d, mkn):
  """fprop, dgrad and wgrad each equal "quantize with numerics, dequantize, f64 matmul"."""
  m, k, n = mkn
  mp, kp, np_ = _up(m), _up(k), _up(n)
  x, w, dy = _rand(4, (m, k), scale=3.0), _rand(5, (k, n), scale=0.05), _rand(6, (m, n), scale=1e-3)
  key = jax.random.key(7)
  r = gemm.GemmRecipe(stochastic_rounding=sr, rht=rht, two_d_weights=two_d)
  y, dx, dw = _fwd_and_grads(r, x, w, dy, key=key)
  assert (y.shape, dx.shape, dw.shape) == ((m, n), x.shape, w.shape)
  assert y.dtype == dx.dtype == dw.dtype == jnp.float32
  kd, kw = (jax.random.fold_in(key, 1), jax.random.fold_in(key, 2)) if sr else (None, None)  # gemm's docstring
  # fprop: x 1x16 along K (RNE) · W 16x16 (or 1x16 along K), RNE.
  qx = _quantize(_pad(x, (m, kp)), axis=1)
  if two_d:
    qw_f = qw_d = _quantize(_pad(w, (kp, np_)), block_2d=True)  # the same tiles serve fprop and dgrad
  else:
    qw_f, qw_d = _quantize(_pad(w, (kp, n)), axis=0), _quantize(_pad(w, (k, np_)), axis=1)
  ref = _assert_gemm_close(y, _deq64(qx), _deq64(qw_f)[:, :n])
  # The quantization is really active: far from the exact product, beyond fp32 noise.
  assert np.abs(ref - np.asarray(x, np.float64) @ np.asarray(w, np.float64)).max() > 1e-3
  # dgrad: dy 1x16 along N (SR with the dgrad key) · Wᵀ.
  qdy = _quantize(_pad(dy, (m, np_)), axis=1, stochastic_key=kd)
  _assert_gemm_close(dx, _deq64(qdy), _deq64(qw_d)[:k].T)
  # wgrad: xᵀ and dy 1x16 along tokens, both RHT-rotated when rht (then these are the RHT-domain
  # dequantized operands, whose product is the wgrad), dy with SR (wgrad key).
  qxt = _quantize(_pad(x, (mp, k)), axis=0, rht=rht)
  qdyt = _quantize(_pad(dy, (mp, n)), axis=0, rht=rht, stochastic_key=kw)
  _assert_gemm_close(dw, _deq64(qxt).T, _deq64(qdyt))


def test_single_k_block_is_bit_exact_with_te_alpha():
  """K = 16: one block, so the fp32 accumulation is exact in any order and y is bit-checkable.

  Each block product sums 16 values q_x q_w (multiples of 1/4, |.| <= 36) times s8_x s8_w (8 bits):
  at most ~20 significant bits, exact in fp32. Then y = fl(sum * alpha) with TE JAX's
  alpha = (amax_x / 2688.) * (amax_w / 2688.) as XLA compiles it (not PyTorch's amax_x amax_w / 2688²).
  """
  m, k, n = 32, 16, 48
  x, w = _rand_jax(46, (m, k), scale=3.0), _rand_jax(47, (k, n), scale=0.02)
  y = np.asarray(_fwd(NO_SR, x, w))
  qx, qw = _quantize(x, axis=1), _quantize(w, block_2d=True)
  bx = np.asarray(qx.data, np.float64) * np.repeat(np.asarray(qx.scale, np.float64), 16, axis=1)
  bw = np.asarray(qw.data, np.float64) * np.repeat(np.repeat(np.asarray(qw.scale, np.float64), 16, 0), 16, 1)
  exact = bx @ bw
  assert np.array_equal(exact.astype(np.float32).astype(np.float64), exact)  # representable: order-free
  alpha = np.float32(_TE_ALPHA_COMPILED(qx.amax, qw.amax))
  # These seeds were picked so the PyTorch-reference alpha differs by an ulp: the test tells them apart.
  # (A fact of the pinned jax's XLA: 0.11.2's folds the scalar product differently, and gives PyTorch's
  # value for these seeds -- the bitwise check of y below holds on both.)
  if jax.__version__ == _PINNED_JAX:
    assert alpha != np.float32(qx.amax) * np.float32(qw.amax) / np.float32(2688.0 * 2688.0)
  want = exact.astype(np.float32) * np.float32(alpha)
  np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32))




def _lognormal_amaxes(seed, n=100_000):
  rng = np.random.default_rng(seed)
  return [rng.lognormal(0.0, 4.0, n).astype(np.float32) for _ in range(2)]


def test_gemm_alpha_is_te_alpha_as_compiled_bit_for_bit():
  """gemm_alpha == XLA's compiled ``(a / 2688.) * (b / 2688.)`` on 100k random amax pairs, every bit.

  The amaxes are chosen so that the true quotient differs in many pairs: an emulation dividing
  exactly (or reassociating to ``a * b / 2688**2``) fails here.
  """
  a, b = _lognormal_amaxes(0)
  want = np.asarray(_TE_ALPHA_COMPILED(a, b))
  got = np.asarray(jax.jit(gemm.gemm_alpha)(a, b))
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
  exact = (a / np.float32(2688.0)) * (b / np.float32(2688.0))  # numpy: true IEEE divisions
  assert np.mean(exact.view(np.uint32) != want.view(np.uint32)) > 0.05  # the test can tell them apart
  # Eager (unjitted) too: the emulation does not depend on being compiled.
  np.testing.assert_array_equal(np.asarray(gemm.gemm_alpha(a[:1000], b[:1000])).view(np.uint32),
                                want[:1000].view(np.uint32))


@pytest.mark.skipif(jax.__version__ != _PINNED_JAX, reason=f"pins the HLO of the XLA in jax {_PINNED_JAX}"
                    " (pyproject); test_gemm_alpha_is_te_alpha_as_compiled_bit_for_bit is the version-free check")
def test_xla_rewrites_division_by_constant_as_reciprocal_multiply():
  """The XLA fact gemm_alpha relies on: ``a / 2688.`` compiles to ``a * fl32(1/2688)``, no divide.

  If a new XLA stops rewriting (or rewrites differently), this fails and gemm_alpha must follow
  (TE's alpha would then be the true quotient again).
  """
  hlo = _TE_ALPHA_COMPILED.lower(np.float32(1), np.float32(1)).compile().as_text()
  assert " divide(" not in hlo and "constant(0.000372023816)" in hlo, hlo
  a, b = _lognormal_amaxes(1, 10_000)
  c = np.float32(1.0) / np.float32(2688.0)
  want = (a * c) * (b * c)  # numpy, no compiler involved
  got = np.asarray(_TE_ALPHA_COMPILED(a, b))
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_fprop_bf16_output_is_rounded_reference():
  x, w = _rand(2, (32, 64), jnp.bfloat16), _rand(3, (64, 32), jnp.bfloat16)
  y = _fwd(NO_SR, x, w)
  y32 = _fwd(NO_SR, x, w, preferred_element_type=jnp.float32)
  assert y.dtype == jnp.bfloat16 and y32.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(y), np.asarray(y32.astype(jnp.bfloat16)))
  qx, qw = _quantize(x, axis=1), _quantize(w, block_2d=True)
  _assert_gemm_close(y32, _deq64(qx), _deq64(qw))


def test_rht_wgrad_structure_rotation_cancels_exactly():
  """x = U Mᵀ with U exactly NVFP4-representable after rotation: wgrad(RHT) == xᵀ dy exactly.

  M = diag(s) H16 / 4 is orthogonal (M Mᵀ = I exactly in binary arithmetic). If each 16-token chunk
  of x is u Mᵀ, the RHT gives back u, which quantizes losslessly (e2m1 values, each block holding a
  ±6, global amax 6), so the NVFP4 wgrad equals uᵀ v = xᵀ M Mᵀ dy = xᵀ dy. Without RHT (or rotating
  only one operand) the result is different.
  """
  rng = np.random.default_rng(0)
  grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
  t, k, n = 64, 16, 32

  def on_grid():
    u = rng.choice(grid, size=(t, k if on_grid.first else n)) * rng.choice([-1, 1], size=(t, k if on_grid.first else n))
    u.reshape(t // 16, 16, -1)[:, 3, :] = 6.0  # every 16-token block of every column holds a 6
    on_grid.first = False
    return u

  on_grid.first = True
  u, v = on_grid(), on_grid()
  mat = np.asarray(numerics.rht_matrix(jnp.float32), np.float64)
  np.testing.assert_array_equal(mat @ mat.T, np.eye(16))

  def unrotate(a):
    # numerics.rht along tokens maps each 16-token chunk c (16, cols) to Mᵀ c, so x_chunk = M u_chunk
    # (exact: multiples of 1/8 with |.| <= 24).
    return np.einsum("ij,cjk->cik", mat, a.reshape(t // 16, 16, -1)).reshape(t, -1)

  x64, dy64 = unrotate(u), unrotate(v)
  x, dy = jnp.asarray(x64, jnp.float32), jnp.asarray(dy64, jnp.float32)
  assert np.array_equal(np.asarray(x, np.float64), x64)  # exact inputs
  # The RHT of x is exactly u (the structure the test relies on).
  np.testing.assert_array_equal(np.asarray(numerics.rht(x, axis=0), np.float64), u)
  exact = x64.T @ dy64
  np.testing.assert_allclose(exact, u.T @ v, rtol=0, atol=0)

  w = jnp.zeros((k, n), jnp.float32)
  _, _, dw_rht = _fwd_and_grads(gemm.GemmRecipe(stochastic_rounding=False, rht=True), x, w, dy)
  # Lossless quantization: only the fp32 alpha/accumulation rounding remains.
  np.testing.assert_allclose(np.asarray(dw_rht, np.float64), exact, rtol=4 * F32_EPS * 64, atol=0)
  _, _, dw_plain = _fwd_and_grads(gemm.GemmRecipe(stochastic_rounding=False, rht=False), x, w, dy)
  assert np.abs(np.asarray(dw_plain, np.float64) - exact).max() > 1e-2 * np.abs(exact).max()


# ----------------------------------------------------------------------------------------------
# Shapes: MaxText's calls, batch dims, padding
# ----------------------------------------------------------------------------------------------
def _grads_of(recipe, dn, lhs, rhs, dy, key=None):
  return _vjp_jit(recipe, lhs, rhs, dy, key, dn)


def test_attention_out_two_contracting_dims_equals_flattened():
  b, s, h, d, e = 2, 8, 4, 12, 32  # heads*head_dim = 48
  lhs, ker = _rand(12, (b, s, h, d), jnp.bfloat16), _rand(13, (h, d, e), jnp.bfloat16)
  dy = _rand(14, (b, s, e), jnp.bfloat16)
  key = jax.random.key(0)
  r = gemm.GemmRecipe()
  y, dl, dk = _grads_of(r, (((2, 3), (0, 1)), ((), ())), lhs, ker, dy, key)
  y2, dl2, dk2 = _grads_of(
      r, (((1,), (0,)), ((), ())), lhs.reshape(b * s, h * d), ker.reshape(h * d, e), dy.reshape(b * s, e), key
  )
  assert y.shape == (b, s, e) and dl.shape == lhs.shape and dk.shape == ker.shape
  np.testing.assert_array_equal(np.asarray(y).reshape(b * s, e), np.asarray(y2))
  np.testing.assert_array_equal(np.asarray(dl).reshape(b * s, h * d), np.asarray(dl2))
  np.testing.assert_array_equal(np.asarray(dk).reshape(h * d, e), np.asarray(dk2))


def test_qkv_several_output_dims_and_leading_contraction():
  b, s, e, h, d = 2, 8, 32, 3, 16
  lhs, ker = _rand(15, (b, s, e)), _rand(16, (e, h, d))
  dy = _rand(17, (b, s, h, d))
  r = NO_SR
  y, dl, dk = _grads_of(r, (((2,), (0,)), ((), ())), lhs, ker, dy)
  y2, dl2, dk2 = _grads_of(r, (((1,), (0,)), ((), ())), lhs.reshape(b * s, e), ker.reshape(e, h * d), dy.reshape(b * s, h * d))
  np.testing.assert_array_equal(np.asarray(y).reshape(b * s, h * d), np.asarray(y2))
  np.testing.assert_array_equal(np.asarray(dl).reshape(b * s, e), np.asarray(dl2))
  np.testing.assert_array_equal(np.asarray(dk).reshape(e, h * d), np.asarray(dk2))
  # Contracting the lhs's FIRST dim (K, M) and the rhs's last (N, K) equals the transposed call.
  xt, wt = jnp.transpose(lhs.reshape(b * s, e)), jnp.transpose(ker.reshape(e, h * d))
  y3 = _fwd(r, xt, wt, dn=(((0,), (1,)), ((), ())))
  np.testing.assert_array_equal(np.asarray(y3), np.asarray(y2))


def test_batch_dims_are_independent_gemms_with_folded_keys():
  g, m, k, n = 3, 16, 32, 32
  lhs, rhs, dy = _rand(18, (m, g, k)), _rand(19, (g, k, n)), _rand(20, (g, m, n))
  key = jax.random.key(5)
  r = gemm.GemmRecipe()
  dn = (((2,), (1,)), ((1,), (0,)))
  y, dl, dr = _grads_of(r, dn, lhs, rhs, dy, key)
  assert y.shape == (g, m, n)
  for i in range(g):
    yi, dli, dri = _grads_of(r, (((1,), (0,)), ((), ())), lhs[:, i], rhs[i], dy[i], jax.random.fold_in(key, i))
    # Same quantized operands; only the batched GEMM's fp32 accumulation order may differ.
    for got, want in ((y[i], yi), (dl[:, i], dli), (dr[i], dri)):
      want = np.asarray(want)
      np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-5 * np.abs(want).max())
  # Slices really differ in amax: one slice scaled by 1000 does not change the others' outputs.
  lhs2 = lhs.at[:, 0].multiply(1000.0)
  y2 = _fwd(r, lhs2, rhs, key=key, dn=dn)
  np.testing.assert_array_equal(np.asarray(y2[1:]), np.asarray(y[1:]))


def test_padding_invariance():
  m, k, n = 24, 40, 20
  x, w, dy = _rand(21, (m, k)), _rand(22, (k, n)), _rand(23, (m, n))
  for r in (NO_SR,):
    y, dx, dw = _fwd_and_grads(r, x, w, dy)
    mp, kp, np_ = _up(m), _up(k), _up(n)
    yp, dxp, dwp = _fwd_and_grads(r, jnp.asarray(_pad(x, (mp, kp))), jnp.asarray(_pad(w, (kp, np_))), jnp.asarray(_pad(dy, (mp, np_))))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(yp)[:m, :n])
    np.testing.assert_array_equal(np.asarray(dx), np.asarray(dxp)[:m, :k])
    np.testing.assert_array_equal(np.asarray(dw), np.asarray(dwp)[:k, :n])
    assert not np.any(np.asarray(yp)[m:]) and not np.any(np.asarray(dwp)[k:])


# ----------------------------------------------------------------------------------------------
# Per-pass precision, the late switch
# ----------------------------------------------------------------------------------------------
def _fp8_ref(a, fa, b, fb):
  qa, qb = fp8.quantize(a, fa), fp8.quantize(b, fb)
  return np.asarray(fp8.dequantize(qa), np.float64), np.asarray(fp8.dequantize(qb), np.float64)


def test_per_pass_precision_selection():
  m, k, n = 32, 48, 32
  # fp32 inputs on the bf16 grid: a bf16 pass is then exact under any matmul precision (XLA:GPU's default
  # for fp32 dots is TF32, which would round fp32 inputs; the bound below is for fp32 accumulation only).
  x, w, dy = (_rand(s, sh, jnp.bfloat16).astype(jnp.float32) for s, sh in ((24, (m, k)), (25, (k, n)), (26, (m, n))))
  x64, w64, dy64 = (np.asarray(a, np.float64) for a in (x, w, dy))
  # bf16 fprop / fp8 dgrad / nvfp4 wgrad
  r = gemm.GemmRecipe(fprop="bf16", dgrad="fp8", wgrad="nvfp4", stochastic_rounding=False, rht=False)
  y, dx, dw = _fwd_and_grads(r, x, w, dy)
  _assert_gemm_close(y, x64, w64)
  a, b = _fp8_ref(dy, "e5m2", w, "e4m3")
  _assert_gemm_close(dx, a, b.T)
  _assert_gemm_close(dw, _deq64(_quantize(x, axis=0)).T, _deq64(_quantize(dy, axis=0)))
  # fp8 fprop / nvfp4 dgrad / bf16 wgrad
  r = gemm.GemmRecipe(fprop="fp8", dgrad="nvfp4", wgrad="bf16", stochastic_rounding=False)
  y, dx, dw = _fwd_and_grads(r, x, w, dy)
  a, b = _fp8_ref(x, "e4m3", w, "e4m3")
  _assert_gemm_close(y, a, b)
  _assert_gemm_close(dx, _deq64(_quantize(dy, axis=1)), _deq64(_quantize(w, block_2d=True)).T)
  _assert_gemm_close(dw, x64.T, dy64)
  # fp8 wgrad: E4M3 x, E5M2 dy.
  r = gemm.GemmRecipe(fprop="bf16", dgrad="bf16", wgrad="fp8")
  _, dx, dw = _fwd_and_grads(r, x, w, dy)
  _assert_gemm_close(dx, dy64, w64.T)
  a, b = _fp8_ref(x, "e4m3", dy, "e5m2")
  _assert_gemm_close(dw, a.T, b)


def test_switch_under_jit_uses_cond_without_retracing():
  m, k, n = 32, 32, 32
  x, w, dy = _rand(27, (m, k), jnp.bfloat16), _rand(28, (k, n), jnp.bfloat16), _rand(29, (m, n), jnp.bfloat16)
  key = jax.random.key(1)
  base = gemm.GemmRecipe()
  sw = gemm.GemmRecipe(fprop="bf16", dgrad="fp8")  # wgrad stays nvfp4: no cond for it
  traces = []

  @jax.jit
  def run(x, w, dy, flag):
    traces.append(1)
    f = lambda x, w: gemm.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=base, switched=sw, use_switched=flag, key=key)
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(dy))

  off = run(x, w, dy, jnp.bool_(False))
  on = run(x, w, dy, jnp.bool_(True))
  off2 = run(x, w, dy, False)
  assert len(traces) == 1
  want_off = _fwd_and_grads(base, x, w, dy, key=key)
  want_on = _fwd_and_grads(sw, x, w, dy, key=key)
  for got, want in list(zip(off, want_off)) + list(zip(on, want_on)) + list(zip(off2, want_off)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert not np.array_equal(np.asarray(on[0]), np.asarray(off[0]))
  np.testing.assert_array_equal(np.asarray(on[2]), np.asarray(off[2]))  # wgrad is not switched
  hlo = run.lower(x, w, dy, jnp.bool_(True)).as_text()
  assert "conditional" in hlo or "case" in hlo


# ----------------------------------------------------------------------------------------------
# Randomness, errors, non-finite inputs
# ----------------------------------------------------------------------------------------------
def test_stochastic_rounding_keys():
  x, w, dy = _rand(30, (32, 32), jnp.bfloat16), _rand(31, (32, 32), jnp.bfloat16), _rand(32, (32, 32), jnp.bfloat16)
  r = gemm.GemmRecipe()
  _, dx1, dw1 = _fwd_and_grads(r, x, w, dy, key=jax.random.key(1))
  _, dx1b, dw1b = _fwd_and_grads(r, x, w, dy, key=jax.random.key(1))
  _, dx2, dw2 = _fwd_and_grads(r, x, w, dy, key=jax.random.key(2))
  np.testing.assert_array_equal(np.asarray(dx1), np.asarray(dx1b))
  np.testing.assert_array_equal(np.asarray(dw1), np.asarray(dw1b))
  assert not np.array_equal(np.asarray(dx1), np.asarray(dx2))
  assert not np.array_equal(np.asarray(dw1), np.asarray(dw2))
  # SR off: the key is irrelevant.
  _, dx3, dw3 = _fwd_and_grads(NO_SR, x, w, dy, key=jax.random.key(1))
  _, dx4, dw4 = _fwd_and_grads(NO_SR, x, w, dy, key=jax.random.key(2))
  np.testing.assert_array_equal(np.asarray(dx3), np.asarray(dx4))
  np.testing.assert_array_equal(np.asarray(dw3), np.asarray(dw4))


def test_sr_is_unbiased_in_the_mean():
  """Averaging dgrad over many SR keys approaches the unquantized-dy product better than RNE does."""
  m, k, n = 16, 16, 32
  x, w, dy = _rand(33, (m, k)), _rand(34, (k, n)), _rand(35, (m, n))
  r_sr = gemm.GemmRecipe(rht=False, two_d_weights=True)
  # dgrad only: the compiled programs drop the forward's output and the wgrad
  dgrad = jax.jit(lambda r, key: _fwd_and_grads(r, x, w, dy, key=key)[1], static_argnums=0)
  mean = np.mean([np.asarray(dgrad(r_sr, jax.random.key(i))) for i in range(64)], axis=0)
  rne = np.asarray(dgrad(NO_SR, None))
  exact_dy = np.asarray(dy, np.float64) @ _deq64(_quantize(w, block_2d=True)).T
  assert np.abs(mean - exact_dy).mean() < np.abs(rne - exact_dy).mean()


def test_errors():
  x, w = jnp.ones((16, 16)), jnp.ones((16, 16))
  dn = (((1,), (0,)), ((), ()))
  with pytest.raises(ValueError, match="key is None"):
    gemm.dot_general(x, w, dn, recipe=gemm.GemmRecipe())
  with pytest.raises(ValueError, match="key is None"):
    gemm.dot_general(x, w, dn, recipe=NO_SR, switched=gemm.GemmRecipe(), use_switched=True)
  with pytest.raises(ValueError, match="use_switched"):
    gemm.dot_general(x, w, dn, recipe=NO_SR, switched=NO_SR)
  with pytest.raises(ValueError, match="choose one of"):
    gemm.GemmRecipe(fprop="fp4")
  with pytest.raises(ValueError, match="does not match"):
    gemm.dot_general(x, jnp.ones((8, 16)), dn, recipe=NO_SR)
  # No SR anywhere (bf16/fp8 backward): no key needed (checked when the call is traced: eval_shape, no compile).
  jax.eval_shape(lambda x, w: gemm.dot_general(x, w, dn, recipe=gemm.GemmRecipe(dgrad="bf16", wgrad="fp8")), x, w)


@pytest.mark.parametrize("precision", ["nvfp4", "fp8"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_operands_poison_outputs(precision, bad):
  m, k, n = 32, 32, 32
  x, w, dy = _rand(36, (m, k), jnp.bfloat16), _rand(37, (k, n), jnp.bfloat16), _rand(38, (m, n), jnp.bfloat16)
  r = gemm.GemmRecipe(fprop=precision, dgrad=precision, wgrad=precision)
  key = jax.random.key(0)
  nonfinite = lambda a: not np.any(np.isfinite(np.asarray(a, np.float32)))
  y, dx, dw = _fwd_and_grads(r, x.at[3, 5].set(bad), w, dy, key=key)
  assert nonfinite(y) and nonfinite(dw) and np.all(np.isfinite(np.asarray(dx, np.float32)))
  y, dx, dw = _fwd_and_grads(r, x, w.at[7, 1].set(bad), dy, key=key)
  assert nonfinite(y) and nonfinite(dx) and np.all(np.isfinite(np.asarray(dw, np.float32)))
  y, dx, dw = _fwd_and_grads(r, x, w, dy.at[0, 0].set(bad), key=key)
  assert np.all(np.isfinite(np.asarray(y, np.float32))) and nonfinite(dx) and nonfinite(dw)


def test_dtypes_follow_inputs():
  # Dtypes are decided at trace time: jax.eval_shape traces the same jitted programs without compiling them.
  x, w, dy = _rand(39, (16, 32), jnp.bfloat16), _rand(40, (32, 16), jnp.float32), _rand(41, (16, 16))
  y, dx, dw = jax.eval_shape(lambda x, w, dy: _fwd_and_grads(NO_SR, x, w, dy), x, w, dy)
  assert (y.dtype, dx.dtype, dw.dtype) == (jnp.float32, jnp.bfloat16, jnp.float32)
  y = jax.eval_shape(lambda x, w: _fwd(NO_SR, x, w, preferred_element_type=jnp.float32), x, w.astype(jnp.bfloat16))
  assert y.dtype == jnp.float32


@pytest.mark.parametrize(
    "recipe,switched",
    [
        (gemm.GemmRecipe(), None),
        (gemm.GemmRecipe(), gemm.GemmRecipe(fprop="bf16")),  # the paper's forward-only switch
        (gemm.GemmRecipe(), gemm.GemmRecipe(fprop="bf16", dgrad="bf16", wgrad="bf16")),
        (gemm.GemmRecipe(fprop="fp8", dgrad="fp8", wgrad="fp8"), None),
    ],
)
def test_residuals_are_no_larger_than_bf16(recipe, switched):
  """The forward saves at most what a bf16 GEMM saves (x and W), never both bf16 and quantized copies."""
  from jax._src.ad_checkpoint import saved_residuals  # pylint: disable=import-outside-toplevel

  x, w = _rand(42, (64, 48), jnp.bfloat16), _rand(43, (48, 32), jnp.bfloat16)
  kw = dict(switched=switched, use_switched=jnp.bool_(True)) if switched else {}
  f = lambda x, w: gemm.dot_general(x, w, _DN, recipe=recipe, key=jax.random.key(0), **kw)
  res = saved_residuals(f, x, w)
  nbytes = sum(np.prod(aval.shape) * aval.dtype.itemsize for aval, _ in res if not jax.dtypes.issubdtype(aval.dtype, jax.dtypes.prng_key))
  budget = x.nbytes + w.nbytes + 16  # + the switch flag
  assert nbytes <= budget, res
  if recipe.wgrad == "nvfp4" and recipe.dgrad == "nvfp4" and switched is None:
    assert nbytes < 0.75 * budget  # 4-bit forms replace the bf16 operands


def test_under_remat_and_scan_equals_unrolled():
  """MaxText wraps layers in jax.checkpoint and (scan_layers) lax.scan: same bits as the plain loop."""
  x, dy = _rand(48, (32, 32), jnp.bfloat16), _rand(49, (32, 32), jnp.bfloat16)
  ws = _rand(50, (2, 32, 32), jnp.bfloat16, scale=0.2)
  key = jax.random.key(3)
  r = gemm.GemmRecipe()

  def layer(h, wk):
    w, k = wk
    return gemm.dot_general(h, w, _DN, recipe=r, key=k), None

  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(2))

  def scanned(x, ws):
    return jax.lax.scan(jax.checkpoint(layer), x, (ws, keys))[0]

  def unrolled(x, ws):
    for i in range(2):
      x = layer(x, (ws[i], keys[i]))[0]
    return x

  outs = []
  for f in (scanned, unrolled):
    y, vjp = jax.vjp(jax.jit(f), x, ws)
    outs.append((y, *vjp(dy)))
  for a, b in zip(*outs):
    assert np.all(np.isfinite(np.asarray(a, np.float32)))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
