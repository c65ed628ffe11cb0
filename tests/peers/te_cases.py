"""Seeded generator of quantizer test cases for the TE-reference differential oracle (numpy only).

A case is ``(mode, dtype, dist, x)``: ``x`` an fp32 array (on the bf16 grid when ``dtype == "bf16"``),
``mode`` one of

  row   1x16 blocks along the last axis        TE: quant_tile_shape (1, 16), rowwise
  col   1x16 blocks along axis 0               TE: quant_tile_shape (1, 16), columnwise (of x.T)
  2d    16x16 tiles                            TE: quant_tile_shape (16, 16), rowwise
  rht   RHT along axis 0, then 1x16 blocks     TE: quant_tile_shape (1, 16), columnwise, with_rht

and ``dist`` names how ``x`` was drawn (DISTRIBUTIONS). ``variant`` names TE's recipe variant (VARIANTS:
4over6 with its E4M3 bound and error mode, row-scaled amax; ``standard`` otherwise), each drawn only with
the modes TE supports for it (:func:`generate_variants`); the variant cases add mode ``2dcol``, TE's
columnwise copy of a 16x16-tiled tensor (with 4over6 its tile error is summed along the other axis). Shapes are multiples of 16 up to a few hundred,
non-square, with 1-row (``row`` only) and one-block edge shapes. The RHT mode takes bf16 only (TE's RHT
kernels take bf16; the reference's fp32 RHT path is a plain fp32 matmul, not a kernel); half the ``row``
cases are fp32. The inputs are
built so that the rounding boundaries are hit exactly: ``e2m1_ties`` puts elements at x * enc = 0.25,
0.75, 1.25, 1.75, 2.5, 3.5 and 5 exactly (power-of-two scales make enc exact); ``e4m3_ties`` picks block
maxima with fl(bamax * fl(S_enc / 6)) exactly on the midpoint between two E4M3 values (exact
power-of-two c in bf16; searched and checked in numpy's IEEE fp32 otherwise), E4M3 subnormals included.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

MODES = ("row", "col", "2d", "rht")
# Shapes (rows, cols): multiples of 16, non-square; (1, *) only for the row mode.
SHAPES = ((16, 16), (16, 400), (400, 16), (32, 48), (48, 80), (80, 32), (64, 128), (128, 64), (96, 208),
          (144, 112), (160, 32), (208, 96), (256, 256), (272, 144), (304, 48), (112, 320))
ROW_ONLY_SHAPES = ((1, 16), (1, 272), (3, 48))
E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
  index: int  # position in the batch (npz key x<index>)
  mode: str  # one of MODES
  dtype: str  # "bf16" or "f32": the dtype both quantizers are given
  dist: str  # the distribution's name (DISTRIBUTIONS)
  x: np.ndarray  # fp32 values (exactly on the bf16 grid for "bf16")
  variant: str = "standard"  # a key of VARIANTS


def _e4m3_grid():
  return np.unique(np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)[:127])


def to_blocks(x, mode):
  """(n_blocks, block_size) copy of x's blocks for ``mode`` (16 elements, or 256 for 2d)."""
  m, n = x.shape
  if mode == "row":
    return x.reshape(-1, 16).copy()
  if mode == "2d":
    return x.reshape(m // 16, 16, n // 16, 16).transpose(0, 2, 1, 3).reshape(-1, 256).copy()
  return x.T.reshape(-1, 16).copy()


def from_blocks(b, mode, shape):
  """Inverse of :func:`to_blocks`."""
  m, n = shape
  if mode == "row":
    return b.reshape(m, n)
  if mode == "2d":
    return b.reshape(m // 16, n // 16, 16, 16).transpose(0, 2, 1, 3).reshape(m, n)
  return b.reshape(n, m).T.copy()


def _scale(rng, lo, hi):
  return np.float32(2.0) ** np.float32(rng.uniform(lo, hi))


def d_normal(rng, shape, mode):
  return rng.standard_normal(shape).astype(np.float32) * _scale(rng, -12, 12)


def d_heavy(rng, shape, mode):
  return rng.standard_t(rng.choice([1.2, 2.0, 3.0]), shape).astype(np.float32) * _scale(rng, -6, 6)


def d_spiky(rng, shape, mode):
  x = rng.standard_normal(shape).astype(np.float32) * _scale(rng, -8, 0)
  k = max(1, x.size // 200)
  flat = x.reshape(-1)
  flat[rng.integers(x.size, size=k)] *= np.float32(2.0) ** rng.uniform(8, 20, size=k).astype(np.float32)
  return x


def d_row_spread(rng, shape, mode):
  """Each row at its own scale, 2**U(-20, 20): 40 binades (inside every column block for col/rht)."""
  rows = (np.float32(2.0) ** rng.uniform(-20, 20, size=(shape[0], 1))).astype(np.float32)
  return rng.standard_normal(shape).astype(np.float32) * rows


def d_zero_blocks(rng, shape, mode):
  b = to_blocks(d_normal(rng, shape, mode), mode)
  pick = rng.random(b.shape[0]) < 0.25
  b[pick] = np.where(rng.random((int(pick.sum()), 1)) < 0.5, np.float32(-0.0), np.float32(0.0))
  if rng.random() < 0.05:
    b[:] = 0.0
  return from_blocks(b, mode, shape)


def d_exact_rht(rng, shape, mode):
  """bf16-grid magnitudes in [2**-3, 2**3] with random signs, times one power of two: every term x * (+-1/4)
  of a 16-point RHT sum is a multiple of 2**-12 (times that power) and the sum is below 2**6, so every partial
  sum is exact in fp32 in any order (< 2**18 ulps) -- TE's RHT of it never depends on its summation order."""
  mag = np.float32(2.0) ** rng.uniform(-3, 3, shape).astype(np.float32)
  x = to_bf16_grid(np.where(rng.random(shape) < 0.5, -mag, mag))
  return x * np.float32(2.0) ** np.float32(rng.integers(-20, 21))


def d_tiny(rng, shape, mode):
  """fp32 subnormals and tiny normals (for bf16: down to bf16's subnormals)."""
  x = rng.standard_normal(shape).astype(np.float64) * 2.0 ** rng.uniform(-148, -118)
  return x.astype(np.float32)


def d_tiny_1e36(rng, shape, mode):
  return (rng.standard_normal(shape) * 1e-36).astype(np.float32)


def d_near_max(rng, shape, mode):
  """amax within a factor 2 of bf16's maximum (so within FLT_MAX's binade)."""
  x = rng.standard_normal(shape)
  x = x / np.max(np.abs(x)) * BF16_MAX * rng.uniform(0.5, 1.0)
  return x.astype(np.float32)


def d_mixed_blocks(rng, shape, mode):
  """Every block at its own scale 2**U(-40, 40) (scale spreads of 80 binades across blocks)."""
  b = to_blocks(rng.standard_normal(shape).astype(np.float32), mode)
  b *= (np.float32(2.0) ** rng.uniform(-40, 40, size=(b.shape[0], 1))).astype(np.float32)
  return from_blocks(b, mode, shape)


def d_e2m1_ties(rng, shape, mode):
  """Elements exactly at every E2M1 rounding boundary of x * enc (exact power-of-two scales).

  The tensor amax is 2688 * 2**k (an anchor element), so S_enc = 2**-k and S_dec = 2**k exactly; a
  block whose max is 6 * e * 2**k with e = 2**j gets s8 = e and enc = 2**-(j + k), both exact, so an
  element t * e * 2**k lands on x * enc = t.
  """
  k = int(rng.integers(-30, 30))
  b = to_blocks(np.zeros(shape, np.float32), mode)
  nb, size = b.shape
  e = 2.0 ** rng.integers(-9, 9, size=(nb, 1))  # E4M3 powers of two 2**-9 .. 2**8
  t = rng.choice(np.concatenate([E2M1_TIES, [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0]]), size=(nb, size))
  t = t * rng.choice([-1.0, 1.0], size=(nb, size))
  t[np.arange(nb), rng.integers(size, size=nb)] = 6.0 * rng.choice([-1.0, 1.0], size=nb)  # block max: s8 = e
  x = from_blocks((t * e * 2.0 ** k).astype(np.float32), mode, shape)
  x.reshape(-1)[rng.integers(x.size)] = np.float32(2688.0 * 2.0 ** k)  # the tensor amax
  return x


def d_e4m3_ties(rng, shape, mode, exact_c=True):
  """Block maxima whose scaled value fl(bamax * c), c = fl(S_enc * fl(1/6)), is an E4M3 midpoint.

  ``exact_c``: the tensor amax is 448 * 2**-j, so S_enc = 6 * 2**j and c = 2**j exactly (6 * fl(1/6)
  rounds to 1), and a block max m * 2**-j (m a midpoint, <= 5 significant bits: bf16-exact) hits m.
  Otherwise (fp32 input) the amax is random and each block max is searched among fp32 neighbours of
  fl(m / c) for fl(b * c) == m.
  """
  grid = _e4m3_grid()
  mids = ((grid[:-1] + grid[1:]) / 2).astype(np.float32)  # (bamax <= amax keeps fl(bamax * c) <= 448)
  if exact_c:
    amax = np.float32(448.0 * 2.0 ** -int(rng.integers(-20, 20)))
  else:
    amax = np.float32(_scale(rng, -20, 20))
  s_enc = np.minimum(np.float32(2688.0) / amax, np.float32(np.finfo(np.float32).max))
  c = s_enc * (np.float32(1.0) / np.float32(6.0))
  blocks = to_blocks(rng.standard_normal(shape).astype(np.float32) * amax * np.float32(1e-4), mode)
  nb, size = blocks.shape
  m = mids[rng.integers(len(mids), size=nb)]
  b0 = (m / c).astype(np.float32)
  found = np.zeros(nb, bool)
  bmax = np.zeros(nb, np.float32)
  for cand in (b0, np.nextafter(b0, np.float32(np.inf)), np.nextafter(b0, np.float32(0))):
    hit = ~found & ((cand * c).astype(np.float32) == m) & (cand <= amax)
    bmax[hit], found = cand[hit], found | hit
  # Blocks with no fp32 max hitting their midpoint exactly stay as drawn.
  rows = np.nonzero(found)[0]
  blocks[rows] = np.clip(blocks[rows], -bmax[rows, None], bmax[rows, None])
  sign = rng.choice([np.float32(-1), np.float32(1)], size=len(rows))
  blocks[rows, rng.integers(size, size=len(rows))] = bmax[rows] * sign
  x = from_blocks(blocks, mode, shape)
  x.reshape(-1)[rng.integers(x.size)] = amax
  return x


DISTRIBUTIONS = {
    "normal": d_normal, "heavy": d_heavy, "spiky": d_spiky, "row_spread": d_row_spread,
    "zero_blocks": d_zero_blocks, "tiny": d_tiny, "tiny_1e-36": d_tiny_1e36, "near_max": d_near_max,
    "mixed_blocks": d_mixed_blocks, "e2m1_ties": d_e2m1_ties, "e4m3_ties": d_e4m3_ties,
}


# TE 2.20.2 recipe variants as NVFP4QuantizerRef keyword arguments, and the modes TE supports for each:
# 4over6 refuses RHT (and SR); row-scaled NVFP4 takes 1x16 tiles only.
VARIANTS = {
    "standard": dict(kw={}, modes=MODES),
    "4over6_mae_256": dict(kw=dict(nvfp4_use_4over6=True, nvfp4_e4m3_max=256, nvfp4_4over6_err_mode="MAE"),
                           modes=("row", "col", "2d", "2dcol")),
    "4over6_mse_256": dict(kw=dict(nvfp4_use_4over6=True, nvfp4_e4m3_max=256, nvfp4_4over6_err_mode="MSE"),
                           modes=("row", "col", "2d", "2dcol")),
    "4over6_mae_448": dict(kw=dict(nvfp4_use_4over6=True, nvfp4_e4m3_max=448, nvfp4_4over6_err_mode="MAE"),
                           modes=("row", "col", "2d", "2dcol")),
    "4over6_mse_448": dict(kw=dict(nvfp4_use_4over6=True, nvfp4_e4m3_max=448, nvfp4_4over6_err_mode="MSE"),
                           modes=("row", "col", "2d", "2dcol")),
    "row_scaled": dict(kw=dict(row_scaled_nvfp4=True), modes=("row", "col", "rht")),
    "row_scaled_4over6_mse_256": dict(kw=dict(row_scaled_nvfp4=True, nvfp4_use_4over6=True, nvfp4_e4m3_max=256,
                                              nvfp4_4over6_err_mode="MSE"), modes=("row", "col")),
}


NORMAL_RANGE = ("normal", "heavy", "spiky", "row_spread", "zero_blocks", "mixed_blocks", "e2m1_ties", "e4m3_ties")


def generate_variants(seed: int, n_cases: int, shapes, start: int = 0) -> list[Case]:
  """``n_cases`` variant cases: round-robin over every (variant, supported mode) pair and the distributions,
  shapes from ``shapes`` (16x16 tiles need both dims % 16: every shape here), bf16 and fp32 inputs."""
  rng = np.random.default_rng(seed + 17)
  pairs = [(v, m) for v, spec in VARIANTS.items() if v != "standard" for m in spec["modes"]]
  dists = list(DISTRIBUTIONS)
  cases = []
  for i in range(n_cases):
    variant, mode = pairs[i % len(pairs)]
    # The first case of every pair is in fp32's normal range (so each pair is compared exactly at least once;
    # tiny tensors may fall in a counted class); later ones from every distribution. An RHT pair's first case
    # is exact_rht: on other inputs of this size TE's bf16 RHT can depend on its fp32 summation order in some
    # 16-group (the counted ``order`` class), which left (row_scaled, rht) with no exact comparison for seed
    # 1019769777.
    pool = NORMAL_RANGE if i < len(pairs) else dists
    dist = pool[rng.integers(len(pool))]
    if i < len(pairs) and mode == "rht":
      dist = "exact_rht"
    shape = shapes[rng.integers(len(shapes))]
    dtype = "f32" if mode == "row" and rng.random() < 0.5 else "bf16"
    if dist == "exact_rht":
      x = d_exact_rht(rng, shape, mode)
    elif dist == "e4m3_ties":
      x = d_e4m3_ties(rng, shape, "2d" if mode == "2dcol" else mode, exact_c=dtype == "bf16")
    else:
      x = DISTRIBUTIONS[dist](rng, shape, "2d" if mode == "2dcol" else mode).astype(np.float32)
    if dtype == "bf16":
      x = to_bf16_grid(np.clip(x, -BF16_MAX, BF16_MAX))
    cases.append(Case(index=start + i, mode=mode, dtype=dtype, dist=dist, x=x, variant=variant))
  return cases


def to_bf16_grid(x):
  """RNE onto the bf16 grid (subnormals kept), as fp32."""
  return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def pick_shapes(rng, n_shapes, max_elements=None):
  """A random subset of SHAPES, always with (16, 16): each shape is 4-5 compiles on our side, and the
  peer's time grows with the elements (TE's ``cast_to_fp4x2`` is 16 masked passes), hence the cap."""
  rest = [s for s in SHAPES if s != (16, 16) and (max_elements is None or s[0] * s[1] <= max_elements)]
  idx = rng.choice(len(rest), size=min(n_shapes - 1, len(rest)), replace=False)
  return [(16, 16)] + [rest[i] for i in sorted(idx)]


def generate(seed: int, n_cases: int, n_shapes: int, max_elements: int | None = None) -> list[Case]:
  """``n_cases`` cases, round-robin over modes and distributions, shapes from ``pick_shapes``."""
  rng = np.random.default_rng(seed)
  shapes = pick_shapes(rng, n_shapes, max_elements)
  row_only = ROW_ONLY_SHAPES[rng.integers(len(ROW_ONLY_SHAPES))]
  dists = list(DISTRIBUTIONS)
  cases = []
  for i in range(n_cases):
    mode = MODES[i % len(MODES)]
    dist = dists[(i // len(MODES)) % len(dists)]
    if mode == "row" and rng.random() < 0.2:
      shape = row_only
    else:
      shape = shapes[rng.integers(len(shapes))]
    # fp32 input for half the row cases (each (shape, mode, dtype) is one compile on our side).
    dtype = "f32" if mode == "row" and rng.random() < 0.5 else "bf16"
    if dist == "e4m3_ties":
      x = d_e4m3_ties(rng, shape, mode, exact_c=dtype == "bf16")
    else:
      x = DISTRIBUTIONS[dist](rng, shape, mode).astype(np.float32)
    if dtype == "bf16":
      x = to_bf16_grid(np.clip(x, -BF16_MAX, BF16_MAX))
    assert np.all(np.isfinite(x)), dist
    cases.append(Case(index=i, mode=mode, dtype=dtype, dist=dist, x=x))
  return cases
