"""The patches :func:`maxtext_nvfp4.integration.plugin.register` applies to MaxText's modules, one per module.

:data:`PATCHES` maps the MaxText adapter's patch jobs (``MaxTextVersion.patched_modules``: module -> job)
to the function applying it. Each is applied once per module (idempotent), when its MaxText module is
first imported or at registration if it already is:

* ``maxtext.configs.types``: ``QuantizationType`` gains the member ``NVFP4 = "nvfp4"`` (in place, so every
  entry point accepts ``quantization: nvfp4``); ``MaxTextConfig`` schema rebuilt.
* ``maxtext.configs.pyconfig._initialize_pydantic`` (used by ``initialize`` and ``initialize_pydantic``):
  validates with :data:`Nvfp4MaxTextConfig` (``MaxTextConfig`` + every ``nvfp4_*`` key of
  :mod:`maxtext_nvfp4.core.settings`, choices as ``Literal`` so the error lists them), turns pydantic
  errors on our keys into one line, then runs :func:`settings.validate` (num_layers, steps, scan_layers)
  and the backend choice, all before any compilation. The ``XLA_FLAGS`` MaxText sets to dump HLO whenever
  they are unset are taken back unless ``dump_hlo`` is true (:mod:`maxtext_nvfp4.integration.hlo_dump`). MaxText's "AQT quantization is deprecated" warning
  is dropped for an nvfp4 config (:func:`log_filter.hold_nvfp4_only`). Errors flow through MaxText's
  ``_handle_config_exception`` ("MAXTEXT CONFIG ERROR: ...", exit code 2; re-raised under pytest).
* ``maxtext.layers.quantizations.configure_quantization``: returns
  :func:`maxtext_nvfp4.integration.quantization.make_quantization` for ``quantization=nvfp4`` and
  delegates every other value to MaxText unchanged.
* ``maxtext.trainers.pre_train.train.train_step`` / ``eval_step``: wrapped
  (:func:`maxtext_nvfp4.integration.step.with_step`) to publish the traced training step, read at trace
  time by the NVFP4 dot_general (stochastic-rounding key and late precision switch); ``train_step``
  also marks the trace as a training step (the only place diagnostics are taken).
* ``maxtext.common.metric_logger.MetricLogger`` (class methods, in place):
  - ``write_metrics``: for ``train`` records, merges the ``nvfp4/*`` diagnostics reported for that step
    (``nvfp4_diagnostics``, see :mod:`maxtext_nvfp4.core.diagnostics` and docs/diagnostics.md) into
    ``metrics["scalar"]`` before MaxText logs/writes them (metrics file, TensorBoard, GCS, wandb);
  - ``write_metrics_locally``: MaxText truncates ``metrics_file`` at every record with step 0, including
    eval records (every eval's first running-eval snapshot, the eval after train step 0), deleting the
    training records written so far. Now a logger truncates once, at its first record if that has step
    0 and the run starts at step 0 (a fresh run); every other record is appended.
* ``maxtext.utils.accelerator_to_spec_map.get_system_characteristics``: also answers the GPU compile topologies
  of :mod:`maxtext_nvfp4.integration.compile_target` (``b200-4``), so that a config with such a
  ``compile_topology`` validates; every MaxText name unchanged.
* ``maxtext.trainers.post_train.distillation.train_distill.MaxTextDistillationTrainer`` (``_train_step`` /
  ``_eval_step``): wrapped to publish the student's step, as ``train_step`` above
  (:func:`maxtext_nvfp4.integration.posttrain.patch_distill`).
* ``maxtext.layers.attentions.Attention.__call__`` / ``maxtext.layers.linears.MlpBlock.__call__``: under
  ``nvfp4_qat=serving`` they publish their projections' kernels as stored, the fp32 weights the export
  quantizes (:mod:`maxtext_nvfp4.integration.serving_layout`); otherwise MaxText's own call.
* ``maxtext.trainers.pre_train.train.loss_fn``, ``maxtext.layers.normalizations.RMSNorm.__call__`` and
  ``maxtext.layers.moe.RoutedMoE.get_topk``: wrapped for the gradient fidelity and the stability telemetry
  (:mod:`maxtext_nvfp4.integration.stability`); they trace nothing unless ``nvfp4_diagnostics`` is on.
* ``maxtext.layers.moe.RoutedMoE.sparse_matmul`` and ``maxtext.kernels.megablox.gmm``: inside a
  ``sparse_matmul`` call of a layer quantized by us, the grouped GEMM runs each expert's GEMM in its planned
  precision (:mod:`maxtext_nvfp4.integration.sparse_moe`); everywhere else MaxText's own, unchanged.
"""

from __future__ import annotations

from maxtext_nvfp4.integration import compile_target
from maxtext_nvfp4.integration import config_checks
from maxtext_nvfp4.integration import config_errors
from maxtext_nvfp4.integration import config_schema
from maxtext_nvfp4.integration import hlo_dump
from maxtext_nvfp4.integration import log_filter
from maxtext_nvfp4.integration import posttrain
from maxtext_nvfp4.integration import serving_layout
from maxtext_nvfp4.integration import sparse_moe
from maxtext_nvfp4.integration import stability
from maxtext_nvfp4.integration import step as step_lib
from maxtext_nvfp4.integration import touchpoints


