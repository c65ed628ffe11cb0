"""Implementation "triton": the GEMM operands x, dy and W quantized by Pallas (Triton) kernels on XLA:GPU, the
same bits as implementation "xla" in two passes over the operand instead of four or more.

XLA cannot fuse a reduction into its consumer, so the XLA form writes the block maxima, reads them back for the
tensor amax and for a block-level kernel, which writes ``s8`` and ``enc`` for the element pass to read (the RHT
operand also writes and reads the transform). Here::

    pass 1:   amax = max |x|  (XLA reduce; ROWS, TILES_2D)  or  max |RHT(x)|  (COLS_RHT: a kernel writes the
              block maxima, uint16, 1/16 of the elements, and XLA reduces them); or both at once (:func:`amaxes`,
              given to the calls of pass 2, whose RHT kernels then take the block maxima from their own tiles)
    pass 2:   the kernels of ``triton_kernels.py``: scales, codes and values of whole blocks, written once

Layouts (:func:`values_layout`, :func:`codes_layout`): :data:`ROWS` -- ``quantize_values`` or ``quantize`` in
1x16 blocks along the last axis (x for fprop, dy for dgrad; ``quantize`` where the GEMM reads codes); :data:`COLS_RHT` -- 1x16 blocks along axis 0 of a 2D operand with
RHT (dy for wgrad with ``quantize_values``, x's 4-bit copy for wgrad with ``quantize``); :data:`TILES_2D` --
``quantize``'s 16x16 tiles of a 2D operand (W for fprop and dgrad). TE's standard rule only; for every other
call the layout functions say why not, and ``api`` takes the XLA form.

Sharded operands: ``custom_partitioning`` runs the kernels on each device's shard (blocks stay whole: the
16 axis is never split) with its slice's amax, the same on every shard of the slice, so the amax is the whole
operand's; SR positions are the global ones (the shard's first row and column from the mesh axis indices).
Batched (``batched=True``: ``vmap``'s batch of independent operands, MoE's experts): the grid's first axis
runs over the slices, each with its own amax, SR key and SR positions, the batch axis shardable like any
other. An operand whose type carries a sharding (an Explicit mesh axis) has no kernel: ``pallas_call`` takes
unsharded types. Pallas's Triton backend is deprecated in jax 0.12 (in favour of Mosaic GPU); it still lowers
and compiles, on a GPU and deviceless for one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from maxtext_nvfp4.core import formats
from maxtext_nvfp4.core.quantizer import random_bits
from maxtext_nvfp4.core.quantizer import triton_kernels as kernels
from maxtext_nvfp4.core.quantizer.formulas import BLOCK as _BLOCK
from maxtext_nvfp4.core.quantizer.formulas import E4M3_MAX, STANDARD_RULE, ScaleRule
from maxtext_nvfp4.core.quantizer.tensor import NVFP4Tensor
from maxtext_nvfp4.core.quantizer.triton_kernels import COLS_RHT, ROWS, TILES_2D

__all__ = ["COLS_RHT", "ROWS", "TILES_2D", "amaxes", "codes_layout", "explicitly_sharded", "quantize", "quantize_codes",
           "quantize_values", "values_layout"]


# ----------------------------------------------------------------------------------------------
# Which calls the kernels take
# ----------------------------------------------------------------------------------------------
def explicitly_sharded(x) -> bool:
  """x's type carries a sharding (an Explicit mesh axis): left to XLA, pallas_call takes unsharded types only."""
  return any(p is not None for p in getattr(getattr(jax.typeof(x), "sharding", None), "spec", ()) or ())


def operand_refusal(x, rule: ScaleRule) -> str | None:
  """Why no kernel takes this operand at all (None: every kernel could): TE's standard rule, a non-empty bf16
  or fp32 operand whose type carries no sharding."""
  if rule != STANDARD_RULE:
    return "a scale rule other than TE's standard one (4over6, row-scaled or E4M3 bound 256)"
  if explicitly_sharded(x):
    return "an operand whose type carries a sharding (an Explicit mesh axis; pallas_call takes unsharded types)"
  if x.size == 0:
    return "an empty operand"
  if x.dtype not in (jnp.bfloat16, jnp.float32):
    return f"a {x.dtype} operand (the kernels take bf16 or fp32)"
  return None


