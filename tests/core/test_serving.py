"""core/serving.py without MaxText: the ModelOpt NVFP4 byte layout on hand-built weights, fused-group
scale sharing, the serving modes' activation quantization, and the reference forward's calibration amax.
Pure functions, a few seconds in all (the MaxText end-to-end checks are in test_export.py)."""

import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_nvfp4.core import nvfp4
from maxtext_nvfp4.core import serving


def test_byte_layout_matches_the_documented_nibble_order_and_codes():
  # amax 6 -> S_enc = 448; every block's amax is 6 -> s8 = 448, encode factor exactly 1: q = the values.
  row = np.array([1.5, -2, 0, 6, 0.5, -6, 3, -0.5, 4, 1, -1, 2, -3, -4, 6, -1.5], np.float32)
  w = np.stack([row, row[::-1]])  # [2, 16]
  (lin,) = serving.quantize_linears([w])
  assert lin.weight.dtype == np.uint8 and lin.weight.shape == (2, 8)
  # code = sign << 3 | index into (0, .5, 1, 1.5, 2, 3, 4, 6); element 2i in the low nibble
  index = {0: 0, 0.5: 1, 1: 2, 1.5: 3, 2: 4, 3: 5, 4: 6, 6: 7}
  codes = np.array([[(8 if v < 0 else 0) | index[abs(float(v))] for v in r] for r in w], np.uint8)
  np.testing.assert_array_equal(lin.weight, codes[:, 0::2] | (codes[:, 1::2] << 4))
  assert lin.weight[0, 0] == 0xC3  # (-2 -> 0b1100) << 4 | (1.5 -> 0b0011)
  assert lin.weight_scale.dtype == jnp.float8_e4m3fn and lin.weight_scale.shape == (2, 1)
  assert float(lin.weight_scale.astype(np.float32)[0, 0]) == 448.0
  assert lin.weight_scale_2.dtype == np.float32 and lin.weight_scale_2.shape == ()
  assert float(lin.weight_scale_2) == np.float32(6) / np.float32(2688)


def test_a_fused_group_is_the_quantization_of_its_row_concatenation():
  rng = np.random.default_rng(0)
  q, k, v = (rng.normal(size=(n, 32)).astype(np.float32) * s for n, s in ((64, 1.0), (32, 3.0), (32, 0.2)))
  lins = serving.quantize_linears([q, k, v])
  ref = nvfp4.quantize(jnp.asarray(np.concatenate([q, k, v])), axis=-1)
  np.testing.assert_array_equal(np.concatenate([x.weight for x in lins]), np.asarray(nvfp4.pack(ref.data)))
  np.testing.assert_array_equal(np.concatenate([x.weight_scale.astype(np.float32) for x in lins]),
                                np.asarray(ref.scale.astype(jnp.float32)))
  # one global scale: the group's amax (k's) / 2688, not each shard's own
  assert {float(x.weight_scale_2) for x in lins} == {float(np.abs(k).max() / np.float32(2688))}
  assert float(serving.quantize_linears([q])[0].weight_scale_2) < float(lins[0].weight_scale_2)


def test_linear_units_group_what_engines_fuse():
  names = [f"model.layers.0.{n}" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                            "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
  assert [len(u) for u in serving.linear_units(names)] == [3, 1, 2, 1]
  assert serving.linear_units(names)[0] == names[:3]


def test_input_scale_is_amax_over_2688_in_fp32():
  assert serving.input_scale(13.5).dtype == np.float32
  assert float(serving.input_scale(13.5)) == np.float32(13.5) / np.float32(2688)


def test_w4a4_activations_get_one_global_scale_per_token():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(2, 3, 32)).astype(np.float32)
  act = serving.served_activations("nvfp4-w4a4")
  y = np.asarray(act(jnp.asarray(x)))
  big = x.copy()
  big[0, 1] *= 1024  # one token 2**10 larger: its own amax, so the others' quantization is unchanged
  y_big = np.asarray(act(jnp.asarray(big)))
  keep = np.ones((2, 3), bool)
  keep[0, 1] = False
  np.testing.assert_array_equal(y_big[keep], y[keep])
  np.testing.assert_array_equal(y_big[0, 1], y[0, 1] * 1024)  # power-of-two scaling commutes exactly
  assert not np.array_equal(y, x)
  # a per-tensor scale would have crushed the small tokens: check the contrast is real
  per_tensor = np.asarray(nvfp4.dequantize(nvfp4.quantize(jnp.asarray(big.reshape(-1, 32)), axis=-1))).reshape(big.shape)
  assert not np.array_equal(per_tensor[keep], y[keep])


@pytest.mark.parametrize("mode", serving.SERVING_MODES)
def test_served_weights_touch_only_the_served_linears(mode):
  rng = np.random.default_rng(2)
  t = {"a.o_proj.weight": rng.normal(size=(16, 32)).astype(np.float32),
       "a.down_proj.weight": rng.normal(size=(32, 16)).astype(np.float32)}
  out = serving.served_weights(t, ["a.o_proj"], mode)
  assert out["a.down_proj.weight"] is t["a.down_proj.weight"]
  assert not np.array_equal(out["a.o_proj.weight"], t["a.o_proj.weight"])
  np.testing.assert_allclose(out["a.o_proj.weight"], t["a.o_proj.weight"], rtol=0.5, atol=0.5)


def test_served_weights_rejects_an_unknown_mode():
  with pytest.raises(ValueError, match="unknown serving mode 'int4'"):
    serving.served_weights({"a.o_proj.weight": np.zeros((16, 16), np.float32)}, ["a.o_proj"], "int4")


def test_forward_records_each_linears_input_amax():
  rng = np.random.default_rng(3)
  emb, nh, hd, mlp, vocab = 32, 2, 16, 64, 50
  w = {"model.embed_tokens.weight": rng.normal(size=(vocab, emb)), "model.norm.weight": np.ones(emb),
       "lm_head.weight": rng.normal(size=(vocab, emb))}
  p = "model.layers.0."
  for name, shape in (("self_attn.q_proj", (nh * hd, emb)), ("self_attn.k_proj", (nh * hd, emb)),
                      ("self_attn.v_proj", (nh * hd, emb)), ("self_attn.o_proj", (emb, nh * hd)),
                      ("mlp.gate_proj", (mlp, emb)), ("mlp.up_proj", (mlp, emb)), ("mlp.down_proj", (emb, mlp))):
    w[p + name + ".weight"] = rng.normal(size=shape) * 0.1
  w[p + "input_layernorm.weight"] = np.full(emb, 2.0)
  w[p + "post_attention_layernorm.weight"] = np.ones(emb)
  shape = serving.LlamaShape(num_layers=1, num_heads=nh, num_kv_heads=nh, head_dim=hd, rms_norm_eps=1e-5,
                             rope_theta=10000.0)
  tokens = rng.integers(0, vocab, (2, 8))
  logits, amax = serving.llama_forward(w, shape, tokens)
  assert logits.shape == (2, 8, vocab)
  # q/k/v see the first RMSNorm's output: emb rows normalized, times the norm weight 2
  h = w["model.embed_tokens.weight"][tokens]
  normed = 2.0 * h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + 1e-5)
  for n in ("q_proj", "k_proj", "v_proj"):
    np.testing.assert_allclose(float(amax[p + "self_attn." + n]), np.abs(normed).max(), rtol=1e-5)
  assert len(amax) == 7
