"""Non-finite and extreme operands through the emulated GEMM, MaxText's quant Linen module and a MaxText model.

What tests/core/test_gemm.py and tests/core/test_numerics.py already cover is not repeated here (a NaN/Inf in one
operand of a 2D GEMM; the quantizer's NaN/Inf/zero/extreme outputs against TE's formulas). This file adds:

* batched and multi-contracting GEMMs (MaxText's attention-out projection contracts heads x head_dim) and
  both branches of the late-switch ``lax.cond``: a NaN/Inf poisons exactly the outputs that depend on it;
* ``+Inf``/``-Inf`` where the exact product is infinite come out with the right sign;
* all-zero tensors and all-zero 16-blocks give exact zeros (no NaN from the ``0 * FLT_MAX`` encode scale);
* extreme magnitudes: scaling an operand by ``2**k`` (|k| = 100: ~1e-30 and ~1e30, and up to bf16 max)
  scales every dependent output by exactly ``2**k`` (TE's two-level scales are scale-invariant),
  overflowing to ``±Inf`` exactly where ``2**k * y`` exceeds fp32; below the S_enc clamp (amax < 2688 /
  FLT_MAX) the result stays finite;
* the ``quantization=nvfp4`` Linen module MaxText wraps, and a whole MaxText model's loss and gradients.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxtext_nvfp4
from maxtext_nvfp4.core import gemm
from maxtext_nvfp4.integration import traced
from maxtext_nvfp4.integration import step as step_lib
from maxtext_helpers import tiny_argv

maxtext_nvfp4.register()  # MaxText accepts quantization=nvfp4 (importing the package registers nothing)

NVFP4 = gemm.GemmRecipe()  # TE defaults: RHT, SR, 2D weights
FP8 = gemm.GemmRecipe(fprop="fp8", dgrad="fp8", wgrad="fp8")
BF16 = gemm.GemmRecipe(fprop="bf16", dgrad="bf16", wgrad="bf16")
KEY = jax.random.key(3)
F32_MAX = float(np.finfo(np.float32).max)
# Every 2D case below is x [M, K] . W [K, N] with these sizes (two 16-row token blocks, four 16-wide K blocks):
# the jitted forward/backward per recipe compiles once and serves them all.
M, K, N = 32, 64, 48
DN2 = (((1,), (0,)), ((), ()))


def _rand(seed, shape, scale=1.0):
  """Standard normal values on the bf16 grid, kept in fp32 (so scaling by 2**k is exact)."""
  return (jax.random.normal(jax.random.key(seed), shape, jnp.float32) * scale).astype(jnp.bfloat16).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("recipe", "dn", "switched"))
def _vjp(recipe, x, w, dy, dn, switched=None, use_switched=None):
  """(y, dx, dw): forward and backward of gemm.dot_general with cotangent ``dy``."""
  kw = dict(switched=switched, use_switched=use_switched) if switched is not None else {}
  f = lambda x, w: gemm.dot_general(x, w, dn, recipe=recipe, key=KEY, **kw)
  y, pull = jax.vjp(f, x, w)
  return (y, *pull(dy.astype(y.dtype)))


@functools.partial(jax.jit, static_argnames=("recipe", "dn", "out"))
def _fwd(recipe, x, w, dn, out=None):
  return gemm.dot_general(x, w, dn, recipe=recipe, key=KEY, preferred_element_type=out)


def _all_nonfinite(a):
  return not np.isfinite(np.asarray(a, np.float32)).any()


def _all_finite(a):
  return np.isfinite(np.asarray(a, np.float32)).all()


# ---------------------------------------------------------------------------------------------------
# NaN / Inf: poisoned exactly where the math depends on the bad value
# ---------------------------------------------------------------------------------------------------
# (lhs shape, rhs shape, dimension_numbers): activations with a batch-of-sequences layout contracting
# emb; the attention-out projection contracting (heads, head_dim); a batched GEMM (vmap'ed in gemm).
_SHAPES = [
    ((2, 16, 32), (32, 48), (((2,), (0,)), ((), ()))),
    ((2, 16, 4, 8), (4, 8, 32), (((2, 3), (0, 1)), ((), ()))),
    ((3, 16, 32), (3, 32, 16), (((2,), (1,)), ((0,), (0,)))),
]


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("shapes", _SHAPES, ids=["seq", "attn_out", "batched"])
def test_bad_value_poisons_exactly_the_dependent_outputs(shapes, bad):
  xs, ws, dn = shapes
  x, w = _rand(1, xs), _rand(2, ws, 0.2)
  y0 = jax.eval_shape(lambda: gemm.dot_general(x, w, dn, recipe=BF16))
  dy = _rand(3, y0.shape)
  batched = bool(dn[1][0])
  for recipe, switched in [(NVFP4, None), (NVFP4, gemm.GemmRecipe(fprop="bf16")), (FP8, None)]:
    for use in ([None] if switched is None else [jnp.bool_(False), jnp.bool_(True)]):
      name = (recipe, switched, use)
      # A bf16 fprop (switched on) is a plain GEMM: only the outputs whose sum meets the bad value
      # (row 0 for a bad x[0...], column 0 for a bad W[0...]) are non-finite. Quantized passes share
      # one amax per tensor (per batch slice): all of it.
      plain_fprop = use is not None and bool(use) and switched.fprop == "bf16"
      sl = 0 if batched else slice(None)
      # x: y and dW depend on it; dx = dy . W^T does not.
      y, dx, dw = _vjp(recipe, x.at[(0,) * x.ndim].set(bad), w, dy, dn, switched, use)
      if plain_fprop:
        assert _all_nonfinite(y[0, 0]) and _all_finite(y[0, 1:]), name
      else:
        assert _all_nonfinite(y[sl]), name
      assert _all_nonfinite(dw[sl]) and _all_finite(dx), name
      if batched:  # batch slice 0 is its own GEMM: the other slices stay finite
        assert _all_finite(y[1:]) and _all_finite(dw[1:]), name
      # W: y and dx depend on it.
      y, dx, dw = _vjp(recipe, x, w.at[(0,) * w.ndim].set(bad), dy, dn, switched, use)
      if plain_fprop:
        assert _all_nonfinite(y[sl][..., 0]) and _all_finite(y[sl][..., 1:]), name
      else:
        assert _all_nonfinite(y[sl]), name
      assert _all_nonfinite(dx[sl]) and _all_finite(dw), name
      # dy (the gradient): dx and dW depend on it.
      y, dx, dw = _vjp(recipe, x, w, dy.at[(0,) * dy.ndim].set(bad), dn, switched, use)
      assert _all_finite(y) and _all_nonfinite(dx[sl]) and _all_nonfinite(dw[sl]), name


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("recipe", [NVFP4, FP8, BF16], ids=["nvfp4", "fp8", "bf16"])
def test_infinite_product_has_the_right_sign(recipe, sign):
  # x > 0 with one ±Inf in row 0, W > 0: the exact row 0 of x.W is ±Inf in every column.
  x = jnp.abs(_rand(4, (M, K))) + 0.5
  w = jnp.abs(_rand(5, (K, N))) + 0.5
  x = x.at[0, 3].set(sign * np.inf)
  y, _, dw = _vjp(recipe, x, w, jnp.ones((M, N)), DN2)
  y = np.asarray(y)
  assert (y[0] == sign * np.inf).all(), y[0]
  assert not np.isnan(y[0]).any()
  if recipe is not BF16:  # per-tensor scales: the Inf amax makes the whole output non-finite
    assert _all_nonfinite(y) and _all_nonfinite(dw)


# ---------------------------------------------------------------------------------------------------
# Zeros
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", [NVFP4, FP8], ids=["nvfp4", "fp8"])
def test_zero_tensors_give_exact_zeros(recipe):
  dn = DN2
  x, w, dy = _rand(6, (M, K)), _rand(7, (K, N)), _rand(8, (M, N))
  z = lambda a: np.asarray(a, np.float32)
  y, dx, dw = _vjp(recipe, jnp.zeros_like(x), w, dy, dn)
  assert not z(y).any() and not z(dw).any() and _all_finite(dx)
  y, dx, dw = _vjp(recipe, x, jnp.zeros_like(w), dy, dn)
  assert not z(y).any() and not z(dx).any() and _all_finite(dw)
  y, dx, dw = _vjp(recipe, x, w, jnp.zeros_like(dy), dn)  # SR of an all-zero gradient stays exactly zero
  assert not z(dx).any() and not z(dw).any() and _all_finite(y)
  for a in (y, dx, dw):
    assert not np.isnan(z(a)).any()


def test_zero_blocks_give_exact_zeros_and_leave_other_blocks_alone():
  dn = DN2
  x, w, dy = _rand(9, (M, K)), _rand(10, (K, N)), _rand(11, (M, N))
  x = x.at[16:32].set(0.0)  # one whole 16-token block (wgrad blocks run along tokens) and 16 fprop rows
  x = x.at[:, :16].set(0.0)  # one 1x16 fprop block in every row
  w = w.at[:16].multiply(0.25)  # W's amax lies outside the rows that meet the zero x-blocks
  y, dx, dw = _vjp(NVFP4, x, w, dy, dn)
  y, dw = np.asarray(y), np.asarray(dw)
  assert not y[16:32].any() and _all_finite(y) and _all_finite(dx) and _all_finite(dw)
  assert (np.abs(y[:16]) > 0).mean() > 0.9  # the other rows are real products
  assert not dw[:16].any()  # dW rows of the all-zero x columns
  # Zero blocks change no amax and no other block: dropping them gives the same fprop.
  y_drop = _fwd(NVFP4, x[:, 16:], w[16:], dn)
  np.testing.assert_allclose(y, np.asarray(y_drop), rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------------
# Extreme magnitudes
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [-100, 100])  # 2**-100 ~ 7.9e-31, 2**100 ~ 1.3e30
@pytest.mark.parametrize("operand", ["x", "w", "dy"])
def test_power_of_two_scaling_is_exact(operand, k):
  """TE's scales are per tensor: q and s8 do not change, amax and alpha scale by 2**k (SR bits included)."""
  dn = DN2
  ops = dict(x=_rand(12, (M, K)), w=_rand(13, (K, N), 0.2), dy=_rand(14, (M, N)))
  y, dx, dw = map(np.asarray, _vjp(NVFP4, ops["x"], ops["w"], ops["dy"], dn))
  ops[operand] = ops[operand] * np.float32(2.0**k)
  ys, dxs, dws = map(np.asarray, _vjp(NVFP4, ops["x"], ops["w"], ops["dy"], dn))
  scaled = {"x": ("y", "dw"), "w": ("y", "dx"), "dy": ("dx", "dw")}[operand]
  for name, base, got in (("y", y, ys), ("dx", dx, dxs), ("dw", dw, dws)):
    want = np.float32(2.0**k) * base if name in scaled else base
    assert np.array_equal(got, want), (operand, k, name)
    assert np.abs(got).max() > 0


