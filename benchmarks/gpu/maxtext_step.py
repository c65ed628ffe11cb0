"""MaxText's whole train step compiled for a GPU or TPU target on a CPU (no accelerator): time, memory, bytes per kernel class.

    JAX_PLATFORMS=cpu python benchmarks/gpu/maxtext_step.py [--target h200] [--programs 'step_*'] [--json F]
        [--devices N] [--set KEY=VALUE ...]

The same deviceless compile as ``deviceless.py`` (compile-only devices of a ``compile_targets`` target, no
autotuning; **compile-derived, not a measurement on the device**), applied to the program
``maxtext_step_bench.py`` times on a real GPU: MaxText's ``train_step`` (forward, backward, AdamW update) for one
of the GPU presets or the CPU demo's tiny model, bf16 / fp8 / nvfp4. MaxText builds it as its own ahead-of-time
compiler does (``trainers/pre_train/train_compile.py``: ``get_shaped_inputs`` for the abstract state and batch,
``maxtext_utils.get_functional_train_with_signature`` for the step and its shardings). On a TPU target the mesh is
train_compile's own (``get_topology_mesh`` with ``compile_topology`` = the target's MaxText slice, e.g. v5e-1)
and the compiler options its ``jit_and_compile`` passes; on a GPU target train_compile's GPU branch takes
``jax.devices()`` (real GPUs), so the mesh is ``--devices`` compile-only GPUs instead (default 1; N > 1: FSDP over
all of them, ``ici_fsdp_parallelism=N``, MaxText told the device count with ``internal_compile_num_devices``).
Each row also counts the bytes each collective kind moves (``all_gather_gib``, ``reduce_scatter_gib``,
``all_reduce_gib``; ``collectives.py``). The plugin is registered in-process as the tests do, so
``quantization=nvfp4`` builds our emulated GEMMs, lowered for the target's platform (their ``cuda`` forms on a
GPU, the default forms on a TPU).

Per program: trace + lower seconds and XLA:GPU compile seconds on this CPU (the MoE proxy's compile-time target
of issue 25 is the nvfp4 / bf16 ratio of these), kernels and GiB per kernel class (GEMM / other, one pass of
``hlo_traffic.traffic`` over the optimized HLO), ``memory_analysis()`` (per device) and the bytes of each collective
kind per step and device (``all_gather_gib``, ``reduce_scatter_gib``, ``all_reduce_gib``, ``all_to_all_gib``,
``collective_permute_gib``; each collective's full-size buffer, ``collectives.py``; ``all_gather_by_dtype``: the
all-gather bytes per element type, e.g. ``u8`` for NVFP4 weights gathered as codes). Each program compiles in its own
process (``--programs`` runs them one after another), so that one program's compile does not share caches or
pyconfig state with the next.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(_HERE))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, ROOT)

import child_rows  # pylint: disable=wrong-import-position

# name -> (what, recipe yml relative to the checkout or "base" for MaxText's base.yml, keys)
# scan_layers=false (the MoE proxy's own setting): ``hlo_traffic`` counts a loop body once and a kernel's whole
# operands, so in a scanned program the per-layer kernels count once and the stacked weights' dynamic slices
# count in full -- unrolled, every layer's kernels are counted as they run.
# attention=dot_product: MaxText's default picks a tokamax kernel by the *host's* device kind (it refuses on a
# CPU host), so the deviceless step uses XLA's dot-product attention, as the MoE proxy recipe does.
_8B = dict(model_name="llama3-8b", override_model_config="true", base_num_decoder_layers=4,
           max_target_length=4096, per_device_batch_size=2, attention="dot_product", scan_layers="false")
# All 32 layers in MaxText's own layer loop (scan_layers=true, its default): collectives.py counts the loop body's
# collectives once per layer (the loop's trip count); hlo_traffic's GEMM / other GiB count the body once.
_8B_ALL = {**_8B, "base_num_decoder_layers": "32", "scan_layers": "true"}
_MOE = dict(base_num_decoder_layers=4)
# The CPU demo's model (recipes/demo_base.yml: llama2-style, 4 layers, emb 128, mlp 512, seq 256, pdbs 4),
# on synthetic data (the demo's own data is built by ``prepare-data``).
_DEMO_NVFP4 = {"nvfp4_backend": "emulate"}
PROGRAMS = {
    "step_demo_bf16": ("MaxText step, the CPU demo's tiny model (recipes/demo_bf16.yml), bf16",
                       "maxtext_nvfp4/recipes/demo_bf16.yml", {}),
    "step_demo_nvfp4": ("the same, nvfp4 emulated, full recipe (recipes/demo_nvfp4.yml)",
                        "maxtext_nvfp4/recipes/demo_nvfp4.yml", _DEMO_NVFP4),
    "step_8b4l_bf16": ("MaxText step, Llama 3 8B shape, 4 layers, seq 4096, pdbs 2, bf16 (gpu-llama3-8b-4layer)",
                       "base", {**_8B, "quantization": ""}),
    "step_8b4l_fp8": ("the same, quantization=fp8 (MaxText's own)", "base", {**_8B, "quantization": "fp8"}),
    "step_8b4l_nvfp4": ("the same, nvfp4 emulated, full recipe", "base",
                        {**_8B, "quantization": "nvfp4", "nvfp4_backend": "emulate"}),
    "step_8b_bf16": ("MaxText step, Llama 3 8B shape, all 32 layers (scan_layers=true), seq 4096, pdbs 2, bf16",
                     "base", {**_8B_ALL, "quantization": ""}),
    "step_8b_fp8": ("the same, quantization=fp8 (MaxText's own)", "base", {**_8B_ALL, "quantization": "fp8"}),
    "step_8b_nvfp4": ("the same, nvfp4 emulated, full recipe", "base",
                      {**_8B_ALL, "quantization": "nvfp4", "nvfp4_backend": "emulate"}),
    "step_moe_bf16": ("MaxText step, one-GPU MoE proxy (recipes/proxy_1gpu_moe_*), 4 layers, bf16",
                      "maxtext_nvfp4/recipes/proxy_1gpu_moe_base.yml", {**_MOE, "quantization": ""}),
    "step_moe_fp8": ("the same, quantization=fp8 (MaxText's own, its expert einsums too)",
                     "maxtext_nvfp4/recipes/proxy_1gpu_moe_fp8.yml", {**_MOE}),
    "step_moe_nvfp4": ("the same, nvfp4 emulated (every attention projection and expert linear)",
                       "maxtext_nvfp4/recipes/proxy_1gpu_moe_nvfp4.yml", {**_MOE, "nvfp4_backend": "emulate"}),
}
# Offline and quiet, as maxtext_step_bench.py runs them; the data pipeline is never built here.
COMMON = dict(dataset_type="synthetic", enable_checkpointing="false", enable_goodput_recording="false",
              monitor_goodput="false", enable_tensorboard="false", log_config="false", eval_interval="-1",
              tokenizer_type="sentencepiece", hardware="gpu", steps=10, run_name="deviceless")


def _argv(name: str, overrides: list[str] = (), target=None, devices: int = 1) -> list[str]:
  import maxtext  # pylint: disable=import-outside-toplevel

  mt = os.path.dirname(maxtext.__file__)
  _, yml, keys = PROGRAMS[name]
  yml = os.path.join(mt, "configs", "base.yml") if yml == "base" else os.path.join(ROOT, yml)
  keys = {**COMMON, "tokenizer_path": os.path.join(mt, "assets", "tokenizers", "tokenizer.llama2"), **keys}
  if target is not None and target.platform == "tpu":
    keys.update(hardware="tpu", compile_topology=target.compile_topology, compile_topology_num_slices=1)
  if devices > 1:  # FSDP over every compile-only device; MaxText cannot count them (jax.devices() is the CPU)
    keys.update(internal_compile="true", internal_compile_num_devices=str(devices), ici_fsdp_parallelism=str(devices))
  keys.update(kv.split("=", 1) for kv in overrides)
  return [None, yml] + [f"{k}={v}" for k, v in keys.items()]


def compile_step(name: str, spec: str = "h200", overrides: list[str] = (), devices: int = 1,
                 hlo_out: str | None = None) -> dict:
  """Compile program ``name`` for the spec's GPU in this process and count it (the module docstring)."""
  import jax  # pylint: disable=import-outside-toplevel
  from flax.core.spmd import logical_axis_rules  # pylint: disable=import-outside-toplevel
  from jax.sharding import AxisType, Mesh  # pylint: disable=import-outside-toplevel

  import collectives  # pylint: disable=import-outside-toplevel
  import compile_targets  # pylint: disable=import-outside-toplevel
  import deviceless  # pylint: disable=import-outside-toplevel
  import maxtext_nvfp4  # pylint: disable=import-outside-toplevel

  maxtext_nvfp4.register()
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train, train_compile  # pylint: disable=import-outside-toplevel
  from maxtext.utils import max_utils, maxtext_utils, sharding  # pylint: disable=import-outside-toplevel

  target = compile_targets.resolve(spec)
  devs = list(deviceless.devices(spec, f"1x{devices}x1"))
  dev = devs[0]
  t0 = time.perf_counter()
  config = pyconfig.initialize(_argv(name, overrides, target, devices))
  options = {}
  if target.platform == "tpu":  # MaxText's own ahead-of-time path: its topology mesh and compiler options
    mesh = train_compile.get_topology_mesh(config)
    options = max_utils.parse_libtpu_flags_to_dict(config.compile_xla_flags)
    dev = mesh.devices.flat[0]
  else:
    mesh = Mesh(maxtext_utils.create_device_mesh(config, devs), config.mesh_axes,
                axis_types=(AxisType.Auto,) * len(config.mesh_axes))
  args, kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
  params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(config, state_shardings)
  in_state = sharding.build_zero1_input_state_mesh_shardings(config, state_shardings, params_shardings)
  data_sharding = sharding.get_input_data_sharding(config, mesh)
  fn, in_sh, out_sh, static, donate = maxtext_utils.get_functional_train_with_signature(
      train.train_step, data_sharding, in_state, model, config, params_shardings)
  # The default device: the GPU Pallas's Triton lowering targets, also inside compile() (deviceless.compile_for).
  with jax.default_device(dev):
    with jax.set_mesh(mesh), logical_axis_rules(config.logical_axis_rules):
      lowered = jax.jit(fn, in_shardings=in_sh, out_shardings=out_sh, static_argnums=static,
                        donate_argnums=donate).lower(*args, **kwargs)
    t1 = time.perf_counter()
    compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
    t2 = time.perf_counter()
  text = compiled.as_text()
  if hlo_out:
    with open(hlo_out, "w", encoding="utf-8") as fh:
      fh.write(text)
  moved = collectives.collective_bytes(text)
  return dict(program=name, what=PROGRAMS[name][0], overrides=list(overrides), spec=spec, target=target.name,
              devices=mesh.devices.size, mesh={a: int(n) for a, n in mesh.shape.items() if n > 1},
              jax=jax.__version__, lower_s=round(t1 - t0, 1), compile_s=round(t2 - t1, 1),
              **deviceless.compiled_counts(compiled, text), **collectives.gib(moved),
              all_gather_by_dtype={k: round(v / 2**30, 4) for k, v in sorted(moved["all_gather"].items())})


