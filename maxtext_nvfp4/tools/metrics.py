"""MaxText metrics files (``metrics_file``, JSON lines): the one reader of them (compare, reproduce, studies).

A record is one JSON object per line with a ``step``. MaxText writes three kinds:

* training record: has ``learning/loss`` (plus ``perf/*``, ``learning/*`` and our ``nvfp4/*``); ``step`` is
  the train step;
* end-of-eval summary: has ``eval/avg_loss`` and no ``eval/step_time_seconds``; ``step`` is the train step
  after which the eval ran;
* running-eval snapshot: has ``eval/step_time_seconds``; its ``step`` counts eval *batches* (its own counter,
  restarting at 0 every eval), so it has no place on the training axis: counted and dropped.

Rules, each applied here and nowhere else:

* a training step recorded twice (a resumed run appending to its file): the last record wins, counted;
* a line that is not a JSON object with a numeric ``step``, or a training record whose loss is not a number:
  skipped, counted, first line number kept;
* truncation: plain MaxText truncates the file at *every* record with step 0 (``write_metrics_locally``),
  and eval records carry step 0 (each eval's first running snapshot; the eval after train step 0), so the
  training records written before are lost. Such a file starts with an eval record and its first training
  step N is > 0: a warning says steps before N are missing (a run resumed at N into a fresh file looks the
  same and is named too). The plugin's writer truncates once, at a fresh run's first record, and a fresh run
  trains step 0 first, so its files (which may start with the step-0 eval) get no warning;
* records rebuilt from MaxText's log lines by ``reproduce`` carry ``"source": "log"``: counted.

Reading errors are :class:`InputError`, one line naming the path and the fix.
"""

from __future__ import annotations

import gzip
import dataclasses
import json
import math
import os
from pathlib import Path

LOSS = "learning/loss"
STEP_TIME = "perf/step_time_seconds"
TOKENS = "perf/per_device_tokens"
TOKENS_PER_SEC = "perf/per_device_tokens_per_sec"
TFLOPS = "perf/per_device_tflops"
TFLOPS_PER_SEC = "perf/per_device_tflops_per_sec"
EVAL_PREFIX = "eval/"
EVAL_LOSS = "eval/avg_loss"
# Only MaxText's running (per-eval-batch) snapshots carry this key.
EVAL_RUNNING_MARKER = "eval/step_time_seconds"
DIAG_PREFIX = "nvfp4/"
# A record rebuilt from a log line: {"source": "log", ...}.
SOURCE_LOG = "log"


class InputError(ValueError):
  """An unusable input (path, file, content, or runs that cannot be compared). Message: one line."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Run:
  """One run's metrics, read from its MaxText metrics file(s)."""

  # Display name (NAME= prefix, else the run directory's or the file's name).
  name: str
  # The metrics file(s) read, in reading order.
  paths: tuple[str, ...]
  # Training records by train step, loss as a float (the last record wins when a step repeats).
  steps: dict[int, dict]
  # End-of-eval summaries by train step (the last one wins).
  evals: dict[int, dict]
  # nvfp4/* diagnostics: key -> [(step, value), ...] in file order (training records only).
  diagnostics: dict[str, list[tuple[int, float]]]
  # Non-blank lines that were not usable records: count, and the first one's line number (0: none).
  malformed: int = 0
  first_malformed: int = 0
  # Training records that replaced an earlier record of the same step.
  repeated_steps: int = 0
  # Running-eval snapshots dropped (they count eval batches, not train steps).
  running_evals: int = 0
  # Reading notes worth a line in a report (truncation, duplicates, rebuilt steps).
  warnings: tuple[str, ...] = ()

  @property
  def sorted_steps(self) -> list[int]:
    return sorted(self.steps)

  @property
  def eval_loss(self) -> dict[int, float]:
    """``eval/avg_loss`` of the end-of-eval summaries by train step."""
    return {s: float(r[EVAL_LOSS]) for s, r in self.evals.items()}

  def loss(self, step: int) -> float:
    return self.steps[step][LOSS]

  def first_nonfinite_step(self) -> int | None:
    return next((s for s in self.sorted_steps if not math.isfinite(self.steps[s][LOSS])), None)


def find_metrics_files(directory: Path) -> list[Path]:
  """The metrics file(s) of a run directory: one ``*.jsonl`` / ``metrics*.txt``, or MaxText's GCS chunks
  (``metrics_step_XXXXXX_to_step_YYYYYY.txt``, all read, in name order)."""
  cands = [p for p in sorted(directory.rglob("*"))
           if p.is_file() and not any(part.startswith(".") for part in p.relative_to(directory).parts)
           and (p.suffix == ".jsonl" or (p.name.startswith("metrics") and p.suffix == ".txt"))]
  chunks = [p for p in cands if p.name.startswith("metrics_step_")]
  if chunks and len(chunks) == len(cands):
    return chunks
  if len(cands) > 1:
    listed = ", ".join(str(p) for p in cands[:5])
    raise InputError(f"{directory}: several metrics files ({listed}); pass the file itself")
  if not cands:
    raise InputError(f"{directory}: no metrics file (*.jsonl or metrics*.txt) in this directory; "
                     "pass the run's metrics_file or its directory")
  return cands


