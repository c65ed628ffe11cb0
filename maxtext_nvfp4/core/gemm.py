"""Emulated NVFP4 GEMM recipe: a ``jax.custom_vjp`` ``dot_general`` with TE ``dense``'s per-GEMM treatment.

For activations ``x`` (M, K) (M = tokens, after flattening) and a kernel ``W`` (K, N):

  fprop  y  = x · W      x: 1x16 blocks along K, RNE            W: 16x16 tiles over (K, N), RNE
                                                                   (1x16 along K if not two_d_weights)
  dgrad  dx = dy · Wᵀ    dy: 1x16 along N, SR (RNE if off)      W: the SAME 16x16 tiles as fprop
                                                                   (1x16 along N if not two_d_weights)
  wgrad  dW = xᵀ · dy    x: 1x16 along tokens, RHT16, RNE       dy: 1x16 along tokens, RHT16, SR

Each NVFP4 GEMM is computed as

    out   = cast( (block_values(a) @ block_values(b), fp32 accumulation) * alpha )
    alpha = fl( fl(amax_a * c) * fl(amax_b * c) ),   c = fl32(1 / 2688) = 0.000372023816...

which is TE JAX's ``alpha = (amax_a / 2688.) * (amax_b / 2688.)`` as XLA compiles it (see
:func:`gemm_alpha`: the division by a constant becomes a multiplication by its rounded reciprocal).
``block_values`` are
``q * s8``, exact in bf16 (a 2-bit e2m1 significand times a 4-bit e4m3 one), so the product of the
16-element blocks is computed exactly and the ordinary bf16 GEMM with fp32 accumulation is the Tensor
Core's NVFP4 GEMM up to the (unspecified) accumulation order. With RHT, both wgrad operands are
rotated by the same orthogonal ``diag(s) H16 / 4`` along tokens, so ``(xM)ᵀ(dyM) = xᵀ dy`` in exact
arithmetic; the quantization happens in the rotated domain and the result needs no inverse transform.

Outputs: y in ``preferred_element_type`` (default: the inputs' dtype), dx in x's dtype, dW in W's
dtype. Other precisions per pass: ``"bf16"`` is a plain ``dot_general`` of the unquantized operands with
fp32 accumulation; ``"fp8"`` is TE's per-tensor current-scaling FP8, HYBRID (E4M3 x and W, E5M2 dy), see
``maxtext_nvfp4.core.fp8``.

Shapes: any ``dimension_numbers``. Contracting dims are flattened (in the order given, last one
fastest) into K; the remaining lhs dims into M and rhs dims into N; the output has lax.dot_general's
layout (batch, lhs free, rhs free). Batch dims are independent GEMMs (``vmap``): each batch slice is
its own tensor with its own amax and, for SR, its own key ``fold_in(key, batch_index)``. Block axes
whose length is not a multiple of 16 are zero-padded; zeros change no amax and no other block, and
the padded outputs are sliced off, so results equal those of explicitly zero-padded inputs.

Randomness: stochastic rounding of dy uses ``sr_keys(key)``: ``fold_in(key, 1)`` for the dgrad copy
and ``fold_in(key, 2)`` for the wgrad copy (TE reuses one Philox seed for both copies but with
different thread/offset mappings, so its two copies also get different bits). SR matches TE in
distribution only.

Quantization count and residuals (TE-like): W is quantized once in the forward; with 2D tiles the same
NVFP4 tensor serves fprop and dgrad. When every branch's dgrad is NVFP4 (same block layout), the
residual is that 4-bit W (data + e4m3 scales + amax) instead of W; when every branch's wgrad is NVFP4
(same RHT), it is the 4-bit xᵀ (tokens-blocked, RHT) quantized in the forward instead of x. Otherwise x
and/or W are saved in their input dtype. Never both: at most what a bf16 GEMM saves. RNE is
deterministic, so saving and re-quantizing give the same bits. Operands used by one GEMM only (x for
fprop, dy for dgrad and for wgrad) go through ``numerics.quantize_values``: the same block values, bit
for bit, without the 4-bit packing and decode.

Late switch: with ``switched`` and a traced boolean ``use_switched``, each pass whose settings differ
between the two recipes is a ``lax.cond`` between both, so flipping the flag never recompiles
(``use_switched`` may be a Python bool too; it is converted to an array, so it never specializes).

Non-finite operands: a NaN/Inf in x, W or dy poisons that operand's amax (numerics/fp8), so the
affected GEMM output is NaN/Inf everywhere instead of finite garbage.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from maxtext_nvfp4.core import settings
from maxtext_nvfp4.core import fp8
from maxtext_nvfp4.core import nvfp4 as numerics

__all__ = ["GemmRecipe", "PRECISIONS", "dot_general", "gemm_alpha", "sr_keys"]

PRECISIONS = settings.PRECISIONS
_BLOCK = numerics.BLOCK
# fold_in constants for the two stochastically rounded copies of dy.
_DGRAD_KEY_TAG = 1
_WGRAD_KEY_TAG = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmRecipe:
  """Precision and NVFP4 options of the three GEMMs of one linear layer."""

  # Precision of y = x·W: "nvfp4" | "bf16" | "fp8".
  fprop: str = "nvfp4"
  # Precision of dx = dy·Wᵀ.
  dgrad: str = "nvfp4"
  # Precision of dW = xᵀ·dy.
  wgrad: str = "nvfp4"
  # RHT16 along tokens on both wgrad operands (nvfp4 wgrad only).
  rht: bool = True
  # Stochastic rounding of dy for the dgrad and wgrad operands (nvfp4 only); needs a key.
  stochastic_rounding: bool = True
  # 16x16 weight tiles shared by fprop and dgrad; False: 1x16 along each GEMM's contraction.
  two_d_weights: bool = True

  def __post_init__(self):
    for name in ("fprop", "dgrad", "wgrad"):
      v = getattr(self, name)
      if v not in PRECISIONS:
        raise ValueError(f"GemmRecipe.{name}={v!r}: choose one of {PRECISIONS}")

  def needs_key(self) -> bool:
    """True when a pass uses stochastic rounding (an nvfp4 dgrad or wgrad with SR on)."""
    return self.stochastic_rounding and "nvfp4" in (self.dgrad, self.wgrad)

  def _pass_signature(self, name: str):
    """Everything that pass ``name`` depends on (equal signatures -> identical computation)."""
    p = getattr(self, name)
    if p != "nvfp4":
      return (p,)
    if name == "fprop":
      return (p, self.two_d_weights)
    if name == "dgrad":
      return (p, self.two_d_weights, self.stochastic_rounding)
    return (p, self.rht, self.stochastic_rounding)


def sr_keys(key):
  """The (dgrad, wgrad) stochastic-rounding keys derived from ``key``: fold_in 1 and 2."""
  return jax.random.fold_in(key, _DGRAD_KEY_TAG), jax.random.fold_in(key, _WGRAD_KEY_TAG)


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------
def _round_up(n: int) -> int:
  return -(-n // _BLOCK) * _BLOCK


def _pad_to(a, shape):
  """Zero-pad ``a`` at the end of each axis up to ``shape`` (no-op when already there)."""
  if tuple(a.shape) == tuple(shape):
    return a
  return jnp.pad(a, [(0, t - s) for s, t in zip(a.shape, shape)])


def _scaled_dot(a, b, contract, alpha, out_dtype):
  """``cast((a · b with fp32 accumulation) * alpha)``; ``contract`` = (a axis, b axis)."""
  y = lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=jnp.float32)
  return (y * alpha).astype(out_dtype)


def _plain_dot(a, b, contract, out_dtype):
  """The unquantized GEMM ("bf16" precision): operands as given, fp32 accumulation."""
  dt = jnp.result_type(a.dtype, b.dtype)
  y = lax.dot_general(
      a.astype(dt), b.astype(dt), (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=jnp.float32
  )
  return y.astype(out_dtype)


# fl32(1 / 2688): the constant XLA's algebraic simplifier substitutes for ``/ 2688.`` (see gemm_alpha).
_RECIP_GLOBAL_DENOM = np.float32(1.0) / np.float32(numerics.E4M3_MAX * numerics.E2M1_MAX)


def gemm_alpha(amax_a, amax_b):
  """The fp32 factor of an NVFP4 GEMM: ``fl( fl(amax_a * c) * fl(amax_b * c) )``, ``c = fl32(1/2688)``.

  TE JAX writes ``alpha = (amax_a / 2688.) * (amax_b / 2688.)`` inside jitted code
  (``transformer_engine/jax/cpp_extensions/gemm.py`` at TE commit d0067d0: ``_get_nvfp4_tensor_scale_inv``
  returns ``amax / (DATA_DTYPE_MAX * SCALE_DTYPE_MAX)``, and ``gemm`` multiplies the two). XLA never executes
  that division: ``AlgebraicSimplifierVisitor::HandleDivide`` (openxla/xla,
  ``xla/hlo/transforms/simplifiers/algebraic_simplifier.cc``, rule ``A / Const => A * (1 / Const)``,
  applied to every floating-point constant, scalar or broadcast, without a precision condition)
  replaces it with a multiplication by ``fl32(1/2688) = 0.000372023816``, which is not correctly
  rounded division (78% agreement on lognormal amaxes). XLA:GPU runs the same visitor
  (``GpuAlgebraicSimplifier`` subclasses it and is added to the optimization pipeline several times in
  ``xla/service/gpu/gpu_compiler.cc``), as XLA:CPU does, so this product is what TE computes in training,
  bit for bit. No constant reassociation follows (the compiled HLO is ``(a * c) * (b * c)``).
  ``tests/test_gemm.py`` compares it with the compiled TE expression and fails if the rewrite changes.

  ``numerics.dequantize`` keeps the true division ``amax / 2688``: that is TE's dequantizer as the golden
  files define it (run eagerly), not the GEMM.
  """
  c = _RECIP_GLOBAL_DENOM
  return (jnp.asarray(amax_a, jnp.float32) * c) * (jnp.asarray(amax_b, jnp.float32) * c)


def _gemm_view(q):
  """(``q * s8`` values in bf16, amax) of an operand: an NVFP4Tensor (kept for reuse or as a residual)
  or the ``(values, amax)`` pair of ``numerics.quantize_values`` (a single-use operand)."""
  if isinstance(q, numerics.NVFP4Tensor):
    return numerics.block_values(q, jnp.bfloat16), q.amax
  return q


def _nvfp4_dot(qa, qb, contract, out_dtype):
  (va, amax_a), (vb, amax_b) = _gemm_view(qa), _gemm_view(qb)
  return _scaled_dot(va, vb, contract, gemm_alpha(amax_a, amax_b), out_dtype)


def _fp8_dot(qa, qb, contract, out_dtype):
  return _scaled_dot(qa.values(jnp.bfloat16), qb.values(jnp.bfloat16), contract, qa.scale_inv * qb.scale_inv, out_dtype)


def _quantize_weight(w, two_d: bool, contraction_axis: int):
  """W (K, N) quantized for fprop (contraction_axis 0) or dgrad (1), zero-padded as the blocks need.

  2D: 16x16 tiles over both (padded) axes, identical for both passes. 1D: 1x16 along the contraction.
  """
  k, n = w.shape
  if two_d:
    return numerics.quantize(_pad_to(w, (_round_up(k), _round_up(n))), block_2d=True)
  shape = (_round_up(k), n) if contraction_axis == 0 else (k, _round_up(n))
  return numerics.quantize(_pad_to(w, shape), axis=contraction_axis)


def _quantize_x_for_wgrad(x, rht: bool):
  """x (M, K) quantized 1x16 along tokens (rows), RHT-rotated when ``rht``; RNE. Tokens zero-padded."""
  return numerics.quantize(_pad_to(x, (_round_up(x.shape[0]), x.shape[1])), axis=0, rht=rht)


# ----------------------------------------------------------------------------------------------
# The three passes on 2D operands: x (M, K), w (K, N), dy (M, N). ``qw`` / ``qx`` are operands
# already quantized for this pass (shared with another pass or saved by the forward).
# ----------------------------------------------------------------------------------------------
def _fprop(r: GemmRecipe, x, w, out_dtype, qw=None):
  if r.fprop == "bf16":
    return _plain_dot(x, w, (1, 0), out_dtype)
  if r.fprop == "fp8":
    return _fp8_dot(fp8.quantize(x, "e4m3"), fp8.quantize(w, "e4m3"), (1, 0), out_dtype)
  if qw is None:
    qw = _quantize_weight(w, r.two_d_weights, 0)
  qx = numerics.quantize_values(_pad_to(x, (x.shape[0], qw.shape[0])), axis=1)
  return _nvfp4_dot(qx, qw, (1, 0), out_dtype)[:, : w.shape[1]]


def _dgrad(r: GemmRecipe, dy, w, key, k: int, out_dtype):
  """``w``: the (K, N) kernel, or (nvfp4 only) its NVFP4Tensor quantized for dgrad."""
  if r.dgrad == "bf16":
    return _plain_dot(dy, w, (1, 1), out_dtype)
  if r.dgrad == "fp8":
    return _fp8_dot(fp8.quantize(dy, "e5m2"), fp8.quantize(w, "e4m3"), (1, 1), out_dtype)
  qw = w if isinstance(w, numerics.NVFP4Tensor) else _quantize_weight(w, r.two_d_weights, 1)
  qdy = numerics.quantize_values(
      _pad_to(dy, (dy.shape[0], qw.shape[1])), axis=1, stochastic_key=key if r.stochastic_rounding else None
  )
  return _nvfp4_dot(qdy, qw, (1, 1), out_dtype)[:, :k]


def _wgrad(r: GemmRecipe, x, dy, key, out_dtype):
  """``x``: the (M, K) activations, or (nvfp4 only) their NVFP4Tensor quantized for wgrad."""
  if r.wgrad == "bf16":
    return _plain_dot(x, dy, (0, 0), out_dtype)
  if r.wgrad == "fp8":
    return _fp8_dot(fp8.quantize(x, "e4m3"), fp8.quantize(dy, "e5m2"), (0, 0), out_dtype)
  qx = x if isinstance(x, numerics.NVFP4Tensor) else _quantize_x_for_wgrad(x, r.rht)
  qdy = numerics.quantize_values(
      _pad_to(dy, (qx.shape[0], dy.shape[1])), axis=0, rht=r.rht, stochastic_key=key if r.stochastic_rounding else None
  )
  return _nvfp4_dot(qx, qdy, (0, 0), out_dtype)


def _select(use_switched, static: "_Static", name: str, fn: Callable):
  """``fn(recipe)``, or a ``lax.cond`` on ``use_switched`` between ``fn(switched)`` and it."""
  if static.uniform(name):
    return fn(static.recipe)
  return lax.cond(use_switched, lambda: fn(static.switched), lambda: fn(static.recipe))


# ----------------------------------------------------------------------------------------------
# The custom_vjp on 2D operands
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Static:
  """Trace-time facts of one 2D GEMM (hashable: a nondiff custom_vjp argument)."""

  recipe: GemmRecipe
  switched: GemmRecipe | None
  out_dtype: object
  x_dtype: object
  w_dtype: object
  k: int

  def uniform(self, name: str) -> bool:
    """Pass ``name`` computes the same thing whether or not the switch is on."""
    return self.switched is None or self.switched._pass_signature(name) == self.recipe._pass_signature(name)

  def _branches(self):
    return (self.recipe,) if self.switched is None else (self.recipe, self.switched)

  @property
  def save_quantized_w(self) -> bool:
    """Every branch's dgrad is nvfp4 with the same weight blocks: save that 4-bit W instead of W."""
    return len({(r.dgrad, r.two_d_weights) for r in self._branches()}) == 1 and self.recipe.dgrad == "nvfp4"

  @property
  def save_quantized_x(self) -> bool:
    """Every branch's wgrad is nvfp4 with the same RHT: save that 4-bit xᵀ instead of x."""
    return len({(r.wgrad, r.rht) for r in self._branches()}) == 1 and self.recipe.wgrad == "nvfp4"


