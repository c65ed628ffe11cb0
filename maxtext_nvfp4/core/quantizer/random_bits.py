"""Stochastic rounding's random bytes: a keyed counter hash, the same bits in the XLA form and the kernels.

    (k0, k1) = jax.random.bits(key, (2,), uint32)           one Threefry evaluation per tensor
    word[i]  = H(H(i + k0) ^ k1)                            H = lowbias32, i the word's row-major position
    byte     = byte (c mod 4) of word[c div 4]              4 consecutive elements along the last axis per
                                                            word (one word per element, its low byte, when
                                                            that axis is not a multiple of 4)
    u        = byte / 256                                   SR's fraction (formulas.e2m1_code_of_product)

SR matches TE in distribution only: TE draws Philox bits tied to its CUDA thread mapping, which cannot be
reproduced. The bytes are uniform and, for practical purposes, independent across elements, tensors and keys
(``tests/core/test_numerics.py`` checks histograms and correlations). The hash is about 12 integer ops per
word against ~100 and a loop for a Threefry word (``jax.random.bits``); the position comes from iotas over
the tensor's own shape, so a sharded tensor computes its bits shard-locally.

The kernels (Pallas Triton and Mosaic TPU) draw the same bytes from scalars: :func:`kernel_seeds` hands them a
Threefry key's words and its deferred ``fold_in`` data, :func:`key_words` applies jax's own rounds to them
(:func:`threefry2x32`, :func:`threefry_bits2`) and :func:`fraction` gives an element's ``u`` from its position.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from maxtext_nvfp4.core import prng


def lowbias32(h):
  """A 32-bit integer hash with near-ideal avalanche (C. Wellons' "lowbias32": xorshift-multiply, 2 rounds)."""
  h = h ^ (h >> 16)
  h = h * np.uint32(0x7FEB352D)
  h = h ^ (h >> 15)
  h = h * np.uint32(0x846CA68B)
  return h ^ (h >> 16)


def random_bytes(key, shape, per_element: bool | None = None):
  """Uniform random ``uint8`` of ``shape`` for stochastic rounding (the module docstring's bytes).

  ``per_element`` chooses how the words become bytes (the same bits either way; default: by word on CPU, per
  element elsewhere).
  """
  shape = tuple(shape)
  k = jax.random.bits(prng.resolve(key), (2,), jnp.uint32)
  per_word = 4 if shape and shape[-1] % 4 == 0 else 1
  wshape = shape[:-1] + (shape[-1] // per_word,) if shape else ()
  hash_words = lambda idx: lowbias32(lowbias32(idx + k[0]) ^ k[1])  # noqa: E731
  if per_word == 1:
    return (hash_words(word_index(wshape, wshape, 1)) & np.uint32(0xFF)).astype(jnp.uint8)

  def by_word():  # one hash per word, split into its 4 bytes: least work (XLA:CPU)
    return lax.bitcast_convert_type(hash_words(word_index(wshape, wshape, 1)), jnp.uint8).reshape(shape)

  def by_element():
    # The same bytes: each element hashes its own word and takes byte (c mod 4) of it, little-endian like
    # the bitcast. 4x the integer work, but elementwise, so XLA:GPU fuses it into the quantizer's element
    # pass (the words' u32 -> u8 bitcast is written out in full there).
    byte = lax.broadcasted_iota(jnp.uint32, shape, len(shape) - 1) % np.uint32(4)
    return ((hash_words(word_index(shape, wshape, 4)) >> (byte * np.uint32(8))) & np.uint32(0xFF)).astype(jnp.uint8)

  if per_element is None:
    return lax.platform_dependent(cpu=by_word, default=by_element)
  return by_element() if per_element else by_word()


def word_index(ishape, wshape, last_div):
  """Row-major index into ``wshape`` of every position of ``ishape`` (its last axis divided by ``last_div``)."""
  idx = jnp.zeros(ishape, jnp.uint32)
  stride = 1
  for d in range(len(wshape) - 1, -1, -1):
    i = lax.broadcasted_iota(jnp.uint32, ishape, d)
    i = i // np.uint32(last_div) if d == len(wshape) - 1 and last_div > 1 else i
    idx = idx + i * np.uint32(stride % 2**32)
    stride *= wshape[d]
  return idx


# ----------------------------------------------------------------------------------------------
# The same bytes in a kernel: the key's words, jax's Threefry rounds, an element's fraction
# ----------------------------------------------------------------------------------------------
_THREEFRY_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def threefry2x32(k1, k2, x1, x2):
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


def threefry_bits2(k1, k2, partitionable: bool):
  """``jax.random.bits(key, (2,), uint32)`` of a Threefry key with words (k1, k2), from scalars (a kernel
  computes it; XLA:GPU spends seconds compiling each of jax's): with ``jax_threefry_partitionable`` each
  word is ``y1 ^ y2`` of the counter (0, i), without it the two words of the counter (0, 1)."""
  zero = np.uint32(0)
  if partitionable:
    (a1, a2), (b1, b2) = threefry2x32(k1, k2, zero, zero), threefry2x32(k1, k2, zero, np.uint32(1))
    return a1 ^ a2, b1 ^ b2
  return threefry2x32(k1, k2, zero, np.uint32(1))


def key_words(seed, threefry: bool | None, folds: int):
  """SR's two key words (k0, k1) from ``seed(i)``, the i-th uint32 of (key word 0, key word 1, fold data 0 ..
  ``folds - 1``) (:func:`kernel_seeds`): the Threefry key's words, each fold ``(w0, w1) = threefry2x32((w0,
  w1), (0, data))`` (``jax.random.fold_in``), then (k0, k1) by :func:`threefry_bits2` (``threefry``: the
  partitionable flag); or (``threefry`` None, no folds) the two words themselves."""
  k0, k1 = seed(0), seed(1)
  for i in range(folds):
    k0, k1 = threefry2x32(k0, k1, np.uint32(0), seed(2 + i))
  if threefry is not None:
    k0, k1 = threefry_bits2(k0, k1, threefry)
  return k0, k1


def kernel_seeds(stochastic_key, batch: int, key_batched: bool):
  """(seeds (batch, 2 + F) uint32, threefry) for SR's two key words of each slice (of each slice's key, or of
  the one key for every slice), ``jax.random.bits(key, (2,), uint32)`` as :func:`random_bytes` draws them:
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


def fraction(words, t, n, n_total: int):
  """``u = byte / 256`` of ``random_bytes(key, (T, N))`` at rows ``t`` and columns ``n`` (uint32, the slice's 2D
  view): ``byte (n mod 4)`` of ``H(H(w + k0) ^ k1)`` with ``w = t * (N / 4) + n div 4`` (one word per element
  when N is not a multiple of 4: ``w = t * N + n``, its low byte), uint32 and wrapping like :func:`word_index`;
  ``words``: (k0, k1) (:func:`key_words`); ``n_total``: N of the whole operand (a tile may be a shard's)."""
  if n_total % 4:
    return word_fraction(words, t * np.uint32(n_total % 2**32) + n, np.uint32(0))
  return word_fraction(words, t * np.uint32((n_total // 4) % 2**32) + n // np.uint32(4), n % np.uint32(4))


def word_fraction(words, word, byte):
  """:func:`fraction` for a tile laid out by words: ``u`` of the element at byte ``byte`` (0..3) of hash word
  ``word`` (``t * (N / 4) + n div 4``; N a multiple of 4), each word hashed once for its four elements -- a
  quarter of :func:`fraction`'s hashing when ``word`` has a size-1 axis that ``byte`` spans (uint32; broadcast)."""
  k0, k1 = words
  h = lowbias32(lowbias32(word + k0) ^ k1)
  return ((h >> (byte * np.uint32(8))) & np.uint32(0xFF)).astype(jnp.float32) * np.float32(1.0 / 256.0)


def shard_start(mesh, axes, local: int):
  """The first global index of this device's shard along a dim sharded over ``axes`` (a spec entry): where the
  shard's stochastic-rounding positions start, inside a kernel run per shard."""
  if axes is None:
    return jnp.uint32(0)
  idx = jnp.uint32(0)
  for a in (axes,) if isinstance(axes, str) else tuple(axes):  # the first axis is the most major
    idx = idx * np.uint32(mesh.shape[a]) + lax.axis_index(a).astype(jnp.uint32)
  return idx * np.uint32(local)
