"""An INDEPENDENT numpy + ml_dtypes implementation of TE's NVFP4 quantizer (the oracle of the quantizer suites:
test_quantizer_implementations.py, test_numerics.py), with the input kinds and golden vectors they check it on.

Written from TE's CUDA kernels at commit d0067d0 (transformer_engine/common/cast/nvfp4/core_nvfp4.cuh:
compute_global_encode_scaling_factor_FP4 and the block-scale order; quantize_transpose_nvfp4.cuh: the element
path; hadamard_transform/ for the RHT); shares no code with maxtext_nvfp4 (numpy float32 keeps subnormals, as
TE's kernels do).
"""

import json
import pathlib

import ml_dtypes
import numpy as np

f32 = np.float32
FLT_MAX = np.finfo(f32).max
BF16_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
RHT_SIGNS = np.array([1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1], np.float64)


def hadamard16():
  """Sylvester H16[r, c] = (-1)**popcount(r & c)."""
  r = np.arange(16)
  pop = np.vectorize(lambda v: bin(v).count("1"))(r[:, None] & r[None, :])
  return np.where(pop % 2 == 0, 1.0, -1.0)


def bf16_round_f64(v):
  """Single RNE rounding of float64 ``v`` to bf16 (8 significant bits, subnormal step 2**-133)."""
  v = np.asarray(v, np.float64)
  _, e = np.frexp(v)  # v = m * 2**e, 0.5 <= |m| < 1  ->  ulp = 2**(e - 8)
  ulp = np.ldexp(1.0, np.maximum(e - 8, -133))
  r = np.round(v / ulp) * ulp  # exact scaling, np.round is half-to-even
  r = np.where(np.abs(r) > BF16_MAX, np.copysign(np.inf, v), r)
  return r.astype(f32)  # exactly representable


