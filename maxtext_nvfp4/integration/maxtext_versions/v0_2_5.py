"""MaxText 0.2.5 (the release pinned in pyproject.toml), as the plugin sees it.

Sources: MaxText 0.2.5's wheel -- ``layers/attentions.py``, ``layers/attention_mla.py`` and
``layers/linears.py`` (projection kernel axes and build order: Attention builds query, key, value, out;
MlpBlock wi_0, wi_1, wo; MLA wq_a, wq_b (or query), wkv_a, wkv_b), ``layers/moe.py`` (GateLogit's axes:
("embed", None) from each decoder block, ("embed_router", None) from RoutedAndSharedMoE; RoutedMoE's expert
einsums asked for at call time with ("exp", "embed_moe", "mlp_moe") / ("exp", "mlp_moe", "embed_moe"), or
("exp", None, "mlp") / ("exp", "mlp", None) with capacity_factor > 0; its sparse_matmul's ``gmm`` closure
calls megablox gmm for wi_0, wi_1, wo -- or [wi_0 | wi_1], wo with prefuse_moe_weights), ``models/deepseek.py``
(routed experts from ``first_num_dense_layers`` on), ``models/llama4.py`` (every
``interleave_moe_layer_step``-th layer), ``configs/pyconfig.py`` (``_prepare_for_pydantic``'s unknown-key
message; the keys it rewrites), ``layers/nnx_wrappers.py`` (DenseGeneral's ``nnx.Rngs(params, dropout,
aqt)``), ``checkpoint_conversion/utils/param_mapping.py`` (the Llama 3.1, Qwen, Mixtral, Gemma 2, Gemma 3,
DeepSeek and Olmo 3 mappings and their hook chains; ``tensor_handling.stacked_axes``: a scanned MoE weight
stacks (experts, layers) leading), ``models/gemma3.py`` (``get_attention_type``, ``get_query_pre_attn_scalar``),
``models/olmo3.py`` (``get_attention_type``), ``models/llama4.py`` (``determine_is_nope_layer``,
``determine_is_moe_layer``; the decoder layer's temperature tuning scale 0.1 and floor 8192),
``layers/embeddings.py`` (``LLaMARotaryEmbedding._apply_scaling_factor``: factor 8, low_freq_factor 1,
high_freq_factor 4, original context 8192), ``checkpoint_conversion/standalone_scripts/llama4_ckpt_unscanned.py``
(llama4's HF names and layouts: :mod:`.llama4_v0_2_5`).
"""

import dataclasses

from maxtext_nvfp4.integration.maxtext_versions.schema import HfConversion, LogNoise, MaxTextVersion, Touch

_TYPES = "maxtext.configs.types"
_PYCONFIG = "maxtext.configs.pyconfig"
_QUANTIZATIONS = "maxtext.layers.quantizations"
_TRAIN = "maxtext.trainers.pre_train.train"
_METRIC_LOGGER = "maxtext.common.metric_logger"
_MOE = "maxtext.layers.moe"
_MEGABLOX = "maxtext.kernels.megablox"
_NORMALIZATIONS = "maxtext.layers.normalizations"
_PARAM_MAPPING = "maxtext.checkpoint_conversion.utils.param_mapping"
_ACCELERATORS = "maxtext.utils.accelerator_to_spec_map"
_TRAIN_COMPILE = "maxtext.trainers.pre_train.train_compile"
_SFT = "maxtext.trainers.post_train.sft.train_sft_native"
_DISTILL = "maxtext.trainers.post_train.distillation.train_distill"

# llama2 and mistral blocks have the same parameters; MaxText has no mistral mapping of its own. Its Llama 3.1
# hooks permute q/k rows from interleaved RoPE pairs to HF halves (adjust_rope): right for LLaMARotaryEmbedding
# (rope_type llama3.1), wrong for the default RotaryEmbedding these blocks run (already HF's halves layout).
_LLAMA = HfConversion(
    names_fn="LLAMA31_MAXTEXT_TO_HF_PARAM_MAPPING", hooks_fn="LLAMA31_MAXTEXT_TO_HF_PARAM_HOOK_FN",
    hooks=frozenset({"scale_query_layer", "adjust_rope", "reshape_kernel"}), dropped=frozenset({"adjust_rope"}),
    dropped_reason="the default RotaryEmbedding already rotates HF's halves (embeddings.py _rotate_half)")
