"""TE's own NVFP4 reference (``reference_nvfp4.py`` from the 2.20.2 wheel) as a randomized differential oracle.

Every case of ``te_cases.generate(seed, ...)`` is quantized by our ``core.nvfp4.quantize`` and by TE's
``NVFP4QuantizerRef`` (run in the peer env, one subprocess for the whole batch); data (E2M1 codes),
E4M3 scale bytes and the fp32 amax must agree bit for bit. Two classes are compared differently, each
for a stated, checked reason (their counts are printed):

* ``zero_sign``: TE's reference ``cast_to_fp4x2`` maps an exact -0.0 product to code 0 (+0), since its
  ``x < -0.0`` test is false for -0.0; the kernels' ``cvt`` and we keep the sign (code 8). Same value.
  Allowed only where the value quantized (x, or its RHT) is -0.0; in SR cases where it rounds to zero
  (TE's SR formula returns sign(x) * 0.0 there, which the same test maps to +0).
* ``torch_flush`` (RHT): torch's CPU bf16 matmul flushes fp32-subnormal inputs and outputs, the CUDA
  kernels and we do not. Each RHT case is therefore also run through TE's quantizer with only the RHT
  matmul made exact; ours must equal that variant bit for bit in every RHT case, and equal the native
  reference wherever torch's RHT output equals the exact one. Where it does not, the peer checks that
  torch's output equals the exact RHT of the flushed input, flushed (so the difference is the flush).
* ``order`` (RHT): groups whose bf16 RHT result depends on the fp32 summation order (the tensor-core MMA
  order is unspecified, so no bit contract exists there) are reported and not compared; this includes
  groups near bf16's maximum whose same-sign terms overflow fp32 in some order (torch's CPU matmul
  produced inf there once in 10,000 cases, where the exact sum and ours are finite).

* ``ftz`` (4over6 variants): 4over6's block choice compares fp32 error sums; where TE's reference meets
  fp32 subnormals in them it gives another answer on a flush-to-zero CPU (the peer reruns it with
  ``torch.set_flush_denormal(True)``), as XLA:CPU computes. Ours may differ from the IEEE reference only at
  positions (codes, scales, amax entries) where those two TE answers differ; such cases are counted.
* ``ftz_tiny`` (4over6 variants, tensors with amax < 2**-100 ~ 7.9e-31): there TE's reference rounds the
  error terms' products onto the fp32 subnormal grid while its global decode scale is itself subnormal, so
  its flush-to-zero rerun differs everywhere and cannot localize the difference; such cases are counted,
  not compared (their amax must still be equal). 4over6 on XLA:CPU is bit-checked for amax >= 2**-100.
* Zero signs in RHT cases: a -0.0 of either torch's or the exact RHT output may be TE's code 0 against our
  code 8 (torch's CPU bf16 matmul and the exact sum disagree on zero signs for tiny inputs: seed 12 on main).
* ``torch_tiny`` (RHT, tensors with max|x| < 2**-100): torch 2.13's CPU bf16 matmul (this peer env) gives
  an RHT that is neither the exact one nor the flushed one (a few bf16 ulps off at ~1e-37; seen with the
  tiny_1e-36 distribution, on main too). Counted when ours equals TE's quantizer on the exact RHT, which
  every RHT case must.

Recipe variants (``te_cases.VARIANTS``: 4over6 with bound 448/256 and MAE/MSE, row-scaled, row-scaled
4over6) run in every mode TE supports for them (1x16 row/col, 16x16 and its columnwise copy ``2dcol``, RHT
for row-scaled), through the same comparison, with ``nvfp4.ScaleRule`` on our side and the reference's
own options on TE's. Removing one element from our 4over6 block error must fail them.

Stochastic rounding: TE's reference has none. Cases with ``sr`` pass our random bytes ``u`` (from
``random_bits.random_bytes`` for the same key) to the peer, which applies TE JAX's SR formula (read from the
wheel) with ``rand = 1 - u / 256`` to the reference's scaled values: same bits in, same codes out.
``test_sr_distribution_matches_te_formula`` compares the distributions with independent bits.

Scale: MAXTEXT_NVFP4_PEER_CASES (default 400), MAXTEXT_NVFP4_PEER_SHAPES (shapes per run, default 3;
each (shape, mode, dtype) is one compile on our side), MAXTEXT_NVFP4_PEER_MAX_ELEMENTS (largest shape
drawn, default 16384; 0 = all of te_cases.SHAPES), MAXTEXT_NVFP4_PEER_SEED (default: fresh each run,
printed in every failure message and on success with -s).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import secrets

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import peer_support
import te_cases
from maxtext_nvfp4.core import nvfp4
from maxtext_nvfp4.core.quantizer import random_bits, xla

N_CASES = int(os.environ.get("MAXTEXT_NVFP4_PEER_CASES", "400"))
N_SHAPES = int(os.environ.get("MAXTEXT_NVFP4_PEER_SHAPES", "3"))
MAX_ELEMENTS = int(os.environ.get("MAXTEXT_NVFP4_PEER_MAX_ELEMENTS", "16384")) or None  # 0: every shape
# Recipe-variant cases per run (one shape per run: each (variant, mode, dtype) is one compile on our side).
N_VARIANT_CASES = int(os.environ.get("MAXTEXT_NVFP4_PEER_VARIANT_CASES", "52"))
VARIANT_SHAPES = ((32, 48), (48, 80), (64, 128), (80, 32), (96, 208), (144, 112))
SEED = int(os.environ.get("MAXTEXT_NVFP4_PEER_SEED", str(secrets.randbelow(2**31))))
CHUNK = 16  # cases per compiled call (vmapped); a group's last chunk is padded with its first case
MODE_KW = {"row": dict(axis=-1), "col": dict(axis=0), "2d": dict(block_2d=True), "rht": dict(axis=0, rht=True),
           "2dcol": dict(block_2d=True, axis=0)}
COLWISE = ("col", "rht", "2dcol")
TINY = np.float32(2.0**-100)  # below: the ftz_tiny / torch_tiny classes (module docstring)


def scale_rule(variant):
  """Our nvfp4.ScaleRule for a te_cases variant (None: TE's standard rule)."""
  kw = te_cases.VARIANTS[variant]["kw"]
  if not kw:
    return None
  return nvfp4.ScaleRule(selection="4over6" if kw.get("nvfp4_use_4over6") else "max",
                         e4m3_bound=kw.get("nvfp4_e4m3_max", 448), err_mode=kw.get("nvfp4_4over6_err_mode", "MAE"),
                         row_scaled=bool(kw.get("row_scaled_nvfp4")))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ours:
  codes: np.ndarray  # uint8 E2M1 codes, oriented as TE's rows (x.T for col/rht)
  scale: np.ndarray  # uint8 E4M3 bytes, same orientation (one per 16x16 tile for 2d)
  amax: np.ndarray  # fp32 scalar (row-scaled: one per row of TE's quantized copy)


@functools.cache
def _batched(mode, sr, variant="standard"):
  kw = dict(MODE_KW[mode], scale_rule=scale_rule(variant))
  if sr:
    return jax.jit(jax.vmap(lambda x, key: nvfp4.quantize(x, stochastic_key=key, **kw)))
  return jax.jit(jax.vmap(lambda x: nvfp4.quantize(x, **kw)))


def _orient(t, mode):
  codes = np.asarray(t.data).view(np.uint8) & 0xF
  scale = np.asarray(t.scale).view(np.uint8)
  if mode in COLWISE:
    codes, scale = codes.T, scale.T
  amax = np.asarray(t.amax, np.float32)
  return Ours(codes=np.ascontiguousarray(codes), scale=np.ascontiguousarray(scale),
              amax=amax.reshape(-1) if amax.ndim else amax)


def quantize_ours(cases, keys=None):
  """Our quantizer on every case, batched by (shape, mode, dtype) with jax.vmap; {index: Ours}."""
  groups = {}
  for c in cases:
    groups.setdefault((c.x.shape, c.mode, c.dtype, c.variant), []).append(c)
  out = {}
  for (_, mode, dtype, variant), group in groups.items():
    fn = _batched(mode, keys is not None, variant)
    for k in range(0, len(group), CHUNK):
      chunk = group[k:k + CHUNK]
      chunk = chunk + [chunk[0]] * (CHUNK - len(chunk))
      x = jnp.asarray(np.stack([c.x for c in chunk]))
      x = x.astype(jnp.bfloat16) if dtype == "bf16" else x
      if keys is None:
        t = fn(x)
      else:
        t = fn(x, jnp.stack([keys[c.index] for c in chunk]))
      t = jax.tree_util.tree_map(np.asarray, t)
      for j, c in enumerate(chunk[: len(group[k:k + CHUNK])]):
        out[c.index] = _orient(jax.tree_util.tree_map(lambda a, j=j: a[j], t), mode)
  return out


def _unpack(packed):
  return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)


