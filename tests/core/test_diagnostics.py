"""NVFP4 diagnostics: statistics on crafted tensors, the host aggregation, the GEMM hook, MaxText runs.

Crafted tensors use amax = 6, so S_enc = 448 and a block whose max is 6 gets the E4M3 scale 448 with an
encode scale of 1 (to fp32 rounding): E2M1 grid values survive exactly, |v| < 0.25 flushes to 0, a block
whose max is 2**-20 gets s8 = RNE_e4m3(2**-20 * 448 / 6) = 0 (below 2**-10) and dequantizes to 0, a
block of 3s gets s8 = 224 and encodes exactly.
"""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxtext_nvfp4
from maxtext_nvfp4.core import diagnostics as diag
from maxtext_nvfp4.core import gemm
from maxtext_nvfp4.core import plan as plan_lib
from maxtext_nvfp4.integration import linen_gemm
from maxtext_nvfp4.integration import traced
from maxtext_nvfp4.integration import step as step_lib
from maxtext_helpers import read_metrics, tiny_argv

maxtext_nvfp4.register()  # MaxText accepts quantization=nvfp4 (importing the package registers nothing)

TINY = 2.0**-20


def _sums(t, **spec):
  out = jax.jit(lambda a: diag.tensor_sums(a, diag.TensorSpec(**spec)))(jnp.asarray(t, jnp.float32))
  return {k: float(v) for k, v in out.items()}


def _stats(t, **spec):
  return diag.summarize([_sums(t, **spec)])


# ---------------------------------------------------------------------------------------------------
# Crafted tensors
# ---------------------------------------------------------------------------------------------------


def test_1x16_blocks_known_counts_and_error():
  b0 = [6, 4, 3, 2, 1, 0.5, 0.125, -0.125] + [0] * 8  # s8 = 448 (saturated); the two 0.125s flush
  b1 = [TINY] * 16  # s8 = 0 with a non-zero block: all 16 flush
  b2 = [0] * 16  # s8 = 0 but an all-zero block: not an underflowed scale, no element
  b3 = [-6] + [0] * 15  # s8 = 448
  t = np.array([b0 + b1 + b2 + b3], np.float32)  # (1, 64): 4 blocks along the columns
  s = _sums(t, axis=1)
  assert (s["blocks"], s["scale_sat"], s["scale_zero"]) == (4, 2, 1)
  assert (s["nonzero"], s["flushed"]) == (25, 18)
  st = diag.summarize([s])
  assert st["underflow"] == pytest.approx(18 / 25)
  assert st["scale_sat"] == 0.5 and st["scale_zero"] == 0.25
  assert st["amax"] == 6.0
  # Error: only the flushed elements (the other values are on the E2M1 grid at scale 1).
  err2 = 2 * 0.125**2 + 16 * TINY**2
  norm2 = 36 + 16 + 9 + 4 + 1 + 0.25 + 2 * 0.125**2 + 16 * TINY**2 + 36
  assert st["rel_err"] == pytest.approx(math.sqrt(err2 / norm2), rel=1e-5)


def _tiles():
  """(32, 32): tile (0,0) all 6, tile (0,1) all 2**-20, tile (1,0) zeros, tile (1,1) all 3."""
  w = np.zeros((32, 32), np.float32)
  w[:16, :16] = 6
  w[:16, 16:] = TINY
  w[16:, 16:] = 3
  return w


def test_2d_weight_tiles():
  s = _sums(_tiles(), axis=0, block_2d=True)
  assert (s["blocks"], s["scale_sat"], s["scale_zero"]) == (4, 1, 1)
  assert (s["nonzero"], s["flushed"]) == (3 * 256, 256)
  st = diag.summarize([s])
  assert st["underflow"] == pytest.approx(1 / 3)
  assert st["rel_err"] == pytest.approx(math.sqrt(256 * TINY**2 / (256 * (36 + 9 + TINY**2))), rel=1e-4)


def test_weight_1x16_along_k_counts_column_blocks():
  # The same matrix with 1x16 blocks along K (axis 0): 2 x 32 blocks; 16 saturated (the 6s), 16 with a
  # zero scale (the tiny ones), 16 all-zero, 16 of 3s (s8 = 224: neither).
  s = _sums(_tiles(), axis=0)
  assert (s["blocks"], s["scale_sat"], s["scale_zero"]) == (64, 16, 16)
  assert (s["nonzero"], s["flushed"]) == (3 * 256, 256)


