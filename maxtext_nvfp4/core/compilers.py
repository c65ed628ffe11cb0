"""Which accelerator compilers this Python environment has, so what a program traced here can be compiled for.

    installed() -> {"cuda"?, "tpu"?}
        "cuda"  XLA:GPU's compiler: jax-cuda12-plugin (``jax_cuda12_plugin``) and jax-cuda12-pjrt
                (``jax_plugins.xla_cuda12``), as ``jax[cuda12]`` and the compile-only targets environment install
        "tpu"   libtpu, as ``jax[tpu]`` installs it

Without them no program traced in this process can be compiled for that platform, on its devices or compile-only
(``backends/targets.py``), so the quantizer does not trace that platform's kernels (``core/quantizer/api.py``).
"""

from __future__ import annotations

import functools
import importlib.util

# each platform's compiler: the modules that must all be importable
_MODULES = {"cuda": ("jax_cuda12_plugin", "jax_plugins.xla_cuda12"), "tpu": ("libtpu",)}


def _importable(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):  # a parent package missing, or a module without a spec
    return False


@functools.cache
def installed() -> frozenset[str]:
  """The platforms ("cuda", "tpu") whose compiler this environment has (see the module docstring)."""
  return frozenset(p for p, modules in _MODULES.items() if all(_importable(m) for m in modules))
