"""The quantizer of the GEMM operands x, dy and W (:func:`maxtext_nvfp4.core.nvfp4.quantize_values`, and
:func:`~maxtext_nvfp4.core.nvfp4.quantize` for the RHT copy of x and W's 16x16 tiles) as Pallas (Triton)
kernels on XLA:GPU: the same bits, in two passes over the operand instead of four or more.

XLA cannot fuse a reduction into its consumer, so its form of the quantizer writes the block maxima, reads
them back for the tensor amax and for a block-level kernel, which writes ``s8`` and ``enc`` for the element
pass to read (8.00 B/element for a bf16 operand; the RHT operand also writes and reads the transform: 14.13;
H200 compile, 2026-12-01/03). Here, for a tile of whole 16-element blocks, in registers::

    pass 1:   amax = max |x|  (XLA reduce; ROWS)  or  max |RHT(x)|  (COLS_RHT: a kernel writes the block
              maxima bamax, 0.25 B/element, and XLA reduces them)
    scalars:  S_enc, S_dec = nvfp4._global_scales(amax);  c = fl(S_enc * fl(1/6))   (in the kernel, per tile)
    pass 2:   [y = RHT(x) as nvfp4._rht_exact: tiny groups at 2**64, one bf16 rounding]    (COLS_RHT)
              bamax = max |y| over the 16                    (ROWS; COLS_RHT reads pass 1's)
              s8    = rnd(min(fl(bamax * c), 448), E4M3)
              enc   = min(fl(1 / fl(s8 * S_dec)), FLT_MAX)          per block, from integers
              k     = E2M1 code of fl(|y| * enc) (RNE, or SR with nvfp4._random_bytes' byte of the element)
              v     = ±grid(k) * s8                                 written once (bf16)
              [or, quantize: k and the sign packed two per byte, s8's E4M3 byte]   written once

Layouts (:func:`layout_of`, :func:`codes_layout_of`): :data:`ROWS` -- 1x16 blocks along the last axis (x for
fprop, dy for dgrad); :data:`COLS_RHT` -- 1x16 blocks along axis 0 of a 2D operand with RHT (dy for wgrad, and
x's 4-bit copy for wgrad); :data:`TILES_2D` -- ``quantize``'s 16x16 tiles of a 2D operand (W for fprop and
dgrad; the tile amax over its 16 rows and 8 column pairs). TE's standard rule only; every other call stays on
the XLA form.

Every formula is ``nvfp4``'s own helper (:class:`Formulas`, handed in by ``nvfp4``), called on the tile, so
the same operations give the same bits. Differences of form, each exact: the encode scale per block
(``nvfp4._encode_from_e4m3_parts``, the row-scaled path's) instead of a lookup in the 127-entry table (Triton
has no gather; the table is the same function of each E4M3 value); SR's two key words
``jax.random.bits(key, (2,), uint32)`` from the Threefry key's words by jax's 20 rounds in the kernel
(:func:`_threefry_bits2`: each of jax's own costs XLA:GPU seconds of compile), after the key's deferred
``fold_in`` chain (``prng.FoldedKey``: one ``threefry2x32`` of ``(0, data)`` per fold); round half to even as
:func:`_rint_nonnegative` (Triton has no ``round``); the RHT of a group's 16 rows elementwise, each output row
``nvfp4._rht16_column`` (the matrix entries as literals or from a loop index's bits: a kernel captures no array
constant), its 16-term fp32 sums left to right where XLA's form reduces in its own order: bit-exact wherever the
sums do not depend on the order (nvfp4's RHT contract). ``fl(|x| * enc)`` and the tiny-group upscale are the
plain IEEE forms, as on XLA:GPU (``xla_gpu_ftz`` off); on a flush-to-zero backend (the Pallas interpreter on a
CPU: the tests) the exact forms (``flush_to_zero_safe``; ``tests/core/test_nvfp4_gpu_paths.py`` checks the two
agree).

Sharded operands: ``custom_partitioning`` runs the kernels on each device's shard (blocks stay whole: the
16 axis is never split) with its slice's amax, the same on every shard of the slice, so the amax is the whole
operand's; SR positions are the global ones (the shard's first row and column from the mesh axis indices).
Batched (``batched=True``: ``vmap``'s batch of independent operands, MoE's experts): the grid's first axis
runs over the slices, each with its own amax, SR key and SR positions, the batch axis shardable like any
other; under a second ``vmap`` and for an explicitly sharded operand ``nvfp4`` takes the XLA form. Pallas's
Triton backend is deprecated in jax 0.12 (in favour of Mosaic GPU); it still lowers and compiles, on a GPU and
deviceless for one. On a GPU, Pallas's Triton lowering negates a float as ``0 - x`` and takes min/max as
minnum/maxnum, unlike XLA and Pallas's interpreter: the kernels use no float neg, min or max
(``formats.negate_where``, ``copysign``, ``min_nan``; tested on the jaxprs).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from maxtext_nvfp4.core import formats, prng
from maxtext_nvfp4.core.formats import E2M1, E4M3

__all__ = ["COLS_RHT", "Formulas", "ROWS", "codes_layout_of", "layout_of", "quantize_codes", "quantize_values"]

_BLOCK = 16
# Tile: up to 16 rows x 16 blocks (4096 elements, 8 KiB of bf16 in): powers of two that divide the operand
# (Triton blocks are powers of two; dividing ones need no masking). Triton unrolls a tile's elements over
# the program's threads: 64 blocks (16K elements) took XLA:GPU 2.8 s to compile with SR, 16 blocks 0.7 s
# (benchmarks/RESULTS.md, 2026-12-04 05:30).
_MAX_ROWS = 16
_MAX_BLOCKS = 16
# COLS_RHT: one group (16 rows) x up to this many columns; each row is a (cols,) array spread over the program's
# threads. H200, 8192x14336 (benchmarks/RESULTS.md, 2026-12-04 12:45): the SR values path 4.46 / 2.24 / 1.28 /
# 1.63 / 1.71 ms at 32 / 64 / 128 / 256 / 512 columns; W's tiles 0.46 / 0.28 / 0.34 ms at 8 / 16 / 32 tiles.
_MAX_RHT_COLS = 128
_MAX_TILES = 16  # 16x16 tiles (TILES_2D) per program: 16 rows x 256 columns


def _rint_nonnegative(t):
  """Round half to even of fp32 ``t`` in [0, 2**31) (NaN: unspecified), from the truncation: Triton has no
  ``round``. ``t - trunc(t)`` is exact below 2**24 and zero above (every such fp32 is an integer)."""
  i = t.astype(jnp.int32)
  d = t - i.astype(jnp.float32)
  up = (d > np.float32(0.5)) | ((d == np.float32(0.5)) & ((i & 1) == 1))
  return (i + up.astype(jnp.int32)).astype(jnp.float32)


def _pow2_tile(n: int, cap: int) -> int:
  """The largest power of two <= cap (itself a power of two) that divides n."""
  return math.gcd(n, cap)


# The two operand layouts the kernels take (x3: the operand reshaped, its 16-element blocks on one axis):
#   ROWS     x (..., K) -> (R, K/16, 16): blocks along the last axis (x for fprop, dy for dgrad)
#   COLS_RHT x (T, N)   -> (T/16, 16, N): blocks along axis 0, RHT along them first (dy for wgrad)
ROWS = "rows"
COLS_RHT = "cols_rht"
TILES_2D = "tiles_2d"  # quantize only: 16x16 tiles of a 2D operand (W), TE's byte layout


def _positions(shape, k_ref):
  """ROWS: (t, n), each element's row and column of a (rows, blocks, 16) tile in its slice's 2D view (T, N),
  uint32, from the shard's first (row, column) in ``k_ref``'s last two entries and the tile's place in the
  grid (batch, i, j)."""
  a, b, c = (lax.broadcasted_iota(jnp.uint32, shape, d) for d in range(3))
  first_t, first_n = k_ref[k_ref.shape[0] - 2], k_ref[k_ref.shape[0] - 1]
  t0 = first_t + (pl.program_id(1) * shape[0]).astype(jnp.uint32)
  n0 = first_n + (pl.program_id(2) * shape[1]).astype(jnp.uint32) * np.uint32(_BLOCK)
  return t0 + a, n0 + b * np.uint32(_BLOCK) + c


def _group_positions(k_ref, cols: int):
  """COLS_RHT: (t, n) of a (1, 16, cols) tile in its slice's 2D view (T, N): its group's first row (a uint32
  scalar) and its columns (cols,), from the shard's first (row, column) in ``k_ref``'s last two entries."""
  first_t, first_n = k_ref[k_ref.shape[0] - 2], k_ref[k_ref.shape[0] - 1]
  t = first_t + (pl.program_id(1) * _BLOCK).astype(jnp.uint32)
  n = first_n + (pl.program_id(2) * cols).astype(jnp.uint32) + lax.broadcasted_iota(jnp.uint32, (cols,), 0)
  return t, n


_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _abs_bits(v):
  """|v|'s fp32 bits as int32 (their order is |v|'s: maxima by integer max, NaN above every number)."""
  return (formats.bits(v) & np.uint32(formats.F32_ABS_MASK)).astype(jnp.int32)


def _slice_amax_bits(xb):
  """Each slice's max |x| (batch first) as :func:`_abs_bits` (a NaN as the quiet NaN), uint32: XLA's reduce, before
  the kernels. In uint32 (the same order for these non-negative bits): XLA:GPU sent an int32 max's last step (a
  few thousand partial maxima to a scalar) to a Triton fusion of its own, one more program to compile for each
  quantizer (deviceless H200, 2026-12-04); a uint32 max stays on its own reduction emitter."""
  bits = formats.canonical_nan_bits(_abs_bits(formats.to_f32_exact(xb))).astype(jnp.uint32)
  return jnp.max(bits, axis=tuple(range(1, xb.ndim)))


def _threefry2x32(k1, k2, x1, x2):
  """jax's Threefry-2x32 hash of the counter words (x1, x2) under the key words (k1, k2), uint32 (the 20
  rounds of ``jax._src.random.threefry2x32``'s unrolled lowering)."""
  ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
  x1, x2 = x1 + ks[0], x2 + ks[1]
  for i in range(5):
    for r in _THREEFRY_ROTATIONS[i % 2]:
      x1 = x1 + x2
      x2 = x1 ^ ((x2 << np.uint32(r)) | (x2 >> np.uint32(32 - r)))
    x1, x2 = x1 + ks[(i + 1) % 3], x2 + ks[(i + 2) % 3] + np.uint32(i + 1)
  return x1, x2


