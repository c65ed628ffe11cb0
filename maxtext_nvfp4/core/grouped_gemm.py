"""Emulated NVFP4 grouped GEMM for mixture-of-experts: TE's per-GEMM recipe applied to each expert on its own.

An MoE layer's expert linear is E independent GEMMs ``y_e = x_e · W_e`` (expert ``e``'s weight ``W_e``
(K, N), its token group ``x_e`` (m_e, K)). Each one runs exactly :func:`maxtext_nvfp4.core.gemm.dot_general`
on 2D operands, so for every expert, bit for bit with a per-expert loop of the 2D GEMM:

  fprop  y_e  = x_e · W_e      x_e: own amax, 1x16 along K, RNE       W_e: own amax, 16x16 tiles, RNE
  dgrad  dx_e = dy_e · W_eᵀ    dy_e: own amax, 1x16 along N, SR       W_e: the same tiles as fprop
  wgrad  dW_e = x_eᵀ · dy_e    x_e, dy_e: 1x16 along the expert's own tokens (blocks start at its first
                               token), RHT16 on both, SR on dy_e

The experts are the batch dimension of one ``gemm.dot_general`` call (its batch slices are independent
GEMMs with their own amax; SR key of expert ``e`` = ``fold_in(key, e)``). Two forms:

* :func:`ragged_dot` -- ``jax.lax.ragged_dot(lhs (M, K), rhs (E, K, N), group_sizes (E,))``: rows
  ``[s_e, s_e + m_e)`` of ``lhs`` (``s_e = m_0 + ... + m_{e-1}``) are expert ``e``'s tokens; rows past
  ``sum(m_e)`` give zeros. Expert ``e``'s group is gathered into rows ``[0, m_e)`` of an (M, K) buffer
  whose other rows are zero: zero rows change no amax, form zero blocks (RHT of zeros is zero) and
  add exact zeros to the fp32 sums, so a group of any size (0, 1, 15, 16, 17, ...) gives the GEMM of its
  zero-padded tokens. Cost: E GEMMs of M rows (E x the FLOPs and E x the activation buffer of one
  ragged_dot): an emulation for correctness studies, not a fast kernel.
* :func:`einsum` -- MaxText's ``RoutedMoE`` einsums with an expert axis on the kernel (``"EBCM,EMH->EBCH"``
  capacity form: expert ``e``'s tokens are its capacity slots; ``"BSM,EMH->BSEH"`` no-capacity form: every
  expert sees every token, MaxText zeroes the unrouted ones in the combine). Labels shared by lhs and the
  output other than the expert's are tokens; the lhs is broadcast over experts when it has no expert axis
  (dx then sums the per-expert dgrads in the activation dtype).

Router, dispatch and combine are not here: they stay in high precision (as in TE/Megatron, only the
expert linears are quantized).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtext_nvfp4.core import gemm

__all__ = ["ragged_dot", "einsum", "expert_token_buffers", "kernel_dims"]


def expert_token_buffers(lhs, group_sizes):
  """``(E, M, K)``: expert ``e``'s token rows ``lhs[s_e : s_e + m_e]`` moved to rows ``[0, m_e)``, zeros elsewhere.

  Also returns ``(expert, local)`` of every output row (row ``r`` of expert ``e`` is ``local = r - s_e``)
  and the mask of rows inside some group.
  """
  m = lhs.shape[0]
  sizes = jnp.asarray(group_sizes, jnp.int32)
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  i = jnp.arange(m, dtype=jnp.int32)
  rows = starts[:, None] + i[None, :]  # (E, M)
  valid = i[None, :] < sizes[:, None]
  buffers = jnp.where(valid[..., None], lhs[jnp.clip(rows, 0, m - 1)], jnp.zeros((), lhs.dtype))
  expert = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)  # first group whose end is past r
  in_group = i < ends[-1]
  expert = jnp.minimum(expert, sizes.shape[0] - 1)
  local = jnp.clip(i - starts[expert], 0, m - 1)
  return buffers, (expert, local), in_group


def ragged_dot(lhs, rhs, group_sizes, *, recipe: gemm.GemmRecipe, switched: gemm.GemmRecipe | None = None,
               use_switched=None, key=None, preferred_element_type=None, observe=None) -> jax.Array:
  """``lax.ragged_dot(lhs (M, K), rhs (E, K, N), group_sizes (E,))`` with one NVFP4 GEMM per expert.

  ``recipe``/``switched``/``use_switched``/``key``/``preferred_element_type`` as in
  :func:`maxtext_nvfp4.core.gemm.dot_general` (expert ``e``'s SR key is ``fold_in(key, e)``).
  ``observe(buffers, rhs, dimension_numbers, y) -> y``: sees the per-expert GEMMs (the experts' token buffers
  (E, M, K), zero rows past each group, as the GEMM quantizes them) and returns their output (diagnostics).
  """
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
    raise ValueError(f"ragged_dot: need lhs (M, K) and rhs (E, K, N); got {lhs.shape} and {rhs.shape}")
  if jnp.shape(group_sizes) != (rhs.shape[0],):
    raise ValueError(f"ragged_dot: group_sizes must have shape ({rhs.shape[0]},), got {jnp.shape(group_sizes)}")
  buffers, (expert, local), in_group = expert_token_buffers(lhs, group_sizes)
  dims = (((2,), (1,)), ((0,), (0,)))
  y = gemm.dot_general(buffers, rhs, dims, recipe=recipe, switched=switched,
                       use_switched=use_switched, key=key, preferred_element_type=preferred_element_type)
  if observe is not None:
    y = observe(buffers, rhs, dims, y)
  return jnp.where(in_group[:, None], y[expert, local], jnp.zeros((), y.dtype))


def _parse(eqn: str):
  spec = eqn.replace(" ", "")
  ins, out = spec.split("->")
  a, b = ins.split(",")
  if len(set(a)) != len(a) or len(set(b)) != len(b) or "." in spec:
    raise ValueError(f"einsum {eqn!r}: repeated labels and ellipses are not supported")
  return a, b, out


def kernel_dims(eqn: str, expert_axis: int = 0) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(contracting, batch) dims of the kernel (rhs) of :func:`einsum`'s ``eqn``, in the order its ``dot_general``
  flattens them (``weight_gather``'s K is the contracting dims in that order)."""
  a, b, out = _parse(eqn)
  contract = [c for c in a if c in b and c not in out]
  return tuple(b.index(c) for c in contract), (expert_axis % len(b),)


def einsum(eqn: str, lhs, rhs, *, expert_axis: int = 0, recipe: gemm.GemmRecipe,
           switched: gemm.GemmRecipe | None = None, use_switched=None, key=None,
           preferred_element_type=None, observe=None, weight_gather=None) -> jax.Array:
  """``jnp.einsum(eqn, lhs, rhs)`` with one NVFP4 GEMM per expert (kernel axis ``expert_axis`` = experts).

  Contracted labels are in both operands and not in the output; the expert label is the only label
  allowed in both operands and the output. Expert ``e``'s SR key is ``fold_in(key, e)``.
  ``observe(lhs, rhs, dimension_numbers, y) -> y``: sees the batched ``dot_general`` (experts as its one batch
  dim) and its output before the output transpose, and returns that output (diagnostics hook here).
  ``weight_gather``: the expert kernel's FSDP layout (``gemm.dot_general``'s; ``batch``: the experts' axes).
  """
  a, b, out = _parse(eqn)
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  if len(a) != lhs.ndim or len(b) != rhs.ndim:
    raise ValueError(f"einsum {eqn!r}: operand ranks {lhs.ndim}, {rhs.ndim} do not match the labels")
  e = b[expert_axis]
  if e not in out:
    raise ValueError(f"einsum {eqn!r}: the expert label {e!r} must be in the output")
  if e not in a:
    a = e + a
    lhs = jnp.broadcast_to(lhs[None], (rhs.shape[expert_axis],) + lhs.shape)
  contract = [c for c in a if c in b and c not in out]
  others = [c for c in a if c in b and c in out and c != e]
  if others:
    raise ValueError(f"einsum {eqn!r}: only the expert label {e!r} may be a batch label, not {others}")
  if any(c not in a + b for c in out) or any(c not in out and c not in contract for c in a + b):
    raise ValueError(f"einsum {eqn!r}: every label must be contracted or in the output")
  dims = (([a.index(c) for c in contract], [b.index(c) for c in contract]), ([a.index(e)], [b.index(e)]))
  y = gemm.dot_general(lhs, rhs, dims, recipe=recipe, switched=switched, use_switched=use_switched, key=key,
                       preferred_element_type=preferred_element_type, weight_gather=weight_gather)
  if observe is not None:
    y = observe(lhs, rhs, dims, y)
  got = e + "".join(c for c in a if c not in b) + "".join(c for c in b if c not in a)
  return jnp.transpose(y, [got.index(c) for c in out])
