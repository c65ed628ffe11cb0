"""``maxtext-nvfp4 export CHECKPOINT_DIR --out DIR [--format F] [--weights-only] [--config R.yml] [key=value ...]``:
a MaxText checkpoint -> a Hugging Face directory in an NVFP4 serving format (docs/export.md has the
formats with their sources):

  --format modelopt            ModelOpt's unified HF checkpoint (default): quant_algo NVFP4, or W4A16_NVFP4
                               with --weights-only; what vLLM's modelopt_fp4, SGLang and TensorRT-LLM load
  --format compressed-tensors  nvfp4-pack-quantized (NVFP4, or NVFP4A16 with --weights-only): what vLLM's
                               compressed-tensors and transformers (dequantize=True, on CPU) load

Both are written from the same quantized tensors (``core.serving_formats``). Which architecture a decoder
block exports as (llama2, mistral, qwen2, qwen3, qwen3_moe, mixtral, gemma, gemma2, gemma3, deepseek, olmo3):
``integration/export_arch.py``;
names and layouts come from MaxText's own conversion (``integration/hf_conversion.py``). MoE experts are
per-expert linears, each its own NVFP4 tensor (an expert's gate/up share one global scale, as vLLM fuses
them); routers, norms, embeddings, ``lm_head`` and every linear that trained in high precision are written
bf16 and listed as excluded.

Written to ``DIR`` (built in a hidden sibling and swapped in whole: :mod:`maxtext_nvfp4.tools.outputs`;
``DIR`` must be new, empty or an earlier export, recognised by its ``maxtext_nvfp4_export.json``):

  model.safetensors             or model-0000i-of-0000N.safetensors + model.safetensors.index.json when the
                                tensors exceed --max-shard-size (default 5GB), streamed layer by layer
  config.json                   the architecture's config + quantization_config
  hf_quant_config.json          (modelopt) ModelOpt's legacy file
  tokenizer files               the run's tokenizer as a server needs it (no appended EOS) and
                                generation_config.json (:mod:`maxtext_nvfp4.tools.tokenizer_export`)
  maxtext_nvfp4_export.json     what was exported from what, written last

Memory: the checkpoint is read one parameter at a time and converted, calibrated and written one layer at
a time (:mod:`maxtext_nvfp4.integration.hf_conversion`, :mod:`maxtext_nvfp4.tools.safetensors_shards`).

Which linears are NVFP4: for a ``quantization: nvfp4`` run, those whose forward trained in NVFP4 (the
``nvfp4_keep_*`` layers and projections outside ``nvfp4_targets`` stay bf16, as in training); for other
runs every decoder linear (``--quantize all`` forces that). ``input_scale`` (W4A4) = activation amax / 2688
from an fp32 forward of the unquantized weights (ModelOpt's max calibration; an expert's over the tokens
routed to it, an expert no calibration token reached takes its layer's largest) over
``--calibration-batches`` batches of the run's eval data; ``dataset_type=synthetic`` is refused unless
``--calibrate-on-synthetic``. ``--weights-only`` needs no calibration data.

Errors (an ``--out`` that cannot be written, bad checkpoint path, a config that does not fit the
checkpoint -- its shapes, or a tensor the written architecture needs that the checkpoint lacks, or one it
has that the architecture would not load (``hf_conversion.required_names`` / ``unused_by``) --, a run
record whose recipe is gone, an unsupported model or tokenizer, data that cannot be read) end with ONE line
on stderr and exit code 2, all before any weight is read, and ``DIR`` is left as it was.
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
  p = cli.ArgumentParser(prog=PROG, description="Export a MaxText checkpoint in an NVFP4 Hugging Face format")
  p.add_argument("checkpoint", metavar="CHECKPOINT_DIR",
                 help="a run's checkpoints/ dir (latest step), one checkpoints/<step>/ dir, or its items/ dir")
  p.add_argument("--out", required=True,
                 help="output folder: new, empty, or an earlier export (replaced as a whole, in one rename)")
  p.add_argument("--format", choices=FORMATS, default="modelopt",
                 help="modelopt (default: ModelOpt's unified HF checkpoint) or compressed-tensors (nvfp4-pack-quantized)")
  p.add_argument("--weights-only", action="store_true",
                 help="NVFP4 weights with 16-bit activations (W4A16_NVFP4 / NVFP4A16): no input scales, no calibration")
  p.add_argument("--max-shard-size", type=_size, default="5GB",
                 help="largest safetensors file (default 5GB; several files get model.safetensors.index.json)")
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


FORMATS = ("modelopt", "compressed-tensors")


def _size(text: str) -> int:
  from maxtext_nvfp4.tools import safetensors_shards  # pylint: disable=import-outside-toplevel

  try:
    return safetensors_shards.parse_size(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def _fail(message: str) -> int:
  print(f"{PROG}: error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
  return 2


def quantized_linears(trained_nvfp4: dict[str, bool], mode: str) -> list[str]:
  """HF linear names to export in NVFP4 (a fused group is all in or all out: engines fuse it)."""
  from maxtext_nvfp4.core import serving  # pylint: disable=import-outside-toplevel

  nvfp4_run = any(trained_nvfp4.values())
  chosen = {n for n, t in trained_nvfp4.items() if mode == "all" or t or not nvfp4_run}
  for name in list(chosen):
    prefix, leaf = name.rsplit(".", 1)
    for group in serving.FUSED_GROUPS:
      if leaf in group and not all(f"{prefix}.{g}" in chosen for g in group):
        chosen.discard(name)
  return [n for n in trained_nvfp4 if n in chosen]


def _at_layer0(tensors: dict, layer: int) -> dict:
  p = f"model.layers.{layer}."
  return {"model.layers.0." + k[len(p):]: v for k, v in tensors.items()}


def calibrate(conv, shape, batches: list[dict], progress) -> dict[str, float]:
  """``{linear: max input amax over the batches}`` from the HF-order fp32 forward of the unquantized weights,
  run one layer at a time (only that layer's weights in memory; one compiled layer per kind of layer:
  ``hf_forward.layer_kind``). An expert that no calibration token reached (amax 0) takes the largest amax of
  the same linear among its layer's experts."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.core import hf_forward  # pylint: disable=import-outside-toplevel

  embed = conv.tensors(None, only=frozenset({"model.embed_tokens.weight"}))["model.embed_tokens.weight"]
  hs = [hf_forward.embed(embed, np.asarray(b["inputs"]), shape) for b in batches]
  del embed

  @functools.partial(jax.jit, static_argnames="like")
  def layer0(w, h, pos, seg, like):
    amax: dict = {}
    mask = hf_forward.attention_mask(pos, seg)
    return hf_forward.decoder_layer(w, shape, 0, h, pos, mask, amax, like=like), amax

  amax: dict[str, float] = {}
  for layer in progress(range(shape.num_layers), desc="calibrate", unit="layer"):
    w = _at_layer0(conv.tensors(layer), layer)
    for j, b in enumerate(batches):
      hs[j], got = layer0(w, hs[j], jnp.asarray(b["inputs_position"]), jnp.asarray(b["inputs_segmentation"]),
                          like=hf_forward.layer_kind(shape, layer))
      for k, v in got.items():
        name = f"model.layers.{layer}." + k[len("model.layers.0."):]
        amax[name] = max(amax.get(name, 0.0), float(v))
  if shape.moe is not None:
    for layer in filter(functools.partial(hf_forward.is_moe_layer, shape), range(shape.num_layers)):
      for leaf in shape.moe.expert_linears:
        names = [f"model.layers.{layer}.{shape.moe.block}.experts.{e}.{leaf}" for e in range(shape.moe.num_experts)]
        top = max(amax[n] for n in names)
        for n in names:
          if amax[n] == 0.0:
            amax[n] = top
  return amax


