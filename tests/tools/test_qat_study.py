"""benchmarks/accuracy/qat_study.py without training: a finished arm is read from its eval.json (nothing runs), an
interrupted arm's folder is removed before it runs again, the table pairs each arm's W4A4 with PTQ's by seed, and
the published tables reprint from the published study files."""

import importlib.util
import json
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "qat_study", Path(__file__).resolve().parents[2] / "benchmarks" / "accuracy" / "qat_study.py")
qat_study = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(qat_study)


def _losses(bf16, w4a16, w4a4):
  return {"bf16": bf16, "nvfp4-w4a16": w4a16, "nvfp4-w4a4": w4a4}


def test_a_finished_arm_is_read_and_an_interrupted_one_starts_over(tmp_path, monkeypatch):
  ran = []
  monkeypatch.setattr(qat_study, "_run", lambda cmd, log: ran.append(cmd))
  (tmp_path / "full_s0.eval.json").write_text(json.dumps({"losses": _losses(5.0, 5.1, 5.2)}))
  assert qat_study.arm("full", 0, 40, str(tmp_path), 8) == _losses(5.0, 5.1, 5.2)
  assert not ran
  partial = tmp_path / "forward_s1" / "checkpoints" / "0"
  partial.mkdir(parents=True)
  with pytest.raises(FileNotFoundError):  # the stubbed runs write no eval.json
    qat_study.arm("forward", 1, 40, str(tmp_path), 8, family="moe")
  assert not (tmp_path / "forward_s1").exists()
  assert ran[0][2:4] == ["maxtext_nvfp4.sft", "sft_demo_moe_nvfp4"] and "nvfp4_qat=forward" in ran[0]
  assert ran[1][2:4] == ["maxtext_nvfp4.tools.cli", "eval-quantized"]


def test_the_table_pairs_w4a4_with_ptq_by_seed():
  losses = {"bf16": {0: _losses(5.0, 5.01, 5.02), 1: _losses(5.1, 5.11, 5.14)},
            "forward": {0: _losses(5.0, 5.005, 5.01), 1: _losses(5.1, 5.12, 5.15)}}
  text = qat_study.table(losses, [0, 1], 40)
  forward = next(line for line in text.splitlines() if line.startswith("forward"))
  assert "-0.0100" in forward and "+0.0100" in forward  # per seed: 5.01 - 5.02, 5.15 - 5.14
  assert forward.split()[-3] == "+0.0000"  # their mean


def test_a_refused_arm_is_left_out_and_the_study_goes_on(tmp_path, monkeypatch):
  """nvfp4_qat=serving on routed experts exits 2 with one line: the study records it and runs the other arms."""
  def fake_arm(name, seed, steps, out, batches, family="dense"):
    if name == "serving":
      raise qat_study.Refused("maxtext-nvfp4 sft: error: nvfp4_qat=serving covers ... use nvfp4_qat=forward")
    return _losses(5.0, 5.01, 5.02)
  monkeypatch.setattr(qat_study, "arm", fake_arm)
  assert qat_study.main(["--seeds", "0", "1", "--arms", "bf16", "serving", "forward", "--out", str(tmp_path),
                         "--family", "moe"]) == 0
  study = json.loads((tmp_path / "study.json").read_text())
  assert sorted(study["losses"]) == ["bf16", "forward"] and "nvfp4_qat=forward" in study["refused"]["serving"]


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_the_published_tables_reprint_from_their_study_files(family):
  """benchmarks/accuracy/RESULTS.md's QAT tables are what qat_study.table prints from the published study.json
  (benchmarks/accuracy/qat/<family>_study.json, the study's own file): a number edited in either fails here."""
  root = Path(__file__).resolve().parents[2] / "benchmarks" / "accuracy"
  study = json.loads((root / "qat" / f"{family}_study.json").read_text())
  losses = {arm: {int(seed): v for seed, v in per_seed.items()} for arm, per_seed in study["losses"].items()}
  assert sorted(losses["bf16"]) == study["seeds"] == [0, 1, 2]
  text = qat_study.table(losses, study["seeds"], study["steps"])
  assert text in (root / "RESULTS.md").read_text(), text