def values_layout(x, axis_n, block_2d: bool, rht: bool, rule: ScaleRule) -> tuple[str | None, str | None]:
  """``(layout, None)`` for the kernel layout that computes this ``quantize_values`` call -- 1x16 blocks along
  the last axis (:data:`ROWS`), or with RHT along axis 0 of a 2D operand whose columns are a multiple of 4
  (:data:`COLS_RHT`) -- else ``(None, why not)``: the XLA form."""
  if block_2d:
    return None, "quantize_values in 16x16 tiles (the tile kernel writes quantize's codes)"
  refusal = operand_refusal(x, rule)
  if refusal:
    return None, refusal
  if not rht:
    if x.ndim >= 1 and axis_n == x.ndim - 1:
      return ROWS, None
    return None, "1x16 blocks along an axis other than the last without RHT"
  if x.ndim != 2 or axis_n != 0:
    return None, "RHT along an axis other than axis 0 of a 2D operand"
  if x.shape[1] % 4:
    return None, "an RHT operand whose column count is not a multiple of 4"
  return COLS_RHT, None


def codes_layout(x, axis_n, block_2d: bool, rht: bool, rule: ScaleRule,
                 stochastic: bool = False) -> tuple[str | None, str | None]:
  """``(layout, None)`` for the kernel layout that computes this ``quantize`` call in TE's byte layout -- 1x16
  blocks along the last axis (:data:`ROWS`: x for fprop, dy for dgrad), RHT along axis 0 of a 2D operand whose
  columns are a multiple of 4 (:data:`COLS_RHT`: x and dy for wgrad), both round to nearest or stochastic, or
  16x16 tiles of a 2D operand (:data:`TILES_2D`: W), round to nearest -- else ``(None, why not)``: the XLA form."""
  refusal = operand_refusal(x, rule)
  if refusal:
    return None, refusal
  if not block_2d and not rht and x.ndim >= 1 and axis_n == x.ndim - 1:
    return ROWS, None
  if block_2d:
    if stochastic:
      return None, "16x16 tiles with stochastic rounding (the tile kernel rounds to nearest)"
    if rht or x.ndim != 2 or x.shape[0] % _BLOCK or x.shape[1] % _BLOCK:
      return None, "16x16 tiles of an operand that is not a 2D matrix"
    return TILES_2D, None
  if not rht:
    return None, "quantize in 1x16 blocks along an axis other than the last without RHT"
  return values_layout(x, axis_n, block_2d, rht, rule)


# ----------------------------------------------------------------------------------------------
# The amaxes, sharding and keys around the kernels
# ----------------------------------------------------------------------------------------------
def _slice_amax_bits(xb):
  """Each slice's max |x| (batch first) as :func:`kernels.abs_bits` (a NaN as the quiet NaN), uint32: XLA's
  reduce, before the kernels. In uint32 (the same order for these non-negative bits): XLA:GPU sends an int32
  max's last step (a few thousand partial maxima to a scalar) to a Triton fusion of its own, one more program
  to compile for each quantizer; a uint32 max stays on its own reduction emitter."""
  bits = formats.canonical_nan_bits(kernels.abs_bits(formats.to_f32_exact(xb))).astype(jnp.uint32)
  return jnp.max(bits, axis=tuple(range(1, xb.ndim)))


