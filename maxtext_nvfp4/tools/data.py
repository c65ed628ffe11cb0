"""``maxtext-nvfp4 prepare-data``: build a local, MaxText-ready text dataset (grain + parquet) and its tokenizer.

Output directory layout (what the recipes point at)::

    OUT/train-00000-of-0000N.parquet   one column ``text`` (a document per row)
    OUT/eval-00000-of-00001.parquet
    OUT/tokenizer/                     HF tokenizer dir (``--tokenizer bpe``) for tokenizer_type=huggingface
    OUT/manifest.json                  inputs (paths, sizes, sha256), options, outputs (sha256), tokenizer

MaxText reads it with ``dataset_type=grain grain_file_type=parquet grain_train_files=OUT/train-*.parquet
grain_eval_files=OUT/eval-*.parquet`` (the manifest's ``maxtext_args`` lists the exact keys).

Sources:

* ``embedded`` (default): the ``*.py`` sources of this Python's standard library (``sysconfig`` stdlib
  path), walked in sorted order, skipping test/site-packages/cache dirs and files over ``--max-file-kb``,
  until ``--max-mb`` of text is collected. One document per file. Real text that is always present.
* ``--input PATH ...``: local files or directories: ``*.jsonl`` / ``*.json`` (JSON lines with a ``text``
  field, e.g. C4 shards), the same gzip-compressed (``*.json.gz``, ``*.jsonl.gz``), and plain text (any
  other suffix; one document per file, cut at line boundaries into ``--max-doc-kb`` pieces).

Split: document ``d`` goes to eval iff ``int(sha256(d)[:8], 16) / 2**32 < eval_fraction`` (stable under
reordering and corpus growth); if that leaves a split empty, the last document is moved.

Idempotence: a run whose inputs (path, size, mtime), options and output files (size, sha256) all match
the existing manifest does nothing. Errors (missing/empty/undecodable input) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import time
from typing import Iterable, Iterator

FORMAT_VERSION = 1
DEFAULT_OUT = os.path.join("data", "embedded")  # relative to the working dir; the demo recipes use it
# Directories never taken from the stdlib: tests are repetitive fixtures, the rest is not stdlib text.
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3"}
BOS, EOS, PAD = "<s>", "</s>", "<pad>"


class DataError(Exception):
  """A bad input or option; ``cli_main`` prints its one-line message and exits with code 2."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrepareOptions:
  """Everything that determines the output of :func:`prepare`. Recorded verbatim in the manifest."""

  # Input files/dirs; empty means the embedded standard-library corpus.
  inputs: tuple[str, ...] = ()
  # Output directory (created if missing).
  out: str = DEFAULT_OUT
  # Cap on the total text collected, in MB (1e6 characters of UTF-8 bytes); <= 0 means no cap.
  max_mb: float = 8.0
  # Embedded corpus: skip source files larger than this (huge generated tables teach little).
  max_file_kb: int = 200
  # Plain-text inputs: cut documents into pieces of at most this many KB (at line boundaries).
  max_doc_kb: int = 64
  # Fraction of documents (by content hash) that go to the eval split.
  eval_fraction: float = 0.05
  # Target parquet shard size in MB (train split); more shards let more hosts read in parallel.
  shard_mb: float = 64.0
  # Tokenizer: "bpe" trains a byte-level BPE on the train split; "llama3" references MaxText's tiktoken
  # asset; "none" writes no tokenizer reference.
  tokenizer: str = "bpe"
  # BPE vocabulary size including the 3 special tokens (<pad>=0, <s>=1, </s>=2).
  vocab_size: int = 2048
  # JSON field that holds the document text.
  text_field: str = "text"


# ---------------------------------------------------------------------------------------------- sources


def stdlib_dir() -> str:
  return sysconfig.get_paths()["stdlib"]


def _embedded_files(opts: PrepareOptions) -> list[str]:
  """Sorted stdlib ``*.py`` paths to use, under the size caps."""
  root = stdlib_dir()
  if not os.path.isdir(root):
    raise DataError(f"embedded corpus: standard-library directory {root!r} not found; pass --input FILES")
  cap = opts.max_mb * 1e6 if opts.max_mb > 0 else math.inf
  chosen, total = [], 0
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
    for name in sorted(filenames):
      if not name.endswith(".py") or name.startswith("test_"):
        continue
      path = os.path.join(dirpath, name)
      size = os.path.getsize(path)
      if size == 0 or size > opts.max_file_kb * 1024:
        continue
      if total + size > cap:
        return chosen
      chosen.append(path)
      total += size
  return chosen


