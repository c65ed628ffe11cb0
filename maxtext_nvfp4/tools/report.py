"""The rendering of ``maxtext-nvfp4 compare``: the terminal summary, ``report.md`` and the plots' files.

Reads a :class:`maxtext_nvfp4.tools.comparison.Comparison`; computes nothing new except formatting.
Output files are written whole or not at all (a temporary file renamed over the old one), so an
interrupted compare never leaves a half-written report or plot.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Sequence

from maxtext_nvfp4.tools.comparison import (INSUFFICIENT, MIN_OVERLAP_FRACTION, MIN_OVERLAP_STEPS, PUBLISHED_GAP,
                                            Comparison, expert_cos_min)

FLOPS_NOTE = ("TFLOP/s/device is MaxText's analytic count: quantized (FP8/NVFP4) GEMMs are counted as "
              "bf16-equivalent FLOPs, so it measures speed, not low-precision FLOP rate.")


def _f(v, fmt="{:.4f}", none="n/a"):
  return none if v is None else fmt.format(v)


def summary_rows(c: Comparison) -> tuple[list[str], list[list[str]]]:
  header = ["run", "steps", "median step (s)", "tokens/s/dev", "TFLOP/s/dev*", "speedup", "final loss",
            "mean gap", "max gap", "rel. gap", "eval loss", "verdict"]
  rows = []
  for res in c.results:
    tp, ls = res.throughput, res.loss
    final = ls.final_loss if ls else None
    if res.is_baseline:
      # the baseline's final loss over the steps it shares with the first other run (else all its steps)
      other = next((x.loss for x in c.results[1:] if x.loss), None)
      if other:
        final = other.final_loss_baseline
      else:
        vals = [res.run.loss(s) for s in res.run.sorted_steps]
        k = max(1, math.ceil(len(vals) / 10))
        final = math.fsum(vals[-k:]) / k
    evals = res.run.eval_loss
    ev = ls.eval_loss if ls else (evals[max(evals)] if evals else None)
    rows.append([
        res.run.name, str(len(res.run.steps)), _f(tp.median_step_time), _f(tp.tokens_per_sec, "{:.1f}"),
        _f(tp.tflops_per_sec, "{:.3f}"), "1.000x" if res.is_baseline else _f(tp.speedup, "{:.3f}x"),
        _f(final), "-" if res.is_baseline else _f(ls and ls.mean_gap, "{:+.4f}"),
        "-" if res.is_baseline else _f(ls and ls.max_gap, "{:+.4f}"),
        "-" if res.is_baseline else _f(ls and ls.relative_gap and 100 * ls.relative_gap, "{:+.2f}%"),
        _f(ev), res.verdict,
    ])
  return header, rows


def _text_table(header, rows) -> str:
  widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
  fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))
  return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def _md_table(header, rows) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
  return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def definitions(c: Comparison) -> list[str]:
  o = c.options
  base = c.results[0]
  w = ("--warmup " + str(o.warmup)) if o.warmup is not None else "max(1, n//10)"
  return [
      f"- Baseline: **{base.run.name}**. Throughput uses each run's steps before its first non-finite loss; "
      f"warm-up: the first of them (XLA compile) plus {w} more are skipped: " + ", ".join(f"{r.run.name} {r.throughput.skipped} skipped / "
                                       f"{r.throughput.measured} measured" for r in c.results) + ".",
      "- Median step time: median of `perf/step_time_seconds` over the measured steps; tokens/s/device and "
      "TFLOP/s/device = MaxText's per-device tokens / TFLOPs per step divided by that median; speedup = "
      "baseline median step time / run median step time.",
      f"- \\* {FLOPS_NOTE}",
      "- Loss numbers use the steps both the run and the baseline recorded (cut before the first non-finite "
      "loss). Final loss: mean of the last max(1, ceil(n/10)) of those steps.",
      f"- Converged part: those steps from position floor({o.converged_from:g}·n) on (the first "
      f"{100 * o.converged_from:g} % dropped). Mean gap: mean of (run − baseline) loss over it; max gap: "
      f"max of the trailing {c.smooth}-step moving average of the gap, taken within it; relative gap: mean gap / mean "
      "baseline loss over it.",
      f"- Verdict: PASS when mean gap ≤ {o.tolerance:g} nats and the loss stays finite "
      f"(NVIDIA's published Llama-3 8B NVFP4 vs FP8 gap: +{PUBLISHED_GAP}); {INSUFFICIENT} when the run "
      f"and the baseline share fewer than min({MIN_OVERLAP_STEPS}, ceil({MIN_OVERLAP_FRACTION:g}·m)) steps "
      "(m: the longer run's step count).",
  ]


def diagnostics_rows(c: Comparison) -> tuple[list[str], list[list[str]]]:
  header = ["metric", "run", "samples", "last (step)", "mean"]
  rows = []
  keys = sorted({k for r in c.results for k in r.run.diagnostics})
  for k in keys:
    for r in c.results:
      vals = r.run.diagnostics.get(k)
      if not vals:
        continue
      finite = [v for _, v in vals if math.isfinite(v)]
      mean = math.fsum(finite) / len(finite) if finite else None
      rows.append([k, r.run.name, str(len(vals)), f"{vals[-1][1]:.4g} ({vals[-1][0]})", _f(mean, "{:.4g}")])
  return header, rows


DIAG_TREND_STATS = ("_underflow", "_scale_sat", "_rel_err", "/dw_cos", "/dw_cos_min", "/dw_norm_ratio", "/rms_span",
                    "/rms_max", "/load", "/load_max")


STABILITY_KEYS = ("nvfp4/model/dw_cos", "nvfp4/residual/rms_span", "nvfp4/moe/load_max")


def has_stability(c: Comparison) -> bool:
  """Some run recorded the gradient fidelity or the stability telemetry (``nvfp4_diagnostics``)."""
  return any(k in r.run.diagnostics for r in c.results for k in STABILITY_KEYS)


def stability_rows(c: Comparison) -> tuple[list[str], list[list[str]]]:
  """Per run: the gradient fidelity (model cosine first -> last, the lowest unit and expert cosines of the last
  sample) and the telemetry (residual RMS span and MoE load imbalance: last and largest)."""
  header = ["run", "fidelity samples", "model dw_cos first → last", "lowest unit dw_cos (last)",
            "lowest expert dw_cos (last)", "model dw_norm_ratio (last)", "residual RMS span last / max",
            "MoE load max/mean last / max"]
  rows = []
  for r in c.results:
    d = r.run.diagnostics
    if not any(k in d for k in STABILITY_KEYS):
      continue
    cos = d.get("nvfp4/model/dw_cos", [])
    last_step = cos[-1][0] if cos else None
    unit = [v for k, series in d.items() if k.endswith("/dw_cos_min") for s, v in series if s == last_step]
    experts = expert_cos_min(d)
    ratio = d.get("nvfp4/model/dw_norm_ratio", [])

    def last_max(key):
      series = [v for _, v in d.get(key, []) if math.isfinite(v)]
      return f"{series[-1]:.4g} / {max(series):.4g}" if series else "-"
    rows.append([r.run.name, str(len(cos)), f"{cos[0][1]:.4f} → {cos[-1][1]:.4f}" if cos else "-",
                 f"{min(unit):.4f}" if unit else "-", f"{experts[-1][1]:.4f}" if experts else "-",
                 f"{ratio[-1][1]:.4f}" if ratio else "-", last_max("nvfp4/residual/rms_span"),
                 last_max("nvfp4/moe/load_max")])
  return header, rows


def stability_lines(c: Comparison) -> list[str]:
  """The ``## Stability`` section of report.md (empty when no run recorded it)."""
  h, rows = stability_rows(c)
  if not rows:
    return []
  return ["## Stability: gradient fidelity and telemetry", "",
          "dw_cos: cosine of the step's gradient with the high-precision gradient of the same batch at the same "
          "parameters (`nvfp4_diagnostics_grad`); a unit is one projection of one layer or one expert of one layer; "
          "residual RMS span: largest / smallest RMS of the residual stream over layers; MoE load: tokens of the "
          "busiest expert over the mean, the largest over MoE layers (docs/diagnostics.md).", "",
          _md_table(h, rows), ""]


