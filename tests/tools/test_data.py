"""prepare-data: embedded corpus, JSONL / json.gz / text inputs, idempotence, bad inputs, MaxText tokenizer."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from maxtext_nvfp4.tools import data

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _rows(out: str, split: str) -> list[str]:
  files = sorted(f for f in os.listdir(out) if f.startswith(split + "-") and f.endswith(".parquet"))
  assert files, f"no {split} parquet files in {out}"
  rows = []
  for f in files:
    t = pq.read_table(os.path.join(out, f))
    assert t.column_names == ["text"]
    rows += t.column("text").to_pylist()
  return rows


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("embedded"))
  opts = data.PrepareOptions(out=out, max_mb=0.4, vocab_size=512)
  manifest, rebuilt = data.prepare(opts, progress=False, log=lambda m: None)
  return opts, manifest, rebuilt


def test_embedded_corpus_is_stdlib_sources_with_manifest(embedded):
  opts, m, rebuilt = embedded
  assert rebuilt
  train, evals = _rows(opts.out, "train"), _rows(opts.out, "eval")
  assert train and evals
  # Every document is the exact content of a listed stdlib file, in the manifest's (sorted) order.
  stdlib = data.stdlib_dir()
  paths = [r["path"] for r in m["inputs"]]
  # Deterministic order: a top-down walk with sorted directories and sorted file names.
  assert paths == sorted(paths, key=lambda p: (os.path.dirname(p).split(os.sep), os.path.basename(p)))
  assert len(paths) > 5 and all(p.endswith(".py") for p in paths)
  contents, content_hash = {}, hashlib.sha256()
  for rec in m["inputs"]:
    assert not any(part in ("test", "tests") for part in rec["path"].split(os.sep)), rec["path"]
    with open(os.path.join(stdlib, rec["path"]), "rb") as f:
      raw = f.read()
    assert hashlib.sha256(raw).hexdigest() == rec["sha256"]
    contents[raw.decode()] = rec["path"]
    content_hash.update(hashlib.sha256(raw.decode().encode()).hexdigest().encode() + b"\n")  # one doc per file
  assert set(train) | set(evals) == set(contents)
  assert not set(train) & set(evals)
  # Size cap respected; totals recorded.
  total = sum(len(d.encode()) for d in train + evals)
  assert total <= 0.4e6 and m["source"]["bytes_used"] == total
  assert m["splits"]["train"]["documents"] == len(train) and m["splits"]["eval"]["documents"] == len(evals)
  # The split rule of the docstring.
  for d in evals:
    assert int(hashlib.sha256(d.encode()).hexdigest()[:8], 16) / 2**32 < opts.eval_fraction or len(evals) == 1
  # Content hash = sha256 over the documents' sha256 hex digests, one line each, in input order.
  assert m["source"]["content_sha256"] == content_hash.hexdigest()
  # Output files hashed in the manifest.
  for e in m["splits"]["train"]["files"] + m["splits"]["eval"]["files"]:
    with open(os.path.join(opts.out, e["name"]), "rb") as f:
      assert hashlib.sha256(f.read()).hexdigest() == e["sha256"]


def test_embedded_is_deterministic_and_idempotent(embedded, tmp_path):
  opts, m, _ = embedded
  # Same options again: nothing rebuilt, same manifest.
  m2, rebuilt = data.prepare(opts, progress=False, log=lambda msg: None)
  assert not rebuilt and m2 == m
  # A fresh directory gives byte-identical parquet files (deterministic order/split/shards).
  other = data.PrepareOptions(**{**opts.__dict__, "out": str(tmp_path / "again")})
  m3, rebuilt3 = data.prepare(other, progress=False, log=lambda msg: None)
  assert rebuilt3
  assert [e["sha256"] for e in m3["splits"]["train"]["files"]] == [e["sha256"] for e in m["splits"]["train"]["files"]]
  assert m3["source"]["content_sha256"] == m["source"]["content_sha256"]
  # Changed options or a damaged output file trigger a rebuild.
  _, rebuilt4 = data.prepare(data.PrepareOptions(**{**other.__dict__, "eval_fraction": 0.2}), progress=False,
                             log=lambda msg: None)
  assert rebuilt4
  victim = os.path.join(other.out, "eval-00000-of-00001.parquet")
  with open(victim, "ab") as f:
    f.write(b"x")
  _, rebuilt5 = data.prepare(data.PrepareOptions(**{**other.__dict__, "eval_fraction": 0.2}), progress=False,
                             log=lambda msg: None)
  assert rebuilt5


def test_bpe_tokenizer_loads_in_maxtext(embedded):
  """MaxText's own build_tokenizer (tokenizer_type=huggingface) loads the dir and honours add_bos/add_eos."""
  from maxtext.input_pipeline import tokenizer as mt_tokenizer  # pylint: disable=import-outside-toplevel

  _, m, _ = embedded
  tok = m["tokenizer"]
  assert tok["type"] == "huggingface" and tok["vocab_size"] == 512
  text = "def f(x):\n  return x + 1\n"
  with_specials = mt_tokenizer.build_tokenizer(tok["path"], "huggingface", True, True, "")
  plain = mt_tokenizer.build_tokenizer(tok["path"], "huggingface", False, False, "")
  ids = plain.encode(text)
  assert with_specials.encode(text) == [tok["bos_id"]] + ids + [tok["eos_id"]]
  assert with_specials.pad_id == tok["pad_id"] == 0
  assert max(ids) < tok["vocab_size"] and plain.decode(ids) == text
  # The manifest's MaxText overrides point at these files.
  args = dict(a.split("=", 1) for a in m["maxtext_args"])
  assert args["dataset_type"] == "grain" and args["grain_file_type"] == "parquet"
  assert args["tokenizer_path"] == tok["path"] and int(args["vocab_size"]) >= tok["vocab_size"]


