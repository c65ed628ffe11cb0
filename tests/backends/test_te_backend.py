"""TE adapter tests.

The CPU tests are WIRING tests: Transformer Engine is not installed here (it needs CUDA), so a small
fake of the TE names MaxText's ``TransformerEngineQuantization`` and our adapter touch is injected via
``sys.modules``. The fake records which recipe each GEMM was built with and which rng key TE's
NVFP4 quantizer drew; its "GEMM" is a plain ``lax.dot_general``. They prove the plumbing (toggles
mapped, plan honoured, bf16 GEMMs not routed to TE, ``sr_rng`` served per step), not TE's numerics.
The ``blackwell`` tests at the bottom use real TE and run only where TE and a cc >= 10.0 GPU exist.
"""

import dataclasses
import sys
import types

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

from maxtext_nvfp4.backends import capability
from maxtext_nvfp4.core import settings as settings_mod
from maxtext_nvfp4.backends import te as te_backend
from maxtext_nvfp4.integration import step as step_lib
from maxtext_nvfp4.integration import te_quantization


# ----------------------------------------------------------------------------------------------
# A fake of the TE names used (recipe classes, flax.module.TransformerEngineBase, dense.dense,
# cpp_extensions' collective-op names). Mirrors TE 2.x signatures as read from its source.
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class FakeNVFP4BlockScaling:
  disable_rht: bool = False
  disable_stochastic_rounding: bool = False
  disable_2d_quantization: bool = False


@dataclasses.dataclass
class FakeFloat8CurrentScaling:
  pass


class _Other:
  pass


DENSE_CALLS: list[dict] = []


class FakeTransformerEngineBase(nn.Module):
  """Like TE's: builds a quantizer set; NVFP4 with SR draws module.make_rng('sr_rng') (helper.py)."""

  def generate_quantizer_set(self, postfix="", variable_collection=None, quantization_checkpoint_name=None,
                             fp8_recipe=None, n_groups=None):
    sr_key = None
    if isinstance(fp8_recipe, FakeNVFP4BlockScaling) and not fp8_recipe.disable_stochastic_rounding:
      sr_key = self.make_rng("sr_rng")
    return dict(recipe=fp8_recipe, sr_key=sr_key, collection=variable_collection,
                checkpoint_name=quantization_checkpoint_name)


def fake_dense(x, kernel, contracting_dims, quantizer_set, collective_op_set=None):
  DENSE_CALLS.append(dict(quantizer_set=quantizer_set, collective=collective_op_set))
  return jax.lax.dot_general(x, kernel, (contracting_dims, ((), ())))


@pytest.fixture
def fake_te(monkeypatch):
  DENSE_CALLS.clear()
  te = types.ModuleType("transformer_engine")
  common = types.ModuleType("transformer_engine.common")
  recipe = types.ModuleType("transformer_engine.common.recipe")
  recipe.NVFP4BlockScaling = FakeNVFP4BlockScaling
  recipe.Float8CurrentScaling = FakeFloat8CurrentScaling
  recipe.DelayedScaling = recipe.MXFP8BlockScaling = recipe.Recipe = _Other
  tej = types.ModuleType("transformer_engine.jax")
  tex = types.ModuleType("transformer_engine.jax.cpp_extensions")
  tex.noop_collective_op_set = "noop"
  tex.CollectiveOp = types.SimpleNamespace(ALL_GATHER="ag", REDUCE_SCATTER="rs")
  tex.CollectiveOpSet = types.SimpleNamespace(create=lambda op: f"set:{op}")
  flax_mod = types.ModuleType("transformer_engine.jax.flax")
  flax_mod.module = types.SimpleNamespace(TransformerEngineBase=FakeTransformerEngineBase)
  dense_mod = types.ModuleType("transformer_engine.jax.dense")
  dense_mod.dense = fake_dense
  te.common, common.recipe, te.jax = common, recipe, tej
  tej.cpp_extensions, tej.flax, tej.dense = tex, flax_mod, dense_mod
  # Our NVFP4 projections call te_shared_dense.dense (TE's dense with x's quantization shared), which has TE's
  # dense's signature and is checked against real TE in the te stage; here it is the fake dense too.
  from maxtext_nvfp4.backends import te_shared_dense  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(te_shared_dense, "dense", fake_dense)
  for name, mod in {
      "transformer_engine": te, "transformer_engine.common": common, "transformer_engine.common.recipe": recipe,
      "transformer_engine.jax": tej, "transformer_engine.jax.cpp_extensions": tex,
      "transformer_engine.jax.flax": flax_mod, "transformer_engine.jax.dense": dense_mod,
  }.items():
    monkeypatch.setitem(sys.modules, name, mod)
  return DENSE_CALLS