def test_bf16_max_operand_overflows_exactly_where_the_math_does():
  dn = DN2
  x, w = _rand(15, (M, K)) * 0.25, _rand(16, (K, N))
  x = x.at[0, 0].set(np.float32(2 - 2.0**-7))  # the largest bf16 significand: 2**127 x holds bf16 max
  big = x * np.float32(2.0**127)
  assert float(jnp.max(big)) == float(jnp.finfo(jnp.bfloat16).max)
  y = np.asarray(_fwd(NVFP4, x, w, dn), np.float64)
  got = np.asarray(_fwd(NVFP4, big.astype(jnp.bfloat16), w.astype(jnp.bfloat16), dn, jnp.float32))
  with np.errstate(over="ignore"):
    want = (y * 2.0**127).astype(np.float32)  # RNE to fp32, ±Inf beyond FLT_MAX
  assert np.array_equal(got, want)
  assert np.isinf(got).any() and np.isfinite(got).any() and not np.isnan(got).any()


def test_tiny_amax_below_the_scale_clamp_stays_finite():
  # amax = 2**-123 < 2688 / FLT_MAX: TE clamps S_enc to FLT_MAX. Nothing may turn into NaN or Inf.
  dn = DN2
  x, w, dy = _rand(17, (M, K)), _rand(18, (K, N), 0.2), _rand(19, (M, N))
  x = x / jnp.max(jnp.abs(x)) * np.float32(2.0**-123)
  assert 2688.0 / float(jnp.max(jnp.abs(x))) > F32_MAX
  for a in _vjp(NVFP4, x, w, dy, dn):
    assert _all_finite(a)