def _forward(static: _Static, x, w, use_switched):
  """(y, the dgrad-quantized W or None)."""
  qw = _quantize_weight(w, static.recipe.two_d_weights, 1) if static.save_quantized_w else None

  def fprop(r):
    # 16x16 tiles are the same for fprop and dgrad: quantize W once.
    share = qw is not None and qw.block_2d and r.two_d_weights
    return _fprop(r, x, w, static.out_dtype, qw=qw if share else None)

  return _select(use_switched, static, "fprop", fprop), qw


def _gemm2d_impl(static: _Static, x, w, use_switched, key):
  del key  # only the backward is stochastic
  return _forward(static, x, w, use_switched)[0]


def _gemm2d_fwd(static, x, w, use_switched, key):
  y, qw = _forward(static, x, w, use_switched)
  # Residuals: at most what a bf16 GEMM saves (x and W), each replaced by its 4-bit form when every
  # branch of the backward consumes only that form.
  x_res = _quantize_x_for_wgrad(x, static.recipe.rht) if static.save_quantized_x else x
  w_res = qw if qw is not None else w
  return y, (x_res, w_res, use_switched, key)


def _gemm2d_bwd(static, res, dy):
  x, w, use_switched, key = res
  kd, kw = sr_keys(key) if key is not None else (None, None)
  dx = _select(use_switched, static, "dgrad", lambda r: _dgrad(r, dy, w, kd, static.k, static.x_dtype))
  dw = _select(use_switched, static, "wgrad", lambda r: _wgrad(r, x, dy, kw, static.w_dtype))
  return dx, dw, None, None


