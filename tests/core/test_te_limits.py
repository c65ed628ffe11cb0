"""TE's NVFP4 shape/dtype limits (maxtext_nvfp4/core/te_limits.py) and their three uses.

Pure-function tests first (milliseconds); then one MaxText config build per use (the TE backend's
config-time refusal -- a one-line config error, exit 2 under the train CLI as tests/integration/test_plugin_config.py
checks for every config error -- and the emulation's start-up line).
"""

import glob
import os

import pytest

from maxtext_nvfp4.backends import capability
from maxtext_nvfp4.backends import te as te_backend
from maxtext_nvfp4.core import settings as settings_mod
from maxtext_nvfp4.core import te_limits
from maxtext_nvfp4.tools import recipes as recipes_mod

from maxtext_helpers import tiny_argv

RECIPES = os.path.join(os.path.dirname(__file__), "..", "..", "recipes")
# Recipes meant for Blackwell + TE (and the single-GPU proxy, which must also run on TE once on Blackwell).
BLACKWELL = ("llama3_8b_", "llama3.1_405b_", "proxy_1gpu_")


def _dims(**kw):
  base = dict(layers="every layer", role="wi_0", tokens=8192, k=4096, n=14336, dtype="bfloat16",
              nvfp4_passes=("fprop", "dgrad", "wgrad"))
  return te_limits.GemmDims(**{**base, **kw})


def _broken(g, rht=True, two_d_weights=True):
  return sorted((r.gemm, r.dimension.split(" (")[0], r.size, r.multiple)
                for r in te_limits.refusals(g, rht=rht, two_d_weights=two_d_weights))


def test_llama_shapes_pass_every_rule():
  assert _broken(_dims()) == []
  assert te_limits.check({"quantization": "nvfp4"}) == []  # no model dimensions: nothing to decide


@pytest.mark.parametrize("kw, rht, two_d, want", [
    # K = 200: fprop contraction (cuBLAS 32 is the strictest broken), W tiles in dgrad (16), RHT columns of x.
    (dict(k=200), True, True, [("dgrad", "K", 200, 16), ("fprop", "K", 200, 32), ("wgrad", "K", 200, 128)]),
    # K = 48: a multiple of 16 (blocks fine) but not of 32 (cuBLAS) nor 128 (RHT).
    (dict(k=48), True, True, [("fprop", "K", 48, 32), ("wgrad", "K", 48, 128)]),
    (dict(k=48), False, True, [("fprop", "K", 48, 32)]),  # no RHT: no RHT rule
    # N = 200: W tiles in fprop only with 2D weights; dgrad contraction; RHT columns of dy.
    (dict(n=200), True, True, [("dgrad", "N", 200, 32), ("fprop", "N", 200, 16), ("wgrad", "N", 200, 128)]),
    (dict(n=200), False, False, [("dgrad", "N", 200, 32)]),
    # tokens = 96: blocks (16) and cuBLAS (32) fine, RHT rows (64) broken.
    (dict(tokens=96), True, True, [("wgrad", "M tokens", 96, 64)]),
    (dict(tokens=96), False, True, []),
    # Only NVFP4 passes are checked: an fp8/bf16 wgrad has no RHT limits.
    (dict(k=48, nvfp4_passes=("fprop", "dgrad")), True, True, [("fprop", "K", 48, 32)]),
    (dict(k=200, nvfp4_passes=()), True, True, []),
])
def test_each_rule_fires_exactly_when_broken(kw, rht, two_d, want):
  assert _broken(_dims(**kw), rht=rht, two_d_weights=two_d) == want


def test_rht_needs_bf16_operands():
  refs = te_limits.refusals(_dims(dtype="float32"), rht=True, two_d_weights=True)
  assert [(r.gemm, r.multiple) for r in refs] == [("wgrad", 0)] and "float32" in refs[0].text()
  assert te_limits.refusals(_dims(dtype="float32"), rht=False, two_d_weights=True) == []


def _check(recipe, *overrides):
  return te_limits.check(recipes_mod.resolve([recipe, *overrides]).values)


