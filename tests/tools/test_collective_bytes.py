"""benchmarks/gpu/collectives.py: each collective's bytes times the runs of the computation that holds it.

Hand-written optimized-HLO text with the shapes XLA:GPU prints (a while loop with ``known_trip_count``, a loop
nested in it, an all-reduce inside an async fusion, a loop whose trip count XLA does not know); the gpu stage
checks the same on a program XLA:GPU compiled (tests/core/test_gpu_compile_bytes.py).
"""

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "collectives", Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "collectives.py")
collectives = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(collectives)

_TRIP = 'backend_config={"known_trip_count":{"n":"%d"},"known_init_step":{"init":"0","step":"1"}}'
_TEXT = f"""HloModule m

%add (x: bf16[], y: bf16[]) -> bf16[] {{
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %s = bf16[] add(%x, %y)
}}

%fused_all-reduce (p: bf16[1024]) -> bf16[1024] {{
  %p = bf16[1024]{{0}} parameter(0)
  ROOT %all-reduce.1 = bf16[1024]{{0}} all-reduce(%p), channel_id=3, replica_groups=[1,8]<=[8], to_apply=%add
}}

%inner_body (q: (s32[], bf16[16,64])) -> (s32[], bf16[16,64]) {{
  %q = (s32[], bf16[16,64]{{1,0}}) parameter(0)
  %v = bf16[16,64]{{1,0}} get-tuple-element(%q), index=1
  %reduce-scatter.1 = bf16[2,64]{{1,0}} reduce-scatter(%v), channel_id=4, replica_groups=[1,8]<=[8], dimensions={{0}}, to_apply=%add
  ROOT %t = (s32[], bf16[16,64]{{1,0}}) tuple(%i, %v)
}}

%inner_cond (q: (s32[], bf16[16,64])) -> pred[] {{
  ROOT %c = pred[] constant(true)
}}

%body (p: (s32[], bf16[128,256])) -> (s32[], bf16[128,256]) {{
  %p = (s32[], bf16[128,256]{{1,0}}) parameter(0)
  %w = bf16[16,256]{{1,0}} get-tuple-element(%p), index=1
  %all-gather.1 = bf16[128,256]{{1,0}} all-gather(%w), channel_id=1, replica_groups=[1,8]<=[8], dimensions={{0}}
  %fusion-start = ((bf16[1024]{{0}}), bf16[1024]{{0}}) fusion-start(%w2), kind=kCustom, calls=%fused_all-reduce
  %while.2 = (s32[], bf16[16,64]{{1,0}}) while(%init2), condition=%inner_cond, body=%inner_body, {_TRIP % 4}
  ROOT %r = (s32[], bf16[128,256]{{1,0}}) tuple(%i, %all-gather.1)
}}

%cond (p: (s32[], bf16[128,256])) -> pred[] {{
  ROOT %c = pred[] constant(true)
}}

%unknown_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {{
  %p = (s32[], f32[8]{{0}}) parameter(0)
  %all-gather.2 = f32[64]{{0}} all-gather(%x), channel_id=5, replica_groups=[1,8]<=[8], dimensions={{0}}
  ROOT %r = (s32[], f32[8]{{0}}) tuple(%i, %x)
}}

ENTRY %main (a: bf16[16,256]) -> bf16[128,256] {{
  %a = bf16[16,256]{{1,0}} parameter(0)
  %all-gather.0 = bf16[128,256]{{1,0}} all-gather(%a), channel_id=0, replica_groups=[1,8]<=[8], dimensions={{0}}
  %while.1 = (s32[], bf16[128,256]{{1,0}}) while(%init), condition=%cond, body=%body, {_TRIP % 32}
  %while.3 = (s32[], f32[8]{{0}}) while(%init3), condition=%cond, body=%unknown_body
  ROOT %out = bf16[128,256]{{1,0}} get-tuple-element(%while.1), index=1
}}
"""


def test_runs_multiply_through_nested_loops_and_calls():
  runs = collectives.computation_runs(_TEXT)
  assert runs["main"] == 1
  assert runs["body"] == 32
  assert runs["inner_body"] == 32 * 4
  assert runs["fused_all-reduce"] == 32  # called from the loop body by an async fusion
  assert runs["unknown_body"] == 1  # no known trip count: once


def test_collective_bytes_count_each_run():
  moved = collectives.collective_bytes(_TEXT)
  gather = 128 * 256 * 2
  assert moved["all_gather"] == {"bf16": gather * (1 + 32), "f32": 64 * 4}
  assert moved["all_reduce"] == {"bf16": 1024 * 2 * 32}
  assert moved["reduce_scatter"] == {"bf16": 2 * 64 * 2 * 8 * 32 * 4}  # the operand: result x group of 8


def test_a_text_without_an_entry_counts_each_collective_once():
  body = _TEXT.split("%cond (p:")[0].replace("ENTRY ", "")
  assert collectives.computation_runs(body) == {}
  assert collectives.collective_bytes(body)["all_gather"] == {"bf16": 128 * 256 * 2}
