"""``maxtext-nvfp4 patch``: apply, check and revert the fork-style MaxText patch series.

The series lives in ``patches/maxtext-<version>/*.patch`` (``git format-patch`` files against MaxText's
``src/maxtext`` layout). It makes MaxText itself accept ``quantization=nvfp4`` and the ``nvfp4_*`` keys,
routes ``configure_quantization`` to :func:`maxtext_nvfp4.maxtext_plugin.make_quantization` and adds
``python -m maxtext.train``. The target is the installed ``maxtext`` package (default) or a MaxText
checkout (a directory holding ``src/maxtext``); the series' ``src/maxtext/`` prefix maps to the package
directory.

Safety contract (every write path goes through :func:`apply` / :func:`revert`):

* the MaxText version is read from ``<pkg>/version.py`` first; versions without a series are refused;
* every hunk is matched exactly (no fuzz) in memory before anything is written (dry run);
* writing is all-or-nothing: originals are copied to ``<pkg>/.maxtext_nvfp4_backup/`` (with a manifest of
  sha256 hashes) before the first write, and any failure restores them;
* applying twice reports "already applied"; a half-applied tree is refused;
* ``--revert`` restores the backed-up originals byte for byte (mode and mtime too), after checking the
  patched files were not edited since; without a backup it reverse-applies the hunks exactly.

Hunks are applied by this module (pure Python), so neither ``git`` nor ``patch`` is needed at run time.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

SERIES_PREFIX = "src/maxtext/"
BACKUP_DIR = ".maxtext_nvfp4_backup"
MANIFEST = "manifest.json"

# status()["state"] values.
APPLIED = "applied"
NOT_APPLIED = "not applied"
PARTIAL = "partial"
UNKNOWN_VERSION = "unknown version"
ERROR = "error"


class PatchError(RuntimeError):
  """A refused or failed patch operation. The message is one line: what, where, what to do."""


# ------------------------------------------------------------------------------------------------
# Parsing git format-patch files


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hunk:
  """One ``@@ -old_start,len +new_start,len @@`` hunk; lines keep their line endings."""

  # 1-based first line of the hunk in the pre-image / post-image (for an empty side: the line before it).
  old_start: int
  new_start: int
  # Pre-image lines (context + removed), each with its "\n" unless "\ No newline at end of file" followed.
  old: tuple[str, ...]
  # Post-image lines (context + added), same convention.
  new: tuple[str, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class FilePatch:
  """The hunks of one file in one patch."""

  # Path relative to the package dir (series path with the "src/maxtext/" prefix removed).
  path: str
  # True when the pre-image is /dev/null (the patch creates the file).
  creates: bool
  # True when the post-image is /dev/null (the patch deletes the file).
  deletes: bool
  # Hunks in file order.
  hunks: tuple[Hunk, ...]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Patch:
  """One ``NNNN-*.patch`` file of the series."""

  # File name, e.g. "0001-configs-add-quantization-nvfp4.patch".
  name: str
  # The mail Subject line without the "[PATCH n/m]" tag.
  subject: str
  # Per-file hunks, in the order they appear.
  files: tuple[FilePatch, ...]


_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _strip_prefix(path: str, side: str) -> str:
  if path.startswith(side + "/"):
    path = path[len(side) + 1 :]
  if not path.startswith(SERIES_PREFIX):
    raise PatchError(f"patch path {path!r} is outside {SERIES_PREFIX!r}; the series must target src/maxtext only")
  return path[len(SERIES_PREFIX) :]


def parse_patch(text: str, name: str = "<patch>") -> Patch:
  """Parse one ``git format-patch`` file (mail header, commit message, unified diff)."""
  lines = text.splitlines(keepends=True)
  subject = ""
  for k, ln in enumerate(lines):
    if ln.startswith("Subject:"):
      folded = ln.rstrip("\n")
      for cont in lines[k + 1 :]:  # RFC 5322 folding: continuation lines start with whitespace
        if not cont[:1] in (" ", "\t") or not cont.strip():
          break
        folded += cont.rstrip("\n")
      subject = re.sub(r"^Subject:\s*(\[PATCH[^\]]*\]\s*)?", "", folded).strip()
      break
  files: list[FilePatch] = []
  i = 0
  while i < len(lines):
    if not lines[i].startswith("diff --git "):
      i += 1
      continue
    i += 1
    old_path = new_path = None
    while i < len(lines) and not lines[i].startswith("@@"):
      ln = lines[i].rstrip("\n")
      if ln.startswith("--- "):
        old_path = ln[4:]
      elif ln.startswith("+++ "):
        new_path = ln[4:]
      elif ln.startswith("diff --git "):
        break
      i += 1
    if old_path is None or new_path is None:
      raise PatchError(f"{name}: a file section has no ---/+++ header (binary or rename patches are not supported)")
    creates, deletes = old_path == "/dev/null", new_path == "/dev/null"
    path = _strip_prefix(new_path if not deletes else old_path, "b" if not deletes else "a")
    hunks = []
    while i < len(lines) and lines[i].startswith("@@"):
      m = _HUNK_RE.match(lines[i])
      if not m:
        raise PatchError(f"{name}: malformed hunk header {lines[i].strip()!r}")
      old_start, new_start = int(m.group(1)), int(m.group(3))
      n_old = int(m.group(2) if m.group(2) is not None else 1)
      n_new = int(m.group(4) if m.group(4) is not None else 1)
      i += 1
      old: list[str] = []
      new: list[str] = []
      last: list[list[str]] = []  # the lists the previous diff line went to (for "\ No newline")
      # Count lines instead of trusting prefixes, so a removed "- " line is never taken for the "-- "
      # mail signature.
      while len(old) < n_old or len(new) < n_new or (i < len(lines) and lines[i].startswith("\\")):
        if i >= len(lines):
          raise PatchError(f"{name}: hunk for {path} is truncated")
        ln = lines[i]
        tag, body = ln[:1], ln[1:]
        if tag == "\\":
          for lst in last:
            lst[-1] = lst[-1].rstrip("\n")
        elif tag == " " or ln in ("\n",):
          body = body if tag == " " else "\n"
          old.append(body)
          new.append(body)
          last = [old, new]
        elif tag == "-":
          old.append(body)
          last = [old]
        elif tag == "+":
          new.append(body)
          last = [new]
        else:
          raise PatchError(f"{name}: unexpected line in hunk for {path}: {ln.rstrip()!r}")
        i += 1
      hunks.append(Hunk(old_start=old_start, new_start=new_start, old=tuple(old), new=tuple(new)))
    files.append(FilePatch(path=path, creates=creates, deletes=deletes, hunks=tuple(hunks)))
  if not files:
    raise PatchError(f"{name}: no file changes found")
  return Patch(name=name, subject=subject, files=tuple(files))


# ------------------------------------------------------------------------------------------------
# Locating the series and the target


def series_root() -> Path:
  """Directory holding ``maxtext-<version>/`` series: $MAXTEXT_NVFP4_PATCHES, the repo's ``patches/``,
  or ``maxtext_nvfp4/patches/`` (package data)."""
  env = os.environ.get("MAXTEXT_NVFP4_PATCHES")
  candidates = [Path(env)] if env else []
  here = Path(__file__).resolve().parent.parent  # maxtext_nvfp4/
  candidates += [here.parent / "patches", here / "patches"]
  for c in candidates:
    if c.is_dir() and any(c.glob("maxtext-*/*.patch")):
      return c
  raise PatchError(
      "no patch series found (looked in: " + ", ".join(str(c) for c in candidates) + "); set MAXTEXT_NVFP4_PATCHES"
      " to the directory holding maxtext-<version>/"
  )


def supported_versions() -> list[str]:
  return sorted(p.name[len("maxtext-") :] for p in series_root().glob("maxtext-*") if any(p.glob("*.patch")))


def load_series(version: str) -> list[Patch]:
  d = series_root() / f"maxtext-{version}"
  files = sorted(d.glob("*.patch"))
  if not files:
    raise PatchError(f"no patch series for MaxText {version} in {d}")
  return [parse_patch(f.read_text(encoding="utf-8"), f.name) for f in files]


def series_digest(version: str) -> str:
  d = series_root() / f"maxtext-{version}"
  h = hashlib.sha256()
  for f in sorted(d.glob("*.patch")):
    h.update(f.name.encode() + b"\0" + f.read_bytes())
  return h.hexdigest()


def resolve_target(target: str | os.PathLike | None = None) -> Path:
  """The MaxText package directory to patch.

  None: the installed ``maxtext`` (found without importing it). A directory holding ``src/maxtext``
  (a checkout), the package directory itself (has ``version.py``), or a directory holding ``maxtext/``.
  """
  if target is None:
    spec = importlib.util.find_spec("maxtext")
    if spec is None or not spec.submodule_search_locations:
      raise PatchError("MaxText is not installed (no importable `maxtext`); pip install maxtext==0.2.5 or pass --target")
    return Path(list(spec.submodule_search_locations)[0]).resolve()
  t = Path(target).resolve()
  if not t.is_dir():
    raise PatchError(f"--target {t} is not a directory")
  for cand in (t / "src" / "maxtext", t, t / "maxtext"):
    if (cand / "version.py").is_file() and (cand / "__init__.py").is_file():
      return cand
  raise PatchError(f"--target {t} is neither a MaxText checkout (src/maxtext) nor a maxtext package dir (version.py)")


_VERSION_RE = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']""", re.M)