def _partitioned_encoder(encode, rank: int, rule: str, replicated: tuple[str, ...], lower=None):
  """``encode(amax, [seeds, bmax,] xn) -> (packed codes, scale bytes)`` under ``custom_partitioning``: each device
  encodes its own shard of xn (batch, groups, 16, columns, ...), sharded along the batch, the groups and the
  columns only (a block's 16 rows and a column pair stay together); ``bmax`` (batch, groups, columns, ...),
  when the rule names it, sharded as xn without its 16 axis; the codes have xn's rank minus one, the scale
  bytes xn's rank, both sharded as xn. ``lower(mesh, xn's spec)``, when given: the per-shard function (else
  ``encode``)."""
  call = custom_partitioning(encode)

  def specs(arg_shapes):
    x_spec = tuple(arg_shapes[-1].sharding.spec)
    x_spec = x_spec + (None,) * (rank - len(x_spec))
    a, g, h = x_spec[0], x_spec[1], x_spec[3]
    rest = (None,) * (rank - 4)
    # per-slice (batch, n) operands (amax, SR seeds), then block maxima sharded as x without its 16 axis
    ins = [PartitionSpec(a, None) if len(s.shape) == 2 else PartitionSpec(a, g, h, *rest) for s in arg_shapes[:-1]]
    x = PartitionSpec(a, g, None, h, *rest)
    return ins + [x], PartitionSpec(a, g, None, h, *(None,) * (rank - 5)), x

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    _, d, e = specs(arg_shapes)
    return NamedSharding(mesh, d), NamedSharding(mesh, e)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    ins, d, e = specs(arg_shapes)
    return (mesh, encode if lower is None else lower(mesh, tuple(ins[-1])),
            (NamedSharding(mesh, d), NamedSharding(mesh, e)),
            tuple(NamedSharding(mesh, s) for s in ins))

  call.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                     need_replication_factors=replicated)
  return call


def _partitioned_tiles(safe: bool, interpret: bool):
  """``kernels.tiles_call`` per device: W's row tiles and column tiles shardable, a tile's 16 rows and 8 column
  pairs together."""
  return _partitioned_encoder(lambda amax, x6: kernels.tiles_call(amax, x6, safe=safe, interpret=interpret), 6,
                              "a s, a g r h p q -> a g r h p, a g o h u v", ("s", "r", "p", "q"))


def _partitioned_codes(safe: bool, interpret: bool, sr: bool = False, n_total: int = 0,
                       threefry: bool | None = None, maxima: bool = True):
  """``kernels.codes_call`` per device: groups and column pairs shardable, the 16 rows of a group and the 2
  columns of a pair together; the block maxima (``maxima``; else the kernel takes them from its tiles) sharded
  as x4 without its 16 axis; SR positions the global ones (:func:`_shard_keys`: groups of 16 rows on x4's dim 1,
  pairs of columns on its dim 3)."""

  def on_shard(amax, seeds, bmax, x4, mesh=None, spec=(None,) * 5):
    keys = _shard_keys(seeds, x4.shape, mesh, spec, rows=(1, _BLOCK), cols=(3, 2)) if sr else None
    return kernels.codes_call(amax, keys, bmax, x4, safe=safe, interpret=interpret, n_total=n_total,
                              threefry=threefry, folds=seeds.shape[1] - 2)

  # custom_partitioning binds every parameter of its function: four, or three without the block maxima
  if maxima:
    def encode(amax, seeds, bmax, x4):
      return on_shard(amax, seeds, bmax, x4)

    return _partitioned_encoder(encode, 5, "a s, a t, a g h p, a g e h p -> a g e h, a g o h p",
                                ("s", "t", "p", "e"),  # need_replication: in the rule's order
                                lower=lambda mesh, spec: lambda s, k, b, x: on_shard(s, k, b, x, mesh, spec))

  def encode_tiles(amax, seeds, x4):
    return on_shard(amax, seeds, None, x4)

  return _partitioned_encoder(encode_tiles, 5, "a s, a t, a g e h p -> a g e h, a g o h p", ("s", "t", "e", "p"),
                              lower=lambda mesh, spec: lambda s, k, x: on_shard(s, k, None, x, mesh, spec))




