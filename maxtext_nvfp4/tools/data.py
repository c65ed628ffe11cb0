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
  until ``--max-mb`` of text is collected (default 8). One document per file. Real text that is always present.
* ``--corpus site-packages``: the ``*.py`` sources of this Python's installed packages (``sysconfig``
  purelib and platlib), for runs too long for the standard library: no download, present wherever the project
  is installed. Files under test directories, over ``--max-file-kb`` or byte-identical to one already taken
  (vendored copies) are skipped; files are taken in the order of ``sha256(relative path)`` (a spread over
  all packages, stable when packages are added) until ``--max-mb``. Each file is cut at line boundaries into
  ``--max-doc-kb`` pieces (default 8 here); *every piece of a file goes to the same split* (eval iff
  ``sha256("split:" + relative path)`` < ``--eval-fraction``, as below: held out by file), and the train pieces are stored in the
  order of ``sha256(path#piece)``, so the stream MaxText reads (whose shuffle is a 100-row window) is a
  mixture of all packages, not one package after another. The manifest's ``train_tokens`` counts the train
  split in the BPE's tokens and ``steps_without_repeat`` how many demo steps (4 x 256 tokens) it lasts.
  Built for the 10,001-step study: ``prepare-data --corpus site-packages --max-mb 48`` (``docs/compare.md``).
* ``--input PATH ...``: local files or directories: ``*.jsonl`` / ``*.json`` (JSON lines with a ``text``
  field, e.g. C4 shards), the same gzip-compressed (``*.json.gz``, ``*.jsonl.gz``), and plain text (any
  other suffix except known binary/compressed ones; one document per file, cut at line boundaries into
  ``--max-doc-kb`` pieces, and a longer line into ``--max-doc-kb`` pieces of its own). Kept whole unless
  ``--max-mb`` is given; when that cap drops text, a line says how much was kept of how much.

Split (stdlib and ``--input``): document ``d`` goes to eval iff ``int(sha256(d)[:8], 16) / 2**32 < eval_fraction`` (stable under
reordering and corpus growth); if that leaves a split empty, the last document is moved.
``content_sha256`` = sha256 over the documents used, in order, each as ``sha256(d).hexdigest() + "\\n"``:
it changes exactly when the extracted text does (e.g. another ``--text-field``).

BPE tokenizer: GPT-2 style byte-level BPE whose pre-tokenizer first isolates every run of ``RUN_CAP``
non-space (or space) characters, so no pre-token is longer than ``RUN_CAP``: BPE training cost grows with
the square of a pre-token's length (a 1 MB line without whitespace took minutes), and text without such
runs tokenizes exactly as with the plain byte-level pre-tokenizer.

Atomic: the dataset is built in ``.OUT_NAME.prepare-data-build`` beside ``OUT`` and swapped in at the end
(two renames), so an interrupted run leaves the previous dataset as it was. ``OUT`` must be new, empty or
a prepare-data output (no other files: the swap replaces the directory).

Idempotence: a run whose inputs (path, size, mtime), options and output files (size, sha256) all match
the existing manifest does nothing. Every bad option, path or input is one line and exit code 2, checked
before anything is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import math
import os
import pathlib
import shutil
import sys
import sysconfig
import time
from typing import Iterable, Iterator

from maxtext_nvfp4.tools import cli

FORMAT_VERSION = 2  # 2: content_sha256 over the documents; BPE pre-tokens capped at RUN_CAP characters
CORPORA = ("stdlib", "site-packages")
# Piece size (KB) of the site-packages corpus when --max-doc-kb is not given.
SITE_PACKAGES_DOC_KB = 8
# Tokens one CPU-demo training step reads (per_device_batch_size 4 x max_target_length 256 of demo_base.yml).
DEMO_TOKENS_PER_STEP = 4 * 256
PROG = "maxtext-nvfp4 prepare-data"
DEFAULT_OUT = os.path.join("data", "embedded")  # relative to the working dir; the demo recipes use it
# Directories never taken from the stdlib: tests are repetitive fixtures, the rest is not stdlib text.
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib2to3"}
BOS, EOS, PAD = "<s>", "</s>", "<pad>"
# Longest BPE pre-token (characters): longer runs of non-space (or space) characters are cut.
RUN_CAP = 256
# Input suffixes that are never text (the fix: decompress / convert to JSON lines or plain text first).
_BINARY_SUFFIXES = (".parquet", ".arrow", ".zip", ".tar", ".tgz", ".bz2", ".xz", ".zst", ".7z", ".npy", ".npz",
                    ".pdf", ".png", ".jpg", ".jpeg", ".gif", ".bin", ".safetensors", ".pkl")
# What prepare-data writes into OUT (anything else there is the user's, and OUT is then refused).
_OUTPUT_NAMES = ("manifest.json", "manifest.json.tmp", "tokenizer", "tokenizer_llama3.tiktoken")


class DataError(Exception):
  """A bad input or option; ``cli_main`` prints its one-line message and exits with code 2."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrepareOptions:
  """Everything that determines the output of :func:`prepare`. Recorded verbatim in the manifest."""

  # Input files/dirs; empty means an embedded corpus (``corpus``).
  inputs: tuple[str, ...] = ()
  # Embedded corpus when ``inputs`` is empty: "stdlib" (this Python's standard library) or "site-packages"
  # (this Python's installed packages; module docstring).
  corpus: str = "stdlib"

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


# Directories and files never taken from site-packages: tests are repetitive fixtures; caches are not text.
_SITE_SKIP_DIRS = {"test", "tests", "testing", "idle_test", "__pycache__"}


def site_packages_dirs() -> list[str]:
  """This Python's package directories (purelib, then platlib when it differs), those that exist."""
  paths = sysconfig.get_paths()
  return [d for d in dict.fromkeys((paths["purelib"], paths["platlib"])) if os.path.isdir(d)]


def _path_rank(text: str) -> int:
  """``int(sha256(text)[:8], 16)``: the order and split key of the site-packages corpus."""
  return int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:8], 16)


