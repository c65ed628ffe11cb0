"""``python -m maxtext_nvfp4.sft`` / ``.distill`` end to end on a tiny checkpoint, and their one-line refusals.

One module-scoped run: a tiny Llama checkpoint (tests/export_families.py: MaxText's init tree, no training compile)
fine-tuned 2 steps with MaxText's own SFT (the pre-training loop with use_sft) in ``nvfp4_qat=serving``, then
exported. Checked:
  * the run trained from the checkpoint (finite losses in MaxText's metrics file, a new checkpoint, the run record
    with use_sft) and every serving GEMM of the train step used the fp32 master kernels of its fused group;
  * the export of what was trained decodes, from the file (test_export.py's own reader and NVFP4 decoder), to
    exactly the weights the serving forward multiplied (core/serving_gemm.served_weights of the trained
    checkpoint's kernels), every q/k/v/o/gate/up/down of every layer, bit for bit;
  * bad input is one line and exit code 2 before MaxText starts: no checkpoint to start from, a checkpoint of
    another shape, a teacher/student mismatch, a QAT mode nvfp4_backend=te cannot run, LoRA.
The other modes' GEMMs are checked in tests/core/test_serving_gemm.py (full is pre-training's path).
"""

import os

import numpy as np
import pytest

import export_families
from maxtext_helpers import read_metrics

pytestmark = pytest.mark.slow

FAMILY = "llama2"  # 2 layers, d=64, 4/2 heads of 32: the query's sqrt(32) export factor is not a power of two
SFT = export_families.SERVING_QAT


def _args(tiny, **extra):
  return export_families.merged_args(tiny["overrides"], **extra)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("posttrain"))
  made = export_families.make(FAMILY, out, seed=0)
  export_families.as_training_checkpoint(made["ckpt"])
  return {**made, "out": out}


@pytest.fixture(scope="module")
def served(tiny):
  from maxtext_nvfp4.integration import serving_layout  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import export  # pylint: disable=import-outside-toplevel

  serving_layout.SERVED.read(reset=True)
  export_families.fine_tune(tiny, tiny["out"], "sft", **SFT)
  run = os.path.join(tiny["out"], "sft")
  hf = os.path.join(run, "hf")
  assert export.cli_main([os.path.join(run, "checkpoints"), "--out", hf, "--calibration-batches", "1",
                          "--calibrate-on-synthetic", "--no-tokenizer"]) == 0
  return {"run": run, "hf": hf, "served": serving_layout.SERVED.read()}


def test_sft_trains_from_the_checkpoint_with_every_serving_gemm_on_master_weights(tiny, served):
  from maxtext_nvfp4.tools import run_record  # pylint: disable=import-outside-toplevel

  losses = [r["learning/loss"] for r in read_metrics(os.path.join(tiny["out"], "sft.jsonl")) if "learning/loss" in r]
  assert len(losses) == 2 and all(np.isfinite(losses))
  assert sorted(os.listdir(os.path.join(served["run"], "checkpoints"))) == ["0", "1"]
  assert "use_sft=true" in run_record.find(os.path.join(served["run"], "checkpoints", "1", "items"))[1]
  roles = {"query", "key", "value", "out", "wi_0", "wi_1", "wo"}
  assert {(layer, role) for layer, role, _ in served["served"]} == {(l, r) for l in (0, 1) for r in roles}
  assert all(on_masters for _, _, on_masters in served["served"])


def test_the_export_is_what_the_serving_forward_trained_against_bit_for_bit(served):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.core import serving_gemm  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel
  from test_export import decode_nvfp4, read_safetensors  # pylint: disable=import-outside-toplevel

  params = checkpoint.read_params(os.path.join(served["run"], "checkpoints", "1", "items"))
  tensors = read_safetensors(os.path.join(served["hf"], "model.safetensors"))
  c = float(np.float32(np.sqrt(32)))  # llama2's conversion scales the query by sqrt(head_dim)
  groups = {"self_attention": (("query", "q_proj", c), ("key", "k_proj", 1.0), ("value", "v_proj", 1.0)),
            "mlp": (("wi_0", "gate_proj", 1.0), ("wi_1", "up_proj", 1.0))}
  singles = {"self_attention": (("out", "o_proj"),), "mlp": (("wo", "down_proj"),)}
  hf_module = {"self_attention": "self_attn", "mlp": "mlp"}
  checked = 0
  for layer in (0, 1):
    for module in ("self_attention", "mlp"):
      for members in (groups[module], *[(m + (1.0,),) for m in singles[module]]):
        kernels = [params[f"params-decoder-layers_{layer}-{module}-{role}-kernel"] for role, _, _ in members]
        group_hf = tuple(jnp.asarray(_hf(k, role)) for k, (role, _, _) in zip(kernels, members))
        factors = tuple(f for _, _, f in members)
        for i, (_, name, _) in enumerate(members):
          got = np.asarray(serving_gemm.served_weights(group_hf, serving_gemm.Member(index=i, factors=factors)))
          pre = f"model.layers.{layer}.{hf_module[module]}.{name}"
          ref = decode_nvfp4(tensors[pre + ".weight"][1], tensors[pre + ".weight_scale"][1],
                             tensors[pre + ".weight_scale_2"][1])
          np.testing.assert_array_equal(got.view(np.uint32), ref.astype(np.float32).view(np.uint32), err_msg=pre)
          checked += 1
  assert checked == 2 * 7


