"""The NVFP4 quantizer's public entry points, and the one place that picks an implementation for a call.

    quantize(x, ...)          -> NVFP4Tensor (E2M1 data, E4M3 block scales, amax)       TE's quantizer, bit for bit
    quantize_values(x, ...)   -> (q * s8 in dtype, amax)       = (block_values(t), t.amax) of t = quantize(x, ...)
    amaxes(x)                 -> Amaxes(max |x|, max |RHT(x)|) from one pass (or None), for ``amaxes=`` of both

Implementations (``implementation=``; for a whole run the environment variable ``MAXTEXT_NVFP4_QUANTIZER_IMPL``,
which the argument overrides):

    "xla"     ``xla.py``: every scale rule, shape, batching and platform.
    "triton"  ``pallas_triton.py``: Pallas (Triton) kernels for the GEMM operands under TE's standard rule --
              ``quantize_values`` in 1x16 blocks along the last axis or with RHT along axis 0, ``quantize``
              in 1x16 blocks along the last axis (RNE or SR), with RHT along axis 0 or in 16x16 tiles -- and, under one ``vmap`` (MoE's experts), one kernel
              over the batch. Compiled by Triton on XLA:GPU; on any other platform run by Pallas's
              interpreter (the same bits, slowly: for tests). A call it cannot compute raises
              :class:`ImplementationUnavailableError`.
    "mosaic_tpu"  ``pallas_mosaic_tpu.py``: Pallas (Mosaic TPU) kernels laid out on TPU tiles for TE's standard
              rule -- ``quantize`` and ``quantize_values`` in 1x16 blocks along the last axis, along axis 0 of a 2D
              operand (with or without RHT) or in 16x16 tiles, round to nearest or stochastic -- and, under one
              ``vmap``, one kernel over the batch. Compiled by Mosaic on a TPU; elsewhere run by Pallas's
              interpreter (the same bits: the kernels' arithmetic never meets an fp32 subnormal). A call it
              cannot compute raises :class:`ImplementationUnavailableError`.
    None      (or the variable unset / ``auto``) the kernels where they compute the call on their platform (Triton
              on XLA:GPU, Mosaic on a TPU), the XLA form everywhere else. A call that leaves the kernels logs one
              line per run and reason (logger ``maxtext_nvfp4``, INFO, process 0) saying why.

Every implementation gives the same bits (``tests/core/test_quantizer_implementations.py``). The platform
itself is chosen per lowering (``lax.platform_dependent``), among the platforms this environment can compile
for (:func:`_compilable_kernel_platforms`); the log line names the default device's platform.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading

import jax
import jax.numpy as jnp
from jax import lax

from maxtext_nvfp4.core import compilers
from maxtext_nvfp4.core.quantizer import pallas_mosaic_tpu, pallas_triton, xla
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
    "Amaxes",
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
    "amaxes",
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

IMPLEMENTATIONS = ("xla", "triton", "mosaic_tpu")
IMPLEMENTATION_ENV = "MAXTEXT_NVFP4_QUANTIZER_IMPL"
_AUTO = "auto"


class ImplementationUnavailableError(ValueError):
  """A forced implementation cannot compute this call (the message names the call's obstacle and the fix)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class Amaxes:
  """The amaxes of a 2D operand x (T, N) for its 1x16 quantizations, from one pass (:func:`amaxes`)."""

  # max |x| (fp32): the amax of x's quantizations without RHT, along either axis
  amax: jax.Array
  # max |RHT(x)| along axis 0 (fp32): the amax of quantize(x, axis=0, rht=True)
  rht_amax: jax.Array


# ----------------------------------------------------------------------------------------------
# Which implementation was asked for, and the line when a call leaves the kernels
# ----------------------------------------------------------------------------------------------
def _requested(implementation: str | None) -> tuple[str, str]:
  """``(request, source)``: "auto" or one of :data:`IMPLEMENTATIONS`, and what asked for it (named in errors)."""
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
_logged: set[tuple[str, str]] = set()


# Each kernel implementation: the platform whose compiler builds it (``lax.platform_dependent``'s name), the
# default-device platforms that name, and how the log line calls it.
_KERNELS = {
    "triton": ("cuda", ("gpu", "cuda"), "the Pallas Triton kernels"),
    "mosaic_tpu": ("tpu", ("tpu",), "the Pallas Mosaic TPU kernels"),
}


def _leave_kernels(request: str, source: str, reason: str, impl: str = "triton") -> None:
  """A call the kernels of ``impl`` do not take: forced to them (``request`` names them), a one-line error;
  automatic, one log line per run and reason (process 0)."""
  if request in _KERNELS:
    fix = "unset it or set it to auto" if source.startswith(IMPLEMENTATION_ENV) else "use None (automatic) or 'xla'"
    raise ImplementationUnavailableError(f"{source} cannot quantize this call: {reason}; {fix}")
  with _lock:
    if (impl, reason) in _logged:
      return
    _logged.add((impl, reason))
  if jax.process_index() == 0:
    _log.info("NVFP4 quantizer: the XLA form, not %s, for %s (%s=xla or =%s chooses)", _KERNELS[impl][2], reason,
              IMPLEMENTATION_ENV, impl)


def _compilable_kernel_platforms(platform: str) -> frozenset[str]:
  """The kernel platforms a program traced in this process can be compiled for: an installed compiler's
  (:func:`compilers.installed`), and ``platform``'s, the default device's. Automatic dispatch traces a kernel
  branch for these only: a process without XLA:GPU's plugin or libtpu (a CPU-only environment) can never compile
  the Pallas kernels, and tracing them costs seconds per model. (A program lowered here for another platform,
  ``lower(lowering_platforms=...)`` with no compiler installed, takes the XLA form: the same bits.)"""
  default = {kernel_platform for kernel_platform, names, _ in _KERNELS.values() if platform in names}
  return compilers.installed() | frozenset(default)


def _default_platform() -> str:
  """The platform of the default device: what a call here most likely lowers for (the log line's)."""
  device = jax.config.jax_default_device
  if device is None:
    return jax.default_backend()
  return device if isinstance(device, str) else device.platform


# ----------------------------------------------------------------------------------------------
# The dispatch
# ----------------------------------------------------------------------------------------------
def _dispatch(request: str, source: str, x, extras: tuple, forms: dict, xla_form):
  """The implementation of one call: ``xla_form(x)`` (``extras`` closed over) or a kernel implementation's
  ``kernel(x, *extras, **kw)`` (``extras``: the call's other traced arguments -- the SR key and the given amaxes,
  either None -- or none; ``kw``: batched, key_batched, interpret and, for "triton", flush_to_zero_safe).
  ``forms``: {implementation: ((layout, refusal), kernel)} of ``pallas_triton`` and ``pallas_mosaic_tpu``.

  Automatic: ``lax.platform_dependent`` between each kernel implementation on its platform (Triton on XLA:GPU,
  Mosaic on a TPU) and the XLA form; forced to kernels: those kernels, compiled on their platform and
  interpreted elsewhere; forced "xla": the XLA form.
  """
  if request == "xla":
    return xla_form(x)
  if request in forms:
    (layout, refusal), kernel = forms[request]
    if layout is None:
      _leave_kernels(request, source, refusal, request)
    interpret_kw = dict(interpret=True, flush_to_zero_safe=True) if request == "triton" else dict(interpret=True)
    interpreted = lambda x, *k, **kw: kernel(x, *k, **interpret_kw, **kw)  # noqa: E731
    run = lambda fn: lambda x: _kernel_unless_vmapped(fn, None, x, *extras, source=source, impl=request)  # noqa: E731
    return lax.platform_dependent(x, **{_KERNELS[request][0]: run(kernel)}, default=run(interpreted))
  platform = _default_platform()
  # the implementation whose platform the default device is (its log lines); Triton's names every other platform
  home = next((impl for impl, (_, names, _) in _KERNELS.items() if platform in names), None)
  compilable = _compilable_kernel_platforms(platform)
  branches = {}
  for impl, ((layout, refusal), kernel) in forms.items():
    logs = impl == (home or "triton")
    if layout is None:
      if logs:
        _leave_kernels(request, source, refusal, impl)
      continue
    if logs and home is None:
      _leave_kernels(request, source, f"every call: the default device is {platform}, and the kernels run on XLA:GPU"
                     " or a TPU", impl)
    if _KERNELS[impl][0] in compilable:
      branches[_KERNELS[impl][0]] = functools.partial(_auto_kernel, kernel, xla_form, extras, impl, logs and home)
  if not branches:
    return xla_form(x)
  return lax.platform_dependent(x, **branches, default=xla_form)


def _auto_kernel(kernel, xla_form, extras, impl, log, x):
  return _kernel_unless_vmapped(kernel, xla_form, x, *extras, log=bool(log), impl=impl)


def _kernel_unless_vmapped(kernel, xla_form, *args, source: str = "", log: bool = True, impl: str = "triton"):
  """``kernel(x, *key)``; under one ``vmap`` of x (batched GEMMs: MoE experts) ``kernel(..., batched=True)``,
  one amax and one SR key per slice, as ``vmap(xla_form)`` has them. Under a second ``vmap`` (per-block amaxes:
  TE's amax scope), a ``vmap`` of the key alone, or a batch whose type carries a sharding: ``xla_form`` vmapped
  (automatic; ``log``: say so), or, forced to the kernels (``xla_form`` None), an error naming ``source``."""

  def leave(reason):
    if xla_form is None:
      _leave_kernels(impl, source, reason, impl)
    elif log:
      _leave_kernels(_AUTO, "", reason, impl)

  def rule(in_batched, x, *extras):
    vxla = None if xla_form is None else _vmapped(xla_form, in_batched)
    if not in_batched[0]:
      leave("a vmap of the stochastic-rounding key or the given amaxes alone (the operand unbatched)")
      return vxla(x, *extras)
    if pallas_triton.explicitly_sharded(x):
      leave("a vmapped operand whose type carries a sharding (pallas_call takes unsharded types)")
      return vxla(x, *extras)
    # (key, amaxes) when the call has extras: the key's leaves say whether each slice has its own key; any
    # unbatched leaf -- a FoldedKey's shared start key, amaxes given once -- is broadcast to the slices
    key_leaves = jax.tree_util.tree_leaves(in_batched[1:2])
    key_batched = any(key_leaves)
    broadcast = lambda a, b: a if b else jnp.broadcast_to(a, x.shape[:1] + jnp.shape(a))  # noqa: E731
    if key_batched and not all(key_leaves):  # a FoldedKey's start key shared, its fold data per slice
      extras = (jax.tree_util.tree_map(broadcast, extras[0], in_batched[1]),) + extras[1:]
    if len(extras) > 1 and extras[1] is not None:
      extras = extras[:1] + (jax.tree_util.tree_map(broadcast, extras[1], in_batched[2]),)
    once = lambda x, *extras: kernel(x, *extras, batched=True, key_batched=key_batched)  # noqa: E731

    def twice(inner, *a):
      leave("a second vmap (per-block amax scopes)")
      return _vmapped(vxla, inner)(*a)

    return _with_vmap_rule(once, twice, x, *extras)

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


def _given_amax(amaxes, rht: bool):
  """The amax an RHT (or plain) 1x16 quantization takes from :class:`Amaxes` ``amaxes`` (None: none given)."""
  return None if amaxes is None else (amaxes.rht_amax if rht else amaxes.amax)


def _quantize_impl(x, stochastic_key, amaxes, axis_n, block_2d, rht, rule, request, source):
  """The traced body of :func:`quantize` (arguments validated; ``axis_n`` non-negative or None)."""
  xla_form = lambda x, key=stochastic_key, am=amaxes: xla.quantize(  # noqa: E731
      x, key, axis_n, block_2d, rht, rule, _given_amax(am, rht))
  sr = stochastic_key is not None
  triton_plan = pallas_triton.codes_layout(x, axis_n, block_2d, rht, rule, sr)
  tpu_plan = pallas_mosaic_tpu.codes_layout(x, axis_n, block_2d, rht, rule, sr)
  forms = {
      "triton": (triton_plan, lambda x, key, am, **kw: pallas_triton.quantize(
          x, triton_plan[0], key, amax=_given_amax(am, rht), **kw)),
      # Mosaic's kernels take their amaxes in passes of their own (the given ones unused: the same values)
      "mosaic_tpu": (tpu_plan, lambda x, key, am, **kw: pallas_mosaic_tpu.quantize(x, tpu_plan[0], key, **kw)),
  }
  return _dispatch(request, source, x, (stochastic_key, amaxes), forms, xla_form)


def _quantize_values_impl(x, stochastic_key, amaxes, axis_n, block_2d, rht, dtype, rule, request, source):
  """The traced body of :func:`quantize_values`."""
  xla_form = lambda x, key=stochastic_key, am=amaxes: xla.quantize_values(  # noqa: E731
      x, key, axis_n, block_2d, rht, dtype, rule, _given_amax(am, rht))
  triton_plan = pallas_triton.values_layout(x, axis_n, block_2d, rht, rule)
  tpu_plan = pallas_mosaic_tpu.values_layout(x, axis_n, block_2d, rht, rule)
  forms = {
      "triton": (triton_plan, lambda x, key, am, **kw: pallas_triton.quantize_values(
          x, dtype, triton_plan[0], key, amax=_given_amax(am, rht), **kw)),
      "mosaic_tpu": (tpu_plan, lambda x, key, am, **kw: pallas_mosaic_tpu.quantize_values(
          x, dtype, tpu_plan[0], key, **kw)),
  }
  return _dispatch(request, source, x, (stochastic_key, amaxes), forms, xla_form)


def _amaxes_impl(x, request, source):
  """The traced body of :func:`amaxes` (``request``: "triton" or "auto"; the caller checked that the kernel takes x)."""
  as_amaxes = lambda t: Amaxes(amax=t[0], rht_amax=t[1])  # noqa: E731
  xla_form = lambda x: as_amaxes(xla.amaxes(x))  # noqa: E731
  plan = pallas_triton.values_layout(x, 0, False, True, STANDARD_RULE)
  forms = {"triton": (plan, lambda x, **kw: as_amaxes(pallas_triton.amaxes(x, **kw)))}
  return _dispatch(request, source, x, (), forms, xla_form)


# One compiled program per (shape, dtype, mode): eager op-by-op dispatch of the ~100 small ops of the quantizer
# costs seconds of compilation per new shape. Inside an outer jit this simply inlines.
_quantize_jit = jax.jit(_quantize_impl, static_argnums=(3, 4, 5, 6, 7, 8))
_quantize_values_jit = jax.jit(_quantize_values_impl, static_argnums=(3, 4, 5, 6, 7, 8, 9))
_amaxes_jit = jax.jit(_amaxes_impl, static_argnums=(1, 2))


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


def _check_amaxes(amaxes, x, axis_n, block_2d: bool, rht: bool, rule: ScaleRule):
  """A given :class:`Amaxes` fits this call: TE's standard rule, 1x16 blocks, with RHT along axis 0 of a 2D x."""
  if amaxes is None:
    return
  if not isinstance(amaxes, Amaxes):
    raise TypeError(f"amaxes must be an Amaxes (from amaxes(x)), got {type(amaxes).__name__}")
  if block_2d or rule != STANDARD_RULE:
    raise ValueError("amaxes= is for 1x16 blocks under TE's standard rule (16x16 tiles, 4over6, row-scaled and"
                     " E4M3 bound 256 take their own amax): drop amaxes=")
  if rht and (x.ndim != 2 or axis_n != 0):
    raise ValueError(f"amaxes= with rht=True is for the RHT along axis 0 of a 2D x (what amaxes(x) computes), got"
                     f" x {tuple(x.shape)} with axis {axis_n}: drop amaxes=")


def quantize(x, *, axis: int = -1, block_2d: bool = False, rht: bool = False, stochastic_key=None,
             scale_rule: ScaleRule | None = None, implementation: str | None = None,
             amaxes: "Amaxes | None" = None) -> NVFP4Tensor:
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
    implementation: "xla", "triton", "mosaic_tpu", or None (automatic; the module docstring).
    amaxes: :func:`amaxes` of ``x`` (or of ``x`` with zero rows or columns appended, for a call without RHT),
      used instead of this call's own amax pass (1x16 blocks, TE's standard rule): the same bits from one read
      of x less. Any other value gives other bits.

  Raises:
    TypeError: non-floating input.
    ValueError: a block axis whose length is not a multiple of 16; a rule TE refuses here (4over6 with
      RHT or SR, row-scaled 16x16 tiles); an unknown implementation.
    ImplementationUnavailableError: a forced implementation that cannot compute this call.
  """
  x, axis_n, rule = _validate(x, axis, block_2d, rht, scale_rule, stochastic_key is not None)
  _check_amaxes(amaxes, x, axis_n, block_2d, rht, rule)
  return _quantize_jit(x, stochastic_key, amaxes, axis_n, block_2d, rht, rule, *_requested(implementation))


def quantize_values(
    x, *, axis: int = -1, block_2d: bool = False, rht: bool = False, stochastic_key=None, dtype=jnp.bfloat16,
    scale_rule: ScaleRule | None = None, implementation: str | None = None, amaxes: "Amaxes | None" = None,
):
  """``(block_values(t, dtype), t.amax)`` for ``t = quantize(x, ...)``, bit for bit, in one pass.

  The GEMM-side view of an operand that is used once: the E2M1 value times its block's E4M3 scale,
  computed from the codes directly, without the 4-bit packing and the ``float4 -> fp32`` decode
  (a software convert on XLA:CPU). Same arguments and errors as :func:`quantize`.
  """
  x, axis_n, rule = _validate(x, axis, block_2d, rht, scale_rule, stochastic_key is not None)
  _check_amaxes(amaxes, x, axis_n, block_2d, rht, rule)
  return _quantize_values_jit(x, stochastic_key, amaxes, axis_n, block_2d, rht, jnp.dtype(dtype), rule,
                              *_requested(implementation))


def amaxes(x, *, implementation: str | None = None) -> "Amaxes | None":
  """Both amaxes of a 2D operand x (T, N) from one read of it, where a kernel computes them (TE's
  ``nvte_hadamard_transform_amax``: the amax of x and of its RHT along axis 0 in one kernel), for the two
  quantizations of an operand that two GEMMs use (dy: 1x16 along N for dgrad, RHT along T for wgrad)::

      Amaxes(amax = max |x|,  rht_amax = max |RHT(x)| along axis 0)

  Pass the result as ``quantize(..., amaxes=)`` / ``quantize_values(..., amaxes=)``: each call then skips its
  own amax pass (on XLA:GPU the quantizer reads x three times instead of four; the RHT kernels take their block
  maxima from their own tiles, so only the two scalars live between the passes). None where no kernel computes
  them -- implementation "xla" or "mosaic_tpu", or automatic in a process that cannot compile for XLA:GPU, or an
  operand the Triton kernels refuse: the quantize calls then take their own amaxes, as without it.

  Args:
    x: a 2D bf16 or fp32 array whose row count is a multiple of 16.
    implementation: as :func:`quantize`'s ("triton": the kernel, interpreted off XLA:GPU).
  """
  x = jnp.asarray(x)
  if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"amaxes: a 2D floating-point operand, got shape {x.shape} dtype {x.dtype}")
  check_block_dim(x.shape, 0)
  request, source = _requested(implementation)
  if request in ("xla", "mosaic_tpu"):
    return None
  layout, refusal = pallas_triton.values_layout(x, 0, False, True, STANDARD_RULE)
  if layout is None:
    if request == "triton":
      raise ImplementationUnavailableError(f"{source} cannot compute amaxes of this operand: {refusal}")
    return None
  if request == _AUTO and "cuda" not in _compilable_kernel_platforms(_default_platform()):
    return None
  return _amaxes_jit(x, request, source)