def _threefry_bits2(k1, k2, partitionable: bool):
  """``jax.random.bits(key, (2,), uint32)`` of a Threefry key with words (k1, k2), from scalars (a kernel
  computes it; XLA:GPU spends seconds compiling each of jax's): with ``jax_threefry_partitionable`` each
  word is ``y1 ^ y2`` of the counter (0, i), without it the two words of the counter (0, 1)."""
  zero = np.uint32(0)
  if partitionable:
    (a1, a2), (b1, b2) = _threefry2x32(k1, k2, zero, zero), _threefry2x32(k1, k2, zero, np.uint32(1))
    return a1 ^ a2, b1 ^ b2
  return _threefry2x32(k1, k2, zero, np.uint32(1))


def _sr_words(k_ref, threefry: bool | None, folds: int):
  """SR's two key words (k0, k1) of this shard, from ``k_ref`` = (key word 0, key word 1, fold data 0 ..
  ``folds - 1``, zeros, first row, first column): the Threefry key's words, each fold ``(w0, w1) =
  threefry2x32((w0, w1), (0, data))`` (``jax.random.fold_in``), then (k0, k1) by :func:`_threefry_bits2`
  (``threefry``: the partitionable flag); or (``threefry`` None, no folds) the two words themselves."""
  k0, k1 = k_ref[0], k_ref[1]
  for i in range(folds):
    k0, k1 = _threefry2x32(k0, k1, np.uint32(0), k_ref[2 + i])
  if threefry is not None:
    k0, k1 = _threefry_bits2(k0, k1, threefry)
  return k0, k1