def test_dy_rne_ties_flush_and_stochastic_rounding_halves_them():
  # Every block: one 6 (scale 448) and fifteen 0.25 = exactly half of the smallest E2M1 step.
  t = np.full((64, 64), 0.25, np.float32)
  t[:, ::16] = 6
  rne = _stats(t, axis=1)
  assert rne["underflow"] == 15 / 16  # RNE: 0.25 ties to the even 0
  assert rne["scale_sat"] == 1.0 and rne["scale_zero"] == 0.0
  sums = jax.jit(lambda a, k: diag.tensor_sums(a, diag.TensorSpec(axis=1, stochastic=True), k))(
      jnp.asarray(t), jax.random.key(0))
  sr = diag.summarize([{k: float(v) for k, v in sums.items()}])
  # SR: 0.25 -> 0.5 with probability 1/2 (u = rbits/256 >= 1/2); 3840 draws, sd 0.008.
  assert abs(sr["underflow"] - 15 / 16 * 0.5) < 0.04


def test_gaussian_error_is_nvfp4_sized_and_padding_adds_no_block():
  x = np.asarray(jax.random.normal(jax.random.key(1), (32, 40)), np.float32)  # K = 40 -> 3 blocks per row
  s = _sums(x, axis=1)
  assert s["blocks"] == 32 * 3 and s["nonzero"] == 32 * 40
  st = diag.summarize([s])
  assert 0.05 < st["rel_err"] < 0.2  # E2M1 with per-16 E4M3 scales on N(0,1): ~0.1
  assert st["amax"] == pytest.approx(np.abs(x).max())


def test_gemm_matrices_follow_dot_general_layout():
  # MaxText's attention out projection: lhs (B, S, H, D) . kernel (H, D, E), contracting (H, D).
  lhs = jnp.arange(2 * 3 * 4 * 16, dtype=jnp.float32).reshape(2, 3, 4, 16)
  rhs = jnp.arange(4 * 16 * 8, dtype=jnp.float32).reshape(4, 16, 8)
  dims = (((2, 3), (0, 1)), ((), ()))
  x, w = diag.gemm_matrices(lhs, rhs, dims)
  assert x.shape == (6, 64) and w.shape == (64, 8)
  y = jax.lax.dot_general(lhs, rhs, dims)
  np.testing.assert_array_equal(x @ w, diag.output_matrix(y, 1))
  with pytest.raises(ValueError, match="batch"):
    diag.gemm_matrices(lhs, rhs, (((3,), (1,)), ((2,), (0,))))


# ---------------------------------------------------------------------------------------------------
# Host aggregation and naming
# ---------------------------------------------------------------------------------------------------


def _report(sq_err, sq_norm, nonzero, flushed, blocks, sat, zero, amax):
  return dict(zip(diag.SUM_FIELDS, (sq_err, sq_norm, nonzero, flushed, blocks, sat, zero, amax)))


def test_summarize_pools_counts_and_averages_relative_error():
  st = diag.summarize([_report(1, 100, 10, 1, 4, 1, 0, 2.0), _report(9, 100, 30, 9, 4, 0, 2, 5.0)])
  assert st["rel_err"] == pytest.approx((0.1 + 0.3) / 2)
  assert st["underflow"] == pytest.approx(10 / 40)
  assert st["scale_sat"] == pytest.approx(1 / 8) and st["scale_zero"] == pytest.approx(2 / 8)
  assert st["amax"] == 5.0
  zero = diag.summarize([_report(0, 0, 0, 0, 1, 0, 0, 0.0)])
  assert zero["rel_err"] == 0.0 and zero["underflow"] == 0.0
  # an all-zero tensor (an expert that got no token) does not pull the mean error down; its block still counts
  with_empty = diag.summarize([_report(1, 100, 10, 1, 4, 1, 0, 2.0), _report(0, 0, 0, 0, 4, 0, 0, 0.0)])
  assert with_empty["rel_err"] == pytest.approx(0.1) and with_empty["scale_sat"] == pytest.approx(1 / 8)


def test_aggregator_by_step_and_key_names():
  agg = diag.Aggregator()
  agg.report(np.int32(4), _report(1, 4, 2, 1, 1, 1, 0, 3.0), group="mlp_last", tensor="dy")
  agg.report(2, _report(0, 1, 1, 0, 1, 1, 0, 1.0), group="mlp", tensor="x")
  assert agg.steps() == [2, 4]
  out = agg.pop(4)
  assert set(out) == {f"nvfp4/mlp_last/dy_{s}" for s in diag.STATS}
  assert out["nvfp4/mlp_last/dy_rel_err"] == 0.5 and out["nvfp4/mlp_last/dy_underflow"] == 0.5
  assert agg.steps() == []  # step 2 can no longer be written: dropped
  assert agg.pop(6) == {}


