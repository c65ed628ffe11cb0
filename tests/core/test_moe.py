"""The emulated NVFP4 grouped GEMM (core/grouped_gemm.py) equals a per-expert loop of the 2D GEMM.

Bit for bit on the RNE path (stochastic rounding off), forward and both gradients, for the ragged form
(``lax.ragged_dot``'s contract) and MaxText RoutedMoE's einsum forms, with empty experts and groups of 1,
15, 16 and 17 tokens; each expert's weight is quantized with its own amax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_nvfp4.core import gemm
from maxtext_nvfp4.core import grouped_gemm
from maxtext_nvfp4.core import nvfp4 as numerics

RNE = gemm.GemmRecipe(stochastic_rounding=False)
BF16 = gemm.GemmRecipe(fprop="bf16", dgrad="bf16", wgrad="bf16")
SIZES = (0, 1, 15, 16, 17)  # an empty expert, groups below/at/above one 16-token block (and unaligned starts)
K, N = 32, 48
CONTRACT_2D = (((1,), (0,)), ((), ()))


def _bits(a):
  return np.asarray(a, np.float32)


def _bf16_normal(seed, *shapes, expert_scales=False):
  """bf16 Gaussian operands from numpy (jax.random would compile a sampler per shape; numpy's bf16 cast rounds
  to nearest even, as XLA's); ``expert_scales``: the second operand's experts scaled 1, 4, 16, ... apart."""
  rng = np.random.default_rng(seed)
  out = [rng.standard_normal(shape, np.float32) for shape in shapes]
  if expert_scales:
    out[1] = out[1] * (np.float32(4.0) ** np.arange(shapes[1][0], dtype=np.float32))[:, None, None]
  return [jnp.asarray(a.astype(jnp.bfloat16)) for a in out]


def _operands(sizes, extra_rows=5):
  e, m = len(sizes), sum(sizes) + extra_rows
  # experts' weights on scales 1..E apart: one shared amax would quantize the small ones coarsely
  x, w, dy = _bf16_normal(0, (m, K), (e, K, N), (m, N), expert_scales=True)
  return x, w, dy


def _loop_ragged(x, w, sizes, recipe, key=None):
  """The reference: expert e's 2D GEMM on its own rows (a row past every group gives zeros)."""
  outs, start = [], 0
  for e, m in enumerate(sizes):
    if m:
      k = None if key is None else jax.random.fold_in(key, e)
      outs.append(gemm.dot_general(x[start:start + m], w[e], CONTRACT_2D, recipe=recipe, key=k))
    start += m
  outs.append(jnp.zeros((x.shape[0] - start, w.shape[2]), x.dtype))
  return jnp.concatenate(outs)


def _vjp(fn, x, w, dy):
  """(y, dx, dW) of ``fn``, compiled once (eager would compile every quantizer op separately)."""
  def run(x, w, dy):
    y, pull = jax.vjp(fn, x, w)
    return (y,) + pull(dy)
  return jax.jit(run)(x, w, dy)


@functools.partial(jax.jit, static_argnames="sr")
def _ragged_vjp(x, w, gs, dy, sr: bool, key):
  """(y, dx, dW) of the grouped GEMM with traced group sizes (as MaxText's routing gives them); one compile
  per (shapes, sr), shared by the tests below."""
  recipe = gemm.GemmRecipe(stochastic_rounding=sr)
  y, pull = jax.vjp(lambda p, q: grouped_gemm.ragged_dot(p, q, gs, recipe=recipe, key=key), x, w)
  return (y,) + pull(dy)


def test_ragged_equals_per_expert_loop_bit_for_bit_forward_and_both_gradients():
  x, w, dy = _operands(SIZES)
  gs = jnp.asarray(SIZES, jnp.int32)
  got = _ragged_vjp(x, w, gs, dy, sr=False, key=jax.random.key(1))  # RNE: the key is unused
  want = _vjp(lambda a, b: _loop_ragged(a, b, SIZES, RNE), x, w, dy)
  for name, g, r in zip(("y", "dx", "dW"), got, want):
    np.testing.assert_array_equal(_bits(g), _bits(r), err_msg=name)
  # the empty expert gets no gradient; rows past the groups get no output and no gradient
  assert not np.any(_bits(got[2][0])) and not np.any(_bits(got[0][sum(SIZES):])) and not np.any(_bits(got[1][sum(SIZES):]))
  # and NVFP4 really happened: it differs from the unquantized ragged_dot
  assert not np.array_equal(_bits(got[0]), _bits(jax.lax.ragged_dot(x, w, gs)))


def test_ragged_with_traced_group_sizes_and_stochastic_rounding():
  """Group sizes are traced in MaxText (routing decides them): one compile serves any sizes. (The operands
  of the test above: its RNE compile is reused.)"""
  sizes = SIZES
  x, w, dy = _operands(sizes)
  key = jax.random.key(1)

  def run(x, w, gs, dy, sr: bool):
    return _ragged_vjp(x, w, gs, dy, sr=sr, key=key)

  y, dx, dw = run(x, w, jnp.asarray(sizes, jnp.int32), dy, sr=True)
  ref = run(x, w, jnp.asarray(sizes, jnp.int32), dy, sr=False)
  # same forward as RNE (SR is on the gradient only); finite SR gradients, different bits from RNE
  np.testing.assert_array_equal(_bits(y), _bits(ref[0]))
  assert np.isfinite(_bits(dx)).all() and np.isfinite(_bits(dw)).all()
  assert not np.array_equal(_bits(dw), _bits(ref[2]))
  other = run(x, w, jnp.asarray(sizes[::-1], jnp.int32), dy, sr=False)  # same compile, other routing
  assert not np.array_equal(_bits(other[0]), _bits(ref[0]))


def test_ragged_bf16_recipe_is_ragged_dot():
  x, w, _ = _operands(SIZES)
  gs = jnp.asarray(SIZES, jnp.int32)
  np.testing.assert_allclose(_bits(grouped_gemm.ragged_dot(x, w, gs, recipe=BF16)),
                             _bits(jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32)),
                             rtol=1e-2, atol=1e-2)


