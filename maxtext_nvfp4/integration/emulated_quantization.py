"""``Nvfp4Quantization``: the emulated ``quantization=nvfp4`` object MaxText's layers ask for their GEMMs.

A ``maxtext.layers.quantizations.Quantization`` whose ``dot_general_cls(mesh_axes)`` names the projection
being built (:class:`maxtext_nvfp4.core.plan.GemmLocator`), looks up its GEMM recipes
(:func:`maxtext_nvfp4.core.plan.gemm_recipes`) and returns the Linen module of :mod:`linen_gemm`;
``einsum`` serves RoutedMoE's expert einsums and ``expert_gemms`` the sparse path's grouped GEMM
(:mod:`sparse_moe`). The class is built on first use (MaxText is imported only then).
"""

from __future__ import annotations

import dataclasses
import functools
import types

from maxtext_nvfp4.core import plan as plan_lib
from maxtext_nvfp4.core import settings as settings_lib
from maxtext_nvfp4.integration import linen_gemm
from maxtext_nvfp4.integration import sparse_moe
from maxtext_nvfp4.integration import touchpoints
from maxtext_nvfp4.integration import traced


def _plain_bf16(recipe) -> bool:
  return recipe is None or (recipe.fprop, recipe.dgrad, recipe.wgrad) == ("bf16", "bf16", "bf16")


