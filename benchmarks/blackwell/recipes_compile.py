"""The Blackwell recipes compiled at their full size for their target, on a CPU host: memory, compile time, TE calls.

    source scripts/te_env.sh   # .venv-targets: real Transformer Engine JAX, XLA:GPU's compile-only plugin
    .venv-targets/bin/python benchmarks/blackwell/recipes_compile.py \\
        --recipes llama3_8b_bf16,llama3_8b_fp8,llama3_8b_nvfp4 --topology b200-4 [--set key=value ...] [--json F]

Each recipe is compiled by :func:`maxtext_nvfp4.integration.aot_compile.compile_train_step` (MaxText's own
ahead-of-time path, compile-only devices of the target's XLA spec, real TE with its device queries answered for the
target; ``attention: cudnn_flash_te`` gets cuDNN's F16 arbitrary-sequence backend and a workspace of
``te_compile_only.FUSED_ATTN_WORKSPACE_BYTES``), each in its own process (one compile's memory and caches do not
reach the next). Per recipe: the step's memory per device from XLA's ``memory_analysis()`` against the target's
HBM, lower / compile seconds and the peak host memory of the process, TE GEMMs by scaling mode and TE quantize
calls. **Compile-derived**: nothing runs; the figures are XLA's plan for the target.

XLA compiles with the flags the recipes' launcher sets (``recipes/launch/slurm_nvfp4.sbatch``: JAX-Toolbox's
collective combine thresholds, pipelined collectives, no rematerialization pass, ...) unless ``--no-launch-flags``;
a step fits when its memory is within the launcher's ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the target's HBM (the
memory JAX's allocator takes; 0.75 when unset).
"""

from __future__ import annotations

import argparse
import collections
import shlex
import os
import re
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "te"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import child_rows  # pylint: disable=wrong-import-position


LAUNCHER = os.path.join(ROOT, "maxtext_nvfp4", "recipes", "launch", "slurm_nvfp4.sbatch")


def launcher_environment() -> dict[str, str]:
  """``XLA_FLAGS`` and ``XLA_PYTHON_CLIENT_MEM_FRACTION`` as the recipes' launcher sets them (read from it)."""
  text = open(LAUNCHER, encoding="utf-8").read()
  flags = re.search(r'export XLA_FLAGS="\$\{XLA_FLAGS:-\} (.*?)"', text, flags=re.S)
  fraction = re.search(r"XLA_PYTHON_CLIENT_MEM_FRACTION:-([0-9.]+)", text)
  return {"XLA_FLAGS": " ".join(shlex.split(flags.group(1))) if flags else "",
          "XLA_PYTHON_CLIENT_MEM_FRACTION": fraction.group(1) if fraction else "0.75"}


def _scaling_names() -> dict[int, str]:
  try:
    import transformer_engine_jax as tej  # pylint: disable=import-outside-toplevel # pytype: disable=import-error
  except ImportError:
    return {}
  m = tej.JAXX_Scaling_Mode
  return {int(m.NVFP4_1D_SCALING): "nvfp4", int(m.NVFP4_2D_SCALING): "nvfp4_2d",
          int(m.CURRENT_TENSOR_SCALING): "fp8_current", int(m.DELAYED_TENSOR_SCALING): "fp8_delayed",
          int(m.MXFP8_1D_SCALING): "mxfp8", int(m.NO_SCALING): "none"}


