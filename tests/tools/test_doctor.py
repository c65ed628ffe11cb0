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


def _maxtext_config(argv):
  """The config MaxText's own pyconfig.initialize builds (what train uses), as {key: plain value}."""
  import maxtext_nvfp4  # pylint: disable=import-outside-toplevel

  maxtext_nvfp4.register()
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel

  cfg = pyconfig.initialize([None, *argv, "skip_jax_distributed_system=true"])
  return {k: getattr(v, "value", v) for k, v in cfg.get_keys().items()}


def _settings(rec):
  return {k: v["value"] for k, v in rec["settings"].items()}


# User-written chains outside the package: my_run.yml -> my_mid.yml -> my_base.yml -> MaxText's base.yml.
CHAIN_FILES = {
    "my_base.yml": "base_config: base.yml\nnvfp4_targets: mlp\nnvfp4_keep_last_layers: 1\nscan_layers: false\n"
                   "base_num_decoder_layers: 4\nnvfp4_seed: 3\n",
    "my_mid.yml": "base_config: my_base.yml\nnvfp4_fallback: fp8\nnvfp4_seed: 4\nsteps: 50\n",
    "my_run.yml": "base_config: my_mid.yml\nquantization: nvfp4\nnvfp4_switch_at_step: 0.5\nnvfp4_rht: false\n",
    "my_two.yml": "base_config: my_base.yml\nquantization: nvfp4\nnvfp4_keep_first_layers: 1\n",
}


@pytest.mark.parametrize("top, overrides, levels", [
    ("my_two.yml", [], 3),                                       # two user levels + MaxText's base.yml
    ("my_run.yml", [], 4),                                       # three user levels
    ("my_run.yml", ["nvfp4_seed=9", "nvfp4_2d_weights=false"], 4),
])
def test_user_base_chains_show_what_maxtext_builds(tmp_path, monkeypatch, top, overrides, levels):
  for name, text in CHAIN_FILES.items():
    (tmp_path / name).write_text(text)
  monkeypatch.chdir(tmp_path)
  rec = doctor.collect(top, overrides)["recipe"]
  assert "error" not in rec, rec
  assert len(rec["chain"]) == levels and rec["chain"][-1].endswith(os.path.join("configs", "base.yml"))
  mine = _settings(rec)
  maxtext = _maxtext_config([str(tmp_path / top), *overrides])
  assert mine == {k: maxtext[k] for k in mine}, (mine, {k: maxtext[k] for k in mine})
  assert (mine["nvfp4_targets"], mine["nvfp4_keep_last_layers"]) == ("mlp", 1)  # the user recipe
  src = {k: v["source"] for k, v in rec["settings"].items()}
  assert src["nvfp4_targets"] == str(tmp_path / "my_base.yml") and src["nvfp4_stochastic_rounding"] == "default"
  if overrides:
    assert src["nvfp4_seed"] == "command line" and mine["nvfp4_seed"] == 9


def test_copied_and_edited_packaged_base_is_the_one_read(tmp_path, monkeypatch):
  from maxtext_nvfp4.tools import recipes  # pylint: disable=import-outside-toplevel

  for name in ("demo_nvfp4.yml", "demo_base.yml"):
    text = open(os.path.join(recipes.PACKAGED_RECIPES, name), encoding="utf-8").read()
    (tmp_path / name).write_text(text.replace("base_num_decoder_layers: 4", "base_num_decoder_layers: 6")
                                 + ("nvfp4_keep_last_layers: 2\n" if name == "demo_base.yml" else ""))
  monkeypatch.chdir(tmp_path)
  rec = doctor.collect("demo_nvfp4.yml")["recipe"]
  assert rec["chain"][:2] == [str(tmp_path / "demo_nvfp4.yml"), str(tmp_path / "demo_base.yml")]
  assert _settings(rec)["nvfp4_keep_last_layers"] == 2
  assert _settings(rec) == {k: v for k, v in _maxtext_config([str(tmp_path / "demo_nvfp4.yml")]).items()
                            if k in rec["settings"]}


def test_model_name_and_override_model_config_as_maxtext(tmp_path):
  f = tmp_path / "m.yml"
  f.write_text("base_config: base.yml\nmodel_name: llama2-7b\nquantization: nvfp4\nnvfp4_keep_last_layers: 31\n"
               "scan_layers: false\n")
  rec = doctor.collect(f)["recipe"]  # llama2-7b has 32 layers: keeping 31 is valid
  assert "error" not in rec, rec
  assert rec["model_file"].endswith(os.path.join("models", "llama2-7b.yml"))
  rec = doctor.collect(f, ["base_num_decoder_layers=8"])["recipe"]  # MaxText refuses overriding a model key
  assert "override_model_config=true" in rec["error"]
  with pytest.raises(ValueError, match="override_model_config"):
    _maxtext_config([str(f), "base_num_decoder_layers=8"])
  rec = doctor.collect(f, ["base_num_decoder_layers=8", "override_model_config=true"])["recipe"]
  assert "nvfp4_keep_last_layers=31" in rec["error"]  # now 8 layers: 31 kept is too many, as in MaxText
  with pytest.raises(ValueError, match="nvfp4_keep_last_layers"):
    _maxtext_config([str(f), "base_num_decoder_layers=8", "override_model_config=true"])


def test_recipe_errors_exit_2_with_one_line(tmp_path):
  f = tmp_path / "bad.yml"
  f.write_text("base_config: base.yml\nquantization: nvfp4\nnvfp4_targets: everything\n")
  p = _run("--json", "--recipe", str(f))
  assert p.returncode == 2
  err = json.loads(p.stdout)["recipe"]["error"]
  assert "nvfp4_targets" in err and "\n" not in err
  assert [l for l in p.stderr.splitlines() if "error" in l] == [f"maxtext-nvfp4 doctor: error: {err}"]
  f.write_text("nvfp4_keep_frist_layers: 1\n")
  assert "did you mean 'nvfp4_keep_first_layers'" in doctor.collect(f)["recipe"]["error"]
  assert "does not exist" in doctor.collect(tmp_path / "missing.yml")["recipe"]["error"]


def test_recipe_asking_for_te_on_cpu_reports_why_and_what_to_do(tmp_path):
  f = tmp_path / "te.yml"
  f.write_text("quantization: nvfp4\nnvfp4_backend: te\n")
  p = _run("--recipe", str(f))
  assert p.returncode == 2
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


def test_overrides_without_recipe_are_rejected(capsys):
  with pytest.raises(SystemExit) as e:
    doctor.cli_main(["nvfp4_rht=false"])
  assert e.value.code == 2 and "need --recipe" in capsys.readouterr().err
