"""Bytes of each collective kind in an optimized HLO text (compile-derived: what the program would move).

    collective_bytes(hlo_text) -> {"all_gather": {"u8": bytes, "bf16": ...}, "reduce_scatter": {...}, ...}

Each collective counts the bytes of its full-size buffer on one device, once per instruction in the text:

  all-gather           the gathered result (what every device ends up holding)
  reduce-scatter       the operand (the buffer being reduced before each device keeps its part)
  all-reduce           the operand (= the result)
  all-to-all, collective-permute   the operand

Async pairs count at their ``-start`` (whose tuple holds operands, then results); ``-done`` is not counted. A
collective counts as often as its computation runs per step (:func:`computation_runs`): a loop body's collectives
times the loop's trip count (XLA's ``known_trip_count``; MaxText's ``scan_layers=true`` layer loop), nested loops
multiplied; a loop whose trip count XLA does not know counts once.
"""

from __future__ import annotations

import collections
import re

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "collective_permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f4e2m1fn": 0.5, "s4": 0.5, "u4": 0.5,
          "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_LINE = re.compile(r"^\s*(?:ROOT )?%\S+ = (.*?) (all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)"
                   r"(-start)?\(")
_ARRAY = re.compile(r"\b(\w+)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$")
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)")
_CALLEES = re.compile(r"\b(?:calls|branch_computations)=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def _arrays(type_text: str) -> list[tuple[str, float]]:
  out = []
  for dtype, dims in _ARRAY.findall(type_text):
    if dtype not in _BYTES:
      continue
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    out.append((dtype, n * _BYTES[dtype]))
  return out


def _split_top(type_text: str) -> list[str]:
  """The top-level elements of a tuple type ``(a, (b, c), d)`` (or the type itself when not a tuple)."""
  t = type_text.strip()
  if not t.startswith("("):
    return [t]
  parts, depth, cur = [], 0, ""
  for ch in t[1:-1]:
    if ch in "({[":
      depth += 1
    elif ch in ")}]":
      depth -= 1
    if ch == "," and depth == 0:
      parts.append(cur)
      cur = ""
    else:
      cur += ch
  return parts + [cur]


def computation_runs(hlo_text: str) -> dict[str, int]:
  """{computation: times it runs per run of the entry}: runs(callee) = sum over its call sites of runs(caller) x
  (the trip count for a while body or condition, else 1). Empty when the text has no ENTRY computation."""
  calls: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)  # callee -> [(caller, factor)]
  entry, current = None, None
  for line in hlo_text.splitlines():
    m = _COMPUTATION.match(line)
    if m:
      current = m.group(2)
      entry = current if m.group(1) else entry
      continue
    if current is None or " = " not in line:
      continue
    trip = _TRIP_COUNT.search(line)
    for role, callee in _CALLEE.findall(line):
      calls[callee].append((current, int(trip.group(1)) if trip and role in ("body", "condition") else 1))
    for group in _CALLEES.findall(line):
      for callee in filter(None, (c.strip().lstrip("%") for c in group.split(","))):
        calls[callee].append((current, 1))
  if entry is None:
    return {}
  runs: dict[str, int] = {entry: 1}

  def count(name: str, seen: frozenset) -> int:
    if name not in runs:
      runs[name] = sum(count(caller, seen | {name}) * factor
                       for caller, factor in calls.get(name, ()) if caller not in seen)
    return runs[name]

  for name in list(calls):
    count(name, frozenset())
  return runs


def collective_bytes(hlo_text: str) -> dict[str, dict[str, float]]:
  """{kind: {dtype: bytes}} of the collectives in ``hlo_text``, each times its computation's runs per step (see
  the module docstring)."""
  out = {k: collections.Counter() for k in KINDS}
  runs = computation_runs(hlo_text)
  current = None
  for line in hlo_text.splitlines():
    c = _COMPUTATION.match(line)
    if c:
      current = c.group(2)
      continue
    m = _LINE.match(line)
    if not m:
      continue
    type_text, op, start = m.groups()
    kind = op.replace("-", "_")
    if start:  # ((operands...), results...) for all-gather-start; (operand, result, ...) for the others
      top = _split_top(type_text)
      if op == "all-gather":
        top = top[1:2] if len(top) >= 2 else top
      else:
        top = top[:1]
      arrays = [a for t in top for a in _arrays(t)]
    elif op == "all-gather" or op == "all-reduce":
      arrays = _arrays(type_text)
    else:  # reduce-scatter / all-to-all / collective-permute: the operand is the full-size side
      arrays = _operand_arrays(line, type_text, op)
    times = runs.get(current, 1) if runs else 1
    for dtype, nbytes in arrays:
      out[kind][dtype] += nbytes * times
  return {k: dict(v) for k, v in out.items()}


def _operand_arrays(line: str, type_text: str, op: str) -> list[tuple[str, float]]:
  """The operand side of a synchronous reduce-scatter / all-to-all / collective-permute: for reduce-scatter the
  result times the group size (XLA's text names the operands without their types); otherwise the result."""
  arrays = _arrays(type_text)
  if op != "reduce-scatter":
    return arrays
  groups = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
  mesh = re.search(r"replica_groups=mesh\[[^\]]*\] \{([^}]*)\}", line)
  n = 1
  if groups:
    n = len(groups.group(1).split(","))
  elif iota:
    n = int(iota.group(2))
  elif mesh:
    sizes = dict((k.strip("'"), int(v)) for k, v in re.findall(r"'?(\w+)'?=(\d+)", line.split("replica_groups=mesh[")[1].split("]")[0]))
    n = 1
    for a in mesh.group(1).split(","):
      n *= sizes.get(a.strip().strip("'"), 1)
  return [(d, b * n) for d, b in arrays]


def gib(table: dict[str, dict[str, float]]) -> dict[str, float]:
  """{"all_gather_gib": ..., ...}: each kind's bytes summed over dtypes, in GiB (rounded to 1e-4)."""
  return {f"{k}_gib": round(sum(v.values()) / 2**30, 4) for k, v in table.items()}
