"""The peer oracles need ./.peers/ (scripts/setup_peers.sh). Without it this folder is skipped, unless
MAXTEXT_NVFP4_REQUIRE_PEERS=1 (the peers stage of scripts/test.sh): then every test here fails instead."""

import os

import pytest

import peer_support

collect_ignore = ["peer_side"]  # scripts for the peer python (torch), not tests

_REQUIRED = os.environ.get("MAXTEXT_NVFP4_REQUIRE_PEERS") == "1"
_HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
  if peer_support.peers_built() or _REQUIRED:
    return
  why = f"peer env {peer_support.PEERS} not built (scripts/setup_peers.sh; MAXTEXT_NVFP4_REQUIRE_PEERS=1 makes this fail)"
  for item in items:
    if str(item.path).startswith(_HERE):
      item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(autouse=True, scope="module")
def _require_peers():
  if not peer_support.peers_built():
    pytest.fail(f"MAXTEXT_NVFP4_REQUIRE_PEERS=1 but the peer env {peer_support.PEERS} is not built: run "
                "scripts/setup_peers.sh", pytrace=False)
