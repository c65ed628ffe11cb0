"""One projection through the TE backend, traced by real Transformer Engine for a B200: what each GEMM becomes.

MaxText's ``DenseGeneral`` with our adapter (:mod:`maxtext_nvfp4.integration.te_quantization`) and real TE JAX:
the lowered program's TE custom calls, which quantized operand feeds which GEMM, and each call's configuration as
TE wrote it (``mhlo.backend_config``). Every recipe switch of ``Nvfp4Settings`` is checked where it must land in
TE's program. Lowering only (no XLA compile: seconds per case).
"""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from maxtext_nvfp4.backends import targets
from maxtext_nvfp4.core import nvfp4
from maxtext_nvfp4.core import settings as settings_mod
from maxtext_nvfp4.integration import te_quantization

import te_program  # pylint: disable=wrong-import-order

K, N, M = 256, 512, 128


def _te():
  import transformer_engine_jax as tej  # pylint: disable=import-outside-toplevel # pytype: disable=import-error

  return tej


def _modes():
  tej = _te()
  return types.SimpleNamespace(nvfp4_1d=int(tej.JAXX_Scaling_Mode.NVFP4_1D_SCALING),
                               nvfp4_2d=int(tej.JAXX_Scaling_Mode.NVFP4_2D_SCALING),
                               fp8_current=int(tej.JAXX_Scaling_Mode.CURRENT_TENSOR_SCALING),
                               rowwise_colwise=int(tej.JAXX_Quantize_Layout.ROWWISE_COLWISE))


