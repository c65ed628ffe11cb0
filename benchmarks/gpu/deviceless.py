"""Compile our programs for a GPU or TPU target on a CPU host (no accelerator) and count what XLA makes of them.

    python benchmarks/gpu/deviceless.py [--target h200|a100|h100|b200|gb200|tpu-v5e|tpu-v6e|tpu-v5p|FILE]
                                        [--programs a,b,...] [--json F] [--dump DIR]

Targets (``benchmarks/compile_targets.py``): GPUs from XLA's own ``GpuTargetConfigProto`` files, vendored in
``maxtext_nvfp4/backends/target_specs/`` (openxla/xla, commit in its README), compiled by the ``jax-cuda12-plugin`` /
``jax-cuda12-pjrt`` compile-only client at jax's version (``.venv-targets``, scripts/setup_targets.sh); a real
device's ``gpu_target_config.pbtxt`` (written by ``--xla_dump_to`` on a GPU run) can be passed as FILE. TPUs from
``libtpu`` at jax's own pin (``scripts/setup_targets.sh``), one chip of MaxText's smallest slice. Runs with
``JAX_PLATFORMS=cpu``: ``jit(f).trace(ShapeDtypeStructs on such a device).lower().compile()`` runs every pass
of the target's compiler down to its machine code.

Everything this prints is **compile-derived, without autotuning**: on a GPU every dot becomes a Triton GEMM
fusion with default tiles where a real run may pick cuBLAS, so the GEMM kernels and the kernels right around them
can differ from a real run's (the non-GEMM kernels of the quantizer and of the bf16 MLP matched the 2026-11-30
H200 run exactly). It is no substitute for a measurement on the device.

Per program (``PROGRAMS``): compile seconds (on this CPU), kernels and bytes per kernel class (GEMM / other;
``hlo_traffic.traffic``, the operand + output bytes of each kernel as ``quantizer_hlo.py`` counts them),
bytes per element of the reference operand (``quantizer_hlo.hlo_stats``: passes, full writes, full-size
32-bit temporaries), XLA's ``memory_analysis()`` (argument / output / temp MiB) and the largest buffers of
the temp allocation from XLA's buffer assignment. MaxText's whole train step: ``maxtext_step.py`` beside this;
every program against bf16, per target: ``benchmarks/target_matrix.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))  # benchmarks/ (quantizer_hlo, mlp_bench)
sys.path.insert(0, _HERE)  # benchmarks/gpu (hlo_traffic)
sys.path.insert(0, os.path.dirname(os.path.dirname(_HERE)))  # the checkout (maxtext_nvfp4)

import compile_targets  # noqa: E402  pylint: disable=wrong-import-position
import hlo_traffic  # noqa: E402  pylint: disable=wrong-import-position
import quantizer_hlo as qh  # noqa: E402  pylint: disable=wrong-import-position

HEADLINE = "compile-derived: deviceless compile on a CPU host, no autotuning (not a measurement on the device)"


def unavailable_reason(spec: str = "h200") -> str | None:
  """None when this environment can compile for target ``spec`` (``compile_targets``); otherwise why not."""
  return compile_targets.unavailable_reason(spec)


def devices(spec: str = "h200", topology: str = "1x1x1"):
  """Compile-only devices of target ``spec`` (a ``compile_targets`` name or a GpuTargetConfigProto file;
  GPU ``topology``: XLA's "hosts x devices x 1" string, one host; raises RuntimeError with the fix when the
  target's compiler is not installed)."""
  hosts, n, _ = (int(v) for v in topology.split("x"))
  if hosts != 1:
    raise ValueError(f"one host only: topology {topology!r}")
  return compile_targets.devices(spec, n)


def device(spec: str = "h200"):
  """One compile-only device of target ``spec``."""
  return devices(spec)[0]


def on_device(args, spec: str = "h200"):
  """``args`` (a pytree of arrays / ShapeDtypeStructs) as ShapeDtypeStructs placed on the spec's device."""
  sharding = jax.sharding.SingleDeviceSharding(device(spec))
  return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)


