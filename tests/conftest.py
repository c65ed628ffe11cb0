import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _restore_jax_prng_impl():
  """MaxText's train.initialize sets jax_default_prng_impl=unsafe_rbg process-wide; an in-process
  training test (often in a module-scoped fixture) must not change the PRNG of later test modules."""
  import jax  # pylint: disable=import-outside-toplevel

  before = jax.config.jax_default_prng_impl
  yield
  if jax.config.jax_default_prng_impl != before:
    jax.config.update("jax_default_prng_impl", before)