@dataclasses.dataclass(frozen=True)
class MlpOnlyPlan:
  """A plugin-style plan: MLP projections in NVFP4, attention out-projection in fp8, the rest bf16."""

  def __call__(self, mesh_axes):
    if "mlp" in mesh_axes:
      return "nvfp4"
    if mesh_axes and mesh_axes[0] == "heads":
      return "fp8"
    return "bf16"


def _te_base():
  from maxtext.layers import quantizations  # pylint: disable=import-outside-toplevel

  return quantizations.TransformerEngineQuantization


def _config():
  return types.SimpleNamespace(te_comm_gemm_overlap="disabled")


def test_recipe_kwargs_map_our_toggles_inverted():
  s = settings_mod.Nvfp4Settings(rht=False, stochastic_rounding=True, two_d_weights=False)
  assert te_backend.recipe_kwargs(s) == dict(disable_rht=True, disable_stochastic_rounding=False,
                                             disable_2d_quantization=True)
  d = settings_mod.Nvfp4Settings()
  assert te_backend.recipe_kwargs(d) == dict(disable_rht=False, disable_stochastic_rounding=False,
                                             disable_2d_quantization=False)


def test_rng_streams_needed_follows_stochastic_rounding():
  assert te_backend.rng_streams_needed(settings_mod.Nvfp4Settings()) == ("sr_rng",)
  assert te_backend.rng_streams_needed(settings_mod.Nvfp4Settings(stochastic_rounding=False)) == ()


def _scaled_fake_dense(monkeypatch, scale):
  """The fake TE dense, its output multiplied by ``scale[type(recipe)]``: tells the TE paths apart by value."""

  def dense(x, kernel, contracting_dims, quantizer_set, collective_op_set=None):
    return fake_dense(x, kernel, contracting_dims, quantizer_set, collective_op_set) * scale[type(quantizer_set["recipe"])]

  monkeypatch.setattr(sys.modules["transformer_engine.jax.dense"], "dense", dense)


@pytest.mark.parametrize("scope, to", [("all", "fp8"), ("forward", "bf16"), ("forward", "fp8")])
def test_wiring_late_switch_is_a_cond_between_te_nvfp4_and_the_switched_dense(fake_te, monkeypatch, scope, to):
  """nvfp4_switch_at_step on the TE backend: one traced program (both TE paths traced once, a cond on the
  traced step); before step S the NVFP4 dense, from S on the switched one -- whole GEMM (scope all) or the
  forward value only, gradients still from the NVFP4 dense (scope forward, the paper's recipe)."""
  from flax import nnx as nnx_  # pylint: disable=import-outside-toplevel

  nv, fp8 = 1.5, 3.0  # fake NVFP4 / FP8 dense = plain dot times these; bf16 = the plain dot itself
  _scaled_fake_dense(monkeypatch, {FakeNVFP4BlockScaling: nv, FakeFloat8CurrentScaling: fp8})
  s = settings_mod.Nvfp4Settings(switch_at_step=5, switch_to=to, switch_scope=scope)
  q = te_quantization.make_te_quantization(_te_base(), types.SimpleNamespace(te_comm_gemm_overlap="disabled",
                                                                             steps=10), s, MlpOnlyPlan())
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 32), jnp.bfloat16)

  @jax.jit
  def run(x, step):
    with step_lib.step_context(step):
      layer = _dense(q, ("embed", "mlp"), nnx_.Rngs(params=0, dropout=1, aqt=2))
      y = layer(x)
      dx = nnx_.grad(lambda layer, x: jnp.sum(layer(x).astype(jnp.float32)), argnums=1)(layer, x)
      return y, dx, layer.kernel[...]

  fake_te.clear()
  traces = 0
  for step in (0, 4, 5, 9):
    y, dx, kernel = run(x, jnp.int32(step))
    traces = max(traces, run._cache_size())  # pylint: disable=protected-access
    plain = np.asarray(jnp.dot(x.astype(jnp.float32), kernel.astype(jnp.bfloat16).astype(jnp.float32)))
    dplain = np.asarray(jnp.sum(kernel.astype(jnp.bfloat16).astype(jnp.float32), axis=1))
    after = {"bf16": 1.0, "fp8": fp8}[to]
    y_scale = nv if step < 5 else after
    dx_scale = nv if step < 5 or scope == "forward" else after
    np.testing.assert_allclose(np.asarray(y, np.float32), y_scale * plain, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(dx, np.float32)[0], dx_scale * dplain, rtol=2e-2, atol=2e-2)
  assert traces == 1  # the step is traced: one compilation for every step
  recipes = {type(c["quantizer_set"]["recipe"]) for c in fake_te}
  assert recipes == ({FakeNVFP4BlockScaling, FakeFloat8CurrentScaling} if to == "fp8" else {FakeNVFP4BlockScaling})


