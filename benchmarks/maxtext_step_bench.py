"""MaxText training-step benchmark: bf16 vs ``quantization=fp8`` vs ``quantization=nvfp4`` (emulate).

Each variant is one subprocess training run of ``python -m maxtext_nvfp4.train`` (MaxText's trainer with
the NVFP4 plugin registered) on synthetic data, writing ``metrics_file``. The step time is MaxText's
``perf/step_time_seconds`` (host wall clock between consecutive step completions; the steady-state
device step time since dispatch is asynchronous); the first ``--skip`` steps (compilation, warm-up) are
dropped and the median of the rest is reported, with min and max. Variants run back to back in the
same process tree order, so compare ratios within one invocation only.

Memory: the child process prints, at exit, the device's ``peak_bytes_in_use`` (GPU; process-wide
high-water mark, so it includes initialisation) and its peak host RSS (``ru_maxrss``, the only figure on
CPU). MaxText's own compiled-memory estimate (``[train] Total estimated memory size: X GB``) is parsed
from the log when present.

Presets:
  cpu-demo              the demo model of ``recipes/demo_{bf16,nvfp4}.yml`` (4 layers, emb 128, seq 256,
                        batch 8; falls back to a tiny llama if the recipes are absent), synthetic data,
                        ``attention=dot_product``, 24 steps, skip 4
  gpu-llama3-8b-4layer  ``model_name=llama3-8b`` with 4 decoder layers, seq 4096, per-device batch 2,
                        default attention (autoselected: tokamax flash on GPU), 30 steps, skip 10.
                        H200 reference (issue 9): bf16 0.157 s/step, fp8 0.128 s/step.

Examples::

  python benchmarks/maxtext_step_bench.py --preset cpu-demo --json out/step_cpu.json
  python benchmarks/maxtext_step_bench.py --preset gpu-llama3-8b-4layer --out-dir $OUT/step
  python benchmarks/maxtext_step_bench.py --preset cpu-demo --variants bf16,nvfp4 --steps 12 --skip 3 \\
      --set remat_policy=minimal
  python benchmarks/maxtext_step_bench.py --preset cpu-demo --variants bf16,fp8,nvfp4 --repeats 3  # paired rounds

Exit status: 0 when every variant produced steps, 1 otherwise (the table still shows the others).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("bf16", "fp8", "nvfp4")

# The child: register the plugin (import maxtext_nvfp4), run the trainer as __main__, and report memory
# high-water marks at exit (absl's app.run ends with sys.exit, which runs atexit handlers).
_CHILD = r"""
import atexit, importlib.util, resource, runpy, sys
def _report():
  try:
    import jax
    st = jax.devices()[0].memory_stats() or {}
    print("BENCH_DEVICE_PEAK_BYTES=%s" % st.get("peak_bytes_in_use"), flush=True)
  except Exception as e:
    print("BENCH_DEVICE_PEAK_BYTES=None", flush=True)
  print("BENCH_HOST_MAXRSS_KB=%d" % resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, flush=True)
atexit.register(_report)
import maxtext_nvfp4
maxtext_nvfp4.register()
mod = "maxtext_nvfp4.train" if importlib.util.find_spec("maxtext_nvfp4.train") else None
if mod is None:
  # The plugin's entry point is not there yet: MaxText's trainer with the plugin registered is the same.
  from absl import app
  from maxtext.trainers.pre_train import train
  app.run(train.main)
else:
  runpy.run_module(mod, run_name="__main__", alter_sys=True)
