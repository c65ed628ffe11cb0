"""Reading a MaxText training checkpoint as a Hugging Face Llama: config, weights, eval batches, forward.

Everything here that knows MaxText's names and layouts is MaxText's own: the parameter names and the
MaxText -> HF transforms come from ``maxtext.checkpoint_conversion.utils.param_mapping``
(``LLAMA31_MAXTEXT_TO_HF_PARAM_MAPPING`` / ``..._HOOK_FN``, what ``checkpoint_conversion/to_huggingface.py``
uses for every Llama): per kernel ``reshape(flip(hf_shape)).T`` to ``[out, in]``, and the query kernel
times ``sqrt(head_dim)`` (MaxText folds ``1/sqrt(head_dim)`` into the query kernel's init and never scales
the scores; HF scales the scores). Those hooks also permute q/k rows from interleaved RoPE pairs to HF's
halves (``adjust_rope``): right for ``LLaMARotaryEmbedding`` (``rope_type: llama3.1``), wrong for the
default ``RotaryEmbedding`` (layers/embeddings.py ``_rotate_half``: already HF's halves layout), which is
what ``decoder_block: llama2`` with ``rope_type: default`` runs -- so it is left out (checked by the
logits test: MaxText's forward vs an HF-order forward of the converted weights).

Supported: ``decoder_block: llama2`` models (Llama 2/3 dense: RMSNorm, default RoPE, GQA, SwiGLU MLP,
unfused q/k/v and gate/up), scanned or per-layer parameters. Anything else is a :class:`CheckpointError`
(one line).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator

import numpy as np

from maxtext_nvfp4.core import plan
from maxtext_nvfp4.core import serving
from maxtext_nvfp4.core import settings as settings_lib
from maxtext_nvfp4.integration import touchpoints

# MaxText projection name (plan role) -> HF linear name inside a decoder layer.
HF_LINEAR = {"query": "self_attn.q_proj", "key": "self_attn.k_proj", "value": "self_attn.v_proj",
             "out": "self_attn.o_proj", "wi_0": "mlp.gate_proj", "wi_1": "mlp.up_proj", "wo": "mlp.down_proj"}


class CheckpointError(ValueError):
  """A checkpoint or config the exporter cannot use (message: one line with the path/key and the fix)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class HfModel:
  """A MaxText checkpoint in Hugging Face Llama terms."""

  # HF state-dict name -> fp32 numpy array in HF layout ([out, in] for linears)
  tensors: dict[str, np.ndarray]
  # HF config.json contents (LlamaForCausalLM)
  hf_config: dict[str, Any]
  # the same shape facts for the reference forward
  shape: serving.LlamaShape
  # HF linear name (no ".weight") -> True when it trained in NVFP4 (fprop before any late switch)
  trained_nvfp4: dict[str, bool]
  # the checkpoint's ``items`` directory and the MaxText config it was read with
  items_dir: str
  config: Any


def _maxtext(module_name: str):
  """Import a MaxText module and check it has every symbol of the adapter's ``touches`` we use."""
  import importlib  # pylint: disable=import-outside-toplevel

  module = importlib.import_module(module_name)
  touchpoints.check(module_name, module)
  return module


def find_items(path: str) -> str:
  """The Orbax ``items`` directory of a checkpoint given as a run's ``checkpoints`` dir (latest committed
  step), a step dir, or the ``items`` dir itself."""
  path = os.path.abspath(os.path.expanduser(path))
  if not os.path.isdir(path):
    raise CheckpointError(f"checkpoint {path}: no such directory (give a MaxText run's checkpoints/ or"
                          " checkpoints/<step>/ directory)")
  if os.path.basename(path) == "items" or os.path.exists(os.path.join(path, "_METADATA")):
    return path
  if os.path.isdir(os.path.join(path, "items")):
    return os.path.join(path, "items")
  steps = sorted((int(s) for s in os.listdir(path) if s.isdigit() and os.path.isdir(os.path.join(path, s, "items"))
                  and os.path.exists(os.path.join(path, s, "commit_success.txt"))), reverse=True)
  if steps:
    return os.path.join(path, str(steps[0]), "items")
  raise CheckpointError(f"checkpoint {path}: no committed MaxText checkpoint in it (expected <step>/items with"
                        " commit_success.txt; train with enable_checkpointing=true)")


