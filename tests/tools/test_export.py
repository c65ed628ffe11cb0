"""``maxtext-nvfp4 export``: a tiny NVFP4 MaxText checkpoint -> ModelOpt's NVFP4 HF format.

One module-scoped fixture makes the checkpoint of a 3-layer GQA Llama (head_dim 32, so the query's sqrt(head_dim)
factor is not a power of two) with ``nvfp4_keep_last_layers=1`` -- MaxText's init tree with seeded distinct
values (tests/export_families.py; no training compile) -- then exports it.
The file is read back with a safetensors reader and an NVFP4 decoder written here from docs/export.md
(not the package's code), and checked against:
  * the format: every tensor's name, dtype and shape; fused groups (q/k/v, gate/up) sharing their scales;
    the two JSON configs vLLM reads;
  * the numerics: decoded weights == our TE-exact quantizer applied to the checkpoint's weights ("trained"
    below; converted to HF layout here, independently of the exporter), bit for bit; excluded modules ==
    bf16(trained);
  * the layout: an HF-order Llama forward (core.serving.llama_forward: modeling_llama's operations on
    HF names) of the decoded export == MaxText's own forward with the same weights put back in MaxText
    layout, to fp32 tolerance -- names, transposes, RoPE layout and query scaling must all be right;
  * errors: a bad path or an unsupported model is one line on stderr and exit code 2;
  * the checkpoint decides: a config that disagrees with its shapes is refused (export, eval-quantized);
    ``--out`` / ``--json`` are checked before any work; a re-export over an earlier one (config from the
    run's record, an HF tokenizer) replaces it whole, with a tokenizer that appends no EOS.
"""

import json
import os
import struct

import numpy as np
import pytest

import maxtext_nvfp4
import export_families
from maxtext_helpers import tiny_argv

maxtext_nvfp4.register()  # MaxText accepts quantization=nvfp4 (importing the package registers nothing)

pytestmark = pytest.mark.slow

MODEL = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=32, base_mlp_dim=128,
             base_num_decoder_layers=3, vocab_size=256)
NL, NH, NKV, HD, EMB, MLP, VOCAB = 3, 4, 2, 32, 64, 128, 256
TRAIN = dict(steps=2, enable_checkpointing=True, async_checkpointing=False, checkpoint_period=1,
             quantization="nvfp4", nvfp4_keep_last_layers=1, learning_rate=1e-2)
LINEARS = {"self_attn.q_proj": (NH * HD, EMB), "self_attn.k_proj": (NKV * HD, EMB), "self_attn.v_proj": (NKV * HD, EMB),
           "self_attn.o_proj": (EMB, NH * HD), "mlp.gate_proj": (MLP, EMB), "mlp.up_proj": (MLP, EMB),
           "mlp.down_proj": (EMB, MLP)}
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def _overrides(out, **extra):
  return tiny_argv(out, run_name="run", **{**MODEL, **TRAIN, **extra}, skip_jax_distributed_system=True)[2:]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import export  # pylint: disable=import-outside-toplevel

  out = str(tmp_path_factory.mktemp("export"))
  # The checkpoint a run of this config writes, without training it (tests/export_families.py: MaxText's
  # own init tree, every tensor distinct, saved as the Orbax params item at step 1); the export of a
  # checkpoint a training run wrote: tests/peers/test_serving_oracles.py.
  params = export_families.init_params(checkpoint.load_config(_overrides(out)), seed=0)
  os.makedirs(os.path.join(out, "run", "checkpoints"))
  export_families.save_checkpoint(params, os.path.join(out, "run", "checkpoints"), step=1)
  hf_dir = os.path.join(out, "hf")
  rc = export.cli_main([os.path.join(out, "run", "checkpoints"), "--out", hf_dir, "--calibration-batches", "2",
                        "--calibrate-on-synthetic", "--no-tokenizer", *_overrides(out)])
  assert rc == 0
  return {"out": out, "hf": hf_dir, "tensors": read_safetensors(os.path.join(hf_dir, "model.safetensors")),
          "trained": trained_params(os.path.join(out, "run", "checkpoints", "1", "items"))}


