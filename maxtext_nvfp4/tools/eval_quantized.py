"""``maxtext-nvfp4 eval-quantized CHECKPOINT_DIR --config R.yml [--mode M ...] [key=value ...]``: the eval
loss of a checkpoint with its linears served in a given format (forward only).

Modes (:data:`maxtext_nvfp4.core.serving.SERVING_MODES`):

  bf16         bf16 weights and activations (the reference)
  nvfp4-w4a16  NVFP4 weights exactly as ``maxtext-nvfp4 export`` writes them (1x16 along the input dim,
               fused q/k/v and gate/up sharing the global scale), bf16 activations
  nvfp4-w4a4   NVFP4 weights as above, activations NVFP4 per token on the fly (one global scale per token
               row from its amax, E4M3 scales per 1x16 block along K)
  fp8          FP8 E4M3 per-tensor current scaling of weights and activations

The served linears are the export's (``--quantize trained|all``, same rule); embeddings, norms, attention
and ``lm_head`` stay fp32. The forward is the HF-order forward of the checkpoint's architecture (every
family ``export`` writes; ``core.hf_forward``) of the checkpoint converted with MaxText's own conversion
(tests/tools/test_export.py checks it against MaxText's forward, per family), over ``--eval-batches`` batches of the recipe's eval data (its train data when it has
no eval split). The loss is MaxText's: summed next-token cross-entropy over ``targets_segmentation != 0``
divided by the token count. Prints a table; ``--json PATH`` writes ``{"checkpoint", "batches", "tokens",
"losses": {mode: loss}, "delta_vs_bf16": {mode: loss - bf16 loss}}``. Errors: one line, exit code 2.
"""

from __future__ import annotations

import json
import sys

from maxtext_nvfp4.tools import cli
from maxtext_nvfp4.tools import cliargs
from maxtext_nvfp4.tools import export

PROG = "maxtext-nvfp4 eval-quantized"


def build_parser():
  from maxtext_nvfp4.core import serving  # pylint: disable=import-outside-toplevel

  p = cli.ArgumentParser(prog=PROG, description="Eval loss of a checkpoint with its linears served in NVFP4/FP8/bf16")
  p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="as for export")
  p.add_argument("--config", default=None,
                 help="the recipe the run trained with (default: the run's maxtext_nvfp4_run.json, else base.yml)")
  p.add_argument("--mode", action="append", choices=serving.SERVING_MODES,
                 help="repeatable; default: all of " + ", ".join(serving.SERVING_MODES))
  p.add_argument("--eval-batches", type=cliargs.number(integer=True, at_least=1), default=4, help="eval batches (default 4)")
  p.add_argument("--quantize", choices=("trained", "all"), default="trained", help="which linears, as for export")
  p.add_argument("--json", default=None, help="also write the result to this JSON file (checked first, written whole)")
  p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for training")
  return p


def evaluate(model, names: list[str], batches: list[dict], modes: list[str]) -> dict[str, tuple[float, float]]:
  """``{mode: (summed token loss, token count)}`` over ``batches``."""
  import jax  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.core import hf_forward  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.core import serving  # pylint: disable=import-outside-toplevel

  served = frozenset(names)
  out = {}
  for mode in modes:
    weights = serving.served_weights(model.tensors, names, mode)
    act = serving.served_activations(mode)

    @jax.jit
    def loss(w, b, act=act):
      logits, _ = hf_forward.decoder_forward(w, model.shape, b["inputs"], b["inputs_position"], b["inputs_segmentation"],
                                        act=act, served=served)
      return serving.token_losses(logits, b["targets"], b["targets_segmentation"])

    total, count = 0.0, 0.0
    for b in batches:
      s, n = loss(weights, b)
      total, count = total + float(s), count + float(n)
    out[mode] = (total, count)
  return out


