"""nvfp4_qat: what each QAT mode's GEMM computes.

* ``serving``: the serving-matched linear (core/serving_gemm.py) multiplies exactly what the export serves --
  its weights are core/serving.py's ``served_weights`` (the export's quantize + decode; fused q/k/v and
  gate/up share one global scale; the query carries the export's sqrt(head_dim)) and its activations
  ``served_activations("nvfp4-w4a4")`` (per token), bit for bit; its output is their fp32 product (divided
  by the query's factor); its gradients are the high-precision straight-through ones of ``forward``.
* ``forward``: the same GEMM recipes as ``nvfp4_backward_override=high_precision``.
* the precision table and the refusals of contradicting keys.
(The trained checkpoint against the export file itself: tests/tools/test_posttrain.py.)
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_nvfp4.core import gemm
from maxtext_nvfp4.core import plan
from maxtext_nvfp4.core import serving
from maxtext_nvfp4.core import serving_gemm
from maxtext_nvfp4.core import settings as settings_lib

EMB, HEADS, KV, HD = 64, 4, 2, 32
C = float(np.float32(np.sqrt(HD)))  # the export's factor on the query (llama2: scale_query_layer)
DIMS = (((2,), (0,)), ((), ()))  # DenseGeneral: x (B, T, emb) . W (emb, heads, head_dim)


@pytest.fixture(scope="module")
def qkv():
  rng = np.random.default_rng(0)
  w = {"q": rng.normal(0, 0.05, (EMB, HEADS, HD)).astype(np.float32),
       "k": rng.normal(0, 0.08, (EMB, KV, HD)).astype(np.float32),
       "v": rng.normal(0, 0.02, (EMB, KV, HD)).astype(np.float32)}
  w["k"][3, 1, 7] = 3.0  # the group's amax sits in k: q and v must use it, as the export's fused scale
  x = rng.normal(0, 1, (2, 16, EMB)).astype(np.float32)
  x[0, 3] *= 40  # one loud token: per-token scales differ from a per-tensor one
  return w, jnp.asarray(x, jnp.bfloat16)


def _export_decode(w):
  """What the export writes for q/k/v, decoded by core/serving.py (HF layout, the query scaled as its hook)."""
  hf = {f"l.{n}_proj.weight": a.reshape(EMB, -1).T * (np.float32(C) if n == "q" else np.float32(1))
        for n, a in w.items()}
  names = [f"l.{n}_proj" for n in ("q", "k", "v")]
  return {n: np.asarray(v) for n, v in serving.served_weights(hf, names, "nvfp4-w4a4").items()}


def test_served_weights_are_the_exports_decode_bit_for_bit(qkv):
  w, _ = qkv
  ref = _export_decode(w)
  group_hf = tuple(jnp.asarray(w[n].reshape(EMB, -1).T) for n in ("q", "k", "v"))
  for i, n in enumerate(("q", "k", "v")):
    got = np.asarray(serving_gemm.served_weights(group_hf, serving_gemm.Member(index=i, factors=(C, 1.0, 1.0))))
    np.testing.assert_array_equal(got.view(np.uint32), ref[f"l.{n}_proj.weight"].view(np.uint32))
  # the fused scale matters: q alone (its own amax) decodes differently
  alone = np.asarray(serving_gemm.served_weights(group_hf[:1], serving_gemm.Member(index=0, factors=(C,))))
  assert not np.array_equal(alone, ref["l.q_proj.weight"])
  # and so does the query's factor
  unscaled = np.asarray(serving_gemm.served_weights(group_hf, serving_gemm.Member(index=0, factors=(1.0, 1.0, 1.0))))
  assert not np.array_equal(unscaled * np.float32(C), ref["l.q_proj.weight"])


def test_serving_forward_is_the_served_linear_and_its_backward_is_high_precision(qkv):
  name, index = "q", 0  # the query: its export factor is divided back out; the other members differ by index only
  w, x = qkv
  member = serving_gemm.Member(index=index, factors=(C, 1.0, 1.0))
  group = (w["q"], w["k"], w["v"])
  kernel = jnp.asarray(w[name], jnp.bfloat16)  # what DenseGeneral hands the GEMM (compute dtype)

  def f(x, k):
    return serving_gemm.dot_general(x, k, DIMS, group=group, member=member, preferred_element_type=jnp.bfloat16)

  y = f(x, kernel)
  d = _export_decode(w)[f"l.{name}_proj.weight"]
  xs = serving.served_activations("nvfp4-w4a4")(jnp.asarray(x, jnp.float32).reshape(-1, EMB))
  ref = xs @ jnp.asarray(d).T
  if name == "q":
    ref = ref / jnp.float32(C)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(ref.astype(jnp.bfloat16).reshape(y.shape), np.float32))
  # gradients: the bf16 passes of core/gemm (= nvfp4_qat=forward / backward_override=high_precision)
  dy = jax.random.normal(jax.random.key(1), y.shape, jnp.bfloat16)
  _, vjp = jax.vjp(f, x, kernel)
  hp = gemm.GemmRecipe(fprop="nvfp4", backward_override="high_precision", stochastic_rounding=False)
  _, vjp_ref = jax.vjp(lambda a, b: gemm.dot_general(a, b, DIMS, recipe=hp, preferred_element_type=jnp.bfloat16),
                       x, kernel)
  for got, want in zip(vjp(dy), vjp_ref(dy)):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_forward_mode_is_backward_override_high_precision():
  qat = settings_lib.Nvfp4Settings(qat="forward")
  override = settings_lib.Nvfp4Settings(backward_override="high_precision")
  for role in ("query", "wo"):
    assert plan.gemm_recipes(qat, layer=1, role=role, num_layers=3) == plan.gemm_recipes(
        override, layer=1, role=role, num_layers=3)
  # an explicit override is kept: forward + dequantized is the bf16 backward on the forward's dequantized operands
  deq = settings_lib.Nvfp4Settings(qat="forward", backward_override="dequantized")
  settings_lib.validate(deq)
  assert plan.gemm_recipes(deq, layer=1, role="wo", num_layers=3)[0].precision("dgrad") == "dequantized"
  full = plan.gemm_recipes(settings_lib.Nvfp4Settings(), layer=1, role="wo", num_layers=3)[0]
  assert full.precision("dgrad") == "nvfp4" and plan.gemm_recipes(qat, layer=1, role="wo", num_layers=3)[0].precision(
      "dgrad") == "bf16"


def test_precision_table_names_each_mode():
  rows = {q: plan.precision_table(settings_lib.Nvfp4Settings(qat=q), num_layers=2)[0]
          for q in settings_lib.QAT_MODES}
  assert (rows["full"].fprop, rows["full"].dgrad, rows["full"].wgrad) == ("nvfp4", "nvfp4", "nvfp4")
  assert (rows["forward"].fprop, rows["forward"].dgrad, rows["forward"].wgrad) == ("nvfp4", "bf16", "bf16")
  assert (rows["serving"].fprop, rows["serving"].dgrad, rows["serving"].wgrad) == ("serve", "bf16", "bf16")


@pytest.mark.parametrize("change,key", [
    (dict(qat="serving", backward_override="dequantized"), "nvfp4_backward_override=dequantized"),
    (dict(qat="serving", four_over_six="weights"), "nvfp4_4over6=weights"),
    (dict(qat="serving", row_scaled_activation=True), "nvfp4_row_scaled_activation=true"),
    (dict(qat="train"), "nvfp4_qat='train'"),
    (dict(qat="serving", backend="te"), "nvfp4_backend=te cannot run nvfp4_qat=serving"),
    (dict(qat="forward", backend="te"), "nvfp4_backend=te cannot run nvfp4_qat=forward"),
])
def test_contradicting_keys_are_one_line(change, key):
  with pytest.raises(settings_lib.SettingsError) as e:
    settings_lib.validate(dataclasses.replace(settings_lib.Nvfp4Settings(), **change))
  assert key in str(e.value) and "\n" not in str(e.value)


def test_te_cannot_run_the_qat_modes_and_auto_emulates():
  from maxtext_nvfp4.backends import capability  # pylint: disable=import-outside-toplevel

  assert capability.te_jax_option_problem(settings_lib.Nvfp4Settings()) is None
  for q in ("forward", "serving"):
    problem = capability.te_jax_option_problem(settings_lib.Nvfp4Settings(qat=q))
    assert problem.startswith(f"nvfp4_qat={q}")
    with pytest.raises(capability.BackendError, match=f"nvfp4_backend=te cannot run nvfp4_qat={q}"):
      capability.choose_backend("te", devices=[], settings=settings_lib.Nvfp4Settings(qat=q))
