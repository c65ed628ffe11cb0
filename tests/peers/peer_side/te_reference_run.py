"""Peer side of the TE differential oracle: quantize every case of an npz with TE's reference_nvfp4.py.

Usage: te_reference_run.py CASES.npz OUT.npz      (run by tests/peers/test_te_reference_oracle.py)

CASES.npz: ``meta`` (JSON list of {index, mode, dtype, sr, qkw}: ``qkw`` the recipe variant's
``NVFP4QuantizerRef`` keyword arguments, e.g. ``nvfp4_use_4over6``), ``x<i>`` fp32 arrays, and for SR cases
``u<i>`` uint8 random bytes (one per element of x, in x's layout). For each case OUT.npz holds TE's
``data<i>`` (packed fp4x2 bytes, rows of the quantized operand: x for row/2d, x.T for col/rht),
``scale<i>`` (E4M3 bytes, same orientation), ``amax<i>`` (fp32), and for 2d ``rep<i>`` (True when TE's
16 repeated scale rows of each tile agree). RHT cases also carry the same three outputs with the RHT
computed exactly (``xdata/xscale/xamax<i>``: TE's quantizer with ``_apply_rht`` replaced by an fp64
matmul rounded to fp32 then bf16 -- the fp32-accumulated sum, correctly rounded), and two flags about
torch's own bf16 CPU matmul: ``rht_exact<i>`` (it equals the exact RHT) and ``rht_flush<i>`` (it equals
the exact RHT of the input with fp32-subnormal inputs and outputs flushed to zero). ``order<i>`` is True
when the bf16 RHT depends on the fp32 summation order for some group (forward, reverse, pairwise, or
an fp32 overflow of a partial sum that some order meets: torch's CPU matmul met one near bf16's max).
``neg0<i>`` / ``xneg0<i>`` mark the RHT outputs (native / exact) that are -0.0.

Modes: row, col, 2d as in te_cases; ``2dcol`` is the columnwise copy of a 16x16-tiled tensor (TE's
``data_t``, the rowwise quantization of x.T). ``amax<i>`` is a vector for row-scaled variants (one per
row of the quantized copy). 4over6 cases are also run with ``torch.set_flush_denormal(True)``
(``fdata/fscale/famax<i>``): what TE's reference gives on a flush-to-zero CPU, as XLA:CPU computes.

SR cases (``sr`` true): TE's reference has no stochastic rounding; its ``cast_to_fp4x2`` input (the
clipped ``x * enc``) is passed first through TE JAX's own SR formula, read from the 2.20.2 wheel's
``NVFP4Quantizer._apply_stochastic_rounding`` (ast; executed with numpy), with ``rand = 1 - u / 256``
for given bytes ``u<i>``, or independent uniform numbers from ``rand_seed`` when no bytes are given.
"""

import ast
import json
import sys
import textwrap

import numpy as np
import torch

import peers_env

ref = peers_env.load_te()
E2M1 = ref.reference_utils.Fp4Formats.E2M1
SMALLEST_NORMAL = float(np.finfo(np.float32).tiny)


def rht_matrix():
  return ref.NVFP4QuantizerRef._build_hadamard_matrix(16, torch.device("cpu"), torch.float32, True) * 0.25


def exact_rht(xt):
  """bf16(fp32(x @ M)) with the sum in fp64 (exact for 16 bf16 terms within 40 binades)."""
  y = xt.double().reshape(-1, 16) @ rht_matrix().double()
  return y.float().bfloat16().reshape(xt.shape)


def flushed_rht(xt):
  """The exact RHT of x with fp32-subnormal inputs and outputs set to zero (a flush-to-zero matmul)."""
  xf = xt.float()
  xf = torch.where(xf.abs() < SMALLEST_NORMAL, torch.zeros_like(xf), xf)
  y = exact_rht(xf.bfloat16()).float()
  return torch.where(y.abs() < SMALLEST_NORMAL, torch.zeros_like(y), y).bfloat16()


def order_sensitive(xt):
  """True when bf16(fp32 sum) of some 16-group differs between forward, reverse and pairwise order, or
  when some order can overflow fp32 in a partial sum (its same-sign terms alone exceed FLT_MAX)."""
  p = xt.float().reshape(-1, 16, 1) * rht_matrix().reshape(1, 16, 16)  # exact products
  fwd = p[:, 0]
  for r in range(1, 16):
    fwd = fwd + p[:, r]
  rev = p[:, 15]
  for r in range(14, -1, -1):
    rev = rev + p[:, r]
  pw = p
  while pw.shape[1] > 1:
    pw = pw[:, 0::2] + pw[:, 1::2]
  pw = pw[:, 0]
  outs = [v.bfloat16().float() for v in (fwd, rev, pw)]
  # Some order overflows fp32 in a partial sum (all same-sign terms first) where another does not.
  big = float(np.finfo(np.float32).max)
  overflow = bool((p.double().clamp(min=0).sum(1) > big).any() or (p.double().clamp(max=0).sum(1) < -big).any())
  return overflow or not (torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]))


def _negative_zero(v):
  return ((v == 0) & torch.signbit(v)).numpy()


class ExactRHTQuantizer(ref.NVFP4QuantizerRef):
  """TE's reference quantizer with only its RHT matmul replaced by the exact one."""

  def _apply_rht(self, x):
    return exact_rht(x) if self.with_rht else x


