"""What NVFP4 serving costs models trained in BF16, FP8 and NVFP4 (CPU demo; issue 19's question).

For each trained precision (bf16 = demo_bf16, fp8 = demo_bf16 with MaxText's quantization=fp8, nvfp4 =
demo_nvfp4, TE's full recipe emulated) and seed (``init_weights_seed``: the initial weights; the data order
is the recipe's, the same for every run), train the CPU demo for its 120 steps with a checkpoint at the
last step, then ``maxtext-nvfp4 eval-quantized --quantize all``: the forward-only eval loss with every
decoder linear served in bf16, NVFP4 W4A16, NVFP4 W4A4 (per-token activation quantization) and FP8.
Prints a markdown table of the serving cost (eval loss in a mode minus the same checkpoint served in bf16)
per trained precision: mean over seeds, and each seed's value.

Run from the checkout, after ``maxtext-nvfp4 prepare-data``:
``python benchmarks/accuracy/serving_cost.py --out runs/serving_cost [--seeds 0 1 2]``.
Finished runs (checkpoint and eval JSON present) are reused.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

ARMS = {"bf16": ("demo_bf16", []), "fp8": ("demo_bf16", ["quantization=fp8"]), "nvfp4": ("demo_nvfp4", [])}
MODES = ("bf16", "nvfp4-w4a16", "nvfp4-w4a4", "fp8")
LAST_STEP = 119  # the demo recipes train 120 steps


def run(out: str, arm: str, seed: int) -> dict:
  recipe, extra = ARMS[arm]
  name = f"{arm}_s{seed}"
  ckpt = os.path.join(out, name, "checkpoints")
  result = os.path.join(out, f"{name}.eval.json")
  env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "HF_HUB_OFFLINE": "1"}
  if not os.path.isdir(os.path.join(ckpt, str(LAST_STEP))):
    with open(os.path.join(out, f"{name}.train.log"), "w", encoding="utf-8") as log:
      subprocess.run([sys.executable, "-m", "maxtext_nvfp4.train", recipe, *extra, f"run_name={name}",
                      f"init_weights_seed={seed}", "enable_checkpointing=true", "async_checkpointing=false",
                      f"checkpoint_period={LAST_STEP}", f"base_output_directory={os.path.abspath(out)}",
                      f"metrics_file={os.path.join(out, name + '.jsonl')}"],
                     stdout=log, stderr=subprocess.STDOUT, env=env, check=True)
  if not os.path.isfile(result):
    with open(os.path.join(out, f"{name}.eval.log"), "w", encoding="utf-8") as log:
      subprocess.run([sys.executable, "-m", "maxtext_nvfp4", "eval-quantized", ckpt, "--config", recipe,
                      "--quantize", "all", "--json", result], stdout=log, stderr=subprocess.STDOUT, env=env,
                     check=True)
  with open(result, encoding="utf-8") as f:
    return json.load(f)


def table(results: dict[tuple[str, int], dict]) -> str:
  seeds = sorted({s for _, s in results})
  lines = ["| trained in | eval loss served bf16 (mean) | " + " | ".join(f"{m} cost (mean; per seed)" for m in MODES[1:])
           + " |", "|---" * (len(MODES) + 1) + "|"]
  for arm in ARMS:
    rows = [results[(arm, s)] for s in seeds if (arm, s) in results]
    if not rows:
      continue
    cells = [arm, f"{statistics.mean(r['losses']['bf16'] for r in rows):.4f}"]
    for mode in MODES[1:]:
      d = [r["delta_vs_bf16"][mode] for r in rows]
      cells.append(f"{statistics.mean(d):+.4f} ({', '.join(f'{x:+.4f}' for x in d)})")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--out", default="runs/serving_cost")
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  a = p.parse_args(argv)
  os.makedirs(a.out, exist_ok=True)
  results = {}
  for seed in a.seeds:
    for arm in ARMS:
      results[(arm, seed)] = run(a.out, arm, seed)
      print(f"done {arm} seed {seed}", flush=True)
  print(table(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