def test_every_shipped_recipe_checked_blackwell_ones_pass():
  paths = sorted(glob.glob(os.path.join(RECIPES, "*.yml")))
  blackwell = [p for p in paths if os.path.basename(p).startswith(BLACKWELL)]
  assert len(blackwell) >= 10, blackwell
  for p in paths:
    values = recipes_mod.resolve([p]).values
    refs = te_limits.check(values)
    if os.path.basename(p).startswith(BLACKWELL):
      assert refs == [], (p, te_limits.summary(refs))
    # The check really looked at the GEMMs: every recipe has decoder projections with NVFP4 passes (an MoE
    # recipe without shared experts has no dense MLP: its attention projections; TE never runs the experts).
    moe = int(values.get("num_experts", 1) or 1) > 1 and not values.get("shared_experts")
    assert len(te_limits.decoder_gemms(values)) >= (4 if moe else 7), p


def test_demo_with_mlp_dim_200_is_summarised_per_limit_with_the_key_to_change():
  refs = _check(os.path.join(RECIPES, "demo_nvfp4.yml"), "base_mlp_dim=200")
  assert {r.role for r in refs} == {"wi_0", "wi_1", "wo"}  # attention shapes are fine
  assert {r.keys for r in refs} == {("base_mlp_dim",)}
  lines = te_limits.summary(refs).splitlines()
  assert lines[0].startswith("Transformer Engine would refuse: 6 NVFP4 GEMM limit(s)") and "per device shard" in lines[0]
  # wi_0 and wi_1 break the same limits: one line each limit, both roles named
  assert "  N (W 16x16 tiles) = 200, not a multiple of 16: fprop of wi_0,wi_1 in layers 0-3" in lines[1], lines
  assert lines[-2].startswith("  ... and 2 more (maxtext-nvfp4 doctor")
  assert lines[-1].startswith("  to run on TE: change base_mlp_dim;") and "nvfp4_targets" in lines[-1], lines
  assert len(lines) == 7 and max(map(len, lines)) <= 160, lines


def test_one_limit_broken_by_every_projection_of_126_layers_is_one_line():
  recipe = os.path.join(RECIPES, "llama3.1_405b_nvfp4.yml")
  for scan, where in (("false", "in layers 0-125"), ("true", "in every layer")):  # the recipe scans its layers
    values = recipes_mod.resolve([recipe, "max_target_length=8", f"scan_layers={scan}"]).values
    lines = te_limits.summary(te_limits.check(values)).splitlines()
    assert lines[1] == ("  M tokens (RHT rows of x and dy) = 8, not a multiple of 64: wgrad of query,key,value,out,wi_0,"
                        f"wi_1,wo {where} (RHT cast fusion)"), lines
    assert len(lines) == 3 and "change per_device_batch_size, max_target_length;" in lines[2], lines


def test_tensor_parallelism_checks_the_per_device_shard():
  # 8B under TP 16: MLP 14336/16 = 896 (7 * 128) is fine, the 8 kv heads x 128 split 16 ways are 64 columns
  # per device: the RHT of dy for key/value needs 128. On one device nothing is refused.
  values = recipes_mod.resolve([os.path.join(RECIPES, "llama3_8b_nvfp4.yml")]).values
  assert te_limits.check({**values, "ici_tensor_parallelism": 1}) == []
  refs = te_limits.check({**values, "ici_tensor_parallelism": 16})
  assert sorted((r.role, r.gemm, r.size, r.multiple) for r in refs) == [("key", "wgrad", 64, 128),
                                                                       ("value", "wgrad", 64, 128)]
  assert te_limits.fix_keys(refs) == ["base_num_kv_heads", "head_dim", "ici_tensor_parallelism"]


def test_kept_layers_and_targets_only_check_nvfp4_gemms():
  demo = os.path.join(RECIPES, "demo_nvfp4.yml")
  assert _check(demo, "base_mlp_dim=200", "nvfp4_targets=attention") == []
  refs = _check(demo, "base_mlp_dim=200", "nvfp4_keep_last_layers=1")
  assert refs and {r.layers for r in refs} == {"layers 0-2"}


