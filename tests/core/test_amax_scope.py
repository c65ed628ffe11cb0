"""nvfp4_amax_scope: the operands' amax blocks from partition specs (core/amax_scope.py) and from MaxText's
logical axis rules on a mesh (integration/mesh_scope.py). Pure and trace-free: an abstract mesh suffices.
The numerics of each scope on 8 real host devices: tests/core/test_gemm_sharding.py."""

import jax
import pytest
from flax.linen import partitioning as nn_partitioning
from jax.sharding import AbstractMesh

from maxtext_nvfp4.core import amax_scope
from maxtext_nvfp4.core import settings
from maxtext_nvfp4.core.gemm import AmaxGroups
from maxtext_nvfp4.integration import mesh_scope
from maxtext_nvfp4.tools import recipes as recipes_mod

MLP_IN = (((2,), (0,)), ((), ()))


def test_te_scope_from_specs():
  mesh = {"data": 2, "fsdp": 2, "tp": 2}
  # x batch-sharded over data x fsdp; W (E, F) over (fsdp, tp): TE pmaxes W over fsdp only.
  g = amax_scope.amax_groups(mesh=mesh, x_rows=[("data", "fsdp"), None], x_k=[None], w_k=["fsdp"], w_n=["tp"])
  assert g == AmaxGroups(tokens=4, x_k=1, w_k=1, w_n=2, dy_n=2, token_axes=("data", "fsdp"))
  # The sequence dim on the tensor-sequence axis is reduced by TE (AmaxScope.TPSP): no extra blocks.
  g = amax_scope.amax_groups(mesh={"fsdp": 4, "tensor_sequence": 2}, x_rows=["fsdp", "tensor_sequence"],
                             x_k=[None], w_k=["fsdp"], w_n=[None])
  assert g == AmaxGroups(tokens=4, token_axes=("fsdp",))
  # Anything else on the sequence dim would give non-contiguous token blocks: refused in one line.
  with pytest.raises(amax_scope.AmaxScopeError) as e:
    amax_scope.amax_groups(mesh={"context": 2}, x_rows=[None, "context"], x_k=[None], w_k=[None], w_n=[None])
  assert "\n" not in str(e.value) and "nvfp4_amax_scope=global" in str(e.value)
  assert amax_scope.describe(AmaxGroups(tokens=4, w_n=2, dy_n=2)) == "x: 4x1, W: 1x2, dy: 4x2"


def test_setting_is_validated_and_defaults_to_te():
  assert settings.Nvfp4Settings().amax_scope == "te"
  settings.validate(settings.Nvfp4Settings(amax_scope="global"))
  with pytest.raises(settings.SettingsError) as e:
    settings.validate(settings.Nvfp4Settings(amax_scope="device"))
  assert "nvfp4_amax_scope='device'" in str(e.value) and "te, global" in str(e.value)


@pytest.fixture(scope="module")
def maxtext_rules():
  return recipes_mod.resolve(["demo_nvfp4.yml"]).values["logical_axis_rules"]


@pytest.mark.parametrize("mesh, kernel_axes, want", [
    # The 8B recipe on 4 GPUs (FSDP 4): x and dy per device (4 token blocks), W one amax (pmax over fsdp).
    ((("fsdp", 4),), ("embed", "mlp"), AmaxGroups(tokens=4, token_axes=("fsdp",))),
    ((("fsdp", 4),), ("mlp", "embed"), AmaxGroups(tokens=4, token_axes=("fsdp",))),
    # FSDP 4 x TP 2 with MaxText's rules: activation_embed and mlp/heads on `tensor`.
    ((("fsdp", 4), ("tensor", 2)), ("embed", "mlp"), AmaxGroups(tokens=4, x_k=2, w_n=2, dy_n=2, token_axes=("fsdp",))),
    ((("fsdp", 4), ("tensor", 2)), ("mlp", "embed"), AmaxGroups(tokens=4, x_k=2, w_k=2, token_axes=("fsdp",))),
    ((("data", 2), ("fsdp", 2), ("tensor", 2)), ("embed", "q_heads", "kv"),
     AmaxGroups(tokens=4, x_k=2, w_n=2, dy_n=2, token_axes=("data", "fsdp"))),
])
def test_maxtext_shardings_give_te_scopes(maxtext_rules, mesh, kernel_axes, want):
  names, sizes = zip(*mesh)
  with jax.sharding.use_abstract_mesh(AbstractMesh(sizes, names)), nn_partitioning.axis_rules(maxtext_rules):
    assert mesh_scope.te_amax_groups((8, 64, 128), (128, 256), MLP_IN, kernel_axes, "role") == want


def test_no_mesh_or_one_device_is_the_global_scope(maxtext_rules):
  shapes = ((8, 64, 128), (128, 256))
  assert mesh_scope.te_amax_groups(*shapes, MLP_IN, ("embed", "mlp")) is None
  with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("fsdp",))), nn_partitioning.axis_rules(maxtext_rules):
    assert mesh_scope.te_amax_groups(*shapes, MLP_IN, ("embed", "mlp")) is None


def test_blocks_te_would_refuse_fall_back_to_one_amax_with_a_warning(maxtext_rules, caplog):
  # 4 devices, 2 x 8 tokens: 4 tokens per device, not a multiple of 16 (TE refuses it; te_limits says so).
  with jax.sharding.use_abstract_mesh(AbstractMesh((4,), ("fsdp",))), nn_partitioning.axis_rules(maxtext_rules):
    assert mesh_scope.te_amax_groups((2, 8, 128), (128, 256), MLP_IN, ("embed", "mlp"), "wi_0") is None
    assert mesh_scope.te_amax_groups((8, 64, 128), (128, 256), MLP_IN, ("embed", "mlp"), "wi_0") == AmaxGroups(
        tokens=4, token_axes=("fsdp",))
  assert any("x rows 16/4" in r.getMessage() and "one amax per tensor" in r.getMessage() for r in caplog.records)