def write_tensors(conv, shape, names: list[str], amax: dict[str, float], writer, progress, *, fmt: str) -> None:
  """Every tensor, one layer at a time: the NVFP4 linears ``names`` in ``fmt`` (fused groups share one
  global scale and one input scale; ``amax`` empty: weights only), everything else bf16 (``FP32_TENSORS``:
  fp32)."""
  import ml_dtypes  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.core import serving  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.core import serving_formats  # pylint: disable=import-outside-toplevel

  quantized = set(names)
  for layer in progress([None, *range(shape.num_layers)], desc="quantize+write", unit="layer"):
    t = conv.tensors(layer)
    here = [n for n in names if n + ".weight" in t]
    for unit in serving.linear_units(here):
      lins = serving.quantize_linears([t[n + ".weight"] for n in unit])
      scale_in = serving.input_scale(max(amax[n] for n in unit)) if amax else None
      for n, lin in zip(unit, lins):
        for k, v in serving_formats.linear_tensors(fmt, n, lin.weight, lin.weight_scale, lin.weight_scale_2,
                                                   scale_in).items():
          writer.add(k, v)
    for k in sorted(t):
      if k[: -len(".weight")] not in quantized:
        writer.add(k, t[k] if k.endswith(FP32_TENSORS) else t[k].astype(ml_dtypes.bfloat16))
    del t


