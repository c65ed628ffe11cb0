"""``python -m maxtext_nvfp4.train_compile``: MaxText's ahead-of-time compile for a Blackwell target from this CPU host.

``nvfp4_backend=auto`` is decided by the compile target: Transformer Engine for compile-only B200s when TE imports
(it does here, with the stand-in driver library), the exact emulation when it does not (the same command without
``scripts/te_env.sh``'s library path: TE is installed but cannot load). Bad input: one line, exit code 2, before
MaxText starts.
"""

import os
import subprocess
import sys

import pytest

_TINY = ("base_config: base.yml\nhardware: gpu\nbase_emb_dim: 256\nbase_mlp_dim: 512\nbase_num_query_heads: 2\n"
         "base_num_kv_heads: 2\nhead_dim: 128\nbase_num_decoder_layers: 1\nvocab_size: 256\nmax_target_length: 128\n"
         "per_device_batch_size: 1\nattention: dot_product\nscan_layers: false\nremat_policy: minimal_with_context\n"
         "dataset_type: synthetic\nenable_checkpointing: false\nsteps: 3\nenable_goodput_recording: false\n"
         "monitor_goodput: false\nenable_tensorboard: false\nlog_config: false\nquantization: nvfp4\n")


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
  path = tmp_path_factory.mktemp("recipe") / "tiny_nvfp4.yml"
  path.write_text(_TINY)
  return str(path)


def _run(args, env=None, cwd=None):
  proc = subprocess.run([sys.executable, "-m", "maxtext_nvfp4.train_compile", *args], capture_output=True, text=True,
                        env=env or dict(os.environ), cwd=cwd, timeout=900, check=False)
  return proc.returncode, proc.stdout + proc.stderr


def test_auto_compiles_te_for_b200_and_reports_memory_against_hbm(recipe, tmp_path):
  rc, out = _run([recipe, "compile_topology=b200-1", "run_name=tc", f"base_output_directory={tmp_path}"])
  assert rc == 0, out[-3000:]
  assert "NVFP4 backend = te (nvfp4_backend=auto: compile target b200-1: every device is a GPU" in out, out[-3000:]
  assert "compiled the train step for b200-1" in out and "of the b200's" in out and "HBM" in out, out[-2000:]


def test_auto_picks_the_emulation_for_b200_where_te_cannot_load():
  """The same choice without ``scripts/te_env.sh``'s library path (TE installed, its libraries unloadable): the
  emulation, saying why. (Compiling the emulation for a GPU target is the gpu stage's.)"""
  env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "CUDA_HOME")}
  code = ("from maxtext_nvfp4.backends import capability, targets\n"
          "with capability.compile_target('b200-1', targets.devices('b200', 1)):\n"
          "  print(capability.choose_backend('auto'))")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "name='emulate'" in proc.stdout and "compile target" not in proc.stdout.split("reason=")[0], proc.stdout
  assert "Transformer Engine 2.20.2 is installed but transformer_engine.jax fails to import" in proc.stdout, proc.stdout


@pytest.mark.parametrize("extra, expect", [
    ((), "compile_topology is not set"),
    (("compile_topology=b300-4",), "Invalid compile topology: b300-4"),
    (("compile_topology=b200-0",), "at least 1"),
])
def test_bad_topologies_are_one_line_and_exit_2(recipe, extra, expect):
  rc, out = _run([recipe, *extra])
  lines = [l for l in out.splitlines() if "error:" in l]
  assert rc == 2 and len(lines) == 1 and expect in lines[0], out[-2000:]
