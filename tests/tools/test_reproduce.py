"""``maxtext-nvfp4 reproduce``: command construction (dry run), labels, orchestration with a fake trainer,
and the demo pair end to end through ``python -m maxtext_nvfp4.train`` on the embedded corpus (prepare-data
first: the README flow; this is the suite's one run of the shipped demo recipes)."""

import importlib.util
import json
import math
import os
import re
import shlex
import stat
import sys
from pathlib import Path

import pytest

from maxtext_nvfp4.tools import reproduce
from maxtext_nvfp4.tools.cli import main as cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def recipes(tmp_path):
  d = tmp_path / "recipes"
  d.mkdir()
  for p in reproduce.PAIRS.values():
    for name in (p.baseline_recipe, p.nvfp4_recipe):
      (d / name).write_text("base_config: base.yml\n")
  return d


def dry(capsys, *args):
  rc = cli(["reproduce", *args, "--dry-run"])
  return rc, capsys.readouterr()


def test_dry_run_commands(tmp_path, recipes, capsys):
  out = tmp_path / "o"
  rc, cap = dry(capsys, "llama3_8b", "--recipes-dir", str(recipes), "--out", str(out), "--steps", "20",
                "--layers", "2", "--seq", "256", "--batch", "0.5", "--seed", "7", "enable_checkpointing=false",
                "--python", "/opt/py")
  assert rc == 0
  lines = cap.out.splitlines()
  assert lines[0] == ("PROXY (not the published configuration): llama3_8b with --steps 20, --layers 2, "
                      "--seq 256, --batch 0.5, enable_checkpointing=false")
  cmds = [shlex.split(l) for l in lines if l.startswith("/opt/py")]
  assert len(cmds) == 2
  common = ["steps=20", "base_num_decoder_layers=2", "override_model_config=true", "max_target_length=256",
            "per_device_batch_size=0.5", "enable_checkpointing=false"]
  for cmd, label, recipe in ((cmds[0], "fp8", "llama3_8b_fp8.yml"), (cmds[1], "nvfp4", "llama3_8b_nvfp4.yml")):
    assert cmd[:4] == ["/opt/py", "-m", "maxtext_nvfp4.train", str(recipes / recipe)]
    assert cmd[4:] == [f"run_name=llama3_8b_{label}", f"base_output_directory={out / 'runs'}",
                       f"metrics_file={out / label / 'metrics.jsonl'}", "init_weights_seed=7",
                       "data_shuffle_seed=7"] + common
  cmp = shlex.split(lines[-1])
  # this environment's command: the bare name when PATH finds it, else its path (tools/cli.shell_command)
  assert os.path.basename(cmp[0]) in ("maxtext-nvfp4", "python") and "compare" in cmp[1:4]
  assert cmp[cmp.index("compare") + 1:][:2] == [f"fp8={out / 'fp8' / 'metrics.jsonl'}",
                                                 f"nvfp4={out / 'nvfp4' / 'metrics.jsonl'}"]
  assert not out.exists()  # a dry run writes nothing


def test_labels(recipes, capsys):
  rc, cap = dry(capsys, "llama3_8b_c4", "--recipes-dir", str(recipes))
  assert rc == 0 and cap.out.startswith("Published configuration:") and "PROXY" not in cap.out
  cmd = shlex.split(cap.out.splitlines()[2])
  assert not any(a.startswith(("steps=", "base_num_decoder_layers=")) for a in cmd)  # recipe values kept
  rc, cap = dry(capsys, "demo", "--recipes-dir", str(recipes), "--steps", "5")
  assert rc == 0 and "not a published configuration" in cap.out and "changed: --steps 5" in cap.out
  assert "demo_bf16.yml" in cap.out and "demo_nvfp4.yml" in cap.out and "# bf16" in cap.out


def test_bad_input(tmp_path, recipes, capsys):
  rc, cap = dry(capsys, "nope", "--recipes-dir", str(recipes))
  assert rc == 2 and "unknown pair 'nope'" in cap.err and "demo" in cap.err
  (recipes / "proxy_1gpu_nvfp4.yml").unlink()
  rc, cap = dry(capsys, "proxy_1gpu", "--recipes-dir", str(recipes))
  assert rc == 2 and "recipe proxy_1gpu_nvfp4.yml not found" in cap.err
  assert len(cap.err.strip().splitlines()) == 1 and "Traceback" not in cap.err
  rc, cap = dry(capsys, "demo", "--recipes-dir", str(recipes), "--steps", "0")
  assert rc == 2 and "argument --steps: 0 is out of range: need an integer >= 1" in cap.err
  rc, cap = dry(capsys, "demo", "--recipes-dir", str(recipes), "notakv")
  assert rc == 2 and "KEY=VALUE" in cap.err