def test_wiring_recipe_toggles_reach_te_recipe(fake_te):
  s = settings_mod.Nvfp4Settings(rht=False, stochastic_rounding=False, two_d_weights=True)
  q = te_quantization.make_te_quantization(_te_base(), _config(), s, MlpOnlyPlan())
  assert isinstance(q, _te_base())
  assert q._recipe == FakeNVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True,
                                            disable_2d_quantization=False)
  assert q.needs_apply_rngs is False  # no SR -> MaxText may release the rngs
  # MaxText's own block-size rule still applies (isinstance on the recipe).
  assert q.get_block_size() == 128
  # Rebuilt objects compare equal (MaxText calls configure_quantization several times per run).
  assert q == te_quantization.make_te_quantization(_te_base(), _config(), s, MlpOnlyPlan())
  assert hash(q) == hash(te_quantization.make_te_quantization(_te_base(), _config(), s, MlpOnlyPlan()))


def _dense(quant, kernel_axes, rngs, n_in=32, n_out=32):
  from maxtext.layers import linears  # pylint: disable=import-outside-toplevel

  return linears.DenseGeneral(n_in, n_out, kernel_axes=kernel_axes, quant=quant, dtype=jnp.bfloat16,
                              weight_dtype=jnp.float32, rngs=rngs)


def test_wiring_plan_routes_each_projection_through_maxtext_dense_general(fake_te):
  """Real MaxText DenseGeneral + our adapter + fake TE: plan honoured, bf16 GEMMs bypass TE."""
  s = settings_mod.Nvfp4Settings(seed=7)
  q = te_quantization.make_te_quantization(_te_base(), _config(), s, MlpOnlyPlan())
  rngs = nnx.Rngs(params=0, dropout=1, aqt=2)
  x = jax.random.normal(jax.random.PRNGKey(0), (4, 32), jnp.bfloat16)

  up = _dense(q, ("embed", "mlp"), rngs)
  fake_te.clear()
  y = up(x)
  assert len(fake_te) == 1
  qs = fake_te[0]["quantizer_set"]
  assert isinstance(qs["recipe"], FakeNVFP4BlockScaling) and qs["recipe"] == FakeNVFP4BlockScaling()
  assert qs["collection"] == "_overwrite_with_gradient" and qs["checkpoint_name"] == "quantization"
  assert qs["sr_key"] is not None
  kernel = up.kernel[...].astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(jnp.dot(x, kernel), np.float32))

  out = _dense(q, ("heads", "embed"), rngs)
  fake_te.clear()
  out(x)
  assert len(fake_te) == 1 and isinstance(fake_te[0]["quantizer_set"]["recipe"], FakeFloat8CurrentScaling)
  assert fake_te[0]["quantizer_set"]["sr_key"] is None

  qkv = _dense(q, ("embed_attn", "kv_heads"), rngs)
  fake_te.clear()
  yq = qkv(x)
  assert fake_te == []  # bf16 projection: never reaches TE
  kq = qkv.kernel[...].astype(jnp.bfloat16)
  np.testing.assert_array_equal(np.asarray(yq, np.float32), np.asarray(jnp.dot(x, kq), np.float32))


