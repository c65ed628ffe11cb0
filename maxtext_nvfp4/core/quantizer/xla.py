"""Implementation "xla": the quantizer's formulas (``formulas.py``) as XLA ops, for every scale rule, shape,
batching and platform.

    quantize         x -> NVFP4Tensor (E2M1 data, E4M3 block scales, amax)
    quantize_values  x -> (q * s8 in ``dtype``, amax): a GEMM operand used once, without the 4-bit packing

Cost (why the code looks the way it does): the element path is ~15 fp32/int ops per element with no
division (E2M1 codes straight from ``fl(x * enc)``); the tensor amax comes from the block maxima; the block
scales touch 1/16 of the data. The per-tensor chain (S_enc, S_dec and the 127-entry encode table) costs
nothing at run time but is most of what XLA compiles per quantized tensor: its three quotients are integer
arithmetic on significands, with the constants' side folded on the host.

XLA pitfalls handled (each one changed golden bits before it was handled): XLA:CPU compares with
denormals-are-zero (a subnormal amax tests ``== 0``; zero tests use the bits), flushes subnormal operands of
arithmetic and dots (exact integer/exponent paths, RHT of tiny groups at 2**64 scale), and its algebraic
simplifier rewrites ``x / constant`` as ``x * fl(1/constant)``; XLA:GPU divides with PTX ``div.full.f32``.
Where fp32 arithmetic keeps subnormals (XLA:GPU, ``lax.platform_dependent`` branch ``cuda``) the element
product and the RHT's tiny-group upscale are plain products, and off CPU the SR bytes are hashed per element:
the same bits with fewer passes over memory (``tests/core/test_nvfp4_gpu_paths.py`` checks each against its
other form).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from maxtext_nvfp4.core import formats
from maxtext_nvfp4.core.formats import E2M1, E4M3, round_to_format
from maxtext_nvfp4.core.formats import F32_ABS_MASK as _F32_ABS_MASK
from maxtext_nvfp4.core.formats import bits as _bits
from maxtext_nvfp4.core.formats import from_bits as _from_bits
from maxtext_nvfp4.core.formats import to_f32_exact as _to_f32_exact
from maxtext_nvfp4.core.quantizer import formulas
from maxtext_nvfp4.core.quantizer.formulas import BLOCK, E2M1_MAX, E4M3_MAX, STANDARD_RULE, ScaleRule
from maxtext_nvfp4.core.quantizer.hadamard import rht_bf16
from maxtext_nvfp4.core.quantizer.random_bits import random_bytes
from maxtext_nvfp4.core.quantizer.tensor import NVFP4Tensor, codes_to_e2m1


def block_amaxes(xb, red, rule: ScaleRule = STANDARD_RULE, nb_axis: int | None = None, amax=None):
  """(amax, bamax) of the blocked fp32 ``xb``: block maxima (keeping the block dims) and the amax that sets
  the global scale (a scalar; row-scaled: per row, the max over the blocks axis ``nb_axis``, kept); ``amax``:
  that amax, already known (:func:`amaxes`), instead of the max over the block maxima."""
  abs_bits = (_bits(xb) & _F32_ABS_MASK).astype(jnp.int32)  # integer max: exact, NaN-propagating
  bamax_bits = jnp.max(abs_bits, axis=red, keepdims=True)
  if amax is not None:
    return jnp.asarray(amax, jnp.float32), _from_bits(bamax_bits)
  # The tensor amax from the block maxima (1/16 of the data). Without the barrier XLA merges the two
  # reductions into one over the whole tensor, which XLA:CPU runs as a reduce-window tree over a
  # materialized int32 copy of it (an extra read and write of 4 bytes per element).
  if rule.row_scaled:
    amax = _from_bits(jnp.max(formats.canonical_nan_bits(lax.optimization_barrier(bamax_bits)), axis=nb_axis,
                               keepdims=True))
  else:
    amax = _from_bits(jnp.max(formats.canonical_nan_bits(lax.optimization_barrier(bamax_bits))))
  return amax, _from_bits(bamax_bits)


def encode_scales(s8, s_dec):
  """``min(fl(1 / fl(s8 * S_dec)), FLT_MAX)`` per block (IEEE 1/0 = inf for a zero-scale block, and
  1/subnormal overflows: both end at FLT_MAX). A scalar S_dec: the exact quotient is taken once per E4M3
  value (a 127-entry table) and looked up by s8's code, so no per-block division; a per-row S_dec
  (row-scaled): one exact quotient per block (1/16 of the data)."""
  if jnp.ndim(s_dec) == 0:
    s_dec_or_1 = jnp.where(jnp.isnan(s_dec), 1.0, s_dec)
    table = formulas.encode_from_e4m3_parts(formulas.E4M3_K8, formulas.E4M3_J8, s_dec_or_1)
    enc = jnp.where(jnp.isnan(s_dec), s_dec, table)[formulas.e4m3_code(s8)]
  else:
    k8, j8 = formulas.e4m3_parts(jnp.where(jnp.isnan(s8), 0.0, s8))
    enc = formulas.encode_from_e4m3_parts(k8, j8, jnp.where(jnp.isnan(s_dec), 1.0, s_dec))
    enc = jnp.where(jnp.isnan(s_dec), s_dec, enc)
  return jnp.where(jnp.isnan(s8), s8, enc)


def block_scales(xb, red, rule: ScaleRule = STANDARD_RULE, nb_axis: int | None = None, amax=None):
  """(amax, s8, enc) of the blocked fp32 ``xb`` under TE's standard selection (blocks along the axes
  ``red``; s8/enc keep those dims; ``amax``: as :func:`block_amaxes`)."""
  amax, bamax = block_amaxes(xb, red, rule, nb_axis, amax)
  s_enc, s_dec = formulas.global_scales(amax, rule.e4m3_bound)
  # Per-block decode scale, E4M3: fl(bamax * fl(S_enc * fl(1/6))), saturated to 448, RNE.
  dec = jnp.minimum(formulas.mul_exact(bamax, formulas.block_scale_factor(s_enc)), np.float32(E4M3_MAX))
  s8 = round_to_format(dec, E4M3)
  return amax, s8, encode_scales(s8, s_dec)


# ----------------------------------------------------------------------------------------------
# Block-scale selections: ScaleRule.selection -> (xb, red, u, rule, nb_axis, err_axis) -> (k, neg, s8, amax)
# ----------------------------------------------------------------------------------------------
def _select_max(xb, red, u, rule: ScaleRule, nb_axis, err_axis, amax=None):
  """TE's standard selection: (k, neg, s8, amax) with s8 from the block amax (formulas' docstring)."""
  del err_axis
  amax, s8, enc = block_scales(xb, red, rule, nb_axis, amax)
  k, neg = formulas.e2m1_code_of_product(xb, enc, u)
  return k, neg, s8, amax


# 4over6's map-to-4 scale factor (TE reference: decode_scale_base * 1.5).
_MAP4_FACTOR = np.float32(1.5)


def four_over_six_element_error(xb, k, neg, s8, amax, rule: ScaleRule):
  """Per-element error of one 4over6 candidate (codes ``k``/``neg``, scales ``s8``), in TE's order:
  ``d = fl(fl(fl(fl(q * s8) * amax) / 6B) - x)``, then ``|d|`` (MAE) or ``fl(d * d)`` (MSE)."""
  q = formats.grid_value(k, E2M1)
  q = jnp.where(neg, -q, q)
  w = (q * s8) * amax  # q * s8 is exact (2 x 4 significant bits)
  val = formats.div_rn(jnp.abs(w), np.float32(formulas.global_denominator(rule.e4m3_bound)))
  val = jnp.where(jnp.signbit(w), -val, val)
  d = val - xb
  return d * d if rule.err_mode == "MSE" else jnp.abs(d)


def _four_over_six_block_error(e, red, err_axis):
  """Block sums of the element errors ``e``: sequential over the 16 elements along ``err_axis`` (a blocked
  axis of ``red``), from 0; with 16x16 tiles the 16 row sums then added as TE's warp-reduction tree
  ((r0..7 + r8..15) -> 4 -> 2 -> 1). Keeps the block dims (size 1)."""
  err = jnp.zeros_like(lax.index_in_dim(e, 0, err_axis, keepdims=True))
  for i in range(BLOCK):  # sequential: fl(...fl(fl(0 + e0) + e1)... + e15), no reassociation
    err = err + lax.index_in_dim(e, i, err_axis, keepdims=True)
  other = [r for r in red if r != err_axis]
  if other:  # 16x16 tiles: the tree over the 16 rows (8 + 8 -> 4 + 4 -> 2 + 2 -> 1 + 1)
    ax = other[0]
    n = BLOCK
    while n > 1:
      n //= 2
      err = lax.slice_in_dim(err, 0, n, axis=ax) + lax.slice_in_dim(err, n, 2 * n, axis=ax)
  return err


def _select_four_over_six(xb, red, u, rule: ScaleRule, nb_axis, err_axis):
  """4over6 (TE reference ``_quantize_blockwise_4over6_reference``): (k, neg, s8, amax), see formulas' docstring."""
  del u  # RNE only (SR is refused)
  amax, bamax = block_amaxes(xb, red, rule, nb_axis)
  s_enc, s_dec = formulas.global_scales(amax, rule.e4m3_bound)
  # base = fl(fl(bamax / 6) * S_enc): the reference's order. bamax / 6 may be subnormal (exact quotient);
  # mul_exact takes it, and results below 2**-126 round to E4M3 zero either way.
  base = formulas.mul_exact(formats.div_rn(bamax, np.float32(E2M1_MAX)), s_enc)
  cands = []
  for dec in (base, base * _MAP4_FACTOR):  # map-to-6, map-to-4
    s8 = round_to_format(jnp.minimum(dec, np.float32(E4M3_MAX)), E4M3)
    k, neg = formulas.e2m1_code_of_product(xb, encode_scales(s8, s_dec))
    e = four_over_six_element_error(xb, k, neg, s8, amax, rule)
    cands.append((k, neg, s8, _four_over_six_block_error(e, red, err_axis)))
  (k6, n6, s6, e6), (k4, n4, s4, e4) = cands
  pick4 = e4 < e6  # ties keep map-to-6
  pick4_elems = jnp.broadcast_to(pick4, xb.shape) if pick4.shape != xb.shape else pick4
  # With 16x16 tiles the error reduced every tile axis; s8 has the same kept dims.
  return (jnp.where(pick4_elems, k4, k6), jnp.where(pick4_elems, n4, n6),
          jnp.where(pick4, s4, s6), amax)


