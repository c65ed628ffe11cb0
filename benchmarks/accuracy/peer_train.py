"""Launch MaxText training with a PEER FP4 path (not ours), for the accuracy study.

  python benchmarks/accuracy/peer_train.py qwix  RECIPE.yml key=value ...
  python benchmarks/accuracy/peer_train.py jaxnn RECIPE.yml key=value ...
  python benchmarks/accuracy/peer_train.py ours_fwd recipes/demo_nvfp4.yml key=value ...   (diagnostic)

Both run ``maxtext_nvfp4.train.cli_main`` (MaxText's ``train.main`` with our plugin registered, so the
recipe files, tokenizer default and step logs are identical to our arms) after monkeypatching MaxText:

* ``qwix``: qwix's ``nvfp4`` qtype through MaxText's own qwix path. ``quantizations.get_qt_provider`` is
  replaced by a ``qwix.QtProvider`` with one rule for every decoder projection
  (``module_path=r"decoder/.*layers.*"``, ``op_names=("dot_general",)``): weights, activations and
  gradients in ``nvfp4`` with 16-element tiles along the last contracting axis (fwd ``tile_size=16``;
  bwd ``dlhs_tile_size = drhs_tile_size = 16``, which qwix only takes through ``additional_qt_config``).
  Each tile's scale is ``e4m3(absmax(tile) / 6)`` with **no FP32 per-tensor scale**, so tiles whose
  absmax is below ~6 * 2^-10 flush to zero; no RHT, no 2D weight blocks, no stochastic rounding.
  ``qwix_fwd`` is the same forward with BF16 gradients (a diagnostic: isolates the gradient underflow).
  Needs ``quantization=fp4 use_qwix_quantization=true`` (any qwix-routed value keeps the config valid;
  the provider ignores it). The LM head (``decoder/logits_dense``) stays BF16 as in our recipe.
* ``jaxnn``: ``jax.nn.scaled_dot_general`` with ``jax.nn.get_scaled_dot_general_config("nvfp4",
  global_scale)`` for lhs, rhs and the gradient. ``quantizations.configure_quantization`` returns a
  ``Quantization`` whose Linen dot_general calls it for every decoder projection (the same GEMMs our
  ``nvfp4_targets=all`` quantizes; the LM head is never given ``quant``). Semantics (JAX 0.12
  ``jax/_src/cudnn/scaled_matmul_stablehlo.py``): forward ``x / g`` is cut into 1x16 blocks along the
  (flattened) contracting axis, block scale ``s = e4m3(clip(amax / 6, 0, 448))``, value ``e2m1(x / g / s)``
  (round-to-nearest), output ``(sum q_x s_x q_w s_w) * g_x * g_w``; ``g`` is a STATIC global scale
  (``--global-scale``, default 1.0 = JAX's default) -- not the per-tensor amax/(6*448) NVFP4 scale. No
  2D weight blocks, RHT or stochastic rounding. Its backward (nvfp4 mode) does NOT quantize: dgrad and
  wgrad are plain ``matmul`` of the BF16 gradient with the unquantized residuals, zeroed where the
  forward input was clipped (``|x| > g * 6 * 448``). It lowers on CPU (XLA expands the scaled matmul
  into dequantize + dot; JAX keeps the FP4/E4M3 casts with an optimization barrier), so this IS
  ``jax.nn.scaled_dot_general``, not a re-implementation. Run it with ``quantization=""``.

Benchmarks may touch MaxText internals directly; the package itself never does this.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

PEERS = ("qwix", "qwix_fwd", "jaxnn", "ours_fwd")


def qwix_rules(backward: bool = True):
  """The qwix rules of the ``qwix`` peer (a list with one ``QtRule``). ``backward=False`` (the ``qwix_fwd``
  diagnostic arm): the same forward, gradients left in BF16."""
  import qwix  # pylint: disable=import-outside-toplevel

  bwd = dict(bwd_qtype="nvfp4",
             # qwix derives the bwd tile sizes from bwd_weight_grad_tile_size only; nvfp4 demands exactly 16.
             additional_qt_config={"dlhs_tile_size": 16, "drhs_tile_size": 16}) if backward else {}
  return [qwix.QtRule(
      module_path=r"decoder/.*layers.*",
      weight_qtype="nvfp4",
      act_qtype="nvfp4",
      tile_size=16,
      op_names=("dot_general",),
      **bwd,
  )]


def install_qwix(backward: bool = True) -> None:
  import qwix  # pylint: disable=import-outside-toplevel
  from maxtext.layers import quantizations  # pylint: disable=import-outside-toplevel

  def get_qt_provider(config):
    del config  # the peer is the same whatever qwix-routed `quantization` value selected the qwix path
    return qwix.QtProvider(qwix_rules(backward))

  quantizations.get_qt_provider = get_qt_provider


@functools.cache
def _jaxnn_module_class():
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  class JaxNnNvfp4DotGeneral(nn.Module):
    """``jax.nn.scaled_dot_general(lhs, rhs, dims, configs=[nvfp4(g)] * 3)`` (no variables)."""

    # static global scale g of every operand (jax.nn's default is 1.0)
    global_scale: float = 1.0

    @nn.compact
    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
      del kwargs
      out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
      if self.is_initializing():  # DenseGeneral's dummy init call: output discarded, shapes may not tile
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=out_dtype)
      # a concrete numpy constant: the config is a non-differentiable custom_vjp argument, and a jnp array
      # built here would be a tracer that leaks out of MaxText's remat into the backward pass
      g = np.full((1,), self.global_scale, np.float32)
      cfg = jax.nn.get_scaled_dot_general_config("nvfp4", g)
      # its bwd asserts lhs.dtype == rhs.dtype (MaxText hands both in the compute dtype already)
      rhs = rhs.astype(lhs.dtype)
      return jax.nn.scaled_dot_general(lhs, rhs, dimension_numbers, preferred_element_type=out_dtype,
                                       configs=[cfg, cfg, cfg])

  return JaxNnNvfp4DotGeneral


def install_jaxnn(global_scale: float = 1.0) -> None:
  from maxtext.layers import quantizations  # pylint: disable=import-outside-toplevel

  module_cls = _jaxnn_module_class()

  @dataclasses.dataclass
  class JaxNnNvfp4Quantization(quantizations.Quantization):
    """Every decoder projection through ``jax.nn.scaled_dot_general`` nvfp4."""

    needs_apply_rngs = False  # no stochastic rounding, no rng stream
    quant_mode = "train"

    def dot_general_cls(self, mesh_axes=()):
      del mesh_axes
      return functools.partial(module_cls, global_scale=global_scale)

    def einsum(self, dtype=None):
      raise NotImplementedError("jaxnn peer: DenseGeneral projections only")

    def get_block_size(self) -> int:
      return 16

  orig = quantizations.configure_quantization

  def configure_quantization(config, quant_mode_str: str = "train"):
    if config.quantization:  # the peer replaces the unquantized path only
      return orig(config, quant_mode_str=quant_mode_str)
    return JaxNnNvfp4Quantization()

  quantizations.configure_quantization = configure_quantization


def install_ours_fwd() -> None:
  """Our recipe with dgrad and wgrad in BF16 (fprop NVFP4 unchanged): the same GEMMs quantized as the
  jax.nn peer, whose nvfp4 backward does not quantize. A diagnostic, not a supported setting: it wraps
  ``maxtext_nvfp4.core.plan.gemm_recipes``, which the plugin looks up per projection."""
  from maxtext_nvfp4.core import plan  # pylint: disable=import-outside-toplevel

  orig = plan.gemm_recipes

  def gemm_recipes(s, *, layer, role, num_layers):
    before, after = orig(s, layer=layer, role=role, num_layers=num_layers)
    fwd_only = lambda r: None if r is None else dataclasses.replace(r, dgrad="bf16", wgrad="bf16")  # noqa: E731
    return fwd_only(before), fwd_only(after)

  plan.gemm_recipes = gemm_recipes


def main(argv: list[str]) -> int:
  if not argv or argv[0] not in PEERS:
    print(f"usage: peer_train.py {{{'|'.join(PEERS)}}} [--global-scale G] RECIPE.yml key=value ...",
          file=sys.stderr)
    return 2
  peer, rest = argv[0], list(argv[1:])
  global_scale = 1.0
  if rest[:1] == ["--global-scale"]:
    global_scale, rest = float(rest[1]), rest[2:]
  import maxtext_nvfp4  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import train  # pylint: disable=import-outside-toplevel

  maxtext_nvfp4.register()
  from maxtext.layers import quantizations  # pylint: disable=import-outside-toplevel,unused-import

  if peer in ("qwix", "qwix_fwd"):
    install_qwix(backward=peer == "qwix")
    print(f"peer_train: qwix nvfp4 (tile 16, no tensor scale, {'fwd+bwd' if peer == 'qwix' else 'fwd only'}) on"
          " decoder/.*layers.* dot_generals", flush=True)
  elif peer == "ours_fwd":
    install_ours_fwd()
    print("peer_train: OUR recipe with dgrad/wgrad in BF16 (fprop NVFP4) -- diagnostic", flush=True)
  else:
    install_jaxnn(global_scale)
    print(f"peer_train: jax.nn.scaled_dot_general nvfp4 (static global scale {global_scale:g}) on every"
          " decoder projection", flush=True)
  return train.cli_main(rest)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
