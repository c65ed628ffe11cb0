"""The NVFP4 quantizer's public entry points, and the one place that picks an implementation for a call.

    quantize(x, ...)          -> NVFP4Tensor (E2M1 data, E4M3 block scales, amax)       TE's quantizer, bit for bit
    quantize_values(x, ...)   -> (q * s8 in dtype, amax)       = (block_values(t), t.amax) of t = quantize(x, ...)

Implementations (``implementation=``; for a whole run the environment variable ``MAXTEXT_NVFP4_QUANTIZER_IMPL``,
which the argument overrides):

    "xla"     ``xla.py``: every scale rule, shape, batching and platform.
    "triton"  ``pallas_triton.py``: Pallas (Triton) kernels for the GEMM operands under TE's standard rule --
              ``quantize_values`` in 1x16 blocks along the last axis or with RHT along axis 0, ``quantize``
              with RHT along axis 0 or in 16x16 tiles -- and, under one ``vmap`` (MoE's experts), one kernel
              over the batch. Compiled by Triton on XLA:GPU; on any other platform run by Pallas's
              interpreter (the same bits, slowly: for tests). A call it cannot compute raises
              :class:`ImplementationUnavailableError`.
    None      (or the variable unset / ``auto``) the kernels where they compute the call on XLA:GPU, the XLA
              form everywhere else. A call that leaves the kernels logs one line per run and reason (logger
              ``maxtext_nvfp4``, INFO, process 0) saying why.

Every implementation gives the same bits (``tests/core/test_quantizer_implementations.py``). The platform
itself is chosen per lowering (``lax.platform_dependent``); the log line names the default device's platform.
"""

from __future__ import annotations

import logging
import os
import threading

import jax
import jax.numpy as jnp
from jax import lax

from maxtext_nvfp4.core.quantizer import pallas_triton, xla
from maxtext_nvfp4.core.quantizer.formulas import (
    BLOCK,
    E2M1_MAX,
    E4M3_MAX,
    RECIP_GLOBAL_DENOMINATOR,
    STANDARD_RULE,
    ScaleRule,
    check_block_dim,
    check_rule,
    global_denominator,
)
from maxtext_nvfp4.core.quantizer.hadamard import RHT_SIGNS, rht, rht_matrix
from maxtext_nvfp4.core.quantizer.tensor import (
    NVFP4Tensor,
    as_numpy,
    block_values,
    dequantize,
    dequantize_kernel_order,
    global_decode_scale,
    pack,
    unpack,
)

__all__ = [
    "BLOCK",
    "E2M1_MAX",
    "E4M3_MAX",
    "IMPLEMENTATIONS",
    "IMPLEMENTATION_ENV",
    "ImplementationUnavailableError",
    "NVFP4Tensor",
    "RECIP_GLOBAL_DENOMINATOR",
    "RHT_SIGNS",
    "STANDARD_RULE",
    "ScaleRule",
    "as_numpy",
    "block_values",
    "dequantize",
    "dequantize_kernel_order",
    "global_decode_scale",
    "global_denominator",
    "pack",
    "quantize",
    "quantize_values",
    "rht",
    "rht_matrix",
    "unpack",
]

IMPLEMENTATIONS = ("xla", "triton")
IMPLEMENTATION_ENV = "MAXTEXT_NVFP4_QUANTIZER_IMPL"
_AUTO = "auto"


class ImplementationUnavailableError(ValueError):
  """A forced implementation cannot compute this call (the message names the call's obstacle and the fix)."""


# ----------------------------------------------------------------------------------------------
# Which implementation was asked for, and the line when a call leaves the kernels
# ----------------------------------------------------------------------------------------------
def _requested(implementation: str | None) -> tuple[str, str]:
  """``(request, source)``: "auto" | "xla" | "triton", and what asked for it (named in errors)."""
  if implementation is None:
    env = os.environ.get(IMPLEMENTATION_ENV, "").strip()
    if env in ("", _AUTO):
      return _AUTO, ""
    if env not in IMPLEMENTATIONS:
      raise ValueError(f"{IMPLEMENTATION_ENV}={env!r}: choose one of {(_AUTO,) + IMPLEMENTATIONS} (or unset it)")
    return env, f"{IMPLEMENTATION_ENV}={env}"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation={implementation!r}: choose one of {IMPLEMENTATIONS}, or None (automatic)")
  return implementation, f"implementation={implementation!r}"


