"""``maxtext-nvfp4 reproduce PAIR``: train a baseline recipe and its NVFP4 twin back to back, then compare.

Both runs are ``python -m maxtext_nvfp4.train RECIPE.yml key=value ...`` subprocesses with the same
``init_weights_seed`` and ``data_shuffle_seed`` (so the same initial weights and the same batches in the
same order), each writing its own MaxText ``metrics_file``; then ``compare`` writes the report and plots
into ``OUT/compare``. Progress is streamed as one ``[label] step N/STEPS loss L (T s)`` line per step
(parsed from MaxText's ``completed step: ...`` log lines; ``--verbose`` echoes everything).

Scaling knobs (applied identically to both runs): ``--steps`` -> ``steps``, ``--layers`` ->
``base_num_decoder_layers`` (+ ``override_model_config=true`` so it beats a model YAML), ``--seq`` ->
``max_target_length``, ``--batch`` -> ``per_device_batch_size``, plus free ``key=value`` overrides. For a
pair that reproduces a published configuration, any of them makes the report say
"PROXY (not the published configuration)".

Exit code: compare's (0 PASS, 1 FAIL), 2 bad input (unknown pair, missing recipe, existing run
directory), 3 a training run failed without leaving metrics.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from maxtext_nvfp4.tools import cli as cli_mod
from maxtext_nvfp4.tools import cliargs
from maxtext_nvfp4.tools import compare
from maxtext_nvfp4.tools import metrics as metrics_io  # (`metrics` names files here)
from maxtext_nvfp4.tools import recipes as recipes_mod


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pair:
  """A baseline/NVFP4 recipe pair."""

  # Pair name on the command line.
  name: str
  # Recipe file names (looked up in the recipes directory).
  baseline_recipe: str
  nvfp4_recipe: str
  # Short run label of the baseline (the NVFP4 run is labelled "nvfp4").
  baseline_label: str
  # True when the recipes reproduce a published configuration (then any knob makes a PROXY).
  published: bool
  # One line for the report.
  description: str


PAIRS: dict[str, Pair] = {p.name: p for p in (
    Pair(name="demo", baseline_recipe="demo_bf16.yml", nvfp4_recipe="demo_nvfp4.yml", baseline_label="bf16",
         published=False, description="CPU demo: tiny Llama-style model, bf16 vs emulated NVFP4"),
    Pair(name="llama3_8b", baseline_recipe="llama3_8b_fp8.yml", nvfp4_recipe="llama3_8b_nvfp4.yml",
         baseline_label="fp8", published=True,
         description="Llama 3 8B throughput setup (4 GPUs FSDP 4, seq 8192, pdbs 4), FP8 vs NVFP4"),
    Pair(name="llama3_8b_c4", baseline_recipe="llama3_8b_fp8_c4.yml", nvfp4_recipe="llama3_8b_nvfp4_c4.yml",
         baseline_label="fp8", published=True,
         description="Llama 3 8B 10,000-step C4 convergence pair, FP8 vs NVFP4 (published gap +0.026)"),
    Pair(name="proxy_1gpu", baseline_recipe="proxy_1gpu_fp8.yml", nvfp4_recipe="proxy_1gpu_nvfp4.yml",
         baseline_label="fp8", published=False,
         description="single-GPU proxy (small Llama fitting one H100/H200), FP8 vs NVFP4"),
    Pair(name="demo_moe", baseline_recipe="demo_moe_bf16.yml", nvfp4_recipe="demo_moe_nvfp4.yml",
         baseline_label="bf16", published=False,
         description="CPU MoE demo: tiny Mixtral-style model, bf16 vs emulated NVFP4 (experts per expert)"),
    Pair(name="proxy_1gpu_moe", baseline_recipe="proxy_1gpu_moe_fp8.yml", nvfp4_recipe="proxy_1gpu_moe_nvfp4.yml",
         baseline_label="fp8", published=False,
         description="single-GPU MoE proxy (Mixtral-style ~1.1B, 8 experts top-2, one H100/H200), FP8 vs NVFP4"),
)}

TRAIN_MODULE = "maxtext_nvfp4.train"
# MaxText's per-step INFO line (metric_logger._log_training_metrics), values printed with 3 decimals.
_STEP_RE = re.compile(r"completed step: (\d+), seconds: ([-+\w.]+),.*?[ ,]loss: ([-+\w.]+)")
_TFLOPS_RE = re.compile(r"TFLOP/s/device: ([-+\w.]+)")
_TOKENS_RE = re.compile(r"Tokens/s/device: ([-+\w.]+)")


def parse_step_line(line: str) -> dict | None:
  """A metrics record rebuilt from MaxText's ``completed step: ...`` log line (3-decimal values), or None."""
  m = _STEP_RE.search(line)
  if not m:
    return None
  try:
    rec = {"step": int(m.group(1)), metrics_io.STEP_TIME: float(m.group(2)), metrics_io.LOSS: float(m.group(3))}
    for rx, key in ((_TFLOPS_RE, metrics_io.TFLOPS_PER_SEC), (_TOKENS_RE, metrics_io.TOKENS_PER_SEC)):
      mm = rx.search(line)
      if mm:
        rec[key] = float(mm.group(1))
  except ValueError:
    return None
  rec["source"] = metrics_io.SOURCE_LOG
  return rec


