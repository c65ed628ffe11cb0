"""``maxtext-nvfp4 compare``: throughput, loss gap and a verdict for MaxText runs.

A RUN is a MaxText ``metrics_file`` (JSON lines, one object per step: ``step``, ``learning/loss``,
``perf/step_time_seconds``, ``perf/per_device_tokens[_per_sec]``, ``perf/per_device_tflops[_per_sec]``),
or a directory holding one, optionally written ``NAME=PATH`` to name it. The first RUN (or
``--baseline``) is the baseline. Every number is defined exactly (``docs/compare.md``):

* Warm-up: per run, the first recorded step (step 0 of a fresh run: it includes the XLA compile) and the
  next ``W`` steps are skipped, ``W = --warmup`` or ``max(1, n // 10)`` for ``n`` recorded steps.
* ``median step time`` = median of ``perf/step_time_seconds`` over the remaining steps;
  ``tokens/s/device`` = ``perf/per_device_tokens / median step time`` and
  ``TFLOP/s/device`` = ``perf/per_device_tflops / median step time`` (both numerators are constant per
  run in MaxText; when absent, the median of the ``*_per_sec`` metric is used). MaxText's TFLOP count is
  analytic from the config, so a quantized GEMM counts as the same FLOPs as a bf16 one
  ("bf16-equivalent"). ``speedup = baseline median step time / run median step time``.
* Loss numbers use only the ``n`` steps that both the run and the baseline recorded ("common steps"),
  cut before the first non-finite loss of either. ``gap_i = loss_run_i - loss_base_i``.
  ``final loss`` = mean of the last ``max(1, ceil(n / 10))`` common steps.
  The *converged part* is the common steps at positions ``floor(f * n) .. n-1`` (``f = 0.2`` by default:
  everything after the first 20 % of steps). ``mean gap`` = mean of ``gap_i`` over the converged part;
  ``max gap`` = max of the trailing moving average (window ``--smooth``) of ``gap_i`` computed over the
  converged part alone (no early-step gap leaks in); ``relative gap`` = ``mean gap / mean baseline loss over the converged part``.
* Verdict: PASS when ``mean gap <= --tolerance`` (default 0.03 nats; NVIDIA's published Llama-3 8B
  NVFP4-vs-FP8 gap is +0.026) and the run has no non-finite loss; else FAIL.
  Exit code: 0 all PASS, 1 any FAIL, 2 bad input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
from pathlib import Path
from typing import Sequence

LOSS = "learning/loss"
STEP_TIME = "perf/step_time_seconds"
TOKENS = "perf/per_device_tokens"
TOKENS_PER_SEC = "perf/per_device_tokens_per_sec"
TFLOPS = "perf/per_device_tflops"
TFLOPS_PER_SEC = "perf/per_device_tflops_per_sec"
# MaxText 0.2.5 writes the end-of-eval summary at the train step with these keys; the running
# per-eval-batch snapshots carry "eval/step_time_seconds" instead and are not used.
EVAL_LOSS = "eval/avg_loss"
EVAL_RUNNING_MARKER = "eval/step_time_seconds"
DIAG_PREFIX = "nvfp4/"
PUBLISHED_GAP = 0.026
FLOPS_NOTE = ("TFLOP/s/device is MaxText's analytic count: quantized (FP8/NVFP4) GEMMs are counted as "
              "bf16-equivalent FLOPs, so it measures speed, not low-precision FLOP rate.")


class InputError(ValueError):
  """Unusable input (missing file, no records, nothing in common). Message: one line."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
  """One run's parsed metrics file."""

  # Display name (NAME= prefix, else file stem, else the directory name).
  name: str
  # The metrics file(s) read.
  paths: tuple[str, ...]
  # Training records by step (the last record wins when a step repeats, e.g. after a resume).
  steps: dict[int, dict]
  # Final-eval loss by train step (``eval/avg_loss`` of the end-of-eval summaries).
  eval_loss: dict[int, float]
  # nvfp4/* diagnostics: key -> [(step, value), ...] in file order.
  diagnostics: dict[str, list[tuple[int, float]]]
  # Lines that were not a JSON object (count, first line number or 0).
  malformed: int = 0
  first_malformed: int = 0
  # Reading problems worth a note (e.g. MaxText's eval-step-0 truncation of the metrics file).
  warnings: tuple[str, ...] = ()

  @property
  def sorted_steps(self) -> list[int]:
    return sorted(self.steps)

  def first_nonfinite_step(self) -> int | None:
    for s in self.sorted_steps:
      if not math.isfinite(self.steps[s][LOSS]):
        return s
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Throughput:
  """Warm-up-free speed of one run (None where the metrics lack the key)."""

  # Steps skipped as warm-up (the first recorded step + W) and steps measured.
  skipped: int
  measured: int
  # Median of perf/step_time_seconds over the measured steps.
  median_step_time: float | None
  # per_device_tokens / median_step_time (or median of tokens_per_sec).
  tokens_per_sec: float | None
  # per_device_tflops / median_step_time (or median of tflops_per_sec); bf16-equivalent FLOPs.
  tflops_per_sec: float | None
  # baseline median step time / this run's median step time.
  speedup: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossStats:
  """Loss of one run against the baseline over their common steps."""

  # Common steps used (cut before the first non-finite loss of either run) and their count.
  steps: tuple[int, ...]
  # Mean loss of the last max(1, ceil(n/10)) common steps, run and baseline.
  final_loss: float
  final_loss_baseline: float
  # Converged part: positions floor(converged_from*n)..n-1 of the common steps; its first step.
  converged_start_step: int | None
  # Mean and max (of the smoothed gap) over the converged part; None without a converged part.
  mean_gap: float | None
  max_gap: float | None
  # mean_gap / mean baseline loss over the converged part.
  relative_gap: float | None
  # Last final-eval loss of the run and of the baseline (None when absent).
  eval_loss: float | None
  eval_loss_baseline: float | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
  """Everything the report says about one run."""

  # The parsed run.
  run: Run
  # True for the baseline.
  is_baseline: bool
  throughput: Throughput
  # None for the baseline or when the runs share no finite step.
  loss: LossStats | None
  # "PASS" | "FAIL" | "BASELINE" | "n/a"
  verdict: str
  # Why (one line each): divergence, mismatched steps, missing metrics.
  notes: tuple[str, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Options:
  """Comparison parameters (CLI flags)."""

  # Verdict threshold on the mean gap, in nats.
  tolerance: float = 0.03
  # Warm-up steps skipped after the first recorded step; None: max(1, n // 10).
  warmup: int | None = None
  # Trailing moving-average window for curves and the max gap; None: max(1, n // 20).
  smooth: int | None = None
  # The converged part starts at this fraction of the common steps.
  converged_from: float = 0.2


# ------------------------------------------------------------------------------------------------ reading


def _find_metrics_files(directory: Path) -> list[Path]:
  """The metrics file(s) of a run directory: one *.jsonl / metrics*.txt, or MaxText's GCS chunks."""
  cands = [p for p in sorted(directory.rglob("*"))
           if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)
           and (p.suffix == ".jsonl" or (p.name.startswith("metrics") and p.suffix == ".txt"))]
  # MaxText's gcs_metrics writes metrics_step_XXXXXX_to_step_YYYYYY.txt chunks of one run: read all.
  chunks = [p for p in cands if p.name.startswith("metrics_step_")]
  if chunks and len(chunks) == len(cands):
    return chunks
  if len(cands) > 1:
    listed = ", ".join(str(p) for p in cands[:5])
    raise InputError(f"{directory}: several metrics files ({listed}); pass the file itself")
  if not cands:
    raise InputError(f"{directory}: no metrics file (*.jsonl or metrics*.txt) found")
  return cands


