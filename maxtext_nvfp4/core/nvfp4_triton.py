"""The 1x16 GEMM operand's quantizer as one Pallas (Triton) kernel on XLA:GPU: the bits of
:func:`maxtext_nvfp4.core.nvfp4.quantize_values`, in two passes over the operand instead of four.

XLA cannot fuse a reduction into its consumer, so its form of the quantizer writes the block maxima, reads
them back for the tensor amax and for a block-level kernel, which writes ``s8`` and ``enc`` for the element
pass to read (8.00 B/element for a bf16 operand, H200 compile, 2026-12-01). Here::

    pass 1 (XLA reduce):  amax = max |x|                                  reads x once        (2 B/el)
    scalars (XLA):        S_enc, S_dec = nvfp4._global_scales(amax);  c = fl(S_enc * fl(1/6))
    pass 2 (this kernel), per tile of (rows, blocks, 16), in registers:
        bamax = max |x| over the 16                                       reads x once        (2 B/el)
        s8    = rnd(min(fl(bamax * c), 448), E4M3)
        enc   = min(fl(1 / fl(s8 * S_dec)), FLT_MAX)                      from integers, per block
        k     = E2M1 code of fl(|x| * enc)  (RNE);  v = ±grid(k) * s8     writes v            (2 B/el)

Every formula is ``nvfp4``'s own helper, called on the tile: the block scale and the element code are the
same operations, so the same bits. Two differences of form, both exact: the encode scale is computed per
block (``nvfp4._encode_from_e4m3_parts``, the row-scaled path's) instead of looked up in the 127-entry table
(Triton has no gather; the table is that same function of each E4M3 value), and round-half-even is
:func:`_rint_nonnegative` (Triton has no ``round``). ``fl(|x| * enc)`` is the plain product, as on XLA:GPU
(``xla_gpu_ftz`` off): on a flush-to-zero backend (interpret mode on a CPU, the tests) the caller passes
``nvfp4``'s flush-to-zero-safe product instead (``tests/core/test_nvfp4_gpu_paths.py`` checks the two agree).

Scope: TE's standard rule, round to nearest, no RHT, the block axis last (the fprop operands x and, 1x16,
W's rowwise copy); everything else stays on the XLA form. Sharded operands: ``custom_partitioning`` runs
the kernel on each device's shard (its blocks are whole: the 16 axis is never split) with the replicated
scalars, so the amax is the caller's (``AmaxGroups`` or the global one), not the shard's.

Pallas's Triton backend is deprecated in jax 0.12 (in favour of Mosaic GPU); it still lowers and compiles,
on a GPU and deviceless for one.
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

from maxtext_nvfp4.core import formats
from maxtext_nvfp4.core.formats import E2M1, E4M3

__all__ = ["COLS_RHT", "Formulas", "ROWS", "layout_of", "quantize_values"]

_BLOCK = 16
# Tile: up to 16 rows x 64 blocks (16K elements, 32 KiB of bf16 in, 32 KiB out): powers of two that divide
# the operand (Triton blocks are powers of two; dividing ones need no masking).
_MAX_ROWS = 16
_MAX_BLOCKS = 64
_MAX_RHT_COLS = 32


def _rint_nonnegative(t):
  """Round half to even of fp32 ``t`` in [0, 2**31) (NaN: unspecified), from the truncation: Triton has no
  ``round``. ``t - trunc(t)`` is exact below 2**24 and zero above (every such fp32 is an integer)."""
  i = t.astype(jnp.int32)
  d = t - i.astype(jnp.float32)
  up = (d > np.float32(0.5)) | ((d == np.float32(0.5)) & ((i & 1) == 1))
  return (i + up.astype(jnp.int32)).astype(jnp.float32)


def _pow2_tile(n: int, cap: int) -> int:
  """The largest power of two <= cap that divides n."""
  return math.gcd(n, cap) if cap & (cap - 1) == 0 else 1


# The two operand layouts the kernels take (x3: the operand reshaped, its 16-element blocks on one axis):
#   ROWS     x (..., K) -> (R, K/16, 16): blocks along the last axis (x for fprop, dy for dgrad)
#   COLS_RHT x (T, N)   -> (T/16, 16, N): blocks along axis 0, RHT along them first (dy for wgrad)
ROWS = "rows"
COLS_RHT = "cols_rht"
_BLOCK_AXIS = {ROWS: 2, COLS_RHT: 1}


def _positions(layout: str, shape, k_ref):
  """(t, n): each tile element's row and column in the operand's 2D view (T, N), uint32, from the shard's
  first (row, column) in ``k_ref[2:4]`` and the tile's place in the grid."""
  a, b, c = (lax.broadcasted_iota(jnp.uint32, shape, d) for d in range(3))
  t0 = k_ref[2] + (pl.program_id(0) * shape[0]).astype(jnp.uint32) * np.uint32(1 if layout == ROWS else _BLOCK)
  if layout == ROWS:  # (rows, blocks, 16)
    n0 = k_ref[3] + (pl.program_id(1) * shape[1]).astype(jnp.uint32) * np.uint32(_BLOCK)
    return t0 + a, n0 + b * np.uint32(_BLOCK) + c
  n0 = k_ref[3] + (pl.program_id(1) * shape[2]).astype(jnp.uint32)  # (groups, 16, cols)
  return t0 + a * np.uint32(_BLOCK) + b, n0 + c


