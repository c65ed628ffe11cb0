"""Determinism on CPU: the stochastic-rounding key and the SR GEMM it drives.

The stochastic-rounding bits come from ``sr_key(nvfp4_seed, step, layer, role)`` only (no MaxText rng
stream, no host randomness), so two runs, or a run and its resumption, draw the same bits. The whole-run
checks share the MaxText runs of tests/integration/test_reliability_checkpoint.py: two identical NVFP4 training
runs give bitwise-identical metrics (test_two_identical_runs_are_bitwise_identical) and a run resumed after a
SIGKILL equals the uninterrupted one bit for bit (test_sigkill_mid_run_then_restart_matches_uninterrupted_run).
What is and is not deterministic on GPU is documented in docs/failure_behaviour.md.
"""

import jax
import jax.numpy as jnp
import numpy as np

from maxtext_nvfp4.core import gemm
from maxtext_nvfp4.core import plan as plan_lib
from maxtext_nvfp4.core import prng


def test_sr_key_depends_only_on_seed_step_layer_role():
  data = lambda k: np.asarray(jax.random.key_data(prng.resolve(k)))
  base = data(plan_lib.sr_key(0, 3, 1, "wo"))
  # Same inputs, traced or not: the same key (nothing else feeds it).
  assert np.array_equal(base, data(plan_lib.sr_key(0, 3, 1, "wo")))
  assert np.array_equal(base, data(jax.jit(lambda s: plan_lib.sr_key(0, s, 1, "wo"))(jnp.int32(3))))
  # Each input changes it.
  for other in [(1, 3, 1, "wo"), (0, 4, 1, "wo"), (0, 3, 0, "wo"), (0, 3, 1, "wi_0")]:
    assert not np.array_equal(base, data(plan_lib.sr_key(*other))), other


def test_sr_gemm_is_reproducible_for_a_key_and_varies_across_keys():
  x = jax.random.normal(jax.random.key(1), (32, 64), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(2), (64, 48), jnp.float32) * 0.2).astype(jnp.bfloat16)
  dy = jax.random.normal(jax.random.key(3), (32, 48), jnp.float32).astype(jnp.bfloat16)
  dn = (((1,), (0,)), ((), ()))

  def grads(key):
    # A fresh jit each time: recompilation must not change the bits either.
    f = jax.jit(lambda x, w: jax.vjp(lambda x, w: gemm.dot_general(x, w, dn, recipe=gemm.GemmRecipe(), key=key),
                                     x, w)[1](dy))
    return [np.asarray(g, np.float32) for g in f(x, w)]

  k = plan_lib.sr_key(0, 7, 1, "wi_0")
  g1, g2 = grads(k), grads(k)
  for a, b in zip(g1, g2):
    assert np.array_equal(a, b)
  g3 = grads(plan_lib.sr_key(0, 8, 1, "wi_0"))
  assert not np.array_equal(g1[0], g3[0]) and not np.array_equal(g1[1], g3[1])