def _drifting(c: Comparison) -> list:
  """The compared runs whose drift analysis has a trend (>= 3 windows: long enough to speak of drift)."""
  return [r for r in c.results if r.drift is not None and r.drift.gap.trend is not None]


def _per_1k(v: float) -> str:
  return f"{1000 * v:+.4f}"


def drift_lines(c: Comparison) -> list[str]:
  """The ``## Drift`` section of report.md (empty without drift windows)."""
  runs = _drifting(c)
  if not runs:
    return []
  base = c.results[0].run.name
  rule = runs[0].drift.rule
  out = ["## Drift: the gap over time and the early warning", "",
         f"Gap = run − {base} per common step, over the converged part, in windows; band = mean ± 1.96·σ/√m with "
         "σ from the step-to-step differences of the gap (σ² = Σ(g_i − g_{i−1})² / (2(m−1))). Trend: least squares "
         "of the window means on the window centres; 95 % interval from the larger of the residual and the band "
         "standard errors, Student's t with k − 2 degrees of freedom; *resolved* when it excludes 0. Early warning: "
         f"the gap's trend resolved, positive, with a fitted rise ≥ {rule.gap_rise:g} nats; or an `*_underflow` "
         f"diagnostic's trend resolved, positive, rising by ≥ max({rule.underflow_rise_rel:g} × its fitted start, "
         f"{rule.underflow_rise_abs:g}); a `*/dw_cos` or `*/dw_cos_min` gradient-fidelity cosine's trend resolved, "
         f"negative, falling by ≥ {rule.cos_fall:g}; `nvfp4/residual/rms_span` at ≥ {rule.rms_span_max:g} or an "
         f"`nvfp4/moe*/load*` imbalance at ≥ {rule.load_max:g} (fitted level at the last step), or either rising by "
         f"≥ {rule.telemetry_rise_rel:g} × its fitted start; the routed experts' lowest `dw_cos` ≥ {rule.expert_lag:g} "
         "below the attention groups' mean over the last samples (`experts_lag`) (docs/diagnostics.md). *First "
         "warning*: the first step at "
         "which the rule fires on the run so far.",
         "", _md_table(
             ["run", "window (steps)", "windows", "first window gap", "last window gap",
              "slope (nats / 1k steps, 95 %)", "rise", "resolved", "early warning", "first warning at step"],
             [[r.run.name, str(r.drift.gap.window), str(len(r.drift.gap.windows)),
               f"{r.drift.gap.windows[0].mean:+.4f} ± {r.drift.gap.windows[0].half_width:.4f}",
               f"{r.drift.gap.windows[-1].mean:+.4f} ± {r.drift.gap.windows[-1].half_width:.4f}",
               f"{_per_1k(r.drift.gap.trend.slope)} [{_per_1k(r.drift.gap.trend.low)}, {_per_1k(r.drift.gap.trend.high)}]",
               "n/a" if r.drift.gap.trend is None else f"{r.drift.gap.trend.rise:+.4f}",
               "n/a" if r.drift.gap.trend is None else ("yes" if r.drift.gap.trend.resolved else "no"),
               "; ".join(w.what for w in r.drift.warnings) or "none",
               "-" if r.drift.first_warning_step is None else str(r.drift.first_warning_step)] for r in runs]), ""]
  for r in runs:
    out += [f"Gap windows of **{r.run.name}**:", "", _md_table(
        ["steps", "mean gap", "± (95 %)", "σ per step"],
        [[f"{w.first}..{w.last}", f"{w.mean:+.4f}", f"{w.half_width:.4f}", f"{w.sigma:.4f}"]
         for w in r.drift.gap.windows]), ""]
  rows = [[d.key, r.run.name, str(d.samples), f"{d.first:.4g}", f"{d.last:.4g}",
           "n/a" if d.trend is None else f"{d.trend.slope * 1000:+.3g} [{d.trend.low * 1000:+.3g}, {d.trend.high * 1000:+.3g}]",
           "n/a" if d.trend is None else ("yes" if d.trend.resolved else "no")]
          for r in runs for d in r.drift.diagnostics if d.key.endswith(DIAG_TREND_STATS)]
  if rows:
    out += ["Diagnostics over the converged part (trend per 1k steps, 95 %):", "",
            _md_table(["metric", "run", "samples", "first", "last", "trend / 1k steps", "resolved"], rows), ""]
  return out


