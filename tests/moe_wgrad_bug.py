"""A test-only injected bug: the per-expert scales of the grouped GEMM's weight gradient swapped between the
experts of each pair (0 <-> 1, 2 <-> 3, ...), as in the per-expert scale-layout bug that cost a public
DeepSeek-V3-16B NVFP4 run 0.076 nats (torchao's wgrad GEMM read the neighbouring expert's scales).

:func:`install` monkeypatches the public :func:`maxtext_nvfp4.core.gemm.dot_general` (which the grouped GEMM
calls with the experts as its batch dimension); forward and dgrad are unchanged, and the wgrad of expert ``e`` is

    dW_bug[e, k, n] = dW[e, k, n] * (a_x[p, k] * a_dy[p, n]) / (a_x[e, k] * a_dy[e, n]),   p = e ^ 1

with ``a_x[e, k] = max_t |x_e[t, k]|`` and ``a_dy[e, n] = max_t |dy_e[t, n]|`` (the scales of expert ``e``'s
wgrad operands along its tokens; a zero scale leaves the entry as it is). At initialization the experts'
scales are alike and the bug is small; as the experts specialize it grows -- as the public run saw it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtext_nvfp4.core import gemm
from maxtext_nvfp4.integration.stability import zero_cotangent

_ORIG = gemm.dot_general


def _scales(t):
  """``max |t|`` over every axis but the first (experts) and the last (the GEMM's K or N): ``(E, last)``."""
  t = jnp.abs(t.astype(jnp.float32))
  return jnp.max(t, axis=tuple(range(1, t.ndim - 1))) if t.ndim > 2 else t


def swapped(dr, lhs, g, dimension_numbers):
  """``dr`` (E, K, N: the grouped GEMM's kernel) with the pairs' scale ratios applied (module doc); ``lhs`` is
  moved to (experts, tokens..., K) first, ``g`` (the dot_general's output layout) is (experts, tokens..., N)."""
  (lc, _), (lb, _) = dimension_numbers
  lb, lc = [d % lhs.ndim for d in lb], [d % lhs.ndim for d in lc]
  lhs = jnp.transpose(lhs, lb + [d for d in range(lhs.ndim) if d not in lb + lc] + lc)
  a_x, a_dy = _scales(lhs), _scales(g)
  e = dr.shape[0]
  partner = jnp.arange(e) ^ 1 if e % 2 == 0 else jnp.arange(e)
  own = a_x[:, :, None] * a_dy[:, None, :]
  other = own[partner]
  ratio = jnp.where(own > 0, other / jnp.where(own > 0, own, 1.0), 1.0)
  return (dr.astype(jnp.float32) * ratio).astype(dr.dtype)


def buggy_dot_general(lhs, rhs, dimension_numbers, **kwargs):
  (_, _), (lb, _) = dimension_numbers
  if not tuple(lb):
    return _ORIG(lhs, rhs, dimension_numbers, **kwargs)
  # traced keyword operands (the SR key, the late switch's flag) are arguments, not closures (remat traces)
  arrays = {k: v for k, v in kwargs.items()  # arrays and pytrees of arrays (the SR key is a prng.FoldedKey)
            if jax.tree_util.tree_leaves(v) and all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(v))}
  static = {k: v for k, v in kwargs.items() if k not in arrays}

  def call(a, b, arr):
    return _ORIG(a, b, dimension_numbers, **static, **arr)

  @jax.custom_vjp
  def f(a, b, arr):
    return call(a, b, arr)

  def fwd(a, b, arr):
    return call(a, b, arr), (a, b, arr)

  def bwd(res, g):  # the original backward, recomputed here (a pullback residual would hold remat tracers)
    a, b, arr = res
    da, db = jax.vjp(lambda p, q: call(p, q, arr), a, b)[1](g)
    return da, swapped(db, a, g, dimension_numbers), jax.tree_util.tree_map(zero_cotangent, arr)

  f.defvjp(fwd, bwd)
  return f(lhs, rhs, arrays)


def install() -> None:
  gemm.dot_general = buggy_dot_general


def uninstall() -> None:
  gemm.dot_general = _ORIG
