"""``maxtext-nvfp4 study`` on real MaxText: an NVFP4 arm (stochastic rounding, RHT, diagnostics) on a grain
parquet dataset, stopped by SIGKILL after its first chunk's checkpoint and resumed by a second call. The first
chunk is told to run 2 steps past its checkpoint (``--verify-overlap 2``), so the steps the resumed chunk
recomputes were also computed by the uninterrupted process: they must be equal bit for bit (model, optimizer,
data iterator position and SR keys all restored). Two MaxText processes of a tiny model."""

import json
import math
import os

import pytest

from maxtext_helpers import TINY_MODEL
from maxtext_nvfp4.tools import data, study
from maxtext_nvfp4.tools.cli import main as cli

# Minutes on a busy 2-core machine (566 s measured at load ~15), so not in the core suite: its own stage runs it
# with MAXTEXT_NVFP4_STUDY_RESUME=1 (see the report of issue 29 for the scripts/test.sh line).
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("MAXTEXT_NVFP4_STUDY_RESUME") != "1",
    reason="study resume stage: MAXTEXT_NVFP4_STUDY_RESUME=1 pytest -n 0 tests/tools/test_study_resume.py")]

STEPS, CHUNK, EVAL = 40, 5, 5


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
  root = tmp_path_factory.mktemp("study_resume")
  manifest, _ = data.prepare(data.PrepareOptions(out=str(root / "ds"), max_mb=0.1, vocab_size=300), progress=False)
  keys = dict(a.split("=", 1) for a in data.maxtext_args(manifest))
  model = {**TINY_MODEL, "base_num_decoder_layers": 2, "vocab_size": keys.pop("vocab_size")}
  recipe = ["base_config: base.yml", "attention: dot_product", "scan_layers: false", "enable_goodput_recording: false",
            "monitor_goodput: false", "enable_tensorboard: false", "log_config: false", "learning_rate: 1.e-2",
            "grain_worker_count: 0", "grain_worker_count_eval: 0", "quantization: nvfp4",
            "nvfp4_stochastic_rounding: true", "nvfp4_rht: true"]
  recipe += [f"{k}: {v}" for k, v in {**model, **keys}.items()]
  recipes = root / "recipes"
  recipes.mkdir()
  (recipes / "demo_nvfp4.yml").write_text("\n".join(recipe) + "\n")
  d = root / "study"
  base = ["study", str(d), "--verify-overlap", "2", "--max-chunks", "1", "--poll", "0.02", "--no-report"]
  assert cli(base + ["--recipes-dir", str(recipes), "--arms", "nvfp4", "--steps", str(STEPS), "--chunk", str(CHUNK),
                     "--eval-interval", str(EVAL), "--eval-steps", "1", "--diagnostics-interval", "2"]) == 0
  first = json.loads((d / "state.json").read_text())["arms"]["nvfp4"]
  chunk1 = study.read_records(d / "arms" / "nvfp4" / "chunks" / "from_0000000_000.jsonl")
  assert cli(base) == 0
  return {"dir": d, "first": first, "chunk1": chunk1, "state": json.loads((d / "state.json").read_text())["arms"]["nvfp4"]}


def test_the_first_chunk_stopped_at_a_checkpoint_after_running_past_it(resumed):
  p1 = resumed["first"]["steps_done"] - 1
  # the chunk ends at a checkpoint: the first one, or a later one when the stop came late on a busy machine
  assert p1 >= CHUNK and p1 % CHUNK == 0 and resumed["first"]["status"] == "stopped"
  train, evals = resumed["chunk1"]
  assert max(train) >= p1 + 2  # the overlap the second chunk recomputes
  assert max(train) < STEPS - 1  # stopped, not finished


def test_resumed_steps_equal_the_uninterrupted_process_bit_for_bit(resumed):
  d, st = resumed["dir"], resumed["state"]
  p1 = resumed["first"]["steps_done"] - 1
  train1, evals1 = resumed["chunk1"]
  chunk2 = d / "arms" / "nvfp4" / "chunks" / f"from_{p1 + 1:07d}_000.jsonl"
  train2, evals2 = study.read_records(chunk2)
  assert min(train2) == p1 + 1  # MaxText restored checkpoint p1 and went on from there
  overlap = sorted(set(train1) & set(train2))
  assert len(overlap) >= 2
  for s in overlap:
    a, b = train1[s], train2[s]
    assert a["learning/loss"] == b["learning/loss"] and a["learning/grad_norm"] == b["learning/grad_norm"], s
    diag = [k for k in a if k.startswith("nvfp4/")]
    assert all(a[k] == b[k] for k in diag), s
  assert any(k.startswith("nvfp4/") for s in overlap for k in train2[s])  # diagnostics steps were recomputed too
  for s in set(evals1) & set(evals2):
    assert evals1[s]["eval/avg_loss"] == evals2[s]["eval/avg_loss"]
  assert st["rechecked_steps"] >= len(overlap) and st["mismatched_steps"] == []
  # batches differ from step to step (a data iterator restarted at the resume would not match the overlap)
  assert len({train1[s]["learning/loss"] for s in range(p1 + 1)}) == p1 + 1


def test_the_arm_metrics_are_every_step_once_with_the_evals(resumed):
  d, st = resumed["dir"], resumed["state"]
  p2 = st["steps_done"] - 1
  assert p2 > resumed["first"]["steps_done"] and st["chunks"] == 2
  recs = [json.loads(l) for l in (d / "arms" / "nvfp4" / "metrics.jsonl").read_text().splitlines()]
  train = [int(r["step"]) for r in recs if "learning/loss" in r]
  evals = [int(r["step"]) for r in recs if "eval/avg_loss" in r]
  assert train == list(range(p2 + 1)) and evals == list(range(0, p2 + 1, EVAL))
  assert all(math.isfinite(r["learning/loss"]) for r in recs if "learning/loss" in r)