def _split_name(arg: str) -> tuple[str | None, str]:
  if "=" in arg and not os.path.exists(arg):
    name, path = arg.split("=", 1)
    if name and path:
      return name, path
  return None, arg


def _default_name(path: Path) -> str:
  if path.is_dir():
    return path.resolve().name
  stem = path.stem
  if stem.startswith("metrics") and path.parent.name:
    return path.resolve().parent.name
  return stem


def load_run(arg: str) -> Run:
  """Parse a RUN argument (``[NAME=]PATH``). Raises :class:`InputError` (one line) when unusable."""
  name, raw = _split_name(arg)
  path = Path(raw)
  if not path.exists():
    raise InputError(f"{raw}: no such file or directory")
  files = _find_metrics_files(path) if path.is_dir() else [path]
  steps: dict[int, dict] = {}
  eval_loss: dict[int, float] = {}
  diags: dict[str, list[tuple[int, float]]] = {}
  malformed, first_bad, nonempty = 0, 0, 0
  warnings = []
  for f in files:
    try:
      text = f.read_text(encoding="utf8", errors="replace")
    except OSError as e:
      raise InputError(f"{f}: cannot read ({e.strerror})") from None
    for lineno, line in enumerate(text.splitlines(), 1):
      if not line.strip():
        continue
      nonempty += 1
      try:
        rec = json.loads(line)
        if not isinstance(rec, dict):
          raise ValueError("not an object")
        step = int(float(rec["step"])) if "step" in rec else None
      except (ValueError, TypeError, OverflowError):
        malformed += 1
        first_bad = first_bad or lineno
        continue
      if step is None:
        malformed += 1
        first_bad = first_bad or lineno
        continue
      if nonempty == 1 and LOSS not in rec and any(k.startswith("eval/") for k in rec):
        # MaxText 0.2.5 truncates metrics_file on every record with step 0: the first running-eval snapshot of
        # each eval (indexed by eval batch) and the summary of an eval after train step 0. A file that starts
        # with an eval record was truncated there; training records before it are gone.
        warnings.append(f"{f.name} starts with an eval record: MaxText truncated it at an eval, "
                        "so earlier training steps are missing")
      for k, v in rec.items():
        if k.startswith(DIAG_PREFIX) and isinstance(v, (int, float)):
          diags.setdefault(k, []).append((step, float(v)))
      if LOSS in rec:
        try:
          rec[LOSS] = float(rec[LOSS])
        except (TypeError, ValueError):
          malformed += 1
          first_bad = first_bad or lineno
          continue
        steps[step] = rec
      elif EVAL_LOSS in rec and EVAL_RUNNING_MARKER not in rec:
        try:
          eval_loss[step] = float(rec[EVAL_LOSS])
        except (TypeError, ValueError):
          pass
  label = name or _default_name(path)
  from_log = sum(1 for r in steps.values() if r.get("source") == "log")
  if from_log:
    warnings.append(f"{from_log} training step(s) rebuilt from MaxText's log lines (values rounded to 3 decimals)")
  if nonempty == 0:
    raise InputError(f"{label}: {', '.join(map(str, files))} is empty")
  if not steps:
    raise InputError(f"{label}: no training records (JSON objects with 'step' and '{LOSS}') in "
                     f"{', '.join(map(str, files))}" + (f"; {malformed} malformed line(s)" if malformed else ""))
  return Run(name=label, paths=tuple(map(str, files)), steps=steps, eval_loss=eval_loss, diagnostics=diags,
             malformed=malformed, first_malformed=first_bad, warnings=tuple(warnings))


