"""Passes over memory in the compiled NVFP4 quantizer: what XLA makes of ``core/nvfp4.py`` on this backend.

For each quantizer call the GEMM recipe makes (and the modes of ``quantize_bench.py``), jit it on an
(M, N) bf16 operand, compile it for the default backend and read the optimized HLO:

    kernels        instructions that run as a pass over memory: every instruction of a memory-level
                   computation (ENTRY, conditional branches, while bodies, called computations)
                   except parameter / constant / tuple / get-tuple-element / bitcast (free on every
                   backend); a fusion is one kernel however many ops it holds
    operand_reads  kernels reading a buffer of >= N*M/2 elements (a pass over operand-sized data)
    full_writes    kernels writing a buffer of >= N*M/2 elements
    f32_temps      kernels writing a 4-byte (f32/s32/u32) buffer of >= M*N elements that is not an
                   output: a full-size 32-bit temporary in memory (8 B/element of traffic: write + read)
    traffic_B/el   sum over kernels of (bytes of every operand + bytes of the output) / (M*N): the memory
                   traffic if each kernel streams each operand once (an upper-bound model: caches are
                   ignored). A plain copy (``-x`` in bf16) is 4.0; the ideal single-pass 1D quantizer is
                   2 (read) + 0.5 (4-bit write) + 1/16 (E4M3 scales), i.e. 2.56, and ``quantize_values``
                   (bf16 values out) 4.0
    temp_B/el      XLA's ``memory_analysis().temp_size_in_bytes`` / (M*N)

At a fixed bandwidth, time ~ traffic, so ``4.0 / traffic_B/el`` bounds the quantizer's speed as a
fraction of the copy's (``quantize_bench.py``'s "% of copy" column) from above.

    python benchmarks/quantizer_hlo.py                        # 8192x4096 on the default backend
    python benchmarks/quantizer_hlo.py --shape 256x512 --dump /tmp/qhlo   # and the HLO text per case

The counts are a property of (XLA version, backend, shape); ``tests/test_quantizer_hlo.py`` pins the
XLA:CPU ones at a small shape. On a GPU run this script is the quantizer's profile (no device time
beyond compilation).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np

# Allow `python benchmarks/quantizer_hlo.py` from a checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxtext_nvfp4.core import nvfp4 as nv  # pylint: disable=wrong-import-position

# name -> (what it is, fn(x, key)). The GEMM recipe's calls (core/gemm.py) and quantize_bench's modes.
CASES = {
    "copy": ("reference: -x (reads and writes every element once)", lambda x, k: -x),
    "q1d": ("quantize 1x16 along the last axis (quantize_bench 1d)", lambda x, k: nv.quantize(x, axis=-1)),
    "q2d": ("quantize 16x16 (W, quantize_bench 2d)", lambda x, k: nv.quantize(x, block_2d=True)),
    "qrht": ("quantize RHT 1x16 along axis 0 (x for wgrad, quantize_bench rht)",
             lambda x, k: nv.quantize(x, axis=0, rht=True)),
    "v1d": ("quantize_values 1x16 along the last axis, RNE (x for fprop)", lambda x, k: nv.quantize_values(x, axis=1)),
    "v1d_sr": ("quantize_values 1x16 along the last axis, SR (dy for dgrad)",
               lambda x, k: nv.quantize_values(x, axis=1, stochastic_key=k)),
    "v0_rht_sr": ("quantize_values RHT 1x16 along axis 0, SR (dy for wgrad)",
                  lambda x, k: nv.quantize_values(x, axis=0, rht=True, stochastic_key=k)),
}

# Opcodes that move no memory on any backend.
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all", "partition-id", "replica-id"}


def is_free(ins) -> bool:
  """Whether ``ins`` moves no memory: a ``_FREE`` opcode, or the ``*-done`` half of an asynchronous pair (its
  ``*-start`` counts the transfer; XLA:TPU's copies and slices into on-chip memory, collectives elsewhere)."""
  return ins.opcode in _FREE or ins.opcode.endswith("-done")


def kernel_io(ins, shapes: dict) -> tuple[tuple, tuple]:
  """(arrays read, arrays written) by kernel ``ins``; ``shapes``: instruction name -> its output arrays. An
  asynchronous ``*-start``'s output tuple holds its source and its destination, so it is read and written as
  that tuple alone."""
  if ins.opcode.endswith("-start"):
    return (), ins.outputs
  return tuple(a for o in ins.operands for a in shapes.get(o, ())), ins.outputs
# Attributes naming computations that run at memory level (not fused): their instructions are kernels too.
_CALLED = re.compile(r"(?:branch_computations=\{([^}]*)\}|true_computation=(%[\w.-]+)|false_computation=(%[\w.-]+)"
                     r"|body=(%[\w.-]+)|condition=(%[\w.-]+)|\bto_apply=(%[\w.-]+))")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|f8e\w+|f4e\w+|c64|c128|token)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Instr:
  """One HLO instruction of a computation."""

  # its name (without %)
  name: str
  # opcode, e.g. fusion, conditional, copy
  opcode: str
  # (element type, element count) of each array in its output (a tuple has several)
  outputs: tuple
  # names of its operands
  operands: tuple
  # the rest of the line (attributes)
  attrs: str


