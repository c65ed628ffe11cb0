"""Every "Transformer Engine would refuse" rule we state, against what real TE does when it traces that GEMM.

:mod:`maxtext_nvfp4.core.te_limits` is the one source of the limits the TE backend refuses at start-up, the emulation
warns about and ``doctor`` lists. Here each shape of a grid around the limits' boundaries (M tokens, K, N on
multiples of 16 / 32 / 64 / 128 and off them; RHT on and off; bf16 and fp32 activations; 2D and 1D weights) is
both judged by ``te_limits.refusals`` and traced fwd+bwd by real TE JAX for a B200 (``dense`` through our adapter):
a rule TE does not enforce, or an enforcement we do not state, fails.
"""

import itertools
import types

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from maxtext_nvfp4.backends import targets
from maxtext_nvfp4.core import settings as settings_mod
from maxtext_nvfp4.core import te_limits
from maxtext_nvfp4.integration import te_quantization


def _te_refuses(m: int, k: int, n: int, *, rht: bool, two_d: bool, dtype) -> str | None:
  """None when TE traces fwd+bwd of x (m, k) @ W (k, n) in NVFP4; else the first line of its error."""
  import maxtext_nvfp4  # pylint: disable=import-outside-toplevel

  maxtext_nvfp4.register()
  from maxtext.layers import linears, quantizations  # pylint: disable=import-outside-toplevel

  s = settings_mod.Nvfp4Settings(rht=rht, two_d_weights=two_d)
  q = te_quantization.make_te_quantization(quantizations.TransformerEngineQuantization,
                                           types.SimpleNamespace(te_comm_gemm_overlap="disabled"), s,
                                           lambda axes: "nvfp4")

  def fwd_bwd(x):
    layer = linears.DenseGeneral(k, n, kernel_axes=("embed", "mlp"), quant=q, dtype=dtype,
                                 weight_dtype=jnp.float32, rngs=nnx.Rngs(params=0, dropout=1, aqt=2))
    return nnx.grad(lambda layer, x: jnp.sum(layer(x).astype(jnp.float32) ** 2), argnums=(0, 1))(layer, x)

  mesh = jax.sharding.Mesh(targets.devices("b200", 1), ("fsdp",))
  try:
    with jax.set_mesh(mesh):
      x = jax.ShapeDtypeStruct((m, k), dtype, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
      jax.jit(fwd_bwd).lower(x)
  except Exception as e:  # pylint: disable=broad-except  (TE asserts, raises ValueError/AssertionError)
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
  return None


def _ours(m: int, k: int, n: int, *, rht: bool, two_d: bool, dtype) -> list[str]:
  g = te_limits.GemmDims(layers="layer 0", role="wi_0", tokens=m, k=k, n=n, dtype=jnp.dtype(dtype).name,
                         nvfp4_passes=("fprop", "dgrad", "wgrad"))
  return [r.text() for r in te_limits.refusals(g, rht=rht, two_d_weights=two_d)]


_SIZES = (48, 96, 128)  # % 16 only; % 32 only; % 128
CASES = ([(m, k, n, rht, True, "bfloat16") for m, k, n, rht in itertools.product(_SIZES, _SIZES, _SIZES, (True, False))]
         + [(128, 40, 128, False, True, "bfloat16"), (128, 128, 40, False, True, "bfloat16"),  # not % 16
            (40, 128, 128, False, True, "bfloat16"), (64, 128, 128, True, True, "bfloat16"),
            (128, 128, 128, True, True, "float32"), (128, 128, 128, False, True, "float32"),  # RHT needs bf16
            (128, 48, 96, False, False, "bfloat16"), (128, 96, 48, False, False, "bfloat16")])  # 1D weights


@pytest.mark.parametrize("m, k, n, rht, two_d, dtype", CASES)
def test_te_refuses_exactly_what_te_limits_states(m, k, n, rht, two_d, dtype):
  ours = _ours(m, k, n, rht=rht, two_d=two_d, dtype=dtype)
  theirs = _te_refuses(m, k, n, rht=rht, two_d=two_d, dtype=getattr(jnp, dtype))
  assert bool(ours) == (theirs is not None), (
      f"M={m} K={k} N={n} rht={rht} 2d={two_d} {dtype}: te_limits says {ours or 'runs'}; TE: {theirs or 'traces'}")
