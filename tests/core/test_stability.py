"""Gradient fidelity and stability telemetry: the unit classification, the sums against numpy, the host pooling
against an independent cosine, and the backward tap against two independently computed gradients (no MaxText
run here; tests/integration/test_stability_run.py runs MaxText)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_nvfp4.core import stability as core
from maxtext_nvfp4.integration import stability
from maxtext_nvfp4.integration import step as step_lib


def _cos(a, b):
  a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
  return float(a @ b / np.sqrt((a @ a) * (b @ b)))


def _ratio(a, b):
  a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
  return float(np.sqrt((a @ a) / (b @ b)))


# ---------------------------------------------------------------------------------------------------------- units


@pytest.mark.parametrize("path, ndim, expect", [
    (("decoder", "layers_3", "self_attention", "query", "kernel"), 3, ("attention", 3, None, None)),
    (("decoder", "layers_0", "mlp", "wi_0", "kernel"), 2, ("mlp", 0, None, None)),
    (("decoder", "layers_1", "MoeBlock_0", "wi_1"), 3, ("experts", 1, 0, None)),
    (("decoder", "layers_1", "MoeBlock_0", "gate", "kernel"), 2, ("other", 1, None, None)),  # the router
    (("decoder", "layers_1", "pre_self_attention_layer_norm", "scale"), 1, ("other", 1, None, None)),
    (("token_embedder", "embedding"), 2, ("other", None, None, None)),
    (("decoder", "layers", "mlp", "wo", "kernel"), 3, ("mlp", None, None, 1)),  # scanned: (mlp, layers, embed)
    (("decoder", "layers", "moe_block", "wo"), 4, ("experts", None, 0, 1)),  # scanned experts: (E, layers, ...)
])
def test_param_role_from_maxtext_paths(path, ndim, expect):
  r = core.param_role(path, ndim, scan_axis=1)
  assert (r.kind, r.layer, r.expert_axis, r.layer_axis) == expect


def test_grad_sums_keep_the_unit_axes_in_order():
  rng = np.random.default_rng(0)
  g, r = rng.normal(size=(4, 3, 5, 2)).astype(np.float32), rng.normal(size=(4, 3, 5, 2)).astype(np.float32)
  full = jax.jit(lambda a, b: core.grad_sums(a, b))(g, r)
  assert float(full["dot"]) == pytest.approx(float(np.sum(g.astype(np.float64) * r)), rel=1e-5)
  # (layer axis 1, expert axis 0): the result is indexed [layer, expert]
  per = jax.jit(lambda a, b: core.grad_sums(a, b, (1, 0)))(g, r)
  assert per["dot"].shape == (3, 4)
  for layer in range(3):
    for e in range(4):
      a, b = g[e, layer].astype(np.float64), r[e, layer].astype(np.float64)
      assert float(per["dot"][layer, e]) == pytest.approx(float(np.sum(a * b)), rel=1e-5, abs=1e-5)
      assert float(per["sq_run"][layer, e]) == pytest.approx(float(np.sum(a * a)), rel=1e-5)
      assert float(per["sq_ref"][layer, e]) == pytest.approx(float(np.sum(b * b)), rel=1e-5)


def test_fidelity_edge_cases():
  assert core.fidelity(0.0, 0.0, 0.0) == (0.0, 1.0)
  assert core.fidelity(0.0, 4.0, 0.0) == (0.0, math.inf)
  assert core.fidelity(-2.0, 1.0, 4.0) == (-1.0, 0.5)
  assert core.load_imbalance([6, 2, 0, 0]) == 3.0 and core.load_imbalance([0, 0]) == 1.0


# ---------------------------------------------------------------------------------------------------------- store


def test_store_pools_units_groups_layers_and_experts():
  rng = np.random.default_rng(1)
  g_att, r_att = rng.normal(size=(8, 4)), rng.normal(size=(8, 4))
  g_exp, r_exp = rng.normal(size=(3, 4, 6)), rng.normal(size=(3, 4, 6))  # 3 experts, layer 1
  g_emb, r_emb = rng.normal(size=(5, 4)), rng.normal(size=(5, 4))
  store = core.Store()
  store.group_of = lambda kind, layer: f"{kind}_first" if layer == 0 else kind
  metas, sums = [], []
  for name, kind, layer, axes, keep, g, r in (
      ("att", "attention", 0, (), (), g_att, r_att), ("exp", "experts", 1, ("expert",), (0,), g_exp, r_exp),
      ("emb", "other", None, (), (), g_emb, r_emb)):
    metas.append(core.UnitMeta(name=name, kind=kind, axes=axes, layer=layer))
    sums.append({k: np.asarray(v) for k, v in core.grad_sums(jnp.asarray(g), jnp.asarray(r), keep).items()})
  store.report_grads(7, sums, metas=metas)
  out = store.pop(7)
  assert out["nvfp4/attention_first/dw_cos"] == pytest.approx(_cos(g_att, r_att), rel=1e-5)
  assert out["nvfp4/experts/dw_norm_ratio"] == pytest.approx(_ratio(g_exp, r_exp), rel=1e-5)
  everything = (np.concatenate([g_att.ravel(), g_exp.ravel(), g_emb.ravel()]),
                np.concatenate([r_att.ravel(), r_exp.ravel(), r_emb.ravel()]))
  assert out["nvfp4/model/dw_cos"] == pytest.approx(_cos(*everything), rel=1e-5)
  for e in range(3):
    assert out[f"nvfp4/expert_{e}/dw_cos"] == pytest.approx(_cos(g_exp[e], r_exp[e]), rel=1e-5)
  assert out["nvfp4/experts/dw_cos_min"] == pytest.approx(min(_cos(g_exp[e], r_exp[e]) for e in range(3)), rel=1e-5)
  assert out["nvfp4/layer_1/dw_cos"] == pytest.approx(_cos(g_exp, r_exp), rel=1e-5)
  assert "nvfp4/layer_None/dw_cos" not in out and out["nvfp4/other/dw_cos"] == pytest.approx(_cos(g_emb, r_emb),
                                                                                              rel=1e-5)
  assert store.pop(7) == {}


def test_store_telemetry_min_max_and_duplicates():
  store = core.Store()
  for step in (3, 4):
    store.report_rms(step, 4.0 * 10, 10)  # rms 2
    store.report_rms(step, 0.25 * 10, 10)  # rms 0.5
    store.report_load(step, [4, 0, 0, 0], index=0)  # 4
    store.report_load(step, [4, 0, 0, 0], index=0)  # remat duplicate: max, not sum
    store.report_load(step, [1, 1, 1, 1], index=1)
  out = store.pop(4)  # drops step 3 too
  assert out == {"nvfp4/residual/rms_min": 0.5, "nvfp4/residual/rms_max": 2.0, "nvfp4/residual/rms_span": 4.0,
                 "nvfp4/moe/load_max": 4.0, "nvfp4/moe_0/load": 4.0, "nvfp4/moe_1/load": 1.0}
  assert store.pop(3) == {} and store.steps() == []


# ---------------------------------------------------------------------------------------------------------- the tap

E, D, F = 3, 16, 8


def _params():
  k = jax.random.split(jax.random.key(0), 3)
  return {"decoder": {"layers_0": {"MoeBlock_0": {"wi_0": jax.random.normal(k[0], (E, D, F))},
                                   "mlp": {"wo": {"kernel": jax.random.normal(k[1], (F, D))}}}},
          "token_embedder": {"embedding": jax.random.normal(k[2], (4, D))}}


def _fake_quant(w):  # a crude "low precision" GEMM operand (2 significant bits), straight-through gradient
  e = jnp.floor(jnp.log2(jnp.abs(w) + 1e-30))
  return w + jax.lax.stop_gradient(jnp.round(w / 2.0**(e - 1)) * 2.0**(e - 1) - w)


def _loss(p, x, *, quantized):
  q = _fake_quant if quantized else (lambda w: w)
  moe = p["decoder"]["layers_0"]["MoeBlock_0"]["wi_0"]
  h = jnp.einsum("td,edf->etf", x, q(moe)) * jnp.arange(1, E + 1, dtype=jnp.float32)[:, None, None]
  y = jnp.tanh(h).sum(0) @ q(p["decoder"]["layers_0"]["mlp"]["wo"]["kernel"])
  return jnp.mean((y - p["token_embedder"]["embedding"][0]) ** 2)


@pytest.fixture(scope="module")
def tap_run():
  """The tap on a toy loss: (outer gradient with the tap, without it, the reference, the report)."""
  p = _params()
  x = jax.random.normal(jax.random.key(1), (32, D))
  metas, keeps = stability.fidelity_units(p)
  store = core.STORE
  store.clear()
  saved, store.group_of = store.group_of, lambda kind, layer: kind

  def reference(pp, x_):
    return jax.grad(lambda q: _loss(q, x_, quantized=False))(pp)

  def with_tap(pp, step):
    t = stability.tapped(pp, (x, step), reference_grads=reference, metas=metas, keeps=keeps, interval=2)
    return _loss(t, x, quantized=True)

  f = jax.jit(jax.grad(with_tap))
  grads = {s: f(p, jnp.int32(s)) for s in (3, 4)}
  reports = {s: store.pop(s) for s in (3, 4)}
  store.group_of = saved
  plain = jax.jit(jax.grad(lambda pp: _loss(pp, x, quantized=True)))(p)  # jitted as the tapped one is
  return {"plain": plain, "tapped": grads, "ref": jax.jit(reference)(p, x),
          "reports": reports, "metas": metas}


def test_tap_changes_no_gradient_bit(tap_run):
  for s in (3, 4):
    for a, b in zip(jax.tree_util.tree_leaves(tap_run["plain"]), jax.tree_util.tree_leaves(tap_run["tapped"][s])):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_tap_reports_on_interval_steps_against_the_reference(tap_run):
  assert tap_run["reports"][3] == {}  # 3 % 2 != 0
  out = tap_run["reports"][4]
  g, r = tap_run["plain"], tap_run["ref"]
  gm, rm = (t["decoder"]["layers_0"]["MoeBlock_0"]["wi_0"] for t in (g, r))
  for e in range(E):  # each expert against its own slice of the independent reference gradient
    assert out[f"nvfp4/expert_{e}/dw_cos"] == pytest.approx(_cos(gm[e], rm[e]), rel=1e-5)
    assert out[f"nvfp4/expert_{e}/dw_norm_ratio"] == pytest.approx(_ratio(gm[e], rm[e]), rel=1e-5)
  gw, rw = (t["decoder"]["layers_0"]["mlp"]["wo"]["kernel"] for t in (g, r))
  assert out["nvfp4/mlp/dw_cos"] == pytest.approx(_cos(gw, rw), rel=1e-5)
  leaves = [(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(r))]
  assert out["nvfp4/model/dw_cos"] == pytest.approx(
      _cos(np.concatenate([a.ravel() for a, _ in leaves]), np.concatenate([b.ravel() for _, b in leaves])), rel=1e-5)
  # the fake quantization is visible: not the same direction, not a permutation of experts either
  cos = [out[f"nvfp4/expert_{e}/dw_cos"] for e in range(E)]
  assert all(0.5 < c < 0.9999 for c in cos), cos
  assert [m.kind for m in tap_run["metas"]] == ["experts", "mlp", "other"]


def test_reference_pass_flag_is_scoped():
  assert not step_lib.in_reference_pass()
  with step_lib.reference_pass():
    assert step_lib.in_reference_pass()
  assert not step_lib.in_reference_pass()


def test_grad_without_diagnostics_is_refused_in_one_line():
  from maxtext_nvfp4.core import settings as settings_lib  # pylint: disable=import-outside-toplevel

  with pytest.raises(settings_lib.SettingsError, match=r"^nvfp4_diagnostics_grad=true needs nvfp4_diagnostics=true"):
    settings_lib.validate(settings_lib.Nvfp4Settings(diagnostics_grad=True))
  settings_lib.validate(settings_lib.Nvfp4Settings(diagnostics=True, diagnostics_grad=True))
  assert settings_lib.config_keys()["nvfp4_diagnostics_grad"] is False
