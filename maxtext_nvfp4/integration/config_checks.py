"""The cross-key checks of a ``quantization=nvfp4`` config, run right after MaxText's pydantic validation.

:func:`maxtext_nvfp4.core.settings.validate` (num_layers, steps, scan_layers), qwix, what TE refuses (from the
config alone, before the device check), the backend choice and the MoE refusals: all before any compile.
"""

from __future__ import annotations

from maxtext_nvfp4.backends import te as te_backend
from maxtext_nvfp4.core import settings as settings_lib
from maxtext_nvfp4.integration import config_schema
from maxtext_nvfp4.integration import moe_refusals
from maxtext_nvfp4.integration import parsed_config
from maxtext_nvfp4.integration import serving_layout


def validate_config(config) -> None:
  """Cross-key checks for ``quantization=nvfp4`` (one-line :class:`SettingsError`/``BackendError``)."""
  if not config_schema.is_nvfp4(config):
    return
  run = parsed_config.parse(config)
  s, layout = run.settings, run.layout
  settings_lib.validate(s, num_layers=config.num_decoder_layers, steps=config.steps, scan_layers=config.scan_layers)
  if config.use_qwix_quantization:
    raise settings_lib.SettingsError(
        "quantization=nvfp4 with use_qwix_quantization=true: the NVFP4 plugin does not use qwix; set"
        " use_qwix_quantization=false")
  insisted = run.insisted
  if insisted is not None and insisted.stops_at_te_limits:  # decided from the config alone: before the device check
    te_backend.check_te_settings(s)
    te_backend.check_te_gemms(s, layout)
  _ = run.choice  # nvfp4_backend=te where it cannot run: a one-line BackendError before any compile
  # MoE paths that would skip the plan (the device-count check waits for make_quantization: asking JAX for
  # devices here would start its backend before MaxText initializes jax.distributed).
  moe_refusals.check_parsed(run, num_devices=None)
  serving = serving_layout.refusal(s, layout)  # nvfp4_qat=serving on a projection the export serves otherwise
  if serving:
    raise settings_lib.SettingsError(serving)
