"""Gradient fidelity and stability telemetry: the math and the host-side store (no MaxText import).

**Gradient fidelity.** On a diagnostic step, ``g`` is the gradient the step trains with (NVFP4 GEMMs) and ``r``
the high-precision gradient of the same batch at the same parameters (every GEMM as MaxText's plain one). For a
*unit* -- one parameter tensor, or one routed expert's slice of an expert weight, or one layer's slice of a
scanned one -- the device computes (fp32)::

    dot = sum(g * r)        sq_run = sum(g * g)        sq_ref = sum(r * r)

and the host pools the units of a set ``U`` (:func:`fidelity`)::

    cos        = sum_U dot / sqrt(sum_U sq_run * sum_U sq_ref)      (1: same direction; 0 if either is zero)
    norm_ratio = sqrt(sum_U sq_run / sum_U sq_ref)                  (1: same length; inf if r = 0, g != 0)

``cos`` of a pooled set is the cosine of the concatenated gradients (not a mean of cosines). Units are
classified by :func:`param_role` from the parameter's path: ``attention`` / ``mlp`` (dense MLPs, shared experts) /
``experts`` (routed experts' ``wi_0``, ``wi_1``, ``wo``) kernels of decoder layer ``i``, else ``other``
(embeddings, norms, router, output head).

**Telemetry.** ``residual``: the RMS ``sqrt(mean(x**2))`` of every input of an RMSNorm over the model width (in a
pre-norm block: the residual stream before each attention and MLP block, and before the final norm).
``moe load``: per MoE layer, the tokens routed to each expert ``c_e`` (top-k choices counted once each) and the
imbalance ``max_e c_e / mean_e c_e`` (1: perfectly balanced; ``num_experts``: every choice on one expert).

Keys (``nvfp4/<group>/<name>``; :func:`Store.pop` writes them):

=============================== ===================================================================
``nvfp4/<g>/dw_cos``, ``dw_norm_ratio``  pooled over the group's units; ``g`` as the quantization
                                         statistics' groups (``mlp_first``, ``experts``, ``attention_last``,
                                         ...) plus ``other``
``nvfp4/<g>/dw_cos_min``                the smallest unit cosine in the group (one projection of one layer,
                                         one expert of one layer)
``nvfp4/model/dw_cos``, ``dw_norm_ratio`` every parameter
``nvfp4/layer_<i>/dw_cos``              decoder layer ``i``'s GEMM kernels (attention, MLP, experts)
``nvfp4/expert_<e>/dw_cos``, ``dw_norm_ratio``  routed expert ``e``, pooled over MoE layers and its 3 kernels
``nvfp4/residual/rms_min``, ``rms_max``  over the step's RMSNorm inputs (layers); ``rms_span`` = max / min
``nvfp4/moe/load_max``                  the largest imbalance over MoE layers
``nvfp4/moe_<k>/load``                  the imbalance of the k-th MoE layer of the forward pass
=============================== ===================================================================

Reports of the same unit or layer within a step (rematerialization, gradient accumulation) are pooled: the
fidelity sums add up (cosines and ratios are unchanged by exact duplicates), the RMS and load take min/max.
"""

from __future__ import annotations

import dataclasses
import math
import re
import threading
from typing import Mapping, Sequence

import numpy as np

__all__ = ["GRAD_FIELDS", "ParamRole", "Store", "STORE", "UnitMeta", "fidelity", "grad_sums", "load_imbalance",
           "param_role", "unit_axes"]

PREFIX = "nvfp4/"
GRAD_FIELDS = ("dot", "sq_run", "sq_ref")
# Module names in a MaxText decoder layer's parameter path (NNX / Linen conversion names).
_ATTENTION = ("self_attention", "self_attention_local", "self_attention_global", "attention", "cross_attention")
_MLP = ("mlp", "mlp_local", "shared_experts", "shared_expert", "MlpBlock_0")
_MOE = ("MoeBlock_0", "moe_block", "RoutedMoE_0")
_EXPERT_WEIGHTS = ("wi_0", "wi_1", "wo", "wi")
_LAYER = re.compile(r"^(?:layers|dense_layers|moe_layers)_(\d+)$")
_SCANNED = ("layers", "dense_layers", "moe_layers", "scanned_blocks")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamRole:
  """What one parameter tensor is, for the fidelity's pooling."""

  # attention | mlp | experts | other
  kind: str
  # decoder layer index (None: scanned, see layer_axis; or not a decoder-layer parameter)
  layer: int | None = None
  # the axis holding the routed experts (experts only), and the scanned layers' axis (scanned only)
  expert_axis: int | None = None
  layer_axis: int | None = None


