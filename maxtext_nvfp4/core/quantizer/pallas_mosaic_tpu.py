"""Implementation "mosaic_tpu": the quantizer as Pallas (Mosaic TPU) kernels, the same bits as implementation "xla" in
two passes over the operand, laid out on TPU tiles.

XLA:TPU cannot keep the XLA form's (..., 16)-blocked views in its (8, 128)-tiled layouts: it materializes them
(a minor dimension of 16 pads to 128 lanes), copies between layouts, and writes fp32 temporaries of the operand's
size (``benchmarks/RESULTS.md``). Here::

    pass 1:   amax = max |x|  (XLA's reduce of the bits)  or  max |RHT(x)|  (COLS_RHT: a kernel's per-group maxima,
              int32 per 16 elements, then XLA's max over them)
    pass 2:   one kernel (``mosaic_tpu_kernels.py``): the per-tensor chain and the SR key words in the kernel, then
              block scales, codes and values of whole blocks, written once

Layouts (:func:`values_layout`, :func:`codes_layout`), TE's standard rule: :data:`ROWS` -- 1x16 blocks along the
last axis of any operand (x for fprop, dy for dgrad); :data:`COLS` / :data:`COLS_RHT` -- 1x16 blocks along axis 0
of a 2D operand, without / with the RHT (x and dy for wgrad); :data:`TILES_2D` -- 16x16 tiles of a 2D operand
(W). ``quantize_values`` writes the values in the operand's dtype; ``quantize`` writes each E2M1 value as an E4M3
byte (exact; the kernels store no 4-bit type) and XLA converts it to ``float4_e2m1fn`` (0.5 byte per
element), and the E4M3 scales directly. Round to nearest or stochastic rounding (``random_bits``' bytes of each
element's position; the key's ``fold_in`` chain and Threefry bits computed in the kernel). An operand whose
shape does not tile (below) takes the XLA form.

Batched (``batched=True``: ``vmap``'s batch of independent operands, MoE's experts): the grid's first axis runs
over the slices, each with its own amax and SR key. Sharded operands: ``custom_partitioning`` runs the kernel on
each device's shard with the whole operand's amax and the shard's global SR positions; a dimension whose shard is
not whole tiles is gathered first.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from maxtext_nvfp4.core import formats
from maxtext_nvfp4.core.quantizer import mosaic_tpu_kernels as kernels
from maxtext_nvfp4.core.quantizer import pallas_triton, random_bits
from maxtext_nvfp4.core.quantizer.formulas import BLOCK as _BLOCK
from maxtext_nvfp4.core.quantizer.formulas import E4M3_MAX, ScaleRule
from maxtext_nvfp4.core.quantizer.mosaic_tpu_kernels import COLS, COLS_RHT, ROWS, TILES_2D
from maxtext_nvfp4.core.quantizer.tensor import NVFP4Tensor

__all__ = ["COLS", "COLS_RHT", "ROWS", "TILES_2D", "codes_layout", "quantize", "quantize_values", "values_layout"]

# Tile sizes (rows x columns of the operand's 2D view), the first of each list that divides the dimension. A
# kernel's body is straight-line vector code over the whole tile (Mosaic unrolls it over the (8, 128) registers),
# so the tile sets its compile time and its VMEM: 32K elements (32 f32 registers per value) for the 1x16 layouts;
# 16x16 tiles need 2048 columns (their scales' block is (rows / 16, 128 lanes)) and 8 groups (8 sublanes).
_ROWS_TILE = ((128,), (256, 128))  # ROWS: (rows, columns); the transposed tile has the rows along the lanes
_COLS_TILE = ((256, 128), (128,))  # COLS / COLS_RHT: (16 * groups, columns)
_TILES_TILE = ((128,), (2048,))  # TILES_2D
# A dimension that no listed size divides is one tile when it is at most this long (rows, columns): a block as
# long as the array's dimension is what Mosaic takes besides multiples of (8, 128); W's columns up to 4096.
_WHOLE = {ROWS: (512, 512), COLS: (512, 512), COLS_RHT: (512, 512), TILES_2D: (512, 4096)}


def _pick(n: int, sizes, multiple: int, whole: int) -> int | None:
  """The first of ``sizes`` dividing ``n``, else ``n`` itself when it is at most ``whole`` long (a
  whole-dimension block) and a multiple of ``multiple``, else None."""
  for s in sizes:
    if n % s == 0:
      return s
  return n if n <= whole and n % multiple == 0 else None


def tile_for(layout: str, rows: int, cols: int) -> tuple[int, int] | None:
  """The kernel's tile (rows, columns) of a (rows, cols) slice, or None when none fits."""
  sizes = {ROWS: _ROWS_TILE, COLS: _COLS_TILE, COLS_RHT: _COLS_TILE, TILES_2D: _TILES_TILE}[layout]
  r = _pick(rows, sizes[0], 1 if layout == ROWS else _BLOCK, _WHOLE[layout][0])
  c = _pick(cols, sizes[1], _BLOCK if layout in (ROWS, TILES_2D) else 1, _WHOLE[layout][1])
  return None if r is None or c is None else (r, c)


