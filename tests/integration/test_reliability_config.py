"""Every invalid ``nvfp4_*`` value or combination fails at config time, in one line, exit code 2, fast.

tests/integration/test_plugin_config.py already checks a first set of bad values in-process (backend, targets,
fallback, switch_scope, rht, quantization; keep sum = layers, keep with scan_layers, switch step = steps,
negative keep_last, qwix, te) and one CLI exit. This file covers the remaining values and combinations
in-process, then runs the train command (``maxtext_nvfp4.train.cli_main``, what ``python -m maxtext_nvfp4.train``
exits with) on three of them, one after the other in ONE fresh process (one start-up instead of three;
test_plugin_config.py checks a real ``python -m maxtext_nvfp4.train`` exit), with ``JAX_LOG_COMPILES=1`` so any
compilation would show, and checks: exit code 2, stderr is the one line ``maxtext-nvfp4 train: error: <key>=<value>
...``, no traceback, nothing compiled or trained, and how long it took (from the process start to the case's
return, measured, printed with ``-s``).
"""

import json
import os
import subprocess
import sys

import pytest

import maxtext_nvfp4
from maxtext_helpers import tiny_argv

from maxtext.configs import pyconfig  # pylint: disable=wrong-import-order

maxtext_nvfp4.register()  # MaxText accepts quantization=nvfp4 (importing the package registers nothing)

# The tiny model has 3 decoder layers and steps=3 (tests/maxtext_helpers.py).
# (overrides, words the one-line message must contain: key, value, allowed values or constraint)
BAD = {
    "switch_to": ({"nvfp4_switch_to": "fp4"}, ["nvfp4_switch_to", "'fp4'", "'bf16'", "'fp8'"]),
    "backend_case": ({"nvfp4_backend": "Emulate"}, ["nvfp4_backend", "'Emulate'", "'auto'", "'emulate'", "'te'"]),
    "targets_empty": ({"nvfp4_targets": "''"}, ["nvfp4_targets", "'mlp'", "'attention'"]),
    "keep_first_negative": ({"nvfp4_keep_first_layers": -2}, ["nvfp4_keep_first_layers=-2", ">= 0"]),
    "keep_first_fraction": ({"nvfp4_keep_first_layers": 1.5}, ["nvfp4_keep_first_layers", "1.5", "integer"]),
    "keep_last_all": ({"nvfp4_keep_last_layers": 3}, ["nvfp4_keep_last_layers=3", "3 decoder layers", "fewer than 3"]),
    "keep_first_beyond": ({"nvfp4_keep_first_layers": 5}, ["nvfp4_keep_first_layers=5", "fewer than 3"]),
    "keep_sum_scan": ({"nvfp4_keep_last_layers": 1, "scan_layers": True},
                      ["nvfp4_keep_first_layers/nvfp4_keep_last_layers", "0/1", "scan_layers=false"]),
    "switch_beyond_steps": ({"nvfp4_switch_at_step": 7}, ["nvfp4_switch_at_step=7", "steps=3", "< 3", "(0, 1)"]),
    "switch_not_integer": ({"nvfp4_switch_at_step": 2.5}, ["nvfp4_switch_at_step=2.5", "step number", "(0, 1)"]),
    "diag_interval_zero": ({"nvfp4_diagnostics_interval": 0}, ["nvfp4_diagnostics_interval=0", ">= 1"]),
    "diag_interval_negative": ({"nvfp4_diagnostics_interval": -5}, ["nvfp4_diagnostics_interval=-5", ">= 1"]),
    "seed_not_int": ({"nvfp4_seed": "abc"}, ["nvfp4_seed", "'abc'", "integer"]),
    "backend_te_without_te": ({"nvfp4_backend": "te"}, ["nvfp4_backend=te", "emulate"]),
}


def _initialize(**overrides):
  return pyconfig.initialize(tiny_argv(quantization="nvfp4", **overrides))


@pytest.mark.parametrize("case", sorted(BAD))
def test_invalid_value_fails_at_config_time_in_one_line(case):
  overrides, words = BAD[case]
  with pytest.raises(ValueError) as info:  # SettingsError, BackendError and pydantic errors are ValueErrors
    _initialize(**overrides)
  msg = str(info.value)
  assert "\n" not in msg, msg
  for w in words:
    assert w in msg, (w, msg)


@pytest.mark.parametrize("overrides", [
    {"nvfp4_switch_at_step": 0.5},  # a fraction of steps
    {"nvfp4_switch_at_step": 2},  # the last valid step number (steps=3)
    {"nvfp4_switch_at_step": 0},  # off
    {"nvfp4_keep_first_layers": 1, "nvfp4_keep_last_layers": 1},  # 2 of 3 layers kept
    {"nvfp4_diagnostics_interval": 1},
    {"nvfp4_backend": "emulate"},
])
def test_valid_boundary_values_are_accepted(overrides):
  # The checks above must reject because of the value, not because they reject everything.
  c = _initialize(**overrides)
  for k, v in overrides.items():
    assert getattr(c, k) == v


