"""Micro-benchmark of the NVFP4 quantizer: throughput in GB/s of (bf16) input.

Times ``maxtext_nvfp4.core.nvfp4.quantize`` -- 1D (1x16 along the last axis), 2D (16x16) and RHT (1x16
along axis 0 after the 16-point RHT, the wgrad path) -- and a plain elementwise copy (``-x``: reads and
writes every element once) of the same array, in the same process on the same device, so the ratio
quantize/copy is meaningful on any machine. Every function is jitted and compiled before timing;
the modes then run round robin ``--iters`` times (each ``block_until_ready``); the table gives the best
and the median time. GB/s and the copy ratio use the best time (least disturbed by other load).

    python benchmarks/quantize_bench.py                       # Llama-3-8B shapes, default device
    python benchmarks/quantize_bench.py --shapes 2048x4096 --iters 5 --modes copy,1d

GB/s = M * N * bytes(dtype) / best time (input bytes only; the copy also writes as many bytes).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

# Allow `python benchmarks/quantize_bench.py` from a checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxtext_nvfp4.core import nvfp4 as nv  # pylint: disable=wrong-import-position

MODES = {
    "copy": lambda x: -x,
    "1d": lambda x: nv.quantize(x, axis=-1),
    "2d": lambda x: nv.quantize(x, block_2d=True),
    "rht": lambda x: nv.quantize(x, axis=0, rht=True),
}


def _parse_shape(s: str) -> tuple[int, int]:
  m, n = s.lower().split("x")
  return int(m), int(n)


def _time_round_robin(fns: dict, x, iters: int, warmup: int) -> dict[str, list[float]]:
  """Wall times (s) of each ``fn(x)``, compiled first, then run in turn ``iters`` times (round robin, so
  that load from other processes hits every mode alike)."""
  for fn in fns.values():
    jax.block_until_ready(fn(x))  # compile
    for _ in range(warmup):
      jax.block_until_ready(fn(x))
  times = {k: [] for k in fns}
  for _ in range(iters):
    for k, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(x))
      times[k].append(time.perf_counter() - t0)
  return times


def run(shapes, modes, iters: int, warmup: int, dtype) -> list[dict]:
  rows = []
  for shape in shapes:
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dtype)
    nbytes = x.size * x.dtype.itemsize
    times = _time_round_robin({m: jax.jit(MODES[m]) for m in modes}, x, iters, warmup)
    copy_best = min(times["copy"]) if "copy" in times else None
    for mode in modes:
      best, med = min(times[mode]), statistics.median(times[mode])
      rows.append(dict(shape=f"{shape[0]}x{shape[1]}", mode=mode, ms_min=best * 1e3, ms_med=med * 1e3,
                       gbs=nbytes / best / 1e9, vs_copy=(copy_best / best) if copy_best else None))
    del x
  return rows


def format_table(rows) -> str:
  lines = ["| shape | mode | best ms | median ms | GB/s (input, best) | % of copy (best) |",
           "|---|---|---:|---:|---:|---:|"]
  for r in rows:
    pct = f"{100 * r['vs_copy']:.1f}%" if r["vs_copy"] is not None else "-"
    lines.append(f"| {r['shape']} | {r['mode']} | {r['ms_min']:.2f} | {r['ms_med']:.2f} | {r['gbs']:.3f} | {pct} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", default="8192x4096,8192x14336", help="comma-separated MxN list")
  p.add_argument("--modes", default="copy,1d,2d,rht", help="comma-separated subset of copy,1d,2d,rht "
                 "(the %% column needs copy)")
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  a = p.parse_args(argv)
  shapes = [_parse_shape(s) for s in a.shapes.split(",") if s]
  modes = [m for m in a.modes.split(",") if m]
  bad = [m for m in modes if m not in MODES]
  if bad:
    p.error(f"unknown modes {bad}; choose from {sorted(MODES)}")
  dev = jax.devices()[0]
  print(f"# device: {dev.platform} {getattr(dev, 'device_kind', '')} | jax {jax.__version__} | "
        f"python {platform.python_version()} | dtype {a.dtype} | iters {a.iters} warmup {a.warmup}")
  rows = run(shapes, modes, a.iters, a.warmup, jnp.dtype(a.dtype))
  print(format_table(rows))
  return 0


if __name__ == "__main__":
  sys.exit(main())
