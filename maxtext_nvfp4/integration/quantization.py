"""The factory MaxText's ``configure_quantization`` calls for ``quantization=nvfp4``: :func:`make_quantization`.

Logs the backend choice and the precision table once per process, runs the start-up refusals on the
config's :class:`~maxtext_nvfp4.core.layout.ModelLayout`, then builds

* :class:`emulated_quantization` ``Nvfp4Quantization`` (emulate), or
* the TE adapter of :mod:`maxtext_nvfp4.integration.te_quantization` (``nvfp4_backend=te``), with the MoE
  experts emulated under ``nvfp4_backend=auto``.

Registration is not done here: the entry points (:func:`maxtext_nvfp4.register`,
:func:`maxtext_nvfp4.maxtext_plugin.make_quantization`) do it.
"""

from __future__ import annotations

import dataclasses

from maxtext_nvfp4.backends import capability
from maxtext_nvfp4.backends import te as te_backend
from maxtext_nvfp4.core import implementations
from maxtext_nvfp4.core import plan as plan_lib
from maxtext_nvfp4.core import settings as settings_lib
from maxtext_nvfp4.core import te_limits
from maxtext_nvfp4.integration import emulated_quantization
from maxtext_nvfp4.integration import moe_refusals
from maxtext_nvfp4.integration import parsed_config
from maxtext_nvfp4.integration import precision_text
from maxtext_nvfp4.integration import serving_layout
from maxtext_nvfp4.integration import te_quantization
from maxtext_nvfp4.integration import te_weight_gather
from maxtext_nvfp4.integration.log_once import log_once


def make_quantization(config, quant_mode_str: str = "train"):
  """Our Quantization object for a ``quantization=nvfp4`` config (the patch series' hook calls it too).

  Logs the backend choice and the precision table once per process. On the TE backend the object comes
  from :func:`maxtext_nvfp4.integration.te_quantization.make_te_quantization`.
  """
  del quant_mode_str  # emulated NVFP4 is the same computation in train/serve/convert
  run = parsed_config.parse(config)
  s, layout, facts = run.settings, run.layout, run.adapter
  choice = run.choice
  impl = choice.implementation
  capability.announce(choice, log=log_once)
  log_once(precision_text.parsed_table_text(run))
  if impl.stops_at_te_limits:
    te_backend.check_te_gemms(s, layout)  # nvfp4_backend=te was checked at config time
    te_weight_gather.announce(config, s, run.device_count, moe=bool(layout.moe_layers))
  else:  # the emulation zero-pads what TE refuses: say so once, so the recipe is not taken to Blackwell as is
    refused = te_limits.summary(te_limits.refusals_of(s, layout))
    if refused:
      log_once(refused)
  moe_refusals.check_parsed(run, num_devices=run.device_count)
  serving_refused = serving_layout.refusal(s, layout)
  if serving_refused:
    raise settings_lib.SettingsError(serving_refused)
  locator = plan_lib.GemmLocator(num_layers=layout.num_layers, num_activations=layout.num_activations,
                                 scan_layers=layout.scan_layers, moe_layers=layout.moe_layers or None,
                                 signatures=facts.kernel_signatures, up_projection_axes=facts.up_projection_axes)
  from maxtext_nvfp4.integration import stability  # pylint: disable=import-outside-toplevel

  stability.configure_settings(config, s, grad_supported=impl.grad_diagnostics)
  return _BUILDERS[impl](run, locator)


def _te_quantization(run: parsed_config.ParsedConfig, locator: plan_lib.GemmLocator):
  """MaxText's TE quantization running our recipe (:mod:`te_quantization`); under ``nvfp4_backend=auto`` the
  MoE experts, which TE cannot run, emulated beside it."""
  config, s, layout = run.config, run.settings, run.layout
  if s.diagnostics:
    log_once("maxtext-nvfp4: nvfp4_diagnostics is available with the emulation backend only; no nvfp4/*"
             " metrics on the TE backend", warn=True)
  from maxtext.layers import quantizations  # pylint: disable=import-outside-toplevel

  te_quant = te_quantization.make_te_quantization(quantizations.TransformerEngineQuantization, config, s,
                                                  plan_lib.FpropPlan(settings=s, locator=locator),
                                                  sr_source_stream=run.adapter.te_sr_source_stream)
  if layout.moe_layers:  # nvfp4_backend=auto (te was refused by check_model): experts emulated
    log_once("maxtext-nvfp4: MoE expert GEMMs run emulated (TE JAX has no NVFP4 grouped GEMM); attention"
             " and dense projections on TE")
    experts = emulated_quantization.quantization_class()(settings=s, num_layers=layout.num_layers,
                                                         locator=dataclasses.replace(locator, counts={}),
                                                         switch_step=s.switch_step(config.steps))
    object.__setattr__(te_quant, "einsum", experts.einsum)
    object.__setattr__(te_quant, "expert_gemms", experts.expert_gemms)
  return te_quant


def _emulated_quantization(run: parsed_config.ParsedConfig, locator: plan_lib.GemmLocator):
  """The emulated ``Nvfp4Quantization`` (:mod:`emulated_quantization`), with diagnostics when asked for."""
  config, s, layout = run.config, run.settings, run.layout
  diag_interval = 0
  if s.diagnostics:
    from maxtext_nvfp4.core import diagnostics  # pylint: disable=import-outside-toplevel  (JAX)

    diag_interval = int(s.diagnostics_interval)
    diagnostics.AGGREGATOR.armed = True  # the metrics writer now waits for and merges nvfp4/* reports
    log_once(f"maxtext-nvfp4: diagnostics on: nvfp4/* metrics every {diag_interval} steps")
  serving = serving_layout.members(config) if s.qat == "serving" else None
  return emulated_quantization.quantization_class()(settings=s, num_layers=layout.num_layers, locator=locator,
                                                    switch_step=s.switch_step(config.steps),
                                                    diagnostics_interval=diag_interval, serving_members=serving)


# how each implementation of the table builds MaxText's quantization object
_BUILDERS = {implementations.EMULATE: _emulated_quantization, implementations.TE: _te_quantization}
