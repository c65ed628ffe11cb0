"""SwiGLU MLP benchmark: bf16 vs emulated NVFP4 (``gemm.dot_general``) vs ``jax.nn.scaled_dot_general``.

The MLP is MaxText's llama block MLP on flattened tokens::

    y = (silu(x · W0) * (x · W1)) · Wo        x (T, D), W0/W1 (D, F), Wo (F, D), all bf16

Variants (each GEMM of the MLP replaced by):
  bf16      ``lax.dot_general`` on bf16 operands (what MaxText runs without quantization)
  nvfp4     ``maxtext_nvfp4.core.gemm.dot_general`` with the full TE recipe (``GemmRecipe()``: 1x16 RNE x,
            16x16 W, SR dy, RHT16 wgrad), one SR key per GEMM
  fp8       ``gemm.dot_general`` with fprop/dgrad/wgrad = "fp8" (TE per-tensor current scaling, HYBRID)
  sdg       ``jax.nn.scaled_dot_general`` with JAX's nvfp4 config (1x16 RNE, no 2D/RHT/SR, one static
            global scale per operand = amax/2688 of the initial tensor; the gradient config uses dy's)
  nvfp4_nosr, nvfp4_norht, nvfp4_plain (no SR/RHT/2D), nvfp4_fprop_only (bf16 dgrad/wgrad):
            ablations of the recipe, for profiling (not run by default)

Modes: ``fwd`` (y only) and ``fwdbwd`` (y and the gradients of ``sum(y * g)`` w.r.t. x, W0, W1, Wo for
a fixed random cotangent g: one full training-step worth of GEMMs).

Order of work: (1) correctness -- every variant's y and gradients are finite and within a relative
Frobenius error of bf16's (NVFP4 tolerance), before anything is timed; (2) timing -- ``jax.jit``,
``--warmup`` untimed calls, then ``--iters`` rounds in which every (variant, mode) is called once in
turn, each call ended by ``block_until_ready`` (round robin: load changes on a shared machine hit all
variants alike); the median (and min / p90) is reported. Inputs are random normal (never zeros: low-entropy data runs faster on
GPUs). Memory: XLA's compiled ``memory_analysis()`` (arguments + outputs + temporaries, any backend),
the bytes saved for the backward (``jax.vjp`` residual leaves, via ``eval_shape``), and on GPU the
device's ``peak_bytes_in_use`` (process-wide peak: use ``--isolate`` to run each variant in its own
process so the peak belongs to that variant).

Examples::

  python benchmarks/mlp_bench.py --preset cpu                      # 1024 x 512 x 1792, 2-core CPU
  python benchmarks/mlp_bench.py --isolate --json out/mlp.json     # 8192 x 4096 x 14336 (H200 shape)
  python benchmarks/mlp_bench.py --preset cpu --dump-hlo /tmp/hlo  # HLO + fusion/reduce/dot counts

Exit status: 0 ok, 1 a correctness check failed (nothing timed for that variant).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Allow `python benchmarks/mlp_bench.py` from a checkout without installing the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxtext_nvfp4.core import gemm  # pylint: disable=wrong-import-position
from maxtext_nvfp4.core import prng  # pylint: disable=wrong-import-position

VARIANTS = ("bf16", "nvfp4", "fp8", "sdg")
# Ablations of the NVFP4 recipe (profiling: what each feature costs). Not run by default.
ABLATIONS = {
    "nvfp4_nosr": gemm.GemmRecipe(stochastic_rounding=False),
    "nvfp4_norht": gemm.GemmRecipe(rht=False),
    "nvfp4_plain": gemm.GemmRecipe(stochastic_rounding=False, rht=False, two_d_weights=False),
    "nvfp4_fprop_only": gemm.GemmRecipe(dgrad="bf16", wgrad="bf16"),
}
MODES = ("fwd", "fwdbwd")
PRESETS = {
    # tokens, d_model, d_ff
    "h200": (8192, 4096, 14336),
    "cpu": (1024, 512, 1792),
    "tiny": (256, 128, 512),
}
# Relative Frobenius error vs bf16 allowed per variant (y, grads). One NVFP4 GEMM is ~8-10% off; the
# MLP chains three and the SR gradients add noise. FP8 is ~3-5%.
TOLERANCE = {"bf16": (0.0, 0.0), "nvfp4": (0.35, 0.6), "fp8": (0.1, 0.2), "sdg": (0.35, 0.6),
             **{name: (0.35, 0.6) for name in ABLATIONS}}
DN = (((1,), (0,)), ((), ()))  # (T, K) x (K, N)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inputs:
  """The benchmark's operands (random normal, bf16)."""

  # activations (T, D)
  x: jax.Array
  # gate / up projections (D, F)
  w0: jax.Array
  w1: jax.Array
  # down projection (F, D)
  wo: jax.Array
  # cotangent of y (T, D) for the backward
  g: jax.Array
  # SR key (one per GEMM derived by fold_in)
  key: jax.Array


