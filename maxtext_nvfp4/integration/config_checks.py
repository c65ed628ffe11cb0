"""The cross-key checks of a ``quantization=nvfp4`` config, run right after MaxText's pydantic validation.

:func:`maxtext_nvfp4.core.settings.validate` (num_layers, steps, scan_layers), qwix, what TE refuses (from the
config alone, before the device check), the backend choice and the MoE refusals: all before any compile.
"""

from __future__ import annotations

from maxtext_nvfp4.backends import te as te_backend
from maxtext_nvfp4.core import settings as settings_lib
from maxtext_nvfp4.integration import compile_target
from maxtext_nvfp4.integration import config_schema
from maxtext_nvfp4.integration import model_layout
from maxtext_nvfp4.integration import moe_refusals
from maxtext_nvfp4.integration import serving_layout


def validate_config(config) -> None:
  """Cross-key checks for ``quantization=nvfp4`` (one-line :class:`SettingsError`/``BackendError``)."""
  if not config_schema.is_nvfp4(config):
    return
  s = settings_lib.from_config(config)
  layout = model_layout.layout_of(config)
  settings_lib.validate(s, num_layers=config.num_decoder_layers, steps=config.steps, scan_layers=config.scan_layers)
  if config.use_qwix_quantization:
    raise settings_lib.SettingsError(
        "quantization=nvfp4 with use_qwix_quantization=true: the NVFP4 plugin does not use qwix; set"
        " use_qwix_quantization=false")
  if s.backend == "te":  # what TE refuses is decided from the config alone: say it before the device check
    te_backend.check_te_settings(s)
    te_backend.check_te_shapes(config, s, layout=layout)
  compile_target.choose_backend(config, s)
  # MoE paths that would skip the plan (the device-count check waits for make_quantization: asking JAX for
  # devices here would start its backend before MaxText initializes jax.distributed).
  moe_refusals.check_model(config, s, s.backend, num_devices=None, layout=layout)
  serving = serving_layout.refusal(s, layout)  # nvfp4_qat=serving on a projection the export serves otherwise
  if serving:
    raise settings_lib.SettingsError(serving)