def _sr_fraction(f: "Formulas", layout: str, k_ref, shape, n_total: int):
  """``u = byte / 256`` of ``nvfp4._random_bytes(key, (T, N))`` for this tile: the same per-element form,
  ``byte (n mod 4)`` of ``H(H(w + k0) ^ k1)`` with ``w = t * (N / 4) + n div 4`` (uint32, wrapping like
  ``nvfp4._word_index``); ``k_ref`` = (k0, k1, first row, first column) of the shard; ``n_total``: N of the
  whole operand (the tile may be a shard's)."""
  t, n = _positions(layout, shape, k_ref)
  word = t * np.uint32(n_total // 4) + n // np.uint32(4)
  h = f.hash32(f.hash32(word + k_ref[0]) ^ k_ref[1])
  byte = (h >> ((n % np.uint32(4)) * np.uint32(8))) & np.uint32(0xFF)
  return byte.astype(jnp.float32) * np.float32(1.0 / 256.0)


def _rht_matrix(f: "Formulas"):
  """TE's ``diag(s) H16 / 4`` as a (1, 16, 16, 1) array from iotas (a kernel cannot capture an array
  constant): ``m[r, c] = s_r * (-1)**popcount(r & c) / 4``, exactly ``nvfp4.rht_matrix()``."""
  r = lax.broadcasted_iota(jnp.int32, (1, _BLOCK, _BLOCK, 1), 1)
  c = lax.broadcasted_iota(jnp.int32, (1, _BLOCK, _BLOCK, 1), 2)
  neg_rows = sum(1 << i for i, sgn in enumerate(f.rht_signs) if sgn < 0)
  odd = (lax.population_count(r & c) & 1) ^ ((neg_rows >> r) & 1)
  return jnp.where(odd == 1, np.float32(-0.25), np.float32(0.25))


def _rht_tile(f: "Formulas", xf, safe: bool):
  """``nvfp4._rht_exact`` of a (groups, 16, cols) fp32 tile: tiny groups (max |x| < 2**-60) at 2**64 scale,
  the 16-term sums, one bf16 rounding back at the true size (fp32 values on the bf16 grid)."""
  gmax = jnp.max((formats.bits(xf) & np.uint32(formats.F32_ABS_MASK)).astype(jnp.int32), axis=1, keepdims=True)
  tiny = gmax < int(np.float32(f.rht_tiny).view(np.int32))
  xs = (f.rht_upscale_safe if safe else f.rht_upscale_ieee)(xf, tiny)
  y = jnp.sum(jnp.expand_dims(xs, 2) * _rht_matrix(f), axis=1)
  return f.rht_round_back(y, tiny, rint=_rint_nonnegative)


def _quantize_tile(f: "Formulas", xf, axis: int, c, s_dec, u, safe: bool):
  """The values ``±grid(k) * s8`` of a tile whose blocks lie along ``axis`` (fp32, on x's grid)."""
  b = formats.bits(xf)
  bamax = formats.from_bits(jnp.max((b & np.uint32(formats.F32_ABS_MASK)).astype(jnp.int32), axis=axis,
                                    keepdims=True))
  dec = jnp.minimum(f.mul_exact(bamax, c), np.float32(f.e4m3_max))
  s8 = formats.round_to_format(dec, E4M3, rint=_rint_nonnegative)
  s8 = jnp.where(jnp.isnan(dec), dec, s8)  # a NaN amax: NaN scales, as jnp.round keeps NaN
  k8, j8 = f.e4m3_parts(jnp.where(jnp.isnan(s8), np.float32(0.0), s8))
  enc = jnp.where(jnp.isnan(s8), s8, f.encode_from_e4m3_parts(k8, j8, s_dec))
  product = f.safe_product if safe else f.plain_product
  k, neg = f.e2m1_code(xf, enc, u, product=product, rint=_rint_nonnegative)
  mag = formats.grid_value(k, E2M1)
  return jnp.where(neg, -mag, mag) * s8


def _values_kernel(s_ref, *refs, f: "Formulas", layout: str, safe: bool, n_total: int):
  k_ref, x_ref, v_ref = refs if len(refs) == 3 else (None,) + refs
  xf = formats.to_f32_exact(x_ref[...])
  if layout == COLS_RHT:
    xf = _rht_tile(f, xf, safe)
  u = None if k_ref is None else _sr_fraction(f, layout, k_ref, xf.shape, n_total)
  v = _quantize_tile(f, xf, _BLOCK_AXIS[layout], s_ref[0], s_ref[1], u, safe)
  v_ref[...] = v.astype(v_ref.dtype)


def _rht_amax_kernel(x_ref, m_ref, *, f: "Formulas", safe: bool):
  """Per tile column: max |RHT(x)| bits over its groups and 16 rows (the tensor amax's first step)."""
  y = _rht_tile(f, formats.to_f32_exact(x_ref[...]), safe)
  m_ref[...] = jnp.max(jnp.max((formats.bits(y) & np.uint32(formats.F32_ABS_MASK)).astype(jnp.int32), axis=1),
                       axis=0, keepdims=True)


def _tiles(layout: str, shape):
  """The kernel's tile of an x3 of ``shape`` and its grid (powers of two that divide the dims)."""
  if layout == ROWS:
    rows, blocks, _ = shape
    t = (_pow2_tile(rows, _MAX_ROWS), _pow2_tile(blocks, _MAX_BLOCKS), _BLOCK)
    return t, (rows // t[0], blocks // t[1]), lambda i, j: (i, j, 0)
  groups, _, cols = shape  # the RHT's (1, 16, 16, cols) products bound the columns of a tile
  t = (1, _BLOCK, _pow2_tile(cols, _MAX_RHT_COLS))
  return t, (groups, cols // t[2]), lambda i, j: (i, 0, j)


def _values_call(scalars, keys, x3, *, f, layout: str, dtype, safe: bool, interpret: bool, n_total: int):
  """The values kernel over the blocked operand ``x3``; ``keys``: SR's (k0, k1, first row, first column),
  or None (RNE)."""
  tile, grid, index = _tiles(layout, x3.shape)
  whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,))  # noqa: E731
  operands = (scalars, x3) if keys is None else (scalars, keys, x3)
  return pl.pallas_call(
      functools.partial(_values_kernel, f=f, layout=layout, safe=safe, n_total=n_total),
      out_shape=jax.ShapeDtypeStruct(x3.shape, dtype),
      grid=grid,
      in_specs=[whole(a) for a in operands[:-1]] + [pl.BlockSpec(tile, index)],
      out_specs=pl.BlockSpec(tile, index),
      interpret=interpret,
      name=f"nvfp4_values_{layout}" + ("" if keys is None else "_sr"),
  )(*operands)


def _rht_amax_call(x3, *, f, safe: bool, interpret: bool):
  """Per (group, column) tile maxima of |RHT(x)| as int32 bits: (groups, cols)."""
  tile, grid, index = _tiles(COLS_RHT, x3.shape)
  return pl.pallas_call(
      functools.partial(_rht_amax_kernel, f=f, safe=safe),
      out_shape=jax.ShapeDtypeStruct((x3.shape[0], x3.shape[2]), jnp.int32),
      grid=grid,
      in_specs=[pl.BlockSpec(tile, index)],
      out_specs=pl.BlockSpec((1, tile[2]), lambda i, j: (i, j)),
      interpret=interpret,
      name="nvfp4_rht_amax",
  )(x3)


def _shard_start(mesh, axes, local: int):
  """The first global index of this device's shard along a dim sharded over ``axes`` (a spec entry)."""
  if axes is None:
    return jnp.uint32(0)
  idx = jnp.uint32(0)
  for a in (axes,) if isinstance(axes, str) else tuple(axes):  # the first axis is the most major
    idx = idx * np.uint32(mesh.shape[a]) + lax.axis_index(a).astype(jnp.uint32)
  return idx * np.uint32(local)


def _x3_spec(layout: str, spec):
  """x3's partition spec with the 16-element block axis unsharded (blocks stay whole on every device)."""
  spec = tuple(spec) + (None,) * (3 - len(tuple(spec)))
  return PartitionSpec(spec[0], spec[1], None) if layout == ROWS else PartitionSpec(spec[0], None, spec[2])


def _partitioned_values(f, layout: str, dtype, safe: bool, interpret: bool, sr: bool, n_total: int):
  """``_values_call`` under ``custom_partitioning``: each device quantizes its own shard's whole blocks with
  the replicated scalars; SR positions are the global ones (the shard's first row and column, from the mesh
  axis indices), so the SR bits do not depend on the mesh, as the XLA form's iotas do not."""

  def on_shard(scalars, seeds, x3, mesh=None, spec=(None, None, None)):
    keys = None
    if sr:
      # x3 dims (0, 1 or 2) that hold the operand's rows and columns, and their element units
      (dt, ut), (dn, un) = ((0, 1), (1, _BLOCK)) if layout == ROWS else ((0, _BLOCK), (2, 1))
      t0, n0 = (_shard_start(mesh, spec[d], x3.shape[d]) * np.uint32(unit) for d, unit in ((dt, ut), (dn, un)))
      keys = jnp.stack([seeds[0], seeds[1], t0, n0])
    return _values_call(scalars, keys, x3, f=f, layout=layout, dtype=dtype, safe=safe, interpret=interpret,
                        n_total=n_total)

  def run(scalars, seeds, x3):  # custom_partitioning binds every parameter of its function: three
    return on_shard(scalars, seeds, x3)

  call = custom_partitioning(run)

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    return NamedSharding(mesh, _x3_spec(layout, arg_shapes[2].sharding.spec))

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    x_sharding = NamedSharding(mesh, _x3_spec(layout, arg_shapes[2].sharding.spec))
    rep = NamedSharding(mesh, PartitionSpec())
    lower = lambda s, k, x: on_shard(s, k, x, mesh, tuple(x_sharding.spec))  # noqa: E731
    return mesh, lower, x_sharding, (rep, rep, x_sharding)

  rule = "s, t, r b e -> r b e" if layout == ROWS else "s, t, g e c -> g e c"
  call.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule,
                     need_replication_factors=("s", "t", "e"))
  return call


