"""The demo's last screen (``tools/demo_summary.py``) reports compare's numbers for the two arms: the loss
gap with the verdict, the step-time ratio, the report/plot paths and the next commands."""

from __future__ import annotations

import json
import math
import os
import statistics

from maxtext_nvfp4.tools import demo_summary

N = 60


def _write(path, losses, times):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    for s, (loss, t) in enumerate(zip(losses, times)):
      f.write(json.dumps({"step": float(s), "learning/loss": loss, "perf/step_time_seconds": t,
                          "perf/per_device_tokens": 1024.0, "perf/per_device_tokens_per_sec": 1024.0 / t}) + "\n")


def _pair(out, gap):
  base = [3.0 + 2.0 * math.exp(-s / 10) for s in range(N)]
  t_base = [5.0 if s < 3 else 0.10 for s in range(N)]
  t_nv = [5.0 if s < 3 else 0.25 for s in range(N)]
  _write(os.path.join(out, "bf16", "metrics.jsonl"), base, t_base)
  _write(os.path.join(out, "nvfp4", "metrics.jsonl"), [b + gap for b in base], t_nv)
  os.makedirs(os.path.join(out, "compare"))
  for name in ("report.md", "loss.png", "throughput.png"):
    open(os.path.join(out, "compare", name), "w").close()


def test_summary_states_the_gap_verdict_and_step_time_ratio(tmp_path):
  out = str(tmp_path / "demo")
  _pair(out, 0.01)
  text = demo_summary.summary(out)
  assert "NVFP4 - BF16 = +0.0100 nats" in text and "verdict    PASS" in text
  # compare's direction (baseline / run), as its table prints it: 0.400x, not 2.50x
  assert f"BF16 0.100 s / NVFP4 0.250 s = {0.10 / statistics.median([0.25] * 10):.3f}x" in text and "slower" in text
  assert os.path.join(out, "compare", "report.md") in text and os.path.join(out, "compare", "loss.png") in text
  assert "maxtext-nvfp4 compare bf16=" in text and "maxtext-nvfp4 export" in text


def test_a_gap_over_the_tolerance_is_a_fail_and_merged_metrics_are_preferred(tmp_path):
  out = str(tmp_path / "demo")
  _pair(out, 0.2)
  os.replace(os.path.join(out, "nvfp4", "metrics.jsonl"), os.path.join(out, "nvfp4", "metrics_merged.jsonl"))
  text = demo_summary.summary(out)
  assert "+0.2000 nats" in text and "verdict    FAIL" in text and "metrics_merged.jsonl" in text


def test_a_merged_file_older_than_the_metrics_is_an_earlier_runs_and_ignored(tmp_path):
  out = str(tmp_path / "demo")
  _pair(out, 0.01)
  stale = os.path.join(out, "nvfp4", "metrics_merged.jsonl")
  with open(os.path.join(out, "nvfp4", "metrics.jsonl"), encoding="utf-8") as f, open(stale, "w", encoding="utf-8") as g:
    for line in f:  # another run's losses (+1 nat)
      rec = json.loads(line)
      g.write(json.dumps({**rec, "learning/loss": rec["learning/loss"] + 1}) + "\n")
  os.utime(stale, (1, 1))  # written before this run's metrics.jsonl
  text = demo_summary.summary(out)
  assert "+0.0100 nats" in text and "metrics_merged" not in text


def test_missing_metrics_is_one_line_exit_2(tmp_path, capsys):
  assert demo_summary.main([str(tmp_path)]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("maxtext-nvfp4 demo summary: error:")


def test_the_next_commands_run_as_printed_without_the_venv_on_path(tmp_path, monkeypatch):
  """A fresh clone's shell has no .venv/bin on PATH (demo.sh calls .venv/bin/...): a bare ``maxtext-nvfp4`` is
  not found and a bare ``python`` is the system one. The printed commands must name this environment's."""
  import shlex  # pylint: disable=import-outside-toplevel
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel

  out = str(tmp_path / "demo")
  _pair(out, 0.01)
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("PATH", "/usr/bin:/bin")
  nxt = [l[len("next"):].strip() if l.startswith("next") else l.strip()
         for l in demo_summary.summary(out).splitlines()[-5:] if l.startswith(("next", "  "))]
  compare_cmd, train_cmd = shlex.split(nxt[0].split("#")[0]), shlex.split(nxt[1])
  bindir = os.path.dirname(sys.executable)
  if os.path.isfile(os.path.join(bindir, "maxtext-nvfp4")):
    assert compare_cmd[0] == os.path.join(bindir, "maxtext-nvfp4")
  assert train_cmd[0] == sys.executable and train_cmd[1:3] == ["-m", "maxtext_nvfp4.train"]
  assert any("activate" in l for l in nxt)
  env = dict(os.environ, PATH="/usr/bin:/bin")
  done = subprocess.run(compare_cmd, env=env, capture_output=True, text=True, check=False, timeout=300)
  assert done.returncode in (0, 1) and (tmp_path / "my_compare" / "report.md").is_file(), done.stderr[-2000:]
