"""The last screen of ``bash scripts/demo.sh``: the answer the user ran the demo for, in a few lines.

``python -m maxtext_nvfp4.tools.demo_summary OUT`` after ``maxtext-nvfp4 reproduce demo --out OUT``
reads the two arms' metrics (``OUT/bf16``, ``OUT/nvfp4``: ``metrics_merged.jsonl`` when reproduce rebuilt
steps MaxText's metrics file lost, else ``metrics.jsonl``) with :mod:`maxtext_nvfp4.tools.compare`'s own
loader and comparison (so the numbers are the report's), and prints:

  * the loss gap: mean (NVFP4 - BF16) training loss over the converged steps, in nats and relative to
    BF16, the final and eval losses, and the verdict against the tolerance;
  * the speedup as compare's table states it: median BF16 step time / median NVFP4 step time (below 1: NVFP4
    slower; the NVFP4 arm is emulated on a CPU: not Blackwell's FP4 speed-up; the arms run one after the
    other, so other load moves it);
  * where the report and the plots are, and the next commands (compare, train with checkpoints, export).

Exit code: 0 when it printed, 2 (one line) when a metrics file is missing or unreadable.
"""

from __future__ import annotations

import os
import sys

PROG = "maxtext-nvfp4 demo summary"


def _metrics(out: str, label: str) -> str:
  """The arm's metrics: ``metrics_merged.jsonl`` when reproduce wrote it from this ``metrics.jsonl`` (not older
  than it: one left by an earlier run describes another run), else ``metrics.jsonl``."""
  merged, plain = os.path.join(out, label, "metrics_merged.jsonl"), os.path.join(out, label, "metrics.jsonl")
  if os.path.isfile(merged) and (not os.path.isfile(plain) or os.path.getmtime(merged) >= os.path.getmtime(plain)):
    return merged
  return plain


def summary(out: str, *, tolerance: float = 0.03) -> str:
  """The summary text for the reproduce output folder ``out``; raises ``compare.InputError``."""
  from maxtext_nvfp4.tools import cli  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import compare  # pylint: disable=import-outside-toplevel

  runs = [compare.load_run(f"{label}={_metrics(out, label)}") for label in ("bf16", "nvfp4")]
  c = compare.compare_runs(runs, compare.Options(tolerance=tolerance))
  base = next(r for r in c.results if r.is_baseline)
  nv = next(r for r in c.results if not r.is_baseline)
  lines = ["", "=== demo summary: BF16 vs emulated NVFP4 (same initial weights, same batches) ==="]
  loss = nv.loss
  if loss is not None and loss.mean_gap is not None:
    rel = f" ({loss.relative_gap:+.2%} of BF16)" if loss.relative_gap is not None else ""
    first = loss.converged_start_step
    lines.append(f"loss gap   NVFP4 - BF16 = {loss.mean_gap:+.4f} nats mean over steps {first}-{loss.steps[-1]}{rel};"
                 f" final loss {loss.final_loss:.4f} vs {loss.final_loss_baseline:.4f}"
                 + (f"; eval loss {loss.eval_loss:.4f} vs {loss.eval_loss_baseline:.4f}"
                    if loss.eval_loss is not None and loss.eval_loss_baseline is not None else ""))
  lines.append(f"verdict    {nv.verdict} (tolerance {tolerance:g} nats; overall: {c.verdict})")
  t_nv, t_b = nv.throughput.median_step_time, base.throughput.median_step_time
  if t_nv and t_b and nv.throughput.speedup:  # compare's direction: baseline time / run time (> 1: faster)
    lines.append(f"speedup    BF16 {t_b:.3f} s / NVFP4 {t_nv:.3f} s = {nv.throughput.speedup:.3f}x (median step times,"
                 f" as compare's table; NVFP4 {'slower' if nv.throughput.speedup < 1 else 'faster'} here: it is"
                 " emulated (exact, no FP4 hardware), so this is not Blackwell's speed-up; other load on the machine"
                 " moves it)")
  cmp_dir = os.path.join(out, "compare")
  lines.append(f"report     {os.path.join(cmp_dir, 'report.md')}")
  plots = [os.path.join(cmp_dir, p) for p in ("loss.png", "throughput.png") if os.path.isfile(os.path.join(cmp_dir, p))]
  lines.append(f"plots      {', '.join(plots) if plots else '(none written)'}")
  mt, py = cli.shell_command("maxtext-nvfp4"), cli.shell_command("python")
  lines += [f"next       {mt} compare bf16={_metrics(out, 'bf16')} nvfp4={_metrics(out, 'nvfp4')} --out my_compare",
            f"           {py} -m maxtext_nvfp4.train demo_nvfp4 enable_checkpointing=true async_checkpointing=false",
            f"           {mt} export runs/demo_nvfp4/checkpoints --out runs/demo_nvfp4_hf"
            "   # NVFP4 checkpoint for vLLM (docs/export.md)"]
  if mt.startswith((".", "/")):
    lines.append(f"           (or first: source {os.path.join(os.path.dirname(py), 'activate')}, then maxtext-nvfp4"
                 " and python are this environment's)")
  return "\n".join(lines)


def main(argv: list[str]) -> int:
  from maxtext_nvfp4.tools import compare  # pylint: disable=import-outside-toplevel

  if len(argv) != 1 or argv[0].startswith("-"):
    print(f"usage: python -m maxtext_nvfp4.tools.demo_summary REPRODUCE_OUT_DIR", file=sys.stderr)
    return 2
  try:
    print(summary(argv[0]), flush=True)
  except compare.InputError as e:
    print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
