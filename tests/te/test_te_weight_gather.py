"""What real TE all-gathers under FSDP, compiled for four compile-only B200s: the start-up line's claims.

MaxText's ``DenseGeneral`` with our TE adapter, its kernel (K x N) sharded over ``fsdp`` = 4 on K and the tokens
over ``fsdp`` too, under MaxText's TE context (``maybe_get_transformer_engine_context``: TE's ``MeshResource``),
fwd + bwd compiled by XLA:GPU. The all-gathers of the optimized HLO are what
:mod:`maxtext_nvfp4.integration.te_weight_gather` says TE does: two copies of the kernel (column-wise for the
fprop, row-wise for the dgrad), each E2M1 codes (``s8``, two per byte) + one E4M3 scale per 16 weights, no bf16
or fp32 copy -- so the line fails here when TE changes. The plan's ``bf16`` GEMM (a plain dot, no TE) gathers W in
bf16, the contrast that shows the count reads what it should.
"""

import math
import os
import re
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from maxtext_nvfp4.backends import targets
from maxtext_nvfp4.core import settings as settings_mod
from maxtext_nvfp4.integration import te_quantization
from maxtext_nvfp4.integration import te_weight_gather

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "gpu"))
import collectives  # pylint: disable=wrong-import-position,wrong-import-order

K, N, M, F = 256, 512, 256, 4
_AXES = ("data", "fsdp", "tensor", "tensor_sequence", "context", "expert")  # every axis TE's MeshResource names


def _gathered(precision: str) -> list[tuple[str, tuple[int, ...]]]:
  """(dtype, shape) of every array the compiled fwd+bwd all-gathers (the gathered, full-size side)."""
  import maxtext_nvfp4  # pylint: disable=import-outside-toplevel

  maxtext_nvfp4.register()
  from maxtext.layers import linears, quantizations  # pylint: disable=import-outside-toplevel
  from maxtext.utils import max_utils  # pylint: disable=import-outside-toplevel

  q = te_quantization.make_te_quantization(
      quantizations.TransformerEngineQuantization, types.SimpleNamespace(te_comm_gemm_overlap="disabled", steps=10),
      settings_mod.Nvfp4Settings(), lambda axes: precision)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: linears.DenseGeneral(
      K, N, kernel_axes=("embed", "mlp"), quant=q, dtype=jnp.bfloat16, weight_dtype=jnp.float32,
      rngs=nnx.Rngs(params=0, dropout=1, aqt=2))))

  def fwd_bwd(state, x):
    return nnx.grad(lambda layer, x: jnp.sum(layer(x).astype(jnp.float32) ** 2), argnums=(0, 1))(
        nnx.merge(graphdef, state), x)

  mesh = jax.sharding.Mesh(np.array(targets.devices("b200", F)).reshape(1, F, 1, 1, 1, 1), _AXES)
  with jax.set_mesh(mesh), max_utils.maybe_get_transformer_engine_context(types.SimpleNamespace(hardware="gpu")):
    shaped = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(
        mesh, P("fsdp", None) if a.shape == (K, N) else P())), state)
    x = jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))
    text = jax.jit(fwd_bwd).lower(shaped, x).compile().as_text()
  out = []
  for line in text.splitlines():
    m = re.match(r"^\s*(?:ROOT )?%\S+ = (.*?) all-gather(-start)?\(", line)
    if m:
      top = collectives._split_top(m.group(1))  # pylint: disable=protected-access
      gathered = top[1] if m.group(2) else m.group(1)
      out += [(d, tuple(int(s) for s in dims.split(",") if s)) for d, dims in re.findall(r"\b(\w+)\[([\d,]*)\]",
                                                                                        gathered)]
  return out


@pytest.fixture(scope="module")
def nvfp4_gathers():
  return _gathered("nvfp4")


def test_te_gathers_each_nvfp4_kernel_as_two_quantized_copies(nvfp4_gathers):
  per_dtype = {}
  for dtype, shape in nvfp4_gathers:
    per_dtype.setdefault(dtype, []).append(math.prod(shape))
  # Two copies (column-wise, row-wise), each K*N E2M1 codes two per byte and K*N/16 E4M3 scales; nothing else.
  assert per_dtype == {"s8": [K * N // 2] * te_weight_gather.COPIES,
                       "f8e4m3fn": [K * N // 16] * te_weight_gather.COPIES}, nvfp4_gathers
  total = sum(sum(v) for v in per_dtype.values())
  assert total == te_weight_gather.COPIES * te_weight_gather.BYTES_PER_WEIGHT_PER_COPY * K * N
  # The row-wise copy keeps N minor (N/2 bytes a row); the column-wise one is stored transposed (K minor).
  assert any(shape[-1] == N // 2 for d, shape in nvfp4_gathers if d == "s8"), nvfp4_gathers
  assert any(shape[-1] != N // 2 for d, shape in nvfp4_gathers if d == "s8"), nvfp4_gathers
  line = te_weight_gather.statement({"fsdp": F})
  assert "E2M1" in line and "E4M3" in line and "column-wise copy for the fprop" in line and "row-wise" in line


def test_a_bf16_gemm_gathers_the_kernel_in_bf16():
  gathers = _gathered("bf16")
  assert [(d, math.prod(s)) for d, s in gathers] == [("bf16", K * N)], gathers
