"""Tiny checkpoints of every exported family, made without training: MaxText's own model init (its
parameter names, shapes and layouts), perturbed so every tensor (norm scales included) is distinct, saved
as the Orbax ``params`` item a training checkpoint holds. A few seconds per family on CPU (no train-step
compile); shared by tests/tools/test_export.py and tests/peers/test_serving_oracles.py.
"""

from __future__ import annotations

import json
import os

import numpy as np

from maxtext_helpers import tiny_argv

# family -> (MaxText model_name, overrides): 2 layers, d=64, GQA 4/2 heads of 32 (sqrt(32) is not a power of
# two, so a missing query scale shows), MoE 4 experts top-2; gemma3: 6 layers, its first global one is the 6th;
# olmo3: 4 layers, the 4th global; llama4: 4 layers, 2 dense and 2 MoE, the 4th NoPE
_DENSE = {"base_emb_dim": 64, "base_num_query_heads": 4, "base_num_kv_heads": 2, "head_dim": 32, "base_mlp_dim": 128,
          "base_num_decoder_layers": 2, "vocab_size": 256, "max_target_length": 32, "per_device_batch_size": 1,
          "override_model_config": True}
_MOE = {"base_mlp_dim": 64, "base_moe_mlp_dim": 64, "num_experts": 4, "num_experts_per_tok": 2, "sparse_matmul": False}
FAMILIES = {
    "llama2": ("llama2-7b", {}),
    "mistral": ("mistral-7b", {}),
    "qwen2": ("qwen2.5-1.5b", {}),
    "qwen3": ("qwen3-0.6b", {}),
    "qwen3_moe": ("qwen3-30b-a3b", _MOE),
    "mixtral": ("mixtral-8x7b", {**_MOE, "head_dim": 16}),  # MaxText's mixtral hook needs heads x head_dim = emb
    # Gemma: a window of 8 (< the 16-32 test tokens) and caps that bite (scores, logits are O(1)-O(3) here)
    "gemma": ("gemma-2b", {}),
    "gemma2": ("gemma2-2b", {"base_num_decoder_layers": 1, "sliding_window_size": 8,  # 1 MaxText layer = 2 HF
                             "attn_logits_soft_cap": 1.0, "final_logits_soft_cap": 2.0}),
    "gemma3": ("gemma3-4b", {"base_num_decoder_layers": 6, "sliding_window_size": 8}),  # 5 sliding + 1 global
    # DeepSeek-V3: a dense layer then an MoE layer (4 experts in 2 groups, 1 eligible, top-2, 1 shared), MLA
    # ranks 32/16, heads 4 x (32 + 16), v 32; YaRN (deepseek3-tiny's: factor 40, mscale 1)
    "deepseek": ("deepseek3-tiny", {**_MOE, "base_num_kv_heads": 4, "first_num_dense_layers": 1,
                                    "n_routing_groups": 2, "topk_routing_group": 1, "q_lora_rank": 32,
                                    "kv_lora_rank": 16, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
                                    "v_head_dim": 32}),
    # Olmo 3: 4 layers (3 sliding with a window of 8, then a global one); olmo3-7b's YaRN with a pretraining
    # context of 16 (factor 4, 64 positions), so its frequencies and cos/sin scale bite within 32 tokens
    "olmo3": ("olmo3-7b", {"base_num_decoder_layers": 4, "sliding_window_size": 8, "rope_factor": 4,
                           "original_max_position_embeddings": 16, "max_position_embeddings": 64}),
    # Llama 4: 4 layers -- RoPE dense, RoPE MoE, RoPE dense, NoPE MoE (nope_layer_interval 4,
    # interleave_moe_layer_step 2); chunks of 8 (< the 16-32 test tokens); 4 experts top-1 + 1 shared
    "llama4": ("llama4-17b-16e", {**_MOE, "num_experts_per_tok": 1, "base_num_decoder_layers": 4,
                                  "interleave_moe_layer_step": 2, "chunk_attn_window_size": 8}),
}


def overrides(family: str, out_dir: str, **extra) -> list[str]:
  """``key=value`` MaxText arguments of the family's tiny model (what export/eval-quantized take)."""
  model, fam = FAMILIES[family]
  return tiny_argv(out_dir, run_name=family, skip_jax_distributed_system=True,
                   **{"model_name": model, **_DENSE, **fam, **extra})[2:]


def _leaf_shapes(tree, path=()):
  """``{path: shape}`` of MaxText's abstract init tree (nnx variable wrappers: ``{"value": ...}`` leaves)."""
  if isinstance(tree, dict):
    if set(tree) == {"value"}:
      return _leaf_shapes(tree["value"], path)
    out = {}
    for k, v in tree.items():
      out.update(_leaf_shapes(v, path + (k,)))
    return out
  return {path: tuple(getattr(tree, "value", tree).shape)}


def _draw(path, shape, rng):
  """Init-like values, every tensor distinct: embeddings N(0, 1); norm scales 1 + 0.1 N; biases 0.1 N;
  kernels N(0, 1/fan_in) with fan_in the contracted dims (out: heads x head_dim; experts: dim 1)."""
  name = path[-1]
  if name == "embedding":
    return rng.normal(size=shape)
  if name == "scale":
    return 1.0 + 0.1 * rng.normal(size=shape)
  if "bias" in name or name == "sinks":
    return 0.1 * rng.normal(size=shape)
  fan_in = shape[0] * shape[1] if path[-2] == "out" else shape[1] if len(shape) == 3 and name != "kernel" else shape[0]
  return rng.normal(size=shape) / np.sqrt(fan_in)


