"""Where the device time goes: per-kernel times of the MLP under the profiler, and the quantizer kernels' tiles.

Two parts, both printed as tables and written to ``--json``:

``profile``  ``mlp_bench``'s SwiGLU MLP forward+backward (bf16 and nvfp4, ``--preset``), ``--iters`` calls
             under ``jax.profiler``; the device plane's kernel events are summed per kernel name and per
             class: ``gemm`` (cuBLAS / CUTLASS / XLA's Triton GEMM fusions), ``pallas`` (our Triton
             kernels, named ``nvfp4_*``), ``other`` (XLA's fusions, copies). Time per call = total / iters.
``tiles``    each of the Pallas quantizer kernels' programs (1x16 values with SR, RHT values with SR, the
             RHT codes of x, W's 16x16 tiles) at the MLP's shapes, once per tile choice
             (``core/quantizer/triton_kernels.py``'s ``_MAX_*`` constants, set before tracing); each choice's
             output is checked bit for bit against the first choice's before it is timed (best and median of
             ``--iters``).

    python benchmarks/gpu/kernel_profile.py --json out.json              # H200: both parts
    python benchmarks/gpu/kernel_profile.py --preset tiny --parts tiles  # CPU: proves the script

On CPU the quantizers take their XLA form (the kernels run on XLA:GPU only), so the tile choices change nothing
there and the times mean nothing; the profile has no device plane (the host's events are listed instead). Exit
status 1 when a tile choice changes any output bit.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import os
import re
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import mlp_bench  # noqa: E402  pylint: disable=wrong-import-position
import quantize_bench  # noqa: E402  pylint: disable=wrong-import-position

from maxtext_nvfp4.core import nvfp4, prng  # noqa: E402  pylint: disable=wrong-import-position
from maxtext_nvfp4.core.quantizer import triton_kernels  # noqa: E402  pylint: disable=wrong-import-position

# cuBLAS / CUTLASS kernel names and XLA's Triton GEMM fusions (gemm_fusion_*, triton_gemm_*)
_GEMM = re.compile(r"gemm|xmma|cutlass|cublas|nvjet|wgmma|sm90_|sm80_", re.I)


def kernel_class(name: str) -> str:
  if "nvfp4_" in name:  # our Pallas kernels' names (nvfp4_values_*, nvfp4_codes_*, nvfp4_rht_amax)
    return "pallas"
  return "gemm" if _GEMM.search(name) else "other"


def _device_events(logdir: str):
  """(plane name, [(kernel name, duration ns)]) of the first GPU plane in the newest trace under ``logdir``;
  without one (CPU), the host plane's XLA op events."""
  files = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
  if not files:
    return None, []
  data = jax.profiler.ProfileData.from_file(files[-1])
  planes = list(data.planes)
  gpu = [p for p in planes if p.name.startswith("/device:GPU")]
  plane = gpu[0] if gpu else next((p for p in planes if p.name.startswith("/host:CPU")), None)
  if plane is None:
    return None, []
  events = []
  for line in plane.lines:
    # GPU: one line per stream (kernels, memcpys); derived lines (XLA Modules / Ops / Steps) are skipped so
    # that nothing counts twice.
    if gpu and not line.name.startswith("Stream"):
      continue
    events += [(e.name, e.duration_ns) for e in line.events]
  return plane.name, events


def profile(variant: str, inp, iters: int) -> dict:
  fn, args = mlp_bench.build(variant, "fwdbwd", inp)
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  with tempfile.TemporaryDirectory() as logdir:
    jax.profiler.start_trace(logdir)
    try:
      for _ in range(iters):
        jax.block_until_ready(fn(*args))
    finally:
      jax.profiler.stop_trace()
    plane, events = _device_events(logdir)
  per_name = collections.defaultdict(lambda: [0, 0])
  for name, ns in events:
    per_name[name][0] += ns
    per_name[name][1] += 1
  kernels = sorted(((n, t / iters / 1e3, c / iters, kernel_class(n)) for n, (t, c) in per_name.items()),
                   key=lambda r: -r[1])
  by_class = collections.Counter()
  for _, us, _, cls in kernels:
    by_class[cls] += us
  return dict(variant=variant, plane=plane, iters=iters, total_us=sum(by_class.values()), by_class=dict(by_class),
              kernels=[dict(name=n, us=us, calls=c, cls=cls) for n, us, c, cls in kernels])


def profile_table(results: list[dict], top: int) -> str:
  lines = ["| variant | plane | device us/call | gemm | pallas | other |", "|---|---|---:|---:|---:|---:|"]
  for r in results:
    c = r["by_class"]
    lines.append(f"| {r['variant']} | {r['plane']} | {r['total_us']:.0f} | {c.get('gemm', 0):.0f} | "
                 f"{c.get('pallas', 0):.0f} | {c.get('other', 0):.0f} |")
  for r in results:
    lines += ["", f"{r['variant']}: top {top} kernels (us per MLP call, launches per call, class)",
              "| us | launches | class | kernel |", "|---:|---:|---|---|"]
    lines += [f"| {k['us']:.1f} | {k['calls']:g} | {k['cls']} | {k['name'][:90]} |" for k in r["kernels"][:top]]
  return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Tiles