def test_wiring_sr_rng_is_served_from_aqt_stream_seeded_and_fresh_each_call(fake_te):
  """TE's make_rng('sr_rng') -> fold_in(aqt stream key, nvfp4_seed); the stream advances per call."""
  base = te_quantization.make_te_quantization(_te_base(), _config(), settings_mod.Nvfp4Settings(seed=0), MlpOnlyPlan())
  seeded = te_quantization.make_te_quantization(_te_base(), _config(), settings_mod.Nvfp4Settings(seed=5), MlpOnlyPlan())
  assert base.needs_apply_rngs and seeded.needs_apply_rngs
  x = jnp.ones((4, 32), jnp.bfloat16)

  def keys(quant, rngs, calls=2):
    layer = _dense(quant, ("embed", "mlp"), rngs)
    fake_te.clear()
    for _ in range(calls):
      layer(x)
    return [np.asarray(jax.random.key_data(c["quantizer_set"]["sr_key"])) if jnp.issubdtype(
        c["quantizer_set"]["sr_key"].dtype, jax.dtypes.prng_key) else np.asarray(c["quantizer_set"]["sr_key"])
            for c in fake_te]

  k0 = keys(base, nnx.Rngs(params=0, dropout=1, aqt=2))
  k5 = keys(seeded, nnx.Rngs(params=0, dropout=1, aqt=2))
  assert not np.array_equal(k0[0], k0[1])  # a fresh key every call (= every train step)
  assert not np.array_equal(k0[0], k5[0])  # nvfp4_seed changes the stream
  # Drawn from the aqt stream: changing only the aqt seed changes the key; params seed does not.
  k_aqt = keys(base, nnx.Rngs(params=0, dropout=1, aqt=3))
  k_params = keys(base, nnx.Rngs(params=9, dropout=1, aqt=2))
  assert not np.array_equal(k0[0], k_aqt[0])
  np.testing.assert_array_equal(k0[0], k_params[0])


def test_wiring_bad_plan_value_is_reported(fake_te):
  q = te_quantization.make_te_quantization(_te_base(), _config(), settings_mod.Nvfp4Settings(), lambda axes: "int8")
  with pytest.raises(ValueError, match="expected one of nvfp4, bf16, fp8"):
    q.dot_general_cls(("embed", "mlp"))


def _tensor_ops(closed_jaxpr):
  """Multiset of (primitive, output shapes/dtypes) of every equation with a non-scalar, non-key output,
  sub-jaxprs (pjit, custom_vjp, cond) included: the tensor-sized work of a traced program."""
  ops = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      outs = [v.aval for v in eqn.outvars if hasattr(v.aval, "shape")]
      tensor_outs = [a for a in outs if a.shape and not jnp.issubdtype(a.dtype, jax.dtypes.prng_key)]
      if tensor_outs:
        ops.append((eqn.primitive.name, tuple((a.shape, str(a.dtype)) for a in tensor_outs)))
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          if isinstance(sub, jax.extend.core.ClosedJaxpr):
            walk(sub.jaxpr)
          elif isinstance(sub, jax.extend.core.Jaxpr):
            walk(sub)

  walk(closed_jaxpr.jaxpr)
  return sorted(ops)


def test_te_backend_traces_the_same_tensor_ops_as_maxtext_te_nvfp4(fake_te):
  """Issue 9 (Blackwell, checked on the traced program): an all-NVFP4 ``nvfp4_backend=te`` projection
  traces exactly the tensor ops of MaxText's own ``quantization=te_nvfp4`` -- the same TE ``dense`` call
  with the same recipe and checkpoint name, no extra quantize/cast -- forward and backward. Only scalar
  key ops may differ (our SR key is ``fold_in(aqt key, nvfp4_seed)``)."""
  from flax import nnx as nnx_  # pylint: disable=import-outside-toplevel

  base_cls = _te_base()
  theirs = base_cls(types.SimpleNamespace(quantization="te_nvfp4", te_comm_gemm_overlap="disabled"))
  ours = te_quantization.make_te_quantization(base_cls, _config(), settings_mod.Nvfp4Settings(), lambda axes: "nvfp4")
  x = jax.random.normal(jax.random.PRNGKey(0), (8, 32), jnp.bfloat16)

  def traced(quant, kernel_axes):
    def fwd_bwd(x):  # the layer is built inside the trace, so its rng streams live at this trace level
      layer = _dense(quant, kernel_axes, nnx_.Rngs(params=0, dropout=1, aqt=2))
      loss = lambda layer, x: jnp.sum(layer(x).astype(jnp.float32) ** 2)
      return nnx_.grad(loss, argnums=(0, 1))(layer, x)

    fake_te.clear()
    jaxpr = jax.make_jaxpr(fwd_bwd)(x)
    calls = [(type(c["quantizer_set"]["recipe"]), c["quantizer_set"]["checkpoint_name"]) for c in fake_te]
    return _tensor_ops(jaxpr), calls

  for kernel_axes in (("embed", "mlp"), ("mlp", "embed"), ("embed_attn", "q_heads")):
    ops_theirs, calls_theirs = traced(theirs, kernel_axes)
    ops_ours, calls_ours = traced(ours, kernel_axes)
    # (the layer's lazy init traces the TE call too, so there is more than one call per variant)
    assert calls_ours == calls_theirs and set(calls_ours) == {(FakeNVFP4BlockScaling, "quantization")}
    assert any(name == "dot_general" for name, _ in ops_ours)
    assert ops_ours == ops_theirs, kernel_axes