def _site_packages_files(opts: PrepareOptions) -> list[tuple[str, str]]:
  """``(path, relative path)`` of the site-packages corpus: every ``*.py`` outside test directories, at most
  ``--max-file-kb``, in the order of :func:`_path_rank` of the relative path (ties: the path), files
  byte-identical to an earlier one skipped, until ``--max-mb``."""
  roots = site_packages_dirs()
  if not roots:
    raise DataError("site-packages corpus: no package directory found (sysconfig purelib/platlib); pass --input "
                    "FILES")
  found = []
  for root in roots:
    for dirpath, dirnames, filenames in os.walk(root):
      dirnames[:] = sorted(d for d in dirnames if d not in _SITE_SKIP_DIRS and not d.startswith("."))
      for name in filenames:
        if not name.endswith(".py") or name.startswith("test_") or name.endswith("_test.py"):
          continue
        path = os.path.join(dirpath, name)
        rel = os.path.relpath(path, root)
        if rel not in found and os.path.isfile(path):
          found.append((rel, path))
  found.sort(key=lambda rp: (_path_rank(rp[0]), rp[0]))
  cap = opts.max_mb * 1e6 if opts.max_mb > 0 else math.inf
  chosen, seen, total = [], set(), 0
  for rel, path in found:
    size = os.path.getsize(path)
    if size == 0 or size > opts.max_file_kb * 1024:
      continue
    with open(path, "rb") as f:
      raw = f.read()
    digest = hashlib.sha256(raw).digest()
    try:
      raw.decode("utf-8")
    except UnicodeDecodeError:  # a few legacy sources are Latin-1: skipped, not an error
      continue
    if digest in seen:
      continue
    if total + size > cap:
      break
    seen.add(digest)
    chosen.append((path, rel))
    total += size
  return chosen