def load_config(config_args: list[str]) -> Any:
  """MaxText's config for ``[RECIPE.yml] key=value ...`` (MaxText's base.yml without a recipe), with the
  plugin registered so ``nvfp4_*`` keys are understood. Raises :class:`CheckpointError` (one line)."""
  import maxtext_nvfp4  # pylint: disable=import-outside-toplevel
  from maxtext.configs import pyconfig  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import config_errors  # pylint: disable=import-outside-toplevel

  maxtext_nvfp4.register()
  args = list(config_args)
  if not args or not args[0].endswith(".yml"):
    import maxtext  # pylint: disable=import-outside-toplevel

    args = [os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml"), *args]
  argv = [None, *args, "skip_jax_distributed_system=true", "enable_checkpointing=false",
          "log_config=false"]
  try:
    return pyconfig.initialize(argv)
  except Exception as e:  # pylint: disable=broad-exception-caught  (MaxText raises many kinds)
    one = config_errors.one_line_error(e)
    raise CheckpointError(f"config {' '.join(args)}: {' '.join(str(one or e).split())}") from None


def _check_supported(config) -> None:
  def get(key):
    v = getattr(config, key, None)
    return getattr(v, "value", v)

  problems = []
  if str(get("decoder_block")).lower() != "llama2":
    problems.append(f"decoder_block={get('decoder_block')} (only llama2 exports)")
  if list(get("mlp_activations") or []) != ["silu", "linear"]:
    problems.append(f"mlp_activations={get('mlp_activations')} (needs [silu, linear])")
  if (str(get("rope_type")) != "default" or float(get("rope_linear_scaling_factor") or 1.0) != 1.0
      or str(get("model_name")).startswith("llama3.1")):
    problems.append(f"rope_type={get('rope_type')}, model_name={get('model_name')} (only default RoPE exports)")
  for key in ("fused_qkv", "fused_mlp", "use_qk_norm"):
    if get(key):
      problems.append(f"{key}=true")
  if float(get("final_logits_soft_cap") or 0) != 0:
    problems.append("final_logits_soft_cap")
  if float(get("rope_min_timescale") or 1) != 1:
    problems.append(f"rope_min_timescale={get('rope_min_timescale')} (HF's RoPE has 1)")
  if get("logits_via_embedding") and get("normalize_embedding_logits"):
    # MaxText divides tied-embedding logits by sqrt(emb_dim) (nnx_decoders.py); HF's tied lm_head does not
    problems.append("logits_via_embedding with normalize_embedding_logits (logits / sqrt(emb_dim))")
  if problems:
    raise CheckpointError(f"unsupported model for the Llama export: {'; '.join(problems)}")


def read_params(items_dir: str) -> dict[str, np.ndarray]:
  """``{"params-decoder-layers_0-...": array}``: the checkpoint's parameters, flattened with MaxText's
  conversion naming (optimizer state is not read)."""
  import jax  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  ckptr = ocp.PyTreeCheckpointer()
  try:
    meta = ckptr.metadata(items_dir)
    tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
    if "params" not in tree:
      raise CheckpointError(f"checkpoint {items_dir}: no 'params' item (not a MaxText training checkpoint)")
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree["params"])
    restored = ckptr.restore(items_dir, args=ocp.args.PyTreeRestore(
        item={"params": tree["params"]}, restore_args={"params": restore_args}, partial_restore=True))
  except CheckpointError:
    raise
  except Exception as e:  # pylint: disable=broad-exception-caught  (Orbax/tensorstore raise many kinds)
    raise CheckpointError(f"checkpoint {items_dir}: cannot read it ({' '.join(str(e).split())[:200]})") from None
  flat = jax.tree_util.tree_flatten_with_path(restored["params"])[0]
  return {"-".join(str(getattr(k, "key", k)) for k in path): np.asarray(v) for path, v in flat}


