"""Micro-benchmark of the NVFP4 quantizer: throughput in GB/s of (bf16) input.

Times ``maxtext_nvfp4.numerics.quantize`` -- 1D (1x16 along the last axis), 2D (16x16) and RHT (1x16
along axis 0 after the 16-point RHT, the wgrad path) -- and a plain elementwise copy (``-x``: reads and
writes every element once) of the same array, in the same process on the same device, so the ratio
quantize/copy is meaningful on any machine. Every function is jitted and compiled before timing;
the reported time is the median over ``--iters`` runs (each ``block_until_ready``).

    python benchmarks/quantize_bench.py                       # Llama-3-8B shapes, default device
    python benchmarks/quantize_bench.py --shapes 2048x4096 --iters 5 --modes copy,1d

GB/s = M * N * bytes(dtype) / median time (input bytes only; the copy also writes as many bytes).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from maxtext_nvfp4 import numerics as nv

MODES = {
    "copy": lambda x: -x,
    "1d": lambda x: nv.quantize(x, axis=-1),
    "2d": lambda x: nv.quantize(x, block_2d=True),
    "rht": lambda x: nv.quantize(x, axis=0, rht=True),
}


def _parse_shape(s: str) -> tuple[int, int]:
  m, n = s.lower().split("x")
  return int(m), int(n)


def _time(fn, x, iters: int, warmup: int) -> float:
  """Median wall time (s) of ``fn(x)`` after compilation and ``warmup`` runs."""
  jax.block_until_ready(fn(x))  # compile
  for _ in range(warmup):
    jax.block_until_ready(fn(x))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(x))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def run(shapes, modes, iters: int, warmup: int, dtype) -> list[dict]:
  rows = []
  for shape in shapes:
    x = jax.random.normal(jax.random.key(0), shape, jnp.float32).astype(dtype)
    nbytes = x.size * x.dtype.itemsize
    copy_gbs = None
    for mode in modes:
      t = _time(jax.jit(MODES[mode]), x, iters, warmup)
      gbs = nbytes / t / 1e9
      if mode == "copy":
        copy_gbs = gbs
      rows.append(dict(shape=f"{shape[0]}x{shape[1]}", mode=mode, ms=t * 1e3, gbs=gbs,
                       vs_copy=(gbs / copy_gbs) if copy_gbs else None))
    del x
  return rows


def format_table(rows) -> str:
  lines = ["| shape | mode | median ms | GB/s (input) | % of copy |", "|---|---|---:|---:|---:|"]
  for r in rows:
    pct = f"{100 * r['vs_copy']:.1f}%" if r["vs_copy"] is not None else "-"
    lines.append(f"| {r['shape']} | {r['mode']} | {r['ms']:.2f} | {r['gbs']:.3f} | {pct} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--shapes", default="8192x4096,8192x14336", help="comma-separated MxN list")
  p.add_argument("--modes", default="copy,1d,2d,rht", help="comma-separated subset of copy,1d,2d,rht "
                 "(put copy first: the %% column is relative to it)")
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