_SCALE_SELECTIONS = {"max": _select_max, "4over6": _select_four_over_six}


# ----------------------------------------------------------------------------------------------
# The quantizer
# ----------------------------------------------------------------------------------------------
def _quantize_parts(x, stochastic_key, axis_n, block_2d, rht, rule: ScaleRule, amax=None):
  """(k, neg, s8, amax, red): the blocked E2M1 codes and block scales of x (arguments validated).

  ``axis_n`` with ``block_2d``: None, or (4over6) the axis along which each tile row's error is summed.
  ``amax``: x's amax (post-RHT with ``rht``) when already known (TE's standard rule only).
  """
  if rht:
    # Materialize the RHT output once: otherwise XLA:CPU fuses its elementwise tail into both consumers
    # (block amax and element path) and recomputes it there.
    xf = _to_f32_exact(lax.optimization_barrier(rht_bf16(x, axis_n)))
  else:
    xf = _to_f32_exact(x)
  xb, red = formulas.blocked(xf, None if block_2d else axis_n, block_2d)
  u = None
  if stochastic_key is not None:
    # Bits drawn over the unblocked shape (its last axis is long): a blocked shape ending in 16 would
    # make the uint32 words' axis 4 long, several times slower on XLA:CPU for the same bits.
    u = random_bytes(stochastic_key, xf.shape).reshape(xb.shape).astype(jnp.float32) * np.float32(1.0 / 256.0)
  nb_axis = None if block_2d else axis_n  # the blocks axis of a 1x16 layout (row-scaled amax)
  if block_2d:  # 4over6: error summed along the tile's row axis (last axis by default)
    err_axis = red[0] if axis_n == x.ndim - 2 else red[1]
  else:
    err_axis = red[0]
  select = _SCALE_SELECTIONS[rule.selection]
  if amax is None:
    k, neg, s8, amax = select(xb, red, u, rule, nb_axis, err_axis)
  else:
    k, neg, s8, amax = select(xb, red, u, rule, nb_axis, err_axis, amax)
  return k, neg, s8, amax, red


