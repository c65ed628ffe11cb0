"""Model-family sweep: which MaxText 0.2.5 decoder blocks train in bf16 and in emulated NVFP4 (CPU).

Each family runs as ``model_name=X override_model_config=true`` with tiny dims (2 decoder layers, d=64,
3 steps, synthetic data), once in bf16 (``quantization=''``) and once with ``quantization=nvfp4``, each in
its own subprocess (one at a time: 2 shared cores). A row records the start-up refusal line or the
first error line when a run fails. MoE families use the dense einsum path (``sparse_matmul=false``);
``--sparse`` adds an nvfp4 run with MaxText's default ``sparse_matmul=true``.

  python benchmarks/model_families.py [--families mixtral,qwen3_moe] [--out benchmarks/model_families.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

# Tiny dims shared by every family (overrides of the model's own yml).
TINY = {
    "base_emb_dim": 64, "base_num_query_heads": 4, "base_num_kv_heads": 4, "base_mlp_dim": 128,
    "base_num_decoder_layers": 2, "head_dim": 16, "vocab_size": 256, "max_target_length": 32,
    "per_device_batch_size": 1, "override_model_config": True,
}
TINY_MOE = {"base_mlp_dim": 64, "base_moe_mlp_dim": 64, "num_experts": 4, "num_experts_per_tok": 2, "sparse_matmul": False}

# family -> (model_name, extra overrides)
FAMILIES = {
    "llama2": ("llama2-7b", {}),
    "mistral": ("mistral-7b", {}),
    "gemma": ("gemma-2b", {}),
    "gemma2": ("gemma2-2b", {}),
    "gemma3": ("gemma3-4b", {}),
    "qwen2": ("qwen2.5-1.5b", {}),
    "qwen3": ("qwen3-0.6b", {}),
    "olmo3": ("olmo3-7b", {"base_num_decoder_layers": 4}),
    "gpt3": ("gpt3-52k", {}),
    "mixtral": ("mixtral-8x7b", TINY_MOE),
    "qwen3_moe": ("qwen3-30b-a3b", TINY_MOE),
    "deepseek": ("deepseek3-tiny", {**TINY_MOE, "first_num_dense_layers": 1, "q_lora_rank": 16,
                                    "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
                                    "v_head_dim": 16}),
    "gpt_oss": ("gpt-oss-20b", {**TINY_MOE, "sliding_window_size": 16}),
    "llama4": ("llama4-17b-16e", {**TINY_MOE, "num_experts_per_tok": 1, "base_num_decoder_layers": 4,
                                  "chunk_attn_window_size": 16}),
}

_CHILD = r"""
import sys, json
import maxtext_nvfp4
maxtext_nvfp4.register()
from maxtext.trainers.pre_train import train
from maxtext_nvfp4.integration import traced
train.main(json.loads(sys.argv[1]))
traced = sorted({(l if l is not None else -1, r, "/".join(b)) for l, r, b, _ in traced.traced_gemms()})
print("TRACED_GEMMS " + json.dumps(traced))
"""


def family_argv(family: str, out_dir: str, quantization: str, **extra) -> list:
  from maxtext_helpers import tiny_argv  # pylint: disable=import-outside-toplevel

  model, overrides = FAMILIES[family]
  return tiny_argv(out_dir, run_name=f"{family}_{quantization or 'bf16'}", model_name=model,
                   **{**TINY, **overrides, "quantization": quantization, **extra})


def run_one(family: str, quantization: str, timeout: int = 600, **extra) -> dict:
  with tempfile.TemporaryDirectory() as out:
    argv = family_argv(family, out, quantization, **extra)
    t0 = time.time()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    try:
      p = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(argv)], capture_output=True, text=True,
                         timeout=timeout, env=env, check=False)
      rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired:
      rc, text = 124, "timeout"
    metrics = os.path.join(out, f"{family}_{quantization or 'bf16'}.jsonl")
    loss = []
    if os.path.exists(metrics):
      with open(metrics, encoding="utf-8") as f:
        loss = [json.loads(line)["learning/loss"] for line in f if line.strip()]
  traced = [json.loads(ln.split(" ", 1)[1]) for ln in text.splitlines() if ln.startswith("TRACED_GEMMS ")]
  why = ""
  if rc != 0:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if "Error" in ln or "error" in ln]
    why = (errs[-1] if errs else lines[-1] if lines else "")[:300]
  return {"family": family, "model_name": FAMILIES[family][0], "quantization": quantization or "bf16",
          **({"extra": extra} if extra else {}), "rc": rc, "losses": loss,
          "traced_gemms": traced[0] if traced else [], "seconds": round(time.time() - t0, 1),
          "why": why}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--families", default=",".join(FAMILIES))
  ap.add_argument("--modes", default="bf16,nvfp4")
  ap.add_argument("--sparse", action="store_true", help="also nvfp4 with sparse_matmul=true for MoE families")
  ap.add_argument("--out", default=os.path.join(HERE, "model_families.jsonl"))
  a = ap.parse_args(argv)
  for fam in a.families.split(","):
    runs = [(m if m != "bf16" else "", {}) for m in a.modes.split(",")]
    if a.sparse and "num_experts" in FAMILIES[fam][1]:
      runs.append(("nvfp4", {"sparse_matmul": True}))
    for q, extra in runs:
      row = run_one(fam, q, **extra)
      print(json.dumps(row), flush=True)
      with open(a.out, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
