"""``maxtext-nvfp4 study DIR``: long comparisons (bf16 / fp8 / nvfp4 / nvfp4 + late switch) that survive
interruption: every arm trains in chunks between MaxText checkpoints and resumes where it stopped.

How one arm runs. Its command is fixed for the whole study but for ``metrics_file`` and ``checkpoint_period``
(``--chunk`` may change on a later call: it moves only where checkpoints are written). ``steps`` = the study's
total, so the learning-rate schedule, the late switch's step and the eval steps are those of one uninterrupted
run::

  python -m maxtext_nvfp4.train RECIPE [arm keys] run_name=ARM base_output_directory=DIR/maxtext
      metrics_file=DIR/arms/ARM/chunks/from_SSSSSSS_NNN.jsonl init_weights_seed=SEED data_shuffle_seed=0
      nvfp4_seed=0 steps=TOTAL eval_interval=E eval_steps=K enable_checkpointing=true async_checkpointing=false
      checkpoint_period=C save_checkpoint_on_completion=true max_num_checkpoints_to_keep=3
      skip_jax_distributed_system=true [nvfp4_diagnostics=true nvfp4_diagnostics_interval=D
      [nvfp4_diagnostics_grad=true: NVFP4 arms]] [KEY=VALUE ...]

MaxText restores the latest checkpoint in ``DIR/maxtext/ARM/checkpoints`` (model, optimizer and the grain data
iterator's position), so a resumed arm sees the same batches in the same order; the stochastic-rounding keys
are derived from the step. A chunk that starts at step ``s`` ends at checkpoint
``b = min(TOTAL - 1, (s // C + 1) * C)``: once checkpoint ``b`` is committed and the arm's records are complete
through ``b`` (below), the study stops the child with SIGKILL (the last chunk ends by itself). Every chunk writes
its own metrics file; nothing MaxText writes is ever edited.

After every chunk, and before an arm resumes, the arm is *rebuilt from disk* (:func:`rebuild_arm`), which is
what makes a kill at any moment (of the child, of the study, of the machine) harmless:

* records: the training records and end-of-eval summaries of all chunk files, a later chunk's record replacing
  an earlier one of the same step (a recomputation after a kill: the same bits);
* complete through ``p``: training records for every step ``0..p`` and an eval summary for every eval step
  ``<= p`` (``p % E == 0``);
* resume point ``p`` = the latest committed checkpoint through which the records are complete. Committed
  checkpoints after ``p`` (e.g. the child was killed after checkpoint ``p'`` but before it wrote step ``p'``'s
  record) and uncommitted ones are moved out of MaxText's folder into ``DIR/arms/ARM/set_aside/``, so MaxText
  resumes from ``p`` and recomputes what was lost;
* ``DIR/arms/ARM/metrics.jsonl`` = the records of steps ``0..p`` sorted by step (training record before the eval
  summary of the same step), written to a temporary file and renamed over the old one.

The study's settings are written once to ``DIR/study.json``; ``DIR/state.json`` (progress: steps done, chunks,
wall time, status per arm) is rewritten atomically after each chunk and every ``--progress-every`` seconds.
A later ``maxtext-nvfp4 study DIR`` continues the study (flags that disagree with study.json are refused); one
study process at a time holds ``DIR/.lock``. Chunks go round-robin to the arm with the fewest steps done, so an
interrupted study has all its arms at similar steps. The children die with the study process
(``PR_SET_PDEATHSIG``).

Exit code: 0 all arms done, or stopped as asked (``--max-chunks``, ``--until``); 2 bad input; 3 a chunk failed
(its log named); 130/143 interrupted (SIGINT/SIGTERM; the study resumes from where it was).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import fcntl
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

from maxtext_nvfp4.tools import cli as cli_mod
from maxtext_nvfp4.tools import cliargs
from maxtext_nvfp4.tools import metrics as metrics_io
from maxtext_nvfp4.tools import recipes as recipes_mod

PROG = "maxtext-nvfp4 study"
TRAIN_MODULE = "maxtext_nvfp4.train"
STUDY_FILE = "study.json"
STATE_FILE = "state.json"
LOCK_FILE = ".lock"
KEEP_CHECKPOINTS = 3
_SWITCH = ("nvfp4_switch_at_step=0.8", "nvfp4_switch_to=bf16", "nvfp4_switch_scope=forward")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Preset:
  """A model family with its recipes; every arm of a study uses one of them."""

  # Name on the command line.
  name: str
  # Recipe of the unquantized model (its `quantization` key is overridden per arm) and the NVFP4 recipe.
  base_recipe: str
  nvfp4_recipe: str
  # The paper's stabilizers (keep last layers + late switch) where a recipe exists, else None.
  paper_recipe: str | None
  # Default arms, baseline first.
  arms: tuple[str, ...]
  # Default training steps, chunk, eval interval and eval batches, diagnostics interval.
  steps: int
  chunk: int
  eval_interval: int
  eval_steps: int
  diagnostics_interval: int
  # One line for --help and the report.
  description: str


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset(name="demo", base_recipe="demo_bf16.yml", nvfp4_recipe="demo_nvfp4.yml",
           paper_recipe="demo_nvfp4_paper.yml", arms=("bf16", "fp8", "nvfp4", "nvfp4_switch"), steps=10001,
           chunk=500, eval_interval=250, eval_steps=8, diagnostics_interval=100,
           description="CPU demo (llama2 block, 4 layers, d=128, embedded corpus, held-out eval split)"),
    Preset(name="demo_moe", base_recipe="demo_moe_bf16.yml", nvfp4_recipe="demo_moe_nvfp4.yml", paper_recipe=None,
           arms=("bf16", "fp8", "nvfp4", "nvfp4_switch"), steps=5001, chunk=500, eval_interval=250, eval_steps=8,
           diagnostics_interval=100, description="CPU MoE demo (mixtral block, 4 experts top-2, einsum path)"),
    Preset(name="proxy_1gpu", base_recipe="proxy_1gpu_fp8.yml", nvfp4_recipe="proxy_1gpu_nvfp4.yml",
           paper_recipe=None, arms=("fp8", "nvfp4", "nvfp4_switch"), steps=10001, chunk=1000, eval_interval=250,
           eval_steps=10, diagnostics_interval=250,
           description="single-GPU proxy (Llama-3.2-1B-like, 16 layers, d=2048, seq 2048, C4), one H100/H200"),
    Preset(name="proxy_1gpu_moe", base_recipe="proxy_1gpu_moe_fp8.yml", nvfp4_recipe="proxy_1gpu_moe_nvfp4.yml",
           paper_recipe=None, arms=("fp8", "nvfp4", "nvfp4_switch"), steps=10001, chunk=1000, eval_interval=250,
           eval_steps=10, diagnostics_interval=250,
           description="single-GPU MoE proxy (Mixtral-style ~1.1B, 8 experts top-2), one H100/H200"),
)}

# arm -> (which recipe of the preset, keys on top of it, one line)
ARMS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "bf16": ("base", ("quantization=",), "no quantization"),
    "fp8": ("base", ("quantization=fp8",), "MaxText quantization=fp8 (per-tensor delayed scaling)"),
    "nvfp4": ("nvfp4", (), "ours, the full TE NVFP4 recipe"),
    "nvfp4_switch": ("nvfp4", _SWITCH, "ours, fprop switched to BF16 for the last 20 % of steps (the paper's late switch)"),
    "nvfp4_paper": ("paper", (), "the preset's paper recipe (last layer BF16 + late forward switch)"),
}


class StudyError(ValueError):
  """Bad input for study. Message: one line."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spec:
  """What a study trains (study.json); identical on every resume."""

  # Preset name and the arms, baseline first.
  preset: str
  arms: tuple[str, ...]
  # Total training steps of every arm, steps per chunk (= MaxText checkpoint_period).
  steps: int
  chunk: int
  # MaxText eval_interval / eval_steps; nvfp4_diagnostics_interval of every arm (0: off): the stability telemetry,
  # and in the NVFP4 arms the quantization statistics and the gradient fidelity.
  eval_interval: int
  eval_steps: int
  diagnostics_interval: int
  # init_weights_seed of every arm (the data order and nvfp4_seed are 0 in every arm).
  seed: int
  # Free KEY=VALUE overrides of every arm, in order.
  overrides: tuple[str, ...] = ()
  # --recipes-dir given at creation (None: ./recipes, then the packaged recipes).
  recipes_dir: str | None = None

  def to_json(self) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}

  @classmethod
  def from_json(cls, d: dict) -> "Spec":
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items() if k in names})


