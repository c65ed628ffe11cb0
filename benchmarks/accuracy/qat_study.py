"""Does NVFP4 QAT close the W4A4 serving gap? The CPU fine-tuning demo, every arm from one bf16 checkpoint.

    python benchmarks/accuracy/qat_study.py [--seeds 0 1 2] [--steps 40] [--arms bf16 full forward serving qad kd_bf16]
                                            [--family dense|moe]
                                            [--out runs/qat_study] [--eval-batches 8]

Run from a directory with ``data/embedded`` and ``data/embedded_sft`` (``maxtext-nvfp4 prepare-data``,
``prepare-sft-data``) and the demo checkpoint (``python -m maxtext_nvfp4.train demo_bf16
enable_checkpointing=true``; ``--family moe``: ``demo_moe_bf16`` and the ``sft_demo_moe_*`` /
``distill_demo_moe_nvfp4`` recipes). Each arm fine-tunes with ``python -m maxtext_nvfp4.sft`` (``sft_demo_bf16`` for
``bf16``, ``sft_demo_nvfp4 nvfp4_qat=<arm>`` otherwise; ``nvfp4_seed`` and ``data_shuffle_seed`` = the seed),
then ``maxtext-nvfp4 eval-quantized`` gives the eval loss of its last checkpoint served in bf16, NVFP4 W4A16 and
NVFP4 W4A4 (the export's weights and, for W4A4, per-token activations: what ``export`` + the consumers' decode
compute). ``bf16`` -> W4A4 is post-training quantization (PTQ). ``qad`` (``distill_demo_nvfp4``: the NVFP4
student distilled from the bf16 teacher, the same data and steps) is an arm when Tunix is installed, and
``kd_bf16`` its control (the same distillation with a bf16 student, then PTQ). An arm whose
``<out>/<arm>_s<seed>.eval.json`` exists is read, not run again (run it again after an interruption: an arm
stopped before its eval runs again whole, its folder removed first);
``<out>/study.json`` is rewritten after each arm. An arm the trainer refuses for the model (exit 2, one line:
``nvfp4_qat=serving`` on routed experts) is left out and named in study.json's ``refused``. Prints one table: per arm the mean and spread (max - min) over
seeds of each served loss, its W4A4 minus its own bf16, and its W4A4 minus PTQ's (the ``bf16`` arm's) W4A4 paired
by seed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

MODES = ("bf16", "nvfp4-w4a16", "nvfp4-w4a4")


class Refused(Exception):
  """An arm the trainer refuses for this model (exit 2 and its one-line reason), e.g. nvfp4_qat=serving on routed
  experts: the study goes on without it."""


def _run(cmd: list[str], log: str) -> None:
  with open(log, "w", encoding="utf-8") as f:
    rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
  if rc == 2:
    with open(log, encoding="utf-8") as f:
      raise Refused(([l.strip() for l in f if l.strip()] or ["(no output)"])[-1])
  if rc != 0:
    raise SystemExit(f"qat_study: {' '.join(cmd)} failed (exit {rc}); see {log}")


def arm(name: str, seed: int, steps: int, out: str, eval_batches: int, family: str = "dense") -> dict:
  run = f"{name}_s{seed}"
  m = "" if family == "dense" else f"{family}_"  # sft_demo_moe_nvfp4, distill_demo_moe_nvfp4, ...
  common = [f"run_name={run}", f"base_output_directory={out}", f"metrics_file={out}/{run}.jsonl", f"steps={steps}",
            f"data_shuffle_seed={seed}"]
  if name == "bf16":
    cmd = [sys.executable, "-m", "maxtext_nvfp4.sft", f"sft_demo_{m}bf16", *common]
  elif name == "qad":
    cmd = [sys.executable, "-m", "maxtext_nvfp4.distill", f"distill_demo_{m}nvfp4", *common, f"nvfp4_seed={seed}"]
  elif name == "kd_bf16":  # QAD's control: the same distillation with a bf16 student, then PTQ
    cmd = [sys.executable, "-m", "maxtext_nvfp4.distill", f"distill_demo_{m}nvfp4", *common, "quantization="]
  else:
    cmd = [sys.executable, "-m", "maxtext_nvfp4.sft", f"sft_demo_{m}nvfp4", *common, f"nvfp4_qat={name}",
           f"nvfp4_seed={seed}"]
  result = f"{out}/{run}.eval.json"
  if os.path.exists(result):
    with open(result, encoding="utf-8") as f:
      return json.load(f)["losses"]
  if os.path.isdir(f"{out}/{run}"):  # an arm stopped before its eval: MaxText would resume its checkpoints
    shutil.rmtree(f"{out}/{run}")     # instead of starting from the pre-trained one, so it runs again whole
  _run(cmd, f"{out}/{run}.train.log")
  _run([sys.executable, "-m", "maxtext_nvfp4.tools.cli", "eval-quantized", f"{out}/{run}/checkpoints",
        *[a for m in MODES for a in ("--mode", m)], "--eval-batches", str(eval_batches), "--json", result],
       f"{out}/{run}.eval.log")
  with open(result, encoding="utf-8") as f:
    return json.load(f)["losses"]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--arms", nargs="+", default=["bf16", "full", "forward", "serving"])
  p.add_argument("--out", default=os.path.join("runs", "qat_study"))
  p.add_argument("--eval-batches", type=int, default=8)
  p.add_argument("--family", choices=("dense", "moe"), default="dense",
                 help="dense: the sft_demo_* / distill_demo_nvfp4 recipes from runs/demo_bf16; moe: sft_demo_moe_* /"
                      " distill_demo_moe_nvfp4 from runs/demo_moe_bf16")
  args = p.parse_args(argv)
  out = os.path.abspath(args.out)
  os.makedirs(out, exist_ok=True)
  losses: dict = {a: {} for a in args.arms}
  refused: dict = {}
  for seed in args.seeds:  # seed by seed: an interrupted study has whole seeds
    for a in [a for a in args.arms if a not in refused]:
      try:
        losses[a][seed] = arm(a, seed, args.steps, out, args.eval_batches, args.family)
      except Refused as e:
        refused[a] = str(e)
        losses.pop(a)
        print(f"qat_study: arm {a} refused for this model, left out: {e}", file=sys.stderr)
      with open(os.path.join(out, "study.json"), "w", encoding="utf-8") as f:
        json.dump({"steps": args.steps, "seeds": args.seeds, "losses": losses, "refused": refused}, f, indent=1)
  print(table(losses, args.seeds, args.steps))
  return 0


def table(losses: dict, seeds: list[int], steps: int) -> str:
  """The study's table (module docstring); the PTQ column needs the ``bf16`` arm."""
  ptq = losses.get("bf16")
  lines = [f"eval loss (mean over seeds {seeds}; spread = max - min), {steps} SFT steps",
           f"{'arm':<10}" + "".join(f"{m:>22}" for m in MODES) + f"{'W4A4 - own bf16':>18}{'W4A4 - PTQ W4A4':>30}"]
  for a, per_seed in losses.items():
    cells = []
    for m in MODES:
      v = [per_seed[s][m] for s in seeds]
      cells.append(f"{statistics.mean(v):>14.4f} ±{max(v) - min(v):>6.4f}")
    gap = [per_seed[s]["nvfp4-w4a4"] - per_seed[s]["bf16"] for s in seeds]
    vs_ptq = ""
    if ptq is not None:
      d = [per_seed[s]["nvfp4-w4a4"] - ptq[s]["nvfp4-w4a4"] for s in seeds]
      vs_ptq = f"{statistics.mean(d):+.4f} [{min(d):+.4f}, {max(d):+.4f}]"
    lines.append(f"{a:<10}" + "".join(f"{c:>22}" for c in cells) + f"{statistics.mean(gap):>+18.4f}{vs_ptq:>30}")
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