# ---------------------------------------------------------------------------------------------------
# Through MaxText: the quant Linen module and a whole model
# ---------------------------------------------------------------------------------------------------
SMALL = dict(base_emb_dim=32, base_num_query_heads=2, base_num_kv_heads=2, base_mlp_dim=64,
             base_num_decoder_layers=2, vocab_size=128)


@pytest.fixture(scope="module")
def config():
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

  return pyconfig.initialize(tiny_argv(quantization="nvfp4", **SMALL))


def test_maxtext_quant_module_propagates_nan(config):
  from maxtext.layers import quantizations  # pylint: disable=import-outside-toplevel

  q = quantizations.configure_quantization(config)
  module = q.dot_general_cls(mesh_axes=("embed", "mlp"))()  # what DenseGeneral builds for wi_0
  assert module.recipe is not None and module.recipe.fprop == "nvfp4"
  dn = (((2,), (0,)), ((), ()))
  x, w, dy = _rand(20, (2, 16, 32)), _rand(21, (32, 64), 0.2), _rand(22, (2, 16, 64))

  @jax.jit
  def run(x, w, dy):
    with step_lib.step_context(jnp.int32(5)):
      y, pull = jax.vjp(lambda x, w: module.apply({}, x, w, dn), x, w)
    return (y, *pull(dy))

  assert all(_all_finite(a) for a in run(x, w, dy))
  y, dx, dw = run(x.at[1, 3, 7].set(np.nan), w, dy)
  assert np.isnan(np.asarray(y)).all() and np.isnan(np.asarray(dw)).all() and _all_finite(dx)
  y, dx, dw = run(x, w.at[5, 5].set(np.nan), dy)
  assert np.isnan(np.asarray(y)).all() and np.isnan(np.asarray(dx)).all() and _all_finite(dw)
  y, dx, dw = run(x, w, dy.at[0, 0, 0].set(np.nan))
  assert _all_finite(y) and np.isnan(np.asarray(dx)).all() and np.isnan(np.asarray(dw)).all()


