"""The te stage: real Transformer Engine JAX (2.20.2, .venv-targets) traced and compiled for Blackwell on a CPU.

Nothing runs on a GPU. TE's libraries load through a stand-in ``libcuda.so.1`` (``libcuda_standin.sh``) with the
pip CUDA wheels on the library path (``source scripts/te_env.sh``); TE's trace-time device queries are answered as
a B200's (:mod:`maxtext_nvfp4.backends.te_compile_only`); the devices are compile-only B200s
(:mod:`maxtext_nvfp4.backends.targets`). What is checked is what TE traces and XLA compiles -- the custom calls and
their configuration, partitioning, what TE refuses -- never a number TE's kernels would compute.

Skipped where TE JAX does not import (the core suite ignores this folder); ``MAXTEXT_NVFP4_REQUIRE_TE=1`` (the
stage) turns that skip into a failure.
"""

import os

import pytest

from maxtext_nvfp4.backends import capability

_REQUIRED = os.environ.get("MAXTEXT_NVFP4_REQUIRE_TE") == "1"
_REASON = None if capability.te_version() else "Transformer Engine is not installed"
if _REASON is None:
  _REASON = capability.te_unavailable_reason()
  if _REASON:
    _REASON = f"transformer_engine.jax does not import ({_REASON}); run: source scripts/te_env.sh"


def pytest_collection_modifyitems(config, items):
  del config
  here = os.path.dirname(os.path.abspath(__file__))
  for item in items:
    if not str(item.fspath).startswith(here) or _REASON is None:
      continue
    if not _REQUIRED:
      item.add_marker(pytest.mark.skip(reason=_REASON))


@pytest.fixture(scope="session", autouse=True)
def b200_answers():
  """TE's trace-time device queries answered as a B200's for the whole session."""
  if _REASON is not None:
    if _REQUIRED:
      pytest.fail(f"te stage (MAXTEXT_NVFP4_REQUIRE_TE=1): {_REASON}")
    yield None
    return
  from maxtext_nvfp4.backends import targets, te_compile_only  # pylint: disable=import-outside-toplevel

  te_compile_only.answer_device_queries(targets.compute_capability("b200"))
  yield targets
  te_compile_only.restore()
