"""`python -m maxtext_nvfp4.train` stops at once on recipes this machine cannot run, and prepares runs/."""

import os
import subprocess
import sys
import time

import pytest

from maxtext_nvfp4.tools import recipes
from maxtext_nvfp4.tools import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("recipe,suggestion", [
    ("recipes/llama3_8b_fp8.yml", "demo_bf16.yml"),
    ("recipes/llama3_8b_nvfp4.yml", "demo_nvfp4.yml"),
])
def test_blackwell_recipe_stops_before_maxtext_with_the_proxy_named(recipe, suggestion):
  te, cc = recipes.detect_hardware()
  if te and cc and cc >= 10.0:
    pytest.skip("this machine can run the Blackwell recipes")
  t0 = time.time()
  p = subprocess.run([sys.executable, "-m", "maxtext_nvfp4.train", recipe], cwd=ROOT, capture_output=True, text=True,
                     timeout=120)
  assert p.returncode == 2, p.stderr[-2000:]
  lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
  assert len(lines) == 1 and suggestion in lines[0] and "Transformer Engine" in lines[0], p.stderr
  assert "completed step" not in p.stdout
  assert time.time() - t0 < 60


def test_cpu_recipes_pass_the_hardware_check():
  assert train.hardware_error(["recipes/demo_nvfp4.yml"]) is None
  assert train.hardware_error(["recipes/demo_bf16.yml", "steps=3"]) is None


def test_metrics_file_folder_is_created(tmp_path):
  target = tmp_path / "a" / "b" / "metrics.jsonl"
  train.ensure_metrics_dir([os.path.join(ROOT, "recipes/demo_nvfp4.yml"), f"metrics_file={target}"])
  assert target.parent.is_dir()
  train.ensure_metrics_dir([f"metrics_file={tmp_path / 'c' / 'm.jsonl'}"])
  assert (tmp_path / "c").is_dir()


def test_single_host_cpu_checkpointing_skips_jax_distributed(monkeypatch):
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  monkeypatch.setattr(train, "_accelerator_present", lambda: False)
  demo = os.path.join(ROOT, "recipes/demo_nvfp4.yml")
  out = train.with_single_host_cpu_defaults([demo, "enable_checkpointing=true"])
  assert out[-1] == "skip_jax_distributed_system=true"
  # the user's choice, multi-process hardware and disabled checkpointing are left alone
  assert train.with_single_host_cpu_defaults([demo, "enable_checkpointing=true", "skip_jax_distributed_system=false"])[-1] \
      == "skip_jax_distributed_system=false"
  assert "skip_jax_distributed_system=true" not in train.with_single_host_cpu_defaults(
      [demo, "enable_checkpointing=true", "hardware=gpu_multiprocess"])
  assert "skip_jax_distributed_system=true" not in train.with_single_host_cpu_defaults([demo, "enable_checkpointing=false"])
  monkeypatch.setattr(train, "_accelerator_present", lambda: True)
  assert "skip_jax_distributed_system=true" not in train.with_single_host_cpu_defaults([demo, "enable_checkpointing=true"])


def test_default_tokenizer_only_when_the_whole_chain_sets_none(tmp_path, monkeypatch, capsys):
  monkeypatch.delenv("M_TOKENIZER_PATH", raising=False)
  (tmp_path / "base2.yml").write_text("base_config: base.yml\ntokenizer_path: my/tok\n")
  (tmp_path / "a.yml").write_text("base_config: base2.yml\n")  # set two levels down: no default added
  (tmp_path / "b.yml").write_text("base_config: base.yml\n")
  assert train.with_default_tokenizer([str(tmp_path / "a.yml")]) == [str(tmp_path / "a.yml")]
  assert train.with_default_tokenizer([str(tmp_path / "b.yml")])[-1].startswith("tokenizer_path=")
  assert train.with_default_tokenizer([str(tmp_path / "b.yml"), "tokenizer_path=x"])[-1] == "tokenizer_path=x"
  assert train.with_default_tokenizer([str(tmp_path / "b.yml"), "model_name=llama2-7b"])[-1] == "model_name=llama2-7b"
  monkeypatch.setenv("M_TOKENIZER_PATH", "env/tok")
  assert train.with_default_tokenizer([str(tmp_path / "b.yml")]) == [str(tmp_path / "b.yml")]
  assert capsys.readouterr().out.count("no tokenizer_path given") == 1


