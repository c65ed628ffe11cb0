"""``maxtext-nvfp4 doctor`` on CPU: reports emulate with the reason; recipe settings; JSON and human."""

import json
import os
import subprocess
import sys

import pytest

from maxtext_nvfp4.tools import doctor

ENV = dict(os.environ, JAX_PLATFORMS="cpu")


def _run(*args):
  return subprocess.run([sys.executable, "-m", "maxtext_nvfp4", "doctor", *args], capture_output=True,
                        text=True, env=ENV, timeout=120)


def test_doctor_json_on_cpu_reports_emulate_with_reason():
  p = _run("--json")
  assert p.returncode == 0, p.stderr
  r = json.loads(p.stdout)
  assert r["backend_auto"]["name"] == "emulate"
  assert "not a GPU" in r["backend_auto"]["reason"]
  assert r["jax"]["default_backend"] == "cpu"
  assert r["jax"]["devices"] and all(d["platform"] == "cpu" and d["compute_capability"] is None
                                     for d in r["jax"]["devices"])
  import jax  # pylint: disable=import-outside-toplevel

  assert r["jax"]["version"] == jax.__version__
  assert r["maxtext"]["version"] == "0.2.5"
  assert r["maxtext"]["patch"]["state"]  # something printable from patching.status() (or its absence)
  te = r["transformer_engine"]
  assert te["installed"] is (te["version"] is not None)
  if not te["installed"]:
    assert te["jax_import"] == "not installed"
  assert "recipe" not in r


def test_doctor_human_mode_on_cpu():
  p = _run()
  assert p.returncode == 0, p.stderr
  out = p.stdout
  assert "Backend auto: emulate" in out and "not a GPU" in out
  assert "JAX:" in out and "device 0: cpu" in out and "MaxText:      0.2.5" in out
  assert not out.lstrip().startswith("{")


def test_recipe_chain_followed_only_inside_recipes_dir(tmp_path, monkeypatch):
  recipes = tmp_path / "recipes"
  recipes.mkdir()
  monkeypatch.setattr(doctor, "RECIPES_DIR", recipes)
  (recipes / "parent.yml").write_text("base_config: base.yml\nnvfp4_targets: mlp\nnvfp4_rht: false\nnvfp4_seed: 3\n")
  (recipes / "child.yml").write_text("base_config: parent.yml\nquantization: nvfp4\nnvfp4_seed: 4\nscan_layers: false\n")
  user = tmp_path / "mine.yml"
  user.write_text("base_config: child.yml\nnvfp4_keep_last_layers: 1\n")  # resolves into recipes dir by name
  r = doctor.collect(user, ["nvfp4_2d_weights=false", "nvfp4_seed=9"])
  rec = r["recipe"]
  assert "error" not in rec, rec
  assert [os.path.basename(c) for c in rec["chain"]] == ["mine.yml", "child.yml", "parent.yml"]
  assert rec["base_not_followed"] == "base.yml"
  s = {k: v["value"] for k, v in rec["settings"].items()}
  src = {k: v["source"] for k, v in rec["settings"].items()}
  assert s["nvfp4_targets"] == "mlp" and src["nvfp4_targets"].endswith("parent.yml")
  assert s["nvfp4_rht"] is False
  assert s["nvfp4_seed"] == 9 and src["nvfp4_seed"] == "command line"
  assert s["nvfp4_2d_weights"] is False
  assert s["nvfp4_keep_last_layers"] == 1 and src["nvfp4_keep_last_layers"].endswith("mine.yml")
  assert s["nvfp4_stochastic_rounding"] is True and src["nvfp4_stochastic_rounding"] == "default"
  assert rec["quantization"] == "nvfp4"
  assert rec["backend"]["name"] == "emulate"


def test_recipe_base_outside_recipes_dir_is_not_followed(tmp_path, monkeypatch):
  monkeypatch.setattr(doctor, "RECIPES_DIR", tmp_path / "recipes")
  (tmp_path / "other.yml").write_text("nvfp4_rht: false\n")
  f = tmp_path / "r.yml"
  f.write_text("base_config: other.yml\nnvfp4_targets: attention\n")
  rec = doctor.collect(f)["recipe"]
  assert rec["base_not_followed"] == "other.yml"
  assert rec["settings"]["nvfp4_rht"]["value"] is True  # other.yml was not read
  assert rec["settings"]["nvfp4_targets"]["value"] == "attention"


def test_recipe_errors_exit_nonzero_with_one_line(tmp_path):
  f = tmp_path / "bad.yml"
  f.write_text("nvfp4_targets: everything\n")
  p = _run("--json", "--recipe", str(f))
  assert p.returncode == 1
  err = json.loads(p.stdout)["recipe"]["error"]
  assert "nvfp4_targets" in err and "\n" not in err
  f.write_text("nvfp4_typo: 1\n")
  assert "unknown key(s) nvfp4_typo" in doctor.collect(f)["recipe"]["error"]
  assert "does not exist" in doctor.collect(tmp_path / "missing.yml")["recipe"]["error"]


def test_recipe_asking_for_te_on_cpu_reports_why_and_what_to_do(tmp_path):
  f = tmp_path / "te.yml"
  f.write_text("nvfp4_backend: te\n")
  p = _run("--recipe", str(f))
  assert p.returncode == 1
  assert "ERROR: nvfp4_backend=te cannot run" in p.stdout and "nvfp4_backend=emulate" in p.stdout


def test_kept_layers_need_scan_layers_false_by_maxtext_default(tmp_path):
  f = tmp_path / "k.yml"
  f.write_text("nvfp4_keep_first_layers: 1\n")
  assert "scan_layers=false" in doctor.collect(f)["recipe"]["error"]


def test_tolerates_missing_patching_module(monkeypatch):
  monkeypatch.setitem(sys.modules, "maxtext_nvfp4.tools.patching", None)
  r = doctor.collect()
  assert r["maxtext"]["patch"]["state"] == "unavailable"
  assert "Backend auto: emulate" in doctor.format_human(r)


def test_overrides_without_recipe_are_rejected():
  with pytest.raises(SystemExit):
    doctor.cli_main(["nvfp4_rht=false"])
