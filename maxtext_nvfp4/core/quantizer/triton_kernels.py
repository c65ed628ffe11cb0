"""The Pallas (Triton) kernels of implementation "triton" (``pallas_triton.py``): for a tile of whole 16-element
blocks, in registers, the formulas of ``formulas.py``, ``hadamard.py`` and ``random_bits.py`` themselves::

    scalars:  S_enc, S_dec = formulas.global_scales(amax);  c = fl(S_enc * fl(1/6))      (per tile)
    [y = RHT(x): tiny groups at 2**64, one bf16 rounding]                            (COLS_RHT)
    bamax = max |y| over the 16            (ROWS, TILES_2D; COLS_RHT reads the RHT-amax kernel's)
    s8    = rnd(min(fl(bamax * c), 448), E4M3)
    enc   = min(fl(1 / fl(s8 * S_dec)), FLT_MAX)                per block, from integers
    k     = E2M1 code of fl(|y| * enc)     (RNE, or SR with random_bits' byte of the element)
    v     = ±grid(k) * s8                  written once (bf16)            (values_call)
    [or: k and the sign packed two per byte, s8's E4M3 byte]   (codes_call, rows_codes_call, tiles_call)

Differences of form from the XLA implementation, each exact: the encode scale per block
(``formulas.encode_from_e4m3_parts``) instead of a lookup in the 127-entry table (Triton has no gather; the
table is the same function of each E4M3 value); SR's two key words ``jax.random.bits(key, (2,), uint32)`` from
the Threefry key's words by jax's 20 rounds in the kernel (:func:`_threefry_bits2`: each of jax's own costs
XLA:GPU seconds of compile), after the key's deferred ``fold_in`` chain (``prng.FoldedKey``: one
``threefry2x32`` of ``(0, data)`` per fold); round half to even as :func:`_rint_nonnegative` (Triton has no
``round``); the RHT of a group's 16 rows elementwise, each output row ``hadamard.rht16_column`` (the matrix
entries as literals or from a loop index's bits: a kernel captures no array constant), its 16-term fp32 sums
left to right where XLA's form reduces in its own order: bit-exact wherever the sums do not depend on the
order (the RHT's contract). ``fl(|x| * enc)`` and the tiny-group upscale are the plain IEEE forms, as on
XLA:GPU (``xla_gpu_ftz`` off); on a flush-to-zero backend (the Pallas interpreter on a CPU) the exact forms
(``safe``; ``tests/core/test_nvfp4_gpu_paths.py`` checks the two agree).

On a GPU, Pallas's Triton lowering negates a float as ``0 - x`` and takes min/max as minnum/maxnum, unlike
XLA and Pallas's interpreter: the kernels use no float neg, min or max (``formats.negate_where``,
``copysign``, ``min_nan``; tested on the jaxprs).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from maxtext_nvfp4.core import formats
from maxtext_nvfp4.core.formats import E2M1, E4M3
from maxtext_nvfp4.core.quantizer import formulas, hadamard, random_bits

_BLOCK = formulas.BLOCK
# Tile: up to 16 rows x 16 blocks (4096 elements, 8 KiB of bf16 in): powers of two that divide the operand
# (Triton blocks are powers of two; dividing ones need no masking). Triton unrolls a tile's elements over
# the program's threads: larger tiles compile several times slower under SR (benchmarks/RESULTS.md, "Facts
# moved out of core/ comments").
_MAX_ROWS = 16
_MAX_BLOCKS = 16
# COLS_RHT: one group (16 rows) x up to this many columns; each row is a (cols,) array spread over the program's
# threads. 128 columns and 16 tiles per program were the fastest of the sizes timed on the H200 (same heading).
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


def _row_fraction(words, k_ref, shape, n_total: int):
  """ROWS, SR: ``u`` of each element of a (rows, blocks, 4, ...) tile -- each block's 16 elements as its 4 hash
  words of 4 (``random_bits``: the 4 consecutive elements along the last axis that share one word), the trailing
  axes the element's byte within its word, row-major -- in its slice's 2D view (T, N), from the shard's first
  (row, column) in ``k_ref``'s last two entries and the tile's place in the grid (batch, i, j). Each word is hashed
  once ((rows, blocks, 4, 1, ...)), not once per element; N (``n_total``) is a multiple of 16."""
  word_shape = shape[:3] + (1,) * (len(shape) - 3)
  a, b, w = (lax.broadcasted_iota(jnp.uint32, word_shape, d) for d in range(3))
  first_t, first_n = k_ref[k_ref.shape[0] - 2], k_ref[k_ref.shape[0] - 1]
  t = first_t + (pl.program_id(1) * shape[0]).astype(jnp.uint32) + a
  n0 = first_n + (pl.program_id(2) * shape[1]).astype(jnp.uint32) * np.uint32(_BLOCK)  # a multiple of 16
  word = t * np.uint32((n_total // 4) % 2**32) + n0 // np.uint32(4) + b * np.uint32(_BLOCK // 4) + w
  return random_bits.word_fraction(words, word, _row_major(shape, 3))  # the byte: its place in the trailing axes


def _row_major(shape, first: int):
  """Each element's row-major index over the axes ``first``.. of ``shape`` (uint32; size-1 elsewhere)."""
  idx = jnp.zeros((1,) * len(shape), jnp.uint32)
  for d in range(first, len(shape)):
    idx = idx * np.uint32(shape[d]) + lax.broadcasted_iota(
        jnp.uint32, (1,) * d + (shape[d],) + (1,) * (len(shape) - d - 1), d)
  return idx