def test_jsonl_and_json_gz_inputs(tmp_path):
  src = tmp_path / "c4"
  src.mkdir()
  docs_a = [f"document {i} about the weather in town {i % 7}." for i in range(30)]
  docs_b = [f"gzipped line {i}: " + "lorem ipsum " * (i % 5 + 1) for i in range(25)]
  with open(src / "c4-train.00000-of-01024.jsonl", "w", encoding="utf-8") as f:
    for i, d in enumerate(docs_a):
      f.write(json.dumps({"text": d, "timestamp": "2019", "url": f"http://x/{i}"}) + "\n")
    f.write("\n")  # blank lines are ignored
  with gzip.open(src / "c4-train.00001-of-01024.json.gz", "wt", encoding="utf-8") as f:
    for d in docs_b:
      f.write(json.dumps({"text": d}) + "\n")
  (src / "notes.txt").write_text("plain text line 1\nline 2\n", encoding="utf-8")
  out = tmp_path / "out"
  m, rebuilt = data.prepare(data.PrepareOptions(inputs=(str(src),), out=str(out), tokenizer="none", eval_fraction=0.1),
                            progress=False, log=lambda msg: None)
  assert rebuilt and m["tokenizer"] is None
  train, evals = _rows(str(out), "train"), _rows(str(out), "eval")
  assert sorted(train + evals) == sorted(docs_a + docs_b + ["plain text line 1\nline 2\n"])
  assert len(evals) >= 1 and len(m["inputs"]) == 3
  assert all(os.path.isabs(r["path"]) for r in m["inputs"])


def test_llama3_tokenizer_is_copied_next_to_the_data(tmp_path):
  src = tmp_path / "in.jsonl"
  src.write_text("\n".join(json.dumps({"text": f"doc {i}"}) for i in range(10)) + "\n", encoding="utf-8")
  m, _ = data.prepare(data.PrepareOptions(inputs=(str(src),), out=str(tmp_path / "o"), tokenizer="llama3"),
                      progress=False, log=lambda msg: None)
  tok = m["tokenizer"]
  assert tok["type"] == "tiktoken" and tok["path"] == str(tmp_path / "o" / "tokenizer_llama3.tiktoken")
  asset = os.path.join(data.maxtext_tokenizer_assets(), "tokenizer_llama3.tiktoken")
  with open(asset, "rb") as a, open(tok["path"], "rb") as b:
    assert a.read() == b.read()
  assert "vocab_size=128256" in m["maxtext_args"]


