"""Compile-derived counts pinned for one Ampere GPU (A100, sm_80) and one TPU (v5e), compiled on this CPU.

``benchmarks/target_matrix.py`` compiles the quantizer calls, the MLP and MaxText's step for every target of
``benchmarks/compile_targets.py``; this file pins a cheap subset of its rows for two targets the H200 pins
(``test_gpu_compile_bytes.py``) do not cover, so a change that makes them worse fails here:

    a100     XLA:GPU for sm_80 (XLA's own spec, vendored): the Pallas (Triton) quantizer kernels compile for
             Ampere, and the SwiGLU MLP's bytes and memory against bf16
    tpu-v5e  XLA:TPU (libtpu at jax's pin, one compile-only v5e chip): the quantizer calls compile with no op
             refused, the 4-bit and E4M3 outputs stay 4 and 8 bits wide, and the bytes and temporaries of the
             XLA forms (shaped for XLA:GPU's fusion; issue 47 item 2 is to reshape them for TPU tiles)

Bounds, not equalities: each is the value measured at the commit that set it (benchmarks/RESULTS.md,
"Target matrix") plus a small slack, so an improvement passes (then lower the bound). The TPU's byte count is
checked first on a program with a known answer (a copy), and its GEMMs on the bf16 MLP (9 fusions around a
convolution), so the accounting itself can fail. The counts are XLA's at jax 0.12.0.1 and libtpu 0.0.50.

A stage of its own (skipped unless MAXTEXT_NVFP4_TARGET_COMPILE_TESTS=1), in an environment with
``jax-cuda12-plugin`` (the A100 tests) and ``libtpu`` (the v5e tests); each target's tests skip with the reason
when its compiler is missing.
"""

import importlib.metadata
import os
import sys
from pathlib import Path

import jax
import pytest

_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT / "benchmarks" / "gpu"))
sys.path.insert(0, str(_ROOT / "benchmarks"))

import compile_targets  # noqa: E402  pylint: disable=wrong-import-position
import deviceless  # noqa: E402  pylint: disable=wrong-import-position

_STAGE_VAR = "MAXTEXT_NVFP4_TARGET_COMPILE_TESTS"
pytestmark = [
    pytest.mark.skipif(os.environ.get(_STAGE_VAR) != "1",
                       reason=f"compiles for other targets (minutes): run as their own stage with {_STAGE_VAR}=1"),
    pytest.mark.skipif(jax.__version__ != "0.12.0.1",
                       reason=f"the pinned counts are XLA's at jax 0.12.0.1 (this is {jax.__version__})"),
]


def _libtpu_version():
  try:
    return importlib.metadata.version("libtpu")
  except importlib.metadata.PackageNotFoundError:
    return None


def _needs(target):
  reason = compile_targets.unavailable_reason(target)
  if reason is None and compile_targets.resolve(target).platform == "tpu" and not (
      _libtpu_version() or "").startswith("0.0.50"):
    reason = f"the pinned TPU counts are libtpu 0.0.50's (this is {_libtpu_version()})"
  return pytest.mark.skipif(reason is not None, reason=f"{target}: {reason}")


_A100 = _needs("a100")
_V5E = _needs("tpu-v5e")


@pytest.fixture(scope="module")
def compiled():
  """``deviceless.run_program`` once per (target, program) for this module."""
  cache = {}

  def get(target, program):
    if (target, program) not in cache:
      cache[target, program] = deviceless.run_program(program, spec=target)
    return cache[target, program]
  return get


def _summary(r):
  return {k: r[k] for k in ("other_kernels", "other_gib", "bytes_per_element", "full_writes", "f32_temps",
                            "temp_mib", "total_mib", "largest_temps") if k in r}


# (target, program) -> upper bounds, each the value measured on 2026-12-05 (commit 012169f) plus a small slack.
# ``f32_temps``: full-size 32-bit temporaries (none on the GPU; the TPU forms' are issue 47's item 2).
_PINS = {
    ("a100", "quant_q2d"): dict(bytes_per_element=4.51, other_kernels=3, temp_mib=0, f32_temps=0),
    ("a100", "quant_v1d_sr"): dict(bytes_per_element=6.01, other_kernels=4, temp_mib=0, f32_temps=0),
    ("a100", "quant_v0_rht_sr"): dict(bytes_per_element=6.76, other_kernels=5, temp_mib=8, f32_temps=0),
    # TPU v5e: XLA's forms of the quantizer (no Pallas kernel on TPU), 8192x4096 bf16: the 1x16 values of x for
    # fprop and W's 16x16 tiles (4-bit data, E4M3 scales). A copy is 4.00 B/element; on an H200 these are 6.00
    # and 4.51 B/element with 0 MiB of temporaries.
    ("tpu-v5e", "quant_v1d"): dict(bytes_per_element=28.6, other_kernels=160, temp_mib=73, f32_temps=0),
    ("tpu-v5e", "quant_q2d"): dict(bytes_per_element=133.0, other_kernels=189, temp_mib=1281, f32_temps=7),
}