def param_role(path: Sequence[str], ndim: int, *, scan_axis: int = 1) -> ParamRole:
  """Classify a parameter by its path (``('decoder', 'layers_3', 'mlp', 'wi_0', 'kernel')``) and rank.

  Routed experts' weights are ``<moe>/wi_0|wi_1|wo`` without a ``kernel`` leaf (``(E, ...)``, the expert axis
  first); under a scanned stack (``layers`` without an index) the layer axis is ``scan_axis`` (MaxText's
  ``param_scan_axis``), shifted past the expert axis for expert weights.
  """
  names = [str(p) for p in path]
  layer, scanned = None, False
  for n in names:
    m = _LAYER.match(n)
    if m:
      layer = int(m.group(1))
    elif n in _SCANNED:
      scanned = True
  if layer is None and not scanned:
    return ParamRole(kind="other")
  layer_axis = None
  if any(n in _MOE for n in names) and names[-1] in _EXPERT_WEIGHTS:
    if scanned:
      layer_axis = scan_axis if scan_axis >= 1 else 1
    return ParamRole(kind="experts", layer=layer, expert_axis=0, layer_axis=layer_axis)
  if names[-1] != "kernel":
    return ParamRole(kind="other", layer=layer)
  kind = "attention" if any(n in _ATTENTION for n in names) else "mlp" if any(n in _MLP for n in names) else None
  if kind is None:
    return ParamRole(kind="other", layer=layer)
  if scanned:
    layer_axis = scan_axis % ndim
  return ParamRole(kind=kind, layer=layer, layer_axis=layer_axis)


def unit_axes(role: ParamRole) -> tuple[int, ...]:
  """The axes a unit keeps (sums run over all others): the layer axis, then the expert axis, where present."""
  return tuple(a for a in (role.layer_axis, role.expert_axis) if a is not None)