def _group_fraction(words, k_ref, shape, n_total: int, by_word: bool):
  """COLS_RHT, SR: ``r -> u`` of row ``r`` of a group's tile, each row's elements ``shape`` (row-major: its
  columns), from the shard's first (row, column) in ``k_ref``'s last two entries and the tile's place in the grid
  (batch, i, j), taken here, outside the rows' loop. ``by_word``: ``shape`` is (words, ...), the trailing axes an
  element's byte within its hash word of 4 consecutive columns, and each word is hashed once ((words, 1, ...));
  else each element hashes its own word (a tile whose columns are not whole words: a shard of columns that is not
  a multiple of 4)."""
  first_t, first_n = k_ref[k_ref.shape[0] - 2], k_ref[k_ref.shape[0] - 1]
  t = first_t + (pl.program_id(1) * _BLOCK).astype(jnp.uint32)
  n0 = first_n + (pl.program_id(2) * math.prod(shape)).astype(jnp.uint32)
  if not by_word:
    n = n0 + _row_major(shape, 0)
    return lambda r: random_bits.fraction(words, t + r.astype(jnp.uint32), n, n_total)
  per_row = np.uint32((n_total // 4) % 2**32)
  w = n0 // np.uint32(4) + lax.broadcasted_iota(jnp.uint32, (shape[0],) + (1,) * (len(shape) - 1), 0)
  byte = _row_major(shape, 1)
  return lambda r: random_bits.word_fraction(words, (t + r.astype(jnp.uint32)) * per_row + w, byte)


def abs_bits(v):
  """|v|'s fp32 bits as int32 (their order is |v|'s: maxima by integer max, NaN above every number)."""
  return (formats.bits(v) & np.uint32(formats.F32_ABS_MASK)).astype(jnp.int32)


_threefry_bits2 = random_bits.threefry_bits2  # the kernels' Threefry (tests reach it here)


def _sr_words(k_ref, threefry: bool | None, folds: int):
  """SR's two key words (k0, k1) of this shard (:func:`random_bits.key_words`) from ``k_ref`` = (key word 0,
  key word 1, fold data 0 .. ``folds - 1``, zeros, first row, first column)."""
  return random_bits.key_words(lambda i: k_ref[i], threefry, folds)


def _int_max(vs):
  """Elementwise max of int32 arrays (Triton lowers an integer max exactly)."""
  m = vs[0]
  for v in vs[1:]:
    m = jnp.maximum(m, v)
  return m


def _rht_columns(x_ref, safe: bool):
  """The RHT (``hadamard``) of a kernel's (1, 16, ...) tile, one group, as ``(sums, back, plain)``: its 16 rows
  loaded on their own (tiny groups, max |x| < 2**-60, at 2**64 scale); ``sums(c)`` -> row c of the transform
  before its rounding (``hadamard.rht16_column``; ``c`` an int, or a ``fori_loop`` index), ``back(y)`` -> its one
  bf16 rounding at the true size (fp32 on the bf16 grid): the transform's row c is ``back(sums(c))``; ``plain``:
  each column's max |x| over the 16 rows as :func:`abs_bits` (the tiny test's, before the transform). Rows, not a
  (16, cols) tile: every step is elementwise, with no reduction across a tile axis (Triton moves those
  through shared memory); a loop over c, not 16 unrolled sums, keeps the kernel small enough for Triton to
  compile in seconds."""
  rows = [formats.to_f32_exact(x_ref[0, r]) for r in range(_BLOCK)]
  plain = _int_max([abs_bits(r) for r in rows])
  tiny = plain < int(np.float32(hadamard.TINY).view(np.int32))
  up = hadamard.upscale_flush_to_zero_safe if safe else hadamard.upscale_ieee
  xs = [up(r, tiny) for r in rows]
  return ((lambda c: hadamard.rht16_column(xs, c)), (lambda y: hadamard.round_back(y, tiny, rint=_rint_nonnegative)),
          plain)


def _rht_amax_bits(sums, back, shape):
  """Block maxima ``max_c |back(sums(c))|`` over the 16 transform rows as :func:`abs_bits` (int32, ``shape``),
  a NaN as the quiet NaN (as ``xla.block_amaxes``), computed as ``back(max_c |sums(c)|)``: the same value,
  as the rounding back is monotone and odd, with one rounding per column instead of 16."""
  m = lax.fori_loop(0, _BLOCK, lambda c, m: jnp.maximum(m, abs_bits(sums(c))), jnp.zeros(shape, jnp.int32))
  return formats.canonical_nan_bits(abs_bits(back(formats.from_bits(m))))  # back keeps NaN a NaN, Inf an Inf


def block_maxima_bits(bits):
  """Block maxima's :func:`abs_bits` (int32) as the uint16 high half the kernels exchange -- half the bytes: exact
  for values on the bf16 grid (the RHT's, ``hadamard.round_back``; a bf16 operand's), a NaN as the quiet NaN, Inf."""
  return lax.shift_right_logical(bits, 16).astype(jnp.uint16)


def block_maxima_values(half):
  """The fp32 values of :func:`block_maxima_bits`' uint16 halves."""
  return formats.from_bits(half.astype(jnp.uint32) << 16)


def _scalars(amax):
  """``(fl(S_enc * fl(1/6)), S_dec)`` of a slice's amax, computed in the kernel (a NaN S_dec as 1: the NaN
  scales then come from the first, as the XLA form's table lookup gives NaN). In the kernel, not in XLA: the
  chain's integer division is scalar work for a kernel, and XLA:GPU spends seconds compiling each copy."""
  s_enc, s_dec = formulas.global_scales(amax)
  return formulas.block_scale_factor(s_enc), jnp.where(jnp.isnan(s_dec), np.float32(1.0), s_dec)


def _block_scale(bamax, c, s_dec):
  """(s8, enc): the E4M3 block scale of block maxima ``bamax`` and its encode scale (NaN for a NaN amax)."""
  dec = formats.min_nan(formulas.mul_exact(bamax, c), np.float32(formulas.E4M3_MAX))
  s8 = formats.round_to_format(dec, E4M3, rint=_rint_nonnegative)
  s8 = jnp.where(jnp.isnan(dec), dec, s8)  # a NaN amax: NaN scales, as jnp.round keeps NaN
  k8, j8 = formulas.e4m3_parts(jnp.where(jnp.isnan(s8), np.float32(0.0), s8))
  return s8, jnp.where(jnp.isnan(s8), s8, formulas.encode_from_e4m3_parts(k8, j8, s_dec))


def _e2m1(y, enc, u, safe: bool):
  """(k, neg): E2M1 magnitude indices (fp32) and signs of fp32 ``y`` under encode scale ``enc``."""
  product = formulas.abs_times_enc_flush_to_zero_safe if safe else formulas.abs_times_enc_ieee
  return formulas.e2m1_code_of_product(y, enc, u, product=product, rint=_rint_nonnegative)


def _value(k, neg, s8):
  """``±grid(k) * s8`` (fp32, on x's grid)."""
  return formats.negate_where(formats.grid_value(k, E2M1), neg) * s8


def _codes_tile(xf, axis, c, s_dec, u, safe: bool):
  """(k, neg, s8): E2M1 magnitude indices (fp32), signs and block scales (fp32, the block dims kept) of a tile
  whose blocks lie along ``axis`` (one axis, or a tuple: 16x16 tiles)."""
  s8, enc = _block_scale(formats.from_bits(jnp.max(abs_bits(xf), axis=axis, keepdims=True)), c, s_dec)
  return (*_e2m1(xf, enc, u, safe), s8)


def _rht_block_scale(b_ref, sums, back, shape, c, s_dec):
  """(s8, enc) of a COLS_RHT tile's blocks: from the RHT-amax kernel's block maxima ``b_ref``, or (None: the
  amax came without them, :func:`rht_amax_call`'s maxima already reduced) from the tile's own transform rows,
  as that kernel computes them -- the same bits, for the RHT's arithmetic a second time instead of a stored
  array that lives from the amax pass to this one."""
  if b_ref is None:
    return _block_scale(formats.from_bits(_rht_amax_bits(sums, back, shape)), c, s_dec)
  return _block_scale(block_maxima_values(b_ref[0]), c, s_dec)


def _values_kernel(a_ref, *refs, layout: str, safe: bool, n_total: int, threefry: bool | None,
                   folds: int, sr: bool, maxima: bool = True, by_word: bool = False):
  refs = list(refs)
  k_ref = refs.pop(0) if sr else None
  b_ref = refs.pop(0) if layout == COLS_RHT and maxima else None  # the RHT-amax kernel's block maxima
  x_ref, v_ref = refs
  c, s_dec = _scalars(a_ref[0])
  words = None if k_ref is None else _sr_words(k_ref, threefry, folds)
  if layout == ROWS:  # a (rows, blocks, 4, 4) tile: each block's 16 elements as 4 hash words of 4
    xf = formats.to_f32_exact(x_ref[...])
    u = None if words is None else _row_fraction(words, k_ref, xf.shape, n_total)
    v_ref[...] = _value(*_codes_tile(xf, (2, 3), c, s_dec, u, safe)).astype(v_ref.dtype)
    return
  # COLS_RHT: a (1, 16, cols) tile, one group; SR: (1, 16, cols / 4, 4), each row's columns as hash words of 4
  sums, back, _ = _rht_columns(x_ref, safe)
  shape = x_ref.shape[2:]
  s8, enc = _rht_block_scale(b_ref, sums, back, shape, c, s_dec)
  fraction = None if words is None else _group_fraction(words, k_ref, shape, n_total, by_word)

  def row(r, carry):
    u = None if fraction is None else fraction(r)
    v_ref[0, r] = _value(*_e2m1(back(sums(r)), enc, u, safe), s8).astype(v_ref.dtype)
    return carry

  lax.fori_loop(0, _BLOCK, row, 0)


def _packed_codes(k, neg, *, pair_axis: int):
  """TE's bytes of a tile's codes: E2M1 codes two per byte along ``pair_axis`` (a column pair; even column in
  the low nibble, as ``tensor.pack``)."""
  codes = k.astype(jnp.int32) | (neg.astype(jnp.int32) << 3)
  nibble = lax.broadcasted_iota(jnp.int32, codes.shape, pair_axis) * 4
  return jnp.sum(codes << nibble, axis=pair_axis).astype(jnp.uint8)


def _scale_bytes(s8):
  """The E4M3 scales' bytes (a non-negative E4M3 grid value's bit pattern is its grid code; NaN: 0x7F, what a
  float8 cast gives)."""
  return jnp.where(jnp.isnan(s8), 0x7F, formulas.e4m3_code(s8)).astype(jnp.uint8)


def _codes_kernel(a_ref, *refs, safe: bool, n_total: int, threefry: bool | None, folds: int, sr: bool,
                  maxima: bool = True, by_word: bool = False):
  """COLS_RHT, RNE or SR, on a (1, 16, pairs, 2) tile of x viewed as (T/16, 16, N/2, 2) -- SR: (1, 16, pairs / 2,
  2, 2), each row's columns as hash words of 2 pairs -- TE's byte layout: E2M1 codes two per byte along the columns
  (even column in the low nibble, as ``tensor.pack``) and the E4M3 block scales' bytes; the same k, sign and s8 as
  :func:`_values_kernel`'s COLS_RHT tile (the same SR byte at each position). (The pair axis keeps a column's pair
  on one device: a sharding rule cannot relate N to N/2.)"""
  refs = list(refs)
  k_ref = refs.pop(0) if sr else None
  b_ref = refs.pop(0) if maxima else None
  x_ref, d_ref, e_ref = refs
  c, s_dec = _scalars(a_ref[0])
  sums, back, _ = _rht_columns(x_ref, safe)
  shape = x_ref.shape[2:]
  s8, enc = _rht_block_scale(b_ref, sums, back, shape, c, s_dec)
  words = None if k_ref is None else _sr_words(k_ref, threefry, folds)
  fraction = None if words is None else _group_fraction(words, k_ref, shape, n_total, by_word)

  def row(r, carry):
    u = None if fraction is None else fraction(r)
    d_ref[0, r] = _packed_codes(*_e2m1(back(sums(r)), enc, u, safe), pair_axis=len(shape) - 1)
    return carry

  lax.fori_loop(0, _BLOCK, row, 0)
  e_ref[0, 0] = _scale_bytes(s8)


def _rows_codes_kernel(a_ref, *refs, safe: bool, n_total: int, threefry: bool | None, folds: int, sr: bool):
  """ROWS, RNE or SR, on a (rows, blocks, 4, 2, 2) tile of x viewed as (R, K/16, 4, 2, 2) (each block's 16
  elements as 4 hash words of 2 column pairs): TE's byte layout -- E2M1 codes two per byte along K (even column in
  the low nibble, as ``tensor.pack``) and each block's E4M3 scale byte; the same k, sign and s8 as
  :func:`_values_kernel`'s ROWS tile (the same SR byte at each position)."""
  refs = list(refs)
  k_ref = refs.pop(0) if sr else None
  x_ref, d_ref, e_ref = refs
  c, s_dec = _scalars(a_ref[0])
  xf = formats.to_f32_exact(x_ref[...])
  u = None if k_ref is None else _row_fraction(_sr_words(k_ref, threefry, folds), k_ref, xf.shape, n_total)
  k, neg, s8 = _codes_tile(xf, (2, 3, 4), c, s_dec, u, safe)
  d_ref[...], e_ref[...] = _packed_codes(k, neg, pair_axis=4), _scale_bytes(s8)


def _tiles_kernel(a_ref, x_ref, d_ref, e_ref, *, safe: bool):
  """TILES_2D, RNE, on a (1, 16, tiles, 8, 2) tile of W viewed as (K/16, 16, N/16, 8, 2): each 16x16 tile's
  amax over its rows and its 8 column pairs, the E2M1 codes two per byte along the columns (even column in the
  low nibble) and the tile's E4M3 scale byte."""
  c, s_dec = _scalars(a_ref[0])
  k, neg, s8 = _codes_tile(formats.to_f32_exact(x_ref[...]), (1, 3, 4), c, s_dec, None, safe)
  d_ref[...], e_ref[...] = _packed_codes(k, neg, pair_axis=4), _scale_bytes(s8)


def _rht_amax_kernel(x_ref, m_ref, p_ref=None, *, safe: bool):
  """Per tile column: max |RHT(x)| bits over its group's 16 rows (the tensor amax's first step); with ``p_ref``
  also its max |x| bits over them (the plain amax's first step: both amaxes from one read of x, as TE's
  ``nvte_hadamard_transform_amax``)."""
  sums, back, plain = _rht_columns(x_ref, safe)
  m_ref[0, :] = block_maxima_bits(_rht_amax_bits(sums, back, (x_ref.shape[2],)))
  if p_ref is not None:
    p_ref[0, :] = plain if p_ref.dtype == jnp.int32 else block_maxima_bits(plain)


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
@functools.partial(jax.jit, static_argnames=("layout", "dtype", "safe", "interpret", "n_total", "threefry",
                                             "folds"))
def values_call(amax, keys, bmax, x3, *, layout: str, dtype, safe: bool, interpret: bool, n_total: int,
                 threefry: bool | None, folds: int):
  """The values kernel over the blocked operand ``x3`` (batch first); ``amax`` (batch, 1); ``keys``:
  SR's (key word 0, key word 1, ``folds`` fold data, zeros, first row, first column) per slice (batch, a power
  of two), or None (RNE); ``bmax``: COLS_RHT's block maxima (batch, groups, columns, uint16) from
  :func:`rht_amax_call`, or None (ROWS; COLS_RHT: the kernel takes them from its tiles); ``threefry`` and
  ``folds``: as :func:`random_bits.key_words`."""
  tile, grid, index = _tiles(layout, x3.shape)
  xk, by_word = x3, False
  bspec = pl.BlockSpec((None, 1, tile[-1]), lambda e, i, j: (e, i, j))
  # SR: the elements laid out by hash words of 4 (free reshapes outside), so that each word is hashed once
  if layout == ROWS:  # each block as 4 words of 4 (_row_fraction)
    xk, tile, index = x3.reshape(x3.shape[:3] + (4, 4)), tile[:2] + (4, 4), lambda e, i, j: (e, i, j, 0, 0)
  elif keys is not None and tile[2] % 4 == 0:  # each row's columns as words of 4 (_group_fraction)
    by_word = True
    xk, tile, index = (x3.reshape(x3.shape[:3] + (x3.shape[3] // 4, 4)), (1, _BLOCK, tile[2] // 4, 4),
                       lambda e, i, j: (e, i, 0, j, 0))
    bmax = None if bmax is None else bmax.reshape(bmax.shape[:2] + (bmax.shape[2] // 4, 4))
    bspec = pl.BlockSpec((None, 1, tile[2], 4), lambda e, i, j: (e, i, j, 0))
  per_slice = [a for a in (amax, keys) if a is not None]
  in_specs = [_per_slice(a) for a in per_slice]
  if bmax is not None:
    in_specs.append(bspec)
  operands = per_slice + [a for a in (bmax, xk) if a is not None]
  return pl.pallas_call(
      functools.partial(_values_kernel, layout=layout, safe=safe, n_total=n_total, threefry=threefry,
                        folds=folds, sr=keys is not None, maxima=bmax is not None, by_word=by_word),
      out_shape=jax.ShapeDtypeStruct(xk.shape, dtype),
      grid=grid,
      in_specs=in_specs + [pl.BlockSpec((None,) + tile, index)],
      out_specs=pl.BlockSpec((None,) + tile, index),
      interpret=interpret,
      name=f"nvfp4_values_{layout}" + ("" if keys is None else "_sr"),
  )(*operands).reshape(x3.shape)


@functools.partial(jax.jit, static_argnames=("safe", "interpret", "plain"))
def rht_amax_call(x3, *, safe: bool, interpret: bool, plain: bool = False):
  """Per (group, column) tile maxima of |RHT(x)| as :func:`block_maxima_bits` (uint16): (batch, groups, cols);
  with ``plain`` also those of |x|, from the same read of x: the same shape, as :func:`block_maxima_bits` for a
  bf16 x (exact), else as :func:`abs_bits` (int32)."""
  tile, grid, index = _tiles(COLS_RHT, x3.shape)
  shape = (x3.shape[0], x3.shape[1], x3.shape[3])
  plain_dtype = jnp.uint16 if x3.dtype == jnp.bfloat16 else jnp.int32
  maxima = (jax.ShapeDtypeStruct(shape, jnp.uint16), jax.ShapeDtypeStruct(shape, plain_dtype))
  spec = pl.BlockSpec((None, 1, tile[2]), lambda e, i, j: (e, i, j))
  out = pl.pallas_call(
      functools.partial(_rht_amax_kernel, safe=safe),
      out_shape=maxima[:1 + plain],
      grid=grid,
      in_specs=[pl.BlockSpec((None,) + tile, index)],
      out_specs=(spec,) * (1 + plain),
      interpret=interpret,
      name="nvfp4_rht_amaxes" if plain else "nvfp4_rht_amax",
  )(x3)
  return out if plain else out[0]


@functools.partial(jax.jit, static_argnames=("safe", "interpret", "n_total", "threefry", "folds"))
def codes_call(amax, keys, bmax, x4, *, safe: bool, interpret: bool, n_total: int = 0, threefry: bool | None = None,
               folds: int = 0):
  """(packed codes (batch, groups, 16, pairs) uint8, scale bytes (batch, groups, 1, pairs, 2) uint8) of x4
  (batch, groups, 16, pairs, 2); ``amax`` (batch, 1); ``keys``: SR's per-slice words as :func:`values_call`'s, or
  None (RNE); ``bmax``: the block maxima (batch, groups, pairs, 2, uint16) from :func:`rht_amax_call`, or None
  (the kernel takes them from its tiles)."""
  e, g, _, pairs, _ = x4.shape
  tp = _pow2_tile(pairs, _MAX_RHT_COLS // 2)
  per_slice = [a for a in (amax, keys) if a is not None]
  maxima = [] if bmax is None else [bmax]
  # SR: each row's pairs as hash words of 2 pairs (free reshapes outside), so that each word is hashed once
  by_word = keys is not None and tp % 2 == 0
  w = (2,) if by_word else ()  # the pairs of a word
  lead = (pairs // 2,) if by_word else (pairs,)  # words (or pairs) per row
  t = (tp // 2,) if by_word else (tp,)
  z = (0,) * len(w)
  index = lambda b, i, j: (b, i, 0, j, *z, 0)  # noqa: E731
  packed, scale_bytes = pl.pallas_call(
      functools.partial(_codes_kernel, safe=safe, n_total=n_total, threefry=threefry, folds=folds,
                        sr=keys is not None, maxima=bmax is not None, by_word=by_word),
      out_shape=(jax.ShapeDtypeStruct((e, g, _BLOCK, *lead, *w), jnp.uint8),
                 jax.ShapeDtypeStruct((e, g, 1, *lead, *w, 2), jnp.uint8)),
      grid=(e, g, pairs // tp),
      in_specs=[_per_slice(a) for a in per_slice]
      + [pl.BlockSpec((None, 1, *t, *w, 2), lambda b, i, j: (b, i, j, *z, 0))] * len(maxima)
      + [pl.BlockSpec((None, 1, _BLOCK, *t, *w, 2), index)],
      out_specs=(pl.BlockSpec((None, 1, _BLOCK, *t, *w), lambda b, i, j: (b, i, 0, j, *z)),
                 pl.BlockSpec((None, 1, 1, *t, *w, 2), index)),
      interpret=interpret,
      name="nvfp4_codes_cols_rht" + ("" if keys is None else "_sr"),
  )(*per_slice, *(m.reshape(e, g, *lead, *w, 2) for m in maxima), x4.reshape(e, g, _BLOCK, *lead, *w, 2))
  return packed.reshape(e, g, _BLOCK, pairs), scale_bytes.reshape(e, g, 1, pairs, 2)


@functools.partial(jax.jit, static_argnames=("safe", "interpret", "n_total", "threefry", "folds"))
def rows_codes_call(amax, keys, x5, *, safe: bool, interpret: bool, n_total: int, threefry: bool | None, folds: int):
  """(packed codes (batch, R, K/16, 8) uint8, scale bytes (batch, R, K/16, 1, 1) uint8) of x viewed as x5
  (batch, R, K/16, 8, 2): 1x16 blocks along the last axis (:data:`ROWS`); ``amax`` (batch, 1); ``keys``: SR's
  per-slice words as :func:`values_call`'s, or None (RNE). The kernel sees each block as 4 hash words of 2 column
  pairs (:func:`_rows_codes_kernel`; free reshapes outside)."""
  batch, rows, blocks, _, _ = x5.shape
  t = (_pow2_tile(rows, _MAX_ROWS), _pow2_tile(blocks, _MAX_BLOCKS))
  per_slice = [a for a in (amax, keys) if a is not None]
  index = lambda e, i, j: (e, i, j, 0, 0, 0)  # noqa: E731
  packed, scale_bytes = pl.pallas_call(
      functools.partial(_rows_codes_kernel, safe=safe, n_total=n_total, threefry=threefry, folds=folds,
                        sr=keys is not None),
      out_shape=(jax.ShapeDtypeStruct((batch, rows, blocks, 4, 2), jnp.uint8),
                 jax.ShapeDtypeStruct((batch, rows, blocks, 1, 1, 1), jnp.uint8)),
      grid=(batch, rows // t[0], blocks // t[1]),
      in_specs=[_per_slice(a) for a in per_slice] + [pl.BlockSpec((None,) + t + (4, 2, 2), index)],
      out_specs=(pl.BlockSpec((None,) + t + (4, 2), lambda e, i, j: (e, i, j, 0, 0)),
                 pl.BlockSpec((None,) + t + (1, 1, 1), index)),
      interpret=interpret,
      name="nvfp4_codes_rows" + ("" if keys is None else "_sr"),
  )(*per_slice, x5.reshape(batch, rows, blocks, 4, 2, 2))
  return packed.reshape(batch, rows, blocks, 8), scale_bytes.reshape(batch, rows, blocks, 1, 1)


@functools.partial(jax.jit, static_argnames=("safe", "interpret"))
def tiles_call(amax, x6, *, safe: bool, interpret: bool):
  """(packed codes (batch, K/16, 16, N/16, 8) uint8, scale bytes (batch, K/16, 1, N/16, 1, 1) uint8) of W viewed
  as x6 (batch, K/16, 16, N/16, 8, 2); ``amax`` (batch, 1)."""
  e, g, _, nt, _, _ = x6.shape
  tt = _pow2_tile(nt, _MAX_TILES)
  index = lambda b, i, j: (b, i, 0, j, 0, 0)  # noqa: E731
  return pl.pallas_call(
      functools.partial(_tiles_kernel, safe=safe),
      out_shape=(jax.ShapeDtypeStruct((e, g, _BLOCK, nt, 8), jnp.uint8),
                 jax.ShapeDtypeStruct((e, g, 1, nt, 1, 1), jnp.uint8)),
      grid=(e, g, nt // tt),
      in_specs=[_per_slice(amax), pl.BlockSpec((None, 1, _BLOCK, tt, 8, 2), index)],
      out_specs=(pl.BlockSpec((None, 1, _BLOCK, tt, 8), lambda b, i, j: (b, i, 0, j, 0)),
                 pl.BlockSpec((None, 1, 1, tt, 1, 1), index)),
      interpret=interpret,
      name="nvfp4_codes_tiles_2d",
  )(amax, x6)
