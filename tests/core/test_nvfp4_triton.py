"""The Pallas Triton kernels (``core/quantizer/pallas_triton.py``) give the XLA form's bits, checked on a CPU.

The kernel runs through Pallas's interpreter here (the same kernel body, as XLA:CPU ops), with the
flush-to-zero-safe form of ``fl(|x| * enc)`` that XLA:CPU needs (on XLA:GPU it takes the plain product;
``test_nvfp4_gpu_paths.py`` checks the two agree). Against ``quantize_values``' XLA form, bit for bit:
values and amax, round to nearest and stochastic rounding, bf16 and fp32 operands with zeros, subnormals,
NaN and Inf, every tile size (block counts that are not powers of two), operands sharded over a 2x2 mesh
(each device's kernel takes its shard; the SR bits stay the global positions'), and batched: under one
``vmap`` (MoE's experts) a kernel over the whole batch with each slice's amax, SR key and positions, under
a second the XLA form. The golden vectors and the independent reference, for every implementation:
``test_quantizer_implementations.py``. That XLA:GPU compiles the kernels is ``test_quantizer_hlo.py``'s and the
GPU byte pins' job.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_nvfp4.core import formats, fp8
from maxtext_nvfp4.core import nvfp4 as nv
from maxtext_nvfp4.core import prng
from maxtext_nvfp4.core.quantizer import api, hadamard, xla
from maxtext_nvfp4.core.quantizer import pallas_triton as pt
from maxtext_nvfp4.core.quantizer import triton_kernels as tk


def _operand(rng, shape, dtype, specials=True):
  """Rows across a wide exponent range (subnormal to near FLT_MAX), with zeros of both signs, subnormals,
  ties of the E2M1 grid and (``specials``) a NaN or an Inf."""
  x = rng.standard_normal(shape).astype(np.float32) * np.exp2(rng.integers(-140, 120, shape[:-1] + (1,)))
  x = x.astype(np.float32)
  flat = x.reshape(-1)
  flat[:6] = [0.0, -0.0, 1e-40, -3e-45, 1.25, 3.5]
  if specials:
    flat[-1] = np.inf
  return jnp.asarray(x, dtype)


def _kernel_values(x, key=None):
  """The forced "triton" path: on a CPU, the kernels in Pallas's interpreter with the flush-to-zero-safe forms."""
  return jax.jit(lambda x, k: nv.quantize_values(x, stochastic_key=k, implementation="triton"))(x, key)


def _same(a, b):
  a, b = np.asarray(a), np.asarray(b)
  return a.shape == b.shape and np.array_equal(a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32),
                                               b.view(np.uint16 if b.dtype.itemsize == 2 else np.uint32))


def _pairwise(firsts):
  """Each of ``firsts`` with two of the four (dtype, stochastic rounding) pairs, alternating: every shape meets
  both dtypes and both roundings, and the four (dtype, rounding) pairs all occur (pairwise coverage at half the
  cases of the full product; each case is one interpreted kernel compile, seconds on a 2-core host)."""
  halves = (((jnp.bfloat16, False), (jnp.float32, True)), ((jnp.bfloat16, True), (jnp.float32, False)))
  return [pytest.param(f, d, sr, id=f"{f}-{jnp.dtype(d).name}-{'sr' if sr else 'rne'}")
          for i, f in enumerate(firsts) for d, sr in halves[i % 2]]


@pytest.mark.parametrize("shape, dtype, sr", _pairwise([(64, 256), (3, 5, 48), (40, 1040), (16,)]))
def test_kernel_gives_quantize_values_bits(shape, dtype, sr):
  x = _operand(np.random.default_rng(sum(shape)), shape, dtype, specials=shape != (16,))
  key = jax.random.key(11) if sr else None
  got_v, got_amax = _kernel_values(x, key)
  want_v, want_amax = nv.quantize_values(x, stochastic_key=key)
  assert _same(got_amax, want_amax)
  assert _same(got_v, want_v)
  assert len(np.unique(np.asarray(want_v, np.float32))) > 3  # not a degenerate operand


