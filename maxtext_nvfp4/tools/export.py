"""``maxtext-nvfp4 export CHECKPOINT_DIR --out DIR [--config R.yml] [key=value ...]``: a MaxText Llama
checkpoint -> a Hugging Face directory in ModelOpt's unified NVFP4 format (what vLLM's ``modelopt_fp4``,
SGLang and TensorRT-LLM load). The format, with its sources: docs/export.md.

Written to ``DIR`` (built in a hidden sibling and swapped in whole: :mod:`maxtext_nvfp4.tools.outputs`;
``DIR`` must be new, empty or an earlier export, recognised by its ``maxtext_nvfp4_export.json``):

  model.safetensors     per quantized linear ``<name>.weight`` (uint8 [out, in/2]), ``.weight_scale``
                        (float8_e4m3fn [out, in/16]), ``.weight_scale_2`` and ``.input_scale`` (float32
                        scalars); everything else (embeddings, norms, lm_head, excluded linears) bf16
  config.json           LlamaForCausalLM config + ``quantization_config`` (quant_method modelopt,
                        quant_algo NVFP4, ignore = the excluded modules); bos/eos/pad ids from the tokenizer
  hf_quant_config.json  ModelOpt's legacy file (quant_algo NVFP4, group_size 16, exclude_modules, ...)
  tokenizer files       the run's tokenizer as a server needs it (no appended EOS), and
                        generation_config.json (:mod:`maxtext_nvfp4.tools.tokenizer_export`);
                        ``--no-tokenizer``: none
  maxtext_nvfp4_export.json  what was exported from what (checkpoint, config, calibration data), last

The config: ``--config`` / overrides when given, else the run's ``maxtext_nvfp4_run.json`` (written by
``maxtext-nvfp4 train``), else MaxText's base.yml; whichever it is, the checkpoint's own shapes must match
it (:mod:`maxtext_nvfp4.tools.model_shapes`), or the export stops naming both values.

Which linears are NVFP4: for a ``quantization: nvfp4`` run, those whose forward trained in NVFP4 (the
``nvfp4_keep_*`` layers and projections outside ``nvfp4_targets`` stay bf16, as in training); for other
runs (bf16, fp8) every decoder linear (``--quantize all`` forces that for NVFP4 runs too). lm_head is
always excluded. ``input_scale`` = activation amax / 2688 from a calibration pass (an HF-order fp32
forward of the unquantized weights, as ModelOpt's max calibration) over ``--calibration-batches`` batches
of the run's eval data (its train data when it has no eval split); ``dataset_type=synthetic`` (random
tokens) is refused unless ``--calibrate-on-synthetic``; the data used is printed and recorded.

Errors (an ``--out`` that cannot be written, bad checkpoint path, a config that does not fit the
checkpoint, an unsupported model or tokenizer, data that cannot be read) end with ONE line on stderr and
exit code 2, all before any weight is read, and ``DIR`` is left as it was.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import numpy as np

from maxtext_nvfp4.tools import cli
from maxtext_nvfp4.tools import cliargs

PROG = "maxtext-nvfp4 export"


def build_parser() -> argparse.ArgumentParser:
  p = cli.ArgumentParser(prog=PROG, description="Export a MaxText Llama checkpoint in ModelOpt's NVFP4 HF format")
  p.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                 help="a run's checkpoints/ dir (latest step), one checkpoints/<step>/ dir, or its items/ dir")
  p.add_argument("--out", required=True,
                 help="output folder: new, empty, or an earlier export (replaced as a whole, in one rename)")
  p.add_argument("--config", default=None,
                 help="the recipe the run trained with (default: the run's maxtext_nvfp4_run.json, else base.yml)")
  p.add_argument("--calibration-batches", type=cliargs.number(integer=True, at_least=1), default=8,
                 help="eval batches for the activation amax (input_scale); default 8")
  p.add_argument("--quantize", choices=("trained", "all"), default="trained",
                 help="trained: the linears that trained in NVFP4 (every decoder linear for non-NVFP4 runs); all")
  p.add_argument("--calibrate-on-synthetic", action="store_true",
                 help="allow dataset_type=synthetic calibration data (random tokens; refused otherwise)")
  p.add_argument("--no-tokenizer", action="store_true", help="export the weights without the tokenizer files")
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


MARKER = "maxtext_nvfp4_export.json"  # written last into every export: what marks a folder as ours


def write(out_dir: str, tensors: dict[str, np.ndarray], hf_config: dict, excluded: list[str]) -> None:
  """The weights and the two configs into ``out_dir`` (an existing, empty build folder)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from safetensors.flax import save_file  # pylint: disable=import-outside-toplevel

  save_file({k: jnp.asarray(v) for k, v in tensors.items()}, os.path.join(out_dir, "model.safetensors"),
            metadata={"format": "pt"})  # transformers loads only safetensors marked "pt"
  legacy, hf_quant = quant_configs(excluded)
  with open(os.path.join(out_dir, "hf_quant_config.json"), "w", encoding="utf-8") as f:
    json.dump(legacy, f, indent=2)
  with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
    json.dump({**hf_config, "quantization_config": hf_quant}, f, indent=2)