def _hf_config(config, vocab: int, emb: int, mlp: int) -> dict[str, Any]:
  return {
      "architectures": ["LlamaForCausalLM"], "model_type": "llama",
      "hidden_size": emb, "intermediate_size": mlp, "num_hidden_layers": int(config.num_decoder_layers),
      "num_attention_heads": int(config.num_query_heads), "num_key_value_heads": int(config.num_kv_heads),
      "head_dim": int(config.head_dim), "vocab_size": vocab, "hidden_act": "silu",
      "rms_norm_eps": float(config.normalization_layer_epsilon), "rope_theta": float(config.rope_max_timescale),
      "rope_scaling": None, "max_position_embeddings": int(config.max_target_length),
      "tie_word_embeddings": bool(config.logits_via_embedding), "attention_bias": False, "mlp_bias": False,
      "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
  }


def _without_adjust_rope(chain):
  """MaxText's hook chain minus ``adjust_rope`` (the adapter's ``llama_conversion_hooks_dropped``; see the
  module docstring)."""
  facts = touchpoints.adapter()
  chain = chain if isinstance(chain, list) else [chain]
  if any(fn.__name__ not in facts.llama_conversion_hooks for fn in chain):
    raise CheckpointError(f"MaxText's Llama conversion hooks changed ({[fn.__name__ for fn in chain]}): the export"
                          f" supports MaxText {facts.version}'s")
  return [fn for fn in chain if fn.__name__ not in facts.llama_conversion_hooks_dropped]


def to_hf(items_dir: str, config) -> HfModel:
  """The checkpoint's weights in HF Llama names and layouts, via MaxText's own conversion functions."""
  module, names, hooks = touchpoints.adapter().llama_param_mapping
  param_mapping = _maxtext(module)
  _check_supported(config)
  params = read_params(items_dir)
  n = int(config.num_decoder_layers)
  scan = bool(config.scan_layers)
  conv_cfg = {"num_hidden_layers": n, "head_dim": int(config.head_dim)}
  names_fn, hooks_fn = getattr(param_mapping, names), getattr(param_mapping, hooks)
  mapping = names_fn(conv_cfg, config, scan_layers=scan)
  hooks = {k: _without_adjust_rope(v) for k, v in hooks_fn(
      conv_cfg, config, scan_layers=scan, saving_to_hf=True).items()}
  if config.logits_via_embedding:
    mapping.pop("params-decoder-logits_dense-kernel", None)
  missing = sorted(set(mapping) - set(params))
  if missing:
    raise CheckpointError(f"checkpoint {items_dir}: has no {missing[0]} ({len(missing)} MaxText parameters missing):"
                          " pass the --config the run trained with")
  emb = params["params-token_embedder-embedding"].shape[1]
  vocab = params["params-token_embedder-embedding"].shape[0]
  mlp = params[next(k for k in mapping if k.endswith("mlp-wi_0-kernel"))].shape[-1]
  nh, nkv, hd = int(config.num_query_heads), int(config.num_kv_heads), int(config.head_dim)
  hf_shapes = {"q_proj": (nh * hd, emb), "k_proj": (nkv * hd, emb), "v_proj": (nkv * hd, emb),
               "o_proj": (emb, nh * hd), "gate_proj": (mlp, emb), "up_proj": (mlp, emb), "down_proj": (emb, mlp),
               "lm_head": (vocab, emb)}
  tensors = {}
  for mt_key, hf_names in mapping.items():
    arr = params[mt_key]
    names = hf_names if isinstance(hf_names, list) else [hf_names]
    for i, hf_name in enumerate(names):
      a = np.take(arr, i, axis=int(config.param_scan_axis)) if isinstance(hf_names, list) else arr
      target = hf_shapes.get(hf_name.split(".")[-2])
      for fn in hooks.get(mt_key, []):
        a = fn(a, target)
      if target is not None and tuple(a.shape) != target:
        raise CheckpointError(f"checkpoint {items_dir}: {mt_key} has shape {arr.shape}, which does not fit the"
                              f" config's {hf_name} {target}: pass the --config the run trained with")
      tensors[hf_name] = np.asarray(a, np.float32)
  settings = settings_lib.from_config(config)
  nvfp4_run = str(getattr(config.quantization, "value", config.quantization)) == "nvfp4"
  trained = {}
  for layer in range(n):
    for role, hf in HF_LINEAR.items():
      p, _ = plan.precisions(settings, layer=None if scan else layer, role=role, num_layers=n)
      trained[f"model.layers.{layer}.{hf}"] = nvfp4_run and p.fprop == "nvfp4"
  shape = serving.LlamaShape(num_layers=n, num_heads=nh, num_kv_heads=nkv, head_dim=hd,
                             rms_norm_eps=float(config.normalization_layer_epsilon),
                             rope_theta=float(config.rope_max_timescale))
  return HfModel(tensors=tensors, hf_config=_hf_config(config, vocab, emb, mlp), shape=shape,
                 trained_nvfp4=trained, items_dir=items_dir, config=config)