FAKE_TRAINER = r'''#!{python}
"""Stands in for `python -m maxtext_nvfp4.train`: writes MaxText-style metrics and log lines."""
import json, math, sys
args = dict(a.split("=", 1) for a in sys.argv[4:])
nv = args["run_name"].endswith("nvfp4")
steps = int(args.get("steps", 10))
trunc = int(args.get("truncate_at", -1))
f = open(args["metrics_file"], "w")
for s in range(steps):
  if s == trunc:  # MaxText 0.2.5: the eval's first running snapshot (eval step 0) truncates the file
    f.close()
    f = open(args["metrics_file"], "w")
    f.write(json.dumps({{"step": 0.0, "eval/avg_loss": 5.0, "eval/step_time_seconds": 0.1}}) + "\n")
  t = (9.0 if s == 0 else (0.4 if nv else 0.5))
  loss = 4.0 - 0.1 * s + (0.01 if nv else 0.0) + 0.001 * int(args["init_weights_seed"])
  f.write(json.dumps({{"step": s, "learning/loss": loss, "perf/step_time_seconds": t,
                      "perf/per_device_tokens": 100.0, "perf/per_device_tflops": 1.0}}) + "\n")
  print(f"I1129 train.py] completed step: {{s}}, seconds: {{t:.3f}}, TFLOP/s/device: 1.0, "
        f"Tokens/s/device: 1.0, total_weights: 10, loss: {{loss:.3f}}, lm_loss: {{loss:.3f}}", flush=True)
f.close()
sys.exit(int(args.get("fail", 0)))
'''


def fake_python(tmp_path):
  p = tmp_path / "fakepy"
  p.write_text(FAKE_TRAINER.format(python=sys.executable))
  p.chmod(p.stat().st_mode | stat.S_IEXEC)
  return str(p)


def test_orchestration_with_fake_trainer(tmp_path, recipes, capsys):
  out = tmp_path / "o"
  args = ["reproduce", "demo", "--recipes-dir", str(recipes), "--out", str(out), "--steps", "10",
          "--python", fake_python(tmp_path), "--warmup", "1"]
  assert cli(args) == 0
  text = capsys.readouterr().out
  assert "[bf16] step 10/10 loss 3.100 (0.500 s)" in text and "[nvfp4] step 1/10 loss 4.010 (9.000 s)" in text
  assert "VERDICT: PASS" in text and "1.250x" in text and "+0.0100" in text
  md = (out / "compare" / "report.md").read_text()
  assert "demo: CPU demo" in md and "changed: --steps 10" in md
  assert (out / "compare" / "loss.png").stat().st_size > 10_000
  # a second run refuses to reuse the directories, --overwrite replaces them
  assert cli(args) == 2 and "--overwrite" in capsys.readouterr().err
  assert cli(args + ["--overwrite", "--tolerance", "0.005"]) == 1
  # a failing run that wrote metrics is still compared; one that wrote none stops with 3
  assert cli(args + ["--overwrite", "fail=1"]) == 0
  assert "continuing" in capsys.readouterr().out
  bad = tmp_path / "nopy"
  bad.write_text("#!/bin/sh\necho boom\nexit 4\n")
  bad.chmod(0o755)
  assert cli(args[:-4] + ["--python", str(bad), "--overwrite"]) == 3
  err = capsys.readouterr().err
  assert "exited with code 4" in err and "boom" in err


def _demo_ready() -> str | None:
  if importlib.util.find_spec("maxtext_nvfp4.train") is None:
    return "maxtext_nvfp4.train (the plugin's training entry point) does not exist yet"
  for name in ("demo_bf16.yml", "demo_nvfp4.yml"):
    if not (REPO / "recipes" / name).is_file():
      return f"recipes/{name} does not exist yet"
  return None