@dataclasses.dataclass
class EmulatedQuantizationMixin:
  """``quantization=nvfp4`` (emulated): every decoder projection's GEMM in its planned precision. Mixed in before
  MaxText's ``Quantization`` by :func:`quantization_class` (MaxText is imported only then)."""

  # SR keys come from (nvfp4_seed, step, layer, role), never from MaxText's rng streams.
  needs_apply_rngs = False
  # MaxText's in_serve_mode/in_convert_mode read it (AQT's modes); emulated NVFP4 is always "train".
  quant_mode = "train"

  # the run's NVFP4 settings
  settings: settings_lib.Nvfp4Settings = dataclasses.field(default_factory=settings_lib.Nvfp4Settings)
  # config.num_decoder_layers
  num_layers: int = 1
  # names each projection from the order of dot_general_cls calls (a fresh one per object)
  locator: plan_lib.GemmLocator = dataclasses.field(default_factory=lambda: plan_lib.GemmLocator(
      num_layers=1, signatures=touchpoints.adapter().kernel_signatures))
  # the first step of the late switch (None: off)
  switch_step: int | None = None
  # nvfp4_diagnostics_interval when nvfp4_diagnostics is on, else 0 (no diagnostics code traced)
  diagnostics_interval: int = 0
  # nvfp4_qat=serving: role -> (its fused group's roles, serving_gemm.Member) (serving_layout.members); else None
  serving_members: dict | None = None

  def _located_recipes(self, mesh_axes):
    """(layer, role, recipe, switched) of the next projection built with ``mesh_axes`` (None: plain BF16)."""
    layer, role = self.locator.locate(mesh_axes)
    recipe, switched = plan_lib.gemm_recipes(self.settings, layer=layer, role=role, num_layers=self.num_layers)
    if _plain_bf16(recipe) and _plain_bf16(switched):
      recipe = switched = None
    return layer, role, recipe, switched

  def dot_general_cls(self, mesh_axes=()):
    layer, role, recipe, switched = self._located_recipes(mesh_axes)
    if self.serving_members is not None and recipe is not None and recipe.fprop == "nvfp4":
      # the export's forward instead of the training recipe's (no diagnostics: the export's quantizer)
      extra = {"serving": self.serving_members[role]}
      group = None
    else:
      group = self.diagnostics_group(layer, role, recipe)
      extra = {} if group is None else {"diag_group": group, "diag_interval": int(self.diagnostics_interval)}
    return functools.partial(linen_gemm.linen_module_class(), recipe=recipe, switched=switched,
                             switch_step=self.switch_step if switched is not None else None,
                             layer=layer, role=role, seed=int(self.settings.seed),
                             kernel_axes=tuple(mesh_axes), amax_scope=self.settings.amax_scope,
                             fp4_weight_gather=self.settings.fp4_weight_gather, **extra)

  def diagnostics_group(self, layer: int | None, role: str, recipe) -> str | None:
    """Aggregation group of a GEMM with diagnostics on and an NVFP4 pass before the switch, else None.

    First/last: the first/last layer that runs NVFP4 (``keep_first_layers``,
    ``num_layers - 1 - keep_last_layers``).
    """
    if not self.diagnostics_interval or recipe is None or "nvfp4" not in traced.passes(recipe):
      return None
    from maxtext_nvfp4.core import diagnostics  # pylint: disable=import-outside-toplevel

    first = int(self.settings.keep_first_layers)
    last = self.num_layers - 1 - int(self.settings.keep_last_layers)
    return diagnostics.group_name(plan_lib.role_group(role), layer, first=first, last=last)

  def einsum(self, mesh_axes=(), dtype=None):
    """RoutedMoE's einsum for kernel axes ``mesh_axes`` (asked for at call time, sparse_matmul=false).

    Dispatch/combine (routing masks, ``activation_*`` axes) stay plain high-precision einsums; the
    expert linears run one emulated GEMM per expert in their planned precision.
    """
    del dtype
    if mesh_axes and str(mesh_axes[0]).startswith(touchpoints.adapter().routing_axis_prefix):
      import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

      return jnp.einsum
    layer, role, recipe, switched = self._located_recipes(mesh_axes)
    group = self.diagnostics_group(layer, role, recipe)
    return linen_gemm.expert_einsum(recipe, switched, self.switch_step if switched is not None else None, layer, role,
                                    int(self.settings.seed), diag_group=group,
                                    diag_interval=int(self.diagnostics_interval),
                                    fp4_weight_gather=self.settings.fp4_weight_gather)

  def expert_gemms(self):
    """RoutedMoE.sparse_matmul's three expert linears (wi_0, wi_1, wo), asked for at call time
    (sparse_matmul=true; :mod:`maxtext_nvfp4.integration.sparse_moe`), located as the einsum path's are."""
    wi, wo = touchpoints.adapter().expert_kernel_axes
    out = []
    for axes in (wi, wi, wo):
      layer, role, recipe, switched = self._located_recipes(axes)
      out.append(sparse_moe.ExpertGemm(layer=layer, role=role, recipe=recipe, switched=switched,
                                       switch_step=self.switch_step if switched is not None else None,
                                       seed=int(self.settings.seed),
                                       diag_group=self.diagnostics_group(layer, role, recipe),
                                       diag_interval=int(self.diagnostics_interval)))
    return tuple(out)

  @property
  def quant_dg(self):
    """Where the MaxText version's sparse_matmul reads ``quant.quant_dg`` unconditionally (the adapter's
    ``sparse_matmul_reads_quant_dg``): a stand-in whose lhs/rhs dtypes are None (the gmm wrapper replaces
    the kernel and ignores them). Elsewhere no such attribute, as MaxText's ``getattr(..., None)`` expects."""
    if not touchpoints.adapter().sparse_matmul_reads_quant_dg:
      raise AttributeError("quant_dg")
    side = types.SimpleNamespace(numerics=types.SimpleNamespace(get_dtype=lambda: None))
    return types.SimpleNamespace(fwd=types.SimpleNamespace(dg_quantizer=types.SimpleNamespace(lhs=side, rhs=side)))

  def get_block_size(self) -> int:
    # DenseGeneral's dummy init batch: one full NVFP4 block of tokens.
    return 16


@functools.cache
def quantization_class():
  """``Nvfp4Quantization``: :class:`EmulatedQuantizationMixin` over MaxText's ``quantizations.Quantization``."""
  from maxtext.layers import quantizations  # pylint: disable=import-outside-toplevel

  return type("Nvfp4Quantization", (EmulatedQuantizationMixin, quantizations.Quantization),
              {"__module__": __name__, "__qualname__": "Nvfp4Quantization"})