def _expand_inputs(inputs: Iterable[str]) -> list[str]:
  """The input files (directories walked in sorted order, hidden entries skipped), each checked readable
  and of a text suffix."""
  files = []
  for p in inputs:
    if os.path.isdir(p):
      found = []
      for d, dirs, fs in os.walk(p):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        found += [os.path.join(d, f) for f in sorted(fs) if not f.startswith(".")]
      if not found:
        raise DataError(f"input directory {p!r} contains no files; pass a directory of text/JSONL files")
      files += found
    elif os.path.isfile(p):
      files.append(p)
    elif os.path.exists(p):
      raise DataError(f"input {p!r} is not a regular file or directory; pass text/JSONL files or directories")
    else:
      raise DataError(f"input {p!r} does not exist; check the --input path")
  for f in files:
    suffix = next((x for x in _BINARY_SUFFIXES if f.lower().endswith(x)), None)
    if suffix:
      raise DataError(f"input {f!r}: {suffix} files are not read; convert it to JSON lines (.jsonl, .json.gz) "
                      "or plain text")
    if not os.access(f, os.R_OK):
      raise DataError(f"input {f!r} is not readable; check its permissions")
  return files


def _build_paths(out: str) -> tuple[str, str]:
  """(build dir, previous-dataset dir during the swap): hidden siblings of ``out``."""
  parent, name = os.path.split(out)
  return os.path.join(parent, f".{name}.prepare-data-build"), os.path.join(parent, f".{name}.prepare-data-old")


def _is_output_name(name: str) -> bool:
  return name in _OUTPUT_NAMES or (name.startswith(("train-", "eval-")) and name.endswith((".parquet", ".parquet.tmp")))


def _check_out(out: str, inputs: Iterable[str], files: list[str]) -> None:
  """``out`` (absolute) can be replaced by a new dataset: a new, empty or prepare-data directory in a
  writable parent, holding none of the input files and outside every input directory."""
  if os.path.lexists(out) and not os.path.isdir(out):
    raise DataError(f"--out {out} exists and is not a directory; pass a new or dataset directory")
  if os.path.isdir(out):
    foreign = sorted(n for n in os.listdir(out) if not _is_output_name(n))
    if foreign:
      raise DataError(f"--out {out} holds files prepare-data did not write ({', '.join(foreign[:3])}"
                      f"{', ...' if len(foreign) > 3 else ''}) and the new dataset replaces the directory; "
                      "pass a new or empty --out")
  existing = next(d for d in pathlib.Path(out).parents if d.exists())
  if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
    raise DataError(f"--out {out}: {existing} is not a writable directory; pass another --out")
  for d in (os.path.abspath(p) for p in inputs if os.path.isdir(p)):
    if os.path.commonpath([d, out]) == d:
      raise DataError(f"--out {out} is inside the input directory {d}, whose files are all read; pass an "
                      "--out outside it")
  for f in files:
    if os.path.commonpath([os.path.abspath(f), out]) == out:
      raise DataError(f"input {f!r} is inside --out {out}, which the new dataset replaces; pass another --out")


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
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except OSError as e:
    raise DataError(f"{path}: cannot read ({e.strerror}); check the file") from None
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
  elif opts.inputs or opts.corpus == "site-packages":
    piece, size, limit = [], 0, opts.max_doc_kb * 1024
    for whole in text.splitlines(keepends=True):
      for line in (whole[i:i + limit] for i in range(0, len(whole), limit)):  # a long line: limit-sized cuts
        if size + len(line) > limit and piece:
          if "".join(piece).strip():
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
    _write_parquet(path, part)  # into the private build directory: swapped in whole at the end
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