def patch_pyconfig(pyconfig) -> None:
  from maxtext.configs import types  # pylint: disable=import-outside-toplevel
  import pydantic  # pylint: disable=import-outside-toplevel

  config_schema.patch_types(types)

  def make(orig):
    def _initialize_pydantic(argv=None, config_class=types.MaxTextConfig, **kwargs):
      if config_class is types.MaxTextConfig:
        config_class = config_schema.Nvfp4MaxTextConfig
      try:
        with hlo_dump.kept_unless_dumping(touchpoints.adapter()) as dumped, \
             log_filter.hold_nvfp4_only() as release:  # MaxText's AQT deprecation warning: not for nvfp4
          config = orig(argv, config_class=config_class, **kwargs)
          release(config_schema.is_nvfp4(config))
          dumped(config)
      except pydantic.ValidationError as e:
        short = config_errors.one_line_error(e)
        if short is None:
          raise
        raise short from None
      except ValueError as e:  # MaxText's unknown-key error is one line of every field name (~21,000 characters)
        key = config_errors.unknown_key(e)
        if key is None:
          raise
        raise config_errors.unknown_key_error(key) from None
      config_checks.validate_config(config)
      return config
    return _initialize_pydantic

  pyconfig._initialize_pydantic = touchpoints.wrap_once(pyconfig._initialize_pydantic, make)  # pylint: disable=protected-access


def patch_quantizations(quantizations) -> None:
  def make(orig):
    def configure_quantization(config, quant_mode_str: str = "train"):
      if config_schema.is_nvfp4(config):
        from maxtext_nvfp4.integration import quantization  # pylint: disable=import-outside-toplevel  (JAX)

        return quantization.make_quantization(config, quant_mode_str=quant_mode_str)
      from maxtext_nvfp4.integration import stability  # pylint: disable=import-outside-toplevel

      stability.configure(config, grad_supported=False)  # telemetry of a BF16/FP8 run with nvfp4_diagnostics
      return orig(config, quant_mode_str=quant_mode_str)
    return configure_quantization

  quantizations.configure_quantization = touchpoints.wrap_once(quantizations.configure_quantization, make)


def patch_train(train) -> None:
  train.train_step = step_lib.with_step(train.train_step, training=True)
  train.eval_step = step_lib.with_step(train.eval_step)
  stability.patch_loss_fn(train)


def patch_moe(moe) -> None:
  sparse_moe.patch_moe(moe)
  stability.patch_topk(moe)


def _merge_diagnostics(metrics, step) -> None:
  """Add the ``nvfp4/*`` statistics reported for training ``step`` to ``metrics["scalar"]`` (host side).

  MaxText writes step ``s`` after dispatching step ``s + 1``; waiting for step ``s``'s own outputs (already
  due: the writer converts them to floats next) guarantees its callbacks have run.
  """
  from maxtext_nvfp4.core import diagnostics  # pylint: disable=import-outside-toplevel

  if not diagnostics.AGGREGATOR.armed or "scalar" not in metrics:
    return
  import jax  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.core import stability as core_stability  # pylint: disable=import-outside-toplevel

  jax.block_until_ready([v for v in metrics["scalar"].values() if isinstance(v, jax.Array)])
  metrics["scalar"].update(diagnostics.AGGREGATOR.pop(int(step)))
  metrics["scalar"].update(core_stability.STORE.pop(int(step)))


def patch_metric_logger(metric_logger) -> None:
  cls = metric_logger.MetricLogger

  def make_write(orig):
    def write_metrics(self, metrics, step, metric_type="train"):
      if metrics and metric_type == "train":
        _merge_diagnostics(metrics, step)
      return orig(self, metrics, step, metric_type)
    return write_metrics

  def make_local(orig):
    del orig  # replaced, not extended: MaxText's version truncates at every step-0 record
    def write_metrics_locally(self, metrics, step):
      # MaxText truncates at every step-0 record; eval records have step 0 too (the running-eval snapshots
      # count eval batches; the eval after train step 0), so it deleted the training records. Truncate
      # once per logger instead: at its first record, when that is step 0 of a run that starts at step 0
      # (a fresh run; the first eval's snapshots may come before train step 0's record). Append otherwise.
      import json  # pylint: disable=import-outside-toplevel

      fresh = not getattr(self, "_maxtext_nvfp4_wrote", False) and step == 0 and getattr(self, "start_step", 0) == 0
      self._maxtext_nvfp4_wrote = True  # pylint: disable=protected-access
      record = metric_logger._prepare_metrics_for_json(metrics, step, self.config.run_name)  # pylint: disable=protected-access
      with open(self.config.metrics_file, "w" if fresh else "a", encoding="utf8") as f:
        f.write(json.dumps(record) + "\n")
    return write_metrics_locally

  cls.write_metrics = touchpoints.wrap_once(cls.write_metrics, make_write)
  cls.write_metrics_locally = touchpoints.wrap_once(cls.write_metrics_locally, make_local)


# the adapter's patch job -> the function applying it
def patch_accelerators(accelerators) -> None:
  def make(orig):
    return lambda name: compile_target.system_characteristics(name, orig)

  accelerators.get_system_characteristics = touchpoints.wrap_once(accelerators.get_system_characteristics, make)


PATCHES = {
    "types": config_schema.patch_types,
    "pyconfig": patch_pyconfig,
    "quantizations": patch_quantizations,
    "train": patch_train,
    "metric_logger": patch_metric_logger,
    "moe": patch_moe,
    "megablox": sparse_moe.patch_megablox,
    "accelerators": patch_accelerators,
    "distill": posttrain.patch_distill,
    "serving_attention": serving_layout.patch_attention,
    "serving_mlp": serving_layout.patch_mlp,
    "normalizations": stability.patch_rms_norm,
}
