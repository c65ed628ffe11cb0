"""What the plugin knows about each supported MaxText version: one frozen :class:`MaxTextVersion` per file.

Every fact about a MaxText release that the code depends on -- the symbols it reads, wraps, replaces or
subclasses (``touches``), how a decoder projection is named from its kernel axes and build order, the
activation axis names, which decoder layers are MoE, the expert kernel axes and grouped-GEMM call order,
pyconfig's error text and rewritten keys, the RNG stream TE's ``sr_rng`` is drawn from, the private TE
quantization attributes, the checkpoint-conversion hooks -- lives in ``v<major>_<minor>_<patch>.py``
here. Nothing else names a MaxText version; ``core/`` receives these facts as arguments.

Adding a MaxText version is one more file holding ``ADAPTER = MaxTextVersion(...)`` (usually
``dataclasses.replace`` of its predecessor with the fields that differ) plus its row in :data:`SUPPORTED`.
:func:`select` picks the adapter of the installed MaxText at registration; an unsupported version fails
there, in one line naming the supported ones.
"""

from __future__ import annotations

from maxtext_nvfp4.integration.maxtext_versions import v0_2_4, v0_2_5
from maxtext_nvfp4.integration.maxtext_versions.schema import MaxTextVersion, MaxTextVersionError, Touch

__all__ = ["MaxTextVersion", "MaxTextVersionError", "Touch", "SUPPORTED", "installed_version", "select",
           "trainer_versions"]


# the supported releases, oldest first: one file each (the only list to extend)
_ADAPTERS: dict[str, MaxTextVersion] = {a.version: a for a in (v0_2_4.ADAPTER, v0_2_5.ADAPTER)}
SUPPORTED: tuple[str, ...] = tuple(_ADAPTERS)


def trainer_versions(trainer: str) -> tuple[str, ...]:
  """The supported MaxText versions, oldest first, whose post-training ``trainer`` was verified (those whose
  adapter lists it in ``posttrain_modules``)."""
  return tuple(v for v, a in _ADAPTERS.items() if trainer in a.posttrain_modules)


def installed_version() -> str:
  """The installed ``maxtext`` distribution's version, or ``unknown``."""
  from importlib import metadata  # pylint: disable=import-outside-toplevel

  try:
    return metadata.version("maxtext")
  except metadata.PackageNotFoundError:
    return "unknown"


def select(version: str | None = None) -> MaxTextVersion:
  """The adapter of MaxText ``version`` (default: the installed one).

  ``unknown`` (no distribution metadata, e.g. a source checkout on ``sys.path``) takes the newest adapter;
  its symbols are still checked one by one when each module is patched. Anything else unsupported raises
  :class:`MaxTextVersionError` naming the supported versions.
  """
  version = installed_version() if version is None else version
  adapters = _ADAPTERS
  if version == "unknown":
    return adapters[SUPPORTED[-1]]
  if version not in adapters:
    raise MaxTextVersionError(
        f"maxtext-nvfp4 supports MaxText {' and '.join(SUPPORTED)}; the installed MaxText is {version}: install a"
        f" supported one (pip install 'maxtext=={SUPPORTED[-1]}')")
  return adapters[version]