def _train_bpe(out_dir: str, docs: list[str], vocab_size: int, *, recorded_dir: str) -> dict:
  """Train a byte-level BPE on ``docs`` and save a HF tokenizer dir MaxText loads with
  ``tokenizer_type=huggingface`` into ``out_dir`` (its manifest entry names ``recorded_dir``, where it will
  live): ``tokenizer.json`` (pre-tokens of at most ``RUN_CAP`` characters, see the module doc;
  post-processor adds ``<s>`` ... ``</s>``, which is what MaxText's add_bos/add_eos ask for) and
  ``tokenizer_config.json`` (bos/eos/pad tokens)."""
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # pylint: disable=import-outside-toplevel

  specials = [PAD, BOS, EOS]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(rf"\S{{{RUN_CAP}}}|\s{{{RUN_CAP}}}"), behavior="isolated"),
      pre_tokenizers.ByteLevel(add_prefix_space=False)])
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
  return {"type": "huggingface", "path": recorded_dir, "vocab_size": tok.get_vocab_size(),
          "pad_id": ids[PAD], "bos_id": ids[BOS], "eos_id": ids[EOS],
          "sha256": _sha256_file(os.path.join(out_dir, "tokenizer.json"))}


def _count_tokens(tokenizer_json: str, docs: list[str]) -> int:
  """Tokens of ``docs`` under the BPE, without the ``<s>``/``</s>`` each document gains: a lower bound on the
  tokens MaxText reads from them."""
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel

  tok = Tokenizer.from_file(tokenizer_json)
  total = 0
  for i in range(0, len(docs), 1024):
    total += sum(len(e.ids) for e in tok.encode_batch(docs[i:i + 1024], add_special_tokens=False))
  return total


def _llama3_asset() -> str:
  src = os.path.join(maxtext_tokenizer_assets(), "tokenizer_llama3.tiktoken")
  if not os.path.isfile(src):
    raise DataError(f"Llama 3 tokenizer asset {src!r} not found in the installed MaxText; reinstall maxtext "
                    "or pass --tokenizer bpe")
  return src


def _tokenizer_info(opts: PrepareOptions, build: str, out: str, train_docs: list[str]) -> dict | None:
  """Write the tokenizer into ``build``; its manifest entry names the path under ``out``."""
  if opts.tokenizer == "none":
    return None
  if opts.tokenizer == "llama3":
    # Copied next to the data so recipes can use a relative path (MaxText's own default asset path is broken
    # for pip installs); the file name must contain "tiktoken" for MaxText's tokenizer_type=tiktoken.
    name = "tokenizer_llama3.tiktoken"
    shutil.copyfile(_llama3_asset(), os.path.join(build, name))
    return {"type": "tiktoken", "path": os.path.join(out, name), "vocab_size": 128256, "bos_id": 128000,
            "eos_id": 128001, "pad_id": -1, "sha256": _sha256_file(os.path.join(build, name))}
  return _train_bpe(os.path.join(build, "tokenizer"), train_docs, opts.vocab_size,
                    recorded_dir=os.path.join(out, "tokenizer"))


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
  if d["corpus"] == "stdlib":  # recorded only when not the default: earlier manifests stay up to date
    del d["corpus"]
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


def _check_options(opts: PrepareOptions) -> None:
  """Every option in range (the CLI flag named in the message), before anything is read or written."""
  numbers = (("--max-mb", opts.max_mb, True, "a finite number (<= 0: no cap)"),
             ("--max-file-kb", opts.max_file_kb, opts.max_file_kb > 0, "> 0"),
             ("--max-doc-kb", opts.max_doc_kb, opts.max_doc_kb > 0, "> 0"),
             ("--eval-fraction", opts.eval_fraction, 0 < opts.eval_fraction < 1, "in (0, 1)"),
             ("--shard-mb", opts.shard_mb, opts.shard_mb > 0, "> 0"),
             ("--vocab-size", opts.vocab_size, opts.tokenizer != "bpe" or 259 <= opts.vocab_size <= 1 << 20,
              "in [259, 1048576] (256 bytes + 3 special tokens at least)"))
  for flag, value, ok, need in numbers:
    if not (math.isfinite(value) and ok):
      raise DataError(f"{flag}={value:g} must be {need}")
  if opts.corpus not in CORPORA:
    raise DataError(f"--corpus={opts.corpus!r} is not allowed; choose one of: {', '.join(CORPORA)}")
  if opts.inputs and opts.corpus != "stdlib":
    raise DataError(f"--corpus {opts.corpus} and --input exclude each other; drop one")
  if opts.tokenizer not in ("bpe", "llama3", "none"):
    raise DataError(f"--tokenizer={opts.tokenizer!r} is not allowed; choose one of: bpe, llama3, none")
  if not opts.text_field:
    raise DataError("--text-field must name the JSON field holding the text (default: text)")
  if opts.tokenizer == "llama3":
    _llama3_asset()


