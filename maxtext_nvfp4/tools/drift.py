"""Drift statistics of a long comparison and an early-warning rule: is the loss gap (or the NVFP4 underflow)
growing, and would you see it coming? Pure functions over step/value series (no I/O, no plotting).

Every number, in order (``docs/compare.md`` repeats them):

* Series: the common finite steps ``s_1 < ... < s_n`` of a run and its baseline, ``g_i = loss_run(s_i) -
  loss_base(s_i)``. The *converged part* drops the first ``floor(f * n)`` steps (``f = converged_from``, 0.2 as
  in ``compare``): the early gap is large and shrinking and says nothing about drift.
* Windows: the converged part cut into consecutive windows of ``W`` steps (``W = window`` or
  ``max(MIN_WINDOW, ceil(n_conv / TARGET_WINDOWS))``; a last window shorter than ``W / 2`` joins the one before).
  Per window ``j`` with ``m_j`` steps: mean gap ``G_j``; step-to-step noise ``sigma_j = sqrt(sum_i (g_i -
  g_{i-1})^2 / (2 (m_j - 1)))`` over consecutive steps of the window (first differences: a slowly varying gap
  does not inflate it); band ``G_j +- Z * sigma_j / sqrt(m_j)`` (``Z = 1.96``; it assumes the per-step noise is
  independent, the same batches in both arms cancel most of the data noise in ``g``).
* Trend: ordinary least squares of ``G_j`` on the window centres ``x_j`` (mean step): slope ``b``. Its standard
  error is the larger of the residual one, ``sqrt(sum r_j^2 / (k - 2) / Sxx)`` (times ``sqrt((1 + r1) / (1 - r1))``
  when the residuals' lag-1 autocorrelation ``r1 = sum r_j r_{j-1} / sum r_j^2`` is positive, ``r1 <= 0.9``: a
  gap that wanders slowly is not a trend), and the one the bands imply,
  ``sqrt(sum (x_j - xbar)^2 (sigma_j^2 / m_j)) / Sxx`` (``Sxx = sum (x_j - xbar)^2``, ``k`` windows, ``k >= 3``).
  *Resolved from zero*: ``|b| > t_{0.975, k-2} * se``. Rise = ``b * (x_k - x_1)``, the fitted change of the
  gap over the windows.
* Diagnostics trend (each ``nvfp4/*`` key): the same OLS of the sampled values on their steps over the
  converged part (residual standard error, ``n - 2`` degrees of freedom); rise = ``b * (last step - first step)``,
  fitted start = the fit at the first step.
* Early warning (:func:`warnings_of`): **gap growing** when the slope is resolved, positive and its rise is at
  least ``gap_rise`` nats (default 0.01: a third of compare's default tolerance); **underflow growing** for an
  ``*_underflow`` key when its slope is resolved, positive and its rise is at least ``max(underflow_rise_rel *
  fitted start, underflow_rise_abs)`` (defaults 0.5 and 0.001); **gradient fidelity falling** for a
  ``*/dw_cos`` or ``*/dw_cos_min`` key (the NVFP4 gradient's cosine with the high-precision one) when its slope
  is resolved, negative and its fall is at least ``cos_fall`` (default 0.03; the torchao expert-layout bug took
  an expert's projection from 0.97 to 0.88); **residual stream spreading** for ``nvfp4/residual/rms_span`` (the
  largest over the smallest per-layer RMS) when its level -- the fit at the last step, or the last sample with
  fewer than 3 -- reaches ``rms_span_max`` (default 1000: three of the four orders of magnitude of Nemotron 3
  Ultra's divergence) or its resolved rise is at least ``telemetry_rise_rel`` (default 1.0: doubling) times its
  fitted start; **expert load concentrating** for ``nvfp4/moe/load_max`` and ``nvfp4/moe_<k>/load`` (tokens of
  the busiest expert over the mean) when its level reaches ``load_max`` (default 8; Nemotron's first layer: 12)
  or its resolved rise is at least ``telemetry_rise_rel`` times its fitted start; **routed experts lagging**
  (:func:`expert_lag`) when, averaged over the last ``LAG_SAMPLES`` diagnostic steps, the mean ``dw_cos`` of the
  attention groups minus the lowest ``dw_cos`` of the routed-expert groups is at least ``expert_lag`` (default
  0.1): the experts run the same recipe as the attention GEMMs, so their gradients should point as well; a bug in
  the experts' own path (a per-expert scale or layout) shows there at once, while the whole model's cosine barely
  moves. :func:`first_warning` applies the rule to growing
  prefixes of the run (every ``every`` common steps) and returns the first step at which it fires.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Sequence

Z = 1.96
MIN_WINDOW = 20
TARGET_WINDOWS = 20
UNDERFLOW_SUFFIX = "_underflow"
COS_SUFFIXES = ("/dw_cos", "/dw_cos_min")
RMS_SPAN_KEY = "nvfp4/residual/rms_span"
LOAD_SUFFIXES = ("/load", "/load_max")
LAG_SAMPLES = 5
# Two-sided 97.5 % quantiles of Student's t for 1..30 degrees of freedom (beyond: normal + 2.4 / dof).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t975(dof: int) -> float:
  """Student's t 97.5 % quantile (table for dof <= 30, ``1.96 + 2.4 / dof`` beyond: within 0.3 %)."""
  if dof < 1:
    return math.inf
  return _T975[dof - 1] if dof <= len(_T975) else Z + 2.4 / dof


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rule:
  """Parameters of the early-warning rule and of the windows."""

  # The gap's fitted rise (nats) over the windows that, resolved and positive, makes a warning.
  gap_rise: float = 0.01
  # An underflow key warns when its resolved positive rise >= max(underflow_rise_rel * start, underflow_rise_abs).
  underflow_rise_rel: float = 0.5
  underflow_rise_abs: float = 0.001
  # A dw_cos key warns when its resolved falling trend loses at least cos_fall.
  cos_fall: float = 0.03
  # The residual RMS span and the MoE load imbalance warn at these levels, or when a resolved rise is at least
  # telemetry_rise_rel times the fitted start.
  rms_span_max: float = 1000.0
  load_max: float = 8.0
  telemetry_rise_rel: float = 1.0
  # Routed experts' dw_cos this far below the attention groups' (averaged over the last LAG_SAMPLES samples) warns.
  expert_lag: float = 0.1
  # Fraction of the common steps dropped before the converged part.
  converged_from: float = 0.2
  # Window width in steps (None: max(MIN_WINDOW, ceil(n_conv / TARGET_WINDOWS))).
  window: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Window:
  """One window of the gap."""

  # First and last step, the mean step (the x of the trend), the number of steps.
  first: int
  last: int
  center: float
  n: int
  # Mean gap and its band half-width Z * sigma / sqrt(n); sigma from first differences.
  mean: float
  half_width: float
  sigma: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class Trend:
  """A least-squares slope with its uncertainty."""

  # Slope per step, its standard error, the t quantile used, and the number of points.
  slope: float
  se: float
  t: float
  points: int
  # Fitted value at the first x and the fitted change from the first to the last x.
  start: float
  rise: float

  @property
  def resolved(self) -> bool:
    """The slope differs from zero at 95 %: ``|slope| > t * se``."""
    return abs(self.slope) > self.t * self.se

  @property
  def low(self) -> float:
    return self.slope - self.t * self.se

  @property
  def high(self) -> float:
    return self.slope + self.t * self.se


