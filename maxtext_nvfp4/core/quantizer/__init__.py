"""TE's NVFP4 quantizer laid out as an op: the formulas, each implementation, and one dispatch.

    formulas.py        the reference formulas: the scale rule (``ScaleRule``), the per-tensor chain, block
                       scales, E4M3 and E2M1 encoding, exact fp32 arithmetic
    random_bits.py     stochastic rounding's random bytes (a keyed counter hash)
    hadamard.py        TE's 16-point random Hadamard transform (RHT)
    tensor.py          ``NVFP4Tensor``, TE's byte layout (pack / unpack), dequantization, GEMM-side views
    xla.py             implementation "xla": the formulas as XLA ops, every rule, shape and platform
    triton_kernels.py  the Pallas (Triton) kernel bodies and their ``pallas_call``\\ s
    pallas_triton.py   implementation "triton": which calls the kernels take, sharding, batching
    api.py             the public entry points and the one dispatch between the implementations

Both implementations compute with the same helpers of ``formulas``, ``random_bits`` and ``hadamard``, so the
same operations give the same bits; ``tests/core/test_quantizer_implementations.py`` runs every implementation
against TE's golden vectors and an independent numpy reference. The public API is :mod:`api`, re-exported
by :mod:`maxtext_nvfp4.core.nvfp4`; the other modules are private to the package.
"""
