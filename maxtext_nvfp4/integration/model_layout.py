"""The :class:`~maxtext_nvfp4.core.layout.ModelLayout` of a MaxText config, with the installed version's MoE rules.

Built once per config and passed on: the plan's locator (MoE layers), the precision table (roles per
layer), the TE limits and the MoE refusals all read this one object.
"""

from __future__ import annotations

from maxtext_nvfp4.core import layout as layout_lib
from maxtext_nvfp4.integration import touchpoints


def layout_of(config) -> layout_lib.ModelLayout:
  """``config``'s decoder (a MaxText config object or a mapping of its keys)."""
  return layout_lib.from_config(config, moe_layer_rules=touchpoints.adapter().moe_layer_rules)