def _expand_inputs(inputs: Iterable[str]) -> list[str]:
  files = []
  for p in inputs:
    if os.path.isdir(p):
      found = sorted(os.path.join(d, f) for d, _, fs in os.walk(p) for f in fs if not f.startswith("."))
      if not found:
        raise DataError(f"input directory {p!r} contains no files")
      files += found
    elif os.path.isfile(p):
      files.append(p)
    else:
      raise DataError(f"input {p!r} does not exist")
  return files


def _is_json(path: str) -> bool:
  base = path[:-3] if path.endswith(".gz") else path
  return base.endswith((".jsonl", ".json"))


def _read_text(path: str, data: bytes) -> str:
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise DataError(f"{path}: not UTF-8 text (byte {e.start}: {data[e.start:e.start + 4]!r})") from None


def _file_documents(path: str, opts: PrepareOptions) -> Iterator[str]:
  """Documents of one input file (see the module docstring for the formats)."""
  with open(path, "rb") as f:
    raw = f.read()
  if path.endswith(".gz"):
    try:
      raw = gzip.decompress(raw)
    except (OSError, EOFError) as e:
      raise DataError(f"{path}: not a valid gzip file ({e})") from None
  text = _read_text(path, raw)
  if _is_json(path):
    for lineno, line in enumerate(text.splitlines(), 1):
      if not line.strip():
        continue
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as e:
        raise DataError(f"{path}:{lineno}: not a JSON line ({e.msg})") from None
      if not isinstance(obj, dict) or not isinstance(obj.get(opts.text_field), str):
        raise DataError(f"{path}:{lineno}: JSON line has no string field {opts.text_field!r}")
      if obj[opts.text_field].strip():
        yield obj[opts.text_field]
  elif opts.inputs:
    piece, size, limit = [], 0, opts.max_doc_kb * 1024
    for line in text.splitlines(keepends=True):
      if size + len(line) > limit and piece:
        yield "".join(piece)
        piece, size = [], 0
      piece.append(line)
      size += len(line)
    if "".join(piece).strip():
      yield "".join(piece)
  elif text.strip():  # embedded stdlib file: one document
    yield text


def _input_signature(files: list[str]) -> list[dict]:
  """Cheap identity of the inputs (for the idempotence check): path, size, mtime."""
  return [{"path": os.path.abspath(p), "size": os.path.getsize(p), "mtime_ns": os.stat(p).st_mtime_ns} for p in files]


# ---------------------------------------------------------------------------------------------- outputs