def table(rows: list[dict]) -> str:
  lines = ["| program | devices | lower s | compile s | GEMM kernels | GEMM GiB | other kernels | other GiB | temp MiB |"
           " total MiB | all-gather GiB | reduce-scatter GiB | all-reduce GiB |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| {r['program']} | failed: {r['error']} |||||||||||")
      continue
    name = r["program"] + "".join(f" {o}" for o in r.get("overrides", ()))
    lines.append(f"| {name} | {r.get('devices', 1)} | {r['lower_s']} | {r['compile_s']} | {r['gemm_kernels']} |"
                 f" {r['gemm_gib']:.2f} | {r['other_kernels']} | {r['other_gib']:.2f} | {r['temp_mib']:.0f} |"
                 f" {r['total_mib']:.0f} | {r['all_gather_gib']:.3f} | {r['reduce_scatter_gib']:.3f} |"
                 f" {r['all_reduce_gib']:.3f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--target", "--spec", dest="spec", default="h200",
                 help="a compile_targets name (a100, h100, h200, b200, gb200, tpu-v5e, tpu-v6e, tpu-v5p) or a"
                      " gpu_target_config.pbtxt path")
  p.add_argument("--programs", default="step_*", help=f"comma list of names or globs from {tuple(PROGRAMS)}")
  p.add_argument("--json", help="append each row as one JSON line here")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a MaxText key")
  p.add_argument("--devices", type=int, default=1, help="compile-only GPUs (N > 1: FSDP over all of them)")
  p.add_argument("--hlo-dir", help="write each program's optimized HLO text here (<program>.hlo.txt)")
  p.add_argument("--timeout", type=float, default=3600, help="seconds per program (its process is killed after)")
  p.add_argument("--one", help=argparse.SUPPRESS)  # the child: compile this one program, print its row
  a = p.parse_args(argv)
  if a.one:
    hlo = os.path.join(a.hlo_dir, f"{a.one}.hlo.txt") if a.hlo_dir else None
    child_rows.emit(compile_step(a.one, a.spec, a.set, a.devices, hlo))
    return 0
  import deviceless  # pylint: disable=import-outside-toplevel

  names = deviceless.select(a.programs, PROGRAMS)
  if not names:
    p.error(f"no program matches {a.programs!r}; choose from {tuple(PROGRAMS)}")

  if a.devices < 1:
    p.error(f"--devices {a.devices}: need at least 1")
  if a.hlo_dir:
    if os.path.exists(a.hlo_dir) and not os.path.isdir(a.hlo_dir):
      p.error(f"--hlo-dir {a.hlo_dir}: a file, not a folder")
    os.makedirs(a.hlo_dir, exist_ok=True)
  print(f"{deviceless.HEADLINE}; target {a.spec} x {a.devices}", flush=True)

  def row_of(name: str, run: child_rows.ChildRun) -> dict:
    if run.row is not None:
      return {**run.row, "wall_s": run.wall_s}
    if run.timed_out:
      return dict(program=name, error=f"not compiled within {a.timeout:.0f} s", wall_s=run.wall_s)
    errors = [l for l in run.stderr.splitlines() if re.match(r"[\w.]+(Error|Exception|Exit)\b", l)]
    error = (errors or run.stderr.strip().splitlines() or ["no output"])[-1][-300:]
    return dict(program=name, error=error, wall_s=run.wall_s)

  rows = child_rows.collect(__file__, names,
                            lambda name: ["--spec", a.spec, "--one", name, f"--devices={a.devices}",
                                          *(f"--set={kv}" for kv in a.set),
                                          *([f"--hlo-dir={a.hlo_dir}"] if a.hlo_dir else [])],
                            row_of, timeout=a.timeout, json_lines=a.json)
  print(table(rows))
  return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
