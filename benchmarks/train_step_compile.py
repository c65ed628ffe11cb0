"""How long XLA:CPU takes to compile one tiny MaxText training, per quantization: the test suite's cost driver.

Runs the tests' tiny model (tests/maxtext_helpers.py: 3 llama2 layers, d=64, 3 steps, synthetic data), each run in
a fresh process with its own cold compilation cache, and reports JAX's own compile timers (jax.monitoring):
tracing, lowering and XLA backend compile, summed over the run's programs, plus its losses (a lever that keeps
the numerics must leave them bit for bit).

  JAX_PLATFORMS=cpu XLA_FLAGS=--xla_backend_optimization_level=0 .venv/bin/python benchmarks/train_step_compile.py
  ... benchmarks/train_step_compile.py --quantization nvfp4 --set remat_policy=minimal --repeat 2

The suite runs at ``--xla_backend_optimization_level=0`` (scripts/test.sh); pass the same XLA_FLAGS to compare.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import child_rows  # noqa: E402  pylint: disable=wrong-import-position

_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace s", "/jax/core/compile/jaxpr_to_mlir_module_duration":
           "lower s", "/jax/core/compile/backend_compile_duration": "XLA compile s"}


def _one_run(quantization: str, overrides: dict) -> dict:
  """One tiny training in this process (a fresh one: run by main()); its compile timers, wall time, losses."""
  from jax import monitoring  # pylint: disable=import-outside-toplevel

  totals: collections.Counter = collections.Counter()
  monitoring.register_event_duration_secs_listener(lambda ev, d, **_: totals.update({ev: d}) if ev in _EVENTS else None)
  from maxtext_helpers import losses, tiny_argv  # pylint: disable=import-outside-toplevel  (registers the plugin)
  from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel

  out = tempfile.mkdtemp(prefix="train_step_compile_")
  t0 = time.time()
  train.main(tiny_argv(out, run_name="run", quantization=quantization, jax_cache_dir=os.path.join(out, "cache"),
                       **overrides))
  wall = time.time() - t0
  return {"timers": {_EVENTS[e]: round(totals[e], 2) for e in _EVENTS}, "wall": round(wall, 1),
          "losses": list(losses(os.path.join(out, "run.jsonl")).values())}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quantization", action="append", help="'' (bf16) or nvfp4 (repeatable; default both)")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a MaxText override (repeatable)")
  p.add_argument("--repeat", type=int, default=1, help="runs per quantization, each in a fresh process")
  p.add_argument("--child", help=argparse.SUPPRESS)  # internal: run one training, print its JSON row
  args = p.parse_args(argv)
  overrides = dict(kv.split("=", 1) for kv in args.set)
  if args.child is not None:
    child_rows.emit(_one_run(args.child, overrides))
    return 0
  print(f"| quantization | run | {' | '.join(_EVENTS.values())} | wall s | losses |")
  print("|---|---|" + "---|" * len(_EVENTS) + "---|---|")
  for q in args.quantization or ["", "nvfp4"]:
    for i in range(args.repeat):
      run = child_rows.run_child([sys.executable, os.path.abspath(__file__), "--child", q,
                                  *(f"--set={kv}" for kv in args.set)])
      if run.returncode or run.row is None:
        print(f"| {q or 'bf16'} | {i} | run failed (exit {run.returncode}): {run.stderr.strip()[-300:]} |")
        return 1
      row = run.row
      cells = " | ".join(f"{v:.1f}" for v in row["timers"].values())
      print(f"| {q or 'bf16'} | {i} | {cells} | {row['wall']:.1f} | {row['losses']} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
