"""Determinism, checkpoints across precisions, and exact resume (stochastic rounding on) after a SIGKILL.

One module-scoped set of MaxText runs (tiny model, CPU, local synchronous Orbax checkpoints every step):

  nvfp4            quantization=nvfp4 (SR + RHT on) from scratch, STEPS steps, checkpoints 0..STEPS-1
  nvfp4_again      the same run again: every step's loss and gradient/parameter norms bit-identical
  bf16_from_nvfp4  quantization='' restarted from nvfp4's step-0 checkpoint; writes its own checkpoints
  fp8_from_nvfp4   quantization=fp8 restarted from nvfp4's step-0 checkpoint; writes its own checkpoints
  nvfp4_from_fp8   nvfp4 restarted from fp8_from_nvfp4's step-1 checkpoint

plus a real ``python -m maxtext_nvfp4.train`` process killed with SIGKILL after its first complete checkpoint,
restarted (in this process) from what it left: the resumed steps equal the uninterrupted nvfp4 run bit for bit,
stochastic rounding included (the SR bits depend on seed, step, layer and role only:
tests/integration/test_determinism.py).

MaxText's checkpoint N holds the state after step N's update, so a run restored from it starts at step
N + 1, whose loss is computed from exactly the restored parameters: with the same precision it equals
the writer's loss at N + 1 bit for bit; in another precision it is close (same weights, other GEMMs).
nvfp4 reading a bf16-written checkpoint needs no run of its own: test_nvfp4_adds_nothing_to_the_checkpoint
shows the two trees are the same (paths, shapes, dtypes), and nvfp4 restoring that tree is the SIGKILL test.
The compiled train steps are shared through JAX's persistent compilation cache, so only the first run
of each precision compiles.
"""

import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import maxtext_nvfp4
from maxtext_helpers import TINY_MODEL, losses, read_metrics, tiny_argv

maxtext_nvfp4.register()  # MaxText accepts quantization=nvfp4 (importing the package registers nothing)

pytestmark = pytest.mark.slow

STEPS = 4
# A small 1-layer Llama (checkpointing does not depend on the depth; one layer halves the compiles); learning
# rate high enough that one step moves the loss far more than the precision does (so "close to the writer's
# loss" cannot be passed by a run that restarted from scratch; 1e-2 moved this model's first loss by 23%,
# short of the 25% asserted below).
SMALL = dict(base_emb_dim=32, base_num_query_heads=2, base_num_kv_heads=2, base_mlp_dim=64,
             base_num_decoder_layers=1, vocab_size=128, steps=STEPS, learning_rate=2e-2)
CKPT = dict(enable_checkpointing=True, async_checkpointing=False, checkpoint_period=1)
PRECISIONS = {"nvfp4": {"quantization": "nvfp4"}, "bf16": {"quantization": ""}, "fp8": {"quantization": "fp8"}}
# |loss in another precision - writer's loss| at the same step, relative (measured 0.7% to 1.6%; the first
# training step moves the loss by ~40%).
CLOSE = 0.05
# The determinism check compares these metrics of two identical runs bit for bit.
COMPARED = ("learning/loss", "learning/grad_norm", "learning/raw_grad_norm", "learning/param_norm")


def run_argv(out, name, precision, **extra):
  return tiny_argv(out, run_name=name, **SMALL, **CKPT, **PRECISIONS[precision], **extra)


def _train(argv):
  from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel

  train.main(argv)


def ckpt_dir(out, run):
  return os.path.join(out, run, "checkpoints")


def complete_steps(out, run) -> list[int]:
  """Committed checkpoint steps (Orbax writes a tmp dir and renames it to the step number when done)."""
  d = ckpt_dir(out, run)
  if not os.path.isdir(d):
    return []
  return sorted(int(s) for s in os.listdir(d) if s.isdigit() and os.path.exists(os.path.join(d, s, "commit_success.txt")))


def seed_from(out, src, step, dst):
  """Start run ``dst`` with only checkpoint ``step`` of run ``src`` (a fresh run dir, as after a copy)."""
  os.makedirs(ckpt_dir(out, dst))
  shutil.copytree(os.path.join(ckpt_dir(out, src), str(step)), os.path.join(ckpt_dir(out, dst), str(step)))


