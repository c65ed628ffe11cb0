"""Passes over memory of the jitted quantizer, counted in its compiled HLO (benchmarks/quantizer_hlo.py).

The counts guard against a quantizer change that silently adds a pass over the operand or a full-size
32-bit temporary (each costs the GPU as much bandwidth as a quarter to a whole extra copy of the tensor):

  * the counter itself, on hand-written HLO text and on programs with a known answer (a copy; a
    materialized f32 widening) -- so the bounds below can fail;
  * XLA:CPU's optimized HLO of every quantizer call of the GEMM recipe at 256x512, against the counts
    measured at jax 0.12.0.1 (the pinned version; bounds, so an improvement passes -- then lower them);
  * the CUDA lowering (StableHLO, before XLA's fusion; no GPU needed): which arrays the quantizer forces
    into memory with an ``optimization_barrier`` on every backend.

What the counts mean and the findings: ``benchmarks/profile_notes.md`` (session 3).
"""

import importlib.util
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

_SPEC = importlib.util.spec_from_file_location(
    "quantizer_hlo", Path(__file__).resolve().parents[2] / "benchmarks" / "quantizer_hlo.py")
qh = importlib.util.module_from_spec(_SPEC)
sys.modules["quantizer_hlo"] = qh  # dataclasses look their module up there
_SPEC.loader.exec_module(qh)

SHAPE = (256, 512)
N = SHAPE[0] * SHAPE[1]
_ON_CPU = jax.default_backend() == "cpu"

# Hand-written optimized-HLO text: a conditional with a cheap and a dear branch, a tuple type whose
# layout holds parentheses, a packed 4-bit output. 1024 elements.
_TEXT = """HloModule m

%fused_a (p: bf16[32,32]) -> s32[32,2] {
  %p = bf16[32,32]{1,0} parameter(0)
  ROOT %r = s32[32,2]{1,0} reduce(%p, %p), dimensions={1}, to_apply=%max
}

%cheap (t: (bf16[32,32])) -> (bf16[32,32]) {
  %t = (bf16[32,32]{1,0}) parameter(0)
  %g = bf16[32,32]{1,0} get-tuple-element(%t), index=0
  %n = bf16[32,32]{1,0} fusion(%g), kind=kLoop, calls=%fused_a
  ROOT %o = (bf16[32,32]{1,0}) tuple(%n)
}

%dear (t: (bf16[32,32])) -> (bf16[32,32]) {
  %t = (bf16[32,32]{1,0}) parameter(0)
  %g = bf16[32,32]{1,0} get-tuple-element(%t), index=0
  %w = f32[32,32]{1,0} fusion(%g), kind=kLoop, calls=%fused_a
  %n = bf16[32,32]{1,0} fusion(%w), kind=kLoop, calls=%fused_a
  ROOT %o = (bf16[32,32]{1,0}) tuple(%n)
}

ENTRY %main (x: bf16[32,32], c: s32[]) -> (f4e2m1fn[32,32], f32[]) {
  %x = bf16[32,32]{1,0} parameter(0)
  %c = s32[] parameter(1)
  %tx = (bf16[32,32]{1,0}) tuple(%x)
  %cond = (bf16[32,32]{1,0}) conditional(%c, %tx, %tx), branch_computations={%cheap, %dear}
  %y = bf16[32,32]{1,0} get-tuple-element(%cond), index=0
  %b = s32[32,2]{1,0} fusion(%y), kind=kInput, calls=%fused_a
  %codes = u8[32,16]{1,0} fusion(%y, %b), kind=kLoop, calls=%fused_a
  %q = f4e2m1fn[32,32]{1,0:E(4)} fusion(%codes), kind=kLoop, calls=%fused_a
  %amax = f32[] fusion(%b), kind=kLoop, calls=%fused_a
  ROOT %out = (f4e2m1fn[32,32]{1,0:E(4)}, f32[]) tuple(%q, %amax)
}
"""


def test_counter_on_handwritten_hlo():
  """Kernels of ENTRY plus the cheapest conditional branch; 4-bit and tuple types sized right."""
  comps, entry = qh.parse_computations(_TEXT)
  assert entry == "main" and set(comps) == {"fused_a", "cheap", "dear", "main"}
  q = next(i for i in comps["main"] if i.name == "q")
  assert q.opcode == "fusion" and q.outputs == (("f4e2m1fn", 1024),) and q.operands == ("codes",)
  s = qh.hlo_stats(_TEXT, 1024)
  # cheap branch: %n (read 2 KiB, write 2 KiB); entry: %b, %codes, %q, %amax.
  assert s["kernels"] == 5
  assert s["operand_reads"] == 4  # n, b, codes (y), q (codes: 512 elements = N/2)
  assert s["full_writes"] == 3  # n, codes, q
  assert s["f32_temps"] == 0  # the dear branch's f32 %w does not run in the cheapest branch
  traffic = (2048 + 2048) + (2048 + 256) + (2048 + 256 + 512) + (512 + 512) + (256 + 4)
  assert s["traffic_bytes_per_element"] == pytest.approx(traffic / 1024, abs=1e-3)


