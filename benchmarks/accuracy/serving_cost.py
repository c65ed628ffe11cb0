"""What NVFP4 serving costs models trained in BF16, FP8 and NVFP4 (CPU demo; issues 19 and 26).

    cost(family, trained, mode, seed) = eval_loss(checkpoint, mode) - eval_loss(checkpoint, bf16)

where ``checkpoint`` is the CPU demo of ``family`` trained in precision ``trained`` from initial weights
``init_weights_seed = seed`` (the data order is the recipe's, the same for every run) for its 120 steps,
checkpointed at the last step, and ``eval_loss(., mode)`` is ``maxtext-nvfp4 eval-quantized --quantize all``:
the forward-only eval loss with every decoder linear (MoE experts included, routers never) served in bf16,
NVFP4 W4A16, NVFP4 W4A4 (per-token activation quantization) or FP8.

Families (:data:`FAMILIES`; ``--families``): ``llama2`` (demo_bf16 / demo_nvfp4, and fp8 = demo_bf16 with
MaxText's ``quantization=fp8``), ``moe`` (demo_moe_*: mixtral block, 4 experts top-2) and ``qwen3``
(demo_qwen3_*: QK-norm block), the last two trained in bf16 and nvfp4. Prints a markdown table of the serving
cost per family and trained precision: mean over seeds, and each seed's value.

Run from the checkout, after ``maxtext-nvfp4 prepare-data``:
``python benchmarks/accuracy/serving_cost.py --out runs/serving_cost [--families llama2 moe qwen3] [--seeds 0 1 2]``.
Finished runs (checkpoint and eval JSON present) are reused; llama2's run names (``{arm}_s{seed}``) are the
ones of the first table (RESULTS.md), the other families' are ``{family}_{arm}_s{seed}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys


@dataclasses.dataclass(frozen=True, kw_only=True)
class Arm:
  """One trained precision of one family."""

  # the recipe trained and evaluated (recipes/<recipe>.yml)
  recipe: str
  # extra key=value arguments of the training (the eval reads the same recipe)
  extra: tuple[str, ...] = ()


FAMILIES: dict[str, dict[str, Arm]] = {
    "llama2": {"bf16": Arm(recipe="demo_bf16"), "fp8": Arm(recipe="demo_bf16", extra=("quantization=fp8",)),
               "nvfp4": Arm(recipe="demo_nvfp4")},
    "moe": {"bf16": Arm(recipe="demo_moe_bf16"), "nvfp4": Arm(recipe="demo_moe_nvfp4")},
    "qwen3": {"bf16": Arm(recipe="demo_qwen3_bf16"), "nvfp4": Arm(recipe="demo_qwen3_nvfp4")},
}
MODES = ("bf16", "nvfp4-w4a16", "nvfp4-w4a4", "fp8")
LAST_STEP = 119  # the demo recipes train 120 steps


def run_name(family: str, arm: str, seed: int) -> str:
  """``{arm}_s{seed}`` for llama2 (the first table's runs), else ``{family}_{arm}_s{seed}``."""
  return f"{arm}_s{seed}" if family == "llama2" else f"{family}_{arm}_s{seed}"


def run(out: str, family: str, arm: str, seed: int) -> dict:
  spec = FAMILIES[family][arm]
  name = run_name(family, arm, seed)
  ckpt = os.path.join(out, name, "checkpoints")
  result = os.path.join(out, f"{name}.eval.json")
  env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "HF_HUB_OFFLINE": "1"}
  if not os.path.isdir(os.path.join(ckpt, str(LAST_STEP))):
    with open(os.path.join(out, f"{name}.train.log"), "w", encoding="utf-8") as log:
      subprocess.run([sys.executable, "-m", "maxtext_nvfp4.train", spec.recipe, *spec.extra, f"run_name={name}",
                      f"init_weights_seed={seed}", "enable_checkpointing=true", "async_checkpointing=false",
                      f"checkpoint_period={LAST_STEP}", f"base_output_directory={os.path.abspath(out)}",
                      f"metrics_file={os.path.join(out, name + '.jsonl')}"],
                     stdout=log, stderr=subprocess.STDOUT, env=env, check=True)
  if not os.path.isfile(result):
    with open(os.path.join(out, f"{name}.eval.log"), "w", encoding="utf-8") as log:
      subprocess.run([sys.executable, "-m", "maxtext_nvfp4", "eval-quantized", ckpt, "--config", spec.recipe,
                      "--quantize", "all", "--json", result], stdout=log, stderr=subprocess.STDOUT, env=env,
                     check=True)
  with open(result, encoding="utf-8") as f:
    return json.load(f)


def table(results: dict[tuple[str, str, int], dict]) -> str:
  """Markdown: one row per (family, trained precision) present in ``results``."""
  seeds = sorted({s for _, _, s in results})
  lines = ["| model | trained in | served linears | eval loss served bf16 (mean) | "
           + " | ".join(f"{m} cost (mean; per seed)" for m in MODES[1:]) + " |", "|---" * (len(MODES) + 3) + "|"]
  for family, arms in FAMILIES.items():
    for arm in arms:
      rows = [results[(family, arm, s)] for s in seeds if (family, arm, s) in results]
      if not rows:
        continue
      cells = [family, arm, str(rows[0].get("served_linears", "")),
               f"{statistics.mean(r['losses']['bf16'] for r in rows):.4f}"]
      for mode in MODES[1:]:
        d = [r["delta_vs_bf16"][mode] for r in rows]
        cells.append(f"{statistics.mean(d):+.4f} ({', '.join(f'{x:+.4f}' for x in d)})")
      lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  p.add_argument("--out", default="runs/serving_cost")
  p.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
  p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  a = p.parse_args(argv)
  os.makedirs(a.out, exist_ok=True)
  results = {}
  for family in a.families:
    for seed in a.seeds:
      for arm in FAMILIES[family]:
        results[(family, arm, seed)] = run(a.out, family, arm, seed)
        print(f"done {family} {arm} seed {seed}", flush=True)
  print(table(results))
  return 0


if __name__ == "__main__":
  sys.exit(main())
