"""``maxtext-nvfp4 study``: chunk boundaries, the rebuild from disk (records, resume point, set-aside
checkpoints, the resume check), bad input, and the chunk loop end to end with a fake trainer that behaves like
MaxText (resumes from its latest committed checkpoint, writes a record per step and checkpoints every
``checkpoint_period`` steps), killed and resumed. The bit-identical resume of real MaxText runs is
tests/tools/test_study_resume.py."""

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from maxtext_nvfp4.tools import study
from maxtext_nvfp4.tools.cli import main as cli

# Stands in for `python -m maxtext_nvfp4.train RECIPE k=v ...`: MaxText's resume and checkpoint layout.
FAKE_TRAINER = r'''#!{python}
import json, os, sys, time
args = dict(a.split("=", 1) for a in sys.argv[4:])
ckpt = os.path.join(args["base_output_directory"], args["run_name"], "checkpoints")
os.makedirs(ckpt, exist_ok=True)
done = sorted(int(d) for d in os.listdir(ckpt) if d.isdigit() and os.path.exists(os.path.join(ckpt, d, "commit_success.txt")))
start = done[-1] + 1 if done else 0
steps, period, ev = int(args["steps"]), int(args["checkpoint_period"]), int(args["eval_interval"])
drift = float(args.get("fake_drift", "0"))  # a "non-deterministic" trainer: depends on where it started
seed = int(args["init_weights_seed"]) + (0 if args.get("quantization", "nvfp4") in ("", "fp8") else 1)
with open(args["metrics_file"], "a") as f:
  for s in range(start, steps):
    time.sleep(float(args.get("fake_sleep", "0.01")))
    loss = 5.0 / (1 + s) ** 0.5 + 0.001 * seed + drift * start
    f.write(json.dumps({{"step": float(s), "learning/loss": loss, "learning/grad_norm": 1.0 / (1 + s),
                         "perf/step_time_seconds": 0.01}}) + "\n")
    f.flush()
    if ev > 0 and s % ev == 0:
      f.write(json.dumps({{"step": 0.0, "eval/avg_loss": loss + 1, "eval/step_time_seconds": 0.1}}) + "\n")
      f.write(json.dumps({{"step": float(s), "eval/avg_loss": loss + 1}}) + "\n")
      f.flush()
    if s % period == 0 or s == steps - 1:
      d = os.path.join(ckpt, str(s))
      os.makedirs(d + ".orbax-checkpoint-tmp")
      os.rename(d + ".orbax-checkpoint-tmp", d)
      open(os.path.join(d, "commit_success.txt"), "w").close()
print("done", start, steps)
'''


@pytest.fixture
def fake(tmp_path):
  p = tmp_path / "fakepy"
  p.write_text(FAKE_TRAINER.format(python=sys.executable))
  p.chmod(p.stat().st_mode | stat.S_IEXEC)
  recipes = tmp_path / "recipes"
  recipes.mkdir()
  for name in ("demo_bf16.yml", "demo_nvfp4.yml", "demo_nvfp4_paper.yml"):
    (recipes / name).write_text("base_config: base.yml\n")
  return str(p), str(recipes)


def args_for(d, fake, *more):
  python, recipes = fake
  return ["study", str(d), "--recipes-dir", recipes, "--python", python, "--poll", "0.01", "--no-report",
          "--arms", "bf16,nvfp4", "--steps", "10", "--chunk", "3", "--eval-interval", "2", *more]


def losses(path):
  recs = [json.loads(l) for l in Path(path).read_text().splitlines()]
  return [(r["step"], "eval/avg_loss" in r, r.get("learning/loss", r.get("eval/avg_loss"))) for r in recs]


def test_chunk_targets_and_completeness():
  assert [study.chunk_target(s, chunk=1000, steps=10001) for s in (0, 1, 999, 1000, 1001, 9001)] == \
      [1000, 1000, 1000, 2000, 2000, 10000]
  assert study.chunk_target(0, chunk=5, steps=5) == 4
  train = {s: {} for s in range(7)}
  assert study.complete_through(train, {0: {}, 3: {}, 6: {}}, 6, 3)
  assert not study.complete_through(train, {0: {}, 6: {}}, 6, 3)  # the eval after step 3 is missing
  assert not study.complete_through({s: {} for s in range(7) if s != 4}, {0: {}, 3: {}, 6: {}}, 6, 3)
  assert study.complete_through(train, {}, 6, 0)  # no evals