class _Progress:
  """A one-line progress bar on stderr: ``prepare-data [#####.....] 52% 4.1/8.0 MB``."""

  def __init__(self, total: float, label: str):
    self.total, self.label, self.done, self._last = max(total, 1e-9), label, 0.0, -1
    self.enabled = True

  def update(self, n: float) -> None:
    self.done += n
    pct = min(100, int(100 * self.done / self.total))
    if pct != self._last and self.enabled:
      self._last = pct
      bar = "#" * (pct // 4) + "." * (25 - pct // 4)
      sys.stderr.write(f"\r{self.label} [{bar}] {pct:3d}% {self.done / 1e6:.1f}/{self.total / 1e6:.1f} MB")
      sys.stderr.flush()

  def close(self) -> None:
    if self.enabled:
      sys.stderr.write("\n")


def _sha256_file(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def _write_parquet(path: str, docs: list[str]) -> None:
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

  pq.write_table(pa.table({"text": pa.array(docs, type=pa.string())}), path, compression="zstd")


def _write_split(out: str, split: str, docs: list[str], n_shards: int) -> list[dict]:
  """Write ``docs`` round-robin into ``n_shards`` parquet files; return their manifest entries."""
  entries = []
  for i in range(n_shards):
    name = f"{split}-{i:05d}-of-{n_shards:05d}.parquet"
    path = os.path.join(out, name)
    part = docs[i::n_shards]
    _write_parquet(path + ".tmp", part)
    os.replace(path + ".tmp", path)
    entries.append({"name": name, "rows": len(part), "text_bytes": sum(len(d.encode()) for d in part),
                    "size": os.path.getsize(path), "sha256": _sha256_file(path)})
  return entries


def maxtext_tokenizer_assets() -> str:
  """MaxText's shipped tokenizer dir, located from the installed package (the pip-install assets path bug
  makes MaxText's own default point at a non-existent ``src/maxtext/assets``)."""
  import importlib.util  # pylint: disable=import-outside-toplevel

  spec = importlib.util.find_spec("maxtext")
  if spec is None or not spec.submodule_search_locations:
    raise DataError("MaxText is not installed; `pip install maxtext-nvfp4` pulls it in")
  return os.path.join(list(spec.submodule_search_locations)[0], "assets", "tokenizers")


def _train_bpe(out_dir: str, docs: list[str], vocab_size: int) -> dict:
  """Train a byte-level BPE on ``docs`` and save a HF tokenizer dir MaxText loads with
  ``tokenizer_type=huggingface``: ``tokenizer.json`` (post-processor adds ``<s>`` ... ``</s>``, which
  is what MaxText's add_bos/add_eos ask for) and ``tokenizer_config.json`` (bos/eos/pad tokens)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # pylint: disable=import-outside-toplevel

  specials = [PAD, BOS, EOS]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
  ids = {t: tok.token_to_id(t) for t in specials}
  tok.post_processor = processors.TemplateProcessing(
      single=f"{BOS} $A {EOS}", pair=f"{BOS} $A {EOS} {BOS} $B {EOS}",
      special_tokens=[(BOS, ids[BOS]), (EOS, ids[EOS])])
  os.makedirs(out_dir, exist_ok=True)
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
               "pad_token": PAD, "add_bos_token": True, "add_eos_token": True,
               "model_max_length": 1 << 30}, f, indent=2)
  return {"type": "huggingface", "path": os.path.abspath(out_dir), "vocab_size": tok.get_vocab_size(),
          "pad_id": ids[PAD], "bos_id": ids[BOS], "eos_id": ids[EOS],
          "sha256": _sha256_file(os.path.join(out_dir, "tokenizer.json"))}


def _tokenizer_info(opts: PrepareOptions, out: str, train_docs: list[str]) -> dict | None:
  if opts.tokenizer == "none":
    return None
  if opts.tokenizer == "llama3":
    # Copied next to the data so recipes can use a relative path (MaxText's own default asset path is broken
    # for pip installs); the file name must contain "tiktoken" for MaxText's tokenizer_type=tiktoken.
    src = os.path.join(maxtext_tokenizer_assets(), "tokenizer_llama3.tiktoken")
    if not os.path.isfile(src):
      raise DataError(f"Llama 3 tokenizer asset {src!r} not found in the installed MaxText")
    dst = os.path.join(out, "tokenizer_llama3.tiktoken")
    shutil.copyfile(src, dst)
    return {"type": "tiktoken", "path": dst, "vocab_size": 128256, "bos_id": 128000, "eos_id": 128001,
            "pad_id": -1, "sha256": _sha256_file(dst)}
  return _train_bpe(os.path.join(out, "tokenizer"), train_docs, opts.vocab_size)


def maxtext_args(manifest: dict) -> list[str]:
  """The MaxText ``key=value`` overrides that train on this dataset (absolute paths)."""
  out = manifest["out"]
  args = ["dataset_type=grain", "grain_file_type=parquet",
          f"grain_train_files={os.path.join(out, 'train-*.parquet')}",
          f"grain_eval_files={os.path.join(out, 'eval-*.parquet')}", "use_truncation=false"]
  tok = manifest.get("tokenizer")
  if tok:
    # vocab_size is the model's embedding size; the BPE's is rounded up to a multiple of 128 for layout.
    args += [f"tokenizer_type={tok['type']}", f"tokenizer_path={tok['path']}",
             f"vocab_size={max(128, -(-tok['vocab_size'] // 128) * 128)}"]
  return args


# ---------------------------------------------------------------------------------------------- driver


def _options_record(opts: PrepareOptions) -> dict:
  d = dataclasses.asdict(opts)
  d["inputs"] = [os.path.abspath(p) for p in opts.inputs]
  d["out"] = os.path.abspath(opts.out)
  return d


def _up_to_date(manifest_path: str, signature: list[dict], options: dict) -> dict | None:
  """The existing manifest when inputs, options and every output file still match it, else None."""
  try:
    with open(manifest_path, encoding="utf-8") as f:
      m = json.load(f)
  except (OSError, ValueError):
    return None
  if m.get("format_version") != FORMAT_VERSION or m.get("options") != options:
    return None
  if m.get("input_signature") != signature:
    return None
  out = os.path.dirname(manifest_path)
  for entry in m["splits"]["train"]["files"] + m["splits"]["eval"]["files"]:
    path = os.path.join(out, entry["name"])
    if not os.path.isfile(path) or os.path.getsize(path) != entry["size"] or _sha256_file(path) != entry["sha256"]:
      return None
  tok = m.get("tokenizer")
  if tok and tok.get("sha256"):
    tok_file = os.path.join(tok["path"], "tokenizer.json") if os.path.isdir(tok["path"]) else tok["path"]
    if not os.path.isfile(tok_file) or _sha256_file(tok_file) != tok["sha256"]:
      return None
  return m


def prepare(opts: PrepareOptions, *, progress: bool = True, log=None) -> tuple[dict, bool]:
  """Build (or reuse) the dataset. Returns ``(manifest, rebuilt)``; raises :class:`DataError`."""
  log = log or (lambda msg: print(msg, file=sys.stderr))
  if opts.tokenizer not in ("bpe", "llama3", "none"):
    raise DataError(f"--tokenizer={opts.tokenizer!r} is not allowed; choose one of: bpe, llama3, none")
  if not 0 < opts.eval_fraction < 1:
    raise DataError(f"--eval-fraction={opts.eval_fraction} must be in (0, 1)")
  if opts.tokenizer == "bpe" and not 259 <= opts.vocab_size <= 1 << 20:
    raise DataError(f"--vocab-size={opts.vocab_size} must be >= 259 (256 bytes + 3 special tokens)")
  embedded = not opts.inputs
  files = _embedded_files(opts) if embedded else _expand_inputs(opts.inputs)
  if not files:
    raise DataError("embedded corpus: no standard-library sources under the size caps" if embedded
                    else "no input files")
  out = os.path.abspath(opts.out)
  manifest_path = os.path.join(out, "manifest.json")
  signature = _input_signature(files)
  options = _options_record(opts)
  existing = _up_to_date(manifest_path, signature, options)
  if existing is not None:
    log(f"prepare-data: {out} is up to date (manifest matches inputs and options); nothing to do")
    return existing, False

  # Read every document, in input order, stopping at the size cap.
  cap = opts.max_mb * 1e6 if opts.max_mb > 0 else math.inf
  bar = _Progress(min(sum(s["size"] for s in signature), cap), "prepare-data: reading")
  bar.enabled = progress
  docs, total, content = [], 0, hashlib.sha256()
  inputs_record, full = [], False
  for path in files:
    n_before = len(docs)
    for doc in _file_documents(path, opts):
      size = len(doc.encode("utf-8"))
      if total + size > cap and docs:
        full = True
        break
      docs.append(doc)
      total += size
      bar.update(size)
    if not embedded and len(docs) == n_before and not full:
      raise DataError(f"{path}: no text documents (empty file or only blank {opts.text_field!r} fields)")
    inputs_record.append({"path": os.path.relpath(path, stdlib_dir()) if embedded else os.path.abspath(path),
                          "size": os.path.getsize(path), "sha256": _sha256_file(path)})
    if full:
      break
  bar.close()
  if not docs:
    raise DataError("inputs contain no text")
  for rec in inputs_record:
    content.update(f"{rec['path']}\0{rec['sha256']}\n".encode())

  # Split by content hash (see module docstring).
  train, evals = [], []
  for d in docs:
    frac = int(hashlib.sha256(d.encode("utf-8")).hexdigest()[:8], 16) / 2**32
    (evals if frac < opts.eval_fraction else train).append(d)
  if len(docs) < 2:
    raise DataError(f"need at least 2 documents for a train/eval split, got {len(docs)}")
  if not evals:
    evals.append(train.pop())
  if not train:
    train.append(evals.pop())

  os.makedirs(out, exist_ok=True)
  if os.path.exists(manifest_path):
    os.remove(manifest_path)  # a crash from here on leaves no stale "up to date" manifest
  for name in os.listdir(out):
    if name.endswith(".parquet") and name.startswith(("train-", "eval-")):
      os.remove(os.path.join(out, name))
  train_bytes = sum(len(d.encode("utf-8")) for d in train)
  n_shards = max(1, min(len(train), math.ceil(train_bytes / (opts.shard_mb * 1e6))))
  t0 = time.time()
  splits = {
      "train": {"documents": len(train), "text_bytes": train_bytes, "files": _write_split(out, "train", train, n_shards)},
      "eval": {"documents": len(evals), "text_bytes": sum(len(d.encode()) for d in evals),
               "files": _write_split(out, "eval", evals, 1)},
  }
  log(f"prepare-data: wrote {len(train)} train / {len(evals)} eval documents ({total / 1e6:.2f} MB) in"
      f" {time.time() - t0:.1f}s")
  if opts.tokenizer == "bpe":
    log(f"prepare-data: training a {opts.vocab_size}-token byte-level BPE on the train split ...")
  tokenizer = _tokenizer_info(opts, out, train)
  source = ({"kind": "embedded", "description": "Python standard library *.py sources",
             "stdlib_dir": stdlib_dir(), "python_version": sys.version.split()[0]}
            if embedded else {"kind": "files"})
  source.update({"files": len(inputs_record), "bytes_used": total, "content_sha256": content.hexdigest()})
  manifest = {
      "format_version": FORMAT_VERSION,
      "out": out,
      "source": source,
      "inputs": inputs_record,
      "input_signature": signature,
      "options": options,
      "splits": splits,
      "tokenizer": tokenizer,
  }
  manifest["maxtext_args"] = maxtext_args(manifest)
  with open(manifest_path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(manifest, f, indent=1)
  os.replace(manifest_path + ".tmp", manifest_path)
  return manifest, True


def _parser() -> argparse.ArgumentParser:
  d = PrepareOptions()
  ap = argparse.ArgumentParser(
      prog="maxtext-nvfp4 prepare-data",
      description="Build a local MaxText dataset (grain/parquet + tokenizer + manifest). Default: the"
      " embedded corpus (this Python's standard-library sources) into data/embedded/, which the demo"
      " recipes read.")
  ap.add_argument("--input", "-i", nargs="+", default=[], metavar="PATH",
                  help="text / JSONL / .json.gz files or dirs (e.g. C4 shards) instead of the embedded corpus")
  ap.add_argument("--out", "-o", default=None, help=f"output dir (default {DEFAULT_OUT} for the embedded corpus,"
                  " data/custom for --input)")
  ap.add_argument("--max-mb", type=float, default=d.max_mb, help="cap on total text, MB (<= 0: no cap)")
  ap.add_argument("--max-file-kb", type=int, default=d.max_file_kb, help="embedded: skip larger source files")
  ap.add_argument("--max-doc-kb", type=int, default=d.max_doc_kb, help="plain text: max document size, KB")
  ap.add_argument("--eval-fraction", type=float, default=d.eval_fraction)
  ap.add_argument("--shard-mb", type=float, default=d.shard_mb, help="target train parquet shard size, MB")
  ap.add_argument("--tokenizer", default=d.tokenizer, choices=("bpe", "llama3", "none"),
                  help="bpe: train a small BPE (CPU demos); llama3: MaxText's Llama 3 tiktoken (8B recipes)")
  ap.add_argument("--vocab-size", type=int, default=d.vocab_size, help="BPE vocabulary size")
  ap.add_argument("--text-field", default=d.text_field, help="JSON field holding the text")
  ap.add_argument("--quiet", action="store_true", help="no progress bar")
  return ap


def cli_main(argv: list[str]) -> int:
  args = _parser().parse_args(argv)
  out = args.out or (os.path.join("data", "custom") if args.input else DEFAULT_OUT)
  opts = PrepareOptions(inputs=tuple(args.input), out=out, max_mb=args.max_mb, max_file_kb=args.max_file_kb,
                        max_doc_kb=args.max_doc_kb, eval_fraction=args.eval_fraction, shard_mb=args.shard_mb,
                        tokenizer=args.tokenizer, vocab_size=args.vocab_size, text_field=args.text_field)
  try:
    manifest, _ = prepare(opts, progress=not args.quiet)
  except DataError as e:
    print(f"prepare-data: error: {e}", file=sys.stderr)
    return 2
  print(f"prepare-data: dataset ready in {manifest['out']} ({manifest['splits']['train']['documents']} train,"
        f" {manifest['splits']['eval']['documents']} eval documents; content sha256"
        f" {manifest['source']['content_sha256'][:16]}...)")
  print("MaxText overrides: " + " ".join(manifest["maxtext_args"]))
  return 0


if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
