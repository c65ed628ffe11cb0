"""The TE backend's start-up line on FSDP weight gathers (``integration/te_weight_gather.py``), on this CPU.

TE is not installed in the core environment: the TE adapter is built against the fake of TE's names of
``test_te_backend.py`` and the backend choice is set to ``te`` (what a Blackwell run picks). What TE gathers is
checked with real TE in the te stage (tests/te/test_te_weight_gather.py); here: the mesh axes the line names, that
MaxText's repeated quantization builds print it exactly once, only with a weight-sharding axis of more than one
device, and ``nvfp4_fp4_weight_gather=off`` refused with ``nvfp4_backend=te`` and explained under ``auto``.
"""

import types

import pytest
from maxtext.configs import pyconfig

import maxtext_nvfp4
from maxtext_nvfp4.backends import capability
from maxtext_nvfp4.backends import te as te_backend
from maxtext_nvfp4.core import settings as settings_mod
from maxtext_nvfp4.integration import compile_target
from maxtext_nvfp4.integration import log_once as log_once_mod
from maxtext_nvfp4.integration import quantization
from maxtext_nvfp4.integration import te_weight_gather

from maxtext_helpers import tiny_argv
from test_te_backend import fake_te  # pylint: disable=unused-import  # the fixture

_PREFIX = "maxtext-nvfp4: TE backend, weights sharded over"
# Sizes TE accepts (the te stage's tiny model): every NVFP4 GEMM dimension a multiple of TE's blocks.
_TE_SIZES = dict(base_emb_dim=256, base_mlp_dim=512, head_dim=64, max_target_length=128, per_device_batch_size=2,
                 base_num_decoder_layers=1)


def _config(**overrides):
  maxtext_nvfp4.register()
  return pyconfig.initialize(tiny_argv(**{"quantization": "nvfp4", **_TE_SIZES, **overrides}))


@pytest.fixture(scope="module")
def mesh_keys():
  """The mesh keys of a real MaxText config (its axes, its ICI/DCN lists, its logical axis rules)."""
  c = _config()
  return dict(mesh_axes=list(c.mesh_axes), ici_parallelism=list(c.ici_parallelism),
              dcn_parallelism=list(c.dcn_parallelism), num_slices=c.num_slices, logical_axis_rules=c.logical_axis_rules)


@pytest.mark.parametrize("ici, devices, axes", [
    ({}, 4, {"fsdp": 4}),  # ici_fsdp_parallelism=-1: every device on fsdp
    ({"fsdp": 2, "tensor": 2}, 4, {"fsdp": 2}),
    ({"fsdp": 2, "fsdp_transpose": 2}, 4, {"fsdp": 2, "fsdp_transpose": 2}),
    ({"fsdp": 1, "tensor": -1}, 4, {}),  # tensor parallelism is not gathered
    ({"fsdp": 2, "expert": 2}, 4, {"fsdp": 2, "expert": 2}),  # a dense kernel's embed dim is sharded on expert too
    ({}, 1, {}),
])
def test_the_axes_are_those_sharding_both_kernels_and_tokens(mesh_keys, ici, devices, axes):
  keys = {**mesh_keys, "ici_parallelism": list(mesh_keys["ici_parallelism"])}
  for axis, n in ici.items():
    keys["ici_parallelism"][keys["mesh_axes"].index(axis)] = n
  assert te_weight_gather.weight_gather_axes(types.SimpleNamespace(**keys), devices) == axes


def _built_twice(monkeypatch, capsys, devices, **keys):
  """make_quantization twice (as MaxText builds it) on the TE path with ``devices`` devices; the lines printed."""
  config = _config(**keys)
  monkeypatch.setattr(compile_target, "choose_backend",
                      lambda config, s: capability.BackendChoice(name="te", reason="a test's Blackwell"))
  monkeypatch.setattr(compile_target, "device_count", lambda config: devices)
  monkeypatch.setattr(log_once_mod, "_logged", set())
  capsys.readouterr()
  quantization.make_quantization(config)
  quantization.make_quantization(config)
  return [l for l in capsys.readouterr().out.splitlines() if l.startswith(_PREFIX)]


def test_the_line_is_printed_once_with_fsdp(fake_te, monkeypatch, capsys):
  del fake_te
  lines = _built_twice(monkeypatch, capsys, 4)
  assert len(lines) == 1, lines
  assert lines[0].startswith(f"{_PREFIX} fsdp=4: TE all-gathers each NVFP4 kernel already quantized"), lines
  assert "0.5625 B/weight per gather instead of bf16's 2" in lines[0] and "fp4_weight_gather" not in lines[0]


def test_no_line_without_fsdp(fake_te, monkeypatch, capsys):
  del fake_te
  assert _built_twice(monkeypatch, capsys, 4, ici_fsdp_parallelism=1, ici_data_parallelism=4) == []  # DP: not gathered
  assert _built_twice(monkeypatch, capsys, 1) == []


def test_off_under_auto_is_explained_on_the_line(fake_te, monkeypatch, capsys):
  del fake_te
  lines = _built_twice(monkeypatch, capsys, 2, nvfp4_fp4_weight_gather="off")
  assert len(lines) == 1 and lines[0].endswith("; nvfp4_fp4_weight_gather=off does not apply to TE (it has no"
                                               " bf16 weight gather)"), lines


def test_off_with_te_is_refused_in_one_line():
  with pytest.raises(capability.BackendError) as e:
    te_backend.check_te_settings(settings_mod.Nvfp4Settings(backend="te", fp4_weight_gather="off"))
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith("nvfp4_fp4_weight_gather=off cannot run on Transformer Engine")
  assert "nvfp4_backend=emulate" in msg
  te_backend.check_te_settings(settings_mod.Nvfp4Settings(backend="auto", fp4_weight_gather="off"))
  te_backend.check_te_settings(settings_mod.Nvfp4Settings(backend="te", fp4_weight_gather="auto"))