def render_markdown(c: Comparison, plots: Sequence[str] = ()) -> str:
  header, rows = summary_rows(c)
  out = ["# maxtext-nvfp4 compare", ""]
  if c.label:
    out += [f"**{c.label}**", ""]
  out += [f"**Verdict: {c.verdict}** (tolerance {c.options.tolerance:g} nats on the mean gap)", "",
          _md_table(header, rows), ""]
  out += definitions(c) + [""]
  notes = [f"- {r.run.name}: {n}" for r in c.results for n in r.notes]
  if notes:
    out += ["## Notes", ""] + notes + [""]
  evals = [r for r in c.results if r.run.eval_loss]
  if evals:
    out += ["## Eval loss (`eval/avg_loss`, last eval)", "", _md_table(
        ["run", "step", "eval loss", "gap vs baseline"],
        [[r.run.name, str(max(r.run.eval_loss)), f"{r.run.eval_loss[max(r.run.eval_loss)]:.4f}",
          "-" if r.is_baseline or not (r.loss and r.loss.eval_loss_baseline is not None)
          else f"{r.loss.eval_loss - r.loss.eval_loss_baseline:+.4f}"
          + ("" if r.loss.eval_shared_at in (None, max(r.run.eval_loss)) else f" (at step {r.loss.eval_shared_at})")]
         for r in evals]), ""]
  out += drift_lines(c)
  out += stability_lines(c)
  dh, dr = diagnostics_rows(c)
  if dr:
    out += ["## NVFP4 diagnostics (`nvfp4/*` metrics)", "", _md_table(dh, dr), ""]
  out += ["## Inputs", ""] + [f"- {r.run.name}: {', '.join(r.run.paths)}" for r in c.results] + [""]
  for p in plots:
    out += [f"![{Path(p).stem}]({Path(p).name})", ""]
  return "\n".join(out)


