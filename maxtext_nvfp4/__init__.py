"""maxtext-nvfp4: NVFP4 training mode for MaxText.

Importing the package (or any ``maxtext_nvfp4.core`` module) changes nothing: :func:`register` makes
MaxText accept ``quantization: nvfp4`` and the ``nvfp4_*`` keys. The entry points call it (the train CLI,
``python -m maxtext_nvfp4.train``, the patch series' ``maxtext_plugin.make_quantization``, the tools that
run MaxText in-process); code running MaxText itself calls ``maxtext_nvfp4.register()`` first.
Registration is cheap: it picks the installed MaxText's adapter (an unsupported version fails here, in
one line), installs an import hook and patches MaxText's modules only when (or if already) they are
imported, so neither importing the package nor registering imports JAX or MaxText.

The public API (each name is loaded on first use, from the module named):

=====================  ==============================================  =================================
name                   module                                          what
=====================  ==============================================  =================================
``quantize``           :mod:`maxtext_nvfp4.core.nvfp4`                 TE's NVFP4 quantizer, bit-exact
``dequantize``         :mod:`maxtext_nvfp4.core.nvfp4`                 TE JAX's dequantizer
``NVFP4Tensor``        :mod:`maxtext_nvfp4.core.nvfp4`                 data, block scales, amax
``dot_general``        :mod:`maxtext_nvfp4.core.gemm`                  TE's NVFP4 GEMM recipe (custom_vjp)
``GemmRecipe``         :mod:`maxtext_nvfp4.core.gemm`                  per-pass precisions and toggles
``Nvfp4Settings``      :mod:`maxtext_nvfp4.core.settings`              the ``nvfp4_*`` keys
``precision_table``    :mod:`maxtext_nvfp4.core.plan`                  which GEMM runs in which precision
``make_quantization``  :mod:`maxtext_nvfp4.maxtext_plugin`            MaxText's quantization object
=====================  ==============================================  =================================
"""

import importlib

__version__ = "0.1.0"

_PUBLIC = {
    "quantize": "maxtext_nvfp4.core.nvfp4",
    "dequantize": "maxtext_nvfp4.core.nvfp4",
    "NVFP4Tensor": "maxtext_nvfp4.core.nvfp4",
    "dot_general": "maxtext_nvfp4.core.gemm",
    "GemmRecipe": "maxtext_nvfp4.core.gemm",
    "Nvfp4Settings": "maxtext_nvfp4.core.settings",
    "precision_table": "maxtext_nvfp4.core.plan",
    "make_quantization": "maxtext_nvfp4.maxtext_plugin",
}
__all__ = ["__version__", "register", *_PUBLIC]


def __getattr__(name: str):
  if name in _PUBLIC:
    return getattr(importlib.import_module(_PUBLIC[name]), name)
  raise AttributeError(f"module 'maxtext_nvfp4' has no attribute {name!r}")


def register() -> None:
  """Make MaxText accept ``quantization=nvfp4`` and the ``nvfp4_*`` keys (idempotent)."""
  from maxtext_nvfp4.integration import plugin  # pylint: disable=import-outside-toplevel

  plugin.register()
