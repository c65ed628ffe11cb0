"""The Mosaic TPU quantizer kernels (implementation "mosaic_tpu") compile for a TPU v5e, on this CPU (no TPU).

``test_quantizer_implementations.py`` checks their bits through Pallas's interpreter; this file checks that Mosaic
itself takes them (an op it cannot legalize fails here, not on a user's TPU) and what XLA:TPU makes of the calls
around them, compile-derived (``benchmarks/gpu/deviceless.py``'s accounting on one compile-only v5e chip of
``benchmarks/compile_targets.py``): one program with every kernel layout -- 1x16 codes of x (ROWS), 16x16 codes of
W (TILES_2D), RHT values with stochastic rounding along axis 0 (COLS_RHT and the RHT amax kernel) and 1x16 values
along axis 0 (COLS) -- the automatic dispatch choosing the kernels, no full-size 32-bit temporary, the 4-bit data
and E4M3 scales kept narrow, and the non-GEMM bytes within the bound measured at the commit that set it
(``benchmarks/RESULTS.md``, "mosaic_tpu") plus slack.

With them (no libtpu needed, but a child process with four CPU devices, so here rather than in the core suite):
the kernels on an operand sharded over a 2x2 mesh, through the interpreter, give the XLA form's bits.

A stage of its own (skipped unless MAXTEXT_NVFP4_TARGET_COMPILE_TESTS=1), in the environment with ``libtpu`` at
jax's pin (``.venv-targets``); one compile and one child process, about 30 s of CPU.
"""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT / "benchmarks" / "gpu"))
sys.path.insert(0, str(_ROOT / "benchmarks"))

_STAGE_VAR = "MAXTEXT_NVFP4_TARGET_COMPILE_TESTS"
pytestmark = [
    pytest.mark.skipif(os.environ.get(_STAGE_VAR) != "1",
                       reason=f"compiles for a TPU (libtpu): run in the targets stage with {_STAGE_VAR}=1"),
    pytest.mark.skipif(jax.__version__ != "0.12.0.1",
                       reason=f"the bounds are XLA:TPU's at jax 0.12.0.1 (this is {jax.__version__})"),
]

_M, _K = 2048, 1024  # x (M, K) and W (K, K) bf16: tiles of every layout, a grid of several steps each


def _libtpu_version():
  try:
    return importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    return None


@pytest.fixture(scope="module")
def compiled():
  compile_targets = pytest.importorskip("compile_targets")
  deviceless = pytest.importorskip("deviceless")
  reason = compile_targets.unavailable_reason("tpu-v5e")
  if reason is None and not (_libtpu_version() or "").startswith("0.0.50"):
    reason = f"the bounds are libtpu 0.0.50's (this is {_libtpu_version()})"
  if reason:
    pytest.skip(f"tpu-v5e: {reason}")
  from maxtext_nvfp4.core import nvfp4 as nv  # pylint: disable=import-outside-toplevel

  def program(x, w, key):
    return (nv.quantize(x), nv.quantize(w, block_2d=True),
            nv.quantize_values(x, axis=0, rht=True, stochastic_key=key), nv.quantize_values(x, axis=0))

  args = (jax.ShapeDtypeStruct((_M, _K), jnp.bfloat16), jax.ShapeDtypeStruct((_K, _K), jnp.bfloat16),
          jax.random.key(0))
  return deviceless.analyze(program, args, n_elements=_M * _K, spec="tpu-v5e")


def test_every_kernel_layout_compiles_for_v5e(compiled):
  hlo = compiled["hlo"]
  names = ("nvfp4_codes_rows", "nvfp4_codes_tiles_2d", "nvfp4_values_cols_rht_sr", "nvfp4_rht_amax",
           "nvfp4_values_cols")
  missing = [n for n in names if f"{n}" not in hlo]
  assert not missing and hlo.count('custom_call_target="tpu_custom_call"') == 5, missing