# --------------------------------------------------------------------------------------------- pure rules


def chunk_target(start: int, *, chunk: int, steps: int) -> int:
  """Last step of the chunk that starts at ``start``: the next checkpoint step ``(start // chunk + 1) * chunk``,
  or the run's last step ``steps - 1``."""
  return min(steps - 1, (start // chunk + 1) * chunk)


def eval_steps_through(p: int, eval_interval: int) -> list[int]:
  """Train steps ``<= p`` after which MaxText runs an eval (``step % eval_interval == 0``; none when <= 0)."""
  return list(range(0, p + 1, eval_interval)) if eval_interval > 0 else []


def complete_through(train: dict[int, dict], evals: dict[int, dict], p: int, eval_interval: int) -> bool:
  """True when every step ``0..p`` has a training record and every eval step ``<= p`` its summary."""
  return all(s in train for s in range(p + 1)) and all(s in evals for s in eval_steps_through(p, eval_interval))


def read_records(path: Path, *, first_step: int = 0) -> tuple[dict[int, dict], dict[int, dict]]:
  """(training records, end-of-eval summaries) by step of one chunk file, raw as MaxText wrote them, steps
  ``>= first_step`` only. Lines that do not parse (the last one of a killed child) and running-eval snapshots
  are skipped (:mod:`maxtext_nvfp4.tools.metrics` defines the kinds)."""
  train, evals = {}, {}
  try:
    text = path.read_text(encoding="utf8", errors="replace")
  except FileNotFoundError:
    return train, evals
  for line in text.splitlines():
    try:
      rec = json.loads(line)
      step = int(rec["step"])
    except (ValueError, KeyError, TypeError):
      continue
    if step < first_step:
      continue
    if metrics_io.LOSS in rec:
      train[step] = rec
    elif metrics_io.EVAL_LOSS in rec and metrics_io.EVAL_RUNNING_MARKER not in rec:
      evals[step] = rec
  return train, evals


def chunk_file_start(path: Path) -> int:
  """``from_0001500_002.jsonl`` -> 1500."""
  return int(path.name.split("_")[1])


# Keys whose values must repeat bit for bit when a step is recomputed after a resume (timing keys may not).
_RECHECKED_PREFIXES = ("learning/", metrics_io.DIAG_PREFIX, metrics_io.EVAL_PREFIX)


def same_values(a: dict, b: dict) -> bool:
  """The ``learning/*``, ``nvfp4/*`` and ``eval/*`` values two records share are equal bit for bit (JSON
  floats round-trip exactly); timing keys are ignored."""
  keys = [k for k in a if k in b and k.startswith(_RECHECKED_PREFIXES) and "time" not in k]
  return bool(keys) and all(a[k] == b[k] or (isinstance(a[k], float) and math.isnan(a[k]) and isinstance(b[k], float)
                                            and math.isnan(b[k])) for k in keys)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Merged:
  """The records of all chunk files of an arm."""

  # Training records and end-of-eval summaries by step (a later chunk's record of a step wins).
  train: dict[int, dict]
  evals: dict[int, dict]
  # Records that a later chunk recomputed (a killed chunk had run past its checkpoint): how many, and the
  # steps whose values differed (a resume that is not bit-identical).
  rechecked: int = 0
  mismatched: tuple[int, ...] = ()


def merged_records(chunk_files: Iterable[Path]) -> Merged:
  """All chunk files in name order (= start step, then attempt); a later file's record of a step replaces an
  earlier one, which it must equal (:func:`same_values`: counted in ``rechecked``, else ``mismatched``)."""
  train, evals = {}, {}
  rechecked, bad = 0, []
  for f in sorted(chunk_files, key=lambda p: p.name):
    t, e = read_records(f, first_step=chunk_file_start(f))
    for new, into in ((t, train), (e, evals)):
      for step, rec in new.items():
        if step in into:
          rechecked += 1
          if not same_values(into[step], rec):
            bad.append(step)
        into[step] = rec
  return Merged(train=train, evals=evals, rechecked=rechecked, mismatched=tuple(sorted(set(bad))))


def render_records(train: dict[int, dict], evals: dict[int, dict], p: int | None) -> str:
  """JSON lines of steps ``0..p``: by step, the training record before that step's eval summary."""
  if p is None:
    return ""
  rows = [(s, 0, r) for s, r in train.items() if s <= p] + [(s, 1, r) for s, r in evals.items() if s <= p]
  return "".join(json.dumps(r) + "\n" for _, _, r in sorted(rows, key=lambda x: x[:2]))


def write_atomic(path: Path, text: str) -> None:
  """Write ``text`` to a temporary file beside ``path``, fsync it and rename it over ``path``."""
  tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
  try:
    with open(tmp, "w", encoding="utf8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    if tmp.exists():
      tmp.unlink()


# --------------------------------------------------------------------------------------------- layout


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
  """Where a study keeps things (all under DIR)."""

  root: Path

  def arm_dir(self, arm: str) -> Path:
    return self.root / "arms" / arm

  def metrics(self, arm: str) -> Path:
    return self.arm_dir(arm) / "metrics.jsonl"

  def chunks(self, arm: str) -> Path:
    return self.arm_dir(arm) / "chunks"

  def maxtext_root(self) -> Path:
    return self.root / "maxtext"

  def checkpoints(self, arm: str) -> Path:
    return self.maxtext_root() / arm / "checkpoints"


def committed_checkpoints(ckpt_dir: Path) -> list[int]:
  """Checkpoint steps whose Orbax commit marker exists (a step folder without one is half-written)."""
  if not ckpt_dir.is_dir():
    return []
  return sorted(int(p.name) for p in ckpt_dir.iterdir()
                if p.name.isdigit() and (p / "commit_success.txt").exists())


@dataclasses.dataclass(frozen=True, kw_only=True)
class ArmProgress:
  """An arm after :func:`rebuild_arm`."""

  # Resume point: last step with a committed checkpoint and complete records (None: start from scratch).
  resume_from: int | None
  # Training steps recorded (0..resume_from), and the last of their losses.
  steps_done: int
  last_loss: float | None
  # Checkpoint folders moved aside by this rebuild.
  set_aside: tuple[str, ...]
  # Steps recomputed after a resume and compared bit for bit; those that differed.
  rechecked: int = 0
  mismatched: tuple[int, ...] = ()


def resume_point(layout: Layout, arm: str, spec: Spec) -> tuple[int | None, Merged, list[int]]:
  """``(resume point, merged records, committed checkpoint steps)`` of one arm, read from disk, nothing moved:
  the last committed checkpoint whose records are complete through it (None: start from scratch)."""
  chunk_dir = layout.chunks(arm)
  files = list(chunk_dir.glob("from_*.jsonl")) if chunk_dir.is_dir() else []
  merged = merged_records(files)
  committed = committed_checkpoints(layout.checkpoints(arm))
  ok = [c for c in committed if complete_through(merged.train, merged.evals, c, spec.eval_interval)]
  return (ok[-1] if ok else None), merged, committed


def chunk_metrics_file(layout: Layout, arm: str, start: int) -> Path:
  """The metrics file of the next chunk that starts at ``start``: ``from_<start>_<attempt>.jsonl``."""
  chunk_dir = layout.chunks(arm)
  attempt = len(list(chunk_dir.glob(f"from_{start:07d}_*.jsonl"))) if chunk_dir.is_dir() else 0
  return chunk_dir / f"from_{start:07d}_{attempt:03d}.jsonl"


def rebuild_arm(layout: Layout, arm: str, spec: Spec) -> ArmProgress:
  """Resume point and merged metrics of one arm, from its checkpoints and chunk files (module doc)."""
  p, merged, committed = resume_point(layout, arm, spec)
  train, evals = merged.train, merged.evals
  ckpt = layout.checkpoints(arm)
  moved = []
  if ckpt.is_dir():
    aside = layout.arm_dir(arm) / "set_aside"
    for entry in sorted(ckpt.iterdir()):
      keep = entry.name.isdigit() and p is not None and int(entry.name) <= p and int(entry.name) in committed
      if keep:
        continue
      aside.mkdir(parents=True, exist_ok=True)
      dest = aside / f"{entry.name}.{time.time_ns()}"
      os.replace(entry, dest)
      moved.append(entry.name)
  layout.arm_dir(arm).mkdir(parents=True, exist_ok=True)
  write_atomic(layout.metrics(arm), render_records(train, evals, p))
  last = train[p][metrics_io.LOSS] if p is not None else None
  return ArmProgress(resume_from=p, steps_done=0 if p is None else p + 1,
                     last_loss=float(last) if last is not None else None, set_aside=tuple(moved),
                     rechecked=merged.rechecked, mismatched=merged.mismatched)


# --------------------------------------------------------------------------------------------- commands


def arm_recipe(spec: Spec, arm: str) -> Path:
  preset = PRESETS[spec.preset]
  which = ARMS[arm][0]
  name = {"base": preset.base_recipe, "nvfp4": preset.nvfp4_recipe, "paper": preset.paper_recipe}[which]
  if name is None:
    raise StudyError(f"arm {arm} needs a paper recipe, which preset {spec.preset} has none of; drop the arm")
  try:
    return Path(recipes_mod.find_recipe(name, spec.recipes_dir))
  except recipes_mod.RecipeError as e:
    raise StudyError(f"{e}; pass --recipes-dir") from None


def arm_argv(spec: Spec, layout: Layout, arm: str, *, metrics_file: Path, python: str = sys.executable) -> list[str]:
  """The arm's training command (the same for every chunk but for ``metrics_file``)."""
  recipe = arm_recipe(spec, arm)
  nvfp4 = ARMS[arm][0] != "base"
  # every arm records the stability telemetry; the NVFP4 arms also the gradient fidelity (docs/diagnostics.md)
  diag = ([f"nvfp4_diagnostics=true", f"nvfp4_diagnostics_interval={spec.diagnostics_interval}"]
          + (["nvfp4_diagnostics_grad=true"] if nvfp4 else []) if spec.diagnostics_interval > 0 else [])
  return [python, "-m", TRAIN_MODULE, str(recipe), *ARMS[arm][1], f"run_name={arm}",
          f"base_output_directory={layout.maxtext_root()}", f"metrics_file={metrics_file}",
          # a seed is the initial weights only: every arm sees the same batches in the same order
          f"init_weights_seed={spec.seed}", "data_shuffle_seed=0", "nvfp4_seed=0",
          f"steps={spec.steps}", f"eval_interval={spec.eval_interval}", f"eval_steps={spec.eval_steps}",
          "enable_checkpointing=true", "async_checkpointing=false", f"checkpoint_period={spec.chunk}",
          "save_checkpoint_on_completion=true", f"max_num_checkpoints_to_keep={KEEP_CHECKPOINTS}",
          "skip_jax_distributed_system=true", *diag, *spec.overrides]


def _die_with_parent() -> None:  # runs in the child between fork and exec
  try:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except OSError:
    pass


# --------------------------------------------------------------------------------------------- the study


def _now() -> str:
  return f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M:%S}Z"


def _fmt_s(s: float) -> str:
  s = int(s)
  return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class _Tail:
  """Incremental reader of a growing chunk metrics file (complete lines only)."""

  def __init__(self, path: Path, *, first_step: int):
    self.path, self.first_step, self.offset = path, first_step, 0
    self.train: dict[int, dict] = {}
    self.evals: dict[int, dict] = {}
    self.max_train = -1

  def update(self) -> None:
    try:
      with open(self.path, "rb") as f:
        f.seek(self.offset)
        data = f.read()
    except FileNotFoundError:
      return
    end = data.rfind(b"\n") + 1
    self.offset += end
    for line in data[:end].decode("utf8", "replace").splitlines():
      try:
        rec = json.loads(line)
        step = int(rec["step"])
      except (ValueError, KeyError, TypeError):
        continue
      if step < self.first_step:
        continue
      if metrics_io.LOSS in rec:
        self.train[step] = rec
        self.max_train = max(self.max_train, step)
      elif metrics_io.EVAL_LOSS in rec and metrics_io.EVAL_RUNNING_MARKER not in rec:
        self.evals[step] = rec


class Study:
  """One study directory: its spec, state file, lock and the chunk loop."""

  def __init__(self, root: Path, spec: Spec, *, python: str = sys.executable, stream=None,
               progress_every: float = 60.0, poll: float = 0.25, overlap: int = 0):
    self.layout = Layout(root=root)
    self.spec = spec
    self.python = python
    self.stream = stream or sys.stdout
    self.progress_every = progress_every
    self.poll = poll
    # Steps a chunk runs past its checkpoint before it is stopped; the next chunk recomputes and checks them.
    self.overlap = overlap
    self.state = self._load_state()
    self.child: subprocess.Popen | None = None

  # --- state
  def _load_state(self) -> dict:
    try:
      state = json.loads((self.layout.root / STATE_FILE).read_text(encoding="utf8"))
    except (FileNotFoundError, ValueError):
      state = {}
    state.setdefault("arms", {})
    for arm in self.spec.arms:
      state["arms"].setdefault(arm, {"steps_done": 0, "chunks": 0, "wall_s": 0.0, "status": "pending",
                                     "last_loss": None})
    return state

  def save_state(self, running: str | None = None) -> None:
    self.state.update(steps=self.spec.steps, updated=_now(), running=running,
                      pid=os.getpid() if running else None)
    write_atomic(self.layout.root / STATE_FILE, json.dumps(self.state, indent=1) + "\n")

  def say(self, text: str) -> None:
    print(text, file=self.stream, flush=True)

  def refresh(self, arm: str) -> ArmProgress:
    prog = rebuild_arm(self.layout, arm, self.spec)
    st = self.state["arms"][arm]
    st.update(steps_done=prog.steps_done, last_loss=prog.last_loss, rechecked_steps=prog.rechecked,
              mismatched_steps=list(prog.mismatched))
    if prog.mismatched:
      self.say(f"[{arm}] RESUME NOT BIT-IDENTICAL: recomputed step(s) {', '.join(map(str, prog.mismatched[:10]))} "
               "differ from the records written before the interruption")
    if prog.steps_done >= self.spec.steps:
      st["status"] = "done"
    elif st["status"] in ("done", "running"):
      st["status"] = "stopped"
    if prog.set_aside:
      self.say(f"[{arm}] moved checkpoint(s) {', '.join(prog.set_aside)} aside (not committed, or their "
               f"records incomplete): resuming from step {0 if prog.resume_from is None else prog.resume_from + 1}")
    return prog

  def status_lines(self, *, alive: bool = True) -> list[str]:
    """Progress per arm: the steps and loss where the next chunk resumes, read from disk (:func:`resume_point`,
    nothing moved: a kill leaves the state file behind the checkpoints); chunks, wall time and status from the
    state file. ``alive``: whether a study process holds the directory's lock; without one, an arm the state
    still calls running was stopped by a kill."""
    total = self.spec.steps
    lines = [f"study {self.layout.root}: preset {self.spec.preset}, {total} steps per arm, chunks of {self.spec.chunk}"]
    for arm in self.spec.arms:
      st = self.state["arms"][arm]
      p, merged, _ = resume_point(self.layout, arm, self.spec)
      done = 0 if p is None else p + 1
      last = None if p is None else merged.train[p].get(metrics_io.LOSS)
      rate = st["wall_s"] / done if done and st["wall_s"] > 0 else None
      left = "" if rate is None or done >= total else f", ~{_fmt_s(rate * (total - done))} left"
      loss = "" if last is None else f", loss {float(last):.4f}"
      chk = st.get("rechecked_steps", 0)
      bad = st.get("mismatched_steps", [])
      resumed = (f", resume check: {chk} recomputed record(s)"
                 + (f", {len(bad)} DIFFER" if bad else " equal bit for bit")) if chk else ""
      status = st["status"]
      if status == "running" and not alive:
        status = (f"killed (no study process runs; continue with: {cli_mod.shell_command()} study"
                  f" {shlex.quote(str(self.layout.root))})")
      lines.append(f"  {arm:<14} {done:>7}/{total} steps ({100 * done / total:5.1f} %), "
                   f"{st['chunks']} chunk(s), {_fmt_s(st['wall_s'])} of training{loss}, {status}{left}{resumed}")
    return lines

  # --- one chunk
  def _should_stop(self, tail: "_Tail", arm: str, start: int, target: int) -> bool:
    """The latest committed checkpoint ``L`` is at or past ``target``, the records are complete through it and
    ``overlap`` more steps are written (or, should an eval summary never come, ``overlap + 2`` more). ``L``, not
    ``target``: a stop that comes late resumes from ``L`` (:func:`rebuild_arm`), and the overlap must follow it."""
    if target >= self.spec.steps - 1 or tail.max_train < target + self.overlap:
      return False
    done = [c for c in committed_checkpoints(self.layout.checkpoints(arm)) if c >= target]
    if not done:
      return False
    last = done[-1]
    if tail.max_train >= last + self.overlap + 2:
      return True
    if tail.max_train < last + self.overlap:
      return False
    before = {s: None for s in range(start)}  # steps before the chunk are complete (rebuild_arm)
    return complete_through({**before, **tail.train}, {**before, **tail.evals}, last, self.spec.eval_interval)

  def run_chunk(self, arm: str) -> int:
    """Train ``arm`` from its resume point to the next checkpoint; returns the child's exit code (0 also
    when the study stopped it at the checkpoint)."""
    prog = self.refresh(arm)
    start = prog.steps_done
    target = chunk_target(start, chunk=self.spec.chunk, steps=self.spec.steps)
    chunk_dir = self.layout.chunks(arm)
    chunk_dir.mkdir(parents=True, exist_ok=True)
    metrics_file = chunk_metrics_file(self.layout, arm, start)
    attempt = int(metrics_file.stem.rsplit("_", 1)[1])
    argv = arm_argv(self.spec, self.layout, arm, metrics_file=metrics_file, python=self.python)
    log_path = metrics_file.with_suffix(".log")
    self.say(f"[{arm}] {_now()} chunk: steps {start}..{target} of {self.spec.steps} (log {log_path})")
    if attempt == 0 and start == 0:
      self.say(f"[{arm}] $ {shlex.join(argv)}")
    st = self.state["arms"][arm]
    st["status"] = "running"
    self.save_state(running=arm)
    t0 = time.monotonic()
    last_report = t0
    stopped_by_us = False
    tail = _Tail(metrics_file, first_step=start)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_path, "w", encoding="utf8") as log:
      self.child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    preexec_fn=_die_with_parent)
      try:
        while self.child.poll() is None:
          time.sleep(self.poll)
          tail.update()
          if self._should_stop(tail, arm, start, target):
            self.child.send_signal(signal.SIGKILL)
            self.child.wait()
            stopped_by_us = True
            break
          now = time.monotonic()
          if now - last_report >= self.progress_every and tail.train:
            last_report = now
            s = tail.max_train
            rate = (now - t0) / max(1, s - start + 1)
            self.say(f"[{arm}] step {s + 1}/{self.spec.steps} loss {tail.train[s][metrics_io.LOSS]:.4f} "
                     f"({rate:.2f} s/step incl. start-up; chunk ends at step {target + 1})")
            st.update(current_step=s + 1)
            self.save_state(running=arm)
      finally:
        if self.child.poll() is None:
          self.child.kill()
          self.child.wait()
        wall = time.monotonic() - t0  # counted also when the study itself is interrupted
        st["wall_s"] = round(st["wall_s"] + wall, 1)
        st["chunks"] += 1
        st.pop("current_step", None)
    rc = 0 if stopped_by_us else self.child.returncode
    self.child = None
    prog = self.refresh(arm)
    if rc != 0 or prog.steps_done <= start:
      st["status"] = "failed"
      st["failed_log"] = str(log_path)
      self.save_state()
      lines = log_path.read_text(encoding="utf8", errors="replace").splitlines()[-15:]
      self.say(f"[{arm}] chunk failed (exit code {rc}, {prog.steps_done} steps recorded); last lines of "
               f"{log_path}:\n" + "\n".join(lines))
      return rc or 1
    st.pop("failed_log", None)
    self.save_state()
    loss = "" if prog.last_loss is None else f", loss {prog.last_loss:.4f}"
    self.say(f"[{arm}] {_now()} {prog.steps_done}/{self.spec.steps} steps{loss} ({_fmt_s(wall)} for this chunk)")
    return 0

  def kill_child(self) -> None:
    if self.child is not None and self.child.poll() is None:
      self.child.kill()
      self.child.wait()

  def next_arm(self, until: int | None, only: Sequence[str] | None = None) -> str | None:
    goal = self.spec.steps if until is None else min(until, self.spec.steps)
    todo = [a for a in self.spec.arms if self.state["arms"][a]["steps_done"] < goal and (not only or a in only)]
    return min(todo, key=lambda a: (self.state["arms"][a]["steps_done"], self.spec.arms.index(a))) if todo else None

  def run(self, *, max_chunks: int | None = None, until: int | None = None, only: Sequence[str] | None = None) -> int:
    for arm in self.spec.arms:
      self.refresh(arm)
    self.save_state()
    for line in self.status_lines():
      self.say(line)
    n = 0
    while max_chunks is None or n < max_chunks:
      arm = self.next_arm(until, only)
      if arm is None:
        break
      rc = self.run_chunk(arm)
      n += 1
      if rc != 0:
        return 3
    self.save_state()
    for line in self.status_lines():
      self.say(line)
    return 0