class ReproduceError(ValueError):
  """Bad input for reproduce. Message: one line."""


def find_recipe(name: str, recipes_dir: str | None = None) -> Path:
  """:func:`maxtext_nvfp4.tools.recipes.find_recipe` (``--recipes-dir`` alone when given, else ./recipes
  and the packaged recipes), as a :class:`ReproduceError`."""
  try:
    return Path(recipes_mod.find_recipe(name, recipes_dir))
  except recipes_mod.RecipeError as e:
    raise ReproduceError(f"{e}{'; create it or pass --recipes-dir' if not recipes_dir else ''}") from None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Knobs:
  """Scaling knobs and overrides applied to both runs (None: the recipe's value)."""

  # steps
  steps: int | None = None
  # base_num_decoder_layers (+ override_model_config=true)
  layers: int | None = None
  # max_target_length
  seq: int | None = None
  # per_device_batch_size
  batch: float | None = None
  # free key=value overrides, in order
  overrides: tuple[str, ...] = ()

  def args(self) -> list[str]:
    out = []
    if self.steps is not None:
      out.append(f"steps={self.steps}")
    if self.layers is not None:
      out += [f"base_num_decoder_layers={self.layers}", "override_model_config=true"]
    if self.seq is not None:
      out.append(f"max_target_length={self.seq}")
    if self.batch is not None:
      out.append(f"per_device_batch_size={self.batch:g}")
    return out + list(self.overrides)

  def describe(self) -> list[str]:
    names = [("--steps", self.steps), ("--layers", self.layers), ("--seq", self.seq), ("--batch", self.batch)]
    return [f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in names if v is not None] + \
        list(self.overrides)


