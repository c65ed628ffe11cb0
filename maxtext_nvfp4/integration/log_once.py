"""Show a start-up line once per process (MaxText builds the quantization object several times)."""

from __future__ import annotations

import logging
import threading

_log = logging.getLogger("maxtext_nvfp4")
_lock = threading.Lock()
_logged: set[str] = set()


def log_once(text: str, warn: bool = False) -> None:
  """Show ``text`` once per process: printed to stdout (where the step lines are parsed), or logged as a
  warning when ``warn``. The printed text goes to ``logging`` at DEBUG only: under MaxText's absl handler
  an INFO record reaches the console too, so every line was shown twice."""
  with _lock:
    if text in _logged:
      return
    _logged.add(text)
  if warn:
    _log.warning(text)
    return
  print(text, flush=True)
  _log.debug(text)
