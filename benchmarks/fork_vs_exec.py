"""What a fork server would save the test suite: one tiny MaxText training (1 layer, MLP GEMMs in NVFP4, 2 steps)
in a child forked after importing MaxText's train module, against the same training in a fresh
``python -m maxtext_nvfp4.train`` process. Each run gets its own cold compilation cache; both must log the same
losses bit for bit.

  JAX_PLATFORMS=cpu .venv/bin/python benchmarks/fork_vs_exec.py

Prints one row per run: exit code, CPU seconds of the child (RUSAGE of the reaped process), wall seconds, losses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from maxtext_helpers import tiny_argv  # noqa: E402  (registers the plugin)


def _reap(pid: int) -> tuple[int, float]:
  _, status, usage = os.wait4(pid, 0)
  return os.waitstatus_to_exitcode(status), usage.ru_utime + usage.ru_stime


def main() -> int:
  out = tempfile.mkdtemp(prefix="fork_vs_exec_")
  base = tiny_argv(out, run_name="base", steps=2, quantization="nvfp4", nvfp4_targets="mlp",
                   base_num_decoder_layers=1)[1:]

  def argv(name):
    return [*base, f"run_name={name}", f"metrics_file={out}/{name}.jsonl", f"jax_cache_dir={out}/cache_{name}"]

  t0 = time.time()
  from maxtext.trainers.pre_train import train  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  from maxtext_nvfp4 import train as cli  # pylint: disable=import-outside-toplevel
  print(f"parent: importing MaxText's train module took {time.time() - t0:.1f} s wall", flush=True)
  rows = []
  t = time.time()
  pid = os.fork()
  if pid == 0:  # the child never returns into this function, whatever the training does
    try:
      os._exit(cli.cli_main(argv("forked")) or 0)
    finally:
      os._exit(1)
  rows.append(("forked after the import", *_reap(pid), time.time() - t, "forked"))
  t = time.time()
  proc = subprocess.Popen([sys.executable, "-m", "maxtext_nvfp4.train", *argv("exec")],  # pylint: disable=consider-using-with
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  rows.append(("fresh process", *_reap(proc.pid), time.time() - t, "exec"))
  print("| run | rc | CPU s | wall s | losses |\n|---|---|---|---|---|")
  losses = {}
  for label, rc, cpu, wall, name in rows:
    losses[name] = []
    if rc == 0:  # a failed run may have written no metrics file
      with open(f"{out}/{name}.jsonl", encoding="utf-8") as f:
        losses[name] = [json.loads(line)["learning/loss"] for line in f if line.strip()]
    print(f"| {label} | {rc} | {cpu:.1f} | {wall:.1f} | {losses[name]} |")
  same = losses["forked"] == losses["exec"] and bool(losses["forked"])
  print(f"losses bit-identical: {same}")
  return 0 if same else 1


if __name__ == "__main__":
  sys.exit(main())