def test_packaged_name_resolves_to_the_packaged_file_for_maxtext(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)  # a pip user's empty directory
  (tmp_path / "data" / "embedded").mkdir(parents=True)
  for split in ("train", "eval"):
    (tmp_path / "data" / "embedded" / f"{split}-0.parquet").write_bytes(b"")
  for name in ("demo_nvfp4", "demo_nvfp4.yml"):
    args, cfg = train.check_command_line([name, "steps=2"])
    assert args == [os.path.join(recipes.PACKAGED_RECIPES, "demo_nvfp4.yml"), "steps=2"]
    assert cfg["steps"] == 2 and cfg["quantization"] == "nvfp4"


def test_version_and_recipe_list(capsys):
  assert train.cli_main(["--version"]) == 0 and capsys.readouterr().out.startswith("maxtext-nvfp4 ")
  assert train.cli_main(["--list"]) == 0
  out = capsys.readouterr().out
  assert all(f"{n} " in out for n in ("demo_nvfp4", "llama3_8b_nvfp4", "proxy_1gpu_fp8")) and "_base" not in out


def test_start_up_lines_reach_the_console_once(capsys, caplog):
  """The backend line and the GEMM table: printed once to stdout, no INFO record (MaxText's absl handler
  would print that to the console a second time)."""
  import logging  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.integration.log_once import log_once  # pylint: disable=import-outside-toplevel

  text = "maxtext-nvfp4: test line for log_once"
  with caplog.at_level(logging.INFO):
    log_once(text)
    log_once(text)
  assert capsys.readouterr().out.count(text) == 1
  assert not [r for r in caplog.records if text in r.getMessage()]


@pytest.mark.parametrize("name", [os.path.basename(p)[:-4] for p in recipes.list_recipes()])
def test_type_check_accepts_every_packaged_recipe(name):
  """The start-up type check may refuse only what MaxText refuses: every packaged recipe passes it."""
  from maxtext_nvfp4.integration import config_errors  # pylint: disable=import-outside-toplevel

  r = recipes.resolve([name])
  assert config_errors.field_error(r.values, list(r.sources)) is None


def test_a_relative_base_output_directory_is_made_absolute(tmp_path, monkeypatch):
  """Orbax refuses a relative checkpoint path only after compiling; the recipes say ``runs``."""
  monkeypatch.chdir(tmp_path)
  monkeypatch.delenv("M_BASE_OUTPUT_DIRECTORY", raising=False)
  args, cfg = train.with_absolute_output_dir(["r.yml", "base_output_directory=runs", "steps=2"],
                                             {"base_output_directory": "runs", "steps": 2})
  assert args == ["r.yml", "steps=2", f"base_output_directory={tmp_path / 'runs'}"]
  assert cfg["base_output_directory"] == str(tmp_path / "runs")
  for base in (str(tmp_path / "abs"), "gs://bucket/runs", ""):
    assert train.with_absolute_output_dir(["r.yml"], {"base_output_directory": base}) == (
        ["r.yml"], {"base_output_directory": base})
  monkeypatch.setenv("M_BASE_OUTPUT_DIRECTORY", "from_env")  # MaxText refuses a key set in both places
  assert train.with_absolute_output_dir(["r.yml"], {"base_output_directory": "from_env"})[0] == ["r.yml"]
  assert os.environ["M_BASE_OUTPUT_DIRECTORY"] == str(tmp_path / "from_env")