def _hf(kernel, role):
  """A MaxText kernel in the export's [out, in] layout (contracting dims first: out's are (heads, head_dim))."""
  k = np.asarray(kernel, np.float32)
  n_in = int(np.prod(k.shape[:2])) if role == "out" else k.shape[0]
  return k.reshape(n_in, -1).T


def _one_line_exit_2(main, argv, capsys, *needles):
  assert main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert "\n" not in err and all(n in err for n in needles), err
  return err


def test_no_checkpoint_to_start_from(tiny, capsys):
  from maxtext_nvfp4.tools import posttrain  # pylint: disable=import-outside-toplevel

  _one_line_exit_2(posttrain.sft_main, _args(tiny, run_name="x", **SFT), capsys,
                   "maxtext-nvfp4 sft: error: load_parameters_path is not set", "enable_checkpointing=true")
  _one_line_exit_2(posttrain.sft_main, _args(tiny, run_name="x", load_parameters_path=tiny["out"] + "/nope", **SFT),
                   capsys, "no such directory")


def test_a_checkpoint_of_another_shape(tiny, capsys):
  from maxtext_nvfp4.tools import posttrain  # pylint: disable=import-outside-toplevel

  _one_line_exit_2(posttrain.sft_main, _args(tiny, run_name="x", load_parameters_path=tiny["ckpt"],
                                             base_num_decoder_layers=3, base_mlp_dim=256, **SFT), capsys,
                   "num_decoder_layers: checkpoint 2, config 3", "mlp_dim: checkpoint 128, config 256")


def test_teacher_student_mismatch(tiny, tmp_path, capsys):
  from maxtext_nvfp4.tools import posttrain  # pylint: disable=import-outside-toplevel

  recipe = tmp_path / "d.yml"
  recipe.write_text("base_config: base.yml\nteacher_overrides:\n  quantization: ''\n  vocab_size: 512\n"
                    f"  load_parameters_path: {tiny['ckpt']}\n")
  _one_line_exit_2(posttrain.distill_main, [str(recipe), *_args(tiny, run_name="x", load_parameters_path=tiny["ckpt"],
                                                                 **SFT)], capsys,
                   "maxtext-nvfp4 distill: error: teacher/student mismatch: vocab_size is 512 for the teacher")
  recipe.write_text("base_config: base.yml\nteacher_overrides:\n  quantization: ''\n")
  _one_line_exit_2(posttrain.distill_main, [str(recipe), *_args(tiny, run_name="x", load_parameters_path=tiny["ckpt"],
                                                                 **SFT)], capsys,
                   "teacher_overrides.load_parameters_path is not set")


def test_a_qat_mode_te_cannot_run_and_lora(tiny, capsys):
  from maxtext_nvfp4.tools import posttrain  # pylint: disable=import-outside-toplevel

  _one_line_exit_2(posttrain.sft_main, _args(tiny, run_name="x", load_parameters_path=tiny["ckpt"],
                                             **{**SFT, "nvfp4_backend": "te"}), capsys,
                   "nvfp4_backend=te cannot run nvfp4_qat=serving")
  _one_line_exit_2(posttrain.sft_main, [*_args(tiny, run_name="x", load_parameters_path=tiny["ckpt"], **SFT),
                                        "lora.enable_lora=true", "lora.lora_rank=4"], capsys,
                   "maxtext-nvfp4 sft: error: LoRA", "Tunix")


def test_distill_qad_trains_the_nvfp4_student_with_its_step_and_exports(tiny, tmp_path):
  """QAD through MaxText's distillation trainer (Tunix): an NVFP4 student from the bf16 teacher's checkpoint. The
  student's GEMMs are traced inside the distillation step with its step published (traced_gemms counts only
  those), the run stops at `steps` and saves the student, which exports."""
  pytest.importorskip("tunix")
  from maxtext_nvfp4.integration import traced  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import export  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import posttrain  # pylint: disable=import-outside-toplevel

  keys = dict(a.split("=", 1) for a in _args(tiny, run_name="qad", load_parameters_path=tiny["ckpt"],
                                              **{**SFT, "nvfp4_qat": "full", "checkpoint_period": 100}))
  recipe = tmp_path / "qad.yml"  # MaxText gives the teacher the recipe file only: the model lives there
  recipe.write_text("base_config: base.yml\n" + "".join(
      f"{k}: {v}\n" for k, v in keys.items() if k not in ("run_name", "load_parameters_path", "quantization",
                                                            "nvfp4_qat", "metrics_file", "model_name",
                                                            "override_model_config"))
                    + f"teacher_overrides:\n  quantization: ''\n  load_parameters_path: {tiny['ckpt']}\n")
  traced.traced_gemms(reset=True)
  assert posttrain.distill_main([str(recipe), "run_name=qad", "quantization=nvfp4",
                                 f"load_parameters_path={tiny['ckpt']}"]) == 0
  student = traced.traced_gemms()
  assert {(layer, role) for layer, role, *_ in student} >= {(0, "query"), (1, "wo")}
  run = os.path.join(tiny["out"], "qad")
  assert os.listdir(os.path.join(run, "checkpoints")) and os.path.isdir(os.path.join(run, "checkpoints", "2",
                                                                                       "model_params"))
  assert export.cli_main([os.path.join(run, "checkpoints"), "--out", os.path.join(run, "hf"), "--calibration-batches",
                          "1", "--calibrate-on-synthetic", "--no-tokenizer"]) == 0
