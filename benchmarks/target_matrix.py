"""The target matrix: what nvfp4 costs against bf16 on each accelerator, compiled on a CPU host (no accelerator).

    JAX_PLATFORMS=cpu python benchmarks/target_matrix.py [--targets all|a100,tpu-v5e,...] [--parts quant,mlp,step]
                                                         [--json F]

For each target of ``compile_targets.TARGETS`` (GPUs: XLA's vendored target specs; TPUs: libtpu's compile-only
chips, ``scripts/setup_targets.sh``) it compiles, each against its bf16 counterpart on the same target:

    quant   the six quantizer calls of the GEMM recipe at 8192x4096 bf16 (``deviceless.PROGRAMS["quant_*"]``)
            against a copy (``-x``: 4.00 B per element, one kernel)
    mlp     the SwiGLU MLP fwd+bwd, T=8192 D=4096 F=14336, nvfp4 full recipe against bf16 (``mlp_bench``)
    step    MaxText's train step of the CPU demo's tiny model (recipes/demo_*.yml, synthetic data), nvfp4
            (emulated, full recipe) against bf16 (``gpu/maxtext_step.py``; on a TPU through MaxText's own
            train_compile mesh and options); each compile in its own process

and prints kernels, non-GEMM GiB (``hlo_traffic``: operand + output bytes per kernel), compiled memory
(``memory_analysis()``: argument + output + temp - alias) and compile seconds on this CPU, with the nvfp4 / bf16
ratio of each. Everything is **compile-derived** (no autotuning, no device): it says what the target's compiler
makes of the programs, not how fast they run; compile seconds are this host's and move with its load. A target
whose compiler is missing gets one line saying which package to install (exit status 2; 1 when a compile failed).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(_HERE)
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(_HERE, "gpu"))
sys.path.insert(0, ROOT)

import compile_targets  # noqa: E402  pylint: disable=wrong-import-position

PARTS = ("quant", "mlp", "step")
QUANT_CASES = ("q1d", "q2d", "qrht", "v1d", "v1d_sr", "v0_rht_sr")
STEP_PROGRAMS = ("step_demo_bf16", "step_demo_nvfp4")
_KEEP = ("compile_s", "gemm_kernels", "gemm_gib", "other_kernels", "other_gib", "temp_mib", "total_mib",
         "bytes_per_element", "full_writes", "f32_temps", "lower_s", "devices", "error")


def _compile_program(name: str, target: str) -> dict:
  import deviceless  # pylint: disable=import-outside-toplevel

  try:
    row = deviceless.run_program(name, spec=target)
  except Exception as e:  # pylint: disable=broad-except
    return dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
  return {k: row[k] for k in _KEEP if k in row}


def _compile_steps(target: str, timeout: float) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "rows.jsonl")
    subprocess.run([sys.executable, os.path.join(_HERE, "gpu", "maxtext_step.py"), "--target", target,
                    "--programs", ",".join(STEP_PROGRAMS), "--json", out, "--timeout", str(timeout)],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
    rows = {}
    if os.path.exists(out):
      with open(out) as fh:
        rows = {r["program"]: r for r in map(json.loads, fh)}
  return {p: {k: v for k, v in rows.get(p, dict(error="no row")).items() if k in _KEEP} for p in STEP_PROGRAMS}


def run_target_isolated(name: str, parts=PARTS, step_timeout: float = 1800) -> dict:
  """``run_target`` in a child process: each target's compilers (libtpu, XLA:GPU) and their memory live and die
  with it (a parent holding libtpu and several GiB once made a TPU step's compile crash, 2026-12-05)."""
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "target.json")
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--targets", name, "--parts", ",".join(parts),
                        "--step-timeout", str(step_timeout), "--json", out, "--in-process"], check=False)
    if not os.path.exists(out):
      return {"target": dict(error=f"the target's process exited with status {r.returncode} and no rows")}
    with open(out) as fh:
      return json.load(fh)["targets"][name]


def run_target(name: str, parts=PARTS, step_timeout: float = 1800) -> dict:
  """Every program of ``parts`` compiled for target ``name``: {program: counts or {"error": ...}}, or
  {"unavailable": reason} when this environment cannot compile for it."""
  reason = compile_targets.unavailable_reason(name)
  if reason:
    return dict(unavailable=reason)
  programs = {}
  names = (["quant_copy"] + [f"quant_{c}" for c in QUANT_CASES] if "quant" in parts else []) + (
      ["mlp_bf16", "mlp_nvfp4"] if "mlp" in parts else [])
  for program in names:
    programs[program] = _compile_program(program, name)
    print(f"  {name} {program}: {json.dumps(programs[program])}", flush=True)
  if "step" in parts:
    for program, row in _compile_steps(name, step_timeout).items():
      programs[program] = row
      print(f"  {name} {program}: {json.dumps(row)}", flush=True)
  return programs


def _ratio(a, b) -> str:
  return f"{a / b:.2f}x" if a is not None and b else "-"


def _pair(programs: dict, nvfp4: str, bf16: str, key: str, fmt: str) -> str:
  n, b = programs.get(nvfp4, {}), programs.get(bf16, {})
  if key not in n or key not in b:
    return "failed" if ("error" in n or "error" in b) else "-"
  return f"{n[key]:{fmt}} / {b[key]:{fmt}} ({_ratio(n[key], b[key])})"


