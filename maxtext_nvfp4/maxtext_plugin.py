"""The stable hook of the MaxText patch series: ``from maxtext_nvfp4.maxtext_plugin import make_quantization``.

``patches/maxtext-<version>/0002-*.patch`` writes this import into MaxText's ``configure_quantization``;
trees patched by any maxtext-nvfp4 release call it, so the path never moves. It registers the plugin (the
patched tree imports nothing else of ours: the step and metrics wrappers come from registration), then
builds the object with :func:`maxtext_nvfp4.integration.quantization.make_quantization`.
"""

from maxtext_nvfp4.integration.plugin import register

__all__ = ["make_quantization", "register"]


def make_quantization(config, quant_mode_str: str = "train"):
  """Our Quantization object for a ``quantization=nvfp4`` config, with the plugin registered first."""
  from maxtext_nvfp4.integration import quantization  # pylint: disable=import-outside-toplevel  (JAX)

  register()
  return quantization.make_quantization(config, quant_mode_str=quant_mode_str)
