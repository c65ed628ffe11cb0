"""Reading Transformer Engine's custom calls out of a lowered (StableHLO) or compiled (HLO) program's text."""

from __future__ import annotations

import collections
import dataclasses
import re

_ATTR = re.compile(r"(\w+) = (true|false|-?\d+)")
# StableHLO: %41:7 = stablehlo.custom_call @te_dbias_quantize_ffi(%arg0, %31) {..., mhlo.backend_config = {...}, ...}
_MLIR_CALL = re.compile(r"^\s*(%[\w.]+)(?::\d+)? = stablehlo\.custom_call @(te_\w+)\(([^)]*)\)(.*)$")
_MLIR_OP = re.compile(r"^\s*(%[\w.]+)(?::\d+)? = (\"?[\w.]+\"?)[ (](.*)$")
# optimized HLO: custom_call_target="te_gemm_v2_ffi", ..., backend_config={...}
_HLO_TARGET = re.compile(r'custom_call_target="(te_\w+)"')


@dataclasses.dataclass(frozen=True)
class Call:
  """One TE custom call: its target, the SSA name of its results, its operands and its configuration."""

  target: str
  name: str
  operands: tuple[str, ...]
  config: dict


def _config(text: str) -> dict:
  out = {}
  for key, value in _ATTR.findall(text):
    out[key] = value == "true" if value in ("true", "false") else int(value)
  return out


def calls(text: str) -> list[Call]:
  """Every TE custom call of a program's text, in program order (StableHLO or optimized HLO)."""
  out = []
  for line in text.splitlines():
    m = _MLIR_CALL.match(line)
    if m:
      name, target, operands, rest = m.groups()
      config = rest.split("mhlo.backend_config = ", 1)[1] if "mhlo.backend_config = " in rest else ""
      out.append(Call(target=target, name=name, operands=tuple(o.strip() for o in operands.split(",") if o.strip()),
                      config=_config(config.split("}, ", 1)[0] if config else "")))
      continue
    t = _HLO_TARGET.search(line)
    if t:
      config = line.split("backend_config=", 1)[1] if "backend_config=" in line else ""
      out.append(Call(target=t.group(1), name="", operands=(), config=_config(config)))
  return out


def counts(text: str) -> collections.Counter:
  """``Counter`` of TE custom-call targets in a program's text."""
  return collections.Counter(c.target for c in calls(text))


def gemm_operand_sources(text: str) -> list[tuple[Call, tuple[Call, int], tuple[Call, int]]]:
  """For each TE GEMM of a StableHLO program: ``(gemm, (lhs quantize call, output index), (rhs ..., index))``.

  An operand is followed back through single-operand ops (reshapes, transposes, ...) to the TE quantize call
  whose output it is; ``(None, -1)`` when it comes from elsewhere.
  """
  defs: dict[str, tuple[str, list[str]]] = {}
  by_name = {}
  for line in text.splitlines():
    m = _MLIR_CALL.match(line)
    if m:
      by_name[m.group(1)] = m.group(2)
      continue
    m = _MLIR_OP.match(line)
    if m:
      defs[m.group(1)] = (m.group(2), re.findall(r"%[\w.]+(?:#\d+)?", m.group(3).split(" : ")[0]))
  te = {c.name: c for c in calls(text) if c.name}

  def source(ref: str) -> tuple[Call | None, int]:
    for _ in range(32):
      base, _, index = ref.partition("#")
      if base in te:
        return te[base], int(index or 0)
      op = defs.get(base)
      if op is None or len(op[1]) != 1:
        return None, -1
      ref = op[1][0]
    return None, -1

  return [(c, source(c.operands[0]), source(c.operands[2])) for c in calls(text) if c.target == "te_gemm_v2_ffi"]
