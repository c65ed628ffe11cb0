"""Drift statistics and the early-warning rule (tools/drift.py) on synthetic runs whose truth is known: flat
gaps (white and slowly wandering noise) never warn, a growing gap and a growing underflow do, before the gap
crosses compare's tolerance; and compare's report and drift plot carry them."""

import json
import math
import random

import pytest

from maxtext_nvfp4.tools import compare, comparison, drift, metrics, plots, report

N = 3000


def gap_series(seed, *, slope=0.0, rho=0.95, wander=0.01, white=0.01, level=0.015, n=N):
  """Per-step gap: level + slope * step + AR(1) (stationary sd `wander`) + white noise."""
  r = random.Random(seed)
  a, out = 0.0, {}
  for s in range(n):
    a = rho * a + r.gauss(0, wander * math.sqrt(1 - rho * rho))
    out[s] = level + slope * s + a + r.gauss(0, white)
  return out


def base_loss(n=N, seed=99):
  r = random.Random(seed)
  return {s: 6.0 - 0.5 * math.log1p(s / 50) + r.gauss(0, 0.05) for s in range(n)}


def run_of(gaps, base):
  return {s: base[s] + g for s, g in gaps.items()}


def test_t_quantiles():
  assert drift.t975(1) == 12.706 and drift.t975(30) == 2.042
  assert drift.t975(31) == pytest.approx(2.040, abs=0.003) and drift.t975(200) == pytest.approx(1.972, abs=0.003)


def test_windows_bands_and_slope_recover_the_truth():
  base = base_loss()
  white = 0.02
  d = drift.analyze(run_of(gap_series(1, slope=4e-6, rho=0.0, wander=0.0, white=white), base), base)
  g = d.gap
  assert g.converged_start == 600 and g.window == 120 and len(g.windows) == 20
  assert [w.first for w in g.windows[:2]] == [600, 720] and g.windows[-1].last == N - 1
  # step-to-step noise: the white noise's sd (the slope adds nothing to first differences)
  assert all(abs(w.sigma / white - 1) < 0.2 for w in g.windows)
  assert all(w.half_width == pytest.approx(1.96 * w.sigma / math.sqrt(w.n)) for w in g.windows)
  # the window means scatter like their bands say: ~95 % of them cover the true gap at their centre
  covered = sum(abs(w.mean - (0.015 + 4e-6 * w.center)) <= w.half_width for w in g.windows)
  assert covered >= 17
  t = g.trend
  assert t.low < 4e-6 < t.high and t.resolved and t.rise == pytest.approx(t.slope * (g.windows[-1].center - g.windows[0].center))


@pytest.mark.parametrize("rho", [0.0, 0.95, 0.99])
def test_flat_gaps_do_not_warn(rho):
  base = base_loss()
  for seed in range(8):
    d = drift.analyze(run_of(gap_series(seed, rho=rho), base), base)
    assert not d.warnings, (rho, seed, d.warnings)
    assert d.first_warning_step is None


def test_a_growing_gap_warns_before_it_crosses_the_tolerance():
  base = base_loss()
  slope = 1e-5  # gap 0.005 -> 0.035: crosses compare's tolerance 0.03 at step 2500
  for seed in range(5):
    d = drift.analyze(run_of(gap_series(seed, slope=slope, level=0.005), base), base)
    assert [w.what for w in d.warnings] == ["gap"], seed
    assert "loss gap growing" in d.warnings[0].why
    assert d.gap.trend.low < slope < d.gap.trend.high
    assert d.first_warning_step is not None and d.first_warning_step < 2000, (seed, d.first_warning_step)
  # a shrinking gap is not a warning
  d = drift.analyze(run_of(gap_series(0, slope=-1e-5, level=0.04), base), base)
  assert d.gap.trend.resolved and d.gap.trend.slope < 0 and not d.warnings


def test_a_growing_underflow_warns_and_a_flat_one_does_not():
  base = base_loss()
  flat = run_of(gap_series(3), base)
  r = random.Random(5)
  grow = {"nvfp4/mlp_last/dy_underflow": [(s, 0.002 + 2e-6 * s + r.gauss(0, 3e-4)) for s in range(0, N, 100)],
          "nvfp4/mlp/x_rel_err": [(s, 0.1 + 1e-5 * s) for s in range(0, N, 100)]}  # not an underflow key
  still = {"nvfp4/mlp_last/dy_underflow": [(s, 0.002 + r.gauss(0, 3e-4)) for s in range(0, N, 100)]}
  d = drift.analyze(flat, base, grow)
  assert [w.what for w in d.warnings] == ["nvfp4/mlp_last/dy_underflow"]
  assert d.first_warning_step is not None and d.first_warning_step < N - 1
  rel = next(x for x in d.diagnostics if x.key == "nvfp4/mlp/x_rel_err")
  assert rel.trend.resolved and rel.samples == 24  # samples from the converged part (steps >= 600)
  assert not drift.analyze(flat, base, still).warnings
  # a tiny but resolved rise (below max(0.5 x start, 0.001)) does not warn
  tiny = {"nvfp4/mlp_last/dy_underflow": [(s, 0.002 + 1e-8 * s) for s in range(0, N, 100)]}
  assert not drift.analyze(flat, base, tiny).warnings


