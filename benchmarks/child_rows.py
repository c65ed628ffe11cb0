"""One process per program: a benchmark script runs itself as a child for each name and reads back one row.

    parent:  for name in names: python <script> *child_args(name)  ->  stdout line ``ROW <json>``  ->  row
    child:   emit(row)  (prints ``ROW <json>`` and flushes)

Why a process each: a compile's memory, jit and pyconfig caches and compiler state (libtpu, XLA:GPU) live and die with
its process, so one program's compile does not reach the next. The parent finds the child's row by the ``ROW ``
prefix (whatever else the child prints is ignored); a child that prints none failed, and the script turns its exit
status and stderr (:class:`ChildRun`) into an error row or stops. Used by ``gpu/maxtext_step.py``,
``gpu/te_weight_gather.py``, ``blackwell/recipes_compile.py`` and ``train_step_compile.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Callable, Iterable

PREFIX = "ROW "


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChildRun:
  """One child process's outcome, as the parent saw it."""
  row: dict | None  # its last ``ROW`` line's JSON; None when it printed none (failed, killed or timed out)
  returncode: int | None  # its exit status (negative: killed by that signal); None when it ran past the timeout
  stderr: str  # what it wrote to stderr ("" when it ran past the timeout)
  wall_s: float  # seconds from its start to its end (or to the timeout), one decimal

  @property
  def timed_out(self) -> bool:
    return self.returncode is None


def emit(row: dict) -> None:
  """The child's side: ``row`` as one ``ROW <json>`` line on stdout, flushed (a crash after it keeps the row)."""
  print(PREFIX + json.dumps(row), flush=True)


def run_child(cmd: list[str], *, env: dict[str, str] | None = None, timeout: float | None = None) -> ChildRun:
  """Run ``cmd`` to its end (or kill it after ``timeout`` seconds) and read its row."""
  t0 = time.time()
  try:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
  except subprocess.TimeoutExpired:
    return ChildRun(row=None, returncode=None, stderr="", wall_s=round(time.time() - t0, 1))
  lines = [l for l in proc.stdout.splitlines() if l.startswith(PREFIX)]
  return ChildRun(row=json.loads(lines[-1][len(PREFIX):]) if lines else None, returncode=proc.returncode,
                  stderr=proc.stderr, wall_s=round(time.time() - t0, 1))


def collect(script: str, names: Iterable[str], child_args: Callable[[str], list[str]],
            row_of: Callable[[str, ChildRun], dict | None], *, env: dict[str, str] | None = None,
            timeout: float | None = None, echo: bool = True, json_lines: str | None = None,
            json_list: str | None = None) -> list[dict] | None:
  """Each name in turn: ``python script *child_args(name)`` (:func:`run_child`), ``row_of(name, run)`` its row.

  After each row: ``echo`` prints it as one JSON line; ``json_lines`` appends it to that file as one JSON line;
  ``json_list`` rewrites that file with every row so far (a JSON list), so a run cut short keeps the rows it has.
  ``row_of`` returning None stops the loop, and ``collect`` returns None (the script's failure); otherwise the rows.
  """
  rows = []
  for name in names:
    row = row_of(name, run_child([sys.executable, os.path.abspath(script), *child_args(name)], env=env,
                                 timeout=timeout))
    if row is None:
      return None
    rows.append(row)
    if echo:
      print(json.dumps(row), flush=True)
    if json_lines:
      with open(json_lines, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")
    if json_list:
      with open(json_list, "w", encoding="utf-8") as fh:
        json.dump(rows, fh, indent=1)
  return rows