# --------------------------------------------------------------------------------------------- report


def write_report(root: Path, spec: Spec, *, stream=None, plots: bool = True) -> int:
  """``compare`` (with the drift section) over the arms' merged metrics, into DIR/compare."""
  from maxtext_nvfp4.tools import compare  # pylint: disable=import-outside-toplevel

  layout = Layout(root=root)
  args = [f"{a}={layout.metrics(a)}" for a in spec.arms if layout.metrics(a).exists()
          and layout.metrics(a).stat().st_size > 0]
  if not args:
    print(f"{PROG}: no arm has recorded steps yet: nothing to compare", file=stream or sys.stdout)
    return 0
  label = f"study {root.name}: preset {spec.preset}, {spec.steps} steps per arm, seed {spec.seed}"
  return compare.run_compare(args, out=str(root / "compare"), label=label, plots=plots, stream=stream)


# --------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
  p = cli_mod.ArgumentParser(
      prog=PROG,
      description="Run (or continue) a long study: arms trained in chunks between MaxText checkpoints, each "
                  "resuming bit-identically where it stopped; one metrics file per arm; state in DIR/state.json.",
      epilog="presets: " + "; ".join(f"{p.name}: {p.description} (arms {', '.join(p.arms)}; {p.steps} steps)"
                                     for p in PRESETS.values())
      + ". arms: " + "; ".join(f"{k}: {v[2]}" for k, v in ARMS.items())
      + ". Exit code: 0 done or stopped as asked, 2 bad input, 3 a chunk failed.")
  p.add_argument("dir", metavar="DIR", help="study directory (created on the first call; later calls continue it)")
  p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="extra MaxText keys for every arm (first call)")
  p.add_argument("--preset", choices=sorted(PRESETS), help="model family (first call; default demo)")
  p.add_argument("--arms", help="comma-separated arms, baseline first (first call; default: the preset's)")
  p.add_argument("--steps", type=cliargs.number(integer=True, at_least=2),
                 help="training steps per arm (first call; default: the preset's)")
  p.add_argument("--chunk", type=cliargs.number(integer=True, at_least=1),
                 help="steps per chunk = MaxText checkpoint_period (may change on a later call)")
  p.add_argument("--eval-interval", type=cliargs.number(integer=True, at_least=0),
                 help="MaxText eval_interval, 0 no evals (first call)")
  p.add_argument("--eval-steps", type=cliargs.number(integer=True, at_least=1), help="MaxText eval_steps (first call)")
  p.add_argument("--diagnostics-interval", type=cliargs.number(integer=True, at_least=0),
                 help="nvfp4_diagnostics_interval (telemetry in every arm; NVFP4 arms also their statistics and the "
                      "gradient fidelity), 0 off (first call)")
  p.add_argument("--seed", type=cliargs.number(integer=True, at_least=0),
                 help="init_weights_seed of every arm (first call; default 0)")
  p.add_argument("--recipes-dir", help="directory holding the recipe YAMLs (first call)")
  p.add_argument("--max-chunks", type=cliargs.number(integer=True, at_least=1),
                 help="stop after this many chunks in this call")
  p.add_argument("--until", type=cliargs.number(integer=True, at_least=1),
                 help="stop once every arm has this many steps")
  p.add_argument("--only", help="comma-separated arms to train in this call (default: all, round-robin)")
  p.add_argument("--status", action="store_true", help="print progress only")
  p.add_argument("--report", action="store_true", help="compare the arms' metrics so far into DIR/compare only")
  p.add_argument("--no-report", action="store_true", help="do not write DIR/compare at the end of this call")
  p.add_argument("--no-plots", action="store_true", help="DIR/compare/report.md without the figures")
  p.add_argument("--dry-run", action="store_true", help="print the arms' commands only")
  p.add_argument("--verify-overlap", type=cliargs.number(integer=True, at_least=0), default=0,
                 help="let each chunk run N steps past its checkpoint; the next chunk recomputes them and the study "
                      "checks they repeat bit for bit (default 0)")
  p.add_argument("--progress-every", type=cliargs.number(above=0), default=60.0,
                 help="seconds between progress lines (default 60)")
  p.add_argument("--python", default=sys.executable, help="interpreter of the training runs")
  # seconds between checks of a chunk
  p.add_argument("--poll", type=cliargs.number(above=0), default=0.25, help=argparse.SUPPRESS)
  return p


