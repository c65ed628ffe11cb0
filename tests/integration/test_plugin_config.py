"""MaxText accepts quantization=nvfp4 and every nvfp4_* key; bad values fail with one line; other modes unchanged."""

import os
import subprocess
import sys

import pytest

import maxtext_nvfp4
from maxtext_nvfp4.core import settings as settings_lib
from maxtext_nvfp4.integration import quantization
from maxtext_nvfp4.core import settings
from maxtext_helpers import tiny_argv

from maxtext.configs import pyconfig  # pylint: disable=wrong-import-order
from maxtext.layers import quantizations  # pylint: disable=wrong-import-order

# A non-default value of the right type for every key (so the test sees our value, not the default).
NON_DEFAULT = {
    "nvfp4_backend": "emulate",
    "nvfp4_targets": "mlp",
    "nvfp4_rht": False,
    "nvfp4_stochastic_rounding": False,
    "nvfp4_2d_weights": False,
    "nvfp4_4over6": "all",  # needs nvfp4_rht=false (TE refuses 4over6 with RHT)
    "nvfp4_4over6_e4m3_use_256": "weights",
    "nvfp4_4over6_err_mode": "MSE",
    "nvfp4_row_scaled_activation": True,
    "nvfp4_backward_override": "dequantized",
    "nvfp4_amax_scope": "global",
    "nvfp4_keep_first_layers": 1,
    "nvfp4_keep_last_layers": 1,
    "nvfp4_fallback": "fp8",
    "nvfp4_switch_at_step": 2,
    "nvfp4_switch_to": "fp8",
    "nvfp4_switch_scope": "all",
    "nvfp4_seed": 7,
    "nvfp4_diagnostics": True,
    "nvfp4_diagnostics_interval": 3,
    "nvfp4_qat": "forward",  # with nvfp4_backward_override=dequantized: that backward
    "nvfp4_diagnostics_grad": True,
    "nvfp4_fp4_weight_gather": "off",
}


def _config(**overrides):
  return pyconfig.initialize(tiny_argv(**overrides))


def test_every_key_is_covered():
  assert set(NON_DEFAULT) == set(settings.config_keys())
  for key, v in NON_DEFAULT.items():
    assert v != settings.config_keys()[key], key


def test_register_is_idempotent_and_patches_once():
  before = quantizations.configure_quantization
  maxtext_nvfp4.register()
  maxtext_nvfp4.register()
  assert quantizations.configure_quantization is before
  assert getattr(before, "_maxtext_nvfp4_wrapped", None) is not None


def test_defaults_and_nvfp4_accepted():
  c = _config(quantization="nvfp4")
  assert c.quantization == "nvfp4"
  for key, default in settings.config_keys().items():
    assert getattr(c, key) == default, key


def test_every_key_accepted_on_the_cli():
  c = _config(quantization="nvfp4", steps=5, base_num_decoder_layers=4, **NON_DEFAULT)
  for key, v in NON_DEFAULT.items():
    assert getattr(c, key) == v, key
  s = settings_lib.from_config(c)
  assert s.fallback == "fp8" and s.two_d_weights is False and s.switch_step(5) == 2


def test_keys_accepted_in_yaml(tmp_path):
  yml = tmp_path / "recipe.yml"
  yml.write_text("base_config: base.yml\nquantization: nvfp4\nnvfp4_targets: attention\nnvfp4_switch_at_step: 0.5\n"
                 "nvfp4_fallback: fp8\n")
  c = pyconfig.initialize(tiny_argv(config=str(yml), steps=4))
  assert c.quantization == "nvfp4" and c.nvfp4_targets == "attention" and c.nvfp4_fallback == "fp8"
  assert settings_lib.from_config(c).switch_step(c.steps) == 2


