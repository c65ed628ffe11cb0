"""MaxText's and its libraries' misleading start-up messages, hidden and said so once: :func:`install`.

Which messages, and why each is harmless, is the MaxText adapter's ``log_noise`` (a fact of the version):
``[NO-OP] ...: dependency missing`` (x6), transformers' "PyTorch was not found" and DeepSeek ``rope_scaling``
lines, MaxText's "AQT quantization is deprecated ... use_qwix_quantization=True" (for ``quantization=nvfp4``
only: :func:`hold_nvfp4_only`), "Memstats unavailable" with its header, and MaxText's ``MAXTEXT CONFIG
ERROR`` banner (the train command prints the error itself). ``MAXTEXT_NVFP4_VERBOSE=1`` hides nothing.

A message is hidden iff its source (the logger that creates the record, or the module that prints it) and
text match one entry; every other message passes unchanged.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading

from maxtext_nvfp4.integration import precision_text
from maxtext_nvfp4.integration import touchpoints

_lock = threading.Lock()
_installed = False
_held = threading.local()  # .records: the nvfp4-only records held while a config is validated (None: not holding)
# ranks a launcher sets (SLURM, Open MPI, PMI, torchrun-style, JAX's own): the notice is shown on rank 0 only
_RANK_VARIABLES = ("JAX_PROCESS_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK")


def _matches(noise, message: str) -> bool:
  return noise.text in message


class _NoiseFilter(logging.Filter):
  """Drops the records of one logger that match its ``LogNoise`` entries (nvfp4-only ones: held instead
  while :func:`hold_nvfp4_only` is active). "Memstats: <label>:" is held until the next record: dropped
  with a "Memstats unavailable" that follows, else shown before it."""

  def __init__(self, entries, hide_all: bool):
    super().__init__()
    self.entries = entries
    self.hide_all = hide_all  # False: only the nvfp4-only entries (the plugin's own use, without the CLI)
    self.header = None
    self.replaying = False

  def filter(self, record: logging.LogRecord) -> bool:
    if self.replaying:
      return True
    message = record.getMessage()
    for noise in self.entries:
      if not _matches(noise, message):
        continue
      if noise.nvfp4_only:
        records = getattr(_held, "records", None)
        if records is None:
          return True
        records.append(record)
        return False
      if self.hide_all:
        if noise.text == "Memstats unavailable":
          self.header = None
        return False
    if self.hide_all and any(n.text == "Memstats unavailable" for n in self.entries):
      if message.lstrip().startswith("Memstats:"):
        self.header = record
        return False
      header, self.header = self.header, None
      if header is not None:
        self._replay(logging.getLogger(header.name), header)
    if self.hide_all and message.strip() == "=" * 80 and any(n.text == "MAXTEXT CONFIG ERROR:" for n in self.entries):
      return False  # the banner lines around MAXTEXT CONFIG ERROR
    return True

  def _replay(self, logger, record) -> None:
    self.replaying = True
    try:
      logger.handle(record)
    finally:
      self.replaying = False


_filters: dict[str, _NoiseFilter] = {}


def _logger_filters(hide_all: bool) -> None:
  by_logger: dict[str, list] = {}
  for noise in touchpoints.adapter().log_noise:
    if noise.kind == "logger" and (hide_all or noise.nvfp4_only):
      by_logger.setdefault(noise.source, []).append(noise)
  for name, entries in by_logger.items():
    old = _filters.get(name)
    if old is not None:
      if hide_all and not old.hide_all:
        old.entries, old.hide_all = entries, True
      continue
    _filters[name] = _NoiseFilter(entries, hide_all)
    logging.getLogger(name).addFilter(_filters[name])


def _quiet_prints() -> None:
  """Replace ``print`` inside each module of the ``print`` entries (a module global shadows the builtin)."""
  import builtins  # pylint: disable=import-outside-toplevel

  by_module: dict[str, list] = {}
  for noise in touchpoints.adapter().log_noise:
    if noise.kind == "print":
      by_module.setdefault(noise.source, []).append(noise)
  for name, entries in by_module.items():
    try:
      module = importlib.import_module(name)
    except ImportError:
      continue

    def quiet_print(*args, _entries=tuple(entries), **kwargs):
      text = " ".join(str(a) for a in args)
      if not any(_matches(n, text) for n in _entries):
        builtins.print(*args, **kwargs)

    module.print = quiet_print


def notice() -> str:
  """The one line that says what is hidden and how to see it."""
  labels = ", ".join(n.label for n in touchpoints.adapter().log_noise)
  return f"maxtext-nvfp4: hiding harmless library messages ({labels}); {precision_text.VERBOSE_ENV}=1 shows them"


def _launcher_rank() -> int:
  for name in _RANK_VARIABLES:
    value = os.environ.get(name, "")
    if value.strip().isdigit():
      return int(value)
  return 0


def install(say=print) -> bool:
  """Hide every ``log_noise`` message of the installed MaxText in this process and ``say`` :func:`notice`
  once (launcher rank 0 only). Call before MaxText is imported (the ``[NO-OP]`` lines are printed at its
  import). Nothing is hidden, and False returned, with ``MAXTEXT_NVFP4_VERBOSE=1``."""
  global _installed
  if precision_text.verbose():
    return False
  with _lock:
    if _installed:
      return True
    _installed = True
    _logger_filters(hide_all=True)
    _quiet_prints()
  if _launcher_rank() == 0:
    say(notice())
  return True


@contextlib.contextmanager
def hold_nvfp4_only():
  """Hold the nvfp4-only messages logged inside the block; ``release(nvfp4)`` after it drops them for an
  nvfp4 config and shows them otherwise (a block that raises shows them). Used around MaxText's config
  validation (the AQT deprecation warning is logged by a validator, before the config exists)."""
  if precision_text.verbose():
    yield lambda nvfp4: None
    return
  _logger_filters(hide_all=False)
  outer = getattr(_held, "records", None)
  _held.records = records = []
  released = []

  def release(nvfp4: bool) -> None:
    released.append(nvfp4)

  try:
    yield release
  finally:
    _held.records = outer
    if not (released and released[-1]):
      for record in records:
        f = _filters.get(record.name)
        if f is not None:
          f._replay(logging.getLogger(record.name), record)  # pylint: disable=protected-access
        else:
          logging.getLogger(record.name).handle(record)
