"""The NVFP4 GEMM's implementations, and the one place that picks one for a call::

    out = cast( (block_values(a) · block_values(b), fp32 accumulation) * alpha )        (core/gemm.py)

    reference  ``gemm._scaled_dot`` of the block values, XLA's dot: every shape, layout, platform (the default)
    triton     ``triton_dot.py``: a Pallas (Triton) GEMM that reads one operand as packed E2M1 codes and E4M3
               block scales and dequantizes it in registers (no bf16 copy of it is written), the other as bf16
    dispatch   ``dispatch.py``: ``implementation=`` / ``MAXTEXT_NVFP4_GEMM_IMPL`` (xla | triton | auto; which one:
               ``requested``), what the kernel takes, whether a single-use operand is quantized to codes for it
               (``reads_codes``), the log line when an automatic call leaves it
"""

from maxtext_nvfp4.core.gemm_kernels.dispatch import (IMPLEMENTATION_ENV, IMPLEMENTATIONS, reads_codes, requested,
                                                      scaled_dot)

__all__ = ["IMPLEMENTATION_ENV", "IMPLEMENTATIONS", "reads_codes", "requested", "scaled_dot"]
