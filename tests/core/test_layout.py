"""core/layout.py: one config's decoder built once, and its users (plan table, TE limits) reading it (pure)."""

import pytest

from maxtext_nvfp4.core import layout as layout_lib
from maxtext_nvfp4.core import plan
from maxtext_nvfp4.core import te_limits
from maxtext_nvfp4.core.settings import Nvfp4Settings

RULES = {"deepseek": ("from", "first_num_dense_layers"), "llama4": ("every", "interleave_moe_layer_step")}
# A DeepSeek-style decoder: MLA with a low-rank query, 1 dense layer then MoE layers with one shared expert.
DEEPSEEK = {"num_decoder_layers": 3, "scan_layers": False, "decoder_block": "deepseek", "first_num_dense_layers": 1,
            "num_experts": 4, "shared_experts": 1, "attention_type": "mla", "q_lora_rank": 32, "kv_lora_rank": 64,
            "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "emb_dim": 128, "mlp_dim": 256,
            "moe_mlp_dim": 64, "num_query_heads": 4, "num_kv_heads": 4, "head_dim": 48,
            "per_device_batch_size": 2, "max_target_length": 64, "mlp_activations": ["silu", "linear"]}


def test_roles_per_layer_dense_mla_experts_and_shared_experts():
  lay = layout_lib.from_config(DEEPSEEK, moe_layer_rules=RULES)
  assert lay.moe_layers == (1, 2) and lay.mla and lay.q_lora
  attn = ("q_a", "q_b", "kv_a", "kv_b", "out")
  assert lay.roles(0) == attn + ("wi_0", "wi_1", "wo")
  assert lay.roles(1) == attn + ("router", "expert_wi_0", "expert_wi_1", "expert_wo", "wi_0", "wi_1", "wo")
  assert lay.mlp_dim(0) == 256 and lay.mlp_dim(1) == 64  # shared experts: shared_experts * moe_mlp_dim
  no_shared = layout_lib.from_config({**DEEPSEEK, "shared_experts": 0}, moe_layer_rules=RULES)
  assert no_shared.roles(2) == attn + ("router", "expert_wi_0", "expert_wi_1", "expert_wo")
  # without the version's rules every layer of an MoE config is MoE
  assert layout_lib.from_config(DEEPSEEK, moe_layer_rules={}).moe_layers == (0, 1, 2)
  with pytest.raises(ValueError, match="unknown MoE layer rule"):
    layout_lib.from_config(DEEPSEEK, moe_layer_rules={"deepseek": ("after", "first_num_dense_layers")})


def test_the_plan_table_and_the_te_limits_read_the_same_roles():
  lay = layout_lib.from_config(DEEPSEEK, moe_layer_rules=RULES)
  s = Nvfp4Settings()
  rows = plan.precision_table(s, num_layers=lay.num_layers, roles=lay.roles)
  assert [(r.layer, r.role) for r in rows] == [(l, role) for l in range(3) for role in lay.roles(l)]
  gemms = {(g.role, g.layers): (g.k, g.n) for g in te_limits.decoder_gemms(DEEPSEEK, s, layout=lay)}
  # MLA projections with their own shapes; the dense MLP and the shared experts apart; no router or experts
  assert gemms[("q_a", "every layer" if lay.scan_layers else "layers 0-2")] == (128, 32)
  assert gemms[("kv_a", "layers 0-2")] == (128, 64 + 16)
  assert gemms[("kv_b", "layers 0-2")] == (64, 4 * (32 + 32))
  assert gemms[("out", "layers 0-2")] == (4 * 32, 128)
  assert gemms[("wo", "layer 0")] == (256, 128) and gemms[("wo", "layers 1-2")] == (64, 128)
  assert not [r for r, _ in gemms if r == "router" or r.startswith("expert_")]
  # the shared experts' 64-wide MLP breaks TE's RHT rule (N % 128) where the dense 256 does not
  refused = {(r.role, r.layers) for r in te_limits.check(DEEPSEEK, s, layout=lay) if "RHT columns of dy" in r.dimension}
  assert ("wi_0", "layers 1-2") in refused and ("wi_0", "layer 0") not in refused