@pytest.mark.slow
@pytest.mark.skipif(_demo_ready() is not None, reason=str(_demo_ready()))
def test_demo_pair_end_to_end(tmp_path, capsys, monkeypatch):
  """The README flow, once for both files' checks (it used to run twice, here on synthetic data and in
  test_recipes.py on the corpus): prepare-data (defaults, small cap), then ``reproduce demo`` from the data's
  parent dir trains the shipped demo recipes (``python -m maxtext_nvfp4.train`` subprocesses) on the embedded
  corpus, with an eval, and compares them."""
  monkeypatch.chdir(tmp_path)  # the demo recipes find data/embedded/ relative to the working directory
  assert cli(["prepare-data", "--quiet", "--max-mb", "0.5"]) == 0
  capsys.readouterr()
  out = tmp_path / "demo"
  # The recipes as shipped, shrunk in time only (1 layer, seq 64, batch 2: the NVFP4 emulation compiles faster).
  rc = cli(["reproduce", "demo", "--recipes-dir", str(REPO / "recipes"), "--out", str(out), "--steps", "5",
            "--layers", "1", "--seq", "64", "--batch", "2", "--warmup", "1", "--tolerance", "100", "--verbose",
            "eval_interval=4", "eval_steps=1"])
  text = capsys.readouterr().out
  assert rc == 0, text[-4000:]
  losses = {}
  for label in ("bf16", "nvfp4"):
    # MaxText truncates metrics.jsonl at each eval; reproduce rebuilds the lost step(s) from the log into
    # metrics_merged.jsonl
    d = out / label
    path = d / "metrics_merged.jsonl" if (d / "metrics_merged.jsonl").exists() else d / "metrics.jsonl"
    recs = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    train = [r for r in recs if "learning/loss" in r]
    assert [int(r["step"]) for r in train] == list(range(5))
    losses[label] = [r["learning/loss"] for r in train]
    assert losses[label][4] < losses[label][0], losses[label]  # it learns
    evals = [r["eval/avg_loss"] for r in recs if "eval/avg_loss" in r]
    assert evals and all(0 < e < losses[label][0] + 1 for e in evals), evals
    # --verbose echoes the run's own lines: it trained 5 steps and read the tokenizer prepare-data wrote
    assert re.search(rf"^\[{label}\] .*completed step: 4,", text, re.M)
    assert re.search(rf"^\[{label}\] .*Loading HF tokenizer: data/embedded/tokenizer", text, re.M), text[-4000:]
  b, n = losses["bf16"], losses["nvfp4"]
  assert b[0] == pytest.approx(n[0], rel=0.05)  # same init and data: step-0 losses agree closely ...
  assert b[1:] != n[1:]  # ... but NVFP4 really changes the trajectory ...
  assert all(abs(x - y) < 0.5 for x, y in zip(b, n)), (b, n)  # ... and stays close
  md = (out / "compare" / "report.md").read_text()
  assert "**Verdict: PASS**" in md and "| nvfp4 | 5 |" in md
  for png in ("loss.png", "throughput.png"):
    assert (out / "compare" / png).stat().st_size > 10_000


def test_steps_lost_to_maxtext_eval_truncation_are_rebuilt(tmp_path, recipes, capsys):
  out = tmp_path / "o"
  assert cli(["reproduce", "demo", "--recipes-dir", str(recipes), "--out", str(out), "--steps", "10",
              "--python", fake_python(tmp_path), "--warmup", "1", "truncate_at=6", "--no-plots"]) == 0
  text = capsys.readouterr().out
  assert "[bf16] 6 training step(s) missing from metrics.jsonl" in text
  recs = [json.loads(l) for l in (out / "nvfp4" / "metrics_merged.jsonl").read_text().splitlines()]
  assert [r["step"] for r in recs] == list(range(10))
  assert [r.get("source") for r in recs] == ["log"] * 6 + [None] * 4
  assert recs[2]["learning/loss"] == 3.81 and recs[2]["perf/step_time_seconds"] == 0.4  # from the log line
  md = (out / "compare" / "report.md").read_text()
  assert "6 training step(s) rebuilt from MaxText's log lines" in md and "+0.0100" in md
  assert "truncated it at an eval" not in md  # the running-eval record is dropped from the merge


def test_parse_step_line():
  line = ("I1129 12:00:00.1 140 metric_logger.py:229] completed step: 41, seconds: 0.512, TFLOP/s/device: 3.250, "
          "Tokens/s/device: 4000.000, total_weights: 2048, loss: 2.345, lm_loss: 2.345, perplexity: 10.433")
  assert reproduce.parse_step_line(line) == {
      "step": 41, "perf/step_time_seconds": 0.512, "learning/loss": 2.345,
      "perf/per_device_tflops_per_sec": 3.25, "perf/per_device_tokens_per_sec": 4000.0, "source": "log"}
  assert math.isnan(reproduce.parse_step_line("completed step: 3, seconds: 1.0, total_weights: 1, loss: nan")
                    ["learning/loss"])
  assert reproduce.parse_step_line("Starting eval after train step 49") is None