# ------------------------------------------------------------------------------------------------ numbers


def moving_average(values: Sequence[float], window: int) -> list[float]:
  """Trailing moving average: ``out[i] = mean(values[max(0, i-window+1) .. i])`` (exact sums)."""
  window = max(1, int(window))
  return [math.fsum(values[max(0, i - window + 1): i + 1]) / min(i + 1, window) for i in range(len(values))]


def default_warmup(n: int) -> int:
  return max(1, n // 10)


def default_smooth(n: int) -> int:
  return max(1, n // 20)


def throughput(run: Run, warmup: int | None) -> Throughput:
  """Median speed over the run's steps after the first one and ``warmup`` more (see module doc)."""
  order = run.sorted_steps
  w = default_warmup(len(order)) if warmup is None else max(0, int(warmup))
  skipped = min(len(order), 1 + w)
  recs = [run.steps[s] for s in order[skipped:]]

  def med(key):
    vals = [float(r[key]) for r in recs if isinstance(r.get(key), (int, float))]
    return statistics.median(vals) if vals else None

  t = med(STEP_TIME)
  tokens, tflops = med(TOKENS), med(TFLOPS)
  tok_s = tokens / t if (tokens is not None and t) else med(TOKENS_PER_SEC)
  tfl_s = tflops / t if (tflops is not None and t) else med(TFLOPS_PER_SEC)
  return Throughput(skipped=skipped, measured=len(recs), median_step_time=t, tokens_per_sec=tok_s,
                    tflops_per_sec=tfl_s)


def loss_stats(run: Run, base: Run, opts: Options, smooth: int) -> LossStats | None:
  """Loss numbers of ``run`` vs ``base`` over their common finite steps (see module doc)."""
  common = sorted(set(run.steps) & set(base.steps))
  cut = []
  for s in common:
    if not (math.isfinite(run.steps[s][LOSS]) and math.isfinite(base.steps[s][LOSS])):
      break
    cut.append(s)
  if not cut:
    return None
  n = len(cut)
  lr = [run.steps[s][LOSS] for s in cut]
  lb = [base.steps[s][LOSS] for s in cut]
  k = max(1, math.ceil(n / 10))
  final, final_b = math.fsum(lr[-k:]) / k, math.fsum(lb[-k:]) / k
  start = int(math.floor(opts.converged_from * n))
  gaps = [a - b for a, b in zip(lr, lb)]
  conv = gaps[start:]
  mean_gap = max_gap = rel = None
  if conv:
    mean_gap = math.fsum(conv) / len(conv)
    max_gap = max(moving_average(conv, smooth))  # smoothed within the converged part only
    base_mean = math.fsum(lb[start:]) / len(conv)
    rel = mean_gap / base_mean if base_mean else None
  ev = run.eval_loss[max(run.eval_loss)] if run.eval_loss else None
  evb = base.eval_loss[max(base.eval_loss)] if base.eval_loss else None
  return LossStats(steps=tuple(cut), final_loss=final, final_loss_baseline=final_b,
                   converged_start_step=cut[start] if start < n else None, mean_gap=mean_gap,
                   max_gap=max_gap, relative_gap=rel, eval_loss=ev, eval_loss_baseline=evb)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Comparison:
  """The whole comparison: per-run results plus the parameters actually used."""

  # Baseline first, then the other runs in argument order.
  results: tuple[RunResult, ...]
  options: Options
  # Effective smoothing window (after the default).
  smooth: int
  # "PASS" | "FAIL" | "n/a" (only a baseline given).
  verdict: str
  # A label shown at the top of the report (e.g. reproduce's PROXY marker).
  label: str = ""

  @property
  def exit_code(self) -> int:
    return 1 if self.verdict == "FAIL" else 0


def compare_runs(runs: Sequence[Run], opts: Options = Options(), *, label: str = "") -> Comparison:
  """Compare ``runs[1:]`` against ``runs[0]`` (the baseline)."""
  base, others = runs[0], list(runs[1:])
  for r in others:
    if not set(r.steps) & set(base.steps):
      raise InputError(f"{r.name} shares no step with the baseline {base.name}: steps {min(r.steps)}.."
                       f"{max(r.steps)} vs {min(base.steps)}..{max(base.steps)}")
  n_common = min((len(set(r.steps) & set(base.steps)) for r in others), default=len(base.steps))
  smooth = opts.smooth if opts.smooth else default_smooth(n_common)
  base_tp = throughput(base, opts.warmup)
  results = []
  base_nan = base.first_nonfinite_step()
  for i, r in enumerate([base] + others):
    notes = []
    tp = throughput(r, opts.warmup)
    if tp.measured == 0:
      notes.append(f"only {len(r.steps)} step(s) recorded, all skipped as warm-up: no throughput")
    elif tp.median_step_time is None:
      notes.append(f"no '{STEP_TIME}' in the metrics: no throughput")
    if i > 0 and tp.median_step_time and base_tp.median_step_time:
      tp = dataclasses.replace(tp, speedup=base_tp.median_step_time / tp.median_step_time)
    notes += r.warnings
    if r.malformed:
      notes.append(f"skipped {r.malformed} malformed line(s), first at line {r.first_malformed}")
    bad = r.first_nonfinite_step()
    if bad is not None:
      notes.append(f"diverged: first non-finite loss ({r.steps[bad][LOSS]}) at step {bad}")
    if i == 0:
      results.append(RunResult(run=r, is_baseline=True, throughput=tp, loss=None, verdict="BASELINE",
                               notes=tuple(notes)))
      continue
    own, theirs = set(r.steps), set(base.steps)
    if own != theirs:
      notes.append(f"step sets differ ({r.name}: {len(own)} steps {min(own)}..{max(own)}, {base.name}: "
                   f"{len(theirs)} steps {min(theirs)}..{max(theirs)}); loss compared over the "
                   f"{len(own & theirs)} common steps")
    ls = loss_stats(r, base, opts, smooth)
    n_shared = len(own & theirs)
    if ls is not None and len(ls.steps) < n_shared:
      notes.append(f"loss numbers use steps {ls.steps[0]}..{ls.steps[-1]} only (before the first non-finite "
                   "loss of this run or the baseline)")
    if bad is not None:
      verdict = "FAIL"
    elif base_nan is not None:
      verdict = "FAIL"
      notes.append(f"baseline diverged at step {base_nan}: no valid comparison")
    elif ls is None or ls.mean_gap is None:
      verdict = "FAIL"
      notes.append("no converged part to compare")
    else:
      verdict = "PASS" if ls.mean_gap <= opts.tolerance else "FAIL"
      if verdict == "FAIL":
        notes.append(f"mean gap {ls.mean_gap:+.4f} > tolerance {opts.tolerance:.4f} nats")
    results.append(RunResult(run=r, is_baseline=False, throughput=tp, loss=ls, verdict=verdict,
                             notes=tuple(notes)))
  if not others:
    overall = "FAIL" if base_nan is not None else "n/a"
  else:
    overall = "FAIL" if any(x.verdict == "FAIL" for x in results[1:]) else "PASS"
  return Comparison(results=tuple(results), options=opts, smooth=smooth, verdict=overall, label=label)


# ------------------------------------------------------------------------------------------------ report


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
        vals = [res.run.steps[s][LOSS] for s in res.run.sorted_steps]
        k = max(1, math.ceil(len(vals) / 10))
        final = math.fsum(vals[-k:]) / k
    ev = (ls.eval_loss if ls else (res.run.eval_loss[max(res.run.eval_loss)] if res.run.eval_loss else None))
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
      f"- Baseline: **{base.run.name}**. Warm-up: per run the first recorded step (XLA compile) plus {w} "
      "more are skipped: " + ", ".join(f"{r.run.name} {r.throughput.skipped} skipped / "
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
      f"(NVIDIA's published Llama-3 8B NVFP4 vs FP8 gap: +{PUBLISHED_GAP}).",
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
          else f"{r.loss.eval_loss - r.loss.eval_loss_baseline:+.4f}"] for r in evals]), ""]
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
  dh, dr = diagnostics_rows(c)
  if dr:
    lines.append(f"nvfp4 diagnostics: {len({r[0] for r in dr})} metric(s), see report.md")
  lines.append(f"VERDICT: {c.verdict}")
  return "\n".join(lines)


