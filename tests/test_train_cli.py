"""`python -m maxtext_nvfp4.train` stops at once on recipes this machine cannot run, and prepares runs/."""

import os
import subprocess
import sys
import time

import pytest

from maxtext_nvfp4.tools import recipes
from maxtext_nvfp4.tools import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("recipe,suggestion", [
    ("recipes/llama3_8b_fp8.yml", "demo_bf16.yml"),
    ("recipes/llama3_8b_nvfp4.yml", "demo_nvfp4.yml"),
])
def test_blackwell_recipe_stops_before_maxtext_with_the_proxy_named(recipe, suggestion):
  te, cc = recipes.detect_hardware()
  if te and cc and cc >= 10.0:
    pytest.skip("this machine can run the Blackwell recipes")
  t0 = time.time()
  p = subprocess.run([sys.executable, "-m", "maxtext_nvfp4.train", recipe], cwd=ROOT, capture_output=True, text=True,
                     timeout=120)
  assert p.returncode == 2, p.stderr[-2000:]
  lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
  assert len(lines) == 1 and suggestion in lines[0] and "Transformer Engine" in lines[0], p.stderr
  assert "completed step" not in p.stdout
  assert time.time() - t0 < 60


def test_cpu_recipes_pass_the_hardware_check():
  assert train.hardware_error(["recipes/demo_nvfp4.yml"]) is None
  assert train.hardware_error(["recipes/demo_bf16.yml", "steps=3"]) is None


def test_metrics_file_folder_is_created(tmp_path):
  target = tmp_path / "a" / "b" / "metrics.jsonl"
  train.ensure_metrics_dir([os.path.join(ROOT, "recipes/demo_nvfp4.yml"), f"metrics_file={target}"])
  assert target.parent.is_dir()
  train.ensure_metrics_dir([f"metrics_file={tmp_path / 'c' / 'm.jsonl'}"])
  assert (tmp_path / "c").is_dir()


def test_single_host_cpu_checkpointing_skips_jax_distributed(monkeypatch):
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  monkeypatch.setattr(train, "_accelerator_present", lambda: False)
  demo = os.path.join(ROOT, "recipes/demo_nvfp4.yml")
  out = train.with_single_host_cpu_defaults([demo, "enable_checkpointing=true"])
  assert out[-1] == "skip_jax_distributed_system=true"
  # the user's choice, multi-process hardware and disabled checkpointing are left alone
  assert train.with_single_host_cpu_defaults([demo, "enable_checkpointing=true", "skip_jax_distributed_system=false"])[-1] \
      == "skip_jax_distributed_system=false"
  assert "skip_jax_distributed_system=true" not in train.with_single_host_cpu_defaults(
      [demo, "enable_checkpointing=true", "hardware=gpu_multiprocess"])
  assert "skip_jax_distributed_system=true" not in train.with_single_host_cpu_defaults([demo, "enable_checkpointing=false"])
  monkeypatch.setattr(train, "_accelerator_present", lambda: True)
  assert "skip_jax_distributed_system=true" not in train.with_single_host_cpu_defaults([demo, "enable_checkpointing=true"])