def _x3_spec(layout: str, spec):
  """x3's partition spec (batch first) with the 16-element block axis unsharded (blocks stay whole on every
  device)."""
  spec = tuple(spec) + (None,) * (4 - len(tuple(spec)))
  return (PartitionSpec(spec[0], spec[1], spec[2], None) if layout == ROWS
          else PartitionSpec(spec[0], spec[1], None, spec[3]))


def _shard_keys(seeds, shape, mesh, spec, rows=(1, 1), cols=(2, _BLOCK)):
  """The kernels' SR words of a shard: ``seeds`` (batch, 2 + F) padded to a power of two >= 2 + F + 2 (Triton's
  blocks), the shard's first row and column (global positions, from the mesh axis indices) in the last two
  entries. ``shape`` / ``spec``: the shard's blocked operand and its partition spec; ``rows`` / ``cols``: (dim,
  elements per index) of its rows and columns (ROWS' x3: rows on dim 1, blocks of 16 columns on dim 2)."""
  t0, n0 = (random_bits.shard_start(mesh, spec[d], shape[d]) * np.uint32(unit) for d, unit in (rows, cols))
  width = 1 << (seeds.shape[1] + 1).bit_length()
  keys = jnp.pad(seeds, ((0, 0), (0, width - seeds.shape[1])))
  col = lax.broadcasted_iota(jnp.uint32, keys.shape, 1)  # elementwise: XLA fuses it with the seeds' producer
  return keys + jnp.where(col == width - 2, t0, np.uint32(0)) + jnp.where(col == width - 1, n0, np.uint32(0))


def _partitioned_row_codes(safe: bool, interpret: bool, sr: bool, n_total: int, threefry: bool | None):
  """``kernels.rows_codes_call`` under ``custom_partitioning``: x5 (batch, R, K/16, 8, 2) shardable along the
  batch, the rows and the blocks (a block's 8 pairs together), each shard with its slice's amax and the global SR
  positions of its elements (:func:`_shard_keys`), as :func:`_partitioned_values`' ROWS."""

  def on_shard(amax, seeds, x5, mesh=None, spec=(None, None, None, None, None)):
    keys = _shard_keys(seeds, x5.shape, mesh, spec) if sr else None
    return kernels.rows_codes_call(amax, keys, x5, safe=safe, interpret=interpret, n_total=n_total,
                                   threefry=threefry, folds=seeds.shape[1] - 2)

  call = custom_partitioning(lambda amax, seeds, x5: on_shard(amax, seeds, x5))

  def specs(x_spec):
    x_spec = tuple(x_spec) + (None,) * (5 - len(tuple(x_spec)))
    a, r, b = x_spec[:3]
    return PartitionSpec(a, r, b, None, None), PartitionSpec(a, r, b, None), PartitionSpec(a, None)

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    x, d, _ = specs(arg_shapes[-1].sharding.spec)
    return NamedSharding(mesh, d), NamedSharding(mesh, x)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    x, d, per_slice = specs(arg_shapes[-1].sharding.spec)
    lower = lambda s, k, x5: on_shard(s, k, x5, mesh, tuple(x))  # noqa: E731
    return (mesh, lower, (NamedSharding(mesh, d), NamedSharding(mesh, x)),
            (NamedSharding(mesh, per_slice), NamedSharding(mesh, per_slice), NamedSharding(mesh, x)))

  call.def_partition(partition=partition, infer_sharding_from_operands=infer,
                     sharding_rule="a s, a t, a r b p q -> a r b p, a r b u v",
                     need_replication_factors=("s", "t", "p", "q"))
  return call


