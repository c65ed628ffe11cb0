"""The Pallas (Mosaic TPU) kernels of implementation "mosaic_tpu" (``pallas_mosaic_tpu.py``): for a tile of whole
16-element blocks, in VMEM, the formulas of ``formulas.py``, ``hadamard.py`` and ``random_bits.py``::

    scalars:  S_enc, S_dec = formulas.global_scales(amax);  c = fl(S_enc * fl(1/6))      (per tile, scalar unit)
    [y = RHT(x) along the 16 rows of each group: tiny groups at 2**64, one bf16 rounding]    (COLS_RHT)
    bamax = max |y| over the block (16 values, or 16x16 for TILES_2D)
    s8    = rnd(min(fl(bamax * c), 448), E4M3)
    enc   = min(fl(1 / fl(s8 * S_dec)), FLT_MAX)                per block, from integers
    k     = E2M1 code of fl(|y| * enc)     (RNE, or SR with random_bits' byte of the element)
    v     = ±grid(k) * s8                  written once (bf16)                     (values_call)
    [or: ±grid(k) as E4M3 bytes (1 byte per element) and s8 as E4M3]           (codes_call)

TPU tiles: a vector register holds 8 sublanes x 128 lanes, so a 16-element block along the last axis (the lane
axis) would fill an eighth of a register. Every tile is therefore computed as ``y3`` (g, 16, L) with its blocks
along the middle (sublane) axis: the block maxima are sublane reductions and the block-level arrays (g, L) are
dense. :data:`COLS` / :data:`COLS_RHT` read x's tile (16g, L) as it lies (blocks along x's axis 0: (g, 16, L) is
the same memory); :data:`ROWS` (blocks along x's last axis) transposes its (L, 16g) tile in VMEM and the results
back; :data:`TILES_2D` (W's 16x16 tiles) takes the sublane maxima and then the maxima of 16 lanes.

Independent of flush-to-zero (TPUs flush fp32 subnormals): no fp32 arithmetic here reads or makes a subnormal
number, so these bits are the same on a TPU, in Pallas's interpreter on a CPU and under IEEE
arithmetic: bf16 widens by bits, block and tensor maxima are integer maxima of the bits, the per-tensor chain
and the encode scales are integer arithmetic on significands (division only as a seed,
``formats.divide_significands``), ``fl(bamax * c)`` and ``fl(|x| * enc)`` take the exact forms of
:func:`formulas.scale_product_normal` and :func:`formulas.abs_times_enc_normal`, and the RHT's tiny-group paths
scale by powers of two before any sum. XLA:CPU flushes fp32 subnormals as a TPU does (operands and results), so
the shared suite's subnormal and tiny input kinds, run through the interpreter on a CPU, check this
(``tests/core/test_quantizer_implementations.py``). No inexact product feeds a sum (FMA contraction cannot change
a bit).
The RHT's 16-term sums run left to right (``hadamard.rht16_column``, as the Triton kernels): the XLA form's bits
wherever the sums do not depend on their order (the RHT's contract).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from maxtext_nvfp4.core import formats
from maxtext_nvfp4.core.formats import E2M1, E4M3
from maxtext_nvfp4.core.quantizer import formulas, hadamard, random_bits

_BLOCK = formulas.BLOCK

# Layouts: how a tile's blocks lie in x (the kernel's view of a 2D slice (T, N) of x, batch first)
ROWS = "rows"  # blocks along the last axis (x for fprop, dy for dgrad): tile (tr, 16g), transposed in VMEM
COLS = "cols"  # blocks along axis 0: tile (16g, L) = (g, 16, L)
COLS_RHT = "cols_rht"  # blocks along axis 0, the RHT along them first (x and dy for wgrad)
TILES_2D = "tiles_2d"  # 16x16 tiles (W): tile (16g, L)
LAYOUTS = (ROWS, COLS, COLS_RHT, TILES_2D)


# ----------------------------------------------------------------------------------------------
# The tile's arithmetic (pure functions of arrays: the kernels load and store around them)
# ----------------------------------------------------------------------------------------------

def _pltpu():
  """``jax.experimental.pallas.tpu``, imported on first use: importing it installs absl's flag-reload import hook,
  which importing the quantizer must not (tests/integration/test_plugin_config.py)."""
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=import-outside-toplevel

  return pltpu

def abs_bits(v):
  """|v|'s fp32 bits as int32 (their order is |v|'s: maxima by integer max, NaN above every number)."""
  return (formats.bits(v) & np.uint32(formats.F32_ABS_MASK)).astype(jnp.int32)


def tensor_scalars(amax):
  """``(c, S_dec)`` = ``(fl(S_enc * fl(1/6)), S_dec)`` of a slice's amax (NaN amax: NaN ``c``, S_dec 1; the NaN
  scales then come from ``c``). Integer arithmetic on significands (``formulas.global_scales``); ``c`` is a
  normal number (``S_enc >= 2688 / FLT_MAX``)."""
  s_enc, s_dec = formulas.global_scales(amax)
  return formulas.block_scale_factor(s_enc), jnp.where(formats.is_nan_bits(s_dec), np.float32(1.0), s_dec)


def block_scales(bamax, c, s_dec):
  """(s8, enc): the E4M3 block scale of block maxima ``bamax`` and its encode scale (NaN for a NaN amax)."""
  dec = formats.min_nan(formulas.scale_product_normal(bamax, c), np.float32(formulas.E4M3_MAX))
  s8 = formats.round_to_format(dec, E4M3)  # NaN stays NaN
  k8, j8 = formulas.e4m3_parts(jnp.where(jnp.isnan(s8), np.float32(0.0), s8))
  return s8, jnp.where(jnp.isnan(s8), s8, formulas.encode_from_e4m3_parts(k8, j8, s_dec))


def element_codes(y, enc, u):
  """(k, neg): E2M1 magnitude indices (fp32) and signs of fp32 ``y`` under encode scale ``enc`` (RNE; SR with
  ``u``), with the product ``fl(|y| * enc)`` in its subnormal-free form."""
  return formulas.e2m1_code_of_product(y, enc, u, product=formulas.abs_times_enc_normal)


def element_value(k, neg):
  """``±grid(k)``: the signed E2M1 value (fp32; exact in E4M3)."""
  return formats.negate_where(formats.grid_value(k, E2M1), neg)


def block_max_bits(y3, axis: int = 1):
  """The block maxima of ``|y3|`` along ``axis`` as fp32 bits (int32, the axis dropped)."""
  return jnp.max(abs_bits(y3), axis=axis)


def lane_group_max_bits(m):
  """Maxima of each 16 consecutive lanes of the int32 (g, L) ``m``: (g, L / 16) (TILES_2D's second step)."""
  g, lanes = m.shape
  return jnp.max(m.reshape(g, lanes // _BLOCK, _BLOCK), axis=2)


def lane_group_broadcast(a):
  """(g, L / 16) -> (g, L): each value repeated over its 16 lanes (the inverse of :func:`lane_group_max_bits`)."""
  g, n = a.shape
  return jnp.broadcast_to(a[:, :, None], (g, n, _BLOCK)).reshape(g, n * _BLOCK)


def rht_tile(x3):
  """The RHT along axis 1 of the fp32 (g, 16, L) ``x3`` (16-element groups along the sublanes), fp32 on the bf16
  grid: groups whose max |x| is below 2**59 at 2**64 scale (``hadamard.upscale_normal``: no subnormal operand or
  partial sum), ``y[:, c] = (...(x[:, 0] m[0, c] + x[:, 1] m[1, c]) + ...) + x[:, 15] m[15, c]`` -- the terms and
  the left-to-right order of ``hadamard.rht16_column``, all 16 columns at once (row r broadcast over the sublanes,
  the ±0.25 entries from a (1, 16, L) iota) -- and one bf16 rounding at the true size
  (``hadamard.round_back_normal``)."""
  bits = abs_bits(x3)
  scaled = jnp.max(bits, axis=1, keepdims=True) < int(np.float32(hadamard.SCALED_BELOW).view(np.int32))
  xs = hadamard.upscale_normal(x3, scaled, bits)
  c = lax.broadcasted_iota(jnp.int32, (1, _BLOCK, x3.shape[2]), 1)
  acc = xs[:, 0:1, :] * hadamard.rht_entry(0, c)
  for r in range(1, _BLOCK):
    acc = acc + xs[:, r:r + 1, :] * hadamard.rht_entry(r, c)
  return hadamard.round_back_normal(acc, scaled)


# ----------------------------------------------------------------------------------------------
# SR positions: each element's (row, column) in its slice's 2D view (T, N)
# ----------------------------------------------------------------------------------------------
def _positions_3d(layout: str, shape, t0, n0):
  """(t, n) uint32 of every element of a (g, 16, L) tile whose first element is x[t0, n0]: COLS/TILES_2D
  (16g rows, L columns of x) or ROWS (the transpose of a (L rows, 16g columns) tile of x)."""
  gi, r, lane = (lax.broadcasted_iota(jnp.uint32, shape, d) for d in range(3))
  within = gi * np.uint32(_BLOCK) + r
  if layout == ROWS:
    return t0 + lane, n0 + within
  return t0 + within, n0 + lane


# ----------------------------------------------------------------------------------------------
# The kernels
# ----------------------------------------------------------------------------------------------
def _scalars_of(amax_ref, b):
  """(c, S_dec) of slice ``b`` from the prefetched amax bits (int32)."""
  return tensor_scalars(lax.bitcast_convert_type(amax_ref[b], jnp.float32))


def _seed_word(seeds_ref, b, width: int, i: int):
  """Entry ``i`` of slice ``b``'s seeds (key words, fold data, the shard's first row and column) as uint32."""
  return lax.bitcast_convert_type(seeds_ref[b * width + i], jnp.uint32)


def _tile_origin(seeds_ref, b, width: int, tile):
  """(t0, n0): the tile's first row and column in its slice's 2D view (uint32): the shard's origin (the seeds'
  last two entries) plus the tile's place in the grid."""
  i, j = pl.program_id(1).astype(jnp.uint32), pl.program_id(2).astype(jnp.uint32)
  t0 = _seed_word(seeds_ref, b, width, width - 2) + i * np.uint32(tile[0])
  n0 = _seed_word(seeds_ref, b, width, width - 1) + j * np.uint32(tile[1])
  return t0, n0


def _kernel(amax_ref, seeds_ref, x_ref, *out_refs, layout: str, tile, sr: bool, codes: bool, n_total: int,
            threefry, folds: int, width: int):
  """One tile: ``values`` (``codes`` False) or (E2M1 values as E4M3 bytes, E4M3 scales) of x's tile."""
  b = pl.program_id(0)
  c, s_dec = _scalars_of(amax_ref, b)
  words, t0, n0 = None, None, None
  if sr:
    words = random_bits.key_words(lambda i: _seed_word(seeds_ref, b, width, i), threefry, folds)
    t0, n0 = _tile_origin(seeds_ref, b, width, tile)
  if layout == ROWS:
    xt = formats.to_f32_exact(x_ref[...]).T  # (16g, L): blocks along sublanes
    y3 = xt.reshape(xt.shape[0] // _BLOCK, _BLOCK, xt.shape[1])
  else:
    y3 = formats.to_f32_exact(x_ref[...])  # (g, 16, L)
    if layout == COLS_RHT:
      y3 = rht_tile(y3)
  m = block_max_bits(y3)  # (g, L)
  if layout == TILES_2D:
    mb = lane_group_max_bits(m)  # (g, L / 16)
    s8b, encb = block_scales(formats.from_bits(mb), c, s_dec)
    s8, enc = lane_group_broadcast(s8b), lane_group_broadcast(encb)
  else:
    s8, enc = block_scales(formats.from_bits(m), c, s_dec)
  u = random_bits.fraction(words, *_positions_3d(layout, y3.shape, t0, n0), n_total) if sr else None
  k, neg = element_codes(y3, enc[:, None, :], u)
  v = element_value(k, neg)
  if not codes:
    v = v * s8[:, None, :]
  if layout == ROWS:
    out_refs[0][...] = v.reshape(xt.shape).T.astype(out_refs[0].dtype)
  else:
    out_refs[0][...] = v.astype(out_refs[0].dtype)
  if codes:
    out_refs[1][...] = (s8b if layout == TILES_2D else s8).astype(out_refs[1].dtype)


def _grid_and_specs(layout: str, shape, tile):
  """(grid, x's BlockSpec, an element output's BlockSpec, the scales' (shape, BlockSpec)) of x3 ``shape``
  (batch first) and ``tile`` (rows, columns of the slice's 2D view)."""
  batch = shape[0]
  if layout == ROWS:
    _, t, n = shape
    tr, tc = tile
    grid = (batch, t // tr, n // tc)
    x_spec = pl.BlockSpec((None, tr, tc), lambda b, i, j, *_: (b, i, j))
    # the scales transposed: (N/16, T) (the kernel's block-level arrays are (16g/16, tr))
    scales = ((batch, n // _BLOCK, t), pl.BlockSpec((None, tc // _BLOCK, tr), lambda b, i, j, *_: (b, j, i)))
    return grid, x_spec, x_spec, scales
  _, groups, _, n = shape
  tt, tc = tile
  g = tt // _BLOCK
  grid = (batch, groups // g, n // tc)
  x_spec = pl.BlockSpec((None, g, _BLOCK, tc), lambda b, i, j, *_: (b, i, 0, j))
  if layout == TILES_2D:
    scales = ((batch, groups, n // _BLOCK), pl.BlockSpec((None, g, tc // _BLOCK), lambda b, i, j, *_: (b, i, j)))
  else:
    scales = ((batch, groups, n), pl.BlockSpec((None, g, tc), lambda b, i, j, *_: (b, i, j)))
  return grid, x_spec, x_spec, scales


@functools.partial(jax.jit, static_argnames=("layout", "tile", "dtype", "codes", "n_total", "threefry", "folds",
                                             "sr", "interpret"))
def quantize_call(amax_bits, seeds, x3, *, layout: str, tile, dtype, codes: bool, n_total: int, threefry,
                  folds: int, sr: bool, interpret: bool):
  """The kernel over ``x3``: (batch, T, N) for ROWS, (batch, T/16, 16, N) otherwise. ``amax_bits`` (batch,) int32;
  ``seeds`` (batch, 2 + folds) uint32 (:func:`random_bits.kernel_seeds`; unused without ``sr``). Returns the
  values in ``dtype`` (x3's shape), or (``codes``) the E2M1 values as float8_e4m3fn (x3's shape) and the E4M3
  scales: (batch, N/16, T) for ROWS (transposed), (batch, T/16, N) for COLS*, (batch, T/16, N/16) for TILES_2D."""
  grid, x_spec, out_spec, (scale_shape, scale_spec) = _grid_and_specs(layout, x3.shape, tile)
  width = seeds.shape[1]
  out_shape = [jax.ShapeDtypeStruct(x3.shape, jnp.float8_e4m3fn if codes else dtype)]
  out_specs = [out_spec]
  if codes:
    out_shape.append(jax.ShapeDtypeStruct(scale_shape, jnp.float8_e4m3fn))
    out_specs.append(scale_spec)
  kernel = functools.partial(_kernel, layout=layout, tile=tile, sr=sr, codes=codes, n_total=n_total,
                             threefry=threefry, folds=folds, width=width)
  grid_spec = _pltpu().PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=grid, in_specs=[x_spec],
                                           out_specs=out_specs if codes else out_specs[0])
  seeds32 = lax.bitcast_convert_type(seeds.astype(jnp.uint32), jnp.int32).reshape(-1)
  return pl.pallas_call(
      kernel,
      out_shape=tuple(out_shape) if codes else out_shape[0],
      grid_spec=grid_spec,
      compiler_params=_pltpu().CompilerParams(dimension_semantics=("parallel",) * 3),
      interpret=interpret,
      name=f"nvfp4_{'codes' if codes else 'values'}_{layout}" + ("_sr" if sr else ""),
  )(amax_bits, seeds32, x3)


def _rht_max_kernel(x_ref, m_ref):
  """Per tile: each group's max |RHT(x)| bits (a NaN as the quiet NaN), (g, L) int32."""
  m_ref[...] = block_max_bits(formats.canonical_nan_bits(abs_bits(rht_tile(formats.to_f32_exact(x_ref[...])))))


@functools.partial(jax.jit, static_argnames=("tile", "interpret"))
def rht_maxima_call(x3, *, tile, interpret: bool):
  """Each group's max |RHT(x)| as fp32 bits, (batch, T/16, N) int32 (a NaN as the quiet NaN), of x3 (batch,
  T/16, 16, N): 4 bytes per 16 elements written; the slice's amax is XLA's max over them (across devices when x is
  sharded)."""
  batch, groups, _, n = x3.shape
  tt, tc = tile
  g = tt // _BLOCK
  return pl.pallas_call(
      _rht_max_kernel,
      out_shape=jax.ShapeDtypeStruct((batch, groups, n), jnp.int32),
      grid=(batch, groups // g, n // tc),
      in_specs=[pl.BlockSpec((None, g, _BLOCK, tc), lambda b, i, j: (b, i, 0, j))],
      out_specs=pl.BlockSpec((None, g, tc), lambda b, i, j: (b, i, j)),
      compiler_params=_pltpu().CompilerParams(dimension_semantics=("parallel",) * 3),
      interpret=interpret,
      name="nvfp4_rht_amax",
  )(x3)
