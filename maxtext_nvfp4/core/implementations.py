"""The NVFP4 implementations ``nvfp4_backend`` chooses between, as one table: :data:`IMPLEMENTATIONS`.

``nvfp4_backend`` = ``emulate`` | ``te`` insists on that implementation; ``auto`` takes the one that runs here
(``backends/capability.py`` holds the rule). What differs between them is a field of :class:`Implementation`,
so the code that refuses, announces or builds asks the table (``impl.expert_gemms``), never the name.

Pure Python (no JAX, no MaxText, no TE): the settings check reads it, and so do the backend choice, the
start-up checks, the quantization factory and the tools.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)  # one object each: compared (and hashed) by identity
class Implementation:
  """One NVFP4 implementation: what it computes with, needs, refuses and reports."""

  # the nvfp4_backend value that insists on it
  name: str
  # what it computes with (the start-up line of an explicit request)
  description: str
  # None: runs on any JAX device; else the least CUDA compute capability of every device (TE JAX's NVFP4 needs
  # Blackwell, ``_check_fp4_support``) and Transformer Engine JAX importing
  min_compute_capability: float | None = None
  # runs the routed experts' GEMMs; without it nvfp4_backend=<name> refuses NVFP4 experts and nvfp4_backend=auto
  # runs them emulated beside it
  expert_gemms: bool = True
  # stops at start-up on a decoder GEMM shape or recipe option TE's kernels refuse (core/te_limits.py,
  # backends/te.py); without it those GEMMs are zero-padded and a start-up line says so
  stops_at_te_limits: bool = False
  # nvfp4_diagnostics' per-GEMM quantization statistics
  gemm_diagnostics: bool = True
  # nvfp4_diagnostics_grad: its GEMMs can run MaxText's plain path in the high-precision reference pass
  grad_diagnostics: bool = True
  # nvfp4_fp4_weight_gather applies: its FSDP weight gather can be switched between FP4 and bf16 (TE gathers
  # the kernel it quantized and has no bf16 gather: ``off`` is refused where the backend insists on it)
  fp4_weight_gather_key: bool = True
  # nvfp4_qat mode -> what it cannot compute there (the modes it refuses, decided from the keys alone)
  qat_refusals: Mapping[str, str] = dataclasses.field(default_factory=dict)


EMULATE = Implementation(name="emulate", description="exact pure-JAX NVFP4 emulation")
TE = Implementation(
    name="te", description="Transformer Engine NVFP4 kernels on Blackwell", min_compute_capability=10.0,
    expert_gemms=False,  # TE JAX has no NVFP4 grouped GEMM
    stops_at_te_limits=True, gemm_diagnostics=False, fp4_weight_gather_key=False,
    grad_diagnostics=False,  # its reference pass would still run TE's GEMMs
    qat_refusals={
        "serving": ("the export's W4A4 forward (1x16 weight blocks, per-token activation scales); TE's kernels compute"
                    " the training recipe's"),
        "forward": ("a high-precision backward (TE PyTorch's backward_override=high_precision), which TE JAX does not"
                    " implement"),
    })
# nvfp4_backend value -> implementation, in the order the choices are listed
IMPLEMENTATIONS: dict[str, Implementation] = {i.name: i for i in (EMULATE, TE)}
# the nvfp4_backend value that takes whichever implementation runs here
AUTO = "auto"


def insisted(backend: str) -> Implementation | None:
  """The implementation ``nvfp4_backend=backend`` insists on; None for ``auto`` (and an unknown value: the
  settings check refuses it)."""
  return IMPLEMENTATIONS.get(str(getattr(backend, "value", backend)))