def test_rebuild_takes_the_latest_complete_checkpoint_and_sets_the_rest_aside(tmp_path):
  spec = study.Spec(preset="demo", arms=("bf16",), steps=20, chunk=3, eval_interval=3, eval_steps=1,
                    diagnostics_interval=0, seed=0)
  lay = study.Layout(root=tmp_path)
  chunks = lay.chunks("bf16")
  chunks.mkdir(parents=True)
  rec = lambda s, v=None: json.dumps({"step": float(s), "learning/loss": v if v is not None else 1.0 / (s + 1)})
  ev = lambda s: json.dumps({"step": float(s), "eval/avg_loss": 9.0 - s})
  # chunk 1: steps 0..7 (a killed child: the half line at the end), evals after 0, 3 and 6
  (chunks / "from_0000000_000.jsonl").write_text("\n".join(
      [rec(0), ev(0), rec(1), rec(2), rec(3), ev(3), rec(4), rec(5), rec(6), rec(7), '{"step": 8.0, "lear']))
  # chunk 2 resumed at 4 (it recomputed 4 and 5 identically, and step 6 differently) and died before eval 6
  (chunks / "from_0000004_000.jsonl").write_text("\n".join([rec(4), rec(5), rec(6, 0.5)]) + "\n")
  ck = lay.checkpoints("bf16")
  for s, committed in ((0, True), (3, True), (6, True), (9, False)):
    (ck / str(s)).mkdir(parents=True)
    if committed:
      (ck / str(s) / "commit_success.txt").write_text("")
  (ck / "12.orbax-checkpoint-tmp").mkdir()
  prog = study.rebuild_arm(lay, "bf16", spec)
  # checkpoint 6 is committed, but the last chunk's records lack the eval after step 6: resume after 3
  assert (prog.resume_from, prog.steps_done) == (3, 4)
  assert sorted(os.listdir(ck)) == ["0", "3"]
  assert sorted(prog.set_aside) == ["12.orbax-checkpoint-tmp", "6", "9"]
  assert len(os.listdir(lay.arm_dir("bf16") / "set_aside")) == 3
  assert losses(lay.metrics("bf16")) == [(0.0, False, 1.0), (0.0, True, 9.0), (1.0, False, 0.5), (2.0, False, 1 / 3),
                                         (3.0, False, 0.25), (3.0, True, 6.0)]
  assert (prog.rechecked, prog.mismatched) == (3, (6,))  # steps 4, 5 repeat bit for bit; step 6 does not
  assert not [p for p in lay.arm_dir("bf16").iterdir() if ".tmp" in p.name]  # the atomic write left nothing
  # nothing usable: start from scratch, an empty metrics file
  for p in (ck / "0", ck / "3"):
    (p / "commit_success.txt").unlink()
  assert study.rebuild_arm(lay, "bf16", spec).resume_from is None
  assert lay.metrics("bf16").read_text() == ""


def test_same_values_ignores_timing_only():
  a = {"step": 3, "learning/loss": 2.5, "perf/step_time_seconds": 0.1, "nvfp4/mlp/x_rel_err": 0.1}
  assert study.same_values(a, {**a, "perf/step_time_seconds": 9.0})
  assert not study.same_values(a, {**a, "nvfp4/mlp/x_rel_err": 0.1000001})
  assert not study.same_values(a, {"step": 3})  # nothing to compare is not a match