def write_outputs(c: Comparison, out_dir: str | os.PathLike) -> dict[str, str]:
  """Write report.md, loss.png and throughput.png into ``out_dir``; returns their paths."""
  from maxtext_nvfp4.tools import plots  # matplotlib is imported only here

  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  paths = {"loss": str(out / "loss.png"), "throughput": str(out / "throughput.png")}
  plots.save(plots.loss_figure(c), paths["loss"])
  plots.save(plots.throughput_figure(c), paths["throughput"])
  paths["report"] = str(out / "report.md")
  Path(paths["report"]).write_text(render_markdown(c, [paths["loss"], paths["throughput"]]), encoding="utf8")
  return paths


# ------------------------------------------------------------------------------------------------ CLI


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="maxtext-nvfp4 compare",
      description="Compare MaxText runs (metrics files or run directories) against a baseline: "
                  "throughput after warm-up, loss gap over the converged part, PASS/FAIL verdict, plots.",
      epilog="Exit code: 0 PASS, 1 FAIL, 2 bad input. RUN may be written NAME=PATH.")
  p.add_argument("runs", nargs="+", metavar="RUN")
  p.add_argument("--baseline", metavar="RUN", help="baseline run (default: the first RUN)")
  p.add_argument("--out", default="compare_out", help="output directory (default: ./compare_out)")
  p.add_argument("--tolerance", type=float, default=0.03, help="max mean gap in nats (default 0.03)")
  p.add_argument("--warmup", type=int, default=None,
                 help="steps skipped after the first one (default max(1, 10%% of steps))")
  p.add_argument("--smooth", type=int, default=None, help="moving-average window (default max(1, n/20))")
  p.add_argument("--converged-from", type=float, default=0.2,
                 help="fraction of common steps dropped before the converged part (default 0.2)")
  p.add_argument("--label", default="", help="a line printed at the top of the report")
  p.add_argument("--no-plots", action="store_true", help="write report.md only")
  return p