def _swap_in(build: str, out: str, previous: str) -> None:
  """Replace ``out`` by ``build``: rename the old dataset aside, the new one in, then delete the old one.
  Interrupted between the renames, :func:`_restore_interrupted_swap` puts the old one back."""
  shutil.rmtree(previous, ignore_errors=True)
  if os.path.isdir(out):
    os.rename(out, previous)
  os.rename(build, out)
  shutil.rmtree(previous, ignore_errors=True)


def _restore_interrupted_swap(out: str, previous: str, log) -> None:
  if not os.path.lexists(out) and os.path.isdir(previous):
    os.rename(previous, out)
    log(f"prepare-data: restored {out} (a run was interrupted while replacing it)")


def prepare(opts: PrepareOptions, *, progress: bool = True, log=None) -> tuple[dict, bool]:
  """Build (or reuse) the dataset. Returns ``(manifest, rebuilt)``; raises :class:`DataError`.

  Checks every option and path first; builds into a hidden sibling of ``opts.out`` and swaps it in at the
  end (module doc), so neither an error nor an interruption touches the previous dataset.
  """
  log = log or (lambda msg: print(msg, file=sys.stderr))
  _check_options(opts)
  embedded = not opts.inputs
  site = embedded and opts.corpus == "site-packages"
  rel_of = {}  # site-packages: path -> relative path (the split and order key)
  if site:
    rel_of = dict(_site_packages_files(opts))
    files = list(rel_of)
  else:
    files = _embedded_files(opts) if embedded else _expand_inputs(opts.inputs)
  if not files:
    raise DataError(f"embedded corpus: no {'site-packages' if site else 'standard-library'} sources under the size"
                    " caps; raise --max-file-kb or --max-mb" if embedded else "no input files")
  out = os.path.abspath(opts.out)
  _check_out(out, opts.inputs, [] if embedded else files)
  build, previous = _build_paths(out)
  _restore_interrupted_swap(out, previous, log)
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
  docs, total = [], 0
  piece_of = []  # site-packages: (relative path, piece index) of each document
  inputs_record, full = [], False
  try:
    for path in files:
      n_before = len(docs)
      for doc in _file_documents(path, opts):
        size = len(doc.encode("utf-8"))
        if total + size > cap and docs:
          full = True
          break
        if site:
          piece_of.append((rel_of[path], len(docs) - n_before))
        docs.append(doc)
        total += size
        bar.update(size)
      if not embedded and len(docs) == n_before and not full:
        raise DataError(f"{path}: no text documents (empty file or only blank {opts.text_field!r} fields)")
      recorded = rel_of[path] if site else os.path.relpath(path, stdlib_dir()) if embedded else os.path.abspath(path)
      inputs_record.append({"path": recorded,
                            "size": os.path.getsize(path), "sha256": _sha256_file(path)})
      if full:
        break
  finally:
    bar.close()
  if len(docs) < 2:
    raise DataError(f"need at least 2 documents for a train/eval split, got {len(docs)}; add input text")
  if full and not embedded:  # the user asked for a cap: say what it dropped, and how to keep everything
    given = sum(s["size"] for s in signature)
    log(f"prepare-data: --max-mb {opts.max_mb:g} reached: kept {total / 1e6:.2f} MB of text ({len(docs)} documents,"
        f" {len(inputs_record)} of {len(files)} input files; the inputs are {given / 1e6:.2f} MB on disk); the rest"
        " is not in the dataset -- pass --max-mb 0 (or leave it out) to keep everything")

  # Split by content hash, or by file for site-packages (see module docstring); the content hash is over
  # the same document hashes.
  train, evals, content = [], [], hashlib.sha256()
  train_order = []
  for i, d in enumerate(docs):
    digest = hashlib.sha256(d.encode("utf-8")).hexdigest()
    content.update(f"{digest}\n".encode())
    rank = _path_rank(f"split:{piece_of[i][0]}") if site else int(digest[:8], 16)
    held_out = rank / 2**32 < opts.eval_fraction
    (evals if held_out else train).append(d)
    if site and not held_out:
      train_order.append((_path_rank(f"{piece_of[i][0]}#{piece_of[i][1]}"), piece_of[i]))
  if site:
    if not evals:  # no file hashed into eval (a tiny corpus): the last file goes there whole (held out by file)
      last = piece_of[-1][0]
      keep = [i for i, (_, (rel, _)) in enumerate(train_order) if rel != last]
      evals = [d for (_, (rel, _)), d in zip(train_order, train) if rel == last]
      train, train_order = [train[i] for i in keep], [train_order[i] for i in keep]
    # a mixture of all packages in every window of the stream (module docstring)
    train = [d for _, d in sorted(zip(train_order, train), key=lambda x: x[0])]
  if not evals:
    evals.append(train.pop())
  if not train:
    train.append(evals.pop())

  shutil.rmtree(build, ignore_errors=True)  # left by an interrupted run
  os.makedirs(build)
  try:
    train_bytes = sum(len(d.encode("utf-8")) for d in train)
    n_shards = max(1, min(len(train), math.ceil(train_bytes / (opts.shard_mb * 1e6))))
    t0 = time.time()
    splits = {
        "train": {"documents": len(train), "text_bytes": train_bytes,
                  "files": _write_split(build, "train", train, n_shards)},
        "eval": {"documents": len(evals), "text_bytes": sum(len(d.encode()) for d in evals),
                 "files": _write_split(build, "eval", evals, 1)},
    }
    log(f"prepare-data: wrote {len(train)} train / {len(evals)} eval documents ({total / 1e6:.2f} MB) in"
        f" {time.time() - t0:.1f}s")
    if opts.tokenizer == "bpe":
      log(f"prepare-data: training a {opts.vocab_size}-token byte-level BPE on the train split ...")
    tokenizer = _tokenizer_info(opts, build, out, train)
    if site:
      source = {"kind": "site-packages", "description": "*.py sources of this Python's installed packages",
                "site_packages_dirs": site_packages_dirs(), "python_version": sys.version.split()[0]}
    elif embedded:
      source = {"kind": "embedded", "description": "Python standard library *.py sources",
                "stdlib_dir": stdlib_dir(), "python_version": sys.version.split()[0]}
    else:
      source = {"kind": "files"}
    if tokenizer and tokenizer["type"] == "huggingface":
      splits["train"]["tokens"] = _count_tokens(os.path.join(build, "tokenizer", "tokenizer.json"), train)
      splits["train"]["steps_without_repeat"] = splits["train"]["tokens"] // DEMO_TOKENS_PER_STEP
      log(f"prepare-data: train split {splits['train']['tokens']:,} tokens: "
          f"lasts {splits['train']['steps_without_repeat']:,} CPU-demo steps ({DEMO_TOKENS_PER_STEP} tokens each)"
          " without reading a document twice")
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
    with open(os.path.join(build, "manifest.json"), "w", encoding="utf-8") as f:
      json.dump(manifest, f, indent=1)
    _swap_in(build, out, previous)
  finally:
    shutil.rmtree(build, ignore_errors=True)
  return manifest, True