def _sr_fraction(f: "Formulas", words, t, n, n_total: int):
  """``u = byte / 256`` of ``nvfp4._random_bytes(key, (T, N))`` at rows ``t`` and columns ``n`` (uint32, the
  slice's 2D view): the same per-element form, ``byte (n mod 4)`` of ``H(H(w + k0) ^ k1)`` with ``w = t * (N /
  4) + n div 4`` (uint32, wrapping like ``nvfp4._word_index``); ``words``: (k0, k1) (:func:`_sr_words`);
  ``n_total``: N of the whole operand (the tile may be a shard's)."""
  k0, k1 = words
  word = t * np.uint32(n_total // 4) + n // np.uint32(4)
  h = f.hash32(f.hash32(word + k0) ^ k1)
  byte = (h >> ((n % np.uint32(4)) * np.uint32(8))) & np.uint32(0xFF)
  return byte.astype(jnp.float32) * np.float32(1.0 / 256.0)


def _int_max(vs):
  """Elementwise max of int32 arrays (Triton lowers an integer max exactly)."""
  m = vs[0]
  for v in vs[1:]:
    m = jnp.maximum(m, v)
  return m


def _rht_columns(f: "Formulas", x_ref, safe: bool):
  """``nvfp4._rht_exact`` of a kernel's (1, 16, ...) tile, one group, as ``(sums, back)``: its 16 rows loaded on
  their own (tiny groups, max |x| < 2**-60, at 2**64 scale); ``sums(c)`` -> row c of the transform before
  its rounding (``nvfp4._rht16_column``; ``c`` an int, or a ``fori_loop`` index), ``back(y)`` -> its one bf16
  rounding at the true size (fp32 on the bf16 grid): the transform's row c is ``back(sums(c))``. Rows, not a
  (16, cols) tile: every step is elementwise, with no reduction across a tile axis (Triton moves those
  through shared memory); a loop over c, not 16 unrolled sums, keeps the kernel small enough for Triton to
  compile in seconds."""
  rows = [formats.to_f32_exact(x_ref[0, r]) for r in range(_BLOCK)]
  tiny = _int_max([_abs_bits(r) for r in rows]) < int(np.float32(f.rht_tiny).view(np.int32))
  up = f.rht_upscale_safe if safe else f.rht_upscale_ieee
  xs = [up(r, tiny) for r in rows]
  return (lambda c: f.rht16_column(xs, c)), (lambda y: f.rht_round_back(y, tiny, rint=_rint_nonnegative))


def _rht_amax_bits(sums, back, shape):
  """Block maxima ``max_c |back(sums(c))|`` over the 16 transform rows as :func:`_abs_bits` (int32, ``shape``),
  a NaN as the quiet NaN (as ``nvfp4._block_amaxes``), computed as ``back(max_c |sums(c)|)``: the same value,
  as the rounding back is monotone and odd, with one rounding per column instead of 16 (H200: the RHT codes of
  an 8192x4096 x 0.42 -> 0.33 ms; benchmarks/RESULTS.md, 2026-12-04 15:06)."""
  m = lax.fori_loop(0, _BLOCK, lambda c, m: jnp.maximum(m, _abs_bits(sums(c))), jnp.zeros(shape, jnp.int32))
  return formats.canonical_nan_bits(_abs_bits(back(formats.from_bits(m))))  # back keeps NaN a NaN, Inf an Inf


def _block_scale(f: "Formulas", bamax, c, s_dec):
  """(s8, enc): the E4M3 block scale of block maxima ``bamax`` and its encode scale (NaN for a NaN amax)."""
  dec = formats.min_nan(f.mul_exact(bamax, c), np.float32(f.e4m3_max))
  s8 = formats.round_to_format(dec, E4M3, rint=_rint_nonnegative)
  s8 = jnp.where(jnp.isnan(dec), dec, s8)  # a NaN amax: NaN scales, as jnp.round keeps NaN
  k8, j8 = f.e4m3_parts(jnp.where(jnp.isnan(s8), np.float32(0.0), s8))
  return s8, jnp.where(jnp.isnan(s8), s8, f.encode_from_e4m3_parts(k8, j8, s_dec))


def _e2m1(f: "Formulas", y, enc, u, safe: bool):
  """(k, neg): E2M1 magnitude indices (fp32) and signs of fp32 ``y`` under encode scale ``enc``."""
  return f.e2m1_code(y, enc, u, product=f.safe_product if safe else f.plain_product, rint=_rint_nonnegative)


def _value(k, neg, s8):
  """``±grid(k) * s8`` (fp32, on x's grid)."""
  return formats.negate_where(formats.grid_value(k, E2M1), neg) * s8


def _codes_tile(f: "Formulas", xf, axis, c, s_dec, u, safe: bool):
  """(k, neg, s8): E2M1 magnitude indices (fp32), signs and block scales (fp32, the block dims kept) of a tile
  whose blocks lie along ``axis`` (one axis, or a tuple: 16x16 tiles)."""
  s8, enc = _block_scale(f, formats.from_bits(jnp.max(_abs_bits(xf), axis=axis, keepdims=True)), c, s_dec)
  return (*_e2m1(f, xf, enc, u, safe), s8)


def _values_kernel(a_ref, *refs, f: "Formulas", layout: str, safe: bool, n_total: int, threefry: bool | None,
                   folds: int, sr: bool):
  refs = list(refs)
  k_ref = refs.pop(0) if sr else None
  b_ref = refs.pop(0) if layout == COLS_RHT else None  # the RHT-amax kernel's block maxima
  x_ref, v_ref = refs
  c, s_dec = _scalars(f, a_ref[0])
  words = None if k_ref is None else _sr_words(k_ref, threefry, folds)
  if layout == ROWS:
    xf = formats.to_f32_exact(x_ref[...])
    u = None if words is None else _sr_fraction(f, words, *_positions(xf.shape, k_ref), n_total)
    v_ref[...] = _value(*_codes_tile(f, xf, 2, c, s_dec, u, safe)).astype(v_ref.dtype)  # (rows, blocks, 16)
    return
  sums, back = _rht_columns(f, x_ref, safe)  # COLS_RHT: a (1, 16, cols) tile, one group
  cols = x_ref.shape[2]
  s8, enc = _block_scale(f, formats.from_bits(b_ref[0]), c, s_dec)
  t, n = (None, None) if words is None else _group_positions(k_ref, cols)

  def row(r, carry):
    u = None if words is None else _sr_fraction(f, words, t + r.astype(jnp.uint32), n, n_total)
    v_ref[0, r, :] = _value(*_e2m1(f, back(sums(r)), enc, u, safe), s8).astype(v_ref.dtype)
    return carry

  lax.fori_loop(0, _BLOCK, row, 0)


def _packed_codes(k, neg, *, pair_axis: int):
  """TE's bytes of a tile's codes: E2M1 codes two per byte along ``pair_axis`` (a column pair; even column in
  the low nibble, as ``nvfp4.pack``)."""
  codes = k.astype(jnp.int32) | (neg.astype(jnp.int32) << 3)
  nibble = lax.broadcasted_iota(jnp.int32, codes.shape, pair_axis) * 4
  return jnp.sum(codes << nibble, axis=pair_axis).astype(jnp.uint8)


def _scale_bytes(f: "Formulas", s8):
  """The E4M3 scales' bytes (a non-negative E4M3 grid value's bit pattern is its grid code; NaN: 0x7F, what a
  float8 cast gives)."""
  return jnp.where(jnp.isnan(s8), 0x7F, f.e4m3_code(s8)).astype(jnp.uint8)


def _codes_kernel(a_ref, b_ref, x_ref, d_ref, e_ref, *, f: "Formulas", safe: bool):
  """COLS_RHT, RNE, on a (1, 16, pairs, 2) tile of x viewed as (T/16, 16, N/2, 2): TE's byte layout -- E2M1
  codes two per byte along the columns (even column in the low nibble, as ``nvfp4.pack``) and the E4M3 block
  scales' bytes. (The pair axis keeps a column's pair on one device: a sharding rule cannot relate N to N/2.)"""
  c, s_dec = _scalars(f, a_ref[0])
  sums, back = _rht_columns(f, x_ref, safe)
  s8, enc = _block_scale(f, formats.from_bits(b_ref[0]), c, s_dec)

  def row(r, carry):
    d_ref[0, r, :] = _packed_codes(*_e2m1(f, back(sums(r)), enc, None, safe), pair_axis=1)
    return carry

  lax.fori_loop(0, _BLOCK, row, 0)
  e_ref[0, 0, :, :] = _scale_bytes(f, s8)


def _tiles_kernel(a_ref, x_ref, d_ref, e_ref, *, f: "Formulas", safe: bool):
  """TILES_2D, RNE, on a (1, 16, tiles, 8, 2) tile of W viewed as (K/16, 16, N/16, 8, 2): each 16x16 tile's
  amax over its rows and its 8 column pairs, the E2M1 codes two per byte along the columns (even column in the
  low nibble) and the tile's E4M3 scale byte."""
  c, s_dec = _scalars(f, a_ref[0])
  k, neg, s8 = _codes_tile(f, formats.to_f32_exact(x_ref[...]), (1, 3, 4), c, s_dec, None, safe)
  d_ref[...], e_ref[...] = _packed_codes(k, neg, pair_axis=4), _scale_bytes(f, s8)


def _rht_amax_kernel(x_ref, m_ref, *, f: "Formulas", safe: bool):
  """Per tile column: max |RHT(x)| bits over its group's 16 rows (the tensor amax's first step)."""
  m_ref[0, :] = _rht_amax_bits(*_rht_columns(f, x_ref, safe), (x_ref.shape[2],))


def _tiles(layout: str, shape):
  """The kernel's tile of an x3 of ``shape`` (batch first: the kernel sees one slice's tile) and its grid
  (batch, i, j) (tiles: powers of two that divide the dims)."""
  if layout == ROWS:
    batch, rows, blocks, _ = shape
    t = (_pow2_tile(rows, _MAX_ROWS), _pow2_tile(blocks, _MAX_BLOCKS), _BLOCK)
    return t, (batch, rows // t[0], blocks // t[1]), lambda e, i, j: (e, i, j, 0)
  batch, groups, _, cols = shape  # the RHT's (1, 16, 16, cols) products bound the columns of a tile
  t = (1, _BLOCK, _pow2_tile(cols, _MAX_RHT_COLS))
  return t, (batch, groups, cols // t[2]), lambda e, i, j: (e, i, 0, j)


def _per_slice(a):
  """The BlockSpec of a (batch, n) operand (amax, SR words): the kernel sees its slice's row (n,)."""
  return pl.BlockSpec((None, a.shape[1]), lambda e, i, j: (e, 0))


# jit: a kernel traced once per distinct call (shapes and parameters), not at every call site (~0.3 s each).
@functools.partial(jax.jit, static_argnames=("f", "layout", "dtype", "safe", "interpret", "n_total", "threefry",
                                             "folds"))
def _values_call(amax, keys, bmax, x3, *, f, layout: str, dtype, safe: bool, interpret: bool, n_total: int,
                 threefry: bool | None, folds: int):
  """The values kernel over the blocked operand ``x3`` (batch first); ``amax`` (batch, 1); ``keys``:
  SR's (key word 0, key word 1, ``folds`` fold data, zeros, first row, first column) per slice (batch, a power
  of two), or None (RNE); ``bmax``: COLS_RHT's block maxima (batch, groups, columns) from
  :func:`_rht_amax_call`, None for ROWS; ``threefry`` and ``folds``: as :func:`_sr_fraction`."""
  tile, grid, index = _tiles(layout, x3.shape)
  per_slice = [a for a in (amax, keys) if a is not None]
  in_specs = [_per_slice(a) for a in per_slice]
  if bmax is not None:
    in_specs.append(pl.BlockSpec((None, 1, tile[2]), lambda e, i, j: (e, i, j)))
  operands = per_slice + [a for a in (bmax, x3) if a is not None]
  return pl.pallas_call(
      functools.partial(_values_kernel, f=f, layout=layout, safe=safe, n_total=n_total, threefry=threefry,
                        folds=folds, sr=keys is not None),
      out_shape=jax.ShapeDtypeStruct(x3.shape, dtype),
      grid=grid,
      in_specs=in_specs + [pl.BlockSpec((None,) + tile, index)],
      out_specs=pl.BlockSpec((None,) + tile, index),
      interpret=interpret,
      name=f"nvfp4_values_{layout}" + ("" if keys is None else "_sr"),
  )(*operands)


@functools.partial(jax.jit, static_argnames=("f", "safe", "interpret"))
def _rht_amax_call(x3, *, f, safe: bool, interpret: bool):
  """Per (group, column) tile maxima of |RHT(x)| as int32 bits: (batch, groups, cols)."""
  tile, grid, index = _tiles(COLS_RHT, x3.shape)
  return pl.pallas_call(
      functools.partial(_rht_amax_kernel, f=f, safe=safe),
      out_shape=jax.ShapeDtypeStruct((x3.shape[0], x3.shape[1], x3.shape[3]), jnp.int32),
      grid=grid,
      in_specs=[pl.BlockSpec((None,) + tile, index)],
      out_specs=pl.BlockSpec((None, 1, tile[2]), lambda e, i, j: (e, i, j)),
      interpret=interpret,
      name="nvfp4_rht_amax",
  )(x3)


@functools.partial(jax.jit, static_argnames=("f", "safe", "interpret"))
def _codes_call(amax, bmax, x4, *, f, safe: bool, interpret: bool):
  """(packed codes (batch, groups, 16, pairs) uint8, scale bytes (batch, groups, 1, pairs, 2) uint8) of x4
  (batch, groups, 16, pairs, 2); ``amax`` (batch, 1); ``bmax``: the block maxima (batch, groups, pairs, 2)
  from :func:`_rht_amax_call`."""
  e, g, _, pairs, _ = x4.shape
  tp = _pow2_tile(pairs, _MAX_RHT_COLS // 2)
  index = lambda b, i, j: (b, i, 0, j, 0)  # noqa: E731
  return pl.pallas_call(
      functools.partial(_codes_kernel, f=f, safe=safe),
      out_shape=(jax.ShapeDtypeStruct((e, g, _BLOCK, pairs), jnp.uint8),
                 jax.ShapeDtypeStruct((e, g, 1, pairs, 2), jnp.uint8)),
      grid=(e, g, pairs // tp),
      in_specs=[_per_slice(amax), pl.BlockSpec((None, 1, tp, 2), lambda b, i, j: (b, i, j, 0)),
                pl.BlockSpec((None, 1, _BLOCK, tp, 2), index)],
      out_specs=(pl.BlockSpec((None, 1, _BLOCK, tp), lambda b, i, j: (b, i, 0, j)),
                 pl.BlockSpec((None, 1, 1, tp, 2), index)),
      interpret=interpret,
      name="nvfp4_codes_cols_rht",
  )(amax, bmax, x4)


@functools.partial(jax.jit, static_argnames=("f", "safe", "interpret"))
def _tiles_call(amax, x6, *, f, safe: bool, interpret: bool):
  """(packed codes (batch, K/16, 16, N/16, 8) uint8, scale bytes (batch, K/16, 1, N/16, 1, 1) uint8) of W viewed
  as x6 (batch, K/16, 16, N/16, 8, 2); ``amax`` (batch, 1)."""
  e, g, _, nt, _, _ = x6.shape
  tt = _pow2_tile(nt, _MAX_TILES)
  index = lambda b, i, j: (b, i, 0, j, 0, 0)  # noqa: E731
  return pl.pallas_call(
      functools.partial(_tiles_kernel, f=f, safe=safe),
      out_shape=(jax.ShapeDtypeStruct((e, g, _BLOCK, nt, 8), jnp.uint8),
                 jax.ShapeDtypeStruct((e, g, 1, nt, 1, 1), jnp.uint8)),
      grid=(e, g, nt // tt),
      in_specs=[_per_slice(amax), pl.BlockSpec((None, 1, _BLOCK, tt, 8, 2), index)],
      out_specs=(pl.BlockSpec((None, 1, _BLOCK, tt, 8), lambda b, i, j: (b, i, 0, j, 0)),
                 pl.BlockSpec((None, 1, 1, tt, 1, 1), index)),
      interpret=interpret,
      name="nvfp4_codes_tiles_2d",
  )(amax, x6)


def _partitioned_encoder(encode, rank: int, rule: str, replicated: tuple[str, ...]):
  """``encode(amax, [bmax,] xn) -> (packed codes, scale bytes)`` under ``custom_partitioning``: each device
  encodes its own shard of xn (batch, groups, 16, columns, ...), sharded along the batch, the groups and the
  columns only (a block's 16 rows and a column pair stay together); ``bmax`` (batch, groups, columns, ...),
  when the rule names it, sharded as xn without its 16 axis; the codes have xn's rank minus one, the scale
  bytes xn's rank, both sharded as xn."""
  call = custom_partitioning(encode)

  def specs(arg_shapes):
    x_spec = tuple(arg_shapes[-1].sharding.spec)
    x_spec = x_spec + (None,) * (rank - len(x_spec))
    a, g, h = x_spec[0], x_spec[1], x_spec[3]
    rest = (None,) * (rank - 4)
    ins = [PartitionSpec(a, None)] + [PartitionSpec(a, g, h, *rest)] * (len(arg_shapes) - 2)
    x = PartitionSpec(a, g, None, h, *rest)
    return ins + [x], PartitionSpec(a, g, None, h, *(None,) * (rank - 5)), x

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    _, d, e = specs(arg_shapes)
    return NamedSharding(mesh, d), NamedSharding(mesh, e)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    ins, d, e = specs(arg_shapes)
    return (mesh, encode, (NamedSharding(mesh, d), NamedSharding(mesh, e)),
            tuple(NamedSharding(mesh, s) for s in ins))

  call.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                     need_replication_factors=replicated)
  return call


def _partitioned_tiles(f, safe: bool, interpret: bool):
  """``_tiles_call`` per device: W's row tiles and column tiles shardable, a tile's 16 rows and 8 column pairs
  together."""
  return _partitioned_encoder(lambda amax, x6: _tiles_call(amax, x6, f=f, safe=safe, interpret=interpret), 6,
                              "a s, a g r h p q -> a g r h p, a g o h u v", ("s", "r", "p", "q"))


def _partitioned_codes(f, safe: bool, interpret: bool):
  """``_codes_call`` per device: groups and column pairs shardable, the 16 rows of a group and the 2 columns
  of a pair together; the block maxima sharded as x4 without its 16 axis."""
  return _partitioned_encoder(
      lambda amax, bmax, x4: _codes_call(amax, bmax, x4, f=f, safe=safe, interpret=interpret), 5,
      "a s, a g h p, a g e h p -> a g e h, a g o h p", ("s", "p", "e"))  # need_replication: in the rule's order


def _shard_start(mesh, axes, local: int):
  """The first global index of this device's shard along a dim sharded over ``axes`` (a spec entry)."""
  if axes is None:
    return jnp.uint32(0)
  idx = jnp.uint32(0)
  for a in (axes,) if isinstance(axes, str) else tuple(axes):  # the first axis is the most major
    idx = idx * np.uint32(mesh.shape[a]) + lax.axis_index(a).astype(jnp.uint32)
  return idx * np.uint32(local)


def _x3_spec(layout: str, spec):
  """x3's partition spec (batch first) with the 16-element block axis unsharded (blocks stay whole on every
  device)."""
  spec = tuple(spec) + (None,) * (4 - len(tuple(spec)))
  return (PartitionSpec(spec[0], spec[1], spec[2], None) if layout == ROWS
          else PartitionSpec(spec[0], spec[1], None, spec[3]))


def _partitioned_values(f, layout: str, dtype, safe: bool, interpret: bool, sr: bool, n_total: int,
                        threefry: bool | None):
  """``_values_call`` under ``custom_partitioning``: each device quantizes its own shard's whole blocks with
  its slice's amax; SR positions are the global ones (the shard's first row and column, from the mesh
  axis indices), so the SR bits do not depend on the mesh, as the XLA form's iotas do not. ``seeds``:
  (batch, 2 + F), each slice's key words and F fold data (:func:`_seeds`); COLS_RHT's call also takes the
  RHT-amax kernel's block maxima (batch, groups, columns) before x3, sharded as x3."""

  def on_shard(amax, seeds, bmax, x3, mesh=None, spec=(None, None, None, None)):
    keys = None
    if sr:
      # x3 dims (1, 2 or 3) that hold the slice's rows and columns, and their element units
      (dt, ut), (dn, un) = ((1, 1), (2, _BLOCK)) if layout == ROWS else ((1, _BLOCK), (3, 1))
      t0, n0 = (_shard_start(mesh, spec[d], x3.shape[d]) * np.uint32(unit) for d, unit in ((dt, ut), (dn, un)))
      width = 1 << (seeds.shape[1] + 1).bit_length()  # a power of two >= 2 + F + 2 (Triton's blocks)
      keys = jnp.pad(seeds, ((0, 0), (0, width - seeds.shape[1])))
      col = lax.broadcasted_iota(jnp.uint32, keys.shape, 1)  # elementwise: XLA fuses it with the seeds' producer
      keys = keys + jnp.where(col == width - 2, t0, np.uint32(0)) + jnp.where(col == width - 1, n0, np.uint32(0))
    return _values_call(amax, keys, bmax, x3, f=f, layout=layout, dtype=dtype, safe=safe, interpret=interpret,
                        n_total=n_total, threefry=threefry, folds=seeds.shape[1] - 2)

  # custom_partitioning binds every parameter of its function: three or four
  block_maxima = layout == COLS_RHT
  if block_maxima:
    def run(amax, seeds, bmax, x3):
      return on_shard(amax, seeds, bmax, x3)
  else:
    def run(amax, seeds, x3):
      return on_shard(amax, seeds, None, x3)

  call = custom_partitioning(run)

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    return NamedSharding(mesh, _x3_spec(layout, arg_shapes[-1].sharding.spec))

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    x_sharding = NamedSharding(mesh, _x3_spec(layout, arg_shapes[-1].sharding.spec))
    spec = tuple(x_sharding.spec)
    per_slice = NamedSharding(mesh, PartitionSpec(spec[0], None))  # amax and seeds
    if block_maxima:
      lower = lambda s, k, b, x: on_shard(s, k, b, x, mesh, spec)  # noqa: E731
      maxima = (NamedSharding(mesh, PartitionSpec(spec[0], spec[1], spec[3])),)
    else:
      lower = lambda s, k, x: on_shard(s, k, None, x, mesh, spec)  # noqa: E731
      maxima = ()
    return mesh, lower, x_sharding, (per_slice, per_slice, *maxima, x_sharding)

  rule = "a s, a t, a r b e -> a r b e" if layout == ROWS else "a s, a t, a g c, a g e c -> a g e c"
  call.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                     need_replication_factors=("s", "t", "e"))
  return call


def _rht_block_maxima(f, x3, safe: bool, interpret: bool):
  """(block maxima (batch, groups, columns), each slice's max |RHT(x)| (batch,)), both as :func:`_abs_bits` (a
  NaN as the quiet NaN): the RHT-amax kernel's output and XLA's max over it (in uint32, as
  :func:`_slice_amax_bits`)."""
  bmax = _partitioned_rht_amax(f, safe, interpret)(x3)
  return bmax, jnp.max(bmax.astype(jnp.uint32), axis=(1, 2))


def _partitioned_rht_amax(f, safe: bool, interpret: bool):
  """``_rht_amax_call`` under ``custom_partitioning``: tile maxima of each device's shard (the caller's max
  over them is XLA's, across devices)."""

  def run(x3):
    return _rht_amax_call(x3, f=f, safe=safe, interpret=interpret)

  call = custom_partitioning(run)

  def out_sharding(mesh, x_spec):
    return NamedSharding(mesh, PartitionSpec(x_spec[0], x_spec[1], x_spec[3]))

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    return out_sharding(mesh, _x3_spec(COLS_RHT, arg_shapes[0].sharding.spec))

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    x_spec = _x3_spec(COLS_RHT, arg_shapes[0].sharding.spec)
    return mesh, run, out_sharding(mesh, x_spec), (NamedSharding(mesh, x_spec),)

  call.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule="a g e c -> a g c",
                     need_replication_factors=("e",))
  return call


def explicitly_sharded(x) -> bool:
  """x's type carries a sharding (an Explicit mesh axis): left to XLA, pallas_call takes unsharded types only."""
  return any(p is not None for p in getattr(getattr(jax.typeof(x), "sharding", None), "spec", ()) or ())


def _kernel_operand(x, rule) -> bool:
  """What every kernel needs: TE's standard rule, a non-empty bf16 or fp32 operand whose type carries no
  sharding."""
  return rule is None and not explicitly_sharded(x) and x.size > 0 and x.dtype in (jnp.bfloat16, jnp.float32)


def layout_of(x, axis_n, block_2d: bool, rht: bool, rule) -> str | None:
  """The kernel layout that computes this ``quantize_values`` call, or None (the XLA form): TE's standard rule,
  1x16 blocks along the last axis (:data:`ROWS`), or with RHT along axis 0 of a 2D operand whose columns
  are a multiple of 4 (:data:`COLS_RHT`); bf16 or fp32."""
  if block_2d or not _kernel_operand(x, rule):
    return None
  if not rht and x.ndim >= 1 and axis_n == x.ndim - 1:
    return ROWS
  if rht and x.ndim == 2 and axis_n == 0 and x.shape[1] % 4 == 0:
    return COLS_RHT
  return None


def codes_layout_of(x, axis_n, block_2d: bool, rht: bool, rule) -> str | None:
  """The kernel layout that computes this ``quantize`` call (TE's byte layout), or None (the XLA form): RHT
  along axis 0 of a 2D operand with an even number of columns that is a multiple of 4 (:data:`COLS_RHT`), or
  16x16 tiles of a 2D operand whose sides are multiples of 16 (:data:`TILES_2D`: W), TE's standard rule."""
  if (block_2d and not rht and x.ndim == 2 and x.shape[0] % _BLOCK == 0 and x.shape[1] % _BLOCK == 0
      and _kernel_operand(x, rule)):
    return TILES_2D
  return COLS_RHT if layout_of(x, axis_n, block_2d, rht, rule) == COLS_RHT and x.shape[1] % 2 == 0 else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Formulas:
  """``nvfp4``'s own helpers, handed in by ``nvfp4`` (it imports this module, so this one cannot import it):
  the kernels compute with exactly these."""

  # amax -> (S_enc, S_dec), the per-tensor chain
  global_scales: Callable
  # S_enc -> fl(S_enc * fl(1/6)), the block scale's factor
  block_scale_factor: Callable
  # (a, b_normal) -> fl(a * b) exact for a subnormal a (the block scale's product)
  mul_exact: Callable
  # s8 -> (k8, j8) with s8 = k8 * 2**j8
  e4m3_parts: Callable
  # (k8, j8, S_dec) -> min(fl(1 / fl(s8 * S_dec)), FLT_MAX)
  encode_from_e4m3_parts: Callable
  # (x, enc, u, product=, rint=) -> (E2M1 magnitude index, sign)
  e2m1_code: Callable
  # (x's bits, enc) -> fl(|x| * enc): with IEEE subnormals (XLA:GPU's), and exact on a flush-to-zero backend
  plain_product: Callable
  safe_product: Callable
  # (x, tiny) -> x * 2**64 in the tiny RHT groups: the same two forms
  rht_upscale_ieee: Callable
  rht_upscale_safe: Callable
  # (y, tiny, rint=) -> the RHT sums rounded once to bf16 at their true size
  rht_round_back: Callable
  # (16 fp32 arrays: a group's rows, c: an int or a traced int32) -> the RHT's row c, in nvfp4's sum order
  rht16_column: Callable
  # the tiny-group threshold (2**-60)
  rht_tiny: float
  # the 32-bit hash of the SR bytes
  hash32: Callable
  # E4M3's largest value (448)
  e4m3_max: float
  # s8 -> its index in the E4M3 grid (the bit pattern of a non-negative E4M3 value)
  e4m3_code: Callable


def _scalars(f: Formulas, amax):
  """``(fl(S_enc * fl(1/6)), S_dec)`` of a slice's amax, computed in the kernel (a NaN S_dec as 1: the NaN
  scales then come from the first, as the XLA form's table lookup gives NaN). In the kernel, not in XLA: the
  chain's integer division is scalar work for a kernel, and XLA:GPU spends seconds compiling each copy."""
  s_enc, s_dec = f.global_scales(amax)
  return f.block_scale_factor(s_enc), jnp.where(jnp.isnan(s_dec), np.float32(1.0), s_dec)


def _seeds(stochastic_key, batch: int, key_batched: bool):
  """(seeds (batch, 2 + F) uint32, threefry) for SR's two key words of each slice (of each slice's key, or of
  the one key for every slice), ``jax.random.bits(key, (2,), uint32)`` as ``nvfp4._random_bytes`` draws them:
  for a Threefry key (or ``prng.FoldedKey``) its two key words and its F fold data, the kernel computing the
  folds and the bits (``threefry``: jax's partitionable flag); for another PRNG the bits themselves (F = 0,
  ``threefry`` None). Zeros for RNE."""
  if stochastic_key is None:
    return jnp.zeros((batch, 2), jnp.uint32), None
  if prng.is_threefry(stochastic_key):
    words, data = prng.split_chain(stochastic_key)
    seeds, threefry = jnp.concatenate([words, data], axis=-1), bool(jax.config.jax_threefry_partitionable)
  else:
    bits = lambda k: jax.random.bits(k, (2,), jnp.uint32)  # noqa: E731
    seeds, threefry = (jax.vmap(bits) if key_batched else bits)(prng.resolve(stochastic_key)), None
  return (seeds if key_batched else jnp.broadcast_to(seeds, (batch,) + seeds.shape)), threefry


def quantize_values(x, dtype, layout: str, stochastic_key=None, *, formulas: Formulas, batched: bool = False,
                    key_batched: bool = False, flush_to_zero_safe: bool = False, interpret: bool = False):
  """``(values, amax)`` of ``nvfp4.quantize_values(x, axis=..., rht=..., stochastic_key=..., dtype=dtype)`` for
  the call :func:`layout_of` gave ``layout``.

  ``batched``: x's leading axis is a batch of independent operands (``vmap``'s: one amax, one SR key and the
  SR positions of each slice; the amax comes back per slice), ``key_batched``: one key per slice (else the one
  key for every slice). ``flush_to_zero_safe``: the element product and the RHT's tiny-group upscale in their
  exact forms for a flush-to-zero backend (interpret mode on a CPU: the tests); default the plain IEEE forms
  (XLA:GPU keeps subnormals). ``interpret``: run the kernels through Pallas's interpreter (any backend).
  """
  f = formulas
  xb = x if batched else x[None]
  e = xb.shape[0]
  if layout == ROWS:
    x3 = xb.reshape(e, -1, x.shape[-1] // _BLOCK, _BLOCK)
    maxima, amax_bits = [], _slice_amax_bits(xb)
  else:
    x3 = xb.reshape(e, xb.shape[1] // _BLOCK, _BLOCK, xb.shape[2])
    bmax, amax_bits = _rht_block_maxima(f, x3, flush_to_zero_safe, interpret)
    maxima = [bmax]
  amax = formats.from_bits(amax_bits)
  seeds, threefry = _seeds(stochastic_key, e, key_batched)
  call = _partitioned_values(f, layout, jnp.dtype(dtype), flush_to_zero_safe, interpret, stochastic_key is not None,
                             x.shape[-1], threefry)
  values = call(amax[:, None], seeds, *maxima, x3).reshape(x.shape)
  return values, (amax if batched else amax[0])


def quantize_codes(x, layout: str = COLS_RHT, *, formulas: Formulas, batched: bool = False,
                   flush_to_zero_safe: bool = False, interpret: bool = False):
  """``(packed, scale_bytes, amax)`` of ``nvfp4.quantize(x, axis=0, rht=True)`` (:data:`COLS_RHT`) or of
  ``nvfp4.quantize(x, block_2d=True)`` (:data:`TILES_2D`) for a :func:`codes_layout_of` operand x (T, N): the
  E2M1 codes two per byte along N (T, N/2) uint8, the E4M3 scales' bytes ((T/16, N), or (T/16, N/16) for
  tiles) uint8, the amax (post-RHT). ``batched``: x (batch, T, N), each slice its own operand (each result gets
  the leading batch axis). ``flush_to_zero_safe`` and ``interpret``: as :func:`quantize_values`."""
  f = formulas
  xb = x if batched else x[None]
  e, t, n = xb.shape
  if layout == TILES_2D:
    amax = formats.from_bits(_slice_amax_bits(xb))
    x6 = xb.reshape(e, t // _BLOCK, _BLOCK, n // _BLOCK, 8, 2)
    packed, scale_bytes = _partitioned_tiles(f, flush_to_zero_safe, interpret)(amax[:, None], x6)
    packed, scale_bytes = packed.reshape(e, t, n // 2), scale_bytes.reshape(e, t // _BLOCK, n // _BLOCK)
    return (packed, scale_bytes, amax) if batched else (packed[0], scale_bytes[0], amax[0])
  x3 = xb.reshape(e, t // _BLOCK, _BLOCK, n)
  bmax, amax_bits = _rht_block_maxima(f, x3, flush_to_zero_safe, interpret)
  amax = formats.from_bits(amax_bits)
  x4 = xb.reshape(e, t // _BLOCK, _BLOCK, n // 2, 2)
  bmax = bmax.reshape(e, t // _BLOCK, n // 2, 2)
  packed, scale_bytes = _partitioned_codes(f, flush_to_zero_safe, interpret)(amax[:, None], bmax, x4)
  packed, scale_bytes = packed.reshape(e, t, n // 2), scale_bytes.reshape(e, t // _BLOCK, n)
  return (packed, scale_bytes, amax) if batched else (packed[0], scale_bytes[0], amax[0])
