"""``tools/outputs.py``: an export folder / JSON file appears whole or not at all.

A child process (no JAX, no MaxText: milliseconds) publishes a new export over an earlier one and is
SIGKILLed at a chosen point (mid-write, before the swap, after the swap, between the fallback's two
renames, during the old tree's removal); then the folder must hold the old export or the new one,
complete, and the next run's up-front check must leave no hidden sibling behind.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys

import pytest

from maxtext_nvfp4.tools import outputs

MARKER = "maxtext_nvfp4_export.json"
CHILD = r'''
import os, shutil, signal, sys
from maxtext_nvfp4.tools import outputs
out, point = sys.argv[1], sys.argv[2]
os.umask(0o077)  # the published files must still be 0644
die = lambda: os.kill(os.getpid(), signal.SIGKILL)

def build(tmp):
  with open(os.path.join(tmp, "model.safetensors"), "wb") as f:
    f.write(b"N" * 200_000)
    if point == "mid-write":
      f.flush(); die()
  os.mkdir(os.path.join(tmp, "sub"))
  with open(os.path.join(tmp, "config.json"), "w") as f:
    f.write("new")

real_exchange, real_rename, real_rmtree = outputs._exchange, os.rename, shutil.rmtree
if point == "before-swap":
  outputs._exchange = lambda a, b: die()
elif point == "after-swap":
  outputs._exchange = lambda a, b: (real_exchange(a, b), die())
elif point == "between-renames":
  outputs._exchange = lambda a, b: False
  calls = []
  def rename(a, b):
    calls.append(a)
    if len(calls) == 2:
      die()
    real_rename(a, b)
  os.rename = rename
elif point == "mid-cleanup":
  def rmtree(path, *a, **k):
    os.unlink(os.path.join(path, "model.safetensors")); die()
  shutil.rmtree = rmtree
elif point == "fallback":
  outputs._exchange = lambda a, b: False
path = outputs.check_out_dir(out, marker="maxtext_nvfp4_export.json")
outputs.publish_dir(path, build, marker="maxtext_nvfp4_export.json", marker_text='{"v": "new"}')
'''


def _old_export(path):
  os.makedirs(path)
  with open(os.path.join(path, "model.safetensors"), "wb") as f:
    f.write(b"O" * 100_000)
  for name in ("model-00001-of-00002.safetensors", "model.safetensors.index.json"):  # stale shards of an older layout
    with open(os.path.join(path, name), "w", encoding="utf-8") as f:
      f.write("stale")
  with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
    f.write("old")
  with open(os.path.join(path, MARKER), "w", encoding="utf-8") as f:
    f.write('{"v": "old"}')


def _state(path):
  """"old" / "new" when ``path`` holds exactly that complete export; else a description of the mess."""
  if not os.path.isdir(path):
    return "missing"
  names = sorted(os.listdir(path))
  with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
    config = f.read()
  size = os.path.getsize(os.path.join(path, "model.safetensors"))
  if config == "old" and size == 100_000 and names == sorted(
      ["model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "config.json", MARKER]):
    return "old"
  if config == "new" and size == 200_000 and names == sorted(["model.safetensors", "sub", "config.json", MARKER]):
    return "new"
  return f"mixed: {names} config={config} size={size}"


def _siblings(tmp_path):
  return sorted(n for n in os.listdir(tmp_path) if n.startswith("."))


@pytest.mark.parametrize("point, after_kill, after_next_check", [
    ("mid-write", "old", "old"), ("before-swap", "old", "old"), ("after-swap", "new", "new"),
    ("mid-cleanup", "new", "new"), ("between-renames", "missing", "old"), ("none", "new", "new"),
    ("fallback", "new", "new")])
def test_sigkill_at_any_point_leaves_the_old_export_or_the_new_one(tmp_path, point, after_kill, after_next_check):
  out = str(tmp_path / "hf")
  _old_export(out)
  p = subprocess.run([sys.executable, "-c", CHILD, out, point], capture_output=True, text=True, timeout=60)
  assert p.returncode == (0 if point in ("none", "fallback") else -signal.SIGKILL), p.stderr[-2000:]
  assert _state(out) == after_kill
  if point in ("none", "fallback"):
    assert _siblings(tmp_path) == []
  outputs.check_out_dir(out, marker=MARKER)  # what the next export does first
  assert _state(out) == after_next_check and _siblings(tmp_path) == []
  if after_next_check == "new":
    for d, dirs, files in os.walk(out):
      assert all(stat.S_IMODE(os.stat(os.path.join(d, f)).st_mode) == 0o644 for f in files), files
      assert all(stat.S_IMODE(os.stat(os.path.join(d, s)).st_mode) == 0o755 for s in dirs)


def test_a_running_exports_temporary_folder_is_not_removed(tmp_path):
  out = str(tmp_path / "hf")
  busy = tmp_path / f".hf.tmp-{os.getppid()}"  # a live process (our parent) owns it
  busy.mkdir()
  outputs.check_out_dir(out, marker=MARKER)
  assert busy.is_dir()


@pytest.mark.parametrize("setup, words", [
    ("file", ["is a file, not a folder"]), ("no-parent", ["parent folder", "does not exist"]),
    ("foreign", ["exists and is not a", "no maxtext_nvfp4_export.json"]), ("read-only", ["not writable"])])
def test_out_dir_refusals_are_one_line_and_touch_nothing(tmp_path, monkeypatch, setup, words):
  out = tmp_path / "hf"
  if setup == "file":
    out.write_text("x")
  elif setup == "no-parent":
    out = tmp_path / "nope" / "hf"
  elif setup == "foreign":
    out.mkdir()
    (out / "notes.txt").write_text("mine")
  elif setup == "read-only":  # simulated: the tests may run as root, for whom every folder is writable
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if str(p) == str(tmp_path) else real(p, m))
  before = sorted(os.walk(tmp_path))
  with pytest.raises(outputs.OutputError) as e:
    outputs.check_out_dir(str(out), marker=MARKER, what="maxtext-nvfp4 export")
  assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
  assert sorted(os.walk(tmp_path)) == before


def test_an_empty_folder_and_an_earlier_export_are_accepted(tmp_path):
  (tmp_path / "empty").mkdir()
  assert outputs.check_out_dir(str(tmp_path / "empty"), marker=MARKER) == str(tmp_path / "empty")
  _old_export(str(tmp_path / "ours"))
  assert outputs.check_out_dir(str(tmp_path / "ours"), marker=MARKER) == str(tmp_path / "ours")


def test_a_failed_build_leaves_the_old_export_and_no_temporary(tmp_path):
  out = str(tmp_path / "hf")
  _old_export(out)

  def build(tmp):
    with open(os.path.join(tmp, "model.safetensors"), "wb") as f:
      f.write(b"partial")
    raise OSError(28, "No space left on device")

  with pytest.raises(OSError):
    outputs.publish_dir(out, build, marker=MARKER, marker_text="{}")
  assert _state(out) == "old" and _siblings(tmp_path) == []


def test_json_file_is_written_whole_0644_and_checked_first(tmp_path):
  path = outputs.check_out_file(str(tmp_path / "r.json"), flag="--json")
  outputs.publish_file(path, json.dumps({"a": 1}))
  assert json.loads((tmp_path / "r.json").read_text()) == {"a": 1}
  assert stat.S_IMODE(os.stat(path).st_mode) == 0o644 and _siblings(tmp_path) == []
  for bad, word in ((tmp_path / "nodir" / "r.json", "does not exist"), (tmp_path, "is a folder")):
    with pytest.raises(outputs.OutputError) as e:
      outputs.check_out_file(str(bad), flag="--json")
    assert word in str(e.value) and "--json" in str(e.value)
