"""The Pallas NVFP4 GEMM (core/gemm_kernels, ``MAXTEXT_NVFP4_GEMM_IMPL=auto``) in programs compiled for an H200 (and an
A100) on this CPU: each NVFP4 GEMM is one Triton kernel that reads both operands as packed codes (u4) and E4M3
scales (u8) -- the quantizers write the single-use operands as codes too, and no other kernel reads the codes, so
no bf16 copy of an operand is written -- and the SwiGLU
MLP's and the experts' non-GEMM bytes drop below the XLA dot's (the bounds: benchmarks/RESULTS.md, "Pallas NVFP4
GEMM", each the measured value plus a small slack). Compile-derived (``benchmarks/gpu/deviceless.py``), jax 0.12.0.1.

A stage of its own (tens of seconds of compilation): skipped unless MAXTEXT_NVFP4_GPU_COMPILE_TESTS=1.
"""


import pytest

from deviceless_gpu_stage import MARKS  # puts benchmarks/gpu and benchmarks on the path

import deviceless  # noqa: E402  pylint: disable=wrong-import-position
import quantizer_hlo as qh  # noqa: E402  pylint: disable=wrong-import-position

from maxtext_nvfp4.core import gemm_kernels  # noqa: E402  pylint: disable=wrong-import-position

pytestmark = [*MARKS]  # the gpu stage's gate: MAXTEXT_NVFP4_GPU_COMPILE_TESTS=1, the compile-only client, jax 0.12.0.1

_NAME = "nvfp4_dequant_dot"
# SwiGLU MLP fwd+bwd T=8192 D=4096 F=14336, full recipe, H200: extra non-GEMM GiB over bf16 (XLA dot: 5.82; this
# GEMM with bf16 block values of the single-use operands: 4.61; with every operand as codes: 3.69) and the compiled
# total (1824.7 MiB, the XLA dot's 1824).
_MLP_EXTRA_OTHER_GIB = 3.72
_MLP_TOTAL_MIB = 1830
# 8 experts fwd+bwd: other GiB (XLA's batched dot: 2.83, its f32 outputs scaled by a kernel of their own; block
# values of the single-use operands: 1.31; every operand as codes: 1.18)
_EXPERTS_OTHER_GIB = 1.22
# what each GEMM reads when both operands are codes + scales: two u4 code arrays, two u8 scale arrays, alpha
_BOTH_CODES = ["f32", "u4", "u4", "u8", "u8"]


def _kernels(hlo: str):
  """(dequant GEMM calls, other kernels that read 4-bit codes) of an optimized HLO text."""
  comps, entry = qh.parse_computations(hlo)
  shapes = {ins.name: ins.outputs for c in comps.values() for ins in c}
  gemms, code_readers = [], []
  for ins in comps[entry]:
    if qh.is_free(ins):
      continue
    read, written = qh.kernel_io(ins, shapes)
    if _NAME in ins.attrs:
      gemms.append((read, written))
    elif any(t in ("u4", "f4e2m1fn") for t, _ in read):
      code_readers.append(ins.name)
  return gemms, code_readers


@pytest.fixture
def auto(monkeypatch):
  monkeypatch.setenv(gemm_kernels.IMPLEMENTATION_ENV, "auto")


def test_mlp_gemms_read_codes_and_scales_on_h200(auto):  # pylint: disable=unused-argument,redefined-outer-name
  bf16, nvfp4 = deviceless.run_program("mlp_bf16"), deviceless.run_program("mlp_nvfp4")
  keys = ("gemm_kernels", "gemm_gib", "other_kernels", "other_gib", "temp_mib", "total_mib", "largest_temps")
  summary = {k: nvfp4[k] for k in keys}
  gemms, code_readers = _kernels(nvfp4["hlo"])
  assert nvfp4["gemm_kernels"] == len(gemms) == 9, summary  # fprop, dgrad and wgrad of 3 layers: all Pallas
  assert not code_readers, code_readers  # no dequantize kernel: the codes go to the GEMMs only
  for read, _ in gemms:  # no bf16 operand: the single-use ones (x fprop, dy dgrad and wgrad) come as codes too
    assert sorted(t for t, _ in read) == _BOTH_CODES, read
  assert nvfp4["other_gib"] - bf16["other_gib"] <= _MLP_EXTRA_OTHER_GIB, summary
  assert nvfp4["total_mib"] <= _MLP_TOTAL_MIB and nvfp4["f32_temps"] == 0, summary


def test_expert_gemms_under_vmap_take_the_dequant_gemm_on_h200(auto):  # pylint: disable=unused-argument,redefined-outer-name
  r = deviceless.run_program("experts_nvfp4")
  gemms, code_readers = _kernels(r["hlo"])
  assert len(gemms) == r["gemm_kernels"] == 3 and not code_readers, (len(gemms), code_readers)
  assert all(sorted(t for t, _ in read) == _BOTH_CODES for read, _ in gemms), gemms
  assert r["other_gib"] <= _EXPERTS_OTHER_GIB and r["f32_temps"] == 0, {k: r[k] for k in ("other_gib", "temp_mib")}


@pytest.mark.parametrize("name", ["gemm_fprop", "gemm_dgrad", "gemm_wgrad"])
def test_each_pass_compiles_for_an_a100(auto, name):  # pylint: disable=unused-argument,redefined-outer-name
  r = deviceless.run_program(name, spec="a100")
  gemms, code_readers = _kernels(r["hlo"])
  assert len(gemms) == r["gemm_kernels"] == 1 and not code_readers, (len(gemms), code_readers)
