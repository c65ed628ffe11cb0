"""Bytes moved by GEMM kernels vs all other kernels in an optimized HLO dump.

    python benchmarks/gpu/hlo_traffic.py DIR [NAME ...]     (default NAMEs: bf16_fwdbwd nvfp4_fwdbwd)
    python benchmarks/gpu/hlo_traffic.py --kernels FILE.hlo.txt [TOP] [other|gemm|all]   (one program's kernels)

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


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def kernels(hlo_text: str) -> list[dict]:
  """Every kernel of the entry computation and what it runs unfused, in program order: ``kind`` ("gemm" /
  "other"), ``name``, ``opcode``, ``op_name`` (its metadata: the JAX source of the work), ``bytes`` (operands +
  outputs) and ``output`` (its output arrays as (element type, count))."""
  comps, entry = qh.parse_computations(hlo_text)
  shapes = {ins.name: ins.outputs for c in comps.values() for ins in c}
  rows = []

  def walk(cname):
    for ins in comps.get(cname, []):
      if qh.is_free(ins):
        continue
      alternatives = qh._called(ins)
      if alternatives and ins.opcode in ("while", "call", "conditional"):
        for c in alternatives[0]:
          walk(c)
        continue
      read, written = qh.kernel_io(ins, shapes)
      m = _OP_NAME.search(ins.attrs)
      rows.append(dict(kind=kind(ins, comps), name=ins.name, opcode=ins.opcode, op_name=m.group(1) if m else "",
                       bytes=qh._bytes(read) + qh._bytes(written), output=ins.outputs))

  walk(entry)
  return rows


def traffic(hlo_text: str) -> dict:
  """{kind: (kernels, bytes)} over the entry computation and what it runs unfused."""
  count, moved = collections.Counter(), collections.Counter()
  for k in kernels(hlo_text):
    count[k["kind"]] += 1
    moved[k["kind"]] += k["bytes"]
  return {k: (count[k], moved[k]) for k in ("gemm", "other")}


def _short_source(op_name: str, width: int = 90) -> str:
  """``op_name`` without the program's own ``jit(...)/`` prefix and the ``cond/branch_N_fun/`` steps of the
  quantizer's platform dispatch, cut to its last ``width`` characters."""
  parts = [p for p in op_name.split("/") if p != "cond" and not re.fullmatch(r"branch_\d+_fun", p)]
  text = "/".join(parts[1:] if parts and parts[0].startswith("jit(") else parts)
  return text if len(text) <= width else "..." + text[-(width - 3):]


def source_op(k: dict) -> str:
  """What a kernel does, for grouping: the last step of its op_name (the Pallas kernel's name for a
  ``pallas_call``), or its opcode when it has no metadata (XLA's own copies and slices)."""
  parts = [p for p in k["op_name"].split("/") if p]
  if not parts:
    return k["opcode"]
  return parts[-2] if parts[-1] == "pallas_call" and len(parts) > 1 else parts[-1]


def source_table(hlo_text: str, which: str = "other") -> str:
  """Kernels of class ``which`` grouped by :func:`source_op`, largest first: kernels, GiB, share."""
  rows = [k for k in kernels(hlo_text) if which in ("all", k["kind"])]
  total = sum(k["bytes"] for k in rows) or 1.0
  groups: dict = collections.defaultdict(list)
  for k in rows:
    groups[source_op(k)].append(k["bytes"])
  lines = ["| source | kernels | GiB | share |", "|---|---:|---:|---:|"]
  for name, b in sorted(groups.items(), key=lambda kv: -sum(kv[1])):
    lines.append(f"| {name} | {len(b)} | {sum(b) / 2**30:.3f} | {sum(b) / total:.1%} |")
  lines.append(f"| all ({which}) | {len(rows)} | {total / 2**30:.3f} | 100% |")
  return "\n".join(lines)


def kernel_table(hlo_text: str, top: int = 30, which: str = "other") -> str:
  """The ``top`` kernels of class ``which`` ("gemm", "other" or "all") by bytes, as a markdown table, and the
  rest summed: rank, kind, opcode, output, GiB, share of the class's bytes, its JAX source (``_short_source``)."""
  rows = [k for k in kernels(hlo_text) if which in ("all", k["kind"])]
  total = sum(k["bytes"] for k in rows) or 1.0
  lines = ["| # | kind | opcode | output | GiB | share | op_name |", "|---:|---|---|---|---:|---:|---|"]
  ranked = sorted(rows, key=lambda k: -k["bytes"])
  for i, k in enumerate(ranked[:top], 1):
    out = ", ".join(f"{t}[{n}]" for t, n in k["output"][:2]) + (", ..." if len(k["output"]) > 2 else "")
    where = _short_source(k["op_name"])
    lines.append(f"| {i} | {k['kind']} | {k['opcode']} | {out} | {k['bytes'] / 2**30:.3f} | "
                 f"{k['bytes'] / total:.1%} | {where} |")
  rest = ranked[top:]
  if rest:
    lines.append(f"| | the other {len(rest)} | | | {sum(k['bytes'] for k in rest) / 2**30:.3f} | "
                 f"{sum(k['bytes'] for k in rest) / total:.1%} | |")
  lines.append(f"| | all {len(rows)} ({which}) | | | {total / 2**30:.3f} | 100% | |")
  return "\n".join(lines)


def main(argv: list[str]) -> int:
  if argv[:1] == ["--kernels"]:  # --kernels FILE.hlo.txt [TOP] [other|gemm|all]: one program, kernel by kernel
    if len(argv) < 2:
      print("usage: hlo_traffic.py --kernels FILE.hlo.txt [TOP] [other|gemm|all]", file=sys.stderr)
      return 2
    with open(argv[1]) as fh:
      text = fh.read()
    which = argv[3] if len(argv) > 3 else "other"
    print(source_table(text, which) + "\n")
    print(kernel_table(text, int(argv[2]) if len(argv) > 2 else 30, which))
    return 0
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
