"""MaxText's grouped-GEMM MoE path (``sparse_matmul=true``) in emulated NVFP4 (integration/sparse_moe.py).

Tiny qwen3_moe-style model (2 MoE layers, 4 experts, top-2, d=64; benchmarks/model_families.py), CPU:

* bf16 with ``sparse_matmul=true`` runs MaxText's own megablox gmm (the wraps change nothing there);
* nvfp4 (the full recipe, experts only: ``nvfp4_targets=experts``) trains with finite losses that differ
  from bf16, and every expert linear of every layer goes through the emulated per-expert GEMM (traced with
  nvfp4 fprop/dgrad/wgrad recipes), never through MaxText's kernel;
* the sparse path equals the einsum path (``sparse_matmul=false`` with a capacity that drops nothing) bit
  for bit, losses of every step, with round-to-nearest and no RHT (``nvfp4_stochastic_rounding=false``,
  ``nvfp4_rht=false``) and with the full recipe: with one sequence per device, expert ``e``'s tokens sit in rows
  ``[0, m_e)`` of its GEMM in both layouts and in the same (token, k) order (MaxText's stable argsort vs
  the capacity cumsum), so the per-expert amaxes, the 1x16 blocks along the tokens (wgrad, RHT16) and even
  the stochastic-rounding bits (a hash of key, row and column) coincide; only the zero padding differs;
* the plan holds on the sparse path: a kept first layer's experts run MaxText's own kernel (bf16), the
  others the emulation, with the late switch's recipe;
* the configurations that cannot be intercepted are refused with one line (config time, exit code 2).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxtext_nvfp4
from maxtext_nvfp4.core import gemm
from maxtext_nvfp4.core import grouped_gemm
from maxtext_nvfp4.core import settings as settings_lib
from maxtext_nvfp4.integration import moe_refusals
from maxtext_nvfp4.integration import traced
from maxtext_nvfp4.integration import sparse_moe
from maxtext_nvfp4.integration import touchpoints
from maxtext_nvfp4.integration.maxtext_versions import v0_2_5
from maxtext_helpers import losses

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import model_families  # noqa: E402  pylint: disable=wrong-import-position

MAXTEXT = v0_2_5.ADAPTER  # the grouped-GEMM call order the sparse path is given
maxtext_nvfp4.register()  # MaxText accepts quantization=nvfp4 (importing the package registers nothing)

pytestmark = pytest.mark.slow

STEPS = 2  # step 1 follows an update: forward, backward and the optimizer all feed the compared losses
FAMILY = "qwen3_moe"
NVFP4 = ("nvfp4", "nvfp4", "nvfp4")
EXPERTS = ("expert_wi_0", "expert_wi_1", "expert_wo")
# capacity = ceil(32 tokens * top-2 / 4 experts) * 2 = 32 >= any expert's group: the einsum path drops nothing
NO_DROP = {"capacity_factor": 2}
# Only the experts in NVFP4: a loss that differs from bf16 can then only come from them (attention and the
# other projections are covered elsewhere; this also halves the compile time).
EXPERTS_ONLY = {"nvfp4_targets": "experts", **NO_DROP}
# How many times one run traces the train step (the installed MaxText's fact): counts below are per trace.
TRACES = touchpoints.adapter().train_step_traces_per_run


def _train(out, name, quantization_name, **extra):
  from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel

  traced.traced_gemms(reset=True)
  sparse_moe.gmm_calls(reset=True)
  argv = model_families.family_argv(FAMILY, out, quantization_name, steps=extra.pop("steps", STEPS), **extra)
  argv = [a for a in argv if not str(a).startswith(("run_name=", "metrics_file="))]
  argv += [f"run_name={name}", f"metrics_file={os.path.join(out, name + '.jsonl')}"]
  t0 = time.monotonic()
  train.main(argv)
  return {"losses": losses(os.path.join(out, name + ".jsonl")), "traced": traced.traced_gemms(reset=True),
          "gmm": sparse_moe.gmm_calls(reset=True), "seconds": round(time.monotonic() - t0, 1)}


def _refusal_cli(out):
  """``python -m maxtext_nvfp4.train`` with the ragged_dot path (megablox=false): started first, collected last."""
  argv = model_families.family_argv(FAMILY, out, "nvfp4", sparse_matmul=True, megablox=False,
                                    skip_jax_distributed_system=True)[1:]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_LOG_COMPILES": "1"}
  cmd = [sys.executable, "-m", "maxtext_nvfp4.train", *argv]
  return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # pylint: disable=consider-using-with


# The runs, each started on first use (the support-matrix stage selects only some of the tests below): name ->
# (quantization, the run's keys).
_RUNS = {
    "bf16": ("", dict(sparse_matmul=True, **NO_DROP)),
    "sparse": ("nvfp4", dict(sparse_matmul=True, **EXPERTS_ONLY)),
    "einsum": ("nvfp4", dict(sparse_matmul=False, **EXPERTS_ONLY)),
    # layer 0 kept in bf16 (MaxText's kernel); layer 1 nvfp4, every pass bf16 from step 1 on
    "plan": ("nvfp4", dict(sparse_matmul=True, steps=2, nvfp4_keep_first_layers=1, nvfp4_switch_at_step=1,
                           nvfp4_switch_scope="all", **EXPERTS_ONLY)),
}


class _LazyRuns(dict):
  """``runs[name]`` trains run ``name`` of :data:`_RUNS` the first time it is asked for; ``runs["cli"]`` collects
  the refusal process started with the fixture."""

  def __init__(self, out, cli):
    super().__init__()
    self.out, self.cli = out, cli

  def __missing__(self, name):
    if name == "cli":
      stdout, stderr = self.cli.communicate(timeout=600)
      self[name] = {"rc": self.cli.returncode, "stdout": stdout, "stderr": stderr}
    else:
      quantization, extra = _RUNS[name]
      self[name] = _train(self.out, name, quantization, **extra)
    return self[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("sparse"))
  r = _LazyRuns(out, _refusal_cli(out))  # the refusal process runs beside the first training run
  yield r
  if r.cli.poll() is None:
    r.cli.kill()
    r.cli.communicate()
  print("\nsparse MoE runs (s):", {k: v["seconds"] for k, v in r.items() if "seconds" in v},
        "\nstep losses:", {k: v["losses"] for k, v in r.items() if "losses" in v})


def test_bf16_sparse_runs_maxtexts_own_grouped_gemm(runs):
  b = runs["bf16"]
  assert sorted(b["losses"]) == list(range(STEPS)) and np.isfinite(list(b["losses"].values())).all()
  assert not b["traced"]  # never our quantizer
  assert b["gmm"]["emulated"] == 0 and b["gmm"]["maxtext"] == 6 * TRACES  # 2 layers x (wi_0, wi_1, wo)


def test_sparse_nvfp4_trains_with_every_expert_gemm_through_the_quantizer(runs):
  s, b = runs["sparse"], runs["bf16"]
  assert sorted(s["losses"]) == list(range(STEPS)) and np.isfinite(list(s["losses"].values())).all()
  assert all(s["losses"][k] != b["losses"][k] for k in range(STEPS)), (s["losses"], b["losses"])
  # every expert linear of both MoE layers (and nothing else: nvfp4_targets=experts), traced once, with all
  # three passes in NVFP4 ...
  assert {(l, r): before for l, r, before, _ in s["traced"]} == {(l, r): NVFP4 for l in (0, 1) for r in EXPERTS}
  assert all(n == TRACES for n in s["traced"].values()), s["traced"]
  # ... and no grouped GEMM left to MaxText's (unquantized) kernel
  assert s["gmm"]["emulated"] == 6 * TRACES and s["gmm"]["maxtext"] == 0, s["gmm"]
  assert not any(r == "router" for _, r, _, _ in s["traced"])  # the router stays plain bf16


def test_sparse_path_equals_the_einsum_path_bit_for_bit(runs):
  """Same per-expert quantization on both MoE paths (see the module docstring), forward and backward: every
  step's loss is identical with the full recipe (SR and RHT on; it also held with both off -- the RNE pair
  was dropped from the suite for time, the full recipe exercising the same GEMMs plus RHT and SR keys)."""
  sparse, einsum = "sparse", "einsum"
  s, e = runs[sparse]["losses"], runs[einsum]["losses"]
  assert s == e, (s, e)
  assert runs[sparse]["gmm"] == {"emulated": 6 * TRACES}  # the sparse run took the emulated grouped GEMM ...
  # ... and the einsum run the einsum path, with the same expert plan
  assert runs[einsum]["gmm"] == {} and {(l, r) for l, r, _, _ in runs[einsum]["traced"]} == {
      (l, r) for l in (0, 1) for r in EXPERTS}
  # NVFP4 really happened on both (the bf16 run's losses are others)
  assert all(s[k] != runs["bf16"]["losses"][k] for k in s)


def test_plan_keep_first_layer_and_late_switch_on_the_sparse_path(runs):
  p = runs["plan"]
  assert sorted(p["losses"]) == [0, 1] and np.isfinite(list(p["losses"].values())).all()
  traced = {(l, r): (before, after) for l, r, before, after in p["traced"]}
  # layer 0 kept (bf16: MaxText's own kernel, not traced); layer 1 nvfp4, all passes bf16 after the switch
  assert traced == {(1, r): (NVFP4, ("bf16", "bf16", "bf16")) for r in EXPERTS}, p["traced"]
  assert p["gmm"]["maxtext"] == 3 * TRACES and p["gmm"]["emulated"] == 3 * TRACES, p["gmm"]
  assert p["losses"][0] != runs["sparse"]["losses"][0]  # layer 0's experts really ran unquantized


def test_ragged_dot_path_is_refused_at_start_up_in_one_line(runs):
  r = runs["cli"]
  assert r["rc"] == 2, r["stderr"][-3000:]
  lines = [ln for ln in r["stderr"].splitlines() if ln.strip()]
  assert "quantization=nvfp4 with sparse_matmul=true and megablox=false" in lines[-1], lines[-1]  # refused before MaxText starts (tools/train) or by the plugin
  assert "set megablox=true" in lines[-1] and "Traceback" not in r["stdout"] + r["stderr"]
  assert "Compiling" not in r["stdout"] + r["stderr"] and "completed step" not in r["stdout"]


# ---------------------------------------------------------------------------------------------------
# Without MaxText runs
# ---------------------------------------------------------------------------------------------------


def test_touched_maxtext_symbols_exist_and_are_wrapped():
  from maxtext.kernels import megablox  # pylint: disable=import-outside-toplevel
  from maxtext.layers import moe  # pylint: disable=import-outside-toplevel

  assert touchpoints.missing("maxtext.layers.moe", moe) == []
  assert touchpoints.missing("maxtext.kernels.megablox", megablox) == []
  assert getattr(moe.RoutedMoE.sparse_matmul, "_maxtext_nvfp4_wrapped", None) is not None
  assert getattr(megablox.gmm, "_maxtext_nvfp4_wrapped", None) is not None


def _gemm(role, recipe):
  return sparse_moe.ExpertGemm(layer=0, role=role, recipe=recipe)


def test_fused_up_projection_is_each_experts_two_own_gemms():
  """prefuse_moe_weights: one gmm of [wi_0 | wi_1] is split back into the two linears, each expert's half
  its own NVFP4 tensor (own amax), bit for bit the two separate grouped GEMMs, forward and both gradients."""
  rne = gemm.GemmRecipe(stochastic_rounding=False)
  sizes = jnp.asarray((17, 0, 3, 16), jnp.int32)
  kx, k0, k1, kd = jax.random.split(jax.random.key(3), 4)
  x = jax.random.normal(kx, (40, 32)).astype(jnp.bfloat16)
  w0 = jax.random.normal(k0, (4, 32, 16)).astype(jnp.bfloat16)
  w1 = (jax.random.normal(k1, (4, 32, 16)) * 64).astype(jnp.bfloat16)  # scales apart: a shared amax would show
  dy = jax.random.normal(kd, (40, 32)).astype(jnp.bfloat16)
  gemms = [_gemm("expert_wi_0", rne), _gemm("expert_wi_1", rne)]

  def vjp(fn, *args):
    y, pull = jax.vjp(fn, *args)
    return (y,) + pull(dy)

  @jax.jit  # one compile for all three (eager, every quantizer op would compile on its own)
  def run(x, w0, w1):
    fused = vjp(lambda a, b, c: sparse_moe._emulated(  # pylint: disable=protected-access
        gemms, a, jnp.concatenate([b, c], -1), sizes, jnp.bfloat16), x, w0, w1)
    apart = vjp(lambda a, b, c: jnp.concatenate(
        [grouped_gemm.ragged_dot(a, b, sizes, recipe=rne, preferred_element_type=jnp.bfloat16),
         grouped_gemm.ragged_dot(a, c, sizes, recipe=rne, preferred_element_type=jnp.bfloat16)], -1), x, w0, w1)
    one = grouped_gemm.ragged_dot(x, jnp.concatenate([w0, w1], -1), sizes, recipe=rne,
                                  preferred_element_type=jnp.bfloat16)
    return fused, apart, one

  fused, apart, one = run(x, w0, w1)
  for name, f, a in zip(("y", "dx", "dw0", "dw1"), fused, apart):
    np.testing.assert_array_equal(np.asarray(f, np.float32), np.asarray(a, np.float32), err_msg=name)
  # one NVFP4 tensor for both halves (a shared amax per expert) would quantize w0 differently
  assert not np.array_equal(np.asarray(fused[0], np.float32), np.asarray(one, np.float32))


def test_gmm_calls_map_to_the_expert_linears_in_order():
  call = sparse_moe._Call(gemms={}, cycle=MAXTEXT.gmm_call_order)  # pylint: disable=protected-access
  assert [call.next_linears() for _ in range(4)] == [("expert_wi_0",), ("expert_wi_1",), ("expert_wo",),
                                                     ("expert_wi_0",)]
  call = sparse_moe._Call(gemms={}, cycle=MAXTEXT.gmm_call_order_fused)  # pylint: disable=protected-access
  assert [call.next_linears() for _ in range(3)] == [("expert_wi_0", "expert_wi_1"), ("expert_wo",),
                                                     ("expert_wi_0", "expert_wi_1")]


def _cfg(**kw):
  base = dict(num_decoder_layers=2, num_experts=4, decoder_block="qwen3_moe", sparse_matmul=True, megablox=True,
              use_tokamax_gmm=False, use_ring_of_experts=False, te_moe_block=False, use_batch_split_schedule=False,
              ici_expert_parallelism=1, dcn_expert_parallelism=1)
  return types.SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("overrides, devices, words", [
    ({"megablox": False}, 1, ["sparse_matmul=true and megablox=false", "jax.lax.ragged_dot", "set megablox=true"]),
    ({"use_ring_of_experts": True}, 1, ["use_ring_of_experts=true", "set use_ring_of_experts=false"]),
    ({"te_moe_block": True}, 1, ["te_moe_block=true", "set te_moe_block=false"]),
    ({"use_batch_split_schedule": True}, 1, ["use_batch_split_schedule=true", "set use_batch_split_schedule=false"]),
    ({"amax_scope": "global"}, 2, ["nvfp4_amax_scope=global on 2 devices", "set nvfp4_amax_scope=te"]),
    ({"ici_expert_parallelism": 2}, 2, ["expert parallelism (ici_expert_parallelism=2, dcn_expert_parallelism=1)",
                                        "not verified", "set ici_expert_parallelism=1"]),
])
def test_unsupported_moe_configs_are_refused_in_one_line(overrides, devices, words):
  s = settings_lib.Nvfp4Settings(amax_scope=overrides.pop("amax_scope", "te"))
  with pytest.raises(settings_lib.SettingsError) as e:
    moe_refusals.check_model(_cfg(**overrides), s, "emulate", num_devices=devices)
  msg = str(e.value)
  assert "\n" not in msg and all(w in msg for w in words), msg


def test_supported_sparse_configs_pass():
  s = settings_lib.Nvfp4Settings()
  moe_refusals.check_model(_cfg(), s, "emulate", num_devices=8)  # megablox (MaxText's default), te scope
  moe_refusals.check_model(_cfg(ici_expert_parallelism=-1), s, "emulate", num_devices=None)  # seen on the mesh
  moe_refusals.check_model(_cfg(megablox=False, use_tokamax_gmm=True), s, "emulate", num_devices=1)  # tokamax gmm
  moe_refusals.check_model(_cfg(), settings_lib.Nvfp4Settings(amax_scope="global"), "emulate", num_devices=1)
  moe_refusals.check_model(_cfg(), settings_lib.Nvfp4Settings(amax_scope="global"), "emulate", num_devices=None)
  # experts out of the plan (bf16 fallback): MaxText's grouped GEMM may run as it likes
  moe_refusals.check_model(_cfg(megablox=False, use_ring_of_experts=True), settings_lib.Nvfp4Settings(
      targets="attention"), "emulate", num_devices=8)
  with pytest.raises(settings_lib.SettingsError, match="nvfp4_backend=te cannot run the MoE expert GEMMs"):
    moe_refusals.check_model(_cfg(), s, "te")


def test_expert_parallel_mesh_is_refused_when_the_layer_is_traced():
  """ici_expert_parallelism=-1 resolves on the mesh: the wrap refuses it before MaxText's sparse_matmul runs."""
  from maxtext.layers import moe  # pylint: disable=import-outside-toplevel

  rne = gemm.GemmRecipe(stochastic_rounding=False)
  quant = types.SimpleNamespace(expert_gemms=lambda: tuple(_gemm(r, rne) for r in EXPERTS))
  layer = types.SimpleNamespace(quant=quant, get_expert_parallelism_size=lambda: 4,
                                config=types.SimpleNamespace(prefuse_moe_weights=False))
  with pytest.raises(settings_lib.SettingsError, match=r"expert parallelism \(4 expert shards on the mesh\)"):
    moe.RoutedMoE.sparse_matmul(layer, None, None, None, None, None, None, None, None, None)