def _partitioned_rht_amax(f, safe: bool, interpret: bool):
  """``_rht_amax_call`` under ``custom_partitioning``: tile maxima of each device's shard (the caller's max
  over them is XLA's, across devices)."""

  def run(x3):
    return _rht_amax_call(x3, f=f, safe=safe, interpret=interpret)

  call = custom_partitioning(run)

  def out_sharding(mesh, x_spec):
    return NamedSharding(mesh, PartitionSpec(x_spec[0], x_spec[2]))

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    return out_sharding(mesh, _x3_spec(COLS_RHT, arg_shapes[0].sharding.spec))

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    x_spec = _x3_spec(COLS_RHT, arg_shapes[0].sharding.spec)
    return mesh, run, out_sharding(mesh, x_spec), (NamedSharding(mesh, x_spec),)

  call.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule="g e c -> g c",
                     need_replication_factors=("e",))
  return call


def layout_of(x, axis_n, block_2d: bool, rht: bool, rule) -> str | None:
  """The kernel layout that computes this ``quantize_values`` call, or None (the XLA form): TE's standard rule,
  1x16 blocks along the last axis (:data:`ROWS`), or with RHT along axis 0 of a 2D operand whose columns
  are a multiple of 4 (:data:`COLS_RHT`); bf16 or fp32."""
  # An explicitly sharded x (sharding in its type) is left to XLA: pallas_call takes unsharded types only.
  explicit = any(p is not None for p in getattr(getattr(jax.typeof(x), "sharding", None), "spec", ()) or ())
  if rule is not None or block_2d or explicit or x.size == 0 or x.dtype not in (jnp.bfloat16, jnp.float32):
    return None
  if not rht and x.ndim >= 1 and axis_n == x.ndim - 1:
    return ROWS
  if rht and x.ndim == 2 and axis_n == 0 and x.shape[1] % 4 == 0:
    return COLS_RHT
  return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Formulas:
  """``nvfp4``'s own helpers, handed in by ``nvfp4`` (it imports this module, so this one cannot import it):
  the kernels compute with exactly these."""

  # amax -> (S_enc, S_dec), the per-tensor chain
  global_scales: Callable
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
  # the RHT's sign vector and the tiny-group threshold (2**-60)
  rht_signs: tuple
  rht_tiny: float
  # the 32-bit hash of the SR bytes
  hash32: Callable
  # E4M3's largest value (448)
  e4m3_max: float