def run_eval(checkpoint: str, config_args: list[str] | None, *, modes: list[str], eval_batches: int,
             quantize: str = "trained", config_overrides: list[str] = ()) -> dict:
  """The result dict (see the module docstring). Raises ``checkpoint.CheckpointError`` or
  ``model_shapes.ShapeMismatch`` (one line). ``config_args`` None: as ``export.resolve_config_args``."""
  from maxtext_nvfp4.integration import checkpoint as ckpt  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import hf_conversion  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import model_shapes  # pylint: disable=import-outside-toplevel

  if eval_batches < 1:
    raise ckpt.CheckpointError("--eval-batches must be >= 1")
  items = ckpt.find_items(checkpoint)
  source = "the caller"
  if config_args is None:
    config_args, source = export.resolve_config_args(items, None, list(config_overrides))
  config = ckpt.load_config(config_args)
  dims = model_shapes.check(items, config)
  export.check_supported(config)
  data = export.data_description(config)
  model = hf_conversion.to_hf(items, config, dims)
  names = export.quantized_linears(model.trained_nvfp4, quantize)
  batches = list(export._batches(config, eval_batches, "--eval-batches"))  # pylint: disable=protected-access
  if not batches:
    raise ckpt.CheckpointError(f"eval data: {data} gave no batch")
  sums = evaluate(model, names, batches, modes)
  losses = {m: s / max(n, 1.0) for m, (s, n) in sums.items()}
  ref = losses.get("bf16")
  return {"checkpoint": items, "batches": len(batches), "tokens": int(next(iter(sums.values()))[1]),
          "served_linears": len(names), "data": data, "config_source": source, "losses": losses,
          "delta_vs_bf16": {m: v - ref for m, v in losses.items()} if ref is not None else {}}


def format_table(result: dict) -> str:
  lines = [f"eval loss of {result['checkpoint']} ({result['batches']} batches, {result['tokens']} tokens,"
           f" {result['served_linears']} served linears; data: {result['data']};"
           f" config from {result['config_source']})", "", "| mode | eval loss | vs bf16 |", "|---|---|---|"]
  for mode, loss in result["losses"].items():
    d = result["delta_vs_bf16"].get(mode)
    lines.append(f"| {mode} | {loss:.4f} | {'' if d is None else f'{d:+.4f}'} |")
  return "\n".join(lines)


def cli_main(argv: list[str]) -> int:
  export.quiet_imports()
  from maxtext_nvfp4.core import serving  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import checkpoint as ckpt  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import export_arch  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import recipes  # pylint: disable=import-outside-toplevel

  try:
    a = build_parser().parse_intermixed_args(argv)
  except SystemExit as e:
    return int(e.code or 0)
  def fail(message: str) -> int:
    print(f"{PROG}: error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    return 2

  bad = [t for t in a.overrides if "=" not in t]
  if bad:
    return fail(f"{bad[0]!r} is not key=value (config overrides come after the options)")
  modes = a.mode or list(serving.SERVING_MODES)
  from maxtext_nvfp4.tools import model_shapes  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import outputs  # pylint: disable=import-outside-toplevel

  try:
    json_path = outputs.check_out_file(a.json, flag="--json") if a.json else None  # before any work
    config_args = ([recipes.find_recipe(a.config)] + list(a.overrides)) if a.config else None
    result = run_eval(a.checkpoint, config_args, modes=modes, eval_batches=a.eval_batches, quantize=a.quantize,
                      config_overrides=a.overrides)
  except (ckpt.CheckpointError, recipes.RecipeError, outputs.OutputError, model_shapes.ShapeMismatch,
          export_arch.UnsupportedModel) as e:
    return fail(str(e))
  print(format_table(result))
  if json_path:
    try:
      outputs.publish_file(json_path, json.dumps(result, indent=2) + "\n")
    except OSError as e:
      return fail(f"--json {json_path}: writing failed ({e.strerror or e})")
  return 0


if __name__ == "__main__":
  sys.exit(cli_main(sys.argv[1:]))