@_A100
@pytest.mark.parametrize("program", [p for t, p in _PINS if t == "a100"])
def test_a100_quantizer_kernels(compiled, program):
  """The Pallas (Triton) quantizer kernels lower and compile for sm_80, within the pinned bytes."""
  r = compiled("a100", program)
  assert 'custom_call_target="__gpu$xla.gpu.triton"' in r["hlo"], _summary(r)
  for key, bound in _PINS["a100", program].items():
    assert r[key] <= bound, (key, _summary(r))


# The SwiGLU MLP fwd+bwd at 8192x4096x14336 on the A100 spec: measured bf16 2.19 GiB non-GEMM, 1600 MiB; nvfp4
# +5.82 GiB and 1824 MiB (1.14x), 52 non-GEMM kernels -- byte for byte the H200's program.
_A100_MLP = dict(extra_other_gib=5.85, total_mib=1830, other_kernels=52)


@_A100
def test_a100_mlp_bytes_and_memory(compiled):
  bf16, nvfp4 = compiled("a100", "mlp_bf16"), compiled("a100", "mlp_nvfp4")
  summary = {"bf16": _summary(bf16), "nvfp4": _summary(nvfp4)}
  assert bf16["gemm_kernels"] == nvfp4["gemm_kernels"] == 9, summary
  assert nvfp4["other_gib"] - bf16["other_gib"] <= _A100_MLP["extra_other_gib"], summary
  assert nvfp4["total_mib"] <= _A100_MLP["total_mib"], summary
  assert nvfp4["other_kernels"] <= _A100_MLP["other_kernels"], summary
  assert nvfp4["hlo"].count('custom_call_target="__gpu$xla.gpu.triton"') >= 4, summary


@_V5E
def test_v5e_accounting_on_known_programs(compiled):
  """The byte count on XLA:TPU's HLO: a copy reads and writes each bf16 element once (asynchronous copies and
  on-chip layouts counted once), and the bf16 MLP's 9 GEMMs are fusions around a convolution."""
  copy = compiled("tpu-v5e", "quant_copy")
  assert (copy["other_kernels"], copy["gemm_kernels"], copy["full_writes"], copy["f32_temps"]) == (1, 0, 1, 0)
  assert copy["bytes_per_element"] == pytest.approx(4.0), _summary(copy)
  mlp = compiled("tpu-v5e", "mlp_bf16")
  assert (mlp["gemm_kernels"], mlp["other_kernels"]) == (9, 3), _summary(mlp)
  assert mlp["total_mib"] < 1700, _summary(mlp)


@_V5E
@pytest.mark.parametrize("program", [p for t, p in _PINS if t == "tpu-v5e"])
def test_v5e_quantizer_compiles_within_bounds(compiled, program):
  """Every op of the quantizer compiles for a TPU v5e (no op refused, no Pallas kernel), and its bytes, kernels
  and temporaries stay within the pinned values."""
  r = compiled("tpu-v5e", program)
  assert "__gpu$xla.gpu.triton" not in r["hlo"] and r["gemm_kernels"] == 0, _summary(r)
  for key, bound in _PINS["tpu-v5e", program].items():
    assert r[key] <= bound, (key, _summary(r))


@_V5E
def test_v5e_keeps_the_4_bit_data_and_e4m3_scales(compiled):
  """``quantize``'s outputs stay float4_e2m1fn data and float8_e4m3fn scales in the program XLA:TPU compiles
  (a target that widened them would hand 8- or 32-bit arrays to the caller)."""
  r = compiled("tpu-v5e", "quant_q2d")
  header = r["hlo"].splitlines()[0]  # HloModule ..., entry_computation_layout={(arguments)->(outputs)}
  outputs = header.split("->", 1)[1]
  assert "f4e2m1fn[8192,4096]" in outputs and "f8e4m3fn[512,256]" in outputs, outputs[:300]
