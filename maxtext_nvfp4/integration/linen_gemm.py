"""The Linen module of one emulated decoder projection, and RoutedMoE's expert einsum (``quantization=nvfp4``).

:func:`linen_module_class` is what ``Nvfp4Quantization.dot_general_cls`` hands MaxText's DenseGeneral:
``dot_general(lhs=activations, rhs=kernel)`` through :func:`maxtext_nvfp4.core.gemm.dot_general` in the
projection's planned precision, with the SR key of (seed, step, layer, role) (:mod:`traced`) and, with
``nvfp4_amax_scope=te``, the operands' amax blocks on the run's mesh (:mod:`mesh_scope`).
:func:`expert_einsum` runs RoutedMoE's expert linears one emulated GEMM per expert.
"""

from __future__ import annotations

import functools
from typing import Any

from maxtext_nvfp4.integration import fsdp_gather
from maxtext_nvfp4.integration import mesh_scope
from maxtext_nvfp4.integration import step as step_lib
from maxtext_nvfp4.integration import touchpoints
from maxtext_nvfp4.integration import traced


@functools.cache
def linen_module_class():
  """The Linen module MaxText's DenseGeneral wraps (built lazily: flax is imported only when used)."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  class Nvfp4DotGeneral(nn.Module):
    """``dot_general(lhs=activations, rhs=kernel)`` of one decoder projection, in its planned precision.

    ``recipe is None`` means every pass is BF16 before and after the switch: the plain
    ``lax.dot_general`` MaxText runs unquantized. Otherwise ``gemm.dot_general`` with the recipe, the
    switched recipe selected by ``step >= switch_step`` (traced: one compile for the whole run), and
    the SR key of (seed, step, layer, role). No variables: the checkpoint is unchanged.
    """

    # GemmRecipe before the switch, or None for plain BF16
    recipe: Any = None
    # GemmRecipe from switch_step on, or None (switch off)
    switched: Any = None
    # first step that uses `switched`
    switch_step: int | None = None
    # decoder layer index (None: scanned layers)
    layer: int | None = None
    # projection role (query, key, value, out, wi_0, wi_1, wo, ...)
    role: str = ""
    # nvfp4_seed
    seed: int = 0
    # diagnostics aggregation group (diagnostics.group_name), or None: no diagnostics (the normal path)
    diag_group: str | None = None
    # nvfp4_diagnostics_interval: statistics on steps with step % diag_interval == 0
    diag_interval: int = 1
    # the kernel's logical axes (DenseGeneral's kernel_axes): with amax_scope te, W's sharding
    kernel_axes: tuple = ()
    # nvfp4_amax_scope: te (TE's per-device / per-shard amaxes on the run's mesh) or global
    amax_scope: str = "global"
    # nvfp4_qat=serving: (the fused group's roles, serving_gemm.Member) of this projection, else None
    serving: Any = None
    # nvfp4_fp4_weight_gather: auto (NVFP4 weights all-gathered as codes + tile scales under FSDP) or off
    fp4_weight_gather: str = "off"

    @nn.compact
    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
      del kwargs  # e.g. MaxText's mutable=["aqt"] is consumed by Linen apply, nothing else is expected
      # recipe None: plain BF16. Initializing: DenseGeneral's dummy lazy_init call, whose output is
      # discarded (no variables to create), so skip the emulation's cost (same shape and dtype). The
      # gradient-fidelity reference pass: MaxText's plain GEMM too.
      if self.recipe is None or self.is_initializing() or step_lib.in_reference_pass():
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type)
      from maxtext_nvfp4.core import gemm  # pylint: disable=import-outside-toplevel

      training, step, use_switched, key = traced.step_inputs(self.layer, self.role, self.seed, self.recipe,
                                                             self.switched, self.switch_step)
      if self.serving is not None:
        return _served(self, lhs, rhs, dimension_numbers, preferred_element_type, use_switched, key)
      groups = None
      if self.amax_scope == "te":
        groups = mesh_scope.te_amax_groups(lhs.shape, rhs.shape, dimension_numbers, self.kernel_axes, self.role)
      gather = None
      if fsdp_gather.reads_quantized_weight(self.recipe, self.switched) and not dimension_numbers[1][1]:
        gather = fsdp_gather.weight_gather(rhs.shape, dimension_numbers[0][1], (), self.kernel_axes, self.role,
                                           groups, self.fp4_weight_gather)
      out = gemm.dot_general(lhs, rhs, dimension_numbers, recipe=self.recipe, switched=self.switched,
                             use_switched=use_switched, key=key, preferred_element_type=preferred_element_type,
                             amax_groups=groups, weight_gather=gather)
      if self.diag_group is None or not training:
        return out  # trace-time decision: without diagnostics the traced GEMM is exactly the one above
      observe = traced.diagnostics_observer(self.recipe, group=self.diag_group, interval=self.diag_interval,
                                            step=step, key=key)
      return observe(lhs, rhs, dimension_numbers, out)

  return Nvfp4DotGeneral


def _served(m, lhs, rhs, dimension_numbers, preferred_element_type, use_switched, key):
  """``nvfp4_qat=serving``'s forward (:mod:`maxtext_nvfp4.core.serving_gemm`) on the fp32 master kernels of the
  projection's fused group (:mod:`serving_layout`); after a late switch, the switched recipe's GEMM."""
  import jax  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.core import gemm  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.core import serving_gemm  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import serving_layout  # pylint: disable=import-outside-toplevel

  roles, member = m.serving
  published = serving_layout.masters() or {}
  group = tuple(published[r] for r in roles) if all(r in published for r in roles) else None
  if traced.step_lib.current_step() is not None:  # inside a train/eval step (not the build's dummy call)
    serving_layout.SERVED.add((m.layer, m.role, group is not None))
    if group is None:
      from maxtext_nvfp4.integration.log_once import log_once  # pylint: disable=import-outside-toplevel

      log_once(f"maxtext-nvfp4: nvfp4_qat=serving: the {m.role} projection ran outside an Attention/MlpBlock that"
               " publishes its fp32 kernels; its serving forward quantizes the kernel as handed (compute dtype) alone",
               warn=True)

  def serve():
    return serving_gemm.dot_general(lhs, rhs, dimension_numbers, group=group,
                                    member=member if group is not None else serving_gemm.Member(),
                                    preferred_element_type=preferred_element_type)

  if m.switched is None:
    return serve()
  return jax.lax.cond(use_switched, lambda: gemm.dot_general(lhs, rhs, dimension_numbers, recipe=m.switched,
                                                             key=key, preferred_element_type=preferred_element_type),
                      serve)


def expert_einsum(recipe, switched, switch_step, layer, role, seed, diag_group=None, diag_interval=1,
                  fp4_weight_gather="off"):
  """MaxText RoutedMoE's expert einsum ``(eqn, tokens, kernel)``: one emulated GEMM per expert
  (:func:`maxtext_nvfp4.core.grouped_gemm.einsum`), or the plain einsum when every pass is BF16.
  ``diag_group``: report each expert's x, W and dy to that diagnostics group (None: no diagnostics).
  ``fp4_weight_gather``: nvfp4_fp4_weight_gather (the expert weights' own axes: the adapter's
  ``expert_kernel_axes``)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  def einsum(eqn, lhs, rhs, *args, **kwargs):
    del args, kwargs  # MaxText drops einsum kwargs (precision) on its quantized path too
    if recipe is None or step_lib.in_reference_pass():  # plain BF16, or the gradient-fidelity reference pass
      return jnp.einsum(eqn, lhs, rhs)
    from maxtext_nvfp4.core import grouped_gemm  # pylint: disable=import-outside-toplevel

    training, step, use_switched, key = traced.step_inputs(layer, role, seed, recipe, switched, switch_step)
    observe = None
    if diag_group is not None and training:  # trace-time decision, as for the dense GEMMs
      observe = traced.diagnostics_observer(recipe, group=diag_group, interval=diag_interval, step=step, key=key)
    gather = None
    if fsdp_gather.reads_quantized_weight(recipe, switched):
      rc, rb = grouped_gemm.kernel_dims(eqn)
      wi, wo = touchpoints.adapter().expert_kernel_axes
      gather = fsdp_gather.weight_gather(jnp.shape(rhs), rc, rb, wo if role == "expert_wo" else wi, role,
                                         None, fp4_weight_gather)
    return grouped_gemm.einsum(eqn, lhs, rhs, recipe=recipe, switched=switched, use_switched=use_switched,
                               key=key, observe=observe, weight_gather=gather)

  return einsum