"""


def _tokenizer() -> str:
  spec = importlib.util.find_spec("maxtext")
  if spec is None or not spec.submodule_search_locations:
    raise SystemExit("maxtext is not importable: install it (or put the wheel bundle on PYTHONPATH)")
  return os.path.join(list(spec.submodule_search_locations)[0], "assets", "tokenizers", "tokenizer.llama2")


def _base_yml() -> str:
  spec = importlib.util.find_spec("maxtext")
  return os.path.join(list(spec.submodule_search_locations)[0], "configs", "base.yml")


# Offline, synthetic, quiet; no eval (MaxText truncates metrics_file at the first eval), no checkpoints.
COMMON = dict(
    dataset_type="synthetic",
    enable_checkpointing="false",
    enable_goodput_recording="false",
    monitor_goodput="false",
    enable_tensorboard="false",
    log_config="false",
    eval_interval="-1",
    tokenizer_type="sentencepiece",
)

NVFP4_KEYS = dict(quantization="nvfp4", nvfp4_backend="emulate")


def preset(name: str) -> dict:
  """{'configs': {variant: yml}, 'keys': {...}, 'steps': n, 'skip': n} for a preset."""
  if name == "cpu-demo":
    bf16_yml = os.path.join(ROOT, "recipes", "demo_bf16.yml")
    nvfp4_yml = os.path.join(ROOT, "recipes", "demo_nvfp4.yml")
    if os.path.exists(bf16_yml) and os.path.exists(nvfp4_yml):
      configs = dict(bf16=bf16_yml, fp8=bf16_yml, nvfp4=nvfp4_yml)
      keys = dict(attention="dot_product")
    else:
      configs = dict.fromkeys(VARIANTS, _base_yml())
      keys = dict(base_emb_dim=128, base_num_query_heads=4, base_num_kv_heads=4, head_dim=32, base_mlp_dim=512,
                  base_num_decoder_layers=4, vocab_size=2048, max_target_length=256, per_device_batch_size=8,
                  scan_layers="false", attention="dot_product")
    return dict(configs=configs, keys=keys, steps=24, skip=4)
  if name == "gpu-llama3-8b-4layer":
    return dict(
        configs=dict.fromkeys(VARIANTS, _base_yml()),
        keys=dict(model_name="llama3-8b", override_model_config="true", base_num_decoder_layers=4,
                  max_target_length=4096, per_device_batch_size=2),
        steps=30,
        skip=10,
    )
  if name == "gpu-moe-proxy":
    # recipes/proxy_1gpu_moe_*: Mixtral-style, 8 experts top-2, einsum path (sparse_matmul=false), cut to 4
    # layers so the unrolled (scan_layers=false) program compiles in well under a minute; synthetic data.
    base = os.path.join(ROOT, "recipes", "proxy_1gpu_moe_base.yml")
    return dict(
        configs=dict(bf16=base, fp8=base, nvfp4=os.path.join(ROOT, "recipes", "proxy_1gpu_moe_nvfp4.yml")),
        keys=dict(base_num_decoder_layers=4),
        steps=15,
        skip=5,
    )
  raise SystemExit(f"unknown preset {name!r}")


def variant_keys(variant: str) -> dict:
  if variant == "bf16":
    return dict(quantization="")
  if variant == "fp8":
    return dict(quantization="fp8")
  if variant == "nvfp4":
    return dict(NVFP4_KEYS)
  raise SystemExit(f"unknown variant {variant!r}; choose from {VARIANTS}")


def _read_metrics(path: str) -> list[dict]:
  rows = []
  try:
    with open(path) as fh:
      for line in fh:
        line = line.strip()
        if line:
          try:
            rows.append(json.loads(line))
          except ValueError:
            pass
  except OSError:
    pass
  return rows


def run_variant(variant: str, p: dict, a, out_dir: str, round_idx: int = 0) -> dict:
  run_name = f"bench_{variant}" + (f"_r{round_idx}" if a.repeats > 1 else "")
  metrics = os.path.join(out_dir, f"{run_name}.jsonl")
  log_path = os.path.join(out_dir, f"{run_name}.log")
  keys = {**COMMON, "tokenizer_path": _tokenizer(), **p["keys"], **variant_keys(variant),
          "steps": a.steps, "run_name": run_name, "base_output_directory": out_dir, "metrics_file": metrics}
  for kv in a.set or []:
    k, _, v = kv.partition("=")
    keys[k] = v
  argv = [p["configs"][variant]] + [f"{k}={v}" for k, v in keys.items()]
  cmd = [sys.executable, "-c", _CHILD] + argv
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
  t0 = time.time()
  with open(log_path, "w") as log:
    log.write("# " + " ".join(cmd[:2] + ["<child>"] + argv) + "\n")
    log.flush()
    proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=a.cwd or ROOT, check=False,
                          timeout=a.timeout)
  wall = time.time() - t0
  with open(log_path) as fh:
    text = fh.read()
  out = dict(variant=variant, round=round_idx, returncode=proc.returncode, wall_s=round(wall, 1), log=log_path,
             command="python -m maxtext_nvfp4.train " + " ".join(argv))
  rows = [r for r in _read_metrics(metrics) if "perf/step_time_seconds" in r]
  times = [(int(r["step"]), float(r["perf/step_time_seconds"])) for r in rows]
  kept = [t for s, t in times if s >= a.skip]
  if kept:
    out.update(steps=len(times), timed_steps=len(kept), median_s=statistics.median(kept), min_s=min(kept),
               max_s=max(kept), final_loss=float(rows[-1].get("learning/loss", float("nan"))))
  m = re.search(r"BENCH_DEVICE_PEAK_BYTES=(\d+)", text)
  out["device_peak_bytes"] = int(m.group(1)) if m else None
  m = re.search(r"BENCH_HOST_MAXRSS_KB=(\d+)", text)
  out["host_maxrss_bytes"] = int(m.group(1)) * 1024 if m else None
  m = re.search(r"\[train\] Total estimated memory size: ([\d.]+) GB", text)
  out["compiled_estimate_gb"] = float(m.group(1)) if m else None
  if not kept:
    tail = [l for l in text.splitlines() if l.strip()][-5:]
    out["error"] = " | ".join(tail)[-600:]
  return out


def table(results: list[dict]) -> str:
  base = next((r for r in results if r["variant"] == "bf16" and "median_s" in r), None)
  lines = ["| variant | median s/step | x bf16 | min / max s | timed steps | final loss | device peak GiB | host RSS GiB |"
           " compiled est. GB |", "|---|---|---|---|---|---|---|---|---|"]
  gib = lambda b: "n/a" if b is None else f"{b / 2**30:.2f}"
  for r in results:
    if "median_s" not in r:
      lines.append(f"| {r['variant']} | FAILED (rc {r['returncode']}): {r.get('error', '')[:200]} | | | | | | | |")
      continue
    ratio = r["median_s"] / base["median_s"] if base else float("nan")
    lines.append(
        f"| {r['variant']} | {r['median_s']:.4f} | {ratio:.2f} | {r['min_s']:.4f} / {r['max_s']:.4f} |"
        f" {r['timed_steps']} | {r['final_loss']:.3f} | {gib(r['device_peak_bytes'])} | {gib(r['host_maxrss_bytes'])} |"
        f" {r['compiled_estimate_gb'] if r['compiled_estimate_gb'] is not None else 'n/a'} |"
    )
  return "\n".join(lines)


def summarize_rounds(results: list[dict], variants: list[str]) -> str:
  """Table over repeated rounds: the median of each variant's per-round medians, and the ratio to bf16
  computed within each round (paired: both runs saw similar machine load) -- its median and range."""
  lines = ["| variant | rounds | median of medians s/step | x bf16 (median of per-round ratios) | per-round x bf16 min / max |",
           "|---|---|---|---|---|"]
  by_round = {}
  for r in results:
    if "median_s" in r:
      by_round.setdefault(r["round"], {})[r["variant"]] = r["median_s"]
  for v in variants:
    meds = [rd[v] for rd in by_round.values() if v in rd]
    ratios = [rd[v] / rd["bf16"] for rd in by_round.values() if v in rd and "bf16" in rd]
    if not meds:
      lines.append(f"| {v} | 0 | FAILED | | |")
      continue
    rr = f"{statistics.median(ratios):.2f}" if ratios else "n/a"
    rng = f"{min(ratios):.2f} / {max(ratios):.2f}" if ratios else "n/a"
    lines.append(f"| {v} | {len(meds)} | {statistics.median(meds):.4f} | {rr} | {rng} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--preset", choices=("cpu-demo", "gpu-llama3-8b-4layer", "gpu-moe-proxy"), default="cpu-demo")
  ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS}")
  ap.add_argument("--steps", type=int, help="training steps per run (default: the preset's)")
  ap.add_argument("--skip", type=int, help="steps dropped before the median (default: the preset's)")
  ap.add_argument("--set", action="append", metavar="KEY=VALUE", help="extra MaxText key for every variant")
  ap.add_argument("--out-dir", help="logs and metrics files (default: a temporary directory)")
  ap.add_argument("--cwd", help="working directory of the runs (default: the repository root)")
  ap.add_argument("--timeout", type=float, default=3600, help="seconds per run")
  ap.add_argument("--json", help="write the results and the table as JSON here")
  ap.add_argument("--repeats", type=int, default=1, help="rounds over all variants, each round in a rotated order;"
                  " >1 adds a table of paired per-round ratios (robust to load drift on shared machines)")
  a = ap.parse_args(argv)
  p = preset(a.preset)
  a.steps = a.steps or p["steps"]
  a.skip = p["skip"] if a.skip is None else a.skip
  if a.skip >= a.steps:
    ap.error(f"--skip {a.skip} leaves no timed step out of --steps {a.steps}")
  variants = [v for v in a.variants.split(",") if v]
  out_dir = a.out_dir or tempfile.mkdtemp(prefix="maxtext_step_bench_")
  os.makedirs(out_dir, exist_ok=True)
  out_dir = os.path.abspath(out_dir)
  header = f"MaxText step bench preset={a.preset} steps={a.steps} skip={a.skip} out={out_dir}"
  print(header, flush=True)
  results = []
  for i in range(a.repeats):
    order = variants[i % len(variants):] + variants[: i % len(variants)]
    for v in order:
      try:
        r = run_variant(v, p, a, out_dir, i)
      except subprocess.TimeoutExpired:
        r = dict(variant=v, round=i, returncode="timeout", error=f"run exceeded {a.timeout} s")
      print(json.dumps(r), flush=True)
      results.append(r)
  text = "\n\n".join(table([r for r in results if r.get("round") == i]) for i in range(a.repeats))
  if a.repeats > 1:
    text += "\n\n" + summarize_rounds(results, variants)
  print(header)
  print(text)
  if a.json:
    with open(a.json, "w") as fh:
      json.dump(dict(header=header, preset=a.preset, results=results, table=text), fh, indent=1)
  return 0 if all("median_s" in r for r in results) else 1


if __name__ == "__main__":
  sys.exit(main())