def _parser() -> argparse.ArgumentParser:
  d = PrepareOptions()
  ap = cli.ArgumentParser(
      prog=PROG,
      description="Build a local MaxText dataset (grain/parquet + tokenizer + manifest). Default: the"
      " embedded corpus (this Python's standard-library sources) into data/embedded/, which the demo"
      " recipes read.")
  ap.add_argument("--input", "-i", nargs="+", default=[], metavar="PATH",
                  help="text / JSONL / .json.gz files or dirs (e.g. C4 shards) instead of the embedded corpus")
  ap.add_argument("--corpus", default=d.corpus, choices=CORPORA,
                  help="embedded corpus without --input: stdlib (this Python's standard library, ~2.5M tokens) or"
                  " site-packages (this Python's installed packages, held out by file; for runs past ~2,000"
                  " demo steps, e.g. --max-mb 48: >= 10M tokens)")
  ap.add_argument("--out", "-o", default=None, help=f"output dir (default {DEFAULT_OUT} for the embedded corpus,"
                  " data/custom for --input)")
  ap.add_argument("--max-mb", type=float, default=None,
                  help=f"cap on total text, MB (<= 0: no cap; default {d.max_mb:g} for the embedded corpus, no cap"
                  " for --input: your files are kept whole)")
  ap.add_argument("--max-file-kb", type=int, default=d.max_file_kb, help="embedded: skip larger source files")
  ap.add_argument("--max-doc-kb", type=int, default=None,
                  help=f"plain text: max document size, KB (default {d.max_doc_kb}; site-packages {SITE_PACKAGES_DOC_KB})")
  ap.add_argument("--eval-fraction", type=float, default=d.eval_fraction)
  ap.add_argument("--shard-mb", type=float, default=d.shard_mb, help="target train parquet shard size, MB")
  ap.add_argument("--tokenizer", default=d.tokenizer, choices=("bpe", "llama3", "none"),
                  help="bpe: train a small BPE (CPU demos); llama3: MaxText's Llama 3 tiktoken (8B recipes)")
  ap.add_argument("--vocab-size", type=int, default=d.vocab_size, help="BPE vocabulary size")
  ap.add_argument("--text-field", default=d.text_field, help="JSON field holding the text")
  ap.add_argument("--quiet", action="store_true", help="no progress bar")
  return ap


