"""``maxtext-nvfp4 compare``: throughput, loss gap and a verdict for MaxText runs (the command line).

A RUN is a MaxText ``metrics_file`` (JSON lines) or a directory holding one, optionally written
``NAME=PATH`` to name it. The first RUN (or ``--baseline``) is the baseline. Three modules do the work,
each importing only the one before it:

* :mod:`maxtext_nvfp4.tools.metrics` reads the files (train vs eval records, repeats, truncation);
* :mod:`maxtext_nvfp4.tools.comparison` computes throughput, loss gaps and verdicts (exact definitions
  there and in ``docs/compare.md``);
* :mod:`maxtext_nvfp4.tools.report` renders the terminal summary and ``report.md``, and
  :mod:`maxtext_nvfp4.tools.plots` the figures.

Exit code: 0 all PASS (or a single run), 1 any FAIL or INSUFFICIENT OVERLAP, 2 bad input (one line on
stderr, checked before anything is read in full or written).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from maxtext_nvfp4.tools import cli
from maxtext_nvfp4.tools import cliargs
from maxtext_nvfp4.tools import metrics
from maxtext_nvfp4.tools import outputs
from maxtext_nvfp4.tools import report
from maxtext_nvfp4.tools.comparison import Comparison, Options, compare_runs  # noqa: F401  (public API)
from maxtext_nvfp4.tools.metrics import InputError, Run  # noqa: F401  (public API)

PROG = "maxtext-nvfp4 compare"


def _split_name(arg: str) -> tuple[str | None, str]:
  if "=" in arg and not os.path.exists(arg):
    name, path = arg.split("=", 1)
    if name and path:
      return name, path
  return None, arg


def load_run(arg: str) -> Run:
  """Read a RUN argument (``[NAME=]PATH``). Raises :class:`InputError` (one line) when unusable."""
  name, raw = _split_name(arg)
  return metrics.read(raw, name=name)


# written last into every compare output (what was compared, with which options): what marks a folder as ours
MARKER = "maxtext_nvfp4_compare.json"
# what compare wrote before it wrote MARKER: a folder holding only these is an earlier compare output too
_EARLIER_OUTPUTS = frozenset({"report.md", "loss.png", "throughput.png", "drift.png", "stability.png"})


def _our_report(path: str) -> bool:
  try:
    with open(path, encoding="utf8") as f:
      return f.readline().strip() == "# maxtext-nvfp4 compare"  # report.render_markdown's first line
  except (OSError, UnicodeDecodeError):
    return False


def check_out_dir(out: str) -> str:
  """``--out``'s absolute path once it may be (re)written as a whole: new (its parent exists), empty, or an earlier
  compare output, which is replaced whole, stale figures included (:mod:`maxtext_nvfp4.tools.outputs`); a folder
  holding anything else is refused. Raises :class:`InputError`."""
  path = os.path.abspath(os.path.expanduser(out))
  try:
    entries = set(os.listdir(path)) if os.path.isdir(path) else set()
  except OSError:
    entries = set()
  marker = MARKER
  if entries and MARKER not in entries and entries <= _EARLIER_OUTPUTS and _our_report(os.path.join(path, "report.md")):
    marker = "report.md"  # an earlier version's output (its report.md is ours): replaced whole like any other
  try:
    return outputs.check_out_dir(path, marker=marker, what="maxtext-nvfp4 compare output")
  except outputs.OutputError as e:
    raise InputError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
  p = cli.ArgumentParser(
      prog=PROG,
      description="Compare MaxText runs (metrics files or run directories) against a baseline: "
                  "throughput after warm-up, loss gap over the converged part, PASS/FAIL verdict, plots.",
      epilog="Exit code: 0 PASS, 1 FAIL or insufficient overlap, 2 bad input. RUN may be written NAME=PATH.")
  p.add_argument("runs", nargs="+", metavar="RUN")
  p.add_argument("--baseline", metavar="RUN", help="baseline run (default: the first RUN)")
  p.add_argument("--out", default="compare_out", help="output directory (default: ./compare_out)")
  p.add_argument("--tolerance", type=cliargs.number(at_least=0), default=0.03,
                 help="max mean gap in nats (default 0.03)")
  p.add_argument("--warmup", type=cliargs.number(integer=True, at_least=0), default=None,
                 help="steps skipped after the first one (default max(1, 10%% of steps))")
  p.add_argument("--smooth", type=cliargs.number(integer=True, at_least=1), default=None,
                 help="moving-average window (default max(1, n/20))")
  p.add_argument("--converged-from", type=cliargs.number(at_least=0, below=1), default=0.2,
                 help="fraction of common steps dropped before the converged part (default 0.2)")
  p.add_argument("--label", default="", help="a line printed at the top of the report")
  p.add_argument("--no-plots", action="store_true", help="write report.md only")
  return p


def run_compare(run_args: Sequence[str], *, baseline: str | None = None, out: str | None = "compare_out",
                opts: Options = Options(), label: str = "", plots: bool = True,
                stream=None) -> int:
  """Load, compare, write outputs, print the summary; returns the exit code (0/1/2). Every input is
  checked (``--out`` first, then each run) before anything is written."""
  stream = stream or sys.stdout
  args = list(run_args)
  if baseline is not None:
    args = [baseline] + [a for a in args if a != baseline]
  try:
    if out:
      check_out_dir(out)
    runs = [load_run(a) for a in args]
    names = [r.name for r in runs]
    if len(set(names)) != len(names):  # keep table rows distinguishable
      runs = [dataclasses.replace(r, name=f"{r.name}#{i}") if names.count(r.name) > 1 else r
              for i, r in enumerate(runs)]
    c = compare_runs(runs, opts, label=label)
  except InputError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
  print(report.render_terminal(c), file=stream)
  if out:
    out = check_out_dir(out)
    written: dict[str, str] = {}
    marker = {"producer": PROG, "version": _version(), "runs": {r.run.name: list(r.run.paths) for r in c.results},
              "baseline": c.results[0].run.name, "label": label,
              "options": {k: v for k, v in dataclasses.asdict(c.options).items() if k != "drift"}}
    outputs.publish_dir(out, lambda tmp: written.update(report.write_outputs(c, tmp, plots=plots)), marker=MARKER,
                        marker_text=json.dumps(marker, indent=2) + "\n")
    paths = {k: os.path.join(out, os.path.basename(v)) for k, v in written.items()}
    print("wrote " + ", ".join(paths[k] for k in sorted(paths)), file=stream)
  return c.exit_code


def _version() -> str:
  import maxtext_nvfp4  # pylint: disable=import-outside-toplevel

  return maxtext_nvfp4.__version__


def cli_main(argv: list[str]) -> int:
  try:
    a = build_parser().parse_args(argv)
  except SystemExit as e:  # --help: 0; a usage error: 2, after its one line on stderr
    return int(e.code or 0)
  opts = Options(tolerance=a.tolerance, warmup=a.warmup, smooth=a.smooth, converged_from=a.converged_from)
  return run_compare(a.runs, baseline=a.baseline, out=a.out, opts=opts, label=a.label, plots=not a.no_plots)


if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