_log = logging.getLogger("maxtext_nvfp4")
_lock = threading.Lock()
_logged: set[str] = set()


def _leave_kernels(request: str, source: str, reason: str) -> None:
  """A call the kernels do not take: forced to them, a one-line error; automatic, one log line per run and
  reason (process 0)."""
  if request == "triton":
    fix = "unset it or set it to auto" if source.startswith(IMPLEMENTATION_ENV) else "use None (automatic) or 'xla'"
    raise ImplementationUnavailableError(f"{source} cannot quantize this call: {reason}; {fix}")
  with _lock:
    if reason in _logged:
      return
    _logged.add(reason)
  if jax.process_index() == 0:
    _log.info("NVFP4 quantizer: the XLA form, not the Pallas Triton kernels, for %s (%s=xla or =triton chooses)",
              reason, IMPLEMENTATION_ENV)


def _default_platform() -> str:
  """The platform of the default device: what a call here most likely lowers for (the log line's)."""
  device = jax.config.jax_default_device
  if device is None:
    return jax.default_backend()
  return device if isinstance(device, str) else device.platform


# ----------------------------------------------------------------------------------------------
# The dispatch
# ----------------------------------------------------------------------------------------------
def _dispatch(request: str, source: str, x, stochastic_key, plan, kernel, xla_form):
  """The implementation of one call: ``xla_form(x)`` (the key closed over) or ``kernel(x, *key, **kw)`` (``kw``:
  batched, key_batched, flush_to_zero_safe, interpret) for ``plan = (layout, refusal)`` of ``pallas_triton``.

  Automatic: ``lax.platform_dependent`` between the kernels (XLA:GPU) and the XLA form; forced "triton": the
  kernels, compiled on XLA:GPU and interpreted elsewhere; forced "xla": the XLA form.
  """
  layout, refusal = plan
  if request == "xla":
    return xla_form(x)
  if layout is None:
    _leave_kernels(request, source, refusal)
    return xla_form(x)
  keys = () if stochastic_key is None else (stochastic_key,)
  if request == "triton":
    interpreted = lambda x, *k, **kw: kernel(x, *k, interpret=True, flush_to_zero_safe=True, **kw)  # noqa: E731
    return lax.platform_dependent(
        x, cuda=lambda x: _kernel_unless_vmapped(kernel, None, x, *keys, source=source),
        default=lambda x: _kernel_unless_vmapped(interpreted, None, x, *keys, source=source))
  platform = _default_platform()
  kernel_platform = platform in ("gpu", "cuda")
  if not kernel_platform:
    _leave_kernels(request, source, f"every call: the default device is {platform}, and the kernels run on XLA:GPU")
  return lax.platform_dependent(
      x, cuda=lambda x: _kernel_unless_vmapped(kernel, xla_form, x, *keys, log=kernel_platform), default=xla_form)