def run_te(tmp_path, cases, sr_cases=(), rbytes=None, rand_seeds=None):
  """TE's reference on every case in ONE peer process: RNE ``cases``, SR ``sr_cases`` with our bytes
  (``rbytes``) or independent uniforms (``rand_seeds``), all by index; returns the peer's npz as a dict."""
  rbytes, rand_seeds = rbytes or {}, rand_seeds or {}
  meta = [dict(index=c.index, mode=c.mode, dtype=c.dtype, sr=False, qkw=te_cases.VARIANTS[c.variant]["kw"])
          for c in cases]
  meta += [dict(index=c.index, mode=c.mode, dtype=c.dtype, sr=True, shape=list(c.x.shape),
                rand_seed=rand_seeds.get(c.index)) for c in sr_cases]
  arrays = {f"x{c.index}": c.x for c in [*cases, *sr_cases]}
  arrays.update({f"u{i}": u for i, u in rbytes.items()})
  src, dst = tmp_path / "cases.npz", tmp_path / "te.npz"
  np.savez(src, meta=np.array(json.dumps(meta)), **arrays)
  peer_support.run_peer("te_reference_run.py", src, dst)
  return dict(np.load(dst))


def compare(cases, ours, te, sr=False):
  """Per-case verdicts: {"ok": [...], "zero_sign": n, "torch_flush": [...], "order": [...], "ftz": [...],
  "bad": [(idx, why)]}."""
  res = dict(ok=[], zero_sign=0, torch_flush=[], torch_tiny=[], order=[], ftz=[], ftz_tiny=[], bad=[])
  for c in cases:
    i, o = c.index, ours[c.index]
    xo = c.x.T if c.mode in COLWISE else c.x
    ftz = f"fdata{i}" in te  # 4over6: TE's answer on a flush-to-zero CPU too
    excused = []

    def flushed_differ(name, ours_v, te_v):
      """Positions where ours differs from TE only where TE's flush-to-zero answer differs from its IEEE one."""
      if not ftz:
        return ours_v != te_v
      f = _unpack(te[f"fdata{i}"]) if name == "codes" else te[f"f{name}{i}"]
      f = f.view(np.uint32) if name == "amax" else f
      diff_ = ours_v != te_v
      ok = diff_ & (f != te_v)
      if ok.any():
        excused.append(name)
      return diff_ & ~ok

    def diff(prefix):
      codes = _unpack(te[f"{prefix}data{i}"])
      bad_codes = flushed_differ("codes", o.codes, codes) if not prefix else codes != o.codes
      if c.mode == "rht" and not sr:  # the value quantized is the RHT output
        # ours follows the exact RHT's zero signs, TE's codes map every zero to +0: a zero of either RHT
        # (torch's CPU matmul and the exact sum can disagree on the sign of a zero of tiny inputs)
        neg_zero = te[f"neg0{i}"] | te[f"xneg0{i}"]
      else:
        neg_zero = (xo == 0) & np.signbit(xo)
      zs = bad_codes & (o.codes == 8) & (codes == 0) & (neg_zero | sr)
      why = []
      if np.any(bad_codes & ~zs):
        why.append(f"{int(np.sum(bad_codes & ~zs))} codes")
      bad_scales = flushed_differ("scale", o.scale, te[f"{prefix}scale{i}"])
      if np.any(bad_scales):
        why.append(f"{int(np.sum(bad_scales))} scales")
      te_amax = np.asarray(te[f"{prefix}amax{i}"], np.float32)
      if te_amax.shape != o.amax.shape or np.any(flushed_differ("amax", o.amax.view(np.uint32), te_amax.view(np.uint32))):
        why.append(f"amax {te_amax!r} vs ours {o.amax!r}")
      return why, int(np.sum(zs))

    why, zs = diff("")
    if c.mode in ("2d", "2dcol") and not bool(te[f"rep{i}"]):
      why.append("TE's 16 scale rows of a tile differ")
    if c.mode == "rht" and not sr:
      if bool(te[f"order{i}"]):
        res["order"].append(i)
        continue
      xwhy, _ = diff("x")
      if xwhy:
        res["bad"].append((i, f"{c.dist}: vs TE with exact RHT: {', '.join(xwhy)}"))
        continue
      if why and not bool(te[f"rht_exact{i}"]):
        if bool(te[f"rht_flush{i}"]):
          res["torch_flush"].append(i)
          continue
        if np.max(np.abs(c.x)) < TINY:
          res["torch_tiny"].append(i)
          continue
        why.append("torch's RHT differs from the exact one and not by the flush")
    res["zero_sign"] += zs
    if why and ftz and np.max(np.asarray(te[f"amax{i}"], np.float32)) < TINY and not any("amax" in w for w in why):
      res["ftz_tiny"].append(i)
      continue
    if why:
      res["bad"].append((i, f"{c.variant}/{c.mode}/{c.dtype}/{c.dist} {c.x.shape}: {', '.join(why)}"))
    elif excused:
      res["ftz"].append(i)
    else:
      res["ok"].append(i)
  return res


