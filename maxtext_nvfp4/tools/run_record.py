"""The config a run trained with, recorded beside its checkpoints so later commands need no ``--config``.

``maxtext-nvfp4 train`` writes ``<base_output_directory>/<run_name>/maxtext_nvfp4_run.json`` (MaxText
puts checkpoints in ``<that folder>/checkpoints/<step>/items``) before MaxText starts:

  {"format": 1, "maxtext_nvfp4": VERSION, "args": [RECIPE.yml path, "key=value", ...],
   "model": {key: value for the shape keys the command line resolved}}

``args`` is exactly what MaxText was given (recipe resolved to its absolute path, our added defaults
included), so ``pyconfig.initialize`` of it rebuilds the run's config. ``export`` and ``eval-quantized``
read it with :func:`find` when given neither ``--config`` nor overrides; the checkpoint's own shapes are
still checked against it (:mod:`maxtext_nvfp4.tools.model_shapes`), so an edited recipe is caught.
"""

from __future__ import annotations

import json
import os

RECORD = "maxtext_nvfp4_run.json"
FORMAT = 1
# keys worth showing in the record (the shapes export checks); the args alone rebuild the config
MODEL_KEYS = ("model_name", "decoder_block", "base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "head_dim",
              "base_mlp_dim", "base_num_decoder_layers", "vocab_size", "num_experts", "base_moe_mlp_dim",
              "scan_layers", "quantization", "tokenizer_type", "tokenizer_path", "dataset_type")


def run_dir(cfg: dict) -> str | None:
  """``<base_output_directory>/<run_name>`` for a local run with a run name, else None."""
  base, name = str(cfg.get("base_output_directory") or ""), str(cfg.get("run_name") or "")
  if not base or not name or "://" in base:
    return None
  return os.path.join(os.path.abspath(base), name)


def write(folder: str, args: list[str], cfg: dict, version: str) -> str:
  """Write the record into ``folder`` (created), atomically; returns its path."""
  from maxtext_nvfp4.tools import outputs  # pylint: disable=import-outside-toplevel

  os.makedirs(folder, exist_ok=True)
  path = os.path.join(folder, RECORD)
  model = {k: cfg[k] for k in MODEL_KEYS if k in cfg and isinstance(cfg[k], (str, int, float, bool, type(None)))}
  outputs.publish_file(path, json.dumps({"format": FORMAT, "maxtext_nvfp4": version, "args": list(args),
                                         "model": model}, indent=2) + "\n")
  return path


def find(items_dir: str) -> tuple[str, list[str]] | None:
  """``(record path, args)`` for the checkpoint ``items_dir`` (``<run>/checkpoints/<step>/items``), or None."""
  d = os.path.abspath(items_dir)
  for _ in range(4):
    path = os.path.join(d, RECORD)
    if os.path.isfile(path):
      try:
        with open(path, encoding="utf-8") as f:
          rec = json.load(f)
      except (OSError, ValueError):
        return None
      if isinstance(rec, dict) and rec.get("format") == FORMAT and isinstance(rec.get("args"), list):
        return path, [str(a) for a in rec["args"]]
      return None
    d = os.path.dirname(d)
  return None