def maxtext_version(pkg: Path) -> str | None:
  """``__version__`` parsed from ``<pkg>/version.py`` (never imported)."""
  try:
    m = _VERSION_RE.search((pkg / "version.py").read_text(encoding="utf-8"))
  except OSError:
    return None
  return m.group(1) if m else None


def _check_version(pkg: Path) -> str:
  v = maxtext_version(pkg)
  known = supported_versions()
  if v not in known:
    raise PatchError(
        f"MaxText {v or '(version unknown)'} at {pkg} is not supported: this maxtext-nvfp4 has patch series for"
        f" MaxText {', '.join(known)} only. Install a supported MaxText (pip install maxtext=={known[-1]}) or use"
        " the plugin mode (python -m maxtext_nvfp4.train), which needs no patch"
    )
  return v


# ------------------------------------------------------------------------------------------------
# Exact hunk application (in memory)


class _Conflict(Exception):
  pass


def _apply_hunks(text: str | None, fp: FilePatch, reverse: bool) -> str | None:
  """Post-image of ``text`` (None = file absent) under ``fp`` (or its inverse); raises _Conflict."""
  creates, deletes = (fp.deletes, fp.creates) if reverse else (fp.creates, fp.deletes)
  if creates:
    if text is not None:
      raise _Conflict(f"{fp.path} already exists")
    return "".join("".join(h.old if reverse else h.new) for h in fp.hunks)
  if text is None:
    raise _Conflict(f"{fp.path} does not exist")
  if deletes:
    body = "".join("".join(h.new if reverse else h.old) for h in fp.hunks)
    if body != text:
      raise _Conflict(f"{fp.path} differs from the content the patch deletes")
    return None
  lines = text.splitlines(keepends=True)
  out: list[str] = []
  pos = 0  # next unconsumed line of `lines`
  for h in fp.hunks:
    pre, post = (h.new, h.old) if reverse else (h.old, h.new)
    start = h.new_start if reverse else h.old_start
    # Hunk positions index the input file (pre-image of this direction); an empty pre-image inserts
    # after line `start`, otherwise `start` is the 1-based first line. Offsets are allowed, fuzz is not.
    expected = max(start if not pre else start - 1, pos)
    where = _find(lines, pre, expected, pos)
    if where is None:
      raise _Conflict(f"{fp.path}: hunk at line {start} does not match")
    out.extend(lines[pos:where])
    out.extend(post)
    pos = where + len(pre)
  out.extend(lines[pos:])
  return "".join(out)


