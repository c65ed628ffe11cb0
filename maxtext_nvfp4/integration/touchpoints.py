"""Every MaxText symbol this package touches, checked when the plugin patches each MaxText module.

Review this table on a MaxText upgrade: it is the whole contact surface. :func:`check` runs before a
module is patched; a missing symbol fails at once with one line naming it and the supported version,
instead of an ``AttributeError`` deep inside a training run.
"""

from __future__ import annotations

import dataclasses
import functools

SUPPORTED_MAXTEXT = "0.2.5"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Touch:
  """One MaxText name we read, wrap, replace or subclass."""

  # dotted module path
  module: str
  # attribute path inside the module ("Class.method" allowed)
  symbol: str
  # what we do with it, and where
  use: str


TOUCHES: tuple[Touch, ...] = (
    Touch(module="maxtext.configs.types", symbol="QuantizationType",
          use="str-Enum gains member NVFP4='nvfp4' in place (plugin._patch_types)"),
    Touch(module="maxtext.configs.types", symbol="MaxTextConfig",
          use="schema rebuilt; Nvfp4MaxTextConfig subclasses it with the nvfp4_* keys (plugin._patch_types)"),
    Touch(module="maxtext.configs.pyconfig", symbol="_initialize_pydantic",
          use="wrapped: validates with Nvfp4MaxTextConfig, one-line errors (plugin._patch_pyconfig)"),
    Touch(module="maxtext.layers.quantizations", symbol="configure_quantization",
          use="wrapped: quantization=nvfp4 -> quantization.make_quantization (plugin._patch_quantizations)"),
    Touch(module="maxtext.layers.quantizations", symbol="Quantization",
          use="base class of the emulated Nvfp4Quantization (dot_general_cls, einsum, get_block_size)"),
    Touch(module="maxtext.layers.quantizations", symbol="TransformerEngineQuantization",
          use="subclassed without its __init__; sets _recipe, _te_comm_gemm_overlap_policy; overrides _wrap"
              " (te_quantization)"),
    Touch(module="maxtext.layers.quantizations", symbol="TransformerEngineQuantization._wrap",
          use="extended to serve TE's sr_rng stream (te_quantization)"),
    Touch(module="maxtext.layers.quantizations", symbol="TransformerEngineQuantization.dot_general_cls",
          use="called for nvfp4/fp8 projections (te_quantization)"),
    Touch(module="maxtext.layers.moe", symbol="RoutedMoE.sparse_matmul",
          use="wrapped: when the layer's quant is ours, publishes its expert GEMMs' plan (quant.expert_gemms) while"
              " MaxText traces the call; reads the instance's quant and config.prefuse_moe_weights (sparse_moe)"),
    Touch(module="maxtext.layers.moe", symbol="RoutedMoE.get_expert_parallelism_size",
          use="called by the sparse_matmul wrapper: an expert-parallel mesh is refused (sparse_moe)"),
    Touch(module="maxtext.kernels.megablox", symbol="gmm",
          use="wrapped (the mblx.gmm layers/moe.py calls): inside such a sparse_matmul, each expert linear runs"
              " grouped_gemm.ragged_dot; elsewhere MaxText's gmm unchanged (sparse_moe)"),
    Touch(module="maxtext.trainers.pre_train.train", symbol="train_step",
          use="wrapped to publish the traced step (step.with_step)"),
    Touch(module="maxtext.trainers.pre_train.train", symbol="eval_step",
          use="wrapped to publish the traced step (step.with_step)"),
    Touch(module="maxtext.trainers.pre_train.train", symbol="main",
          use="run by python -m maxtext_nvfp4.train (plugin.run_pretrain)"),
    Touch(module="maxtext.common.metric_logger", symbol="MetricLogger.write_metrics",
          use="wrapped: merges nvfp4/* diagnostics into train records (plugin._patch_metric_logger)"),
    Touch(module="maxtext.common.metric_logger", symbol="MetricLogger.write_metrics_locally",
          use="replaced: truncate the metrics file once per fresh run, append otherwise"),
    Touch(module="maxtext.common.metric_logger", symbol="_prepare_metrics_for_json",
          use="called by the replaced write_metrics_locally (same JSON records as MaxText)"),
    Touch(module="maxtext.checkpoint_conversion.utils.param_mapping", symbol="LLAMA31_MAXTEXT_TO_HF_PARAM_MAPPING",
          use="MaxText -> HF Llama names for the NVFP4 export (checkpoint.to_hf)"),
    Touch(module="maxtext.checkpoint_conversion.utils.param_mapping", symbol="LLAMA31_MAXTEXT_TO_HF_PARAM_HOOK_FN",
          use="MaxText -> HF Llama layouts (minus adjust_rope) for the NVFP4 export (checkpoint.to_hf)"),
    Touch(module="maxtext.input_pipeline.input_pipeline_interface", symbol="create_data_iterator",
          use="the run's eval batches for the export's calibration (checkpoint.eval_batches)"),
    Touch(module="maxtext.utils.model_creation_utils", symbol="from_config",
          use="MaxText's forward of a checkpoint (checkpoint.maxtext_logits)"),
)


def wrap_once(orig, make_wrapper):
  """``make_wrapper(orig)`` marked as ours, or ``orig`` itself when it already is one of our wrappers.

  Patching is idempotent: a module patched twice (re-registration, ``__main__`` copies) keeps one layer.
  """
  if getattr(orig, "_maxtext_nvfp4_wrapped", None) is not None:
    return orig
  wrapper = functools.wraps(orig)(make_wrapper(orig))
  wrapper._maxtext_nvfp4_wrapped = orig  # pylint: disable=protected-access
  return wrapper


class MaxTextVersionError(ImportError):
  """The installed MaxText lacks a symbol the plugin needs (one line: symbol, supported version)."""


def missing(module_name: str, module) -> list[str]:
  """The ``module.symbol`` entries of :data:`TOUCHES` for ``module_name`` that ``module`` lacks."""
  out = []
  for t in TOUCHES:
    if t.module != module_name:
      continue
    obj = module
    for part in t.symbol.split("."):
      obj = getattr(obj, part, None)
      if obj is None:
        out.append(f"{t.module}.{t.symbol}")
        break
  return out


def check(module_name: str, module) -> None:
  """Raise :class:`MaxTextVersionError` when ``module`` lacks a symbol of :data:`TOUCHES`."""
  gone = missing(module_name, module)
  if gone:
    raise MaxTextVersionError(
        f"maxtext-nvfp4 supports MaxText {SUPPORTED_MAXTEXT}; the installed MaxText ({installed_version()}) has no"
        f" {', '.join(gone)}: install maxtext=={SUPPORTED_MAXTEXT} (pip install 'maxtext=={SUPPORTED_MAXTEXT}')")


def installed_version() -> str:
  """The installed ``maxtext`` distribution's version, or ``unknown``."""
  from importlib import metadata  # pylint: disable=import-outside-toplevel

  try:
    return metadata.version("maxtext")
  except metadata.PackageNotFoundError:
    return "unknown"


def maxtext_package_dir() -> str:
  """The directory of the installed ``maxtext`` package (its assets and configs live there)."""
  import os  # pylint: disable=import-outside-toplevel

  import maxtext  # pylint: disable=import-outside-toplevel

  return os.path.dirname(maxtext.__file__)