def render_terminal(c: Comparison) -> str:
  header, rows = summary_rows(c)
  lines = []
  if c.label:
    lines.append(c.label)
  lines += [_text_table(header, rows), f"* {FLOPS_NOTE}"]
  lines += [f"{r.run.name}: {n}" for r in c.results for n in r.notes]
  for r in _drifting(c):
    t = r.drift.gap.trend
    if t is not None:
      lines.append(f"{r.run.name}: gap trend {_per_1k(t.slope)} nats/1k steps (95 % [{_per_1k(t.low)}, "
                   f"{_per_1k(t.high)}], {'resolved' if t.resolved else 'not resolved'} from 0); early warning: "
                   + ("; ".join(w.what for w in r.drift.warnings) or "none"))
  dh, dr = diagnostics_rows(c)
  if dr:
    lines.append(f"nvfp4 diagnostics: {len({r[0] for r in dr})} metric(s), see report.md")
  lines.append(f"VERDICT: {c.verdict}")
  return "\n".join(lines)


def _write_whole(path: Path, write) -> None:
  """``write(tmp_path)``, then rename the temporary file over ``path`` (never a half-written file)."""
  tmp = path.with_name(f".{path.name}.tmp")
  try:
    write(str(tmp))
    os.replace(tmp, path)
  finally:
    tmp.unlink(missing_ok=True)


def write_outputs(c: Comparison, out_dir: str | os.PathLike, *, plots: bool = True) -> dict[str, str]:
  """Write report.md (and loss.png, throughput.png, drift.png when there are drift windows, stability.png when a
  run recorded the gradient fidelity or telemetry, unless ``plots`` is false) into ``out_dir``; returns
  their paths by kind."""
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  paths = {}
  if plots:
    from maxtext_nvfp4.tools import plots as figures  # pylint: disable=import-outside-toplevel  (matplotlib)

    kinds = [("loss", figures.loss_figure), ("throughput", figures.throughput_figure)]
    if _drifting(c):
      kinds.append(("drift", figures.drift_figure))
    if has_stability(c):
      kinds.append(("stability", figures.stability_figure))
    for kind, figure in kinds:
      paths[kind] = str(out / f"{kind}.png")
      fig = figure(c)
      _write_whole(Path(paths[kind]), lambda tmp, fig=fig: fig.savefig(tmp, format="png"))
  paths["report"] = str(out / "report.md")
  text = render_markdown(c, [paths[k] for k in ("loss", "throughput", "drift", "stability") if k in paths])
  _write_whole(Path(paths["report"]), lambda tmp: Path(tmp).write_text(text, encoding="utf8"))
  return paths