# qwen2/qwen3/qwen3_moe: query scaled by query_pre_attn_scalar in the forward (no depth scaling folded in the
# kernel), RoPE in halves: MaxText's hooks are only reshapes/transposes (and vocab padding for the embedding).
_QWEN = HfConversion(
    names_fn="QWEN_MAXTEXT_TO_HF_PARAM_MAPPING", hooks_fn="QWEN_MAXTEXT_TO_HF_PARAM_HOOK_FN",
    hooks=frozenset({"pad_embedding_layer", "reshape_kernel", "reshape_bias", "reshape_expert_kernel"}))

TOUCHES: tuple[Touch, ...] = (
    Touch(module=_TYPES, symbol="QuantizationType",
          use="str-Enum gains member NVFP4='nvfp4' in place (config_schema.patch_types)"),
    Touch(module=_TYPES, symbol="MaxTextConfig",
          use="schema rebuilt; Nvfp4MaxTextConfig subclasses it with the nvfp4_* keys (config_schema.patch_types)"),
    Touch(module=_TYPES, symbol="Multimodal",
          use="its fields are known keys for 'did you mean' (config_errors.known_config_keys)"),
    Touch(module=_PYCONFIG, symbol="_initialize_pydantic",
          use="wrapped: validates with Nvfp4MaxTextConfig, one-line errors (patches.patch_pyconfig)"),
    Touch(module=_QUANTIZATIONS, symbol="configure_quantization",
          use="wrapped: quantization=nvfp4 -> quantization.make_quantization (patches.patch_quantizations)"),
    Touch(module=_QUANTIZATIONS, symbol="Quantization",
          use="base class of the emulated Nvfp4Quantization (dot_general_cls, einsum, get_block_size)"),
    Touch(module=_QUANTIZATIONS, symbol="TransformerEngineQuantization",
          use="subclassed without its __init__; sets _recipe, _te_comm_gemm_overlap_policy; overrides _wrap"
              " (te_quantization)"),
    Touch(module=_QUANTIZATIONS, symbol="TransformerEngineQuantization._wrap",
          use="extended to serve TE's sr_rng stream (te_quantization)"),
    Touch(module=_QUANTIZATIONS, symbol="TransformerEngineQuantization.dot_general_cls",
          use="called for nvfp4/fp8 projections (te_quantization)"),
    Touch(module=_MOE, symbol="RoutedMoE.sparse_matmul",
          use="wrapped: when the layer's quant is ours, publishes its expert GEMMs' plan (quant.expert_gemms) while"
              " MaxText traces the call; reads the instance's quant and config.prefuse_moe_weights (sparse_moe)"),
    Touch(module=_MOE, symbol="RoutedMoE.get_expert_parallelism_size",
          use="called by the sparse_matmul wrapper: an expert-parallel mesh is refused (sparse_moe)"),
    Touch(module=_MEGABLOX, symbol="gmm",
          use="wrapped (the mblx.gmm layers/moe.py calls): inside such a sparse_matmul, each expert linear runs"
              " grouped_gemm.ragged_dot; elsewhere MaxText's gmm unchanged (sparse_moe)"),
    Touch(module=_TRAIN, symbol="train_step",
          use="wrapped to publish the traced step (step.with_step)"),
    Touch(module=_TRAIN, symbol="eval_step",
          use="wrapped to publish the traced step (step.with_step)"),
    Touch(module=_TRAIN, symbol="loss_fn",
          use="wrapped (train_step looks it up at call time): the gradient-fidelity tap and the MoE layer numbering"
              " of nvfp4_diagnostics (stability.patch_loss_fn)"),
    Touch(module=_NORMALIZATIONS, symbol="RMSNorm.__call__",
          use="wrapped: the residual-stream RMS of nvfp4_diagnostics (stability.patch_rms_norm)"),
    Touch(module=_MOE, symbol="RoutedMoE.get_topk",
          use="wrapped: tokens per expert of nvfp4_diagnostics (stability.patch_topk)"),
    Touch(module=_TRAIN, symbol="main",
          use="run by python -m maxtext_nvfp4.train (plugin.run_pretrain)"),
    Touch(module=_ACCELERATORS, symbol="get_system_characteristics",
          use="wrapped: also answers our GPU compile topologies, b200-4 -> 4 GPUs per slice (compile_target)"),
    Touch(module=_ACCELERATORS, symbol="SystemCharacteristics",
          use="built for our GPU compile topologies (compile_target.system_characteristics)"),
    Touch(module=_TRAIN_COMPILE, symbol="main",
          use="run by python -m maxtext_nvfp4.train_compile for MaxText's own compile topologies (TPU)"),
    Touch(module=_TRAIN_COMPILE, symbol="get_shaped_inputs",
          use="the abstract state and batch of the ahead-of-time step for our GPU targets (aot_compile)"),
    Touch(module="maxtext.utils.maxtext_utils", symbol="get_functional_train_with_signature",
          use="the train step and its shardings, as train_compile builds them (aot_compile)"),
    Touch(module="maxtext.utils.maxtext_utils", symbol="create_device_mesh",
          use="the config's mesh over the compile-only devices (aot_compile)"),
    Touch(module="maxtext.utils.sharding", symbol="maybe_update_params_sharding_with_opt",
          use="Zero-1 parameter shardings, as train_compile (aot_compile)"),
    Touch(module="maxtext.utils.sharding", symbol="build_zero1_input_state_mesh_shardings",
          use="the step's input state shardings, as train_compile (aot_compile)"),
    Touch(module="maxtext.utils.sharding", symbol="get_input_data_sharding",
          use="the batch sharding, as train_compile (aot_compile)"),
    Touch(module="maxtext.utils.max_utils", symbol="maybe_get_transformer_engine_context",
          use="TE's mesh resources around lowering and compiling a TE program (aot_compile)"),
    Touch(module="maxtext.layers.attentions", symbol="Attention.__call__",
          use="wrapped: under nvfp4_qat=serving, publishes its query/key/value/out kernels as stored (serving_layout)"),
    Touch(module="maxtext.layers.linears", symbol="MlpBlock.__call__",
          use="wrapped: under nvfp4_qat=serving, publishes its wi_0/wi_1/wo kernels as stored (serving_layout)"),
    Touch(module=_SFT, symbol="main",
          use="run by python -m maxtext_nvfp4.sft (posttrain.run): MaxText's pre-training loop with use_sft=True, whose"
              " train_step/eval_step are the wrapped ones above"),
    Touch(module=_DISTILL, symbol="main",
          use="run by python -m maxtext_nvfp4.distill (posttrain.run)"),
    Touch(module=_DISTILL, symbol="MaxTextDistillationTrainer._train_step",
          use="wrapped to publish the student's step (ModelBundle.training_step) as a training step (posttrain)"),
    Touch(module=_DISTILL, symbol="MaxTextDistillationTrainer._eval_step",
          use="wrapped to publish the student's step to the eval forward (posttrain)"),
    Touch(module=_DISTILL, symbol="distillation_utils.MaxTextCheckpointManager",
          use="given Tunix's newer _save_checkpointables / _checkpointer on google-tunix 0.1.7 (posttrain.bridge_tunix_v0)"),
    Touch(module=_METRIC_LOGGER, symbol="MetricLogger.write_metrics",
          use="wrapped: merges nvfp4/* diagnostics into train records (patches.patch_metric_logger)"),
    Touch(module=_METRIC_LOGGER, symbol="MetricLogger.write_metrics_locally",
          use="replaced: truncate the metrics file once per fresh run, append otherwise"),
    Touch(module=_METRIC_LOGGER, symbol="_prepare_metrics_for_json",
          use="called by the replaced write_metrics_locally (same JSON records as MaxText)"),
    Touch(module=_PARAM_MAPPING, symbol="LLAMA31_MAXTEXT_TO_HF_PARAM_MAPPING",
          use="MaxText -> HF names of llama2/mistral/gemma blocks for the NVFP4 export (hf_conversion)"),
    Touch(module=_PARAM_MAPPING, symbol="LLAMA31_MAXTEXT_TO_HF_PARAM_HOOK_FN",
          use="MaxText -> HF layouts (minus adjust_rope) of llama2/mistral blocks (hf_conversion)"),
    Touch(module=_PARAM_MAPPING, symbol="QWEN_MAXTEXT_TO_HF_PARAM_MAPPING",
          use="MaxText -> HF names of qwen2/qwen3/qwen3_moe blocks for the NVFP4 export (hf_conversion)"),
    Touch(module=_PARAM_MAPPING, symbol="QWEN_MAXTEXT_TO_HF_PARAM_HOOK_FN",
          use="MaxText -> HF layouts of qwen2/qwen3/qwen3_moe blocks (hf_conversion)"),
    Touch(module=_PARAM_MAPPING, symbol="MIXTRAL_MAXTEXT_TO_HF_PARAM_MAPPING",
          use="MaxText -> HF names of mixtral blocks for the NVFP4 export (hf_conversion)"),
    Touch(module=_PARAM_MAPPING, symbol="MIXTRAL_MAXTEXT_TO_HF_PARAM_HOOK_FN",
          use="MaxText -> HF layouts of mixtral blocks (hf_conversion)"),
    Touch(module=_PARAM_MAPPING, symbol="GEMMA2_MAXTEXT_TO_HF_PARAM_MAPPING",
          use="MaxText -> HF names of gemma2 blocks (a local and a global HF layer each) for the export"
              " (hf_conversion)"),
    Touch(module=_PARAM_MAPPING, symbol="GEMMA2_MAXTEXT_TO_HF_PARAM_HOOK_FN",
          use="MaxText -> HF layouts of gemma2 blocks: norms - 1, embedding / sqrt(d), query scale; gemma (v1)"
              " borrows its norm and embedding hooks (hf_conversion)"),
    Touch(module=_PARAM_MAPPING, symbol="GEMMA3_MAXTEXT_TO_HF_PARAM_MAPPING",
          use="MaxText -> HF names of gemma3 blocks (its text model's) for the export (hf_conversion)"),
    Touch(module=_PARAM_MAPPING, symbol="GEMMA3_MAXTEXT_TO_HF_PARAM_HOOK_FN",
          use="MaxText -> HF layouts of gemma3 blocks: norms - 1, embedding / sqrt(d) (hf_conversion)"),
    Touch(module=_PARAM_MAPPING, symbol="DEEPSEEK_MAXTEXT_TO_HF_PARAM_MAPPING",
          use="MaxText -> HF names of deepseek blocks (dense_layers_<i>, moe_layers_<j>) for the export"
              " (hf_conversion)"),
    Touch(module=_PARAM_MAPPING, symbol="DEEPSEEK_MAXTEXT_TO_HF_PARAM_HOOK_FN",
          use="MaxText -> HF layouts of deepseek blocks (hf_conversion)"),
    Touch(module=_PARAM_MAPPING, symbol="OLMO3_MAXTEXT_TO_HF_PARAM_MAPPING",
          use="MaxText -> HF names of olmo3 blocks, scanned (layers_<k>: the k-th layer of each cycle) or not"
              " (hf_conversion)"),
    Touch(module=_PARAM_MAPPING, symbol="OLMO3_MAXTEXT_TO_HF_PARAM_HOOK_FN",
          use="MaxText -> HF layouts of olmo3 blocks: transposes; norms and the full-width q/k norms as they are"
              " (hf_conversion)"),
    Touch(module="maxtext.models.olmo3", symbol="get_attention_type",
          use="which olmo3 layers slide (HF layer_types of the export; export_arch)"),
    Touch(module="maxtext.models.gemma3", symbol="get_attention_type",
          use="which gemma3 layers slide (HF layer_types of the export; export_arch)"),
    Touch(module="maxtext.models.gemma3", symbol="get_query_pre_attn_scalar",
          use="gemma3's query scale, as HF's query_pre_attn_scalar (export_arch)"),
    Touch(module="maxtext.models.llama4", symbol="determine_is_nope_layer",
          use="which llama4 layers have no RoPE (HF no_rope_layers of the export; export_arch)"),
    Touch(module="maxtext.models.llama4", symbol="determine_is_moe_layer",
          use="which llama4 layers have routed experts (HF moe_layers of the export; export_arch)"),
    Touch(module="maxtext.input_pipeline.input_pipeline_interface", symbol="create_data_iterator",
          use="the run's eval batches for the export's calibration (checkpoint.eval_batches)"),
    Touch(module="maxtext.utils.model_creation_utils", symbol="from_config",
          use="MaxText's forward of a checkpoint (checkpoint.maxtext_logits)"),
)