# ---- independent readers (from the safetensors spec and docs/export.md) ---------------------------
_DTYPES = {"U8": np.uint8, "F32": np.float32, "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn"}


def read_safetensors(path):
  """``{name: (dtype string, numpy array)}`` from the raw file: u64 header length, JSON header, data."""
  import ml_dtypes  # pylint: disable=import-outside-toplevel

  with open(path, "rb") as f:
    raw = f.read()
  n = struct.unpack("<Q", raw[:8])[0]
  header = json.loads(raw[8 : 8 + n])
  assert header.pop("__metadata__") == {"format": "pt"}
  out = {}
  for name, h in header.items():
    dt = _DTYPES[h["dtype"]]
    dt = getattr(ml_dtypes, dt) if isinstance(dt, str) else dt
    a, b = h["data_offsets"]
    out[name] = (h["dtype"], np.frombuffer(raw[8 + n + a : 8 + n + b], dtype=dt).reshape(h["shape"]))
  return out


def decode_nvfp4(weight, weight_scale, weight_scale_2):
  """fp32 [out, in]: low nibble = even element; bit 3 sign, bits 0-2 index into E2M1; then
  value * (float(weight_scale) * weight_scale_2) per 16-element block along the input dim."""
  nibbles = np.empty((weight.shape[0], weight.shape[1] * 2), np.uint8)
  nibbles[:, 0::2] = weight & 0x0F
  nibbles[:, 1::2] = weight >> 4
  values = E2M1[nibbles & 7] * np.where(nibbles & 8, np.float32(-1), np.float32(1))
  block = weight_scale.astype(np.float32) * np.float32(weight_scale_2)
  return (values.reshape(weight.shape[0], -1, 16) * block[:, :, None]).reshape(values.shape)


def trained_params(items):
  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel

  return checkpoint.read_params(items)


def nested(params):
  """``{"params-decoder-...": array}`` -> the checkpoint's ``{"params": {"decoder": ...}}`` tree."""
  tree: dict = {}
  for key, value in params.items():
    d = tree
    *parents, leaf = key.split("-")
    for part in parents:
      d = d.setdefault(part, {})
    d[leaf] = value
  return tree


def hf_layout(p, layer):
  """The trained MaxText kernels of one layer in HF ``[out, in]`` layout (written from HF's Llama
  convention: q scaled by sqrt(head_dim) because MaxText folds 1/sqrt(head_dim) into the query kernel)."""
  k = lambda name: p[f"params-decoder-layers_{layer}-{name}-kernel"]  # noqa: E731
  return {
      "self_attn.q_proj": (k("self_attention-query").reshape(EMB, NH * HD) * np.float32(np.sqrt(HD))).T,
      "self_attn.k_proj": k("self_attention-key").reshape(EMB, NKV * HD).T,
      "self_attn.v_proj": k("self_attention-value").reshape(EMB, NKV * HD).T,
      "self_attn.o_proj": k("self_attention-out").reshape(NH * HD, EMB).T,
      "mlp.gate_proj": k("mlp-wi_0").T, "mlp.up_proj": k("mlp-wi_1").T, "mlp.down_proj": k("mlp-wo").T,
  }


