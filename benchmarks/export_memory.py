"""Peak host memory of ``maxtext-nvfp4 export`` on a ~1.1B-parameter Llama checkpoint (CPU).

Makes the checkpoint once (MaxText's init shapes of a Llama with d=2048, 16 layers, 16/8 heads of 128,
MLP 8192, vocab 32000; seeded values, fp32, unscanned or scanned: tests/export_families.py's maker), then
runs the export in a child process under ``/usr/bin/time -v`` and reads its "Maximum resident set size"
(``getrusage(RUSAGE_CHILDREN)`` is not usable here: it also counts the maker's own peak). The stated bound
(docs/export.md) is checked against it:

  peak <= baseline (an export of a 2-layer model of the same width and vocab: imports, JIT, the
          embedding table)
        + largest MaxText parameter as read (fp32; scanned: every layer of it)
        + 4 x one decoder layer's fp32 HF tensors (the layer, its hook outputs, quantizer temporaries)

  python benchmarks/export_memory.py [--work /tmp/export_mem] [--scan] [--layers 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

DIMS = {"base_emb_dim": 2048, "base_num_query_heads": 16, "base_num_kv_heads": 8, "head_dim": 128,
        "base_mlp_dim": 8192, "vocab_size": 32000, "max_target_length": 128, "per_device_batch_size": 1,
        "override_model_config": True, "model_name": "llama2-7b"}


def overrides(out_dir: str, layers: int, scan: bool) -> list[str]:
  from maxtext_helpers import tiny_argv  # pylint: disable=import-outside-toplevel

  return tiny_argv(out_dir, run_name="mem", skip_jax_distributed_system=True,
                   **{**DIMS, "base_num_decoder_layers": layers, "scan_layers": scan})[2:]


def make(work: str, layers: int, scan: bool) -> tuple[str, list[str], dict]:
  """The checkpoint (made once per shape), its overrides and its sizes."""
  import numpy as np  # pylint: disable=import-outside-toplevel

  import export_families  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel

  args = overrides(work, layers, scan)
  ckpt = os.path.join(work, f"ckpt_{layers}{'_scan' if scan else ''}")
  config = checkpoint.load_config(args)
  if not os.path.exists(os.path.join(ckpt, "0", "commit_success.txt")):
    params = export_families.init_params(config)
    export_families.save_checkpoint(params, ckpt)
    del params
  sizes = checkpoint.ParamReader(checkpoint.find_items(ckpt)).shapes
  elems = {k: int(np.prod(v)) for k, v in sizes.items()}
  layer0 = sum(v for k, v in elems.items() if "layers_0-" in k) if not scan else \
      sum(v for k, v in elems.items() if "-layers-" in k) // layers
  return ckpt, args, {"parameters": sum(elems.values()), "largest_param_bytes": 4 * max(elems.values()),
                      "layer_bytes": 4 * layer0}


def run_export(ckpt: str, args: list[str], out: str) -> tuple[float, float]:
  """(peak RSS in bytes of a fresh child running the export, wall seconds)."""
  t0 = time.time()
  cmd = ["/usr/bin/time", "-v", sys.executable, "-m", "maxtext_nvfp4", "export", ckpt, "--out", out,
         "--calibration-batches", "1", "--calibrate-on-synthetic", "--no-tokenizer", "--max-shard-size", "1GB", *args]
  p = subprocess.run(cmd, capture_output=True, text=True, check=False, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  if p.returncode:
    raise SystemExit(p.stderr[-2000:])
  kb = next(int(line.split(":")[1]) for line in p.stderr.splitlines() if "Maximum resident set size" in line)
  return kb * 1024, time.time() - t0


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--work", default="/tmp/export_mem")
  ap.add_argument("--layers", type=int, default=16)
  ap.add_argument("--scan", action="store_true")
  ap.add_argument("--baseline", action="store_true", help="export the 2-layer model of the same width only")
  a = ap.parse_args(argv)
  os.makedirs(a.work, exist_ok=True)
  layers = 2 if a.baseline else a.layers
  ckpt, args, sizes = make(a.work, layers, a.scan)
  out = os.path.join(a.work, f"hf_{layers}{'_scan' if a.scan else ''}")
  peak, wall = run_export(ckpt, args, out)
  files = sorted(os.listdir(out))
  written = sum(os.path.getsize(os.path.join(out, f)) for f in files)
  print(json.dumps({"layers": layers, "scan": a.scan, **sizes, "checkpoint_fp32_bytes": 4 * sizes["parameters"],
                    "peak_rss_bytes": peak, "export_seconds": round(wall, 1), "written_bytes": written,
                    "files": files}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
