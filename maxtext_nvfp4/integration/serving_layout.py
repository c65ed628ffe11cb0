"""``nvfp4_qat=serving`` in MaxText: which export tensor each projection is, and its fp32 master weights.

The serving-matched linear (:mod:`maxtext_nvfp4.core.serving_gemm`) quantizes what the export quantizes: the
fp32 checkpoint weights (MaxText hands a DenseGeneral's GEMM its kernel cast to the compute dtype), with one
global scale per fused group (vLLM's qkv_proj and gate_up_proj) and the export's factor on the query. So:

* :func:`patch_attention` / :func:`patch_mlp` wrap ``Attention.__call__`` and ``MlpBlock.__call__``: while a
  layer quantized with ``nvfp4_qat=serving`` runs, its projections' kernels as stored (``kernel[...]``, the
  weight dtype; traced inside the train step) are published by role (:func:`masters`). Other quantization
  modes are not touched (one attribute check per call).
* :func:`members` maps a role to its fused group and export factor for the config's decoder block: the group
  ``(query, key, value)`` and ``(wi_0, wi_1)``, the query's factor ``fl32(sqrt(head_dim))`` where the block's
  MaxText conversion scales it (the adapter's ``hf_conversions``: ``scale_query_layer`` kept), else 1.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any

from maxtext_nvfp4.integration import touchpoints
from maxtext_nvfp4.integration import traced

# the roles the serving forward covers, and the fused groups the export (and vLLM) give one global scale
ROLES = ("query", "key", "value", "out", "wi_0", "wi_1", "wo")
GROUPS = (("query", "key", "value"), ("out",), ("wi_0", "wi_1"), ("wo",))
_ATTENTION_CHILDREN = ("query", "key", "value", "out")
_MLP_CHILDREN = ("wi_0", "wi_1", "wo")

# (layer, role, whether its fused group's stored kernels were published) of each serving-mode GEMM traced inside
# a train/eval step (trace time only; tests read it)
SERVED = traced.TraceCounter()
# role -> the kernel as stored, published while a serving-mode Attention / MlpBlock runs
_MASTERS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("maxtext_nvfp4_serving_masters", default=None)


def masters() -> dict[str, Any] | None:
  """The kernels (by role) of the Attention / MlpBlock being traced in serving mode, or None."""
  return _MASTERS.get()


def is_serving(quant) -> bool:
  s = getattr(quant, "settings", None)
  return getattr(s, "qat", None) == "serving"


def _kernel(module, name):
  child = getattr(module, name, None)
  var = getattr(child, "kernel", None)
  if var is None:
    return None
  return var.get_value() if hasattr(var, "get_value") else var[...]


@contextlib.contextmanager
def _published(module, names):
  found = {n: k for n in names for k in [_kernel(module, n)] if k is not None}
  token = _MASTERS.set({**(_MASTERS.get() or {}), **found})
  try:
    yield
  finally:
    _MASTERS.reset(token)


def _wrap_call(cls, names) -> None:
  def make(orig):
    def __call__(self, *args, **kwargs):
      if not is_serving(getattr(self, "quant", None)):
        return orig(self, *args, **kwargs)
      with _published(self, names):
        return orig(self, *args, **kwargs)
    return __call__

  cls.__call__ = touchpoints.wrap_once(cls.__call__, make)


def patch_attention(module) -> None:
  _wrap_call(module.Attention, _ATTENTION_CHILDREN)


def patch_mlp(module) -> None:
  _wrap_call(module.MlpBlock, _MLP_CHILDREN)


def query_factor(config) -> float:
  """The export's factor on the query kernel of ``config``'s decoder block (module docstring)."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  block = str(getattr(getattr(config, "decoder_block", ""), "value", getattr(config, "decoder_block", "")))
  conv = touchpoints.adapter().hf_conversions.get(block)
  if conv is None or "scale_query_layer" not in conv.hooks or "scale_query_layer" in conv.dropped:
    return 1.0
  return float(np.float32(math.sqrt(int(config.head_dim))))


def members(config) -> dict[str, tuple[tuple[str, ...], Any]]:
  """role -> (its fused group's roles, :class:`serving_gemm.Member`) for ``config``."""
  from maxtext_nvfp4.core import serving_gemm  # pylint: disable=import-outside-toplevel  (JAX)

  c = query_factor(config)
  out = {}
  for group in GROUPS:
    factors = tuple(c if r == "query" else 1.0 for r in group)
    for i, role in enumerate(group):
      out[role] = (group, serving_gemm.Member(index=i, factors=factors))
  return out


def unsupported_roles(settings, layout) -> list[str]:
  """The projection roles of ``layout`` planned in NVFP4 that the serving forward does not cover (MLA's, fused
  q/k/v or MLP, MoE experts): the export serves them otherwise, or not at all."""
  from maxtext_nvfp4.core import plan as plan_lib  # pylint: disable=import-outside-toplevel

  out = set()
  for layer in layout.layers():
    for role in layout.roles(layer):
      before, _ = plan_lib.precisions(settings, layer=layer, role=role, num_layers=layout.num_layers)
      if before.fprop == "nvfp4" and role not in ROLES:
        out.add(role)
  return sorted(out)


def refusal(settings, layout) -> str | None:
  """One line when ``nvfp4_qat=serving`` plans NVFP4 on a projection it does not cover, else None."""
  if settings.qat != "serving":
    return None
  bad = unsupported_roles(settings, layout)
  if not bad:
    return None
  return (f"nvfp4_qat=serving covers the attention query/key/value/out and MLP wi_0/wi_1/wo projections that the"
          f" export serves as q/k/v/o_proj and gate/up/down_proj; this model plans NVFP4 on {', '.join(bad)} too: set"
          " nvfp4_targets to leave them out, or use nvfp4_qat=forward")
