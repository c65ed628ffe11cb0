"""Tiny-model MaxText argv builder shared by the tests (CPU, 2 cores: each run takes ~10-30 s)."""

from __future__ import annotations

import json
import os

import maxtext  # the package only (cheap); MaxText internals are imported by the code under test

import maxtext_nvfp4

# The tests run MaxText in-process: register the plugin (importing the package registers nothing).
maxtext_nvfp4.register()

MAXTEXT_DIR = os.path.dirname(maxtext.__file__)
BASE_YML = os.path.join(MAXTEXT_DIR, "configs", "base.yml")
TOKENIZER = os.path.join(MAXTEXT_DIR, "assets", "tokenizers", "tokenizer.llama2")

# A 2-4 layer Llama-style model (llama2 decoder block: wi_0/wi_1/wo + query/key/value/out) that compiles
# and trains in seconds on CPU.
TINY_MODEL = {
    "base_emb_dim": 64,
    "base_num_query_heads": 4,
    "base_num_kv_heads": 4,
    "base_mlp_dim": 128,
    "base_num_decoder_layers": 3,
    "head_dim": 16,
    "vocab_size": 256,
    "max_target_length": 64,
    "per_device_batch_size": 1,
}

# Offline, local-only, quiet: what every CPU test run needs.
RUN_DEFAULTS = {
    "dataset_type": "synthetic",
    "attention": "dot_product",
    "enable_checkpointing": False,
    "enable_goodput_recording": False,
    "monitor_goodput": False,
    "enable_tensorboard": False,
    "log_config": False,
    "scan_layers": False,
    "steps": 3,
    "tokenizer_path": TOKENIZER,
}


def tiny_argv(out_dir: str | None = None, *, run_name: str = "tiny", config: str | None = None, **overrides) -> list[str]:
  """``[None, config.yml, key=value, ...]`` for ``train.main`` / ``pyconfig.initialize`` (argv[0] is ignored).

  ``out_dir`` sets ``base_output_directory`` and ``metrics_file=<out_dir>/<run_name>.jsonl``.
  Overrides win over the tiny-model and run defaults; a value of None drops the key.
  """
  keys = {**TINY_MODEL, **RUN_DEFAULTS, "run_name": run_name}
  if out_dir is not None:
    keys["base_output_directory"] = out_dir
    keys["metrics_file"] = os.path.join(out_dir, f"{run_name}.jsonl")
  keys.update(overrides)
  argv = [None, config or BASE_YML]
  for k, v in keys.items():
    if v is None:
      continue
    if isinstance(v, bool):
      v = str(v).lower()
    argv.append(f"{k}={v}")
  return argv


def read_metrics(path: str) -> list[dict]:
  """MaxText's ``metrics_file`` as raw records, one JSON object per line (training and eval records)."""
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def losses(path: str) -> dict[int, float]:
  """``{train step: learning/loss}`` of a metrics file's training records (eval records have their own
  steps; the package's one reader, :mod:`maxtext_nvfp4.tools.metrics`, tells them apart)."""
  from maxtext_nvfp4.tools import metrics  # pylint: disable=import-outside-toplevel

  run = metrics.read(path, strict=False)
  return {s: run.loss(s) for s in run.sorted_steps}
