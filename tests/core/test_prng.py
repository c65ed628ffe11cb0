"""``core/prng.py``: a FoldedKey stands for exactly the key ``jax.random.fold_in`` gives, wherever it is used.

The chain is checked against ``jax.random.fold_in`` itself (never against ``prng.resolve``): plain, batched
(vmap's per-slice data), through jit with traced data, both ``jax_threefry_partitionable`` settings, other
PRNGs (folded at once), and as the SR key of a GEMM and of a batched GEMM (the same gradients as the key jax
derives). The kernels' own application of the chain is ``test_nvfp4_triton.py``'s.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_nvfp4.core import gemm
from maxtext_nvfp4.core import prng


def _words(key):
  return np.asarray(jax.random.key_data(key))


def _jax_chain(key, data):
  for d in data:
    key = jax.random.fold_in(key, d)
  return key


@pytest.mark.parametrize("partitionable", [True, False])
@pytest.mark.parametrize("data", [[5], [0, 2**32 - 1, 7], [3, 1, 4, 1, 5, 9]])
def test_folded_key_resolves_to_jax_fold_in_chain(partitionable, data):
  with jax.threefry_partitionable(partitionable):
    k = jax.random.key(11)
    f = k
    for d in data:
      f = prng.fold_in(f, d)
    assert isinstance(f, prng.FoldedKey) and f.data.shape == (len(data),) and f.data.dtype == jnp.uint32
    assert np.array_equal(_words(prng.resolve(f)), _words(_jax_chain(k, data)))
    words, chain = prng.split_chain(f)
    assert np.array_equal(np.asarray(words), _words(k)) and np.array_equal(np.asarray(chain), np.uint32(data))


def test_traced_data_and_a_raw_key():
  raw = jax.random.PRNGKey(3)  # uint32[2] under jax's default (Threefry) PRNG
  got = jax.jit(lambda s: prng.resolve(prng.fold_in(prng.fold_in(raw, s), 2)))(jnp.int32(-4))
  want = jax.random.fold_in(jax.random.fold_in(raw, jnp.int32(-4)), 2)
  assert got.dtype == jnp.uint32 and np.array_equal(np.asarray(got), np.asarray(want))


def test_vmapped_fold_data_gives_a_batched_folded_key():
  k = prng.fold_in(jax.random.key(4), 9)
  keys = jax.vmap(lambda i: prng.fold_in(k, i))(jnp.arange(5))
  assert keys.shape == (5,) and keys.key.shape == (5,) and keys.data.shape == (5, 2)
  want = jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(jax.random.key(4), 9), i))(jnp.arange(5))
  assert np.array_equal(_words(prng.resolve(keys)), _words(want))


def test_another_prng_is_folded_at_once():
  k = jax.random.key(5, impl="rbg")
  got = prng.fold_in(k, 3)
  assert not isinstance(got, prng.FoldedKey) and not prng.is_threefry(k)
  assert np.array_equal(_words(got), _words(jax.random.fold_in(k, 3)))


def _grads(x, w, dy, key, dn=(((1,), (0,)), ((), ()))):
  f = lambda x, w: gemm.dot_general(x, w, dn, recipe=gemm.GemmRecipe(), key=key)  # noqa: E731
  return [np.asarray(g, np.float32) for g in jax.jit(lambda x, w: jax.vjp(f, x, w)[1](dy))(x, w)]


def test_gemm_with_a_folded_key_draws_the_jax_keys_bits():
  x = jax.random.normal(jax.random.key(1), (32, 64), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(2), (64, 48), jnp.float32) * 0.2).astype(jnp.bfloat16)
  dy = jax.random.normal(jax.random.key(3), (32, 48), jnp.float32).astype(jnp.bfloat16)
  base = jax.random.key(7)
  got = _grads(x, w, dy, prng.fold_in(prng.fold_in(base, 4), 2))
  want = _grads(x, w, dy, _jax_chain(base, [4, 2]))
  other = _grads(x, w, dy, _jax_chain(base, [4, 3]))
  for g, h, o in zip(got, want, other):
    assert np.array_equal(g, h) and not np.array_equal(g, o)


def test_batched_gemm_with_a_folded_key_gives_each_expert_its_fold():
  b, m, k, n = 3, 32, 64, 48
  x = jax.random.normal(jax.random.key(1), (b, m, k), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(2), (b, k, n), jnp.float32) * 0.2).astype(jnp.bfloat16)
  dy = jax.random.normal(jax.random.key(3), (b, m, n), jnp.float32).astype(jnp.bfloat16)
  dn = (((2,), (1,)), ((0,), (0,)))
  base = jax.random.key(8)
  gx, gw = _grads(x, w, dy, prng.fold_in(base, 6), dn)
  for e in range(b):  # expert e: fold_in(key, e) of the GEMM's key (gemm's docstring)
    ex, ew = _grads(x[e], w[e], dy[e], _jax_chain(base, [6, e]))
    # The same quantized operands; only the batched GEMM's fp32 accumulation order may differ, and so the bf16
    # rounding of the gradients by one bf16 ulp (seen on the H200: benchmarks/RESULTS.md).
    for got, want in ((gx[e], ex), (gw[e], ew)):
      assert _within_one_bf16_ulp(got, want), e
    # Another expert's key draws other bits: outside that tolerance.
    _, other_w = _grads(x[e], w[e], dy[e], _jax_chain(base, [6, e + 1]))
    assert not _within_one_bf16_ulp(other_w, ew), e


def _within_one_bf16_ulp(got, want) -> bool:
  """|got - want| <= one bf16 ulp of want (2**-7 relative bounds it) or 1e-5 of the largest |want|."""
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return bool(np.allclose(got, want, rtol=2.0**-7, atol=1e-5 * np.abs(want).max()))
