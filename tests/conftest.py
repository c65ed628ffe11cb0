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


# Test files by measured cost, heaviest first (CPU seconds per file, cold compilation cache, 2026-12-02: 162 s
# down to 42 s; every other file takes under 40 s). `--dist loadfile` hands out whole files in collection order,
# so starting the longest ones first keeps both workers busy to the end instead of one long file running
# alone at the tail (longest-processing-time-first scheduling). Order only: every test still runs.
_HEAVY_FIRST = (
    "test_serving_oracles.py", "test_te_reference_oracle.py",  # the peers stage's two long files
    "test_moe_sparse.py", "test_reliability_checkpoint.py", "test_gemm.py", "test_gemm_sharding.py",
    "test_model_families.py", "test_diagnostics.py", "test_reliability_nonfinite.py", "test_reproduce.py",
    "test_patching.py", "test_numerics.py", "test_export_families.py", "test_moe.py", "test_selective_precision.py",
    "test_export.py", "test_train_e2e.py", "test_recipes.py",
)


# Last: its two ranks rendezvous through gloo, which gives up after a fixed 30 s; under the other worker's
# load their compiles drift apart (seen: first in the queue, it kept a worker ~10 min). At the end of the queue
# it shares the machine with at most one shorter file.
_LAST = ("test_distributed.py",)


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(_HEAVY_FIRST)}
  rank.update({name: len(_HEAVY_FIRST) + 1 + i for i, name in enumerate(_LAST)})
  # A stable sort on the file's rank keeps each file's own order (and files not listed, alphabetically, after).
  items.sort(key=lambda item: rank.get(item.path.name, len(_HEAVY_FIRST)))
