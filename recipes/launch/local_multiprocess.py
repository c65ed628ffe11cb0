#!/usr/bin/env python3
"""Start N copies of a training command on this machine as one JAX distributed job (no torchrun).

    python recipes/launch/local_multiprocess.py -n 2 --cpu-devices 4 -- \
        python -m maxtext_nvfp4.train recipes/demo_nvfp4.yml hardware=gpu_multiprocess

How the children find each other: MaxText's ``hardware=gpu_multiprocess`` calls
``jax.distributed.initialize()`` with no arguments, which auto-detects a SLURM step. This launcher
presents each child as task ``i`` of a one-node SLURM step (``SLURM_NTASKS=N``, ``SLURM_PROCID=i``,
``SLURM_LOCALID=i``, ...) and pins the coordinator with ``JAX_COORDINATOR_ADDRESS=127.0.0.1:PORT`` (JAX
reads it before any SLURM-derived address). So the children take exactly the code path they take under
``srun`` on a cluster (recipes/launch/slurm_nvfp4.sbatch). On GPUs, ``SLURM_LOCALID=i`` makes JAX show
process ``i`` only GPU ``i`` (one process per GPU). With ``--cpu-devices K`` each child instead gets
``K`` host-platform CPU devices (``--xla_force_host_platform_device_count=K``, ``JAX_PLATFORMS=cpu``);
cross-process CPU collectives use JAX's default gloo implementation.

Output: each child's stdout/stderr lines are prefixed with ``[rank i]`` (and also written to
``--log-dir/rank_i.log`` if given). The launcher exits with the first non-zero child exit code (the
other children are then terminated), or 0 when all succeed.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
  """A TCP port that was free a moment ago on 127.0.0.1 (the coordinator binds it shortly after)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env(base: dict[str, str], *, rank: int, nproc: int, port: int, cpu_devices: int | None) -> dict[str, str]:
  """Environment of child ``rank``: a one-node SLURM step of ``nproc`` tasks plus the coordinator address."""
  env = dict(base)
  # Drop any outer SLURM step description so that only ours is seen (e.g. when run inside salloc).
  for k in list(env):
    if k.startswith("SLURM_"):
      del env[k]
  env.update({
      "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
      "SLURM_JOB_ID": str(port),  # only used by JAX to derive a port; ours is explicit above
      "SLURM_STEP_NODELIST": "localhost",
      "SLURM_NTASKS": str(nproc),
      "SLURM_PROCID": str(rank),
      "SLURM_LOCALID": str(rank),
      "SLURM_STEP_NUM_NODES": "1",
  })
  if cpu_devices:
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={cpu_devices}"])
    env["JAX_PLATFORMS"] = "cpu"
  return env


def _die_with_parent() -> None:
  """Linux: SIGTERM this child when the launcher dies, even by SIGKILL (no orphaned ranks blocking a port)."""
  try:
    import ctypes  # pylint: disable=import-outside-toplevel
    import signal  # pylint: disable=import-outside-toplevel

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):
    pass


def _pump(rank: int, stream, log) -> None:
  for line in iter(stream.readline, ""):
    sys.stdout.write(f"[rank {rank}] {line}")
    sys.stdout.flush()
    if log:
      log.write(line)
      log.flush()


def launch(cmd: list[str], *, nproc: int, cpu_devices: int | None = None, port: int | None = None,
           log_dir: str | None = None, timeout: float | None = None) -> int:
  """Run ``cmd`` as ``nproc`` processes; return the first non-zero exit code, else 0."""
  port = port or free_port()
  if log_dir:
    os.makedirs(log_dir, exist_ok=True)
  procs, threads, logs = [], [], []
  for rank in range(nproc):
    log = open(os.path.join(log_dir, f"rank_{rank}.log"), "w", encoding="utf-8") if log_dir else None
    logs.append(log)
    p = subprocess.Popen(cmd, env=child_env(os.environ, rank=rank, nproc=nproc, port=port, cpu_devices=cpu_devices),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                         preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    procs.append(p)
    t = threading.Thread(target=_pump, args=(rank, p.stdout, log), daemon=True)
    t.start()
    threads.append(t)
  import signal  # pylint: disable=import-outside-toplevel

  def _on_term(signum, frame):  # pylint: disable=unused-argument
    raise SystemExit(128 + signum)

  if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, _on_term)
  deadline = None if timeout is None else time.monotonic() + timeout
  rc = 0
  try:
    while any(p.poll() is None for p in procs):
      failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
      if failed or (deadline is not None and time.monotonic() > deadline):
        rc = failed[0] if failed else 124
        break
      time.sleep(0.2)
    else:
      rc = next((p.returncode for p in procs if p.returncode), 0)
  finally:
    # A failed rank leaves the others blocked in a collective forever: stop them (only our own children).
    for p in procs:
      if p.poll() is None:
        p.terminate()
    for p in procs:
      try:
        p.wait(timeout=10)
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
    for t in threads:
      t.join(timeout=5)
    for log in logs:
      if log:
        log.close()
  return rc


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if "--" not in argv:
    print("usage: local_multiprocess.py [-n N] [--cpu-devices K] [--port P] [--log-dir DIR] -- COMMAND...",
          file=sys.stderr)
    return 2
  split = argv.index("--")
  ap = argparse.ArgumentParser(prog="local_multiprocess.py")
  ap.add_argument("-n", "--nproc", type=int, default=2, help="number of processes (e.g. one per GPU)")
  ap.add_argument("--cpu-devices", type=int, default=None, help="CPU only: host devices per process")
  ap.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
  ap.add_argument("--log-dir", default=None, help="also write rank_<i>.log files here")
  ap.add_argument("--timeout", type=float, default=None, help="stop all processes after this many seconds")
  args = ap.parse_args(argv[:split])
  cmd = argv[split + 1:]
  if not cmd or args.nproc < 1:
    print("local_multiprocess.py: need a COMMAND after -- and -n >= 1", file=sys.stderr)
    return 2
  return launch(cmd, nproc=args.nproc, cpu_devices=args.cpu_devices, port=args.port, log_dir=args.log_dir,
                timeout=args.timeout)


if __name__ == "__main__":
  sys.exit(main())