def _get(config, key, default=None):
  value = getattr(config, key, default)
  return getattr(value, "value", value)


def data_description(config) -> str:
  """Which data MaxText's input pipeline reads for ``config`` (its eval split, else its train split)."""
  kind = str(_get(config, "dataset_type", "") or "")
  evals = _get(config, "eval_interval", -1) and int(_get(config, "eval_interval", -1) or -1) > 0
  if kind == "grain":
    files = _get(config, "grain_eval_files" if evals and _get(config, "grain_eval_files") else "grain_train_files")
    return f"dataset_type=grain {files}"
  if kind == "hf":
    return f"dataset_type=hf {_get(config, 'hf_path', '')} {_get(config, 'hf_data_dir', '') or ''}".strip()
  if kind == "tfds":
    return f"dataset_type=tfds {_get(config, 'dataset_name', '')}"
  return f"dataset_type={kind}"


def check_supported(config) -> None:
  """The Llama exporter's model check (``checkpoint.to_hf`` runs it after reading the weights), asked
  first so an unsupported model is refused before any data or weight is read."""
  from maxtext_nvfp4.integration import checkpoint as ckpt  # pylint: disable=import-outside-toplevel

  check = getattr(ckpt, "_check_supported", None)
  if check is not None:
    check(config)


def check_calibration_data(config, *, allow_synthetic: bool) -> str:
  """The data description; :class:`checkpoint.CheckpointError` for synthetic data unless allowed."""
  from maxtext_nvfp4.integration import checkpoint as ckpt  # pylint: disable=import-outside-toplevel

  desc = data_description(config)
  if str(_get(config, "dataset_type", "")) == "synthetic" and not allow_synthetic:
    raise ckpt.CheckpointError("calibration data: the config says dataset_type=synthetic (random tokens: input_scale"
                               " would not fit real prompts); pass the run's real data (dataset_type=grain"
                               " grain_train_files=... or dataset_type=hf ...), or --calibrate-on-synthetic")
  return desc


def _batches(config, n: int, flag: str):
  """``checkpoint.eval_batches`` with its data error naming a fix this command accepts."""
  from maxtext_nvfp4.integration import checkpoint as ckpt  # pylint: disable=import-outside-toplevel

  try:
    yield from ckpt.eval_batches(config, n)
  except ckpt.CheckpointError as e:
    msg = str(e).replace(", or pass --calibration-batches 0", "")
    raise ckpt.CheckpointError(f"{msg} (dataset keys: dataset_type, grain_train_files/grain_eval_files, hf_path;"
                               f" {flag} sets how many batches)") from None


def resolve_config_args(items: str, config: str | None, overrides: list[str]) -> tuple[list[str], str]:
  """``(config args, where they came from)``: ``--config``/overrides when given, else the run's record
  (:mod:`maxtext_nvfp4.tools.run_record`), else MaxText's base.yml."""
  from maxtext_nvfp4.tools import recipes  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import run_record  # pylint: disable=import-outside-toplevel

  if config or overrides:
    return ([recipes.find_recipe(config)] if config else []) + list(overrides), "the command line"
  found = run_record.find(items)
  if found:
    return found[1], found[0]
  return [], "MaxText's base.yml (no --config and no maxtext_nvfp4_run.json beside the checkpoint)"