def test_group_names():
  g = lambda layer: diag.group_name("mlp", layer, first=1, last=4)  # noqa: E731
  assert [g(1), g(2), g(3), g(4)] == ["mlp_first", "mlp", "mlp", "mlp_last"]
  assert diag.group_name("attention", None, first=0, last=3) == "attention"
  assert diag.group_name("attention", 0, first=0, last=0) == "attention_first"
  assert diag.group_name("experts", 2, first=0, last=3) == "experts"
  with pytest.raises(ValueError):
    diag.group_name("logits", 0, first=0, last=1)


# ---------------------------------------------------------------------------------------------------
# The plugin's GEMM module: off = the plain emulated GEMM; on = same numbers plus reports
# ---------------------------------------------------------------------------------------------------

DIMS = (((1,), (0,)), ((), ()))


def _module_loss(diag_group, recipe):
  mod = linen_gemm.linen_module_class()(recipe=recipe, layer=1, role="wi_0", seed=0,  # pylint: disable=protected-access
                                             diag_group=diag_group, diag_interval=2)

  def loss(x, w, step):
    with step_lib.step_context(step, training=True):
      y = mod.apply({}, x, w, DIMS)
    return jnp.sum(y.astype(jnp.float32) * jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape) / y.size)

  return jax.value_and_grad(loss, argnums=(0, 1))


def _direct_loss(recipe):
  def loss(x, w, step):  # what the module computed before diagnostics existed
    y = gemm.dot_general(x, w, DIMS, recipe=recipe, key=plan_lib.sr_key(0, jnp.asarray(step, jnp.int32), 1, "wi_0"))
    return jnp.sum(y.astype(jnp.float32) * jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape) / y.size)

  return jax.value_and_grad(loss, argnums=(0, 1))


@pytest.fixture(scope="module")
def operands():
  x = jax.random.normal(jax.random.key(2), (32, 64), jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(3), (64, 32), jnp.float32) * 0.05).astype(jnp.bfloat16)
  return x, w


def test_diagnostics_off_traces_exactly_the_plain_gemm(operands):
  x, w = operands
  recipe = gemm.GemmRecipe()
  off = str(jax.make_jaxpr(_module_loss(None, recipe))(x, w, jnp.int32(3)))
  direct = str(jax.make_jaxpr(_direct_loss(recipe))(x, w, jnp.int32(3)))
  on = str(jax.make_jaxpr(_module_loss("mlp", recipe))(x, w, jnp.int32(3)))
  assert off == direct  # forward and backward: no extra op, no callback
  assert "debug_callback" not in off and on.count("debug_callback[") == 3  # x, w (forward) and dy (backward)


def test_diagnostics_on_changes_no_number_and_reports_on_interval_steps(operands):
  x, w = operands
  recipe = gemm.GemmRecipe()
  off = jax.jit(_module_loss(None, recipe))
  on = jax.jit(_module_loss("mlp_first", recipe))
  diag.AGGREGATOR.clear()
  for step in (3, 4):
    (l0, g0), (l1, g1) = off(x, w, jnp.int32(step)), on(x, w, jnp.int32(step))
    np.testing.assert_array_equal(np.asarray(l0), np.asarray(l1))
    for a, b in zip(g0, g1):
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  jax.effects_barrier()
  assert diag.AGGREGATOR.steps() == [4]  # interval 2: step 3 reports nothing
  out = diag.AGGREGATOR.pop(4)
  assert set(out) == {f"nvfp4/mlp_first/{t}_{s}" for t in diag.TENSORS for s in diag.STATS}
  assert out["nvfp4/mlp_first/x_amax"] == pytest.approx(float(jnp.max(jnp.abs(x.astype(jnp.float32)))))
  assert out["nvfp4/mlp_first/w_amax"] == pytest.approx(float(jnp.max(jnp.abs(w.astype(jnp.float32)))))
  for t in diag.TENSORS:
    assert 0.03 < out[f"nvfp4/mlp_first/{t}_rel_err"] < 0.3, out