def test_te_backend_refuses_in_one_line_naming_layer_role_dimension_size_rule():
  values = recipes_mod.resolve([os.path.join(RECIPES, "demo_nvfp4.yml"), "base_mlp_dim=200"]).values
  with pytest.raises(capability.BackendError) as e:
    te_backend.check_te_shapes(values, settings_mod.from_config(values))
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith("nvfp4_backend=te: Transformer Engine would refuse layers 0-3 wi_0")
  assert "= 200 is not a multiple of" in msg and "8 more" in msg and "nvfp4_backend=emulate" in msg
  assert "change base_mlp_dim (sizes are per device shard)" in msg
  te_backend.check_te_shapes(recipes_mod.resolve([os.path.join(RECIPES, "llama3_8b_nvfp4.yml")]).values,
                             settings_mod.Nvfp4Settings())  # nothing to refuse: no error


def test_te_backend_refuses_1d_weights_with_rht_in_one_line():
  with pytest.raises(capability.BackendError) as e:
    te_backend.check_te_settings(settings_mod.Nvfp4Settings(two_d_weights=False, rht=True))
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith("nvfp4_2d_weights=false with nvfp4_rht=true") and "nvfp4_rht=false" in msg
  for ok in (dict(two_d_weights=False, rht=False), dict(two_d_weights=True, rht=True)):
    te_backend.check_te_settings(settings_mod.Nvfp4Settings(**ok))


# ---------------------------------------------------------------------------------------------------
# The uses inside MaxText (one config build each).
# ---------------------------------------------------------------------------------------------------
def _config(**overrides):
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
  import maxtext_nvfp4  # pylint: disable=import-outside-toplevel

  maxtext_nvfp4.register()
  return pyconfig.initialize(tiny_argv(**overrides))


def test_te_backend_refusal_at_config_time_before_any_device_check():
  # On this CPU the device check would refuse nvfp4_backend=te too; the shape refusal comes first.
  with pytest.raises(ValueError) as e:
    _config(quantization="nvfp4", nvfp4_backend="te", base_emb_dim=128, head_dim=32, base_mlp_dim=200)
  msg = str(e.value)
  assert "\n" not in msg and "Transformer Engine would refuse" in msg and "wi_0" in msg and "200" in msg, msg


def test_emulation_logs_the_refusal_line_once_at_start_up(capsys):
  from maxtext_nvfp4.integration import quantization  # pylint: disable=import-outside-toplevel

  c = _config(quantization="nvfp4", nvfp4_backend="emulate", base_emb_dim=128, head_dim=32, base_mlp_dim=200)
  quantization.make_quantization(c)
  quantization.make_quantization(c)
  out = capsys.readouterr().out
  lines = [l for l in out.splitlines() if l.startswith("Transformer Engine would refuse:")]
  assert len(lines) == 1 and "per device shard" in lines[0], out
  assert "  N (W 16x16 tiles) = 200, not a multiple of 16: fprop of wi_0,wi_1 in layers 0-2" in out, out


def test_doctor_reports_the_refusals_in_json_and_text():
  from maxtext_nvfp4.tools import doctor  # pylint: disable=import-outside-toplevel

  report = doctor.collect(os.path.join(RECIPES, "demo_nvfp4.yml"), ["base_mlp_dim=200"])
  refused = report["recipe"]["te_refusals"]
  assert len(refused) == 9 and refused[0] == dict(layers="layers 0-3", role="wi_0", gemm="fprop",
                                                  dimension="N (W 16x16 tiles)", size=200, multiple=16,
                                                  rule=refused[0]["rule"], keys=("base_mlp_dim",))
  text = doctor.format_human(report)
  assert "Transformer Engine would refuse: 9 limit(s) broken" in text
  assert "    layers 0-3 wo fprop: K (fprop contraction) = 200 is not a multiple of 32" in text
  assert "  amax of W  over each tensor-parallel shard (TE AmaxScope.FSDP: pmax over fsdp only)" in text
  plain = doctor.collect(os.path.join(RECIPES, "demo_nvfp4.yml"), ["nvfp4_amax_scope=global"])["recipe"]
  assert plain["te_refusals"] == [] and plain["amax_scope"]["x"].startswith("the whole tensor")
