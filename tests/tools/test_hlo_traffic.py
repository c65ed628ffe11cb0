"""benchmarks/gpu/hlo_traffic.py on a hand-written optimized HLO: each kernel's bytes (operands + outputs), its class
and its JAX source, walked into a while loop's body; free instructions move nothing; the class totals are the
kernels' sums; the kernel table ranks by bytes."""

import importlib.util
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(_ROOT / "benchmarks"))
_SPEC = importlib.util.spec_from_file_location("hlo_traffic", _ROOT / "benchmarks" / "gpu" / "hlo_traffic.py")
hlo_traffic = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(hlo_traffic)

_TEXT = """HloModule m

%scale (p0: f32[64,128]) -> bf16[64,128] {
  %p0 = f32[64,128]{1,0} parameter(0)
  ROOT %c = bf16[64,128]{1,0} convert(%p0)
}

%body (t: (s32[], bf16[64,128])) -> (s32[], bf16[64,128]) {
  %t = (s32[], bf16[64,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %x = bf16[64,128]{1,0} get-tuple-element(%t), index=1
  %n = bf16[64,128]{1,0} negate(%x), metadata={op_name="jit(f)/while/body/neg"}
  ROOT %r = (s32[], bf16[64,128]{1,0}) tuple(%i, %n)
}

%cond (t: (s32[], bf16[64,128])) -> pred[] {
  %t = (s32[], bf16[64,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %k = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %k), direction=LT
}

ENTRY %main (a: f32[64,128], w: bf16[128,256]) -> bf16[64,256] {
  %a = f32[64,128]{1,0} parameter(0)
  %w = bf16[128,256]{1,0} parameter(1)
  %f = bf16[64,128]{1,0} fusion(%a), kind=kLoop, calls=%scale, metadata={op_name="jit(f)/quantize/convert_element_type"}
  %z = s32[] constant(0)
  %t0 = (s32[], bf16[64,128]{1,0}) tuple(%z, %f)
  %loop = (s32[], bf16[64,128]{1,0}) while(%t0), condition=%cond, body=%body
  %y = bf16[64,128]{1,0} get-tuple-element(%loop), index=1
  ROOT %d = bf16[64,256]{1,0} dot(%y, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/dot_general"}
}
"""


def test_each_kernel_with_its_bytes_class_and_source():
  rows = {k["name"]: k for k in hlo_traffic.kernels(_TEXT)}
  assert rows["f"]["bytes"] == 64 * 128 * (4 + 2) and rows["f"]["kind"] == "other"
  assert rows["f"]["op_name"] == "jit(f)/quantize/convert_element_type"
  assert rows["n"]["bytes"] == 64 * 128 * 2 * 2 and rows["n"]["op_name"].endswith("/neg")  # inside the loop body
  assert rows["d"]["kind"] == "gemm" and rows["d"]["bytes"] == (64 * 128 + 128 * 256 + 64 * 256) * 2
  assert "z" not in rows and "t0" not in rows  # constants and tuples move nothing
  t = hlo_traffic.traffic(_TEXT)
  assert t["gemm"] == (1, rows["d"]["bytes"])
  assert t["other"][1] == sum(k["bytes"] for k in rows.values() if k["kind"] == "other")


def test_the_kernel_table_ranks_by_bytes_and_sums_the_rest():
  table = hlo_traffic.kernel_table(_TEXT, top=1, which="all").splitlines()
  assert "| 1 | gemm | dot |" in table[2]  # the largest
  assert table[3].startswith("| | the other") and table[-1].startswith("| | all ")
  other = hlo_traffic.kernel_table(_TEXT, top=5).splitlines()
  assert all("| gemm |" not in line for line in other)


def test_kernels_grouped_by_what_they_do():
  rows = {k["name"]: k for k in hlo_traffic.kernels(_TEXT)}
  assert hlo_traffic.source_op(rows["f"]) == "convert_element_type" and hlo_traffic.source_op(rows["n"]) == "neg"
  assert hlo_traffic.source_op({"op_name": "jit(f)/jit(q)/nvfp4_values_rows/pallas_call", "opcode": "custom-call"}) \
      == "nvfp4_values_rows"
  assert hlo_traffic.source_op({"op_name": "", "opcode": "copy-start"}) == "copy-start"
  table = hlo_traffic.source_table(_TEXT).splitlines()
  assert table[2].startswith("| convert_element_type | 1 |") and table[-1].startswith("| all (other) | 3 |")  # the loop condition's compare too
