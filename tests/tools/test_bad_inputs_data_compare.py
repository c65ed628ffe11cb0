"""Bad inputs to ``compare`` and ``prepare-data``: exit code 2, ONE line on stderr naming what is wrong and
what to do, no traceback, nothing on stdout, nothing written (and nothing of a previous output touched).

Table-driven, in-process (``maxtext-nvfp4``'s ``main`` with capsys): each row costs milliseconds.
"""

from __future__ import annotations

import gzip
import json
import os
import pathlib

import pytest

from maxtext_nvfp4.tools.cli import main as cli


def _records(n, first=0):
  return "".join(json.dumps({"step": float(s), "learning/loss": 3.0 - 0.01 * s, "perf/step_time_seconds": 1.0})
                 + "\n" for s in range(first, first + n))


def _file(tmp, name, content):
  path = tmp / name
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(content if isinstance(content, bytes) else content.encode())
  return str(path)


def _folder(tmp, name, files):
  for f, content in files.items():
    _file(tmp, f"{name}/{f}", content)
  return str(tmp / name)


def _fifo(tmp, name):
  path = tmp / name
  os.mkfifo(path)
  return str(path)


def _unreadable(tmp, monkeypatch, name, content=b""):
  """A file reading refuses (as for a non-root user after chmod 000; the tests may run as root)."""
  path = _file(tmp, name, content)
  real_access, real_read = os.access, pathlib.Path.read_text

  def access(p, mode, *a, **k):
    return False if os.path.abspath(p) == path else real_access(p, mode, *a, **k)

  def read_text(self, *a, **k):
    if str(self.absolute()) == path:
      raise PermissionError(13, "Permission denied", str(self))
    return real_read(self, *a, **k)

  monkeypatch.setattr(os, "access", access)
  monkeypatch.setattr(pathlib.Path, "read_text", read_text)
  return path


GOOD = "good.jsonl"

# (id, argv builder (tmp, monkeypatch) -> argv after "compare", expected text in the error line)
COMPARE_ROWS = [
    ("missing path", lambda t, m: [_file(t, GOOD, _records(30)), str(t / "nope.jsonl")], "no such file or directory"),
    ("missing NAME=path", lambda t, m: [_file(t, GOOD, _records(30)), f"nv={t / 'nope'}"], "no such file"),
    ("empty file", lambda t, m: [_file(t, GOOD, _records(30)), _file(t, "e.jsonl", "")], "is empty"),
    ("blank lines only", lambda t, m: [_file(t, GOOD, _records(30)), _file(t, "e.jsonl", "\n \n")], "is empty"),
    ("binary file", lambda t, m: [_file(t, GOOD, _records(30)), _file(t, "b.jsonl", bytes(range(256)) * 40)],
     "no training records"),
    ("bad JSON lines", lambda t, m: [_file(t, GOOD, _records(30)), _file(t, "j.jsonl", '{"step": 1,\n[1, 2]\nnope\n')],
     "no training records (JSON objects with 'step' and 'learning/loss') in"),
    ("eval records only", lambda t, m: [_file(t, GOOD, _records(30)),
                                        _file(t, "ev.jsonl", '{"step": 0, "eval/avg_loss": 1.0}\n')],
     "no training records"),
    ("wrong suffix (an image)", lambda t, m: [_file(t, GOOD, _records(30)), _file(t, "loss.png", b"\x89PNG\r\n\x1a\n")],
     "no training records"),
    ("unreadable file", lambda t, m: [_file(t, GOOD, _records(30)), _unreadable(t, m, "u.jsonl", _records(3).encode())],
     "cannot read (Permission denied); check its permissions"),
    ("not a regular file", lambda t, m: [_file(t, GOOD, _records(30)), _fifo(t, "fifo.jsonl")],
     "not a regular file"),
    ("directory without metrics", lambda t, m: [_file(t, GOOD, _records(30)), _file(t, "run/config.yml", "a: 1\n")
                                                and str(t / "run")], "no metrics file (*.jsonl or metrics*.txt)"),
    ("directory with two metrics files", lambda t, m: [_file(t, GOOD, _records(30)), _file(t, "r/a.jsonl", _records(3))
                                                       and _file(t, "r/b.jsonl", _records(3)) and str(t / "r")],
     "several metrics files"),
    ("no shared step", lambda t, m: [_file(t, GOOD, _records(30)), _file(t, "late.jsonl", _records(5, first=100))],
     "shares no step with the baseline"),
    ("--out is a file", lambda t, m: [_file(t, GOOD, _records(30)), "--out", _file(t, "out.txt", "keep me")],
     "is a file, not a folder"),
    ("--out under a file", lambda t, m: [_file(t, GOOD, _records(30)), "--out",
                                         os.path.join(_file(t, "out.txt", "keep me"), "sub")],
     "its parent folder"),
    # compare writes only into its own folder: a user's folder (here with a report.md of theirs) is refused
    ("--out a user's folder", lambda t, m: [_file(t, GOOD, _records(30)), "--out",
                                            _folder(t, "mine", {"report.md": "keep me", "notes.txt": "me too"})],
     "exists and is not a maxtext-nvfp4 compare output"),
    ("--tolerance negative", lambda t, m: [_file(t, GOOD, _records(30)), "--tolerance", "-1"],
     "argument --tolerance: -1 is out of range: need a finite number >= 0"),
    ("--tolerance nan", lambda t, m: [_file(t, GOOD, _records(30)), "--tolerance", "nan"], "argument --tolerance: nan"),
    ("--tolerance text", lambda t, m: [_file(t, GOOD, _records(30)), "--tolerance", "abc"],
     "argument --tolerance: 'abc' is not a finite number"),
    ("--warmup negative", lambda t, m: [_file(t, GOOD, _records(30)), "--warmup", "-2"], "argument --warmup"),
    ("--warmup fraction", lambda t, m: [_file(t, GOOD, _records(30)), "--warmup", "1.5"], "is not an integer"),
    ("--smooth 0", lambda t, m: [_file(t, GOOD, _records(30)), "--smooth", "0"], "need an integer >= 1"),
    ("--converged-from 1", lambda t, m: [_file(t, GOOD, _records(30)), "--converged-from", "1"],
     "need a finite number >= 0 and < 1"),
    ("unknown flag", lambda t, m: [_file(t, GOOD, _records(30)), "--tolerence", "0.1"], "unrecognized arguments"),
    ("no RUN", lambda t, m: [], "the following arguments are required: RUN"),
]


