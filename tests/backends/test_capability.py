"""Backend choice (auto | emulate | te) with faked devices and faked TE presence (the module's TE probes
monkeypatched); error messages."""

import dataclasses
import subprocess
import sys

import pytest

from maxtext_nvfp4.backends import capability
from maxtext_nvfp4.backends.capability import BackendError, choose_backend


@dataclasses.dataclass(frozen=True)
class FakeDevice:
  platform: str
  device_kind: str
  id: int = 0
  compute_capability: str | None = None


CPU = FakeDevice("cpu", "cpu")
H100 = FakeDevice("gpu", "NVIDIA H100 80GB HBM3", 0, "9.0")
B200 = FakeDevice("gpu", "NVIDIA B200", 0, "10.0")
B200_1 = FakeDevice("gpu", "NVIDIA B200", 1, "10.0")
RTX5090 = FakeDevice("gpu", "NVIDIA GeForce RTX 5090", 0, "12.0")
ROCM = FakeDevice("gpu", "AMD Instinct MI300X", 0, None)

TE_OK = dict(version="2.9.0")
NO_TE = dict(version=None)


def _never_called():
  raise AssertionError("TE import probe must not run when the devices do not qualify")


@pytest.fixture(name="fake_te")
def _fake_te(monkeypatch):
  """``fake_te(version=..., import_error=...)``: TE's installed version (None: absent) and its import
  probe (None: imports; a string: the failure; a callable: the probe itself)."""

  def fake(version, import_error=None):
    monkeypatch.setattr(capability, "te_version", lambda: version)
    probe = import_error if callable(import_error) else (lambda: import_error)
    monkeypatch.setattr(capability, "te_unavailable_reason", probe)

  return fake


def test_compute_capability_parsing():
  assert capability.device_compute_capability(B200) == 10.0
  assert capability.device_compute_capability(H100) == 9.0
  assert capability.device_compute_capability(RTX5090) == 12.0
  assert capability.device_compute_capability(CPU) is None
  assert capability.device_compute_capability(ROCM) is None
  assert capability.device_compute_capability(FakeDevice("gpu", "x", 0, "10.3")) == pytest.approx(10.3)


@pytest.mark.parametrize("devices", [[B200], [B200, B200_1], [RTX5090]])
def test_auto_picks_te_on_blackwell_with_te(devices, fake_te):
  fake_te(**TE_OK)
  c = choose_backend("auto", devices=devices)
  assert c.name == "te"
  assert "2.9.0" in c.reason
  assert f"cc {devices[0].compute_capability}" in c.reason


@pytest.mark.parametrize(
    "devices,needle",
    [([CPU], "not a GPU"), ([H100], "compute capability 9.0"), ([B200, dataclasses.replace(H100, id=1)], "9.0"),
     ([ROCM], "no CUDA compute capability"), ([], "no JAX devices")],
)
def test_auto_falls_back_to_emulate_with_the_device_reason(devices, needle, fake_te):
  fake_te("2.9.0", import_error=_never_called)
  c = choose_backend("auto", devices=devices)
  assert c.name == "emulate"
  assert needle in c.reason and "\n" not in c.reason


def test_auto_mixed_devices_names_the_offending_device(fake_te):
  fake_te(**TE_OK)
  h100_1 = dataclasses.replace(H100, id=1)
  c = choose_backend("auto", devices=[B200, h100_1])
  assert c.name == "emulate" and "gpu 1 (NVIDIA H100" in c.reason


def test_auto_emulates_on_blackwell_without_te(fake_te):
  fake_te(None, import_error=_never_called)
  c = choose_backend("auto", devices=[B200])
  assert c.name == "emulate" and "not installed" in c.reason and "maxtext-nvfp4[te]" in c.reason


def test_auto_emulates_when_te_installed_but_import_fails(fake_te):
  fake_te("2.9.0", import_error="ImportError: libcudart.so.13")
  c = choose_backend("auto", devices=[B200])
  assert c.name == "emulate" and "libcudart" in c.reason and "2.9.0" in c.reason


def test_emulate_is_always_emulate(fake_te):
  fake_te(**TE_OK)
  c = choose_backend("emulate", devices=[B200])
  assert c.name == "emulate" and "requested" in c.reason


def test_te_requested_on_blackwell_with_te(fake_te):
  fake_te(**TE_OK)
  assert choose_backend("te", devices=[B200, B200_1]).name == "te"


@pytest.mark.parametrize(
    "devices,kw,why",
    [
        ([CPU], TE_OK, "not a GPU"),
        ([H100], TE_OK, "compute capability 9.0 < 10.0"),
        ([B200], NO_TE, "Transformer Engine is not installed"),
        ([B200], dict(version="2.9.0", import_error="OSError: libcublasLt"), "libcublasLt"),
    ],
)
def test_te_requested_where_impossible_raises_one_line_why_and_what_to_do(devices, kw, why, fake_te):
  fake_te(**kw)
  with pytest.raises(BackendError) as e:
    choose_backend("te", devices=devices)
  msg = str(e.value)
  assert "\n" not in msg
  assert msg.startswith("nvfp4_backend=te cannot run: ")
  assert why in msg
  assert "nvfp4_backend=emulate" in msg
  assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("devices", [[CPU], [B200]])
def test_te_requested_without_te_says_how_to_install(devices, fake_te):
  fake_te(**NO_TE)
  with pytest.raises(BackendError, match=r"pip install 'maxtext-nvfp4\[te\]'"):
    choose_backend("te", devices=devices)


def test_unknown_backend_rejected(fake_te):
  fake_te(**TE_OK)
  with pytest.raises(BackendError, match="choose one of: auto, emulate, te"):
    choose_backend("cuda", devices=[B200])


def test_real_cpu_host_picks_emulate_without_importing_te():
  code = (
      "import sys; from maxtext_nvfp4.backends import capability as c; ch = c.choose_backend('auto'); "
      "assert ch.name == 'emulate', ch; assert 'not a GPU' in ch.reason, ch; "
      "assert not [m for m in sys.modules if m.startswith('transformer_engine')]; print(ch.reason)"
  )
  out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                       env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
  assert "cpu" in out.stdout


def test_announce_logs_once():
  lines = []
  c = capability.BackendChoice(name="emulate", reason="unit-test reason 1234")
  assert capability.announce(c, lines.append) is True
  assert capability.announce(c, lines.append) is False
  assert len(lines) == 1 and "emulate" in lines[0] and "unit-test reason 1234" in lines[0]
