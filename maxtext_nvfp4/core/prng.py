"""Stochastic rounding's keys as ``fold_in`` chains that the quantizer applies where it draws the bits.

A GEMM's SR key is a chain of ``jax.random.fold_in``: MaxText's step, layer and projection (``plan.sr_key``),
the expert of a batched GEMM (``gemm.dot_general``), the dgrad or wgrad copy of dy (``gemm.sr_keys``). Each
``fold_in`` of a Threefry key is one ``threefry2x32`` of the counter ``(0, data)`` under the key's two words:
about 120 scalar integer instructions, which XLA:GPU fuses into its consumers and takes seconds to compile
(a MaxText MoE step has one chain per quantized GEMM operand; benchmarks/RESULTS.md has the cost).

:func:`fold_in` of a Threefry key therefore returns a :class:`FoldedKey` -- the key and its fold data -- and
the consumer resolves it: the XLA form with ``jax.random.fold_in`` itself (:func:`resolve`), the Pallas
kernels (``quantizer/triton_kernels.py``) from the key's words by the same 20 rounds per fold, computed per
program. The bits are the same either way (``tests/core/test_nvfp4_triton.py`` checks the kernels' chain
against ``jax.random.fold_in``). Any other PRNG's key is folded at once by ``jax.random.fold_in``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FoldedKey", "fold_in", "is_threefry", "resolve", "split_chain"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, kw_only=True)
class FoldedKey:
  """``fold_in(... fold_in(key, data[..., 0]) ..., data[..., -1])`` of a Threefry key, not yet applied."""

  # the Threefry key the chain starts from: typed (shape B) or raw uint32 words (shape B + (2,))
  key: jax.Array
  # the fold_in data in order, uint32 (shape B + (F,), F >= 1)
  data: jax.Array

  @property
  def shape(self) -> tuple[int, ...]:
    """B: the batch shape of the keys it stands for (a typed key array's shape)."""
    return tuple(self.data.shape[:-1])


def _typed(key) -> bool:
  return jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)


def is_threefry(key) -> bool:
  """Whether ``key`` (a typed key, raw words under jax's default PRNG, or a FoldedKey) is a Threefry key."""
  if isinstance(key, FoldedKey):
    return True
  if _typed(key):
    return str(jax.random.key_impl(key)) == "threefry2x32"
  return jax.config.jax_default_prng_impl == "threefry2x32"


def _batch_shape(key) -> tuple[int, ...]:
  return tuple(key.shape) if _typed(key) else tuple(key.shape[:-1])


def fold_in(key, data):
  """``jax.random.fold_in(key, data)`` (``data`` a 32-bit integer, converted as jax does: ``jnp.uint32``); for a
  Threefry key (or a FoldedKey) deferred: a FoldedKey with ``data`` appended to its chain."""
  if not is_threefry(key):
    return jax.random.fold_in(key, data)
  base, chain = (key.key, key.data) if isinstance(key, FoldedKey) else (key, None)
  batch = _batch_shape(base)
  d = jnp.broadcast_to(jnp.uint32(data), batch)[..., None]
  if isinstance(data, (int, np.integer)):
    # A constant behind a barrier: XLA cannot fold it into the small fusion that assembles the kernel's key
    # words, so that fusion is the same at every call site and compiles once (each distinct constant would make
    # it a kernel of its own, each compiled on its own).
    d = jax.lax.optimization_barrier(d)
  return FoldedKey(key=base, data=d if chain is None else jnp.concatenate([chain, d], axis=-1))


def resolve(key):
  """The key a FoldedKey stands for, by ``jax.random.fold_in`` (batched keys fold elementwise); other keys as
  they are."""
  if not isinstance(key, FoldedKey):
    return key
  fold = jax.random.fold_in
  for _ in range(key.data.ndim - 1):
    fold = jax.vmap(fold)
  out = key.key
  for i in range(key.data.shape[-1]):
    out = fold(out, key.data[..., i])
  return out


def split_chain(key):
  """``(words, data)`` of a Threefry key or FoldedKey: the start key's uint32 words (B + (2,)) and its fold
  data (B + (F,), F = 0 for a plain key)."""
  base, data = (key.key, key.data) if isinstance(key, FoldedKey) else (key, None)
  words = jax.random.key_data(base) if _typed(base) else base
  if data is None:
    data = jnp.zeros(words.shape[:-1] + (0,), jnp.uint32)
  return words, data
