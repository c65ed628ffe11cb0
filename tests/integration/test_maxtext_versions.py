"""The MaxText adapters (integration/maxtext_versions/): one per supported version, chosen by version at
registration; an unsupported version fails in one line naming the supported ones. Pure (no MaxText import),
except the one subprocess that fakes the installed version."""

import dataclasses
import os
import subprocess
import sys

import importlib

import pytest

from maxtext_nvfp4.core import layout as layout_lib
from maxtext_nvfp4.core import plan
from maxtext_nvfp4.integration import maxtext_versions
from maxtext_nvfp4.integration import touchpoints

# One row per supported MaxText version: (version, a decoder_block whose MoE layers start after dense ones)
ROWS = [("0.2.4", "deepseek"), ("0.2.5", "deepseek")]


def test_every_supported_version_has_a_row_here():
  assert [v for v, _ in ROWS] == list(maxtext_versions.SUPPORTED)


@pytest.mark.parametrize("version,moe_block", ROWS)
def test_each_adapter_is_complete_and_consistent(version, moe_block):
  a = maxtext_versions.select(version)
  assert a.version == version
  # every patched module has its touched symbols listed, and a patch job
  assert set(a.patched_modules) <= {t.module for t in a.touches}
  assert set(a.patched_modules.values()) - {"distill", "serving_attention", "serving_mlp"} == {
      "types", "pyconfig", "quantizations", "train", "metric_logger", "moe", "megablox", "accelerators", "normalizations"}
  # a post-training trainer the plugin runs is a checked touch point (its main), and a patched one has a job
  from maxtext_nvfp4.integration import patches  # pylint: disable=import-outside-toplevel

  assert set(a.patched_modules.values()) <= set(patches.PATCHES)
  assert all(any(t.module == m and t.symbol == "main" for t in a.touches) for m in a.posttrain_modules.values())
  assert a.train_module in a.patched_modules
  # the locator names every decoder role from these signatures (each role reachable, none twice per layer)
  roles = [r for sig in a.kernel_signatures.values() for r in sig] + list(
      plan.signature_roles(a.up_projection_axes, 2, a.kernel_signatures, a.up_projection_axes))
  assert set(plan.ROLE_IDS) == set(roles)
  wi, wo = a.expert_kernel_axes
  assert a.kernel_signatures[wi] == ("expert_wi_0", "expert_wi_1") and a.kernel_signatures[wo] == ("expert_wo",)
  assert {r for call in a.gmm_call_order for r in call} == set(plan.EXPERT_ROLES)
  assert {r for call in a.gmm_call_order_fused for r in call} == set(plan.EXPERT_ROLES)
  # the MoE layer rules are data core/layout.py interprets
  cfg = {"num_decoder_layers": 4, "num_experts": 8, "decoder_block": moe_block, "first_num_dense_layers": 1}
  assert layout_lib.from_config(cfg, moe_layer_rules=a.moe_layer_rules).moe_layers == (1, 2, 3)
  assert all(c.dropped <= c.hooks for c in a.hf_conversions.values())
  # every MaxText conversion function the export calls (a borrowed hooks function too) is a checked touch point;
  # a block MaxText has no mapping for (llama4) names the adapter's own module, which has both functions
  touched = {t.symbol for t in a.touches}
  assert all({c.names_fn, c.hooks_fn} - {""} <= touched and (c.borrowed_hooks_fn in touched or not c.borrowed_hooks_fn)
             for c in a.hf_conversions.values() if not c.module)
  for c in a.hf_conversions.values():
    if c.module:
      assert c.module.startswith("maxtext_nvfp4.integration.maxtext_versions.")
      own = importlib.import_module(c.module)
      assert callable(getattr(own, c.names_fn)) and callable(getattr(own, c.hooks_fn))


def test_an_unsupported_version_fails_in_one_line_naming_the_supported_ones():
  with pytest.raises(maxtext_versions.MaxTextVersionError) as e:
    maxtext_versions.select("0.1.0")
  msg = str(e.value)
  assert "\n" not in msg and "0.1.0" in msg
  assert all(v in msg for v in maxtext_versions.SUPPORTED) and "pip install" in msg


def test_the_installed_maxtext_is_supported_and_its_symbols_are_checked():
  a = touchpoints.adapter()
  assert a.version == maxtext_versions.installed_version()
  fake = type("FakeModule", (), {"QuantizationType": object})  # MaxTextConfig missing
  gone = touchpoints.missing("maxtext.configs.types", fake, a)
  assert "maxtext.configs.types.MaxTextConfig" in gone and "maxtext.configs.types.QuantizationType" not in gone
  with pytest.raises(maxtext_versions.MaxTextVersionError, match=r"supports MaxText .*has no maxtext\.configs\.types"):
    touchpoints.check("maxtext.configs.types", fake, a)