def report_label(pair: Pair, knobs: Knobs) -> str:
  """The line at the top of the report: published / PROXY / not-published, with the knobs used."""
  changed = knobs.describe()
  if pair.published and changed:
    return f"PROXY (not the published configuration): {pair.name} with {', '.join(changed)}"
  if pair.published:
    return f"Published configuration: {pair.description}"
  tail = f"; changed: {', '.join(changed)}" if changed else ""
  return f"{pair.name}: {pair.description} (not a published configuration){tail}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """Everything reproduce will run."""

  pair: Pair
  # (label, recipe path, argv, metrics file, run directory) per run: baseline first.
  runs: tuple[tuple[str, Path, tuple[str, ...], Path, Path], ...]
  # Output directory of compare.
  compare_dir: Path
  label: str


def build_plan(pair_name: str, *, out: str | os.PathLike, knobs: Knobs = Knobs(), seed: int = 0,
               python: str = sys.executable, recipes_dir: str | None = None) -> Plan:
  """The two training commands (same seeds, same knobs) and compare's output directory."""
  if pair_name not in PAIRS:
    raise ReproduceError(f"unknown pair {pair_name!r}; choose one of: {', '.join(PAIRS)}")
  pair = PAIRS[pair_name]
  out = Path(out).absolute()
  runs = []
  for label, recipe_name in ((pair.baseline_label, pair.baseline_recipe), ("nvfp4", pair.nvfp4_recipe)):
    recipe = find_recipe(recipe_name, recipes_dir)
    run_name = f"{pair.name}_{label}"
    metrics = out / label / "metrics.jsonl"
    argv = (python, "-m", TRAIN_MODULE, str(recipe), f"run_name={run_name}",
            f"base_output_directory={out / 'runs'}", f"metrics_file={metrics}",
            # identical initial weights and identical batches in both runs
            f"init_weights_seed={seed}", f"data_shuffle_seed={seed}", *knobs.args())
    runs.append((label, recipe, argv, metrics, out / "runs" / run_name))
  return Plan(pair=pair, runs=tuple(runs), compare_dir=out / "compare", label=report_label(pair, knobs))


def _stream(label: str, argv: Sequence[str], *, total: int | None, verbose: bool, stream,
            logged: dict[int, dict]) -> tuple[int, list[str]]:
  """Run one training subprocess, printing a compact line per completed step; returns (rc, last lines).
  ``logged`` receives the records parsed from the step log lines."""
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  tail: collections.deque[str] = collections.deque(maxlen=40)
  proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace", bufsize=1, env=env)
  try:
    for line in proc.stdout:
      line = line.rstrip("\n")
      tail.append(line)
      rec = parse_step_line(line)
      if rec is not None:
        logged[rec["step"]] = rec
      if verbose:
        print(f"[{label}] {line}", file=stream, flush=True)
      elif rec is not None:
        m = _STEP_RE.search(line)
        of = f"/{total}" if total else ""
        print(f"[{label}] step {rec['step'] + 1}{of} loss {m.group(3)} ({m.group(2)} s)", file=stream, flush=True)
    rc = proc.wait()
  except KeyboardInterrupt:
    proc.terminate()
    proc.wait()
    raise
  return rc, list(tail)


def recover_missing_steps(path: Path, logged: dict[int, dict]) -> tuple[Path, int]:
  """Rebuild training records the metrics file lost; returns (file to compare, number of steps rebuilt).

  Plain MaxText truncates ``metrics_file`` at each eval (:mod:`maxtext_nvfp4.tools.metrics`), so only
  the records since the last eval survive. Steps the log showed but the file lacks are rebuilt from the
  ``completed step`` lines (values with 3 decimals, marked ``"source": "log"``) and written with the file's
  training records and end-of-eval summaries, by step, into ``metrics_merged.jsonl`` beside it.
  """
  run = metrics_io.read(path, strict=False) if path.exists() else None
  missing = sorted(set(logged) - set(run.steps if run else ()))
  if not missing:
    return path, 0
  merged = path.with_name("metrics_merged.jsonl")
  train = {**(run.steps if run else {}), **{s: logged[s] for s in missing}}
  recs = sorted([(s, 0, r) for s, r in train.items()] + [(s, 1, r) for s, r in (run.evals if run else {}).items()],
                key=lambda x: x[:2])
  merged.write_text("".join(json.dumps(r) + "\n" for _, _, r in recs), encoding="utf8")
  return merged, len(missing)


# what reproduce writes into --out: one folder per run label (its metrics), runs/ (MaxText's), compare/
def _own_entries() -> set[str]:
  return {"runs", "compare"} | {lbl for p in PAIRS.values() for lbl in (p.baseline_label, "nvfp4")}


