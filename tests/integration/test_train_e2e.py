"""``python -m maxtext_nvfp4.train`` trains end to end in a subprocess (tiny model, CPU)."""

import math
import os
import subprocess
import sys

import pytest

from maxtext_helpers import read_metrics, tiny_argv

pytestmark = pytest.mark.slow

STEPS = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("e2e"))
  # No tokenizer_path: the entry point must supply the packaged one (MaxText's pip default is broken). NVFP4 on
  # the MLP GEMMs of layer 0 (layer 1 kept in bf16): both kinds of table row, a third of the compile of all GEMMs.
  args = tiny_argv(out, run_name="e2e", steps=STEPS, quantization="nvfp4", nvfp4_keep_last_layers=1,
                   nvfp4_targets="mlp", base_num_decoder_layers=2, tokenizer_path=None)[1:]
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "-m", "maxtext_nvfp4.train", *args], capture_output=True, text=True,
                        timeout=900, env=env, check=False)
  return proc, os.path.join(out, "e2e.jsonl")


def test_exits_cleanly(run):
  proc, _ = run
  assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])


def test_per_step_log_lines(run):
  proc, _ = run
  text = proc.stdout + proc.stderr
  for s in range(STEPS):
    assert f"completed step: {s}," in text, text[-3000:]


def test_backend_table_and_tokenizer_are_reported(run):
  proc, _ = run
  text = proc.stdout + proc.stderr
  assert "NVFP4 backend = emulate" in text
  assert "no tokenizer_path given; using" in text and "tokenizer.llama2" in text
  # the start-up table: runs of identical layers, the roles sharing precisions on one line (a run's later
  # lines leave the layer column blank): layer 0's MLP in NVFP4, its attention and all of layer 1 in bf16
  lines = text.splitlines()
  head = next(i for i, l in enumerate(lines) if l.split()[:2] == ["layers", "roles"])
  assert [l.split() for l in lines[head + 2 : head + 5]] == [
      ["0", "query,key,value,out", "bf16", "bf16", "bf16"],
      ["wi_0,wi_1,wo", "nvfp4", "nvfp4", "nvfp4"],
      ["1", "query,key,value,out,wi_0,wi_1,wo", "bf16", "bf16", "bf16"]], lines[head : head + 6]


def test_metrics_file_has_every_step(run):
  _, metrics = run
  rows = read_metrics(metrics)
  assert [int(r["step"]) for r in rows] == list(range(STEPS))
  assert all(math.isfinite(r["learning/loss"]) for r in rows)


def test_cli_dispatcher_help():
  from maxtext_nvfp4.tools import train  # pylint: disable=import-outside-toplevel

  assert train.cli_main(["--help"]) == 0


def test_default_tokenizer_only_when_nothing_sets_it(tmp_path, monkeypatch):
  from maxtext_nvfp4.tools import train  # pylint: disable=import-outside-toplevel

  monkeypatch.delenv("M_TOKENIZER_PATH", raising=False)
  (tmp_path / "parent.yml").write_text("base_config: base.yml\ntokenizer_path: my/tok\n")
  (tmp_path / "child.yml").write_text("base_config: parent.yml\nsteps: 2\n")
  (tmp_path / "bare.yml").write_text("base_config: base.yml\nsteps: 2\n")
  assert train.with_default_tokenizer([str(tmp_path / "child.yml")]) == [str(tmp_path / "child.yml")]
  assert train.with_default_tokenizer(["tokenizer_path=x"]) == ["tokenizer_path=x"]
  added = train.with_default_tokenizer([str(tmp_path / "bare.yml"), "steps=3"])
  assert added[:2] == [str(tmp_path / "bare.yml"), "steps=3"]
  assert added[2] == f"tokenizer_path={train.default_tokenizer_path()}" and os.path.isfile(added[2].split("=", 1)[1])
