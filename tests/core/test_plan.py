"""Selective-precision plan: per (layer, role) precisions and the precision table (pure Python)."""

import pytest

from maxtext_nvfp4.core import plan
from maxtext_nvfp4.integration.maxtext_versions import v0_2_5
from maxtext_nvfp4.core.settings import Nvfp4Settings

MAXTEXT = v0_2_5.ADAPTER  # the kernel-axes signatures the locator is given (data, as core/ receives them)

ROLES = plan.decoder_roles()


def test_decoder_roles_in_construction_order():
  assert ROLES == ("query", "key", "value", "out", "wi_0", "wi_1", "wo")
  assert plan.decoder_roles(num_activations=1) == ("query", "key", "value", "out", "wi", "wo")
  assert plan.decoder_roles(fused_qkv=True, fused_mlp=True) == ("qkv_proj", "out", "wi", "wo")
  assert len(set(plan.ROLE_IDS.values())) == len(plan.ROLE_IDS)


def test_default_everything_nvfp4_no_switch():
  rows = plan.precision_table(Nvfp4Settings(), num_layers=2)
  assert [(r.layer, r.role) for r in rows] == [(l, r) for l in range(2) for r in ROLES]
  for r in rows:
    assert (r.fprop, r.dgrad, r.wgrad) == ("nvfp4",) * 3
    assert (r.fprop_after, r.dgrad_after, r.wgrad_after) == ("nvfp4",) * 3


@pytest.mark.parametrize("targets", ["all", "mlp", "attention"])
@pytest.mark.parametrize("fallback", ["bf16", "fp8"])
def test_table_matches_first_last_targets_fallback(targets, fallback):
  s = Nvfp4Settings(targets=targets, fallback=fallback, keep_first_layers=2, keep_last_layers=1)
  rows = plan.precision_table(s, num_layers=6)
  assert len(rows) == 6 * len(ROLES)
  for r in rows:
    kept = r.layer in (0, 1, 5)
    targeted = targets == "all" or (targets == "mlp") == (r.role in ("wi_0", "wi_1", "wo"))
    want = "nvfp4" if targeted and not kept else fallback
    assert (r.fprop, r.dgrad, r.wgrad) == (want,) * 3, r


def test_paper_setting_62_layers():
  # NVIDIA's 12B recipe: first 2 and last 8 of 62 blocks in BF16 (~16% of the linear layers).
  s = Nvfp4Settings(keep_first_layers=2, keep_last_layers=8)
  rows = plan.precision_table(s, num_layers=62)
  bf16_layers = sorted({r.layer for r in rows if r.fprop == "bf16"})
  assert bf16_layers == [0, 1] + list(range(54, 62))


@pytest.mark.parametrize("scope, after", [("forward", ("bf16", "nvfp4", "nvfp4")), ("all", ("bf16", "bf16", "bf16"))])
def test_switch_scope(scope, after):
  s = Nvfp4Settings(switch_at_step=0.8, switch_scope=scope, keep_first_layers=1)
  rows = plan.precision_table(s, num_layers=3)
  for r in rows:
    if r.layer == 0:  # kept: stays in the fallback, the switch never touches it
      assert (r.fprop_after, r.dgrad_after, r.wgrad_after) == ("bf16",) * 3
    else:
      assert (r.fprop, r.dgrad, r.wgrad) == ("nvfp4",) * 3
      assert (r.fprop_after, r.dgrad_after, r.wgrad_after) == after


def test_switch_to_fp8_leaves_bf16_fallback_alone():
  s = Nvfp4Settings(switch_at_step=10, switch_to="fp8", switch_scope="all", targets="mlp")
  before, after = plan.precisions(s, layer=0, role="query", num_layers=2)
  assert before.as_tuple() == after.as_tuple() == ("bf16",) * 3
  before, after = plan.precisions(s, layer=0, role="wo", num_layers=2)
  assert before.as_tuple() == ("nvfp4",) * 3 and after.as_tuple() == ("fp8",) * 3


