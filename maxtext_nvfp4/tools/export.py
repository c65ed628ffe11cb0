"""``maxtext-nvfp4 export CHECKPOINT_DIR --out DIR [--config R.yml] [key=value ...]``: a MaxText Llama
checkpoint -> a Hugging Face directory in ModelOpt's unified NVFP4 format (what vLLM's ``modelopt_fp4``,
SGLang and TensorRT-LLM load). The format, with its sources: docs/export.md.

Written to ``DIR``:

  model.safetensors     per quantized linear ``<name>.weight`` (uint8 [out, in/2]), ``.weight_scale``
                        (float8_e4m3fn [out, in/16]), ``.weight_scale_2`` and ``.input_scale`` (float32
                        scalars); everything else (embeddings, norms, lm_head, excluded linears) bf16
  config.json           LlamaForCausalLM config + ``quantization_config`` (quant_method modelopt,
                        quant_algo NVFP4, ignore = the excluded modules)
  hf_quant_config.json  ModelOpt's legacy file (quant_algo NVFP4, group_size 16, exclude_modules, ...)
  tokenizer files       copied when the run's ``tokenizer_path`` is a local Hugging Face tokenizer dir

Which linears are NVFP4: for a ``quantization: nvfp4`` run, those whose forward trained in NVFP4 (the
``nvfp4_keep_*`` layers and projections outside ``nvfp4_targets`` stay bf16, as in training); for other
runs (bf16, fp8) every decoder linear (``--quantize all`` forces that for NVFP4 runs too). lm_head is
always excluded. ``input_scale`` = activation amax / 2688 from a calibration pass (an HF-order fp32
forward of the unquantized weights, as ModelOpt's max calibration) over ``--calibration-batches`` batches
of the run's eval data (its train data when it has no eval split).

Errors (bad checkpoint path, a checkpoint that does not fit the config, an unsupported model, data that
cannot be read) end with ONE line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys

import numpy as np

PROG = "maxtext-nvfp4 export"


class _Parser(argparse.ArgumentParser):
  def error(self, message: str):  # one line on stderr, exit 2 (argparse prints its usage block first)
    self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
  p = _Parser(prog=PROG, description="Export a MaxText Llama checkpoint in ModelOpt's NVFP4 HF format")
  p.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                 help="a run's checkpoints/ dir (latest step), one checkpoints/<step>/ dir, or its items/ dir")
  p.add_argument("--out", required=True, help="output directory (created; existing files are overwritten)")
  p.add_argument("--config", default=None, help="the recipe the run trained with (default: MaxText's base.yml)")
  p.add_argument("--calibration-batches", type=int, default=8,
                 help="eval batches for the activation amax (input_scale); default 8")
  p.add_argument("--quantize", choices=("trained", "all"), default="trained",
                 help="trained: the linears that trained in NVFP4 (every decoder linear for non-NVFP4 runs); all")
  p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for training")
  return p


def _fail(message: str) -> int:
  print(f"{PROG}: error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
  return 2


def quantized_linears(model, mode: str) -> list[str]:
  """HF linear names to export in NVFP4 (a fused group is all in or all out: engines fuse it)."""
  from maxtext_nvfp4.core import serving  # pylint: disable=import-outside-toplevel

  nvfp4_run = any(model.trained_nvfp4.values())
  chosen = {n for n, t in model.trained_nvfp4.items() if mode == "all" or t or not nvfp4_run}
  for name in list(chosen):
    prefix, leaf = name.rsplit(".", 1)
    for group in serving.FUSED_GROUPS:
      if leaf in group and not all(f"{prefix}.{g}" in chosen for g in group):
        chosen.discard(name)
  return [n for n in model.trained_nvfp4 if n in chosen]


def calibrate(model, batches, progress, total: int) -> dict[str, float]:
  """``{linear: max activation amax over the batches}`` from the HF-order forward (unquantized weights)."""
  import jax  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.core import serving  # pylint: disable=import-outside-toplevel

  fwd = jax.jit(lambda w, t, p, s: serving.llama_forward(w, model.shape, t, p, s)[1])
  amax: dict[str, float] = {}
  for batch in progress(batches, desc="calibration", unit="batch", total=total):
    got = fwd(model.tensors, batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    for k, v in got.items():
      amax[k] = max(amax.get(k, 0.0), float(v))
  return amax


def export_tensors(model, names: list[str], amax: dict[str, float], progress) -> dict[str, np.ndarray]:
  """The safetensors contents: ModelOpt NVFP4 tensors for ``names``, bf16 for every other tensor."""
  import ml_dtypes  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.core import serving  # pylint: disable=import-outside-toplevel

  quantized = set(names)
  out = {k: v.astype(ml_dtypes.bfloat16) for k, v in model.tensors.items() if k[: -len(".weight")] not in quantized}
  units = serving.linear_units(names)  # fused groups share one global weight scale and one input scale
  for unit in progress(units, desc="quantize", unit="linear"):
    lins = serving.quantize_linears([model.tensors[n + ".weight"] for n in unit])
    scale_in = serving.input_scale(max(amax[n] for n in unit))
    for n, lin in zip(unit, lins):
      out[n + ".weight"] = lin.weight
      out[n + ".weight_scale"] = lin.weight_scale
      out[n + ".weight_scale_2"] = lin.weight_scale_2
      out[n + ".input_scale"] = scale_in
  return out


def quant_configs(excluded: list[str]) -> tuple[dict, dict]:
  """``(hf_quant_config.json, config.json quantization_config)`` in ModelOpt's two layouts."""
  import maxtext_nvfp4  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.core import serving  # pylint: disable=import-outside-toplevel

  producer = {"name": "maxtext-nvfp4", "version": maxtext_nvfp4.__version__}
  legacy = {"producer": producer, "quantization": {
      "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": serving.GROUP_SIZE,
      "exclude_modules": excluded}}
  group = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": serving.GROUP_SIZE}
  hf = {"config_groups": {"group_0": {"input_activations": dict(group), "weights": dict(group), "targets": ["Linear"]}},
        "ignore": excluded, "quant_algo": "NVFP4", "producer": producer, "quant_method": "modelopt"}
  return legacy, hf