def quantize(x, stochastic_key, axis_n, block_2d, rht, rule: ScaleRule = STANDARD_RULE, amax=None) -> NVFP4Tensor:
  """The NVFP4Tensor of ``x`` (arguments validated by ``api``; ``axis_n`` non-negative, or None for tiles;
  ``amax``: as :func:`_quantize_parts`)."""
  k, neg, s8, amax, red = _quantize_parts(x, stochastic_key, axis_n, block_2d, rht, rule, amax)
  codes = (k.astype(jnp.uint8) | (neg.astype(jnp.uint8) << 3)).reshape(x.shape)
  data = codes_to_e2m1(codes)
  scale = jnp.squeeze(s8, axis=red).astype(jnp.float8_e4m3fn)
  if rule.row_scaled:  # one amax per row: x's shape with the block axis reduced to 1
    amax = amax.reshape(x.shape[:axis_n] + (1,) + x.shape[axis_n + 1:])
  return NVFP4Tensor(data=data, scale=scale, amax=amax, axis=None if block_2d else axis_n, block_2d=block_2d,
                     rht=rht, e4m3_bound=rule.e4m3_bound)


def quantize_values(x, stochastic_key, axis_n, block_2d, rht, dtype, rule: ScaleRule = STANDARD_RULE, amax=None):
  """``(q * s8 in dtype, amax)`` of ``x``: :func:`quantize`'s values, computed from the codes directly."""
  k, neg, s8, amax, _ = _quantize_parts(x, stochastic_key, axis_n, block_2d, rht, rule, amax)
  mag = formats.grid_value(k, E2M1)
  v = formats.negate_where(mag, neg) * s8
  if rule.row_scaled:
    amax = amax.reshape(x.shape[:axis_n] + (1,) + x.shape[axis_n + 1:])
  return v.astype(dtype).reshape(x.shape), amax


def amaxes(x):
  """``(max |x|, max |RHT(x)|)`` of a 2D x (T, N), T a multiple of 16: the amax of x's 1x16 quantizations without
  RHT and that of ``quantize(x, axis=0, rht=True)`` (a NaN as the quiet NaN, ``formats.canonical_nan_bits``):
  ``pallas_triton.amaxes``' results, here as XLA ops."""
  canonical = lambda v: formats.canonical_nan_bits((_bits(v) & _F32_ABS_MASK).astype(jnp.uint32))  # noqa: E731
  return (_from_bits(jnp.max(canonical(_to_f32_exact(x)))),
          _from_bits(jnp.max(canonical(_to_f32_exact(rht_bf16(x, 0))))))