def test_each_expert_weight_gets_its_own_amax():
  """Expert e's fprop equals the 2D GEMM with W_e quantized alone; with one amax over all W it would not."""
  x, w, dy = _operands(SIZES)
  # the forward of the RNE program the first test compiled (same operands)
  y = _ragged_vjp(x, w, jnp.asarray(SIZES, jnp.int32), dy, sr=False, key=jax.random.key(1))[0]
  e = 2  # rows 1..15; a shared amax (the last expert's, 4**2 larger) would flush many of its values
  x0 = x[1:16]
  qw_own = numerics.quantize(w[e], block_2d=True)
  np.testing.assert_array_equal(_bits(numerics.global_decode_scale(qw_own)),
                                _bits(jnp.max(jnp.abs(w[e].astype(jnp.float32))) / 2688))
  dot = jax.jit(lambda a, b: gemm.dot_general(a, b, CONTRACT_2D, recipe=RNE))
  np.testing.assert_array_equal(_bits(y[1:16]), _bits(dot(x0, w[e])))
  shared = jnp.concatenate([w[e], w[-1]], axis=1)  # W_e quantized next to the largest expert's weight
  y_shared = dot(x0, shared)[:, :N]
  assert not np.array_equal(_bits(y[1:16]), _bits(y_shared))


@pytest.mark.parametrize("eqn,lhs_shape,rhs_shape,dy_shape", [
    ("EBCM,EMH->EBCH", (2, 2, 17, K), (2, K, N), (2, 2, 17, N)),      # capacity form (up projection)
    ("BSM,EMH->BSEH", (2, 15, K), (2, K, N), (2, 15, 2, N)),          # no-capacity form: every token, every expert
    ("BSEH,EHM->BSEM", (2, 16, 2, K), (2, K, N), (2, 16, 2, N)),      # no-capacity down projection
])
def test_einsum_forms_equal_per_expert_loop_bit_for_bit(eqn, lhs_shape, rhs_shape, dy_shape):
  x, w, dy = _bf16_normal(2, lhs_shape, rhs_shape, dy_shape, expert_scales=True)
  got = _vjp(lambda a, b: grouped_gemm.einsum(eqn, a, b, recipe=RNE), x, w, dy)

  ins, out = eqn.split("->")
  a_spec, b_spec = ins.split(",")
  spec = a_spec.replace("E", "")  # the tokens' labels, then the contraction label (last in every form)

  def loop(a, b):
    ys = []
    if "E" not in a_spec:  # every expert sees every token: dx is the sum of the per-expert dgrads
      a = jnp.broadcast_to(a[None], (rhs_shape[0],) + a.shape)
    for e in range(rhs_shape[0]):
      xe = jnp.take(a, e, axis=a_spec.index("E") if "E" in a_spec else 0)
      tokens = xe.reshape(-1, xe.shape[-1])
      ys.append(gemm.dot_general(tokens, b[e], CONTRACT_2D, recipe=RNE).reshape(xe.shape[:-1] + (N,)))
    return jnp.einsum(f"E{spec[:-1]}{b_spec[-1]}->{out}", jnp.stack(ys))

  want = _vjp(loop, x, w, dy)
  for name, g, r in zip(("y", "dx", "dW"), got, want):
    np.testing.assert_array_equal(_bits(g), _bits(r), err_msg=name)
  np.testing.assert_allclose(_bits(got[0]), _bits(jnp.einsum(eqn, _bits(x), _bits(w))),
                             rtol=0.5, atol=0.5 * float(jnp.max(jnp.abs(got[0].astype(jnp.float32)))))


def test_einsum_rejects_a_second_batch_label():
  with pytest.raises(ValueError, match="only the expert label"):
    grouped_gemm.einsum("EBM,EBMH->EBH", jnp.ones((2, 3, 16)), jnp.ones((2, 3, 16, 16)), recipe=RNE)