def test_adapter_module_does_not_import_te_or_maxtext():
  import subprocess  # pylint: disable=import-outside-toplevel

  code = ("import sys, maxtext_nvfp4.backends.te, maxtext_nvfp4.backends.capability; "
          "bad = [m for m in sys.modules if m.startswith(('transformer_engine', 'maxtext.'))]; "
          "assert not bad, bad")
  subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------------------------
# Real TE (Blackwell only).
# ----------------------------------------------------------------------------------------------
def _blackwell_with_te() -> bool:
  try:
    return capability.choose_backend("auto").name == "te"
  except Exception:  # pylint: disable=broad-except
    return False


@pytest.mark.blackwell
@pytest.mark.skipif(not _blackwell_with_te(), reason="needs Transformer Engine and a GPU with compute capability >= 10.0")
def test_real_te_dense_general_nvfp4_close_to_bf16():
  from maxtext.layers import quantizations  # pylint: disable=import-outside-toplevel

  q = te_quantization.make_te_quantization(quantizations.TransformerEngineQuantization, _config(),
                                      settings_mod.Nvfp4Settings(), MlpOnlyPlan())
  layer = _dense(q, ("embed", "mlp"), nnx.Rngs(params=0, dropout=1, aqt=2), n_in=256, n_out=256)
  x = jax.random.normal(jax.random.PRNGKey(0), (128, 256), jnp.bfloat16)
  y = layer(x).astype(jnp.float32)
  ref = jnp.dot(x, layer.kernel[...].astype(jnp.bfloat16)).astype(jnp.float32)
  rel = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
  assert 0 < rel < 0.2, rel  # quantized (not bf16-identical) yet close


@pytest.mark.blackwell
@pytest.mark.skipif(not _blackwell_with_te(), reason="needs Transformer Engine and a GPU with compute capability >= 10.0")
def test_real_te_verify_hardware_passes():
  from maxtext_nvfp4.tools import verify_hardware  # pylint: disable=import-outside-toplevel

  assert verify_hardware.cli_main(["--json"]) == 0