# ---- format ---------------------------------------------------------------------------------------
def test_every_tensor_has_the_documented_name_dtype_and_shape(exported):
  t = exported["tensors"]
  expected = {"model.embed_tokens.weight": ("BF16", (VOCAB, EMB)), "lm_head.weight": ("BF16", (VOCAB, EMB)),
              "model.norm.weight": ("BF16", (EMB,))}
  for i in range(NL):
    p = f"model.layers.{i}."
    expected[p + "input_layernorm.weight"] = ("BF16", (EMB,))
    expected[p + "post_attention_layernorm.weight"] = ("BF16", (EMB,))
    for name, (o, n) in LINEARS.items():
      if i == NL - 1:  # nvfp4_keep_last_layers=1: trained in bf16, exported in bf16
        expected[p + name + ".weight"] = ("BF16", (o, n))
        continue
      expected[p + name + ".weight"] = ("U8", (o, n // 2))
      expected[p + name + ".weight_scale"] = ("F8_E4M3", (o, n // 16))
      expected[p + name + ".weight_scale_2"] = ("F32", ())
      expected[p + name + ".input_scale"] = ("F32", ())
  assert {k: (d, a.shape) for k, (d, a) in t.items()} == expected


def test_fused_groups_share_their_global_scales_and_scales_are_positive(exported):
  t = exported["tensors"]
  for i in range(NL - 1):
    p = f"model.layers.{i}."
    for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
      for key in ("weight_scale_2", "input_scale"):
        vals = {float(t[f"{p}{g}.{key}"][1]) for g in group}
        assert len(vals) == 1 and all(np.isfinite(v) and v > 0 for v in vals), (p, group, key, vals)
    # different inputs, different calibrated scales (o_proj sees attention outputs, q_proj normed states)
    assert float(t[p + "self_attn.o_proj.input_scale"][1]) != float(t[p + "self_attn.q_proj.input_scale"][1])


def test_configs_are_what_vllms_modelopt_loader_reads(exported):
  with open(os.path.join(exported["hf"], "hf_quant_config.json"), encoding="utf-8") as f:
    legacy = json.load(f)
  with open(os.path.join(exported["hf"], "config.json"), encoding="utf-8") as f:
    config = json.load(f)
  excluded = ["lm_head", "model.embed_tokens"] + [f"model.layers.{NL - 1}.{n}" for n in LINEARS]
  # vLLM and TensorRT-LLM apply hf_quant_config.json alone only for producer "modelopt"
  assert legacy["producer"]["name"] == "modelopt" and legacy["producer"]["exporter"].startswith("maxtext-nvfp4")
  q = legacy["quantization"]
  assert q["quant_algo"] == "NVFP4" and q["group_size"] == 16 and q["kv_cache_quant_algo"] is None
  assert sorted(q["exclude_modules"]) == sorted(excluded)
  qc = config["quantization_config"]
  assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4" and sorted(qc["ignore"]) == sorted(excluded)
  assert qc["config_groups"]["group_0"]["weights"] == {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
  assert (config["architectures"], config["num_key_value_heads"], config["head_dim"]) == (["LlamaForCausalLM"], NKV, HD)
  assert (config["hidden_size"], config["intermediate_size"], config["vocab_size"]) == (EMB, MLP, VOCAB)
  # transformers 5 / ModelOpt keys (rope_theta kept for transformers-4 readers); no legacy torch_dtype/rope_scaling
  assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": config["rope_theta"]}
  assert config["dtype"] == "bfloat16" and "torch_dtype" not in config and "rope_scaling" not in config


# ---- numerics -------------------------------------------------------------------------------------
def test_decoded_export_is_our_nvfp4_of_the_trained_weights_bit_for_bit(exported):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.core import nvfp4  # pylint: disable=import-outside-toplevel

  t, p = exported["tensors"], exported["trained"]
  for i in range(NL - 1):
    hf = hf_layout(p, i)
    for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
                  ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)):
      fused = np.concatenate([hf[g] for g in group], axis=0)
      ref = np.asarray(nvfp4.dequantize(nvfp4.quantize(jnp.asarray(fused), axis=-1)))
      got = np.concatenate([decode_nvfp4(*(t[f"model.layers.{i}.{g}.{s}"][1] for s in
                                           ("weight", "weight_scale", "weight_scale_2"))) for g in group], axis=0)
      np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32), err_msg=f"layer {i} {group}")
      # and the quantization is not the identity: NVFP4 moved most weights
      assert np.mean(got != fused) > 0.5


def test_excluded_modules_are_bf16_of_the_trained_weights(exported):
  import ml_dtypes  # pylint: disable=import-outside-toplevel

  t, p = exported["tensors"], exported["trained"]
  bf16 = lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16)  # noqa: E731
  hf = hf_layout(p, NL - 1)
  for name in LINEARS:
    np.testing.assert_array_equal(t[f"model.layers.{NL - 1}.{name}.weight"][1], bf16(hf[name]))
  np.testing.assert_array_equal(t["lm_head.weight"][1], bf16(p["params-decoder-logits_dense-kernel"].T))
  np.testing.assert_array_equal(t["model.embed_tokens.weight"][1], bf16(p["params-token_embedder-embedding"]))
  np.testing.assert_array_equal(t["model.layers.0.input_layernorm.weight"][1],
                                bf16(p["params-decoder-layers_0-pre_self_attention_layer_norm-scale"]))