def compile_one(recipe: str, topology: str, overrides: list[str]) -> dict:
  """Compile ``recipe`` for ``topology`` in this process and describe the result (the module docstring)."""
  import te_program  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.backends import targets  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import aot_compile  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import recipes  # pylint: disable=import-outside-toplevel

  argv = [None, recipes.find_recipe(recipe), f"compile_topology={topology}", "compile_topology_num_slices=1", *overrides]
  t0 = time.time()
  step = aot_compile.compile_train_step(argv)
  text = step.compiled.as_text()
  names = _scaling_names()
  gemms = collections.Counter(names.get(c.config.get("scaling_mode"), str(c.config.get("scaling_mode")))
                              for c in te_program.calls(text) if c.target == "te_gemm_v2_ffi")
  calls = te_program.counts(text)
  mem = step.compiled.memory_analysis()
  gib = 2.0 ** 30
  name = targets.parse_topology(topology)[0]
  hbm = targets.memory_bytes(name)
  fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
  total = mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes - mem.alias_size_in_bytes
  return dict(recipe=recipe, topology=topology, overrides=overrides, backend=step.backend,
              quantization=str(step.config.quantization), layers=int(step.config.num_decoder_layers),
              attention=str(step.config.attention), mesh={k: v for k, v in step.mesh.items() if v > 1},
              lower_s=step.lower_s, compile_s=step.compile_s, wall_s=round(time.time() - t0, 1),
              host_peak_gib=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
              argument_gib=round(mem.argument_size_in_bytes / gib, 2), output_gib=round(mem.output_size_in_bytes / gib, 2),
              temp_gib=round(mem.temp_size_in_bytes / gib, 2), alias_gib=round(mem.alias_size_in_bytes / gib, 2),
              total_gib=round(total / gib, 2), hbm_gib=round(hbm / gib, 1) if hbm else None, mem_fraction=fraction,
              usable_gib=round(fraction * hbm / gib, 1) if hbm else None, fits=bool(hbm and total <= fraction * hbm),
              xla_flags=os.environ.get("XLA_FLAGS", ""), te_gemms=dict(gemms), te_quantize=calls.get("te_dbias_quantize_ffi", 0),
              te_rht_amax=calls.get("te_rht_amax_ffi", 0), te_fused_attn=sum(v for k, v in calls.items() if "fused_attn" in k))


def table(rows: list[dict]) -> str:
  lines = ["| recipe | topology | layers | mesh | per-device GiB (temp) | usable GiB (HBM x fraction) | fits | TE GEMMs |"
           " TE quantize | compile s | host peak GiB |", "|---|---|---:|---|---:|---:|---|---|---:|---:|---:|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['recipe']} | {r['topology']} | | | failed: {r['error']} |||||||")
      continue
    mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items()) or "1"
    gemms = ", ".join(f"{v} {k}" for k, v in sorted(r["te_gemms"].items())) or "none"
    lines.append(f"| {r['recipe']} | {r['topology']} | {r['layers']} | {mesh} | {r['total_gib']:.1f} ({r['temp_gib']:.1f})"
                 f" | {r.get('usable_gib')} ({r['hbm_gib']} x {r.get('mem_fraction')}) | {'yes' if r['fits'] else 'NO'} | {gemms} | {r['te_quantize']} | {r['compile_s']}"
                 f" | {r['host_peak_gib']} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--recipes", default="llama3_8b_bf16,llama3_8b_fp8,llama3_8b_nvfp4")
  p.add_argument("--topology", default="b200-4")
  p.add_argument("--set", action="append", default=[], help="key=value override for every recipe")
  p.add_argument("--json", help="write the rows here (JSON list)")
  p.add_argument("--no-launch-flags", action="store_true", help="compile with XLA's defaults, not the launcher's flags")
  p.add_argument("--one", help=argparse.SUPPRESS)  # internal: compile this recipe in this process
  args = p.parse_args(argv)
  if args.one:
    child_rows.emit(compile_one(args.one, args.topology, args.set))
    return 0
  env = dict(os.environ)
  if not args.no_launch_flags:
    env.update(launcher_environment())

  def row_of(recipe: str, run: child_rows.ChildRun) -> dict:
    if run.row is not None:
      return run.row
    lines = [l for l in run.stderr.strip().splitlines() if l.strip()]
    err = [l for l in lines if "Error" in l.split(":", 1)[0] or l.startswith("E ")][-1:] or lines[-1:] or [
        f"exit {run.returncode}"]
    killed = f"killed by signal {-run.returncode}" if run.returncode < 0 else f"exit {run.returncode}"
    return dict(recipe=recipe, topology=args.topology, error=f"{killed}: {err[0][:300]}")

  rows = child_rows.collect(
      __file__, args.recipes.split(","),
      lambda recipe: ["--one", recipe, "--topology", args.topology, *(a for kv in args.set for a in ("--set", kv))],
      row_of, env=env, json_list=args.json)
  print("compile-derived (XLA's plan for the target; nothing ran):")
  print(table(rows))
  return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
