"""Transformer Engine JAX traced and compiled for a GPU that this host does not have.

TE asks the CUDA driver about the device while it traces, not only when it runs: the compute capability
(``transformer_engine_jax.get_device_compute_capability``, read by ``quantize/device_utils.py`` -- which picks
FP8/FP4 layouts and checks NVFP4 support -- and by ``cpp_extensions/misc.py``, once per local device), and, for
fused attention, cuDNN's backend and workspace sizes. On a host without that GPU (a CPU machine compiling for
compile-only B200 devices, :mod:`maxtext_nvfp4.backends.targets`) the driver has no answer, so
:func:`answer_device_queries` answers for the target:

* compute capability: the target's, from its XLA spec (B200 / GB200: 10.0 -> TE's integer 100);
* fused attention (only with ``answer_fused_attention=True``): cuDNN's arbitrary-sequence-length F16 backend
  (``NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen``, the one TE picks for bf16 causal attention on
  Blackwell), and a workspace of :data:`FUSED_ATTN_WORKSPACE_BYTES` per call -- cuDNN's real figure depends on
  the engine it would choose on the device, which no host without it can know.

Nothing runs on a device: the answers shape what TE traces and what XLA compiles, so the compiled program's
custom calls, shapes and memory are TE's, and no number TE would compute is.
"""

from __future__ import annotations

import sys
from typing import Any

# The workspace answered for each fused-attention call (bytes). A stated assumption, not cuDNN's answer.
FUSED_ATTN_WORKSPACE_BYTES = 0
_ORIGINALS: dict[tuple[Any, str], Any] = {}


def _patch(owner: Any, name: str, value: Any) -> None:
  """Replace ``owner.name`` and every TE module's own binding of the same function (``from transformer_engine_jax
  import get_device_compute_capability`` copies the name into ``cpp_extensions/gemm.py``)."""
  original = _ORIGINALS.get((owner, name), getattr(owner, name))
  for module in [owner] + [m for n, m in list(sys.modules.items()) if n.startswith("transformer_engine.")]:
    if module is owner or getattr(module, name, None) is original:
      _ORIGINALS.setdefault((module, name), original)
      setattr(module, name, value)


def _clear_caches() -> None:
  """TE caches its device answers (``functools.lru_cache``); clear them so the new answer is read."""
  for module_name in ("transformer_engine.jax.quantize.device_utils", "transformer_engine.jax.cpp_extensions.misc"):
    module = sys.modules.get(module_name)
    for value in vars(module).values() if module is not None else ():
      if callable(getattr(value, "cache_clear", None)):
        value.cache_clear()


def answer_device_queries(compute_capability: float, *, answer_fused_attention: bool = False) -> None:
  """Answer TE's trace-time device queries as a GPU of ``compute_capability`` would (see the module docstring).

  Imports TE JAX (which must load: on a host without a GPU driver its libraries need a stand-in
  ``libcuda.so.1``, tests/te/libcuda_standin.sh). Idempotent; :func:`restore` undoes it.
  """
  import transformer_engine.jax  # pylint: disable=import-outside-toplevel,unused-import # pytype: disable=import-error
  import transformer_engine_jax  # pylint: disable=import-outside-toplevel # pytype: disable=import-error

  cc = int(round(compute_capability * 10))
  _patch(transformer_engine_jax, "get_device_compute_capability", lambda gpu_id=0: cc)
  if answer_fused_attention:
    backend = transformer_engine_jax.NVTE_Fused_Attn_Backend.NVTE_F16_arbitrary_seqlen
    _patch(transformer_engine_jax, "get_fused_attn_backend", lambda *args, **kwargs: (backend, ""))
    workspace = _workspace_answer(transformer_engine_jax)
    _patch(transformer_engine_jax, "get_fused_attn_fwd_workspace_sizes", workspace)
    _patch(transformer_engine_jax, "get_fused_attn_bwd_workspace_sizes", workspace)
  _clear_caches()


def _workspace_answer(tej):
  """A workspace-size query's answer: ``(shape, TE dtype)`` of :data:`FUSED_ATTN_WORKSPACE_BYTES` bytes."""

  def answer(*args, **kwargs):
    del args, kwargs
    return ((FUSED_ATTN_WORKSPACE_BYTES,), tej.DType.kByte)

  return answer


def restore() -> None:
  """Undo :func:`answer_device_queries` (the driver's own answers again)."""
  for (owner, name), value in _ORIGINALS.items():
    setattr(owner, name, value)
  _ORIGINALS.clear()
  _clear_caches()