@pytest.mark.parametrize(
    "overrides, expect",
    [
        ({"nvfp4_backend": "cuda"}, ["nvfp4_backend", "'cuda'", "'auto'", "'emulate'", "'te'"]),
        ({"nvfp4_targets": "ffn"}, ["nvfp4_targets", "'ffn'", "'mlp'", "'attention'"]),
        ({"nvfp4_fallback": "fp16"}, ["nvfp4_fallback", "'bf16'", "'fp8'"]),
        ({"nvfp4_switch_scope": "backward"}, ["nvfp4_switch_scope", "'forward'", "'all'"]),
        ({"nvfp4_rht": "maybe"}, ["nvfp4_rht", "'maybe'", "bool"]),
        ({"quantization": "nvfp5"}, ["quantization", "'nvfp5'", "'nvfp4'", "'te_nvfp4'"]),
    ],
)
def test_bad_value_is_one_line_with_choices(overrides, expect):
  if "quantization" not in overrides:
    overrides = {"quantization": "nvfp4", **overrides}
  with pytest.raises(Exception) as info:
    _config(**overrides)
  msg = str(info.value)
  assert "\n" not in msg, msg
  for word in expect:
    assert word in msg, (word, msg)


@pytest.mark.parametrize(
    "overrides, expect",
    [
        ({"nvfp4_keep_first_layers": 2, "nvfp4_keep_last_layers": 1}, ["nvfp4_keep_first_layers=2", "3 decoder layers"]),
        ({"nvfp4_keep_first_layers": 1, "scan_layers": True}, ["scan_layers=false"]),
        ({"nvfp4_switch_at_step": 3}, ["nvfp4_switch_at_step=3", "steps=3"]),
        ({"nvfp4_keep_last_layers": -1}, ["nvfp4_keep_last_layers=-1", ">= 0"]),
        ({"use_qwix_quantization": True}, ["use_qwix_quantization=false"]),
        ({"nvfp4_backend": "te"}, ["nvfp4_backend=te"]),
    ],
)
def test_bad_combination_fails_at_config_time(overrides, expect):
  with pytest.raises(ValueError) as info:
    _config(quantization="nvfp4", **overrides)  # tiny model: 3 layers, steps=3
  msg = str(info.value)
  assert "\n" not in msg, msg
  for word in expect:
    assert word in msg, (word, msg)


def test_nvfp4_keys_ignored_without_nvfp4():
  # Cross-key checks apply to quantization=nvfp4 only; other modes just carry the (inert) keys.
  c = _config(nvfp4_keep_first_layers=5)
  assert c.quantization == "" and quantizations.configure_quantization(c) is None


@pytest.mark.parametrize("mode, cls", [("", None), ("fp8", "Fp8Quantization"), ("int8", "AqtQuantization"),
                                       ("nanoo_fp8", "NANOOFp8Quantization")])
def test_other_modes_unchanged(mode, cls):
  c = _config(quantization=mode)
  ours = quantizations.configure_quantization(c)
  theirs = quantizations.configure_quantization._maxtext_nvfp4_wrapped(c)  # MaxText's own function
  if cls is None:
    assert ours is None and theirs is None
  else:
    assert type(ours).__name__ == cls and type(ours) is type(theirs)
    assert repr(ours) == repr(theirs)
    axes = ("embed", "mlp")
    assert repr(ours.dot_general_cls(mesh_axes=axes)) == repr(theirs.dot_general_cls(mesh_axes=axes))


def test_nvfp4_routed_to_our_quantization():
  c = _config(quantization="nvfp4", nvfp4_backend="emulate")
  q = quantizations.configure_quantization(c)
  assert isinstance(q, quantizations.Quantization) and q.needs_apply_rngs is False
  assert q.num_layers == 3 and q.settings == settings.Nvfp4Settings(backend="emulate")
  assert quantization.make_quantization(c) == q  # fresh object, same configuration


def test_train_cli_config_error_exits_2_with_one_line():
  args = tiny_argv(quantization="nvfp4", nvfp4_targets="ffn")[1:]
  out = subprocess.run([sys.executable, "-m", "maxtext_nvfp4.train", *args], capture_output=True, text=True,
                       timeout=300, check=False)
  assert out.returncode == 2, out.stderr[-3000:]
  assert "Traceback" not in out.stderr, out.stderr[-3000:]
  lines = out.stderr.strip().splitlines()
  # Refused by the train command's own settings check, before MaxText starts: exactly one line.
  assert len(lines) == 1, out.stderr[-3000:]
  assert lines[0].startswith("maxtext-nvfp4 train: error: nvfp4_targets='ffn'") and "mlp" in lines[0], lines[0]



