"""``nvfp4_fp4_weight_gather`` inside MaxText: each NVFP4 kernel's FSDP layout, from the shardings MaxText gives it.

At trace time (inside MaxText's train step, under ``jax.set_mesh(mesh)`` and flax's ``logical_axis_rules``) a
kernel's mesh axes come from its logical axes (``DenseGeneral(kernel_axes=...)``; for RoutedMoE's expert einsums
the expert weights' own axes, the adapter's ``expert_kernel_axes``, since MaxText names only ``("exp", None,
"mlp")`` there) and the tokens' from the adapter's ``activation_row_axes``. The mesh axes (of more than one
device) that shard both the kernel and the tokens are FSDP's: the GEMM gathers the kernel over them. The others
(tensor parallelism, the experts' axis) stay. :func:`weight_gather` turns that into a
:class:`maxtext_nvfp4.core.weight_gather.WeightGather`, or None with one line saying why the kernel is gathered
as before (in the activation dtype) where its shards are not whole 16x16 tiles.
"""

from __future__ import annotations

import math

from maxtext_nvfp4.core import weight_gather as weight_gather_lib
from maxtext_nvfp4.integration import touchpoints
from maxtext_nvfp4.integration.log_once import log_once

KEY = "nvfp4_fp4_weight_gather"


def reads_quantized_weight(*recipes) -> bool:
  """A GEMM recipe among ``recipes`` reads an NVFP4 copy of W (fprop or dgrad nvfp4, or a dgrad on the
  dequantized fprop copy)."""
  return any(r is not None and (r.fprop == "nvfp4" or r.precision("dgrad") == "nvfp4"
                                or (r.precision("dgrad") == "dequantized" and r.fprop == "nvfp4"))
             for r in recipes)


def _axes(entry, sizes) -> tuple[str, ...]:
  """A PartitionSpec entry's mesh axes of more than one device, major to minor."""
  axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
  return tuple(a for a in axes if int(sizes.get(a, 1)) > 1)


def _flat_axes(dims, shape, spec, sizes, what: str) -> tuple[tuple[str, ...], str | None]:
  """The mesh axes of the flattening of ``dims`` (major first), or a reason: one dim may be sharded, and only
  when every dim before it has size 1 (then the flattened dim is sharded contiguously, as that dim)."""
  per_dim = [_axes(spec[d], sizes) for d in dims]
  sharded = [i for i, a in enumerate(per_dim) if a]
  if not sharded:
    return (), None
  if len(sharded) > 1 or any(shape[d] > 1 for d in dims[:sharded[0]]):
    return (), f"W's {what} dims {tuple(shape[d] for d in dims)} are sharded as {per_dim} (not contiguous once flattened)"
  return per_dim[sharded[0]], None


def _split(axes: tuple[str, ...], tokens: set[str], what: str) -> tuple[tuple, tuple, str | None]:
  """(kept, gathered) of one dim's axes; the kept ones must be major (after the gather each device holds a
  contiguous block)."""
  gathered = tuple(a for a in axes if a in tokens)
  kept = tuple(a for a in axes if a not in tokens)
  if gathered and kept and axes != kept + gathered:
    return (), (), f"W's {what} is sharded on {axes}: an FSDP axis before a kept one (not contiguous after the gather)"
  return kept, gathered, None


def weight_gather(rhs_shape: tuple, rhs_contract, rhs_batch, kernel_axes: tuple, role: str = "",
                  groups=None, setting: str = "auto"):
  """The :class:`WeightGather` of ``dot_general``'s kernel ``rhs`` on the current mesh, or None.

  None without a mesh (or on one device), with ``setting`` "off", when nothing of W is gathered (no FSDP axis
  on it), and, with one start-up line saying why, when W's layout is not whole 16x16 tiles per shard.
  ``rhs_contract`` / ``rhs_batch``: rhs dims in ``gemm.dot_general``'s flattening order. ``groups``: TE's amax
  blocks of this GEMM (``gemm.AmaxGroups``) or None.
  """
  if setting == "off" or not kernel_axes:
    return None
  import jax  # pylint: disable=import-outside-toplevel
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return None
  sizes = {a: int(n) for a, n in dict(mesh.shape).items()}
  nd = len(rhs_shape)
  rc = tuple(int(d) % nd for d in rhs_contract)
  rb = tuple(int(d) % nd for d in rhs_batch)
  rf = tuple(d for d in range(nd) if d not in rc and d not in rb)
  w_spec = tuple(nn.logical_to_mesh_axes(tuple(kernel_axes)))
  token_spec = tuple(nn.logical_to_mesh_axes(tuple(touchpoints.adapter().activation_row_axes)))
  tokens = {a for entry in token_spec for a in _axes(entry, sizes)}
  name = role or str(kernel_axes)

  k_axes, why = _flat_axes(rc, rhs_shape, w_spec, sizes, "contracting")
  n_axes, why_n = (), None
  if why is None:
    n_axes, why_n = _flat_axes(rf, rhs_shape, w_spec, sizes, "output")
  why = why or why_n
  batch = tuple(a for d in rb for a in _axes(w_spec[d], sizes))
  if why is None and not (set(k_axes + n_axes) & tokens):
    return None  # no FSDP axis on W: nothing is gathered
  wg = None
  if why is None:
    k_kept, k_gathered, why = _split(k_axes, tokens, "K")
  if why is None:
    n_kept, n_gathered, why = _split(n_axes, tokens, "N")
  if why is None and set(batch) & tokens:
    why = f"W's batch (expert) dim is sharded on token axes {sorted(set(batch) & tokens)}"
  if why is None:
    wg = weight_gather_lib.WeightGather(mesh=mesh, k_kept=k_kept, k_gathered=k_gathered, n_kept=n_kept,
                                        n_gathered=n_gathered, batch=batch)
    k = math.prod(rhs_shape[d] for d in rc)
    n = math.prod(rhs_shape[d] for d in rf)
    why = weight_gather_lib.refusal(wg, k, n, (groups.w_k, groups.w_n) if groups is not None else (1, 1))
  if why is not None:
    log_once(f"maxtext-nvfp4: {name}: its NVFP4 weight is all-gathered in the activation dtype, not in FP4: {why}"
             f" ({KEY}=off gathers every weight so)")
    return None
  log_once(f"maxtext-nvfp4: {name}: NVFP4 weight all-gathered in FP4 (E2M1 codes + E4M3 16x16 tile scales,"
           f" {weight_gather_lib.gathered_bytes_per_weight():.3f} B/weight instead of 2) {wg.describe()}")
  return wg