def compile_for(fn, args, *, spec: str = "h200", dump_dir: str | None = None):
  """``jax.jit(fn)`` compiled for the spec's GPU from abstract ``args`` (XLA's dump into ``dump_dir``)."""
  jitted = fn if hasattr(fn, "trace") else jax.jit(fn)
  options = {"xla_dump_to": dump_dir, "xla_dump_hlo_as_text": True} if dump_dir else None
  # The default device names the GPU that Pallas's Triton lowering targets (it reads the default device's
  # kind) and the platform lax.platform_dependent picks; the partitioner lowers custom_partitioning's kernels
  # inside compile(), so both run under it.
  with jax.default_device(device(spec)):
    lowered = jitted.trace(*on_device(args, spec)).lower()
    return lowered.compile(options) if options else lowered.compile()


_VALUE = re.compile(r"value: <\d+ ([\w.-]+)(\{[\d,]*\})? @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")


def largest_temp_buffers(buffer_assignment: str, top: int = 6) -> list[dict]:
  """The ``top`` largest values of the preallocated-temp allocation of an XLA buffer-assignment text."""
  out, in_temp = [], False
  for line in buffer_assignment.splitlines():
    if line.startswith("allocation "):
      in_temp = "preallocated-temp" in line
      continue
    m = _VALUE.search(line) if in_temp else None
    if m and not m.group(5).startswith("("):
      out.append(dict(name=m.group(1), shape=m.group(5).split("{")[0], mib=int(m.group(3)) / 2**20))
  return sorted(out, key=lambda d: -d["mib"])[:top]


def analyze(fn, args, *, n_elements: int, spec: str = "h200", keep_dump: str | None = None) -> dict:
  """Compile ``fn(*args)`` for the spec and count it (see the module docstring); ``n_elements`` is the size of
  the reference operand (per-element bytes and the "full-size" threshold)."""
  with tempfile.TemporaryDirectory() as tmp:
    dump = keep_dump or tmp
    t0 = time.perf_counter()
    compiled = compile_for(fn, args, spec=spec, dump_dir=dump)
    seconds = time.perf_counter() - t0
    text = compiled.as_text()
    assignments = sorted(glob.glob(os.path.join(dump, "*after_optimizations-buffer-assignment.txt")),
                         key=os.path.getmtime)
    buffers = []
    if assignments:
      with open(assignments[-1]) as fh:
        buffers = largest_temp_buffers(fh.read())
  stats = qh.hlo_stats(text, n_elements)
  return dict(
      compile_s=round(seconds, 1),
      **compiled_counts(compiled, text),
      bytes_per_element=stats["traffic_bytes_per_element"], operand_reads=stats["operand_reads"],
      full_writes=stats["full_writes"], f32_temps=stats["f32_temps"],
      largest_temps=[f"{b['name']} {b['shape']} {b['mib']:.1f} MiB" for b in buffers],
      hlo=text,
  )


def compiled_counts(compiled, text: str | None = None) -> dict:
  """Kernels and GiB per kernel class (``hlo_traffic.traffic`` of the optimized HLO ``text``, by default the
  compiled program's) and ``memory_analysis()`` in MiB (argument, output, temp, total = their sum - aliased)."""
  mem = compiled.memory_analysis()
  traffic = hlo_traffic.traffic(compiled.as_text() if text is None else text)
  mib = lambda b: round(b / 2**20, 1)  # noqa: E731
  return dict(
      gemm_kernels=traffic["gemm"][0], gemm_gib=round(traffic["gemm"][1] / 2**30, 3),
      other_kernels=traffic["other"][0], other_gib=round(traffic["other"][1] / 2**30, 3),
      argument_mib=mib(mem.argument_size_in_bytes), output_mib=mib(mem.output_size_in_bytes),
      temp_mib=mib(mem.temp_size_in_bytes),
      total_mib=mib(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                    - mem.alias_size_in_bytes))