def eval_batches(config, num_batches: int) -> Iterator[dict[str, np.ndarray]]:
  """Up to ``num_batches`` batches of the run's eval data (MaxText's own input pipeline; its train data
  when the config has no eval split), as numpy ``inputs`` / ``inputs_position`` / ``inputs_segmentation`` /
  ``targets`` / ``targets_segmentation``."""
  create_data_iterator = _maxtext("maxtext.input_pipeline.input_pipeline_interface").create_data_iterator
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  mesh = maxtext_utils.get_mesh_from_config(config)
  try:
    train_it, eval_it = create_data_iterator(config, mesh)
  except Exception as e:  # pylint: disable=broad-exception-caught  (the pipelines raise many kinds)
    raise CheckpointError(f"calibration data: cannot open the run's data ({' '.join(str(e).split())[:200]}):"
                          " check the dataset keys, or pass --calibration-batches 0") from None
  it = eval_it if eval_it is not None else train_it
  for _ in range(num_batches):
    try:
      batch = next(it)
    except StopIteration:
      return
    yield {k: np.asarray(batch[k]) for k in ("inputs", "inputs_position", "inputs_segmentation", "targets",
                                             "targets_segmentation")}


def maxtext_logits(config, params_tree: dict, tokens: np.ndarray, positions=None, segment_ids=None) -> np.ndarray:
  """MaxText's own forward (Linen wrapper of its model, dropout off) of ``tokens`` with ``params_tree``
  (``{"params": {...}}`` as in the checkpoint): ``[B, T, vocab]`` logits as numpy fp32. Positions default
  to ``arange``, segment ids to one segment."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from maxtext.utils import maxtext_utils  # pylint: disable=import-outside-toplevel

  model_creation_utils = _maxtext("maxtext.utils.model_creation_utils")
  mesh = maxtext_utils.get_mesh_from_config(config)
  model = model_creation_utils.from_config(config, mesh=mesh)
  tokens = jnp.asarray(tokens, jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape) if positions is None else positions
  segment_ids = jnp.ones_like(tokens) if segment_ids is None else segment_ids
  with mesh:
    logits = model.apply(params_tree, tokens, jnp.asarray(positions), decoder_segment_ids=jnp.asarray(segment_ids),
                         enable_dropout=False)
  return np.asarray(logits, np.float32)
