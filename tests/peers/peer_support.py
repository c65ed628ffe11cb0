"""Main-side helpers of the peer oracles: where the peer env is, and how to run a peer-side script in it.

The main suite never imports torch: each oracle writes its inputs to a file (npz / safetensors), runs a
script of ``tests/peers/peer_side/`` with ``.peers/venv/bin/python`` (built by ``scripts/setup_peers.sh``)
and reads the peer's answers back from a file.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
PEERS = pathlib.Path(os.environ.get("MAXTEXT_NVFP4_PEERS", REPO / ".peers"))
PEER_SIDE = pathlib.Path(__file__).resolve().parent / "peer_side"
PEER_PYTHON = PEERS / "venv" / "bin" / "python"


def peers_built() -> bool:
  """True when setup_peers.sh finished (its stamp exists)."""
  return (PEERS / ".built").is_file() and PEER_PYTHON.is_file()


def run_peer(script: str, *args, timeout: float = 600) -> str:
  """Run ``peer_side/<script> *args`` in the peer python; returns its stdout, raises with its stderr."""
  env = dict(os.environ, MAXTEXT_NVFP4_PEERS=str(PEERS), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
  env.pop("PYTHONPATH", None)
  env.pop("PYTHONDONTWRITEBYTECODE", None)  # any value, "0" too, disables .pyc writing: each peer import compiled again
  proc = subprocess.run([str(PEER_PYTHON), str(PEER_SIDE / script), *map(str, args)], capture_output=True,
                        text=True, timeout=timeout, env=env, check=False)
  if proc.returncode:
    sys.stderr.write(proc.stderr[-4000:])
    raise RuntimeError(f"peer script {script} failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
  return proc.stdout
