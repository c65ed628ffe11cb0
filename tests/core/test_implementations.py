"""The NVFP4 implementations as one table (core/implementations.py): the settings, refusals and tools ask it."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest

from maxtext_nvfp4.core import implementations
from maxtext_nvfp4.core import settings as settings_lib

PKG = pathlib.Path(__file__).resolve().parents[2] / "maxtext_nvfp4"


def test_the_backend_choices_are_auto_and_the_table():
  assert settings_lib.BACKENDS == ("auto", "emulate", "te")
  assert settings_lib.KEY_HELP["backend"] == "auto | emulate | te"
  assert implementations.insisted("auto") is None
  assert implementations.insisted("te") is implementations.TE
  assert implementations.insisted(type("Enum", (), {"value": "emulate"})()) is implementations.EMULATE


def test_the_rows_say_what_differs():
  emu, te = implementations.EMULATE, implementations.TE
  assert (emu.min_compute_capability, emu.expert_gemms, emu.stops_at_te_limits, emu.grad_diagnostics) == (
      None, True, False, True)
  assert (te.min_compute_capability, te.expert_gemms, te.stops_at_te_limits, te.grad_diagnostics) == (
      10.0, False, True, False)
  assert set(te.qat_refusals) == {"forward", "serving"} and not emu.qat_refusals


@pytest.mark.parametrize("qat", ["forward", "serving"])
def test_the_qat_refusal_comes_from_the_table(qat, monkeypatch):
  s = settings_lib.Nvfp4Settings(backend="te", qat=qat)
  assert settings_lib.qat_refusal(s).startswith(f"nvfp4_backend=te cannot run nvfp4_qat={qat}: ")
  assert settings_lib.qat_refusal(dataclasses.replace(s, backend="emulate")) is None
  # a row without the refusal: the same settings pass (the check reads the row, not the name)
  monkeypatch.setitem(implementations.IMPLEMENTATIONS, "te", dataclasses.replace(implementations.TE, qat_refusals={}))
  assert settings_lib.qat_refusal(s) is None


def test_the_moe_refusal_comes_from_the_table(monkeypatch):
  import types  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.core import layout as layout_lib  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import moe_refusals  # pylint: disable=import-outside-toplevel

  cfg = types.SimpleNamespace(sparse_matmul=False, num_experts=4, num_decoder_layers=2)
  layout = layout_lib.from_config({"num_decoder_layers": 2, "num_experts": 4, "decoder_block": "mixtral"},
                                  moe_layer_rules={})
  assert layout.moe_layers == (0, 1)
  s = settings_lib.Nvfp4Settings(backend="te")
  with pytest.raises(settings_lib.SettingsError, match="nvfp4_backend=te cannot run the MoE expert GEMMs"):
    moe_refusals.check_model(cfg, s, "te", num_devices=None, layout=layout)
  moe_refusals.check_model(cfg, s, "emulate", num_devices=None, layout=layout)
  monkeypatch.setitem(implementations.IMPLEMENTATIONS, "te", dataclasses.replace(implementations.TE, expert_gemms=True))
  moe_refusals.check_model(cfg, s, "te", num_devices=None, layout=layout)


def test_no_package_file_compares_the_backend_with_a_name():
  """``nvfp4_backend`` / a choice's name is asked through the table, never compared with "te" or "emulate"."""
  compare = re.compile(r"""(backend\b[^=\n]*|\.name\s*|requested\s*)[!=]=\s*["'](te|emulate)["']""")
  found = [f"{p.relative_to(PKG)}:{i}: {line.strip()}" for p in sorted(PKG.rglob("*.py"))
           for i, line in enumerate(p.read_text().splitlines(), 1) if compare.search(line)]
  assert found == []
  assert compare.search('  if choice.name == "te":')
  assert compare.search('if str(cfg.get("nvfp4_backend", "auto")) != "te":')