def table(results: dict) -> str:
  """The matrix: one row per target and program pair (nvfp4 / bf16 (ratio)); quantizers against a copy."""
  lines = ["| target | program | non-GEMM kernels | non-GEMM GiB | memory MiB | compile s |", "|---|---|---|---|---|---|"]
  for name, programs in results.items():
    if "unavailable" in programs:
      lines.append(f"| {name} | not compiled: {programs['unavailable']} |||||")
      continue
    quants = [programs[f"quant_{c}"] for c in QUANT_CASES if f"quant_{c}" in programs]
    if quants:
      ok = [q for q in quants if "error" not in q]
      failed = len(quants) - len(ok)
      copy = programs.get("quant_copy", {})
      b_el = (f"{min(q['bytes_per_element'] for q in ok):.2f}-{max(q['bytes_per_element'] for q in ok):.2f}"
              f" B/el (copy {copy.get('bytes_per_element', 0):.2f})") if ok else "-"
      lines.append(f"| {name} | 6 quantizer calls 8192x4096{f' ({failed} failed)' if failed else ''} |"
                   f" {min(q['other_kernels'] for q in ok) if ok else '-'}-{max(q['other_kernels'] for q in ok) if ok else '-'}"
                   f" (copy {copy.get('other_kernels', '-')}) | {b_el} |"
                   f" temp <= {max(q['temp_mib'] for q in ok) if ok else 0:.0f} |"
                   f" {min(q['compile_s'] for q in ok) if ok else 0:.0f}-{max(q['compile_s'] for q in ok) if ok else 0:.0f} |")
    for what, nv, bf in (("MLP fwd+bwd 8192x4096x14336", "mlp_nvfp4", "mlp_bf16"),
                         ("MaxText step, demo model", "step_demo_nvfp4", "step_demo_bf16")):
      if nv not in programs:
        continue
      errors = [programs.get(p, {}).get("error") for p in (nv, bf)]
      if any(errors):
        lines.append(f"| {name} | {what} | failed: {next(e for e in errors if e)[:160]} ||||")
        continue
      kernels = _pair(programs, nv, bf, "other_kernels", "d")
      lines.append(f"| {name} | {what} | {kernels} | {_pair(programs, nv, bf, 'other_gib', '.2f')} |"
                   f" {_pair(programs, nv, bf, 'total_mib', '.0f')} | {_pair(programs, nv, bf, 'compile_s', '.1f')} |")
  return "\n".join(lines)


def _environment() -> dict:
  import jax  # pylint: disable=import-outside-toplevel

  def version(pkg):
    try:
      return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
      return None

  commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=False).stdout.strip()
  return dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=commit,
              host=f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs", jax=jax.__version__,
              jax_cuda12_plugin=version("jax-cuda12-plugin"), libtpu=version("libtpu"),
              load_average=os.getloadavg())


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--targets", default="all", help=f"'all' or a comma list of {tuple(compile_targets.TARGETS)}")
  p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {PARTS}")
  p.add_argument("--json", help="write the environment and every row here")
  p.add_argument("--step-timeout", type=float, default=1800, help="seconds per MaxText step compile")
  p.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)  # the child of run_target_isolated
  p.add_argument("--table", nargs="+", metavar="JSON", help="compile nothing: print the table of these --json files"
                 " (a later file's rows replace an earlier one's for the same target and program)")
  a = p.parse_args(argv)
  if a.table:
    merged = {}
    for path in a.table:
      with open(path) as fh:
        for name, programs in json.load(fh)["targets"].items():
          merged.setdefault(name, {}).update(programs)
    print(table(merged))
    return 0
  names = list(compile_targets.TARGETS) if a.targets == "all" else a.targets.split(",")
  parts = a.parts.split(",")
  bad = [n for n in names if n not in compile_targets.TARGETS] + [x for x in parts if x not in PARTS]
  if bad:
    print(f"target_matrix.py: unknown {', '.join(bad)}: targets {tuple(compile_targets.TARGETS)}, parts {PARTS}",
          file=sys.stderr)
    return 2
  import deviceless  # pylint: disable=import-outside-toplevel

  env = _environment()
  if not a.in_process:
    print(f"{deviceless.HEADLINE}; {json.dumps(env)}", flush=True)
  results = {}
  for name in names:
    if a.in_process:
      results[name] = run_target(name, parts, a.step_timeout)
    else:
      print(f"{name}: {compile_targets.TARGETS[name].chip}", flush=True)
      results[name] = run_target_isolated(name, parts, a.step_timeout)
    if a.json:  # after every target: a long run killed midway keeps what it compiled
      with open(a.json, "w") as fh:
        json.dump(dict(headline=deviceless.HEADLINE, environment=env, targets=results), fh, indent=1)
  if a.in_process:
    return 0
  print(table(results))
  failed = [n for n, r in results.items() if any("error" in row for row in r.values() if isinstance(row, dict))]
  return 1 if failed else 2 if any("unavailable" in r for r in results.values()) else 0


if __name__ == "__main__":
  sys.exit(main())
