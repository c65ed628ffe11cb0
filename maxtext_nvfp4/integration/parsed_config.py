"""A ``quantization=nvfp4`` MaxText config read once: :class:`ParsedConfig`, built by :func:`parse`.

The config's ``nvfp4_*`` settings, its decoder (``ModelLayout``, with the installed MaxText's MoE layer rules),
that MaxText's adapter and the backend choice are read here once per entry point (the config check after
MaxText's validation, the quantization factory) and handed to every check and builder that needs them; none
of those reads the ``nvfp4_*`` keys or the decoder's shape from the raw config again.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from maxtext_nvfp4.backends import capability
from maxtext_nvfp4.core import implementations
from maxtext_nvfp4.core import layout as layout_lib
from maxtext_nvfp4.core import settings as settings_lib
from maxtext_nvfp4.integration import compile_target
from maxtext_nvfp4.integration import touchpoints
from maxtext_nvfp4.integration.maxtext_versions import MaxTextVersion


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParsedConfig:
  """What the plugin reads of one MaxText config, read once (:func:`parse`)."""

  # the MaxText config itself: its other keys (steps, sparse_matmul, te_moe_block, te_comm_gemm_overlap, ...)
  config: Any
  # its nvfp4_* keys
  settings: settings_lib.Nvfp4Settings
  # its decoder: layers, roles per layer, MoE layers (the installed MaxText's rules), dimensions
  layout: layout_lib.ModelLayout
  # the installed MaxText's facts (touchpoints.adapter())
  adapter: MaxTextVersion

  @functools.cached_property
  def choice(self) -> capability.BackendChoice:
    """The backend that runs the config (judged once, on its compile target's devices where it has one);
    a one-line ``BackendError`` where ``nvfp4_backend=te`` cannot run."""
    return compile_target.choose_backend(self.config, self.settings)

  @property
  def device_count(self) -> int:
    """Devices the config's program runs on: its compile target's, else the host's (asks JAX: not before
    MaxText has initialized ``jax.distributed``)."""
    return compile_target.device_count(self.config)

  @property
  def insisted(self) -> implementations.Implementation | None:
    """The implementation ``nvfp4_backend`` insists on (None: ``auto``)."""
    return implementations.insisted(self.settings.backend)


def parse(config, *, layout: layout_lib.ModelLayout | None = None) -> ParsedConfig:
  """``config`` (a MaxText config object or a mapping of its keys) read once; ``layout``: its decoder when
  the caller already has it."""
  facts = touchpoints.adapter()
  return ParsedConfig(config=config, settings=settings_lib.from_config(config),
                      layout=layout or layout_lib.from_config(config, moe_layer_rules=facts.moe_layer_rules),
                      adapter=facts)