def tree(out, run, step) -> dict:
  """``{path: (shape, dtype)}`` of a checkpoint, from Orbax's metadata (no array is read)."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  meta = ocp.PyTreeCheckpointer().metadata(os.path.join(ckpt_dir(out, run), str(step), "items"))
  t = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
  return {jax.tree_util.keystr(k): (tuple(v.shape), str(v.dtype)) for k, v in jax.tree_util.tree_flatten_with_path(t)[0]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("ckpt"))
  plan = [
      ("nvfp4", "nvfp4", None),
      ("nvfp4_again", "nvfp4", None),
      ("bf16_from_nvfp4", "bf16", ("nvfp4", 0)),
      ("fp8_from_nvfp4", "fp8", ("nvfp4", 0)),
      ("nvfp4_from_fp8", "nvfp4", ("fp8_from_nvfp4", 1)),
  ]
  result = {"out": out, "seeded": {}}
  for name, precision, seed in plan:
    if seed is not None:
      seed_from(out, *seed, name)
      result["seeded"][name] = seed
    _train(run_argv(out, name, precision))
    result[name] = losses(os.path.join(out, f"{name}.jsonl"))
    result[name + "/ckpts"] = complete_steps(out, name)
  print("\ncheckpoint runs' losses:", {name: result[name] for name, _, _ in plan})
  return result


def test_writer_checkpoints_every_step_and_trains(runs):
  assert sorted(runs["nvfp4"]) == list(range(STEPS))
  assert runs["nvfp4/ckpts"] == list(range(STEPS))
  w = runs["nvfp4"]
  assert all(np.isfinite(list(w.values())))
  assert w[0] - w[1] > 5 * CLOSE * w[1], w  # one step moves the loss far more than CLOSE


def test_nvfp4_adds_nothing_to_the_checkpoint(runs):
  out = runs["out"]
  nv, bf = tree(out, "nvfp4", 1), tree(out, "bf16_from_nvfp4", 1)
  assert any("wi_0" in p and "kernel" in p for p in nv)
  assert nv == bf  # same paths, shapes and dtypes: nothing added, nothing changed
  # MaxText's own quantization=fp8 (delayed scaling) does add state: amax histories and scales.
  fp = tree(out, "fp8_from_nvfp4", 1)
  extra = set(fp) - set(nv)
  assert not set(nv) - set(fp) and extra and all("Fp8DirectDotGeneralOp" in p for p in extra)
  assert {p: fp[p] for p in nv} == nv


def test_two_identical_runs_are_bitwise_identical(runs):
  """Two identical NVFP4 runs (stochastic rounding and RHT on) give bitwise-identical metrics at every step."""
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.core import settings as settings_lib  # pylint: disable=import-outside-toplevel

  s = settings_lib.from_config(pyconfig.initialize(run_argv(runs["out"], "nvfp4", "nvfp4")))
  assert s.stochastic_rounding and s.rht  # randomness is really in play
  a, b = (read_metrics(os.path.join(runs["out"], f"{name}.jsonl")) for name in ("nvfp4", "nvfp4_again"))
  assert [m["step"] for m in a] == [m["step"] for m in b] == list(range(STEPS))
  for ma, mb in zip(a, b):
    for k in COMPARED:
      assert np.float32(ma[k]).tobytes() == np.float32(mb[k]).tobytes(), (ma["step"], k, ma[k], mb[k])
  losses_a = [m["learning/loss"] for m in a]
  assert len(set(losses_a)) == len(losses_a)  # it trains (not a constant that would compare equal trivially)


@pytest.mark.parametrize("reader, writer, first", [
    ("bf16_from_nvfp4", "nvfp4", 1),
    ("fp8_from_nvfp4", "nvfp4", 1),
    ("nvfp4_from_fp8", "fp8_from_nvfp4", 2),
])
def test_checkpoint_restores_across_precisions(runs, reader, writer, first):
  got, ref = runs[reader], runs[writer]
  assert runs["seeded"][reader] == (writer, first - 1)
  assert sorted(got) == list(range(first, STEPS)), got  # step counter continues, training goes on
  assert abs(got[first] - ref[first]) <= CLOSE * ref[first], (got, ref)  # same weights, other GEMM precision
  assert got[STEPS - 1] < got[first]  # it keeps training from there
  assert runs[reader + "/ckpts"][-1] == STEPS - 1  # and writes its own checkpoints


# ---------------------------------------------------------------------------------------------------
# Crash safety: a real training process killed with SIGKILL after its first complete checkpoint, then
# exact resume (stochastic rounding on) from what it left
# ---------------------------------------------------------------------------------------------------
def _cli(out, name, metrics):
  argv = run_argv(out, name, "nvfp4", metrics_file=metrics, skip_jax_distributed_system=True)[1:]
  return [sys.executable, "-m", "maxtext_nvfp4.train", *argv]


def test_sigkill_mid_run_then_restart_matches_uninterrupted_run(runs):
  out = runs["out"]
  name = "killed"
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  log = open(os.path.join(out, "killed.log"), "w", encoding="utf-8")  # pylint: disable=consider-using-with
  proc = subprocess.Popen(_cli(out, name, os.path.join(out, "killed.jsonl")), stdout=log, stderr=subprocess.STDOUT,
                          env=env)
  try:
    deadline = time.time() + 600
    while not complete_steps(out, name):
      assert proc.poll() is None, f"exited ({proc.returncode}) before any checkpoint completed"
      assert time.time() < deadline, "no checkpoint within 600 s"
      time.sleep(0.02)
    alive = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    log.close()
  assert alive and proc.returncode == -signal.SIGKILL
  done = complete_steps(out, name)
  last = done[-1]
  assert last < STEPS - 1, f"the run had finished ({done}) before the kill"

  # Restart with the same keys, in this process (the restore is MaxText's either way; a second process would
  # only import MaxText again). Fresh metrics file to see only the resumed steps.
  metrics = os.path.join(out, "restarted.jsonl")
  _train(run_argv(out, name, "nvfp4", metrics_file=metrics, skip_jax_distributed_system=True))
  resumed = losses(metrics)
  assert sorted(resumed) == list(range(last + 1, STEPS)), (done, resumed)  # the step counter continues
  for s in resumed:  # the uninterrupted in-process run, bit for bit (stochastic rounding and RHT on)
    assert resumed[s] == runs["nvfp4"][s], (s, resumed, runs["nvfp4"])
  assert all(m["run_name"] == name for m in read_metrics(metrics))
  assert complete_steps(out, name)[-1] == STEPS - 1


def test_the_checkpoint_a_training_run_wrote_exports(runs, tmp_path):
  """The user's path end to end: the Orbax checkpoint a real NVFP4 training run wrote (not an init-made one, as
  in tests/tools/test_export*.py) -> ``maxtext-nvfp4 export`` -> every decoder linear as an NVFP4 tensor of its
  layer's shape (packed uint8 [out, in/2], E4M3 block scales [out, in/16], a finite positive global scale)."""
  import json  # pylint: disable=import-outside-toplevel

  from safetensors import safe_open  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.tools import export  # pylint: disable=import-outside-toplevel

  out, hf = runs["out"], tmp_path / "hf"
  rc = export.cli_main([ckpt_dir(out, "nvfp4"), "--out", str(hf), "--calibration-batches", "1",
                        "--calibrate-on-synthetic", "--no-tokenizer", *run_argv(out, "nvfp4", "nvfp4")[2:]])
  assert rc == 0
  assert json.loads((hf / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "NVFP4"
  head_dim = TINY_MODEL["head_dim"]  # SMALL keeps the tiny model's
  emb, mlp, q = SMALL["base_emb_dim"], SMALL["base_mlp_dim"], SMALL["base_num_query_heads"] * head_dim
  kv = SMALL["base_num_kv_heads"] * head_dim
  want = {"self_attn.q_proj": (q, emb), "self_attn.k_proj": (kv, emb), "self_attn.v_proj": (kv, emb),
          "self_attn.o_proj": (emb, q), "mlp.gate_proj": (mlp, emb), "mlp.up_proj": (mlp, emb),
          "mlp.down_proj": (emb, mlp)}
  with safe_open(str(hf / "model.safetensors"), framework="numpy") as f:
    names = set(f.keys())
    for lin, (o, i) in want.items():
      p = f"model.layers.0.{lin}"
      assert {p + ".weight", p + ".weight_scale", p + ".weight_scale_2"} <= names, sorted(names)
      assert f.get_slice(p + ".weight").get_dtype() == "U8" and f.get_slice(p + ".weight").get_shape() == [o, i // 2]
      assert f.get_slice(p + ".weight_scale").get_shape() == [o, i // 16]
      s2 = float(f.get_tensor(p + ".weight_scale_2"))
      assert np.isfinite(s2) and s2 > 0, (p, s2)