def write(out_dir: str, tensors: dict[str, np.ndarray], hf_config: dict, excluded: list[str]) -> None:
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from safetensors.flax import save_file  # pylint: disable=import-outside-toplevel

  os.makedirs(out_dir, exist_ok=True)
  save_file({k: jnp.asarray(v) for k, v in tensors.items()}, os.path.join(out_dir, "model.safetensors"),
            metadata={"format": "pt"})  # transformers loads only safetensors marked "pt"
  legacy, hf_quant = quant_configs(excluded)
  with open(os.path.join(out_dir, "hf_quant_config.json"), "w", encoding="utf-8") as f:
    json.dump(legacy, f, indent=2)
  with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
    json.dump({**hf_config, "quantization_config": hf_quant}, f, indent=2)


def _copy_tokenizer(config, out_dir: str) -> bool:
  src = str(getattr(config, "tokenizer_path", "") or "")
  if not os.path.isdir(src) or not os.path.exists(os.path.join(src, "tokenizer.json")):
    return False
  for name in os.listdir(src):
    if name.startswith("tokenizer") or name in ("special_tokens_map.json", "vocab.json", "merges.txt"):
      shutil.copy2(os.path.join(src, name), os.path.join(out_dir, name))
  return True


def run_export(checkpoint: str, out_dir: str, config_args: list[str], *, calibration_batches: int,
               quantize: str = "trained", quiet: bool = False) -> dict:
  """Export; returns a summary dict. Raises ``checkpoint.CheckpointError`` (one-line message)."""
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.integration import checkpoint as ckpt  # pylint: disable=import-outside-toplevel

  progress = functools.partial(tqdm, disable=quiet, file=sys.stderr)

  if calibration_batches < 1:
    raise ckpt.CheckpointError("--calibration-batches must be >= 1 (NVFP4 W4A4 serving needs every input_scale)")
  items = ckpt.find_items(checkpoint)
  config = ckpt.load_config(config_args)
  model = ckpt.to_hf(items, config)
  names = quantized_linears(model, quantize)
  if not names:
    raise ckpt.CheckpointError(f"checkpoint {items}: no decoder linear to quantize (use --quantize all)")
  amax = calibrate(model, ckpt.eval_batches(config, calibration_batches), progress, calibration_batches)
  if not amax:
    raise ckpt.CheckpointError("calibration data: the run's data gave no batch")
  tensors = export_tensors(model, names, amax, progress)
  excluded = ["lm_head"] + [n for n in model.trained_nvfp4 if n not in set(names)]
  if model.hf_config["tie_word_embeddings"]:
    excluded = excluded[1:]
  write(out_dir, tensors, model.hf_config, excluded)
  tokenizer = _copy_tokenizer(config, out_dir)
  return {"items": items, "quantized": names, "excluded": excluded, "tokenizer_copied": tokenizer}


def cli_main(argv: list[str]) -> int:
  try:
    a = build_parser().parse_intermixed_args(argv)
  except SystemExit as e:  # --help: 0; a usage error: 2, after its one line on stderr
    return int(e.code or 0)
  from maxtext_nvfp4.integration import checkpoint as ckpt  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import recipes  # pylint: disable=import-outside-toplevel

  bad = [t for t in a.overrides if "=" not in t]
  if bad:
    return _fail(f"{bad[0]!r} is not key=value (config overrides come after the options)")
  try:
    config_args = ([recipes.find_recipe(a.config)] if a.config else []) + list(a.overrides)
    summary = run_export(a.checkpoint, a.out, config_args, calibration_batches=a.calibration_batches,
                         quantize=a.quantize)
  except (ckpt.CheckpointError, recipes.RecipeError) as e:
    return _fail(str(e))
  print(f"exported {summary['items']} -> {a.out}: {len(summary['quantized'])} NVFP4 linears,"
        f" {len(summary['excluded'])} excluded modules ({', '.join(summary['excluded'][:4])}"
        f"{', ...' if len(summary['excluded']) > 4 else ''})")
  return 0


if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
