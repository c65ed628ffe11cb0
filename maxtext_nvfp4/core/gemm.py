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

Recipe options (:class:`~maxtext_nvfp4.core.recipe_options.RecipeOptions`, inherited by :class:`GemmRecipe`)
change the operands' quantizers (``GemmRecipe.scale_rule``: 4over6 on W and/or x, E4M3 bound 256, one amax
per row of x) and the backward (``backward_override``):

  high_precision   dgrad dx = dy · Wᵀ, wgrad dW = xᵀ · dy as "bf16" passes on the original operands
  dequantized      dx = dy · deq(W_f)ᵀ,  dW = deq(x_f)ᵀ · dy  ("dequantized" passes): W_f, x_f the operands
                   as the fprop quantized them (RNE, so re-quantized from the saved x and W in the backward:
                   the same bits), deq = TE's CUDA dequantize (``numerics.dequantize_kernel_order``) to the
                   activation dtype, dy unquantized, fp32 accumulation (TE PyTorch ``Linear``)

A tensor with E4M3 bound B contributes ``fl(amax * fl32(1 / 6B))`` to alpha (the standard B = 448 gives
the 1/2688 above); a row-scaled x contributes one such factor per row of the output (fprop: per token;
wgrad: per input feature, its wgrad copy's amax being per column of x). With 4over6 2D weights, fprop and
dgrad use two quantizations of W (TE's rowwise and columnwise copies, whose 4over6 errors are summed along
K and along N respectively), not one shared tensor.

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

Amax scope: with ``amax_groups`` (:class:`AmaxGroups`, ``nvfp4_amax_scope: te``) each operand is cut into
the blocks TE's ``dense`` gives their own amax on the run's mesh (x and dy: one per device; W: one per
tensor-parallel shard), each block is quantized alone, and each partial product over a sharded contraction
is scaled by its own alpha and the partials are summed in the output dtype. Blocks are contiguous and
aligned with the shards, so this needs no communication beyond that sum. Without it: one amax per tensor.

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
from maxtext_nvfp4.core import gemm_kernels
from maxtext_nvfp4.core import nvfp4 as numerics
from maxtext_nvfp4.core import prng
from maxtext_nvfp4.core import recipe_options
from maxtext_nvfp4.core import weight_gather as weight_gather_lib

__all__ = ["AmaxGroups", "GemmRecipe", "PRECISIONS", "dot_general", "gemm_alpha", "sr_keys"]

PRECISIONS = settings.PRECISIONS
_BLOCK = numerics.BLOCK
# fold_in constants for the two stochastically rounded copies of dy.
_DGRAD_KEY_TAG = 1
_WGRAD_KEY_TAG = 2


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmRecipe(recipe_options.RecipeOptions):
  """Precision and NVFP4 options of the three GEMMs of one linear layer (the options: inherited fields)."""

  # Precision of y = x·W: "nvfp4" | "bf16" | "fp8".
  fprop: str = "nvfp4"
  # Precision of dx = dy·Wᵀ as planned (``backward_override`` may turn nvfp4 into bf16 / dequantized).
  dgrad: str = "nvfp4"
  # Precision of dW = xᵀ·dy as planned (likewise).
  wgrad: str = "nvfp4"

  def __post_init__(self):
    for name in ("fprop", "dgrad", "wgrad"):
      v = getattr(self, name)
      if v not in PRECISIONS:
        raise ValueError(f"GemmRecipe.{name}={v!r}: choose one of {PRECISIONS}")
    for f in recipe_options.option_fields():
      v, choices = getattr(self, f.name), f.metadata["choices"]
      if choices and v not in choices:
        raise ValueError(f"GemmRecipe.{f.name}={v!r}: choose one of {choices}")
    refused = recipe_options.refusal(self)
    if refused:
      raise ValueError(refused)

  def precision(self, name: str) -> str:
    """What pass ``name`` computes: its planned precision, the backward passes after ``backward_override``
    ("nvfp4" | "bf16" | "fp8" | "dequantized")."""
    p = getattr(self, name)
    return p if name == "fprop" else self.backward_precision(p)

  def scale_rule(self, tensor: str) -> numerics.ScaleRule:
    """The quantizer rule of ``tensor`` ("weight" | "activation" | "gradient") under these options."""
    return numerics.ScaleRule(selection="4over6" if self.uses_4over6(tensor) else "max",
                              err_mode=self.four_over_six_err_mode, e4m3_bound=self.e4m3_bound(tensor),
                              row_scaled=self.row_scaled(tensor))

  def needs_key(self) -> bool:
    """True when a pass uses stochastic rounding (an nvfp4 dgrad or wgrad with SR on)."""
    return self.stochastic_rounding and "nvfp4" in (self.precision("dgrad"), self.precision("wgrad"))

  def _pass_signature(self, name: str):
    """Everything pass ``name`` depends on (equal signatures -> identical computation), derived from the
    fields: its precision, and for a quantized pass every recipe option (plus, for a pass on the dequantized
    forward operands, the fprop precision that quantized them). A new option is part of it by construction,
    so the late switch's ``lax.cond`` cannot ignore it."""
    p = self.precision(name)
    if p in ("bf16", "fp8"):
      return (p,)
    opts = tuple(getattr(self, f.name) for f in recipe_options.option_fields())
    return (p,) + opts + ((self.fprop,) if p == "dequantized" else ())


@dataclasses.dataclass(frozen=True, kw_only=True)
class AmaxGroups:
  """How many independent amaxes each operand of the 2D GEMM has along each axis (TE's amax scope on a mesh).

  An operand with ``(gr, gc)`` groups is cut into ``gr x gc`` equal contiguous blocks (rows x columns of
  its 2D view) and each block is quantized alone, with its own amax -- what TE's ``dense`` does on a device
  that holds that block (``AmaxScope.TPSP`` for x and dy: the device-local amax; ``AmaxScope.FSDP`` for W:
  the amax over the FSDP shards of one tensor-parallel shard). All 1: one amax per tensor (global scope).
  Each block's sizes must be multiples of 16 (TE does not pad a shard).

  The GEMM then scales each partial product by its own alpha: for output block (i, j) and contraction
  group g, ``p_g = cast(acc_g * gemm_alpha(amax_a[i, g], amax_b[g, j]))``, and sums the partials in the
  output dtype in group order ``((p_0 + p_1) + p_2) + ...`` (TE: each device's GEMM output, then the psum
  of the sharded contraction in that dtype; with 2 groups the sum is order-free, with more the
  all-reduce order is XLA's).
  """

  # x (M, K) and dy (M, N) along tokens: contiguous row blocks (batch shards)
  tokens: int = 1
  # x along its contraction K (blocks of the flattened contracting dims)
  x_k: int = 1
  # dy along N (blocks of the flattened output features)
  dy_n: int = 1
  # W (K, N) along K and along N
  w_k: int = 1
  w_n: int = 1
  # the mesh axes the token groups live on (x's batch dim), when known: the token-grouped operands and the
  # wgrad's per-group partial products are then kept where their tokens are (sharding constraints), so that
  # each device quantizes and multiplies its own group and only the partials move -- as TE's wgrad psum --
  # instead of XLA gathering every group's operands to every device (:func:`_local_groups`)
  token_axes: tuple[str, ...] = ()

  def __post_init__(self):
    for name in _GROUP_COUNTS:
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"AmaxGroups.{name}={v!r}: need an integer >= 1")
    if not isinstance(self.token_axes, tuple) or not all(isinstance(a, str) for a in self.token_axes):
      raise ValueError(f"AmaxGroups.token_axes={self.token_axes!r}: need a tuple of mesh axis names")

  @property
  def trivial(self) -> bool:
    """One amax per tensor: the global scope."""
    return all(getattr(self, name) == 1 for name in _GROUP_COUNTS)


