"""What MaxText's train step all-gathers under FSDP with real Transformer Engine, compiled for compile-only B200s.

    source scripts/te_env.sh; .venv-targets/bin/python benchmarks/gpu/te_weight_gather.py [--devices 8]
        [--layers 2] [--programs bf16,te_fp8,te_nvfp4] [--json F]

A small Llama-style model (the te stage's: emb 256, MLP 512, 4 heads of 64, seq 128, pdbs 2, ``scan_layers=false``,
``remat_policy=minimal_with_context``) built and compiled as MaxText's ahead-of-time compiler does
(:func:`maxtext_nvfp4.integration.aot_compile.compile_train_step`, ``compile_topology=b200-N``, FSDP over all N)
with real TE JAX (``scripts/te_env.sh``). Per program: the bytes each collective kind moves per step and device
(``collectives.py``: each collective's full-size buffer), all-gathers split by element type, and the decoder
kernels' all-gather bytes per weight (all-gathered bytes minus the embedding's bf16 gather, over the decoder's
weights). **Compile-derived** (what the compiled program would move), not measured on a B200. Programs:

  bf16      ``quantization=""``: MaxText's plain bf16 step (no TE)
  te_fp8    ``quantization=te_fp8_currentscaling``: MaxText's TE FP8 recipe
  te_nvfp4  ``quantization=nvfp4 nvfp4_backend=te``: ours, TE's NVFP4 GEMMs

Each program compiles in its own process (pyconfig and jit caches are per process).
"""

from __future__ import annotations

import argparse
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(_HERE))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, ROOT)

import child_rows  # pylint: disable=wrong-import-position

MODEL = dict(base_emb_dim=256, base_mlp_dim=512, base_num_query_heads=4, base_num_kv_heads=4, head_dim=64,
             vocab_size=512, max_target_length=128, per_device_batch_size=2, attention="dot_product",
             scan_layers="false", remat_policy="minimal_with_context", dataset_type="synthetic",
             enable_checkpointing="false", steps=5, run_name="te_weight_gather", hardware="gpu",
             enable_goodput_recording="false", monitor_goodput="false", enable_tensorboard="false",
             log_config="false", compile_topology_num_slices=1)
PROGRAMS = {"bf16": {"quantization": ""}, "te_fp8": {"quantization": "te_fp8_currentscaling"},
            "te_nvfp4": {"quantization": "nvfp4", "nvfp4_backend": "te"}}


def decoder_weights(layers: int) -> int:
  """Weights of the decoder's projections: q, k, v, out (emb x heads*head_dim) and wi_0, wi_1, wo (emb x mlp)."""
  emb, mlp, hd = MODEL["base_emb_dim"], MODEL["base_mlp_dim"], MODEL["base_num_query_heads"] * MODEL["head_dim"]
  return layers * (4 * emb * hd + 3 * emb * mlp)


def compile_one(name: str, devices: int, layers: int) -> dict:
  """Compile program ``name`` in this process; its row."""
  import maxtext  # pylint: disable=import-outside-toplevel
  import collectives  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import aot_compile  # pylint: disable=import-outside-toplevel

  mt = os.path.dirname(maxtext.__file__)
  keys = {**MODEL, **PROGRAMS[name], "compile_topology": f"b200-{devices}", "ici_fsdp_parallelism": devices,
          "base_num_decoder_layers": layers,
          "tokenizer_path": os.path.join(mt, "assets", "tokenizers", "tokenizer.llama2")}
  step = aot_compile.compile_train_step([None, os.path.join(mt, "configs", "base.yml")]
                                        + [f"{k}={v}" for k, v in keys.items()])
  moved = collectives.collective_bytes(step.compiled.as_text())
  gathered = {k: int(v) for k, v in moved["all_gather"].items()}
  embedding = MODEL["vocab_size"] * MODEL["base_emb_dim"] * 2  # MaxText gathers the (bf16) embedding table
  kernels = sum(v for k, v in gathered.items() if k != "s32") - embedding
  mem = step.compiled.memory_analysis()
  return dict(program=name, devices=devices, layers=layers, backend=step.backend, mesh=step.mesh.get("fsdp"),
              all_gather_by_dtype=gathered, all_gather_bytes=sum(gathered.values()),
              reduce_scatter_bytes=int(sum(moved["reduce_scatter"].values())),
              all_reduce_bytes=int(sum(moved["all_reduce"].values())),
              kernel_gather_bytes_per_weight=round(kernels / decoder_weights(layers), 4),
              temp_mib=round(mem.temp_size_in_bytes / 2**20, 2), compile_s=step.compile_s)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  p.add_argument("--devices", type=int, default=8, help="compile-only B200s (FSDP over all of them)")
  p.add_argument("--layers", type=int, default=2, help="decoder layers")
  p.add_argument("--programs", default=",".join(PROGRAMS), help="comma-separated, among " + ", ".join(PROGRAMS))
  p.add_argument("--json", help="append each row as one JSON line here")
  p.add_argument("--one", help=argparse.SUPPRESS)  # the child: compile this one program, print its row
  a = p.parse_args(argv)
  if a.one:
    child_rows.emit(compile_one(a.one, a.devices, a.layers))
    return 0

  def row_of(name: str, run: child_rows.ChildRun) -> dict | None:
    if run.row is None:
      print(f"{name}: failed (exit {run.returncode}): {run.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
      return None
    return {**run.row, "wall_s": run.wall_s}

  rows = child_rows.collect(__file__, a.programs.split(","),
                            lambda name: ["--one", name, f"--devices={a.devices}", f"--layers={a.layers}"],
                            row_of, echo=False, json_lines=a.json)
  if rows is None:
    return 1
  base = next((r["all_gather_bytes"] for r in rows if r["program"] == "bf16"), None)
  print(f"{'program':9} {'all-gather B':>12} {'x bf16':>6} {'kernels B/w':>11} {'reduce-scatter B':>16}"
        f" {'temp MiB':>8}  all-gather by dtype")
  for r in rows:
    ratio = f"{r['all_gather_bytes'] / base:.3f}" if base else "-"
    print(f"{r['program']:9} {r['all_gather_bytes']:>12} {ratio:>6} {r['kernel_gather_bytes_per_weight']:>11}"
          f" {r['reduce_scatter_bytes']:>16} {r['temp_mib']:>8}  {r['all_gather_by_dtype']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