def _kernel_unless_vmapped(kernel, xla_form, *args, source: str = "", log: bool = True):
  """``kernel(x, *key)``; under one ``vmap`` of x (batched GEMMs: MoE experts) ``kernel(..., batched=True)``,
  one amax and one SR key per slice, as ``vmap(xla_form)`` has them. Under a second ``vmap`` (per-block amaxes:
  TE's amax scope), a ``vmap`` of the key alone, or a batch whose type carries a sharding: ``xla_form`` vmapped
  (automatic; ``log``: say so), or, forced to the kernels (``xla_form`` None), an error naming ``source``."""

  def leave(reason):
    if xla_form is None:
      _leave_kernels("triton", source, reason)
    elif log:
      _leave_kernels(_AUTO, "", reason)

  def rule(in_batched, x, *key):
    vxla = None if xla_form is None else _vmapped(xla_form, in_batched)
    if not in_batched[0]:
      leave("a vmap of the stochastic-rounding key alone (the operand unbatched)")
      return vxla(x, *key)
    if pallas_triton.explicitly_sharded(x):
      leave("a vmapped operand whose type carries a sharding (pallas_call takes unsharded types)")
      return vxla(x, *key)
    key_leaves = jax.tree_util.tree_leaves(in_batched[1:])
    key_batched = any(key_leaves)
    if key_batched and not all(key_leaves):  # a FoldedKey's start key shared, its fold data per slice
      key = jax.tree_util.tree_map(lambda a, b: a if b else jnp.broadcast_to(a, x.shape[:1] + a.shape), key,
                                   tuple(in_batched[1:]))
    once = lambda x, *key: kernel(x, *key, batched=True, key_batched=key_batched)  # noqa: E731

    def twice(inner, *a):
      leave("a second vmap (per-block amax scopes)")
      return _vmapped(vxla, inner)(*a)

    return _with_vmap_rule(once, twice, x, *key)

  return _with_vmap_rule(kernel, rule, *args)


def _vmapped(fn, in_batched):
  return jax.vmap(fn, in_axes=tuple(jax.tree_util.tree_map(lambda b: 0 if b else None, b) for b in in_batched))


def _with_vmap_rule(fn, rule, *args):
  """``fn(*args)`` whose ``vmap`` is ``rule(in_batched, *batched_args)`` (every output batched)."""
  wrapped = jax.custom_batching.custom_vmap(fn)

  @wrapped.def_vmap
  def _batched(axis_size, in_batched, *batched_args):  # pylint: disable=unused-variable
    del axis_size
    out = rule(in_batched, *batched_args)
    return out, jax.tree_util.tree_map(lambda _: True, out)

  return wrapped(*args)


def _quantize_impl(x, stochastic_key, axis_n, block_2d, rht, rule, request, source):
  """The traced body of :func:`quantize` (arguments validated; ``axis_n`` non-negative or None)."""
  xla_form = lambda x, key=stochastic_key: xla.quantize(x, key, axis_n, block_2d, rht, rule)  # noqa: E731
  plan = pallas_triton.codes_layout(x, axis_n, block_2d, rht, rule, stochastic_key is not None)
  kernel = lambda x, **kw: pallas_triton.quantize(x, plan[0], **kw)  # noqa: E731
  return _dispatch(request, source, x, None, plan, kernel, xla_form)


def _quantize_values_impl(x, stochastic_key, axis_n, block_2d, rht, dtype, rule, request, source):
  """The traced body of :func:`quantize_values`."""
  xla_form = lambda x, key=stochastic_key: xla.quantize_values(x, key, axis_n, block_2d, rht, dtype, rule)  # noqa: E731
  plan = pallas_triton.values_layout(x, axis_n, block_2d, rht, rule)
  kernel = lambda x, *key, **kw: pallas_triton.quantize_values(x, dtype, plan[0], *key, **kw)  # noqa: E731
  return _dispatch(request, source, x, stochastic_key, plan, kernel, xla_form)


# One compiled program per (shape, dtype, mode): eager op-by-op dispatch of the ~100 small ops of the quantizer
# costs seconds of compilation per new shape. Inside an outer jit this simply inlines.
_quantize_jit = jax.jit(_quantize_impl, static_argnums=(2, 3, 4, 5, 6, 7))
_quantize_values_jit = jax.jit(_quantize_values_impl, static_argnums=(2, 3, 4, 5, 6, 7, 8))


