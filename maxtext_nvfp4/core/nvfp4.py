"""NVFP4 quantization in pure JAX, bit-identical to Transformer Engine's quantizer: the public API.

    t = quantize(x, axis=-1 | block_2d=True, rht=..., stochastic_key=..., scale_rule=..., implementation=...)
    v, amax = quantize_values(x, ...)          # block_values(t), t.amax in one pass (a GEMM operand)
    a = amaxes(x)                              # max|x| and max|RHT(x)| in one pass, for quantize(..., amaxes=a)
    dequantize(t), dequantize_kernel_order(t), block_values(t), global_decode_scale(t), pack, unpack, rht

The op lives in :mod:`maxtext_nvfp4.core.quantizer`: the formulas (``formulas.py``: what is computed, formula
first), the RHT, each implementation ("xla", "triton") and ``api.py``'s dispatch between them. This module
re-exports ``api``'s public names, so ``from maxtext_nvfp4.core import nvfp4`` stays the one import.
"""

from maxtext_nvfp4.core.quantizer.api import (  # noqa: F401  (the public API)
    BLOCK,
    E2M1_MAX,
    E4M3_MAX,
    IMPLEMENTATION_ENV,
    IMPLEMENTATIONS,
    RECIP_GLOBAL_DENOMINATOR,
    RHT_SIGNS,
    STANDARD_RULE,
    Amaxes,
    ImplementationUnavailableError,
    NVFP4Tensor,
    ScaleRule,
    __all__,
    amaxes,
    as_numpy,
    block_values,
    dequantize,
    dequantize_kernel_order,
    global_decode_scale,
    global_denominator,
    pack,
    quantize,
    quantize_values,
    rht,
    rht_matrix,
    unpack,
)
