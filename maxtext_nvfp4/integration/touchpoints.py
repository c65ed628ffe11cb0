"""The installed MaxText's adapter (:func:`adapter`), the check of its symbols, and our idempotent wrapper.

The facts themselves live in :mod:`maxtext_nvfp4.integration.maxtext_versions` (one file per MaxText
version). :func:`check` runs before a module is patched; a missing symbol fails at once with one line naming
it and the supported versions, instead of an ``AttributeError`` deep inside a training run.
"""

from __future__ import annotations

import functools

from maxtext_nvfp4.integration import maxtext_versions
from maxtext_nvfp4.integration.maxtext_versions import MaxTextVersion, MaxTextVersionError, installed_version

__all__ = ["MaxTextVersionError", "adapter", "check", "installed_version", "maxtext_package_dir", "missing",
           "wrap_once"]


@functools.cache
def adapter() -> MaxTextVersion:
  """The facts of the installed MaxText (chosen once per process; unsupported: :class:`MaxTextVersionError`)."""
  return maxtext_versions.select()


def wrap_once(orig, make_wrapper):
  """``make_wrapper(orig)`` marked as ours, or ``orig`` itself when it already is one of our wrappers.

  Patching is idempotent: a module patched twice (re-registration, ``__main__`` copies) keeps one layer.
  """
  if getattr(orig, "_maxtext_nvfp4_wrapped", None) is not None:
    return orig
  wrapper = functools.wraps(orig)(make_wrapper(orig))
  wrapper._maxtext_nvfp4_wrapped = orig  # pylint: disable=protected-access
  return wrapper


def missing(module_name: str, module, facts: MaxTextVersion | None = None) -> list[str]:
  """The ``module.symbol`` entries of the adapter's ``touches`` for ``module_name`` that ``module`` lacks."""
  out = []
  for t in (facts or adapter()).touches:
    if t.module != module_name:
      continue
    obj = module
    for part in t.symbol.split("."):
      obj = getattr(obj, part, None)
      if obj is None:
        out.append(f"{t.module}.{t.symbol}")
        break
  return out


def check(module_name: str, module, facts: MaxTextVersion | None = None) -> None:
  """Raise :class:`MaxTextVersionError` when ``module`` lacks a symbol of the adapter's ``touches``."""
  facts = facts or adapter()
  gone = missing(module_name, module, facts)
  if gone:
    supported = " and ".join(maxtext_versions.SUPPORTED)
    raise MaxTextVersionError(
        f"maxtext-nvfp4 supports MaxText {supported}; the installed MaxText ({installed_version()}) has no"
        f" {', '.join(gone)}: install maxtext=={facts.version} (pip install 'maxtext=={facts.version}')")


def maxtext_package_dir() -> str:
  """The directory of the installed ``maxtext`` package (its assets and configs live there)."""
  import os  # pylint: disable=import-outside-toplevel

  import maxtext  # pylint: disable=import-outside-toplevel

  return os.path.dirname(maxtext.__file__)