def _partitioned_values(layout: str, dtype, safe: bool, interpret: bool, sr: bool, n_total: int,
                        threefry: bool | None, maxima: bool = True):
  """``kernels.values_call`` under ``custom_partitioning``: each device quantizes its own shard's whole blocks
  with its slice's amax; SR positions are the global ones (the shard's first row and column, from the mesh
  axis indices), so the SR bits do not depend on the mesh, as the XLA form's iotas do not. ``seeds``:
  (batch, 2 + F), each slice's key words and F fold data (:func:`_seeds`); COLS_RHT's call also takes the
  RHT-amax kernel's block maxima (batch, groups, columns) before x3, sharded as x3 (``maxima``; else the
  kernel takes them from its tiles)."""

  def on_shard(amax, seeds, bmax, x3, mesh=None, spec=(None, None, None, None)):
    keys = _shard_keys(seeds, x3.shape, mesh, spec, *(() if layout == ROWS else ((1, _BLOCK), (3, 1)))) if sr else None
    return kernels.values_call(amax, keys, bmax, x3, layout=layout, dtype=dtype, safe=safe, interpret=interpret,
                               n_total=n_total, threefry=threefry, folds=seeds.shape[1] - 2)

  # custom_partitioning binds every parameter of its function: three or four
  block_maxima = layout == COLS_RHT and maxima
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

  rule = ("a s, a t, a r b e -> a r b e" if layout == ROWS else
          "a s, a t, a g c, a g e c -> a g e c" if block_maxima else "a s, a t, a g e c -> a g e c")
  call.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                     need_replication_factors=("s", "t", "e"))
  return call


def _rht_block_maxima(x3, safe: bool, interpret: bool):
  """(block maxima (batch, groups, columns) as :func:`kernels.block_maxima_bits`, each slice's max |RHT(x)| (batch,)
  as :func:`kernels.abs_bits`), a NaN as the quiet NaN: the RHT-amax kernel's output and XLA's max over it (in
  uint32, as :func:`_slice_amax_bits`)."""
  bmax = _partitioned_rht_amax(safe, interpret)(x3)
  return bmax, _max_of_block_maxima(bmax)


def _max_of_block_maxima(bmax):
  """Each slice's max of its uint16 block maxima, as fp32 bits (uint32)."""
  return jnp.max(bmax.astype(jnp.uint32) << 16, axis=(1, 2))


def _partitioned_rht_amax(safe: bool, interpret: bool, plain: bool = False):
  """``kernels.rht_amax_call`` under ``custom_partitioning``: tile maxima of each device's shard (the caller's
  max over them is XLA's, across devices); ``plain``: also those of |x|, sharded alike."""

  def run(x3):
    return kernels.rht_amax_call(x3, safe=safe, interpret=interpret, plain=plain)

  call = custom_partitioning(run)

  def out_sharding(mesh, x_spec):
    one = NamedSharding(mesh, PartitionSpec(x_spec[0], x_spec[1], x_spec[3]))
    return (one, one) if plain else one

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    return out_sharding(mesh, _x3_spec(COLS_RHT, arg_shapes[0].sharding.spec))

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    x_spec = _x3_spec(COLS_RHT, arg_shapes[0].sharding.spec)
    return mesh, run, out_sharding(mesh, x_spec), (NamedSharding(mesh, x_spec),)

  call.def_partition(partition=partition, infer_sharding_from_operands=infer,
                     sharding_rule="a g e c -> a g c, a g c" if plain else "a g e c -> a g c",
                     need_replication_factors=("e",))
  return call