# ----------------------------------------------------------------------------------------------
# verify-hardware: comparison logic, wired against a fake TE (tex.quantize / tex.gemm / factory)
# that lays results out as TE does (colwise data transposed, 2D scales broadcast to 1x16 rows).
# ----------------------------------------------------------------------------------------------
def _install_fake_te_quantize(monkeypatch, *, flip_one=False, sr_zeros=False, gemm_scale=1.0):
  from maxtext_nvfp4.core import nvfp4 as numerics  # pylint: disable=import-outside-toplevel

  ns = types.SimpleNamespace

  def create(scaling_mode, q_dtype, q_layout, use_rht=False, stochastic_rounding_rng_state=None, **kw):
    assert q_dtype == jnp.float4_e2m1fn and not kw
    return ns(scaling_mode=scaling_mode, q_layout=q_layout, use_rht=use_rht, sr=stochastic_rounding_rng_state)

  def _one(x, qz, colwise):
    key = None if qz.sr is None else jax.random.PRNGKey(int(qz.sr[0, 0]))
    if qz.scaling_mode == "2D":
      t = numerics.quantize(x, block_2d=True)
      scale = jnp.repeat(t.scale.astype(jnp.float32), 16, axis=0)  # broadcast 2D -> 1x16 layout
      data = t.data
    else:
      t = numerics.quantize(x, axis=0 if colwise else -1, rht=qz.use_rht and colwise, stochastic_key=key)
      data, scale = t.data, t.scale
    if sr_zeros and key is not None:
      data = jnp.zeros_like(data)
    if flip_one and not colwise and qz.scaling_mode == "1D" and key is None:
      d = data.astype(jnp.float32)
      data = d.at[0, 0].set(jnp.where(d[0, 0] == 6, 4, 6)).astype(data.dtype)
    if colwise:
      return ns(data=data.T, scale_inv=scale.T, amax=t.amax, data_layout="T")
    return ns(data=data, scale_inv=scale, amax=t.amax, data_layout="N")

  def quantize(x, quantizer, flatten_axis=-1):
    assert flatten_axis == -1
    if quantizer.q_layout == "ROWWISE":
      return _one(x, quantizer, False)
    if quantizer.q_layout == "COLWISE":
      return _one(x, quantizer, True)
    return ns(rowwise_tensor=_one(x, quantizer, False), colwise_tensor=_one(x, quantizer, True))

  def gemm(lhs, rhs, contracting_dims, lhs_quantizer, rhs_quantizer):
    # An independent route to the same product: dequantize (TE's dequantizer formula) then matmul.
    (ca,), (cb,) = contracting_dims
    def deq(x, qz, c):
      if qz.scaling_mode == "2D":
        return numerics.dequantize(numerics.quantize(x, block_2d=True))
      return numerics.dequantize(numerics.quantize(x, axis=c, rht=qz.use_rht))
    y = jax.lax.dot_general(deq(lhs, lhs_quantizer, ca), deq(rhs, rhs_quantizer, cb), (((ca,), (cb,)), ((), ())))
    return (y * gemm_scale).astype(jnp.bfloat16)

  tej = types.ModuleType("transformer_engine.jax")
  tex = types.ModuleType("transformer_engine.jax.cpp_extensions")
  tex.quantize, tex.gemm = quantize, gemm
  qmod = types.ModuleType("transformer_engine.jax.quantize")
  qmod.QuantizerFactory = ns(create=create)
  qmod.ScalingMode = ns(NVFP4_1D_SCALING="1D", NVFP4_2D_SCALING="2D")
  qmod.QuantizeLayout = ns(ROWWISE="ROWWISE", COLWISE="COLWISE", ROWWISE_COLWISE="ROWWISE_COLWISE")
  tej.cpp_extensions, tej.quantize = tex, qmod
  for name, mod in {"transformer_engine": types.ModuleType("transformer_engine"), "transformer_engine.jax": tej,
                    "transformer_engine.jax.cpp_extensions": tex, "transformer_engine.jax.quantize": qmod}.items():
    monkeypatch.setitem(sys.modules, name, mod)


def _by_name(results):
  return {r["check"]: r for r in results}


def test_verify_hardware_wiring_all_checks_pass_against_a_faithful_fake(monkeypatch):
  from maxtext_nvfp4.tools import verify_hardware  # pylint: disable=import-outside-toplevel

  _install_fake_te_quantize(monkeypatch)
  res = verify_hardware.run_checks(m=64, k=128, n=128, seed=1, sr_draws=4)
  assert len(res) == 6
  assert all(r["passed"] for r in res), [r for r in res if not r["passed"]]
  by = _by_name(res)
  assert by["quantize x 1x16 RNE"]["elements"] == 64 * 128
  assert 0 < by["GEMM fprop x@w (1x16 x 16x16)"]["rel_frobenius"] < 8e-3


def test_verify_hardware_wiring_detects_broken_kernels(monkeypatch):
  from maxtext_nvfp4.tools import verify_hardware  # pylint: disable=import-outside-toplevel

  _install_fake_te_quantize(monkeypatch, flip_one=True, sr_zeros=True, gemm_scale=1.02)
  by = _by_name(verify_hardware.run_checks(m=64, k=128, n=128, seed=1, sr_draws=4))
  assert not by["quantize x 1x16 RNE"]["passed"] and by["quantize x 1x16 RNE"]["data_mismatches"] == 1
  assert by["quantize w 16x16 RNE"]["passed"] and by["quantize xT 1x16 RHT RNE"]["passed"]
  sr = by["quantize dy 1x16 SR"]
  assert not sr["passed"] and not sr["not_degenerate"]  # the sm_120 "SR gives zeros" failure mode
  assert not by["GEMM fprop x@w (1x16 x 16x16)"]["passed"]
  assert not by["GEMM wgrad xT@dy (RHT)"]["passed"]


def test_verify_hardware_exits_2_with_reason_off_blackwell():
  from maxtext_nvfp4.tools import verify_hardware  # pylint: disable=import-outside-toplevel

  if _blackwell_with_te():
    pytest.skip("this host can run TE NVFP4")
  assert verify_hardware.cli_main([]) == 2
