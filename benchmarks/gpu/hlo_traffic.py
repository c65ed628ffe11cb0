"""Bytes moved by GEMM kernels vs all other kernels in an optimized HLO dump.

    python benchmarks/gpu/hlo_traffic.py DIR [NAME ...]     (default NAMEs: bf16_fwdbwd nvfp4_fwdbwd)

reads ``DIR/<NAME>.hlo.txt`` (the ``hlo`` stage of ``benchmarks/gpu/run.sh`` writes them, and they come
back in ``hlo.tgz``). A kernel's traffic is the bytes of its operands plus its outputs, as counted by
``benchmarks/quantizer_hlo.py``; loops and calls are walked into. GEMMs are cuBLAS custom calls and
fusions that XLA:GPU emits as Triton GEMMs, and on XLA:TPU the fusions around a convolution or dot (its matrix
unit's kernels). ``benchmarks/gpu/deviceless.py`` uses ``traffic`` for programs it compiles for a GPU or TPU
target on a CPU (compile-derived, no autotuning). Every buffer counts as memory traffic: on a TPU some operands
sit in on-chip memory (``S(1)`` layouts), so there the count is an upper bound of HBM traffic.
"""

from __future__ import annotations

import collections
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import quantizer_hlo as qh  # noqa: E402


_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_METADATA = re.compile(r"metadata=\{[^}]*\}")
_CALLS = re.compile(r"\bcalls=%?([\w.-]+)")
_MATRIX_OPS = ("convolution", "dot")


def _runs_matrix_op(comps: dict, cname: str) -> bool:
  """Whether fused computation ``cname`` (or a fusion nested in it) holds a convolution or dot."""
  for ins in comps.get(cname, ()):
    if ins.opcode in _MATRIX_OPS:
      return True
    m = _CALLS.search(ins.attrs) if ins.opcode == "fusion" else None
    if m and _runs_matrix_op(comps, m.group(1)):
      return True
  return False


def kind(ins, comps: dict | None = None) -> str:
  """"gemm" or "other" for kernel ``ins``; ``comps`` (the module's computations) finds XLA:TPU's GEMM fusions."""
  # Not the metadata: its op names carry our function names (``_gemm2d``), on GEMMs and quantizers alike.
  attrs = _METADATA.sub("", ins.attrs).lower()
  if ins.opcode == "custom-call":
    target = _TARGET.search(ins.attrs)
    target = target.group(1).lower() if target else ""
    # cuBLAS / cuBLASLt GEMMs, and the Pallas NVFP4 GEMM (core/gemm_kernels: a Triton custom call named
    # nvfp4_dequant_dot); not the other Triton custom calls of Pallas kernels (__gpu$xla.gpu.triton: quantizers).
    if "nvfp4_dequant_dot" in ins.attrs:
      return "gemm"
    return "gemm" if ("gemm" in target or "cublas" in target or "matmul" in target) else "other"
  # XLA:GPU's Triton GEMM fusions: kind=kCustom calling a gemm computation, or tagged triton_gemm.
  if ins.opcode == "fusion" and ("triton_gemm" in attrs or ("kind=kcustom" in attrs and "gemm" in attrs)):
    return "gemm"
  if ins.opcode in _MATRIX_OPS:
    return "gemm"
  # XLA:TPU: the kernel of a dot is a fusion (kind=kOutput) around a convolution.
  if ins.opcode == "fusion" and comps is not None:
    m = _CALLS.search(ins.attrs)
    if m and _runs_matrix_op(comps, m.group(1)):
      return "gemm"
  return "other"


def traffic(hlo_text: str) -> dict:
  """{kind: (kernels, bytes)} over the entry computation and what it runs unfused."""
  comps, entry = qh.parse_computations(hlo_text)
  shapes = {ins.name: ins.outputs for c in comps.values() for ins in c}
  kernels, moved = collections.Counter(), collections.Counter()

  def walk(cname):
    for ins in comps.get(cname, []):
      if qh.is_free(ins):
        continue
      alternatives = qh._called(ins)
      if alternatives and ins.opcode in ("while", "call", "conditional"):
        for c in alternatives[0]:
          walk(c)
        continue
      k = kind(ins, comps)
      kernels[k] += 1
      read, written = qh.kernel_io(ins, shapes)
      moved[k] += qh._bytes(read) + qh._bytes(written)

  walk(entry)
  return {k: (kernels[k], moved[k]) for k in ("gemm", "other")}


def main(argv: list[str]) -> int:
  if not argv:
    print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
    return 2
  names = argv[1:] or ["bf16_fwdbwd", "nvfp4_fwdbwd"]
  print("| program | GEMM kernels | GEMM GiB | other kernels | other GiB |")
  print("|---|---:|---:|---:|---:|")
  for name in names:
    with open(os.path.join(argv[0], f"{name}.hlo.txt")) as fh:
      t = traffic(fh.read())
    print(f"| {name} | {t['gemm'][0]} | {t['gemm'][1] / 2**30:.2f} | {t['other'][0]} | {t['other'][1] / 2**30:.2f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