def _lowered(settings, precision="nvfp4", *, kernel_axes=("embed", "mlp"), steps=10):
  """Lowered StableHLO text of fwd+bwd of one DenseGeneral(K -> N) on a compile-only B200."""
  import maxtext_nvfp4  # pylint: disable=import-outside-toplevel

  maxtext_nvfp4.register()
  from maxtext.layers import linears, quantizations  # pylint: disable=import-outside-toplevel

  q = te_quantization.make_te_quantization(
      quantizations.TransformerEngineQuantization, types.SimpleNamespace(te_comm_gemm_overlap="disabled", steps=steps),
      settings, lambda axes: precision)

  def fwd_bwd(x):
    layer = linears.DenseGeneral(K, N, kernel_axes=kernel_axes, quant=q, dtype=jnp.bfloat16,
                                 weight_dtype=jnp.float32, rngs=nnx.Rngs(params=0, dropout=1, aqt=2))
    return nnx.grad(lambda layer, x: jnp.sum(layer(x).astype(jnp.float32) ** 2), argnums=(0, 1))(layer, x)

  mesh = jax.sharding.Mesh(targets.devices("b200", 1), ("fsdp",))
  with jax.set_mesh(mesh):
    x = jax.ShapeDtypeStruct((M, K), jnp.bfloat16,
                             sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    return jax.jit(fwd_bwd).lower(x).as_text()


def _by_role(text):
  """{"fprop"|"dgrad"|"wgrad": (gemm, lhs (quantize, output), rhs (quantize, output))} by which operand is which.

  fprop reads W's quantize and not dy's; dgrad reads dy's and W's; wgrad reads x's and dy's.
  """
  gemms = te_program.gemm_operand_sources(text)
  assert len(gemms) == 3, [g.config for g, *_ in gemms]
  quantizes = [c for c in te_program.calls(text) if c.target == "te_dbias_quantize_ffi"]
  assert len(quantizes) == 3, [c.config for c in quantizes]
  x_q, w_q, dy_q = quantizes  # program order: x, then W (forward), then dy (backward)
  roles = {}
  for g, lhs, rhs in gemms:
    pair = (lhs[0], rhs[0])
    if pair == (x_q, w_q):
      roles["fprop"] = (g, lhs, rhs)
    elif pair == (dy_q, w_q):
      roles["dgrad"] = (g, lhs, rhs)
    elif pair == (x_q, dy_q):
      roles["wgrad"] = (g, lhs, rhs)
  assert set(roles) == {"fprop", "dgrad", "wgrad"}, [(lhs[0] and lhs[0].name, rhs[0] and rhs[0].name)
                                                     for _, lhs, rhs in gemms]
  return roles, (x_q, w_q, dy_q)


def test_standard_recipe_each_gemm_reads_the_operands_te_recipe_prescribes():
  """TE's NVFP4BlockScaling as our defaults ask: x 1x16 (RHT on its column-wise copy, the wgrad operand), W 16x16
  (2D, no RHT), dy 1x16 with stochastic rounding and RHT on its column-wise copy; all three GEMMs NVFP4_1D."""
  text = _lowered(settings_mod.Nvfp4Settings())
  modes = _modes()
  assert te_program.counts(text) == {"te_rht_amax_ffi": 2, "te_dbias_quantize_ffi": 3, "te_gemm_v2_ffi": 3}
  roles, (x_q, w_q, dy_q) = _by_role(text)
  assert x_q.config["scaling_mode"] == modes.nvfp4_1d
  assert (x_q.config["use_rht"], x_q.config["stochastic_rounding"]) == (True, False)
  assert (w_q.config["scaling_mode"], w_q.config["use_rht"], w_q.config["stochastic_rounding"]) == (
      modes.nvfp4_2d, False, False)
  assert (dy_q.config["scaling_mode"], dy_q.config["use_rht"], dy_q.config["stochastic_rounding"]) == (
      modes.nvfp4_1d, True, True)
  assert {q.config["q_layout"] for q in (x_q, w_q, dy_q)} == {modes.rowwise_colwise}
  for role, (g, _, _) in roles.items():
    assert g.config["scaling_mode"] == modes.nvfp4_1d, role
  # Row-wise copies (output 0) feed fprop's lhs and dgrad's lhs; the column-wise ones (RHT applied: output 1) wgrad.
  assert roles["fprop"][1][1] == 0 and roles["dgrad"][1][1] == 0
  assert roles["wgrad"][1][1] == 1 and roles["wgrad"][2][1] == 1


def test_te_rht_sign_mask_is_the_emulations_rht():
  """TE's 16-point Hadamard transform's random signs (``rht_matrix_random_sign_mask_t``, bit i = sign of column i
  is -1) equal the emulation's ``nvfp4.RHT_SIGNS``: both sides transform the wgrad operands the same way."""
  text = _lowered(settings_mod.Nvfp4Settings())
  masks = {c.config["rht_matrix_random_sign_mask_t"] for c in te_program.calls(text) if c.target == "te_rht_amax_ffi"}
  ours = sum(1 << i for i, sign in enumerate(nvfp4.RHT_SIGNS) if sign < 0)
  assert masks == {ours}, (masks, ours)


@pytest.mark.parametrize("switch, check", [
    ("rht", lambda x_q, w_q, dy_q, c: c.get("te_rht_amax_ffi", 0) == 0 and not x_q["use_rht"] and not dy_q["use_rht"]),
    ("stochastic_rounding", lambda x_q, w_q, dy_q, c: not dy_q["stochastic_rounding"] and dy_q["use_rht"]),
])
def test_each_recipe_switch_reaches_te(switch, check):
  s = settings_mod.Nvfp4Settings(**{switch: False})
  text = _lowered(s)
  _, (x_q, w_q, dy_q) = _by_role(text)
  assert check(x_q.config, w_q.config, dy_q.config, te_program.counts(text)), [x_q.config, w_q.config, dy_q.config]


def test_1d_weights_reach_te_as_nvfp4_1d():
  """``nvfp4_2d_weights=false`` (with ``nvfp4_rht=false``; TE refuses 1D weights under RHT): W quantized 1x16."""
  text = _lowered(settings_mod.Nvfp4Settings(two_d_weights=False, rht=False))
  _, (_, w_q, _) = _by_role(text)
  assert w_q.config["scaling_mode"] == _modes().nvfp4_1d


def test_fp8_fallback_is_te_current_scaling_and_bf16_never_reaches_te():
  """The plan's ``fp8`` GEMMs are TE's Float8CurrentScaling (every quantize and GEMM in current tensor scaling);
  its ``bf16`` GEMMs are a plain dot with no TE call at all."""
  modes = _modes()
  fp8 = _lowered(settings_mod.Nvfp4Settings(), precision="fp8")
  calls = te_program.calls(fp8)
  assert {c.target for c in calls} >= {"te_gemm_v2_ffi", "te_dbias_quantize_ffi"}
  assert {c.config["scaling_mode"] for c in calls if "scaling_mode" in c.config} == {modes.fp8_current}
  bf16 = _lowered(settings_mod.Nvfp4Settings(), precision="bf16")
  assert te_program.counts(bf16) == {}
  assert "stablehlo.dot_general" in bf16


def test_late_switch_compiles_both_te_recipes_into_one_program():
  """``nvfp4_switch_at_step`` to fp8: the NVFP4 dense and TE's FP8 dense are both in the program, under a cond."""
  modes = _modes()
  text = _lowered(settings_mod.Nvfp4Settings(switch_at_step=5, switch_to="fp8", switch_scope="all"))
  gemm_modes = {c.config["scaling_mode"] for c in te_program.calls(text) if c.target == "te_gemm_v2_ffi"}
  assert gemm_modes == {modes.nvfp4_1d, modes.fp8_current}
  assert "stablehlo.case" in text or "stablehlo.if" in text


def test_quantized_shapes_are_tes_blocks():
  """The scale tensors TE allocates: one E4M3 scale per 1x16 block of x (padded to TE's 128x4 tile) and per 16x16
  tile of W -- read from the quantize calls' result types (a change of TE's layout fails here, not on a B200)."""
  text = _lowered(settings_mod.Nvfp4Settings())
  line = next(l for l in text.splitlines() if "@te_dbias_quantize_ffi" in l)
  result_types = line.rsplit("->", 1)[1]
  assert "f4E2M1FN" in result_types and "f8E4M3FN" in result_types, result_types
  shapes = [tuple(int(d) for d in s.split("x")[:-1]) for s in re.findall(r"tensor<([\dx]+x\w+)>", result_types)]
  assert (M, K) in shapes, shapes  # the row-wise FP4 data
  assert any(np.prod(s) >= M * K // 16 for s in shapes if len(s) == 2 and s != (M, K)), shapes