def test_a_second_version_is_one_replace_away():
  """What adding a version looks like: a replace of the predecessor with the fields that differ."""
  a = maxtext_versions.select(maxtext_versions.SUPPORTED[-1])
  b = dataclasses.replace(a, version="9.9.9", te_sr_source_stream="quant")
  assert b.kernel_signatures is a.kernel_signatures and b.te_sr_source_stream == "quant"
  with pytest.raises(dataclasses.FrozenInstanceError):
    a.version = "x"  # type: ignore[misc]


# A process whose `importlib.metadata.version("maxtext")` answers 0.1.0 (the lookup select() makes), then:
# register() directly, and the documented entry point's command line.
_FAKE_VERSION = """
import sys
from importlib import metadata
real = metadata.version
metadata.version = lambda name: "0.1.0" if name == "maxtext" else real(name)
import maxtext_nvfp4
from maxtext_nvfp4.integration import maxtext_versions
try:
  maxtext_nvfp4.register()
except maxtext_versions.MaxTextVersionError as e:
  print("REGISTER " + str(e))
from maxtext_nvfp4.tools import train
print("RC", train.cli_main([sys.argv[1], "steps=1"]))
"""


def test_an_unsupported_installed_maxtext_fails_at_registration_in_one_line_naming_the_supported_ones():
  recipe = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "demo_nvfp4.yml")
  p = subprocess.run([sys.executable, "-c", _FAKE_VERSION, recipe], capture_output=True, text=True, timeout=300,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"}, check=False)
  lines = p.stdout.splitlines()
  register = [ln for ln in lines if ln.startswith("REGISTER ")]
  assert len(register) == 1, p.stdout + p.stderr
  assert "0.1.0" in register[0] and " and ".join(maxtext_versions.SUPPORTED) in register[0], register[0]
  assert {"0.2.4", "0.2.5"} <= set(maxtext_versions.SUPPORTED)
  # the command line: exit 2, one line on stderr, no traceback
  assert lines[-1] == "RC 2", p.stdout + p.stderr
  err = p.stderr.strip().splitlines()
  assert len(err) == 1 and "supports MaxText 0.2.4 and 0.2.5" in err[0] and "0.1.0" in err[0], p.stderr


def test_the_posttrain_facts_come_from_the_adapter(monkeypatch):
  """The verified trainer version, the Tunix pins and the Tunix API bridged are the adapter's (integration/posttrain.py
  names none of them); the messages read as before."""
  import importlib.util  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.integration import posttrain  # pylint: disable=import-outside-toplevel

  assert maxtext_versions.trainer_versions("sft") == maxtext_versions.trainer_versions("distill") == ("0.2.5",)
  assert maxtext_versions.trainer_versions("rl") == ()
  monkeypatch.setattr(touchpoints, "adapter", lambda: maxtext_versions.select("0.2.4"))
  with pytest.raises(posttrain.PosttrainUnavailable) as e:
    posttrain.trainer_module("sft")
  assert str(e.value) == ("maxtext-nvfp4 sft runs MaxText 0.2.5's sft trainer; the installed MaxText 0.2.4 was not"
                          " verified with it (pip install 'maxtext==0.2.5')")
  monkeypatch.setattr(touchpoints, "adapter", lambda: maxtext_versions.select("0.2.5"))
  real_find_spec = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tunix" else real_find_spec(name, *a))
  with pytest.raises(posttrain.PosttrainUnavailable) as e:
    posttrain.check_importable("distill")
  assert str(e.value) == (
      "MaxText's distillation trainer runs on Tunix, which is not installed: pip install --no-deps"
      " google-tunix==0.1.7 google-metrax==0.2.4 clu==0.0.12 perfetto==0.59.1 wrapt==2.5.2 && pip install pandas"
      " (google-tunix's own dependency list would downgrade transformers; scripts/setup.sh does this)")

  class Tunix:  # a Tunix with the API: nothing to bridge
    _save_checkpointables = _checkpointer = None

  class Manager(Tunix):
    pass

  assert posttrain.bridge_tunix_v0(Manager, object) is False
  assert maxtext_versions.select("0.2.5").tunix_checkpoint_api == ("_save_checkpointables", "_checkpointer")


def test_setup_installs_the_adapters_tunix_pins():
  import pathlib  # pylint: disable=import-outside-toplevel
  import re  # pylint: disable=import-outside-toplevel

  setup = (pathlib.Path(__file__).resolve().parents[2] / "scripts" / "setup.sh").read_text()
  want = re.search(r'^tunix_want="([^"]*)"', setup, re.M)
  assert want is not None and tuple(want.group(1).split()) == maxtext_versions.select(
      maxtext_versions.trainer_versions("distill")[-1]).tunix_pins
