"""The stable hook of the MaxText patch series: ``from maxtext_nvfp4.maxtext_plugin import make_quantization``.

``patches/maxtext-0.2.5/0002-*.patch`` writes this import into MaxText's ``configure_quantization``;
trees patched by any maxtext-nvfp4 release call it, so the path never moves. The implementation is
:mod:`maxtext_nvfp4.integration.quantization`.
"""

from maxtext_nvfp4.integration.plugin import register
from maxtext_nvfp4.integration.quantization import make_quantization

__all__ = ["make_quantization", "register"]