def _wgrad_operand(rng, shape, dtype):
  """Column groups of 16 rows across a wide exponent range, each within a few binades (their 16-term RHT
  sums are exact in fp32, so the sum order does not matter), some groups below 2**-60 (the RHT's tiny-group
  path; subnormals too), zeros, and an Inf."""
  t, n = shape
  scale = np.exp2(rng.integers(-150, 100, (t // 16, 1, n))).astype(np.float32)
  x = (rng.integers(-64, 65, (t // 16, 16, n)).astype(np.float32) / np.float32(64) * scale).reshape(t, n)
  x[:16, 0] = np.float32(3e-45) * rng.integers(-3, 4, 16)  # a subnormal group
  x[16:32, 1] = 0.0
  if n >= 96:
    x[-1, -1] = np.inf  # every value then +-0 or +-2688 (not for the degeneracy check below)
  return jnp.asarray(x, dtype)


@pytest.mark.parametrize("shape, dtype, sr", _pairwise([(64, 96), (32, 4), (48, 160)]))
def test_rht_kernel_gives_quantize_values_bits(shape, dtype, sr):
  x = _wgrad_operand(np.random.default_rng(sum(shape)), shape, dtype)
  key = jax.random.key(12) if sr else None
  fn = lambda x, k: pt.quantize_values(x, jnp.bfloat16, pt.COLS_RHT, k, interpret=True,  # noqa: E731
                                               flush_to_zero_safe=True)
  got_v, got_amax = jax.jit(fn)(x, key)
  want_v, want_amax = nv.quantize_values(x, axis=0, rht=True, stochastic_key=key)
  assert _same(got_amax, want_amax)
  assert _same(got_v, want_v)
  assert len(np.unique(np.asarray(want_v, np.float32))) > (1 if shape[1] >= 96 else 3)


def _same_tensor(got, want):
  """NVFP4Tensor bits: data and scale as their bytes, amax as fp32 bits, and the static fields."""
  as_bytes = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype.itemsize == 1  # noqa: E731
                                  else a)
  return (got.data.dtype == want.data.dtype and got.scale.dtype == want.scale.dtype
          and (got.axis, got.block_2d, got.rht, got.e4m3_bound) == (want.axis, want.block_2d, want.rht, want.e4m3_bound)
          and np.array_equal(np.asarray(nv.pack(got.data)), np.asarray(nv.pack(want.data)))
          and np.array_equal(as_bytes(got.scale), as_bytes(want.scale)) and _same(got.amax, want.amax))


@pytest.mark.parametrize("shape", [(64, 96), (32, 4), (48, 160)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rht_codes_kernel_gives_quantize_bits(shape, dtype):
  x = _wgrad_operand(np.random.default_rng(sum(shape) + 1), shape, dtype)
  got = jax.jit(lambda x: pt.quantize(x, interpret=True, flush_to_zero_safe=True))(x)
  want = nv.quantize(x, axis=0, rht=True)
  assert _same_tensor(got, want)
  assert len(np.unique(np.asarray(want.scale, np.float32))) > 1


def _weight(rng, shape, dtype):
  """W: 16x16 tiles each at its own scale (2**-12 .. 2**12: distinct E4M3 scales), a tile of subnormals, a zero
  tile, signed zeros and ties of the grid."""
  k, n = shape
  x = rng.standard_normal(shape).astype(np.float32) * np.repeat(np.repeat(
      np.exp2(rng.integers(-12, 12, (k // 16, n // 16))), 16, axis=0), 16, axis=1).astype(np.float32)
  x[0, :6] = [0.0, -0.0, 1e-40, -3e-45, 1.25, 3.5]
  x[:16, -16:] = np.float32(3e-45) * rng.integers(-3, 4, (16, 16))
  x[16:32, 16:32] = 0.0
  return jnp.asarray(x, dtype)


@pytest.mark.parametrize("shape", [(64, 256), (32, 48), (48, 2064)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_tiles_kernel_gives_quantize_2d_bits(shape, dtype):
  x = _weight(np.random.default_rng(sum(shape) + 2), shape, dtype)
  got = jax.jit(lambda x: pt.quantize(x, pt.TILES_2D, interpret=True, flush_to_zero_safe=True))(x)
  want = nv.quantize(x, block_2d=True)
  assert _same_tensor(got, want)
  assert len(np.unique(np.asarray(want.scale, np.float32))) > 3


def test_tiles_kernel_batched_and_under_vmap():
  rng = np.random.default_rng(41)
  x = jnp.stack([_weight(rng, (32, 64), jnp.bfloat16) for _ in range(3)])
  kernel = lambda x, **kw: pt.quantize(x, pt.TILES_2D, interpret=True, flush_to_zero_safe=True, **kw)  # noqa: E731
  xla_form = lambda x: xla.quantize(x, None, None, True, False)  # noqa: E731
  fn = jax.vmap(lambda x: api._kernel_unless_vmapped(kernel, xla_form, x))
  assert _pallas_calls(fn, x) == 1
  got = jax.jit(fn)(x)
  for i in range(3):
    assert _same_tensor(jax.tree_util.tree_map(lambda a, i=i: a[i], got), nv.quantize(x[i], block_2d=True)), i


@pytest.mark.parametrize("traced", [False, True])
def test_rht_column_of_unit_rows_is_tes_matrix(traced):
  """``hadamard.rht16_column`` (the kernels' RHT: a Python int column in the XLA form, a loop index in the
  kernels) of the 16 unit rows gives column c of TE's ``diag(s) H16 / 4``."""
  eye = jnp.eye(16, dtype=jnp.float32)
  column = lambda e, c: hadamard.rht16_column(list(e), c)  # noqa: E731
  col = jax.jit(column) if traced else column
  got = np.stack([np.asarray(col(eye, jnp.int32(c) if traced else c)) for c in range(16)], axis=1)
  assert np.array_equal(got, np.asarray(nv.rht_matrix()))


def test_rht_block_maxima_round_back_once_equal_the_rounded_rows_maxima():
  """The RHT kernels' block maxima round the maximum of the unrounded sums back once (``_rht_amax_bits``);
  bit for bit the maximum of the 16 rounded rows, canonical NaN included: sums across bf16 ties, the tiny
  groups' subnormal boundary (2**-62 at their 2**64 scale), rounding up to Inf, Inf and NaN with a payload."""
  rng = np.random.default_rng(12)
  cols = 4096
  y = rng.standard_normal((16, cols)).astype(np.float32) * np.exp2(rng.integers(-70, 127, (1, cols))).astype(np.float32)
  y[:, :64] = np.float32(2.0**-62) * (1 + rng.integers(-300, 300, (16, 64)).astype(np.float32) * 2.0**-9)
  ties = (np.arange(1, 17, dtype=np.uint32)[:, None] * 0x10000 + 0x3F808000).view(np.float32)  # 1 + (2k+1) 2**-8
  y[:, 64:80] = np.broadcast_to(ties, (16, 16)) * np.where(rng.random((16, 16)) < 0.5, -1, 1)
  y[3, 80] = np.float32(3.4e38)  # rounds to Inf in bf16
  y[5, 81] = -np.inf
  y[7, 82] = np.uint32(0x7FA00005).view(np.float32)  # a NaN with a payload
  tiny = jnp.asarray(rng.random(cols) < 0.5).at[:64].set(True).at[80:83].set(False)
  rows = jnp.asarray(y)
  back = lambda v: hadamard.round_back(v, tiny, rint=tk._rint_nonnegative)  # noqa: E731
  got = jax.jit(lambda r: tk._rht_amax_bits(lambda c: r[c], back, (cols,)))(rows)
  want = formats.canonical_nan_bits(jnp.max(jnp.stack([tk.abs_bits(back(rows[c])) for c in range(16)]), axis=0))
  assert np.array_equal(np.asarray(got), np.asarray(want))
  assert int(got[80]) == 0x7F800000 and int(got[81]) == 0x7F800000 and int(got[82]) == 0x7FC00000


def test_nan_operand_poisons_every_value_as_the_xla_form():
  x = _operand(np.random.default_rng(5), (32, 64), jnp.bfloat16).at[3, 7].set(jnp.nan)
  got_v, got_amax = _kernel_values(x)
  want_v, want_amax = nv.quantize_values(x)
  assert np.isnan(np.asarray(got_amax)) and np.isnan(np.asarray(want_amax))
  assert _same(got_v, want_v) and np.all(np.isnan(np.asarray(got_v, np.float32)))


def test_a_nan_amax_is_the_quiet_nan_on_every_path():
  """A NaN's payload depends on the arithmetic that made it (on the H200 XLA's RHT and the RHT kernels gave
  different ones); every path's amax is the quiet NaN 0x7FC00000, here from an input NaN with a payload."""
  x = _operand(np.random.default_rng(6), (64, 64), jnp.bfloat16, specials=False)
  x = x.at[5, 9].set(jax.lax.bitcast_convert_type(jnp.uint16(0xFFA5), jnp.bfloat16))
  key = jax.random.key(2)
  kw = dict(interpret=True, flush_to_zero_safe=True)
  amaxes = {
      "kernel rows": _kernel_values(x)[1],
      "kernel rows sr": _kernel_values(x, key)[1],
      "kernel rht sr": pt.quantize_values(x, jnp.bfloat16, pt.COLS_RHT, key, **kw)[1],
      "kernel rht codes": pt.quantize(x, **kw).amax,
      "kernel tiles": pt.quantize(x, pt.TILES_2D, **kw).amax,
      "xla 1x16": nv.quantize(x).amax,
      "xla rht sr": nv.quantize_values(x, axis=0, rht=True, stochastic_key=key)[1],
      "xla 16x16": nv.quantize(x, block_2d=True).amax,
      "fp8": fp8.quantize(x).amax,
  }
  got = {k: hex(int(np.asarray(v, np.float32).view(np.uint32))) for k, v in amaxes.items()}
  assert got == dict.fromkeys(amaxes, hex(0x7FC00000))


def test_rint_nonnegative_is_round_half_even():
  rng = np.random.default_rng(2)
  halves = np.arange(0, 2**12, dtype=np.float32) / np.float32(2)
  t = np.concatenate([halves, rng.uniform(0, 2**24, 20000).astype(np.float32), np.float32([2**24, 2**30 + 64])])
  got = np.asarray(jax.jit(tk._rint_nonnegative)(jnp.asarray(t)))
  assert np.array_equal(got, np.round(t).astype(np.float32))  # numpy rounds half to even


@pytest.mark.parametrize("sr", [False, True])
@pytest.mark.parametrize("rht", [False, True])
def test_vmap_takes_the_xla_form_per_slice(sr, rht):
  x = _operand(np.random.default_rng(3), (4, 32, 64), jnp.bfloat16, specials=False)
  keys = jax.random.split(jax.random.key(4), 4) if sr else None
  kw = dict(axis=0, rht=True) if rht else {}
  fn = jax.vmap(lambda a, k: nv.quantize_values(a, stochastic_key=k, **kw), in_axes=(0, 0 if sr else None))
  got_v, got_amax = jax.jit(fn)(x, keys)
  for i in range(4):
    want_v, want_amax = nv.quantize_values(x[i], stochastic_key=None if keys is None else keys[i], **kw)
    assert _same(got_v[i], want_v) and _same(got_amax[i], want_amax)


@pytest.mark.parametrize("partitionable", [True, False])
def test_kernel_threefry_is_jax_random_bits(partitionable):
  """The kernels draw SR's two key words from the key's Threefry words themselves: jax.random.bits's."""
  keys = jax.random.split(jax.random.key(31), 512)
  words = jax.random.key_data(keys)
  with jax.threefry_partitionable(partitionable):
    want = np.asarray(jax.vmap(lambda k: jax.random.bits(k, (2,), jnp.uint32))(keys))
  got = jax.jit(lambda a, b: tk._threefry_bits2(a, b, partitionable))(words[:, 0], words[:, 1])
  assert np.array_equal(np.stack([np.asarray(w) for w in got], axis=1), want)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_sr_kernel_with_another_prng_or_a_raw_key(impl):
  """A non-Threefry key's bits are drawn outside the kernel; a raw uint32[2] key is a Threefry key."""
  x = _operand(np.random.default_rng(32), (32, 64), jnp.bfloat16, specials=False)
  key = jax.random.PRNGKey(33) if impl == "threefry2x32" else jax.random.key(33, impl=impl)
  got_v, got_amax = _kernel_values(x, key)
  want_v, want_amax = nv.quantize_values(x, stochastic_key=key)
  assert _same(got_v, want_v) and _same(got_amax, want_amax)


def _jax_chain(key, data):
  for d in data:
    key = jax.random.fold_in(key, d)
  return key


# Pairwise: every chain length with both layouts and both threefry modes, and all four (layout, mode) pairs.
_FOLD_CASES = [pytest.param(layout, partitionable, data, id=f"{name}-{'rows' if layout == pt.ROWS else 'cols_rht'}-"
                            f"{'partitionable' if partitionable else 'classic'}")
               for i, (name, data) in enumerate([("1 fold", [2]), ("3 folds", [5, 1, 2]),
                                                 ("6 folds", [0, 2**32 - 1, 3, 9, 4, 1])])
               for layout, partitionable in (((pt.ROWS, True), (pt.COLS_RHT, False)),
                                             ((pt.ROWS, False), (pt.COLS_RHT, True)))[i % 2]]


@pytest.mark.parametrize("layout, partitionable, data", _FOLD_CASES)
def test_kernel_applies_a_folded_keys_chain_as_jax_fold_in(layout, partitionable, data):
  """A FoldedKey's fold data reach the kernel (the last one traced), which applies them to the key's words: the
  bits of the key jax.random.fold_in derives."""
  x = _slices_operand(layout, np.random.default_rng(41), n=1)[0]
  base = jax.random.key(42)

  def kernel(x, last):
    key = base
    for d in data[:-1]:
      key = prng.fold_in(key, d)
    key = prng.fold_in(key, last)
    return pt.quantize_values(x, jnp.bfloat16, layout, key, interpret=True, flush_to_zero_safe=True)

  with jax.threefry_partitionable(partitionable):
    got_v, got_amax = jax.jit(kernel)(x, jnp.uint32(data[-1]))
    want_v, want_amax = nv.quantize_values(x, stochastic_key=_jax_chain(base, data), **_slice_kwargs(layout))
    other_v, _ = nv.quantize_values(x, stochastic_key=_jax_chain(base, data[:-1] + [data[-1] + 1]),
                                    **_slice_kwargs(layout))
  assert _same(got_amax, want_amax) and _same(got_v, want_v)
  assert not _same(got_v, other_v)  # the last fold matters


def _slices_operand(layout, rng, n=3):
  """n independent operands stacked (a batch of experts): each its own exponent range, so each slice has its
  own amax and block scales."""
  if layout == pt.ROWS:
    return jnp.stack([_operand(rng, (32, 64), jnp.bfloat16, specials=False) for _ in range(n)])
  return jnp.stack([_wgrad_operand(rng, (32, 64), jnp.bfloat16) for _ in range(n)])


def _slice_kwargs(layout):
  return {} if layout == pt.ROWS else dict(axis=0, rht=True)


@pytest.mark.parametrize("layout", [pt.ROWS, pt.COLS_RHT])
@pytest.mark.parametrize("keys", ["rne", "one key", "a key per slice"])
def test_batched_kernel_gives_each_slice_its_bits(layout, keys):
  x = _slices_operand(layout, np.random.default_rng(21))
  key = {"rne": None, "one key": jax.random.key(22), "a key per slice": jax.random.split(jax.random.key(23), 3)}[keys]
  per_slice = keys == "a key per slice"
  got_v, got_amax = jax.jit(lambda x, k: pt.quantize_values(
      x, jnp.bfloat16, layout, k, batched=True, key_batched=per_slice, interpret=True, flush_to_zero_safe=True))(x, key)
  assert got_amax.shape == (3,)
  for i in range(3):
    k = key[i] if per_slice else key
    want_v, want_amax = nv.quantize_values(x[i], stochastic_key=k, **_slice_kwargs(layout))
    assert _same(got_amax[i], want_amax) and _same(got_v[i], want_v), i
  assert len({float(a) for a in np.asarray(got_amax)}) == 3  # the slices' amaxes differ: per-slice scalars


def test_batched_codes_kernel_gives_each_slice_its_bits():
  x = _slices_operand(pt.COLS_RHT, np.random.default_rng(24))
  got = jax.jit(lambda x: pt.quantize(x, batched=True, interpret=True, flush_to_zero_safe=True))(x)
  for i in range(3):
    want = nv.quantize(x[i], axis=0, rht=True)
    assert _same_tensor(jax.tree_util.tree_map(lambda a, i=i: a[i], got), want), i


def _vmappable(layout):
  """api's dispatch between the kernel and the XLA form (``_kernel_unless_vmapped``), the kernel in Pallas's
  interpreter: what runs on XLA:GPU, here on the CPU."""
  kw = _slice_kwargs(layout)
  axis_n = 0 if kw else 1

  def fn(x, key):
    kernel = lambda x, *k, **b: pt.quantize_values(  # noqa: E731
        x, jnp.bfloat16, layout, *k, interpret=True, flush_to_zero_safe=True, **b)
    xla_form = lambda x, *k: xla.quantize_values(  # noqa: E731
        x, k[0] if k else None, axis_n, False, bool(kw), jnp.bfloat16)
    return api._kernel_unless_vmapped(kernel, xla_form, x, key)

  return fn


def _pallas_calls(fn, *args):
  return str(jax.make_jaxpr(fn)(*args)).count("pallas_call")


@pytest.mark.parametrize("layout", [pt.ROWS, pt.COLS_RHT])
def test_vmap_over_fold_data_runs_the_batched_kernel(layout):
  """MoE's experts: one start key for every slice, each slice's own fold (vmapped data) -- the start key is
  broadcast to the batch and the batched kernel gives each slice the bits of its jax.random.fold_in key."""
  x = _slices_operand(layout, np.random.default_rng(43), n=4)
  base = jax.random.key(44)
  fn = jax.vmap(lambda xi, i: _vmappable(layout)(xi, prng.fold_in(prng.fold_in(base, 7), i)))
  assert _pallas_calls(fn, x, jnp.arange(4)) == (1 if layout == pt.ROWS else 2)
  got_v, got_amax = jax.jit(fn)(x, jnp.arange(4))
  for i in range(4):
    want_v, want_amax = nv.quantize_values(x[i], stochastic_key=_jax_chain(base, [7, i]), **_slice_kwargs(layout))
    assert _same(got_v[i], want_v) and _same(got_amax[i], want_amax), i


@pytest.mark.parametrize("layout", [pt.ROWS, pt.COLS_RHT])
def test_vmap_runs_the_batched_kernel_and_a_second_vmap_the_xla_form(layout):
  x = _slices_operand(layout, np.random.default_rng(25), n=4)
  keys = jax.random.split(jax.random.key(26), 4)
  once = jax.vmap(_vmappable(layout))
  assert _pallas_calls(once, x, keys) == (1 if layout == pt.ROWS else 2)  # values (+ the RHT amax): one call each
  got_v, got_amax = jax.jit(once)(x, keys)
  x2, keys2 = x.reshape((2, 2) + x.shape[1:]), keys.reshape(2, 2)
  twice = jax.vmap(jax.vmap(_vmappable(layout)))
  assert _pallas_calls(twice, x2, keys2) == 0
  got2_v, got2_amax = jax.jit(twice)(x2, keys2)
  for i in range(4):
    want_v, want_amax = nv.quantize_values(x[i], stochastic_key=keys[i], **_slice_kwargs(layout))
    assert _same(got_v[i], want_v) and _same(got_amax[i], want_amax), i
    assert _same(got2_v[i // 2, i % 2], want_v) and _same(got2_amax[i // 2, i % 2], want_amax), i


_SHARDED = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from maxtext_nvfp4.core import nvfp4 as nv, prng
from maxtext_nvfp4.core.quantizer import api, xla, pallas_triton as pt
assert jax.device_count() == 4, jax.devices()
def folded(seed, *data):  # (a FoldedKey, the key jax.random.fold_in derives)
  f = j = jax.random.key(seed)
  for d in data:
    f, j = prng.fold_in(f, d), jax.random.fold_in(j, d)
  return f, j
mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
rng = np.random.default_rng(0)
x = jnp.asarray(rng.standard_normal((64, 512)) * np.exp2(rng.integers(-10, 10, (64, 1))), jnp.bfloat16)
kernel = jax.jit(lambda x, k: pt.quantize_values(
    x, jnp.bfloat16, pt.ROWS, k, interpret=True, flush_to_zero_safe=True))
for spec in [P("a", "b"), P(("b", "a"), None), P(None, ("a", "b"))]:
  xs = jax.device_put(x, NamedSharding(mesh, spec))
  for key, ref in [(None, None), (jax.random.key(3),) * 2 if spec == P("a", "b") else folded(3, 9, 2)]:
    got, amax = kernel(xs, key)
    want, want_amax = nv.quantize_values(x, stochastic_key=ref)
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, spec), 2), (got.sharding.spec, spec)
    assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16)), (spec, key)
    assert np.asarray(amax) == np.asarray(want_amax)
    assert "all-gather" not in kernel.lower(xs, key).compile().as_text(), spec
rht = jax.jit(lambda x, k: pt.quantize_values(
    x, jnp.bfloat16, pt.COLS_RHT, k, interpret=True, flush_to_zero_safe=True))
for spec in [P("a", "b"), P(None, ("b", "a")), P(("a", "b"), None)]:
  xs = jax.device_put(x, NamedSharding(mesh, spec))
  for key, ref in [(None, None), (jax.random.key(5),) * 2 if spec == P("a", "b") else folded(5, 1, 2, 3)]:
    got, amax = rht(xs, key)
    want, want_amax = nv.quantize_values(x, axis=0, rht=True, stochastic_key=ref)
    assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16)), ("rht", spec, key)
    assert np.asarray(amax) == np.asarray(want_amax), ("rht", spec)
    assert "all-gather" not in rht.lower(xs, key).compile().as_text(), ("rht", spec)
# columns sharded into shards of 6 (not whole SR words of 4): the RHT SR kernels hash per element there
x12, key12 = x[:, :12], jax.random.key(13)
xs12 = jax.device_put(x12, NamedSharding(mesh, P(None, "b")))
got_v, _ = rht(xs12, key12)
want_v, _ = nv.quantize_values(x12, axis=0, rht=True, stochastic_key=key12)
assert np.array_equal(np.asarray(got_v).view(np.uint16), np.asarray(want_v).view(np.uint16)), "rht 6-column shards"
got_c = jax.jit(lambda x, k: pt.quantize(x, pt.COLS_RHT, k, interpret=True, flush_to_zero_safe=True))(xs12, key12)
want_c = nv.quantize(x12, axis=0, rht=True, stochastic_key=key12)
assert np.array_equal(np.asarray(nv.pack(got_c.data)), np.asarray(nv.pack(want_c.data))), "codes 6-column shards"
codes = jax.jit(lambda x: pt.quantize(x, interpret=True, flush_to_zero_safe=True))
for spec in [P("a", "b"), P(None, ("b", "a")), P(("a", "b"), None)]:
  xs = jax.device_put(x, NamedSharding(mesh, spec))
  got, want = codes(xs), nv.quantize(x, axis=0, rht=True)
  assert np.array_equal(np.asarray(nv.pack(got.data)), np.asarray(nv.pack(want.data))), ("codes", spec)
  assert np.array_equal(np.asarray(got.scale, np.float32), np.asarray(want.scale, np.float32)), ("codes", spec)
  assert np.asarray(got.amax) == np.asarray(want.amax), ("codes", spec)
  assert "all-gather" not in codes.lower(xs).compile().as_text(), ("codes", spec)
# one amax pass for both quantizations (pt.amaxes), then the quantizers given them, on sharded operands
shared = jax.jit(lambda x, k: (lambda a: (a, pt.quantize_values(
    x, jnp.bfloat16, pt.COLS_RHT, k, amax=a[1], interpret=True, flush_to_zero_safe=True), pt.quantize(
    x, pt.COLS_RHT, k, amax=a[1], interpret=True, flush_to_zero_safe=True), pt.quantize(
    x, pt.ROWS, k, amax=a[0], interpret=True, flush_to_zero_safe=True)))(
    pt.amaxes(x, interpret=True, flush_to_zero_safe=True)))
for spec in [P("a", "b"), P(None, ("b", "a")), P(("a", "b"), None)]:
  xs, key = jax.device_put(x, NamedSharding(mesh, spec)), jax.random.key(11)
  (amax, rht_amax), (got_v, _), got_c, got_r = jax.device_get(shared(xs, key))
  want_c, want_r = nv.quantize(x, axis=0, rht=True, stochastic_key=key), nv.quantize(x, stochastic_key=key)
  assert np.asarray(amax) == np.abs(np.asarray(x, np.float32)).max() == np.asarray(want_r.amax), ("shared", spec)
  assert np.asarray(rht_amax) == np.asarray(want_c.amax), ("shared", spec)
  want_v, _ = nv.quantize_values(x, axis=0, rht=True, stochastic_key=key)
  assert np.array_equal(np.asarray(got_v).view(np.uint16), np.asarray(want_v).view(np.uint16)), ("shared", spec)
  for got, want in ((got_c, want_c), (got_r, want_r)):
    assert np.array_equal(np.asarray(nv.pack(jnp.asarray(got.data))), np.asarray(nv.pack(want.data))), ("shared", spec)
    assert np.array_equal(np.asarray(got.scale, np.float32), np.asarray(want.scale, np.float32)), ("shared", spec)
  assert "all-gather" not in shared.lower(xs, key).compile().as_text(), ("shared", spec)
xb = jnp.stack([x[:, :256], x[:, 256:] * 64, x[:, :256] / 1024, x[:, 256:]])  # 4 slices, 4 amaxes
keys = jax.random.split(jax.random.key(7), 4)
for layout, kw, spec in [(pt.ROWS, {}, P("a", None, "b")), (pt.COLS_RHT, dict(axis=0, rht=True), P("a", "b", None))]:
  batched = jax.jit(lambda x, k: pt.quantize_values(
      x, jnp.bfloat16, layout, k, batched=True, key_batched=True, interpret=True, flush_to_zero_safe=True))
  xs = jax.device_put(xb, NamedSharding(mesh, spec))
  # on the host before slicing: slicing a sharded array on the devices sums masked shards (-0.0 + 0.0 = +0.0)
  got, amax = jax.device_get(batched(xs, keys))
  for i in range(4):
    want, want_amax = nv.quantize_values(xb[i], stochastic_key=keys[i], **kw)
    assert np.array_equal(np.asarray(got[i]).view(np.uint16), np.asarray(want).view(np.uint16)), ("batched", layout, i)
    assert np.asarray(amax[i]) == np.asarray(want_amax), ("batched", layout, i)
  assert "all-gather" not in batched.lower(xs, keys).compile().as_text(), ("batched", layout)
bcodes = jax.jit(lambda x: pt.quantize(x, batched=True, interpret=True, flush_to_zero_safe=True))
xs = jax.device_put(xb, NamedSharding(mesh, P("a", None, "b")))
got = jax.device_get(bcodes(xs))
for i in range(4):
  want = nv.quantize(xb[i], axis=0, rht=True)
  assert np.array_equal(np.asarray(nv.pack(jnp.asarray(got.data[i]))), np.asarray(nv.pack(want.data))), ("bcodes", i)
  assert np.array_equal(np.asarray(got.scale[i], np.float32), np.asarray(want.scale, np.float32)), ("bcodes", i)
  assert np.asarray(got.amax[i]) == np.asarray(want.amax), ("bcodes", i)
assert "all-gather" not in bcodes.lower(xs).compile().as_text(), "bcodes"
tiles = jax.jit(lambda x: pt.quantize(x, pt.TILES_2D, interpret=True, flush_to_zero_safe=True))
for spec in [P("a", "b"), P(None, ("a", "b"))]:
  xs = jax.device_put(x, NamedSharding(mesh, spec))
  got, want = jax.device_get(tiles(xs)), nv.quantize(x, block_2d=True)
  assert np.array_equal(np.asarray(nv.pack(jnp.asarray(got.data))), np.asarray(nv.pack(want.data))), ("tiles", spec)
  assert np.array_equal(np.asarray(got.scale, np.float32), np.asarray(want.scale, np.float32)), ("tiles", spec)
  assert "all-gather" not in tiles.lower(xs).compile().as_text(), ("tiles", spec)
# A batch whose type carries its sharding (an Explicit mesh axis) takes the XLA form under vmap.
emesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
def dispatch(x, k):
  kernel = lambda x, *k, **b: pt.quantize_values(x, jnp.bfloat16, pt.ROWS, *k, interpret=True,
                                                         flush_to_zero_safe=True, **b)
  xla_form = lambda x, *k: xla.quantize_values(x, k[0] if k else None, 1, False, False, jnp.bfloat16)
  return api._kernel_unless_vmapped(kernel, xla_form, x, k)
with jax.set_mesh(emesh):
  xe, ke = (jax.device_put(a, NamedSharding(emesh, P("a"))) for a in (xb, keys))
  assert "pallas_call" not in str(jax.make_jaxpr(jax.vmap(dispatch))(xe, ke))
  got, amax = jax.device_get(jax.jit(jax.vmap(dispatch))(xe, ke))
for i in range(4):
  want, want_amax = nv.quantize_values(xb[i], stochastic_key=keys[i])
  assert np.array_equal(np.asarray(got[i]).view(np.uint16), np.asarray(want).view(np.uint16)), ("explicit", i)
print("ok")
"""


def test_sharded_operand_each_device_quantizes_its_shard_with_global_bits():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
  out = subprocess.run([sys.executable, "-c", _SHARDED], env=env, capture_output=True, text=True, timeout=600,
                       check=False)
  assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_vmapped_rht_quantize_takes_the_xla_form_per_slice():
  x = _operand(np.random.default_rng(6), (3, 32, 64), jnp.bfloat16, specials=False)
  got = jax.jit(jax.vmap(lambda a: nv.quantize(a, axis=0, rht=True)))(x)
  for i in range(3):
    want = nv.quantize(x[i], axis=0, rht=True)
    assert np.array_equal(np.asarray(got.data[i], np.float32), np.asarray(want.data, np.float32))
    assert np.array_equal(np.asarray(got.scale[i], np.float32), np.asarray(want.scale, np.float32))
    assert _same(got.amax[i], want.amax)


def _kernel_jaxprs(jaxpr):
  """The kernel bodies of every pallas_call in ``jaxpr`` (through custom_partitioning, vmap rules, jit)."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      yield eqn.params["jaxpr"]
    for p in eqn.params.values():
      for sub in p if isinstance(p, (tuple, list)) else (p,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from _kernel_jaxprs(sub)


def _float_ops(jaxpr, names):
  out = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in names and any(jnp.issubdtype(v.aval.dtype, jnp.floating) for v in eqn.invars):
      out.append(f"{eqn.primitive.name} at {jax._src.source_info_util.summarize(eqn.source_info)}")
    for p in eqn.params.values():
      for sub in p if isinstance(p, (tuple, list)) else (p,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          out += _float_ops(sub, names)
  return out


def test_kernels_use_no_float_neg_min_or_max():
  """Pallas's Triton lowering negates a float as ``0 - x`` (-0.0 becomes +0.0) and lowers min/max as
  minnum/maxnum (a NaN operand yields the other one); Pallas's interpreter, like XLA, flips the sign bit and
  propagates NaN. So the CPU tests cannot see those differences, and the kernels must not contain such ops
  (``formats.negate_where``, ``copysign``, ``min_nan`` instead; on the H200 they cost signed zeros and NaN
  scales)."""
  x, key = jnp.zeros((64, 256), jnp.bfloat16), jax.random.key(0)
  calls = [lambda x, k: pt.quantize_values(x, jnp.bfloat16, pt.ROWS, k),
           lambda x, k: pt.quantize_values(x, jnp.bfloat16, pt.COLS_RHT, k),
           lambda x, k: pt.quantize_codes(x, pt.COLS_RHT),
           lambda x, k: pt.quantize_codes(x, pt.TILES_2D),
           # the shared amax pass, and the RHT kernels that take their block maxima from their own tiles
           lambda x, k: pt.amaxes(x),
           lambda x, k: pt.quantize_values(x, jnp.bfloat16, pt.COLS_RHT, k, amax=pt.amaxes(x)[1]),
           lambda x, k: pt.quantize_codes(x, pt.COLS_RHT, k, amax=pt.amaxes(x)[1])]
  for call in calls:
    kernels = list(_kernel_jaxprs(jax.make_jaxpr(call)(x, key).jaxpr))
    assert kernels, "no pallas_call found: the check would pass vacuously"
    for kernel in kernels:
      assert not _float_ops(kernel, ("neg", "min", "max")), _float_ops(kernel, ("neg", "min", "max"))


_LOWBIAS32 = {0x7FEB352D, 0x846CA68B}  # random_bits.lowbias32's multipliers


def _uint32_products(jaxpr):
  """Element counts of every multiply by one of lowbias32's constants in ``jaxpr`` (nested jaxprs included): the
  SR hash's work."""
  out = []
  for eqn in jaxpr.eqns:
    literal = [int(np.asarray(v.val)) for v in eqn.invars if hasattr(v, "val") and np.ndim(v.val) == 0]
    if eqn.primitive.name == "mul" and eqn.outvars[0].aval.dtype == jnp.uint32 and _LOWBIAS32 & set(literal):
      out.append(int(np.prod(eqn.outvars[0].aval.shape)))
    for p in eqn.params.values():
      for sub in p if isinstance(p, (tuple, list)) else (p,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          out += _uint32_products(sub)
  return out


def test_sr_kernels_hash_each_word_once():
  """The SR kernels hash each 32-bit word once for its 4 elements (the tile laid out as words of 4:
  ``_row_fraction``, ``_group_fraction``), not once per element: every multiply of the hash (lowbias32's two per
  round, two rounds) runs on a quarter of the elements it draws for (the 1x16 kernels: the tile; the RHT kernels:
  one of the group's 16 rows at a time). (Their bytes: the golden and XLA-form tests.)"""
  x, key = jnp.zeros((64, 256), jnp.bfloat16), jax.random.key(0)
  for per_hash, call in ((4, lambda x, k: pt.quantize_values(x, jnp.bfloat16, pt.ROWS, k)),
                         (4, lambda x, k: pt.quantize_codes(x, pt.ROWS, k)),
                         (64, lambda x, k: pt.quantize_values(x, jnp.bfloat16, pt.COLS_RHT, k)),
                         (64, lambda x, k: pt.quantize_codes(x, pt.COLS_RHT, k))):
    kernels = [k for k in _kernel_jaxprs(jax.make_jaxpr(call)(x, key).jaxpr) if _uint32_products(k)]
    assert kernels, "no pallas_call hashes: the check would pass vacuously"
    for kernel in kernels:
      tile = max(int(np.prod(v.aval.shape)) for v in kernel.invars if v.aval.dtype == jnp.bfloat16)
      products = _uint32_products(kernel)
      assert products.count(tile // per_hash) >= 4 and max(products) == tile // per_hash, (tile, products)


def test_layout_only_where_a_kernel_computes_the_call():
  """The layout functions name a kernel exactly for the calls it computes, and otherwise say why not."""
  x, std = jnp.zeros((32, 64), jnp.bfloat16), nv.STANDARD_RULE
  values = lambda x, *a: pt.values_layout(x, *a)  # noqa: E731
  assert values(x, 1, False, False, std) == (pt.ROWS, None)
  assert values(x, 0, False, True, std) == (pt.COLS_RHT, None)
  for args, why in [((x, 0, False, False, std), "other than the last"),  # block axis not last, no RHT
                    ((x, 1, False, True, std), "other than axis 0"),  # RHT along the last axis
                    ((jnp.zeros((32, 6), jnp.bfloat16), 0, False, True, std), "multiple of 4"),  # columns not 4k
                    ((x, None, True, False, std), "16x16 tiles"),
                    ((x, 1, False, False, nv.ScaleRule(row_scaled=True)), "scale rule"),
                    ((x.astype(jnp.float16), 1, False, False, std), "float16")]:
    layout, reason = values(*args)
    assert layout is None and why in reason, (args[1:], reason)
  codes = lambda x, *a: pt.codes_layout(x, *a)  # noqa: E731
  assert codes(x, 0, False, True, std) == codes(x, 0, False, True, std, True) == (pt.COLS_RHT, None)  # RNE, SR
  assert codes(x, 1, False, False, std) == codes(x, 1, False, False, std, True) == (pt.ROWS, None)
  assert codes(x, None, True, False, std) == (pt.TILES_2D, None)  # W's 16x16 tiles
  for args, why in [((x, 0, False, False, std), "other than the last without RHT"),  # 1x16 along axis 0: XLA form
                    ((jnp.zeros((32, 40), jnp.bfloat16), None, True, False, std), "not a 2D matrix"),  # 40 columns
                    ((jnp.zeros((2, 32, 64), jnp.bfloat16), None, True, False, std), "not a 2D matrix"),
                    ((x, None, True, False, nv.ScaleRule(selection="4over6")), "scale rule"),
                    ((x, None, True, False, std, True), "stochastic rounding")]:
    layout, reason = codes(*args)
    assert layout is None and why in reason, (args[1:], reason)