def test_study_runs_in_chunks_survives_a_sigkill_and_matches_an_uninterrupted_run(tmp_path, fake, capsys):
  one = tmp_path / "one"
  assert cli(args_for(one, fake, "--chunk", "100", "fake_sleep=0.05")) == 0  # one chunk: the uninterrupted reference
  assert "10/10 steps" in capsys.readouterr().out
  ref = {a: losses(study.Layout(root=one).metrics(a)) for a in ("bf16", "nvfp4")}
  assert ref["bf16"] != ref["nvfp4"]
  assert [s for s, is_eval, _ in ref["nvfp4"] if not is_eval] == list(range(10))

  d = tmp_path / "chunked"
  assert cli(args_for(d, fake, "--max-chunks", "1", "--verify-overlap", "1", "fake_sleep=0.05")) == 0
  out = capsys.readouterr().out
  state = json.loads((d / "state.json").read_text())
  assert state["arms"]["bf16"]["steps_done"] == 4 and state["arms"]["nvfp4"]["steps_done"] == 0
  assert "bf16                 4/10 steps" in out and "stopped" in out
  # the study process itself is SIGKILLed mid-chunk (its child dies with it), then continued
  cmd = [sys.executable, "-m", "maxtext_nvfp4", *args_for(d, fake, "--verify-overlap", "1", "fake_sleep=0.05")]
  proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
  deadline = time.time() + 60
  while not list((d / "arms" / "nvfp4" / "chunks").glob("*.jsonl")) or \
      not (d / "arms" / "nvfp4" / "chunks" / "from_0000000_000.jsonl").stat().st_size:
    assert time.time() < deadline and proc.poll() is None
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  part = d / "arms" / "nvfp4" / "chunks" / "from_0000000_000.jsonl"
  size = part.stat().st_size
  time.sleep(0.3)
  assert part.stat().st_size == size  # the training child died with the study (PR_SET_PDEATHSIG)
  assert len(study.read_records(part)[0]) < 10  # ... in the middle of the arm
  assert cli(args_for(d, fake, "--verify-overlap", "1", "fake_sleep=0.05")) == 0
  out = capsys.readouterr().out
  for arm in ("bf16", "nvfp4"):
    assert losses(study.Layout(root=d).metrics(arm)) == ref[arm]
  state = json.loads((d / "state.json").read_text())
  for arm in ("bf16", "nvfp4"):
    st = state["arms"][arm]
    assert st["status"] == "done" and st["steps_done"] == 10 and st["chunks"] >= 3
    assert st["rechecked_steps"] >= 2 and st["mismatched_steps"] == []
  assert "resume check" in out and "DIFFER" not in out
  assert not list(d.rglob(".*.tmp*"))


def test_a_resume_that_is_not_bit_identical_is_reported(tmp_path, fake, capsys):
  d = tmp_path / "s"
  assert cli(args_for(d, fake, "--arms", "bf16", "--verify-overlap", "1", "fake_drift=0.001")) == 0
  out = capsys.readouterr().out
  assert "RESUME NOT BIT-IDENTICAL" in out
  assert json.loads((d / "state.json").read_text())["arms"]["bf16"]["mismatched_steps"]


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, fake, capsys):
  d = tmp_path / "s"
  cases = [
      (args_for(d, fake, "--arms", "bf16,nope"), "unknown arm(s) nope"),
      (args_for(d, fake, "--steps", "1"), "argument --steps: 1 is out of range: need an integer >= 2"),
      # 0 is a value, not "the default": each is refused with the range (they used to mean the preset's value)
      (args_for(d, fake, "--steps", "0"), "argument --steps: 0 is out of range"),
      (args_for(d, fake, "--chunk", "0"), "argument --chunk: 0 is out of range: need an integer >= 1"),
      (args_for(d, fake, "--eval-steps", "0"), "argument --eval-steps: 0 is out of range"),
      (args_for(d, fake, "--max-chunks", "0"), "argument --max-chunks: 0 is out of range"),
      (args_for(d, fake, "--seed", "-1"), "argument --seed: -1 is out of range"),
      (args_for(d, fake, "--progress-every", "nan"), "argument --progress-every: nan is out of range"),
      (args_for(d, fake, "oops"), "KEY=VALUE"),
      (["study", str(d), "--status"], "holds no study"),
  ]
  for argv, what in cases:
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert what in err and len(err.strip().splitlines()) == 1, err
  assert not d.exists()
  (d / "x").parent.mkdir()
  (d / "x").write_text("")
  assert cli(args_for(d, fake)) == 2 and "not empty" in capsys.readouterr().err
  d2 = tmp_path / "s2"
  assert cli(args_for(d2, fake, "--max-chunks", "1")) == 0
  capsys.readouterr()
  assert cli(args_for(d2, fake, "--steps", "12")) == 2
  assert "--steps 12: the study was started with 10" in capsys.readouterr().err
  assert cli(["study", str(d2), "--status"]) == 0 and "bf16" in capsys.readouterr().out
  assert cli(["study", str(d2), "--report", "--no-plots"]) in (0, 1)  # compare's exit code over the steps so far
  md = (d2 / "compare" / "report.md").read_text()
  assert "study s2: preset demo, 10 steps per arm" in md and "| bf16 | 4 |" in md
  # the chunk size may change on a later call (only where checkpoints are written moves)
  assert cli(args_for(d2, fake, "--chunk", "4", "--max-chunks", "1")) == 0
  assert "chunks of 4 steps from now on (were 3)" in capsys.readouterr().out
  assert json.loads((d2 / "study.json").read_text())["chunk"] == 4
  assert json.loads((d2 / "state.json").read_text())["arms"]["nvfp4"]["steps_done"] == 5  # 0..4: one chunk of 4
  # --only trains the named arms only (here the one ahead: no round-robin)
  assert cli(args_for(d2, fake, "--only", "nvfp4", "--until", "9")) == 0
  arms = json.loads((d2 / "state.json").read_text())["arms"]
  assert arms["bf16"]["steps_done"] == 4 and arms["nvfp4"]["steps_done"] >= 9
  assert cli(args_for(d2, fake, "--only", "fp8")) == 2 and "the study's arms are bf16,nvfp4" in capsys.readouterr().err


