"""Outputs as transactions: a result directory or file appears whole or not at all, and is checked first.

Directory (:func:`check_out_dir`, :func:`publish_dir`), what ``export`` writes:

  1. Up front, before any work: ``OUT`` must not be a file, its parent must exist and be writable, and an
     existing ``OUT`` must be empty or an earlier output of the same command (it holds the command's
     ``marker`` file, written last). Anything else is a :class:`OutputError` (one line: the path, why,
     the fix).
  2. The result is built in ``.<OUT name>.tmp-<pid>`` beside ``OUT`` (same filesystem), files mode 0644,
     folder 0755, fsynced, the marker written last.
  3. Swap: with no ``OUT``, one ``rename(tmp, OUT)``; with an earlier ``OUT``, one
     ``renameat2(tmp, OUT, RENAME_EXCHANGE)`` (Linux >= 3.15: both names always exist, each holding a
     complete tree), then the old tree (now under the temporary name) is removed. Where the exchange is
     not available: ``rename(OUT, .<OUT name>.old-<pid>)``, ``rename(tmp, OUT)``; a kill between the two
     leaves ``OUT`` missing, and the next run puts ``.old-*`` back before it checks ``OUT``.
  4. Leftovers of killed runs (``.<OUT name>.tmp-<pid>`` / ``.old-<pid>`` of processes that no longer
     run) are removed by the next :func:`check_out_dir` of the same ``OUT``.

So a SIGKILL at any point leaves either the old ``OUT`` or the new one, complete, plus at most a hidden
sibling that the next run removes.

File (:func:`check_out_file`, :func:`publish_file`), what ``eval-quantized --json`` writes: the same
checks (not a folder, parent exists and is writable), then the text goes to ``.<name>.tmp-<pid>``
(0644, fsynced) and ``os.replace`` puts it in place.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
from typing import Callable


class OutputError(ValueError):
  """An output path that cannot be written as asked (one line: the path, why, the fix)."""


def _tmp_prefix(path: str) -> str:
  return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-")


def _old_prefix(path: str) -> str:
  return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.old-")


def _pid_running(pid: int) -> bool:
  if pid == os.getpid():
    return True
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def _stale_siblings(path: str, prefix: str) -> list[str]:
  parent, base = os.path.dirname(prefix), os.path.basename(prefix)
  try:
    names = os.listdir(parent)
  except OSError:
    return []
  out = []
  for name in names:
    if name.startswith(base) and name[len(base):].isdigit() and not _pid_running(int(name[len(base):])):
      out.append(os.path.join(parent, name))
  return sorted(out)


def _remove(path: str) -> None:
  if os.path.isdir(path) and not os.path.islink(path):
    shutil.rmtree(path, ignore_errors=True)
  else:
    try:
      os.unlink(path)
    except FileNotFoundError:
      pass


def recover(path: str) -> None:
  """Undo what a killed run left beside ``path``: put a lone ``.old-*`` back, remove temporaries."""
  path = os.path.abspath(path)
  olds = _stale_siblings(path, _old_prefix(path))
  if olds and not os.path.lexists(path):
    os.rename(olds.pop(), path)
  for stale in olds + _stale_siblings(path, _tmp_prefix(path)):
    _remove(stale)


def _check_parent(path: str, flag: str) -> None:
  parent = os.path.dirname(path)
  if not os.path.isdir(parent):
    what = "is a file" if os.path.exists(parent) else "does not exist"
    raise OutputError(f"{flag} {path}: its parent folder {parent} {what}; create it first or choose another {flag}")
  if not os.access(parent, os.W_OK | os.X_OK):
    raise OutputError(f"{flag} {path}: the folder {parent} is not writable; choose another {flag}")


def check_out_dir(path: str, *, marker: str, flag: str = "--out", what: str = "output") -> str:
  """The absolute ``path`` once it may be (re)written as a whole; else :class:`OutputError`.

  Also removes the leftovers of killed runs (module docstring, step 4).
  """
  path = os.path.abspath(os.path.expanduser(path))
  _check_parent(path, flag)
  recover(path)
  if os.path.lexists(path) and not os.path.isdir(path):
    raise OutputError(f"{flag} {path}: is a file, not a folder; choose a folder path (it is created)")
  if os.path.isdir(path):
    entries = os.listdir(path)
    if entries and marker not in entries:
      raise OutputError(f"{flag} {path}: the folder exists and is not a {what} ({len(entries)} entries, no"
                        f" {marker}); choose a new folder, or empty it (an earlier {what} is replaced as a whole)")
    if not os.access(path, os.W_OK | os.X_OK):
      raise OutputError(f"{flag} {path}: the folder is not writable; choose another {flag}")
  return path


def _fsync_tree(root: str) -> None:
  for d, _, files in os.walk(root):
    for f in files:
      fd = os.open(os.path.join(d, f), os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)


def _exchange(a: str, b: str) -> bool:
  """``renameat2(a, b, RENAME_EXCHANGE)``: True when done, False when the system cannot."""
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn = libc.renameat2
  except (OSError, AttributeError):
    return False
  at_fdcwd, rename_exchange = -100, 2
  if fn(at_fdcwd, a.encode(), at_fdcwd, b.encode(), rename_exchange) == 0:
    return True
  err = ctypes.get_errno()
  if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
    return False
  raise OSError(err, os.strerror(err), b)


def publish_dir(path: str, build: Callable[[str], None], *, marker: str, marker_text: str) -> None:
  """Run ``build(tmp_dir)`` (writes the result's files), then swap it in as ``path`` (module docstring).

  ``path``: from :func:`check_out_dir`. On any exception the temporary folder is removed and ``path`` is
  left as it was.
  """
  tmp = f"{_tmp_prefix(path)}{os.getpid()}"
  _remove(tmp)
  os.mkdir(tmp)
  try:
    build(tmp)
    with open(os.path.join(tmp, marker), "w", encoding="utf-8") as f:
      f.write(marker_text)
    for d, dirs, files in os.walk(tmp):
      for name in files:
        os.chmod(os.path.join(d, name), 0o644)
      for name in dirs:
        os.chmod(os.path.join(d, name), 0o755)
    os.chmod(tmp, 0o755)
    _fsync_tree(tmp)
  except BaseException:
    _remove(tmp)
    raise
  if not os.path.lexists(path):
    os.rename(tmp, path)
  elif _exchange(tmp, path):
    _remove(tmp)  # the old tree, now under the temporary name
  else:
    old = f"{_old_prefix(path)}{os.getpid()}"
    os.rename(path, old)
    os.rename(tmp, path)
    _remove(old)


def check_out_file(path: str, *, flag: str) -> str:
  """The absolute ``path`` once a file may be written there; else :class:`OutputError`."""
  path = os.path.abspath(os.path.expanduser(path))
  _check_parent(path, flag)
  for stale in _stale_siblings(path, _tmp_prefix(path)):
    _remove(stale)
  if os.path.isdir(path):
    raise OutputError(f"{flag} {path}: is a folder; give a file path")
  if os.path.exists(path) and not os.access(path, os.W_OK):
    raise OutputError(f"{flag} {path}: the file is not writable; choose another {flag}")
  return path


def publish_file(path: str, text: str) -> None:
  """Write ``text`` to ``path`` (from :func:`check_out_file`) all at once: temporary sibling, fsync, replace."""
  tmp = f"{_tmp_prefix(path)}{os.getpid()}"
  try:
    with open(tmp, "w", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  except BaseException:
    _remove(tmp)
    raise