def _summary(res, cases):
  by = {}
  for i in res["ok"]:
    c = cases[i]
    by[c.mode] = by.get(c.mode, 0) + 1
  return (f"seed={SEED} cases={len(cases)} equal={len(res['ok'])} by mode {by}; zero_sign codes={res['zero_sign']};"
          f" torch_flush cases={len(res['torch_flush'])} (dists {sorted({cases[i].dist for i in res['torch_flush']})});"
          f" torch_tiny={len(res['torch_tiny'])}; order-sensitive={len(res['order'])}; ftz cases={len(res['ftz'])}"
          f" (dists {sorted({cases[i].dist for i in res['ftz']})}); ftz_tiny={len(res['ftz_tiny'])};"
          f" mismatches={len(res['bad'])}")


SR_SHARED = 6  # SR cases with shared bits (row, col, rht in turn)
SR_DRAWS = 64  # independent SR draws of one tensor (distribution test)
SR_SHAPE = (16, 16)  # the SR cases' shape too: one compile per SR mode


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerRun:
  cases: list  # the RNE cases (indices 0 .. N_CASES - 1)
  sr_shared: list  # SR cases with our random bytes passed to the peer
  sr_draws: list  # one tensor under SR_DRAWS keys (the peer draws its own uniforms)
  ties: list  # E2M1-tie cases at 16x16, row and col (16 blocks each), for the mutation test
  variants: list  # recipe-variant cases (te_cases.VARIANTS)
  keys: dict  # index -> jax key of every SR case
  te: dict  # the peer's npz