def make_inputs(t: int, d: int, f: int, seed: int = 0) -> Inputs:
  ks = jax.random.split(jax.random.key(seed), 6)
  bf = jnp.bfloat16
  # Weight scales as in a fan-in initialisation (std 1/sqrt(fan_in)) so activations stay O(1).
  return Inputs(
      x=jax.random.normal(ks[0], (t, d), bf),
      w0=(jax.random.normal(ks[1], (d, f), jnp.float32) / np.sqrt(d)).astype(bf),
      w1=(jax.random.normal(ks[2], (d, f), jnp.float32) / np.sqrt(d)).astype(bf),
      wo=(jax.random.normal(ks[3], (f, d), jnp.float32) / np.sqrt(f)).astype(bf),
      g=(jax.random.normal(ks[4], (t, d), jnp.float32) * 1e-3).astype(bf),
      key=ks[5],
  )


# ----------------------------------------------------------------------------------------------
# The MLP with a pluggable dot
# ----------------------------------------------------------------------------------------------
def _bf16_dot(a, b, i, key):
  del i, key
  return lax.dot_general(a, b, DN)


_FULL = gemm.GemmRecipe()
_FP8 = gemm.GemmRecipe(fprop="fp8", dgrad="fp8", wgrad="fp8")


# Each GEMM's SR key: fold_in(key, i), deferred as MaxText's plan.sr_key does (prng: the kernels apply it).
def _nvfp4_dot(a, b, i, key):
  return gemm.dot_general(a, b, DN, recipe=_FULL, key=prng.fold_in(key, i))


def _ablation_dot(name):
  recipe = ABLATIONS[name]
  return lambda a, b, i, key: gemm.dot_general(a, b, DN, recipe=recipe, key=prng.fold_in(key, i))


def _fp8_dot(a, b, i, key):
  del i
  return gemm.dot_general(a, b, DN, recipe=_FP8, key=key)


def _sdg_dot_factory(inp: Inputs):
  """scaled_dot_general with a static per-operand global scale amax/2688 (JAX's nvfp4 convention)."""
  cfg = lambda a: jax.nn.get_scaled_dot_general_config(
      "nvfp4", jnp.reshape(jnp.max(jnp.abs(a.astype(jnp.float32))) / 2688.0, (1,)).astype(jnp.float32)
  )
  # The operands of GEMM i: (x, w0), (x, w1), (h, wo). h's amax is estimated from a bf16 forward.
  h = jax.jit(lambda p: _mlp(p, _bf16_dot, None, want_h=True))((inp.x, inp.w0, inp.w1, inp.wo))
  lhs = [cfg(inp.x), cfg(inp.x), cfg(h)]
  rhs = [cfg(inp.w0), cfg(inp.w1), cfg(inp.wo)]
  grad = cfg(inp.g)

  def dot(a, b, i, key):
    del key
    return jax.nn.scaled_dot_general(a, b, DN, preferred_element_type=a.dtype, configs=[lhs[i], rhs[i], grad])

  return dot


def _mlp(params, dot, key, want_h=False):
  x, w0, w1, wo = params
  h = jax.nn.silu(dot(x, w0, 0, key)) * dot(x, w1, 1, key)
  if want_h:
    return h
  return dot(h, wo, 2, key)