def test_the_run_records_its_config_beside_its_checkpoints(tmp_path, monkeypatch):
  """What export and eval-quantized read when given no --config: MaxText's config from the record is the
  run's (absolute data/tokenizer paths, so another working directory reads the same files)."""
  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import run_record  # pylint: disable=import-outside-toplevel

  monkeypatch.chdir(tmp_path)
  for name in ("train-00000-of-00001.parquet", "eval-00000-of-00001.parquet"):
    os.makedirs(tmp_path / "data" / "embedded", exist_ok=True)
    (tmp_path / "data" / "embedded" / name).write_bytes(b"")
  args, cfg = train.check_command_line(["demo_nvfp4", "steps=2", "base_num_decoder_layers=3"])
  args, cfg = train.with_absolute_output_dir(args, cfg)
  record = train._record_run(args, cfg)  # pylint: disable=protected-access
  path = tmp_path / "runs" / "demo_nvfp4" / run_record.RECORD
  assert (record.path, record.created, record.previous) == (str(path), True, None)
  found = run_record.find(str(tmp_path / "runs" / "demo_nvfp4" / "checkpoints" / "5" / "items"))
  assert found is not None and found[0] == str(path)
  assert f"tokenizer_path={tmp_path / 'data' / 'embedded' / 'tokenizer'}" in found[1]
  monkeypatch.chdir(tmp_path / "runs")  # export runs from anywhere
  config = checkpoint.load_config(found[1])
  assert (int(config.num_decoder_layers), int(config.steps), config.run_name) == (3, 2, "demo_nvfp4")
  assert config.base_output_directory == str(tmp_path / "runs")
  assert config.grain_train_files == str(tmp_path / "data" / "embedded" / "train-*.parquet")
  train._settle_record(record, 2)  # pylint: disable=protected-access  (what a config error MaxText finds does)
  assert not (tmp_path / "runs" / "demo_nvfp4").exists()


@pytest.mark.parametrize("rc, new_step, kept", [
    (2, False, "first"),   # the relaunch MaxText refused (a config error): the first run's record is back
    (1, False, "first"),   # the relaunch crashed before writing a checkpoint
    (0, False, "first"),   # the relaunch ran without checkpointing: the checkpoints there are still the first run's
    (0, True, "second"),   # the relaunch wrote a checkpoint: its config is the folder's now
])
def test_a_relaunch_leaves_the_record_of_the_checkpoints_beside_it(tmp_path, monkeypatch, rc, new_step, kept):
  """A second launch into a run folder that holds checkpoints must not leave a record (or none) that does not
  describe them: export and eval-quantized rebuild the model from it."""
  from maxtext_nvfp4.tools import run_record  # pylint: disable=import-outside-toplevel

  monkeypatch.chdir(tmp_path)
  # pylint: disable=protected-access
  cfg = {"base_output_directory": str(tmp_path / "runs"), "run_name": "r"}
  base = [f"base_output_directory={tmp_path / 'runs'}", "run_name=r"]
  first = train._record_run(["a.yml", *base, "learning_rate=0.1"], cfg)
  os.makedirs(tmp_path / "runs" / "r" / "checkpoints" / "4")
  train._settle_record(first, 0)
  second = train._record_run(["a.yml", *base, "learning_rate=0.2"], cfg)
  assert "learning_rate=0.2" in run_record.find(second.path)[1]
  if new_step:
    os.makedirs(tmp_path / "runs" / "r" / "checkpoints" / "8")
  train._settle_record(second, rc)
  found = run_record.find(str(tmp_path / "runs" / "r" / "checkpoints" / "4" / "items"))
  assert found is not None and f"learning_rate={'0.1' if kept == 'first' else '0.2'}" in found[1]