def test_no_switch_gives_none():
  assert plan.precisions(Nvfp4Settings(), layer=0, role="wo", num_layers=1)[1] is None


def test_scanned_layers_single_row_per_role():
  rows = plan.precision_table(Nvfp4Settings(targets="mlp"), num_layers=8, scan_layers=True)
  assert [r.layer for r in rows] == [None] * len(ROLES)
  assert [r.fprop for r in rows] == ["bf16"] * 4 + ["nvfp4"] * 3


def test_gemm_recipes_carry_the_nvfp4_options():
  s = Nvfp4Settings(rht=False, stochastic_rounding=False, two_d_weights=False, switch_at_step=5)
  r, sw = plan.gemm_recipes(s, layer=0, role="wo", num_layers=2)
  assert (r.fprop, r.dgrad, r.wgrad, r.rht, r.stochastic_rounding, r.two_d_weights) == (
      "nvfp4", "nvfp4", "nvfp4", False, False, False)
  assert (sw.fprop, sw.dgrad, sw.wgrad) == ("bf16", "nvfp4", "nvfp4") and sw.rht is False


def test_format_lists_every_gemm():
  s = Nvfp4Settings(keep_first_layers=1, switch_at_step=3)
  rows = plan.precision_table(s, num_layers=2)
  text = plan.format_precision_table(rows, switch_step=3)
  lines = text.splitlines()
  assert len(lines) == 2 + len(rows)
  assert lines[0].split() == ["layer", "role", "fprop", "dgrad", "wgrad", "fprop@3+", "dgrad@3+", "wgrad@3+"]
  assert lines[2].split() == ["0", "query", "bf16", "bf16", "bf16", "bf16", "bf16", "bf16"]
  assert lines[-1].split() == ["1", "wo", "nvfp4", "nvfp4", "nvfp4", "bf16", "nvfp4", "nvfp4"]


def test_runs_of_identical_layers_keep_first_last_and_switch():
  s = Nvfp4Settings(targets="mlp", keep_first_layers=2, keep_last_layers=2, switch_at_step=20)
  rows = plan.precision_table(s, num_layers=126)
  runs = plan.precision_runs(rows)
  assert [r.layers() for r in runs] == ["0-1", "2-123", "124-125"]
  middle = runs[1].groups
  assert [g[0] for g in middle] == [("query", "key", "value", "out"), ("wi_0", "wi_1", "wo")]
  assert middle[1][1] == ("nvfp4", "nvfp4", "nvfp4", "bf16", "nvfp4", "nvfp4")
  lines = plan.format_precision_runs(runs, switch_step=20).splitlines()
  assert len(lines) == 2 + 4 and lines[0].split()[:2] == ["layers", "roles"]
  assert lines[3].split() == ["2-123", "query,key,value,out"] + ["bf16"] * 6
  assert lines[4].split() == ["wi_0,wi_1,wo", "nvfp4", "nvfp4", "nvfp4", "bf16", "nvfp4", "nvfp4"]
  # every row is in exactly one run
  assert sum((r.last - r.first + 1) * sum(len(g[0]) for g in r.groups) for r in runs) == len(rows)


def test_runs_split_where_roles_differ_and_scanned_is_one_run():
  dense, moe = plan.decoder_roles(), plan.decoder_roles(moe=True, dense_mlp=False)
  rows = plan.precision_table(Nvfp4Settings(), num_layers=4, roles=lambda layer: dense if layer < 1 else moe)
  assert [r.layers() for r in plan.precision_runs(rows)] == ["0", "1-3"]
  scanned = plan.precision_runs(plan.precision_table(Nvfp4Settings(), num_layers=8, scan_layers=True))
  assert [r.layers() for r in scanned] == ["all (scanned)"]


def test_unknown_role_rejected():
  with pytest.raises(ValueError, match="unknown decoder GEMM role"):
    plan.role_group("logits")


# ---------------------------------------------------------------------------------------------------
# MoE and MLA roles
# ---------------------------------------------------------------------------------------------------