@dataclasses.dataclass(frozen=True, kw_only=True)
class GapDrift:
  """The windows and trend of one run's gap against its baseline."""

  # Window width used, the windows, and the trend over their means (None with fewer than 3 windows).
  window: int
  windows: tuple[Window, ...]
  trend: Trend | None
  # The converged part's first step and the number of common steps.
  converged_start: int | None
  steps: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiagTrend:
  """The trend of one nvfp4/* diagnostic over the converged part."""

  key: str
  # Samples used, first and last value (raw).
  samples: int
  first: float
  last: float
  # None with fewer than 3 samples.
  trend: Trend | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Warning_:
  """One early-warning finding."""

  # "gap" or the diagnostics key.
  what: str
  # One line saying why.
  why: str


def _ols(xs: Sequence[float], ys: Sequence[float], extra_var: Sequence[float] | None = None) -> Trend | None:
  """OLS slope of ys on xs; se = max(residual se, se implied by ``extra_var`` (variance of each y))."""
  k = len(xs)
  if k < 3:
    return None
  xbar, ybar = math.fsum(xs) / k, math.fsum(ys) / k
  sxx = math.fsum((x - xbar) ** 2 for x in xs)
  if sxx <= 0:
    return None
  b = math.fsum((x - xbar) * (y - ybar) for x, y in zip(xs, ys)) / sxx
  a = ybar - b * xbar
  r = [y - a - b * x for x, y in zip(xs, ys)]
  res = math.fsum(v * v for v in r)
  se = math.sqrt(res / (k - 2) / sxx)
  # residuals that follow each other (a slowly wandering gap) carry less information: widen by the AR(1)
  # variance factor sqrt((1 + r1) / (1 - r1)) of their lag-1 autocorrelation r1 (when > 0, capped at 0.9)
  r1 = math.fsum(r[i] * r[i - 1] for i in range(1, k)) / res if res > 0 else 0.0
  if r1 > 0:
    r1 = min(r1, 0.9)
    se *= math.sqrt((1 + r1) / (1 - r1))
  if extra_var is not None:
    se = max(se, math.sqrt(math.fsum((x - xbar) ** 2 * v for x, v in zip(xs, extra_var))) / sxx)
  return Trend(slope=b, se=se, t=t975(k - 2), points=k, start=a + b * xs[0], rise=b * (xs[-1] - xs[0]))


