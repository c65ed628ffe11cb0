"""The FSDP all-gather of NVFP4 weights in FP4 (core/weight_gather.py) on 8 host CPU devices.

One subprocess (the host device count is set before JAX starts) runs a small model -- an MLP in-projection, an
attention-style out-projection contracting two dims, and MoE expert einsums with the experts over the expert
axis -- forward and backward with and without ``weight_gather``: FSDP 8 with the ``global`` amax scope, FSDP 4 x
TP 2 with TE's (``te``: W's amax per tensor-parallel shard, x's and dy's per device), expert 2 x FSDP 4 (one amax
per expert, the only scope of the expert GEMMs). It reports:

* the loss and every gradient, bit for bit, with the gather on and off;
* the compiled program's all-gathers by dtype: with the gather on, the weights cross as ``u8`` (codes two per
  byte + one E4M3 byte per 16x16 tile), pinned to the byte, and no weight-sized float all-gather is left;
* two mutations the equality check must see: each FSDP shard quantized with its own amax (not TE's
  FSDP-reduced one), and a layout whose shard boundaries cut 16x16 tiles (24 rows per shard) quantized per shard.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks", "gpu")

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, BENCH)
    from collectives import collective_bytes
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from maxtext_nvfp4.core import amax_scope, gemm, grouped_gemm, weight_gather as wgl
    from maxtext_nvfp4.core import nvfp4 as nv

    assert jax.device_count() == 8, jax.devices()
    recipe = gemm.GemmRecipe()  # TE's standard recipe: 2D weights, RHT, stochastic rounding (keys fixed)
    key = jax.random.key(7)
    b, s, e, f, h, d = 8, 16, 128, 256, 4, 32
    rng = np.random.default_rng(0)
    bf16 = lambda shape, scale=1.0: jnp.asarray((rng.standard_normal(shape, np.float32) * np.float32(scale)).astype(jnp.bfloat16))
    x0, wi0, wq0, dy0 = bf16((b, s, e)), bf16((e, h * d), 0.1), bf16((h, d, e), 0.1), bf16((b, s, e))
    # MoE: 4 experts, capacity 16 (EBCM / EMH / EHM)
    ne, cap = 4, 16
    xe0, we_in0, we_out0, dye0 = bf16((ne, b, cap, e)), bf16((ne, e, f), 0.1), bf16((ne, f, e), 0.1), bf16((ne, b, cap, e))

    def bits(a):
      return np.asarray(a, np.float32).view(np.uint32)

    def compare(fn, args, shardings, with_gather, without):
      res = {}
      for name, extra in (("on", with_gather), ("off", without)):
        c = jax.jit(lambda *a: fn(*a, **extra), in_shardings=shardings).lower(*args).compile()
        res[name] = (jax.device_get(c(*[jax.device_put(a, sh) for a, sh in zip(args, shardings)])),
                     collective_bytes(c.as_text())["all_gather"])
      on, off = (jax.tree_util.tree_leaves(res[k][0]) for k in ("on", "off"))
      mism = [int(np.sum(bits(a) != bits(b_))) for a, b_ in zip(on, off)]
      finite = all(bool(np.all(np.isfinite(np.asarray(a, np.float32)))) for a in on)
      return dict(mismatches=mism, finite=finite, on=res["on"][1], off=res["off"][1])

    # ---------------- dense: MLP in (E, F), attention out (H, D, E) contracting (H, D) ----------------
    def dense_case(mesh, scope):
      names = mesh.axis_names
      tp = "tensor" if "tensor" in names else None
      sizes = dict(mesh.shape)
      x_spec = P("fsdp", None, None)
      w_specs = {"wi": P("fsdp", tp), "wq": P(tp, None, "fsdp")}
      # (x's token spec, x's K spec, W's K spec, W's N spec) of each GEMM, for TE's amax groups
      layout = {"wi": ([None], ["fsdp"], [tp]), "wq": ([tp, None], [tp, None], ["fsdp"])}
      groups = {}
      for k, (xk, wk, wn) in layout.items():
        groups[k] = None if scope == "global" else amax_scope.amax_groups(
            mesh=sizes, x_rows=["fsdp", None], x_k=xk, w_k=wk, w_n=wn)
      tp_t = (tp,) if tp else ()
      gathers = {"wi": wgl.WeightGather(mesh=mesh, k_gathered=("fsdp",), n_kept=tp_t),
                 "wq": wgl.WeightGather(mesh=mesh, k_kept=tp_t, n_gathered=("fsdp",))}

      def fn(x, wi, wq, dy, gather):
        def loss(x, wi, wq):
          g = lambda k: gather[k] if gather else None
          hdn = gemm.dot_general(x, wi, (((2,), (0,)), ((), ())), recipe=recipe, key=key, amax_groups=groups["wi"],
                                 weight_gather=g("wi"))
          att = gemm.dot_general(hdn.reshape(b, s, h, d), wq, (((2, 3), (0, 1)), ((), ())), recipe=recipe, key=key,
                                 amax_groups=groups["wq"], weight_gather=g("wq"))
          return jnp.sum((att * dy).astype(jnp.float32))
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(x, wi, wq)

      shardings = [NamedSharding(mesh, sp) for sp in (x_spec, w_specs["wi"], w_specs["wq"], x_spec)]
      r = compare(fn, (x0, wi0, wq0, dy0), shardings, dict(gather=gathers), dict(gather=None))
      # per device, one gather of each weight's kept block: codes (1/2 B) + scales (1/256 B) per weight
      kept = sizes.get("tensor", 1)
      r["expected_u8"] = int(sum(a.size for a in (wi0, wq0)) // kept * (1 / 2 + 1 / 256))
      r["weight_elems"] = int(sum(a.size for a in (wi0, wq0)) // kept)
      return r

    # ---------------- MoE: expert einsums, experts over "expert", their embed dim over "fsdp" ----------------
    def moe_case(mesh):
      wg_in = wgl.WeightGather(mesh=mesh, k_gathered=("fsdp",), batch=("expert",))
      wg_out = wgl.WeightGather(mesh=mesh, n_gathered=("fsdp",), batch=("expert",))

      def fn(xe, wa, wb, dye, gather):
        def loss(xe, wa, wb):
          hdn = grouped_gemm.einsum("EBCM,EMH->EBCH", xe, wa, recipe=recipe, key=key,
                                    weight_gather=wg_in if gather else None)
          y = grouped_gemm.einsum("EBCH,EHM->EBCM", hdn, wb, recipe=recipe, key=key,
                                  weight_gather=wg_out if gather else None)
          return jnp.sum((y * dye).astype(jnp.float32))
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(xe, wa, wb)

      specs = (P("expert", "fsdp", None, None), P("expert", "fsdp", None), P("expert", None, "fsdp"),
               P("expert", "fsdp", None, None))
      r = compare(fn, (xe0, we_in0, we_out0, dye0), [NamedSharding(mesh, sp) for sp in specs],
                  dict(gather=True), dict(gather=False))
      experts_here = ne // mesh.shape["expert"]
      r["expected_u8"] = int((we_in0.size + we_out0.size) // ne * experts_here * (1 / 2 + 1 / 256))
      r["weight_elems"] = int((we_in0.size + we_out0.size) // ne * experts_here)
      return r

    devs = np.array(jax.devices())
    results = {
        "fsdp8_global": dense_case(Mesh(devs.reshape(8), ("fsdp",)), "global"),
        "fsdp4_tp2_te": dense_case(Mesh(devs.reshape(4, 2), ("fsdp", "tensor")), "te"),
        "moe_ep2_fsdp4": moe_case(Mesh(devs.reshape(2, 4), ("expert", "fsdp"))),
    }

    # ---------------- mutations the equality check must see ----------------
    mesh = Mesh(devs.reshape(8), ("fsdp",))
    wg = wgl.WeightGather(mesh=mesh, k_gathered=("fsdp",))
    w = wi0.at[:16].multiply(9.0)  # (128, 128): 16 rows per shard  # the first shard's amax is the tensor's; the others' are smaller
    fprop = lambda qw: gemm._nvfp4_dot(nv.quantize_values(x0.reshape(-1, e), axis=1) + (448,), qw, (1, 0), jnp.bfloat16)
    ref = fprop(gemm._quantize_weight(w, True, 0))

    # (a) a per-shard amax: each shard quantized alone, then the codes and scales gathered
    shards = [gemm._quantize_weight(w[i * 16:(i + 1) * 16], True, 0) for i in range(8)]
    glued = nv.NVFP4Tensor(data=jnp.concatenate([t.data for t in shards]), scale=jnp.concatenate([t.scale for t in shards]),
                           amax=shards[0].amax, block_2d=True)
    amax_differs = float(np.max([float(t.amax) for t in shards[1:]])) < float(shards[0].amax)
    per_shard_differs = bool(np.any(bits(fprop(glued)) != bits(ref))) and amax_differs
    # (b) 24 rows per shard (K = 192 over 8): tiles straddle shard boundaries. refusal() says so, dot_general
    # refuses such a gather, and quantizing each shard alone (zero-padded to whole tiles, the amax right) differs.
    w24 = bf16((192, f), 0.1)
    why = wgl.refusal(wg, 192, f)
    try:
      gemm.dot_general(bf16((16, 192)), w24, (((1,), (0,)), ((), ())), recipe=recipe, key=key, weight_gather=wg)
      raised = None
    except ValueError as err:
      raised = str(err)
    full = gemm._quantize_weight(w24, True, 0)
    # each shard zero-padded to whole tiles plus one tile holding the tensor's amax (so the amax is right)
    cut = [nv.quantize(jnp.pad(w24[i * 24:(i + 1) * 24], ((0, 24), (0, 0))).at[-1, 0].set(jnp.max(jnp.abs(w24))),
                       block_2d=True) for i in range(8)]
    cut_data = jnp.concatenate([t.data[:24] for t in cut]).astype(jnp.float32)
    straddle_differs = bool(np.any(np.asarray(cut_data) != np.asarray(full.data.astype(jnp.float32))))
    results["mutations"] = dict(per_shard_differs=per_shard_differs, straddle_refusal=why, straddle_raised=raised,
                                straddle_differs=straddle_differs)
    print("RESULT" + json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def results():
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
  env["JAX_PLATFORMS"] = "cpu"
  script = f"BENCH = {_BENCH!r}\n" + _SCRIPT
  proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=1200)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT")]
  assert line, proc.stdout[-2000:]
  return json.loads(line[-1][len("RESULT"):])


_CASES = ("fsdp8_global", "fsdp4_tp2_te", "moe_ep2_fsdp4")


@pytest.mark.parametrize("case", _CASES)
def test_losses_and_gradients_bit_identical_with_and_without_the_fp4_gather(results, case):
  r = results[case]
  assert r["finite"] and len(r["mismatches"]) == 4, r  # the loss and every gradient
  assert r["mismatches"] == [0] * len(r["mismatches"]), r


@pytest.mark.parametrize("case", _CASES)
def test_weights_cross_the_network_as_fp4_codes_and_tile_scales(results, case):
  r = results[case]
  # Off: the weights cross in a float type (XLA:CPU gathers the fp32-widened block values), each once per GEMM
  # that reads them at least; on: the u8 bytes of one gather of codes + scales per weight, to the byte
  # (fprop and dgrad read the same gathered tensor), and the float all-gathers shrink by at least the weights.
  assert "u8" not in r["off"], r
  assert r["on"]["u8"] == r["expected_u8"], r
  float_on = sum(v for k, v in r["on"].items() if k != "u8")
  float_off = sum(v for k, v in r["off"].items() if k != "u8")
  assert float_off - float_on >= 4 * r["weight_elems"], r


def test_mutations_are_seen(results):
  m = results["mutations"]
  assert m["per_shard_differs"], m  # a per-shard amax changes the bits: the equality above can fail
  assert m["straddle_refusal"] and "K 192/8" in m["straddle_refusal"], m
  assert m["straddle_raised"] and "weight_gather" in m["straddle_raised"] and "\n" not in m["straddle_raised"], m
  assert m["straddle_differs"], m  # per-shard quantization across cut tiles is not the tensor's quantization
