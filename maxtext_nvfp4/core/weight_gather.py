"""The FSDP all-gather of an NVFP4 weight in FP4: E2M1 codes and E4M3 tile scales instead of bf16 values.

Under FSDP the kernel W (K, N) of a GEMM is sharded over the mesh axes that also shard the tokens, and every
GEMM that reads it gathers it first. With TE's recipe W is quantized in 16x16 tiles with one amax per tensor
(TE's ``AmaxScope.FSDP``: the local amaxes all-reduced over the FSDP group), so when every shard is a whole
number of tiles the quantization of the gathered W is the gather of the shards' quantizations::

    quantize(all_gather(W), amax)  =  all_gather(quantize(W_shard, amax))        (bit for bit)

since each tile's scale and codes depend on its own 256 values and the tensor's amax only. The right side
moves, per weight, 4 bits of code plus 8 bits per 256-weight tile (``0.5 + 1/256`` bytes) instead of 2;
the amax (one fp32 per amax block) is already on every device.

:func:`gather` is that right side for an :class:`~maxtext_nvfp4.core.nvfp4.NVFP4Tensor` quantized from a
sharded W (its quantization runs on the shards: ``jit``'s partitioner computes it where W lives, as the
``shard_map``'s input layout asks): a ``shard_map`` whose body all-gathers the codes, packed two per byte
(``uint8``), and the scales' bytes over the gathered axes only. Nothing is recomputed: the gathered tensor
has the same bits as the unsharded quantization, whatever the amax scope. :class:`WeightGather` is W's
layout on the mesh, :func:`refusal` says when it is not a whole number of tiles per shard (then the GEMM
gathers W as before, in the activation dtype).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from maxtext_nvfp4.core import nvfp4 as numerics

__all__ = ["WeightGather", "gather", "gathered_bytes_per_weight", "refusal"]

_BLOCK = numerics.BLOCK


@dataclasses.dataclass(frozen=True, kw_only=True)
class WeightGather:
  """How the 2D kernel W (K, N) of a GEMM lies on the mesh, and which of its mesh axes the GEMM gathers.

  Along each dim the mesh axes are major to minor (a ``PartitionSpec`` entry); the kept axes come first, so
  after the gather each device holds the contiguous block of the kept axes (the layout the GEMM computes in:
  tensor parallelism). K is the flattened contraction (its leading dim's axes), N the flattened output dims.
  """

  # the run's mesh (``jax.sharding.Mesh`` or the ``AbstractMesh`` of ``jax.sharding.get_abstract_mesh()``)
  mesh: Any
  # mesh axes sharding K that stay sharded after the gather (e.g. tensor parallelism of an out-projection)
  k_kept: tuple[str, ...] = ()
  # mesh axes sharding K that the GEMM gathers (FSDP: the axes that also shard the tokens)
  k_gathered: tuple[str, ...] = ()
  # the same two for N
  n_kept: tuple[str, ...] = ()
  n_gathered: tuple[str, ...] = ()
  # mesh axes of a leading batch dim of W (MoE's experts), kept (``vmap``'s ``spmd_axis_name``)
  batch: tuple[str, ...] = ()

  def __post_init__(self):
    for f in ("k_kept", "k_gathered", "n_kept", "n_gathered", "batch"):
      v = getattr(self, f)
      if not isinstance(v, tuple) or not all(isinstance(a, str) for a in v):
        raise TypeError(f"WeightGather.{f}={v!r}: need a tuple of mesh axis names")
    names = self.k_kept + self.k_gathered + self.n_kept + self.n_gathered + self.batch
    if len(set(names)) != len(names):
      raise ValueError(f"WeightGather: a mesh axis shards two dims of W or is both kept and gathered: {names}")
    unknown = [a for a in names if a not in self.mesh.shape]
    if unknown:
      raise ValueError(f"WeightGather: axes {unknown} are not in the mesh {dict(self.mesh.shape)}")

  def size(self, axes: tuple[str, ...]) -> int:
    return math.prod(int(self.mesh.shape[a]) for a in axes)

  @property
  def gathered(self) -> tuple[str, ...]:
    return self.k_gathered + self.n_gathered

  @property
  def active(self) -> bool:
    """Something is gathered (more than one device along the gathered axes)."""
    return self.size(self.gathered) > 1

  def describe(self) -> str:
    """``over fsdp=8 (K), kept tensor=2 (N)``."""
    part = lambda axes: ",".join(f"{a}={self.mesh.shape[a]}" for a in axes)  # noqa: E731
    where = [f"{part(ax)} ({d})" for ax, d in ((self.k_gathered, "K"), (self.n_gathered, "N")) if ax]
    kept = [f"{part(ax)} ({d})" for ax, d in ((self.k_kept, "K"), (self.n_kept, "N"), (self.batch, "batch")) if ax]
    return "over " + " and ".join(where) + (f", kept {' and '.join(kept)}" if kept else "")


def refusal(wg: WeightGather, k: int, n: int, groups: tuple[int, int] = (1, 1)) -> str | None:
  """Why W (K, N) cannot be gathered in FP4 on this layout (one line), or None.

  Every device's shard must be a whole number of 16x16 tiles (K and N per shard multiples of 16: then no tile
  straddles two shards and nothing is padded), and an amax-block grid ``groups`` (TE's scope,
  ``gemm.AmaxGroups`` ``(w_k, w_n)``) must be the kept axes' shards (the blocks each device keeps).
  """
  sk, sn = wg.size(wg.k_kept + wg.k_gathered), wg.size(wg.n_kept + wg.n_gathered)
  bad = [f"{name} {size}/{parts}" for name, size, parts in (("K", k, sk), ("N", n, sn))
         if size % parts or (size // parts) % _BLOCK]
  if bad:
    return (f"W's shards ({', '.join(bad)}) are not whole 16x16 tiles (a tile would straddle two shards or be"
            " padded)")
  gk, gn = groups
  if (gk, gn) != (1, 1) and (gk, gn) != (wg.size(wg.k_kept), wg.size(wg.n_kept)):
    return f"W's amax blocks {gk}x{gn} are not its kept shards {wg.size(wg.k_kept)}x{wg.size(wg.n_kept)}"
  return None


def gathered_bytes_per_weight() -> float:
  """Bytes the gather moves per weight: a 4-bit code plus one E4M3 scale per 16x16 tile."""
  return 0.5 + 1 / (_BLOCK * _BLOCK)


def _entry(axes: tuple[str, ...]):
  return None if not axes else (axes[0] if len(axes) == 1 else axes)


def _specs(wg: WeightGather, ndim: int) -> tuple[P, P]:
  """(sharded, gathered) specs of a quantized W's data and scale: (K, N), or the amax-block form
  (gk, gn, K/gk, N/gn) of ``gemm._quantize_grouped`` (the kept axes on the block dims)."""
  if ndim == 2:
    return (P(_entry(wg.k_kept + wg.k_gathered), _entry(wg.n_kept + wg.n_gathered)),
            P(_entry(wg.k_kept), _entry(wg.n_kept)))
  return (P(_entry(wg.k_kept), _entry(wg.n_kept), _entry(wg.k_gathered), _entry(wg.n_gathered)),
          P(_entry(wg.k_kept), _entry(wg.n_kept), None, None))


def _to_bytes(data):
  """float4_e2m1fn (..., n) -> uint8 (..., n/2): two codes per byte, element 2i in the low nibble (a bitcast)."""
  return lax.bitcast_convert_type(data.reshape(data.shape[:-1] + (data.shape[-1] // 2, 2)), jnp.uint8)


def _from_bytes(packed):
  """Inverse of :func:`_to_bytes`."""
  return lax.bitcast_convert_type(packed, jnp.float4_e2m1fn).reshape(packed.shape[:-1] + (packed.shape[-1] * 2,))


def gather(t: numerics.NVFP4Tensor, wg: WeightGather) -> numerics.NVFP4Tensor:
  """``t`` (W quantized, laid out as ``wg`` says) with its codes and scales all-gathered over ``wg.gathered``.

  The same bits as ``t``: only the layout changes (each device then holds the kept axes' block). What
  crosses the network: ``uint8`` bytes of packed codes and of E4M3 scales. The amax stays as it is.
  """
  if not wg.active:
    return t
  nd = t.data.ndim
  if nd not in (2, 4) or t.data.shape[-1] % 2:
    raise ValueError(f"weight_gather.gather: need a 2D (or amax-block 4D) NVFP4 tensor with an even last dim,"
                     f" got data of shape {t.data.shape}")
  sharded, full = _specs(wg, nd)
  k_dim, n_dim = (0, 1) if nd == 2 else (2, 3)

  def body(codes, scales):
    for dim, axes in ((k_dim, wg.k_gathered), (n_dim, wg.n_gathered)):
      if axes:
        codes = lax.all_gather(codes, axes, axis=dim, tiled=True)
        scales = lax.all_gather(scales, axes, axis=dim, tiled=True)
    return codes, scales

  move = jax.shard_map(body, mesh=wg.mesh, in_specs=(sharded, sharded), out_specs=(full, full), check_vma=False)
  codes, scales = move(_to_bytes(t.data), lax.bitcast_convert_type(t.scale, jnp.uint8))
  return dataclasses.replace(t, data=_from_bytes(codes), scale=lax.bitcast_convert_type(scales, t.scale.dtype))