ADAPTER = MaxTextVersion(
    version="0.2.5",
    touches=TOUCHES,
    patched_modules={_TYPES: "types", _PYCONFIG: "pyconfig", _QUANTIZATIONS: "quantizations", _TRAIN: "train",
                     _METRIC_LOGGER: "metric_logger", _MOE: "moe", _MEGABLOX: "megablox", _DISTILL: "distill",
                     "maxtext.layers.attentions": "serving_attention", "maxtext.layers.linears": "serving_mlp",
                     _ACCELERATORS: "accelerators", _NORMALIZATIONS: "normalizations"},
    train_module=_TRAIN,
    train_compile_module=_TRAIN_COMPILE,
    posttrain_modules={"sft": _SFT, "distill": _DISTILL},
    # distillation_utils.py MaxTextCheckpointManager: save -> self._save_checkpointables, maybe_restore /
    # wait_until_finished / close -> self._checkpointer; google-tunix 0.1.7 (PyPI's) keeps an Orbax
    # CheckpointManager in _checkpoint_manager instead
    tunix_pins=("google-tunix==0.1.7", "google-metrax==0.2.4", "clu==0.0.12", "perfetto==0.59.1", "wrapt==2.5.2"),
    tunix_checkpoint_api=("_save_checkpointables", "_checkpointer"),
    ep_only_flags={"use_ring_of_experts": False, "use_random_routing": False, "use_ragged_sort": False,
                   "num_moe_emb_chunks": 0},
    kernel_signatures={
        ("embed_attn", "q_heads", "kv"): ("query",),
        ("embed_attn", "kv_heads", "kv_head_dim"): ("key", "value"),
        ("embed_attn", "heads", "kv"): ("qkv_proj",),
        ("embed_attn", "qkv", "heads", "kv"): ("qkv_proj",),  # fused_qkv (gpt3): one tensor for q, k and v
        ("embed_attn", "q_lora_up_proj"): ("q_a",),
        ("q_lora", "q_heads", "kv"): ("q_b",),
        ("embed_attn", "kv_lora_up_proj"): ("kv_a",),
        ("kv_lora", "kv_heads", "kv_head_dim"): ("kv_b",),
        ("heads", "kv", "embed_attn"): ("out",),
        ("embed", "num_activations", "mlp"): ("wi",),
        ("mlp", "embed"): ("wo",),
        ("embed", None): ("router",),
        ("embed_router", None): ("router",),
        ("exp", "embed_moe", "mlp_moe"): ("expert_wi_0", "expert_wi_1"),
        ("exp", "mlp_moe", "embed_moe"): ("expert_wo",),
        ("exp", None, "mlp"): ("expert_wi_0", "expert_wi_1"),
        ("exp", "mlp", None): ("expert_wo",),
    },
    up_projection_axes=("embed", "mlp"),
    activation_of_kernel_axis={
        "embed": "activation_embed",
        "mlp": "activation_mlp",
        "heads": "activation_heads",
        "q_heads": "activation_heads",
        "kv": "activation_kv",
        "kv_head_dim": "activation_kv",
    },
    activation_row_axes=("activation_batch", "activation_length"),
    routing_axis_prefix="activation_",
    moe_layer_rules={"deepseek": ("from", "first_num_dense_layers"), "llama4": ("every", "interleave_moe_layer_step")},
    expert_kernel_axes=(("exp", "embed_moe", "mlp_moe"), ("exp", "mlp_moe", "embed_moe")),
    gmm_call_order=(("expert_wi_0",), ("expert_wi_1",), ("expert_wo",)),
    gmm_call_order_fused=(("expert_wi_0", "expert_wi_1"), ("expert_wo",)),
    unknown_key_pattern=r"^'([^']+)' not in '",
    rewritten_keys=frozenset({
        "logical_axis_rules", "data_sharding", "train_data_columns", "eval_data_columns", "trainable_parameters_mask",
        "adamw_mask", "tokenizer_path", "run_name", "dump_hlo_local_module_name", "dump_hlo_module_name",
        "constant_bound_config", "quantization"}),
    te_sr_source_stream="aqt",
    te_recipe_attr="_recipe",
    te_overlap_attr="_te_comm_gemm_overlap_policy",
    hf_param_mapping_module=_PARAM_MAPPING,
    hf_conversions={
        "llama2": _LLAMA, "mistral": _LLAMA,
        "qwen2": _QWEN, "qwen3": _QWEN, "qwen3_moe": _QWEN,
        "mixtral": HfConversion(
            names_fn="MIXTRAL_MAXTEXT_TO_HF_PARAM_MAPPING", hooks_fn="MIXTRAL_MAXTEXT_TO_HF_PARAM_HOOK_FN",
            hooks=frozenset({"reshape_and_transpose_attention", "scale_query_layer", "reshape_kernel"})),
        # gemma (v1): MaxText has no conversion of its own; its layer is llama's but for the norms' names
        # (pre_self_attention_norm, pre_ffw_norm): llama's names and hooks (query * sqrt(head_dim), transposes;
        # adjust_rope dropped as for llama), plus gemma2's norm scales - 1 and embedding / sqrt(hidden) (fp32)
        "gemma": dataclasses.replace(
            _LLAMA, hooks=_LLAMA.hooks | {"scale_rmsnorm_layer", "pad_hf_embedding_layer"},
            renames=(("-pre_self_attention_norm-", "-pre_self_attention_layer_norm-"),
                     ("-pre_ffw_norm-", "-post_self_attention_layer_norm-")),
            borrowed_hooks_fn="GEMMA2_MAXTEXT_TO_HF_PARAM_HOOK_FN",
            borrowed_hooks=(("-scale", "params-decoder-decoder_norm-scale"),
                            ("params-token_embedder-embedding", "params-token_embedder-embedding"))),
        # gemma2: norm scales - 1, embedding / sqrt(hidden) (fp32) cut to the vocab, query * sqrt(head_dim)
        "gemma2": HfConversion(
            names_fn="GEMMA2_MAXTEXT_TO_HF_PARAM_MAPPING", hooks_fn="GEMMA2_MAXTEXT_TO_HF_PARAM_HOOK_FN",
            hooks=frozenset({"pad_hf_embedding_layer", "reshape_kernel", "scale_rmsnorm_layer", "scale_query_layer"})),
        # gemma3: written for Gemma3ForConditionalGeneration (model.language_model.*); norm scales - 1, embedding /
        # bf16(sqrt(hidden)); the query is scaled in the forward (query_pre_attn_scalar), not in the kernel
        "gemma3": HfConversion(
            names_fn="GEMMA3_MAXTEXT_TO_HF_PARAM_MAPPING", hooks_fn="GEMMA3_MAXTEXT_TO_HF_PARAM_HOOK_FN",
            hooks=frozenset({"pad_and_scale_embedding", "scale_rmsnorm", "reshape_kernel"}),
            multimodal_config=True, hf_prefix=("model.language_model.", "model.")),
        # deepseek: transposes/reshapes only (MLA's softmax scale and the YaRN RoPE live in the forward). The
        # deepseek3* routing bias is a MoEBiasVar (layers/moe.py GateLogit), so a checkpoint holds it as
        # MoEBiasVar-...-gate-bias where the mapping names params-...-gate-bias (common/checkpointing.py
        # _alias_legacy_collections is MaxText's own alias of the two)
        "deepseek": HfConversion(
            names_fn="DEEPSEEK_MAXTEXT_TO_HF_PARAM_MAPPING", hooks_fn="DEEPSEEK_MAXTEXT_TO_HF_PARAM_HOOK_FN",
            hooks=frozenset({"reshape_kernel"}), aliases=(("MoEBiasVar-", "params-"),)),
        # olmo3: transposes/reshapes only: its norms (scale_rmsnorm_layer, adapt_olmo3_qk_norm: w as is -- MaxText's
        # RMSNorm applies w, not 1 + w) and the vocab cut of the embedding; the query is scaled in the forward
        # (query_pre_attn_scalar = head_dim ** -0.5), RoPE rotates HF's halves (rope_interleave=false, checked)
        "olmo3": HfConversion(
            names_fn="OLMO3_MAXTEXT_TO_HF_PARAM_MAPPING", hooks_fn="OLMO3_MAXTEXT_TO_HF_PARAM_HOOK_FN",
            hooks=frozenset({"reshape_kernel", "scale_rmsnorm_layer", "adapt_olmo3_qk_norm",
                             "pad_hf_embedding_layer"})),
        # llama4: no mapping in param_mapping; the adapter's own (llama4_v0_2_5.py, from MaxText's llama4 conversion
        # script): transposes only -- no RoPE permutation (both rotate interleaved pairs), no query scale
        "llama4": HfConversion(
            names_fn="LLAMA4_MAXTEXT_TO_HF_PARAM_MAPPING", hooks_fn="LLAMA4_MAXTEXT_TO_HF_PARAM_HOOK_FN",
            hooks=frozenset({"reshape_kernel"}), module="maxtext_nvfp4.integration.maxtext_versions.llama4_v0_2_5",
            constants=(("attn_scale", 0.1), ("floor_scale", 8192.0), ("rope_factor", 8.0), ("low_freq_factor", 1.0),
                       ("high_freq_factor", 4.0), ("original_max_position_embeddings", 8192.0))),
    },
    scanned_expert_axes=(0, 1),  # checkpoint_conversion/utils/tensor_handling.py stacked_axes: leading
    configs_dir="configs",
    base_config="base.yml",
    models_dir="models",
    env_prefix="M_",
    patch_anchors={
        "quantization_enum_last": '  SERVE_FP8_WEIGHT = "serve_fp8_weight"\n',
        "base_yml_quantization_comment":
            "# 'serve_fp8_weight' to load and use FP8 checkpoint directly at inference time.\n",
    },
    sparse_matmul_reads_quant_dg=False,  # get_quantization_dtypes: getattr(self.quant, "quant_dg", None)
    train_step_traces_per_run=1,  # train.py: `compiled = p_train_step.lower(...).compile()` is what the loop runs
    # types.py validate_and_set_hlo_dump_defaults (0.2.4: the same function): XLA_FLAGS unset and dump_hlo_xla_flags
    # empty -> XLA_FLAGS = these flags, whatever dump_hlo says
    hlo_dump_injected_flags="--xla_dump_to={dump_hlo_local_dir} --xla_dump_large_constants",
    hlo_dump_injected_module_flag=" --xla_dump_hlo_module_re={dump_hlo_local_module_name}",
    log_noise=(
        LogNoise(kind="print", source="maxtext.common.gcloud_stub", text=": dependency missing; using stub.",
                 label="[NO-OP] stubs", why="optional Google Cloud packages (goodput, diagnostics, workload"
                 " monitor, Vertex TensorBoard) MaxText replaces with stubs; the run does not use them"),
        LogNoise(kind="logger", source="transformers", text="PyTorch was not found", label="PyTorch not found",
                 why="MaxText uses transformers for tokenizers and model configs only, never its PyTorch models"),
        LogNoise(kind="logger", source="transformers.configuration_utils",
                 text="got `key=rope_scaling` in kwargs", label="rope_scaling",
                 why="MaxText builds DeepSeek V3.2/V4 config objects at import; they are not the model you train"),
        LogNoise(kind="logger", source=_TYPES, text="AQT quantization is deprecated", label="AQT deprecation",
                 why="quantization=nvfp4 is not AQT, and the use_qwix_quantization=True it suggests is refused"
                 " by the plugin", nvfp4_only=True),
        LogNoise(kind="logger", source="absl", text="Memstats unavailable", label="Memstats unavailable",
                 why="devices without memory statistics (CPU); its 'Memstats: <label>:' header goes with it"),
        LogNoise(kind="logger", source="absl", text="MAXTEXT CONFIG ERROR:", label="config-error banner",
                 why="the train command prints every config error itself, once, with its own prefix"),
    ),
)