def _find(lines: list[str], block: tuple[str, ...], expected: int, lo: int) -> int | None:
  """Index >= lo where ``block`` matches exactly, nearest to ``expected`` (ties: the earlier one)."""
  n = len(block)
  last = len(lines) - n
  if last < lo:
    return None
  for d in range(0, max(expected - lo, last - expected) + 1):
    for cand in (expected - d, expected + d):
      if lo <= cand <= last and tuple(lines[cand : cand + n]) == block:
        return cand
  return None


def _read(path: Path) -> str | None:
  try:
    return path.read_bytes().decode("utf-8")
  except FileNotFoundError:
    return None


def _unit_states(pkg: Path, series: list[Patch]) -> dict[str, str]:
  """``{"<patch>:<file>": applied | not applied | conflict: why}`` for every file of every patch."""
  states = {}
  for p in series:
    for fp in p.files:
      text = _read(pkg / fp.path)
      key = f"{p.name}:{fp.path}"
      try:
        _apply_hunks(text, fp, reverse=False)
        states[key] = NOT_APPLIED
        continue
      except _Conflict as e:
        why = str(e)
      try:
        _apply_hunks(text, fp, reverse=True)
        states[key] = APPLIED
      except _Conflict:
        states[key] = f"conflict: {why}"
  return states


