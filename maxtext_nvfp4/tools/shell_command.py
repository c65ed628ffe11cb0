"""How to type this environment's commands in the user's shell, for the commands the tools print."""

from __future__ import annotations

import sys


def shell_command(name: str = "maxtext-nvfp4") -> str:
  """How to type this environment's ``name`` (``maxtext-nvfp4`` or ``python``) in the shell that started us, for
  the commands we print: the bare name when ``PATH`` finds this environment's, else its path (relative to the
  working directory when under it: ``.venv/bin/maxtext-nvfp4`` after ``bash scripts/demo.sh`` in a fresh clone,
  whose venv is not activated; a bare ``python`` would then be the system one, without this package)."""
  import os  # pylint: disable=import-outside-toplevel
  import shutil  # pylint: disable=import-outside-toplevel

  mine = sys.executable if name == "python" else os.path.join(os.path.dirname(sys.executable), name)
  if name != "python" and not os.path.isfile(mine):  # no console script beside this interpreter
    return f"{shell_command('python')} -m maxtext_nvfp4"
  found = shutil.which(name)
  if found and os.path.abspath(found) == os.path.abspath(mine):
    return name
  rel = os.path.relpath(mine)
  return rel if not rel.startswith("..") else mine