def test_a_finished_run_ends_on_where_everything_went(tmp_path, monkeypatch, capsys):
  """The last line names the metrics file, the run record, the checkpoints (with their steps) and TensorBoard, then
  the export command (MaxText's own last line is its step log). The runner stands in for MaxText's main."""
  monkeypatch.chdir(tmp_path)
  for name in ("train-00000-of-00001.parquet", "eval-00000-of-00001.parquet"):
    os.makedirs(tmp_path / "data" / "embedded", exist_ok=True)
    (tmp_path / "data" / "embedded" / name).write_bytes(b"")
  run = tmp_path / "runs" / "demo_nvfp4"

  def fake_maxtext(argv):
    for step in ("4", "9"):
      os.makedirs(run / "checkpoints" / step)
    os.makedirs(run / "tensorboard")

  monkeypatch.setattr(train, "_pretrain", fake_maxtext)
  monkeypatch.setattr("maxtext_nvfp4.register", lambda: None)  # nothing of MaxText's is patched in this process
  monkeypatch.setattr("maxtext_nvfp4.integration.log_filter.install", lambda *a, **k: True)
  assert train.cli_main(["demo_nvfp4", "steps=10", "enable_checkpointing=true"]) == 0
  last = capsys.readouterr().out.strip().splitlines()[-2:]
  assert last[0].startswith("maxtext-nvfp4 train: done; ")
  assert f"metrics {tmp_path / 'runs' / 'demo_nvfp4.jsonl'}" in last[0]
  assert f"run record {run / 'maxtext_nvfp4_run.json'}" in last[0] and (run / "maxtext_nvfp4_run.json").is_file()
  assert f"checkpoints {run / 'checkpoints'} (steps 4, 9)" in last[0]
  assert f"TensorBoard {run / 'tensorboard'}" in last[0]
  assert last[1].startswith("next: ") and f"export {run / 'checkpoints'} --out {run}_hf" in last[1]


@pytest.mark.parametrize("command", ["export", "eval-quantized"])
def test_a_record_whose_recipe_is_gone_is_one_line(tmp_path, capsys, command):
  """export and eval-quantized trust the run's record for the config: a recipe moved or deleted since the run was
  a traceback (AttributeError from the config error's one-line formatter)."""
  from maxtext_nvfp4.tools import cli  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import run_record  # pylint: disable=import-outside-toplevel

  run = tmp_path / "runs" / "r"
  os.makedirs(run / "checkpoints" / "3" / "items")
  (run / "checkpoints" / "3" / "commit_success.txt").write_text("")
  run_record.write(str(run), [str(tmp_path / "gone.yml"), "steps=4"], {}, "test")
  extra = ["--out", str(tmp_path / "hf")] if command == "export" else []
  assert cli.main([command, str(run / "checkpoints"), *extra]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "Traceback" not in err[0] and f"names the recipe {tmp_path / 'gone.yml'}" in err[0], err
  assert "--config" in err[0] and not (tmp_path / "hf").exists()


def test_a_config_maxtext_refuses_leaves_no_folder_behind(tmp_path, monkeypatch, capsys):
  """MaxText's own validation (after our checks) refuses: exit 2, one line, and neither the run record nor the
  runs/ folders made for the metrics file and the checkpoints stay."""
  monkeypatch.chdir(tmp_path)
  for name in ("train-00000-of-00001.parquet", "eval-00000-of-00001.parquet"):
    os.makedirs(tmp_path / "data" / "embedded", exist_ok=True)
    (tmp_path / "data" / "embedded" / name).write_bytes(b"")

  def refusing_maxtext(argv):
    from maxtext_nvfp4.core import settings  # pylint: disable=import-outside-toplevel

    raise settings.SettingsError("nvfp4_x=1: refused by MaxText's validation")

  monkeypatch.setattr(train, "_pretrain", refusing_maxtext)
  monkeypatch.setattr("maxtext_nvfp4.register", lambda: None)
  monkeypatch.setattr("maxtext_nvfp4.integration.log_filter.install", lambda *a, **k: True)
  assert train.cli_main(["demo_nvfp4", "steps=3"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["maxtext-nvfp4 train: error: nvfp4_x=1: refused by MaxText's validation"], err
  assert sorted(os.listdir(tmp_path)) == ["data"]