def _overall(states: dict[str, str]) -> str:
  values = set(states.values())
  if values == {APPLIED}:
    return APPLIED
  if values == {NOT_APPLIED}:
    return NOT_APPLIED
  return PARTIAL


def _plan(pkg: Path, series: list[Patch], reverse: bool) -> dict[str, str | None]:
  """``{relpath: new text or None (delete)}`` for the whole series, computed in memory (the dry run)."""
  contents: dict[str, str | None] = {}
  order = list(reversed(series)) if reverse else series
  for p in order:
    for fp in (reversed(p.files) if reverse else p.files):
      cur = contents[fp.path] if fp.path in contents else _read(pkg / fp.path)
      try:
        contents[fp.path] = _apply_hunks(cur, fp, reverse=reverse)
      except _Conflict as e:
        raise PatchError(f"{p.name} does not apply{' in reverse' if reverse else ''} to {pkg}: {e}") from None
  return contents


# ------------------------------------------------------------------------------------------------
# Public operations


def _sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def status(target: str | os.PathLike | None = None) -> dict:
  """Patch state of a MaxText target, never raising.

  Returns ``{"state", "target", "maxtext_version", "series", "files", "backup", "message"}`` where
  ``state`` is one of "applied", "not applied", "partial", "unknown version", "error" and ``files`` maps
  ``"<patch>:<path>"`` to that file's state.
  """
  out = {"state": ERROR, "target": None, "maxtext_version": None, "series": None, "files": {}, "backup": False,
         "message": ""}
  try:
    pkg = resolve_target(target)
    out["target"] = str(pkg)
    out["maxtext_version"] = maxtext_version(pkg)
    out["backup"] = (pkg / BACKUP_DIR / MANIFEST).is_file()
    try:
      version = _check_version(pkg)
    except PatchError as e:
      out.update(state=UNKNOWN_VERSION, message=str(e))
      return out
    out["series"] = f"maxtext-{version}"
    states = _unit_states(pkg, load_series(version))
    out["files"] = states
    out["state"] = _overall(states)
    out["message"] = {
        APPLIED: f"the maxtext-nvfp4 patch series is applied to MaxText {version} at {pkg}",
        NOT_APPLIED: f"the maxtext-nvfp4 patch series is not applied to MaxText {version} at {pkg}",
        PARTIAL: f"MaxText at {pkg} is partially patched or locally modified: "
        + "; ".join(f"{k}: {v}" for k, v in states.items() if v != APPLIED),
    }[out["state"]]
  except PatchError as e:
    out["message"] = str(e)
  except Exception as e:  # pylint: disable=broad-except  # doctor must never crash on a status probe
    out["message"] = f"{type(e).__name__}: {e}"
  return out


def _write_atomic(path: Path, data: bytes, mode: int | None) -> None:
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    if mode is not None:
      os.chmod(tmp, mode)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def _check_writable(pkg: Path, paths: list[str]) -> None:
  dirs = {pkg} | {(pkg / p).parent for p in paths}
  bad = [str(d) for d in sorted(dirs) if not os.access(d, os.W_OK)]
  bad += [str(pkg / p) for p in paths if (pkg / p).exists() and not os.access(pkg / p, os.W_OK)]
  if bad:
    raise PatchError(f"cannot write to {', '.join(bad)}: the target is read-only; nothing was changed"
                     " (run with permissions to that MaxText install, or patch a copy with --target)")


def _restore(pkg: Path, originals: dict[str, bytes | None], modes: dict[str, int]) -> None:
  """Best-effort rollback to ``originals`` (None = the file did not exist)."""
  for rel, data in originals.items():
    p = pkg / rel
    try:
      if data is None:
        if p.exists():
          p.unlink()
      elif not p.exists() or p.read_bytes() != data:
        _write_atomic(p, data, modes.get(rel))
    except OSError:
      pass


