"""Transformer Engine's NVFP4 ``dense`` with each activation quantized once for every projection that reads it.

TE JAX's ``dense(x, kernel, quantizer_set=...)`` (``transformer_engine/jax/dense.py``) quantizes ``x`` inside its
forward rule, so projections that share an input -- q, k and v read the same normalized hidden state, wi_0 and wi_1
the same MLP input -- each quantize it again: the same E2M1 codes, E4M3 block scales and RHT'd column-wise copy,
computed and written up to three times per layer (MaxText's own ``te_nvfp4`` does the same). Here the activation's
quantization is looked up first: the first projection to read ``x`` quantizes it with its ``quantizer_set.x``
(``tex.quantize``, amax scope TPSP, as TE's dense does), later projections reading the *same traced array* under the
*same trace*, with an x quantizer of the same configuration, reuse that result. Each projection then runs TE's
three GEMMs on it exactly as TE's dense does:

  fprop   y     = gemm(x_q[row-wise],  W_q[row-wise])
  dgrad   dx_i  = gemm(dy_q[row-wise], W_q[column-wise])       (summed over the projections by autodiff)
  wgrad   dW    = gemm(x_q[column-wise, RHT], dy_q[column-wise, RHT])

with W and dy quantized per projection (their own quantizers; dy with stochastic rounding). What each GEMM reads is
bit for bit what it reads through TE's dense -- the x quantizer is deterministic (no stochastic rounding; the RHT
signs are fixed) and its configuration is part of the lookup key -- so results are identical by construction; only
the number of quantize calls changes. The reuse needs JAX's current-trace identity (``jax._src.core``); where it is
missing, nothing is shared.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

# (x, key, trace state, quantized x) of the last few activations quantized; identity lookups, a few entries per layer
_RECENT: list[tuple[Any, tuple, Any, Any]] = []
_RECENT_MAX = 8


def _trace_state():
  try:
    from jax._src import core  # pylint: disable=import-outside-toplevel

    return core.get_opaque_trace_state()
  except (ImportError, AttributeError, AssertionError):
    return None


def _quantizer_key(quantizer, flatten_axis: int) -> tuple:
  """What makes two x quantizers produce the same quantized tensor from the same x."""
  return (type(quantizer).__name__, str(quantizer.scaling_mode), str(quantizer.q_layout), str(quantizer.q_dtype),
          bool(getattr(quantizer, "use_rht", False)),
          getattr(quantizer, "stochastic_rounding_rng_state", None) is None, flatten_axis)


def quantize_activation(x, quantizer, flatten_axis: int):
  """``(quantized x, reused)``: the quantization of ``x`` a projection reading it under this trace already made, or
  a new one (``tex.quantize`` of ``stop_gradient(x)``: the gradient reaches ``x`` through :func:`dense`'s dgrad)."""
  from transformer_engine.jax import cpp_extensions as tex  # pylint: disable=import-outside-toplevel # pytype: disable=import-error
  from transformer_engine.jax.cpp_extensions.amax import AmaxScope  # pylint: disable=import-outside-toplevel # pytype: disable=import-error

  key, state = _quantizer_key(quantizer, flatten_axis), _trace_state()
  if state is not None and getattr(quantizer, "stochastic_rounding_rng_state", None) is None:
    for seen_x, seen_key, seen_state, casted in _RECENT:
      if seen_x is x and seen_key == key and seen_state == state:
        return casted, True
  casted = tex.quantize(jax.lax.stop_gradient(x), flatten_axis=flatten_axis, quantizer=quantizer,
                        amax_scope=AmaxScope.TPSP)
  if state is not None:
    _RECENT.append((x, key, state, casted))
    del _RECENT[:-_RECENT_MAX]
  return casted, False


def dense(x, kernel, contracting_dims, quantizer_set, collective_op_set=None):
  """TE's NVFP4 ``dense(x, kernel)`` (no bias, ``NN`` layout, as MaxText calls it) with ``x``'s quantization shared
  (module docstring). Same signature and result as ``transformer_engine.jax.dense.dense`` for these arguments."""
  from transformer_engine.jax import cpp_extensions as tex  # pylint: disable=import-outside-toplevel # pytype: disable=import-error

  collective_op_set = tex.noop_collective_op_set if collective_op_set is None else collective_op_set
  x_dims, k_dims = map(tex.sanitize_dims, (x.ndim, kernel.ndim), contracting_dims)
  assert x.ndim - 1 in x_dims and kernel.ndim - 1 not in k_dims, "NN layout only (TE's dense asks the same)"
  casted_x, _ = quantize_activation(x, quantizer_set.x, -len(x_dims))
  # the quantized x enters as its leaves: JAX rebuilds custom_vjp arguments with placeholders, which TE's
  # ScaledTensor validation refuses
  leaves, treedef = jax.tree.flatten(casted_x)
  return _dense(x, tuple(leaves), kernel, quantizer_set, tuple(map(tuple, (x_dims, k_dims))), collective_op_set,
                treedef)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _dense(x, x_leaves, kernel, quantizer_set, dims, collective_op_set, x_treedef):
  return _dense_fwd(x, x_leaves, kernel, quantizer_set, dims, collective_op_set, x_treedef)[0]


def _dense_fwd(x, x_leaves, kernel, quantizer_set, dims, collective_op_set, x_treedef):
  from transformer_engine.jax import cpp_extensions as tex  # pylint: disable=import-outside-toplevel # pytype: disable=import-error
  from transformer_engine.jax.cpp_extensions.amax import AmaxScope  # pylint: disable=import-outside-toplevel # pytype: disable=import-error
  from transformer_engine.jax.quantize import TensorUsage  # pylint: disable=import-outside-toplevel # pytype: disable=import-error

  casted_x = jax.tree.unflatten(x_treedef, x_leaves)
  x_dims, k_dims = dims
  flatten_k = len(k_dims) - kernel.ndim
  casted_kernel = tex.quantize(kernel, flatten_axis=flatten_k, quantizer=quantizer_set.kernel,
                               amax_scope=AmaxScope.FSDP)
  y = tex.gemm(casted_x.get_tensor(usage=TensorUsage.LHS), casted_kernel.get_tensor(usage=TensorUsage.RHS),
               contracting_dims=(x_dims, k_dims), collective_op=collective_op_set.forward)
  residuals = (casted_x.get_tensor(usage=TensorUsage.LHS_TRANS).checkpoint(quantizer_set.x),
               casted_kernel.get_tensor(usage=TensorUsage.RHS_TRANS).checkpoint(quantizer_set.kernel),
               x.shape, kernel.shape, quantizer_set, flatten_k)
  return y, residuals


def _dense_bwd(dims, collective_op_set, x_treedef, residuals, grad):
  from transformer_engine.jax import cpp_extensions as tex  # pylint: disable=import-outside-toplevel # pytype: disable=import-error
  from transformer_engine.jax.cpp_extensions.amax import AmaxScope  # pylint: disable=import-outside-toplevel # pytype: disable=import-error
  from transformer_engine.jax.quantize import TensorUsage  # pylint: disable=import-outside-toplevel # pytype: disable=import-error

  x_t, kernel_t, x_shape, kernel_shape, quantizer_set, flatten_k = residuals
  x_dims, k_dims = dims
  casted_grad, _ = tex.quantize_dbias(grad, is_dbias=False, flatten_axis=flatten_k, quantizer=quantizer_set.dgrad,
                                      amax_scope=AmaxScope.TPSP)
  g_dims = tuple(range(grad.ndim - len(kernel_shape) + len(k_dims), grad.ndim))
  k_free = tuple(d for d in range(len(kernel_shape)) if d not in k_dims)
  dgrad = tex.gemm(casted_grad.get_tensor(usage=TensorUsage.LHS), kernel_t, contracting_dims=(g_dims, k_free),
                   collective_op=collective_op_set.backward)
  batch = tuple(range(len(x_shape) - len(x_dims)))
  wgrad = tex.gemm(x_t, casted_grad.get_tensor(usage=TensorUsage.RHS), contracting_dims=(batch, batch))
  del x_treedef
  return dgrad, None, wgrad, quantizer_set


_dense.defvjp(_dense_fwd, _dense_bwd)