def _arrays(type_text: str) -> tuple:
  return tuple((t, int(np.prod([int(d) for d in dims.split(",") if d]))) for t, dims in _ARRAY.findall(type_text))


def _bytes(arrays) -> float:
  total = 0.0
  for t, n in arrays:
    bits = _BITS.get(t) or int(re.sub(r"\D", "", t.split("e")[0]) or 8)
    total += n * bits / 8
  return total


def _split_instr(line: str) -> Instr | None:
  m = re.match(r"\s*(?:ROOT\s+)?%?([\w.-]+)\s*=\s*", line)
  if not m:
    return None
  rest = line[m.end():]
  if rest.startswith("("):  # tuple type: scan to the matching parenthesis
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        break
    type_text, rest = rest[: i + 1], rest[i + 1 :].lstrip()
  else:
    type_text, _, rest = rest.partition(" ")
  om = re.match(r"([\w-]+)\(", rest)
  if not om:
    return None
  depth, j = 0, om.end() - 1
  for j in range(om.end() - 1, len(rest)):
    depth += rest[j] == "("
    depth -= rest[j] == ")"
    if depth == 0:
      break
  operand_text = rest[om.end() : j]
  return Instr(name=m.group(1), opcode=om.group(1), outputs=_arrays(type_text),
               operands=tuple(re.findall(r"%([\w.-]+)", operand_text)), attrs=rest[j + 1 :])


def parse_computations(hlo_text: str) -> tuple[dict, str]:
  """({computation name: [Instr]}, entry name) of an optimized HLO module's text."""
  comps, entry, cur = {}, None, None
  for line in hlo_text.splitlines():
    h = re.match(r"^(ENTRY\s+)?%?([\w.-]+)\s.*\{\s*$", line)
    if h and not line.startswith(" "):
      cur = h.group(2)
      comps[cur] = []
      if h.group(1):
        entry = cur
      continue
    if line.startswith("}"):
      cur = None
      continue
    if cur is not None:
      ins = _split_instr(line)
      if ins is not None:
        comps[cur].append(ins)
  return comps, entry


def _called(ins: Instr) -> list[list[str]]:
  """Computations ``ins`` runs unfused, as alternatives: [[branch 1], [branch 2]] for a conditional,
  [[body, condition]] for a while loop or [[callee]] for a call; [] for fusions and the per-element
  bodies of reduce, map, sort and the like."""
  if ins.opcode in ("fusion", "reduce", "reduce-window", "map", "sort", "scatter", "select-and-scatter", "all-reduce"):
    return []
  names = [n.strip().lstrip("%") for groups in _CALLED.findall(ins.attrs) for g in groups for n in g.split(",")
           if n.strip()]
  if ins.opcode == "conditional":
    return [[n] for n in names]
  return [names] if names else []