def te_sr_formula():
  """TE JAX's SR body (``abs_x = ...`` to the return) from the wheel, as a function of (x, rand)."""
  src = (peers_env.PEERS / "te" / "transformer_engine" / "jax" / "quantize" / "quantizer.py").read_text()
  tree = ast.parse(src)
  fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_apply_stochastic_rounding")
  body = [s for s in fn.body if ast.get_source_segment(src, s).startswith(("abs_x", "sign_x", "floor", "ceil", "frac",
                                                                            "rand", "return"))]
  assert [ast.get_source_segment(src, s).split()[0] for s in body] == [
      "abs_x", "sign_x", "floor", "ceil", "frac", "rand", "return"], "TE's SR formula changed shape"
  code = "def sr(x, key, jnp, jax):\n" + textwrap.indent("\n".join(ast.get_source_segment(src, s) for s in body), "  ")
  ns = {}
  exec(compile(code, "te_jax_sr", "exec"), ns)  # pylint: disable=exec-used
  return ns["sr"]


class _NumpyRandom:
  def __init__(self, rand):
    self.random = self
    self._rand = rand

  def uniform(self, key, shape):
    assert tuple(shape) == self._rand.shape, (shape, self._rand.shape)
    return self._rand


COLWISE = ("col", "rht", "2dcol")


def quantizer(mode, cls=ref.NVFP4QuantizerRef, qkw=None):
  tile = (16, 16) if mode in ("2d", "2dcol") else (1, 16)
  colwise = mode in COLWISE
  # Row-scaled NVFP4 requires rowwise usage in TE's reference: quantize both copies, read the one asked for.
  rowwise = not colwise or bool((qkw or {}).get("row_scaled_nvfp4"))
  return cls(dtype=E2M1, rowwise=rowwise, columnwise=colwise, quant_tile_shape=tile, with_rht=mode == "rht",
             **(qkw or {}))


def outputs(r, mode):
  """(packed data, scale bytes, amax) of the quantized operand; 2d scales once per tile (see rep<i>)."""
  if mode in COLWISE:
    data, scale, amax = r.data_t, r.scale_t, r.global_amax_col
  else:
    data, scale, amax = r.data, r.scale, r.global_amax_row
  s = scale.contiguous().view(torch.uint8).numpy()
  if mode in ("2d", "2dcol"):  # TE repeats each tile's scale on its 16 rows
    s = s.reshape(-1, 16, s.shape[1])[:, 0]
  a = amax.float().numpy()
  row_scaled = bool(getattr(r._quantizer, "row_scaled_nvfp4", False))  # pylint: disable=protected-access
  return data.numpy(), s, a.reshape(-1) if row_scaled else a.reshape(())


def tile_rows_repeat(r, mode="2d"):
  s = (r.scale_t if mode == "2dcol" else r.scale).contiguous().view(torch.uint8).numpy()
  s3 = s.reshape(-1, 16, s.shape[1])
  return bool((s3 == s3[:, :1]).all())


def main(cases_path, out_path):
  cases = np.load(cases_path)
  meta = json.loads(str(cases["meta"]))
  sr_fn = te_sr_formula() if any(c.get("sr") for c in meta) else None
  out = {}
  orig_cast = ref.cast_to_fp4x2
  for c in meta:
    i, mode = c["index"], c["mode"]
    x = torch.from_numpy(cases[f"x{i}"])
    x = x.bfloat16() if c["dtype"] == "bf16" else x
    if c.get("sr"):
      if f"u{i}" in cases:  # our bytes: our SR rounds up iff frac >= 1 - u / 256
        rand = (np.float32(1.0) - cases[f"u{i}"].astype(np.float32) / np.float32(256.0)).astype(np.float32)
      else:  # independent uniform bits (the distribution test)
        rand = np.random.default_rng(c["rand_seed"]).random(c["shape"], dtype=np.float32)
      rand = rand.T.copy() if mode in ("col", "rht") else rand
      rnd = _NumpyRandom(rand)
      # jnp -> numpy: the formula is elementwise; the where/sign/abs names are numpy's too.
      ref.cast_to_fp4x2 = lambda v: orig_cast(torch.from_numpy(
          np.asarray(sr_fn(v.numpy(), None, np, rnd), np.float32)))
    qkw = c.get("qkw") or {}
    try:
      r = quantizer(mode, qkw=qkw).quantize(x)
    finally:
      ref.cast_to_fp4x2 = orig_cast
    out[f"data{i}"], out[f"scale{i}"], out[f"amax{i}"] = outputs(r, mode)
    if mode in ("2d", "2dcol"):
      out[f"rep{i}"] = np.array(tile_rows_repeat(r, mode))
    if qkw.get("nvfp4_use_4over6"):  # the same reference on a flush-to-zero CPU (FTZ + DAZ)
      torch.set_flush_denormal(True)
      try:
        rf = quantizer(mode, qkw=qkw).quantize(x)
      finally:
        torch.set_flush_denormal(False)
      out[f"fdata{i}"], out[f"fscale{i}"], out[f"famax{i}"] = outputs(rf, mode)
    if mode == "rht" and not c.get("sr"):
      rx = quantizer(mode, ExactRHTQuantizer, qkw=qkw).quantize(x)
      out[f"xdata{i}"], out[f"xscale{i}"], out[f"xamax{i}"] = outputs(rx, mode)
      xt = x.t().contiguous()
      native = ref.NVFP4QuantizerRef(dtype=E2M1, with_rht=True)._apply_rht(xt).float()
      out[f"neg0{i}"] = _negative_zero(native)
      out[f"xneg0{i}"] = _negative_zero(exact_rht(xt).float())
      out[f"rht_exact{i}"] = np.array(torch.equal(native, exact_rht(xt).float()))
      out[f"rht_flush{i}"] = np.array(torch.equal(native, flushed_rht(xt).float()))
      out[f"order{i}"] = np.array(order_sensitive(xt))
  np.savez(out_path, te_version=np.array(peers_env.te_version()), **out)


if __name__ == "__main__":
  main(*sys.argv[1:])
