"""Diagnostic for the peer comparison: NVFP4 round-trip error vs tensor magnitude, per quantizer.

  python benchmarks/accuracy/quant_error.py [--markdown]

For ``x = mag * N(0, 1)`` of shape (256, 512) (bf16, one fixed key) and mag = 1 ... 1e-7 it prints the
relative error ``||deq(q(x)) - x||_2 / ||x||_2`` and the fraction of 16-element blocks that flush to all
zeros, for each 1x16-block NVFP4 quantizer of the study, each through its own library code:

* ours: ``maxtext_nvfp4.core.nvfp4.quantize`` (1x16 E4M3 block scale + FP32 per-tensor scale
  ``amax / (6 * 448)``; round-to-nearest here), ``dequantize``;
* qwix: ``qwix qarray.quantize_api(x, "nvfp4", tiled_axes={1: 16})`` -- block scale ``e4m3(absmax / 6)``
  with no per-tensor scale (what the qwix peer applies to weights, activations and gradients);
* jax.nn: the quantizer ``jax.nn.scaled_dot_general`` runs (``jax._src.cudnn.scaled_matmul_stablehlo.quantize``
  with ``get_scaled_dot_general_config("nvfp4", g)``), g = 1 (the study's static global scale).

Why it matters: MaxText's loss is a mean over the batch's tokens, so the output gradients the backward
GEMMs quantize are small (per element roughly 1e-3 at the logits and below 1e-4 inside the decoder in this
proxy): a quantizer without a per-tensor scale flushes such tensors block by block to zero.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

MAGS = (1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6, 1e-7)


def _ours(x):
  from maxtext_nvfp4.core import nvfp4 as numerics  # pylint: disable=import-outside-toplevel

  return numerics.dequantize(numerics.quantize(x, axis=-1), jnp.float32)


def _qwix(x):
  from qwix._src.core import qarray  # pylint: disable=import-outside-toplevel

  q = qarray.quantize_api(x, "nvfp4", tiled_axes={1: 16}, scale_dtype=jnp.float32)
  return qarray.dequantize(q).astype(jnp.float32)


def _jaxnn(x, g=1.0):
  from jax._src.cudnn import scaled_matmul_stablehlo as sms  # pylint: disable=import-outside-toplevel

  cfg = jax.nn.get_scaled_dot_general_config("nvfp4", np.full((1,), g, np.float32))
  q, s = sms.quantize(x[None], cfg)  # (1, M, K) -> values (1, M, K), scales (1, M, K/16)
  deq = q.astype(jnp.float32).reshape(1, x.shape[0], -1, 16) * s.astype(jnp.float32)[..., None]
  return (deq.reshape(x.shape) * g).astype(jnp.float32)


QUANTIZERS = {"ours": _ours, "qwix": _qwix, "jax.nn (g=1)": _jaxnn}


def measure(mags=MAGS) -> dict[str, list[tuple[float, float, float]]]:
  """``{quantizer: [(mag, relative error, fraction of all-zero blocks), ...]}``."""
  base = jax.random.normal(jax.random.PRNGKey(0), (256, 512), jnp.float32)
  out = {}
  for name, fn in QUANTIZERS.items():
    rows = []
    for m in mags:
      x = (base * m).astype(jnp.bfloat16)
      xf = x.astype(jnp.float32)
      d = jax.jit(fn)(x)
      rel = float(jnp.linalg.norm(d - xf) / jnp.linalg.norm(xf))
      zero_blocks = float(jnp.mean(jnp.all(d.reshape(256, -1, 16) == 0, axis=-1)))
      rows.append((m, rel, zero_blocks))
    out[name] = rows
  return out


def markdown(res) -> str:
  names = list(res)
  lines = ["| magnitude | " + " | ".join(f"{n}: rel. err / zero blocks" for n in names) + " |",
           "|---|" + "---|" * len(names)]
  for i, m in enumerate(res[names[0]]):
    lines.append(f"| {m[0]:.0e} | " + " | ".join(f"{res[n][i][1]:.3f} / {100 * res[n][i][2]:.0f} %"
                                                  for n in names) + " |")
  return "\n".join(lines)


if __name__ == "__main__":
  r = measure()
  print(markdown(r))
  sys.exit(0)