# ----------------------------------------------------------------------------------------------
# Which calls the kernels take
# ----------------------------------------------------------------------------------------------
def _layout(x, axis_n, block_2d: bool, rht: bool, rule: ScaleRule) -> tuple[str | None, str | None]:
  refusal = pallas_triton.operand_refusal(x, rule)  # the same operands as the Triton kernels'
  if refusal:
    return None, refusal
  if block_2d:
    if x.ndim != 2:
      return None, "16x16 tiles of an operand that is not a 2D matrix"
    layout, rows, cols = TILES_2D, x.shape[0], x.shape[1]
  elif not rht and axis_n == x.ndim - 1:
    layout, rows, cols = ROWS, math.prod(x.shape[:-1]), x.shape[-1]
  elif x.ndim == 2 and axis_n == 0:
    layout, rows, cols = (COLS_RHT if rht else COLS), x.shape[0], x.shape[1]
  else:
    return None, ("RHT along an axis other than axis 0 of a 2D operand" if rht
                  else "1x16 blocks along an axis other than the last (or axis 0 of a 2D operand)")
  if tile_for(layout, rows, cols) is None:
    return None, f"an operand of shape {tuple(x.shape)} that does not tile ({layout}: see pallas_mosaic_tpu)"
  return layout, None


def values_layout(x, axis_n, block_2d: bool, rht: bool, rule: ScaleRule) -> tuple[str | None, str | None]:
  """``(layout, None)`` for the kernel layout that computes this ``quantize_values`` call, else ``(None, why
  not)``: the XLA form."""
  return _layout(x, axis_n, block_2d, rht, rule)


def codes_layout(x, axis_n, block_2d: bool, rht: bool, rule: ScaleRule,
                 stochastic: bool = False) -> tuple[str | None, str | None]:
  """``(layout, None)`` for the kernel layout that computes this ``quantize`` call (TE's layout: E2M1 data and
  E4M3 scales), else ``(None, why not)``."""
  del stochastic  # the codes kernels round stochastically as well
  return _layout(x, axis_n, block_2d, rht, rule)


