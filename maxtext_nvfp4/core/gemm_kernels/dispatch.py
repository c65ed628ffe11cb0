"""Which implementation computes one NVFP4 GEMM ``cast((values(a) · values(b)) * alpha)`` (``gemm._nvfp4_dot``).

Implementations (``implementation=``; for a whole run the environment variable ``MAXTEXT_NVFP4_GEMM_IMPL``, which
the argument overrides):

    "xla"     (the default, and the variable unset) ``reference()``: XLA's dot of the bf16 block values.
    "triton"  the Pallas (Triton) GEMM of ``triton_dot.py``, compiled by Triton on XLA:GPU and run by Pallas's
              interpreter elsewhere (the same products, for tests). A call it cannot take raises
              :class:`GemmImplementationUnavailableError` naming why.
    "auto"    the Triton GEMM where the program is lowered for XLA:GPU and it takes the call, the XLA dot
              elsewhere; a call that leaves the kernel logs one line per run and reason (logger ``maxtext_nvfp4``,
              INFO, process 0).

The kernel takes a call with an ``NVFP4Tensor`` operand (2D, one amax: its codes and scales are read) and the other
an NVFP4Tensor too or bf16 block values (``quantize_values``' output), a scalar alpha, every dimension tiled by a power of two >= 16,
a bf16 / fp16 / fp32 output, and no mesh of several devices: it is not partitioned yet (a ``pallas_call`` under the
partitioner would have its operands gathered). Under ``vmap`` (MoE's experts) Pallas adds a grid axis over the batch. The results agree with ``reference()`` up to the fp32 accumulation order
(``tests/core/test_gemm_kernels.py``: bit for bit where every partial sum is exact).

:func:`reads_codes` tells ``gemm`` where a single-use operand (x for fprop, dy for dgrad) is worth quantizing to
codes + scales for the kernel instead of bf16 block values; "xla" never.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from maxtext_nvfp4.core import compilers
from maxtext_nvfp4.core.gemm_kernels import triton_dot
from maxtext_nvfp4.core.quantizer import pallas_triton
from maxtext_nvfp4.core.quantizer.formulas import BLOCK
from maxtext_nvfp4.core.quantizer.tensor import NVFP4Tensor

IMPLEMENTATION_ENV = "MAXTEXT_NVFP4_GEMM_IMPL"
IMPLEMENTATIONS = ("xla", "triton", "auto")
_DEFAULT = "xla"
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))

_log = logging.getLogger("maxtext_nvfp4")
_lock = threading.Lock()
_logged: set[tuple[str, str]] = set()


class GemmImplementationUnavailableError(ValueError):
  """A forced GEMM implementation cannot compute this call (the message names the obstacle and the fix)."""


def _requested(implementation: str | None) -> tuple[str, str]:
  """``(request, source)``: one of :data:`IMPLEMENTATIONS` and what asked for it (named in errors)."""
  if implementation is None:
    env = os.environ.get(IMPLEMENTATION_ENV, "").strip()
    if env == "":
      return _DEFAULT, ""
    if env not in IMPLEMENTATIONS:
      raise ValueError(f"{IMPLEMENTATION_ENV}={env!r}: choose one of {IMPLEMENTATIONS} (or unset it: xla)")
    return env, f"{IMPLEMENTATION_ENV}={env}"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r}: choose one of {IMPLEMENTATIONS}, or None")
  return implementation, f"implementation={implementation!r}"


def requested(implementation: str | None = None) -> str:
  """The GEMM implementation asked for: ``implementation``, else ``MAXTEXT_NVFP4_GEMM_IMPL``, else "xla"."""
  return _requested(implementation)[0]


def _view(q, contract_axis: int):
  """(stored 2D array, Operand, parts) of one GEMM operand: an NVFP4Tensor (codes and scales) or a
  ``(values, amax, bound)`` triple (bf16 values)."""
  if isinstance(q, NVFP4Tensor):
    op = triton_dot.Operand(quantized=True, contract_axis=contract_axis, scale_rows=q.block_2d or q.axis == 0,
                            scale_cols=q.block_2d or q.axis == 1)
    return q.data, op, (q.data, q.scale)
  return q[0], triton_dot.Operand(quantized=False, contract_axis=contract_axis), (q[0],)


def refusal(qa, qb, contract, alpha, out_dtype) -> str | None:
  """Why the Triton GEMM does not take this call (None: it does)."""
  if not (isinstance(qa, NVFP4Tensor) or isinstance(qb, NVFP4Tensor)):
    return "a GEMM without an NVFP4Tensor operand (both are block values already)"
  (a, _, _), (b, _, _) = _view(qa, contract[0]), _view(qb, contract[1])
  if a.ndim != 2 or b.ndim != 2:
    return "an operand that is not a 2D matrix (grouped amax blocks)"
  if jnp.ndim(alpha) or any(isinstance(q, NVFP4Tensor) and jnp.ndim(q.amax) for q in (qa, qb)):
    return "a row-scaled operand (one alpha per output row or column)"
  for q in (qa, qb):
    if isinstance(q, NVFP4Tensor):
      if not q.block_2d and q.axis not in (0, 1):
        return "an NVFP4Tensor without 16x16 tiles or 1x16 blocks along one of its axes"
    elif q[0].dtype != jnp.bfloat16:
      return f"{q[0].dtype} block values (the kernel reads bf16)"
  if jnp.dtype(out_dtype) not in _OUT_DTYPES:
    return f"a {jnp.dtype(out_dtype)} output"
  k, m, n = a.shape[contract[0]], a.shape[1 - contract[0]], b.shape[1 - contract[1]]
  if triton_dot.blocks(m, n, k) is None:
    return f"a {m}x{k}x{n} GEMM (every dimension needs a power-of-two tile >= 16 dividing it)"
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and mesh.size > 1:
    return "a GEMM traced under a mesh of several devices (the kernel is not partitioned yet)"
  return None


def _kernel(qa, qb, contract, alpha, out_dtype, interpret: bool):
  (_, a, a_parts), (_, b, b_parts) = _view(qa, contract[0]), _view(qb, contract[1])
  as_bytes = lambda parts: parts if len(parts) == 1 else (  # noqa: E731
      lax.bitcast_convert_type(parts[0], jnp.uint4), lax.bitcast_convert_type(parts[1], jnp.uint8))
  return triton_dot.dot(as_bytes(a_parts), as_bytes(b_parts), alpha, a=a, b=b, out_dtype=jnp.dtype(out_dtype),
                        interpret=interpret)


def _leave(reason: str, what: str = "XLA's dot of the block values, not the Triton GEMM") -> None:
  with _lock:
    if (what, reason) in _logged:
      return
    _logged.add((what, reason))
  if jax.process_index() == 0:
    _log.info("NVFP4 GEMM: %s, for %s (%s=xla or =triton chooses)", what, reason, IMPLEMENTATION_ENV)


def reads_codes(a, axis: int, other, other_axis: int, a_first: bool, out_dtype, *, rht: bool, stochastic: bool,
                rule, implementation: str | None = None) -> bool:
  """Whether ``gemm`` should quantize its single-use 2D operand ``a`` (x for fprop, dy for dgrad / wgrad; 1x16
  blocks along ``axis``, its contraction axis) to an NVFP4Tensor -- E2M1 codes + E4M3 scales, 0.5625 B/element --
  instead of bf16 block values (2 B/element): the Triton GEMM takes the call with ``a`` as codes (``other``: the
  other operand, contracted along ``other_axis``; ``a_first``: ``a`` is the GEMM's left operand) and the Triton
  quantizer has a codes kernel for ``a`` (``pallas_triton.codes_layout``). The same bits either way (``values =
  block_values(quantize(...))``). "xla" (the default): never, so that path is today's, op for op."""
  request, _ = _requested(implementation)
  if request == "xla":
    return False
  if request == "auto" and "cuda" not in compilers.installed() and jax.default_backend() != "gpu":
    return False  # as scaled_dot: no program traced here takes the kernel
  layout, why = pallas_triton.codes_layout(a, axis, False, rht, rule, stochastic)
  if layout is not None:
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    scale_shape = tuple(d // BLOCK if i == axis else d for i, d in enumerate(a.shape))
    stand_in = NVFP4Tensor(data=spec(a.shape, jnp.float4_e2m1fn), scale=spec(scale_shape, jnp.float8_e4m3fn),
                           amax=np.float32(0), axis=axis)
    qa, qb = (stand_in, other) if a_first else (other, stand_in)
    contract = (axis, other_axis) if a_first else (other_axis, axis)
    why = refusal(qa, qb, contract, np.float32(0), out_dtype)
  if why is None:
    return True
  _leave(why, "a single-use operand as bf16 block values, not codes")
  return False


def scaled_dot(qa, qb, contract, alpha, out_dtype, reference: Callable[[], jax.Array],
               implementation: str | None = None) -> jax.Array:
  """``cast((values(qa) · values(qb), fp32 accumulation) * alpha, out_dtype)``; ``contract`` = (a axis, b axis).

  ``qa`` / ``qb``: an NVFP4Tensor or a ``(values, amax, bound)`` triple (``gemm._operand``); ``reference()``: the
  XLA form of the same GEMM. See the module docstring for the implementations.
  """
  request, source = _requested(implementation)
  if request == "xla":
    return reference()
  why = refusal(qa, qb, contract, alpha, out_dtype)
  if request == "triton":
    if why:
      raise GemmImplementationUnavailableError(f"{source} cannot compute this GEMM: {why}; use xla or auto")
    return lax.platform_dependent(cuda=lambda: _kernel(qa, qb, contract, alpha, out_dtype, False),
                                  default=lambda: _kernel(qa, qb, contract, alpha, out_dtype, True))
  if why:
    _leave(why)
    return reference()
  if "cuda" not in compilers.installed() and jax.default_backend() != "gpu":
    return reference()  # no program traced here can be compiled for XLA:GPU
  return lax.platform_dependent(cuda=lambda: _kernel(qa, qb, contract, alpha, out_dtype, False), default=reference)