def _check_one_line(capsys, rc, needle, prog):
  cap = capsys.readouterr()
  lines = [ln for ln in cap.err.splitlines() if ln.strip()]
  assert rc == 2, cap
  assert len(lines) == 1 and "Traceback" not in cap.err, cap.err
  assert lines[0].startswith(f"{prog}: error: ") and needle in lines[0], lines[0]
  assert cap.out == ""
  return lines[0]


def _tree(path):
  return sorted((str(p.relative_to(path)), p.read_bytes() if p.is_file() else None)
                for p in pathlib.Path(path).rglob("*") if not p.is_fifo())


@pytest.mark.parametrize("argv, needle", [pytest.param(a, n, id=i) for i, a, n in COMPARE_ROWS])
def test_compare_bad_input(tmp_path, monkeypatch, capsys, argv, needle):
  monkeypatch.chdir(tmp_path)  # the default --out (./compare_out) must not appear either
  args = argv(tmp_path, monkeypatch)
  before = _tree(tmp_path)
  rc = cli(["compare", *args] + ([] if "--out" in args or not args else ["--out", str(tmp_path / "o")]))
  _check_one_line(capsys, rc, needle, "maxtext-nvfp4 compare")
  assert _tree(tmp_path) == before  # nothing written, nothing changed


def _jsonl(n=12, field="text"):
  return "".join(json.dumps({field: f"document number {i} with some words"}) + "\n" for i in range(n))


