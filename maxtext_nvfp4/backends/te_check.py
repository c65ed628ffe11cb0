"""TE's NVFP4 kernels vs our exact emulation, on the same inputs (``maxtext-nvfp4 verify-hardware``).

For users with Blackwell (compute capability >= 10.0) and Transformer Engine JAX. It catches a broken
kernel, driver or TE build (TE once shipped stochastic rounding that silently produced zeros on
sm_120) before a long training run. Elsewhere it exits with status 2 and the capability reason.

Checks, on random bf16 ``x`` (m, k) activations, ``w`` (k, n) weights and ``dy`` (m, n) gradients:

  ============================  =================================  ==============================
  check                         TE                                 emulation (maxtext_nvfp4.core.nvfp4)
  ============================  =================================  ==============================
  quantize x 1x16 RNE           tex.quantize, NVFP4_1D, ROWWISE    quantize(x, axis=-1)
  quantize w 16x16 RNE          tex.quantize, NVFP4_2D, ROWWISE    quantize(w, block_2d=True)
  quantize xT 1x16 RHT RNE      tex.quantize, NVFP4_1D, COLWISE,   quantize(x, axis=0, rht=True)
                                use_rht=True (data stored (k, m))
  quantize dy 1x16 SR           8 draws with fresh rng states      8 draws, jax.random keys
  GEMM fprop x @ w (1D x 2D)    tex.gemm(x, w, quantizers)         sum_k (q s8)(q s8) * alpha
  GEMM wgrad xT @ dy (RHT)      tex.gemm(x, dy, ((0,),(0,)), RHT)  same, RHT on both operands
  ============================  =================================  ==============================

Pass criteria: RNE quantization must agree **bit for bit** in data (E2M1 values; +0 and -0 count as
equal), per-element block scales (E4M3) and amax (fp32). Stochastic rounding cannot be bit-compared
(hardware Philox bits tied to the CUDA thread mapping), so it is checked in distribution, as TE's own
``test_sr_nvfp4`` does: the mean of the SR dequantizations is closer to the input than RNE is, TE's
and our mean-abs-errors agree to ``rtol=0.2, atol=1e-4``, and SR does not collapse to zeros. GEMMs
agree when ``|te - emu| <= 8e-3 max|emu| + 8e-3 |emu|`` elementwise (TE's atol = rtol = 8e-3 for its
exact NVFP4 GEMM test, the absolute part relative to the output's scale; accumulation order inside
cuBLAS is unspecified), with ``alpha = (amax_a/2688)(amax_b/2688)``.

Written from TE 2.x's JAX API as read in its source (``cpp_extensions.quantize``, ``cpp_extensions.gemm``,
``quantize.QuantizerFactory.create(scaling_mode=, q_dtype=, q_layout=, use_rht=,
stochastic_rounding_rng_state=)``, ``ScaledTensor1x.{data, scale_inv, amax, data_layout}``). It has
NOT been run on real Blackwell hardware; its comparison logic is tested on CPU against a fake TE.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# 6 * 448: TE JAX's global denominator. Every NVFP4 tensor TE JAX makes has the E4M3 bound 448 (its recipe
# has no 4over6, whose 256 bound exists in TE PyTorch only); the emulation's is per tensor (NVFP4Tensor.e4m3_bound).
_TE_JAX_DENOMINATOR = 2688.0

GEMM_TOL = 8e-3  # TE tests/pytorch/nvfp4/test_nvfp4_gemm_exact.py: atol = rtol = 8e-3
SR_RTOL, SR_ATOL = 0.2, 1e-4  # TE tests/jax/test_custom_call_compute.py test_sr_nvfp4


def _f32(a) -> np.ndarray:
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  return np.asarray(jnp.asarray(a).astype(jnp.float32))


def expand_scale(scale, data_shape) -> np.ndarray:
  """Per-element fp32 scale: repeat each axis of a block-scale array up to ``data_shape``.

  Works for 1x16 scales, 16x16 scales and TE's 2D scales broadcast to the 1x16 layout alike, so
  2D and 1D layouts compare element by element.
  """
  s = _f32(scale)
  if s.ndim != len(data_shape):
    raise ValueError(f"scale of shape {s.shape} does not match data of shape {tuple(data_shape)}")
  for ax, (ns, nd) in enumerate(zip(s.shape, data_shape)):
    if ns == 0 or nd % ns:
      raise ValueError(f"scale of shape {s.shape} does not tile data of shape {tuple(data_shape)} (axis {ax})")
    s = np.repeat(s, nd // ns, axis=ax)
  return s


def compare_quantized(te_data, te_scale, te_amax, emu, *, transposed: bool = False) -> dict[str, Any]:
  """Bit agreement of one TE quantized tensor with an emulated :class:`NVFP4Tensor`.

  ``transposed``: TE stored the data (and scales) transposed (its column-wise "T" layout).
  """
  td = _f32(te_data)
  ed = _f32(emu.data)
  es = expand_scale(emu.scale, ed.shape)  # 1x16 along any axis, or 16x16
  if transposed:
    ed, es = ed.T, es.T
  if td.shape != ed.shape:
    return {"passed": False, "error": f"TE data shape {td.shape} != emulated {ed.shape}"}
  ts = expand_scale(te_scale, td.shape)
  data_mis = int(np.sum(td != ed))
  scale_mis = int(np.sum(~((ts == es) | (np.isnan(ts) & np.isnan(es)))))
  ta, ea = np.float32(_f32(te_amax).reshape(-1)[0]), np.float32(_f32(emu.amax))
  amax_eq = bool(ta.view(np.uint32) == ea.view(np.uint32))
  return {
      "passed": data_mis == 0 and scale_mis == 0 and amax_eq,
      "data_mismatches": data_mis,
      "scale_mismatches": scale_mis,  # per element (each block scale counted 16 or 256 times)
      "elements": int(td.size),
      "amax_te": float(ta),
      "amax_emulated": float(ea),
      "amax_equal": amax_eq,
  }


def emulated_gemm(a, b, contract_a: int, contract_b: int, out_dtype=None):
  """NVFP4 GEMM as the Tensor Core computes it, up to fp32 accumulation order.

  ``sum over blocks (q_a s8_a)(q_b s8_b)`` in fp32 (each term exact), times
  ``alpha = gemm.gemm_alpha(amax_a, amax_b)`` (TE's as compiled), cast to ``out_dtype`` (bf16, TE's output dtype).
  """
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.core import gemm  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.core import nvfp4 as numerics  # pylint: disable=import-outside-toplevel

  va = numerics.block_values(a, jnp.float32)
  vb = numerics.block_values(b, jnp.float32)
  acc = jax.lax.dot_general(va, vb, (((contract_a,), (contract_b,)), ((), ())),
                            precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
  alpha = gemm.gemm_alpha(a.amax, b.amax)  # TE's alpha as XLA compiles it
  return (acc * alpha).astype(out_dtype or jnp.bfloat16)


def compare_gemm(te_out, emu_out, tol: float = GEMM_TOL) -> dict[str, Any]:
  """``|te - emu| <= tol * max|emu| + tol * |emu|`` elementwise, plus the relative Frobenius difference.

  TE's exact-GEMM test uses ``atol = rtol = 8e-3`` on outputs of order one; the absolute part is
  scaled by ``max|emu|`` here so that small outputs (wgrad with small gradients) are not waved through.
  """
  t, e = _f32(te_out), _f32(emu_out)
  if t.shape != e.shape:
    return {"passed": False, "error": f"TE GEMM shape {t.shape} != emulated {e.shape}"}
  diff = np.abs(t - e)
  scale = float(np.max(np.abs(e))) if e.size else 0.0
  bad = int(np.sum(~(diff <= tol * scale + tol * np.abs(e))))
  rel = float(np.linalg.norm(t - e) / max(np.linalg.norm(e), np.finfo(np.float32).tiny))
  return {"passed": bad == 0 and np.all(np.isfinite(t)), "violations": bad, "elements": int(t.size),
          "max_abs_diff": float(diff.max()), "rel_frobenius": rel, "tolerance": tol}


def _sr_stats(x32: np.ndarray, draws: list[np.ndarray], rn: np.ndarray) -> dict[str, float]:
  mean = np.mean(np.stack(draws), axis=0)
  return {
      "sr_mae": float(np.mean(np.abs(mean - x32))),
      "rn_mae": float(np.mean(np.abs(rn - x32))),
      "sr_nonzero_fraction": float(np.mean(np.stack(draws) != 0)),
      "rn_nonzero_fraction": float(np.mean(rn != 0)),
      "sr_variance": float(np.var(np.stack(draws))),
  }


def _dequant(data, scale, amax) -> np.ndarray:
  d = _f32(data)
  return d * expand_scale(scale, d.shape) * (np.float32(_f32(amax).reshape(-1)[0]) / np.float32(_TE_JAX_DENOMINATOR))


def _rowwise(t):
  """The row-wise copy of a TE ``ScaledTensor2x``, or the tensor itself (``ScaledTensor1x``)."""
  r = getattr(t, "rowwise_tensor", None)
  return t if r is None else r


def _colwise(t):
  c = getattr(t, "colwise_tensor", None)
  return t if c is None else c


def run_checks(m: int = 256, k: int = 512, n: int = 256, seed: int = 0, sr_draws: int = 8) -> list[dict[str, Any]]:
  """Run every check (module docstring) with TE imported here; returns one dict per check."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from transformer_engine.jax import cpp_extensions as tex  # pylint: disable=import-outside-toplevel # pytype: disable=import-error
  from transformer_engine.jax.quantize import QuantizeLayout, QuantizerFactory, ScalingMode  # pylint: disable=import-outside-toplevel # pytype: disable=import-error

  from maxtext_nvfp4.core import nvfp4 as numerics  # pylint: disable=import-outside-toplevel

  fp4 = jnp.float4_e2m1fn
  kx, kr, kw, kd, ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  # Rows of different magnitude so block scales span many E4M3 binades; gradients are small.
  x = (jax.random.normal(kx, (m, k)) * jnp.exp2(jax.random.randint(kr, (m, 1), -6, 6))).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (k, n)) * 0.05).astype(jnp.bfloat16)
  dy = (jax.random.normal(kd, (m, n)) * 1e-3).astype(jnp.bfloat16)

  def q(mode, layout, **kw_):
    return QuantizerFactory.create(scaling_mode=mode, q_dtype=fp4, q_layout=layout, **kw_)

  results = []

  def record(name, kind, fn):
    try:
      r = fn()
    except Exception as e:  # pylint: disable=broad-except  # a crash is a failed check, reported
      r = {"passed": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    results.append({"check": name, "kind": kind, **r})

  def quant_x():
    t = _rowwise(tex.quantize(x, quantizer=q(ScalingMode.NVFP4_1D_SCALING, QuantizeLayout.ROWWISE), flatten_axis=-1))
    return compare_quantized(t.data, t.scale_inv, t.amax, numerics.quantize(x, axis=-1))

  def quant_w():
    t = _rowwise(tex.quantize(w, quantizer=q(ScalingMode.NVFP4_2D_SCALING, QuantizeLayout.ROWWISE), flatten_axis=-1))
    return compare_quantized(t.data, t.scale_inv, t.amax, numerics.quantize(w, block_2d=True))

  def quant_xt_rht():
    t = _colwise(tex.quantize(
        x, quantizer=q(ScalingMode.NVFP4_1D_SCALING, QuantizeLayout.COLWISE, use_rht=True), flatten_axis=-1))
    return compare_quantized(t.data, t.scale_inv, t.amax, numerics.quantize(x, axis=0, rht=True),
                             transposed=getattr(t, "data_layout", "T") == "T")

  def sr_dy():
    dy32 = _f32(dy)
    rn = numerics.dequantize(numerics.quantize(dy, axis=-1))
    te_draws, emu_draws = [], []
    for i in range(sr_draws):
      key = jax.random.fold_in(ks, i)
      state = jax.random.randint(key, (1, 4), 0, 2**30 - 1, dtype=jnp.uint32)
      t = _rowwise(tex.quantize(dy, quantizer=q(ScalingMode.NVFP4_1D_SCALING, QuantizeLayout.ROWWISE,
                                                stochastic_rounding_rng_state=state), flatten_axis=-1))
      te_draws.append(_dequant(t.data, t.scale_inv, t.amax))
      emu_draws.append(_f32(numerics.dequantize(numerics.quantize(dy, axis=-1, stochastic_key=key))))
    te, emu = _sr_stats(dy32, te_draws, _f32(rn)), _sr_stats(dy32, emu_draws, _f32(rn))
    close = abs(te["sr_mae"] - emu["sr_mae"]) <= SR_ATOL + SR_RTOL * abs(emu["sr_mae"])
    not_degenerate = te["sr_variance"] > 0 and te["sr_nonzero_fraction"] >= 0.5 * te["rn_nonzero_fraction"]
    return {"passed": bool(te["sr_mae"] < te["rn_mae"] and close and not_degenerate), "te": te, "emulated": emu,
            "mae_close": bool(close), "not_degenerate": bool(not_degenerate)}

  def gemm_fprop():
    out = tex.gemm(x, w, contracting_dims=((1,), (0,)),
                   lhs_quantizer=q(ScalingMode.NVFP4_1D_SCALING, QuantizeLayout.ROWWISE_COLWISE),
                   rhs_quantizer=q(ScalingMode.NVFP4_2D_SCALING, QuantizeLayout.ROWWISE_COLWISE))
    out = out[0] if isinstance(out, (tuple, list)) else out
    emu = emulated_gemm(numerics.quantize(x, axis=-1), numerics.quantize(w, block_2d=True), 1, 0)
    return compare_gemm(out, emu)

  def gemm_wgrad():
    out = tex.gemm(x, dy, contracting_dims=((0,), (0,)),
                   lhs_quantizer=q(ScalingMode.NVFP4_1D_SCALING, QuantizeLayout.ROWWISE_COLWISE, use_rht=True),
                   rhs_quantizer=q(ScalingMode.NVFP4_1D_SCALING, QuantizeLayout.ROWWISE_COLWISE, use_rht=True))
    out = out[0] if isinstance(out, (tuple, list)) else out
    emu = emulated_gemm(numerics.quantize(x, axis=0, rht=True), numerics.quantize(dy, axis=0, rht=True), 0, 0)
    return compare_gemm(out, emu)

  record("quantize x 1x16 RNE", "bitwise", quant_x)
  record("quantize w 16x16 RNE", "bitwise", quant_w)
  record("quantize xT 1x16 RHT RNE", "bitwise", quant_xt_rht)
  record("quantize dy 1x16 SR", "distribution", sr_dy)
  record("GEMM fprop x@w (1x16 x 16x16)", "gemm", gemm_fprop)
  record("GEMM wgrad xT@dy (RHT)", "gemm", gemm_wgrad)
  return results