def grad_sums(g, r, keep: tuple[int, ...] = ()):
  """``{dot, sq_run, sq_ref}`` of gradients ``g`` (the run's) and ``r`` (the reference), fp32, summed over every
  axis but ``keep`` (in that order: the result has shape ``[g.shape[a] for a in keep]``)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  g = jnp.moveaxis(g.astype(jnp.float32), keep, tuple(range(len(keep))))
  r = jnp.moveaxis(r.astype(jnp.float32), keep, tuple(range(len(keep))))
  rest = tuple(range(len(keep), g.ndim))

  def total(t):
    return jnp.sum(t, axis=rest)

  return {"dot": total(g * r), "sq_run": total(g * g), "sq_ref": total(r * r)}


def fidelity(dot: float, sq_run: float, sq_ref: float) -> tuple[float, float]:
  """``(cos, norm_ratio)`` of pooled sums (module doc)."""
  cos = dot / math.sqrt(sq_run * sq_ref) if sq_run > 0 and sq_ref > 0 else 0.0
  if sq_ref > 0:
    ratio = math.sqrt(sq_run / sq_ref)
  else:
    ratio = 1.0 if sq_run == 0 else math.inf
  return cos, ratio


def load_imbalance(counts) -> float:
  """``max(c) / mean(c)`` of tokens per expert (1.0 when no token was routed)."""
  c = np.asarray(counts, dtype=np.float64).ravel()
  mean = float(c.mean()) if c.size else 0.0
  return float(c.max()) / mean if mean > 0 else 1.0


# ---------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class UnitMeta:
  """Static description of one reported parameter (sent with its sums)."""

  # the parameter's path, joined by "/" (a unit is (name, index over ``axes``))
  name: str
  # attention | mlp | experts | other (ParamRole.kind)
  kind: str
  # per kept axis (``unit_axes``): what its index means, "layer" or "expert"
  axes: tuple[str, ...] = ()
  # the layer index of an unscanned decoder parameter
  layer: int | None = None


def _add(acc: dict, key, sums: tuple[float, float, float]) -> None:
  a = acc.setdefault(key, [0.0, 0.0, 0.0])
  for i in range(3):
    a[i] += sums[i]


class Store:
  """Thread-safe ``step -> reports`` store of the fidelity and telemetry callbacks, read by the metrics writer.

  ``group_of(kind, layer)`` names a unit's group (the integration passes the quantization statistics' rule:
  ``<kind>_first`` / ``<kind>`` / ``<kind>_last``); ``other`` units are in ``other``.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._grads: dict[int, list] = {}
    self._rms: dict[int, list[float]] = {}
    self._load: dict[int, dict[int, float]] = {}
    self.group_of = lambda kind, layer: kind

  def report_grads(self, step, sums: Sequence[Mapping[str, object]], *, metas: Sequence[UnitMeta]) -> None:
    """One report per parameter: ``sums[i]`` (fields of :data:`GRAD_FIELDS`, arrays over ``metas[i].axes``)."""
    rows = [({f: np.asarray(s[f], dtype=np.float64) for f in GRAD_FIELDS}, m) for s, m in zip(sums, metas)]
    with self._lock:
      self._grads.setdefault(int(np.asarray(step)), []).extend(rows)

  def report_rms(self, step, sum_sq, count) -> None:
    """One RMSNorm input: ``sum(x**2)`` over ``count`` elements."""
    rms = math.sqrt(float(np.asarray(sum_sq)) / max(float(np.asarray(count)), 1.0))
    with self._lock:
      self._rms.setdefault(int(np.asarray(step)), []).append(rms)

  def report_load(self, step, counts, *, index: int) -> None:
    """Tokens per expert of the ``index``-th MoE layer of the forward pass."""
    value = load_imbalance(counts)
    with self._lock:
      d = self._load.setdefault(int(np.asarray(step)), {})
      d[index] = max(d.get(index, 0.0), value)

  def steps(self) -> list[int]:
    with self._lock:
      return sorted(set(self._grads) | set(self._rms) | set(self._load))

  def pop(self, step: int) -> dict[str, float]:
    """``{metric key: value}`` of ``step`` (empty if nothing was reported); earlier steps are dropped."""
    step = int(step)
    with self._lock:
      grads, rms, load = self._grads.pop(step, []), self._rms.pop(step, []), self._load.pop(step, {})
      for d in (self._grads, self._rms, self._load):
        for stale in [s for s in d if s < step]:
          del d[stale]
    out: dict[str, float] = {}
    if grads:
      out.update(self._fidelity_keys(grads))
    if rms:
      lo, hi = min(rms), max(rms)
      out.update({f"{PREFIX}residual/rms_min": lo, f"{PREFIX}residual/rms_max": hi,
                  f"{PREFIX}residual/rms_span": hi / lo if lo > 0 else math.inf})
    if load:
      out[f"{PREFIX}moe/load_max"] = max(load.values())
      out.update({f"{PREFIX}moe_{k}/load": v for k, v in sorted(load.items())})
    return out

  def _fidelity_keys(self, rows) -> dict[str, float]:
    model, groups, layers, experts, unit_cos = {}, {}, {}, {}, {}
    for sums, meta in rows:
      arrays = [sums[f] for f in GRAD_FIELDS]
      for idx in np.ndindex(*arrays[0].shape):
        s = tuple(float(a[idx]) for a in arrays)
        named = dict(zip(meta.axes, idx))
        layer = named.get("layer", meta.layer)
        expert = named.get("expert")
        group = "other" if meta.kind == "other" else self.group_of(meta.kind, layer)
        _add(model, "model", s)
        _add(groups, group, s)
        if meta.kind != "other" and layer is not None:
          _add(layers, layer, s)
        if expert is not None:
          _add(experts, expert, s)
        # one unit: the same parameter slice reported twice (remat) is pooled before its cosine is taken
        _add(unit_cos, (group, meta.name, idx), s)
    out = {}
    for prefix, acc in (("model", model), *((g, {g: v}) for g, v in groups.items())):
      cos, ratio = fidelity(*acc[prefix])
      out[f"{PREFIX}{prefix}/dw_cos"] = cos
      out[f"{PREFIX}{prefix}/dw_norm_ratio"] = ratio
    for group in groups:
      out[f"{PREFIX}{group}/dw_cos_min"] = min(fidelity(*v)[0] for k, v in unit_cos.items() if k[0] == group)
    for layer, v in sorted(layers.items()):
      out[f"{PREFIX}layer_{layer}/dw_cos"] = fidelity(*v)[0]
    for e, v in sorted(experts.items()):
      cos, ratio = fidelity(*v)
      out[f"{PREFIX}expert_{e}/dw_cos"] = cos
      out[f"{PREFIX}expert_{e}/dw_norm_ratio"] = ratio
    return out

  def clear(self) -> None:
    with self._lock:
      self._grads.clear()
      self._rms.clear()
      self._load.clear()


# The process-wide store the plugin's callbacks report into and its metrics writer reads.
STORE = Store()
