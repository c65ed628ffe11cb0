"""MoE parity across expert shards: both grouped-GEMM forms (MaxText RoutedMoE's einsum, ``lax.ragged_dot``) with
8 experts sharded over an expert axis (4 shards: 4 groups of 2 experts) and FSDP (2) on an 8-device CPU mesh.

Every expert's forward output, dgrad and wgrad equal the per-expert dense NVFP4 GEMM (``gemm.dot_general`` on that
expert's 2D operands, one device) bit for bit -- the RNE path for both forms, and stochastic rounding for the
einsum form (expert ``e``'s key is ``fold_in(key, e)``, threefry is sharding-invariant). Bit for bit holds although the token contraction of the wgrad
is split over the FSDP shards: the emulated GEMM's partial sums are of products of E2M1 codes (fp32, exact at these
sizes), so the accumulation order does not show. With the injected per-expert scale-layout swap in the wgrad
(tests/moe_wgrad_bug.py, a monkeypatch of the public ``gemm.dot_general``) the same check finds every expert's
wgrad wrong and its forward and dgrad still right.

One subprocess runs everything (the host device count is fixed when JAX starts).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import functools, json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from maxtext_nvfp4.core import gemm, grouped_gemm
    import moe_wgrad_bug

    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("exp", "fsdp"))
    E, K, N = 8, 32, 48
    SIZES = (0, 1, 15, 16, 17, 5, 33, 12)       # an empty expert, groups around one 16-token block
    M = sum(SIZES) + 3                           # rows past every group
    C2 = (((1,), (0,)), ((), ()))
    rng = np.random.default_rng(0)
    bf16 = lambda *shape: rng.standard_normal(shape, np.float32)
    scales = (np.float32(2.0) ** np.arange(E, dtype=np.float32))[:, None, None]  # experts 2x apart
    w = jnp.asarray((bf16(E, K, N) * scales).astype(jnp.bfloat16))
    x_e = jnp.asarray(bf16(E, 4, 16, K).astype(jnp.bfloat16))      # capacity form: (E, B, C, M)
    dy_e = jnp.asarray(bf16(E, 4, 16, N).astype(jnp.bfloat16))
    x_r = jnp.asarray(bf16(M, K).astype(jnp.bfloat16))               # ragged form: (tokens, K)
    dy_r = jnp.asarray(bf16(M, N).astype(jnp.bfloat16))
    gs = jnp.asarray(SIZES, jnp.int32)
    key = jax.random.key(7)

    def vjp(fn, *args):
      y, pull = jax.vjp(fn, *args[:2])
      return (y,) + pull(args[2])

    def einsum_step(x, w, dy, sr):
      r = gemm.GemmRecipe(stochastic_rounding=sr)
      return vjp(lambda a, b: grouped_gemm.einsum("EBCM,EMH->EBCH", a, b, recipe=r, key=key), x, w, dy)

    def ragged_step(x, w, dy, sr):
      r = gemm.GemmRecipe(stochastic_rounding=sr)
      return vjp(lambda a, b: grouped_gemm.ragged_dot(a, b, gs, recipe=r, key=key), x, w, dy)

    def dense_expert(x, w, dy, e, r):
      # expert e alone: the 2D GEMM on its own tokens with its own key
      return vjp(lambda p, q: gemm.dot_general(p, q, C2, recipe=r, key=jax.random.fold_in(key, e)), x, w, dy)

    @functools.partial(jax.jit, static_argnums=3)
    def dense_einsum(x, w, dy, sr):  # every expert's dense GEMM, one program (one device)
      r = gemm.GemmRecipe(stochastic_rounding=sr)
      return [dense_expert(x[e].reshape(-1, K), w[e], dy[e].reshape(-1, N), e, r) for e in range(E)]

    @functools.partial(jax.jit, static_argnums=3)
    def dense_ragged(x, w, dy, sr):
      r = gemm.GemmRecipe(stochastic_rounding=sr)
      out, start = [], 0
      for e, m in enumerate(SIZES):
        out.append(dense_expert(x[start:start + m], w[e], dy[start:start + m], e, r) if m else None)
        start += m
      return out

    one = jax.devices()[0]
    sh = lambda *spec: NamedSharding(mesh, P(*spec))

    def check(sr, label, forms=("einsum", "ragged")):
      out = {}
      # einsum: experts over "exp", tokens (B) and N over "fsdp"
      args = (x_e, w, dy_e)
      specs = (sh("exp", "fsdp", None, None), sh("exp", None, "fsdp"), sh("exp", "fsdp", None, None))
      got = jax.device_get(jax.jit(lambda a, b, g: einsum_step(a, b, g, sr), in_shardings=specs)(
          *(jax.device_put(a, s) for a, s in zip(args, specs))))
      n_shards = [len(jax.device_put(a, s).addressable_shards) for a, s in zip(args, specs)]
      mism = {"y": [], "dx": [], "dw": []}
      refs = jax.device_get(dense_einsum(*(jax.device_put(a, one) for a in (x_e, w, dy_e)), sr))
      for e in range(E):
        ref = refs[e]
        for name, g, r in zip(("y", "dx", "dw"), (got[0][e].reshape(-1, N), got[1][e].reshape(-1, K), got[2][e]), ref):
          mism[name].append(int(np.sum(np.asarray(g, np.float32).view(np.uint32) != np.asarray(r, np.float32).view(np.uint32))))
      out["einsum"] = dict(mism=mism, n_shards=n_shards)
      if "ragged" not in forms:
        print("RESULT" + json.dumps(dict(label=label, sr=sr, **out)), flush=True)
        return
      # ragged: tokens over "fsdp", experts over "exp"
      args = (x_r, w, dy_r)
      specs = (sh("fsdp", None), sh("exp", None, "fsdp"), sh("fsdp", None))
      got = jax.device_get(jax.jit(lambda a, b, g: ragged_step(a, b, g, sr), in_shardings=specs)(
          *(jax.device_put(a, s) for a, s in zip(args, specs))))
      mism = {"y": [], "dx": [], "dw": []}
      refs = jax.device_get(dense_ragged(*(jax.device_put(a, one) for a in (x_r, w, dy_r)), sr))
      start = 0
      for e, m in enumerate(SIZES):
        if m:
          ref = refs[e]
          pairs = ((got[0][start:start + m], ref[0]), (got[1][start:start + m], ref[1]), (got[2][e], ref[2]))
        else:  # an empty expert: no gradient at all
          pairs = ((np.zeros(1), np.zeros(1)), (np.zeros(1), np.zeros(1)), (got[2][e], np.zeros_like(got[2][e])))
        for name, (g, r) in zip(("y", "dx", "dw"), pairs):
          mism[name].append(int(np.sum(np.asarray(g, np.float32).view(np.uint32) != np.asarray(r, np.float32).view(np.uint32))))
        start += m
      tail = [int(np.count_nonzero(np.asarray(t[start:], np.float32))) for t in got[:2]]
      out["ragged"] = dict(mism=mism, tail_nonzero=tail)
      print("RESULT" + json.dumps(dict(label=label, sr=sr, **out)), flush=True)

    check(False, "clean")
    check(True, "clean", forms=("einsum",))  # SR: the einsum form (the ragged form's SR: tests/core/test_moe.py)
    moe_wgrad_bug.install()
    check(False, "injected")
    """
)


