"""The Quantization object inside MaxText's model: which GEMM gets which (layer, role) and precision."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maxtext_nvfp4
from maxtext_nvfp4.core import gemm
from maxtext_nvfp4.core import prng
from maxtext_nvfp4.core import settings as settings_lib
from maxtext_nvfp4.integration import linen_gemm
from maxtext_nvfp4.integration import step as step_lib
from maxtext_nvfp4.core import plan
from maxtext_nvfp4.integration.maxtext_versions import v0_2_5
from maxtext_helpers import tiny_argv

from maxtext.configs import pyconfig  # pylint: disable=wrong-import-order
from maxtext.layers import quantizations  # pylint: disable=wrong-import-order
from maxtext.utils import model_creation_utils  # pylint: disable=wrong-import-order

maxtext_nvfp4.register()  # MaxText accepts quantization=nvfp4 (importing the package registers nothing)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))  # model_families

MAXTEXT = v0_2_5.ADAPTER  # the kernel-axes signatures the locator is given (data, as core/ receives them)

# The MaxText module path (below decoder/layers_i) of each role, llama2 decoder block.
ROLE_PATHS = {
    ("self_attention", "query"): "query",
    ("self_attention", "key"): "key",
    ("self_attention", "value"): "value",
    ("self_attention", "out"): "out",
    ("mlp", "wi_0"): "wi_0",
    ("mlp", "wi_1"): "wi_1",
    ("mlp", "wo"): "wo",
}
# Construction order of one llama2 decoder layer's projections, by kernel axes.
LAYER_AXES = [
    ("embed_attn", "q_heads", "kv"),
    ("embed_attn", "kv_heads", "kv_head_dim"),
    ("embed_attn", "kv_heads", "kv_head_dim"),
    ("heads", "kv", "embed_attn"),
    ("embed", "mlp"),
    ("embed", "mlp"),
    ("mlp", "embed"),
]


def _config(**overrides):
  return pyconfig.initialize(tiny_argv(quantization="nvfp4", **overrides))


def _quantized_modules(config):
  """``{module path: Nvfp4DotGeneral}`` of an abstract (shape-only) model built by MaxText."""
  _, model = model_creation_utils.create_nnx_abstract_model(config)
  cls = linen_gemm.linen_module_class()  # pylint: disable=protected-access
  found = {}
  for path, node in nnx.iter_graph(model):
    if isinstance(node, nnx.Module) and isinstance(getattr(node, "to_nnx__module", None), cls):
      found[tuple(str(p) for p in path)] = node.to_nnx__module
  return found


@pytest.fixture(scope="module")
def unscanned():
  return _quantized_modules(_config(nvfp4_keep_first_layers=1, nvfp4_targets="mlp", nvfp4_switch_at_step=2,
                                    nvfp4_switch_scope="all"))


def test_layer_and_role_match_module_structure(unscanned):
  # VERIFIES the ordering assumption: the counted (layer, role) equals MaxText's decoder/layers_i/<role>.
  assert len(unscanned) == 3 * 7
  for path, m in unscanned.items():
    assert path[0] == "decoder" and path[1].startswith("layers_"), path
    assert m.layer == int(path[1][len("layers_"):]), path
    assert m.role == ROLE_PATHS[(path[2], path[3])], path


def test_only_decoder_projections_are_quantized(unscanned):
  # Embeddings, logits and attention scores never get the quant object.
  assert not any("logits" in "/".join(p) or "embed" in "/".join(p) or "attention_op" in "/".join(p) for p in unscanned)


def test_recipes_follow_the_plan(unscanned):
  s = settings_lib.from_config(_config(nvfp4_keep_first_layers=1, nvfp4_targets="mlp", nvfp4_switch_at_step=2,
                                         nvfp4_switch_scope="all"))
  for m in unscanned.values():
    nvfp4 = m.layer >= 1 and m.role in plan.MLP_ROLES
    if not nvfp4:  # kept layer 0 and attention (untargeted): plain BF16, no emulation at all
      assert m.recipe is None and m.switched is None, (m.layer, m.role)
      continue
    want, want_after = plan.gemm_recipes(s, layer=m.layer, role=m.role, num_layers=3)
    assert m.recipe == want and m.switched == want_after and m.switch_step == 2
    assert (m.recipe.fprop, m.recipe.dgrad, m.recipe.wgrad) == ("nvfp4",) * 3
    assert (m.switched.fprop, m.switched.dgrad, m.switched.wgrad) == ("bf16",) * 3


def test_scanned_layers_have_no_layer_index():
  found = _quantized_modules(_config(scan_layers=True))
  assert sorted(m.role for m in found.values()) == sorted(ROLE_PATHS.values())
  assert all(m.layer is None and m.recipe is not None for m in found.values())


def _build(q, n_layers):
  """Call dot_general_cls as MaxText does for ``n_layers`` layers: ``[(layer, role, linen module)]``."""
  out = []
  for _ in range(n_layers):
    for axes in LAYER_AXES:
      part = q.dot_general_cls(mesh_axes=axes)
      m = part()
      out.append((m.layer, m.role, m))
  return out


def _mlp_operands():
  kx, kw = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (2, 32, 64), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (64, 128), jnp.float32) * 0.1).astype(jnp.bfloat16)
  return x, w, (((2,), (0,)), ((), ()))


def test_counting_is_fresh_per_object_and_wraps_around():
  c = _config()
  q = quantizations.configure_quantization(c)
  got = [(l, r) for l, r, _ in _build(q, 3)]
  assert got == [(l, r) for l in range(3) for r in plan.decoder_roles()]
  # A second model built from the same object (e.g. eval_shape, then real): indices start over.
  assert [(l, r) for l, r, _ in _build(q, 1)] == [(0, r) for r in plan.decoder_roles()]
  q2 = quantizations.configure_quantization(c)
  assert q2.dot_general_cls(mesh_axes=("mlp", "embed"))().layer == 0


def test_unknown_projection_is_rejected():
  q = quantizations.configure_quantization(_config())
  with pytest.raises(ValueError, match="cannot identify"):
    q.dot_general_cls(mesh_axes=(None, None, None))


@pytest.mark.parametrize("fallback", ["bf16", "fp8"])
def test_kept_layer_equals_fallback_exactly_and_nvfp4_layer_differs(fallback):
  q = quantizations.configure_quantization(_config(nvfp4_keep_first_layers=1, nvfp4_fallback=fallback))
  mods = {(l, r): m for l, r, m in _build(q, 3)}
  x, w, dn = _mlp_operands()
  plain = jax.lax.dot_general(x, w, dn)
  kept = mods[(0, "wi_0")].apply({}, x, w, dn)
  quant = mods[(1, "wi_0")].apply({}, x, w, dn)
  if fallback == "bf16":
    np.testing.assert_array_equal(np.asarray(kept, np.float32), np.asarray(plain, np.float32))
  else:
    fp8 = gemm.dot_general(x, w, dn, recipe=gemm.GemmRecipe(fprop="fp8", dgrad="fp8", wgrad="fp8"))
    np.testing.assert_array_equal(np.asarray(kept, np.float32), np.asarray(fp8, np.float32))
    assert not np.array_equal(np.asarray(kept, np.float32), np.asarray(plain, np.float32))
  nv = gemm.dot_general(x, w, dn, recipe=gemm.GemmRecipe(), key=plan.sr_key(0, 0, 1, "wi_0"))
  np.testing.assert_array_equal(np.asarray(quant, np.float32), np.asarray(nv, np.float32))
  assert not np.array_equal(np.asarray(quant, np.float32), np.asarray(plain, np.float32))
  assert quant.dtype == plain.dtype == kept.dtype


def test_untargeted_fp8_fallback_goes_through_the_fp8_emulation():
  q = quantizations.configure_quantization(_config(nvfp4_targets="attention", nvfp4_fallback="fp8"))
  mods = {(l, r): m for l, r, m in _build(q, 1)}
  assert mods[(0, "wo")].recipe == gemm.GemmRecipe(fprop="fp8", dgrad="fp8", wgrad="fp8")
  assert mods[(0, "query")].recipe == gemm.GemmRecipe()


def _dgrad(module, step):
  x, w, dn = _mlp_operands()

  def loss(x):
    with step_lib.step_context(step):
      return jnp.sum(module.apply({}, x, w, dn).astype(jnp.float32) * jnp.arange(128, dtype=jnp.float32))

  return np.asarray(jax.jit(jax.grad(loss))(x), np.float32)


def test_sr_randomness_fresh_per_step_and_layer_and_reproducible():
  q = quantizations.configure_quantization(_config())
  mods = {(l, r): m for l, r, m in _build(q, 2)}
  a0 = _dgrad(mods[(0, "wi_0")], 0)
  np.testing.assert_array_equal(a0, _dgrad(mods[(0, "wi_0")], 0))  # same step: same SR bits
  assert not np.array_equal(a0, _dgrad(mods[(0, "wi_0")], 1))  # next step: fresh
  assert not np.array_equal(a0, _dgrad(mods[(1, "wi_0")], 0))  # next layer: fresh
  assert not np.array_equal(a0, _dgrad(mods[(0, "wi_1")], 0))  # other role: fresh


def test_sr_key_is_the_documented_fold_in_chain():
  k = jax.random.key(3, impl="threefry2x32")
  want = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(k, 5), 2), plan.ROLE_IDS["wo"])
  got = plan.sr_key(3, 5, 2, "wo")
  np.testing.assert_array_equal(jax.random.key_data(prng.resolve(got)), jax.random.key_data(want))


def test_switch_selects_the_switched_recipe_by_traced_step():
  q = quantizations.configure_quantization(_config(nvfp4_switch_at_step=2, steps=4, nvfp4_stochastic_rounding=False))
  m = {(l, r): m for l, r, m in _build(q, 1)}[(0, "wi_0")]
  x, w, dn = _mlp_operands()
  plain = np.asarray(jax.lax.dot_general(x, w, dn), np.float32)
  traces = []

  @jax.jit
  def fwd(step):
    traces.append(1)
    with step_lib.step_context(step):
      return m.apply({}, x, w, dn)

  before = [np.asarray(fwd(jnp.int32(s)), np.float32) for s in (0, 1)]
  after = [np.asarray(fwd(jnp.int32(s)), np.float32) for s in (2, 3)]
  assert len(traces) == 1  # one trace for all steps: no recompilation at the switch
  for y in after:
    np.testing.assert_array_equal(y, plain)  # forward scope: fprop in bf16 from step 2
  for y in before:
    assert not np.array_equal(y, plain)


def test_step_wrapper_publishes_the_optimizer_step():
  seen = []

  def train_step(model, config, state_mesh_shardings, params_shardings, state, data, dropout_rng=None):
    seen.append(step_lib.current_step())
    return state

  wrapped = step_lib.with_step(train_step)  # pylint: disable=protected-access
  wrapped(None, None, None, None, {"optimizer": {"step": 7}}, None)
  wrapped(None, None, None, None, state={"optimizer": {"step": 9}}, data=None)
  assert seen == [7, 9] and step_lib.current_step() is None


def test_no_state_added_to_the_model():
  # The checkpointed state (params, optimizer inputs, rng counters) of an nvfp4 model is the bf16 one.
  def leaves(**overrides):
    _, model = model_creation_utils.create_nnx_abstract_model(pyconfig.initialize(tiny_argv(**overrides)))
    return {tuple(map(str, p)): (v.shape, v.dtype) for p, v in nnx.to_flat_state(nnx.state(model))}

  bf16 = leaves(quantization="")
  assert any("wi_0" in p for p in bf16)
  assert leaves(quantization="nvfp4", nvfp4_fallback="fp8") == bf16


def test_te_plan_counts_like_the_emulation():
  c = _config(nvfp4_keep_first_layers=1, nvfp4_targets="attention")
  s = settings_lib.from_config(c)
  fresh = lambda: plan.FpropPlan(settings=s, locator=plan.GemmLocator(num_layers=3, signatures=MAXTEXT.kernel_signatures))  # noqa: E731
  p = fresh()
  got = [p(axes) for _ in range(3) for axes in LAYER_AXES]
  want = [("nvfp4" if l >= 1 and r in plan.ATTENTION_ROLES else "bf16") for l in range(3) for r in plan.decoder_roles()]
  assert got == want
  assert p == fresh() and hash(p) == hash(fresh())


def _same_numbers_and_one_report_per_expert(run_off, run_on, experts: int) -> dict:
  """``run_off()`` and ``run_on()`` (loss, grads) of layer 0's first expert linear with diagnostics off / on are
  equal bit for bit, and the run with them on reported one x, W and dy per expert to ``experts_first``;
  returns those reports (``{(group, tensor): [report per expert]}``)."""
  from maxtext_nvfp4.core import diagnostics  # pylint: disable=import-outside-toplevel

  diagnostics.AGGREGATOR.clear()
  (l0, g0), (l1, g1) = run_off(), run_on()
  jax.effects_barrier()
  np.testing.assert_array_equal(np.asarray(l0), np.asarray(l1))
  for a, b in zip(g0, g1):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  reports = diagnostics.AGGREGATOR._data[0]  # pylint: disable=protected-access
  diagnostics.AGGREGATOR.clear()
  assert {k: len(v) for k, v in reports.items()} == {("experts_first", t): experts for t in diagnostics.TENSORS}
  return reports


def test_moe_expert_einsum_reports_each_expert_when_diagnostics_are_on():
  """RoutedMoE's expert einsum (sparse_matmul=false) from our Quantization: with diagnostics on, the same
  numbers as with them off, and one x / W / dy report per expert in the ``experts_*`` group of its layer."""
  import model_families  # pylint: disable=import-outside-toplevel  (benchmarks/: the families' tiny configs)
  from maxtext_nvfp4.integration import quantization, touchpoints  # pylint: disable=import-outside-toplevel

  wi_axes, _ = touchpoints.adapter().expert_kernel_axes

  def expert_einsum(**keys):
    c = pyconfig.initialize(model_families.family_argv("mixtral", None, "nvfp4", **keys))
    return quantization.make_quantization(c).einsum(mesh_axes=wi_axes)  # the first expert linear: layer 0

  e, tokens, d, f = 4, 32, 64, 32
  x = jax.random.normal(jax.random.key(7), (e, tokens, d), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(jax.random.key(8), (e, d, f), jnp.float32) * 0.05).astype(jnp.bfloat16)

  def grads(einsum):
    def loss(x, w):
      with step_lib.step_context(jnp.int32(0), training=True):
        y = einsum("EBM,EMH->EBH", x, w)
      return jnp.sum(y.astype(jnp.float32) * jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape) / y.size)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)

  _same_numbers_and_one_report_per_expert(lambda: grads(expert_einsum()),
                                          lambda: grads(expert_einsum(nvfp4_diagnostics=True,
                                                                      nvfp4_diagnostics_interval=1)), e)


def test_sparse_moe_expert_gemm_reports_each_experts_token_group_when_diagnostics_are_on():
  """The grouped-GEMM path (sparse_matmul=true): with diagnostics on, the emulated gmm computes the same numbers
  and reports one x / W / dy per expert, x being the expert's token buffer (its group's rows, then zeros)."""
  import model_families  # pylint: disable=import-outside-toplevel  (benchmarks/: the families' tiny configs)
  from maxtext_nvfp4.integration import quantization, sparse_moe  # pylint: disable=import-outside-toplevel

  def first_expert_linear(**keys):
    c = pyconfig.initialize(model_families.family_argv("qwen3_moe", None, "nvfp4", sparse_matmul=True, **keys))
    return quantization.make_quantization(c).expert_gemms()[0]  # layer 0's expert_wi_0

  e, m, d, f = 4, 48, 64, 32
  group_sizes = jnp.asarray([20, 0, 12, 16], jnp.int32)
  lhs = jax.random.normal(jax.random.key(9), (m, d), jnp.float32).astype(jnp.bfloat16)
  rhs = (jax.random.normal(jax.random.key(10), (e, d, f), jnp.float32) * 0.05).astype(jnp.bfloat16)

  def grads(g):
    def loss(lhs, rhs):
      with step_lib.step_context(jnp.int32(0), training=True):
        y = sparse_moe._emulated([g], lhs, rhs, group_sizes, jnp.float32)  # pylint: disable=protected-access
      return jnp.sum(y * jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape) / y.size)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(lhs, rhs)

  off, on = first_expert_linear(), first_expert_linear(nvfp4_diagnostics=True, nvfp4_diagnostics_interval=1)
  assert (off.diag_group, on.diag_group, on.role) == (None, "experts_first", "expert_wi_0")
  reports = _same_numbers_and_one_report_per_expert(lambda: grads(off), lambda: grads(on), e)
  # expert e's x holds its group's rows: the non-zero counts are the group sizes times d (an empty group: 0)
  assert [r["nonzero"] for r in reports[("experts_first", "x")]] == [float(n * d) for n in group_sizes]
