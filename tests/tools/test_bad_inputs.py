"""Every bad input a user can give train, doctor, reproduce, verify-hardware and the dispatcher: exit code 2,
exactly ONE line on stderr naming what is wrong (and, where asked, what to do), no traceback, nothing written.

Rows run in-process through ``maxtext_nvfp4.tools.cli.main(argv)`` (the ``maxtext-nvfp4`` command) with
capsys, in an empty temporary working directory whose files are compared before and after; one row per
process boundary that matters (``python -m maxtext_nvfp4.train`` from an empty directory) is a subprocess.
``compare`` and ``prepare-data`` (helper H2b) and ``patch`` (H1) have their own tables.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from maxtext_nvfp4.tools import cli
from maxtext_nvfp4.tools import recipes

# Files every row may use (written into the row's empty working directory before the snapshot).
FILES = {
    "empty.yml": "",
    "comments.yml": "# only a comment\n",
    "list.yml": "- a\n- b\n",
    "bad_yaml.yml": "base_config: base.yml\nsteps: [1,\n",
    "binary.yml": b"\x89PNG\r\n\x1a\n\x00\xff\xfe\x00",
    "wrong_suffix.yaml": "base_config: base.yml\n",
    "typo.yml": "base_config: base.yml\nquantization: nvfp4\nnvfp4_keep_frist_layers: 1\n",
    "typo_base.yml": "base_config: base.yml\nlearning_rat: 0.1\n",
    "typo_child.yml": "base_config: typo_base.yml\nquantization: nvfp4\n",
    "missing_base.yml": "base_config: nope_base.yml\nsteps: 3\n",
    "cycle_a.yml": "base_config: cycle_b.yml\n",
    "cycle_b.yml": "base_config: cycle_a.yml\n",
    "bad_value.yml": "base_config: base.yml\nquantization: nvfp4\nnvfp4_targets: everything\n",
    "bad_interp.yml": "base_config: base.yml\nrun_name: ${no_such_key}\n",
    "bad_type.yml": "base_config: base.yml\nenable_checkpointing: maybe\n",
    "ok.yml": "base_config: base.yml\nquantization: nvfp4\nscan_layers: false\nbase_num_decoder_layers: 4\n",
    "sub/.keep": "",
}

# (row id, argv of `maxtext-nvfp4`, words the one stderr line must contain)
ROWS = [
    # --- train: paths and files
    ("train-missing-path", ["train", "no/such/recipe.yml"], ["no/such/recipe.yml", "does not exist"]),
    ("train-missing-name", ["train", "no_such_recipe"], ["no_such_recipe", "not found", "maxtext-nvfp4 recipes"]),
    ("train-checkout-path-pip", ["train", "recipes/demo_nvfp4.yml"], ["does not exist", "named demo_nvfp4"]),
    ("train-directory", ["train", "sub"], ["sub", "is a directory"]),
    ("train-empty-file", ["train", "empty.yml"], ["empty.yml", "is empty", "base_config"]),
    ("train-only-comments", ["train", "comments.yml"], ["comments.yml", "is empty"]),
    ("train-binary", ["train", "binary.yml"], ["binary.yml", "not a text file"]),
    ("train-bad-yaml", ["train", "bad_yaml.yml"], ["bad_yaml.yml", "not valid YAML", "line 3"]),
    ("train-not-mapping", ["train", "list.yml"], ["list.yml", "mapping"]),
    ("train-wrong-suffix", ["train", "wrong_suffix.yaml"], ["wrong_suffix.yaml", ".yml", "rename"]),
    ("train-missing-base", ["train", "missing_base.yml"], ["nope_base.yml", "not found"]),
    ("train-base-cycle", ["train", "cycle_a.yml"], ["cycle", "cycle_b.yml"]),
    ("train-bad-interpolation", ["train", "bad_interp.yml"], ["bad_interp.yml", "no_such_key"]),
    # --- train: keys and values
    ("train-typo-in-file", ["train", "typo.yml"], ["nvfp4_keep_frist_layers", "typo.yml", "did you mean",
                                                   "nvfp4_keep_first_layers"]),
    ("train-typo-in-base", ["train", "typo_child.yml"], ["learning_rat", "typo_base.yml", "'learning_rate'"]),
    ("train-typo-on-cli", ["train", "ok.yml", "nvfp4_keep_frist_layers=1"],
     ["nvfp4_keep_frist_layers", "command line", "did you mean 'nvfp4_keep_first_layers'"]),
    ("train-not-key-value", ["train", "ok.yml", "steps"], ["'steps'", "key=value"]),
    ("train-empty-key", ["train", "ok.yml", "=3"], ["'=3'", "key=value"]),
    ("train-bad-choice", ["train", "bad_value.yml"], ["nvfp4_targets='everything'", "mlp"]),
    ("train-negative-layers", ["train", "ok.yml", "nvfp4_keep_last_layers=-1"], ["nvfp4_keep_last_layers=-1", ">= 0"]),
    ("train-too-many-kept", ["train", "ok.yml", "nvfp4_keep_last_layers=4"], ["nvfp4_keep_last_layers=4", "fewer than 4"]),
    ("train-fraction-layers", ["train", "ok.yml", "nvfp4_keep_first_layers=1.5"], ["nvfp4_keep_first_layers=1.5", "integer"]),
    ("train-switch-after-end", ["train", "ok.yml", "steps=10", "nvfp4_switch_at_step=20"],
     ["nvfp4_switch_at_step=20", "steps=10"]),
    ("train-bool-not-bool", ["train", "ok.yml", "nvfp4_rht=maybe"], ["nvfp4_rht='maybe'", "true or false"]),
    # YAML-typed values for an enumerated key: answered with the choices (they said "must be a string")
    ("train-yaml-no-for-choice", ["train", "ok.yml", "nvfp4_backend=no"],
     ["nvfp4_backend=false", "YAML read it as a boolean", "choose one of: auto, emulate, te"]),
    ("train-yaml-digit-for-choice", ["train", "ok.yml", "nvfp4_targets=1"],
     ["nvfp4_targets=1", "YAML read it as a number", "choose one of: all, mlp"]),
    ("train-yaml-empty-for-choice", ["train", "ok.yml", "nvfp4_fallback="], ["nvfp4_fallback=null", "bf16, fp8"]),
    ("train-yaml-no-for-integer", ["train", "ok.yml", "nvfp4_keep_first_layers=no"],
     ["nvfp4_keep_first_layers=false", "boolean", "must be an integer"]),
    ("train-maxtext-int", ["train", "ok.yml", "steps=abc"], ["steps='abc'", "valid integer"]),
    ("train-maxtext-bool-in-file", ["train", "bad_type.yml"], ["enable_checkpointing='maybe'", "valid boolean"]),
    ("train-env-and-cli", ["train", "ok.yml", "steps=3"], ["steps", "M_STEPS"]),
    ("train-bad-env", ["train", "ok.yml"], ["M_STEPS='many'", "int"]),
    ("train-model-key-clash", ["train", "ok.yml", "model_name=llama2-7b", "base_emb_dim=64"],
     ["base_emb_dim", "model_name=llama2-7b", "override_model_config=true"]),
    ("train-unknown-option", ["train", "--bogus"], ["'--bogus'", "--list"]),
    ("train-missing-demo-data", ["train", "demo_nvfp4"], ["grain_train_files=data/embedded/train-*.parquet",
                                                          "maxtext-nvfp4 prepare-data"]),
    ("train-te-on-cpu", ["train", "ok.yml", "nvfp4_backend=te"], ["nvfp4_backend=te", "nvfp4_backend=emulate"]),
    # a shape Transformer Engine refuses: sizes said to be per device shard, the key to change named (any host)
    ("train-te-refused-shape", ["train", "ok.yml", "nvfp4_backend=te", "base_mlp_dim=200"],
     ["maxtext-nvfp4 train: error: nvfp4_backend=te: Transformer Engine would refuse", "= 200",
      "change base_mlp_dim (sizes are per device shard)", "nvfp4_backend=emulate"]),
    # --- train: GPU-node recipes on a CPU host name every blocker at once (no fix-one-see-the-next loop)
    ("train-8b-emulate-on-cpu", ["train", "llama3_8b_nvfp4", "nvfp4_backend=emulate"],
     ["attention=cudnn_flash_te", "ici_fsdp_parallelism=4 needs 4 devices per slice", "demo_nvfp4.yml"]),
    # (the 8B/405B recipes without overrides: test_train_cli.py's subprocess rows; every mismatch kind of the
    # checkpoint-shape check: tests/tools/test_model_shapes.py)
    ("train-8b-dot-product-on-cpu", ["train", "llama3_8b_nvfp4", "nvfp4_backend=emulate", "attention=dot_product"],
     ["ici_fsdp_parallelism=4 needs 4 devices per slice, but this host has 1 CPU device", "demo_nvfp4.yml"]),
    ("train-dcn-on-cpu", ["train", "ok.yml", "dcn_data_parallelism=2"], ["dcn_data_parallelism=2", "2 slices"]),
    # --- train: MoE settings MaxText or the plugin refuse inside pydantic, named before MaxText starts
    ("train-moe-ring-ep1", ["train", "demo_moe_nvfp4", "use_ring_of_experts=true"],
     ["use_ring_of_experts=true", "ici_expert_parallelism=1", "use_ring_of_experts=false"]),
    ("train-moe-te-block", ["train", "demo_moe_nvfp4", "te_moe_block=true"], ["te_moe_block=true", "te_moe_block=false"]),
    ("train-moe-batch-split", ["train", "demo_moe_nvfp4", "use_batch_split_schedule=true"],
     ["use_batch_split_schedule=true", "use_batch_split_schedule=false"]),
    # --- doctor
    ("doctor-missing-recipe", ["doctor", "--recipe", "no_such.yml"], ["no_such.yml", "not found"]),
    ("doctor-directory", ["doctor", "--recipe", "sub"], ["is a directory"]),
    ("doctor-bad-yaml", ["doctor", "--recipe", "bad_yaml.yml"], ["not valid YAML"]),
    ("doctor-typo", ["doctor", "--recipe", "typo.yml"], ["did you mean 'nvfp4_keep_first_layers'"]),
    ("doctor-overrides-without-recipe", ["doctor", "nvfp4_rht=false"], ["need --recipe"]),
    ("doctor-bad-override", ["doctor", "--recipe", "ok.yml", "steps"], ["'steps'", "key=value"]),
    ("doctor-unknown-option", ["doctor", "--bogus"], ["--bogus", "--help"]),
    ("doctor-bad-value", ["doctor", "--recipe", "bad_value.yml"], ["nvfp4_targets='everything'"]),
    # --- reproduce
    ("reproduce-unknown-pair", ["reproduce", "nope"], ["unknown pair 'nope'", "demo"]),
    ("reproduce-zero-steps", ["reproduce", "demo", "--steps", "0"], ["argument --steps: 0 is out of range", ">= 1"]),
    ("reproduce-steps-not-int", ["reproduce", "demo", "--steps", "many"], ["--steps", "'many'"]),
    ("reproduce-negative-batch", ["reproduce", "demo", "--batch", "-1"], ["argument --batch: -1 is out of range", "> 0"]),
    ("reproduce-recipes-dir-missing", ["reproduce", "demo", "--recipes-dir", "nodir"], ["--recipes-dir nodir"]),
    ("reproduce-recipe-missing", ["reproduce", "demo", "--recipes-dir", "sub"], ["demo_bf16.yml", "not found"]),
    ("reproduce-out-is-file", ["reproduce", "demo", "--out", "ok.yml"], ["--out ok.yml", "not a directory"]),
    ("reproduce-bad-override", ["reproduce", "demo", "notakv"], ["KEY=VALUE"]),
    ("reproduce-unknown-option", ["reproduce", "demo", "--bogus"], ["--bogus"]),
    # --- verify-hardware (argument checks come before the hardware check)
    ("verify-m-not-multiple", ["verify-hardware", "--m", "3"], ["--m=3", "multiple of 64"]),
    ("verify-k-negative", ["verify-hardware", "--k", "-128"], ["--k=-128", "multiple of 128"]),
    ("verify-n-not-int", ["verify-hardware", "--n", "abc"], ["--n", "'abc'"]),
    ("verify-sr-draws-zero", ["verify-hardware", "--sr-draws", "0"], ["--sr-draws=0"]),
    ("verify-unknown-option", ["verify-hardware", "--bogus"], ["--bogus"]),
    # --- the dispatcher
    ("cli-unknown-command", ["trian"], ["unknown command 'trian'", "did you mean 'train'"]),
    ("cli-recipes-extra-arg", ["recipes", "extra"], ["extra"]),
]
ENV = {"train-env-and-cli": {"M_STEPS": "5"}, "train-bad-env": {"M_STEPS": "many"}}


def _snapshot(root):
  out = {}
  for d, _, files in os.walk(root):
    for f in files:
      p = os.path.join(d, f)
      out[os.path.relpath(p, root)] = (os.path.getsize(p), os.path.getmtime(p))
  return out


@pytest.fixture
def workdir(tmp_path, monkeypatch):
  for name, text in FILES.items():
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
  monkeypatch.chdir(tmp_path)
  for key in [k for k in os.environ if k.startswith("M_") and k != "M_JAX_CACHE_DIR"]:
    monkeypatch.delenv(key)
  return tmp_path


@pytest.mark.parametrize("row, argv, words", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_one_line_exit_2_nothing_written(workdir, monkeypatch, capsys, row, argv, words):
  if row == "train-te-on-cpu":
    te, cc = recipes.detect_hardware()
    if te and cc and cc >= 10.0:
      pytest.skip("this machine runs nvfp4_backend=te")
  if row.endswith("-on-cpu") and row != "train-te-on-cpu":
    from maxtext_nvfp4.tools import train  # pylint: disable=import-outside-toplevel

    if train._accelerator_present():  # pylint: disable=protected-access
      pytest.skip("a host with an accelerator")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  for key, value in ENV.get(row, {}).items():
    monkeypatch.setenv(key, value)
  before = _snapshot(workdir)
  rc = cli.main(list(argv))
  err = capsys.readouterr().err
  lines = [l for l in err.splitlines() if l.strip()]
  assert rc == 2, (rc, err)
  assert len(lines) == 1, err
  assert "Traceback" not in err
  for w in words:
    assert w in lines[0], (w, lines[0])
  assert _snapshot(workdir) == before


def test_unreadable_recipe_is_one_line(workdir, monkeypatch, capsys):
  """Permission denied (simulated: the tests may run as root, who reads every file)."""
  def denied(path, *a, **k):
    raise PermissionError(13, "Permission denied", str(path))

  from omegaconf import OmegaConf  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(OmegaConf, "load", denied)
  for argv in (["train", "ok.yml"], ["doctor", "--recipe", "ok.yml"]):
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "ok.yml" in lines[0] and "permission denied" in lines[0], lines


def test_pip_user_runs_a_packaged_name_from_an_empty_directory(tmp_path):
  """The process a pip user starts: exit 2 with how to get the data, before MaxText or JAX starts."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("M_")}
  p = subprocess.run([sys.executable, "-m", "maxtext_nvfp4.train", "demo_nvfp4.yml", "steps=2"], cwd=tmp_path,
                     capture_output=True, text=True, env=env, timeout=120)
  lines = [l for l in p.stderr.splitlines() if l.strip()]
  assert p.returncode == 2 and len(lines) == 1, p.stderr[-2000:]
  assert "maxtext-nvfp4 prepare-data" in lines[0] and "Traceback" not in p.stderr
  assert "completed step" not in p.stdout and list(tmp_path.iterdir()) == []
