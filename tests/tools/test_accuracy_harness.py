"""benchmarks/accuracy/run_study.py: arm construction, sizing checks, log parsing, target verdicts (no training)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]


def _load(name):
  spec = importlib.util.spec_from_file_location(name, _ROOT / "benchmarks" / "accuracy" / f"{name}.py")
  mod = importlib.util.module_from_spec(spec)
  sys.modules[name] = mod
  spec.loader.exec_module(mod)
  return mod


study = _load("run_study")
peer = _load("peer_train")


def _opt(argv, key):
  vals = [a.split("=", 1)[1] for a in argv if a.startswith(key + "=")]
  assert len(vals) == 1, (key, argv)
  return vals[0]


def test_cpu_study_runs_and_seeds(tmp_path):
  sizing, out, runs, publish = study.resolve(study.build_parser().parse_args(["--out", str(tmp_path)]))
  keys = [r.key for r in runs]
  assert len(keys) == len(set(keys))
  # >= 3 seeds for bf16, fp8, nvfp4; every arm present at seed 0
  for arm in ("bf16", "fp8", "nvfp4"):
    assert {f"{arm}_s{s}" for s in range(3)} <= set(keys)
  assert {f"{a.name}_s0" for a in study.ARMS} <= set(keys)
  # order: key arms + peers at seed 0, key arms' extra seeds, then ablations/switches (partial studies stay useful)
  groups = [(r.arm.group, r.seed > 0) for r in runs]
  assert groups.index(("key", True)) > max(i for i, g in enumerate(groups) if g[0] in ("key", "peer") and not g[1])
  assert groups.index(("key", True)) < min(i for i, g in enumerate(groups) if g[0] in ("ablation", "switch"))
  for r in runs:
    seed = str(r.seed)
    # same init, data order and SR seed for a given seed, whatever the arm
    assert _opt(r.argv, "init_weights_seed") == seed
    # the same batches in the same order in every run; SR seed fixed (keeps the compile cache entry shared)
    assert _opt(r.argv, "data_shuffle_seed") == _opt(r.argv, "nvfp4_seed") == "0"
    assert int(_opt(r.argv, "steps")) == sizing.steps
    assert _opt(r.argv, "metrics_file").startswith(str(tmp_path / r.key))
  assert (sizing.steps - 1) % sizing.eval_interval == 0  # the last eval sees the final weights
  assert publish == study.HERE


def test_arm_commands():
  runs = {r.key: r for r in study.build_runs(study.SIZINGS["quick"], Path("/x"))}
  q, j, nv, f8 = runs["qwix_nvfp4_s0"].argv, runs["jaxnn_nvfp4_s0"].argv, runs["nvfp4_s0"].argv, runs["fp8_s0"].argv
  assert q[1].endswith("peer_train.py") and q[2] == "qwix" and "use_qwix_quantization=true" in q
  assert j[1].endswith("peer_train.py") and j[2] == "jaxnn" and not any(a.startswith("quantization=") for a in j)
  assert nv[1:3] == ("-m", "maxtext_nvfp4.train") and nv[3].endswith("demo_nvfp4.yml")
  assert "quantization=fp8" in f8 and f8[3].endswith("demo_bf16.yml")
  sw = runs["nvfp4_switch_fwd_s0"].argv
  assert "nvfp4_switch_scope=forward" in sw and "nvfp4_switch_at_step=0.8" in sw
  # every ablation flips exactly one ingredient of the nvfp4 arm and states the paper's direction
  for a in study.ARMS:
    if a.group in ("ablation", "switch"):
      assert a.recipe == "demo_nvfp4.yml" and a.expect in (-1, 1) and a.overrides


def test_family_arms():
  """MoE and qwen3 families: bf16 / fp8 / nvfp4 each, 3 seeds, the same data order, the fp8 arm = the family's
  bf16 recipe + quantization=fp8, and each family's own arms as its baselines."""
  runs = {r.key: r for r in study.build_runs(study.SIZINGS["cpu"], Path("/x"))}
  recipe = {"moe": ("demo_moe_bf16.yml", "demo_moe_nvfp4.yml"),
            "qwen3": ("demo_qwen3_bf16.yml", "demo_qwen3_nvfp4.yml")}
  assert [f.name for f in study.FAMILIES] == ["llama2", "moe", "qwen3"]
  for fam in study.FAMILIES[1:]:
    bf16_yml, nvfp4_yml = recipe[fam.name]
    arms = [study.ARM_BY_NAME[n] for n in (fam.bf16, fam.fp8, fam.nvfp4)]
    assert all(a.family == fam.name and a.group == "key" and a.peer is None for a in arms)
    assert {a.name for a in study.ARMS if a.family == fam.name and a.group == "key"} == {fam.bf16, fam.fp8, fam.nvfp4}
    for seed in range(3):
      bf, f8, nv = (runs[f"{n}_s{seed}"].argv for n in (fam.bf16, fam.fp8, fam.nvfp4))
      assert bf[3].endswith(bf16_yml) and f8[3].endswith(bf16_yml) and nv[3].endswith(nvfp4_yml)
      assert [a for a in f8 if a.startswith("quantization=")] == ["quantization=fp8"]
      assert not any(a.startswith("quantization=") for a in bf + nv)  # the recipes say "" / nvfp4
      for argv in (bf, f8, nv):
        assert _opt(argv, "init_weights_seed") == str(seed) and _opt(argv, "data_shuffle_seed") == "0"
        assert (_opt(argv, "steps"), _opt(argv, "eval_interval"), _opt(argv, "eval_steps")) == ("101", "50", "8")
  # the llama2 arms stay on the llama2 recipes
  assert all(a.family == "llama2" for a in study.ARMS if a.recipe in ("demo_bf16.yml", "demo_nvfp4.yml"))
  # --quick covers every arm, the new families included
  quick = {r.key for r in study.build_runs(study.SIZINGS["quick"], Path("/x"))}
  assert {f"{n}_s0" for f in study.FAMILIES for n in (f.bf16, f.fp8, f.nvfp4)} <= quick