def select(patterns: str, programs) -> list[str]:
  """The names of ``programs`` matching a comma list of names or globs, in the programs' order."""
  import fnmatch  # pylint: disable=import-outside-toplevel

  return [n for pat in patterns.split(",") if pat for n in programs if fnmatch.fnmatch(n, pat)]


# ----------------------------------------------------------------------------------------------
# The programs: name -> (what, builder(shape) -> (fn, abstract args, n_elements))
# ----------------------------------------------------------------------------------------------
_BF16 = jnp.bfloat16
_KEY = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)


def _sds(*shape, dtype=_BF16):
  return jax.ShapeDtypeStruct(shape, dtype)


def _quantizer(case):
  def build(m=8192, k=4096, **_):
    return qh.CASES[case][1], (_sds(m, k), _KEY), m * k
  return build


def _gemm_pass(name):
  from maxtext_nvfp4.core import gemm  # pylint: disable=import-outside-toplevel

  r = gemm.GemmRecipe()

  def build(m=8192, k=4096, n=14336, **_):
    if name == "fprop":  # y = x W: x 1x16 RNE, W 16x16 RNE
      return (lambda x, w, key: gemm._fprop(r, x, w, _BF16)), (_sds(m, k), _sds(k, n), _KEY), m * k  # pylint: disable=protected-access
    if name == "dgrad":  # dx = dy W^T: dy 1x16 SR, W 16x16
      return ((lambda dy, w, key: gemm._dgrad(r, dy, w, key, k, _BF16)),  # pylint: disable=protected-access
              (_sds(m, n), _sds(k, n), _KEY), m * n)
    # wgrad: dW = x^T dy, both RHT 1x16 along tokens (dy SR)
    return ((lambda x, dy, key: gemm._wgrad(r, x, dy, key, _BF16)),  # pylint: disable=protected-access
            (_sds(m, k), _sds(m, n), _KEY), m * n)
  return build


def _mlp(variant):
  def build(t=8192, d=4096, f=14336, **_):
    import mlp_bench  # pylint: disable=import-outside-toplevel

    inp = mlp_bench.Inputs(x=_sds(t, d), w0=_sds(d, f), w1=_sds(d, f), wo=_sds(f, d), g=_sds(t, d), key=_KEY)
    fn, args = mlp_bench.build(variant, "fwdbwd", inp)
    return fn, args, t * d
  return build


def _experts(variant):
  """MoE's expert GEMM as MaxText's dense MoE path runs it: a batched ``dot_general`` (one GEMM per expert,
  under ``vmap``), forward and backward (the gradients of ``sum(y * g)`` w.r.t. x and W)."""
  def build(e=8, c=1024, d=4096, f=4096, **_):
    from maxtext_nvfp4.core import gemm  # pylint: disable=import-outside-toplevel

    dn = (((2,), (1,)), ((0,), (0,)))
    if variant == "bf16":
      dot = lambda x, w, key: jax.lax.dot_general(x, w, dn, preferred_element_type=_BF16)  # noqa: E731
    else:
      dot = lambda x, w, key: gemm.dot_general(x, w, dn, recipe=gemm.GemmRecipe(), key=key)  # noqa: E731

    def fwdbwd(x, w, g, key):
      y, vjp = jax.vjp(lambda x, w: dot(x, w, key), x, w)
      return y, vjp(g)
    return fwdbwd, (_sds(e, c, d), _sds(e, d, f), _sds(e, c, f), _KEY), e * c * d
  return build


