"""benchmarks/accuracy/run_study.py: arm construction, sizing checks, log parsing, target verdicts (no training)."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[1]


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
  p = tmp_path / "RESULTS.md"
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
