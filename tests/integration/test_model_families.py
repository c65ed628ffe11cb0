"""MaxText model families beyond llama2 in emulated NVFP4: MoE experts, MLA, shared experts (tiny CPU runs).

A representative subset of ``benchmarks/model_families.py`` (its full sweep and results are in docs/usage.md's
model-support table): a DeepSeek-style model (MLA with the low-rank query, one dense layer, routed +
shared experts, MaxText's default no-capacity einsum path) trained in bf16 and in nvfp4. Every expert and projection GEMM must go through our quantizer (traced_gemms);
the router never does. Plus the one-line refusals of the MoE paths we cannot quantize (the grouped-GEMM
path itself: tests/integration/test_moe_sparse.py).
"""

from __future__ import annotations

import os
import sys
import types

import numpy as np
import pytest

import maxtext_nvfp4
from maxtext_nvfp4.core import plan
from maxtext_nvfp4.core import settings as settings_lib
from maxtext_nvfp4.integration import model_layout
from maxtext_nvfp4.integration import moe_refusals
from maxtext_nvfp4.integration import precision_text
from maxtext_nvfp4.integration import traced
from maxtext_helpers import losses

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import model_families  # noqa: E402  pylint: disable=wrong-import-position

maxtext_nvfp4.register()  # MaxText accepts quantization=nvfp4 (importing the package registers nothing)

pytestmark = pytest.mark.slow

STEPS = 2
NVFP4 = ("nvfp4", "nvfp4", "nvfp4")
EXPERTS = set(plan.EXPERT_ROLES)


def _train(family, out, quantization_name, **extra):
  from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel

  traced.traced_gemms(reset=True)
  train.main(model_families.family_argv(family, out, quantization_name, steps=STEPS, **extra))
  name = f"{family}_{quantization_name or 'bf16'}"
  return {"losses": losses(os.path.join(out, f"{name}.jsonl")), "traced": traced.traced_gemms(reset=True)}


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("deepseek"))
  return {"bf16": _train("deepseek", out, ""), "nvfp4": _train("deepseek", out, "nvfp4")}


def test_moe_trains_in_nvfp4_with_finite_losses_different_from_bf16(deepseek):
  a, b = deepseek["bf16"]["losses"], deepseek["nvfp4"]["losses"]
  assert sorted(a) == sorted(b) == list(range(STEPS))
  assert np.isfinite(list(b.values())).all()
  assert any(a[s] != b[s] for s in a), (a, b)
  assert not deepseek["bf16"]["traced"]  # bf16 runs never touch the quantizer


def test_every_expert_mla_shared_and_dense_gemm_goes_through_the_quantizer(deepseek):
  traced = deepseek["nvfp4"]["traced"]
  attention = {"q_a", "q_b", "kv_a", "kv_b", "out"}
  # layer 0: dense (first_num_dense_layers=1); layer 1: routed experts + shared experts (an MlpBlock)
  assert {(l, r) for l, r, _, _ in traced} == {(0, r) for r in attention | {"wi_0", "wi_1", "wo"}} | {
      (1, r) for r in attention | EXPERTS | {"wi_0", "wi_1", "wo"}}
  assert all(before == NVFP4 for (_, _, before, _) in traced)  # and never the router (plain bf16)


def _config(family, **extra):
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

  return pyconfig.initialize(model_families.family_argv(family, None, "nvfp4", **extra))


def test_sparse_matmul_runs_and_te_experts_are_refused_with_one_line():
  # MaxText's default grouped-GEMM path (megablox gmm) is intercepted now (tests/integration/test_moe_sparse.py); its
  # ragged_dot variant is refused (config time already: pyconfig runs check_model)
  cfg = _config("qwen3_moe", sparse_matmul=True)
  s = settings_lib.from_config(cfg)
  moe_refusals.check_model(cfg, s, "emulate", num_devices=1)
  with pytest.raises(settings_lib.SettingsError, match="sparse_matmul=true and megablox=false.*set megablox=true") as e:
    _config("qwen3_moe", sparse_matmul=True, megablox=False)
  assert "\n" not in str(e.value)
  cfg = _config("qwen3_moe")
  with pytest.raises(settings_lib.SettingsError, match="nvfp4_backend=te cannot run the MoE expert GEMMs"):
    moe_refusals.check_model(cfg, s, "te")
  # experts out of the plan (bf16 fallback): the grouped GEMM may run unquantized, TE may run the rest
  moe_refusals.check_model(cfg, settings_lib.Nvfp4Settings(targets="attention"), "te")
  assert model_layout.layout_of(cfg).moe_layers == (0, 1)


@pytest.mark.parametrize("block, extra, want", [
    ("deepseek", {"first_num_dense_layers": 1}, (1, 2, 3)),
    ("llama4", {"interleave_moe_layer_step": 2}, (1, 3)),
    ("mixtral", {}, (0, 1, 2, 3)),
])
def test_moe_layers_per_decoder_block(block, extra, want):
  cfg = types.SimpleNamespace(num_decoder_layers=4, num_experts=4, decoder_block=block, **extra)
  assert model_layout.layout_of(cfg).moe_layers == want
  assert model_layout.layout_of(types.SimpleNamespace(num_decoder_layers=4, num_experts=1)).moe_layers == ()


@pytest.mark.parametrize("recipe", ["demo_moe_nvfp4", "proxy_1gpu_moe_nvfp4"])
def test_moe_recipes_take_the_emulated_expert_path(recipe):
  """The MoE recipes validate in MaxText with the plugin, every layer is MoE, experts are planned in NVFP4
  and nothing is refused (einsum path, emulation)."""
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

  path = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", recipe + ".yml")
  cfg = pyconfig.initialize([None, path, "skip_jax_distributed_system=true", "nvfp4_backend=emulate"])
  s = settings_lib.from_config(cfg)
  moe_refusals.check_model(cfg, s, s.backend)
  assert model_layout.layout_of(cfg).moe_layers == tuple(range(cfg.num_decoder_layers))
  rows = plan.precision_table(s, num_layers=cfg.num_decoder_layers, roles=model_layout.layout_of(cfg).roles)  # pylint: disable=protected-access
  assert {r.role for r in rows if r.fprop == "nvfp4"} >= EXPERTS and {r.fprop for r in rows if r.role == "router"} == {"bf16"}
  assert "router = gate logits, always bf16; dispatch/combine" in precision_text.precision_table_text(cfg)