def test_moe_and_mla_roles_in_construction_order():
  assert plan.decoder_roles(moe=True, dense_mlp=False) == (
      "query", "key", "value", "out", "router", "expert_wi_0", "expert_wi_1", "expert_wo")
  # deepseek: MLA with the low-rank query, routed experts and shared experts (an MlpBlock)
  assert plan.decoder_roles(mla=True, q_lora=True, moe=True) == (
      "q_a", "q_b", "kv_a", "kv_b", "out", "router", "expert_wi_0", "expert_wi_1", "expert_wo", "wi_0", "wi_1", "wo")
  assert plan.decoder_roles(mla=True)[:3] == ("query", "kv_a", "kv_b")
  assert {plan.role_group(r) for r in plan.decoder_roles(mla=True, q_lora=True, moe=True)} == {
      "attention", "mlp", "experts", "router"}


@pytest.mark.parametrize("targets, nvfp4_groups", [
    ("all", {"attention", "mlp", "experts"}), ("experts", {"experts"}), ("mlp", {"mlp"}),
    ("attention", {"attention"})])
@pytest.mark.parametrize("fallback", ["bf16", "fp8"])
def test_targets_select_expert_roles_and_the_router_is_always_bf16(targets, nvfp4_groups, fallback):
  s = Nvfp4Settings(targets=targets, fallback=fallback, switch_at_step=5, switch_to="fp8", switch_scope="all")
  roles = plan.decoder_roles(mla=True, q_lora=True, moe=True)
  for r in plan.precision_table(s, num_layers=2, roles=roles):
    if r.role == "router":  # high precision whatever the targets, fallback or switch
      assert (r.fprop, r.dgrad, r.wgrad, r.fprop_after, r.dgrad_after, r.wgrad_after) == ("bf16",) * 6
      continue
    want = "nvfp4" if plan.role_group(r.role) in nvfp4_groups else fallback
    assert (r.fprop, r.dgrad, r.wgrad) == (want,) * 3, r


def test_precision_table_with_per_layer_roles_counts_decoder_layers():
  """deepseek-style: layer 0 dense, layers 1-2 MoE; keep_last counts decoder layers, not MoE layers."""
  dense, moe = plan.decoder_roles(), plan.decoder_roles(moe=True, dense_mlp=False)
  s = Nvfp4Settings(keep_last_layers=1)
  rows = plan.precision_table(s, num_layers=3, roles=lambda layer: dense if layer == 0 else moe)
  assert [r.role for r in rows if r.layer == 0] == list(dense)
  assert [r.role for r in rows if r.layer == 2] == list(moe)
  assert {r.fprop for r in rows if r.layer == 2} == {"bf16"}
  assert {r.fprop for r in rows if r.layer == 1 and r.role != "router"} == {"nvfp4"}


def test_locator_places_router_and_experts_in_moe_layers():
  loc = plan.GemmLocator(num_layers=4, moe_layers=(1, 3), signatures=MAXTEXT.kernel_signatures)
  wi, wo = ("exp", "embed_moe", "mlp_moe"), ("exp", "mlp_moe", "embed_moe")
  got = [loc.locate(a) for a in [("embed", None), ("embed", None), wi, wi, wo, wi, wi, wo, wi]]
  assert got == [(1, "router"), (3, "router"), (1, "expert_wi_0"), (1, "expert_wi_1"), (1, "expert_wo"),
                 (3, "expert_wi_0"), (3, "expert_wi_1"), (3, "expert_wo"), (1, "expert_wi_0")]  # next trace wraps
  assert plan.signature_roles(("exp", None, "mlp"), 2, MAXTEXT.kernel_signatures) == ("expert_wi_0", "expert_wi_1")  # capacity form
  assert plan.signature_roles(("embed_attn", "qkv", "heads", "kv"), 1, MAXTEXT.kernel_signatures) == ("qkv_proj",)  # gpt3's fused QKV
  with pytest.raises(plan.settings_lib.SettingsError, match=r"kernel axes \('exp', 'embed_moe'\)"):
    plan.signature_roles(("exp", "embed_moe"), 2, MAXTEXT.kernel_signatures)