def apply(target: str | os.PathLike | None = None, *, log=print) -> str:
  """Apply the series all-or-nothing; returns "applied" or "already applied". Raises PatchError."""
  pkg = resolve_target(target)
  version = _check_version(pkg)
  series = load_series(version)
  st = _overall(_unit_states(pkg, series))
  if st == APPLIED:
    log(f"already applied: MaxText {version} at {pkg}")
    return "already applied"
  if st == PARTIAL:
    raise PatchError(
        f"MaxText at {pkg} is partially patched or locally modified; refusing to apply (nothing changed)."
        " Run `maxtext-nvfp4 patch --check` for details, then `--revert` or reinstall maxtext"
    )
  plan = _plan(pkg, series, reverse=False)  # dry run: every hunk matched in memory
  _check_writable(pkg, list(plan))
  originals = {rel: ((pkg / rel).read_bytes() if (pkg / rel).exists() else None) for rel in plan}
  modes = {rel: (pkg / rel).stat().st_mode & 0o7777 for rel in plan if (pkg / rel).exists()}
  backup = pkg / BACKUP_DIR
  if backup.exists():
    shutil.rmtree(backup)  # a stale backup of an unpatched tree (state is "not applied")
  staging = pkg / (BACKUP_DIR + ".tmp")
  try:
    if staging.exists():
      shutil.rmtree(staging)
    manifest = {"maxtext_version": version, "series": f"maxtext-{version}", "series_sha256": series_digest(version),
                "patches": [p.name for p in series], "files": {}}
    for rel, new in plan.items():
      entry = {"original_sha256": None, "patched_sha256": None}
      if originals[rel] is not None:
        (staging / "files" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(pkg / rel, staging / "files" / rel)  # keeps mode and mtime for a faithful revert
        entry["original_sha256"] = _sha256(originals[rel])
      if new is not None:
        entry["patched_sha256"] = _sha256(new.encode("utf-8"))
      manifest["files"][rel] = entry
    staging.mkdir(parents=True, exist_ok=True)
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(staging, backup)
    for rel, new in plan.items():
      p = pkg / rel
      if new is None:
        p.unlink()
      else:
        p.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(p, new.encode("utf-8"), modes.get(rel, 0o644))
    if _overall(_unit_states(pkg, series)) != APPLIED:
      raise PatchError("post-apply verification failed")
  except BaseException as e:
    _restore(pkg, originals, modes)
    for d in (staging, backup):
      shutil.rmtree(d, ignore_errors=True)
    if isinstance(e, PatchError):
      raise PatchError(f"{e}; restored the original files, nothing changed") from None
    if isinstance(e, OSError):
      raise PatchError(f"writing {pkg} failed ({e}); restored the original files, nothing changed") from None
    raise
  log(f"applied {len(series)} patches to MaxText {version} at {pkg} (originals backed up in {backup})")
  for p in series:
    log(f"  {p.name}: {p.subject}")
  return APPLIED


def revert(target: str | os.PathLike | None = None, *, log=print) -> str:
  """Restore the original files; returns "reverted" or "not applied". Raises PatchError."""
  pkg = resolve_target(target)
  version = _check_version(pkg)
  series = load_series(version)
  backup = pkg / BACKUP_DIR
  manifest_path = backup / MANIFEST
  if manifest_path.is_file():
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    files = manifest["files"]
    current = {rel: ((pkg / rel).read_bytes() if (pkg / rel).exists() else None) for rel in files}
    cur_hash = {rel: (None if b is None else _sha256(b)) for rel, b in current.items()}
    if all(cur_hash[r] == e["original_sha256"] for r, e in files.items()):
      shutil.rmtree(backup)
      log(f"not applied: MaxText at {pkg} already has its original files (removed the stale backup)")
      return NOT_APPLIED
    edited = [r for r, e in files.items() if cur_hash[r] != e["patched_sha256"]]
    if edited:
      raise PatchError(
          f"{', '.join(edited)} changed after patching; refusing to revert (nothing changed). Originals are in {backup}"
      )
    for rel, e in files.items():
      if e["original_sha256"] is not None:
        data = (backup / "files" / rel).read_bytes()
        if _sha256(data) != e["original_sha256"]:
          raise PatchError(f"backup of {rel} in {backup} is corrupt (hash mismatch); nothing changed")
    _check_writable(pkg, list(files))
    modes = {rel: (pkg / rel).stat().st_mode & 0o7777 for rel in files if (pkg / rel).exists()}
    try:
      for rel, e in files.items():
        p = pkg / rel
        if e["original_sha256"] is None:
          p.unlink()
        else:
          src = backup / "files" / rel
          fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
          os.close(fd)
          shutil.copy2(src, tmp)  # content, mode and mtime of the original
          os.replace(tmp, p)
    except BaseException as e:
      _restore(pkg, current, modes)
      if isinstance(e, OSError):
        raise PatchError(f"reverting {pkg} failed ({e}); left the patched files in place") from None
      raise
    shutil.rmtree(backup)
    log(f"reverted MaxText {version} at {pkg} to its original files (byte for byte)")
    return "reverted"
  st = _overall(_unit_states(pkg, series))
  if st == NOT_APPLIED:
    log(f"not applied: MaxText {version} at {pkg} is not patched; nothing to revert")
    return NOT_APPLIED
  if st == PARTIAL:
    raise PatchError(f"MaxText at {pkg} is partially patched and has no backup; refusing to revert (nothing changed)")
  plan = _plan(pkg, series, reverse=True)
  _check_writable(pkg, list(plan))
  originals = {rel: ((pkg / rel).read_bytes() if (pkg / rel).exists() else None) for rel in plan}
  modes = {rel: (pkg / rel).stat().st_mode & 0o7777 for rel in plan if (pkg / rel).exists()}
  try:
    for rel, new in plan.items():
      if new is None:
        (pkg / rel).unlink()
      else:
        _write_atomic(pkg / rel, new.encode("utf-8"), modes.get(rel, 0o644))
  except BaseException as e:
    _restore(pkg, originals, modes)
    if isinstance(e, OSError):
      raise PatchError(f"reverting {pkg} failed ({e}); left the patched files in place") from None
    raise
  log(f"reverted MaxText {version} at {pkg} by reverse-applying the series (no backup was present)")
  return "reverted"


# ------------------------------------------------------------------------------------------------
# Maintainer tool: (re)generate the series from pristine MaxText files and settings.py
#
# `python -m maxtext_nvfp4.patching --write-series PRISTINE_MAXTEXT_PKG_DIR OUT_DIR` copies the touched
# files into a scratch git repo (src/maxtext layout), makes one commit per concern and runs
# `git format-patch`. The config hunks are rendered from maxtext_nvfp4.settings, so the schema and
# base.yml keys cannot drift from the plugin (tests/test_patching.py checks the committed series).

_AUTHOR = ("maxtext-nvfp4", "maxtext-nvfp4@users.noreply.github.com")
_DATE = "2026-11-29T00:00:00+00:00"


def _yaml_scalar(v) -> str:
  if isinstance(v, bool):
    return "true" if v else "false"
  if isinstance(v, str):
    return json.dumps(v)
  return repr(v)


def _render_schema_class() -> str:
  from maxtext_nvfp4.core import settings  # pylint: disable=import-outside-toplevel

  lines = [
      "class Nvfp4Quantization(BaseModel):",
      '  """NVFP4 training (`quantization=nvfp4`), implemented by the maxtext_nvfp4 package.',
      "",
      "  Defaults follow Transformer Engine's NVFP4BlockScaling recipe; maxtext_nvfp4.settings documents each key.",
      '  """',
      "",
  ]
  for f in dataclasses.fields(settings.Nvfp4Settings):
    key = settings.config_key(f.name)
    choices = settings.CHOICES.get(f.name)
    ann = f"Literal[{', '.join(json.dumps(c) for c in choices)}]" if choices else str(f.type)
    default = json.dumps(f.default) if isinstance(f.default, str) else repr(f.default)
    lines.append(f"  {key}: {ann} = Field({default}, description={json.dumps(settings.KEY_HELP[f.name])})")
  return "\n".join(lines) + "\n"


def _render_base_yml_block() -> str:
  from maxtext_nvfp4.core import settings  # pylint: disable=import-outside-toplevel

  out = [
      '# NVFP4 training (quantization: "nvfp4"), implemented by the maxtext_nvfp4 package',
      "# (pip install maxtext-nvfp4). Defaults follow Transformer Engine's NVFP4BlockScaling recipe.",
  ]
  for f in dataclasses.fields(settings.Nvfp4Settings):
    out.append(f"{settings.config_key(f.name)}: {_yaml_scalar(f.default)} # {settings.KEY_HELP[f.name]}")
  return "\n".join(out) + "\n"


_TRAIN_PY = """\
# Copyright 2026 The maxtext-nvfp4 Authors
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#    https://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

\"\"\"Pre-training entry point: `python -m maxtext.train [CONFIG.yml] [key=value ...]`.

A short alias of `python -m maxtext.trainers.pre_train.train`: the same `main`, run under
`absl.app.run` so absl logging is configured and every step prints its `completed step: ...` line.
\"\"\"

from absl import app

from maxtext.trainers.pre_train import train


def main(argv):
  train.main(argv)


if __name__ == "__main__":
  app.run(main)
"""

_COMMITS = (
    (
        "configs: add quantization=nvfp4 and the nvfp4_* keys",
        "Add the `nvfp4` QuantizationType and an Nvfp4Quantization schema section\n"
        "(mixed into MaxTextConfig) with the nvfp4_* keys, and the same keys with\n"
        "their defaults to base.yml, so `quantization=nvfp4 nvfp4_backend=emulate`\n"
        "validates from YAML and key=value overrides. nvfp4 is not an AQT mode, so\n"
        "it is exempt from the AQT deprecation warning.\n"
        "\n"
        "The keys, defaults and allowed values mirror maxtext_nvfp4.settings, the\n"
        "single source of truth; this patch is generated from it.",
    ),
    (
        "quantizations: route quantization=nvfp4 to maxtext_nvfp4",
        "configure_quantization() hands `nvfp4` to\n"
        "maxtext_nvfp4.maxtext_plugin.make_quantization(config, quant_mode_str)\n"
        "with a single call, before any other mode is considered, so the NVFP4\n"
        "recipe (emulated or Transformer Engine) lives in one place: the\n"
        "maxtext_nvfp4 package. _get_quant_config() is never reached for nvfp4.",
    ),
    (
        "train: add the `python -m maxtext.train` entry point",
        "A short pre-training entry point that runs\n"
        "maxtext.trainers.pre_train.train.main under absl.app.run, so absl logging\n"
        "is set up and the per-step `completed step: ...` lines are printed.",
    ),
)


def _edit(text: str, anchor: str, replacement: str) -> str:
  if text.count(anchor) != 1:
    raise PatchError(f"anchor not found exactly once while building the series: {anchor[:60]!r}")
  return text.replace(anchor, replacement)


def build_series(pristine_pkg: str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
  """Write ``0001..0003-*.patch`` for the pristine MaxText package at ``pristine_pkg`` into ``out_dir``."""
  import subprocess  # pylint: disable=import-outside-toplevel

  pristine_pkg, out_dir = Path(pristine_pkg), Path(out_dir)
  touched = ["configs/types.py", "configs/base.yml", "layers/quantizations.py"]
  env = dict(os.environ, GIT_AUTHOR_NAME=_AUTHOR[0], GIT_AUTHOR_EMAIL=_AUTHOR[1], GIT_COMMITTER_NAME=_AUTHOR[0],
             GIT_COMMITTER_EMAIL=_AUTHOR[1], GIT_AUTHOR_DATE=_DATE, GIT_COMMITTER_DATE=_DATE, GIT_CONFIG_NOSYSTEM="1",
             GIT_CONFIG_GLOBAL=os.devnull)
  with tempfile.TemporaryDirectory() as tmp:
    repo = Path(tmp)

    def git(*a):
      return subprocess.run(["git", "-c", "core.autocrlf=false", *a], cwd=repo, env=env, check=True,
                            capture_output=True, text=True).stdout

    git("init", "-q")
    for rel in touched:
      (repo / SERIES_PREFIX / rel).parent.mkdir(parents=True, exist_ok=True)
      shutil.copyfile(pristine_pkg / rel, repo / SERIES_PREFIX / rel)
    git("add", "-A")
    git("commit", "-q", "-m", f"MaxText {maxtext_version(pristine_pkg)} (pristine files)")
    src = repo / SERIES_PREFIX

    # 1. configs: enum member, schema section, MaxTextConfig mixin, no AQT warning; base.yml keys.
    t = (src / "configs/types.py").read_text(encoding="utf-8")
    t = _edit(t, '  SERVE_FP8_WEIGHT = "serve_fp8_weight"\n',
              '  SERVE_FP8_WEIGHT = "serve_fp8_weight"\n  NVFP4 = "nvfp4"\n')
    t = _edit(t, "\n\nclass ModelArchitecture(BaseModel):",
              "\n\n" + _render_schema_class() + "\n\nclass ModelArchitecture(BaseModel):")
    t = _edit(t, "    Quantization,\n    # Core Model Architecture\n",
              "    Quantization,\n    Nvfp4Quantization,\n    # Core Model Architecture\n")
    t = _edit(t, '          "fp8",\n          "nanoo_fp8",\n      ) and not self.quantization.startswith("te_"):',
              '          "fp8",\n          "nanoo_fp8",\n          "nvfp4",\n      ) and not self.quantization.startswith("te_"):')
    (src / "configs/types.py").write_text(t, encoding="utf-8")
    b = (src / "configs/base.yml").read_text(encoding="utf-8")
    b = _edit(b, "# 'serve_fp8_weight' to load and use FP8 checkpoint directly at inference time.\n",
              "# 'serve_fp8_weight' to load and use FP8 checkpoint directly at inference time.\n"
              "# 'nvfp4' for NVFP4 training (maxtext_nvfp4 package; see the nvfp4_* keys below).\n")
    b = _edit(b, 'te_comm_gemm_overlap: "disabled"\n', 'te_comm_gemm_overlap: "disabled"\n\n' + _render_base_yml_block())
    (src / "configs/base.yml").write_text(b, encoding="utf-8")
    git("commit", "-q", "-a", "-m", _COMMITS[0][0] + "\n\n" + _COMMITS[0][1])

    # 2. quantizations: one call into the plugin.
    q = (src / "layers/quantizations.py").read_text(encoding="utf-8")
    q = _edit(q, '  """Configure quantization based on user config and quant mode."""\n',
              '  """Configure quantization based on user config and quant mode."""\n'
              '  if config.quantization == "nvfp4":\n'
              "    # NVFP4 training is implemented by the maxtext_nvfp4 package (pip install maxtext-nvfp4).\n"
              "    from maxtext_nvfp4.maxtext_plugin import make_quantization  # pylint: disable=import-outside-toplevel\n"
              "\n"
              "    return make_quantization(config, quant_mode_str)\n\n")
    (src / "layers/quantizations.py").write_text(q, encoding="utf-8")
    git("commit", "-q", "-a", "-m", _COMMITS[1][0] + "\n\n" + _COMMITS[1][1])

    # 3. maxtext.train
    (src / "train.py").write_text(_TRAIN_PY, encoding="utf-8")
    git("add", "-A")
    git("commit", "-q", "-m", _COMMITS[2][0] + "\n\n" + _COMMITS[2][1])

    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*.patch"):
      old.unlink()
    names = git("format-patch", "--zero-commit", "--no-signature", "-3", "-o", str(out_dir.resolve())).split()
  return [Path(n) for n in names]



def cli_main(argv: list[str]) -> int:
  """``maxtext-nvfp4 patch [--target DIR] [--check] [--revert] [--json]``.

  Exit codes: apply/revert: 0 done or nothing to do, 2 refused/failed (nothing changed).
  --check: 0 applied, 1 not applied, 2 partial / unknown version / error.
  """
  ap = argparse.ArgumentParser(prog="maxtext-nvfp4 patch", description=__doc__.split("\n\n")[0])
  ap.add_argument("--target", help="MaxText checkout (holding src/maxtext) or maxtext package dir;"
                  " default: the installed maxtext package")
  g = ap.add_mutually_exclusive_group()
  g.add_argument("--check", action="store_true", help="report the patch state without writing")
  g.add_argument("--revert", action="store_true", help="restore the original MaxText files byte for byte")
  ap.add_argument("--json", action="store_true", help="with --check: print status() as JSON")
  # Maintainer only: regenerate the series from a pristine maxtext package dir into OUT_DIR.
  ap.add_argument("--write-series", nargs=2, metavar=("PRISTINE_PKG", "OUT_DIR"), help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.write_series:
    for p in build_series(*args.write_series):
      print(p)
    return 0
  if args.check:
    st = status(args.target)
    if args.json:
      print(json.dumps(st, indent=2))
    else:
      print(f"{st['state']}: {st['message']}")
    return {APPLIED: 0, NOT_APPLIED: 1}.get(st["state"], 2)
  try:
    if args.revert:
      revert(args.target)
    else:
      apply(args.target)
  except PatchError as e:
    print(f"maxtext-nvfp4 patch: error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