def default_window(n_conv: int) -> int:
  return max(MIN_WINDOW, math.ceil(n_conv / TARGET_WINDOWS))


def windows_of(steps: Sequence[int], gaps: Sequence[float], width: int) -> list[Window]:
  """Consecutive windows of ``width`` points (a last one shorter than width/2 joins the one before)."""
  n = len(steps)
  bounds = list(range(0, n, width))
  if len(bounds) > 1 and n - bounds[-1] < width / 2:
    bounds.pop()
  out = []
  for j, lo in enumerate(bounds):
    hi = bounds[j + 1] if j + 1 < len(bounds) else n
    s, g = steps[lo:hi], gaps[lo:hi]
    m = len(g)
    mean = math.fsum(g) / m
    d2 = [(g[i] - g[i - 1]) ** 2 for i in range(1, m)]
    sigma = math.sqrt(math.fsum(d2) / (2 * len(d2))) if d2 else 0.0
    out.append(Window(first=s[0], last=s[-1], center=math.fsum(s) / m, n=m, mean=mean,
                      half_width=Z * sigma / math.sqrt(m), sigma=sigma))
  return out


def gap_drift(steps: Sequence[int], gaps: Sequence[float], rule: Rule = Rule()) -> GapDrift:
  """Windows and trend of a gap series (steps ascending, finite gaps; see the module doc)."""
  n = len(steps)
  start = int(math.floor(rule.converged_from * n))
  cs, cg = list(steps[start:]), list(gaps[start:])
  width = rule.window or default_window(len(cs))
  wins = windows_of(cs, cg, width) if cs else []
  trend = _ols([w.center for w in wins], [w.mean for w in wins], [(w.sigma ** 2) / w.n for w in wins])
  return GapDrift(window=width, windows=tuple(wins), trend=trend, converged_start=cs[0] if cs else None, steps=n)


def diag_trend(key: str, series: Sequence[tuple[int, float]], *, from_step: int | None) -> DiagTrend | None:
  """Trend of one diagnostic over its finite samples at steps >= ``from_step`` (None: no samples)."""
  pts = [(s, v) for s, v in series if math.isfinite(v) and (from_step is None or s >= from_step)]
  if not pts:
    return None
  xs, ys = [float(s) for s, _ in pts], [v for _, v in pts]
  return DiagTrend(key=key, samples=len(pts), first=ys[0], last=ys[-1], trend=_ols(xs, ys))