# ----------------------------------------------------------------------------------------------
# name -> (program (operand) -> outputs, its operand, the constants it depends on and the choices to try). The
# operand is an argument: captured, a 235 MB array became a constant of the program (25 s compiles on the H200).
def _programs(t: int, d: int, f: int):
  k = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(k[0], (t, d), jnp.bfloat16)
  dy = jax.random.normal(k[1], (t, f), jnp.bfloat16)
  w = jax.random.normal(k[2], (d, f), jnp.bfloat16)
  key = prng.fold_in(jax.random.key(7), 2)
  rht_cols = dict(_MAX_RHT_COLS=(64, 128, 256))
  return {
      # wgrad's dy, RHT along T, SR
      "values_rht_sr": (lambda a: nvfp4.quantize_values(a, axis=0, rht=True, stochastic_key=key), dy, rht_cols),
      # wgrad's x, RHT along T, RNE codes
      "codes_rht": (lambda a: nvfp4.quantize(a, axis=0, rht=True), x, rht_cols),
      # dgrad's dy, 1x16 along F, SR
      "values_rows_sr": (lambda a: nvfp4.quantize_values(a, axis=-1, stochastic_key=key), dy,
                         dict(_MAX_ROWS=(16, 32, 64), _MAX_BLOCKS=(16, 8, 4))),
      # W's 16x16 tiles
      "tiles_2d": (lambda a: nvfp4.quantize(a, block_2d=True), w, dict(_MAX_TILES=(8, 16, 32))),
  }


@contextlib.contextmanager
def _constants(values: dict):
  old = {n: getattr(triton_kernels, n) for n in values}
  for n, v in values.items():
    setattr(triton_kernels, n, v)
  try:
    yield
  finally:
    for n, v in old.items():
      setattr(triton_kernels, n, v)


def _same_bits(a, b) -> bool:
  la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
  return len(la) == len(lb) and all(
      x.shape == y.shape and x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
      for x, y in zip(la, lb))


def tiles(t: int, d: int, f: int, iters: int, names) -> list[dict]:
  rows = []
  for name, (build, operand, choices) in _programs(t, d, f).items():
    if names and name not in names:
      continue
    n_choices = len(next(iter(choices.values())))
    ref = None
    for i in range(n_choices):
      values = {c: v[i] for c, v in choices.items()}
      label = ",".join(f"{c.strip('_').lower()}={v}" for c, v in values.items())
      row = dict(program=name, tiles=label)
      with _constants(values):
        jax.clear_caches()  # the jitted quantizers cache their traces: retrace under these constants
        fn = jax.jit(build)
        try:
          t0 = time.perf_counter()
          out = jax.block_until_ready(fn(operand))
          row["compile_s"] = time.perf_counter() - t0
          ref = out if ref is None else ref
          row["same_bits"] = _same_bits(out, ref)
          ts = sorted(quantize_bench._time_round_robin({name: fn}, operand, iters, warmup=0)[name])
          row.update(best_ms=1e3 * ts[0], median_ms=1e3 * statistics.median(ts))
        except Exception as e:  # pylint: disable=broad-except
          row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
      print(json.dumps(row), flush=True)
      rows.append(row)
  return rows


def tiles_table(rows: list[dict]) -> str:
  lines = ["| program | tiles | compile s | same bits | best ms | median ms |", "|---|---|---:|---|---:|---:|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['program']} | {r['tiles']} | | | {r['error']} | |")
    else:
      lines.append(f"| {r['program']} | {r['tiles']} | {r['compile_s']:.1f} | {r['same_bits']} | "
                   f"{r['best_ms']:.3f} | {r['median_ms']:.3f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", choices=sorted(mlp_bench.PRESETS), default="h200")
  p.add_argument("--parts", default="profile,tiles", help="comma list of profile, tiles")
  p.add_argument("--variants", default="bf16,nvfp4", help="profile: mlp_bench variants")
  p.add_argument("--programs", default="", help="tiles: comma list of programs (default all)")
  p.add_argument("--iters", type=int, default=5)
  p.add_argument("--top", type=int, default=25)
  p.add_argument("--json")
  a = p.parse_args(argv)
  t, d, f = mlp_bench.PRESETS[a.preset]
  parts = a.parts.split(",")
  out = dict(preset=a.preset, shape=[t, d, f], backend=jax.default_backend(), jax=jax.__version__)
  print(f"# kernel_profile: preset {a.preset} (T, D, F) = {(t, d, f)} on {jax.devices()[0].device_kind}", flush=True)
  rc = 0
  if "profile" in parts:
    inp = mlp_bench.make_inputs(t, d, f)
    out["profile"] = [profile(v, inp, a.iters) for v in a.variants.split(",")]
    print(profile_table(out["profile"], a.top), flush=True)
  if "tiles" in parts:
    out["tiles"] = tiles(t, d, f, a.iters, [n for n in a.programs.split(",") if n])
    print(tiles_table(out["tiles"]), flush=True)
    rc = int(any(not r.get("same_bits", True) for r in out["tiles"]))
  if a.json:
    with open(a.json, "w", encoding="utf-8") as fh:
      json.dump(out, fh, indent=1)
  return rc


if __name__ == "__main__":
  sys.exit(main())