def rht_ref(x, axis=0):
  """TE's wgrad RHT along ``axis`` (groups of 16): exact float64 sum, one bf16 rounding.

  ``y[16g + c] = bf16(sum_r s_r * x[16g + r] * H16[r, c] / 4)``. float64 holds the sum exactly whenever
  the 16 inputs span fewer than ~45 binary orders of magnitude (true for every input kind here).
  """
  m = np.diag(RHT_SIGNS) @ hadamard16() / 4.0
  xm = np.moveaxis(np.asarray(x, np.float64), axis, -1)
  g = xm.reshape(xm.shape[:-1] + (xm.shape[-1] // 16, 16))
  y = np.einsum("...r,rc->...c", g, m).reshape(xm.shape)
  return np.moveaxis(bf16_round_f64(y), -1, axis)


def rht_order_sensitive(x, axis=0):
  """True if some RHT output changes when the fp32 sum runs sequentially, reversed or pairwise.

  TE's kernel accumulates the 16 products in an fp32 tensor-core MMA (order unspecified); like the golden
  generator, RHT cases use inputs whose bf16 result does not depend on the order.
  """
  m = (np.diag(RHT_SIGNS) @ hadamard16() / 4.0).astype(f32)
  xm = np.moveaxis(np.asarray(x, f32), axis, -1)
  g = xm.reshape(xm.shape[:-1] + (xm.shape[-1] // 16, 16))
  terms = g[..., :, None] * m  # exact (x * ±0.25), shape (..., r, c)
  exact = np.moveaxis(rht_ref(x, axis), axis, -1).reshape(g.shape)

  def tree(t):
    while t.shape[-2] > 1:
      t = t[..., 0::2, :] + t[..., 1::2, :]
    return t[..., 0, :]

  seq = np.zeros_like(terms[..., 0, :])
  rev = np.zeros_like(seq)
  for r in range(16):
    seq = seq + terms[..., r, :]
    rev = rev + terms[..., 15 - r, :]
  for s in (seq, rev, tree(terms)):
    b = s.astype(ml_dtypes.bfloat16).astype(f32)
    if not np.array_equal(b, exact):
      return True
  return False


def sr_e2m1(y, u):
  """Stochastic rounding of ``y`` (|y| <= 6) onto the E2M1 grid with fractions ``u`` (multiples of 1/256 in [0, 1)):
  TE's software emulation of ``cvt.rs`` (``ptx.cuh``), in float32 as it computes it::

      step = a >= 4 ? 2 : (a >= 2 ? 1 : 0.5);  t = a + u * step  (fp32, RN);  q = min(floor(t / step) * step, 6)

  with ``a = |y|`` and the sign of ``y`` kept (t's rounding can round a sum just below a grid point up to it)."""
  a = np.abs(np.asarray(y, f32))
  step = np.where(a >= 4, f32(2), np.where(a >= 2, f32(1), f32(0.5))).astype(f32)
  t = (a + np.asarray(u, f32) * step).astype(f32)
  return np.copysign(np.minimum(np.floor(t / step) * step, f32(6)), y).astype(f32)


def quantize_ref(x, mode, u=None):
  """q, s8, amax (float32) of the 2-D float32 array ``x`` for mode row | col | 2d | rht_col.

      amax  = max|xq|;  S_enc = min(2688/amax, FLT_MAX), 1 if amax == 0 or S_enc == 0;  S_dec = 1/S_enc
      s8    = e4m3(min(bamax * fl(S_enc * fl(1/6)), 448));  enc = min(1/(s8 * S_dec), FLT_MAX)
      q     = e2m1(clip(xq * enc, -6, 6))           (RNE; with ``u``, x's shape: sr_e2m1 of it)
  """
  x = np.asarray(x, f32)
  if mode == "rht_col":
    x = rht_ref(x, axis=0)
  amax = f32(np.abs(x).max())
  with np.errstate(divide="ignore", over="ignore"):
    s_enc = f32(np.fmin(f32(2688) / amax, FLT_MAX))
  if amax == 0 or s_enc == 0:
    s_enc = f32(1)
  s_dec = f32(f32(1) / s_enc)
  m, n = x.shape
  if mode == "2d":
    xb, red = x.reshape(m // 16, 16, n // 16, 16), (1, 3)
  elif mode == "row":
    xb, red = x.reshape(m, n // 16, 16), (2,)
  else:
    xb, red = x.reshape(m // 16, 16, n), (1,)
  bamax = np.abs(xb).max(axis=red, keepdims=True)
  c = f32(s_enc * f32(f32(1) / f32(6)))
  s8 = np.minimum(bamax * c, f32(448)).astype(ml_dtypes.float8_e4m3fn).astype(f32)
  with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
    enc = np.fmin(f32(1) / (s8 * s_dec), FLT_MAX)
    y = np.clip(xb * enc, -6, 6)
  q = y.astype(ml_dtypes.float4_e2m1fn).astype(f32) if u is None else sr_e2m1(y, np.reshape(u, xb.shape))
  return q.reshape(m, n), s8.squeeze(red), amax


def values_ref(q, s8, mode):
  """``q * s8`` with each block's scale expanded over its elements (exact in float32)."""
  if mode == "2d":
    s = np.repeat(np.repeat(s8, 16, axis=0), 16, axis=1)
  else:
    s = np.repeat(s8, 16, axis=1 if mode == "row" else 0)
  return (np.asarray(q, f32) * s).astype(f32)


# ------------------------------------------------------------------------------------------------
# Input kinds (the golden vectors' generator kinds, tests/golden/README.md, plus edge kinds), own seeds.
# ------------------------------------------------------------------------------------------------
def to_bf16(v):
  """RNE to bf16 (via float32, subnormals kept), stored as float32, with -0.0 replaced by +0.0."""
  out = np.asarray(v, np.float64).astype(f32).astype(ml_dtypes.bfloat16).astype(f32)
  return np.where(out == 0, f32(0), out)


def _ties(rng, m, n):
  """amax exactly 2688 (S_enc = 1). Even tiles: E2M1 ties under an exact 2**k scale (6 * 2**k on the
  tile's diagonal so every row, column and tile has that block amax). Odd tiles: block amax 6 * t with
  t an E4M3 rounding tie (normal or subnormal), the rest random below it."""
  e2m1_ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
  normal_ties = [(1 + (2 * j + 1) / 16) * 2.0**e for e in range(-6, 8) for j in range(8)]
  normal_ties += [(1 + (2 * j + 1) / 16) * 256 for j in range(6)]  # up to 432
  sub_ties = [(2 * j + 1) * 2.0**-10 for j in range(8)]  # 2**-10 (ties to 0), 1.5 * 2**-9, ...
  e4m3_ties = np.array(normal_ties + sub_ties)
  x = np.zeros((m, n))
  diag = np.eye(16, dtype=bool)
  for ti in range(m // 16):
    for tj in range(n // 16):
      sign = rng.choice([-1.0, 1.0], size=(16, 16))
      if (ti + tj) % 2 == 0:
        k = rng.integers(-8, 8)
        tile = rng.choice(e2m1_ties, size=(16, 16)) * 2.0**k
        tile[diag] = 6 * 2.0**k
      else:
        t = rng.choice(e4m3_ties)
        tile = rng.uniform(0, 6 * t, size=(16, 16))
        tile[diag] = 6 * t
      x[ti * 16 : ti * 16 + 16, tj * 16 : tj * 16 + 16] = tile * sign
  x[0, 0] = 2688.0
  return x


def make_input(kind, shape, seed, tiny_block_axis=1):
  rng = np.random.default_rng(seed)
  m, n = shape
  if kind == "normal":
    x = rng.standard_normal(shape)
  elif kind == "student_t":
    x = rng.standard_t(2, size=shape)
  elif kind == "spikes":
    x = rng.standard_normal(shape)
    x[rng.random(shape) < 0.002] *= 1000
  elif kind == "wide_elem":
    x = rng.choice([-1.0, 1.0], size=shape) * 10.0 ** rng.uniform(-8, 4, size=shape)
  elif kind == "wide_tile":
    tiles = 10.0 ** rng.uniform(-8, 4, size=(m // 16, n // 16))
    x = rng.standard_normal(shape) * np.repeat(np.repeat(tiles, 16, 0), 16, 1)
  elif kind == "zero_blocks":
    x = rng.standard_normal(shape)
    assert m >= 64 and n >= 80, "zero_blocks needs a (>=64, >=80) shape"
    x[0:16, 0:16] = 0
    x[20, 32:48] = 0
    x[48:64, 70] = 0
    x[16:32, 16:32] *= 1e-3
  elif kind == "all_zero":
    x = np.zeros(shape)
  elif kind == "tiny_pow2":
    x = rng.standard_normal(shape) * 2.0**-100
  elif kind == "tiny_clamped":
    x = rng.standard_normal(shape) * 2.0**-124
  elif kind == "subnormal":
    x = rng.integers(-127, 128, size=shape) * 2.0**-133
    x[rng.random(shape) < 0.1] = 0
  elif kind == "huge":
    x = rng.standard_normal(shape) * 1e37
    x[m // 2, n // 3] = BF16_MAX
    if tiny_block_axis == 1:
      x[1, 16:32] = rng.standard_normal(16) * 1e28
    else:  # along axis 0: RHT groups then never mix 1e28 with 1e37 (the fp32 sum would be order-sensitive)
      x[16:32, 1] = rng.standard_normal(16) * 1e28
  elif kind == "ties":
    x = _ties(rng, m, n)
  else:
    raise ValueError(kind)
  return to_bf16(x)


KINDS = ("normal", "student_t", "spikes", "wide_elem", "wide_tile", "zero_blocks", "all_zero",
         "tiny_pow2", "tiny_clamped", "subnormal", "huge", "ties")


def input_for(kind, mode, shape=(64, 128), seed=11):
  """The kind's input; for RHT the first seed (from ``seed``) whose RHT is accumulation-order free."""
  for s in range(seed, seed + 50):
    x = make_input(kind, shape, s, tiny_block_axis=0 if mode == "rht_col" else 1)
    if mode != "rht_col" or not rht_order_sensitive(x, 0):
      return x
  raise AssertionError(f"no accumulation-order-insensitive {kind} input found")


# ------------------------------------------------------------------------------------------------
# TE's golden vectors (tests/golden/README.md) and the comparisons
# ------------------------------------------------------------------------------------------------
GOLDEN = pathlib.Path(__file__).resolve().parents[1] / "golden" / "nvfp4_golden_public.npz"
# The quantize() arguments of each mode.
MODES = ("row", "col", "2d", "rht_col")
MODE_KW = {"row": dict(axis=1), "col": dict(axis=0), "2d": dict(block_2d=True), "rht_col": dict(axis=0, rht=True)}


def golden_case_names():
  """The golden cases' names ([] when the file is missing: the tests that load it then fail)."""
  return [c["name"] for c in json.loads(str(np.load(GOLDEN)["__index_json__"]))["cases"]] if GOLDEN.exists() else []


def load_golden():
  """(the npz, {case name: its index entry}); AssertionError naming the file when it is missing."""
  if not GOLDEN.exists():
    raise AssertionError(f"{GOLDEN} is missing: the TE golden vectors ship with the repository"
                         " (tests/golden/README.md)")
  z = np.load(GOLDEN)
  return z, {c["name"]: c for c in json.loads(str(z["__index_json__"]))["cases"]}


def golden_mode(case):
  """A golden case's mode (row | col | 2d | rht_col)."""
  if case["rht"]:
    return "rht_col"
  return "2d" if case["mode"] == "2d" else ("row" if case["axis"] == 1 else "col")


def bits(a):
  return np.ascontiguousarray(np.asarray(a, np.float32)).view(np.uint32)


def assert_bits_equal(ours, ref, what):
  ours, ref = np.asarray(ours, np.float32), np.asarray(ref, np.float32)
  assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
  bad = bits(ours) != bits(ref)
  if bad.any():
    idx = tuple(np.argwhere(bad)[0])
    raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} differ; first at {idx}: ours {ours[idx]!r} vs ref"
                         f" {ref[idx]!r}")