# --chunk is not here: a continuing call may change it (it moves only where checkpoints are written).
_SPEC_FLAGS = (("preset", "--preset"), ("steps", "--steps"),
               ("eval_interval", "--eval-interval"), ("eval_steps", "--eval-steps"),
               ("diagnostics_interval", "--diagnostics-interval"), ("seed", "--seed"),
               ("recipes_dir", "--recipes-dir"))


def spec_from_args(a: argparse.Namespace) -> Spec:
  """A new study's spec from the command line (defaults from the preset). Raises :class:`StudyError`."""
  preset = PRESETS[a.preset or "demo"]
  arms = tuple(x for x in (a.arms or ",".join(preset.arms)).split(",") if x)
  unknown = [x for x in arms if x not in ARMS]
  if unknown or not arms:
    raise StudyError(f"unknown arm(s) {', '.join(unknown) or '(none)'}; choose from {', '.join(ARMS)}")
  if len(set(arms)) != len(arms):
    raise StudyError(f"--arms {a.arms}: an arm is named twice")
  pick = lambda given, default: default if given is None else given  # noqa: E731  (0 is a value, not "default")
  spec = Spec(preset=preset.name, arms=arms, steps=pick(a.steps, preset.steps), chunk=pick(a.chunk, preset.chunk),
              eval_interval=pick(a.eval_interval, preset.eval_interval),
              eval_steps=pick(a.eval_steps, preset.eval_steps),
              diagnostics_interval=preset.diagnostics_interval if a.diagnostics_interval is None
              else a.diagnostics_interval,
              seed=pick(a.seed, 0), overrides=tuple(a.overrides),
              recipes_dir=os.path.abspath(a.recipes_dir) if a.recipes_dir else None)
  if spec.steps < 2 or spec.chunk < 1 or spec.eval_steps < 1 or spec.diagnostics_interval < 0 or spec.eval_interval < 0:
    raise StudyError("--steps must be >= 2, --chunk and --eval-steps >= 1, --eval-interval and "
                     "--diagnostics-interval >= 0")
  for arm in arms:
    arm_recipe(spec, arm)  # every recipe exists
  return spec


