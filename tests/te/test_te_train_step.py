"""MaxText's whole train step with ``quantization=nvfp4 nvfp4_backend=te``, compiled by XLA for compile-only B200s.

Built as MaxText's ahead-of-time compiler builds it (:mod:`maxtext_nvfp4.integration.aot_compile`), with real TE:
one B200, and four (FSDP 2 x tensor 2: TE's custom partitioner has to go through). In the compiled program the
number of TE GEMMs in each scaling mode equals the precision plan's (every NVFP4 projection is 3 NVFP4 GEMMs:
fprop, dgrad, wgrad; every fp8-fallback projection 3 FP8 ones; a bf16 one none) -- so ``nvfp4_targets``,
``nvfp4_keep_first_layers`` and ``nvfp4_fallback`` are checked where they land. ``scan_layers=false`` (each
layer's GEMMs appear in the program) and ``remat_policy=minimal_with_context`` (the projections' outputs are
saved: no forward GEMM is recomputed in the backward).
"""

import collections
import os

import pytest

from maxtext_nvfp4.core import plan as plan_lib
from maxtext_nvfp4.core import settings as settings_lib
from maxtext_nvfp4.integration import aot_compile
from maxtext_nvfp4.integration import model_layout

import te_program  # pylint: disable=wrong-import-order

_TINY = dict(base_emb_dim=256, base_mlp_dim=512, base_num_query_heads=4, base_num_kv_heads=4, head_dim=64,
             vocab_size=512, max_target_length=128, per_device_batch_size=2, attention="dot_product",
             scan_layers="false", remat_policy="minimal_with_context", dataset_type="synthetic",
             enable_checkpointing="false", steps=5, run_name="te_stage", hardware="gpu", enable_goodput_recording="false",
             monitor_goodput="false", enable_tensorboard="false", log_config="false", quantization="nvfp4",
             nvfp4_backend="te", compile_topology_num_slices=1)


def _compile(compile=True, **keys):  # pylint: disable=redefined-builtin
  import maxtext  # pylint: disable=import-outside-toplevel

  mt = os.path.dirname(maxtext.__file__)
  keys = {**_TINY, "tokenizer_path": os.path.join(mt, "assets", "tokenizers", "tokenizer.llama2"), **keys}
  return aot_compile.compile_train_step([None, os.path.join(mt, "configs", "base.yml")]
                                        + [f"{k}={v}" for k, v in keys.items()], compile=compile)


def _planned(config) -> collections.Counter:
  """GEMMs per precision the precision plan gives the decoder (3 per projection, in the projection's precision)."""
  layout = model_layout.layout_of(config)
  rows = plan_lib.precision_table(settings_lib.from_config(config), num_layers=layout.num_layers, roles=layout.roles)
  return collections.Counter(p for r in rows for p in (r.fprop, r.dgrad, r.wgrad))


def _te_gemms(step) -> collections.Counter:
  import transformer_engine_jax as tej  # pylint: disable=import-outside-toplevel # pytype: disable=import-error

  names = {int(tej.JAXX_Scaling_Mode.NVFP4_1D_SCALING): "nvfp4",
           int(tej.JAXX_Scaling_Mode.CURRENT_TENSOR_SCALING): "fp8"}
  return collections.Counter(names.get(c.config.get("scaling_mode"), f"mode {c.config.get('scaling_mode')}")
                             for c in te_program.calls((step.compiled or step.lowered).as_text())
                             if c.target == "te_gemm_v2_ffi")


def test_one_b200_selective_precision_reaches_te():
  """3 layers, layer 0 kept, MLP projections only in NVFP4, the rest TE FP8: 2 x 3 NVFP4 projections, 7 + 2 x 4 FP8
  (the lowered program: XLA's passes do not change these counts, checked on the compiled one by hand)."""
  step = _compile(compile=False, compile_topology="b200-1", base_num_decoder_layers=3, nvfp4_keep_first_layers=1,
                  nvfp4_targets="mlp", nvfp4_fallback="fp8")
  assert step.backend == "te"
  planned = _planned(step.config)
  assert planned == {"nvfp4": 2 * 3 * 3, "fp8": (7 + 2 * 4) * 3}, planned
  assert _te_gemms(step) == planned


def test_four_b200s_fsdp_and_tensor_parallel_partition_through_te():
  """FSDP 2 x tensor 2 on four B200s: TE's partitioner goes through; every projection is 3 NVFP4 GEMMs per device."""
  step = _compile(compile_topology="b200-4", base_num_decoder_layers=2, ici_fsdp_parallelism=2,
                  ici_tensor_parallelism=2)
  assert step.mesh["fsdp"] == 2 and step.mesh["tensor"] == 2
  planned = _planned(step.config)
  assert planned == {"nvfp4": 2 * 7 * 3}, planned
  assert _te_gemms(step) == planned
  assert step.compiled.memory_analysis().temp_size_in_bytes > 0


def test_auto_picks_te_for_a_blackwell_compile_target_on_this_cpu_host():
  """``nvfp4_backend=auto`` judges the compile target (four B200s, TE importable), not this CPU host."""
  from maxtext_nvfp4.backends import capability, targets  # pylint: disable=import-outside-toplevel

  with capability.compile_target("b200-4", targets.devices("b200", 4)):
    choice = capability.choose_backend("auto")
  assert choice.name == "te" and "compile target b200-4" in choice.reason, choice
  with capability.compile_target("h200-1", targets.devices("h200", 1)):
    choice = capability.choose_backend("auto")
  assert choice.name == "emulate" and "compile target h200-1" in choice.reason and "9.0 < 10.0" in choice.reason
  assert capability.choose_backend("auto").name == "emulate"  # the host itself: a CPU