def test_expert_gemms_report_each_expert_as_its_own_gemm():
  """Routed experts (a dot_general with the expert as batch dim, the einsum path's form): every expert's x, W
  and dy is one report, equal to the report of that expert's GEMM instrumented alone; the numbers unchanged."""
  e, c, k, n = 3, 32, 64, 32
  x = jax.random.normal(jax.random.key(4), (e, c, k), jnp.float32)
  x = (x * jnp.asarray([1.0, 100.0, 1e-3])[:, None, None]).astype(jnp.bfloat16)  # experts far apart in scale
  w = (jax.random.normal(jax.random.key(5), (e, k, n), jnp.float32) * 0.05).astype(jnp.bfloat16)
  batched_dims = (((2,), (1,)), ((0,), (0,)))

  dy = jax.random.normal(jax.random.key(6), (e, c, n), jnp.float32) * jnp.asarray([1.0, 1e-2, 10.0])[:, None, None]

  def run(fn, ct, *args):
    agg = diag.Aggregator()
    y, vjp = jax.vjp(lambda *a: fn(agg, *a), *args)
    vjp(ct)
    jax.effects_barrier()
    return y, agg

  def batched(agg, x, w):
    y = jax.lax.dot_general(x, w, batched_dims, preferred_element_type=jnp.float32)
    return diag.instrument(x, w, batched_dims, y, step=0, interval=1, group="experts", aggregator=agg)

  y, agg = run(batched, dy, x, w)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(jnp.einsum("eck,ekn->ecn", x, w,
                                                                     preferred_element_type=jnp.float32)))
  got = agg._data[0]  # pylint: disable=protected-access
  assert {t for (_, t) in got} == set(diag.TENSORS) and all(len(v) == e for v in got.values())
  for i in range(e):
    def one(agg, xi, wi):
      yi = jax.lax.dot_general(xi, wi, DIMS, preferred_element_type=jnp.float32)
      return diag.instrument(xi, wi, DIMS, yi, step=0, interval=1, group="experts", aggregator=agg)

    _, ref = run(one, dy[i], x[i], w[i])
    for t in diag.TENSORS:
      a, b = got[("experts", t)][i], ref._data[0][("experts", t)][0]  # pylint: disable=protected-access
      # counts and amax exactly; the fp32 sums up to summation order (vmapped reductions may reassociate)
      assert {f: a[f] for f in diag.SUM_FIELDS if not f.startswith("sq_")} == \
             {f: b[f] for f in diag.SUM_FIELDS if not f.startswith("sq_")}, (i, t)
      for f in ("sq_err", "sq_norm"):
        assert a[f] == pytest.approx(b[f], rel=1e-5), (i, t, f)
  # own amax per expert: the x amaxes are three different numbers (one pooled tensor would give one)
  amaxes = [r["amax"] for r in got[("experts", "x")]]
  assert amaxes == [float(jnp.max(jnp.abs(x[i].astype(jnp.float32)))) for i in range(e)] and len(set(amaxes)) == e
  assert set(agg.pop(0)) == {f"nvfp4/experts/{t}_{s}" for t in diag.TENSORS for s in diag.STATS}


# ---------------------------------------------------------------------------------------------------
# MaxText: the train step with diagnostics off/on, and a short run
# ---------------------------------------------------------------------------------------------------


class _Traced(Exception):
  pass


def _train_step_jaxpr(monkeypatch, out_dir, **overrides) -> str:
  """The jaxpr of MaxText's jitted train step for a tiny nvfp4 config (traced, never compiled or run)."""
  from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  def trace(config, p_train_step, args):  # called by train_loop right before the AOT compile
    del config
    raise _Traced(str(jax.make_jaxpr(getattr(p_train_step, "__wrapped__", p_train_step))(*args)))

  monkeypatch.setattr(maxtext_utils, "maybe_dump_jaxpr", trace)
  with pytest.raises(_Traced) as e:
    train.main(tiny_argv(str(out_dir), quantization="nvfp4", nvfp4_targets="mlp", base_num_decoder_layers=2, **overrides))
  return str(e.value)


def test_train_step_without_diagnostics_has_no_callback_or_branch(monkeypatch, tmp_path):
  off = _train_step_jaxpr(monkeypatch, tmp_path)
  on = _train_step_jaxpr(monkeypatch, tmp_path, nvfp4_diagnostics=True)
  # The quantizer has conds of its own (the RHT's rare tiny-group path); diagnostics add theirs on top,
  # each with host callbacks, and none when off.
  assert "debug_callback" not in off
  assert "debug_callback" in on and on.count("cond[") > off.count("cond[")


STEPS = 3
INTERVAL = 2


@pytest.fixture(scope="module")
def diag_run(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("diag"))
  from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel

  diag.AGGREGATOR.clear()
  traced.traced_gemms(reset=True)
  # RHT off: it rotates only the wgrad operands, which diagnostics do not measure (x, w: fprop; dy: dgrad,
  # with SR), and leaving it out of 9 GEMMs shortens the compile; diagnostics with RHT on: the module test above.
  train.main(tiny_argv(out, run_name="diag", steps=STEPS, quantization="nvfp4", nvfp4_targets="mlp",
                       nvfp4_rht=False, nvfp4_diagnostics=True, nvfp4_diagnostics_interval=INTERVAL))
  return {"metrics": read_metrics(os.path.join(out, "diag.jsonl")), "traced": traced.traced_gemms()}


