"""Determinism on CPU: two identical NVFP4 training runs (stochastic rounding on) give bitwise-identical metrics.

The stochastic-rounding bits come from ``sr_key(nvfp4_seed, step, layer, role)`` only (no MaxText rng
stream, no host randomness), so two runs, or a run and its resumption, draw the same bits. What is and
is not deterministic on GPU is documented in docs/failure_behaviour.md.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxtext_nvfp4
from maxtext_nvfp4.core import gemm
from maxtext_nvfp4.core import plan as plan_lib
from maxtext_nvfp4.core import settings as settings_lib
from maxtext_helpers import read_metrics, tiny_argv

maxtext_nvfp4.register()  # MaxText accepts quantization=nvfp4 (importing the package registers nothing)

# Same model/steps/learning rate as tests/integration/test_reliability_checkpoint.py, so the compiled step is
# shared through JAX's persistent compilation cache.
SMALL = dict(base_emb_dim=32, base_num_query_heads=2, base_num_kv_heads=2, base_mlp_dim=64,
             base_num_decoder_layers=2, vocab_size=128, steps=5, learning_rate=1e-2)
COMPARED = ("learning/loss", "learning/grad_norm", "learning/raw_grad_norm", "learning/param_norm")


@pytest.mark.slow
def test_two_identical_runs_are_bitwise_identical(tmp_path):
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel

  out = str(tmp_path)
  cfg = pyconfig.initialize(tiny_argv(out, run_name="a", quantization="nvfp4", **SMALL))
  s = settings_lib.from_config(cfg)
  assert s.stochastic_rounding and s.rht  # randomness is really in play
  runs = []
  for name in ("a", "b"):
    train.main(tiny_argv(out, run_name=name, quantization="nvfp4", **SMALL))
    runs.append(read_metrics(os.path.join(out, f"{name}.jsonl")))
  a, b = runs
  assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(SMALL["steps"]))
  for ma, mb in zip(a, b):
    for k in COMPARED:
      assert np.float32(ma[k]).tobytes() == np.float32(mb[k]).tobytes(), (ma["step"], k, ma[k], mb[k])
  losses = [m["learning/loss"] for m in a]
  assert len(set(losses)) == len(losses)  # it trains (not a constant that would compare equal trivially)


def test_sr_key_depends_only_on_seed_step_layer_role():
  data = lambda k: np.asarray(jax.random.key_data(k))
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
