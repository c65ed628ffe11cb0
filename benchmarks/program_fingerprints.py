"""Fingerprints of the quantizer's programs, to show that a refactor leaves every compiled program as it was.

For each program (``quantizer_hlo.CASES``, recipe variants, vmapped calls, dequantization, the RHT, and the
GEMM passes, the experts and the MLP of ``benchmarks/gpu/deviceless.py`` at small shapes) three texts:

    jaxpr   ``jax.make_jaxpr`` (the kernels' bodies included: a pallas_call prints its kernel's jaxpr)
    cpu     XLA:CPU's optimized HLO
    h200    XLA:GPU's optimized HLO, compiled deviceless for the H200 spec (needs jax-cuda12-plugin)

each with what is not the program taken out: metadata (source files and lines, function names), the debug
tables, the pre-scheduling fingerprint, the serialized Triton IR (its debug locations name source files; the
kernel's operations are in the jaxpr), and the names of the kernels' jitted wrappers. Two checkouts give the
same programs when every fingerprint matches::

    python benchmarks/program_fingerprints.py /tmp/before            # in the old checkout
    python benchmarks/program_fingerprints.py /tmp/after --compare /tmp/before

Compile-derived: no device runs anything. Exit status 1 when ``--compare`` finds a difference.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "gpu"))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.dirname(_HERE))

import jax  # noqa: E402  pylint: disable=wrong-import-position
import jax.numpy as jnp  # noqa: E402  pylint: disable=wrong-import-position

import quantizer_hlo as qh  # noqa: E402  pylint: disable=wrong-import-position
from maxtext_nvfp4.core import nvfp4 as nv  # noqa: E402  pylint: disable=wrong-import-position

_KERNEL_CALLS = r"(values_call|codes_call|tiles_call|rht_amax_call)"


def clean(text: str) -> str:
  """``text`` without what is not the program (the module docstring's list)."""
  text = re.sub(r"\nFileNames\n.*?\n(?=ENTRY|%)", "\n", text, flags=re.S)
  text = re.sub(r", frontend_attributes=\{fingerprint_before_lhs=\"[0-9a-f]*\"\}", "", text)
  text = re.sub(r"\b_" + _KERNEL_CALLS, r"\1", text)
  text = re.sub(r"jit__" + _KERNEL_CALLS, r"jit_\1", text)
  text = re.sub(r", metadata=\{[^}]*\}", "", text)
  text = re.sub(r'(custom_call_target="__gpu\$xla\.gpu\.triton".*?)backend_config=.*$', r"\1<triton ir>", text,
                flags=re.M)
  text = re.sub(r'"?/[^"\s]*\.py"?(:\d+)?', "<path>", text)
  return text


def _quantizer_programs():
  x = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16)
  key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
  extra = {
      "r4o6": lambda x, k: nv.quantize(x, scale_rule=nv.ScaleRule(selection="4over6")),
      "v_rows": lambda x, k: nv.quantize_values(x, scale_rule=nv.ScaleRule(row_scaled=True)),
      "v_vmap": lambda x, k: jax.vmap(lambda a: nv.quantize_values(a, stochastic_key=k))(x.reshape(4, 64, 512)),
      "q_vmap_rht": lambda x, k: jax.vmap(lambda a: nv.quantize(a, axis=0, rht=True))(x.reshape(4, 64, 512)),
      "v_vmap2": lambda x, k: jax.vmap(jax.vmap(nv.quantize_values))(x.reshape(2, 2, 64, 512)),
      "deq": lambda x, k: nv.dequantize(nv.quantize(x)),
      "deqk": lambda x, k: nv.dequantize_kernel_order(nv.quantize(x, block_2d=True)),
      "rht": lambda x, k: nv.rht(x, axis=0),
  }
  return {name: (fn, (x, key)) for name, fn in {**{c: f for c, (_, f) in qh.CASES.items()}, **extra}.items()}


def _deviceless_programs():
  import deviceless  # pylint: disable=import-outside-toplevel

  shapes = {"gemm_fprop": dict(m=256, k=512, n=384), "gemm_dgrad": dict(m=256, k=512, n=384),
            "gemm_wgrad": dict(m=256, k=512, n=384), "experts_nvfp4": dict(e=4, c=128, d=256, f=256),
            "mlp_nvfp4": dict(t=256, d=256, f=512)}
  out = {}
  for name, shape in shapes.items():
    fn, args, _ = deviceless.PROGRAMS[name][1](**shape)
    out[name] = (fn, args)
  return out


def fingerprints(parts) -> dict[str, str]:
  """{part_program: cleaned text}."""
  quantizer = _quantizer_programs()
  out = {}
  if "jaxpr" in parts or "h200" in parts:
    gemms = _deviceless_programs()
  if "jaxpr" in parts:
    for name, (fn, args) in {**quantizer, **gemms}.items():
      out[f"jaxpr_{name}"] = clean(str(jax.make_jaxpr(fn)(*args)))
  if "cpu" in parts:
    for name, (fn, args) in quantizer.items():
      out[f"cpu_{name}"] = clean(jax.jit(fn).lower(*args).compile().as_text())
  if "h200" in parts:
    import deviceless  # pylint: disable=import-outside-toplevel

    for name, (fn, args) in {**quantizer, **gemms}.items():
      out[f"h200_{name}"] = clean(deviceless.compile_for(fn, args).as_text())
  return out


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("out", help="folder for the cleaned texts (one file per program)")
  p.add_argument("--parts", default="jaxpr,cpu,h200", help="comma list of jaxpr, cpu, h200")
  p.add_argument("--compare", help="a folder an earlier run wrote: exit 1 when any program differs")
  args = p.parse_args(argv)
  parts = set(args.parts.split(","))
  if parts - {"jaxpr", "cpu", "h200"}:
    p.error(f"--parts: choose from jaxpr, cpu, h200 (got {args.parts!r})")
  os.makedirs(args.out, exist_ok=True)
  differ = 0
  print("| program | sha1 | " + ("same as --compare |" if args.compare else "|"))
  for name, text in fingerprints(parts).items():
    with open(os.path.join(args.out, name + ".txt"), "w") as fh:
      fh.write(text)
    row = f"| {name} | {hashlib.sha1(text.encode()).hexdigest()[:12]} |"
    if args.compare:
      path = os.path.join(args.compare, name + ".txt")
      same = os.path.exists(path) and open(path).read() == text  # pylint: disable=consider-using-with
      differ += not same
      row += f" {'yes' if same else 'NO'} |"
    print(row, flush=True)
  if args.compare:
    print(f"{differ} program(s) differ" if differ else "every program is the same")
  return 1 if differ else 0


if __name__ == "__main__":
  sys.exit(main())
