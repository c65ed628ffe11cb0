"""``maxtext-nvfp4 prepare-sft-data``: the CPU fine-tuning demo's prompt/completion data, made locally from real text.

The demo pre-training data (``prepare-data``, ``data/embedded/``: this Python's standard-library sources) is
turned into an instruction set MaxText's SFT pipeline reads (``use_sft``: columns ``prompt`` and ``completion``,
the chat template of the ``sft_demo_*`` recipes, loss on the completion only)::

    prompt      the ``def`` line(s) and docstring of a documented function (dedented)
    completion  the rest of that function's source: its body after the docstring (dedented)

Each split comes from the same split of ``data/embedded`` (SFT eval functions are from files the pre-training
run never trained on). Functions are taken in document order; kept when the prompt has at most
``MAX_PROMPT`` characters and the completion between ``MIN_COMPLETION`` and ``MAX_COMPLETION`` (so most
examples fit the recipes' 256 tokens). A file Python cannot parse is skipped.

Output (``OUT``, default ``data/embedded_sft``): ``train-00000-of-00001.parquet``, ``eval-00000-of-00001.parquet``
and ``manifest.json`` (the source dataset's ``content_sha256``, the counts). Built beside ``OUT`` and renamed into
place; rebuilt only when the source dataset changed. Builds ``data/embedded`` first when it is missing.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import sys
import textwrap

from maxtext_nvfp4.tools import cli

PROG = "maxtext-nvfp4 prepare-sft-data"
DEFAULT_OUT = os.path.join("data", "embedded_sft")
FORMAT_VERSION = 1
# characters: a prompt (signature + docstring) at most, a completion (the body) within these bounds
MAX_PROMPT = 600
MIN_COMPLETION = 40
MAX_COMPLETION = 900


class SftDataError(Exception):
  """A bad input or option (one line; exit code 2)."""


def function_examples(source: str) -> list[dict[str, str]]:
  """``[{"prompt": ..., "completion": ...}]`` of the documented functions of one Python source text."""
  try:
    tree = ast.parse(source)
  except (SyntaxError, ValueError):
    return []
  lines = source.splitlines()
  out = []
  for node in ast.walk(tree):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
      continue
    doc, body = node.body[0], node.body[1:]
    if not body or node.decorator_list:
      continue
    head = textwrap.dedent("\n".join(lines[node.lineno - 1 : doc.end_lineno]))
    indent = len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())
    tail = "\n".join(line[indent:] for line in lines[doc.end_lineno : node.end_lineno])
    if len(head) <= MAX_PROMPT and MIN_COMPLETION <= len(tail) <= MAX_COMPLETION:
      out.append({"prompt": head + "\n", "completion": tail + "\n"})
  return out


def _read_texts(pattern: str) -> list[str]:
  import glob  # pylint: disable=import-outside-toplevel

  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

  texts = []
  for path in sorted(glob.glob(pattern)):
    texts += pq.read_table(path, columns=["text"]).column("text").to_pylist()
  return texts


def _write(path: str, rows: list[dict[str, str]]) -> None:
  import pyarrow as pa  # pylint: disable=import-outside-toplevel
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel

  table = pa.table({k: pa.array([r[k] for r in rows], type=pa.string()) for k in ("prompt", "completion")})
  pq.write_table(table, path, compression="zstd")


def _manifest(folder: str) -> dict | None:
  """``folder/manifest.json`` as a dict, None when there is none; :class:`SftDataError` when it is not JSON."""
  path = os.path.join(folder, "manifest.json")
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except (OSError, ValueError) as e:
    raise SftDataError(f"{path}: not a readable manifest ({e.__class__.__name__}: {e})") from None
  if not isinstance(data, dict):
    raise SftDataError(f"{path}: not a manifest (a JSON object)")
  return data


def check_out(out: str) -> dict | None:
  """``--out``'s earlier prepare-sft-data manifest (None: new or empty folder), checked before anything is read
  or written; :class:`SftDataError` when ``out`` is a file or a folder this command did not write (a
  prepare-data dataset included: it holds a manifest.json too)."""
  if os.path.lexists(out) and not os.path.isdir(out):
    raise SftDataError(f"--out {out}: is a file, not a folder; choose a folder path (it is created)")
  if not os.path.isdir(out) or not os.listdir(out):
    return None
  try:
    old = _manifest(out)
  except SftDataError as e:
    raise SftDataError(f"--out {out}: {e}; choose another --out, or delete the folder") from None
  if old is None or "source_content_sha256" not in old or "examples" not in old:
    raise SftDataError(f"--out {out}: the folder exists and is not a prepare-sft-data output; choose a new or"
                       " empty --out (an earlier prepare-sft-data output is replaced)")
  return old


def prepare(source: str, out: str, *, log=None) -> tuple[dict, bool]:
  """Build (or reuse) the SFT demo data from the ``prepare-data`` output ``source``: ``(manifest, rebuilt)``."""
  log = log or (lambda m: print(m, file=sys.stderr, flush=True))
  old = check_out(out)
  try:
    src = _manifest(source)
  except SftDataError as e:
    raise SftDataError(f"--source {source}: {e}; rebuild it with `{cli.shell_command()} prepare-data`") from None
  if src is None:
    raise SftDataError(f"{source}: no prepare-data output here (no manifest.json); run `maxtext-nvfp4 prepare-data`"
                       " first, or pass --source DIR")
  content = src.get("content_sha256", "")
  if old is not None and old.get("source_content_sha256") == content and old.get("format_version") == FORMAT_VERSION \
      and all(os.path.isfile(os.path.join(out, n)) for n in old.get("files", [])):
    return old, False
  splits = {}
  for split in ("train", "eval"):
    rows = [ex for text in _read_texts(os.path.join(source, f"{split}-*.parquet")) for ex in function_examples(text)]
    if not rows:
      raise SftDataError(f"{source}: its {split} split has no documented Python function to make an example of")
    splits[split] = rows
  build = os.path.join(os.path.dirname(os.path.abspath(out)), f".{os.path.basename(out)}.build")
  shutil.rmtree(build, ignore_errors=True)
  os.makedirs(build)
  files = []
  for split, rows in splits.items():
    name = f"{split}-00000-of-00001.parquet"
    _write(os.path.join(build, name), rows)
    files.append(name)
  manifest = {"format_version": FORMAT_VERSION, "source": os.path.abspath(source), "source_content_sha256": content,
              "examples": {k: len(v) for k, v in splits.items()}, "files": files,
              "maxtext_args": [f"grain_train_files={os.path.abspath(out)}/train-*.parquet",
                               f"grain_eval_files={os.path.abspath(out)}/eval-*.parquet",
                               "train_data_columns=['prompt','completion']",
                               "eval_data_columns=['prompt','completion']"]}
  with open(os.path.join(build, "manifest.json"), "w", encoding="utf-8") as f:
    json.dump(manifest, f, indent=1)
  shutil.rmtree(out, ignore_errors=True)
  os.replace(build, out)
  log(f"prepare-sft-data: {manifest['examples']['train']} train / {manifest['examples']['eval']} eval examples"
      f" (documented functions of {source}) in {out}")
  return manifest, True


def cli_main(argv: list[str]) -> int:
  p = cli.ArgumentParser(prog=PROG, description="Build the CPU fine-tuning demo's prompt/completion data from the"
                         " demo pre-training data (documented stdlib functions: signature + docstring -> body).")
  p.add_argument("--source", default=os.path.join("data", "embedded"),
                 help="prepare-data output to read (default data/embedded; built first when missing)")
  p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
  args = p.parse_args(argv)
  try:
    check_out(args.out)  # before the default source is built
    if not os.path.exists(os.path.join(args.source, "manifest.json")) and args.source == os.path.join("data",
                                                                                                        "embedded"):
      from maxtext_nvfp4.tools import data  # pylint: disable=import-outside-toplevel

      try:
        data.prepare(data.PrepareOptions())
      except data.DataError as e:
        raise SftDataError(str(e)) from None
    manifest, rebuilt = prepare(args.source, args.out)
  except SftDataError as e:
    print(f"{PROG}: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  if not rebuilt:
    print(f"prepare-sft-data: {args.out} is up to date ({manifest['examples']['train']} train /"
          f" {manifest['examples']['eval']} eval examples)", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
