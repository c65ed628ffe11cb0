"""``maxtext-nvfp4 prepare-sft-data``: builds from a tiny prepare-data-like source, reuses an up-to-date output, and
refuses (one line, exit code 2, nothing written or deleted) an --out it did not write -- the prepare-data dataset
it reads included -- and manifests that are not JSON."""

import json
import os

import pytest

from maxtext_nvfp4.tools.cli import main as cli

FUNCS = '''
def add(a, b):
    """Add two numbers and return the sum of them."""
    total = a + b
    if total < 0:
        total = -total
    return total


def scale(x, factor=2):
    """Scale x by a factor."""
    result = x * factor
    for _ in range(3):
        result = result + 0
    return result
'''


@pytest.fixture
def source(tmp_path):
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

  d = tmp_path / "src"
  d.mkdir()
  for split in ("train", "eval"):
    pq.write_table(pa.table({"text": [FUNCS]}), str(d / f"{split}-00000-of-00001.parquet"))
  (d / "manifest.json").write_text(json.dumps({"content_sha256": "abc"}))
  return d


def _refused(capsys, argv, words):
  assert cli(["prepare-sft-data", *argv]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("maxtext-nvfp4 prepare-sft-data: error:") and "Traceback" not in err[0]
  assert all(w in err[0] for w in words), err[0]


def test_builds_then_reuses(tmp_path, source, capsys):
  out = tmp_path / "sft"
  assert cli(["prepare-sft-data", "--source", str(source), "--out", str(out)]) == 0
  made = json.loads((out / "manifest.json").read_text())
  assert made["examples"] == {"train": 2, "eval": 2} and made["source_content_sha256"] == "abc"
  capsys.readouterr()
  assert cli(["prepare-sft-data", "--source", str(source), "--out", str(out)]) == 0
  assert "is up to date" in capsys.readouterr().err


def test_an_out_it_did_not_write_is_refused_and_left_alone(tmp_path, source, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  # the dataset it reads (a manifest.json of prepare-data's): it used to be deleted and replaced
  _refused(capsys, ["--source", str(source), "--out", str(source)], ["not a prepare-sft-data output"])
  assert sorted(os.listdir(source)) == ["eval-00000-of-00001.parquet", "manifest.json", "train-00000-of-00001.parquet"]
  mine = tmp_path / "mine"
  mine.mkdir()
  (mine / "notes.txt").write_text("keep me")
  # checked before the default --source (data/embedded) is built: nothing appears in the working directory
  _refused(capsys, ["--out", str(mine)], ["--out", "not a prepare-sft-data output"])
  (tmp_path / "afile").write_text("x")
  _refused(capsys, ["--source", str(source), "--out", str(tmp_path / "afile")], ["is a file, not a folder"])
  bad = tmp_path / "bad"
  bad.mkdir()
  (bad / "manifest.json").write_text("{half")
  _refused(capsys, ["--source", str(source), "--out", str(bad)], ["manifest.json: not a readable manifest"])
  (source / "manifest.json").write_text("[1, 2")
  _refused(capsys, ["--source", str(source), "--out", str(tmp_path / "new")], ["--source", "prepare-data"])
  assert not (tmp_path / "data").exists() and not (tmp_path / "new").exists()
  assert (mine / "notes.txt").read_text() == "keep me" and os.listdir(mine) == ["notes.txt"]