def _cli(args, cwd):
  return subprocess.run([sys.executable, "-m", "maxtext_nvfp4", "prepare-data", "--quiet", *args], cwd=cwd,
                        capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "name, content, expect",
    [
        ("missing.jsonl", None, "does not exist"),
        ("empty.jsonl", b"", "no text documents"),
        ("blank.txt", b"\n\n  \n", "no text documents"),
        ("latin1.txt", "caf\xe9 cr\xe8me\n".encode("latin-1"), "not UTF-8"),
        ("broken.json.gz", b"this is not gzip", "not a valid gzip"),
        ("badline.jsonl", b'{"text": "ok"}\n{not json\n', "not a JSON line"),
        ("nofield.jsonl", b'{"body": "x"}\n', "no string field 'text'"),
    ],
)
def test_bad_inputs_fail_with_one_line_and_exit_2(tmp_path, name, content, expect):
  path = tmp_path / name
  if content is not None:
    path.write_bytes(content)
  r = _cli(["--input", str(path), "--out", str(tmp_path / "out"), "--tokenizer", "none"], cwd=tmp_path)
  assert r.returncode == 2, r.stderr
  lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
  assert len(lines) == 1 and lines[0].startswith("maxtext-nvfp4 prepare-data: error:") and expect in lines[0], r.stderr
  assert not (tmp_path / "out" / "manifest.json").exists()


def test_cli_default_output_is_data_embedded(tmp_path):
  r = _cli(["--max-mb", "0.15", "--vocab-size", "300"], cwd=tmp_path)
  assert r.returncode == 0, r.stderr
  m = json.loads((tmp_path / "data" / "embedded" / "manifest.json").read_text())
  assert m["out"] == str(tmp_path / "data" / "embedded") and m["source"]["kind"] == "embedded"
  assert "dataset ready" in r.stdout and "grain_train_files=" in r.stdout
  r2 = _cli(["--max-mb", "0.15", "--vocab-size", "300"], cwd=tmp_path)
  assert r2.returncode == 0 and "up to date" in r2.stderr


def test_long_line_without_whitespace_is_fast(tmp_path):
  """A 30 MB line without whitespace (issue 20: BPE training ran for > 10 min): cut into --max-doc-kb
  documents, and no BPE pre-token longer than RUN_CAP characters."""
  import time  # pylint: disable=import-outside-toplevel
  from tokenizers import Tokenizer, pre_tokenizers  # pylint: disable=import-outside-toplevel

  src = tmp_path / "line.txt"
  src.write_text("a b c\n" * 300 + "x" * (30 << 20) + "\n", encoding="utf-8")
  t0 = time.monotonic()
  m, _ = data.prepare(data.PrepareOptions(inputs=(str(src),), out=str(tmp_path / "o"), vocab_size=300),
                      progress=False, log=lambda msg: None)
  assert time.monotonic() - t0 < 30
  docs = _rows(str(tmp_path / "o"), "train") + _rows(str(tmp_path / "o"), "eval")
  assert max(len(d) for d in docs) <= 64 * 1024 and m["source"]["bytes_used"] <= 8e6
  assert sum(d.count("x") for d in docs) == m["source"]["bytes_used"] - 1800  # the 'a b c' lines come first
  tok = Tokenizer.from_file(os.path.join(m["tokenizer"]["path"], "tokenizer.json"))
  long_run = "y" * 1000 + " " * 600 + "z"
  pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(long_run)]
  assert max(len(p) for p in pieces) <= data.RUN_CAP and tok.decode(tok.encode(long_run).ids) == long_run
  # Text without such runs is pre-tokenized exactly as by the plain byte-level pre-tokenizer.
  text = "def f(x):\n    return {'a': [1, 2.5e-3]}  # caf\u00e9\n" * 3
  plain = pre_tokenizers.ByteLevel(add_prefix_space=False)
  assert tok.pre_tokenizer.pre_tokenize_str(text) == plain.pre_tokenize_str(text)