PROGRAMS = {
    **{f"quant_{c}": (qh.CASES[c][0] + ", 8192x4096", _quantizer(c)) for c in qh.CASES},
    "gemm_fprop": ("fprop GEMM incl. quantizing x (1x16) and W (16x16), 8192x4096 . 4096x14336", _gemm_pass("fprop")),
    "gemm_dgrad": ("dgrad GEMM incl. dy (1x16 SR) and W (16x16)", _gemm_pass("dgrad")),
    "gemm_wgrad": ("wgrad GEMM incl. x and dy (RHT 1x16 along tokens, dy SR)", _gemm_pass("wgrad")),
    "mlp_bf16": ("SwiGLU MLP fwd+bwd T=8192 D=4096 F=14336, bf16 (mlp_bench)", _mlp("bf16")),
    "mlp_nvfp4": ("SwiGLU MLP fwd+bwd T=8192 D=4096 F=14336, nvfp4 full recipe (mlp_bench)", _mlp("nvfp4")),
    "experts_bf16": ("8 experts' GEMMs fwd+bwd (batched dot_general) 8x1024x4096 . 8x4096x4096, bf16",
                     _experts("bf16")),
    "experts_nvfp4": ("the same, nvfp4 full recipe (the quantizers under vmap)", _experts("nvfp4")),
}


def run_program(name: str, *, spec: str = "h200", keep_dump: str | None = None, **shape) -> dict:
  """Build program ``name`` (optional shape overrides: m/k/n or t/d/f) and ``analyze`` it."""
  fn, args, n = PROGRAMS[name][1](**shape)
  row = analyze(fn, args, n_elements=n, spec=spec, keep_dump=keep_dump)
  return dict(program=name, **row)


def table(rows: list[dict]) -> str:
  lines = ["| program | compile s | GEMM kernels | GEMM GiB | other kernels | other GiB | B/el | full writes |"
           " f32 temps | temp MiB | total MiB |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['program']} | {r['compile_s']} | {r['gemm_kernels']} | {r['gemm_gib']:.2f} | {r['other_kernels']} |"
                 f" {r['other_gib']:.2f} | {r['bytes_per_element']:.2f} | {r['full_writes']} | {r['f32_temps']} |"
                 f" {r['temp_mib']:.0f} | {r['total_mib']:.0f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--target", "--spec", dest="spec", default="h200",
                 help=f"one of {tuple(compile_targets.TARGETS)} or a gpu_target_config.pbtxt path")
  p.add_argument("--programs", default="quant_*,mlp_*", help="comma list of names or globs from PROGRAMS")
  p.add_argument("--json", help="write the rows (without HLO text) as JSON here")
  p.add_argument("--dump", metavar="DIR", help="keep each program's optimized HLO and XLA's dump under DIR/<program>/")
  p.add_argument("--buffers", action="store_true", help="also print the largest temp buffers per program")
  a = p.parse_args(argv)
  try:
    reason = unavailable_reason(a.spec)
  except compile_targets.UnknownTarget as e:
    print(f"deviceless.py: {e}", file=sys.stderr)
    return 2
  if reason:
    print(f"deviceless.py: {reason}", file=sys.stderr)
    return 2
  names = select(a.programs, PROGRAMS)
  if not names:
    p.error(f"no program matches {a.programs!r}; choose from {tuple(PROGRAMS)}")
  print(f"{HEADLINE}; target {a.spec}; jax {jax.__version__}", flush=True)
  rows = []
  for name in names:
    dump = os.path.join(a.dump, name) if a.dump else None
    row = run_program(name, spec=a.spec, keep_dump=dump)
    if dump:
      with open(os.path.join(dump, f"{name}.hlo.txt"), "w") as fh:
        fh.write(row["hlo"])
    rows.append({k: v for k, v in row.items() if k != "hlo"})
    print(json.dumps(rows[-1]), flush=True)
  print(table(rows))
  if a.buffers:
    for r in rows:
      print(f"  {r['program']}: " + "; ".join(r["largest_temps"]))
  if a.json:
    with open(a.json, "w") as fh:
      json.dump(dict(headline=HEADLINE, spec=a.spec, target=a.spec, jax=jax.__version__, rows=rows), fh, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