def quantize_values(x, dtype, layout: str, stochastic_key=None, *, formulas: Formulas,
                    flush_to_zero_safe: bool = False, interpret: bool = False):
  """``(values, amax)`` of ``nvfp4.quantize_values(x, axis=..., rht=..., stochastic_key=..., dtype=dtype)`` for
  the call :func:`layout_of` gave ``layout``.

  ``flush_to_zero_safe``: the element product and the RHT's tiny-group upscale in their exact forms for a
  flush-to-zero backend (interpret mode on a CPU: the tests); default the plain IEEE forms (XLA:GPU keeps
  subnormals). ``interpret``: run the kernels through Pallas's interpreter (any backend).
  """
  f = formulas
  if layout == ROWS:
    x3 = x.reshape(-1, x.shape[-1] // _BLOCK, _BLOCK)
    xf = formats.to_f32_exact(x)
    amax_bits = jnp.max((formats.bits(xf) & np.uint32(formats.F32_ABS_MASK)).astype(jnp.int32))
  else:
    x3 = x.reshape(x.shape[0] // _BLOCK, _BLOCK, x.shape[1])
    amax_bits = jnp.max(_partitioned_rht_amax(f, flush_to_zero_safe, interpret)(x3))
  amax = formats.from_bits(amax_bits)
  s_enc, s_dec = f.global_scales(amax)
  c = s_enc * np.float32(np.float32(1.0) / np.float32(6.0))
  scalars = jnp.stack([c, jnp.where(jnp.isnan(s_dec), np.float32(1.0), s_dec)])
  sr = stochastic_key is not None
  seeds = jax.random.bits(stochastic_key, (2,), jnp.uint32) if sr else jnp.zeros((2,), jnp.uint32)
  call = _partitioned_values(f, layout, jnp.dtype(dtype), flush_to_zero_safe, interpret, sr, x.shape[-1])
  return call(scalars, seeds, x3).reshape(x.shape), amax