def test_content_hash_follows_the_extracted_text(tmp_path):
  src = tmp_path / "in.jsonl"
  src.write_text("\n".join(json.dumps({"text": f"doc {i}", "body": f"other {i}"}) for i in range(10)) + "\n")
  hashes = {}
  for field in ("text", "body", "text"):
    m, _ = data.prepare(data.PrepareOptions(inputs=(str(src),), out=str(tmp_path / field), tokenizer="none",
                                            text_field=field), progress=False, log=lambda msg: None)
    hashes.setdefault(field, set()).add(m["source"]["content_sha256"])
  assert len(hashes["text"]) == 1 and hashes["text"] != hashes["body"]
  # the same documents from a renamed file: the same content hash
  moved = tmp_path / "moved.jsonl"
  moved.write_bytes(src.read_bytes())
  m, _ = data.prepare(data.PrepareOptions(inputs=(str(moved),), out=str(tmp_path / "moved"), tokenizer="none"),
                      progress=False, log=lambda msg: None)
  assert {m["source"]["content_sha256"]} == hashes["text"]


def _dataset_intact(out, manifest) -> None:
  """Every file the manifest lists is there with its sha256, and prepare with its options does nothing."""
  for e in manifest["splits"]["train"]["files"] + manifest["splits"]["eval"]["files"]:
    with open(os.path.join(out, e["name"]), "rb") as f:
      assert hashlib.sha256(f.read()).hexdigest() == e["sha256"]
  with open(os.path.join(out, "manifest.json"), encoding="utf-8") as f:
    assert json.load(f) == manifest
  assert sorted(n for n in os.listdir(out) if n.endswith(".parquet")) == sorted(
      e["name"] for e in manifest["splits"]["train"]["files"] + manifest["splits"]["eval"]["files"])


def test_interrupted_rebuild_leaves_the_previous_dataset_usable(tmp_path, monkeypatch):
  src = tmp_path / "in.jsonl"
  src.write_text("\n".join(json.dumps({"text": f"document {i}: " + "word " * (i % 9)}) for i in range(60)) + "\n")
  out = str(tmp_path / "ds")
  old_opts = data.PrepareOptions(inputs=(str(src),), out=out, vocab_size=300, shard_mb=0.0005)
  old, _ = data.prepare(old_opts, progress=False, log=lambda msg: None)
  assert len(old["splits"]["train"]["files"]) > 1
  build, previous = data._build_paths(out)  # pylint: disable=protected-access
  new_argv = ["--input", str(src), "--out", out, "--vocab-size", "300", "--quiet"]  # 1 shard, other split

  # SIGKILL during BPE training (after the new parquet files were written): no cleanup runs at all.
  child = ("import os, signal, sys\nfrom maxtext_nvfp4.tools import data\n"
           "data._train_bpe = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)\n"
           f"sys.exit(data.cli_main({new_argv!r}))\n")
  r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
  assert r.returncode == -9, r.stderr
  assert os.path.isdir(build) and any(n.startswith("train-") for n in os.listdir(build))  # it was mid-build
  _dataset_intact(out, old)
  m, rebuilt = data.prepare(old_opts, progress=False, log=lambda msg: None)
  assert not rebuilt and m == old

  # Ctrl-C during BPE: the build directory is removed too.
  def interrupted(*a, **k):
    raise KeyboardInterrupt

  monkeypatch.setattr(data, "_train_bpe", interrupted)
  with pytest.raises(KeyboardInterrupt):
    data.cli_main(new_argv)
  assert not os.path.exists(build)
  _dataset_intact(out, old)
  monkeypatch.undo()

  # Killed between the swap's two renames: the next run puts the previous dataset back.
  os.rename(out, previous)
  m, rebuilt = data.prepare(old_opts, progress=False, log=lambda msg: None)
  assert not rebuilt and m == old and not os.path.exists(previous)
  _dataset_intact(out, old)

  # A completed rebuild replaces it whole (no shard of the old one left).
  assert data.cli_main(new_argv) == 0
  with open(os.path.join(out, "manifest.json"), encoding="utf-8") as f:
    new = json.load(f)
  _dataset_intact(out, new)
  assert len(new["splits"]["train"]["files"]) == 1 and not os.path.exists(build)


