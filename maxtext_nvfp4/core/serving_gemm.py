"""The serving-matched linear (``nvfp4_qat=serving``): the forward an NVFP4 export serves, trained through.

For activations ``x`` (M, K) and the kernel ``W`` (K, N) of one decoder projection, with the export's tensors
and decode (:mod:`maxtext_nvfp4.core.serving`, docs/export.md)::

    W_hf  = Wᵀ · c                          [out, in], fp32; c = the export's factor of this projection (the
                                            query of families whose conversion folds sqrt(head_dim) into q_proj:
                                            fl32(sqrt(head_dim)); else 1), multiplied in fp32 as the hook does
    D     = dequantize(quantize(concat(W_hf of the fused group), axis=-1))[this projection's rows]
                                            1x16 blocks along K, RNE, no RHT, one global scale per fused group
                                            (q/k/v; gate/up): serving.served_weights, bit for bit
    x_s   = serving.served_activations("nvfp4-w4a4")(x)
                                            per token: each row its own global scale, 1x16 blocks along K
    y     = cast(fl(x_s @ Dᵀ) / c)          the served linear's fp32 output, divided by c (MaxText's attention
                                            has no score scale; HF scales the scores by 1/sqrt(head_dim))

``W`` (fp32: the master weights the export reads, not the compute-dtype copy the GEMM is handed) and the fused
group's other kernels come from :func:`dot_general`'s ``group``. Backward: straight-through in high precision,
``dx = dy · Wᵀ``, ``dW = xᵀ · dy`` on the operands the GEMM was handed -- the ``"bf16"`` passes of
:mod:`maxtext_nvfp4.core.gemm`, i.e. what ``nvfp4_qat=forward`` (``nvfp4_backward_override=high_precision``)
computes.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from maxtext_nvfp4.core import gemm
from maxtext_nvfp4.core import nvfp4
from maxtext_nvfp4.core import serving

_BF16_PASSES = gemm.GemmRecipe(fprop="bf16", dgrad="bf16", wgrad="bf16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Member:
  """This projection's place in its fused group (hashable: a static argument)."""

  # index of this projection among the group's kernels (HF row order: q, k, v; gate, up)
  index: int = 0
  # the export's factor c of every member (1.0 but the scaled query)
  factors: tuple[float, ...] = (1.0,)


def served_weights(group_hf, member: Member) -> jax.Array:
  """``D`` (module docstring): this member's decoded export weight, fp32 [out, in] (HF layout), from the fused
  group's fp32 weights in HF layout (``Wᵀ`` of each member, before the export's factor)."""
  hf = [w if c == 1.0 else w * jnp.float32(c) for w, c in zip(group_hf, member.factors)]
  t = nvfp4.quantize(jnp.concatenate(hf, axis=0), axis=-1)
  start = sum(w.shape[0] for w in hf[: member.index])
  return nvfp4.dequantize(t)[start : start + hf[member.index].shape[0]]


def served_linear(x2, group_hf, member: Member, out_dtype):
  """``y`` (module docstring) of 2D activations ``x2`` (M, K) and the group's fp32 weights [out_i, K]."""
  d = served_weights(group_hf, member)
  xs = serving.served_activations("nvfp4-w4a4")(jnp.asarray(x2, jnp.float32))
  y = xs @ d.T
  c = member.factors[member.index]
  if c != 1.0:
    y = y / jnp.float32(c)
  return y.astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _serve(member, out_dtype, x2, w2, group):
  return served_linear(x2, group, member, out_dtype)


def _serve_fwd(member, out_dtype, x2, w2, group):
  return served_linear(x2, group, member, out_dtype), (x2, w2, group)


def _serve_bwd(member, out_dtype, res, dy):
  del member
  x2, w2, group = res
  _, vjp = jax.vjp(lambda a, b: gemm.dot_general(a, b, (((1,), (0,)), ((), ())), recipe=_BF16_PASSES,
                                                 preferred_element_type=out_dtype), x2, w2)
  dx, dw = vjp(dy.astype(out_dtype))
  return dx, dw, jax.tree.map(jnp.zeros_like, group)


_serve.defvjp(_serve_fwd, _serve_bwd)


def dot_general(lhs, rhs, dimension_numbers, *, group=None, member: Member = Member(),
                preferred_element_type=None) -> jax.Array:
  """``lax.dot_general(lhs, rhs, dimension_numbers)`` as the export serves it (module docstring).

  Args:
    lhs: activations; contracting dims last-to-first as MaxText's DenseGeneral gives them (no batch dims).
    rhs: the kernel the GEMM is handed (gradients flow to it).
    group: the fused group's fp32 master kernels, each shaped like its DenseGeneral kernel (contracting dims
      first, as ``rhs``); None: ``rhs`` alone, in fp32 (what the export reads when the kernel is kept in the
      compute dtype).
    member: this projection's index in ``group`` and every member's export factor.
    preferred_element_type: output dtype (default: the result type of lhs and rhs).
  """
  (lc, rc), (lb, rb) = dimension_numbers
  if lb or rb:
    raise ValueError("serving_gemm.dot_general: batch dimensions are not a dense projection's")
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  lc = tuple(int(d) % lhs.ndim for d in lc)
  rc = tuple(int(d) % rhs.ndim for d in rc)
  if rc != tuple(range(len(rc))):
    raise ValueError(f"serving_gemm.dot_general: the kernel's contracting dims must lead, got {rc}")
  lf = tuple(d for d in range(lhs.ndim) if d not in lc)
  k = math.prod(lhs.shape[d] for d in lc)
  n_shape = rhs.shape[len(rc):]
  x2 = jnp.transpose(lhs, lf + lc).reshape(-1, k)
  w2 = rhs.reshape(k, -1)
  nc = len(rc)
  masters = (rhs,) if group is None else tuple(group)
  # each kernel (K..., N...) -> [N, K] in fp32: the export's HF layout (rows = output features)
  group_hf = tuple(jax.lax.stop_gradient(jnp.asarray(g, jnp.float32).reshape(math.prod(g.shape[:nc]), -1).T)
                   for g in masters)
  out_dtype = jnp.dtype(preferred_element_type) if preferred_element_type is not None else jnp.result_type(lhs, rhs)
  y = _serve(member, out_dtype, x2, w2, group_hf)
  return y.reshape(tuple(lhs.shape[d] for d in lf) + n_shape)