# written fp32, as the architecture holds them: DeepSeek-V3's routing-choice bias (an fp32 buffer in
# transformers; bf16 would move which experts a token picks)
FP32_TENSORS = (".e_score_correction_bias",)

MARKER = "maxtext_nvfp4_export.json"  # written last into every export: what marks a folder as ours


def write_configs(out_dir: str, hf_config: dict, excluded: list[str], *, fmt: str, weights_only: bool) -> None:
  """config.json (+ quantization_config) and, for modelopt, hf_quant_config.json."""
  import maxtext_nvfp4  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.core import serving_formats  # pylint: disable=import-outside-toplevel

  version = maxtext_nvfp4.__version__
  if fmt == "modelopt":
    with open(os.path.join(out_dir, "hf_quant_config.json"), "w", encoding="utf-8") as f:
      json.dump(serving_formats.hf_quant_config(excluded, weights_only=weights_only, producer_version=version), f,
                indent=2)
  quant = serving_formats.quantization_config(fmt, excluded, weights_only=weights_only, producer_version=version)
  with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
    json.dump({**hf_config, "quantization_config": quant}, f, indent=2)


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


def check_supported(config):
  """The export family of ``config`` (``integration/export_arch.py``), asked first so an unsupported model is
  refused before any data or weight is read; raises ``export_arch.UnsupportedModel`` (one line)."""
  from maxtext_nvfp4.integration import export_arch  # pylint: disable=import-outside-toplevel

  return export_arch.check_supported(config)


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
    raise ckpt.CheckpointError(f"{e} (dataset keys: dataset_type, grain_train_files/grain_eval_files, hf_path;"
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
    record, args = found
    recipe = args[0] if args and "=" not in args[0] else None
    if recipe and not os.path.isfile(recipe):  # moved or deleted since the run: MaxText would say only ENOENT
      from maxtext_nvfp4.integration import checkpoint as ckpt  # pylint: disable=import-outside-toplevel

      raise ckpt.CheckpointError(f"the run's record {record} names the recipe {recipe}, which no longer exists;"
                                 " pass --config RECIPE.yml (and the key=value overrides the run trained with)")
    return args, record
  return [], "MaxText's base.yml (no --config and no maxtext_nvfp4_run.json beside the checkpoint)"


def run_export(checkpoint: str, out_dir: str, config_args: list[str] | None, *, calibration_batches: int,
               quantize: str = "trained", quiet: bool = False, allow_synthetic: bool = False,
               tokenizer: bool = True, config_overrides: list[str] = (), fmt: str = "modelopt",
               weights_only: bool = False, max_shard_size: int = 5 * 10**9) -> dict:
  """Export; returns a summary dict. Raises ``checkpoint.CheckpointError``, ``export_arch.UnsupportedModel``,
  ``outputs.OutputError``, ``model_shapes.ShapeMismatch`` or ``tokenizer_export.TokenizerError`` (one-line
  messages), all before any weight is read (the calibration batches are read first); ``out_dir`` is
  untouched then.

  ``config_args``: ``[RECIPE.yml] key=value ...``; None: :func:`resolve_config_args` of
  ``config_overrides`` (the run's record when empty).
  """
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel

  import maxtext_nvfp4  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.core import hf_forward  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import checkpoint as ckpt  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import export_arch  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import hf_conversion  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import model_shapes  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import outputs  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import safetensors_shards  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import tokenizer_export  # pylint: disable=import-outside-toplevel

  progress = functools.partial(tqdm, disable=quiet, file=sys.stderr, leave=False)
  say = (lambda *_: None) if quiet else (lambda m: print(m, file=sys.stderr, flush=True))

  if fmt not in FORMATS:
    raise ckpt.CheckpointError(f"--format {fmt}: choose one of {', '.join(FORMATS)}")
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
  tok_plan = tokenizer_export.plan(config, dims.get("vocab_size", int(config.vocab_size))) if tokenizer else None
  shape = export_arch.forward_shape(config, dims)
  hf_cfg = export_arch.hf_config(config, dims)
  conv = hf_conversion.Converter(items, config, dims, hf_cfg)
  conv.check_complete(shape, hf_cfg)  # every tensor the architecture needs (extra ones: the Converter refuses)
  trained = hf_conversion.trained_nvfp4(config, shape)
  names = quantized_linears(trained, quantize)
  if not names:
    raise ckpt.CheckpointError(f"checkpoint {items}: no decoder linear to quantize (use --quantize all)")
  data = None
  if weights_only:
    say(f"maxtext-nvfp4 export: config from {source}; weights only ({fmt}): no calibration")
    amax: dict[str, float] = {}
  else:
    data = check_calibration_data(config, allow_synthetic=allow_synthetic)
    batches = list(_batches(config, calibration_batches, "--calibration-batches"))  # data errors before the weights
    if not batches:
      raise ckpt.CheckpointError(f"calibration data: {data} gave no batch")
    say(f"maxtext-nvfp4 export: config from {source}; calibrating input_scale on {len(batches)} batch(es) of {data}")
    amax = calibrate(conv, shape, batches, progress)
  routers = [f"model.layers.{i}.{shape.moe.block}.{shape.moe.router}" for i in range(shape.num_layers)
             if hf_forward.is_moe_layer(shape, i)]
  excluded = ["lm_head", "model.embed_tokens", *routers, *[n for n in trained if n not in set(names)]]
  files: list[str] = []

  def build(tmp: str) -> None:
    writer = safetensors_shards.ShardWriter(tmp, max_shard_size)
    write_tensors(conv, shape, names, amax, writer, progress, fmt=fmt)
    files.extend(writer.close())
    ids = tokenizer_export.write(tok_plan, tmp) if tok_plan else {"bos_token_id": None, "eos_token_id": None}
    generation = export_arch.generation_config(config)
    if generation:  # what the family's server reads there (Llama 4: attn_temperature_tuning), beside the ids
      path = os.path.join(tmp, "generation_config.json")
      if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
          generation = {**json.load(f), **generation}
      with open(path, "w", encoding="utf-8") as f:
        json.dump(generation, f, indent=2)
    hf_config = {**hf_cfg, "bos_token_id": ids["bos_token_id"], "eos_token_id": ids["eos_token_id"]}
    if ids.get("pad_token_id") is not None:
      hf_config["pad_token_id"] = ids["pad_token_id"]
    write_configs(tmp, hf_config, excluded, fmt=fmt, weights_only=weights_only)

  marker = {"producer": "maxtext-nvfp4 export", "version": maxtext_nvfp4.__version__, "checkpoint": items,
            "config_args": list(config_args), "config_source": source, "format": fmt, "weights_only": weights_only,
            "architecture": hf_cfg["architectures"][0], "calibration": None if weights_only else {
                "batches": calibration_batches, "data": data}, "tokenizer": tok_plan.kind if tok_plan else None}
  outputs.publish_dir(out_dir, build, marker=MARKER, marker_text=json.dumps(marker, indent=2) + "\n")
  return {"items": items, "quantized": names, "excluded": excluded, "tokenizer_copied": tok_plan is not None,
          "out": out_dir, "data": data, "config_source": source, "files": files,
          "architecture": hf_cfg["architectures"][0], "format": fmt}


def quiet_imports() -> None:
  """Before MaxText is imported: transformers' import-time notices ("PyTorch was not found", config
  classes' rope warnings), which MaxText's checkpoint-conversion imports trigger and which say nothing about
  an export, are silenced unless the user set ``TRANSFORMERS_VERBOSITY``."""
  os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def cli_main(argv: list[str]) -> int:
  try:
    a = build_parser().parse_intermixed_args(argv)
  except SystemExit as e:  # --help: 0; a usage error: 2, after its one line on stderr
    return int(e.code or 0)
  quiet_imports()
  from maxtext_nvfp4.integration import checkpoint as ckpt  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import export_arch  # pylint: disable=import-outside-toplevel
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
                         tokenizer=not a.no_tokenizer, config_overrides=a.overrides, fmt=a.format,
                         weights_only=a.weights_only, max_shard_size=a.max_shard_size)
  except (ckpt.CheckpointError, recipes.RecipeError, outputs.OutputError, model_shapes.ShapeMismatch,
          tokenizer_export.TokenizerError, export_arch.UnsupportedModel) as e:
    return _fail(str(e))
  except OSError as e:  # the disk filled or a permission changed mid-write: the old export is still in place
    return _fail(f"--out {a.out}: writing failed ({e.strerror or e}); nothing was replaced")
  print(f"exported {summary['items']} -> {summary['out']} ({summary['architecture']}, {summary['format']},"
        f" {sum(f.endswith('.safetensors') for f in summary['files'])} safetensors file(s)):"
        f" {len(summary['quantized'])} NVFP4 linears,"
        f" {len(summary['excluded'])} excluded modules ({', '.join(summary['excluded'][:4])}"
        f"{', ...' if len(summary['excluded']) > 4 else ''}); tokenizer"
        f" {'written' if summary['tokenizer_copied'] else 'not written (--no-tokenizer)'}")
  return 0


if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
