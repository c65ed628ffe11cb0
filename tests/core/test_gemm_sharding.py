"""The emulated GEMM under FSDP x TP sharding (8 host devices), for both values of nvfp4_amax_scope.

Runs in a subprocess (one for both scripts) because the host device count must be set before JAX initializes.
``global`` (no amax groups): bit-identical to one device, the amax of every operand is the tensor's.
``te`` (TE's scopes, core/amax_scope.py): bit-identical to an independent per-shard reference.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from maxtext_nvfp4.core import gemm

    assert jax.device_count() == 8, jax.devices()
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tp"))
    # The full recipe: stochastic rounding of the gradients (keys from threefry are sharding-invariant), RHT and
    # 2D weights on; fprop's x and W round to nearest. Round-to-nearest gradients under the same sharding are the
    # second script's (against a per-shard reference).
    for sr in (True,):
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

      # operands from numpy (jax.random would compile a sampler per shape); bf16 casts round to nearest even
      rng = np.random.default_rng(0)
      normal = lambda shape, scale=1.0: jnp.asarray((rng.standard_normal(shape, np.float32) * np.float32(scale)).astype(jnp.bfloat16))
      x, wi, wo, wq, dy = normal((b, s, e)), normal((e, f), 0.1), normal((f, e), 0.1), normal((h, d, e), 0.1), normal((b, s, e))
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
      if sr:  # fprop rounds to nearest in this recipe too
        fprop = jax.jit(lambda x: gemm.dot_general(x, wi, (((2,), (0,)), ((), ())), recipe=recipe, key=key))
        x_ps = x.at[:2].multiply(7.3)  # not a power of two: the other shards' scales must move
        per_shard = jnp.concatenate([fprop(x_ps[i * 2 : (i + 1) * 2]) for i in range(4)])
        per_shard_differs = bool(np.any(np.asarray(per_shard[2:] != fprop(x_ps)[2:])))
      print("RESULT" + json.dumps(dict(sr=sr, mismatches=mism, sizes=[int(np.size(a)) for a in leaves_ref],
                                       n_shards=n_shards, per_shard_differs=per_shard_differs,
                                       finite=[bool(np.all(np.isfinite(np.asarray(a, np.float32)))) for a in leaves_ref])))
    """
)


