"""``maxtext-nvfp4 compare`` on synthetic MaxText metrics files with known speeds and loss gaps.

Every expected number below is derived from how the files are constructed (closed forms), not from the
implementation.
"""

import json
import os
import math

import numpy as np
import pytest
from PIL import Image

from maxtext_nvfp4.tools import compare
from maxtext_nvfp4.tools import comparison
from maxtext_nvfp4.tools import plots
from maxtext_nvfp4.tools import report
from maxtext_nvfp4.tools.cli import main as cli

N = 50  # steps per run; default warm-up = max(1, 50 // 10) = 5 -> steps 0..5 skipped, 6..49 measured


def base_loss(s):
  return 3.0 + 2.0 * math.exp(-s / 10.0)


def gap(s):
  # large gap during the first 20 % (positions 0..9) so the converged-part definition matters
  return 0.5 if s < 10 else 0.02 + 0.001 * (s - 10)


def record(s, loss, t, **extra):
  r = {"step": float(s), "learning/loss": loss, "learning/grad_norm": 1.0, "perf/step_time_seconds": t,
       "perf/per_device_tokens": 2048.0, "perf/per_device_tokens_per_sec": 2048.0 / t,
       "perf/per_device_tflops": 3.0, "perf/per_device_tflops_per_sec": 3.0 / t, "run_name": "r"}
  r.update(extra)
  return r


def write(path, records, extra_lines=()):
  with open(path, "w", encoding="utf8") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")
    for line in extra_lines:
      f.write(line + "\n")
  return str(path)


def step_time(s, fast):
  if s <= 5:
    return 10.0  # compile + warm-up steps: must be skipped
  return (0.8 if fast else 1.0) + 0.001 * s


def make_pair(tmp_path, n_run=N, nan_at=None, run_extra=None):
  base = [record(s, base_loss(s), step_time(s, False)) for s in range(N)]
  run = []
  for s in range(n_run):
    loss = base_loss(s) + gap(s)
    if nan_at is not None and s >= nan_at:
      loss = float("nan")
    run.append(record(s, loss, step_time(s, True), **(run_extra(s) if run_extra else {})))
  evals_b = [json.dumps({"step": N - 1.0, "eval/avg_loss": 3.1, "eval/total_loss": 310.0,
                         "eval/total_weights": 100.0, "run_name": "b"}),
             # a running (per-eval-batch) snapshot: must be ignored
             json.dumps({"step": 0.0, "eval/avg_loss": 99.0, "eval/step_time_seconds": 0.1})]
  evals_r = [json.dumps({"step": N - 1.0, "eval/avg_loss": 3.15, "eval/total_loss": 315.0,
                         "eval/total_weights": 100.0, "run_name": "r"})]
  (tmp_path / "fp8").mkdir(exist_ok=True)
  (tmp_path / "nvfp4").mkdir(exist_ok=True)
  b = write(tmp_path / "fp8" / "metrics.jsonl", base, evals_b)
  r = write(tmp_path / "nvfp4" / "metrics.jsonl", run, evals_r)
  return b, r


# median of the 44 measured step times (steps 6..49) = mean of the 22nd and 23rd = steps 27 and 28
MED_BASE = 1.0 + 0.001 * 27.5
MED_RUN = 0.8 + 0.001 * 27.5
CONV = range(10, N)  # converged part: positions floor(0.2 * 50) = 10 .. 49
MEAN_GAP = 0.02 + 0.001 * (sum(range(40)) / 40)  # 0.0395
FINAL_BASE = sum(base_loss(s) for s in range(45, 50)) / 5  # last ceil(50 / 10) = 5 steps
FINAL_RUN = sum(base_loss(s) + gap(s) for s in range(45, 50)) / 5
REL_GAP = MEAN_GAP / (sum(base_loss(s) for s in CONV) / 40)