_gemm2d = jax.custom_vjp(_gemm2d_impl, nondiff_argnums=(0,))
_gemm2d.defvjp(_gemm2d_fwd, _gemm2d_bwd)


# ----------------------------------------------------------------------------------------------
# Public entry point
# ----------------------------------------------------------------------------------------------
def _normalize_dims(dims, ndim, what):
  out = tuple(int(d) % ndim for d in dims)
  if len(set(out)) != len(out):
    raise ValueError(f"repeated {what} dimension in {dims}")
  return out


def dot_general(
    lhs,
    rhs,
    dimension_numbers,
    *,
    recipe: GemmRecipe,
    switched: GemmRecipe | None = None,
    use_switched=None,
    key=None,
    preferred_element_type=None,
) -> jax.Array:
  """``lax.dot_general(lhs, rhs, dimension_numbers)`` computed with the emulated GEMM recipe.

  Args:
    lhs: activations (bf16 or fp32).
    rhs: the kernel (MaxText DenseGeneral's convention).
    dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch))``.
    recipe: per-pass precision and NVFP4 options.
    switched: the recipe used when ``use_switched`` is true (late precision switch).
    use_switched: traced boolean scalar; required iff ``switched`` is given.
    key: PRNG key for stochastic rounding; required when a recipe uses SR.
    preferred_element_type: output dtype of the forward (default: result type of lhs and rhs).

  Returns:
    The product with lax.dot_general's output layout (batch, lhs free, rhs free).
  """
  if not isinstance(recipe, GemmRecipe):
    raise TypeError(f"recipe must be a GemmRecipe, got {type(recipe).__name__}")
  if (switched is None) != (use_switched is None):
    raise ValueError("dot_general: pass both `switched` and `use_switched` (the late-switch flag), or neither")
  if key is None and (recipe.needs_key() or (switched is not None and switched.needs_key())):
    raise ValueError(
        "dot_general: stochastic rounding is on (nvfp4 dgrad/wgrad with stochastic_rounding=True) but key is None;"
        " pass a PRNG key (fresh per step and layer) or set stochastic_rounding=False"
    )
  lhs = jnp.asarray(lhs)
  rhs = jnp.asarray(rhs)
  (lc, rc), (lb, rb) = dimension_numbers
  lc = _normalize_dims(lc, lhs.ndim, "lhs contracting")
  rc = _normalize_dims(rc, rhs.ndim, "rhs contracting")
  lb = _normalize_dims(lb, lhs.ndim, "lhs batch")
  rb = _normalize_dims(rb, rhs.ndim, "rhs batch")
  if len(lc) != len(rc) or len(lb) != len(rb):
    raise ValueError(f"dimension_numbers {dimension_numbers}: lhs and rhs need as many contracting/batch dims")
  for a, b in zip(lc + lb, rc + rb):
    if lhs.shape[a] != rhs.shape[b]:
      raise ValueError(
          f"dimension_numbers {dimension_numbers}: lhs dim {a} (size {lhs.shape[a]}) does not match rhs dim {b}"
          f" (size {rhs.shape[b]}); shapes {lhs.shape} and {rhs.shape}"
      )
  lf = tuple(d for d in range(lhs.ndim) if d not in lc and d not in lb)
  rf = tuple(d for d in range(rhs.ndim) if d not in rc and d not in rb)
  batch_shape = tuple(lhs.shape[d] for d in lb)
  lf_shape = tuple(lhs.shape[d] for d in lf)
  rf_shape = tuple(rhs.shape[d] for d in rf)
  b, m, n = math.prod(batch_shape), math.prod(lf_shape), math.prod(rf_shape)
  k = math.prod(lhs.shape[d] for d in lc)

  out_dtype = jnp.dtype(preferred_element_type) if preferred_element_type is not None else jnp.result_type(lhs, rhs)
  static = _Static(
      recipe=recipe, switched=switched, out_dtype=out_dtype, x_dtype=lhs.dtype, w_dtype=rhs.dtype, k=k
  )
  if use_switched is not None:
    use_switched = jnp.asarray(use_switched, jnp.bool_)

  x = jnp.transpose(lhs, lb + lf + lc).reshape((b, m, k))
  w = jnp.transpose(rhs, rb + rc + rf).reshape((b, k, n))
  if not lb:
    y = _gemm2d(static, x[0], w[0], use_switched, key)
  else:
    keys = None if key is None else jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(b))
    y = jax.vmap(lambda xi, wi, ki: _gemm2d(static, xi, wi, use_switched, ki))(x, w, keys)
  return y.reshape(batch_shape + lf_shape + rf_shape)