# (id, argv builder (tmp, monkeypatch) -> argv after "prepare-data", expected text in the error line)
DATA_ROWS = [
    ("missing input", lambda t, m: ["--input", str(t / "nope.jsonl")], "does not exist; check the --input path"),
    ("empty file", lambda t, m: ["--input", _file(t, "in/e.jsonl", "")], "no text documents"),
    ("blank text file", lambda t, m: ["--input", _file(t, "in/b.txt", "\n \n")], "no text documents"),
    ("binary file", lambda t, m: ["--input", _file(t, "in/b.txt", b"\xff\xfe\x00\x01" * 100)], "not UTF-8 text"),
    ("unreadable file", lambda t, m: ["--input", _unreadable(t, m, "in/u.jsonl", _jsonl().encode())],
     "is not readable; check its permissions"),
    ("not a regular file", lambda t, m: ["--input", _fifo(t, "in.fifo")], "is not a regular file or directory"),
    ("empty directory", lambda t, m: ["--input", str(t / "in") if (t / "in").mkdir() is None else ""],
     "contains no files"),
    ("bad JSON line", lambda t, m: ["--input", _file(t, "in/j.jsonl", _jsonl() + "{nope\n")],
     "j.jsonl:13: not a JSON line"),
    ("JSON without the field", lambda t, m: ["--input", _file(t, "in/f.jsonl", _jsonl(field="body"))],
     "no string field 'text'"),
    ("wrong --text-field", lambda t, m: ["--input", _file(t, "in/f.jsonl", _jsonl()), "--text-field", "content"],
     "no string field 'content'"),
    ("broken gzip", lambda t, m: ["--input", _file(t, "in/g.json.gz", b"not gzip at all")], "not a valid gzip"),
    ("gzip of binary", lambda t, m: ["--input", _file(t, "in/g.jsonl.gz", gzip.compress(b"\xff" * 50))], "not UTF-8"),
    ("wrong suffix .parquet", lambda t, m: ["--input", _file(t, "in/x.parquet", b"PAR1....PAR1")],
     ".parquet files are not read; convert it to JSON lines"),
    ("wrong suffix .zst in a directory", lambda t, m: ["--input", _file(t, "in/a.jsonl", _jsonl())
                                                       and _file(t, "in/b.json.zst", b"(\xb5/\xfd") and str(t / "in")],
     ".zst files are not read"),
    ("--out is a file", lambda t, m: ["--input", _file(t, "in/a.jsonl", _jsonl()), "--out",
                                      _file(t, "out.txt", "keep me")], "exists and is not a directory"),
    ("--out holds other files", lambda t, m: ["--input", _file(t, "in/a.jsonl", _jsonl()), "--out",
                                              os.path.dirname(_file(t, "mine/notes.md", "keep me"))],
     "holds files prepare-data did not write (notes.md) and the new dataset replaces the directory"),
    ("--out inside the input directory", lambda t, m: ["--input", os.path.dirname(_file(t, "in/a.jsonl", _jsonl())),
                                                       "--out", str(t / "in" / "ds")], "is inside the input directory"),
    ("input inside --out", lambda t, m: ["--input", _file(t, "ds/manifest.json", _jsonl()), "--out", str(t / "ds")],
     "which the new dataset replaces"),
    ("--out under a file", lambda t, m: ["--input", _file(t, "in/a.jsonl", _jsonl()), "--out",
                                         os.path.join(_file(t, "f.txt", "x"), "ds")], "is not a writable directory"),
    ("--shard-mb -1", lambda t, m: ["--shard-mb", "-1"], "--shard-mb=-1 must be > 0"),
    ("--shard-mb nan", lambda t, m: ["--shard-mb", "nan"], "--shard-mb=nan must be > 0"),
    ("--max-mb inf", lambda t, m: ["--max-mb", "inf"], "--max-mb=inf must be a finite number"),
    ("--max-mb text", lambda t, m: ["--max-mb", "lots"], "argument --max-mb: invalid float value: 'lots'"),
    ("--max-doc-kb 0", lambda t, m: ["--max-doc-kb", "0"], "--max-doc-kb=0 must be > 0"),
    ("--max-file-kb -5", lambda t, m: ["--max-file-kb", "-5"], "--max-file-kb=-5 must be > 0"),
    ("--eval-fraction 1", lambda t, m: ["--eval-fraction", "1"], "--eval-fraction=1 must be in (0, 1)"),
    ("--eval-fraction 0", lambda t, m: ["--eval-fraction", "0"], "--eval-fraction=0 must be in (0, 1)"),
    ("--vocab-size 100", lambda t, m: ["--tokenizer", "bpe", "--vocab-size", "100"], "--vocab-size=100 must be in [259, 1048576]"),
    ("--text-field empty", lambda t, m: ["--text-field", ""], "--text-field must name the JSON field"),
    ("--tokenizer unknown", lambda t, m: ["--tokenizer", "gpt2"], "argument --tokenizer: invalid choice: 'gpt2'"),
    ("unknown flag", lambda t, m: ["--max-mbs", "1"], "unrecognized arguments"),
    ("--input without a path", lambda t, m: ["--input"], "argument --input/-i: expected at least one argument"),
]


@pytest.mark.parametrize("argv, needle", [pytest.param(a, n, id=i) for i, a, n in DATA_ROWS])
def test_prepare_data_bad_input(tmp_path, monkeypatch, capsys, argv, needle):
  monkeypatch.chdir(tmp_path)  # the default --out (data/...) must not appear either
  args = argv(tmp_path, monkeypatch)
  before = _tree(tmp_path)
  rc = cli(["prepare-data", "--quiet", "--tokenizer", "none", *args]
           + ([] if "--out" in args else ["--out", str(tmp_path / "o")]))
  _check_one_line(capsys, rc, needle, "maxtext-nvfp4 prepare-data")
  assert _tree(tmp_path) == before  # nothing written (no dataset, no build directory), nothing changed


def test_bad_rebuild_leaves_the_previous_dataset_untouched(tmp_path, capsys):
  """A previous dataset in --out survives a rebuild that fails on its input (the failure comes after
  reading started: a bad line at the end)."""
  src = _file(tmp_path, "in/a.jsonl", _jsonl(40))
  out = str(tmp_path / "ds")
  assert cli(["prepare-data", "--quiet", "--tokenizer", "none", "--input", src, "--out", out]) == 0
  capsys.readouterr()
  before = _tree(tmp_path / "ds")
  bad = _file(tmp_path, "in2/b.jsonl", _jsonl(40) + "{truncated")
  rc = cli(["prepare-data", "--quiet", "--tokenizer", "none", "--input", bad, "--out", out])
  _check_one_line(capsys, rc, "b.jsonl:41: not a JSON line", "maxtext-nvfp4 prepare-data")
  assert _tree(tmp_path / "ds") == before
  assert sorted(os.listdir(tmp_path)) == ["ds", "in", "in2"]  # no build directory left behind