def test_every_number_exact(tmp_path, capsys):
  b, r = make_pair(tmp_path)
  c = comparison.compare_runs([compare.load_run(b), compare.load_run(r)], comparison.Options(smooth=4))
  base, run = c.results
  assert (base.run.name, run.run.name) == ("fp8", "nvfp4")  # names from the run directories
  for res, med in ((base, MED_BASE), (run, MED_RUN)):
    tp = res.throughput
    assert (tp.skipped, tp.measured) == (6, 44)
    assert tp.median_step_time == pytest.approx(med, rel=1e-12)
    assert tp.tokens_per_sec == pytest.approx(2048.0 / med, rel=1e-12)
    assert tp.tflops_per_sec == pytest.approx(3.0 / med, rel=1e-12)
  assert run.throughput.speedup == pytest.approx(MED_BASE / MED_RUN, rel=1e-12)
  ls = run.loss
  assert len(ls.steps) == N and ls.converged_start_step == 10
  assert ls.final_loss == pytest.approx(FINAL_RUN, abs=1e-12)
  assert ls.final_loss_baseline == pytest.approx(FINAL_BASE, abs=1e-12)
  assert ls.mean_gap == pytest.approx(MEAN_GAP, abs=1e-12)
  # smoothed (window 4) gap is largest at the end: mean of gap(46..49)
  assert ls.max_gap == pytest.approx(0.02 + 0.001 * 37.5, abs=1e-12)
  assert ls.relative_gap == pytest.approx(REL_GAP, rel=1e-10)
  assert (ls.eval_loss, ls.eval_loss_baseline) == (3.15, 3.1)
  assert c.smooth == 4
  assert run.verdict == "FAIL" and c.verdict == "FAIL" and c.exit_code == 1  # 0.0395 > 0.03
  c2 = comparison.compare_runs([compare.load_run(b), compare.load_run(r)], comparison.Options(tolerance=0.04))
  assert c2.verdict == "PASS" and c2.exit_code == 0
  # window 1: the max gap is the raw max gap(49)
  c3 = comparison.compare_runs([compare.load_run(b), compare.load_run(r)], comparison.Options(smooth=1))
  assert c3.results[1].loss.max_gap == pytest.approx(0.059, abs=1e-12)


def test_cli_outputs_and_exit_codes(tmp_path, capsys):
  b, r = make_pair(tmp_path)
  out = tmp_path / "out"
  assert cli(["compare", b, r, "--out", str(out)]) == 1
  term = capsys.readouterr().out
  assert "VERDICT: FAIL" in term and "bf16-equivalent" in term
  assert f"{MED_RUN:.4f}" in term and f"{MED_BASE / MED_RUN:.3f}x" in term and f"{MEAN_GAP:+.4f}" in term
  md = (out / "report.md").read_text()
  assert "**Verdict: FAIL**" in md and f"| {FINAL_RUN:.4f} |" in md and f"{100 * REL_GAP:+.2f}%" in md
  assert "6 skipped / 44 measured" in md and "floor(0.2·n)" in md and "bf16-equivalent" in md
  assert "| nvfp4 | 49 | 3.1500 | +0.0500 |" in md  # eval table: final eval only, running snapshot ignored
  assert cli(["compare", b, r, "--out", str(out), "--tolerance", "0.04"]) == 0
  assert "VERDICT: PASS" in capsys.readouterr().out
  # --baseline swaps roles: the fp8 run is now 0.0395 nats better -> PASS, speedup inverted
  assert cli(["compare", b, "--baseline", r, "--out", str(tmp_path / "o2"), "--no-plots"]) == 0
  assert f"{MED_RUN / MED_BASE:.3f}x" in capsys.readouterr().out
  # --warmup 0: only step 0 skipped; 49 values = 44 fast ones (steps 6..49) + five 10 s ones (steps 1..5):
  # the median is the 25th smallest, i.e. step 6 + 24 = 30
  c = comparison.compare_runs([compare.load_run(b), compare.load_run(r)], comparison.Options(warmup=0))
  assert c.results[1].throughput.measured == 49
  assert c.results[1].throughput.median_step_time == pytest.approx(0.8 + 0.001 * 30, rel=1e-12)