def amaxes(x, *, batched: bool = False, key_batched: bool = False, flush_to_zero_safe: bool = False,
           interpret: bool = False):
  """``(max |x|, max |RHT(x)|)`` of a 2D x (T, N) (``batched``: (E, T, N), each slice its own) from one kernel
  pass over x (:func:`kernels.rht_amax_call` with ``plain``): the amax of x's 1x16 quantizations without RHT and
  that of ``quantize(x, axis=0, rht=True)``. Given to :func:`quantize_codes` / :func:`quantize_values`, the RHT
  kernels then take their block maxima from their own tiles, so nothing but the two scalars lives between this
  pass and theirs. ``key_batched``: unused (the dispatch's vmap rule passes it); the other flags as
  :func:`quantize_values`."""
  del key_batched
  xb = x if batched else x[None]
  e, t, n = xb.shape
  bmax, plain = _partitioned_rht_amax(flush_to_zero_safe, interpret, plain=True)(
      xb.reshape(e, t // _BLOCK, _BLOCK, n))
  plain = plain.astype(jnp.uint32) << 16 if plain.dtype == jnp.uint16 else plain.astype(jnp.uint32)
  amax = formats.from_bits(jnp.max(formats.canonical_nan_bits(plain), axis=(1, 2)))
  rht_amax = formats.from_bits(_max_of_block_maxima(bmax))
  return (amax, rht_amax) if batched else (amax[0], rht_amax[0])


def _given(amax, batched: bool):
  """A given amax (from :func:`amaxes`) batch first, (batch,); None when none was given."""
  return amax if amax is None or batched else amax[None]


_seeds = random_bits.kernel_seeds


# ----------------------------------------------------------------------------------------------
# Entry points
# ----------------------------------------------------------------------------------------------
def quantize_values(x, dtype, layout: str, stochastic_key=None, *, amax=None, batched: bool = False,
                    key_batched: bool = False, flush_to_zero_safe: bool = False, interpret: bool = False):
  """``(values, amax)`` of ``quantize_values(x, axis=..., rht=..., stochastic_key=..., dtype=dtype)`` for
  the call :func:`values_layout` gave ``layout``; ``amax``: this call's amax from :func:`amaxes` (max |x| for
  :data:`ROWS`, max |RHT(x)| for :data:`COLS_RHT`; batched alike), which then replaces its own amax pass.

  ``batched``: x's leading axis is a batch of independent operands (``vmap``'s: one amax, one SR key and the
  SR positions of each slice; the amax comes back per slice), ``key_batched``: one key per slice (else the one
  key for every slice). ``flush_to_zero_safe``: the element product and the RHT's tiny-group upscale in their
  exact forms for a flush-to-zero backend (interpret mode on a CPU: the tests); default the plain IEEE forms
  (XLA:GPU keeps subnormals). ``interpret``: run the kernels through Pallas's interpreter (any backend).
  """
  xb = x if batched else x[None]
  e = xb.shape[0]
  given = _given(amax, batched)
  if layout == ROWS:
    x3 = xb.reshape(e, -1, x.shape[-1] // _BLOCK, _BLOCK)
    maxima = []
    amax = formats.from_bits(_slice_amax_bits(xb)) if given is None else given
  elif given is None:
    x3 = xb.reshape(e, xb.shape[1] // _BLOCK, _BLOCK, xb.shape[2])
    bmax, amax_bits = _rht_block_maxima(x3, flush_to_zero_safe, interpret)
    amax, maxima = formats.from_bits(amax_bits), [bmax]
  else:
    x3 = xb.reshape(e, xb.shape[1] // _BLOCK, _BLOCK, xb.shape[2])
    amax, maxima = given, []
  seeds, threefry = _seeds(stochastic_key, e, key_batched)
  call = _partitioned_values(layout, jnp.dtype(dtype), flush_to_zero_safe, interpret, stochastic_key is not None,
                             x.shape[-1], threefry, maxima=bool(maxima))
  values = call(amax[:, None], seeds, *maxima, x3).reshape(x.shape)
  return values, (amax if batched else amax[0])


def quantize_codes(x, layout: str = COLS_RHT, stochastic_key=None, *, amax=None, batched: bool = False,
                   key_batched: bool = False, flush_to_zero_safe: bool = False, interpret: bool = False):
  """``(packed, scale_bytes, amax)`` of ``quantize(x, axis=-1, stochastic_key=...)`` (:data:`ROWS`, x (..., K)),
  ``quantize(x, axis=0, rht=True)`` (:data:`COLS_RHT`) or ``quantize(x, block_2d=True)`` (:data:`TILES_2D`) for a
  :func:`codes_layout` operand (x (T, N) for the last two): the E2M1 codes two per byte along the last axis
  ((..., K/2), (T, N/2)) uint8, the E4M3 scales' bytes ((..., K/16), (T/16, N), or (T/16, N/16) for tiles) uint8,
  the amax (post-RHT). ``batched``: x's leading axis is a batch of operands, each its own (each result gets the
  leading batch axis); ``amax`` (not for TILES_2D), ``key_batched``, ``flush_to_zero_safe`` and ``interpret``:
  as :func:`quantize_values`."""
  xb = x if batched else x[None]
  given = _given(amax, batched)
  if layout == ROWS:
    e, k = xb.shape[0], xb.shape[-1]
    amax = formats.from_bits(_slice_amax_bits(xb)) if given is None else given
    seeds, threefry = _seeds(stochastic_key, e, key_batched)
    x5 = xb.reshape(e, -1, k // _BLOCK, _BLOCK // 2, 2)
    packed, scale_bytes = _partitioned_row_codes(flush_to_zero_safe, interpret, stochastic_key is not None, k,
                                                 threefry)(amax[:, None], seeds, x5)
    packed, scale_bytes = packed.reshape(xb.shape[:-1] + (k // 2,)), scale_bytes.reshape(xb.shape[:-1] + (k // _BLOCK,))
    return (packed, scale_bytes, amax) if batched else (packed[0], scale_bytes[0], amax[0])
  e, t, n = xb.shape
  if layout == TILES_2D:
    if given is not None:
      raise ValueError("quantize_codes: 16x16 tiles take no given amax (amaxes() is for 1x16 blocks)")
    if stochastic_key is not None:
      raise ValueError("quantize_codes: 16x16 tiles with stochastic rounding (the tile kernel rounds to nearest)")
    amax = formats.from_bits(_slice_amax_bits(xb))
    x6 = xb.reshape(e, t // _BLOCK, _BLOCK, n // _BLOCK, 8, 2)
    packed, scale_bytes = _partitioned_tiles(flush_to_zero_safe, interpret)(amax[:, None], x6)
    packed, scale_bytes = packed.reshape(e, t, n // 2), scale_bytes.reshape(e, t // _BLOCK, n // _BLOCK)
    return (packed, scale_bytes, amax) if batched else (packed[0], scale_bytes[0], amax[0])
  if given is None:
    bmax, amax_bits = _rht_block_maxima(xb.reshape(e, t // _BLOCK, _BLOCK, n), flush_to_zero_safe, interpret)
    amax, maxima = formats.from_bits(amax_bits), [bmax.reshape(e, t // _BLOCK, n // 2, 2)]
  else:
    amax, maxima = given, []
  x4 = xb.reshape(e, t // _BLOCK, _BLOCK, n // 2, 2)
  seeds, threefry = _seeds(stochastic_key, e, key_batched)
  packed, scale_bytes = _partitioned_codes(flush_to_zero_safe, interpret, stochastic_key is not None, n, threefry,
                                           maxima=bool(maxima))(amax[:, None], seeds, *maxima, x4)
  packed, scale_bytes = packed.reshape(e, t, n // 2), scale_bytes.reshape(e, t // _BLOCK, n)
  return (packed, scale_bytes, amax) if batched else (packed[0], scale_bytes[0], amax[0])


def quantize(x, layout: str = COLS_RHT, stochastic_key=None, *, batched: bool = False, **kw) -> NVFP4Tensor:
  """``quantize``'s NVFP4Tensor from :func:`quantize_codes` (``kw``: amax, key_batched, flush_to_zero_safe, interpret;
  a key for :data:`ROWS` only). Batched, the tensor's ``axis`` is a slice's (what ``vmap`` gives back)."""
  packed, scale_bytes, amax = quantize_codes(x, layout, stochastic_key, batched=batched, **kw)
  data = lax.bitcast_convert_type(packed, jnp.float4_e2m1fn).reshape(x.shape)
  scale = lax.bitcast_convert_type(scale_bytes, jnp.float8_e4m3fn)
  tiles = layout == TILES_2D
  axis = None if tiles else (x.ndim - 1 - batched if layout == ROWS else 0)
  return NVFP4Tensor(data=data, scale=scale, amax=amax, axis=axis, block_2d=tiles, rht=layout == COLS_RHT,
                     e4m3_bound=E4M3_MAX)