def common_gaps(run_loss: dict[int, float], base_loss: dict[int, float]) -> tuple[list[int], list[float]]:
  """Common steps (cut before the first non-finite loss of either) and their gaps."""
  steps, gaps = [], []
  for s in sorted(set(run_loss) & set(base_loss)):
    a, b = run_loss[s], base_loss[s]
    if not (math.isfinite(a) and math.isfinite(b)):
      break
    steps.append(s)
    gaps.append(a - b)
  return steps, gaps


@dataclasses.dataclass(frozen=True, kw_only=True)
class Drift:
  """Everything the report says about one run's drift."""

  gap: GapDrift
  # Trends of the run's nvfp4/* diagnostics (sorted by key).
  diagnostics: tuple[DiagTrend, ...]
  # What the rule flags on the whole run, and the first step at which it flagged a prefix (None: never).
  warnings: tuple[Warning_, ...]
  first_warning_step: int | None
  rule: Rule


def expert_lag(diagnostics: dict[str, list[tuple[int, float]]], *, until: int | None = None) -> float | None:
  """Mean over the last :data:`LAG_SAMPLES` steps (``<= until``) that have every ``nvfp4/attention*/dw_cos`` and
  ``nvfp4/experts*/dw_cos`` key of ``mean(attention cosines) - min(expert cosines)``; None without both kinds."""
  att = [dict(v) for k, v in diagnostics.items() if k.startswith("nvfp4/attention") and k.endswith("/dw_cos")]
  exp = [dict(v) for k, v in diagnostics.items() if k.startswith("nvfp4/experts") and k.endswith("/dw_cos")]
  if not att or not exp:
    return None
  steps = sorted(set.intersection(*(set(d) for d in att + exp)))
  steps = [s for s in steps if until is None or s <= until][-LAG_SAMPLES:]
  if not steps:
    return None
  lags = [math.fsum(d[s] for d in att) / len(att) - min(d[s] for d in exp) for s in steps]
  return math.fsum(lags) / len(lags)


def warnings_of(gap: GapDrift, diags: Sequence[DiagTrend], rule: Rule, lag: float | None = None) -> list[Warning_]:
  """The early-warning rule (module doc) on one analysis (``lag``: :func:`expert_lag` of its diagnostics)."""
  out = []
  t = gap.trend
  if t is not None and t.resolved and t.slope > 0 and t.rise >= rule.gap_rise:
    out.append(Warning_(what="gap", why=f"loss gap growing: {1000 * t.slope:+.4f} nats per 1k steps "
                                        f"(95 % [{1000 * t.low:+.4f}, {1000 * t.high:+.4f}]), rise {t.rise:+.4f} "
                                        f"nats over steps {gap.windows[0].first}..{gap.windows[-1].last}"))
  for d in diags:
    w = _diag_warning(d, rule)
    if w is not None:
      out.append(w)
  if lag is not None and lag >= rule.expert_lag:
    out.append(Warning_(what="experts_lag", why=f"routed experts' gradient cosine {lag:.3f} below the attention "
                                                f"GEMMs' (>= {rule.expert_lag:g}): a bug in the experts' own path?"))
  return out


def watched(key: str) -> bool:
  """The diagnostics the early-warning rule reads (module doc)."""
  return key.endswith((UNDERFLOW_SUFFIX, *COS_SUFFIXES, *LOAD_SUFFIXES)) or key == RMS_SPAN_KEY


