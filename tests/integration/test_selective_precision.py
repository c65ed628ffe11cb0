"""Selective precision inside real MaxText training runs (tiny model, CPU).

One module-scoped set of runs (2 decoder layers: one kept, one in NVFP4) shared by all assertions:
  bf16     quantization='' (baseline), 4 steps
  nvfp4    quantization=nvfp4, targets=mlp, keep_first_layers=1, switch at step 2 (forward scope),
           stochastic rounding on, checkpoint every step (local dir, synchronous)
  resumed  the same run restarted from its step-1 checkpoint (later checkpoints deleted, as after a
           crash), so it resumes across the switch and trains steps 2 and 3 again.
A recorder around ``gemm.dot_general`` logs, at run time (``jax.debug.callback``), the step and the
late-switch flag every emulated GEMM saw.
"""

import collections
import os
import shutil

import jax
import numpy as np
import pytest

import maxtext_nvfp4
from maxtext_nvfp4.core import gemm
from maxtext_nvfp4.integration import traced
from maxtext_nvfp4.integration import step as step_lib
from maxtext_helpers import losses, tiny_argv

maxtext_nvfp4.register()  # MaxText accepts quantization=nvfp4 (importing the package registers nothing)

pytestmark = pytest.mark.slow

STEPS = 4
SWITCH = 2
LAYERS = 2  # layer 0 kept in bf16, layer 1 in NVFP4: both sides of keep_first_layers, half the compile of 3
NVFP4 = {
    "quantization": "nvfp4",
    "nvfp4_targets": "mlp",
    "nvfp4_keep_first_layers": 1,
    "nvfp4_switch_at_step": SWITCH,
    "nvfp4_switch_scope": "forward",
    "enable_checkpointing": True,
    "async_checkpointing": False,
    "checkpoint_period": 1,
}


def _train(argv):
  from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel

  train.main(argv)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("sp"))
  seen: dict[str, dict[int, set]] = {}
  label = ["?"]
  orig = gemm.dot_general

  def record(step, use_switched):
    seen[label[0]].setdefault(int(step), set()).add(bool(use_switched))

  def recording_dot_general(lhs, rhs, dn, **kw):
    step = step_lib.current_step()
    if step is not None and kw.get("use_switched") is not None:
      jax.debug.callback(record, step, kw["use_switched"])
    return orig(lhs, rhs, dn, **kw)

  gemm.dot_general = recording_dot_general
  result = {}
  try:
    for name, overrides in [
        ("bf16", {"quantization": ""}),
        ("nvfp4", NVFP4),
    ]:
      label[0] = name
      seen[name] = {}
      traced.traced_gemms(reset=True)
      _train(tiny_argv(out, run_name=name, steps=STEPS, base_num_decoder_layers=LAYERS, **overrides))
      result[name] = {"losses": losses(os.path.join(out, f"{name}.jsonl")), "traced": traced.traced_gemms()}

    ckpt_dir = os.path.join(out, "nvfp4", "checkpoints")
    result["checkpoints"] = sorted(int(d) for d in os.listdir(ckpt_dir) if d.isdigit())
    for d in os.listdir(ckpt_dir):  # simulate a crash after the step-1 checkpoint (before the switch)
      if d.isdigit() and int(d) >= SWITCH:
        shutil.rmtree(os.path.join(ckpt_dir, d))
    label[0] = "resumed"
    seen["resumed"] = {}
    traced.traced_gemms(reset=True)
    _train(tiny_argv(out, run_name="nvfp4", steps=STEPS, base_num_decoder_layers=LAYERS,
                     metrics_file=os.path.join(out, "resumed.jsonl"), **NVFP4))
    result["resumed"] = {"losses": losses(os.path.join(out, "resumed.jsonl")), "traced": traced.traced_gemms()}
  finally:
    gemm.dot_general = orig
  result["seen"] = seen
  return result


def test_nvfp4_changes_the_loss_trajectory(runs):
  a, b = runs["bf16"]["losses"], runs["nvfp4"]["losses"]
  assert sorted(a) == sorted(b) == list(range(STEPS))
  assert all(np.isfinite(list(b.values())))
  assert any(a[s] != b[s] for s in a), (a, b)


def test_exactly_the_targeted_unkept_gemms_go_through_the_emulation(runs):
  traced = runs["nvfp4"]["traced"]
  keys = {(l, r) for l, r, _, _ in traced}
  # 2 layers, layer 0 kept, attention untargeted -> only the MLP GEMMs of layer 1.
  assert keys == {(l, r) for l in range(1, LAYERS) for r in ("wi_0", "wi_1", "wo")}
  for (_, _, before, after), n in traced.items():
    assert before == ("nvfp4", "nvfp4", "nvfp4") and after == ("bf16", "nvfp4", "nvfp4")
    # traced once per compiled program, not once per step (the switch does not recompile)
    assert 1 <= n < STEPS, traced
  assert len(set(traced.values())) == 1  # every GEMM traced equally often
  assert not runs["bf16"]["traced"]


def test_switch_flag_per_step_uninterrupted(runs):
  seen = runs["seen"]["nvfp4"]
  assert seen == {s: {s >= SWITCH} for s in range(STEPS)}, seen
  assert not runs["seen"]["bf16"]


def test_resume_across_the_switch_matches_uninterrupted_run(runs):
  assert runs["checkpoints"][:SWITCH] == list(range(SWITCH))  # the step-1 checkpoint existed
  resumed, full = runs["resumed"]["losses"], runs["nvfp4"]["losses"]
  assert sorted(resumed) == list(range(SWITCH, STEPS)), resumed
  for s in resumed:
    assert resumed[s] == full[s], (s, resumed, full)  # bit-identical, stochastic rounding included
  assert runs["seen"]["resumed"] == {s: {True} for s in range(SWITCH, STEPS)}