@pytest.fixture(scope="module")
def cpu_counts():
  if not _ON_CPU:
    pytest.skip("the pinned counts are XLA:CPU's (on a GPU run, benchmarks/quantizer_hlo.py reports them)")
  return {name: qh.profile(name, SHAPE) for name in qh.CASES}


def test_counter_on_known_programs(cpu_counts):
  """A copy is one pass of 4 bytes per element; a materialized f32 widening is caught as a temporary."""
  c = cpu_counts["copy"]
  assert (c["kernels"], c["operand_reads"], c["full_writes"], c["f32_temps"]) == (1, 1, 1, 0)
  assert c["traffic_bytes_per_element"] == pytest.approx(4.0)

  def widened_twice(x):
    y = jax.lax.optimization_barrier(x.astype(jnp.float32))  # forced into memory: 4 B/element
    return (y * 2).astype(jnp.bfloat16), jnp.max(y)

  text = jax.jit(widened_twice).lower(jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16)).compile().as_text()
  s = qh.hlo_stats(text, N)
  assert s["f32_temps"] >= 1 and s["operand_reads"] >= 3
  assert s["traffic_bytes_per_element"] >= 2 + 4 + 4 + 4 + 2


# XLA:CPU at jax 0.12.0.1, 256x512 bf16: operand reads, f32 temps, traffic B/element (the measured values:
# benchmarks/RESULTS.md, "Facts moved out of core/ comments").
# 1D/2D: the operand is read twice (block amax, element pass) and no full-size 32-bit buffer exists; the
# packed-code -> float4 bitcast is a third pass over half-size data (q*); the block-level f32 arrays (scales,
# encode factors) are most of the rest. RHT: the CPU's YNNPACK reduce needs its f32 input materialized, and
# the RHT output is written once in bf16 (optimization_barrier) and read twice.
_CPU_BOUNDS = {
    "q1d": (3, 0, 7.9),
    "q2d": (3, 0, 5.7),
    "qrht": (7, 2, 31.0),
    "v1d": (2, 0, 8.1),
    "v1d_sr": (2, 0, 8.1),
    "v0_rht_sr": (6, 2, 31.1),
}


@pytest.mark.parametrize("case", sorted(_CPU_BOUNDS))
def test_quantizer_passes_on_cpu(cpu_counts, case):
  reads, temps, traffic = _CPU_BOUNDS[case]
  c = cpu_counts[case]
  assert c["operand_reads"] <= reads, c
  assert c["f32_temps"] <= temps, c
  assert c["traffic_bytes_per_element"] <= traffic, c
  # Every quantizer must at least read its operand and write one full-size result.
  assert c["operand_reads"] >= 1 and c["full_writes"] >= 1 and c["traffic_bytes_per_element"] > 2.0


# The calls that run as Pallas Triton kernels on XLA:GPU (core/quantizer/pallas_triton.py).
_TRITON_CASES = ("v1d", "v1d_sr", "v0_rht_sr", "q1d", "qrht", "q2d")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "gpu"))
import deviceless  # noqa: E402  pylint: disable=wrong-import-position


def _cuda_lowering(fn, triton: bool):
  x = jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16)
  traced = jax.jit(fn).trace(x, jax.random.key(0))
  if triton:  # Pallas's Triton lowering reads the default device's kind: a compile-only H200 (no GPU needed)
    reason = deviceless.unavailable_reason()
    if reason:
      pytest.skip(f"the Triton kernel's lowering needs a (compile-only) GPU device: {reason}")
    with jax.default_device(deviceless.device()):
      text = traced.lower(lowering_platforms=("cuda",)).as_text()
  else:
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert "stablehlo.while" not in text  # sanity: the GPU program (tests/core/test_numerics.py checks this too)
  return text


def _barrier_operand_types(text):
  return re.findall(r"stablehlo\.optimization_barrier .*?: (tensor<[^>]*>)", text)


@pytest.mark.parametrize("case", sorted(c for c in qh.CASES if c != "copy"))
def test_cuda_lowering_materializes_only_the_rht_output(case):
  """On every backend an optimization_barrier forces its operand into memory. For the GPU program the
  quantizer has one on the block maxima (1/16 of the data; keeps the tensor amax a second, small
  reduction) and, on the RHT path, one on the bf16 RHT output (written once, read by the block amax and
  the element pass) and one on the per-group tiny flag (a pred, 1/16 of the data: keeps XLA:GPU from
  writing the tiny-group select out in fp32). No other full-size array is forced into memory, and none
  in f32. The operands of ``quantize_values`` that Triton kernels quantize there (1x16 along the last axis;
  RHT along axis 0) have no barrier at all, and the kernels' custom calls are in the program (and on no
  other path)."""
  text = _cuda_lowering(qh.CASES[case][1], case in _TRITON_CASES)
  assert ("__gpu$xla.gpu.triton" in text) == (case in _TRITON_CASES), case
  types = _barrier_operand_types(text)
  full = [t for t in types if t.startswith(f"tensor<{SHAPE[0]}x{SHAPE[1]}x")]
  if case in _TRITON_CASES:
    assert types == [], types
    return
  assert len(types) == (3 if "rht" in case else 1), types
  assert full == (["tensor<256x512xbf16>"] if "rht" in case else []), types
  if "rht" in case:
    assert f"tensor<{SHAPE[0] // 16}x1x{SHAPE[1]}xi1>" in types, types