def _diag_warning(d: DiagTrend, rule: Rule) -> Warning_ | None:
  """The rule on one diagnostic's trend (module doc), or None."""
  dt = d.trend
  if d.key.endswith(UNDERFLOW_SUFFIX):
    if dt is None:
      return None
    need = max(rule.underflow_rise_rel * abs(dt.start), rule.underflow_rise_abs)
    if dt.resolved and dt.slope > 0 and dt.rise >= need:
      return Warning_(what=d.key, why=f"{d.key} growing: fitted {dt.start:.4g} -> {dt.start + dt.rise:.4g} "
                                     f"over {d.samples} samples (rise >= {need:.3g})")
    return None
  if d.key.endswith(COS_SUFFIXES):
    if dt is not None and dt.resolved and dt.slope < 0 and -dt.rise >= rule.cos_fall:
      return Warning_(what=d.key, why=f"{d.key} falling: fitted {dt.start:.4g} -> {dt.start + dt.rise:.4g} over "
                                     f"{d.samples} samples (fall >= {rule.cos_fall:g}): the NVFP4 gradient turns away "
                                     "from the high-precision one")
    return None
  if d.key == RMS_SPAN_KEY or d.key.endswith(LOAD_SUFFIXES):
    limit, what = (rule.rms_span_max, "residual RMS span") if d.key == RMS_SPAN_KEY else (rule.load_max,
                                                                                           "expert load imbalance")
    level = d.last if dt is None else dt.start + dt.rise
    if level >= limit:
      return Warning_(what=d.key, why=f"{d.key}: {what} at {level:.4g} (>= {limit:g})")
    if dt is not None and dt.resolved and dt.slope > 0 and dt.rise >= rule.telemetry_rise_rel * abs(dt.start):
      return Warning_(what=d.key, why=f"{d.key} growing: fitted {dt.start:.4g} -> {level:.4g} over {d.samples} "
                                     f"samples (rise >= {rule.telemetry_rise_rel:g} x start)")
  return None


def analyze(run_loss: dict[int, float], base_loss: dict[int, float],
            diagnostics: dict[str, list[tuple[int, float]]] | None = None, rule: Rule = Rule(), *,
            every: int | None = None) -> Drift:
  """Drift of a run against its baseline (loss by step each), with its diagnostics' trends, the rule's
  warnings and the first prefix step at which the rule fires (prefixes every ``every`` common steps,
  default: a tenth of the window's default for the whole run, at least 50)."""
  steps, gaps = common_gaps(run_loss, base_loss)
  diagnostics = diagnostics or {}
  gap = gap_drift(steps, gaps, rule)
  diags = tuple(d for d in (diag_trend(k, v, from_step=gap.converged_start) for k, v in sorted(diagnostics.items()))
                if d is not None)
  warns = warnings_of(gap, diags, rule, expert_lag(diagnostics, until=steps[-1] if steps else None))
  first = first_warning(steps, gaps, diagnostics, rule, every=every) if warns else None
  return Drift(gap=gap, diagnostics=diags, warnings=tuple(warns), first_warning_step=first, rule=rule)


def first_warning(steps: Sequence[int], gaps: Sequence[float], diagnostics: dict[str, list[tuple[int, float]]],
                  rule: Rule = Rule(), *, every: int | None = None) -> int | None:
  """The first prefix end (a common step, tried every ``every`` steps) at which :func:`warnings_of` fires on the
  prefix alone (its own converged part and default window), or None."""
  n = len(steps)
  every = every or max(50, n // 40)
  for end in range(max(every, 3 * MIN_WINDOW), n + every, every):
    end = min(end, n)
    ps, pg = steps[:end], gaps[:end]
    g = gap_drift(ps, pg, rule)
    last = ps[-1]
    ds = [d for d in (diag_trend(k, [(s, v) for s, v in series if s <= last], from_step=g.converged_start)
                      for k, series in diagnostics.items() if watched(k)) if d is not None]
    if warnings_of(g, ds, rule, expert_lag(diagnostics, until=last)):
      return last
    if end == n:
      break
  return None


def gap_at(windows: Sequence[Window], step: int) -> Window | None:
  """The window holding ``step`` (None when outside every window)."""
  firsts = [w.first for w in windows]
  i = bisect.bisect_right(firsts, step) - 1
  return windows[i] if i >= 0 and windows[i].first <= step <= windows[i].last else None