def test_falling_gradient_fidelity_and_telemetry_warn_and_steady_ones_do_not():
  base = base_loss()
  flat = run_of(gap_series(3), base)
  r = random.Random(7)
  steps = range(0, N, 100)
  falling = {"nvfp4/expert_3/dw_cos": [(s, 0.97 - 0.09 * s / N + r.gauss(0, 0.005)) for s in steps],  # 0.97 -> 0.88
             "nvfp4/model/dw_cos": [(s, 0.95 + r.gauss(0, 0.005)) for s in steps]}
  d = drift.analyze(flat, base, falling)
  assert [w.what for w in d.warnings] == ["nvfp4/expert_3/dw_cos"] and "falling" in d.warnings[0].why
  assert d.first_warning_step is not None and d.first_warning_step < N - 1
  # a resolved but small fall (0.01 < cos_fall) and a rising cosine do not warn
  small = {"nvfp4/model/dw_cos": [(s, 0.95 - 0.01 * s / N) for s in steps]}
  rising = {"nvfp4/model/dw_cos": [(s, 0.80 + 0.1 * s / N) for s in steps]}
  assert not drift.analyze(flat, base, small).warnings and not drift.analyze(flat, base, rising).warnings
  # residual span: a level past 1000 warns, a steady 3-4x span does not; doubling load imbalance warns
  span = {"nvfp4/residual/rms_span": [(s, 3.0 + 2000 * s / N) for s in steps]}
  steady = {"nvfp4/residual/rms_span": [(s, 3.5 + r.gauss(0, 0.2)) for s in steps],
            "nvfp4/moe/load_max": [(s, 1.3 + r.gauss(0, 0.05)) for s in steps]}
  load = {"nvfp4/moe_0/load": [(s, 1.2 + 4.0 * s / N + r.gauss(0, 0.05)) for s in steps]}
  assert [w.what for w in drift.analyze(flat, base, span).warnings] == ["nvfp4/residual/rms_span"]
  assert not drift.analyze(flat, base, steady).warnings
  assert [w.what for w in drift.analyze(flat, base, load).warnings] == ["nvfp4/moe_0/load"]
  assert drift.watched("nvfp4/layer_2/dw_cos") and not drift.watched("nvfp4/model/dw_norm_ratio")


def test_routed_experts_lagging_the_attention_gemms_warn():
  """A bug in the experts' own path (the injected wgrad scale swap: experts ~0.73 while attention stays ~0.93)
  warns from the first samples; experts as good as attention do not."""
  base = base_loss()
  flat = run_of(gap_series(3), base)
  r = random.Random(9)
  steps = range(0, N, 100)

  def diags(experts):
    return {"nvfp4/attention_first/dw_cos": [(s, 0.93 + r.gauss(0, 0.005)) for s in steps],
            "nvfp4/attention_last/dw_cos": [(s, 0.92 + r.gauss(0, 0.005)) for s in steps],
            "nvfp4/experts_first/dw_cos": [(s, experts + r.gauss(0, 0.005)) for s in steps],
            "nvfp4/experts_last/dw_cos": [(s, experts + 0.01 + r.gauss(0, 0.005)) for s in steps]}
  bad = drift.analyze(flat, base, diags(0.73))
  assert [w.what for w in bad.warnings] == ["experts_lag"] and bad.first_warning_step is not None
  assert bad.first_warning_step <= 100  # the first prefix the rule looks at
  assert drift.expert_lag(diags(0.73)) == pytest.approx(0.925 - 0.73, abs=0.01)
  assert not drift.analyze(flat, base, diags(0.92)).warnings
  assert drift.expert_lag({"nvfp4/attention/dw_cos": [(0, 0.9)]}) is None  # no experts: no lag


def test_short_runs_have_no_trend():
  base = base_loss(n=40)
  d = drift.analyze(run_of(gap_series(0, n=40), base), base)
  assert d.gap.trend is None and not d.warnings


