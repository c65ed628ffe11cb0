import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# One persistent XLA compilation cache inside the checkout (ignored by git), shared by the in-process
# tests, every subprocess they start, and MaxText (whose own default is ~/jax_cache, set through its
# jax_cache_dir key; M_* environment variables override MaxText keys). The suite compiles the same tiny
# models in many processes; each later compile is a cache read.
_JAX_CACHE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "jax")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _JAX_CACHE)
os.environ.setdefault("M_JAX_CACHE_DIR", os.environ["JAX_COMPILATION_CACHE_DIR"])

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