# ----------------------------------------------------------------------------------------------
# The amax, the keys and the sharding around the kernel
# ----------------------------------------------------------------------------------------------
def _view(x, layout: str, batched: bool):
  """x as the kernel's x3 (batch first): (B, T, N) for ROWS, (B, T/16, 16, N) otherwise."""
  xb = x if batched else x[None]
  if layout == ROWS:
    return xb.reshape(xb.shape[0], -1, xb.shape[-1])
  return xb.reshape(xb.shape[0], xb.shape[1] // _BLOCK, _BLOCK, xb.shape[2])


def _amax_bits(x3, layout: str, interpret: bool):
  """Each slice's max |x| (or |RHT(x)|) as fp32 bits (batch,) int32, a NaN as the quiet NaN."""
  if layout == COLS_RHT:
    maxima = _partitioned_rht_maxima(interpret)(x3)
    return jnp.max(maxima, axis=(1, 2))  # non-negative bits: int32 order is |x|'s
  bits = formats.canonical_nan_bits(kernels.abs_bits(formats.to_f32_exact(x3))).astype(jnp.uint32)
  # uint32 (the same order for these non-negative bits) as pallas_triton's: one reduction emitter, no extra program
  return lax.bitcast_convert_type(jnp.max(bits, axis=tuple(range(1, x3.ndim))), jnp.int32)


def _tile_of(layout: str, x3_shape):
  """The tile of an x3 (per device: a shard's)."""
  if layout == ROWS:
    return tile_for(layout, x3_shape[1], x3_shape[2])
  return tile_for(layout, x3_shape[1] * _BLOCK, x3_shape[3])


def _seeds_with_origin(seeds, t0, n0):
  """(batch, 2 + F + 2) uint32: the key words and fold data, then the shard's first row and column."""
  origin = jnp.stack([jnp.asarray(t0, jnp.uint32), jnp.asarray(n0, jnp.uint32)])
  return jnp.concatenate([seeds, jnp.broadcast_to(origin, (seeds.shape[0], 2))], axis=1)


def _call(layout: str, *, dtype, codes: bool, n_total: int, threefry, folds: int, sr: bool, interpret: bool):
  """The kernel of one device: ``(amax_bits, seeds, x3) -> outputs`` (``seeds`` with the shard's origin)."""

  def run(amax_bits, seeds, x3):
    tile = _tile_of(layout, x3.shape)
    return kernels.quantize_call(amax_bits, seeds, x3, layout=layout, tile=tile, dtype=dtype, codes=codes,
                                 n_total=n_total, threefry=threefry, folds=folds, sr=sr, interpret=interpret)
  return run


def _x3_spec(layout: str, spec, x3_shape, mesh) -> PartitionSpec:
  """x3's partition spec with the block axis whole and every sharded dimension's shard whole tiles (else that
  dimension gathered)."""
  spec = tuple(spec) + (None,) * (len(x3_shape) - len(tuple(spec)))

  def size(axes):
    if axes is None:
      return 1
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))

  if layout == ROWS:
    b, t, n = spec
    t = t if x3_shape[1] % size(t) == 0 else None
    n = n if x3_shape[2] % (size(n) * _BLOCK) == 0 else None
    local = (x3_shape[1] // size(t), x3_shape[2] // size(n))
    if tile_for(layout, *local) is None:
      t, n = None, None
    return PartitionSpec(b, t, n)
  b, g, _, n = spec
  g = g if x3_shape[1] % size(g) == 0 else None
  n = n if x3_shape[3] % size(n) == 0 else None
  local = (x3_shape[1] // size(g) * _BLOCK, x3_shape[3] // size(n))
  if tile_for(layout, *local) is None:
    g, n = None, None
  return PartitionSpec(b, g, None, n)




def _partitioned(layout: str, **kw):
  """:func:`_call` under ``custom_partitioning``: each device runs the kernel on its shard of x3 with its slice's
  amax and its shard's first (row, column) in the seeds."""
  run = _call(layout, **kw)
  codes = kw["codes"]

  def out_shardings(mesh, x_spec):
    spec = tuple(x_spec)
    if not codes:
      return NamedSharding(mesh, x_spec)
    if layout == ROWS:
      scale = PartitionSpec(spec[0], spec[2], spec[1])  # (B, N/16, T)
    elif layout == TILES_2D:
      scale = PartitionSpec(spec[0], spec[1], spec[3])
    else:
      scale = PartitionSpec(spec[0], spec[1], spec[3])
    return (NamedSharding(mesh, x_spec), NamedSharding(mesh, scale))

  def lower(mesh, x_spec):
    spec = tuple(x_spec)

    def on_shard(amax_bits, seeds, x3):
      if layout == ROWS:
        t0 = random_bits.shard_start(mesh, spec[1], x3.shape[1])
        n0 = random_bits.shard_start(mesh, spec[2], x3.shape[2])
      else:
        t0 = random_bits.shard_start(mesh, spec[1], x3.shape[1] * _BLOCK)
        n0 = random_bits.shard_start(mesh, spec[3], x3.shape[3])
      width = seeds.shape[1]
      col = lax.broadcasted_iota(jnp.uint32, seeds.shape, 1)
      seeds = seeds + jnp.where(col == width - 2, t0, np.uint32(0)) + jnp.where(col == width - 1, n0, np.uint32(0))
      return run(amax_bits, seeds, x3)
    return on_shard

  call = custom_partitioning(lambda amax_bits, seeds, x3: run(amax_bits, seeds, x3))

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    x = arg_shapes[2]
    return out_shardings(mesh, _x3_spec(layout, x.sharding.spec, x.shape, mesh))

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    x = arg_shapes[2]
    x_spec = _x3_spec(layout, x.sharding.spec, x.shape, mesh)
    per_slice = NamedSharding(mesh, PartitionSpec(x_spec[0]))
    seeds = NamedSharding(mesh, PartitionSpec(x_spec[0], None))
    return mesh, lower(mesh, x_spec), out_shardings(mesh, x_spec), (per_slice, seeds, NamedSharding(mesh, x_spec))

  if layout == ROWS:
    rule = "b, b s, b t n -> b t n" if not codes else "b, b s, b t n -> b t n, b k t"
  elif layout == TILES_2D:
    rule = "b, b s, b g r n -> b g r n" if not codes else "b, b s, b g r n -> b g r n, b g k"
  else:
    rule = "b, b s, b g r n -> b g r n" if not codes else "b, b s, b g r n -> b g r n, b g n"
  call.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                     need_replication_factors=("s", "r") if layout != ROWS else ("s",))
  return call


def _partitioned_rht_maxima(interpret: bool):
  """``kernels.rht_maxima_call`` under ``custom_partitioning``: each device's shard's group maxima (the max over
  them, across devices, is XLA's)."""

  def run(x3):
    return kernels.rht_maxima_call(x3, tile=_tile_of(COLS_RHT, x3.shape), interpret=interpret)

  call = custom_partitioning(run)

  def out_sharding(mesh, x_spec):
    return NamedSharding(mesh, PartitionSpec(x_spec[0], x_spec[1], x_spec[3]))

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    x = arg_shapes[0]
    return out_sharding(mesh, _x3_spec(COLS_RHT, x.sharding.spec, x.shape, mesh))

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    x = arg_shapes[0]
    x_spec = _x3_spec(COLS_RHT, x.sharding.spec, x.shape, mesh)
    return mesh, run, out_sharding(mesh, x_spec), (NamedSharding(mesh, x_spec),)

  call.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule="b g r n -> b g n",
                     need_replication_factors=("r",))
  return call


