"""Slide-ready figures for ``compare``: ``loss.png`` (curves + gap panel) and ``throughput.png``.

Drawn from a :class:`maxtext_nvfp4.tools.comparison.Comparison` (statistics); ``report`` writes the files.

Figures are built with ``matplotlib.figure.Figure`` (Agg canvas, no pyplot global state, no display
needed) and returned, so tests can read the drawn data back: every curve carries a ``gid``
(``raw:NAME``, ``smoothed:NAME``, ``gap:NAME``) and every bar a ``gid`` (``step_time:NAME``,
``tokens:NAME``).
"""

from __future__ import annotations

import math
import textwrap

import matplotlib

matplotlib.use("Agg")
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from maxtext_nvfp4.tools.comparison import Comparison, expert_cos_min, moving_average  # noqa: E402

_COLORS = ("#4c72b0", "#76b900", "#dd8452", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c")


def _color(i: int) -> str:
  return _COLORS[i % len(_COLORS)]


def _wrap(text: str, width: int = 110) -> str:
  return "\n".join(textwrap.wrap(text, width))


def loss_figure(c: Comparison) -> Figure:
  """Top: raw (faint) and smoothed training loss per run; bottom, when a run is compared with the baseline: the
  smoothed gap vs the baseline (a single run: the top panel alone)."""
  compared = any(not r.is_baseline and r.loss is not None for r in c.results)
  fig = Figure(figsize=(10, 7.5 if compared else 5), dpi=100)
  FigureCanvasAgg(fig)
  if compared:
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
  else:
    top = fig.subplots(1, 1)
  n_marked = 0  # non-finite-loss labels drawn so far: each one goes a line lower, so none overprints another
  for i, res in enumerate(c.results):
    steps = res.run.sorted_steps
    loss = [res.run.loss(s) for s in steps]
    top.plot(steps, loss, color=_color(i), alpha=0.25, linewidth=0.8, gid=f"raw:{res.run.name}")
    finite = [(s, v) for s, v in zip(steps, loss) if math.isfinite(v)]
    if finite:
      fs, fv = zip(*finite)
      top.plot(fs, moving_average(fv, c.smooth), color=_color(i), linewidth=2,
               label=res.run.name + (" (baseline)" if res.is_baseline else ""), gid=f"smoothed:{res.run.name}")
    bad = res.run.first_nonfinite_step()
    if bad is not None:
      top.axvline(bad, color=_color(i), linestyle=":", linewidth=1.5)
      top.annotate(f"{res.run.name}: non-finite loss", (bad, 0.95 - 0.06 * n_marked),
                   xycoords=("data", "axes fraction"), color=_color(i), fontsize=8, ha="right",
                   gid=f"nonfinite:{res.run.name}")
      n_marked += 1
  top.set_ylabel("training loss")
  title = f"Training loss (trailing {c.smooth}-step average)"
  top.set_title((_wrap(c.label) + "\n" if c.label else "") + title, fontsize=11)
  top.grid(alpha=0.3)
  top.legend(loc="best")
  if not compared:
    top.set_xlabel("step")
    top.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig

  tol = c.options.tolerance
  bottom.axhline(0.0, color="black", linewidth=0.8)
  bottom.axhline(tol, color="#c44e52", linestyle="--", linewidth=1, label=f"tolerance +{tol:g}")
  start = None
  for i, res in enumerate(c.results):
    if res.is_baseline or res.loss is None:
      continue
    ls = res.loss
    gaps = [res.run.loss(s) - c.results[0].run.loss(s) for s in ls.steps]
    bottom.plot(ls.steps, moving_average(gaps, c.smooth), color=_color(i), linewidth=1.8,
                label=f"{res.run.name} − {c.results[0].run.name} (mean "
                      f"{'n/a' if ls.mean_gap is None else format(ls.mean_gap, '+.4f')})",
                gid=f"gap:{res.run.name}")
    if ls.mean_gap is not None and ls.converged_start_step is not None:
      bottom.hlines(ls.mean_gap, ls.converged_start_step, ls.steps[-1], colors=_color(i), linestyles=":",
                    linewidth=1.5)
    if ls.converged_start_step is not None:
      start = ls.converged_start_step if start is None else start  # shade for the first compared run
  if start is not None:
    lo = min(min(r.run.steps) for r in c.results)
    bottom.axvspan(lo, start, color="gray", alpha=0.12, label="excluded (not converged)")
  bottom.set_xlabel("step")
  bottom.set_ylabel("loss gap (nats)")
  bottom.set_title(f"Gap vs baseline {c.results[0].run.name} — verdict {c.verdict}", fontsize=10)
  bottom.grid(alpha=0.3)
  bottom.legend(loc="best", fontsize=8)
  bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
  fig.tight_layout()
  return fig


def throughput_figure(c: Comparison) -> Figure:
  """Bars: median step time (annotated with the speedup) and tokens/s/device per run; a panel no run has a value
  for is left out (tokens/s needs MaxText's per-device token count), the step-time panel always drawn."""
  kinds = [(attr, gid, ylabel, title) for attr, gid, ylabel, title in (
      ("median_step_time", "step_time", "median step time (s)", "Median step time after warm-up (speedup vs baseline)"),
      ("tokens_per_sec", "tokens", "tokens/s/device", "Throughput per device"))
           if attr == "median_step_time" or any(getattr(r.throughput, attr) is not None for r in c.results)]
  fig = Figure(figsize=(5 + 5 * (len(kinds) > 1), 4.5), dpi=100)
  FigureCanvasAgg(fig)
  axes = fig.subplots(1, len(kinds), squeeze=False)[0]
  names = [r.run.name for r in c.results]
  for ax, (attr, gid, ylabel, title) in zip(axes, kinds):
    ax.set_title(title, fontsize=10)
    for i, res in enumerate(c.results):
      v = getattr(res.throughput, attr)
      bar = ax.bar(i, 0.0 if v is None else v, color=_color(i), gid=f"{gid}:{res.run.name}")
      if v is None:
        ax.annotate("n/a", (i, 0), ha="center", va="bottom")
      elif attr == "median_step_time":
        sp = 1.0 if res.is_baseline else res.throughput.speedup
        ax.annotate(f"{v:.3g} s\n{'' if sp is None else format(sp, '.2f') + 'x'}",
                    (bar[0].get_x() + bar[0].get_width() / 2, v), ha="center", va="bottom", fontsize=9)
      else:
        ax.annotate(f"{v:,.0f}", (bar[0].get_x() + bar[0].get_width() / 2, v), ha="center", va="bottom",
                    fontsize=9)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel(ylabel)
    ax.margins(y=0.2)
    ax.grid(axis="y", alpha=0.3)
  skipped = ", ".join(f"{r.run.name}: {r.throughput.measured} steps" for r in c.results)
  fig.suptitle((_wrap(c.label) + "\n" if c.label else "") + f"measured steps: {skipped}", fontsize=9)
  fig.tight_layout()
  return fig



def drift_figure(c: Comparison) -> Figure:
  """Top: each run's gap vs the baseline over steps on a log x axis (trailing average, faint) with the window
  means and their 95 % bands and the fitted trend; bottom, when a run recorded them: the ``*_underflow``
  diagnostics over steps (log x); without them the figure is the top panel alone and says why under it.
  gids: ``gapline:NAME``, ``windows:NAME``, ``trend:NAME``, ``underflow:NAME:KEY``."""
  drifting = [(i, res) for i, res in enumerate(c.results)
              if not res.is_baseline and res.drift is not None and res.drift.gap.trend is not None]
  underflow = [(i, res.run.name, key, list(zip(*pts)))
               for i, res in drifting for key, series in sorted(res.run.diagnostics.items())
               if key.endswith("_underflow")
               for pts in [[(s, v) for s, v in series if s > 0 and math.isfinite(v)]] if pts]
  fig = Figure(figsize=(10, 7.5 if underflow else 5.5), dpi=100)
  FigureCanvasAgg(fig)
  if underflow:
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
  else:
    top, bottom = fig.subplots(1, 1), None
  base = c.results[0].run
  top.axhline(0.0, color="black", linewidth=0.8)
  top.axhline(c.options.tolerance, color="#c44e52", linestyle="--", linewidth=1,
              label=f"tolerance +{c.options.tolerance:g}")
  for i, res in drifting:
    d = res.drift
    steps = list(res.loss.steps)
    gaps = [res.run.loss(s) - base.loss(s) for s in steps]
    pos = [(s, g) for s, g in zip(steps, moving_average(gaps, c.smooth)) if s > 0]
    if pos:
      xs, ys = zip(*pos)
      top.plot(xs, ys, color=_color(i), alpha=0.3, linewidth=0.8, gid=f"gapline:{res.run.name}")
    w = d.gap.windows
    t = d.gap.trend
    warn = " — EARLY WARNING" if d.warnings else ""
    top.errorbar([x.center for x in w], [x.mean for x in w], yerr=[x.half_width for x in w], fmt="o", ms=3,
                 color=_color(i), capsize=2, gid=f"windows:{res.run.name}",
                 label=f"{res.run.name} − {base.name}: window means ± 95 % (trend {1000 * t.slope:+.4f} / 1k steps"
                       f"{', resolved' if t.resolved else ''}){warn}")
    x0, x1 = w[0].center, w[-1].center
    top.plot([x0, x1], [t.start, t.start + t.rise], color=_color(i), linestyle=":", linewidth=1.5,
             gid=f"trend:{res.run.name}")
  for i, name, key, (xs, ys) in underflow:
    bottom.plot(xs, ys, linewidth=1, label=f"{name}: {key.removeprefix('nvfp4/')}", gid=f"underflow:{name}:{key}")
  top.set_xscale("log")
  top.set_ylabel("loss gap (nats)")
  top.set_title((_wrap(c.label) + "\n" if c.label else "") + "Loss gap over steps (log x)", fontsize=11)
  top.grid(alpha=0.3, which="both")
  top.legend(loc="best", fontsize=8)
  last = bottom if bottom is not None else top
  if bottom is not None:
    bottom.set_ylabel("underflow fraction")
    bottom.legend(loc="best", fontsize=6, ncol=2)
    bottom.set_xscale("log")
    bottom.grid(alpha=0.3, which="both")
  last.set_xlabel("step (log)" + ("" if bottom is not None else "   (no nvfp4/*_underflow diagnostics in these runs:"
                                                                 " nvfp4_diagnostics=true records them)"))
  fig.tight_layout()
  return fig


def stability_figure(c: Comparison) -> Figure:
  """Gradient fidelity and telemetry over steps (log x), one colour per run, one panel per kind some run recorded
  (the others named under the last panel, not drawn empty): ``nvfp4/model/dw_cos`` (solid) and the lowest expert
  cosine per step (dashed); the residual stream's RMS, smallest and largest over layers (log y); the MoE load
  imbalance, largest over layers. gids: ``cos:NAME``, ``expert_cos:NAME``,
  ``rms_min:NAME``, ``rms_max:NAME``, ``load:NAME``."""
  fig = Figure(figsize=(10, 8), dpi=100)
  FigureCanvasAgg(fig)

  def pts_of(series):
    return [(s, v) for s, v in series if s > 0 and math.isfinite(v)]

  def draw(ax, series, i, gid, label, style="-"):
    pts = pts_of(series)
    if pts:
      xs, ys = zip(*pts)
      ax.plot(xs, ys, style, color=_color(i), linewidth=1, marker=".", ms=3, gid=gid, label=label)

  panels = [("cos", "gradient cosine with the high-precision gradient (dw_cos)",
             "dw_cos (nvfp4_diagnostics_grad=true records it)"),
            ("rms", "residual-stream RMS", "residual RMS (nvfp4_diagnostics=true records it)"),
            ("load", "MoE load: busiest expert / mean", "MoE load (MoE layers with nvfp4_diagnostics=true)")]
  # panel -> the run's diagnostics -> [(series, gid, label, line style)]
  series = {"cos": lambda d: [(d.get("nvfp4/model/dw_cos", []), "cos", "model", "-"),
                              (expert_cos_min(d), "expert_cos", "lowest expert", "--")],
            "rms": lambda d: [(d.get("nvfp4/residual/rms_min", []), "rms_min", "min over layers", "--"),
                              (d.get("nvfp4/residual/rms_max", []), "rms_max", "max over layers", "-")],
            "load": lambda d: [(d.get("nvfp4/moe/load_max", []), "load", "", "-")]}
  has = [p for p in panels if any(pts_of(ser) for res in c.results for ser, *_ in series[p[0]](res.run.diagnostics))]
  missing = [p[2] for p in panels if p not in has]
  has = has or panels[:1]  # (the figure is drawn only when a run recorded one of them: report.has_stability)
  fig.set_size_inches(10, 2.2 + 2.6 * len(has))
  axes = fig.subplots(len(has), 1, sharex=True, squeeze=False)[:, 0]
  for ax, (kind, title, _) in zip(axes, has):
    for i, res in enumerate(c.results):
      name = res.run.name
      for ser, gid, label, style in series[kind](res.run.diagnostics):
        draw(ax, ser, i, f"{gid}:{name}", f"{name}: {label}" if label else name, style)
    ax.set_title(title, fontsize=10)
    ax.set_xscale("log")
    ax.grid(alpha=0.3, which="both")
    if ax.get_lines():
      ax.legend(loc="best", fontsize=7)
    if kind == "rms" and ax.get_lines():
      ax.set_yscale("log")
  axes[-1].set_xlabel("step (log)" + (f"   (not recorded: {'; '.join(missing)})" if missing else ""))
  if c.label:
    fig.suptitle(_wrap(c.label), fontsize=9)
  fig.tight_layout()
  return fig
