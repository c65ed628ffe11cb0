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
  """Top: raw (faint) and smoothed training loss per run; bottom: smoothed gap vs the baseline."""
  fig = Figure(figsize=(10, 7.5), dpi=100)
  FigureCanvasAgg(fig)
  top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
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
  """Bars: median step time (annotated with the speedup) and tokens/s/device per run."""
  fig = Figure(figsize=(10, 4.5), dpi=100)
  FigureCanvasAgg(fig)
  left, right = fig.subplots(1, 2)
  names = [r.run.name for r in c.results]
  for ax, attr, gid, ylabel in ((left, "median_step_time", "step_time", "median step time (s)"),
                                (right, "tokens_per_sec", "tokens", "tokens/s/device")):
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
  left.set_title("Median step time after warm-up (speedup vs baseline)", fontsize=10)
  right.set_title("Throughput per device", fontsize=10)
  fig.suptitle((_wrap(c.label) + "\n" if c.label else "") + f"measured steps: {skipped}", fontsize=9)
  fig.tight_layout()
  return fig



def drift_figure(c: Comparison) -> Figure:
  """Top: each run's gap vs the baseline over steps on a log x axis (trailing average, faint) with the window
  means and their 95 % bands and the fitted trend; bottom: the ``*_underflow`` diagnostics over steps (log x).
  gids: ``gapline:NAME``, ``windows:NAME``, ``trend:NAME``, ``underflow:NAME:KEY``."""
  fig = Figure(figsize=(10, 7.5), dpi=100)
  FigureCanvasAgg(fig)
  top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
  base = c.results[0].run
  top.axhline(0.0, color="black", linewidth=0.8)
  top.axhline(c.options.tolerance, color="#c44e52", linestyle="--", linewidth=1,
              label=f"tolerance +{c.options.tolerance:g}")
  any_diag = False
  for i, res in enumerate(c.results):
    d = res.drift
    if res.is_baseline or d is None or d.gap.trend is None:
      continue
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
    for key, series in sorted(res.run.diagnostics.items()):
      if not key.endswith("_underflow"):
        continue
      pts = [(s, v) for s, v in series if s > 0 and math.isfinite(v)]
      if pts:
        xs, ys = zip(*pts)
        bottom.plot(xs, ys, linewidth=1, label=f"{res.run.name}: {key.removeprefix('nvfp4/')}",
                    gid=f"underflow:{res.run.name}:{key}")
        any_diag = True
  top.set_xscale("log")
  top.set_ylabel("loss gap (nats)")
  top.set_title((_wrap(c.label) + "\n" if c.label else "") + "Loss gap over steps (log x)", fontsize=11)
  top.grid(alpha=0.3, which="both")
  top.legend(loc="best", fontsize=8)
  if any_diag:
    bottom.set_ylabel("underflow fraction")
    bottom.legend(loc="best", fontsize=6, ncol=2)
  else:
    bottom.annotate("no nvfp4/*_underflow diagnostics in these runs (nvfp4_diagnostics=true records them)",
                    (0.5, 0.5), xycoords="axes fraction", ha="center", fontsize=9)
  bottom.set_xscale("log")
  bottom.set_xlabel("step (log)")
  bottom.grid(alpha=0.3, which="both")
  fig.tight_layout()
  return fig


def stability_figure(c: Comparison) -> Figure:
  """Gradient fidelity and telemetry over steps (log x), one colour per run. Top: ``nvfp4/model/dw_cos`` (solid)
  and the lowest expert cosine per step (dashed); middle: the residual stream's RMS, smallest and largest over
  layers (log y); bottom: the MoE load imbalance, largest over layers. gids: ``cos:NAME``, ``expert_cos:NAME``,
  ``rms_min:NAME``, ``rms_max:NAME``, ``load:NAME``."""
  fig = Figure(figsize=(10, 8), dpi=100)
  FigureCanvasAgg(fig)
  top, mid, bottom = fig.subplots(3, 1, sharex=True)

  def draw(ax, series, i, gid, label, style="-"):
    pts = [(s, v) for s, v in series if s > 0 and math.isfinite(v)]
    if pts:
      xs, ys = zip(*pts)
      ax.plot(xs, ys, style, color=_color(i), linewidth=1, marker=".", ms=3, gid=gid, label=label)
      return True
    return False

  drawn = {top: False, mid: False, bottom: False}
  for i, res in enumerate(c.results):
    d, name = res.run.diagnostics, res.run.name
    drawn[top] |= draw(top, d.get("nvfp4/model/dw_cos", []), i, f"cos:{name}", f"{name}: model")
    drawn[top] |= draw(top, expert_cos_min(d), i, f"expert_cos:{name}", f"{name}: lowest expert", "--")
    drawn[mid] |= draw(mid, d.get("nvfp4/residual/rms_min", []), i, f"rms_min:{name}", f"{name}: min over layers", "--")
    drawn[mid] |= draw(mid, d.get("nvfp4/residual/rms_max", []), i, f"rms_max:{name}", f"{name}: max over layers")
    drawn[bottom] |= draw(bottom, d.get("nvfp4/moe/load_max", []), i, f"load:{name}", name)
  for ax, title, empty in ((top, "gradient cosine with the high-precision gradient (dw_cos)",
                            "no nvfp4/*/dw_cos (nvfp4_diagnostics_grad=true records them)"),
                           (mid, "residual-stream RMS", "no nvfp4/residual/* (nvfp4_diagnostics=true records them)"),
                           (bottom, "MoE load: busiest expert / mean", "no MoE layers (or no nvfp4_diagnostics)")):
    ax.set_title(title, fontsize=10)
    ax.set_xscale("log")
    ax.grid(alpha=0.3, which="both")
    if drawn[ax]:
      ax.legend(loc="best", fontsize=7)
    else:
      ax.annotate(empty, (0.5, 0.5), xycoords="axes fraction", ha="center", fontsize=9)
  if drawn[mid]:
    mid.set_yscale("log")
  bottom.set_xlabel("step (log)")
  if c.label:
    fig.suptitle(_wrap(c.label), fontsize=9)
  fig.tight_layout()
  return fig
