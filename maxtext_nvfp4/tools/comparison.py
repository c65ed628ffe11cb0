"""The statistics of ``maxtext-nvfp4 compare``: throughput, loss gap and a verdict for runs vs a baseline.

Runs come from :mod:`maxtext_nvfp4.tools.metrics` (training records by step). Every number is defined
exactly (``docs/compare.md``):

* Throughput steps: a run's steps before its first non-finite loss (a diverged run's last steps time an
  aborting step). Warm-up: the first of them (step 0 of a fresh run: it includes the XLA compile) and the
  next ``W`` are skipped, ``W = --warmup`` or ``max(1, n // 10)`` for ``n`` throughput steps.
* ``median step time`` = median of the finite ``perf/step_time_seconds`` over the remaining steps;
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
  converged part alone (no early-step gap leaks in); ``relative gap`` = ``mean gap / mean baseline loss
  over the converged part``.
* Overlap: the run and the baseline must share at least ``min(20, ceil(0.2 * m))`` steps, ``m`` = the
  larger of their step counts; fewer is verdict ``INSUFFICIENT OVERLAP`` (a handful of shared steps says
  nothing about the gap).
* Drift (:mod:`maxtext_nvfp4.tools.drift`): the gap per window with a band from the step-to-step noise, its
  trend, the ``nvfp4/*`` diagnostics' trends and the early-warning rule; reported beside the verdict, which it
  does not change.
* Verdict: PASS when ``mean gap <= --tolerance`` (default 0.03 nats; NVIDIA's published Llama-3 8B
  NVFP4-vs-FP8 gap is +0.026), the overlap suffices and neither loss is non-finite; else FAIL or
  INSUFFICIENT OVERLAP. Overall: FAIL if any run fails, else INSUFFICIENT OVERLAP if any, else PASS.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Sequence

from maxtext_nvfp4.tools import drift as drift_lib
from maxtext_nvfp4.tools.metrics import (LOSS, STEP_TIME, TFLOPS, TFLOPS_PER_SEC, TOKENS, TOKENS_PER_SEC,
                                         InputError, Run)

PUBLISHED_GAP = 0.026
# Minimum overlap: MIN_OVERLAP_STEPS shared steps, or MIN_OVERLAP_FRACTION of the longer run when that is less.
MIN_OVERLAP_STEPS = 20
MIN_OVERLAP_FRACTION = 0.2
INSUFFICIENT = "INSUFFICIENT OVERLAP"


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
  # Drift windows and early-warning thresholds (its converged_from is replaced by the one above).
  drift: drift_lib.Rule = drift_lib.Rule()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Throughput:
  """Warm-up-free speed of one run (None where the metrics lack the key)."""

  # Steps skipped as warm-up (the first throughput step + W) and steps measured.
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
  # Steps left out because they come at or after the first non-finite loss.
  diverged_steps: int = 0


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
  # Final-eval loss of the run and of the baseline at eval_shared_at (None when absent).
  eval_loss: float | None
  eval_loss_baseline: float | None
  # The last eval step both runs have (their last evals can differ: a run still going, a shorter run); with
  # no common eval step, each one's own last eval (None when a run has none).
  eval_shared_at: int | None = None


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
  # "PASS" | "FAIL" | INSUFFICIENT | "BASELINE"
  verdict: str
  # Why (one line each): divergence, mismatched steps, missing metrics, reading notes.
  notes: tuple[str, ...]
  # Gap windows, trends and early warnings against the baseline (None for the baseline / no common steps).
  drift: drift_lib.Drift | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Comparison:
  """The whole comparison: per-run results plus the parameters actually used."""

  # Baseline first, then the other runs in argument order.
  results: tuple[RunResult, ...]
  options: Options
  # Effective smoothing window (after the default).
  smooth: int
  # "PASS" | "FAIL" | INSUFFICIENT | "n/a" (only a baseline given).
  verdict: str
  # A label shown at the top of the report (e.g. reproduce's PROXY marker).
  label: str = ""

  @property
  def exit_code(self) -> int:
    return 1 if self.verdict in ("FAIL", INSUFFICIENT) else 0


def moving_average(values: Sequence[float], window: int) -> list[float]:
  """Trailing moving average: ``out[i] = mean(values[max(0, i-window+1) .. i])`` (exact sums)."""
  window = max(1, int(window))
  return [math.fsum(values[max(0, i - window + 1): i + 1]) / min(i + 1, window) for i in range(len(values))]


def default_warmup(n: int) -> int:
  return max(1, n // 10)


def default_smooth(n: int) -> int:
  return max(1, n // 20)


def min_overlap(n_run: int, n_base: int) -> int:
  """Fewest shared steps a loss comparison needs: ``min(20, ceil(0.2 * max(n_run, n_base)))``."""
  return min(MIN_OVERLAP_STEPS, math.ceil(MIN_OVERLAP_FRACTION * max(n_run, n_base)))


def throughput(run: Run, warmup: int | None) -> Throughput:
  """Median speed over the run's finite-loss steps after the first one and ``warmup`` more (module doc)."""
  order = run.sorted_steps
  bad = run.first_nonfinite_step()
  finite = order if bad is None else [s for s in order if s < bad]
  w = default_warmup(len(finite)) if warmup is None else max(0, int(warmup))
  skipped = min(len(finite), 1 + w)
  recs = [run.steps[s] for s in finite[skipped:]]

  def med(key):
    vals = [float(r[key]) for r in recs
            if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return statistics.median(vals) if vals else None

  t = med(STEP_TIME)
  tokens, tflops = med(TOKENS), med(TFLOPS)
  tok_s = tokens / t if (tokens is not None and t) else med(TOKENS_PER_SEC)
  tfl_s = tflops / t if (tflops is not None and t) else med(TFLOPS_PER_SEC)
  return Throughput(skipped=skipped, measured=len(recs), median_step_time=t, tokens_per_sec=tok_s,
                    tflops_per_sec=tfl_s, diverged_steps=len(order) - len(finite))


def loss_stats(run: Run, base: Run, opts: Options, smooth: int) -> LossStats | None:
  """Loss numbers of ``run`` vs ``base`` over their common finite steps (see module doc)."""
  common = sorted(set(run.steps) & set(base.steps))
  cut = []
  for s in common:
    if not (math.isfinite(run.loss(s)) and math.isfinite(base.loss(s))):
      break
    cut.append(s)
  if not cut:
    return None
  n = len(cut)
  lr = [run.loss(s) for s in cut]
  lb = [base.loss(s) for s in cut]
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
  ev, evb = run.eval_loss, base.eval_loss
  shared = set(ev) & set(evb)
  at = max(shared) if shared else None
  return LossStats(steps=tuple(cut), final_loss=final, final_loss_baseline=final_b,
                   converged_start_step=cut[start] if start < n else None, mean_gap=mean_gap,
                   max_gap=max_gap, relative_gap=rel,
                   eval_loss=ev[at] if at is not None else (ev[max(ev)] if ev else None),
                   eval_loss_baseline=evb[at] if at is not None else (evb[max(evb)] if evb else None),
                   eval_shared_at=at)


def _steps_span(run: Run) -> str:
  return f"{len(run.steps)} steps {min(run.steps)}..{max(run.steps)}"


def compare_runs(runs: Sequence[Run], opts: Options = Options(), *, label: str = "") -> Comparison:
  """Compare ``runs[1:]`` against ``runs[0]`` (the baseline). Raises :class:`InputError` when a run shares
  no step with the baseline."""
  base, others = runs[0], list(runs[1:])
  for r in others:
    if not set(r.steps) & set(base.steps):
      raise InputError(f"{r.name} shares no step with the baseline {base.name}: steps {min(r.steps)}.."
                       f"{max(r.steps)} vs {min(base.steps)}..{max(base.steps)}; compare runs of the same "
                       "training steps")
  n_common = min((len(set(r.steps) & set(base.steps)) for r in others), default=len(base.steps))
  smooth = opts.smooth if opts.smooth else default_smooth(n_common)
  base_tp = throughput(base, opts.warmup)
  results = []
  base_nan = base.first_nonfinite_step()
  for i, r in enumerate([base] + others):
    notes = list(r.warnings)
    tp = throughput(r, opts.warmup)
    if tp.measured == 0:
      notes.append(f"only {len(r.steps) - tp.diverged_steps} finite-loss step(s) recorded, all skipped as "
                   "warm-up: no throughput")
    elif tp.median_step_time is None:
      notes.append(f"no '{STEP_TIME}' in the metrics: no throughput")
    if tp.diverged_steps and tp.measured:
      notes.append(f"throughput from the {tp.measured} measured step(s) before the first non-finite loss")
    if i > 0 and tp.median_step_time and base_tp.median_step_time:
      tp = dataclasses.replace(tp, speedup=base_tp.median_step_time / tp.median_step_time)
    if r.malformed:
      notes.append(f"skipped {r.malformed} malformed line(s), first at line {r.first_malformed}")
    bad = r.first_nonfinite_step()
    if bad is not None:
      notes.append(f"diverged: first non-finite loss ({r.loss(bad)}) at step {bad}")
    if i == 0:
      results.append(RunResult(run=r, is_baseline=True, throughput=tp, loss=None, verdict="BASELINE",
                               notes=tuple(notes)))
      continue
    own, theirs = set(r.steps), set(base.steps)
    n_shared = len(own & theirs)
    if own != theirs:
      notes.append(f"step sets differ ({r.name}: {_steps_span(r)}, {base.name}: {_steps_span(base)}); loss "
                   f"compared over the {n_shared} common steps")
    ls = loss_stats(r, base, opts, smooth)
    if ls is not None and len(ls.steps) < n_shared:
      notes.append(f"loss numbers use steps {ls.steps[0]}..{ls.steps[-1]} only (before the first non-finite "
                   "loss of this run or the baseline)")
    need = min_overlap(len(own), len(theirs))
    if bad is not None:
      verdict = "FAIL"
    elif base_nan is not None:
      verdict = "FAIL"
      notes.append(f"baseline diverged at step {base_nan}: no valid comparison")
    elif n_shared < need:
      verdict = INSUFFICIENT
      notes.append(f"insufficient overlap: {n_shared} common step(s) with the baseline, need at least {need} "
                   f"(min({MIN_OVERLAP_STEPS}, {MIN_OVERLAP_FRACTION:g} x {max(len(own), len(theirs))} steps)); "
                   "compare runs over the same steps")
    elif ls is None or ls.mean_gap is None:
      verdict = "FAIL"
      notes.append("no converged part to compare")
    else:
      verdict = "PASS" if ls.mean_gap <= opts.tolerance else "FAIL"
      if verdict == "FAIL":
        notes.append(f"mean gap {ls.mean_gap:+.4f} > tolerance {opts.tolerance:.4f} nats")
    dr = None
    if ls is not None:
      rule = dataclasses.replace(opts.drift, converged_from=opts.converged_from)
      dr = drift_lib.analyze({s: r.loss(s) for s in ls.steps}, {s: base.loss(s) for s in ls.steps}, r.diagnostics,
                             rule)
      notes += [f"DRIFT WARNING: {w.why}" for w in dr.warnings]
    results.append(RunResult(run=r, is_baseline=False, throughput=tp, loss=ls, verdict=verdict,
                             notes=tuple(notes), drift=dr))
  verdicts = [x.verdict for x in results[1:]]
  if not others:
    overall = "FAIL" if base_nan is not None else "n/a"
  else:
    overall = "FAIL" if "FAIL" in verdicts else INSUFFICIENT if INSUFFICIENT in verdicts else "PASS"
  return Comparison(results=tuple(results), options=opts, smooth=smooth, verdict=overall, label=label)


def expert_cos_min(diagnostics: dict) -> list[tuple[int, float]]:
  """``(step, min over experts of nvfp4/expert_<e>/dw_cos)`` per step (empty without per-expert keys)."""
  by_step: dict[int, float] = {}
  for k, series in diagnostics.items():
    if k.startswith("nvfp4/expert_") and k.endswith("/dw_cos"):
      for s, v in series:
        by_step[s] = min(by_step.get(s, math.inf), v)
  return sorted(by_step.items())