def _check_same(a: argparse.Namespace, spec: Spec) -> None:
  """Flags given on a continuing call must agree with study.json."""
  for key, flag in _SPEC_FLAGS:
    given = getattr(a, key)
    if given is None:
      continue
    have = getattr(spec, key)
    if key == "recipes_dir":
      given = os.path.abspath(given)
    if given != have:
      raise StudyError(f"{flag} {given}: the study was started with {have}; drop the flag or use another DIR")
  if a.arms and tuple(x for x in a.arms.split(",") if x) != spec.arms:
    raise StudyError(f"--arms {a.arms}: the study was started with {','.join(spec.arms)}; drop the flag or use another DIR")
  if a.overrides and tuple(a.overrides) != spec.overrides:
    raise StudyError(f"overrides {' '.join(a.overrides)}: the study was started with "
                     f"{' '.join(spec.overrides) or 'none'}; drop them or use another DIR")


def _locked(path: Path) -> bool:
  """Whether a study process holds the lock ``path`` (asked without creating it)."""
  try:
    with open(path, encoding="utf8") as f:
      fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
  except FileNotFoundError:
    return False
  except OSError:
    return True
  return False


def cli_main(argv: list[str]) -> int:
  try:
    a = build_parser().parse_intermixed_args(argv)
  except SystemExit as e:
    return int(e.code or 0)
  root = Path(a.dir).absolute()
  lock = None
  try:
    bad = [o for o in a.overrides if "=" not in o or o.startswith("=")]
    if bad:
      raise StudyError(f"overrides must be KEY=VALUE: {' '.join(bad)}")
    only = tuple(x for x in (a.only or "").split(",") if x)
    if root.exists() and not root.is_dir():
      raise StudyError(f"{root} exists and is not a directory; choose another DIR")
    spec_path = root / STUDY_FILE
    rewrite_spec = False
    if spec_path.exists():
      try:
        spec = Spec.from_json(json.loads(spec_path.read_text(encoding="utf8")))
      except (ValueError, TypeError) as e:
        raise StudyError(f"{spec_path} is not a study file ({e}); use another DIR") from None
      _check_same(a, spec)
      if a.chunk is not None and a.chunk != spec.chunk:
        if a.chunk < 1:
          raise StudyError("--chunk must be >= 1")
        print(f"{PROG}: chunks of {a.chunk} steps from now on (were {spec.chunk}); only where checkpoints are"
              " written changes", flush=True)
        spec = dataclasses.replace(spec, chunk=a.chunk)
        rewrite_spec = True
      if any(x not in spec.arms for x in only):
        raise StudyError(f"--only {a.only}: the study's arms are {','.join(spec.arms)}")
      if spec.preset not in PRESETS or any(x not in ARMS for x in spec.arms):
        raise StudyError(f"{spec_path} names a preset or arm this version lacks; use the version that started it")
    else:
      if a.status or a.report:
        raise StudyError(f"{root} holds no study ({STUDY_FILE} missing); start one with {PROG} {a.dir}")
      if root.exists() and any(root.iterdir()):
        raise StudyError(f"{root} is not empty and holds no {STUDY_FILE}; choose a new or empty DIR")
      spec = spec_from_args(a)
    if a.dry_run:  # what the next chunk of each arm would run, read from disk (nothing moved or written)
      layout = Layout(root=root)
      for arm in spec.arms:
        p = resume_point(layout, arm, spec)[0] if spec_path.exists() else None
        start = 0 if p is None else p + 1
        if start >= spec.steps:
          print(f"# {arm}: done ({spec.steps}/{spec.steps} steps)")
          continue
        where = f"resumes after step {p}" if p is not None else "starts at step 0"
        argv_ = arm_argv(spec, layout, arm, metrics_file=chunk_metrics_file(layout, arm, start), python=a.python)
        print(f"# {arm}: {where}\n{shlex.join(argv_)}")
      return 0
    if a.status:
      for line in Study(root, spec, python=a.python).status_lines(alive=_locked(root / LOCK_FILE)):
        print(line)
      return 0
    root.mkdir(parents=True, exist_ok=True)
    lock = open(root / LOCK_FILE, "a+", encoding="utf8")  # pylint: disable=consider-using-with
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      raise StudyError(f"{root} is in use by another study process; wait for it or stop it") from None
    if not spec_path.exists() or rewrite_spec:
      write_atomic(spec_path, json.dumps(spec.to_json(), indent=1) + "\n")
    if a.report:
      return write_report(root, spec, plots=not a.no_plots)
  except StudyError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
  study = Study(root, spec, python=a.python, progress_every=a.progress_every, overlap=a.verify_overlap,
                poll=a.poll)

  def _stop(signum, _frame):
    study.kill_child()
    raise SystemExit(128 + signum)

  old = {s: signal.signal(s, _stop) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    rc = study.run(max_chunks=a.max_chunks, until=a.until, only=only)
  except SystemExit as e:
    for arm in spec.arms:
      study.refresh(arm)
    study.save_state()
    print(f"{PROG}: interrupted; continue with: {cli_mod.shell_command()} study {shlex.quote(str(root))}",
          file=sys.stderr)
    return int(e.code)
  finally:
    for s, h in old.items():
      signal.signal(s, h)
    lock.close()
  if rc == 0 and not a.no_report:
    write_report(root, spec, plots=not a.no_plots)
  return rc


if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
