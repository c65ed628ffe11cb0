"""What every deviceless XLA:GPU compile test file shares: ``benchmarks/gpu`` and ``benchmarks`` on the path (for
``deviceless``, ``quantizer_hlo``, ``hlo_traffic``) and :data:`MARKS`, the gate of the gpu stage: such a file runs
only in its own stage (``MAXTEXT_NVFP4_GPU_COMPILE_TESTS=1``; minutes of compilation), where the compile-only client
is installed, and at jax 0.12.0.1, whose XLA the counts pin. Use ``pytestmark = [*MARKS]``."""

import os
import sys
from pathlib import Path

import jax
import pytest

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT / "benchmarks" / "gpu"))
sys.path.insert(0, str(_ROOT / "benchmarks"))

import deviceless  # noqa: E402  pylint: disable=wrong-import-position

STAGE_VAR = "MAXTEXT_NVFP4_GPU_COMPILE_TESTS"
REASON = deviceless.unavailable_reason()
MARKS = [
    pytest.mark.skipif(os.environ.get(STAGE_VAR) != "1",
                       reason=f"deviceless GPU compile tests take minutes: run them as their own stage with {STAGE_VAR}=1"),
    pytest.mark.skipif(REASON is not None, reason=f"deviceless GPU compile unavailable: {REASON}"),
    pytest.mark.skipif(jax.__version__ != "0.12.0.1",
                       reason=f"the pinned counts are XLA's at jax 0.12.0.1 (this is {jax.__version__})"),
]