def default_name(path: Path) -> str:
  """A directory's name; a file's stem, or its directory's name for ``metrics*`` files."""
  if path.is_dir():
    return path.resolve().name
  if path.stem.startswith("metrics") and path.resolve().parent.name:
    return path.resolve().parent.name
  return path.stem


def _step_of(rec) -> int | None:
  """The integer step of a record, or None when it is not a JSON object with a finite numeric step."""
  if not isinstance(rec, dict) or isinstance(rec.get("step"), bool):
    return None
  try:
    step = float(rec["step"])
  except (KeyError, TypeError, ValueError):
    return None
  return int(step) if math.isfinite(step) else None


def read(path: str | os.PathLike, *, name: str | None = None, strict: bool = True) -> Run:
  """Read a metrics file, or the metrics file(s) of a run directory (see the module doc).

  ``strict``: raise :class:`InputError` when the files hold no training record (else return the Run with
  empty ``steps``, e.g. to rebuild a truncated file). A missing or unreadable path always raises.
  """
  path = Path(path)
  if not path.exists():
    raise InputError(f"{path}: no such file or directory; pass a MaxText metrics_file or its run directory")
  files = find_metrics_files(path) if path.is_dir() else [path]
  steps: dict[int, dict] = {}
  evals: dict[int, dict] = {}
  diags: dict[str, list[tuple[int, float]]] = {}
  malformed = first_bad = repeated = running = nonempty = 0
  warnings = []
  for f in files:
    if not f.is_file():
      raise InputError(f"{f}: not a regular file; pass a MaxText metrics_file (JSON lines)")
    try:
      if f.suffix == ".gz":  # a published metrics file (benchmarks/accuracy/long_sp/*.jsonl.gz)
        with gzip.open(f, "rt", encoding="utf8", errors="replace") as fh:
          text = fh.read()
      else:
        text = f.read_text(encoding="utf8", errors="replace")
    except (OSError, EOFError) as e:
      why = getattr(e, "strerror", None)
      raise InputError(f"{f}: cannot read ({why}); check its permissions" if why else
                       f"{f}: cannot read ({e}); a .gz metrics file must be gzip-compressed JSON lines") from None
    first_kind = None  # "train" | "eval" of the file's first record
    first_train = None
    for lineno, line in enumerate(text.splitlines(), 1):
      if not line.strip():
        continue
      nonempty += 1
      try:
        rec = json.loads(line)
      except ValueError:
        rec = None
      step = _step_of(rec)
      if step is None:
        malformed += 1
        first_bad = first_bad or lineno
        continue
      if LOSS in rec:
        try:
          rec[LOSS] = float(rec[LOSS])
        except (TypeError, ValueError):
          malformed += 1
          first_bad = first_bad or lineno
          continue
        first_kind = first_kind or "train"
        first_train = step if first_train is None else first_train
        repeated += step in steps
        steps[step] = rec
        for k, v in rec.items():
          if k.startswith(DIAG_PREFIX) and isinstance(v, (int, float)) and not isinstance(v, bool):
            diags.setdefault(k, []).append((step, float(v)))
      elif any(k.startswith(EVAL_PREFIX) for k in rec):
        first_kind = first_kind or "eval"
        if EVAL_RUNNING_MARKER in rec:
          running += 1
        elif isinstance(rec.get(EVAL_LOSS), (int, float)):
          evals[step] = rec
    if first_kind == "eval" and first_train is not None and first_train > 0:
      warnings.append(f"{f.name} starts with an eval record and its first training step is {first_train}: "
                      f"plain MaxText truncated it at an eval (or the run resumed at step {first_train}), so "
                      "earlier training steps are missing")
  label = name or default_name(path)
  if repeated:
    warnings.append(f"{repeated} training step(s) recorded more than once (e.g. a resumed run); the last "
                    "record of each is used")
  from_log = sum(1 for r in steps.values() if r.get("source") == SOURCE_LOG)
  if from_log:
    warnings.append(f"{from_log} training step(s) rebuilt from MaxText's log lines (values rounded to 3 decimals)")
  if strict and nonempty == 0:
    raise InputError(f"{label}: {', '.join(map(str, files))} is empty; pass a metrics_file a run has written to")
  if strict and not steps:
    raise InputError(f"{label}: no training records (JSON objects with 'step' and '{LOSS}') in "
                     f"{', '.join(map(str, files))}" + (f" ({malformed} malformed line(s))" if malformed else "")
                     + "; pass a MaxText metrics_file")
  return Run(name=label, paths=tuple(map(str, files)), steps=steps, evals=evals, diagnostics=diags,
             malformed=malformed, first_malformed=first_bad, repeated_steps=repeated, running_evals=running,
             warnings=tuple(warnings))