# ---- layout: HF-order forward of the export == MaxText's forward of the same weights ----------------
def _decoded_hf_weights(t):
  w = {}
  for name, (dtype, a) in t.items():
    if name.endswith(".weight") and dtype == "U8":
      base = name[: -len(".weight")]
      w[name] = decode_nvfp4(a, t[base + ".weight_scale"][1], t[base + ".weight_scale_2"][1])
    elif dtype == "BF16":
      w[name] = a.astype(np.float32)
  return w


def _to_maxtext(w):
  """HF [out, in] weights back to the MaxText checkpoint tree (inverse of hf_layout)."""
  d = {"token_embedder": {"embedding": w["model.embed_tokens.weight"]},
       "decoder": {"decoder_norm": {"scale": w["model.norm.weight"]},
                   "logits_dense": {"kernel": w["lm_head.weight"].T}}}
  for i in range(NL):
    g = lambda n: w[f"model.layers.{i}.{n}.weight"]  # noqa: E731
    d["decoder"][f"layers_{i}"] = {
        "pre_self_attention_layer_norm": {"scale": g("input_layernorm")},
        "post_self_attention_layer_norm": {"scale": g("post_attention_layernorm")},
        "self_attention": {
            "query": {"kernel": (g("self_attn.q_proj").T / np.float32(np.sqrt(HD))).reshape(EMB, NH, HD)},
            "key": {"kernel": g("self_attn.k_proj").T.reshape(EMB, NKV, HD)},
            "value": {"kernel": g("self_attn.v_proj").T.reshape(EMB, NKV, HD)},
            "out": {"kernel": g("self_attn.o_proj").T.reshape(NH, HD, EMB)}},
        "mlp": {"wi_0": {"kernel": g("mlp.gate_proj").T}, "wi_1": {"kernel": g("mlp.up_proj").T},
                "wo": {"kernel": g("mlp.down_proj").T}}}
  return {"params": d}


def test_hf_forward_of_the_export_matches_maxtexts_forward_of_the_same_weights(exported):
  from maxtext_nvfp4.core import serving  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import hf_conversion  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import model_shapes  # pylint: disable=import-outside-toplevel

  with open(os.path.join(exported["hf"], "config.json"), encoding="utf-8") as f:
    c = json.load(f)
  w = _decoded_hf_weights(exported["tensors"])
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 64))
  shape = serving.LlamaShape(num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
                             num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                             rms_norm_eps=c["rms_norm_eps"], rope_theta=c["rope_parameters"]["rope_theta"])
  import jax  # pylint: disable=import-outside-toplevel

  forward = jax.jit(lambda w, t: serving.llama_forward(w, shape, t)[0])  # compiled, not op by op (twice below)
  hf_logits = np.asarray(forward(w, tokens))
  config = checkpoint.load_config(_overrides(exported["out"], quantization="", dtype="float32",
                                             matmul_precision="highest"))
  mt_logits = checkpoint.maxtext_logits(config, _to_maxtext(w), tokens)
  assert np.abs(hf_logits).max() > 1.0
  np.testing.assert_allclose(hf_logits, mt_logits, atol=2e-4 * np.abs(mt_logits).max(), rtol=0)
  # The round trip above cannot see a layout error that hf_layout and its inverse share (e.g. the same
  # permutation of q and k rows). Ground truth: MaxText's forward of the trained checkpoint itself vs the
  # HF forward of the exporter's conversion of it, and that conversion is hf_layout bit for bit (the
  # layout the bit-for-bit test quantizes).
  items = checkpoint.find_items(os.path.join(exported["out"], "run", "checkpoints"))
  model = hf_conversion.to_hf(items, config, model_shapes.check(items, config))
  for i in range(NL):
    for name, a in hf_layout(exported["trained"], i).items():
      np.testing.assert_array_equal(model.tensors[f"model.layers.{i}.{name}.weight"], a, err_msg=name)
  mt_trained = checkpoint.maxtext_logits(config, nested(exported["trained"]), tokens)
  hf_trained = np.asarray(forward(dict(model.tensors), tokens))
  np.testing.assert_allclose(hf_trained, mt_trained, atol=2e-4 * np.abs(mt_trained).max(), rtol=0)