def test_dry_run_prints_the_fixed_arm_commands(tmp_path, fake, capsys):
  d = tmp_path / "s"
  assert cli(args_for(d, fake, "--arms", "bf16,fp8,nvfp4,nvfp4_switch", "--dry-run")) == 0
  out = capsys.readouterr().out.splitlines()
  cmds = {out[i][2:].split(":")[0]: out[i + 1].split() for i in range(0, len(out), 2)}
  assert all(out[i].endswith(": starts at step 0") for i in range(0, len(out), 2))
  assert list(cmds) == ["bf16", "fp8", "nvfp4", "nvfp4_switch"]
  for arm, cmd in cmds.items():
    assert "steps=10" in cmd and "checkpoint_period=3" in cmd and "enable_checkpointing=true" in cmd
    assert "data_shuffle_seed=0" in cmd and f"run_name={arm}" in cmd
  assert "quantization=fp8" in cmds["fp8"] and "quantization=" in cmds["bf16"]
  assert "nvfp4_switch_at_step=0.8" in cmds["nvfp4_switch"] and "nvfp4_diagnostics=true" in cmds["nvfp4"]
  # telemetry in every arm, the gradient fidelity in the NVFP4 arms only
  assert all("nvfp4_diagnostics=true" in c for c in cmds.values())
  assert ["nvfp4_diagnostics_grad=true" in cmds[a] for a in cmds] == [False, False, True, True]
  assert not d.exists()


def test_status_of_a_killed_study_does_not_say_running(tmp_path, fake, capsys):
  """A SIGKILLed study process leaves state.json saying an arm is running; --status must tell a live study
  (it holds DIR/.lock) from a dead one."""
  import fcntl  # pylint: disable=import-outside-toplevel

  d = tmp_path / "s"
  assert cli(args_for(d, fake, "--max-chunks", "1")) == 0
  capsys.readouterr()
  state = json.loads((d / "state.json").read_text())
  state["arms"]["nvfp4"]["status"] = "running"  # what a kill in the middle of the nvfp4 chunk leaves
  state["arms"]["bf16"].update(steps_done=0, last_loss=None)  # ... and a state saved before bf16's chunk ended
  state.update(running="nvfp4", pid=2 ** 22 + 1)
  (d / "state.json").write_text(json.dumps(state))
  assert cli(["study", str(d), "--status"]) == 0
  out = capsys.readouterr().out.splitlines()
  line = next(l for l in out if l.strip().startswith("nvfp4"))
  assert "running" not in line and "killed" in line and f"maxtext-nvfp4 study {d}" in line, line  # (or its path)
  bf16 = next(l for l in out if l.strip().startswith("bf16"))
  assert "4/10 steps" in bf16 and ", loss " in bf16, bf16  # where the next call resumes, read from disk
  with open(d / study.LOCK_FILE, encoding="utf8") as lock:  # a live study process holds the lock
    fcntl.flock(lock, fcntl.LOCK_EX)
    assert cli(["study", str(d), "--status"]) == 0
  line = next(l for l in capsys.readouterr().out.splitlines() if l.strip().startswith("nvfp4"))
  assert line.rstrip().endswith("running"), line


def test_dry_run_of_a_continuing_study_prints_the_next_chunk(tmp_path, fake, capsys):
  """Not the first call's commands again: where each arm resumes, and the metrics file its next chunk writes."""
  d = tmp_path / "s"
  assert cli(args_for(d, fake, "--max-chunks", "1")) == 0
  capsys.readouterr()
  before = sorted(p for p in d.rglob("*"))
  assert cli(["study", str(d), "--python", fake[0], "--dry-run"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0] == "# bf16: resumes after step 3" and "metrics_file=" + str(d / "arms" / "bf16" / "chunks" /
                                                                         "from_0000004_000.jsonl") in out[1]
  assert out[2] == "# nvfp4: starts at step 0" and "from_0000000_000.jsonl" in out[3]
  assert sorted(p for p in d.rglob("*")) == before
