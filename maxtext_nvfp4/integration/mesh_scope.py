"""``nvfp4_amax_scope=te`` inside MaxText: each GEMM operand's amax blocks from the shardings MaxText gives it.

At trace time (inside MaxText's train step, under ``jax.set_mesh(mesh)`` and flax's
``logical_axis_rules``), the operands' partition specs come from their logical axes through the run's own
rules (``flax.linen.logical_to_mesh_axes``):

  x (B, S, K...)   (<row axes>, <activation axis of each kernel input axis>): the MaxText version's
                   ``activation_row_axes`` and ``activation_of_kernel_axis`` (e.g. activation_batch,
                   activation_length; embed -> activation_embed, mlp -> activation_mlp, heads/q_heads ->
                   activation_heads, kv/kv_head_dim -> activation_kv)
  W (K..., N...)   the kernel's own logical axes (``DenseGeneral(kernel_axes=...)``, passed to
                   ``dot_general_cls(mesh_axes)``)

and the mesh's axis sizes; :func:`maxtext_nvfp4.core.amax_scope.amax_groups` turns them into TE's amax
blocks. Outside a mesh (or on one device) every operand has one amax, as with ``global``.
"""

from __future__ import annotations

from maxtext_nvfp4.core import amax_scope
from maxtext_nvfp4.integration import touchpoints
from maxtext_nvfp4.integration.log_once import log_once

def te_amax_groups(lhs_shape: tuple, rhs_shape: tuple, dimension_numbers, kernel_axes: tuple, role: str = ""):
  """The ``te`` scope's ``AmaxGroups`` for ``lax.dot_general(lhs, kernel, dimension_numbers)`` on the
  current mesh, or None (no mesh, one device, batch dims, or no kernel axes).

  Also None, with a warning logged once, when a per-device block is not a multiple of 16 along a block
  axis: TE refuses such a GEMM anyway (``te_limits``), and the emulation then zero-pads it with one amax
  per tensor instead of failing.
  """
  import math  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  lhs_ndim = len(lhs_shape)
  mesh = jax.sharding.get_abstract_mesh()
  (lc, rc), (lb, _) = dimension_numbers
  if mesh.empty or mesh.size == 1 or lb or not kernel_axes:
    return None
  sizes = dict(mesh.shape)
  lc = tuple(int(d) % lhs_ndim for d in lc)
  rc = tuple(int(d) % len(kernel_axes) for d in rc)
  rows = [d for d in range(lhs_ndim) if d not in lc]
  facts = touchpoints.adapter()
  x_logical = [None] * lhs_ndim
  for i, d in enumerate(rows[:2]):
    x_logical[d] = facts.activation_row_axes[i]
  for dl, dr in zip(lc, rc):
    x_logical[dl] = facts.activation_of_kernel_axis.get(kernel_axes[dr])
  x_spec = tuple(nn.logical_to_mesh_axes(tuple(x_logical)))
  w_spec = tuple(nn.logical_to_mesh_axes(tuple(kernel_axes)))
  groups = amax_scope.amax_groups(mesh=sizes, x_rows=[x_spec[d] for d in rows], x_k=[x_spec[d] for d in lc],
                                  w_k=[w_spec[d] for d in rc],
                                  w_n=[w_spec[d] for d in range(len(kernel_axes)) if d not in rc])
  shown = {a: n for a, n in sizes.items() if n > 1}
  m, k = math.prod(lhs_shape[d] for d in rows), math.prod(lhs_shape[d] for d in lc)
  n = math.prod(rhs_shape[d] for d in range(len(rhs_shape)) if d not in rc)
  blocks = {"x rows": (m, groups.tokens), "x K": (k, groups.x_k), "W K": (k, groups.w_k), "W N": (n, groups.w_n),
            "dy N": (n, groups.dy_n)}
  bad = [f"{name} {size}/{g}" for name, (size, g) in blocks.items() if size % g or (size // g) % 16]
  if bad:
    log_once(
        f"maxtext-nvfp4: nvfp4_amax_scope=te on mesh {shown}: {role or kernel_axes} per-device blocks"
        f" ({', '.join(bad)}) are not multiples of 16 (TE refuses this GEMM); it runs with one amax per tensor",
        warn=True)
    return None
  log_once(f"maxtext-nvfp4: nvfp4_amax_scope=te on mesh {shown}: {role or kernel_axes} amax blocks"
           f" {amax_scope.describe(groups)}")
  return None if groups.trivial else groups
