"""MaxText's HLO-dump default, undone when no dump was asked for.

MaxText's config validation (``types.py``, ``validate_and_set_hlo_dump_defaults``, run for every config) sets
``XLA_FLAGS = --xla_dump_to={dump_hlo_local_dir} --xla_dump_large_constants [--xla_dump_hlo_module_re=...]`` whenever
``XLA_FLAGS`` is unset or empty and ``dump_hlo_xla_flags`` is empty, whatever ``dump_hlo`` says: every run of a
process that had no ``XLA_FLAGS`` would write its train step's HLO to ``/tmp/xla_dump/``. :func:`kept_unless_dumping`
puts ``XLA_FLAGS`` back as it was when MaxText set exactly those defaults and ``dump_hlo`` is false, or when the
config failed to validate after setting them. ``dump_hlo=true``, a user's ``dump_hlo_xla_flags`` and a user's
``XLA_FLAGS`` are left as MaxText made them.
"""

from __future__ import annotations

import contextlib
import os


def injected_flags(adapter, config) -> str | None:
  """The flags MaxText's default sets for ``config`` (the adapter's format), or None when the version sets none."""
  fmt = getattr(adapter, "hlo_dump_injected_flags", "")
  if not fmt:
    return None
  values = {k: getattr(config, k, "") for k in ("dump_hlo_local_dir", "dump_hlo_local_module_name")}
  flags = fmt.format(**values)
  if values["dump_hlo_local_module_name"]:
    flags += adapter.hlo_dump_injected_module_flag.format(**values)
  return flags


@contextlib.contextmanager
def kept_unless_dumping(adapter):
  """Around MaxText's config validation: yields a callback ``done(config)`` to call with the validated config.

  On an exception, or when ``done`` sees ``dump_hlo`` false and ``XLA_FLAGS`` equal to MaxText's own default,
  ``XLA_FLAGS`` is restored to what it was (unset stays unset, empty stays empty)."""
  before = os.environ.get("XLA_FLAGS")
  if before:  # a user's XLA_FLAGS: MaxText sets nothing
    yield lambda config: None
    return

  def restore():
    if before is None:
      os.environ.pop("XLA_FLAGS", None)
    else:
      os.environ["XLA_FLAGS"] = before

  def done(config):
    now = os.environ.get("XLA_FLAGS")
    if now and not getattr(config, "dump_hlo", False) and now == injected_flags(adapter, config):
      restore()

  try:
    yield done
  except BaseException:
    if os.environ.get("XLA_FLAGS") != before:
      restore()
    raise