def test_named_runs_and_directories(tmp_path, capsys):
  b, r = make_pair(tmp_path)
  assert cli(["compare", f"FP8={tmp_path / 'fp8'}", f"NV={r}", "--out", str(tmp_path / "o"), "--no-plots"]) == 1
  out = capsys.readouterr().out
  assert out.splitlines()[2].startswith("FP8 ") and out.splitlines()[3].startswith("NV ")
  # a directory with two metrics files is ambiguous
  write(tmp_path / "fp8" / "other.jsonl", [record(0, 1.0, 1.0)])
  assert cli(["compare", str(tmp_path / "fp8"), r, "--out", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err
  assert "several metrics files" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("content,needle", [
    ("", "is empty"),
    ("\n\n", "is empty"),
    ("not json\n{broken\n", "no training records"),
    (json.dumps({"step": 0, "eval/avg_loss": 1.0}) + "\n", "no training records"),
])
def test_bad_inputs_exit_2_one_line(tmp_path, capsys, content, needle):
  b, _ = make_pair(tmp_path)
  bad = tmp_path / "bad.jsonl"
  bad.write_text(content)
  assert cli(["compare", b, str(bad), "--out", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err
  assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
  assert not (tmp_path / "o").exists()


def test_missing_path_bad_flags_and_disjoint_steps(tmp_path, capsys):
  b, _ = make_pair(tmp_path)
  assert cli(["compare", b, str(tmp_path / "nope.jsonl")]) == 2
  assert "no such file" in capsys.readouterr().err
  assert cli(["compare", b, b, "--smooth", "0"]) == 2
  assert cli(["compare", b, "--tolerance", "abc"]) == 2
  late = write(tmp_path / "late.jsonl", [record(s, 1.0, 1.0) for s in range(100, 110)])
  assert cli(["compare", b, late, "--out", str(tmp_path / "o")]) == 2
  assert "late shares no step with the baseline fp8" in capsys.readouterr().err


def test_malformed_lines_skipped_and_reported(tmp_path, capsys):
  b, r = make_pair(tmp_path)
  lines = open(r).read().splitlines()
  lines.insert(3, "{truncated")
  lines.insert(7, "[1, 2]")
  lines.append('{"step": 3, "learning/loss": "x"}')
  (tmp_path / "nvfp4" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
  c = comparison.compare_runs([compare.load_run(b), compare.load_run(r)])
  run = c.results[1]
  assert run.run.malformed == 3 and run.run.first_malformed == 4
  assert any("3 malformed line(s), first at line 4" in n for n in run.notes)
  assert run.loss.mean_gap == pytest.approx(MEAN_GAP, abs=1e-12)  # the good records are all kept


def test_mismatched_lengths_use_common_steps(tmp_path):
  b, r = make_pair(tmp_path, n_run=40)
  c = comparison.compare_runs([compare.load_run(b), compare.load_run(r)])
  run = c.results[1]
  ls = run.loss
  assert ls.steps == tuple(range(40))
  # n = 40: converged part = positions 8..39, final = last 4 common steps
  assert ls.converged_start_step == 8
  gaps = [gap(s) for s in range(8, 40)]
  assert ls.mean_gap == pytest.approx(sum(gaps) / len(gaps), abs=1e-12)
  assert ls.final_loss == pytest.approx(sum(base_loss(s) + gap(s) for s in range(36, 40)) / 4, abs=1e-12)
  assert ls.final_loss_baseline == pytest.approx(sum(base_loss(s) for s in range(36, 40)) / 4, abs=1e-12)
  assert any("40 common steps" in n for n in run.notes)


def test_nan_loss_is_divergence_fail(tmp_path, capsys):
  b, r = make_pair(tmp_path, nan_at=30)
  assert cli(["compare", b, r, "--out", str(tmp_path / "o"), "--tolerance", "1.0"]) == 1
  out = capsys.readouterr().out
  assert "first non-finite loss (nan) at step 30" in out and "VERDICT: FAIL" in out
  c = comparison.compare_runs([compare.load_run(b), compare.load_run(r)])
  assert c.results[1].loss.steps == tuple(range(30))
  assert c.results[1].loss.converged_start_step == 6  # floor(0.2 * 30)
  # a diverged baseline makes every comparison FAIL too
  assert cli(["compare", r, b, "--out", str(tmp_path / "o2"), "--tolerance", "1.0"]) == 1
  assert "baseline diverged at step 30" in capsys.readouterr().out


def test_missing_perf_keys_and_single_run(tmp_path, capsys):
  b, _ = make_pair(tmp_path)
  bare = write(tmp_path / "bare.jsonl", [{"step": s, "learning/loss": base_loss(s)} for s in range(N)])
  c = comparison.compare_runs([compare.load_run(b), compare.load_run(bare)])
  tp = c.results[1].throughput
  assert tp.median_step_time is None and tp.tokens_per_sec is None and tp.speedup is None
  assert any("no 'perf/step_time_seconds'" in n for n in c.results[1].notes)
  assert c.results[1].loss.mean_gap == 0.0 and c.verdict == "PASS"
  assert cli(["compare", b, bare, "--out", str(tmp_path / "o")]) == 0  # plots cope with n/a bars
  assert "n/a" in capsys.readouterr().out
  assert cli(["compare", b, "--out", str(tmp_path / "o1")]) == 0  # one run: summary only
  assert "VERDICT: n/a" in capsys.readouterr().out


def test_diagnostics_summarized(tmp_path, capsys):
  diag = lambda s: {"nvfp4/mlp/x_rel_err": 0.1 + s / 1000, "nvfp4/attn/underflow": 0.25} if s % 10 == 0 else {}
  b, r = make_pair(tmp_path, run_extra=diag)
  out = tmp_path / "o"
  assert cli(["compare", b, r, "--out", str(out), "--no-plots", "--tolerance", "0.04"]) == 0
  assert "nvfp4 diagnostics: 2 metric(s)" in capsys.readouterr().out
  md = (out / "report.md").read_text()
  # x_rel_err at steps 0,10,20,30,40: last 0.14 (step 40), mean 0.12
  assert "| nvfp4/mlp/x_rel_err | nvfp4 | 5 | 0.14 (40) | 0.12 |" in md
  assert "| nvfp4/attn/underflow | nvfp4 | 5 | 0.25 (40) | 0.25 |" in md


def test_moving_average():
  assert comparison.moving_average([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
  assert comparison.moving_average([1.0, 2.0, 3.0], 1) == [1.0, 2.0, 3.0]
  assert comparison.moving_average([2.0, 4.0, 9.0], 10) == [2.0, 3.0, 5.0]


def _trailing(vals, w):
  out = []
  for i in range(len(vals)):
    win = vals[max(0, i - w + 1): i + 1]
    out.append(sum(win) / len(win))
  return out


def test_plots_drawn_from_data(tmp_path):
  b, r = make_pair(tmp_path)
  c = comparison.compare_runs([compare.load_run(b), compare.load_run(r)], comparison.Options(smooth=3))
  fig = plots.loss_figure(c)
  lines = {ln.get_gid(): ln for ax in fig.axes for ln in ax.get_lines() if ln.get_gid()}
  sm = lines["smoothed:nvfp4"]
  assert list(sm.get_xdata()) == list(range(N))
  np.testing.assert_allclose(sm.get_ydata(), _trailing([base_loss(s) + gap(s) for s in range(N)], 3), atol=1e-12)
  np.testing.assert_allclose(lines["raw:fp8"].get_ydata(), [base_loss(s) for s in range(N)], atol=0)
  np.testing.assert_allclose(lines["gap:nvfp4"].get_ydata(), _trailing([gap(s) for s in range(N)], 3), atol=1e-12)
  tfig = plots.throughput_figure(c)
  bars = {p.get_gid(): p.get_height() for ax in tfig.axes for p in ax.patches if p.get_gid()}
  assert bars["step_time:fp8"] == pytest.approx(MED_BASE) and bars["step_time:nvfp4"] == pytest.approx(MED_RUN)
  assert bars["tokens:nvfp4"] == pytest.approx(2048 / MED_RUN)

  # PNGs: expected size, not blank, and they change with the data
  o1, o2 = tmp_path / "o1", tmp_path / "o2"
  report.write_outputs(c, o1)
  (tmp_path / "x").mkdir()
  b2, r2 = make_pair(tmp_path / "x", nan_at=25)
  report.write_outputs(comparison.compare_runs([compare.load_run(b2), compare.load_run(r2)],
                                             comparison.Options(smooth=3)), o2)
  img1 = np.asarray(Image.open(o1 / "loss.png").convert("L"), dtype=np.int16)
  img2 = np.asarray(Image.open(o2 / "loss.png").convert("L"), dtype=np.int16)
  assert img1.shape == (750, 1000) and Image.open(o1 / "throughput.png").size == (1000, 450)
  assert img1.std() > 10  # not a blank canvas
  changed_cols = np.nonzero(np.abs(img1 - img2).sum(axis=0))[0]
  assert len(changed_cols) > 100  # curves differ across a wide range of x


def test_maxtext_eval_truncation_is_flagged(tmp_path):
  # MaxText 0.2.5 truncates metrics_file at the first running-eval snapshot (eval step 0) of each eval
  b, _ = make_pair(tmp_path)
  running = json.dumps({"step": 0.0, "eval/avg_loss": 3.2, "eval/step_time_seconds": 0.1})
  r = write(tmp_path / "trunc.jsonl", [], [running] + [json.dumps(record(s, base_loss(s), 1.0)) for s in range(25, N)])
  c = comparison.compare_runs([compare.load_run(b), compare.load_run(r)])
  run = c.results[1]
  assert any("truncated it at an eval" in n for n in run.notes)
  assert run.loss.steps == tuple(range(25, N)) and run.loss.mean_gap == 0.0
  assert not any("truncated" in n for n in c.results[0].notes)


def test_plugin_written_file_has_no_truncation_note(tmp_path):
  # What the plugin's writer leaves for a fresh run with an eval after step 0 (tests/tools/test_metrics_file.py):
  # the eval's running snapshot and summary may come first (step 0), then every training step from 0.
  b, _ = make_pair(tmp_path)
  first = [json.dumps({"step": 0.0, "eval/avg_loss": 5.0, "eval/step_time_seconds": 0.1}),
           json.dumps({"step": 0.0, "eval/avg_loss": 5.0, "eval/avg_z_loss": 0.0})]
  r = write(tmp_path / "plugin.jsonl", [], first + [json.dumps(record(s, base_loss(s), 1.0)) for s in range(N)])
  run = compare.load_run(r)
  assert run.warnings == () and run.sorted_steps == list(range(N)) and run.running_evals == 1
  assert run.eval_loss == {0: 5.0}
  c = comparison.compare_runs([compare.load_run(b), run])
  assert not any("truncated" in n for res in c.results for n in res.notes) and c.verdict == "PASS"


def test_repeated_steps_last_record_wins_and_noted(tmp_path):
  # a run resumed at step 3 appends steps 3.. again to the same file
  recs = [record(s, 9.0, 1.0) for s in range(5)] + [record(s, base_loss(s), 1.0) for s in range(3, N)]
  run = compare.load_run(write(tmp_path / "resumed.jsonl", recs))
  assert run.repeated_steps == 2 and run.loss(3) == base_loss(3) and run.loss(2) == 9.0
  assert run.warnings == ("2 training step(s) recorded more than once (e.g. a resumed run); the last record of "
                          "each is used",)


@pytest.mark.parametrize("first_run_step, verdict", [(48, comparison.INSUFFICIENT), (40, "PASS")])
def test_overlap_below_the_minimum_is_insufficient_not_pass(tmp_path, capsys, first_run_step, verdict):
  # 50 baseline steps vs 50 run steps starting at first_run_step: they share 50 - first_run_step steps;
  # the minimum is min(20, ceil(0.2 * 50)) = 10. The run's loss is 48 % lower: on 2 steps that is no evidence.
  b, _ = make_pair(tmp_path)
  late = write(tmp_path / "late.jsonl", [record(s, 0.52 * base_loss(s), 1.0) for s in range(first_run_step,
                                                                                            first_run_step + N)])
  c = comparison.compare_runs([compare.load_run(b), compare.load_run(late)], comparison.Options(tolerance=10))
  res = c.results[1]
  assert res.verdict == verdict and c.verdict == verdict
  shared = N - first_run_step
  assert comparison.min_overlap(N, N) == 10
  if verdict == comparison.INSUFFICIENT:
    assert c.exit_code == 1
    assert any(n.startswith(f"insufficient overlap: {shared} common step(s) with the baseline, need at least 10")
               for n in res.notes)
    assert cli(["compare", b, late, "--out", str(tmp_path / "o"), "--no-plots", "--tolerance", "10"]) == 1
    assert f"VERDICT: {comparison.INSUFFICIENT}" in capsys.readouterr().out
  else:
    assert c.exit_code == 0 and not any("insufficient" in n for n in res.notes)


def test_diverged_run_throughput_from_finite_steps_only(tmp_path):
  # the NaN steps record a tiny step time (an aborting step): it must not enter the median
  b, r = make_pair(tmp_path, nan_at=30, run_extra=lambda s: {"perf/step_time_seconds": 1e-4} if s >= 30 else {})
  c = comparison.compare_runs([compare.load_run(b), compare.load_run(r)])
  tp = c.results[1].throughput
  # steps 0..29 are finite: warm-up max(1, 30 // 10) = 3 -> steps 0..3 skipped, 4..29 measured (26 steps):
  # two 10 s steps (4, 5) and 24 fast ones (6..29); the median is the mean of the 13th and 14th smallest
  # = steps 18 and 19.
  assert (tp.skipped, tp.measured, tp.diverged_steps) == (4, 26, 20)
  assert tp.median_step_time == pytest.approx(0.8 + 0.001 * 18.5, rel=1e-12)
  assert tp.tokens_per_sec == pytest.approx(2048.0 / (0.8 + 0.001 * 18.5), rel=1e-12)
  assert any("before the first non-finite loss" in n for n in c.results[1].notes)
  assert c.results[0].throughput.diverged_steps == 0


def test_non_finite_labels_do_not_overprint(tmp_path):
  b, r = make_pair(tmp_path, nan_at=30)
  (tmp_path / "x").mkdir()
  _, r2 = make_pair(tmp_path / "x", nan_at=30)
  c = comparison.compare_runs([compare.load_run(r), compare.load_run(f"again={r2}"), compare.load_run(b)])
  fig = plots.loss_figure(c)
  labels = {t.get_gid(): t for t in fig.axes[0].texts if (t.get_gid() or "").startswith("nonfinite:")}
  assert set(labels) == {"nonfinite:nvfp4", "nonfinite:again"}
  (x1, y1), (x2, y2) = (t.xy for t in labels.values())
  assert x1 == x2 == 30 and abs(y1 - y2) >= 0.05  # same step, different heights
  fig.canvas.draw()
  boxes = [t.get_window_extent() for t in labels.values()]
  assert not boxes[0].overlaps(boxes[1])


def test_layers_import_downward_only():
  """metrics <- comparison <- report/plots <- compare: no module imports one after it, at any level
  (function-level imports included), so plots never imports compare."""
  import ast  # pylint: disable=import-outside-toplevel
  import pathlib  # pylint: disable=import-outside-toplevel

  order = ["metrics", "comparison", "plots", "report", "compare"]
  tools = pathlib.Path(compare.__file__).parent
  for i, name in enumerate(order):
    tree = ast.parse((tools / f"{name}.py").read_text())
    used = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module == "maxtext_nvfp4.tools":
        used |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("maxtext_nvfp4.tools."):
        used.add(node.module.rsplit(".", 1)[1])
    later = used & set(order[i + 1:])
    assert not later, f"{name}.py imports {sorted(later)}"


def test_eval_gap_is_taken_at_the_last_eval_step_both_runs_have(tmp_path):
  """A baseline that has run further (a study still going) has a later eval: the gap compares the two runs at
  the last eval step they share, not each one's own last eval."""
  base = [record(s, base_loss(s), step_time(s, False)) for s in range(N)]
  run = [record(s, base_loss(s) + gap(s), step_time(s, True)) for s in range(N)]

  def ev(step, loss, name):
    return json.dumps({"step": float(step), "eval/avg_loss": loss, "eval/total_loss": 100 * loss,
                       "eval/total_weights": 100.0, "run_name": name})

  (tmp_path / "fp8").mkdir()
  (tmp_path / "nvfp4").mkdir()
  b = write(tmp_path / "fp8" / "metrics.jsonl", base, [ev(20, 3.3, "b"), ev(40, 3.1, "b"), ev(60, 2.0, "b")])
  r = write(tmp_path / "nvfp4" / "metrics.jsonl", run, [ev(20, 3.32, "r"), ev(40, 3.15, "r")])
  c = comparison.compare_runs([compare.load_run(b), compare.load_run(r)], comparison.Options())
  ls = c.results[1].loss
  assert (ls.eval_shared_at, ls.eval_loss, ls.eval_loss_baseline) == (40, 3.15, 3.1)
  out = tmp_path / "out"
  cli(["compare", b, r, "--out", str(out), "--no-plots"])
  assert "| nvfp4 | 40 | 3.1500 | +0.0500 |" in (out / "report.md").read_text()
  # the baseline's own last eval (step 60) is still its row
  assert "| fp8 | 60 | 2.0000 | - |" in (out / "report.md").read_text()


def test_out_is_replaced_whole_and_says_what_it_compared(tmp_path, capsys):
  """A second comparison into the same --out leaves no figure of the first beside its report (here: the first
  drew plots, the second --no-plots), and the folder records which runs and options made it."""
  b, r = make_pair(tmp_path)
  out = tmp_path / "o"
  out.mkdir()
  (out / "loss.png").write_bytes(b"from an earlier compare")  # what an earlier version wrote (no marker)
  (out / "report.md").write_text("# maxtext-nvfp4 compare\n\nearlier\n")
  assert cli(["compare", f"base={b}", f"run={r}", "--out", str(out), "--no-plots", "--tolerance", "0.05"]) == 0
  assert sorted(os.listdir(out)) == ["maxtext_nvfp4_compare.json", "report.md"]
  made = json.loads((out / "maxtext_nvfp4_compare.json").read_text())
  assert made["runs"] == {"base": [b], "run": [r]} and made["options"]["tolerance"] == 0.05
  assert "wrote " + str(out / "report.md") in capsys.readouterr().out
  assert not [p for p in os.listdir(tmp_path) if p.startswith(".o.")]  # no temporary left beside it
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "report.md").write_text("# my own report\n")  # a user's report.md alone is not an earlier comparison
  assert cli(["compare", b, r, "--out", str(mine)]) == 2
  assert "exists and is not a maxtext-nvfp4 compare output" in capsys.readouterr().err
  assert os.listdir(mine) == ["report.md"]