@pytest.fixture(scope="module")
def results():
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
  env["JAX_PLATFORMS"] = "cpu"
  tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join(p for p in (tests_dir, env.get("PYTHONPATH", "")) if p)
  proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return [json.loads(l[len("RESULT"):]) for l in proc.stdout.splitlines() if l.startswith("RESULT")]


def test_every_expert_equals_its_dense_gemm_bit_for_bit_across_expert_and_fsdp_shards(results):
  clean = [r for r in results if r["label"] == "clean"]
  assert [r["sr"] for r in clean] == [False, True]
  for r in clean:
    assert r["einsum"]["n_shards"] == [8, 8, 8]  # every operand really spread over the 8 devices
    for form in ("einsum", "ragged") if not r["sr"] else ("einsum",):
      assert r[form]["mism"] == {k: [0] * 8 for k in ("y", "dx", "dw")}, (form, r["sr"], r[form]["mism"])
  assert clean[0]["ragged"]["tail_nonzero"] == [0, 0]  # rows past every group: no output, no gradient


def test_injected_wgrad_scale_swap_is_caught_per_expert(results):
  (bad,) = [r for r in results if r["label"] == "injected"]
  for form in ("einsum", "ragged"):
    m = bad[form]["mism"]
    assert m["y"] == [0] * 8 and m["dx"] == [0] * 8, (form, m)  # forward and dgrad untouched
    # every expert that has tokens (and whose partner has) gets a wrong wgrad; the empty expert 0 stays zero
    wrong = [e for e in range(8) if m["dw"][e] > 0]
    assert wrong == (list(range(8)) if form == "einsum" else list(range(1, 8))), (form, m["dw"])
