"""MaxText 0.2.4, as the plugin sees it: MaxText 0.2.5's facts (:mod:`.v0_2_5`) except the fields below.

Sources: MaxText 0.2.4's wheel against 0.2.5's (``diff -r`` of the two packages; every touched symbol is
present in both with the same signature, except ``RoutedMoE.sparse_matmul``, which 0.2.5 extends with
``forced_routed_experts=None``, and megablox ``gmm``, to which 0.2.5 adds ``use_gmm_v2_heuristic_tiling``;
the plugin passes both through):

* ``layers/attentions.py`` and ``layers/attention_mla.py``: the attention kernels' embedding axis is
  ``"embed"`` (0.2.5 renamed it ``"embed_attn"``): query ("embed", "q_heads", "kv"), key/value ("embed",
  "kv_heads", "kv_head_dim"), out ("heads", "kv", "embed"), MLA wq_a ("embed", "q_lora_up_proj") and wkv_a
  ("embed", "kv_lora_up_proj"). Build order unchanged (query, key, value, out; wq_a, wq_b, wkv_a, wkv_b).
* ``layers/moe.py``: RoutedAndSharedMoE builds its RoutedMoE with ``kernel_axes=("embed_moe", None)``
  (moe.py:3308; 0.2.5: ("embed_router", None)), so the router's GateLogit carries those axes; the decoder
  blocks' own GateLogit axes ("embed", None) are unchanged. ``sparse_matmul``'s
  ``get_quantization_dtypes`` (moe.py:1473) reads ``self.quant.quant_dg`` whenever a quantization is set.
* ``trainers/pre_train/train.py``: the ahead-of-time ``p_train_step.lower(...).compile()`` (train.py:978) only
  feeds the memory statistics; the loop calls ``p_train_step`` itself, which traces the step a second time
  (0.2.5 runs the compiled executable): per-trace counts are twice the per-step ones.
* ``configs/types.py`` / ``configs/base.yml``: no ``serve_fp8_weight`` mode (nor ``te_no_quant``): the patch
  series inserts ``nvfp4`` after ``TE_NVFP4_NO_RHT``, the last member, and its base.yml comment after the
  ``fp8_full`` line.

Not a fact of the adapter, but of the environment: 0.2.4's ``trainers/pre_train/train.py`` imports
``maxtext.common.goodput``, which needs ``ml_goodput_measurement`` unless ``DECOUPLE_GCLOUD=TRUE`` (0.2.5
falls back to a stub); scripts/setup_matrix.sh installs it.
"""

import dataclasses

from maxtext_nvfp4.integration.maxtext_versions import v0_2_5

ADAPTER = dataclasses.replace(
    v0_2_5.ADAPTER,
    version="0.2.4",
    kernel_signatures={
        ("embed", "q_heads", "kv"): ("query",),
        ("embed", "kv_heads", "kv_head_dim"): ("key", "value"),
        ("embed", "heads", "kv"): ("qkv_proj",),
        ("embed", "qkv", "heads", "kv"): ("qkv_proj",),  # fused_qkv (gpt3): one tensor for q, k and v
        ("embed", "q_lora_up_proj"): ("q_a",),
        ("q_lora", "q_heads", "kv"): ("q_b",),
        ("embed", "kv_lora_up_proj"): ("kv_a",),
        ("kv_lora", "kv_heads", "kv_head_dim"): ("kv_b",),
        ("heads", "kv", "embed"): ("out",),
        ("embed", "num_activations", "mlp"): ("wi",),
        ("mlp", "embed"): ("wo",),
        ("embed", None): ("router",),
        ("embed_moe", None): ("router",),  # RoutedAndSharedMoE's router (0.2.5: ("embed_router", None))
        ("exp", "embed_moe", "mlp_moe"): ("expert_wi_0", "expert_wi_1"),
        ("exp", "mlp_moe", "embed_moe"): ("expert_wo",),
        ("exp", None, "mlp"): ("expert_wi_0", "expert_wi_1"),
        ("exp", "mlp", None): ("expert_wo",),
    },
    patch_anchors={
        "quantization_enum_last": '  TE_NVFP4_NO_RHT = "te_nvfp4_no_rht"\n',
        "base_yml_quantization_comment": "# 'fp8_full' for fp8 quantization with static scaling.\n",
    },
    sparse_matmul_reads_quant_dg=True,  # get_quantization_dtypes: quant_dg = self.quant.quant_dg
    train_step_traces_per_run=2,  # train.py:978 lowers for memory_analysis only; the loop calls p_train_step
    # the post-training entry points (sft, distill) were run on 0.2.5 only
    patched_modules={m: job for m, job in v0_2_5.ADAPTER.patched_modules.items() if job != "distill"},
    posttrain_modules={},
)