def _count(comps: dict, cname: str, shapes: dict, outputs: set, n_elements: int) -> dict:
  """Counts of the module docstring over computation ``cname`` and what it runs unfused (recursively);
  a conditional contributes its cheapest branch (by traffic)."""
  tot = dict(kernels=0, operand_reads=0, full_writes=0, f32_temps=0, traffic=0.0)
  for ins in comps.get(cname, []):
    if is_free(ins):
      continue
    alternatives = [[_count(comps, c, shapes, outputs, n_elements) for c in alt] for alt in _called(ins)]
    if alternatives:
      sums = [{k: sum(d[k] for d in alt) for k in tot} for alt in alternatives]
      for k, v in min(sums, key=lambda d: d["traffic"]).items():
        tot[k] += v
      if ins.opcode in ("conditional", "while", "call"):
        continue  # the control op itself moves nothing beyond what its computations do
    tot["kernels"] += 1
    ins_in, _ = kernel_io(ins, shapes)
    tot["operand_reads"] += any(n >= n_elements // 2 for _, n in ins_in)
    tot["full_writes"] += any(n >= n_elements // 2 for _, n in ins.outputs)
    tot["f32_temps"] += ins.name not in outputs and any(n >= n_elements and _bytes([(t, 1)]) == 4 for t, n in ins.outputs)
    tot["traffic"] += _bytes(ins_in) + _bytes(ins.outputs)
  return tot


def hlo_stats(hlo_text: str, n_elements: int) -> dict:
  """The counts of the module docstring for an optimized HLO text; ``n_elements`` = M*N of the operand."""
  comps, entry = parse_computations(hlo_text)
  shapes = {ins.name: ins.outputs for c in comps.values() for ins in c}
  root = comps[entry][-1]
  outputs = {root.name, *(root.operands if root.opcode == "tuple" else ())}
  tot = _count(comps, entry, shapes, outputs, n_elements)
  traffic = tot.pop("traffic")
  return dict(**tot, traffic_bytes_per_element=round(traffic / n_elements, 3))


def profile(name: str, shape: tuple[int, int], dump_dir: str | None = None) -> dict:
  """Compile case ``name`` for the default backend at ``shape`` (bf16) and return its counts."""
  x = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  key = jax.random.key(0)
  compiled = jax.jit(CASES[name][1]).lower(x, key).compile()
  text = compiled.as_text()
  if dump_dir:
    os.makedirs(dump_dir, exist_ok=True)
    with open(os.path.join(dump_dir, f"quantizer_{name}.hlo.txt"), "w") as fh:
      fh.write(text)
  n = shape[0] * shape[1]
  out = dict(case=name, shape=f"{shape[0]}x{shape[1]}", **hlo_stats(text, n))
  try:
    out["temp_bytes_per_element"] = round(compiled.memory_analysis().temp_size_in_bytes / n, 3)
  except Exception:  # pylint: disable=broad-except
    out["temp_bytes_per_element"] = None  # not every backend/runtime reports it
  return out


def table(rows: list[dict]) -> str:
  lines = ["| case | kernels | operand reads | full writes | f32 temps | traffic B/el | 4.0 / traffic | temp B/el |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    t = r["traffic_bytes_per_element"]
    lines.append(f"| {r['case']} | {r['kernels']} | {r['operand_reads']} | {r['full_writes']} | {r['f32_temps']} |"
                 f" {t:.2f} | {4.0 / t:.0%} | {r['temp_bytes_per_element']} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shape", default="8192x4096", help="MxN of the bf16 operand")
  p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {tuple(CASES)}")
  p.add_argument("--dump", metavar="DIR", help="also write each case's optimized HLO here")
  p.add_argument("--json", help="write the rows as JSON here")
  a = p.parse_args(argv)
  m, n = (int(v) for v in a.shape.lower().split("x"))
  cases = [c for c in a.cases.split(",") if c]
  bad = [c for c in cases if c not in CASES]
  if bad:
    p.error(f"unknown cases {bad}; choose from {tuple(CASES)}")
  dev = jax.devices()[0]
  header = f"quantizer HLO at {m}x{n} bf16 on {dev.platform}:{dev.device_kind} (jax {jax.__version__})"
  print(header, flush=True)
  rows = [profile(c, (m, n), a.dump) for c in cases]
  text = table(rows)
  print(text)
  for c in cases:
    print(f"  {c}: {CASES[c][0]}")
  if a.json:
    with open(a.json, "w") as fh:
      json.dump(dict(header=header, rows=rows, table=text), fh, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