def run_export(checkpoint: str, out_dir: str, config_args: list[str] | None, *, calibration_batches: int,
               quantize: str = "trained", quiet: bool = False, allow_synthetic: bool = False,
               tokenizer: bool = True, config_overrides: list[str] = ()) -> dict:
  """Export; returns a summary dict. Raises ``checkpoint.CheckpointError``, ``outputs.OutputError``,
  ``model_shapes.ShapeMismatch`` or ``tokenizer_export.TokenizerError`` (one-line messages), all before
  any weight is read (the calibration batches are read first); ``out_dir`` is untouched then.

  ``config_args``: ``[RECIPE.yml] key=value ...``; None: :func:`resolve_config_args` of
  ``config_overrides`` (the run's record when empty).
  """
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.integration import checkpoint as ckpt  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import model_shapes  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import outputs  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import tokenizer_export  # pylint: disable=import-outside-toplevel

  progress = functools.partial(tqdm, disable=quiet, file=sys.stderr)
  say = (lambda *_: None) if quiet else (lambda m: print(m, file=sys.stderr, flush=True))

  if calibration_batches < 1:
    raise ckpt.CheckpointError("--calibration-batches must be >= 1 (NVFP4 W4A4 serving needs every input_scale)")
  out_dir = outputs.check_out_dir(out_dir, marker=MARKER, what="maxtext-nvfp4 export")
  items = ckpt.find_items(checkpoint)
  source = "the caller"
  if config_args is None:
    config_args, source = resolve_config_args(items, None, list(config_overrides))
  config = ckpt.load_config(config_args)
  dims = model_shapes.check(items, config)
  check_supported(config)
  data = check_calibration_data(config, allow_synthetic=allow_synthetic)
  tok_plan = tokenizer_export.plan(config, dims.get("vocab_size", int(config.vocab_size))) if tokenizer else None
  batches = list(_batches(config, calibration_batches, "--calibration-batches"))  # data errors before the weights
  if not batches:
    raise ckpt.CheckpointError(f"calibration data: {data} gave no batch")
  say(f"maxtext-nvfp4 export: config from {source}; calibrating input_scale on {len(batches)} batch(es) of {data}")
  model = ckpt.to_hf(items, config)
  names = quantized_linears(model, quantize)
  if not names:
    raise ckpt.CheckpointError(f"checkpoint {items}: no decoder linear to quantize (use --quantize all)")
  amax = calibrate(model, batches, progress, len(batches))
  tensors = export_tensors(model, names, amax, progress)
  excluded = ["lm_head"] + [n for n in model.trained_nvfp4 if n not in set(names)]
  if model.hf_config["tie_word_embeddings"]:
    excluded = excluded[1:]

  def build(tmp: str) -> None:
    ids = tokenizer_export.write(tok_plan, tmp) if tok_plan else {"bos_token_id": None, "eos_token_id": None}
    hf_config = {**model.hf_config, "bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"]}
    if ids.get("pad_token_id") is not None:
      hf_config["pad_token_id"] = ids["pad_token_id"]
    write(tmp, tensors, hf_config, excluded)

  import maxtext_nvfp4  # pylint: disable=import-outside-toplevel

  marker = {"producer": "maxtext-nvfp4 export", "version": maxtext_nvfp4.__version__, "checkpoint": items,
            "config_args": list(config_args), "config_source": source, "calibration": {
                "batches": calibration_batches, "data": data}, "tokenizer": tok_plan.kind if tok_plan else None}
  outputs.publish_dir(out_dir, build, marker=MARKER, marker_text=json.dumps(marker, indent=2) + "\n")
  return {"items": items, "quantized": names, "excluded": excluded, "tokenizer_copied": tok_plan is not None,
          "out": out_dir, "data": data, "config_source": source}


def cli_main(argv: list[str]) -> int:
  try:
    a = build_parser().parse_intermixed_args(argv)
  except SystemExit as e:  # --help: 0; a usage error: 2, after its one line on stderr
    return int(e.code or 0)
  from maxtext_nvfp4.integration import checkpoint as ckpt  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import model_shapes  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import outputs  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import recipes  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import tokenizer_export  # pylint: disable=import-outside-toplevel

  bad = [t for t in a.overrides if "=" not in t]
  if bad:
    return _fail(f"{bad[0]!r} is not key=value (config overrides come after the options)")
  try:
    config_args = ([recipes.find_recipe(a.config)] + list(a.overrides)) if a.config else None
    summary = run_export(a.checkpoint, a.out, config_args, calibration_batches=a.calibration_batches,
                         quantize=a.quantize, allow_synthetic=a.calibrate_on_synthetic,
                         tokenizer=not a.no_tokenizer, config_overrides=a.overrides)
  except (ckpt.CheckpointError, recipes.RecipeError, outputs.OutputError, model_shapes.ShapeMismatch,
          tokenizer_export.TokenizerError) as e:
    return _fail(str(e))
  except OSError as e:  # the disk filled or a permission changed mid-write: the old export is still in place
    return _fail(f"--out {a.out}: writing failed ({e.strerror or e}); nothing was replaced")
  print(f"exported {summary['items']} -> {summary['out']}: {len(summary['quantized'])} NVFP4 linears,"
        f" {len(summary['excluded'])} excluded modules ({', '.join(summary['excluded'][:4])}"
        f"{', ...' if len(summary['excluded']) > 4 else ''}); tokenizer"
        f" {'written' if summary['tokenizer_copied'] else 'not written (--no-tokenizer)'}")
  return 0


if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
