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