# ---- errors ---------------------------------------------------------------------------------------
def test_bad_checkpoint_path_is_one_line_and_exit_2(exported, tmp_path, capsys):
  from maxtext_nvfp4.tools import export  # pylint: disable=import-outside-toplevel

  assert export.cli_main([str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "no such directory" in err[0] and "nope" in err[0]
  assert export.cli_main([str(tmp_path), "--out", str(tmp_path / "o")]) == 2  # a dir with no checkpoint
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "no committed MaxText checkpoint" in err[0]


def test_unsupported_model_is_one_line_and_exit_2(exported, tmp_path, capsys):
  from maxtext_nvfp4.tools import export  # pylint: disable=import-outside-toplevel

  ckpt = os.path.join(exported["out"], "run", "checkpoints")
  rc = export.cli_main([ckpt, "--out", str(tmp_path / "o"), *_overrides(exported["out"]), "fused_qkv=true"])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and len(err) == 1 and "unsupported model" in err[0] and "fused_qkv" in err[0], err
  assert not os.path.exists(tmp_path / "o")


# ---- eval-quantized ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def evaluated(exported):
  from maxtext_nvfp4.core import serving  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import eval_quantized  # pylint: disable=import-outside-toplevel

  out = exported["out"]
  path = os.path.join(out, "eval.json")
  assert eval_quantized.cli_main([os.path.join(out, "run", "checkpoints"), "--eval-batches", "2", "--json", path,
                                  *_overrides(out)]) == 0
  with open(path, encoding="utf-8") as f:
    result = json.load(f)
  # MaxText's own eval loss of the checkpoint on the same batches: its forward (bf16 compute, as the run
  # trained) and its loss (cross-entropy over targets_segmentation != 0, summed / token count).
  config = checkpoint.load_config(_overrides(out, quantization=""))
  tree = nested(exported["trained"])
  total, count = 0.0, 0.0
  for b in checkpoint.eval_batches(config, 2):
    logits = checkpoint.maxtext_logits(config, tree, b["inputs"], b["inputs_position"], b["inputs_segmentation"])
    s, n = serving.token_losses(logits, b["targets"], b["targets_segmentation"])
    total, count = total + float(s), count + float(n)
  return {"result": result, "maxtext_loss": total / count, "maxtext_tokens": count}


def test_eval_quantized_bf16_mode_is_maxtexts_eval_loss(evaluated):
  r = evaluated["result"]
  assert r["tokens"] == evaluated["maxtext_tokens"] > 0
  # bf16 GEMM operands here (fp32 elsewhere) vs MaxText's bf16 activations everywhere: equal to bf16
  # tolerance (2**-8 = 0.4% per value; measured 0.24% of the loss). A wrong name, layout or norm moves
  # the loss by tens of percent (the untrained model's loss is ~ln(256) = 5.5).
  assert abs(r["losses"]["bf16"] - evaluated["maxtext_loss"]) < 1e-2 * evaluated["maxtext_loss"], (r, evaluated)


def test_eval_quantized_low_precision_modes_differ_and_are_finite(evaluated):
  losses = evaluated["result"]["losses"]
  assert set(losses) == {"bf16", "nvfp4-w4a16", "nvfp4-w4a4", "fp8"}
  assert all(np.isfinite(v) for v in losses.values())
  for mode in ("nvfp4-w4a16", "nvfp4-w4a4", "fp8"):
    assert losses[mode] != losses["bf16"], mode
  # quantizing the activations too changes the loss again
  assert losses["nvfp4-w4a4"] != losses["nvfp4-w4a16"]
  assert evaluated["result"]["served_linears"] == 7 * (NL - 1)  # the kept last layer is not served in NVFP4


def test_eval_quantized_bad_checkpoint_is_one_line_and_exit_2(tmp_path, capsys):
  from maxtext_nvfp4.tools import eval_quantized  # pylint: disable=import-outside-toplevel

  assert eval_quantized.cli_main([str(tmp_path / "missing")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("maxtext-nvfp4 eval-quantized: error:") and "missing" in err[0]


# ---- the checkpoint decides; outputs checked first ----------------------------------------------------
WRONG_CONFIGS = [  # the two cases; every dimension kind: tests/tools/test_model_shapes.py
    ("fewer-layers", {"base_num_decoder_layers": 2}, ["num_decoder_layers: checkpoint 3, config 2"]),
    ("re-split-heads", {"base_num_query_heads": 2, "base_num_kv_heads": 1, "head_dim": 64},
     ["num_query_heads: checkpoint 4, config 2", "num_kv_heads: checkpoint 2, config 1", "head_dim: checkpoint 32, config 64"]),
    # same shapes, another architecture: a tensor it needs is missing, or one it would not load is there (these
    # exported with exit code 0 before)
    ("lacks-qk-norms", {"model_name": "qwen3-0.6b", "override_model_config": True},
     ["has nothing for model.layers.0.self_attn.q_norm.weight", "Qwen3ForCausalLM needs", "--config"]),
    ("lacks-biases", {"model_name": "qwen2.5-1.5b", "override_model_config": True},
     ["has nothing for model.layers.0.self_attn.q_proj.bias", "9 tensor(s)", "Qwen2ForCausalLM"]),
    ("extra-lm-head", {"logits_via_embedding": True, "normalize_embedding_logits": False},
     ["has lm_head.weight", "LlamaForCausalLM does not load"]),
]


def _one_line_error(capsys, prefix):
  err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
  assert len(err) == 1 and err[0].startswith(prefix) and "Traceback" not in err[0], err
  return err[0]


@pytest.mark.parametrize("row, extra, words", WRONG_CONFIGS, ids=[r[0] for r in WRONG_CONFIGS])
def test_a_config_that_disagrees_with_the_checkpoint_is_refused(exported, tmp_path, capsys, row, extra, words):
  from maxtext_nvfp4.tools import export  # pylint: disable=import-outside-toplevel

  ckpt = os.path.join(exported["out"], "run", "checkpoints")
  rc = export.cli_main([ckpt, "--out", str(tmp_path / "o"), "--calibrate-on-synthetic", "--no-tokenizer",
                        *_overrides(exported["out"], **extra)])
  line = _one_line_error(capsys, "maxtext-nvfp4 export: error: checkpoint")
  assert rc == 2 and all(w in line for w in words), line
  assert os.listdir(tmp_path) == []


def test_eval_quantized_refuses_a_config_that_disagrees_with_the_checkpoint(exported, tmp_path, capsys):
  from maxtext_nvfp4.tools import eval_quantized  # pylint: disable=import-outside-toplevel

  ckpt = os.path.join(exported["out"], "run", "checkpoints")
  rc = eval_quantized.cli_main([ckpt, "--json", str(tmp_path / "r.json"),
                                *_overrides(exported["out"], base_num_decoder_layers=2)])
  line = _one_line_error(capsys, "maxtext-nvfp4 eval-quantized: error: checkpoint")
  assert rc == 2 and "num_decoder_layers: checkpoint 3, config 2" in line and os.listdir(tmp_path) == []


OUT_ROWS = [  # (row, how to make --out, words); each refused before the checkpoint is opened
    ("out-is-a-file", "file", ["is a file, not a folder"]),
    ("out-parent-missing", "no-parent", ["parent folder", "does not exist"]),
    ("out-not-writable", "read-only", ["is not writable"]),
    ("out-foreign-folder", "foreign", ["exists and is not a maxtext-nvfp4 export", "choose a new folder"]),
]


@pytest.mark.parametrize("row, setup, words", OUT_ROWS, ids=[r[0] for r in OUT_ROWS])
def test_export_out_is_checked_before_any_work(tmp_path, monkeypatch, capsys, row, setup, words):
  from maxtext_nvfp4.tools import export  # pylint: disable=import-outside-toplevel

  out = tmp_path / "o"
  if setup == "file":
    out.write_text("x")
  elif setup == "no-parent":
    out = tmp_path / "missing" / "o"
  elif setup == "foreign":
    out.mkdir()
    (out / "keep.txt").write_text("mine")
  else:  # simulated (root writes everywhere)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if str(p) == str(tmp_path) else real(p, m))
  before = sorted(os.walk(tmp_path))
  # a checkpoint that does not exist: the --out line must come first, before anything is opened
  assert export.cli_main([str(tmp_path / "no_checkpoint"), "--out", str(out)]) == 2
  line = _one_line_error(capsys, f"maxtext-nvfp4 export: error: --out {out}")
  assert all(w in line for w in words), line
  assert sorted(os.walk(tmp_path)) == before


def test_eval_quantized_json_is_checked_before_any_work(tmp_path, capsys):
  from maxtext_nvfp4.tools import eval_quantized  # pylint: disable=import-outside-toplevel

  for bad, word in ((tmp_path / "nodir" / "r.json", "does not exist"), (tmp_path, "is a folder")):
    assert eval_quantized.cli_main([str(tmp_path / "no_checkpoint"), "--json", str(bad)]) == 2
    assert word in _one_line_error(capsys, f"maxtext-nvfp4 eval-quantized: error: --json {bad}")
  assert os.listdir(tmp_path) == []


def test_synthetic_calibration_data_is_refused_unless_asked(exported, tmp_path, capsys):
  from maxtext_nvfp4.tools import export  # pylint: disable=import-outside-toplevel

  ckpt = os.path.join(exported["out"], "run", "checkpoints")
  assert export.cli_main([ckpt, "--out", str(tmp_path / "o"), "--no-tokenizer", *_overrides(exported["out"])]) == 2
  line = _one_line_error(capsys, "maxtext-nvfp4 export: error: calibration data")
  assert "dataset_type=synthetic" in line and "--calibrate-on-synthetic" in line and os.listdir(tmp_path) == []
  assert export.cli_main([ckpt, "--out", str(tmp_path / "o"), "--calibration-batches", "0"]) == 2
  line = _one_line_error(capsys, "maxtext-nvfp4 export: error: argument --calibration-batches")
  assert ">= 1" in line


def test_unreadable_calibration_data_names_no_refused_option(exported, tmp_path, capsys):
  from maxtext_nvfp4.tools import export  # pylint: disable=import-outside-toplevel

  ckpt = os.path.join(exported["out"], "run", "checkpoints")
  rc = export.cli_main([ckpt, "--out", str(tmp_path / "o"), "--no-tokenizer", "--calibration-batches", "1",
                        *_overrides(exported["out"], dataset_type="grain", grain_file_type="parquet",
                                    grain_train_files=str(tmp_path / "none-*.parquet"), grain_worker_count=0)])
  line = _one_line_error(capsys, "maxtext-nvfp4 export: error: calibration data")
  assert rc == 2 and "--calibration-batches 0" not in line and "dataset_type" in line, line
  assert os.listdir(tmp_path) == []


def _word_tokenizer(folder):
  """A tiny HF tokenizer as prepare-data writes one (post-processor ``<s> $A </s>``, add_eos_token true)
  with non-default special ids (<s> = 5, </s> = 6), so ids copied from the tokenizer are visible."""
  from tokenizers import Tokenizer, models, pre_tokenizers, processors  # pylint: disable=import-outside-toplevel

  vocab = {"<unk>": 0, "hello": 1, "world": 2, "a": 3, "b": 4, "<s>": 5, "</s>": 6, "<pad>": 7}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.add_special_tokens(["<s>", "</s>", "<pad>"])
  tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", pair="<s> $A </s> <s> $B </s>",
                                                     special_tokens=[("<s>", 5), ("</s>", 6)])
  os.makedirs(folder)
  tok.save(os.path.join(folder, "tokenizer.json"))
  with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
               "pad_token": "<pad>", "add_bos_token": True, "add_eos_token": True}, f)


def test_reexport_from_the_runs_record_replaces_the_earlier_export_whole(exported, tmp_path, capsys):
  """No --config: the run's record decides; the earlier export (plus stale shards) is replaced as a whole;
  the tokenizer serves: BOS, no EOS, ids from the tokenizer in config.json and generation_config.json."""
  import shutil  # pylint: disable=import-outside-toplevel
  import stat  # pylint: disable=import-outside-toplevel

  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.tools import export  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import run_record  # pylint: disable=import-outside-toplevel
  from maxtext_helpers import BASE_YML  # pylint: disable=import-outside-toplevel

  run = tmp_path / "run"
  shutil.copytree(os.path.join(exported["out"], "run", "checkpoints"), run / "checkpoints")
  _word_tokenizer(str(tmp_path / "tok"))
  args = [BASE_YML, *_overrides(exported["out"], tokenizer_type="huggingface", tokenizer_path=str(tmp_path / "tok"))]
  with open(run / run_record.RECORD, "w", encoding="utf-8") as f:
    json.dump({"format": run_record.FORMAT, "maxtext_nvfp4": "test", "args": args, "model": {}}, f)
  hf = tmp_path / "hf"
  shutil.copytree(exported["hf"], hf)
  for stale in ("model-00001-of-00002.safetensors", "model.safetensors.index.json"):
    (hf / stale).write_text("stale")
  capsys.readouterr()
  assert export.cli_main([str(run / "checkpoints"), "--out", str(hf), "--calibration-batches", "1",
                          "--calibrate-on-synthetic"]) == 0
  err = capsys.readouterr().err
  assert f"config from {run / run_record.RECORD}" in err and "dataset_type=synthetic" in err
  assert sorted(os.listdir(hf)) == sorted(["model.safetensors", "config.json", "hf_quant_config.json", export.MARKER,
                                           "tokenizer.json", "tokenizer_config.json", "generation_config.json"])
  assert sorted(n for n in os.listdir(tmp_path) if n.startswith(".")) == []
  assert all(stat.S_IMODE(os.stat(hf / n).st_mode) == 0o644 for n in os.listdir(hf))
  with open(hf / "config.json", encoding="utf-8") as f:
    config = json.load(f)
  with open(hf / "generation_config.json", encoding="utf-8") as f:
    generation = json.load(f)
  with open(hf / "tokenizer_config.json", encoding="utf-8") as f:
    tok_cfg = json.load(f)
  assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (5, 6, 7)
  assert (generation["bos_token_id"], generation["eos_token_id"]) == (5, 6)
  assert tok_cfg["add_eos_token"] is False and tok_cfg["add_bos_token"] is True
  assert Tokenizer.from_file(str(hf / "tokenizer.json")).encode("hello world").ids == [5, 1, 2]
  # the same weights as the first export (the record holds the same config)
  assert read_safetensors(str(hf / "model.safetensors")).keys() == exported["tensors"].keys()