def test_import_is_cheap_then_registers_lazily_including_train_run_as_main():
  # One subprocess (imports are slow on 2 cores): 1) `import maxtext_nvfp4` and a core module import
  # neither JAX (core.plan) nor MaxText and register nothing (sys.meta_path unchanged); 2) after
  # register(), MaxText modules imported later are patched; 3) `python -m maxtext.trainers.pre_train.train`
  # (patch-set mode) runs MaxText's train module as __main__, whose train_step must be wrapped too.
  code = ("import sys\nhooks = list(sys.meta_path)\n"
          "import maxtext_nvfp4, maxtext_nvfp4.core.plan\n"
          "assert 'jax' not in sys.modules and 'maxtext.configs.pyconfig' not in sys.modules\n"
          "assert sys.meta_path == hooks, sys.meta_path\n"
          "maxtext_nvfp4.register()\n"
          "assert len(sys.meta_path) == len(hooks) + 1 and 'jax' not in sys.modules\n"
          "from maxtext.configs import types\n"
          "assert types.QuantizationType('nvfp4').value == 'nvfp4'\n"
          "import maxtext.trainers.pre_train.train as t\n"
          "assert getattr(t.train_step, '_maxtext_nvfp4_wrapped', None) is not None\n"
          "mod = type(sys)('__main__'); mod.__spec__ = t.__spec__\n"
          "mod.train_step = t.train_step._maxtext_nvfp4_wrapped; mod.eval_step = t.eval_step._maxtext_nvfp4_wrapped\n"
          "sys.modules['__main__'] = mod\n"
          "maxtext_nvfp4.register()\n"
          "assert getattr(mod.train_step, '_maxtext_nvfp4_wrapped', None) is not None\n"
          "print('ok')")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_importing_a_core_module_has_no_side_effects():
  """``import maxtext_nvfp4.core.nvfp4`` (JAX, but no MaxText) installs no import hook and imports no maxtext."""
  code = ("import sys\nhooks = list(sys.meta_path)\nimport maxtext_nvfp4.core.nvfp4\n"
          "assert sys.meta_path == hooks, sys.meta_path\n"
          "assert not [m for m in sys.modules if m == 'maxtext' or m.startswith('maxtext.')], 'maxtext imported'\n"
          "print('ok')")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_no_hlo_dump_flags_left_behind_unless_dump_hlo(monkeypatch):
  # MaxText sets XLA_FLAGS=--xla_dump_to=/tmp/xla_dump/ ... whenever XLA_FLAGS is unset, even with dump_hlo=false:
  # every run would write HLO dumps. The plugin puts back what was there; dump_hlo=true keeps MaxText's flags.
  monkeypatch.setenv("XLA_FLAGS", "")  # empty counts as unset for MaxText
  _config(quantization="nvfp4")
  assert os.environ["XLA_FLAGS"] == ""
  monkeypatch.delenv("XLA_FLAGS")
  c = _config(quantization="nvfp4", dump_hlo=True)
  assert os.environ.get("XLA_FLAGS") == c.dump_hlo_xla_flags
  assert c.dump_hlo_xla_flags.startswith("--xla_dump_to=")


def test_user_xla_flags_and_dump_flags_untouched(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=0")
  _config(quantization="nvfp4")
  assert os.environ["XLA_FLAGS"] == "--xla_backend_optimization_level=0"
  monkeypatch.delenv("XLA_FLAGS")
  _config(quantization="nvfp4", dump_hlo_xla_flags="--xla_dump_to=/tmp/mine")  # asked for: kept
  assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/mine"
  monkeypatch.delenv("XLA_FLAGS")
  with pytest.raises(Exception):
    _config(quantization="nvfp4", distill_beta=0.5)  # MaxText fails after setting its flags: none left behind
  assert "XLA_FLAGS" not in os.environ


def test_a_choice_yaml_reads_as_a_boolean_is_that_choice():
  # MaxText's command line and YAML read `off` as False: a choice spelled so must still be that choice
  c = _config(quantization="nvfp4", nvfp4_fp4_weight_gather="off")
  assert c.nvfp4_fp4_weight_gather == "off"
  with pytest.raises(Exception, match="nvfp4_fp4_weight_gather"):
    _config(quantization="nvfp4", nvfp4_fp4_weight_gather="yes")  # a boolean that is no choice: still refused
