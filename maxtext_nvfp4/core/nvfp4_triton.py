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

__all__ = ["Formulas", "applies", "quantize_values_1x16"]

_BLOCK = 16
# Tile: up to 16 rows x 64 blocks (16K elements, 32 KiB of bf16 in, 32 KiB out): powers of two that divide
# the operand (Triton blocks are powers of two; dividing ones need no masking).
_MAX_ROWS = 16
_MAX_BLOCKS = 64


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


def _sr_fraction(f: "Formulas", k_ref, shape, blocks: int):
  """``u = byte / 256`` of ``nvfp4._random_bytes(key, x.shape)`` for this tile (x as (rows, blocks * 16)): the
  same per-element form, ``byte (c mod 4)`` of ``H(H(w + k0) ^ k1)`` with ``w = r * (K / 4) + c div 4``
  (uint32, wrapping like ``nvfp4._word_index``); ``k_ref`` = (k0, k1, first row, first block) of the shard,
  r and c from those and the tile's place in the grid. ``blocks``: the global blocks per row."""
  tr, tb, _ = shape
  r = k_ref[2] + (pl.program_id(0) * tr).astype(jnp.uint32) + lax.broadcasted_iota(jnp.uint32, shape, 0)
  col = k_ref[3] + (pl.program_id(1) * tb).astype(jnp.uint32) + lax.broadcasted_iota(jnp.uint32, shape, 1)
  col = col * np.uint32(_BLOCK)
  col = col + lax.broadcasted_iota(jnp.uint32, shape, 2)
  word = r * np.uint32(blocks * _BLOCK // 4) + col // np.uint32(4)
  h = f.hash32(f.hash32(word + k_ref[0]) ^ k_ref[1])
  byte = (h >> ((col % np.uint32(4)) * np.uint32(8))) & np.uint32(0xFF)
  return byte.astype(jnp.float32) * np.float32(1.0 / 256.0)


def _kernel(s_ref, *refs, f: "Formulas", product, blocks: int):
  k_ref, x_ref, v_ref = refs if len(refs) == 3 else (None,) + refs
  c, s_dec = s_ref[0], s_ref[1]
  xf = formats.to_f32_exact(x_ref[...])  # (rows, blocks, 16)
  b = formats.bits(xf)
  bamax = formats.from_bits(jnp.max((b & np.uint32(formats.F32_ABS_MASK)).astype(jnp.int32), axis=-1,
                                    keepdims=True))
  dec = jnp.minimum(f.mul_exact(bamax, c), np.float32(f.e4m3_max))
  s8 = formats.round_to_format(dec, E4M3, rint=_rint_nonnegative)
  s8 = jnp.where(jnp.isnan(dec), dec, s8)  # a NaN amax: NaN scales, as jnp.round keeps NaN
  k8, j8 = f.e4m3_parts(jnp.where(jnp.isnan(s8), np.float32(0.0), s8))
  enc = jnp.where(jnp.isnan(s8), s8, f.encode_from_e4m3_parts(k8, j8, s_dec))
  u = None if k_ref is None else _sr_fraction(f, k_ref, xf.shape, blocks)
  k, neg = f.e2m1_code(xf, enc, u, product=product, rint=_rint_nonnegative)
  mag = formats.grid_value(k, E2M1)
  v_ref[...] = (jnp.where(neg, -mag, mag) * s8).astype(v_ref.dtype)


def _values_call(scalars, keys, x3, *, f, dtype, product, interpret: bool, global_blocks: int | None = None):
  """The kernel over the blocked operand ``x3`` (rows, blocks, 16); ``keys``: SR's (k0, k1, first row, first
  block), or None (RNE); ``global_blocks``: blocks per row of the whole operand (x3 may be a shard)."""
  rows, blocks, _ = x3.shape
  tr, tb = _pow2_tile(rows, _MAX_ROWS), _pow2_tile(blocks, _MAX_BLOCKS)
  tile = pl.BlockSpec((tr, tb, _BLOCK), lambda i, j: (i, j, 0))
  whole = lambda a: pl.BlockSpec(a.shape, lambda i, j: (0,))  # noqa: E731
  operands = (scalars, x3) if keys is None else (scalars, keys, x3)
  return pl.pallas_call(
      functools.partial(_kernel, f=f, product=product, blocks=global_blocks or blocks),
      out_shape=jax.ShapeDtypeStruct(x3.shape, dtype),
      grid=(rows // tr, blocks // tb),
      in_specs=[whole(a) for a in operands[:-1]] + [tile],
      out_specs=tile,
      interpret=interpret,
      name="nvfp4_values_1x16" if keys is None else "nvfp4_values_1x16_sr",
  )(*operands)


def _shard_start(mesh, axes, local: int):
  """The first global index of this device's shard along a dim sharded over ``axes`` (a spec entry)."""
  if axes is None:
    return jnp.uint32(0)
  idx = jnp.uint32(0)
  for a in (axes,) if isinstance(axes, str) else tuple(axes):  # the first axis is the most major
    idx = idx * np.uint32(mesh.shape[a]) + lax.axis_index(a).astype(jnp.uint32)
  return idx * np.uint32(local)


def _partitioned(f, dtype, product, interpret: bool, sr: bool, blocks: int):
  """``_values_call`` under ``custom_partitioning``: each device quantizes its own shard's whole blocks with
  the replicated scalars; SR positions are the global ones (the shard's start rows and blocks, from the mesh
  axis indices), so the SR bits do not depend on the mesh, as the XLA form's iotas do not."""

  def on_shard(scalars, seeds, x3, mesh=None, spec=(None, None)):
    if not sr:
      return _values_call(scalars, None, x3, f=f, dtype=dtype, product=product, interpret=interpret)
    starts = [jnp.uint32(0) if axes is None else _shard_start(mesh, axes, n) for axes, n in zip(spec, x3.shape)]
    keys = jnp.stack([seeds[0], seeds[1], starts[0], starts[1]])
    return _values_call(scalars, keys, x3, f=f, dtype=dtype, product=product, interpret=interpret,
                        global_blocks=blocks)

  def run(scalars, seeds, x3):  # custom_partitioning binds every parameter of its function: three
    return on_shard(scalars, seeds, x3)

  call = custom_partitioning(run)

  def shardings(mesh, x_sharding):
    spec = tuple(x_sharding.spec) + (None,) * (3 - len(x_sharding.spec))
    return NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec(spec[0], spec[1], None))

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    return shardings(mesh, arg_shapes[2].sharding)[1]

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    rep, x_sharding = shardings(mesh, arg_shapes[2].sharding)
    lower = lambda s, k, x: on_shard(s, k, x, mesh, tuple(x_sharding.spec)[:2])  # noqa: E731
    return mesh, lower, x_sharding, (rep, rep, x_sharding)

  call.def_partition(partition=partition, infer_sharding_from_operands=infer,
                     sharding_rule="s, t, r b e -> r b e", need_replication_factors=("s", "t", "e"))
  return call


def applies(x, axis_n, block_2d: bool, rht: bool, rule) -> bool:
  """Whether :func:`quantize_values_1x16` computes this ``quantize_values`` call (else the XLA form)."""
  # An explicitly sharded x (sharding in its type) is left to XLA: pallas_call takes unsharded types only.
  explicit = any(p is not None for p in getattr(getattr(jax.typeof(x), "sharding", None), "spec", ()) or ())
  return (rule is None and not block_2d and not rht and x.ndim >= 1 and axis_n == x.ndim - 1
          and x.dtype in (jnp.bfloat16, jnp.float32) and x.size > 0 and not explicit)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Formulas:
  """``nvfp4``'s own helpers, handed in by ``nvfp4`` (it imports this module, so this one cannot import it):
  the kernel computes with exactly these."""

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
  # (x's bits, enc) -> fl(|x| * enc) with IEEE subnormals (XLA:GPU's)
  plain_product: Callable
  # the 32-bit hash of the SR bytes
  hash32: Callable
  # E4M3's largest value (448)
  e4m3_max: float


def quantize_values_1x16(x, dtype, stochastic_key=None, *, formulas: Formulas, product=None,
                         interpret: bool = False):
  """``(values, amax)`` of ``nvfp4.quantize_values(x, stochastic_key=stochastic_key, dtype=dtype)`` for 1x16
  blocks along x's last axis.

  ``product``: ``fl(|x| * enc)`` from (x's bits, enc); default the plain product (XLA:GPU keeps subnormals).
  ``interpret``: run the kernel through Pallas's interpreter (any backend; the tests, on a CPU).
  """
  f = formulas
  product = f.plain_product if product is None else product
  xf = formats.to_f32_exact(x)
  amax = formats.from_bits(jnp.max((formats.bits(xf) & np.uint32(formats.F32_ABS_MASK)).astype(jnp.int32)))
  s_enc, s_dec = f.global_scales(amax)
  c = s_enc * np.float32(np.float32(1.0) / np.float32(6.0))
  scalars = jnp.stack([c, jnp.where(jnp.isnan(s_dec), np.float32(1.0), s_dec)])
  x3 = x.reshape(-1, x.shape[-1] // _BLOCK, _BLOCK)
  sr = stochastic_key is not None
  seeds = jax.random.bits(stochastic_key, (2,), jnp.uint32) if sr else jnp.zeros((2,), jnp.uint32)
  v = _partitioned(f, jnp.dtype(dtype), product, interpret, sr, x3.shape[1])(scalars, seeds, x3)
  return v.reshape(x.shape), amax
