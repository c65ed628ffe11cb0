"""Per-GEMM NVFP4 quantization statistics (the math; no MaxText import).

What is measured. For a tensor ``t`` quantized the way one GEMM operand is (``numerics.quantize``:
x 1x16 along K with RNE, W 16x16 tiles or 1x16 along K with RNE, dy 1x16 along N with stochastic
rounding when the recipe uses it) and ``d = dequantize(q(t))`` (fp32), the device computes the raw sums
of :data:`SUM_FIELDS`:

    sq_err     = sum((d - t)**2)                     sq_norm = sum(t**2)        (fp32)
    nonzero    = #{i : t_i != 0}                     flushed = #{i : t_i != 0 and d_i == 0}
    blocks     = number of NVFP4 blocks (16 or 16x16 elements; a zero-padded tail block counts once)
    scale_sat  = #{blocks : s8 == 448}               scale_zero = #{blocks : s8 == 0 and max|t_block| > 0}
    amax       = max |t|

(``flushed`` uses the dequantized value: a block whose E4M3 scale rounds to 0 dequantizes to 0 even
though its E2M1 codes are saturated at ±6.) The host turns the sums of every GEMM in an aggregation
group into the published statistics (:func:`summarize`):

    rel_err    = mean over the group's reports of sqrt(sq_err / sq_norm), all-zero tensors left out
                 (an expert no token reached; 0 when every tensor is zero)
                 SNR in dB is -20 * log10(rel_err)
    underflow  = sum(flushed) / sum(nonzero)                                (0 if no non-zero element)
    scale_sat  = sum(scale_sat) / sum(blocks)
    scale_zero = sum(scale_zero) / sum(blocks)
    amax       = max(amax)

Note ``scale_sat``: with two-level scaling the block holding the tensor amax always gets s8 = 448
(``bamax * 448 / amax``), so it counts the blocks whose max is within E4M3 rounding (~3.6 %) of the
tensor amax; a value near 1 means the tensor is flat, near 1/blocks that one outlier sets the range.

Metric keys: ``nvfp4/<group>/<tensor>_<stat>``, tensor in ``x``, ``w``, ``dy``, stat as above, group
``<kind>_first`` / ``<kind>`` / ``<kind>_last`` with kind ``attention``, ``mlp`` (dense MLPs and shared experts)
or ``experts`` (routed experts): the first and the last decoder layer that runs NVFP4 GEMMs are reported
separately, the layers between them together (:func:`group_name`; with scanned layers every layer is in
``<kind>``). Routed experts are a batched GEMM, one GEMM per expert with its own tensors: each expert's x, W
and dy is one report (its own amax), so ``rel_err`` is the mean over experts and layers. An expert's x is its
token buffer (rows past its tokens are zeros: unfilled capacity on the einsum path, buffer padding on the
grouped-GEMM path; their blocks count in ``blocks`` with s8 = 0, and never in ``scale_zero``, which needs a
non-zero block).

Host side: :class:`Aggregator` collects reports by training step (fed by ``jax.debug.callback`` from
the plugin's GEMM module) and hands a step's summary to the metrics writer. Reports of the same GEMM
repeated within a step (rematerialization, gradient accumulation, scanned layers) are pooled; the
means and fractions above are insensitive to exact duplicates.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from maxtext_nvfp4.core import nvfp4 as numerics
from maxtext_nvfp4.core import prng

__all__ = [
    "Aggregator",
    "AGGREGATOR",
    "KINDS",
    "PREFIX",
    "STATS",
    "SUM_FIELDS",
    "TENSORS",
    "TensorSpec",
    "group_name",
    "instrument",
    "metric_key",
    "gemm_matrices",
    "batched_gemm_matrices",
    "output_matrix",
    "summarize",
    "tensor_sums",
]

PREFIX = "nvfp4/"
KINDS = ("attention", "mlp", "experts")
TENSORS = ("x", "w", "dy")
STATS = ("rel_err", "underflow", "scale_sat", "scale_zero", "amax")
SUM_FIELDS = ("sq_err", "sq_norm", "nonzero", "flushed", "blocks", "scale_sat", "scale_zero", "amax")

_BLOCK = numerics.BLOCK
_ABS_MASK = 0x7FFFFFFF


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorSpec:
  """How one GEMM operand is quantized for the statistics (a 2D ``(rows, cols)`` matrix)."""

  # block axis of the matrix for 1x16 blocks (1: along the columns); ignored when block_2d
  axis: int = 1
  # 16x16 tiles (TE's weight path)
  block_2d: bool = False
  # draw stochastic rounding with the key passed to tensor_sums (dy when the recipe uses SR)
  stochastic: bool = False
  # the tensor's scale rule (the recipe's: 4over6, E4M3 bound, row-scaled x); None: TE's standard rule.
  # With 16x16 tiles and 4over6, ``axis`` is the axis the tile error is summed along (0: fprop's copy).
  rule: numerics.ScaleRule | None = None


def group_name(kind: str, layer: int | None, *, first: int | None, last: int | None) -> str:
  """Aggregation group of a GEMM: ``<kind>_first`` / ``<kind>_last`` / ``<kind>``.

  ``first``/``last``: the first and last decoder layer with NVFP4 GEMMs. ``layer is None`` (scanned
  layers, index unknown) -> ``<kind>``. When first == last the single layer is ``<kind>_first``.
  """
  if kind not in KINDS:
    raise ValueError(f"unknown GEMM kind {kind!r}; expected one of {KINDS}")
  if layer is None:
    return kind
  if layer == first:
    return f"{kind}_first"
  if layer == last:
    return f"{kind}_last"
  return kind


def metric_key(group: str, tensor: str, stat: str) -> str:
  """``nvfp4/<group>/<tensor>_<stat>``."""
  return f"{PREFIX}{group}/{tensor}_{stat}"


# ---------------------------------------------------------------------------------------------------
# Device side
# ---------------------------------------------------------------------------------------------------


def _pad_to_block(m, axes):
  pads = [(0, 0)] * m.ndim
  for a in axes:
    pads[a] = (0, (-m.shape[a]) % _BLOCK)
  return jnp.pad(m, pads) if any(p[1] for p in pads) else m


def _normalize(dims, ndim):
  return tuple(d % ndim for d in dims)


def gemm_matrices(lhs, rhs, dimension_numbers):
  """``(x, w)`` as 2D matrices ``(M, K)`` and ``(K, N)`` of ``lax.dot_general(lhs, rhs, dims)``.

  Contracting dims are flattened in the given order into K, the other dims (in order) into M / N, like
  the emulated GEMM does. Batch dims: ValueError (:func:`batched_gemm_matrices` takes them).
  """
  (lc, rc), (lb, rb) = dimension_numbers
  if tuple(lb) or tuple(rb):
    raise ValueError("NVFP4 diagnostics support dot_generals without batch dimensions only")
  lc, rc = _normalize(lc, lhs.ndim), _normalize(rc, rhs.ndim)
  lfree = [d for d in range(lhs.ndim) if d not in lc]
  rfree = [d for d in range(rhs.ndim) if d not in rc]
  x = jnp.transpose(lhs, lfree + list(lc))
  w = jnp.transpose(rhs, list(rc) + rfree)
  k = math.prod(lhs.shape[d] for d in lc)
  return x.reshape(-1, k), w.reshape(k, -1)


def batched_gemm_matrices(lhs, rhs, dimension_numbers):
  """``(x, w)`` as ``(B, M, K)`` and ``(B, K, N)`` stacks of :func:`gemm_matrices`, one per batch index (the batch
  dims flattened in order into B): a dot_general with batch dims is B GEMMs, each its own tensor (an expert's)."""
  (lc, rc), (lb, rb) = dimension_numbers
  lb, rb = _normalize(lb, lhs.ndim), _normalize(rb, rhs.ndim)
  lc, rc = _normalize(lc, lhs.ndim), _normalize(rc, rhs.ndim)
  b = math.prod(lhs.shape[d] for d in lb)
  lhs = jnp.transpose(lhs, list(lb) + [d for d in range(lhs.ndim) if d not in lb]).reshape(
      (b,) + tuple(lhs.shape[d] for d in range(lhs.ndim) if d not in lb))
  rhs = jnp.transpose(rhs, list(rb) + [d for d in range(rhs.ndim) if d not in rb]).reshape(
      (b,) + tuple(rhs.shape[d] for d in range(rhs.ndim) if d not in rb))
  # the contracting dims renumbered for the per-index operands (batch dims gone)
  lc = tuple(d - sum(x < d for x in lb) for d in lc)
  rc = tuple(d - sum(x < d for x in rb) for d in rc)
  return jax.vmap(lambda l, r: gemm_matrices(l, r, ((lc, rc), ((), ()))))(lhs, rhs)


def output_matrix(y, num_free_rhs: int):
  """``y`` (a dot_general output: lhs free dims, then ``num_free_rhs`` rhs free dims) as ``(M, N)``."""
  n = math.prod(y.shape[y.ndim - num_free_rhs:])
  return y.reshape(-1, n)


def tensor_sums(t, spec: TensorSpec = TensorSpec(), key=None) -> dict[str, jax.Array]:
  """The raw sums of :data:`SUM_FIELDS` for the 2D matrix ``t`` quantized as ``spec`` says.

  The block axes are zero-padded to a multiple of 16 first (zeros change no amax, count as no
  element, and add no block beyond the GEMM's own). Counts are int32, the rest fp32.
  """
  if t.ndim != 2:
    raise ValueError(f"tensor_sums takes a 2D matrix, got shape {t.shape}")
  axes = (0, 1) if spec.block_2d else (spec.axis % 2,)
  t = _pad_to_block(t, axes)
  q = numerics.quantize(t, axis=spec.axis, block_2d=spec.block_2d,
                        stochastic_key=key if spec.stochastic else None, scale_rule=spec.rule)
  d = numerics.dequantize(q, jnp.float32)
  tf = t.astype(jnp.float32)
  # Zero tests on the bits: XLA:CPU compares with denormals-are-zero, and bf16/fp32 subnormals are
  # real (non-zero) inputs here.
  t_nz = (lax.bitcast_convert_type(tf, jnp.uint32) & _ABS_MASK) != 0
  d_nz = (lax.bitcast_convert_type(d, jnp.uint32) & _ABS_MASK) != 0
  s8 = q.scale.astype(jnp.float32)
  if spec.block_2d:
    r, c = tf.shape
    blk = tf.reshape(r // _BLOCK, _BLOCK, c // _BLOCK, _BLOCK)
    block_nz = jnp.any(t_nz.reshape(blk.shape), axis=(1, 3))
  else:
    a = spec.axis % 2
    shape = (tf.shape[0] // _BLOCK, _BLOCK, tf.shape[1]) if a == 0 else (tf.shape[0], tf.shape[1] // _BLOCK, _BLOCK)
    block_nz = jnp.any(t_nz.reshape(shape), axis=a + 1)
  err = d - tf
  return {
      "sq_err": jnp.sum(err * err),
      "sq_norm": jnp.sum(tf * tf),
      "nonzero": jnp.sum(t_nz, dtype=jnp.int32),
      "flushed": jnp.sum(t_nz & ~d_nz, dtype=jnp.int32),
      "blocks": jnp.int32(s8.size),
      "scale_sat": jnp.sum(s8 == numerics.E4M3_MAX, dtype=jnp.int32),
      "scale_zero": jnp.sum((s8 == 0) & block_nz, dtype=jnp.int32),
      "amax": jnp.max(q.amax),  # row-scaled: the largest row amax
  }


_DY_KEY_TAG = 3  # fold_in tag of the diagnostic SR draw (gemm uses 1 and 2 for its dgrad/wgrad copies)


def instrument(lhs, rhs, dimension_numbers, out, *, step, interval: int, group: str, two_d_weights: bool = True,
               stochastic: bool = False, key=None, aggregator: "Aggregator | None" = None,
               x_rule: numerics.ScaleRule | None = None, w_rule: numerics.ScaleRule | None = None):
  """Report the statistics of x and W now and of dy in the backward pass, on steps ``step % interval == 0``.

  Returns ``out`` unchanged (through an identity ``custom_vjp`` whose backward sees dy = d loss / d out).
  The work sits in ``lax.cond`` branches on the traced ``step``: other steps run only the predicate, and
  flipping it never recompiles. Reports go to ``aggregator.report`` via ``jax.debug.callback``
  (tensor ``x``: 1x16 along K, RNE; ``w``: 16x16 if ``two_d_weights`` else 1x16 along K, RNE; ``dy``:
  1x16 along N, stochastic rounding with ``fold_in(key, 3)`` if ``stochastic``, i.e. an independent draw
  with the dgrad GEMM's distribution). ``x_rule`` / ``w_rule``: the recipe's scale rules of x and W (4over6,
  E4M3 bound, row-scaled x; None: TE's standard), so the statistics are those of the operands the fprop
  uses. Called only when diagnostics are on (a trace-time decision).
  """
  agg = AGGREGATOR if aggregator is None else aggregator
  step = jnp.asarray(step, jnp.int32)
  on = (step % jnp.int32(interval)) == 0
  (rc, _), (_, rb) = dimension_numbers
  num_batch = len(tuple(rb))
  lhs, rhs = lax.stop_gradient(lhs), lax.stop_gradient(rhs)
  x_spec = TensorSpec(axis=1, rule=x_rule)
  w_spec = TensorSpec(axis=0, block_2d=bool(two_d_weights), rule=w_rule)

  if num_batch:  # B GEMMs (experts): one report per index, each its own tensor
    x, w = batched_gemm_matrices(lhs, rhs, dimension_numbers)

    def forward_stats(step, x, w):
      jax.debug.callback(functools.partial(agg.report_each, group=group, tensor="x"), step,
                         jax.vmap(lambda t: tensor_sums(t, x_spec))(x))
      jax.debug.callback(functools.partial(agg.report_each, group=group, tensor="w"), step,
                         jax.vmap(lambda t: tensor_sums(t, w_spec))(w))
  else:
    x, w = gemm_matrices(lhs, rhs, dimension_numbers)

    def forward_stats(step, x, w):
      jax.debug.callback(functools.partial(agg.report, group=group, tensor="x"), step, tensor_sums(x, x_spec))
      jax.debug.callback(functools.partial(agg.report, group=group, tensor="w"), step, tensor_sums(w, w_spec))

  lax.cond(on, forward_stats, lambda *_: None, step, x, w)
  num_free_rhs = rhs.ndim - len(tuple(rc)) - num_batch
  use_sr = bool(stochastic) and key is not None
  dy_key = jax.random.fold_in(prng.resolve(key), _DY_KEY_TAG) if use_sr else jnp.zeros((), jnp.uint32)
  watch = _grad_watch(agg, group, num_free_rhs, use_sr, num_batch)
  return watch(out, step, on, dy_key)


@functools.cache
def _grad_watch(agg, group: str, num_free_rhs: int, use_sr: bool, num_batch: int = 0):
  """``f(y, step, on, key) = y`` whose backward reports the statistics of the cotangent dy when ``on``
  (``num_batch`` leading batch dims: one report per batch index, index b drawing SR from ``fold_in(key, b)``)."""

  def backward_stats(step, g, key):
    spec = TensorSpec(axis=1, stochastic=use_sr)
    if not num_batch:
      sums = tensor_sums(output_matrix(g, num_free_rhs), spec, key if use_sr else None)
      jax.debug.callback(functools.partial(agg.report, group=group, tensor="dy"), step, sums)
      return
    b = math.prod(g.shape[:num_batch])
    gs = g.reshape((b,) + g.shape[num_batch:])
    keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(b)) if use_sr else jnp.zeros((b,), jnp.uint32)
    sums = jax.vmap(lambda t, k: tensor_sums(output_matrix(t, num_free_rhs), spec, k if use_sr else None))(gs, keys)
    jax.debug.callback(functools.partial(agg.report_each, group=group, tensor="dy"), step, sums)

  @jax.custom_vjp
  def watch(y, step, on, key):
    del step, on, key
    return y

  def fwd(y, step, on, key):
    return y, (step, on, key)

  def bwd(res, g):
    step, on, key = res
    lax.cond(on, backward_stats, lambda *_: None, step, lax.stop_gradient(g), key)
    return g, None, None, None

  watch.defvjp(fwd, bwd)
  return watch


# ---------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------


def summarize(reports: list[Mapping[str, float]]) -> dict[str, float]:
  """The published statistics (:data:`STATS`) of one group's reports of one tensor (formulas above)."""
  if not reports:
    raise ValueError("summarize needs at least one report")
  rel = []
  for r in reports:
    sq_err, sq_norm = float(r["sq_err"]), float(r["sq_norm"])
    if sq_norm == 0 and sq_err == 0:  # an all-zero tensor (an expert no token reached): no error to average
      continue
    rel.append(math.sqrt(sq_err / sq_norm) if sq_norm > 0 else math.inf)
  tot = {f: sum(float(r[f]) for r in reports) for f in ("nonzero", "flushed", "blocks", "scale_sat", "scale_zero")}
  amaxes = [float(r["amax"]) for r in reports]
  return {
      "rel_err": float(np.mean(rel)) if rel else 0.0,
      "underflow": tot["flushed"] / tot["nonzero"] if tot["nonzero"] else 0.0,
      "scale_sat": tot["scale_sat"] / tot["blocks"] if tot["blocks"] else 0.0,
      "scale_zero": tot["scale_zero"] / tot["blocks"] if tot["blocks"] else 0.0,
      # NaN-propagating max (a NaN amax is the signal that the tensor held a NaN).
      "amax": float(np.max(amaxes)),
  }


class Aggregator:
  """Thread-safe ``step -> (group, tensor) -> [reports]`` store between device callbacks and the writer."""

  def __init__(self):
    self._lock = threading.Lock()
    self._data: dict[int, dict[tuple[str, str], list[dict[str, float]]]] = {}
    # Set once a diagnosed GEMM is built: the metrics writer only waits/merges when True.
    self.armed = False

  def report(self, step, sums: Mapping[str, object], *, group: str, tensor: str) -> None:
    """Record one GEMM operand's sums for ``step`` (the ``jax.debug.callback`` target)."""
    entry = {f: float(np.asarray(sums[f])) for f in SUM_FIELDS}
    with self._lock:
      self._data.setdefault(int(np.asarray(step)), {}).setdefault((group, tensor), []).append(entry)

  def report_each(self, step, sums: Mapping[str, object], *, group: str, tensor: str) -> None:
    """:meth:`report` for each index of the leading axis of ``sums`` (a batched GEMM: one report per expert)."""
    fields = {f: np.asarray(sums[f]) for f in SUM_FIELDS}
    for i in range(len(fields["amax"])):
      self.report(step, {f: v[i] for f, v in fields.items()}, group=group, tensor=tensor)

  def steps(self) -> list[int]:
    with self._lock:
      return sorted(self._data)

  def pop(self, step: int) -> dict[str, float]:
    """``{metric key: value}`` for ``step`` (empty if nothing was reported), removing it from the store."""
    with self._lock:
      found = self._data.pop(int(step), {})
      # Earlier steps can no longer be written (metrics are written in step order): drop them.
      for stale in [s for s in self._data if s < int(step)]:
        del self._data[stale]
    out = {}
    for (group, tensor), reports in sorted(found.items()):
      for stat, v in summarize(reports).items():
        out[metric_key(group, tensor, stat)] = v
    return out

  def clear(self) -> None:
    with self._lock:
      self._data.clear()


# The process-wide store the plugin's callbacks report into and its metrics writer reads.
AGGREGATOR = Aggregator()