def cli_main(argv: list[str]) -> int:
  try:
    args = _parser().parse_args(argv)
  except SystemExit as e:  # --help: 0; a usage error: 2, after its one line on stderr
    return int(e.code or 0)
  out = args.out or (os.path.join("data", "custom") if args.input else
                     os.path.join("data", "site-packages") if args.corpus == "site-packages" else DEFAULT_OUT)
  max_doc_kb = args.max_doc_kb if args.max_doc_kb is not None else (
      SITE_PACKAGES_DOC_KB if args.corpus == "site-packages" else PrepareOptions().max_doc_kb)
  max_mb = args.max_mb if args.max_mb is not None else (0.0 if args.input else PrepareOptions().max_mb)
  opts = PrepareOptions(inputs=tuple(args.input), corpus=args.corpus, out=out, max_mb=max_mb,
                        max_file_kb=args.max_file_kb, max_doc_kb=max_doc_kb, eval_fraction=args.eval_fraction,
                        shard_mb=args.shard_mb,
                        tokenizer=args.tokenizer, vocab_size=args.vocab_size, text_field=args.text_field)
  try:
    manifest, _ = prepare(opts, progress=not args.quiet and sys.stderr.isatty())
  except DataError as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
  print(f"prepare-data: dataset ready in {manifest['out']} ({manifest['splits']['train']['documents']} train,"
        f" {manifest['splits']['eval']['documents']} eval documents; content sha256"
        f" {manifest['source']['content_sha256'][:16]}...)")
  print("MaxText overrides: " + " ".join(manifest["maxtext_args"]))
  return 0


if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
