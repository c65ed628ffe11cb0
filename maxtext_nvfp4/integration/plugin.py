"""MaxText 0.2.5 plugin: registration and the patches it applies to MaxText's modules.

The integration layer (this folder) is the only code that imports MaxText; every MaxText symbol it
touches is listed, and checked at registration, in :mod:`maxtext_nvfp4.integration.touchpoints`.

What :func:`register` changes (idempotent; each patch is applied when its MaxText module is first
imported, or immediately if it already is, so ``import maxtext_nvfp4`` stays cheap):

* ``maxtext.configs.types``: ``QuantizationType`` gains the member ``NVFP4 = "nvfp4"`` (in place, so every
  entry point accepts ``quantization: nvfp4``); ``MaxTextConfig`` schema rebuilt.
* ``maxtext.configs.pyconfig._initialize_pydantic`` (used by ``initialize`` and ``initialize_pydantic``):
  validates with :data:`Nvfp4MaxTextConfig` (``MaxTextConfig`` + every ``nvfp4_*`` key of
  :mod:`maxtext_nvfp4.core.settings`, choices as ``Literal`` so the error lists them), turns pydantic
  errors on our keys into one line, then runs :func:`settings.validate` (num_layers, steps, scan_layers)
  and the backend choice, all before any compilation. Errors flow through MaxText's
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
* ``maxtext.layers.moe.RoutedMoE.sparse_matmul`` and ``maxtext.kernels.megablox.gmm``: inside a
  ``sparse_matmul`` call of a layer quantized by us, the grouped GEMM runs each expert's GEMM in its planned
  precision (:mod:`maxtext_nvfp4.integration.sparse_moe`); everywhere else MaxText's own, unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.abc
import re
import sys
import threading
from typing import Any, Literal

from maxtext_nvfp4.backends import capability
from maxtext_nvfp4.backends import te as te_backend
from maxtext_nvfp4.core import settings as settings_lib
from maxtext_nvfp4.integration import step as step_lib
from maxtext_nvfp4.integration import touchpoints

QUANTIZATION = "nvfp4"

_TYPES = "maxtext.configs.types"
_PYCONFIG = "maxtext.configs.pyconfig"
_QUANTIZATIONS = "maxtext.layers.quantizations"
_TRAIN = "maxtext.trainers.pre_train.train"
_METRIC_LOGGER = "maxtext.common.metric_logger"
_MOE = "maxtext.layers.moe"
_MEGABLOX = "maxtext.kernels.megablox"


# ---------------------------------------------------------------------------------------------------
# Config schema
# ---------------------------------------------------------------------------------------------------

_PY_TYPES = {"bool": bool, "int": int, "float": float, "str": str}
Nvfp4MaxTextConfig: Any = None  # built on registration: MaxTextConfig + the nvfp4_* keys


def _field_annotations() -> dict[str, Any]:
  """``{config key: annotation}``: ``Literal[choices]`` for enumerated keys, else the settings type."""
  out = {}
  for f in dataclasses.fields(settings_lib.Nvfp4Settings):
    choices = settings_lib.CHOICES.get(f.name)
    typ = f.type if isinstance(f.type, type) else _PY_TYPES[str(f.type)]
    out[settings_lib.config_key(f.name)] = Literal[choices] if choices else typ
  return out


def _patch_types(types) -> None:
  qt = types.QuantizationType
  if QUANTIZATION not in qt._value2member_map_:  # pylint: disable=protected-access
    # Extend the str-Enum in place (a subclass/replacement would break `is`/== checks elsewhere).
    member = str.__new__(qt, QUANTIZATION)
    member._name_ = "NVFP4"  # pylint: disable=protected-access
    member._value_ = QUANTIZATION  # pylint: disable=protected-access
    member._sort_order_ = len(qt._member_names_)  # pylint: disable=protected-access
    member.__objclass__ = qt
    qt._member_map_["NVFP4"] = member  # pylint: disable=protected-access
    qt._value2member_map_[QUANTIZATION] = member  # pylint: disable=protected-access
    qt._member_names_.append("NVFP4")  # pylint: disable=protected-access
    type.__setattr__(qt, "NVFP4", member)
    types.MaxTextConfig.model_rebuild(force=True)

  global Nvfp4MaxTextConfig
  if Nvfp4MaxTextConfig is None:
    import pydantic  # pylint: disable=import-outside-toplevel

    defaults = settings_lib.config_keys()
    fields = {
        key: (ann, pydantic.Field(defaults[key], description=settings_lib.KEY_HELP[settings_lib.field_of_key(key)]))
        for key, ann in _field_annotations().items()
    }
    Nvfp4MaxTextConfig = pydantic.create_model("Nvfp4MaxTextConfig", __base__=types.MaxTextConfig, **fields)


def _is_nvfp4(config) -> bool:
  q = getattr(config, "quantization", "")
  return str(getattr(q, "value", q)) == QUANTIZATION


def _one_line_error(e) -> Exception | None:
  """A pydantic ValidationError on ``quantization``/``nvfp4_*`` as one line (key=value: allowed), or None."""
  ours = [err for err in e.errors() if err.get("loc") and str(err["loc"][0]).startswith(("nvfp4_", "quantization"))]
  if not ours:
    return None
  parts = [f"{err['loc'][0]}={err.get('input')!r}: {err['msg']}" for err in ours]
  return settings_lib.SettingsError("; ".join(parts))


_UNKNOWN_KEY = re.compile(r"^'([^']+)' not in '")  # pyconfig._prepare_for_pydantic's message (lists every field)


def known_config_keys() -> list[str]:
  """Every key MaxText's pyconfig accepts (``MaxTextConfig`` fields, fields of its nested models, the
  multimodal keys it ignores) plus the ``nvfp4_*`` keys; for "did you mean" only."""
  from maxtext.configs import types  # pylint: disable=import-outside-toplevel

  keys, todo = set(settings_lib.config_keys()), [types.MaxTextConfig.model_fields, types.Multimodal.model_fields]
  while todo:
    for name, field in todo.pop().items():
      keys.add(name)
      if hasattr(getattr(field, "annotation", None), "model_fields"):
        todo.append(field.annotation.model_fields)
  return sorted(keys)


def unknown_key_error(key: str, where: str = "") -> settings_lib.SettingsError:
  """One line for a key MaxText does not know, with the closest known keys (difflib) as the fix."""
  import difflib  # pylint: disable=import-outside-toplevel

  close = difflib.get_close_matches(key, known_config_keys(), n=2, cutoff=0.75)
  fix = (f"did you mean {' or '.join(repr(c) for c in close)}?" if close
         else "see docs/usage.md for the nvfp4_* keys and MaxText's base.yml for the others")
  return settings_lib.SettingsError(f"unknown config key {key!r}{' ' + where if where else ''}; {fix}")


# Keys pyconfig._prepare_for_pydantic or a "before" validator rewrites before pydantic sees them: their raw
# value may legitimately fail the bare annotation, so only MaxText itself judges them.
_REWRITTEN_KEYS = frozenset({
    "logical_axis_rules", "data_sharding", "train_data_columns", "eval_data_columns", "trainable_parameters_mask",
    "adamw_mask", "tokenizer_path", "run_name", "dump_hlo_local_module_name", "dump_hlo_module_name",
    "constant_bound_config", "quantization"})


def field_error(values, keys) -> settings_lib.SettingsError | None:
  """The first of ``keys`` whose value in ``values`` fails its own ``MaxTextConfig`` field type, as one line
  (``steps='abc': Input should be a valid integer``), else None.

  Field types only (no model validators, which depend on the whole config MaxText builds), and only for
  plain top-level fields whose value MaxText passes to pydantic unchanged: a check that can refuse only
  what MaxText's own validation refuses.
  """
  import pydantic  # pylint: disable=import-outside-toplevel
  from maxtext.configs import types  # pylint: disable=import-outside-toplevel

  fields = types.MaxTextConfig.model_fields
  for key in keys:
    value = values.get(key)
    if key not in fields or key in _REWRITTEN_KEYS or value is None or (isinstance(value, str) and value.lower()
                                                                         in ("", "none")):
      continue
    try:
      pydantic.TypeAdapter(fields[key].annotation).validate_python(value)
    except pydantic.ValidationError as e:
      return settings_lib.SettingsError(f"{key}={value!r}: {e.errors()[0]['msg']}")
    except Exception:  # pylint: disable=broad-exception-caught  (an annotation TypeAdapter cannot build)
      continue
  return None


def validate_config(config) -> None:
  """Cross-key checks for ``quantization=nvfp4`` (one-line :class:`SettingsError`/``BackendError``)."""
  if not _is_nvfp4(config):
    return
  s = settings_lib.from_config(config)
  settings_lib.validate(s, num_layers=config.num_decoder_layers, steps=config.steps, scan_layers=config.scan_layers)
  if config.use_qwix_quantization:
    raise settings_lib.SettingsError(
        "quantization=nvfp4 with use_qwix_quantization=true: the NVFP4 plugin does not use qwix; set"
        " use_qwix_quantization=false")
  if s.backend == "te":  # what TE refuses is decided from the config alone: say it before the device check
    te_backend.check_te_settings(s)
    te_backend.check_te_shapes(config, s)
  capability.choose_backend(s.backend)
  from maxtext_nvfp4.integration import quantization  # pylint: disable=import-outside-toplevel

  # MoE paths that would skip the plan (the device-count check waits for make_quantization: asking JAX for
  # devices here would start its backend before MaxText initializes jax.distributed).
  quantization.check_model(config, s, s.backend, num_devices=None)


def _patch_pyconfig(pyconfig) -> None:
  from maxtext.configs import types  # pylint: disable=import-outside-toplevel
  import pydantic  # pylint: disable=import-outside-toplevel

  _patch_types(types)

  def make(orig):
    def _initialize_pydantic(argv=None, config_class=types.MaxTextConfig, **kwargs):
      if config_class is types.MaxTextConfig:
        config_class = Nvfp4MaxTextConfig
      try:
        config = orig(argv, config_class=config_class, **kwargs)
      except pydantic.ValidationError as e:
        short = _one_line_error(e)
        if short is None:
          raise
        raise short from None
      except ValueError as e:  # MaxText's unknown-key error is one line of every field name (~21,000 characters)
        unknown = _UNKNOWN_KEY.match(str(e))
        if unknown is None:
          raise
        raise unknown_key_error(unknown.group(1)) from None
      validate_config(config)
      return config
    return _initialize_pydantic

  pyconfig._initialize_pydantic = touchpoints.wrap_once(pyconfig._initialize_pydantic, make)  # pylint: disable=protected-access


# ---------------------------------------------------------------------------------------------------
# Quantization routing, the step, the metrics writer
# ---------------------------------------------------------------------------------------------------


def _patch_quantizations(quantizations) -> None:
  def make(orig):
    def configure_quantization(config, quant_mode_str: str = "train"):
      if _is_nvfp4(config):
        from maxtext_nvfp4.integration import quantization  # pylint: disable=import-outside-toplevel

        return quantization.make_quantization(config, quant_mode_str=quant_mode_str)
      return orig(config, quant_mode_str=quant_mode_str)
    return configure_quantization

  quantizations.configure_quantization = touchpoints.wrap_once(quantizations.configure_quantization, make)


def _patch_train(train) -> None:
  train.train_step = step_lib.with_step(train.train_step, training=True)
  train.eval_step = step_lib.with_step(train.eval_step)


def _merge_diagnostics(metrics, step) -> None:
  """Add the ``nvfp4/*`` statistics reported for training ``step`` to ``metrics["scalar"]`` (host side).

  MaxText writes step ``s`` after dispatching step ``s + 1``; waiting for step ``s``'s own outputs (already
  due: the writer converts them to floats next) guarantees its callbacks have run.
  """
  from maxtext_nvfp4.core import diagnostics  # pylint: disable=import-outside-toplevel

  if not diagnostics.AGGREGATOR.armed or "scalar" not in metrics:
    return
  import jax  # pylint: disable=import-outside-toplevel

  jax.block_until_ready([v for v in metrics["scalar"].values() if isinstance(v, jax.Array)])
  metrics["scalar"].update(diagnostics.AGGREGATOR.pop(int(step)))


def _patch_metric_logger(metric_logger) -> None:
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


def _patch_moe(moe) -> None:
  from maxtext_nvfp4.integration import sparse_moe  # pylint: disable=import-outside-toplevel

  sparse_moe.patch_moe(moe)


def _patch_megablox(megablox) -> None:
  from maxtext_nvfp4.integration import sparse_moe  # pylint: disable=import-outside-toplevel

  sparse_moe.patch_megablox(megablox)


def run_pretrain(argv) -> None:
  """MaxText's pre-training ``main(argv)`` (``maxtext.trainers.pre_train.train.main``)."""
  from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel

  train.main(argv)


# ---------------------------------------------------------------------------------------------------
# Registration (lazy, via an import hook)
# ---------------------------------------------------------------------------------------------------

_PATCHERS = {
    _TYPES: _patch_types,
    _PYCONFIG: _patch_pyconfig,
    _QUANTIZATIONS: _patch_quantizations,
    _TRAIN: _patch_train,
    _METRIC_LOGGER: _patch_metric_logger,
    _MOE: _patch_moe,
    _MEGABLOX: _patch_megablox,
}
_lock = threading.RLock()
_finder: Any = None


def _apply(name: str, module, check: bool = True) -> None:
  with _lock:
    if getattr(module, "_maxtext_nvfp4_patched", False):
      return
    if check:  # a __main__ copy is still executing (later names not defined yet): the real module is checked
      touchpoints.check(name, module)
    _PATCHERS[name](module)
    module._maxtext_nvfp4_patched = True  # pylint: disable=protected-access


class _PatchingLoader(importlib.abc.Loader):
  """Runs the real loader, then our patch for that module (before anyone can use it)."""

  def __init__(self, loader, name):
    self._loader = loader
    self._name = name

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module):
    self._loader.exec_module(module)
    _apply(self._name, module)

  def __getattr__(self, attr):  # get_source, get_resource_reader, ... of the real loader
    return getattr(self._loader, attr)


class _PatchFinder(importlib.abc.MetaPathFinder):
  """Finds the MaxText modules we patch with the other finders and wraps their loader."""

  def find_spec(self, fullname, path, target=None):
    if fullname not in _PATCHERS:
      return None
    for finder in sys.meta_path:
      if finder is self or not hasattr(finder, "find_spec"):
        continue
      spec = finder.find_spec(fullname, path, target)
      if spec is not None:
        break
    else:
      return None
    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
      spec.loader = _PatchingLoader(spec.loader, fullname)
    return spec


def register() -> None:
  """Make MaxText accept ``quantization=nvfp4`` and the ``nvfp4_*`` keys (idempotent, cheap)."""
  global _finder
  with _lock:
    if _finder is None:
      _finder = _PatchFinder()
      sys.meta_path.insert(0, _finder)
    for name in _PATCHERS:
      module = sys.modules.get(name)
      if module is not None:
        _apply(name, module)
    # `python -m maxtext.trainers.pre_train.train` (e.g. with the patch set) runs MaxText's train module as
    # __main__: its train_step is looked up there, so wrap that copy too.
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) == _TRAIN and hasattr(main, "train_step"):
      _apply(_TRAIN, main, check=False)

