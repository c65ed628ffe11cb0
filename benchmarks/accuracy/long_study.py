"""Publish a long ``maxtext-nvfp4 study`` (issue 29) into benchmarks/accuracy/long/: the arms' metrics files,
the compare report with its drift section, the plots, and long/summary.json (the drift statistics and the
early-warning findings, which tests/tools/test_drift.py recomputes from the copied files).

  python benchmarks/accuracy/long_study.py --study DIR [--out benchmarks/accuracy/long_sp] [--arms bf16,nvfp4] --print

copies each arm's metrics (``<arm>.jsonl.gz``, gzip with no timestamp: the same bytes for the same records), writes
the compare report and its figures (loss, drift, stability) and summary.json, and with ``--print`` prints the
RESULTS.md table. ``--arms``: only these arms (e.g. the finished ones of a study still running). No path of this
machine is written: the study is named by its folder's name.

Pairs analysed: every arm against the study's first arm (the baseline, bf16 in the demo), and nvfp4 / nvfp4_switch
against fp8 when present (NVIDIA's comparison). Steps: the steps each pair shares in the arms' merged metrics
(``DIR/arms/ARM/metrics.jsonl``: up to each arm's last complete checkpoint).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "long"


def pairs_of(arms: list[str]) -> list[tuple[str, str]]:
  """(run, baseline) pairs: every arm vs the first; the NVFP4 arms vs fp8 too."""
  out = [(a, arms[0]) for a in arms[1:]]
  if "fp8" in arms and arms[0] != "fp8":
    out += [(a, "fp8") for a in arms if a.startswith("nvfp4")]
  return out


def pair_summary(run, base) -> dict:
  """The compare + drift numbers of one pair (runs from tools.metrics.read)."""
  from maxtext_nvfp4.tools import comparison  # pylint: disable=import-outside-toplevel

  c = comparison.compare_runs([base, run])
  res = c.results[1]
  ls, d = res.loss, res.drift
  out = {"run": run.name, "baseline": base.name, "common_steps": len(ls.steps) if ls else 0,
         "mean_gap": ls.mean_gap if ls else None, "final_loss": ls.final_loss if ls else None,
         "final_loss_baseline": ls.final_loss_baseline if ls else None,
         "eval_gap": (ls.eval_loss - ls.eval_loss_baseline) if ls and ls.eval_loss is not None
         and ls.eval_loss_baseline is not None else None, "verdict": res.verdict}
  if d is not None:
    t = d.gap.trend
    out.update(window=d.gap.window, windows=[dataclasses.asdict(w) for w in d.gap.windows],
               trend=None if t is None else {"slope_per_1k": 1000 * t.slope, "low_per_1k": 1000 * t.low,
                                             "high_per_1k": 1000 * t.high, "rise": t.rise, "resolved": t.resolved},
               warnings=[w.what for w in d.warnings], first_warning_step=d.first_warning_step,
               underflow=[{"key": x.key, "first": x.first, "last": x.last, "samples": x.samples,
                           "slope_per_1k": None if x.trend is None else 1000 * x.trend.slope,
                           "resolved": None if x.trend is None else x.trend.resolved}
                          for x in d.diagnostics if x.key.endswith("_underflow")])
  return out


def publish(study_dir: Path, out: Path = OUT, only: set[str] | None = None) -> dict:
  from maxtext_nvfp4.tools import compare, metrics  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, str(HERE))
  from run_study import shrink_png  # pylint: disable=import-outside-toplevel

  spec = json.loads((study_dir / "study.json").read_text())
  state = json.loads((study_dir / "state.json").read_text())
  spec = {**spec, **({"recipes_dir": Path(spec["recipes_dir"]).name} if spec.get("recipes_dir") else {})}
  out.mkdir(parents=True, exist_ok=True)
  arms = []
  for arm in spec["arms"]:
    src = study_dir / "arms" / arm / "metrics.jsonl"
    if (only is None or arm in only) and src.exists() and src.stat().st_size:
      with open(src, "rb") as fin, open(out / f"{arm}.jsonl.gz", "wb") as raw, \
          gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as fout:
        shutil.copyfileobj(fin, fout)
      arms.append(arm)
  runs = {a: metrics.read(out / f"{a}.jsonl.gz", name=a) for a in arms}
  summary = {
      "written": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}Z",
      "study": study_dir.name, "spec": spec, "published_arms": arms,
      "arms": {a: {k: state["arms"][a].get(k) for k in ("steps_done", "chunks", "wall_s", "status", "last_loss",
                                                          "rechecked_steps", "mismatched_steps")}
               for a in spec["arms"]},
      "median_step_s": {a: statistics.median(float(r["perf/step_time_seconds"]) for s, r in runs[a].steps.items()
                                             if s > 1 and isinstance(r.get("perf/step_time_seconds"), (int, float)))
                        for a in arms if len(runs[a].steps) > 3},
      "pairs": [pair_summary(runs[r], runs[b]) for r, b in pairs_of(arms)],
  }
  (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
  if len(arms) >= 2:
    cmp_dir = study_dir / "compare"
    with open(os.devnull, "w", encoding="utf8") as sink:
      compare.run_compare([f"{a}={out / (a + '.jsonl.gz')}" for a in arms], out=str(cmp_dir),
                          label=f"long study {study_dir.name}: {', '.join(arms)}", stream=sink)
    for name in ("loss", "drift", "stability"):
      if (cmp_dir / f"{name}.png").exists():
        shrink_png(cmp_dir / f"{name}.png", out / f"{name}.png")
    shutil.copyfile(cmp_dir / "report.md", out / "report.md")
  return summary


def table(summary: dict) -> str:
  """The RESULTS.md table of the pairs."""
  head = "| run − baseline | common steps | mean gap (converged) | eval gap (last eval) | window | gap: first → last window | slope / 1k steps (95 %) | resolved | early warning |"
  rows = [head, "|" + "---|" * 9]
  f = lambda v, fmt="{:+.4f}": "n/a" if v is None else fmt.format(v)  # noqa: E731
  for p in summary["pairs"]:
    w = p.get("windows") or []
    t = p.get("trend")
    rows.append(f"| {p['run']} − {p['baseline']} | {p['common_steps']} | {f(p['mean_gap'])} | {f(p['eval_gap'])} | "
                f"{p.get('window', 'n/a')} | "
                + (f"{w[0]['mean']:+.4f} ± {w[0]['half_width']:.4f} → {w[-1]['mean']:+.4f} ± {w[-1]['half_width']:.4f}"
                   if w else "n/a") + " | "
                + ("n/a (< 3 windows)" if t is None else
                   f"{t['slope_per_1k']:+.4f} [{t['low_per_1k']:+.4f}, {t['high_per_1k']:+.4f}]") + " | "
                + ("n/a" if t is None else ("yes" if t["resolved"] else "no")) + " | "
                + (", ".join(p.get("warnings") or []) or "none") + " |")
  return "\n".join(rows)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--study", required=True, help="the study directory (maxtext-nvfp4 study DIR)")
  ap.add_argument("--out", default=str(OUT), help="where to publish (default benchmarks/accuracy/long)")
  ap.add_argument("--print", action="store_true", help="print the RESULTS.md table")
  ap.add_argument("--arms", help="comma list: publish only these arms (default: every arm with metrics)")
  a = ap.parse_args(argv)
  s = publish(Path(a.study).absolute(), Path(a.out), None if not a.arms else set(a.arms.split(",")))
  print(f"wrote {a.out}: " + ", ".join(sorted(os.listdir(a.out))))
  if a.print:
    print(table(s))
  return 0


if __name__ == "__main__":
  sys.exit(main())