def check_out(plan: Plan, *, overwrite: bool) -> None:
  """Everything :func:`execute` refuses, checked before anything is deleted, created or run (the dry run asks
  it too): an ``--out`` holding files reproduce does not write, earlier runs without ``--overwrite``, a
  ``compare`` folder that is not a compare output."""
  out = plan.compare_dir.parent
  foreign = sorted(set(os.listdir(out)) - _own_entries()) if out.is_dir() else []
  if foreign:
    raise ReproduceError(f"--out {out}: the folder holds {foreign[0]} ({len(foreign)} entries reproduce does not"
                         " write); choose a new or empty --out")
  existing = [run_dir if run_dir.exists() else metrics for _, _, _, metrics, run_dir in plan.runs
              if run_dir.exists() or metrics.exists()]
  if existing and not overwrite:
    raise ReproduceError(f"{existing[0]} exists (a rerun could resume from its checkpoint); pass --overwrite or "
                         "another --out")
  try:
    if os.path.lexists(plan.compare_dir):
      compare.check_out_dir(str(plan.compare_dir))
  except compare.InputError as e:
    raise ReproduceError(str(e)) from None


def execute(plan: Plan, *, knobs: Knobs, opts: compare.Options, overwrite: bool = False, verbose: bool = False,
            plots: bool = True, stream=None) -> int:
  stream = stream or sys.stdout
  check_out(plan, overwrite=overwrite)  # a refusal leaves --out as it was
  for _, _, _, metrics, run_dir in plan.runs:  # the earlier runs, and what was made of them
    shutil.rmtree(run_dir, ignore_errors=True)
    metrics.unlink(missing_ok=True)
    metrics.with_name("metrics_merged.jsonl").unlink(missing_ok=True)
    metrics.parent.mkdir(parents=True, exist_ok=True)
  shutil.rmtree(plan.compare_dir, ignore_errors=True)
  print(plan.label, file=stream)
  run_args = []
  for i, (label, recipe, argv, metrics, _) in enumerate(plan.runs):
    print(f"[{label}] {i + 1}/{len(plan.runs)}: training {recipe.name}\n[{label}] $ {shlex.join(argv)}",
          file=stream, flush=True)
    logged: dict[int, dict] = {}
    rc, tail = _stream(label, argv, total=knobs.steps, verbose=verbose, stream=stream, logged=logged)
    has_metrics = metrics.exists() and metrics.stat().st_size > 0
    if rc != 0:
      print(f"[{label}] training exited with code {rc}; last output:\n" + "\n".join(tail), file=sys.stderr)
      if not has_metrics:
        print(f"maxtext-nvfp4 reproduce: error: the {label} run failed before writing metrics", file=sys.stderr)
        return 3
      print(f"[{label}] continuing: its metrics (e.g. up to a NaN abort) go into the comparison", file=stream)
    elif not has_metrics:
      print(f"maxtext-nvfp4 reproduce: error: the {label} run wrote no metrics to {metrics}", file=sys.stderr)
      return 3
    path, n = recover_missing_steps(metrics, logged)
    if n:
      print(f"[{label}] {n} training step(s) missing from {metrics.name} (MaxText truncates it at each eval) "
            f"rebuilt from the log into {path.name}", file=stream)
    run_args.append(f"{label}={path}")
  return compare.run_compare(run_args, out=str(plan.compare_dir), opts=opts, label=plan.label, plots=plots,
                             stream=stream)


