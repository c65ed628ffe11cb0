"""``nvfp4_amax_scope``: over which part of a sharded operand each NVFP4 amax is taken (pure Python).

``global``: one amax per tensor, so results do not depend on the mesh (compare runs across meshes).
``te``: what Transformer Engine's ``dense`` computes on the run's mesh (TE commit d0067d0,
``transformer_engine/jax/dense.py`` and ``cpp_extensions/amax.py``):

  x, dy   ``AmaxScope.TPSP``: each device's local amax (``AmaxCalculationPrimitive`` partitions the amax
          over the operand's own sharding); a ``pmax`` over the tensor-sequence axis only when the
          sequence dim is sharded on it (``all_reduce_amax_along_TPSP_and_FSDP``).
  W       ``AmaxScope.FSDP``: the local amax, ``pmax``-ed over the FSDP axis only: each tensor-parallel
          (or other non-FSDP) shard of W keeps its own amax.

So an operand has independent amaxes on a grid of blocks: along each dim, as many as the mesh axes
sharding that dim have devices, minus the axes the scope reduces over. :func:`amax_groups` turns the
operands' partition specs into that grid (:class:`maxtext_nvfp4.core.gemm.AmaxGroups`, which the GEMM
implements without communication: a per-block amax of the global array is bit-identical to a per-device
amax). ``dy`` is taken to be sharded along N like W's tensor-parallel shards (the GEMM output's sharding).
Rows are tokens flattened batch-major, so only the leading (batch) dim of x may carry row groups; a sharded
sequence dim is supported only where TE reduces over it (the tensor-sequence axis).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

# MaxText's TE mesh resources (maxtext/utils/max_utils.py transformer_engine_context).
FSDP_AXIS = "fsdp"
TPSP_AXIS = "tensor_sequence"

Spec = None | str | Sequence[str]


class AmaxScopeError(ValueError):
  """A sharding the ``te`` scope cannot express as contiguous amax blocks (one line, with the fix)."""


def _axes(spec: Spec) -> tuple[str, ...]:
  if spec is None:
    return ()
  return (spec,) if isinstance(spec, str) else tuple(spec)


def _size(spec: Spec, mesh: Mapping[str, int], reduced: tuple[str, ...] = ()) -> int:
  return math.prod(int(mesh.get(a, 1)) for a in _axes(spec) if a not in reduced)


def amax_groups(*, mesh: Mapping[str, int], x_rows: Sequence[Spec], x_k: Sequence[Spec], w_k: Sequence[Spec],
                w_n: Sequence[Spec], seq_dim: int = 1):
  """The ``te`` scope's :class:`AmaxGroups` of one GEMM from its operands' partition specs.

  Args:
    mesh: mesh axis name -> size.
    x_rows: specs of x's non-contracting dims (batch first; ``seq_dim`` is the sequence dim).
    x_k: specs of x's contracting dims. w_k / w_n: specs of W's contracting / output dims.
  Raises:
    AmaxScopeError: a non-leading row dim sharded on an axis TE does not reduce over.
  """
  from maxtext_nvfp4.core.gemm import AmaxGroups  # pylint: disable=import-outside-toplevel  (JAX)

  for i, spec in enumerate(x_rows[1:], start=1):
    reduced = (TPSP_AXIS,) if i == seq_dim else ()
    if _size(spec, mesh, reduced) > 1:
      raise AmaxScopeError(
          f"nvfp4_amax_scope=te: activation dim {i} is sharded on {_axes(spec)}, which gives per-device amaxes"
          " over non-contiguous token blocks (not modelled); use nvfp4_amax_scope=global"
      )
  tokens = _size(x_rows[0], mesh) if x_rows else 1
  wn = math.prod(_size(s, mesh, (FSDP_AXIS,)) for s in w_n)
  token_axes = tuple(a for a in _axes(x_rows[0]) if int(mesh.get(a, 1)) > 1) if x_rows else ()
  return AmaxGroups(tokens=tokens, x_k=math.prod(_size(s, mesh) for s in x_k),
                    w_k=math.prod(_size(s, mesh, (FSDP_AXIS,)) for s in w_k), w_n=wn, dy_n=wn, token_axes=token_axes)


def describe(groups) -> str:
  """``x: 4x1, W: 1x2, dy: 4x2`` (amax blocks rows x columns of each operand)."""
  if groups is None:
    return "x: 1x1, W: 1x1, dy: 1x1"
  return (f"x: {groups.tokens}x{groups.x_k}, W: {groups.w_k}x{groups.w_n}, dy: {groups.tokens}x{groups.dy_n}")


def operand_scopes(scope: str) -> dict[str, str]:
  """Over what each operand's amax is taken under ``scope`` (for ``doctor``; the start-up log gives the
  concrete blocks on the run's mesh)."""
  if scope == "global":
    return {op: "the whole tensor (independent of the mesh)" for op in ("x", "W", "dy")}
  local = "each device's shard (TE AmaxScope.TPSP: pmax over tensor_sequence only if the sequence dim is on it)"
  return {"x": local, "W": "each tensor-parallel shard (TE AmaxScope.FSDP: pmax over fsdp only)", "dy": local}