@pytest.fixture(scope="module")
def peer_run(tmp_path_factory):
  """One generation and ONE peer process for every test of this module."""
  cases = te_cases.generate(SEED, N_CASES, N_SHAPES, MAX_ELEMENTS)
  sr_shared, keys = _sr_cases(SEED, SR_SHARED, start=N_CASES)
  rng = np.random.default_rng(SEED)
  x = te_cases.to_bf16_grid(rng.standard_normal(SR_SHAPE).astype(np.float32))
  sr_draws, keys2 = _sr_cases(SEED, SR_DRAWS, start=N_CASES + SR_SHARED, shape=SR_SHAPE, x=x)
  keys.update(keys2)
  rbytes = {c.index: np.asarray(random_bits.random_bytes(keys[c.index], c.x.shape)) for c in sr_shared}
  start = N_CASES + SR_SHARED + SR_DRAWS
  ties = [te_cases.Case(index=start + i, mode=mode, dtype=dtype, dist="e2m1_ties",
                        x=te_cases.d_e2m1_ties(rng, (16, 16), mode))
          for i, (mode, dtype) in enumerate((("row", "bf16"), ("row", "f32"), ("col", "bf16"), ("col", "bf16")))]
  vshape = VARIANT_SHAPES[np.random.default_rng(SEED + 5).integers(len(VARIANT_SHAPES))]
  variants = te_cases.generate_variants(SEED, N_VARIANT_CASES, [vshape], start=start + len(ties))
  te = run_te(tmp_path_factory.mktemp("te"), [*cases, *ties, *variants], [*sr_shared, *sr_draws], rbytes=rbytes,
              rand_seeds={c.index: SEED * 7919 + c.index for c in sr_draws})
  return PeerRun(cases=cases, sr_shared=sr_shared, sr_draws=sr_draws, ties=ties, variants=variants, keys=keys, te=te)