def init_params(config, seed: int = 0) -> dict:
  """``{"params": {...}, <other collection>: {...}}`` with exactly the names and shapes of MaxText's init of
  ``config``'s model (``jax.eval_shape`` of it: nothing is computed; every collection, as a training
  state's ``params`` holds them) and seeded init-like values (:func:`_draw`)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils, model_creation_utils  # pylint: disable=import-outside-toplevel

  mesh = maxtext_utils.get_mesh_from_config(config)
  model = model_creation_utils.from_config(config, mesh=mesh)
  tok = jnp.zeros((1, 8), jnp.int32)
  key = jax.random.PRNGKey(seed)
  with jax.set_mesh(mesh):
    tree = jax.eval_shape(lambda: model.init({"params": key, "dropout": key, "aqt": key}, tok,
                                             jnp.broadcast_to(jnp.arange(8), (1, 8)),
                                             decoder_segment_ids=jnp.ones_like(tok), enable_dropout=False))
  rng = np.random.default_rng(seed)
  out: dict = {}
  for collection in sorted(dict(tree)):  # "params", and e.g. deepseek3's routing bias in "MoEBiasVar"
    for path, shape in sorted(_leaf_shapes(dict(tree)[collection]).items()):
      d = out.setdefault(collection, {})
      for part in path[:-1]:
        d = d.setdefault(part, {})
      d[path[-1]] = _draw(path, shape, rng).astype(np.float32)
  return out


def save_checkpoint(params: dict, ckpt_dir: str, step: int = 0) -> str:
  """``params`` as ``<ckpt_dir>/<step>/items`` (the Orbax ``params`` item of a MaxText training
  checkpoint) with ``commit_success.txt``; returns ``ckpt_dir``."""
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  items = os.path.join(os.path.abspath(ckpt_dir), str(step), "items")
  ocp.PyTreeCheckpointer().save(items, {"params": params})
  with open(os.path.join(ckpt_dir, str(step), "commit_success.txt"), "w", encoding="utf-8") as f:
    f.write("ok\n")
  return ckpt_dir


def make(family: str, out_dir: str, seed: int = 0, **extra) -> dict:
  """A family's tiny checkpoint: ``{"ckpt": checkpoints dir, "overrides": [...], "config", "params"}``."""
  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel

  args = overrides(family, out_dir, **extra)
  config = checkpoint.load_config(args)
  params = init_params(config, seed)
  ckpt = save_checkpoint(params, os.path.join(out_dir, family, "checkpoints"))
  return {"ckpt": ckpt, "overrides": args, "config": config, "params": params}


def as_training_checkpoint(ckpt_dir: str, step: int = 0) -> None:
  """:func:`save_checkpoint` writes the params item with Orbax's PyTreeCheckpointer (its metadata inside ``items``);
  MaxText's load_parameters_path reads a step folder as its checkpoint manager writes it, naming ``items``."""
  step_dir = os.path.join(ckpt_dir, str(step))
  if os.path.exists(os.path.join(step_dir, "_CHECKPOINT_METADATA")):  # already in the training layout
    return
  os.remove(os.path.join(step_dir, "items", "_CHECKPOINT_METADATA"))
  with open(os.path.join(step_dir, "_CHECKPOINT_METADATA"), "w", encoding="utf-8") as f:
    json.dump({"item_handlers": {"items": "orbax.checkpoint.experimental.v1._src.handlers.pytree_handler.PyTreeHandler"},
               "metrics": {}, "performance_metrics": {}, "init_timestamp_nsecs": 1, "commit_timestamp_nsecs": 2,
               "custom_metadata": {"scan_layers": False}}, f)


def merged_args(made_overrides: list[str], **extra) -> list[str]:
  """``key=value`` arguments: a family's overrides with ``extra`` on top (bools as MaxText spells them; None drops)."""
  keys = dict(a.split("=", 1) for a in made_overrides)
  keys.update({k: (str(v).lower() if isinstance(v, bool) else v) for k, v in extra.items()})
  return [f"{k}={v}" for k, v in keys.items() if v is not None]


# A short NVFP4 QAT fine-tuning in the serving-matched forward (nvfp4_qat=serving) that leaves a checkpoint of its
# last step to export: the keys test_posttrain and the peers stage fine-tune a tiny checkpoint with.
SERVING_QAT = dict(quantization="nvfp4", nvfp4_qat="serving", steps=2, enable_checkpointing=True,
                   async_checkpointing=False, checkpoint_period=100, learning_rate=1e-2)


def fine_tune(made: dict, out_dir: str, run_name: str, **keys) -> str:
  """``python -m maxtext_nvfp4.sft`` (MaxText's SFT, in this process) from :func:`make`'s checkpoint, with ``keys``;
  returns the run's checkpoints folder (step 0 and the last step)."""
  from maxtext_nvfp4.tools import posttrain  # pylint: disable=import-outside-toplevel

  as_training_checkpoint(made["ckpt"])
  rc = posttrain.sft_main(merged_args(made["overrides"], run_name=run_name, base_output_directory=out_dir,
                                      load_parameters_path=made["ckpt"],
                                      metrics_file=os.path.join(out_dir, f"{run_name}.jsonl"), **keys))
  assert rc == 0, f"sft {run_name} exited {rc}"
  return os.path.join(out_dir, run_name, "checkpoints")