def test_nvfp4_keys_are_not_validated_for_other_quantizations():
  # quantization='' runs never build the plugin: its cross-key checks do not apply (keys are inert).
  c = pyconfig.initialize(tiny_argv(quantization="", nvfp4_keep_first_layers=3, nvfp4_switch_at_step=9))
  assert c.nvfp4_keep_first_layers == 3


# The CLI cases (one process runs them in turn: a start-up is most of a case's cost).
CLI_CASES = ["switch_to", "keep_first_beyond", "switch_not_integer"]
# The child: each case's output between marker lines on both streams, then its exit code and the seconds since
# the process started (the first case's include the imports).
CLI_RUNNER = """
import json, sys, time
t0 = time.monotonic()
from maxtext_nvfp4.train import cli_main
for case, argv in json.loads(sys.argv[1]):
  for stream in (sys.stdout, sys.stderr):
    print("@@case " + case, file=stream, flush=True)
  rc = cli_main(argv)
  sys.stdout.flush()
  sys.stderr.flush()
  print("@@rc %s %d %.3f" % (case, rc, time.monotonic() - t0), flush=True)
"""


def _by_case(text: str) -> dict[str, str]:
  """A stream split at the child's ``@@case`` lines; what came before the first case belongs to it."""
  parts = text.split("@@case ")
  out = {}
  for part in parts[1:]:
    case, _, rest = part.partition("\n")
    out[case] = rest
  first = parts[1].partition("\n")[0] if len(parts) > 1 else None
  if first is not None:
    out[first] = parts[0] + out[first]
  return out
# Words that appear only once MaxText got past the config: model build, compilation, training.
PAST_CONFIG = ("Compiling", "compiling", "completed step", "decoder GEMM precisions", "Total TFLOPs", "Traceback")


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("cfg"))
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_LOG_COMPILES": "1"}
  cases = [(case, tiny_argv(out, run_name=case, quantization="nvfp4", skip_jax_distributed_system=True,
                            **BAD[case][0])[1:]) for case in CLI_CASES]
  p = subprocess.run([sys.executable, "-c", CLI_RUNNER, json.dumps(cases)], capture_output=True, text=True,
                     env=env, timeout=600, check=False)
  assert p.returncode == 0, p.stderr[-3000:]
  stdout, stderr = _by_case(p.stdout), _by_case(p.stderr)
  results = {}
  for line in p.stdout.splitlines():
    if line.startswith("@@rc "):
      _, case, rc, seconds = line.split()
      results[case] = dict(rc=int(rc), stdout=stdout[case].replace(line + "\n", ""), stderr=stderr[case],
                           seconds=float(seconds))
  assert sorted(results) == sorted(CLI_CASES), p.stdout[-3000:]
  print("\nconfig-error cases, seconds since the process started (a shared machine):",
        {c: round(r["seconds"], 1) for c, r in results.items()})
  return results


@pytest.mark.parametrize("case", CLI_CASES)
def test_cli_exits_2_with_the_one_line_before_compiling(cli_runs, case):
  r = cli_runs[case]
  assert r["rc"] == 2, r["stderr"][-3000:]
  lines = [l for l in r["stderr"].splitlines() if l.strip()]
  # Caught by train's start-up check (the plugin's checks on the recipe as MaxText reads it) before
  # MaxText starts: one line, MaxText's own logging never runs.
  assert len(lines) == 1 and lines[0].startswith("maxtext-nvfp4 train: error: "), lines
  for w in BAD[case][1]:
    assert w.strip("'") in lines[0], (w, lines[0])
  everything = r["stdout"] + r["stderr"]
  for w in PAST_CONFIG:
    assert w not in everything, (w, everything[-3000:])
  # No training artifacts either.
  assert "completed step" not in everything and "learning/loss" not in everything
  # Fast: the time is Python imports and MaxText's config schema; nothing is built or compiled. Generous
  # bound for a loaded 2-core machine (a tiny run that does compile takes minutes there).
  assert r["seconds"] < 60, r["seconds"]


@pytest.mark.parametrize("key, close", [("nvfp4_keep_frist_layers", "nvfp4_keep_first_layers"),
                                        ("learning_rat", "learning_rate")])
def test_unknown_key_inside_maxtext_is_one_short_line_with_did_you_mean(key, close):
  # MaxText's own message lists every field (~21,000 characters on one line); the plugin shortens it.
  with pytest.raises(ValueError) as info:
    pyconfig.initialize(tiny_argv(quantization="nvfp4", **{key: 1}))
  msg = str(info.value)
  assert "\n" not in msg and len(msg) < 300, msg[:500]
  assert f"unknown config key {key!r}" in msg and f"did you mean {close!r}" in msg
