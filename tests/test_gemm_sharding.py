"""The emulated GEMM under FSDP x TP sharding (8 host devices) is bit-identical to one device.

Runs in a subprocess because the host device count must be set before JAX initializes. The amax of
every quantized operand must be the global one (a per-shard amax would change scales and outputs).
"""

import json
import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from maxtext_nvfp4.core import gemm

    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tp"))
    # RNE (the required path) and stochastic rounding (keys from threefry are sharding-invariant);
    # RHT and 2D weights on.
    for sr in (False, True):
      recipe = gemm.GemmRecipe(stochastic_rounding=sr)
      key = jax.random.key(42)
      b, s, e, f, h, d = 8, 16, 64, 96, 4, 16

      def step(x, wi, wo, wq, dy):
        def loss(x, wi, wo, wq):
          # MLP in (wi: embed x mlp), MLP out (wo: mlp x embed), attention-style out projection
          # contracting (heads, head_dim) against a (heads, head_dim, embed) kernel.
          hdn = gemm.dot_general(x, wi, (((2,), (0,)), ((), ())), recipe=recipe, key=key)
          y = gemm.dot_general(hdn, wo, (((2,), (0,)), ((), ())), recipe=recipe, key=key)
          att = gemm.dot_general(y.reshape(b, s, h, d), wq, (((2, 3), (0, 1)), ((), ())), recipe=recipe, key=key)
          return jnp.sum((att * dy).astype(jnp.float32)), (hdn, y, att)
        (l, outs), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, wi, wo, wq)
        return outs, grads

      ks = jax.random.split(jax.random.key(0), 5)
      x = jax.random.normal(ks[0], (b, s, e), jnp.bfloat16)
      wi = (jax.random.normal(ks[1], (e, f)) * 0.1).astype(jnp.bfloat16)
      wo = (jax.random.normal(ks[2], (f, e)) * 0.1).astype(jnp.bfloat16)
      wq = (jax.random.normal(ks[3], (h, d, e)) * 0.1).astype(jnp.bfloat16)
      dy = jax.random.normal(ks[4], (b, s, e), jnp.bfloat16)
      args = (x, wi, wo, wq, dy)

      single = jax.jit(step)
      ref = jax.device_get(single(*(jax.device_put(a, jax.devices()[0]) for a in args)))

      specs = (P("fsdp", None, None), P("fsdp", "tp"), P("tp", "fsdp"), P("tp", None, "fsdp"), P("fsdp", None, None))
      shard = [NamedSharding(mesh, sp) for sp in specs]
      sharded_args = [jax.device_put(a, sh) for a, sh in zip(args, shard)]
      got_dev = jax.jit(step, in_shardings=shard)(*sharded_args)
      n_shards = [len(a.addressable_shards) for a in sharded_args]
      got = jax.device_get(got_dev)

      leaves_ref = jax.tree_util.tree_leaves(ref)
      leaves_got = jax.tree_util.tree_leaves(got)
      mism = [int(np.sum(np.asarray(a, np.float32).view(np.uint32) != np.asarray(b, np.float32).view(np.uint32)))
              for a, b in zip(leaves_ref, leaves_got)]
      # Control (once): a per-shard amax (each fsdp shard of x quantized on its own) changes outputs.
      per_shard_differs = None
      if not sr:
        fprop = jax.jit(lambda x: gemm.dot_general(x, wi, (((2,), (0,)), ((), ())), recipe=recipe, key=key))
        x_ps = x.at[:2].multiply(7.3)  # not a power of two: the other shards' scales must move
        per_shard = jnp.concatenate([fprop(x_ps[i * 2 : (i + 1) * 2]) for i in range(4)])
        per_shard_differs = bool(np.any(np.asarray(per_shard[2:] != fprop(x_ps)[2:])))
      print("RESULT" + json.dumps(dict(sr=sr, mismatches=mism, sizes=[int(np.size(a)) for a in leaves_ref],
                                       n_shards=n_shards, per_shard_differs=per_shard_differs,
                                       finite=[bool(np.all(np.isfinite(np.asarray(a, np.float32)))) for a in leaves_ref])))
    """
)


def test_fsdp_tp_sharded_gemm_is_bit_identical_to_single_device():
  """RNE (required) and SR: outputs and all gradients bit for bit."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  results = [json.loads(l[len("RESULT") :]) for l in proc.stdout.splitlines() if l.startswith("RESULT")]
  assert [r["sr"] for r in results] == [False, True]
  for res in results:
    assert res["n_shards"] == [8, 8, 8, 8, 8]  # really distributed over all 8 devices
    assert all(res["finite"]) and len(res["mismatches"]) == 7  # 3 outputs + 4 gradients
    assert res["mismatches"] == [0] * 7, res
  assert results[0]["per_shard_differs"]  # the check can see a per-shard amax