@pytest.mark.slow
def test_run_writes_diagnostics_at_interval_steps(diag_run):
  records = {int(m["step"]): m for m in diag_run["metrics"]}
  assert sorted(records) == list(range(STEPS))
  # 3 layers, MLP only: first (0), middle (1), last (2); x, w, dy; 5 statistics each.
  expected = {f"nvfp4/{g}/{t}_{s}" for g in ("mlp_first", "mlp", "mlp_last") for t in diag.TENSORS for s in diag.STATS}
  expected |= {f"nvfp4/residual/rms_{s}" for s in ("min", "max", "span")}  # the telemetry (core/stability.py)
  for step, m in records.items():
    keys = {k for k in m if k.startswith("nvfp4/")}
    assert keys == (expected if step % INTERVAL == 0 else set()), (step, keys ^ expected)
  for step in (0, 2):
    m = records[step]
    for g in ("mlp_first", "mlp", "mlp_last"):
      for t in diag.TENSORS:
        assert 0.03 < m[f"nvfp4/{g}/{t}_rel_err"] < 0.3, (step, g, t)
        assert 0.0 <= m[f"nvfp4/{g}/{t}_underflow"] < 0.5
        assert 0.0 < m[f"nvfp4/{g}/{t}_scale_sat"] <= 1.0  # the amax block is always at 448
        assert m[f"nvfp4/{g}/{t}_scale_zero"] == 0.0
        assert 0.0 < m[f"nvfp4/{g}/{t}_amax"] < 100.0
      assert m[f"nvfp4/{g}/x_amax"] > m[f"nvfp4/{g}/dy_amax"]  # gradients of a mean loss are tiny


@pytest.fixture(scope="module")
def grad_run(tmp_path_factory):
  """``diag_run``'s twin with ``nvfp4_diagnostics_grad`` on."""
  out = str(tmp_path_factory.mktemp("grad"))
  from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel

  train.main(tiny_argv(out, run_name="grad", steps=STEPS, quantization="nvfp4", nvfp4_targets="mlp",
                       nvfp4_rht=False, nvfp4_diagnostics=True, nvfp4_diagnostics_interval=INTERVAL,
                       nvfp4_diagnostics_grad=True))
  return {int(m["step"]): m for m in read_metrics(os.path.join(out, "grad.jsonl"))}


@pytest.mark.slow
def test_gradient_fidelity_trains_the_same_bits_and_reports_against_a_high_precision_reference(diag_run, grad_run):
  plain = {int(m["step"]): m for m in diag_run["metrics"]}
  assert sorted(grad_run) == sorted(plain) == list(range(STEPS))
  for s in range(STEPS):  # the tap and the reference pass change nothing the step trains with
    for k in ("learning/loss", "learning/grad_norm", "learning/param_norm"):
      assert grad_run[s][k] == plain[s][k], (s, k)
    assert {k: v for k, v in grad_run[s].items() if k.startswith("nvfp4/") and "/dw_" not in k} == {
        k: v for k, v in plain[s].items() if k.startswith("nvfp4/")}
  groups = ("mlp_first", "mlp", "mlp_last", "attention_first", "attention", "attention_last", "other", "model")
  for s in range(STEPS):
    dw = {k for k in grad_run[s] if "/dw_" in k}
    if s % INTERVAL:
      assert not dw, s
      continue
    m = grad_run[s]
    for g in groups:
      # NVFP4 (with SR) turns the gradient a little, in every group (attention too: its inputs come through the
      # quantized MLPs). A reference that ran NVFP4 itself would give exactly 1 (the same SR keys).
      assert 0.5 < m[f"nvfp4/{g}/dw_cos"] < 0.999, (s, g, m[f"nvfp4/{g}/dw_cos"])
      assert 0.7 < m[f"nvfp4/{g}/dw_norm_ratio"] < 1.3, (s, g)
    for g in groups[:-1]:
      assert m[f"nvfp4/{g}/dw_cos_min"] <= m[f"nvfp4/{g}/dw_cos"] + 1e-6
    assert {f"nvfp4/layer_{i}/dw_cos" for i in range(3)} <= dw and not any("expert_" in k for k in dw)


@pytest.mark.slow
def test_run_traces_each_gemm_once_per_program(diag_run):
  traced = diag_run["traced"]
  assert len(traced) == 3 * 3  # 3 layers x (wi_0, wi_1, wo)
  assert len(set(traced.values())) == 1 and 1 <= next(iter(traced.values())) < STEPS  # no per-step retrace