def build(variant: str, mode: str, inp: Inputs):
  """(jitted fn, args) for one variant and mode; fn(*args) returns y (fwd) or (y, grads) (fwdbwd)."""
  if variant == "bf16":
    dot = _bf16_dot
  elif variant == "nvfp4":
    dot = _nvfp4_dot
  elif variant == "fp8":
    dot = _fp8_dot
  elif variant == "sdg":
    dot = _sdg_dot_factory(inp)
  elif variant in ABLATIONS:
    dot = _ablation_dot(variant)
  else:
    raise ValueError(f"unknown variant {variant!r}; choose from {VARIANTS}")
  params = (inp.x, inp.w0, inp.w1, inp.wo)
  if mode == "fwd":
    return jax.jit(lambda p, k: _mlp(p, dot, k)), (params, inp.key)

  def fwdbwd(p, g, k):
    y, vjp = jax.vjp(lambda q: _mlp(q, dot, k), p)
    return y, vjp(g)[0]

  return jax.jit(fwdbwd), (params, inp.g, inp.key)


def residual_bytes(variant: str, inp: Inputs) -> int:
  """Bytes the backward keeps from the forward: the leaves of ``jax.vjp``'s closure (shapes only)."""
  if variant in ABLATIONS:
    dot = _ablation_dot(variant)
  else:
    dot = {"bf16": _bf16_dot, "nvfp4": _nvfp4_dot, "fp8": _fp8_dot}.get(variant) or _sdg_dot_factory(inp)
  params = (inp.x, inp.w0, inp.w1, inp.wo)
  shapes = jax.eval_shape(lambda p, k: jax.vjp(lambda q: _mlp(q, dot, k), p)[1], params, inp.key)
  return int(sum(_nbytes(s) for s in jax.tree_util.tree_leaves(shapes)))


def _nbytes(s) -> int:
  if jax.dtypes.issubdtype(s.dtype, jax.dtypes.prng_key):
    return int(np.prod(s.shape)) * 8  # a threefry key is two uint32 words
  return int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize


# ----------------------------------------------------------------------------------------------
# Correctness, timing, memory
# ----------------------------------------------------------------------------------------------
def _rel(a, b) -> float:
  a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
  b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def check(variant: str, inp: Inputs, ref) -> dict:
  """Finite outputs and relative errors vs the bf16 reference ``ref`` = (y, grads)."""
  fn, args = build(variant, "fwdbwd", inp)
  y, grads = fn(*args)
  y_ref, g_ref = ref
  leaves, leaves_ref = jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(g_ref)
  finite = bool(jnp.isfinite(y.astype(jnp.float32)).all()) and all(
      bool(jnp.isfinite(l.astype(jnp.float32)).all()) for l in leaves
  )
  err_y = _rel(y, y_ref)
  err_g = max(_rel(a, b) for a, b in zip(leaves, leaves_ref))
  tol_y, tol_g = TOLERANCE[variant]
  # A variant identical to bf16 would mean the quantization was folded away: demand a nonzero error.
  quantized = variant == "bf16" or err_y > 0
  ok = finite and err_y <= tol_y and err_g <= tol_g and quantized
  return dict(finite=finite, rel_err_y=err_y, rel_err_grad_max=err_g, tol_y=tol_y, tol_grad=tol_g, ok=ok)


def _compiled_memory(fn, args) -> int | None:
  try:
    m = fn.lower(*args).compile().memory_analysis()  # the same executable jit dispatches to
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)
  except Exception:  # pylint: disable=broad-except
    return None  # not every backend/runtime reports it


def _device_peak() -> int | None:
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use")