def test_recover_missing_steps_keeps_eval_summaries_in_step_order(tmp_path):
  # What plain MaxText leaves after an eval at step 5: its running snapshot (eval step 0), its summary, steps 6..9.
  path = tmp_path / "metrics.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in (
      [{"step": 0.0, "eval/avg_loss": 2.9, "eval/step_time_seconds": 0.1},
       {"step": 5.0, "eval/avg_loss": 2.8, "eval/avg_z_loss": 0.0}]
      + [{"step": float(s), "learning/loss": 4.0 - 0.1 * s} for s in range(6, 10)])))
  logged = {s: reproduce.parse_step_line(f"completed step: {s}, seconds: 0.5, loss: {4.0 - 0.1 * s:.3f}")
            for s in range(10)}
  merged, n = reproduce.recover_missing_steps(path, logged)
  assert (merged.name, n) == ("metrics_merged.jsonl", 6)
  recs = [json.loads(l) for l in merged.read_text().splitlines()]
  assert [(r["step"], "eval/avg_loss" in r, r.get("source")) for r in recs] == (
      [(s, False, "log") for s in range(6)] + [(5.0, True, None)] + [(float(s), False, None) for s in range(6, 10)])
  assert reproduce.recover_missing_steps(merged, logged) == (merged, 0)  # complete: nothing to rebuild


def test_a_refused_rerun_leaves_no_empty_arm_folders(tmp_path, recipes, capsys):
  # issue 28 item 10: only the NVFP4 run's directory exists; the refusal must not create the baseline's folder
  out = tmp_path / "o"
  (out / "runs" / "demo_nvfp4").mkdir(parents=True)
  rc = cli(["reproduce", "demo", "--recipes-dir", str(recipes), "--out", str(out), "--steps", "10",
            "--python", fake_python(tmp_path)])
  err = capsys.readouterr().err
  assert rc == 2 and "demo_nvfp4 exists" in err and "--overwrite" in err
  assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == ["runs", "runs/demo_nvfp4"]


def _tree(path):
  return sorted((str(p.relative_to(path)), p.read_bytes() if p.is_file() else None) for p in path.rglob("*"))


def test_overwrite_checks_everything_first_and_leaves_nothing_of_the_earlier_runs(tmp_path, recipes, capsys):
  """--overwrite deletes only once every input is checked (a compare option that would fail after the training
  deleted nothing), and takes the earlier runs' derived files (metrics_merged.jsonl, the comparison) with them."""
  out = tmp_path / "o"
  args = ["reproduce", "demo", "--recipes-dir", str(recipes), "--out", str(out), "--steps", "10",
          "--python", fake_python(tmp_path), "--warmup", "1"]
  assert cli(args + ["truncate_at=6"]) == 0  # writes metrics_merged.jsonl and compare/ with plots
  before = _tree(out)
  for bad, word in ((["--tolerance", "-1"], "argument --tolerance: -1 is out of range"),
                    (["--smooth", "0"], "argument --smooth: 0 is out of range"),
                    (["--seed", "-3"], "argument --seed: -3 is out of range")):
    capsys.readouterr()
    assert cli(args + ["--overwrite", *bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and word in err[0], err
  assert _tree(out) == before
  assert cli(args + ["--overwrite", "--no-plots"]) == 0
  assert not (out / "bf16" / "metrics_merged.jsonl").exists() and not (out / "nvfp4" / "metrics_merged.jsonl").exists()
  assert sorted(os.listdir(out / "compare")) == ["maxtext_nvfp4_compare.json", "report.md"]  # no earlier figure


def test_out_holding_other_files_is_refused_and_dry_run_refuses_what_the_run_would(tmp_path, recipes, capsys):
  out = tmp_path / "mine"
  out.mkdir()
  (out / "notes.txt").write_text("keep me")
  base = ["reproduce", "demo", "--recipes-dir", str(recipes), "--out", str(out), "--python", fake_python(tmp_path)]
  for extra in ([], ["--dry-run"]):
    assert cli(base + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds notes.txt" in err[0] and "new or empty --out" in err[0], err
  assert os.listdir(out) == ["notes.txt"]
  out2 = tmp_path / "o2"
  (out2 / "runs" / "demo_bf16").mkdir(parents=True)  # an earlier run: the real run needs --overwrite, so does the dry run
  assert cli(base[:-4] + ["--out", str(out2), "--dry-run"]) == 2 and "--overwrite" in capsys.readouterr().err
  assert cli(base[:-4] + ["--out", str(out2), "--dry-run", "--overwrite"]) == 0
