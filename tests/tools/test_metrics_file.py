"""metrics_file: truncated once at the start of a fresh run (MaxText 0.2.5 truncated at every step-0 eval record)."""

import json
import os
import types

import pytest

import maxtext_nvfp4
from maxtext_helpers import losses, read_metrics, tiny_argv

from maxtext_nvfp4.tools import metrics

from maxtext.common import metric_logger  # pylint: disable=wrong-import-order

maxtext_nvfp4.register()  # MaxText accepts quantization=nvfp4 (importing the package registers nothing)


def _logger(path, start_step=0):
  """MetricLogger.write_metrics_locally bound to a minimal logger (a new instance = a new run)."""
  fake = types.SimpleNamespace(config=types.SimpleNamespace(metrics_file=str(path), run_name="r"), start_step=start_step)
  return lambda metrics, step: metric_logger.MetricLogger.write_metrics_locally(fake, {"scalar": metrics}, step)


def _records(path):
  return [(r["step"], r.get("learning/loss"), r.get("eval/avg_loss")) for r in map(json.loads, path.read_text().splitlines())]


OLD = '{"step": 7.0, "learning/loss": 1.0, "run_name": "old"}\n'


def test_fresh_run_truncates_once_and_appends_step_0_eval_records(tmp_path):
  path = tmp_path / "m.jsonl"
  path.write_text(OLD)
  write = _logger(path)
  write({"learning/loss": 2.0}, 0)  # a fresh run: the old file goes
  write({"eval/avg_loss": 3.0}, 0)  # the eval after train step 0: appended (MaxText truncated here)
  write({"learning/loss": 4.0}, 1)
  write({"eval/avg_loss": 5.0}, 0)  # the next eval's first running snapshot (eval step 0): appended
  assert _records(path) == [(0.0, 2.0, None), (0.0, None, 3.0), (1.0, 4.0, None), (0.0, None, 5.0)]
  assert all(json.loads(line)["run_name"] == "r" for line in path.read_text().splitlines())


def test_eval_snapshot_before_train_step_0_starts_the_file(tmp_path):
  # An eval at step 0 is flushed before train step 0's record (MaxText writes metrics one step late).
  path = tmp_path / "m.jsonl"
  path.write_text(OLD)
  write = _logger(path)
  write({"eval/avg_loss": 3.0}, 0)
  write({"learning/loss": 2.0}, 0)
  assert _records(path) == [(0.0, None, 3.0), (0.0, 2.0, None)]


def test_resumed_run_appends(tmp_path):
  path = tmp_path / "m.jsonl"
  path.write_text(OLD)
  write = _logger(path, start_step=5)
  write({"eval/avg_loss": 3.0}, 0)  # a resumed run's eval snapshot never truncates
  write({"learning/loss": 2.0}, 5)
  assert _records(path) == [(7.0, 1.0, None), (0.0, None, 3.0), (5.0, 2.0, None)]


def test_plugin_written_file_reads_without_truncation_note(tmp_path):
  # The order MaxText writes a run with eval_interval=2: the eval at step 0 first (running snapshot, summary),
  # then training records; the next eval's first snapshot has eval step 0 again.
  path = tmp_path / "m.jsonl"
  path.write_text(OLD)
  write = _logger(path)
  write({"eval/avg_loss": 3.0, "eval/step_time_seconds": 0.1}, 0)
  write({"eval/avg_loss": 3.0, "eval/avg_z_loss": 0.0}, 0)
  for s in range(3):
    write({"learning/loss": 2.0 - s}, s)
  write({"eval/avg_loss": 2.5, "eval/step_time_seconds": 0.1}, 0)
  write({"eval/avg_loss": 2.5, "eval/avg_z_loss": 0.0}, 2)
  run = metrics.read(path)
  assert run.warnings == () and run.malformed == 0 and run.repeated_steps == 0
  assert losses(str(path)) == {0: 2.0, 1: 1.0, 2: 0.0}
  assert run.eval_loss == {0: 3.0, 2: 2.5} and run.running_evals == 2
  # What plain MaxText 0.2.5 leaves of the same run (truncated at the second eval's step-0 snapshot) is flagged.
  path.write_text("".join(line + "\n" for line in path.read_text().splitlines()[5:]))
  assert metrics.read(path, strict=False).steps == {}
  path.write_text(path.read_text() + '{"step": 3.0, "learning/loss": -1.0}\n')
  assert metrics.read(path).warnings[0].startswith(
      "m.jsonl starts with an eval record and its first training step is 3: plain MaxText truncated it")


@pytest.mark.slow
def test_run_with_eval_keeps_every_training_step(tmp_path):
  from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel

  steps = 4
  # Plain MaxText (no quantization): the fix is in the metrics writer, not the model. eval after train
  # steps 0 and 2, two eval batches each (two running-eval snapshots with steps 0 and 1).
  train.main(tiny_argv(str(tmp_path), run_name="ev", steps=steps, quantization="", eval_interval=2, eval_steps=2,
                       base_num_decoder_layers=1))
  recs = read_metrics(os.path.join(str(tmp_path), "ev.jsonl"))
  train_steps = [int(r["step"]) for r in recs if "learning/loss" in r]
  assert train_steps == list(range(steps))
  # The final eval summaries (they carry eval/avg_z_loss, the running snapshots do not) after steps 0 and 2.
  evals = [int(r["step"]) for r in recs if "eval/avg_z_loss" in r]
  assert evals == [0, 2]
  # Both evals' running snapshots (eval steps 0 and 1) survive too: nothing was truncated after the start.
  assert [int(r["step"]) for r in recs if "eval/step_time_seconds" in r] == [0, 1, 0, 1]
  # and the package's reader takes it as complete: no truncation note, every step, both evals
  run = metrics.read(os.path.join(str(tmp_path), "ev.jsonl"))
  assert run.warnings == () and run.sorted_steps == list(range(steps)) and sorted(run.evals) == [0, 2]


def test_a_gzipped_metrics_file_reads_as_the_plain_one(tmp_path):
  """Published study arms are stored as <arm>.jsonl.gz: the same records as the plain file; a .gz that is not gzip
  is one InputError line naming the file."""
  import gzip  # pylint: disable=import-outside-toplevel

  lines = [json.dumps({"step": s, "learning/loss": 5.0 - s / 10, "perf/step_time_seconds": 0.5}) for s in range(5)]
  plain = tmp_path / "a.jsonl"
  plain.write_text("\n".join(lines) + "\n")
  packed = tmp_path / "a.jsonl.gz"
  with gzip.open(packed, "wt", encoding="utf8") as f:
    f.write("\n".join(lines) + "\n")
  assert metrics.read(packed, name="a").steps == metrics.read(plain, name="a").steps
  assert len(metrics.read(packed, name="a").steps) == 5
  bad = tmp_path / "b.jsonl.gz"
  bad.write_text(lines[0])
  with pytest.raises(metrics.InputError) as e:
    metrics.read(bad)
  assert str(bad) in str(e.value) and "\n" not in str(e.value) and "gzip" in str(e.value)