def test_user_files_are_kept_whole_unless_a_cap_is_asked_for(tmp_path, capsys):
  """9 MB of user text (over the embedded corpus's 8 MB default) is kept whole; an explicit --max-mb keeps
  less and says how much, and how to keep everything."""
  big = tmp_path / "big.txt"
  line = "the quick brown fox jumps over the lazy dog " * 20 + "\n"  # 881 bytes
  with open(big, "w", encoding="utf-8") as f:
    for i in range(10_300):
      f.write(f"{i} {line}")
  size = os.path.getsize(big)
  assert size > 9e6
  out = tmp_path / "whole"
  assert data.cli_main(["--input", str(big), "--out", str(out), "--tokenizer", "none", "--quiet"]) == 0
  kept = "".join(_rows(str(out), "train") + _rows(str(out), "eval"))
  assert len(kept.encode("utf-8")) == size and "max-mb" not in capsys.readouterr().err
  capped = tmp_path / "capped"
  assert data.cli_main(["--input", str(big), "--out", str(capped), "--tokenizer", "none", "--quiet",
                        "--max-mb", "2"]) == 0
  err = capsys.readouterr().err
  assert "--max-mb 2 reached: kept" in err and "pass --max-mb 0" in err, err
  kept = "".join(_rows(str(capped), "train") + _rows(str(capped), "eval"))
  assert 1.9e6 < len(kept.encode("utf-8")) <= 2e6


def test_site_packages_corpus_is_held_out_by_file_mixed_and_counted(tmp_path):
  """--corpus site-packages: files in sha256(path) order, each file's pieces in one split only, the train pieces
  interleaved across files, the same bytes twice, and the train split's tokens counted with the BPE."""
  opts = data.PrepareOptions(corpus="site-packages", out=str(tmp_path / "a"), max_mb=0.25, max_doc_kb=2,
                             vocab_size=300)
  m, _ = data.prepare(opts, progress=False, log=lambda s: None)
  assert m["source"]["kind"] == "site-packages" and m["source"]["files"] == len(m["inputs"]) > 10
  rels = [i["path"] for i in m["inputs"]]
  assert all(r.endswith(".py") and not os.path.isabs(r) for r in rels)
  assert len({i["sha256"] for i in m["inputs"]}) == len(rels)  # byte-identical copies skipped
  rank = [data._path_rank(r) for r in rels]  # pylint: disable=protected-access
  assert rank == sorted(rank)
  # every piece comes from one file; find each row's file by content (pieces are line-aligned substrings)
  texts = {}
  for r in rels:
    root = next(d for d in data.site_packages_dirs() if os.path.isfile(os.path.join(d, r)))
    with open(os.path.join(root, r), encoding="utf-8") as f:
      texts[r] = f.read()
  held = {r for r in rels if data._path_rank(f"split:{r}") / 2**32 < opts.eval_fraction}  # pylint: disable=protected-access
  train, evals = _rows(opts.out, "train"), _rows(opts.out, "eval")
  owner = lambda piece: next(r for r, t in texts.items() if piece in t)  # noqa: E731
  eval_files, train_files = {owner(p) for p in evals}, {owner(p) for p in train}
  assert held <= eval_files and not train_files & eval_files  # (a corpus hashing no file into eval: its last file)
  assert all(len(p) <= 2 * 1024 for p in train + evals)  # characters, cut at line ends
  # interleaved: consecutive train pieces mostly come from different files
  owners = [owner(p) for p in train[:60]]
  assert sum(a != b for a, b in zip(owners, owners[1:])) > 0.8 * (len(owners) - 1)
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  tok = Tokenizer.from_file(os.path.join(opts.out, "tokenizer", "tokenizer.json"))
  n = sum(len(tok.encode(p, add_special_tokens=False).ids) for p in train)
  assert m["splits"]["train"]["tokens"] == n and m["splits"]["train"]["steps_without_repeat"] == n // 1024
  again, _ = data.prepare(dataclasses.replace(opts, out=str(tmp_path / "b"), tokenizer="none"), progress=False,
                          log=lambda s: None)
  assert again["source"]["content_sha256"] == m["source"]["content_sha256"]
  assert [f["sha256"] for f in again["splits"]["train"]["files"]] == [f["sha256"] for f in m["splits"]["train"]["files"]]
  with pytest.raises(data.DataError, match="--corpus site-packages and --input exclude each other"):
    data.prepare(dataclasses.replace(opts, inputs=(str(tmp_path),)), progress=False)
