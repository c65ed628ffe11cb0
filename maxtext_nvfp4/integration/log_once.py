"""Show a start-up line once per run: once per process (MaxText builds the quantization object several
times), and on process 0 only (a 128-host run prints one copy, not 128)."""

from __future__ import annotations

import logging
import threading

_log = logging.getLogger("maxtext_nvfp4")
_lock = threading.Lock()
_logged: set[str] = set()


def is_primary() -> bool:
  """``jax.process_index() == 0``. Call it where JAX is already up (MaxText's model build): asking earlier
  would start JAX's backend before ``jax.distributed.initialize``."""
  import jax  # pylint: disable=import-outside-toplevel

  return jax.process_index() == 0


def log_once(text: str, warn: bool = False) -> None:
  """Show ``text`` once per process, on process 0 only: printed to stdout (where the step lines are
  parsed), or logged as a warning when ``warn``. The printed text goes to ``logging`` at DEBUG only: under
  MaxText's absl handler an INFO record reaches the console too, so every line was shown twice."""
  with _lock:
    if text in _logged:
      return
    _logged.add(text)
  if not is_primary():
    return
  if warn:
    _log.warning(text)
    return
  print(text, flush=True)
  _log.debug(text)
