"""maxtext-nvfp4: NVFP4 training mode for MaxText.

Importing the package registers the MaxText plugin (:func:`register`): MaxText then accepts
``quantization: nvfp4`` and the ``nvfp4_*`` keys. Registration is lazy and cheap: it installs an import
hook and patches MaxText's config/quantization/train modules only when (or if already) they are imported,
so ``import maxtext_nvfp4`` itself imports neither JAX nor MaxText.
"""

__version__ = "0.1.0"


def register() -> None:
  """Make MaxText accept ``quantization=nvfp4`` and the ``nvfp4_*`` keys (idempotent)."""
  from maxtext_nvfp4 import maxtext_plugin  # pylint: disable=import-outside-toplevel

  maxtext_plugin.register()


register()
