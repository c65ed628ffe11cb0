"""The quantizer's GPU-only formulations give the bits of the flush-to-zero-safe ones, checked on a CPU.

The XLA form (``core/quantizer/xla.py``) picks, per platform, cheaper forms on XLA:GPU
(``lax.platform_dependent``): fewer passes over memory there (benchmarks/RESULTS.md, "Deviceless H200
compile"). The golden vectors run the CPU forms; these tests pin the GPU forms to them without a GPU:

  * the stochastic-rounding bytes per element equal the bytes split from one hash word (integer arithmetic:
    both forms run here);
  * ``fl(|x| * enc)`` as a plain fp32 product, evaluated with IEEE subnormals (numpy float32), equals the
    flush-to-zero-safe product wherever it is above 2**-100, and both give E2M1 code 0 below;
  * the RHT's tiny-group upscale ``xb * 2**64`` (numpy, IEEE) equals the exact split form bit for bit.

That XLA:GPU keeps fp32 subnormals (``xla_gpu_ftz`` is off by default) is the premise; the GPU stage of
``benchmarks/gpu/run.sh`` (golden vectors on CUDA, subnormal cases included) checks it on a device.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_nvfp4.core.quantizer import formulas, hadamard, random_bits


@pytest.mark.parametrize("shape", [(3, 5, 32), (2048,)])
def test_sr_bytes_per_element_equal_bytes_per_word(shape):
  key = jax.random.key(7)
  by_word = np.asarray(jax.jit(lambda k: random_bits.random_bytes(k, shape, per_element=False))(key))
  by_element = np.asarray(jax.jit(lambda k: random_bits.random_bytes(k, shape, per_element=True))(key))
  assert by_word.shape == by_element.shape == shape and by_word.dtype == np.uint8
  assert np.array_equal(by_word, by_element)
  by_default = np.asarray(jax.jit(lambda k: random_bits.random_bytes(k, shape))(key))
  assert np.array_equal(by_word, by_default)  # the default here
  assert len(np.unique(by_word)) > min(by_word.size // 4, 64)  # not a constant


def _f32_from_bits(b):
  return np.asarray(b, np.uint32).view(np.float32)


def _operands(rng, n):
  """x with many subnormals and zeros (both signs), enc across the range the quantizer produces."""
  x_bits = np.concatenate([
      rng.integers(0, 1 << 23, n, dtype=np.uint32),  # subnormals (and +0)
      rng.integers(1 << 23, 0x7F800000, n, dtype=np.uint32),  # normals
      np.array([0, 1, (1 << 23) - 1, 1 << 23, 0x7F7FFFFF], np.uint32),
  ])
  x_bits = x_bits | (rng.integers(0, 2, x_bits.size, dtype=np.uint32) << 31)
  enc = np.concatenate([
      np.exp2(rng.uniform(-20, 127, x_bits.size // 2)),
      np.exp2(rng.uniform(20, 30, x_bits.size - x_bits.size // 2)),  # around 2**23: the subnormal branch's edge
  ]).astype(np.float32)
  enc[:4] = [np.float32(2.0**23), np.float32(2.0**23) * np.float32(1.5), np.finfo(np.float32).max, 1.0]
  return x_bits, rng.permutation(enc)


def test_plain_product_with_subnormals_equals_the_flush_to_zero_safe_product():
  x_bits, enc = _operands(np.random.default_rng(0), 20000)
  with np.errstate(over="ignore"):
    ieee = np.abs(_f32_from_bits(x_bits)) * enc  # numpy: IEEE fp32 with subnormals
  safe = np.asarray(jax.jit(formulas.abs_times_enc_flush_to_zero_safe)(jnp.asarray(x_bits), jnp.asarray(enc)))
  # Below 2**-100 both forms give E2M1 code 0 (RNE: below 0.25; SR: floor(2 * y + u) = 0 for u <= 255/256);
  # the safe form is exact above (a subnormal x times an enc below 2**23 is below 2**-103).
  big = ieee >= np.float32(2.0**-100)
  assert big.sum() > 10000 and (~big).sum() > 1000
  assert np.array_equal(ieee[big].view(np.uint32), safe[big].view(np.uint32))
  assert np.all((safe[~big] >= 0) & (safe[~big] < np.float32(2.0**-100)))
  # Subnormal x with a large enc: the branch the safe form computes from the integer significand.
  sub_x = (x_bits & 0x7F800000) == 0
  assert np.sum(sub_x & (enc >= 2.0**23) & big) > 100


def test_rht_upscale_of_tiny_groups_is_the_exact_product():
  rng = np.random.default_rng(1)
  bits = rng.integers(0, 0x22800000, (64, 16, 8), dtype=np.uint32)  # |x| < 2**-58, subnormals included
  bits[:, :4] = rng.integers(0, 1 << 23, (64, 4, 8), dtype=np.uint32)
  bits |= rng.integers(0, 2, bits.shape, dtype=np.uint32) << 31
  xb = _f32_from_bits(bits)
  tiny = rng.integers(0, 2, (64, 1, 8)).astype(bool)
  want = np.where(tiny, xb * np.float32(2.0**64), xb)  # numpy: IEEE, exact (a power of two, no overflow)
  upscale = jax.jit(lambda b, t: hadamard.upscale_flush_to_zero_safe(jax.lax.bitcast_convert_type(b, jnp.float32), t))
  got = np.asarray(upscale(jnp.asarray(bits), jnp.asarray(tiny)))
  assert np.array_equal(want.view(np.uint32), got.view(np.uint32))
  assert np.sum(tiny & (np.abs(xb) < np.float32(2.0**-126)) & (xb != 0)) > 100
