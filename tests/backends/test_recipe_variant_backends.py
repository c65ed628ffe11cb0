"""The TE-PyTorch-only recipe options (4over6, row-scaled activations, backward override) and the backends:
``nvfp4_backend=te`` refuses them in one line naming the option (before any device check); ``auto`` runs them
emulated on Blackwell and says why. Devices and TE presence are doubles (as in test_capability.py)."""

import dataclasses

import pytest

from maxtext_nvfp4.backends import capability
from maxtext_nvfp4.backends import te as te_backend
from maxtext_nvfp4.core import settings


@dataclasses.dataclass(frozen=True)
class FakeDevice:
  platform: str
  device_kind: str
  id: int = 0
  compute_capability: str | None = None


B200 = FakeDevice("gpu", "NVIDIA B200", 0, "10.0")
CPU = FakeDevice("cpu", "cpu")

PYTORCH_ONLY = [
    (dict(four_over_six="weights"), "nvfp4_4over6=weights"),
    (dict(four_over_six="all", rht=False), "nvfp4_4over6=all"),
    (dict(row_scaled_activation=True), "nvfp4_row_scaled_activation=true"),
    (dict(backward_override="high_precision"), "nvfp4_backward_override=high_precision"),
    (dict(backward_override="dequantized"), "nvfp4_backward_override=dequantized"),
]


@pytest.fixture(name="te_present")
def _te_present(monkeypatch):
  monkeypatch.setattr(capability, "te_version", lambda: "2.20.2")
  monkeypatch.setattr(capability, "te_unavailable_reason", lambda: None)


@pytest.mark.parametrize("kw,named", PYTORCH_ONLY)
def test_te_backend_refuses_the_option_in_one_line(kw, named, te_present):
  s = settings.Nvfp4Settings(**kw)
  with pytest.raises(capability.BackendError) as e:
    te_backend.check_te_settings(s)
  msg = str(e.value)
  assert "\n" not in msg and named in msg and "nvfp4_backend=emulate" in msg and "Transformer Engine JAX" in msg
  for devices in ([B200], [CPU]):  # refused before the devices are judged
    with pytest.raises(capability.BackendError, match=named):
      capability.choose_backend("te", devices=devices, settings=s)


@pytest.mark.parametrize("kw,named", PYTORCH_ONLY)
def test_auto_on_blackwell_runs_the_option_emulated_and_says_so(kw, named, te_present):
  c = capability.choose_backend("auto", devices=[B200], settings=settings.Nvfp4Settings(**kw))
  assert c.name == "emulate" and named in c.reason and "emulation" in c.reason


def test_standard_recipe_still_picks_te_on_blackwell(te_present):
  s = settings.Nvfp4Settings()
  assert capability.choose_backend("auto", devices=[B200], settings=s).name == "te"
  assert capability.choose_backend("te", devices=[B200], settings=s).name == "te"
  te_backend.check_te_settings(s)
  # 4over6's bound and error mode change nothing without 4over6: not a reason to leave TE
  s = settings.Nvfp4Settings(four_over_six_e4m3_use_256="none", four_over_six_err_mode="MSE")
  assert capability.choose_backend("auto", devices=[B200], settings=s).name == "te"
