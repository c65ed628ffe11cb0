"""Does XLA:GPU fuse a weight dequantize into its GEMM as a prologue? (issue 51 item 1)

    JAX_PLATFORMS=cpu .venv-targets/bin/python benchmarks/gpu/gemm_prologue.py [--target h200] [--shape M K N]

``y = x @ dequantize(W)``, x bf16 [M, K], for each way of writing the dequantize that XLA could take into its Triton
GEMM fusion:

  s8_convert             W as int8 converted to bf16 (the control: int8 weight-only GEMMs are XLA's own case)
  s8_convert_tile_scale  NVFP4's W as int8 (2 x the E2M1 value: an integer in [-12, 12]) times its tile scales x the
                         global scale / 2, in bf16
  f8_convert_scale       W as f8e4m3fn times an fp32 scale (the FP8 form, which XLA's GEMM fusion is known for)
  f4_convert             W as XLA's own f4e2m1fn type, converted to bf16 (no scales)
  f4_convert_tile_scale  f4e2m1fn W times E4M3 16x16 tile scales times an fp32 global scale (NVFP4's 2D weight)
  u8_unpack_table        NVFP4 as stored: two E2M1 codes per byte, unpacked with shifts and a 16-entry table,
                         times the tile and global scales

Per form: the kernels of the compiled program's entry computation, whether the GEMM fusion reads W's stored
operand (a prologue: no bf16 W is written) or a bf16 W another kernel wrote, and XLA's temp memory (a bf16 W
written before the GEMM shows up there as K*N*2 bytes). Compile-derived (``deviceless.HEADLINE``): no
autotuning, so a real run could pick cuBLAS for the GEMM, which takes no prologue either.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import deviceless  # noqa: E402  pylint: disable=wrong-import-position
import quantizer_hlo as qh  # noqa: E402  pylint: disable=wrong-import-position

_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FORMS = ("s8_convert", "s8_convert_tile_scale", "f8_convert_scale", "f4_convert", "f4_convert_tile_scale",
         "u8_unpack_table")


def form(name: str, m: int, k: int, n: int):
  """(function, argument shapes) of one way to write x @ dequantize(W)."""
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
  tiles = jax.ShapeDtypeStruct((k // 16, n // 16), jnp.float8_e4m3fn)
  g = jax.ShapeDtypeStruct((), jnp.float32)

  def scaled(w, scales, gs):  # w: f32 [k, n] times its 16x16 tile's scale and the global scale, in bf16
    w = w.reshape(k // 16, 16, n // 16, 16) * scales.astype(jnp.float32)[:, None, :, None]
    return (w.reshape(k, n) * gs).astype(jnp.bfloat16)

  if name == "s8_convert":
    return (lambda x, w: x @ w.astype(jnp.bfloat16)), (x, jax.ShapeDtypeStruct((k, n), jnp.int8))
  if name == "s8_convert_tile_scale":  # E2M1 values x 2 are the integers 0..12: NVFP4's W as int8 times its scales / 2
    def f(x, w, s, gs):
      scales = (s.astype(jnp.float32) * (gs * 0.5)).astype(jnp.bfloat16)
      w = w.astype(jnp.bfloat16).reshape(k // 16, 16, n // 16, 16) * scales[:, None, :, None]
      return x @ w.reshape(k, n)
    return f, (x, jax.ShapeDtypeStruct((k, n), jnp.int8), tiles, g)
  if name == "f8_convert_scale":
    return (lambda x, w, s: x @ (w.astype(jnp.bfloat16) * s.astype(jnp.bfloat16))), (
        x, jax.ShapeDtypeStruct((k, n), jnp.float8_e4m3fn), g)
  if name == "f4_convert":
    return (lambda x, w: x @ w.astype(jnp.bfloat16)), (x, jax.ShapeDtypeStruct((k, n), jnp.float4_e2m1fn))
  if name == "f4_convert_tile_scale":
    return (lambda x, w, s, gs: x @ scaled(w.astype(jnp.float32), s, gs)), (
        x, jax.ShapeDtypeStruct((k, n), jnp.float4_e2m1fn), tiles, g)
  if name == "u8_unpack_table":
    def f(x, packed, s, gs):
      codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(k, n)
      return x @ scaled(jnp.asarray(_E2M1, jnp.float32)[codes], s, gs)
    return f, (x, jax.ShapeDtypeStruct((k, n // 2), jnp.uint8), tiles, g)
  raise ValueError(f"unknown form {name!r}; choose from {FORMS}")


def inspect(name: str, target: str, m: int, k: int, n: int) -> dict:
  """Compile one form for ``target`` and read its entry computation's kernels."""
  fn, args = form(name, m, k, n)
  dev = deviceless.devices(target)[0]
  with jax.default_device(dev):
    compiled = jax.jit(fn).trace(*args).lower().compile()
  comps, entry = qh.parse_computations(compiled.as_text())
  ins = {i.name: i for i in comps[entry]}

  def source(name):  # through bitcasts and copies to the kernel (or parameter) that wrote the buffer
    while name in ins and ins[name].opcode in ("bitcast", "copy") and ins[name].operands:
      name = ins[name].operands[0]
    return name

  kernels = [n for n, i in ins.items() if i.opcode in ("fusion", "custom-call")]
  gemm = [n for n in kernels if "gemm" in n or "dot" in n or "cublas" in n]
  written_w = sorted({source(o) for g in gemm for o in ins[g].operands}
                     - {n for n, i in ins.items() if i.opcode == "parameter"})
  return dict(form=name, kernels=len(kernels), gemm=", ".join(gemm), w_written_by=", ".join(written_w) or "-",
              prologue=not written_w, temp_mib=round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 1))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--target", default="h200", help="a GPU target of benchmarks/compile_targets.py")
  p.add_argument("--shape", type=int, nargs=3, default=(8192, 4096, 14336), metavar=("M", "K", "N"))
  p.add_argument("--forms", default=",".join(FORMS), help=f"comma list from {FORMS}")
  a = p.parse_args(argv)
  m, k, n = a.shape
  print(f"{deviceless.HEADLINE}; target {a.target}; x bf16 [{m}, {k}] @ W [{k}, {n}] (bf16 W: {k * n * 2 / 2**20:.0f} MiB)")
  print("| form | kernels | GEMM kernel | bf16 W written by | dequantize in the GEMM | temp MiB |")
  print("|---|---:|---|---|---|---:|")
  for name in a.forms.split(","):
    r = inspect(name, a.target, m, k, n)
    print(f"| {r['form']} | {r['kernels']} | {r['gemm']} | {r['w_written_by']} | {'yes' if r['prologue'] else 'no'} |"
          f" {r['temp_mib']} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