def test_rne_equals_te_reference_bit_for_bit(peer_run):
  cases, te = peer_run.cases, peer_run.te
  assert str(te["te_version"]) == "2.20.2"
  res = compare(cases, quantize_ours(cases), te)
  summary = _summary(res, cases)
  print(summary)
  assert not res["bad"], f"{summary}\nfirst mismatches: {res['bad'][:8]}\nrerun: MAXTEXT_NVFP4_PEER_SEED={SEED}"
  # The oracle saw every mode, and most RHT cases compared exactly (not by a class).
  assert {cases[i].mode for i in res["ok"]} == set(te_cases.MODES), summary
  n_rht = sum(c.mode == "rht" for c in cases)
  assert len(res["order"]) + len(res["torch_flush"]) <= n_rht // 4, summary


def _perturb_enc_one_ulp(block_scales):
  """A one-ulp change in our per-block encode scale (``enc`` one fp32 ulp up): the seam for the mutation."""
  def mutated(*args):
    amax, s8, enc = block_scales(*args)
    return amax, s8, jnp.nextafter(enc, jnp.float32(jnp.inf))
  return mutated


def test_variants_equal_te_reference_bit_for_bit(peer_run):
  """Every recipe variant in every mode TE supports for it, bit for bit (classes as above)."""
  cases, te = peer_run.variants, peer_run.te
  by_index = {c.index: c for c in cases}
  res = compare(cases, quantize_ours(cases), te)
  counts = {}
  for i in res["ok"]:
    counts[(by_index[i].variant, by_index[i].mode)] = counts.get((by_index[i].variant, by_index[i].mode), 0) + 1
  summary = (f"seed={SEED} variant cases={len(cases)} shape={cases[0].x.shape} equal={len(res['ok'])};"
             f" ftz={len(res['ftz'])} ({sorted({by_index[i].dist for i in res['ftz']})}); ftz_tiny={len(res['ftz_tiny'])};"
             f" torch_flush={len(res['torch_flush'])}; torch_tiny={len(res['torch_tiny'])}; order={len(res['order'])};"
             f" mismatches={len(res['bad'])}")
  print(summary)
  assert not res["bad"], f"{summary}\nfirst mismatches: {res['bad'][:8]}\nrerun: MAXTEXT_NVFP4_PEER_SEED={SEED}"
  pairs = {(v, m) for v, spec in te_cases.VARIANTS.items() if v != "standard" for m in spec["modes"]}
  assert set(counts) == pairs, f"{summary}: not compared exactly: {sorted(pairs - set(counts))}"


def _drop_one_element(element_error):
  """Our 4over6 error without its last element per block (a one-element change): the mutation."""
  def mutated(xb, k, neg, s8, amax, rule):
    e = element_error(xb, k, neg, s8, amax, rule)
    return e.at[..., -1].set(0.0) if e.ndim else e
  return mutated


def test_oracle_catches_a_one_element_change_in_4over6(peer_run, monkeypatch):
  """Zeroing one element's error in every 4over6 block (the last along the blocked shape's last axis) moves
  the choice in some blocks of the 4over6 cases (two variants, 1x16 and 16x16; recompiled for those only)."""
  te = peer_run.te
  smooth = ("normal", "heavy", "spiky", "row_spread", "mixed_blocks")  # many blocks with a close choice
  cases = [c for c in peer_run.variants if c.variant in ("4over6_mse_256", "4over6_mae_448") and c.mode in ("row", "2d")
           and c.dist in smooth]
  assert cases and not compare(cases, quantize_ours(cases), te)["bad"], f"seed={SEED}: fails unmutated"
  jax.clear_caches()
  _batched.cache_clear()
  monkeypatch.setattr(xla, "four_over_six_element_error", _drop_one_element(xla.four_over_six_element_error))
  try:
    res = compare(cases, quantize_ours(cases), te)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
    _batched.cache_clear()
  print(f"seed={SEED}: one element dropped from the 4over6 error: {len(res['bad'])} of {len(cases)} cases mismatch")
  assert res["bad"], f"seed={SEED}: the mutation went unnoticed in all {len(cases)} cases: {res}"