def prepare_variant(variant: str, inp: Inputs, ref, modes) -> tuple[dict, dict]:
  """Correctness check, residual bytes and the compiled functions of one variant: (result, {mode: (fn, args)})."""
  out = dict(variant=variant)
  try:
    out["check"] = check(variant, inp, ref)
  except Exception as e:  # pylint: disable=broad-except
    # e.g. scaled_dot_general not lowering on this backend: recorded, not fatal.
    out["na"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return out, {}
  if not out["check"]["ok"]:
    return out, {}
  out["residual_bytes"] = residual_bytes(variant, inp)
  fns = {}
  for mode in modes:
    fn, args = build(variant, mode, inp)
    out[mode] = dict(compiled_bytes=_compiled_memory(fn, args))
    fns[mode] = (fn, args)
  return out, fns


def time_round_robin(prepared: list[tuple[dict, dict]], warmup: int, iters: int) -> None:
  """Time every (variant, mode) in turn, one call each per round, so that load changes on a shared
  machine hit all variants alike (ratios stay meaningful); fills ``result[mode]`` in place."""
  jobs = [(r, m, fn, args) for r, fns in prepared for m, (fn, args) in fns.items()]
  for _, _, fn, args in jobs:
    for _ in range(warmup):
      jax.block_until_ready(fn(*args))
  times = {id(fn): [] for _, _, fn, _ in jobs}
  for _ in range(iters):
    for _, _, fn, args in jobs:
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times[id(fn)].append(time.perf_counter() - t0)
  for r, m, fn, _ in jobs:
    ts = sorted(times[id(fn)])
    r[m].update(median_ms=1e3 * statistics.median(ts), min_ms=1e3 * ts[0], p90_ms=1e3 * ts[int(0.9 * (len(ts) - 1))],
                iters=iters)
  for r, fns in prepared:
    if fns:
      r["device_peak_bytes"] = _device_peak()


# ----------------------------------------------------------------------------------------------
# HLO profile
# ----------------------------------------------------------------------------------------------
def hlo_profile(variant: str, mode: str, inp: Inputs, dump_dir: str | None) -> dict:
  """Counts in the optimized HLO: fusions, reduces, dots/convolutions, transposes, sorts, while loops."""
  fn, args = build(variant, mode, inp)
  text = fn.lower(*args).compile().as_text()
  if dump_dir:
    os.makedirs(dump_dir, exist_ok=True)
    with open(os.path.join(dump_dir, f"{variant}_{mode}.hlo.txt"), "w") as fh:
      fh.write(text)
  entry = text[text.find("ENTRY") :]
  count = lambda pat, s: len(re.findall(pat, s))
  return dict(
      variant=variant,
      mode=mode,
      # top-level ops in the entry computation (each is one kernel / pass over memory on CPU and GPU)
      entry_fusions=count(r"= \S+ fusion\(", entry),
      entry_dots=count(r"= \S+ (?:dot|convolution)\(", entry),
      entry_reduces=count(r"= \S+ reduce\(", entry),
      entry_transposes=count(r"= \S+ (?:transpose|copy)\(", entry),
      # everywhere (inside fusions too)
      all_dots=count(r"= \S+ dot\(", text),
      all_reduces=count(r"= \S+ reduce\(", text),
      all_rng=count(r"rng-bit-generator|threefry|= \S+ rng\(", text),
      all_while=count(r"= \S+ while\(", text),
      hlo_lines=text.count("\n"),
  )


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------
def _fmt_bytes(b) -> str:
  return "n/a" if b is None else f"{b / 2**20:.1f}"


def table(results: list[dict], modes) -> str:
  base = next((r for r in results if r["variant"] == "bf16"), None)
  lines = []
  hdr = "| variant | check (rel err y / grad) |"
  for m in modes:
    hdr += f" {m} median ms | {m} x bf16 |"
  hdr += " compiled MiB (fwdbwd) | residual MiB | device peak MiB |"
  lines.append(hdr)
  lines.append("|" + "---|" * (hdr.count("|") - 1))
  for r in results:
    if "na" in r:
      lines.append(f"| {r['variant']} | n/a: {r['na']} |" + " |" * (2 * len(modes) + 3))
      continue
    c = r["check"]
    row = f"| {r['variant']} | {'ok' if c['ok'] else 'FAIL'} ({c['rel_err_y']:.3f} / {c['rel_err_grad_max']:.3f}) |"
    for m in modes:
      if m in r:
        ratio = r[m]["median_ms"] / base[m]["median_ms"] if base and m in base else float("nan")
        row += f" {r[m]['median_ms']:.2f} | {ratio:.2f} |"
      else:
        row += " - | - |"
    mem = r.get("fwdbwd", {}).get("compiled_bytes")
    row += f" {_fmt_bytes(mem)} | {_fmt_bytes(r.get('residual_bytes'))} | {_fmt_bytes(r.get('device_peak_bytes'))} |"
    lines.append(row)
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", choices=sorted(PRESETS), default="h200", help="shape preset (default h200)")
  p.add_argument("--tokens", type=int, help="T (overrides the preset)")
  p.add_argument("--d-model", type=int, help="D (overrides the preset)")
  p.add_argument("--d-ff", type=int, help="F (overrides the preset)")
  p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS + tuple(ABLATIONS)}")
  p.add_argument("--modes", default=",".join(MODES), help=f"comma list of {MODES}")
  p.add_argument("--warmup", type=int, default=3)
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--isolate", action="store_true", help="one subprocess per variant (clean device peak memory)")
  p.add_argument("--json", help="write the results (and the table) as JSON here")
  p.add_argument("--dump-hlo", metavar="DIR", help="profile only: write optimized HLO per variant/mode, print op counts")
  a = p.parse_args(argv)

  t, d, f = PRESETS[a.preset]
  t, d, f = a.tokens or t, a.d_model or d, a.d_ff or f
  variants = [v for v in a.variants.split(",") if v]
  modes = [m for m in a.modes.split(",") if m]
  for v in variants:
    if v not in VARIANTS and v not in ABLATIONS:
      p.error(f"unknown variant {v!r}; choose from {VARIANTS + tuple(ABLATIONS)}")
  for m in modes:
    if m not in MODES:
      p.error(f"unknown mode {m!r}; choose from {MODES}")
  dev = jax.devices()[0]
  header = f"SwiGLU MLP T={t} D={d} F={f} on {dev.platform}:{dev.device_kind} (jax {jax.__version__})"
  print(header, flush=True)
  inp = make_inputs(t, d, f)

  if a.dump_hlo is not None:
    rows = [hlo_profile(v, m, inp, a.dump_hlo) for v in variants for m in modes]
    for r in rows:
      print(json.dumps(r))
    if a.json:
      with open(a.json, "w") as fh:
        json.dump(dict(header=header, hlo=rows), fh, indent=1)
    return 0

  results = []
  if a.isolate and len(variants) > 1:
    import tempfile  # pylint: disable=import-outside-toplevel

    for v in variants:
      with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        cmd = [sys.executable, os.path.abspath(__file__), f"--variants={v}", f"--modes={a.modes}",
               f"--tokens={t}", f"--d-model={d}", f"--d-ff={f}", f"--warmup={a.warmup}", f"--iters={a.iters}",
               f"--json={tmp.name}"]
        proc = subprocess.run(cmd, check=False)
        try:
          with open(tmp.name) as fh:
            results.extend(json.load(fh)["results"])
        except (OSError, ValueError):
          results.append(dict(variant=v, na=f"subprocess exited {proc.returncode} without results"))
  else:
    # The bf16 reference for the correctness checks (y and grads of sum(y * g)).
    ref_fn, ref_args = build("bf16", "fwdbwd", inp)
    ref = jax.block_until_ready(ref_fn(*ref_args))
    prepared = [prepare_variant(v, inp, ref, modes) for v in variants]
    time_round_robin(prepared, a.warmup, a.iters)
    for r, _ in prepared:
      print(json.dumps(r), flush=True)
      results.append(r)

  text = table(results, modes)
  print(header)
  print(text)
  if a.json:
    with open(a.json, "w") as fh:
      json.dump(dict(header=header, shape=dict(tokens=t, d_model=d, d_ff=f), results=results, table=text), fh, indent=1)
  failed = [r["variant"] for r in results if "check" in r and not r["check"]["ok"]]
  if failed:
    print(f"CORRECTNESS FAILED: {failed}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
