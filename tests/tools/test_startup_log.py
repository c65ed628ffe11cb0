"""The start-up log a person reads (issue 28, items 9-10): it fits on one screen at 405B, is printed by
process 0 only, hides MaxText's misleading messages (saying so once), and our errors carry our prefix.

All on resolved configs and small fakes: nothing is trained, compiled or imported from MaxText's model code.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import types

import pytest

from maxtext_nvfp4.backends import capability
from maxtext_nvfp4.core import settings as settings_lib
from maxtext_nvfp4.core import te_limits
from maxtext_nvfp4.integration import log_filter
from maxtext_nvfp4.integration import log_once as log_once_lib
from maxtext_nvfp4.integration import model_layout
from maxtext_nvfp4.integration import precision_text
from maxtext_nvfp4.integration import touchpoints
from maxtext_nvfp4.integration.maxtext_versions.schema import LogNoise
from maxtext_nvfp4.tools import recipes

RECIPES = os.path.join(os.path.dirname(__file__), "..", "..", "recipes")
# One screen: a 50-line terminal, 200 columns (MaxText's own absl lines are wider).
SCREEN_LINES, SCREEN_COLUMNS = 50, 200


@functools.lru_cache(maxsize=None)
def _resolved(recipe: str) -> dict:
  return dict(recipes.resolve([os.path.join(RECIPES, recipe)]).values)


def startup_text(recipe: str, overrides: dict) -> str:
  """What the plugin prints at start-up for ``recipe`` (on the emulation, so the TE-limits text is in it):
  the log-filter notice, the backend line, the precision table and the TE-limits summary."""
  values = {**_resolved(recipe), **overrides}
  config = types.SimpleNamespace(**{**values, "num_decoder_layers": values["base_num_decoder_layers"]})
  layout = model_layout.layout_of(values)
  choice = capability.choose_backend("emulate")  # the line capability.announce prints
  lines = [log_filter.notice(), f"maxtext-nvfp4: NVFP4 backend = {choice.name} ({choice.reason})",
           precision_text.precision_table_text(config, layout, per_layer=False)]
  refused = te_limits.summary(te_limits.check(values, settings_lib.from_config(values), layout=layout))
  return "\n".join(lines + ([refused] if refused else []))


@pytest.mark.parametrize("recipe, overrides", [
    ("llama3.1_405b_nvfp4.yml", {}),
    # kept layers, a late switch, and every projection breaking a TE limit (8 tokens per device)
    ("llama3.1_405b_nvfp4.yml", {"nvfp4_keep_first_layers": 2, "nvfp4_keep_last_layers": 2, "nvfp4_targets": "mlp",
                                 "nvfp4_switch_at_step": 20, "max_target_length": 8}),
    ("llama3_8b_nvfp4.yml", {}),
    ("llama3_8b_nvfp4.yml", {"ici_tensor_parallelism": 16}),
])
def test_the_startup_text_fits_on_one_screen(recipe, overrides):
  text = startup_text(recipe, overrides)
  lines = text.splitlines()
  print(f"\n{recipe} {overrides}: {len(lines)} lines, widest {max(map(len, lines))}")
  assert len(lines) <= 20 < SCREEN_LINES and max(map(len, lines)) <= SCREEN_COLUMNS, text


def test_the_per_layer_table_behind_the_verbose_variable(monkeypatch):
  config = types.SimpleNamespace(**{**_resolved("llama3_8b_nvfp4.yml"), "num_decoder_layers": 32})
  short = precision_text.precision_table_text(config)
  assert "0-31    query,key,value,out,wi_0,wi_1,wo  nvfp4  nvfp4  nvfp4" in short
  assert short.splitlines()[-1] == "(runs of identical layers; one line per GEMM: MAXTEXT_NVFP4_VERBOSE=1)"
  monkeypatch.setenv("MAXTEXT_NVFP4_VERBOSE", "1")
  full = precision_text.precision_table_text(config).splitlines()
  assert len(full) == 2 + 2 + 32 * 7 and full[-1].split() == ["31", "wo", "nvfp4", "nvfp4", "nvfp4"]


def test_only_process_0_prints(monkeypatch, capsys):
  monkeypatch.setattr(log_once_lib, "is_primary", lambda: False)
  log_once_lib.log_once("maxtext-nvfp4: shown by process 0 only (test line a)")
  assert capsys.readouterr().out == ""
  monkeypatch.setattr(log_once_lib, "is_primary", lambda: True)
  log_once_lib.log_once("maxtext-nvfp4: shown by process 0 only (test line b)")
  log_once_lib.log_once("maxtext-nvfp4: shown by process 0 only (test line b)")
  assert capsys.readouterr().out == "maxtext-nvfp4: shown by process 0 only (test line b)\n"


# ---------------------------------------------------------------------------------------------------
# The log filter (log_filter.py) on a private logger and a fake module: nothing global is installed.
# ---------------------------------------------------------------------------------------------------
class _Collect(logging.Handler):
  def __init__(self):
    super().__init__()
    self.messages = []

  def emit(self, record):
    self.messages.append(record.getMessage())


def _logger_with(entries, name):
  logger = logging.getLogger(name)
  logger.propagate = False
  handler = _Collect()
  logger.handlers = [handler]
  logger.setLevel(logging.INFO)
  logger.filters = [log_filter._NoiseFilter(entries, hide_all=True)]  # pylint: disable=protected-access
  return logger, handler.messages


def test_the_absl_noise_is_hidden_and_everything_else_kept():
  absl = [n for n in touchpoints.adapter().log_noise if n.source == "absl"]
  logger, seen = _logger_with(absl, "test_startup_log.absl")
  for message in ("\nMemstats: After params initialized:", "\tMemstats unavailable, error: 'NoneType'",
                  "=" * 80, "MAXTEXT CONFIG ERROR: nvfp4_targets='x'", "=" * 80,
                  "\nMemstats: After training:", "\tUsing (GB) 1.0 / 80.0 (1.25%) on cuda:0", "completed step: 1"):
    logger.info(message)
  assert seen == ["\nMemstats: After training:", "\tUsing (GB) 1.0 / 80.0 (1.25%) on cuda:0", "completed step: 1"]


def test_the_transformers_noise_is_hidden():
  entries = [n for n in touchpoints.adapter().log_noise if n.source.startswith("transformers")]
  logger, seen = _logger_with(entries, "test_startup_log.transformers")
  logger.warning("PyTorch was not found. Models won't be available and only tokenizers, ... can be used.")
  logger.warning("DeepseekV32Config got `key=rope_scaling` in kwargs but hasn't set it as attribute.")
  logger.warning("a tokenizer warning that matters")
  assert seen == ["a tokenizer warning that matters"]


def test_the_no_op_prints_are_hidden(monkeypatch, capsys):
  module = types.ModuleType("fake_gcloud_stub")
  monkeypatch.setitem(sys.modules, "fake_gcloud_stub", module)
  noise = LogNoise(kind="print", source="fake_gcloud_stub", text=": dependency missing; using stub.", label="x", why="")
  monkeypatch.setattr(touchpoints, "adapter", lambda: types.SimpleNamespace(log_noise=(noise,)))
  log_filter._quiet_prints()  # pylint: disable=protected-access
  module.print("[NO-OP] mldiagnostics: dependency missing; using stub. (ModuleNotFoundError)")
  module.print("[DECOUPLED NO-OP] jetstream: using stub.")
  assert capsys.readouterr().out == "[DECOUPLED NO-OP] jetstream: using stub.\n"


def test_the_aqt_warning_is_dropped_for_nvfp4_only():
  logger = logging.getLogger("maxtext.configs.types")
  handler = _Collect()
  logger.addHandler(handler)
  try:
    for nvfp4 in (True, False):
      with log_filter.hold_nvfp4_only() as release:
        logger.warning("WARNING: AQT quantization is deprecated and will be removed in a future release.")
        logger.warning("another config warning")
        release(nvfp4)
    assert handler.messages == ["another config warning",
                                "another config warning",
                                "WARNING: AQT quantization is deprecated and will be removed in a future release."]
  finally:
    logger.removeHandler(handler)


def test_the_notice_is_one_line_naming_what_and_how_to_see_it(monkeypatch):
  line = log_filter.notice()
  assert "\n" not in line and len(line) <= SCREEN_COLUMNS, line
  for noise in touchpoints.adapter().log_noise:
    assert noise.label in line
  assert "MAXTEXT_NVFP4_VERBOSE=1" in line
  monkeypatch.setenv("MAXTEXT_NVFP4_VERBOSE", "1")
  assert log_filter.install(say=pytest.fail) is False  # verbose: nothing hidden, nothing said


# ---------------------------------------------------------------------------------------------------
# Our errors, our prefix; patched MaxText's entry point with a recipe name
# ---------------------------------------------------------------------------------------------------
def test_a_config_error_found_inside_maxtext_carries_our_prefix():
  from maxtext_nvfp4.tools import train  # pylint: disable=import-outside-toplevel

  line = train.config_error_line(settings_lib.SettingsError("nvfp4_switch_to='fp4': Input should be\n 'bf16'"))
  assert line == "maxtext-nvfp4 train: error: nvfp4_switch_to='fp4': Input should be 'bf16'"


def test_patched_maxtext_train_with_a_recipe_name_is_one_line(monkeypatch, capsys):
  """patches/*/0003's maxtext/train.py, loaded with a fake MaxText train module (nothing heavy imported)."""
  from maxtext_nvfp4.tools import patching  # pylint: disable=import-outside-toplevel

  path = os.path.join(os.path.dirname(__file__), "..", "..", "patches", "maxtext-0.2.5",
                      "0003-train-add-the-python-m-maxtext.train-entry-point.patch")
  (fp,) = patching.parse_patch(open(path, encoding="utf-8").read(), os.path.basename(path)).files
  source = patching._apply_hunks(None, fp, reverse=False)  # pylint: disable=protected-access
  fake = types.ModuleType("maxtext.trainers.pre_train.train")
  fake.initialize = lambda argv: pytest.fail("MaxText must not start")
  fake.main = lambda argv: pytest.fail("MaxText must not start")
  parent = types.ModuleType("maxtext.trainers.pre_train")
  parent.train = fake
  for name, mod in (("maxtext.trainers", types.ModuleType("maxtext.trainers")),
                    ("maxtext.trainers.pre_train", parent), ("maxtext.trainers.pre_train.train", fake)):
    monkeypatch.setitem(sys.modules, name, mod)
  module = types.ModuleType("patched_maxtext_train")
  exec(compile(source, "maxtext/train.py", "exec"), module.__dict__)  # pylint: disable=exec-used
  for argv, words in ((["train", "demo_nvfp4", "steps=2"], ["'demo_nvfp4'", "recipes", "demo_nvfp4.yml"]),
                      (["train", "cfg.yml", "steps"], ["'steps'", "key=value", "steps=VALUE"])):
    with pytest.raises(SystemExit) as e:
      module.main(argv)
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert e.value.code == 2 and len(lines) == 1 and len(lines[0]) < 300, err
    assert lines[0].startswith("python -m maxtext.train: error: ") and all(w in lines[0] for w in words), lines