def test_oracle_catches_a_one_ulp_change_in_our_scale(peer_run, monkeypatch):
  """x * enc lands exactly on E2M1 rounding boundaries in the tie cases, so one ulp more in enc moves
  the ties that round down (0.25, 1.25, 2.5, 5). 16x16 row/col cases have 16 blocks, so blocks other
  than the amax anchor's keep exact power-of-two scales (a single 16x16 tile would not); the mutated
  quantizer is recompiled for that one shape only."""
  te, ties = peer_run.te, peer_run.ties
  assert not compare(ties, quantize_ours(ties), te)["bad"], f"seed={SEED}: tie cases fail unmutated"
  jax.clear_caches()
  _batched.cache_clear()
  monkeypatch.setattr(xla, "block_scales", _perturb_enc_one_ulp(xla.block_scales))
  try:
    res = compare(ties, quantize_ours(ties), te)
  finally:
    monkeypatch.undo()
    jax.clear_caches()
    _batched.cache_clear()
  print(f"seed={SEED}: one ulp up in enc: {len(res['bad'])} of {len(ties)} tie cases mismatch: {res['bad']}")
  assert len(res["bad"]) == len(ties), f"seed={SEED}: the mutation went unnoticed in {len(res['ok'])} of {len(ties)}"


def _sr_cases(seed, n, *, start, shape=None, x=None):
  """SR cases (row, col, rht in turn) with a fresh key each; ``x`` fixed when given (distribution test)."""
  rng = np.random.default_rng(seed + 1)
  cases, keys = [], {}
  for i in range(start, start + n):
    mode = ("row", "col", "rht")[i % 3] if x is None else "row"
    shp = shape or (16, 16)
    dist = ("normal", "heavy", "row_spread", "zero_blocks")[i % 4] if x is None else "fixed"
    xi = te_cases.to_bf16_grid(te_cases.DISTRIBUTIONS[dist](rng, shp, mode)) if x is None else x
    cases.append(te_cases.Case(index=i, mode=mode, dtype="bf16", dist=dist, x=xi))
    keys[i] = jax.random.PRNGKey(seed * 1000 + i)
  return cases, keys


def _value(codes):
  mag = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)[codes & 7]
  return np.where(codes & 8, -mag, mag)


def test_sr_with_shared_bits_equals_te_formula(peer_run):
  """Same bits in, same codes out -- except where TE JAX's SR formula skips E2M1's 1.5.

  TE JAX's ``_apply_stochastic_rounding`` (2.20.2) computes floor = 1 on [1, 2) and ceil = 2 on (1, 2):
  it rounds every |x * enc| in (1, 2) to 1 or 2, never to 1.5 (unbiased, but not the E2M1 neighbours
  that ``cvt.rs`` and we round between). That class is checked to be exactly where the two differ.
  """
  cases, te = peer_run.sr_shared, peer_run.te
  ours = quantize_ours(cases, peer_run.keys)
  n_same = n_skip15 = 0
  for c in cases:
    o, i = ours[c.index], c.index
    codes = _unpack(te[f"data{i}"])
    assert np.array_equal(te[f"scale{i}"], o.scale) and te[f"amax{i}"] == o.amax, f"seed={SEED} case {i}"
    a = np.abs(_value(o.codes))
    # TE rounds a value in (1, 2) to 1 or 2; ours to its E2M1 neighbours (1, 1.5 or 1.5, 2).
    one_to_two = (np.abs(_value(codes)) != a) & np.isin(np.abs(_value(codes)), [1.0, 2.0]) & np.isin(a, [1.0, 1.5, 2.0])
    zero_sign = (o.codes == 8) & (codes == 0)
    differ = (codes != o.codes) & ~zero_sign
    assert not np.any(differ & ~one_to_two), f"seed={SEED} case {i} {c.mode}: {int(np.sum(differ & ~one_to_two))} codes"
    n_skip15 += int(np.sum(differ))
    n_same += int(np.sum(~differ))
  print(f"seed={SEED} SR shared bits: {n_same} codes equal, {n_skip15} differ only by TE JAX's 1.5-skip")
  assert n_skip15 < n_same