def test_no_full_size_32_bit_temporaries_and_narrow_outputs(compiled):
  """XLA's forms wrote full-size f32/u32/pred temporaries on a TPU (issue 47); the kernels keep them in VMEM."""
  summary = {k: compiled[k] for k in ("f32_temps", "full_writes", "bytes_per_element", "temp_mib", "other_kernels",
                                      "largest_temps")}
  assert compiled["f32_temps"] == 0, summary
  outputs = compiled["hlo"].splitlines()[0].split("->", 1)[1]
  assert f"f4e2m1fn[{_M},{_K}]" in outputs and f"f8e4m3fn[{_M},{_K // 16}]" in outputs, outputs[:300]
  assert f"f4e2m1fn[{_K},{_K}]" in outputs and f"f8e4m3fn[{_K // 16},{_K // 16}]" in outputs, outputs[:300]
  # bytes per element of x: four calls on x and one on W (half x's size), each an amax pass and the kernel's,
  # plus XLA's prefetches into VMEM (S(1)) counted as copies (an upper bound of HBM traffic)
  assert compiled["bytes_per_element"] <= _BOUNDS["bytes_per_element"], summary
  assert compiled["temp_mib"] <= _BOUNDS["temp_mib"], summary


# Measured 2026-12-05 (h6-tpu, jax 0.12.0.1, libtpu 0.0.50.1): 26.57 B/element, 0.2 MiB of temporaries (22 non-GEMM
# kernels, 9 full-size writes); the XLA forms of the same calls wrote hundreds of MiB of f32 temporaries.
_BOUNDS = dict(bytes_per_element=28.0, temp_mib=1.0)


_MOSAIC_SHARDED = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from maxtext_nvfp4.core import nvfp4 as nv
from maxtext_nvfp4.core.quantizer import pallas_mosaic_tpu as pm
pm._ROWS_TILE = pm._COLS_TILE = pm._TILES_TILE = ((16,), (32,))  # several tiles per shard
assert jax.device_count() == 4, jax.devices()
mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((128, 256)) * np.exp2(rng.integers(-10, 10, (128, 1))), jnp.bfloat16)
key = jax.random.key(3)
for layout, kw, spec in [(pm.ROWS, {}, P("a", "b")), (pm.COLS_RHT, dict(axis=0, rht=True), P(None, ("a", "b"))),
                         (pm.COLS_RHT, dict(axis=0, rht=True), P(("b", "a"), None))]:
  f = jax.jit(lambda x, k: pm.quantize_values(x, jnp.bfloat16, layout, k, interpret=True))
  xs = jax.device_put(x, NamedSharding(mesh, spec))
  got, amax = f(xs, key)
  want, want_amax = nv.quantize_values(x, stochastic_key=key, implementation="xla", **kw)
  assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16)), (layout, spec)
  assert np.asarray(amax) == np.asarray(want_amax), (layout, spec)
  assert "all-gather" not in f.lower(xs, key).compile().as_text(), (layout, spec)
g = jax.jit(lambda x: pm.quantize(x, pm.TILES_2D, interpret=True))
xs = jax.device_put(x, NamedSharding(mesh, P("a", "b")))
t, w = g(xs), nv.quantize(x, block_2d=True, implementation="xla")
assert np.array_equal(np.asarray(nv.pack(t.data)), np.asarray(nv.pack(w.data)))
assert np.array_equal(np.asarray(t.scale, np.float32), np.asarray(w.scale, np.float32))
gathered = [l for l in g.lower(xs).compile().as_text().splitlines() if "all-gather(" in l]
assert all("bf16" not in l and "f32" not in l for l in gathered), gathered  # the E4M3 scales at most
print("ok")
"""


def test_mosaic_kernels_on_a_sharded_operand_quantize_each_shard_with_global_bits():
  """Over a 2x2 mesh of CPU devices (a child process): each device's kernel takes its shard, with the whole
  operand's amax (the RHT's group maxima reduced across devices) and the SR bits of its global positions; no
  operand is gathered (quantize's E4M3 scales are: their sharding rule does not carry the column axis)."""
  env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4",
             JAX_PLATFORMS="cpu")
  r = subprocess.run([sys.executable, "-c", _MOSAIC_SHARDED], env=env, capture_output=True, text=True, timeout=600,
                     check=False)
  assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
