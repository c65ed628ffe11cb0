"""``tools/model_shapes.py``: model dimensions from a checkpoint's parameter shapes (MaxText's layouts,
written out here: per-layer ``layers_<i>`` and scanned ``layers`` with the layer axis at
``param_scan_axis``), and the one-line refusal of a config that states them differently."""

from __future__ import annotations

import types

import pytest

from maxtext_nvfp4.tools import model_shapes

L, EMB, NH, NKV, HD, MLP, VOCAB, E, MOE = 4, 64, 4, 2, 32, 128, 256, 8, 96


def _layer(prefix, scan_axis=None, moe=False):
  def s(*shape):
    return shape if scan_axis is None else shape[:scan_axis] + (L,) + shape[scan_axis:]

  out = {prefix + "self_attention-query-kernel": s(EMB, NH, HD), prefix + "self_attention-key-kernel": s(EMB, NKV, HD),
         prefix + "self_attention-value-kernel": s(EMB, NKV, HD), prefix + "self_attention-out-kernel": s(NH, HD, EMB)}
  if moe:
    out[prefix + "MoeBlock_0-gate-kernel"] = s(EMB, E)
    out[prefix + "MoeBlock_0-wi_0"] = s(E, EMB, MOE)
  else:
    out[prefix + "mlp-wi_0-kernel"] = s(EMB, MLP)
  return out


def _shapes(scan_axis=None, moe=False):
  shapes = {"params-token_embedder-embedding": (VOCAB, EMB), "params-decoder-decoder_norm-scale": (EMB,)}
  if scan_axis is None:
    for i in range(L):
      shapes.update(_layer(f"params-decoder-layers_{i}-", moe=moe))
  else:
    shapes.update(_layer("params-decoder-layers-", scan_axis, moe=moe))
  return shapes


DENSE = dict(vocab_size=VOCAB, emb_dim=EMB, num_decoder_layers=L, num_query_heads=NH, num_kv_heads=NKV, head_dim=HD,
             mlp_dim=MLP)


@pytest.mark.parametrize("scan_axis", [None, 1, 0])
def test_dense_dimensions_per_layer_and_scanned(scan_axis):
  dims = model_shapes.dimensions(_shapes(scan_axis), param_scan_axis=scan_axis if scan_axis is not None else 1)
  assert dims == {**DENSE, "scan_layers": scan_axis is not None}


def test_moe_dimensions():
  dims = model_shapes.dimensions(_shapes(moe=True))
  assert (dims["num_experts"], dims["moe_mlp_dim"], dims["num_query_heads"]) == (E, MOE, NH) and "mlp_dim" not in dims


def _deepseek(scan_axis=None):
  """MaxText's deepseek block (1 dense + 3 MoE layers), MLA ranks q 24 / kv 16, heads NH x (nope 32 + rope 8),
  v 16; shared experts 2 x MOE wide."""
  def s(n, *shape):
    return shape if scan_axis is None else shape[:scan_axis] + (n,) + shape[scan_axis:]

  def attention(prefix, n):
    return {prefix + "self_attention-wq_a-kernel": s(n, EMB, 24),
            prefix + "self_attention-wq_b-kernel": s(n, 24, NH, 40),
            prefix + "self_attention-wkv_a-kernel": s(n, EMB, 16 + 8),
            prefix + "self_attention-wkv_b-kernel": s(n, 16, NH, 32 + 16),
            prefix + "self_attention-out-kernel": s(n, NH, 16, EMB)}

  shapes = {"params-token_embedder-embedding": (VOCAB, EMB)}
  for part, n, layers in (("dense_layers", 1, [0]), ("moe_layers", 3, [0, 1, 2])):
    prefixes = [f"params-decoder-{part}-"] if scan_axis is not None else [f"params-decoder-{part}_{i}-" for i in layers]
    for prefix in prefixes:
      shapes.update(attention(prefix, n))
      if part == "dense_layers":
        shapes[prefix + "mlp-wi_0-kernel"] = s(n, EMB, MLP)
      else:
        shapes[prefix + "DeepSeekMoeBlock_0-MoeBlock_0-gate-kernel"] = s(n, EMB, E)
        shapes[prefix + "DeepSeekMoeBlock_0-MoeBlock_0-wi_0"] = s(n, E, EMB, MOE)
        shapes[prefix + "DeepSeekMoeBlock_0-shared_experts-wi_0-kernel"] = s(n, EMB, 2 * MOE)
  return shapes


@pytest.mark.parametrize("scan_axis", [None, 1])
def test_deepseek_dimensions(scan_axis):
  dims = model_shapes.dimensions(_deepseek(scan_axis), param_scan_axis=scan_axis or 1)
  assert dims == {"vocab_size": VOCAB, "emb_dim": EMB, "scan_layers": scan_axis is not None, "num_decoder_layers": 4,
                  "first_num_dense_layers": 1, "kv_lora_rank": 16, "num_query_heads": NH, "num_kv_heads": NH,
                  "v_head_dim": 16, "qk_nope_head_dim": 32, "qk_rope_head_dim": 8, "q_lora_rank": 24, "mlp_dim": MLP,
                  "num_experts": E, "moe_mlp_dim": MOE, "shared_mlp_dim": 2 * MOE}
  wrong = model_shapes.config_dimensions(types.SimpleNamespace(first_num_dense_layers=2, kv_lora_rank=16,
                                                               num_experts=E))
  assert model_shapes.mismatches(dims, wrong) == [
      "first_num_dense_layers: checkpoint 1, config 2 (first_num_dense_layers)"]


def _config(**kw):
  return types.SimpleNamespace(**{**DENSE, "scan_layers": False, "num_experts": 1, "moe_mlp_dim": -1, **kw})


@pytest.mark.parametrize("wrong, words", [
    ({"num_decoder_layers": 2}, ["num_decoder_layers: checkpoint 4, config 2 (base_num_decoder_layers)"]),
    ({"num_query_heads": 2, "head_dim": 64}, ["num_query_heads: checkpoint 4, config 2", "head_dim: checkpoint 32, config 64"]),
    ({"mlp_dim": 256, "vocab_size": 512}, ["mlp_dim: checkpoint 128, config 256", "vocab_size: checkpoint 256, config 512"]),
    ({"scan_layers": True}, ["scan_layers: checkpoint false, config true"]),
])
def test_every_disagreement_is_named_with_both_values(wrong, words):
  got = "; ".join(model_shapes.mismatches(model_shapes.dimensions(_shapes()), model_shapes.config_dimensions(_config(**wrong))))
  assert all(w in got for w in words) and got.count(";") == len(words) - 1, got


def test_a_matching_config_and_an_moe_checkpoint_under_a_dense_config():
  assert model_shapes.mismatches(model_shapes.dimensions(_shapes()), model_shapes.config_dimensions(_config())) == []
  got = model_shapes.mismatches(model_shapes.dimensions(_shapes(moe=True)), model_shapes.config_dimensions(_config()))
  assert got == [f"num_experts: checkpoint {E} (an MoE model), config 1 (num_experts)",
                 f"moe_mlp_dim: checkpoint {MOE}, config -1 (base_moe_mlp_dim)"]
