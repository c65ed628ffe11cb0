"""Argument types that check ranges while argparse parses, so a bad number is a one-line usage error.

``type=number(above=0)`` etc. with :class:`maxtext_nvfp4.tools.cli.ArgumentParser`: a value out of range,
non-finite or not a number gives ``PROG: error: argument --FLAG: ...; see PROG --help`` and exit code 2
before the command does anything.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable


def number(*, integer: bool = False, above: float | None = None, at_least: float | None = None,
           below: float | None = None) -> Callable[[str], float | int]:
  """An argparse ``type``: the text as an int (``integer``) or a finite float with
  ``value > above``, ``value >= at_least`` and ``value < below`` (each bound optional)."""
  kind = "an integer" if integer else "a finite number"
  need = [f"> {above:g}" if above is not None else "", f">= {at_least:g}" if at_least is not None else "",
          f"< {below:g}" if below is not None else ""]
  need_text = kind + (" " + " and ".join(n for n in need if n) if any(need) else "")

  def convert(text: str):
    try:
      value = int(text) if integer else float(text)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not {need_text}") from None
    if (not integer and not math.isfinite(value)) or (above is not None and not value > above) \
        or (at_least is not None and not value >= at_least) or (below is not None and not value < below):
      raise argparse.ArgumentTypeError(f"{text} is out of range: need {need_text}")
    return value

  convert.__name__ = "integer" if integer else "number"
  return convert