def _write(path, losses, diags=None):
  recs = []
  for s, v in losses.items():
    rec = {"step": s, "learning/loss": v, "perf/step_time_seconds": 0.5}
    for k, series in (diags or {}).items():
      rec.update({k: x for st, x in series if st == s})
    recs.append(json.dumps(rec))
  path.write_text("\n".join(recs) + "\n")


def test_compare_reports_and_plots_the_drift(tmp_path, capsys):
  base = base_loss()
  r = random.Random(2)
  diags = {"nvfp4/mlp_last/dy_underflow": [(s, 0.002 + r.gauss(0, 3e-4)) for s in range(0, N, 100)]}
  _write(tmp_path / "bf16.jsonl", base)
  _write(tmp_path / "nvfp4.jsonl", run_of(gap_series(0, slope=1e-5, level=0.005), base), diags)
  _write(tmp_path / "fp8.jsonl", run_of(gap_series(1), base))
  out = tmp_path / "cmp"
  rc = compare.run_compare([f"bf16={tmp_path / 'bf16.jsonl'}", f"nvfp4={tmp_path / 'nvfp4.jsonl'}",
                            f"fp8={tmp_path / 'fp8.jsonl'}"], out=str(out), plots=False)
  text = capsys.readouterr().out
  assert "nvfp4: gap trend +0.0" in text and "early warning: gap" in text and "fp8: gap trend" in text
  assert "DRIFT WARNING: loss gap growing" in text
  md = (out / "report.md").read_text()
  assert "## Drift: the gap over time and the early warning" in md
  row = next(l for l in md.splitlines() if l.startswith("| nvfp4 | 120 | 20 |"))
  assert "| yes | gap |" in row
  assert next(l for l in md.splitlines() if l.startswith("| fp8 | 120 | 20 |")).endswith("| none | - |")
  assert "nvfp4/mlp_last/dy_underflow" in md.split("Diagnostics over the converged part")[1]
  # the case the warning is for: the mean gap (0.023) still passes compare's tolerance, the trend does not
  assert rc == 0 and "**Verdict: PASS**" in md
  c = comparison.compare_runs([metrics.read(tmp_path / n, name=n.split(".")[0])
                               for n in ("bf16.jsonl", "nvfp4.jsonl")])
  assert report._drifting(c) and "![drift](drift.png)" in report.render_markdown(c, [str(tmp_path / "drift.png")])
  fig = plots.drift_figure(c)
  top, bottom = fig.axes[:2]
  assert top.get_xscale() == "log" and bottom.get_xscale() == "log"
  gids = {a.get_gid() for ax in fig.axes for a in ax.get_children() if a.get_gid()}
  assert {"gapline:nvfp4", "windows:nvfp4", "trend:nvfp4", "underflow:nvfp4:nvfp4/mlp_last/dy_underflow"} <= gids
  trend = next(a for a in top.get_lines() if a.get_gid() == "trend:nvfp4")
  t = c.results[1].drift.gap.trend
  assert list(trend.get_ydata()) == pytest.approx([t.start, t.start + t.rise])


def test_compare_reports_and_plots_gradient_fidelity_and_telemetry(tmp_path):
  base = base_loss()
  steps = range(0, N, 100)
  fid = {"nvfp4/model/dw_cos": [(s, 0.95) for s in steps], "nvfp4/model/dw_norm_ratio": [(s, 1.01) for s in steps],
         "nvfp4/experts/dw_cos_min": [(s, 0.9 - 0.1 * s / N) for s in steps],
         "nvfp4/expert_0/dw_cos": [(s, 0.96) for s in steps],
         "nvfp4/expert_1/dw_cos": [(s, 0.97 - 0.09 * s / N) for s in steps],
         "nvfp4/residual/rms_min": [(s, 0.8) for s in steps], "nvfp4/residual/rms_max": [(s, 3.0) for s in steps],
         "nvfp4/residual/rms_span": [(s, 3.75) for s in steps], "nvfp4/moe/load_max": [(s, 1.4) for s in steps]}
  tele = {k: v for k, v in fid.items() if k.startswith(("nvfp4/residual", "nvfp4/moe"))}
  _write(tmp_path / "bf16.jsonl", base, tele)
  _write(tmp_path / "nvfp4.jsonl", run_of(gap_series(0), base), fid)
  c = comparison.compare_runs([metrics.read(tmp_path / n, name=n.split(".")[0]) for n in ("bf16.jsonl", "nvfp4.jsonl")])
  assert [w.what for w in c.results[1].drift.warnings] == ["nvfp4/expert_1/dw_cos", "nvfp4/experts/dw_cos_min"]
  md = report.render_markdown(c)
  section = md.split("## Stability: gradient fidelity and telemetry")[1].split("##")[0]
  row = next(l for l in section.splitlines() if l.startswith("| nvfp4 |"))
  last = max(steps)
  assert f"0.9500 → 0.9500" in row and f"{0.9 - 0.1 * last / N:.4f}" in row and f"{0.97 - 0.09 * last / N:.4f}" in row
  assert "3.75 / 3.75" in row and "1.4 / 1.4" in row
  assert next(l for l in section.splitlines() if l.startswith("| bf16 |")).split("|")[3].strip() == "-"
  fig = plots.stability_figure(c)
  gids = {a.get_gid() for ax in fig.axes for a in ax.get_children() if a.get_gid()}
  assert {"cos:nvfp4", "expert_cos:nvfp4", "rms_max:bf16", "rms_min:nvfp4", "load:nvfp4"} <= gids
  assert "cos:bf16" not in gids
  ec = next(a for a in fig.axes[0].get_lines() if a.get_gid() == "expert_cos:nvfp4")
  assert list(ec.get_ydata()) == pytest.approx([min(0.96, 0.97 - 0.09 * s / N) for s in steps if s > 0])