# ----------------------------------------------------------------------------------------------
# The entry points
# ----------------------------------------------------------------------------------------------
def _validate(x, axis, block_2d, rht, scale_rule: ScaleRule | None, stochastic: bool):
  """Checks shared by :func:`quantize` and :func:`quantize_values`; returns (x, axis_n, rule).

  ``rule`` is a ScaleRule (None means STANDARD_RULE). ``axis_n`` is None for 16x16 tiles unless the rule is
  4over6.
  """
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"NVFP4 quantize needs a floating-point array (bf16 or fp32), got dtype {x.dtype}")
  rule = STANDARD_RULE if scale_rule is None else scale_rule
  if not isinstance(rule, ScaleRule):
    raise TypeError(f"scale_rule must be a ScaleRule, got {type(rule).__name__}")
  check_rule(rule, block_2d, rht, stochastic)
  if block_2d:
    if x.ndim < 2:
      raise ValueError(f"2D (16x16) NVFP4 blocks need at least 2 dims, got shape {x.shape}")
    if rht:
      raise ValueError("RHT applies to 1x16 (column-wise) quantization only, not to 16x16 blocks")
    check_block_dim(x.shape, x.ndim - 2)
    check_block_dim(x.shape, x.ndim - 1)
    if rule.selection == "4over6":
      axis_n = axis % x.ndim
      if axis_n < x.ndim - 2:
        raise ValueError(f"4over6 with 16x16 tiles sums the error along one of the last two axes, got axis {axis}")
      return x, axis_n, rule
    return x, None, rule
  if x.ndim == 0:
    raise ValueError("cannot quantize a scalar")
  axis_n = axis % x.ndim
  check_block_dim(x.shape, axis_n)
  return x, axis_n, rule


def quantize(x, *, axis: int = -1, block_2d: bool = False, rht: bool = False, stochastic_key=None,
             scale_rule: ScaleRule | None = None, implementation: str | None = None) -> NVFP4Tensor:
  """Quantize ``x`` to NVFP4 exactly as TE's kernels do (the formulas: ``formulas.py``'s docstring).

  Args:
    x: bf16 or fp32 array. fp32 values are used as given (TE's fallback kernel); bf16 is what the
      optimized kernels take.
    axis: the 1x16 block axis (the GEMM contraction axis). Ignored when ``block_2d``.
    block_2d: 16x16 tiles over the last two axes (TE's weight path, ``NVFP4_2D_SCALING``).
    rht: apply TE's 16-point RHT along ``axis`` first (the wgrad operands); the amax is then the
      post-RHT amax and the result stays in the RHT domain.
    stochastic_key: a ``jax.random`` key (or a ``prng.FoldedKey``) for stochastic rounding of the
      elements (gradients); ``None`` means RNE.
    scale_rule: how the scales are chosen (:class:`ScaleRule`; None: :data:`STANDARD_RULE`, TE's standard
      rule). With 16x16 tiles and 4over6, ``axis`` is the axis along which each tile row's error is summed (TE's
      rowwise copy of a matrix: the last axis; its columnwise copy: axis 0).
    implementation: "xla", "triton", or None (automatic; the module docstring).

  Raises:
    TypeError: non-floating input.
    ValueError: a block axis whose length is not a multiple of 16; a rule TE refuses here (4over6 with
      RHT or SR, row-scaled 16x16 tiles); an unknown implementation.
    ImplementationUnavailableError: a forced implementation that cannot compute this call.
  """
  x, axis_n, rule = _validate(x, axis, block_2d, rht, scale_rule, stochastic_key is not None)
  return _quantize_jit(x, stochastic_key, axis_n, block_2d, rht, rule, *_requested(implementation))


def quantize_values(
    x, *, axis: int = -1, block_2d: bool = False, rht: bool = False, stochastic_key=None, dtype=jnp.bfloat16,
    scale_rule: ScaleRule | None = None, implementation: str | None = None,
):
  """``(block_values(t, dtype), t.amax)`` for ``t = quantize(x, ...)``, bit for bit, in one pass.

  The GEMM-side view of an operand that is used once: the E2M1 value times its block's E4M3 scale,
  computed from the codes directly, without the 4-bit packing and the ``float4 -> fp32`` decode
  (a software convert on XLA:CPU). Same arguments and errors as :func:`quantize`.
  """
  x, axis_n, rule = _validate(x, axis, block_2d, rht, scale_rule, stochastic_key is not None)
  return _quantize_values_jit(x, stochastic_key, axis_n, block_2d, rht, jnp.dtype(dtype), rule,
                              *_requested(implementation))