def test_moe_variant_arms_mirror_the_dense_variants():
  """Each TE recipe variant runs on the MoE demo with exactly the dense arm's overrides, on the MoE nvfp4 recipe."""
  dense = {a.name: a for a in study.VARIANT_ARMS}
  moe = {a.name: a for a in study.MOE_VARIANT_ARMS}
  assert set(moe) == {f"moe_{n}" for n in dense}
  runs = {r.key: r for r in study.build_runs(study.SIZINGS["cpu"], Path("/x"), arms=sorted(moe))}
  assert len(runs) == 3 * len(moe)
  for name, arm in moe.items():
    d = dense[name.removeprefix("moe_")]
    assert (arm.family, arm.group, arm.recipe, arm.overrides) == ("moe", "variant", "demo_moe_nvfp4.yml", d.overrides)
    argv = runs[f"{name}_s2"].argv
    assert argv[3].endswith("demo_moe_nvfp4.yml") and set(d.overrides) <= set(argv)
    assert _opt(argv, "init_weights_seed") == "2" and _opt(argv, "data_shuffle_seed") == "0"


def test_variants_report_pairs_the_moe_arms_with_the_moe_baselines(tmp_path, capsys):
  report = _load("variants_report")
  for arm, seed, loss in (("moe_nvfp4_diag", 0, 6.10), ("moe_nvfp4_diag", 1, 6.12), ("moe_nvfp4_4o6_w", 0, 6.08),
                          ("nvfp4_diag", 0, 5.0)):
    d = tmp_path / f"{arm}_s{seed}"
    d.mkdir()
    (d / "result.json").write_text(json.dumps({"complete": True, "seed": seed, "final_eval_loss": loss}))
  carry = tmp_path / "summary.json"
  carry.write_text(json.dumps({"moe_bf16": {"0": {"final_eval_loss": 6.0}, "1": {"final_eval_loss": 6.2}},
                               "bf16": {"0": {"final_eval_loss": 1.0}}}))
  assert report.main([str(tmp_path), "--carry", str(carry), "--family", "moe"]) == 0
  rows = {ln.split(" | ")[0]: ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ")}
  # paired by seed with moe_nvfp4_diag (6.10 at seed 0) and moe_bf16 (6.0), never the dense arms
  assert "-0.0200 (-0.0200)" in rows["| moe_nvfp4_4o6_w"] and "+1.33 %" in rows["| moe_nvfp4_4o6_w"]
  assert "| 2 | 6.1100 | 0.0200 |" in rows["| moe_nvfp4_diag"]
  assert "not run" in rows["| moe_nvfp4_bwd_hp"] and "| nvfp4_diag" not in rows


def test_family_gaps_use_the_family_baseline():
  # llama2 bf16 at 3.0, MoE bf16 at 4.0: moe_nvfp4 = 4.04 is +1 % vs moe_bf16 (it would be +35 % vs llama2's).
  st = _stats({"bf16": {0: 3.0, 1: 3.0}, "nvfp4": {0: 3.0, 1: 3.0}, "moe_bf16": {0: 4.0, 1: 4.0},
               "moe_fp8": {0: 4.02, 1: 4.02}, "moe_nvfp4": {0: 4.04, 1: 4.04}, "qwen3_bf16": {0: 5.0}})
  moe = "\n".join(study.table(st, study.FAMILY_BY_NAME["moe"]))
  row = next(ln for ln in moe.splitlines() if ln.startswith("| moe_nvfp4 "))
  assert "+1.00 % [+1.00 %, +1.00 %]" in row and "+0.50 %" in row, row
  assert "| bf16 " not in moe and "| nvfp4 " not in moe  # other families' arms are not in this table
  assert "| moe_bf16 " not in "\n".join(study.table(st))  # the default table is llama2's
  text = "\n".join(study.verdicts(st))
  assert "**moe_nvfp4 eval-loss gap vs moe_bf16 <= 1 % relative**: +1.00 %" in text
  assert "moe_nvfp4 +0.0400 vs moe_fp8 +0.0200" in text and "qwen3_nvfp4" not in text  # no qwen3 nvfp4 run


def test_carry_takes_only_arms_without_runs(tmp_path, capsys):
  sizing = study.SIZINGS["cpu"]
  rec = lambda v: {"final_train_loss": v, "final_eval_loss": v, "step0_loss": 8.0, "wall_s": 1.0,  # noqa: E731
                   "median_step_s": 1.0, "eval_loss": {"0": 8.0, "50": 6.0, "100": v}}
  summary = tmp_path / "study_summary.json"
  summary.write_text(json.dumps({"bf16": {"0": rec(5.8), "1": rec(5.9)}, "nvfp4": {"0": rec(5.85)},
                                 "fp8": {"0": {**rec(5.7), "eval_loss": {"0": 8.0, "6": 7.0}}}}))
  carry = study.load_carry(summary, sizing)
  assert set(carry) == {"bf16", "nvfp4"} and "fp8" in capsys.readouterr().err  # fp8: another sizing's evals
  out = tmp_path / "out"
  runs = study.build_runs(sizing, out, arms=["bf16", "nvfp4", "moe_bf16"])
  nv0 = next(r for r in runs if r.key == "nvfp4_s0")
  nv0.out.mkdir(parents=True)
  (nv0.out / "result.json").write_text(json.dumps({**rec(5.5), "complete": True, "finite": True}))
  st = study.collect(out, runs, carry)
  assert st["bf16"].carried and st["bf16"].evals() == {0: 5.8, 1: 5.9}
  assert not st["nvfp4"].carried and st["nvfp4"].evals() == {0: 5.5}  # OUT wins, never mixed with the summary
  assert not st["moe_bf16"].carried and not st["moe_bf16"].runs
  assert "| bf16 † | 2 |" in "\n".join(study.table(st))
  assert not study.collect(out, runs)["bf16"].runs  # without --carry nothing is carried


@pytest.mark.parametrize("argv,msg", [(["--steps", "100"], "k * 50 + 1"), (["--arms", "bf16,nope"], "unknown arm"),
                                      (["--quick", "foo"], "KEY=VALUE")])
def test_bad_input(argv, msg, capsys):
  assert study.main(argv + ["--dry-run"]) == 2
  assert msg in capsys.readouterr().err


def test_parse_log():
  text = ("I1129 metric_logger.py:265] completed step: 3, seconds: 0.907, TFLOP/s/device: 0.010, "
          "Tokens/s/device: 1128.464, total_weights: 836, loss: 7.994, lm_loss: 7.994, perplexity: 2961.762\n"
          "I1129 metric_logger.py:280] Completed eval after train step 6, loss=7.125, perplexity=1242.0, x\n"
          "Completed eval step: 0, seconds: 1.0, running loss=9.0\n")
  train, secs, evals = study.parse_log(text)
  assert train == {3: 7.994} and secs == {3: 0.907} and evals == {6: 7.125}


def _stats(evals_by_arm):
  out = {}
  for name, evals in evals_by_arm.items():
    runs = {s: {"final_eval_loss": v, "final_train_loss": v, "step0_loss": 8.0, "median_step_s": 1.0, "wall_s": 1}
            for s, v in evals.items()}
    out[name] = study.ArmStats(arm=study.ARM_BY_NAME[name], runs=runs, incomplete=0)
  return out


def test_verdicts():
  st = _stats({"bf16": {0: 3.00, 1: 3.02, 2: 3.01}, "fp8": {0: 3.01, 1: 3.03, 2: 3.02},
               "nvfp4": {0: 3.06, 1: 3.07, 2: 3.08}, "qwix_nvfp4": {0: 5.0}, "jaxnn_nvfp4": {0: 3.08},
               "nvfp4_no_sr": {0: 3.2}, "nvfp4_keep_last1": {0: 3.07}})
  text = "\n".join(study.verdicts(st))
  # nvfp4 gap = 0.06/3.01 ~ 2 % > 1 %
  assert "<= 1 % relative**: +1.99 %" in text and "NOT MET" in text.split("\n")[0]
  # nvfp4 - bf16 = 0.06 > fp8 gap 0.01 + spread 0.02
  assert "NOT MET" in text.split("\n")[1]
  assert "qwix_nvfp4**: eval 5.0000 - 3.0700 = +1.9300 vs spread 0.0200 -> MET" in text
  assert "jaxnn_nvfp4**" in text and "within the spread" in text
  assert "paired per seed: [+0.0500, +0.0700], nvfp4 worse in 3/3 seed(s)" in text.split("\n")[0]
  assert "nvfp4_no_sr** vs nvfp4 (seed 0): +0.1400" in text and "reproduces" in text
  assert "nvfp4_keep_last1** vs nvfp4 (seed 0): +0.0100" in text and "opposite direction, within seed spread" in text
  diag = _stats({"nvfp4": {0: 3.06, 1: 3.07}, "nvfp4_fwd_only": {0: 3.01, 1: 3.03}, "jaxnn_nvfp4": {0: 3.02, 1: 3.02}})
  dtext = "\n".join(study.verdicts(diag))
  assert "jaxnn_nvfp4 - nvfp4_fwd_only = +0.0000" in dtext and "[-0.0100, +0.0100]" in dtext
  assert "nvfp4 - nvfp4_fwd_only = +0.0450" in dtext
  good = _stats({"bf16": {0: 3.00, 1: 3.02}, "fp8": {0: 3.01, 1: 3.03}, "nvfp4": {0: 3.02, 1: 3.04}})
  lines = study.verdicts(good)
  assert "-> MET;" in lines[0] and "NOT" not in lines[0] and "-> MET;" in lines[1] and "NOT" not in lines[1]


def test_results_markers_keep_hand_written_text(tmp_path):
  p = tmp_path / "new_publish_dir" / "RESULTS.md"  # a --publish-dir that does not exist yet is created
  study.write_results(p, f"{study.BEGIN}\nA\n{study.END}", "# head")
  p.write_text(p.read_text() + "\n## analysis by hand\n")
  study.write_results(p, f"{study.BEGIN}\nB\n{study.END}", "# head")
  text = p.read_text()
  assert "B" in text and "\nA\n" not in text and "analysis by hand" in text and text.startswith("# head")


def test_peer_qwix_rule():
  (rule,) = peer.qwix_rules()
  assert rule.weight_qtype == rule.act_qtype == rule.bwd_qtype == "nvfp4" and rule.tile_size == 16
  assert rule.additional_qt_config == {"dlhs_tile_size": 16, "drhs_tile_size": 16}
  assert rule.op_names == ("dot_general",)


def test_peer_qwix_fwd_rule_has_no_backward():
  (rule,) = peer.qwix_rules(backward=False)
  assert rule.act_qtype == "nvfp4" and rule.bwd_qtype is None and not rule.additional_qt_config


def test_peer_usage_error(capsys):
  assert peer.main(["nope"]) == 2 and "usage" in capsys.readouterr().err


def test_summary_json_roundtrip(tmp_path):
  # summarize() must work from a log alone (metrics file truncated away) and mark incomplete runs
  spec = study.RunSpec(arm=study.ARM_BY_NAME["bf16"], seed=0, out=tmp_path, argv=("x",))
  (tmp_path / "train.log").write_text("".join(
      f"completed step: {s}, seconds: 0.5, loss: {8 - s / 10:.3f}, x\n" for s in range(7))
      + "Completed eval after train step 6, loss=7.100, perplexity=1\n")
  res = study.summarize(spec, rc=0, wall_s=1.0, steps=7)
  assert res["complete"] and res["final_eval_loss"] == 7.1 and res["final_train_loss"] == pytest.approx(7.4)
  assert json.loads(json.dumps(res))["step0_loss"] == 8.0
  assert not study.summarize(spec, rc=0, wall_s=1.0, steps=9)["complete"]


def test_shrink_png(tmp_path):
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  fig, ax = plt.subplots(figsize=(10, 7.5))
  for i in range(8):
    ax.plot([(j * (i + 1)) % 17 for j in range(200)], label=str(i))
  ax.legend()
  fig.savefig(tmp_path / "a.png")
  study.shrink_png(tmp_path / "a.png", tmp_path / "b.png")
  assert 0 < (tmp_path / "b.png").stat().st_size < min(200_000, (tmp_path / "a.png").stat().st_size)