# AmaxGroups' group counts (its other field names where they live)
_GROUP_COUNTS = ("tokens", "x_k", "dy_n", "w_k", "w_n")


def sr_keys(key):
  """The (dgrad, wgrad) stochastic-rounding keys derived from ``key``: fold_in 1 and 2 (``prng.fold_in``: for a
  Threefry key, applied where the bits are drawn)."""
  return prng.fold_in(key, _DGRAD_KEY_TAG), prng.fold_in(key, _WGRAD_KEY_TAG)


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


def _split_groups(a, gr: int, gc: int):
  """(R, C) -> (gr, gc, R/gr, C/gc): the contiguous blocks of ``a``."""
  r, c = a.shape
  if r % gr or c % gc or (r // gr) % _BLOCK or (c // gc) % _BLOCK:
    raise ValueError(
        f"amax scope: an operand of shape {tuple(a.shape)} split into {gr} x {gc} shards needs each shard's sizes"
        f" to be multiples of {_BLOCK} (TE quantizes a shard without padding)"
    )
  return a.reshape(gr, r // gr, gc, c // gc).transpose(0, 2, 1, 3)


def _merge_groups(a):
  """Inverse of :func:`_split_groups`: (gr, gc, r, c) -> (gr * r, gc * c)."""
  gr, gc, r, c = a.shape
  return a.transpose(0, 2, 1, 3).reshape(gr * r, gc * c)


def _local_groups(a, axes: tuple[str, ...], dim: int = 0):
  """``a`` constrained to be sharded along ``dim`` over the mesh ``axes`` (the other dims unconstrained), when the
  current mesh has them and ``a.shape[dim]`` divides evenly; else ``a`` unchanged.

  Placement only, the values are the same: the token groups of an ``AmaxGroups`` are the devices' own token
  blocks, and saying so keeps the partitioner from gathering every group to every device (XLA:GPU's did, for
  MaxText's step under FSDP: benchmarks/RESULTS.md).
  """
  if not axes:
    return a
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or any(ax not in mesh.shape for ax in axes):
    return a
  size = math.prod(mesh.shape[ax] for ax in axes)
  if size <= 1 or a.shape[dim] % size:
    return a
  spec = [jax.sharding.PartitionSpec.UNCONSTRAINED] * a.ndim  # the other dims keep what the partitioner gives
  spec[dim] = axes if len(axes) > 1 else axes[0]
  return jax.lax.with_sharding_constraint(a, jax.sharding.PartitionSpec(*spec))


def _quantize_grouped(fn, a, groups: tuple[int, int], key=None, row_axes: tuple[str, ...] = ()):
  """``fn(block, key)`` on each of the ``groups`` blocks of the 2D ``a`` (vmapped; per-block amax).

  ``groups == (1, 1)``: ``fn(a, key)`` itself. Otherwise every output leaf gets leading (gr, gc) dims and
  block (i, j) draws its stochastic-rounding bits from ``fold_in(key, i * gc + j)`` (as TE's devices
  draw from their own rng states). ``row_axes``: the mesh axes the row groups live on (the tokens'), which
  then quantize where they are.
  """
  gr, gc = groups
  if (gr, gc) == (1, 1):
    return fn(a, key)
  parts = _local_groups(_split_groups(a, gr, gc), row_axes)
  if key is None:
    return jax.vmap(jax.vmap(lambda blk: fn(blk, None)))(parts)
  keys = jax.vmap(lambda i: prng.fold_in(key, i))(jnp.arange(gr * gc))
  keys = jax.tree_util.tree_map(lambda k: k.reshape((gr, gc) + k.shape[1:]), keys)
  return jax.vmap(jax.vmap(fn))(parts, keys)


def _batched_dot_f32(a3, b3):
  """(g, m, k) x (g, k, n) -> (g, m, n) with fp32 accumulation of the exact bf16 block-value products.

  XLA:CPU has no batched bf16 x bf16 -> f32 dot: there the operands are widened first (exact: the values
  are bf16, their products exact in fp32, so the result is the same).
  """
  dims = (((2,), (1,)), ((0,), (0,)))
  native = lambda: lax.dot_general(a3, b3, dims, preferred_element_type=jnp.float32)  # noqa: E731
  widened = lambda: lax.dot_general(a3.astype(jnp.float32), b3.astype(jnp.float32), dims,  # noqa: E731
                                    precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  return lax.platform_dependent(cpu=widened, default=native)


def _grouped_dot(a3, amax_a, b3, amax_b, out_dtype, bound_a: int = numerics.E4M3_MAX,
                 bound_b: int = numerics.E4M3_MAX, group_axes: tuple[str, ...] = ()):
  """The GEMM of operands with amax grids, per contraction group (see AmaxGroups).

  ``a3`` (g, m, k/g) and ``b3`` (g, k/g, n): the operands cut into the ``g`` contraction groups along a
  leading axis (aligned with the shards, so each device multiplies its own blocks). ``amax_a`` (gm, gka)
  and ``amax_b`` (gkb, gn) are the amax grids over (rows, contraction) and (contraction, columns), ``g`` a
  multiple of gka and gkb. ``p_g = cast(acc_g * gemm_alpha(...))``, summed in ``out_dtype`` in group order.
  ``group_axes``: the mesh axes the contraction groups live on (the wgrad's token groups), where each partial
  is then computed before the partials move to the output slice's device.
  """
  g, m, n = a3.shape[0], a3.shape[1], b3.shape[2]
  rows = jnp.repeat(jnp.repeat(amax_a, m // amax_a.shape[0], 0), g // amax_a.shape[1], 1).T  # (g, m)
  cols = jnp.repeat(jnp.repeat(amax_b, g // amax_b.shape[0], 0), n // amax_b.shape[1], 1)  # (g, n)
  alpha = gemm_alpha(rows[:, :, None], cols[:, None, :], bound_a, bound_b)
  parts = _local_groups((_batched_dot_f32(a3, b3) * alpha).astype(out_dtype), group_axes)
  out = parts[0]
  for i in range(1, g):
    out = (out + parts[i]).astype(out_dtype)
  return out


def _contraction_groups(v, axis: int, g: int, lhs: bool):
  """2D ``v`` contracted along ``axis`` -> (g, m, k/g) (``lhs``) or (g, k/g, n): a reshape and transpose
  that keep each contraction group's shard where it is."""
  if axis == 1:
    r, k = v.shape
    v3 = v.reshape(r, g, k // g).transpose(1, 0, 2)  # (g, r, k/g)
    return v3 if lhs else v3.transpose(0, 2, 1)
  k, c = v.shape
  v3 = v.reshape(g, k // g, c)  # (g, k/g, c)
  return v3.transpose(0, 2, 1) if lhs else v3


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


def _recip_denominator(bound: int) -> np.float32:
  """fl32(1 / (6 * bound)): the constant XLA's algebraic simplifier substitutes for ``/ (6 * bound).``
  (``fl32(1 / 2688)`` for TE's standard bound; see gemm_alpha)."""
  return numerics.RECIP_GLOBAL_DENOMINATOR[int(bound)]


def gemm_alpha(amax_a, amax_b, bound_a: int = numerics.E4M3_MAX, bound_b: int = numerics.E4M3_MAX):
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
  bit for bit. With jax/jaxlib 0.12.0.1 (pinned here) no constant reassociation follows (the compiled HLO
  is ``(a * c) * (b * c)``); jax 0.11.2's XLA folds a scalar ``(a*c)*(b*c)`` into ``(a*b)*c^2`` -- TE's and
  ours alike, since both are the same expression (checked on 3000 pairs), but two tests in
  ``tests/test_gemm.py`` that pin the 0.12 HLO fail there (benchmarks/RESULTS.md, GPU preparation).
  ``tests/test_gemm.py`` compares it with the compiled TE expression and fails if the rewrite changes.

  ``numerics.dequantize`` keeps the true division ``amax / 2688``: that is TE's dequantizer as the golden
  files define it (run eagerly), not the GEMM.

  ``bound_a`` / ``bound_b``: each operand's E4M3 bound (TE PyTorch's 4over6 variant: 256), its factor then
  ``fl(amax * fl32(1 / 6B))`` -- the same expression with that tensor's denominator (TE JAX has no such
  tensor; TE PyTorch's reference divides ``amax_a * amax_b`` by ``36 * B_a * B_b`` once, its kernels apply
  the per-row scales to the fp32 output: neither is bit-checkable, the accumulation order being unspecified).
  Row-scaled amaxes broadcast (one alpha per output row).
  """
  ca, cb = _recip_denominator(bound_a), _recip_denominator(bound_b)
  return (jnp.asarray(amax_a, jnp.float32) * ca) * (jnp.asarray(amax_b, jnp.float32) * cb)


def _gemm_view(q):
  """(``q * s8`` values in bf16, amax, E4M3 bound, grouped) of an operand: an NVFP4Tensor (kept for reuse or
  as a residual) or the ``(values, amax, bound)`` of :func:`_operand` (a single-use operand). A grouped
  operand (leading (gr, gc) dims, :func:`_quantize_grouped`) gives its merged 2D values and its (gr, gc) amax
  grid; otherwise the amax is a scalar, or (row-scaled) one per row of the quantized copy."""
  if isinstance(q, numerics.NVFP4Tensor):
    if q.data.ndim == 4:
      return _merge_groups(jax.vmap(jax.vmap(numerics.block_values))(q)), q.amax, q.e4m3_bound, True
    return numerics.block_values(q, jnp.bfloat16), q.amax, q.e4m3_bound, False
  values, amax, bound = q
  return (_merge_groups(values), amax, bound, True) if values.ndim == 4 else (values, amax, bound, False)


def _nvfp4_dot(qa, qb, contract, out_dtype, group_axes: tuple[str, ...] = ()):
  (va, amax_a, ba, ga), (vb, amax_b, bb, gb) = _gemm_view(qa), _gemm_view(qb)
  if not (ga or gb):
    # Per-tensor amaxes, or a row-scaled one: oriented as output rows (a) / output columns (b).
    ra = amax_a.T if jnp.ndim(amax_a) == 2 and contract[0] == 0 else amax_a  # wgrad: xᵀ, per column of x
    rb = amax_b.T if jnp.ndim(amax_b) == 2 and contract[1] == 1 else amax_b
    alpha = gemm_alpha(ra, rb, ba, bb)
    # XLA's dot of the block values, or (MAXTEXT_NVFP4_GEMM_IMPL) a GEMM that reads an NVFP4Tensor's codes and
    # scales: the same products, summed in its own fp32 order
    return gemm_kernels.scaled_dot(qa, qb, contract, alpha, out_dtype,
                                   reference=lambda: _scaled_dot(va, vb, contract, alpha, out_dtype))
  grid = lambda amax: jnp.reshape(amax, (1, 1)) if amax.ndim == 0 else amax  # noqa: E731
  # Grids as (rows, contraction) for a and (contraction, columns) for b.
  amax_a = grid(amax_a).T if contract[0] == 0 else grid(amax_a)  # wgrad: xᵀ · dy
  amax_b = grid(amax_b).T if contract[1] == 1 else grid(amax_b)  # dgrad: dy · Wᵀ
  g = max(amax_a.shape[1], amax_b.shape[0])
  a3 = _local_groups(_contraction_groups(va, contract[0], g, lhs=True), group_axes)
  b3 = _local_groups(_contraction_groups(vb, contract[1], g, lhs=False), group_axes)
  return _grouped_dot(a3, amax_a, b3, amax_b, out_dtype, ba, bb, group_axes)


def _fp8_dot(qa, qb, contract, out_dtype):
  return _scaled_dot(qa.values(jnp.bfloat16), qb.values(jnp.bfloat16), contract, qa.scale_inv * qb.scale_inv, out_dtype)


def _quantize_weight(w, two_d: bool, contraction_axis: int, groups: AmaxGroups | None = None,
                     rule: numerics.ScaleRule = numerics.STANDARD_RULE):
  """W (K, N) quantized for fprop (contraction_axis 0) or dgrad (1), zero-padded as the blocks need.

  2D: 16x16 tiles over both (padded) axes, identical for both passes under TE's standard rule (with 4over6
  the tile's error is summed along the contraction: TE's rowwise copy for fprop, columnwise for dgrad).
  1D: 1x16 along the contraction. ``groups``: one amax per (w_k x w_n) block (no padding then).
  """
  k, n = w.shape
  if groups is not None and not groups.trivial:
    fn = (lambda b, _: numerics.quantize(b, block_2d=True, axis=contraction_axis, scale_rule=rule)) if two_d else (
        lambda b, _: numerics.quantize(b, axis=contraction_axis, scale_rule=rule))
    return _quantize_grouped(fn, w, (groups.w_k, groups.w_n))
  if two_d:
    return numerics.quantize(_pad_to(w, (_round_up(k), _round_up(n))), block_2d=True, axis=contraction_axis,
                             scale_rule=rule)
  shape = (_round_up(k), n) if contraction_axis == 0 else (k, _round_up(n))
  return numerics.quantize(_pad_to(w, shape), axis=contraction_axis, scale_rule=rule)


def _quantize_x_for_wgrad(x, rht: bool, groups: AmaxGroups | None = None,
                          rule: numerics.ScaleRule = numerics.STANDARD_RULE):
  """x (M, K) quantized 1x16 along tokens (rows), RHT-rotated when ``rht``; RNE. Tokens zero-padded
  (``groups``: one amax per (tokens x x_k) block, no padding)."""
  if groups is not None and not groups.trivial:
    return _quantize_grouped(lambda b, _: numerics.quantize(b, axis=0, rht=rht, scale_rule=rule), x,
                             (groups.tokens, groups.x_k), row_axes=groups.token_axes)
  return numerics.quantize(_pad_to(x, (_round_up(x.shape[0]), x.shape[1])), axis=0, rht=rht, scale_rule=rule)


def _gathered(t, gather: weight_gather_lib.WeightGather | None):
  """A quantized W (still laid out as W) all-gathered as codes + tile scales when ``gather`` says so (the same
  bits; :mod:`weight_gather`), else ``t`` (the partitioner gathers what the GEMM reads)."""
  return t if gather is None or t is None else weight_gather_lib.gather(t, gather)


def _operand(a, rule: numerics.ScaleRule, groups: tuple[int, int] | None = None, key=None,
             row_axes: tuple[str, ...] = (), **kw):
  """``(values, amax, bound)`` of ``numerics.quantize_values(a, **kw)`` under ``rule``, per amax block when
  ``groups`` is not (1, 1) (see AmaxGroups; ``row_axes``: where its row groups live; ``kw['amaxes']`` with one
  block only)."""
  if groups is None or groups == (1, 1):
    v, amax = numerics.quantize_values(a, stochastic_key=key, scale_rule=rule, **kw)
  else:
    v, amax = _quantize_grouped(lambda b, k: numerics.quantize_values(b, stochastic_key=k, scale_rule=rule, **kw),
                                a, groups, key, row_axes)
  return v, amax, rule.e4m3_bound


def _single_use(a, rule: numerics.ScaleRule, axis: int, other, other_axis: int, a_first: bool, out_dtype, key=None,
                rht: bool = False, amaxes: numerics.Amaxes | None = None):
  """A 2D operand used by one GEMM only, quantized 1x16 along its contraction ``axis``: ``_operand``'s bf16 block
  values, or -- where the GEMM reads codes (``gemm_kernels.reads_codes``: never with the default "xla") -- its
  NVFP4Tensor (codes + scales), ``block_values`` of which are those values, bit for bit. ``amaxes``: its amaxes
  from a pass shared with another quantization of it (:func:`_dy_amaxes`), or None."""
  if gemm_kernels.reads_codes(a, axis, other, other_axis, a_first, out_dtype, rht=rht, stochastic=key is not None,
                              rule=rule):
    return numerics.quantize(a, axis=axis, rht=rht, stochastic_key=key, scale_rule=rule, amaxes=amaxes)
  return _operand(a, rule, key=key, axis=axis, rht=rht, amaxes=amaxes)


def _dequantized(t, dtype):
  """TE's CUDA dequantize of an NVFP4Tensor (a grouped one: per block, merged), as 2D ``dtype``."""
  if t.data.ndim == 4:
    return _merge_groups(jax.vmap(jax.vmap(lambda b: numerics.dequantize_kernel_order(b, dtype)))(t))
  return numerics.dequantize_kernel_order(t, dtype)


def _fprop_operand_dequantized(r: GemmRecipe, a, which: str, dtype, groups: AmaxGroups | None, gather=None):
  """x (M, K) or W (K, N) as the fprop consumed it, in ``dtype`` (``backward_override="dequantized"``):
  NVFP4 -> TE's CUDA dequantize of the fprop quantization (RNE: re-quantizing gives the fprop's bits);
  fp8 -> its dequantized values; bf16 -> the operand itself."""
  if r.fprop == "bf16":
    return a.astype(dtype)
  if r.fprop == "fp8":
    q = fp8.quantize(a, "e4m3")
    return (q.values(jnp.float32) * q.scale_inv).astype(dtype)
  m, n = a.shape
  if which == "weight":
    t = _gathered(_quantize_weight(a, r.two_d_weights, 0, groups, r.scale_rule("weight")), gather)
  elif groups is not None and not groups.trivial:
    rule = r.scale_rule("activation")
    t = _quantize_grouped(lambda b, _: numerics.quantize(b, axis=1, scale_rule=rule), a, (groups.tokens, groups.x_k),
                          row_axes=groups.token_axes)
  else:
    t = numerics.quantize(_pad_to(a, (m, _round_up(n))), axis=1, scale_rule=r.scale_rule("activation"))
  return _dequantized(t, dtype)[:m, :n]


# ----------------------------------------------------------------------------------------------
# The three passes on 2D operands: x (M, K), w (K, N), dy (M, N). ``qw`` / ``qx`` are operands
# already quantized for this pass (shared with another pass or saved by the forward).
# ----------------------------------------------------------------------------------------------
def _fprop(r: GemmRecipe, x, w, out_dtype, qw=None, groups: AmaxGroups | None = None, gather=None):
  if r.fprop == "bf16":
    return _plain_dot(x, w, (1, 0), out_dtype)
  if r.fprop == "fp8":
    return _fp8_dot(fp8.quantize(x, "e4m3"), fp8.quantize(w, "e4m3"), (1, 0), out_dtype)
  if qw is None:
    qw = _gathered(_quantize_weight(w, r.two_d_weights, 0, groups, r.scale_rule("weight")), gather)
  x_rule = r.scale_rule("activation")
  if groups is not None and not groups.trivial:
    return _nvfp4_dot(_operand(x, x_rule, (groups.tokens, groups.x_k), row_axes=groups.token_axes, axis=1), qw,
                      (1, 0), out_dtype)
  qx = _single_use(_pad_to(x, (x.shape[0], qw.shape[0])), x_rule, 1, qw, 0, True, out_dtype)
  return _nvfp4_dot(qx, qw, (1, 0), out_dtype)[:, : w.shape[1]]


def _dgrad(r: GemmRecipe, dy, w, key, k: int, out_dtype, groups: AmaxGroups | None = None, gather=None,
           dy_amaxes: numerics.Amaxes | None = None):
  """``w``: the (K, N) kernel, or (nvfp4 only) its NVFP4Tensor quantized for dgrad (not yet gathered);
  ``dy_amaxes``: :func:`_dy_amaxes`."""
  p = r.precision("dgrad")
  if p == "bf16":
    return _plain_dot(dy, w, (1, 1), out_dtype)
  if p == "dequantized":  # dy unquantized x W as the fprop quantized it, in the activation dtype
    return _plain_dot(dy, _fprop_operand_dequantized(r, w, "weight", out_dtype, groups, gather), (1, 1), out_dtype)
  if p == "fp8":
    return _fp8_dot(fp8.quantize(dy, "e5m2"), fp8.quantize(w, "e4m3"), (1, 1), out_dtype)
  qw = _gathered(w if isinstance(w, numerics.NVFP4Tensor) else _quantize_weight(w, r.two_d_weights, 1, groups,
                                                                                 r.scale_rule("weight")), gather)
  sr = key if r.stochastic_rounding else None
  dy_rule = r.scale_rule("gradient")
  if groups is not None and not groups.trivial:
    return _nvfp4_dot(_operand(dy, dy_rule, (groups.tokens, groups.dy_n), sr, row_axes=groups.token_axes, axis=1),
                      qw, (1, 1), out_dtype)
  qdy = _single_use(_pad_to(dy, (dy.shape[0], qw.shape[1])), dy_rule, 1, qw, 1, True, out_dtype, key=sr,
                    amaxes=dy_amaxes)
  return _nvfp4_dot(qdy, qw, (1, 1), out_dtype)[:, :k]


def _wgrad(r: GemmRecipe, x, dy, key, out_dtype, groups: AmaxGroups | None = None,
           dy_amaxes: numerics.Amaxes | None = None):
  """``x``: the (M, K) activations, or (nvfp4 only) their NVFP4Tensor quantized for wgrad; ``dy_amaxes``:
  :func:`_dy_amaxes`."""
  p = r.precision("wgrad")
  if p == "bf16":
    return _plain_dot(x, dy, (0, 0), out_dtype)
  if p == "dequantized":  # x as the fprop quantized it (activation dtype) x dy unquantized
    return _plain_dot(_fprop_operand_dequantized(r, x, "activation", x.dtype, groups), dy, (0, 0), out_dtype)
  if p == "fp8":
    return _fp8_dot(fp8.quantize(x, "e4m3"), fp8.quantize(dy, "e5m2"), (0, 0), out_dtype)
  qx = x if isinstance(x, numerics.NVFP4Tensor) else _quantize_x_for_wgrad(x, r.rht, groups,
                                                                           r.scale_rule("activation"))
  sr = key if r.stochastic_rounding else None
  dy_rule = r.scale_rule("gradient")
  if groups is not None and not groups.trivial:
    qdy = _operand(dy, dy_rule, (groups.tokens, groups.dy_n), sr, row_axes=groups.token_axes, axis=0, rht=r.rht)
    return _nvfp4_dot(qx, qdy, (0, 0), out_dtype, groups.token_axes)
  qdy = _single_use(_pad_to(dy, (qx.shape[0], dy.shape[1])), dy_rule, 0, qx, 0, False, out_dtype, key=sr, rht=r.rht,
                    amaxes=dy_amaxes)
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
  # per-operand amax blocks (TE's scope on the mesh), or None: one amax per tensor
  groups: AmaxGroups | None = None
  # W's FSDP layout when its NVFP4 copies are all-gathered as codes + tile scales (None: XLA gathers what the
  # GEMM reads, the block values in the activation dtype)
  gather: weight_gather_lib.WeightGather | None = None

  def uniform(self, name: str) -> bool:
    """Pass ``name`` computes the same thing whether or not the switch is on."""
    return self.switched is None or self.switched._pass_signature(name) == self.recipe._pass_signature(name)

  def _branches(self):
    return (self.recipe,) if self.switched is None else (self.recipe, self.switched)

  def _same(self, name: str) -> bool:
    """Pass ``name`` is nvfp4 and computes the same thing in every branch (derived signatures)."""
    return self.recipe.precision(name) == "nvfp4" and len({r._pass_signature(name) for r in self._branches()}) == 1

  @property
  def save_quantized_w(self) -> bool:
    """Every branch's dgrad is the same nvfp4 pass: save that 4-bit W instead of W."""
    return self._same("dgrad")

  @property
  def save_quantized_x(self) -> bool:
    """Every branch's wgrad is the same nvfp4 pass: save that 4-bit xᵀ instead of x."""
    return self._same("wgrad")


def _forward(static: _Static, x, w, use_switched):
  """(y, the dgrad-quantized W or None)."""
  r0 = static.recipe
  qw = _quantize_weight(w, r0.two_d_weights, 1, static.groups, r0.scale_rule("weight")) if static.save_quantized_w else None

  def fprop(r):
    # 16x16 tiles are the same for fprop and dgrad under TE's standard rule: quantize W once. (4over6 sums a
    # tile's error along the contraction, K for fprop and N for dgrad: two copies, as TE's.)
    share = qw is not None and qw.block_2d and r.two_d_weights and r.scale_rule("weight").selection == "max"
    return _fprop(r, x, w, static.out_dtype, qw=_gathered(qw, static.gather) if share else None,
                  groups=static.groups, gather=static.gather)

  return _select(use_switched, static, "fprop", fprop), qw


def _gemm2d_impl(static: _Static, x, w, use_switched, key):
  del key  # only the backward is stochastic
  return _forward(static, x, w, use_switched)[0]


def _gemm2d_fwd(static, x, w, use_switched, key):
  y, qw = _forward(static, x, w, use_switched)
  # Residuals: at most what a bf16 GEMM saves (x and W), each replaced by its 4-bit form when every
  # branch of the backward consumes only that form.
  r0 = static.recipe
  x_res = (_quantize_x_for_wgrad(x, r0.rht, static.groups, r0.scale_rule("activation")) if static.save_quantized_x
           else x)
  w_res = qw if qw is not None else w
  return y, (x_res, w_res, use_switched, key)


def _dy_amaxes(static: _Static, dy) -> numerics.Amaxes | None:
  """dy's amaxes for both of its quantizations -- 1x16 along N for dgrad, RHT along the tokens for wgrad -- from
  one read of dy (``numerics.amaxes``: a kernel on XLA:GPU, as TE's ``nvte_hadamard_transform_amax``), where every
  branch quantizes dy for both passes with TE's standard rule, one amax per tensor, RHT on, and the GEMM
  implementation is not the default "xla"; else None (each pass takes its own amax). The same amaxes either way:
  the same bits. Not under "xla": XLA:GPU schedules that program's peak a few MiB higher with the shared pass
  (benchmarks/RESULTS.md), and its memory stays today's until a GPU run weighs the trade."""
  if gemm_kernels.requested() == "xla" or not (static._same("dgrad") and static._same("wgrad")):
    return None
  r = static.recipe
  if not r.rht or (static.groups is not None and not static.groups.trivial) or \
      r.scale_rule("gradient") != numerics.STANDARD_RULE:
    return None
  return numerics.amaxes(_pad_to(dy, (_round_up(dy.shape[0]), dy.shape[1])))


def _gemm2d_bwd(static, res, dy):
  x, w, use_switched, key = res
  # dy's producer (outside this GEMM: e.g. the SiLU gradient making dh_gate and dh_up from gate, up and dh)
  # stays a fusion of its own instead of taking dy's amax reduction in: XLA:GPU lets a fusion's output reuse a
  # dying operand's buffer only along elementwise paths, through at most its one reduction hero
  # (xla/service/gpu/buffer_sharing.cc, FusionCanShareBufferHint), and a producer of two operands carries two
  # amax reductions. Costs one more read of dy for its amax; saves two full-size buffers at the SwiGLU MLP's
  # peak (benchmarks/RESULTS.md). Ordering only: the same bits.
  dy = lax.optimization_barrier(dy)
  kd, kw = sr_keys(key) if key is not None else (None, None)
  g = static.groups
  dy_amaxes = _dy_amaxes(static, dy)
  dx = _select(use_switched, static, "dgrad",
               lambda r: _dgrad(r, dy, w, kd, static.k, static.x_dtype, g, static.gather, dy_amaxes))
  # dgrad before the wgrad operands exist: each pass's full-size quantized operands are dead before the
  # next pass makes its own (XLA:GPU otherwise fused the element passes of both into one kernel, and with
  # it all of their outputs were live at once). Ordering only: the same bits.
  dx, dy, dy_amaxes = lax.optimization_barrier((dx, dy, dy_amaxes))
  dw = _select(use_switched, static, "wgrad", lambda r: _wgrad(r, x, dy, kw, static.w_dtype, g, dy_amaxes))
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
    amax_groups: AmaxGroups | None = None,
    weight_gather: weight_gather_lib.WeightGather | None = None,
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
    amax_groups: the operands' amax blocks on the run's mesh (TE's amax scope, :class:`AmaxGroups`); None
      or all 1: one amax per tensor (results independent of the mesh).
    weight_gather: the kernel's FSDP layout (:class:`~maxtext_nvfp4.core.weight_gather.WeightGather`, in terms
      of the 2D view (K, N); with batch dims, ``batch`` names their mesh axes): every NVFP4 copy of W is
      quantized where its shards live and all-gathered as E2M1 codes + E4M3 scales (the same bits). None:
      the partitioner gathers what the GEMM reads (the block values in the activation dtype).

  Returns:
    The product with lax.dot_general's output layout (batch, lhs free, rhs free).
  """
  if not isinstance(recipe, GemmRecipe):
    raise TypeError(f"recipe must be a GemmRecipe, got {type(recipe).__name__}")
  if (switched is None) != (use_switched is None):
    raise ValueError("dot_general: pass both `switched` and `use_switched` (the late-switch flag), or neither")
  if amax_groups is not None and not amax_groups.trivial and any(
      r is not None and r.row_scaled_activation for r in (recipe, switched)):
    raise ValueError(
        "dot_general: nvfp4_row_scaled_activation=true with a per-shard amax scope (nvfp4_amax_scope=te on a sharded"
        " mesh) is not implemented; set nvfp4_amax_scope=global (row amaxes over the whole row)")
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

  groups = None if amax_groups is None or amax_groups.trivial else amax_groups
  if weight_gather is not None:
    refused = weight_gather_lib.refusal(weight_gather, k, n, (groups.w_k, groups.w_n) if groups else (1, 1))
    if refused:
      raise ValueError(f"dot_general: weight_gather: {refused}; pass weight_gather=None (gather W as it is)")
    if not weight_gather.active:
      weight_gather = None
  out_dtype = jnp.dtype(preferred_element_type) if preferred_element_type is not None else jnp.result_type(lhs, rhs)
  static = _Static(
      recipe=recipe, switched=switched, out_dtype=out_dtype, x_dtype=lhs.dtype, w_dtype=rhs.dtype, k=k,
      groups=groups, gather=weight_gather,
  )
  if use_switched is not None:
    use_switched = jnp.asarray(use_switched, jnp.bool_)

  x = jnp.transpose(lhs, lb + lf + lc).reshape((b, m, k))
  w = jnp.transpose(rhs, rb + rc + rf).reshape((b, k, n))
  if not lb:
    y = _gemm2d(static, x[0], w[0], use_switched, key)
  else:
    keys = None if key is None else jax.vmap(lambda i: prng.fold_in(key, i))(jnp.arange(b))
    # The batch dim keeps its mesh axes inside the weight gather's shard_map (experts stay where they are).
    spmd = weight_gather.batch if weight_gather is not None and weight_gather.batch else None
    y = jax.vmap(lambda xi, wi, ki: _gemm2d(static, xi, wi, use_switched, ki), spmd_axis_name=spmd)(x, w, keys)
  return y.reshape(batch_shape + lf_shape + rf_shape)