@pytest.fixture(scope="module")
def outputs():
  """The stdout of both scripts, run one after the other in ONE 8-device subprocess (one JAX start-up)."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
  env["JAX_PLATFORMS"] = "cpu"
  both = "import sys\nexec(sys.argv[1], {'__name__': 'global_scope'})\nexec(sys.argv[2], {'__name__': 'te_scope'})\n"
  proc = subprocess.run([sys.executable, "-c", both, _SCRIPT, _TE_SCOPE_SCRIPT], env=env, capture_output=True,
                        text=True, timeout=1200)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return proc.stdout


def test_fsdp_tp_sharded_gemm_is_bit_identical_to_single_device(outputs):
  """The full recipe (SR gradients): outputs and all gradients bit for bit."""
  results = [json.loads(l[len("RESULT") :]) for l in outputs.splitlines() if l.startswith("RESULT")]
  assert [r["sr"] for r in results] == [True]
  for res in results:
    assert res["n_shards"] == [8, 8, 8, 8, 8]  # really distributed over all 8 devices
    assert all(res["finite"]) and len(res["mismatches"]) == 7  # 3 outputs + 4 gradients
    assert res["mismatches"] == [0] * 7, res
  assert results[0]["per_shard_differs"]  # the check can see a per-shard amax


# ---------------------------------------------------------------------------------------------------
# nvfp4_amax_scope=te: TE's per-device / per-TP-shard amaxes, against an independent per-shard reference.
# ---------------------------------------------------------------------------------------------------
_TE_SCOPE_SCRIPT = textwrap.dedent(
    """
    import json, re
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from maxtext_nvfp4.core import amax_scope, gemm
    from maxtext_nvfp4.core import nvfp4 as nv

    assert jax.device_count() == 8, jax.devices()
    recipe = gemm.GemmRecipe(stochastic_rounding=False)  # the RNE path: bit-checkable
    b, s, e, f, h, d = 8, 32, 64, 128, 4, 32
    F32 = jnp.float32

    def blocks(a, gr, gc):
      r, c = a.shape
      return {(i, j): a[i * r // gr:(i + 1) * r // gr, j * c // gc:(j + 1) * c // gc] for i in range(gr) for j in range(gc)}

    def ref_product(A, ga, B, gb, shape, out_dtype):
      # A[(i, c)] = (values, amax) of a's block; B[(c, j)] likewise: each block quantized ALONE. The product of
      # rows i and columns j sums, over contraction groups, bf16(acc * alpha) partials in group order.
      (m, k), n = shape, None
      gm, gka = ga
      gkb, gn = gb
      n = sum(B[(0, j)][0].shape[1] for j in range(gn))
      gk = max(gka, gkb)
      out = np.zeros((m, n), np.float32)
      for i in range(gm):
        for j in range(gn):
          total = None
          for g in range(gk):
            ca, cb = g * gka // gk, g * gkb // gk
            (av, aam), (bv, bam) = A[(i, ca)], B[(cb, j)]
            wa, wb = k // gka, k // gkb
            k0, k1 = g * k // gk, (g + 1) * k // gk
            acc = jnp.dot(av[:, k0 - ca * wa:k1 - ca * wa], bv[k0 - cb * wb:k1 - cb * wb], preferred_element_type=F32)
            p = (acc * gemm.gemm_alpha(aam, bam)).astype(out_dtype)
            total = p if total is None else (total + p).astype(out_dtype)
          rm, cn = m // gm, n // gn
          out[i * rm:(i + 1) * rm, j * cn:(j + 1) * cn] = np.asarray(total.astype(F32))
      return out

    def qv(a, **kw):
      return nv.quantize_values(a, **kw)

    def qt(a, **kw):
      t = nv.quantize(a, **kw)
      return nv.block_values(t), t.amax

    def reference(x2, w2, dy2, G):
      # fprop: x blocks 1x16 along K; W blocks 16x16 (2D), each block alone.
      X = {key: qv(v, axis=1) for key, v in blocks(x2, G.tokens, G.x_k).items()}
      W = {key: qt(v, block_2d=True) for key, v in blocks(w2, G.w_k, G.w_n).items()}
      y = ref_product(X, (G.tokens, G.x_k), W, (G.w_k, G.w_n), x2.shape, jnp.bfloat16)
      # dgrad: dy blocks 1x16 along N; the same W blocks, transposed.
      DY = {key: qv(v, axis=1) for key, v in blocks(dy2, G.tokens, G.dy_n).items()}
      WT = {(j, i): (v.T, a) for (i, j), (v, a) in W.items()}
      dx = ref_product(DY, (G.tokens, G.dy_n), WT, (G.w_n, G.w_k), dy2.shape, jnp.bfloat16)
      # wgrad: x and dy blocks 1x16 along tokens with RHT, each block alone; partials over token groups.
      XT = {(j, i): (v.T, a) for (i, j), (v, a) in {key: qt(v, axis=0, rht=True)
                                                    for key, v in blocks(x2, G.tokens, G.x_k).items()}.items()}
      DYT = {key: qv(v, axis=0, rht=True) for key, v in blocks(dy2, G.tokens, G.dy_n).items()}
      dw = ref_product(XT, (G.x_k, G.tokens), DYT, (G.tokens, G.dy_n), (x2.shape[1], x2.shape[0]), w2.dtype)
      return y, dx, dw

    def bits(a):
      return np.asarray(a, np.float32).view(np.uint32)

    def collectives(hlo):
      ops = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
      return {op: len(re.findall(r"= [^ ]+ " + op + r"[(.]", hlo)) for op in ops}

    # (name, lhs shape, contracting dims of lhs, kernel shape, kernel spec axes, lhs spec, logical sharding)
    cases = [
        ("mlp_in", (b, s, e), (f,), lambda m: (P(m["batch"], None, None), P("fsdp", "tp"))),
        ("mlp_out", (b, s, f), (e,), lambda m: (P(m["batch"], None, "tp"), P("tp", "fsdp"))),
        ("attn_out", (b, s, h, d), (e,), lambda m: (P(m["batch"], None, None, None), P("tp", None, "fsdp"))),
    ]
    results = []
    # (data=2, fsdp=2, tp=2): the attention out-projection only. Its MLP cases have the same amax groups as on
    # (fsdp=4, tp=2) (x: 4 token groups from data x fsdp instead of fsdp; W's fsdp is gathered, as there), so
    # they would repeat those checks; the data axis's token groups are checked by attn_out.
    for mesh_shape, case_names in (({"fsdp": 4, "tp": 2}, ("mlp_in", "mlp_out", "attn_out")),
                                   ({"data": 2, "fsdp": 2, "tp": 2}, ("attn_out",))):
      names = tuple(mesh_shape)
      mesh = Mesh(np.array(jax.devices()).reshape(tuple(mesh_shape.values())), names)
      batch = tuple(n for n in names if n in ("data", "fsdp"))
      for ci, (name, xshape, nshape, specs) in enumerate(cases):
        if name not in case_names:
          continue
        x_spec, w_spec = specs({"batch": batch})
        kdims = xshape[2:]
        wshape = kdims + nshape
        # Operands from numpy (jax.random would compile a sampler per shape; bf16 casts round to nearest even).
        # Rows and columns with very different magnitudes: every shard's amax differs.
        rng = np.random.default_rng(ci)
        normal = lambda shape: rng.standard_normal(shape, np.float32)
        bf16 = lambda a: jnp.asarray(np.asarray(a, np.float32).astype(jnp.bfloat16))
        x = bf16(normal(xshape) * np.exp(normal(xshape[:1] + (1,) * (len(xshape) - 1))))
        w = bf16(normal(wshape) * np.linspace(0.02, 0.3, wshape[-1], dtype=np.float32))
        dy = bf16(normal(xshape[:2] + nshape))
        nk = len(kdims)
        G = amax_scope.amax_groups(mesh={"fsdp": mesh_shape["fsdp"], "tp": mesh_shape["tp"], "data": mesh_shape.get("data", 1)},
                                   x_rows=[x_spec[0], x_spec[1]], x_k=list(x_spec[2:]), w_k=list(w_spec[:nk]),
                                   w_n=list(w_spec[nk:]))
        dn = (tuple(range(2, 2 + nk)), tuple(range(nk))), ((), ())

        def vjp(x, w, dy, groups):
          fn = lambda x, w: gemm.dot_general(x, w, dn, recipe=recipe, amax_groups=groups)
          y, back = jax.vjp(fn, x, w)
          return (y, *back(dy))

        shard = [NamedSharding(mesh, x_spec), NamedSharding(mesh, w_spec), NamedSharding(mesh, P(x_spec[0], None, None))]
        args = [jax.device_put(a, sh) for a, sh in zip((x, w, dy), shard)]
        # compiled once each: the executable gives the results and the HLO whose collectives are counted
        # under the mesh, as MaxText traces its step: the token groups' placement constraints apply
        with jax.set_mesh(mesh):
          te_fn = jax.jit(lambda x, w, dy: vjp(x, w, dy, G), in_shardings=shard).lower(*args).compile()
        glob_fn = jax.jit(lambda x, w, dy: vjp(x, w, dy, None), in_shardings=shard).lower(*args).compile()
        te = jax.device_get(te_fn(*args))
        te_one = jax.device_get(jax.jit(lambda x, w, dy: vjp(x, w, dy, G))(x, w, dy))
        glob = jax.device_get(glob_fn(*args))
        m = b * s
        ry, rdx, rdw = reference(x.reshape(m, -1), w.reshape(int(np.prod(kdims)), -1), dy.reshape(m, -1), G)
        want = (ry.reshape(te[0].shape), rdx.reshape(te[1].shape), rdw.reshape(te[2].shape))
        results.append(dict(
            mesh=mesh_shape, case=name, groups=amax_scope.describe(G),
            n_shards=[len(a.addressable_shards) for a in args],
            mismatch_ref=[int(np.sum(bits(a) != bits(r))) for a, r in zip(te, want)],
            mismatch_one_device=[int(np.sum(bits(a) != bits(r))) for a, r in zip(te, te_one)],
            differs_from_global=[bool(np.any(bits(a) != bits(r))) for a, r in zip(te, glob)],
            collectives={k: collectives(fn.as_text()) for k, fn in (("te", te_fn), ("global", glob_fn))},
            # additions of partial products over sharded contractions (wgrad, fprop, dgrad)
            partial_adds=(G.tokens - 1) + (max(G.x_k, G.w_k) - 1) + (max(G.dy_n, G.w_n) - 1),
        ))
    print("TE_RESULT" + json.dumps(results))
    """
)


def test_te_amax_scope_equals_per_shard_reference_on_fsdp_tp_meshes(outputs):
  """(fsdp=4, tp=2) and (data=2, fsdp=2, tp=2) (there the out-projection only), MaxText-style shardings of
  x (B, S, E), W (E, F), W (F, E) and the attention out-projection W (H, D, E): y, dx and dW with TE's scopes are bit-identical to quantizing
  each shard alone and assembling as TE does (RNE path), the same on one device, and differ from global;
  the compiled sharded program communicates no more than global's (fewer all-reduces: local amaxes)."""
  results = json.loads(next(l for l in outputs.splitlines() if l.startswith("TE_RESULT"))[len("TE_RESULT"):])
  assert len(results) == 4
  groups = {(tuple(r["mesh"]), r["case"]): r["groups"] for r in results}
  assert groups[(("fsdp", "tp"), "mlp_in")] == "x: 4x1, W: 1x2, dy: 4x2"
  assert groups[(("fsdp", "tp"), "mlp_out")] == "x: 4x2, W: 2x1, dy: 4x1"
  assert groups[(("data", "fsdp", "tp"), "attn_out")] == "x: 4x1, W: 2x1, dy: 4x1"
  # The MLP cases on (data=2, fsdp=2, tp=2) are not run: their amax groups are (fsdp=4, tp=2)'s.
  from maxtext_nvfp4.core import amax_scope  # pylint: disable=import-outside-toplevel

  mesh2, batch = {"data": 2, "fsdp": 2, "tp": 2}, ("data", "fsdp")
  for name, x_k, w_k, w_n in (("mlp_in", [None], ["fsdp"], ["tp"]), ("mlp_out", ["tp"], ["tp"], ["fsdp"])):
    g = amax_scope.amax_groups(mesh=mesh2, x_rows=[batch, None], x_k=x_k, w_k=w_k, w_n=w_n)
    assert amax_scope.describe(g) == groups[(("fsdp", "tp"), name)], name
  for r in results:
    assert r["n_shards"] == [8, 8, 8], r
    assert r["mismatch_ref"] == [0, 0, 0], r
    assert r["mismatch_one_device"] == [0, 0, 0], r
    assert all(r["differs_from_global"]), r  # the scopes really change the numerics
    # No communication where TE has none: the local amaxes need no all-reduce (global needs one per
    # quantized operand), nothing is gathered beyond what global gathers, and the only extra traffic is
    # one collective-permute per partial-product addition (TE's psum of a sharded contraction).
    te, glob = r["collectives"]["te"], r["collectives"]["global"]
    assert te["all-reduce"] < glob["all-reduce"], r
    for op in ("all-gather", "reduce-scatter", "all-to-all"):
      assert te[op] <= glob[op], (op, r)
    assert te["collective-permute"] <= r["partial_adds"], r