def _neighbours(a, merge_1_2=False):
  """(lo, hi) around each |value| a: E2M1's neighbours, or TE JAX's SR formula's (1 and 2 on (1, 2))."""
  grid = np.array([0, 0.5, 1, 2, 3, 4, 6] if merge_1_2 else [0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float64)
  j = np.searchsorted(grid, a, side="right") - 1
  return grid[j], grid[np.minimum(j + 1, len(grid) - 1)]


def _binomial_outliers(vals, a, p_up, lo, hi):
  """Elements whose count of round-ups over the draws is impossible at P = p_up (two-sided p < 1e-6);
  values on the top of the grid (lo == hi == 6) have nothing to round to and are skipped."""
  from scipy import stats  # pylint: disable=import-outside-toplevel
  ups = np.sum(np.abs(vals) == hi[None], axis=0)
  k = vals.shape[0]
  bad = []
  for idx in zip(*np.nonzero(hi > lo)):
    p = float(np.clip(p_up[idx], 0.0, 1.0))
    if stats.binomtest(int(ups[idx]), k, p).pvalue < 1e-6:
      bad.append((idx, int(ups[idx]), p))
  return bad


def test_sr_distribution_matches_te_formula(peer_run):
  """Independent bits: per element, the number of round-ups over the draws is Binomial(draws, P) with

    ours:        P = #{u in 0..255 : u / 256 >= 1 - frac} / 256 between E2M1's neighbours (8 random bits)
    TE formula:  P = frac between its own floor/ceil (1 and 2 on (1, 2), see the test above)

  with frac = (a - lo) / (hi - lo), a = |x * enc| from the RNE scales; an element whose count has a
  two-sided binomial p-value below 1e-6 fails (SR_DRAWS draws of one SR_SHAPE tensor). Both are then
  unbiased (E = a, up to ours' 8-bit granularity of P).
  """
  cases, te, k = peer_run.sr_draws, peer_run.te, SR_DRAWS
  x = cases[0].x
  ours = quantize_ours(cases, peer_run.keys)
  rne = quantize_ours(cases[:1])[cases[0].index]
  te_vals = np.stack([_value(_unpack(te[f"data{c.index}"])) for c in cases])
  our_vals = np.stack([_value(ours[c.index].codes) for c in cases])
  # x * enc from our (RNE) scales: enc = min(1 / (s8 * S_dec), FLT_MAX), S_dec = 1 / (2688 / amax).
  s8 = np.repeat(rne.scale.view(np.uint8).view(__import__("ml_dtypes").float8_e4m3fn).astype(np.float32), 16, axis=1)
  s_dec = np.float32(1) / (np.float32(2688) / rne.amax)
  a = np.abs(np.clip(x * (np.float32(1) / (s8 * s_dec)), -6, 6)).astype(np.float64)
  lo, hi = _neighbours(a)
  frac = np.where(hi > lo, (a - lo) / np.where(hi > lo, hi - lo, 1), 0.0)
  p_ours = np.clip(256 - np.ceil((1 - frac) * 256), 0, 256) / 256
  bad = _binomial_outliers(our_vals, a, p_ours, lo, hi)
  assert not bad, f"seed={SEED} ours: {len(bad)} elements off their SR distribution, e.g. {bad[:3]}"
  lo_t, hi_t = _neighbours(a, merge_1_2=True)
  frac_t = np.where(hi_t > lo_t, (a - lo_t) / np.where(hi_t > lo_t, hi_t - lo_t, 1), 0.0)
  bad = _binomial_outliers(te_vals, a, frac_t, lo_t, hi_t)
  assert not bad, f"seed={SEED} TE formula: {len(bad)} elements off their SR distribution, e.g. {bad[:3]}"
  # Both unbiased: the mean over draws and elements of (value - a), in units of the standard error.
  for name, vals in (("ours", our_vals), ("TE formula", te_vals)):
    err = (np.abs(vals) - a[None]).mean()
    se = np.abs(vals).std(axis=0).mean() / np.sqrt(vals.size) + 1e-12
    assert abs(err) < 6 * se + 1 / 256, f"seed={SEED} {name}: mean bias {err:.3g} (se {se:.3g})"