def _long_study_module():
  import importlib.util  # pylint: disable=import-outside-toplevel
  from pathlib import Path  # pylint: disable=import-outside-toplevel

  path = Path(__file__).resolve().parents[2] / "benchmarks" / "accuracy" / "long_study.py"
  spec = importlib.util.spec_from_file_location("long_study", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod, path.parent


@pytest.mark.parametrize("folder", ["long", "long_sp"])
def test_the_recorded_long_runs_say_what_results_md_says(folder):
  """The rule on the recorded long-study arms (benchmarks/accuracy/<folder>/<arm>.jsonl[.gz]) gives the findings of
  <folder>/summary.json, whose table is the one in RESULTS.md: change the rule or the data and this fails until
  the published text is regenerated. long: issue 29's study on the repeating corpus; long_sp: issue 49's on the
  non-repeating one."""
  long_study, here = _long_study_module()
  summary = json.loads((here / folder / "summary.json").read_text())
  assert summary["pairs"], "no pair of arms recorded"
  files = {a: next((here / folder / f"{a}{ext}" for ext in (".jsonl", ".jsonl.gz")
                    if (here / folder / f"{a}{ext}").exists()), None) for a in summary["arms"]}
  runs = {a: metrics.read(f, name=a) for a, f in files.items() if f is not None}
  for p in summary["pairs"]:
    got = long_study.pair_summary(runs[p["run"]], runs[p["baseline"]])
    assert (got["common_steps"], got["warnings"], got["first_warning_step"]) == \
        (p["common_steps"], p["warnings"], p["first_warning_step"]), p["run"]
    assert got["trend"] == p["trend"] and got["mean_gap"] == p["mean_gap"]
  assert long_study.table(summary) in (here / "RESULTS.md").read_text()


def test_figures_draw_no_empty_panel(tmp_path):
  """Runs without the underflow diagnostics (the default demo) get a one-panel drift figure, and a dense model's
  stability figure has no MoE-load panel: what is not recorded is named under the last panel, not drawn empty."""
  base = base_loss()
  _write(tmp_path / "bf16.jsonl", base)
  _write(tmp_path / "nvfp4.jsonl", run_of(gap_series(1), base),
         {"nvfp4/model/dw_cos": [(s, 0.95) for s in range(0, N, 100)]})
  c = comparison.compare_runs([metrics.read(tmp_path / n, name=n.split(".")[0]) for n in ("bf16.jsonl", "nvfp4.jsonl")])
  for fig in (plots.drift_figure(c), plots.stability_figure(c)):
    assert all(ax.get_lines() for ax in fig.axes), [ax.get_title() for ax in fig.axes if not ax.get_lines()]
  drift, stability = plots.drift_figure(c), plots.stability_figure(c)
  assert len(drift.axes) == 1 and "nvfp4_diagnostics=true records them" in drift.axes[0].get_xlabel()
  assert [ax.get_title() for ax in stability.axes] == ["gradient cosine with the high-precision gradient (dw_cos)"]
  assert "residual RMS" in stability.axes[0].get_xlabel() and "MoE load" in stability.axes[0].get_xlabel()
  # these records have no per-device token count: no tokens/s panel of "n/a" bars
  throughput = plots.throughput_figure(c)
  assert [ax.get_ylabel() for ax in throughput.axes] == ["median step time (s)"]
  # one run alone: its loss, no empty gap panel under it
  single = comparison.compare_runs([metrics.read(tmp_path / "nvfp4.jsonl", name="nvfp4")])
  loss = plots.loss_figure(single)
  assert len(loss.axes) == 1 and loss.axes[0].get_lines()
  assert len(plots.loss_figure(c).axes) == 2