@pytest.mark.slow
def test_maxtext_model_loss_and_grads_are_nan_with_a_nan_weight():
  """A NaN in one decoder weight gives a NaN loss and NaN gradients (MaxText's checks can see it).

  One decoder layer with its MLP in NVFP4 keeps the compile short (the value_and_grad of the whole model).
  """
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils_nnx, model_creation_utils  # pylint: disable=import-outside-toplevel

  config = pyconfig.initialize(tiny_argv(quantization="nvfp4", nvfp4_targets="mlp",
                                         **{**SMALL, "base_num_decoder_layers": 1}))
  model = model_creation_utils.from_config(config, rngs=maxtext_utils_nnx.create_nnx_rngs(config))
  tokens = jax.random.randint(jax.random.key(0), (2, 64), 1, 128)
  positions = jnp.broadcast_to(jnp.arange(64), (2, 64))

  @nnx.jit
  def loss_and_grads(model):
    def loss_fn(m):
      with step_lib.step_context(jnp.int32(0)):
        logits = m(tokens, positions, decoder_segment_ids=jnp.ones_like(tokens), enable_dropout=False)
      logp = jax.nn.log_softmax(logits.astype(jnp.float32)[:, :-1])
      return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    return nnx.value_and_grad(loss_fn)(model)

  loss, grads = loss_and_grads(model)
  assert np.isfinite(float(loss))
  assert all(_all_finite(g) for g in jax.tree_util.tree_leaves(grads))
  seen = traced.traced_gemms()
  assert {(l, r) for (l, r, p, _) in seen if p == ("nvfp4",) * 3} >= {(0, "wi_0"), (0, "wi_1"), (0, "wo")}

  kernel = model.decoder.layers_0.mlp.wi_0.kernel
  kernel[...] = kernel[...].at[0, 0].set(jnp.nan)
  loss, grads = loss_and_grads(model)
  assert np.isnan(float(loss))
  # The MLP's weights and everything below it in the backward pass (attention, embedding) see the NaN.
  gflat = {tuple(map(str, p)): v for p, v in nnx.to_flat_state(grads)}
  checked = 0
  for p, g in gflat.items():
    if "mlp" in p or "self_attention" in p or "token_embedder" in p:
      assert np.isnan(np.asarray(g[...], np.float32)).any(), p
      checked += 1
  assert checked >= 7, list(gflat)