def run_compare(run_args: Sequence[str], *, baseline: str | None = None, out: str | None = "compare_out",
                opts: Options = Options(), label: str = "", plots: bool = True,
                stream=None) -> int:
  """Load, compare, write outputs, print the summary; returns the exit code (0/1/2)."""
  stream = stream or sys.stdout
  args = list(run_args)
  if baseline is not None:
    args = [baseline] + [a for a in args if a != baseline]
  try:
    runs = [load_run(a) for a in args]
    names = [r.name for r in runs]
    if len(set(names)) != len(names):  # keep table rows distinguishable
      runs = [dataclasses.replace(r, name=f"{r.name}#{i}") if names.count(r.name) > 1 else r
              for i, r in enumerate(runs)]
    c = compare_runs(runs, opts, label=label)
  except InputError as e:
    print(f"maxtext-nvfp4 compare: error: {e}", file=sys.stderr)
    return 2
  print(render_terminal(c), file=stream)
  if out:
    if plots:
      paths = write_outputs(c, out)
    else:
      Path(out).mkdir(parents=True, exist_ok=True)
      paths = {"report": str(Path(out) / "report.md")}
      Path(paths["report"]).write_text(render_markdown(c), encoding="utf8")
    print("wrote " + ", ".join(paths[k] for k in sorted(paths)), file=stream)
  return c.exit_code


def cli_main(argv: list[str]) -> int:
  parser = build_parser()
  try:
    a = parser.parse_args(argv)
  except SystemExit as e:  # argparse: usage errors exit 2, --help exits 0
    return int(e.code or 0)
  if a.tolerance < 0 or (a.warmup is not None and a.warmup < 0) or (a.smooth is not None and a.smooth < 1) \
      or not 0 <= a.converged_from < 1:
    print("maxtext-nvfp4 compare: error: need --tolerance >= 0, --warmup >= 0, --smooth >= 1, "
          "0 <= --converged-from < 1", file=sys.stderr)
    return 2
  opts = Options(tolerance=a.tolerance, warmup=a.warmup, smooth=a.smooth, converged_from=a.converged_from)
  return run_compare(a.runs, baseline=a.baseline, out=a.out, opts=opts, label=a.label, plots=not a.no_plots)


if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