def build_parser() -> argparse.ArgumentParser:
  p = cli_mod.ArgumentParser(
      prog="maxtext-nvfp4 reproduce",
      description="Train a named baseline/NVFP4 recipe pair back to back (same seeds and data), then compare.",
      epilog="pairs: " + "; ".join(f"{p.name}: {p.baseline_recipe} vs {p.nvfp4_recipe}" for p in PAIRS.values())
      + ". Exit code: 0 PASS, 1 FAIL, 2 bad input, 3 a training run failed.")
  p.add_argument("pair", metavar="PAIR", help=", ".join(PAIRS))
  p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="extra MaxText overrides for both runs")
  positive = cliargs.number(integer=True, at_least=1)
  p.add_argument("--steps", type=positive, help="training steps (steps=)")
  p.add_argument("--layers", type=positive,
                 help="decoder layers (base_num_decoder_layers=, override_model_config=true)")
  p.add_argument("--seq", type=positive, help="sequence length (max_target_length=)")
  p.add_argument("--batch", type=cliargs.number(above=0), help="per-device batch size (per_device_batch_size=)")
  p.add_argument("--seed", type=cliargs.number(integer=True, at_least=0), default=0,
                 help="init_weights_seed and data_shuffle_seed of both runs")
  p.add_argument("--out", help="output directory (default ./reproduce_out/PAIR)")
  p.add_argument("--recipes-dir", help="directory holding the recipe YAMLs (default: ./recipes, the package's)")
  p.add_argument("--python", default=sys.executable, help="interpreter for the training runs")
  p.add_argument("--dry-run", action="store_true", help="print the commands only")
  p.add_argument("--overwrite", action="store_true", help="delete earlier runs in --out first")
  p.add_argument("--verbose", action="store_true", help="echo the full training output")
  # compare's own ranges: a bad value is refused before hours of training, not after
  p.add_argument("--tolerance", type=cliargs.number(at_least=0), default=0.03, help="compare: max mean gap in nats")
  p.add_argument("--warmup", type=cliargs.number(integer=True, at_least=0),
                 help="compare: warm-up steps skipped after the first")
  p.add_argument("--smooth", type=cliargs.number(integer=True, at_least=1), help="compare: moving-average window")
  p.add_argument("--no-plots", action="store_true", help="compare: report.md only")
  return p


def cli_main(argv: list[str]) -> int:
  parser = build_parser()
  try:
    a = parser.parse_intermixed_args(argv)
  except SystemExit as e:
    return int(e.code or 0)
  out = a.out or os.path.join("reproduce_out", a.pair)
  bad = [o for o in a.overrides if "=" not in o or o.startswith("=")]
  problems = [  # (is wrong, what to say), checked before anything is read, run or written
      (bad, f"overrides must be KEY=VALUE: {' '.join(bad)}"),
      (a.recipes_dir and not os.path.isdir(a.recipes_dir), f"--recipes-dir {a.recipes_dir} is not a directory"),
      (os.path.lexists(out) and not os.path.isdir(out), f"--out {out} exists and is not a directory; choose another"),
  ]
  what = next((msg for wrong, msg in problems if wrong), None)
  if what:
    print(f"maxtext-nvfp4 reproduce: error: {what}", file=sys.stderr)
    return 2
  knobs = Knobs(steps=a.steps, layers=a.layers, seq=a.seq, batch=a.batch, overrides=tuple(a.overrides))
  try:
    plan = build_plan(a.pair, out=out, knobs=knobs, seed=a.seed,
                      python=a.python, recipes_dir=a.recipes_dir)
    if a.dry_run:
      check_out(plan, overwrite=a.overwrite)  # what the real run would refuse, the dry run refuses
      print(plan.label)
      for label, _, run_argv, _, _ in plan.runs:
        print(f"# {label}\n{shlex.join(run_argv)}")
      cmp = [*shlex.split(cli_mod.shell_command()), "compare"] + [f"{lbl}={m}" for lbl, _, _, m, _ in plan.runs] + \
          ["--out", str(plan.compare_dir), "--tolerance", f"{a.tolerance:g}", "--label", plan.label]
      cmp += (["--warmup", str(a.warmup)] if a.warmup is not None else []) + \
          (["--smooth", str(a.smooth)] if a.smooth is not None else []) + (["--no-plots"] if a.no_plots else [])
      print("# compare (it reads metrics_merged.jsonl instead when MaxText truncated metrics.jsonl at an eval)\n"
            + shlex.join(cmp))
      return 0
    opts = compare.Options(tolerance=a.tolerance, warmup=a.warmup, smooth=a.smooth)
    return execute(plan, knobs=knobs, opts=opts, overwrite=a.overwrite, verbose=a.verbose,
                   plots=not a.no_plots)
  except ReproduceError as e:
    print(f"maxtext-nvfp4 reproduce: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