def _run(x, layout: str, stochastic_key, *, codes: bool, dtype, batched: bool, key_batched: bool,
         interpret: bool):
  """(outputs, amax per slice) of the kernel on x."""
  x3 = _view(x, layout, batched)
  amax_bits = _amax_bits(x3, layout, interpret)
  seeds, threefry = random_bits.kernel_seeds(stochastic_key, x3.shape[0], key_batched)
  folds = seeds.shape[1] - 2
  seeds = _seeds_with_origin(seeds.astype(jnp.uint32), 0, 0)
  n_total = x3.shape[-1]
  call = _partitioned(layout, dtype=jnp.dtype(dtype), codes=codes, n_total=n_total, threefry=threefry, folds=folds,
                      sr=stochastic_key is not None, interpret=interpret)
  out = call(amax_bits, seeds, x3)
  return out, lax.bitcast_convert_type(amax_bits, jnp.float32)


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------
def quantize_values(x, dtype, layout: str, stochastic_key=None, *, batched: bool = False,
                    key_batched: bool = False, interpret: bool = False):
  """``(values, amax)`` of ``quantize_values(x, ...)`` for the call :func:`values_layout` gave ``layout``.

  ``batched``: x's leading axis is a batch of independent operands (``vmap``'s: one amax and one SR key per slice;
  the amax comes back per slice), ``key_batched``: one key per slice (else the one key for every slice).
  ``interpret``: run the kernel through Pallas's interpreter (any backend: the tests on a CPU).
  """
  values, amax = _run(x, layout, stochastic_key, codes=False, dtype=dtype, batched=batched, key_batched=key_batched,
                      interpret=interpret)
  return values.reshape(x.shape), (amax if batched else amax[0])


def quantize(x, layout: str, stochastic_key=None, *, batched: bool = False, key_batched: bool = False,
             interpret: bool = False) -> NVFP4Tensor:
  """``quantize(x, ...)``'s NVFP4Tensor for the call :func:`codes_layout` gave ``layout`` (arguments as
  :func:`quantize_values`; batched: every field with the leading batch axis)."""
  (data8, scale), amax = _run(x, layout, stochastic_key, codes=True, dtype=jnp.float8_e4m3fn, batched=batched,
                              key_batched=key_batched, interpret=interpret)
  xb_shape = x.shape if batched else (1,) + x.shape
  data = data8.astype(jnp.float4_e2m1fn).reshape(xb_shape)  # exact: E2M1 values, E4M3 bytes
  if layout == ROWS:
    scale = jnp.swapaxes(scale, 1, 2).reshape(xb_shape[:-1] + (xb_shape[-1] // _BLOCK,))
  if not batched:
    data, scale, amax = data[0], scale[0], amax[0]
  tiles = layout == TILES_2D
  axis = None if tiles else (x.ndim - (1 if batched else 0) - 1 if layout == ROWS else 0)
  return NVFP4Tensor(data=data, scale=scale, amax=amax, axis=axis, block_2d=tiles,
                     rht=layout == COLS_RHT, e4m3_bound=E4M3_MAX)
