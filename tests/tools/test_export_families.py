"""Export by architecture: every exported family converts to what MaxText's own forward computes; the two
formats, sharding, weights-only; an unsupported family is one line.

The checkpoints are MaxText's init shapes with seeded values (tests/export_families.py: no training). The
ground truth is MaxText's forward (``model.apply`` of its model, fp32) of the checkpoint against our HF-order
forward (``core.hf_forward``, what ``eval-quantized`` runs and what the peer oracles check against
transformers) of the checkpoint converted by MaxText's own mappings: equal to 2e-5 of max|logits| (fp32
op-order differences; measured <= 2.2e-6; gemma 9.2e-7, olmo3 8.2e-7, scanned olmo3 1.2e-6, llama4 6.3e-7).
One exception, MaxText's: with tied embeddings its logits use the embedding table cast to bf16
(``embeddings.attend_on_embedding``), so ours is given that table as ``lm_head`` -- which is also what a served
model has, the export writing embeddings in bf16. A conversion-style layout error, and for gemma, gemma2,
gemma3, deepseek, olmo3 and llama4 each of the family's own operations turned off in our forward
(``_OPERATIONS``; llama4's temperature tuning and router score placement: their own test), moves the logits
> 100x the tolerance: the tiny configs exercise them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import struct

import ml_dtypes
import numpy as np
import pytest

import export_families

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  work = str(tmp_path_factory.mktemp("families"))
  return {f: export_families.make(f, os.path.join(work, f)) for f in export_families.FAMILIES}


def _matches_maxtexts_forward(label, d, weights, shape, tokens):
  """Our HF-order forward of ``weights`` equals MaxText's ``model.apply`` of checkpoint ``d`` (fp32) to 2e-5 of
  max|logits| on ``tokens``; returns (MaxText's logits, that max) for the checks that follow."""
  import jax  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.core import hf_forward  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel

  ours = np.asarray(jax.jit(lambda w, t: hf_forward.decoder_forward(w, shape, t)[0])(weights, tokens))
  config = checkpoint.load_config(d["overrides"] + ["dtype=float32", "matmul_precision=highest"])
  theirs = checkpoint.maxtext_logits(config, d["params"], tokens)
  scale = np.abs(theirs).max()
  np.testing.assert_allclose(ours, theirs, atol=2e-5 * scale, rtol=0)
  print(f"{label}: ours vs MaxText: max |diff| / max |logits| = {np.abs(ours - theirs).max() / scale:.3g}")
  return theirs, scale


@pytest.mark.parametrize("family", list(export_families.FAMILIES))
def test_the_conversion_computes_what_maxtexts_forward_computes(checkpoints, family):
  from maxtext_nvfp4.core import hf_forward  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import hf_conversion  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import model_shapes  # pylint: disable=import-outside-toplevel

  d = checkpoints[family]
  items = checkpoint.find_items(d["ckpt"])
  model = hf_conversion.to_hf(items, d["config"], model_shapes.check(items, d["config"]))
  w = dict(model.tensors)
  if model.hf_config["tie_word_embeddings"]:
    assert "lm_head.weight" not in w
    w["lm_head.weight"] = w["model.embed_tokens.weight"].astype(ml_dtypes.bfloat16).astype(np.float32)
  tokens = np.random.default_rng(1).integers(0, 256, (2, 32))
  theirs, scale = _matches_maxtexts_forward(family, d, w, model.shape, tokens)
  assert scale > 1.0
  # a real check: a layout error of the kind a conversion makes (a transposed-then-reshaped projection)
  # moves the logits far beyond the tolerance
  bad = dict(w)
  name = next(n for n in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.q_b_proj.weight")
              if n in w)  # MLA: the query's up-projection
  q = bad[name]
  bad[name] = q.reshape(-1, 2, q.shape[1] // 2).transpose(1, 0, 2).reshape(q.shape)
  moved = np.asarray(hf_forward.decoder_forward(bad, model.shape, tokens)[0])
  assert np.abs(moved - theirs).max() > 100 * 2e-5 * scale
  # and each of the family's own operations shows: the forward without it is as far off
  for op, off in _OPERATIONS.get(family, {}).items():
    moved = np.asarray(hf_forward.decoder_forward(w, off(model.shape), tokens)[0])
    assert np.abs(moved - theirs).max() > 100 * 2e-5 * scale, op


def _off(**fields):
  """The shape with top-level ``fields`` replaced (``moe__x`` / ``mla__x`` / ``yarn__x``: nested fields)."""
  def apply(shape):
    top = {k: v for k, v in fields.items() if "__" not in k}
    moe = {k[5:]: v for k, v in fields.items() if k.startswith("moe__")}
    mla = {k[5:]: v for k, v in fields.items() if k.startswith("mla__")}
    yarn = {k[6:]: v for k, v in fields.items() if k.startswith("yarn__")}
    if moe:
      top["moe"] = dataclasses.replace(shape.moe, **moe)
    if mla or yarn:
      top["mla"] = dataclasses.replace(shape.mla, **mla, **({"yarn": dataclasses.replace(shape.mla.yarn, **yarn)}
                                                            if yarn else {}))
    return dataclasses.replace(shape, **top)
  return apply


# family -> its own operations, each as the forward's shape with that operation turned off
_OPERATIONS = {
    "gemma": {"(1 + w) norms": _off(norm_plus_one=False), "embedding scale": _off(scale_embeddings=False),
              "gelu-tanh": _off(activation="silu")},
    "gemma2": {"window": _off(sliding_layers=()), "attention soft-cap": _off(attn_softcap=None),
               "final soft-cap": _off(final_softcap=None), "(1 + w) norms": _off(norm_plus_one=False)},
    # (gemma3's query_pre_attn_scalar is head_dim's at this size: not a distinct operation here)
    "gemma3": {"window": _off(sliding_layers=()), "global layers' linear RoPE": _off(rope_linear_factor=1.0),
               "local RoPE base": _off(local_rope_theta=None), "q/k norms": _off(qk_norm=False),
               "embedding scale": _off(scale_embeddings=False)},
    "deepseek": {"routed_scaling_factor": _off(moe__routed_scaling_factor=1.0),
                 "expert groups": _off(moe__n_group=1, moe__topk_group=1),
                 "shared experts": _off(moe__shared_experts=False),
                 "YaRN frequencies": _off(yarn__factor=1.0), "mscale": _off(yarn__mscale=0.0)},
    # (its post-norm-only layers and full-width q/k norms have no "off" in the same weights: the comparison
    # with MaxText's forward above is their check)
    "olmo3": {"window": _off(sliding_layers=()), "YaRN frequencies": _off(rope_yarn=None),
              "YaRN cos/sin scale": _off(rope_attention_factor=1.0), "q/k norms": _off(qk_norm=False)},
    # (its llama3 RoPE frequencies only change wavelengths > 2048 tokens, which chunks of 8 cannot show:
    # checked against MaxText's LLaMARotaryEmbedding directly in the llama4 test below)
    "llama4": {"NoPE layer": _off(nope_layers=()), "chunked attention": _off(attention_chunk_size=0),
               "L2 q/k norm": _off(qk_l2_norm=False), "interleaved RoPE pairs": _off(rope_interleaved=False),
               "shared expert": _off(moe__shared_experts=False), "router score": _off(moe__scoring="softmax")},
}


def _header(path):
  with open(path, "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    return json.loads(f.read(n))


@pytest.fixture(scope="module")
def moe_exports(checkpoints):
  """qwen3_moe exported three ways: ModelOpt W4A4 sharded, compressed-tensors W4A4, compressed-tensors W4A16."""
  from maxtext_nvfp4.tools import export  # pylint: disable=import-outside-toplevel

  d = checkpoints["qwen3_moe"]
  base = os.path.dirname(d["ckpt"].rstrip("/"))
  runs = {"modelopt": ["--format", "modelopt", "--max-shard-size", "48KB"],
          "ct": ["--format", "compressed-tensors"],
          "ct-w4a16": ["--format", "compressed-tensors", "--weights-only"]}
  out = {}
  for name, flags in runs.items():
    out[name] = os.path.join(base, f"hf_{name}")
    assert export.cli_main([d["ckpt"], "--out", out[name], "--calibration-batches", "1", "--calibrate-on-synthetic",
                            "--no-tokenizer", *flags, *d["overrides"]]) == 0, name
  return out


def _tensors(folder):
  """``{name: (dtype, shape, file)}`` over every safetensors file of an export."""
  out = {}
  for f in sorted(os.listdir(folder)):
    if f.endswith(".safetensors"):
      h = _header(os.path.join(folder, f))
      assert h.pop("__metadata__") == {"format": "pt"}
      out.update({k: (v["dtype"], tuple(v["shape"]), f) for k, v in h.items()})
  return out


def test_a_sharded_export_has_an_index_that_covers_every_tensor_once(moe_exports):
  folder = moe_exports["modelopt"]
  files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
  assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
  with open(os.path.join(folder, "model.safetensors.index.json"), encoding="utf-8") as f:
    index = json.load(f)
  t = _tensors(folder)
  assert index["weight_map"] == {k: v[2] for k, v in t.items()}
  sizes = {f: os.path.getsize(os.path.join(folder, f)) for f in files}
  data = sum(e - b for f in files for k, v in _header(os.path.join(folder, f)).items() if k != "__metadata__"
             for b, e in [v["data_offsets"]])
  assert index["metadata"]["total_size"] == data
  # every shard but the one holding an oversized tensor stays within the limit (48 KB of tensor data)
  assert sum(1 for f in files if sizes[f] > 48_000 + 8 + 16_000) <= 1
  assert all(stat.S_IMODE(os.stat(os.path.join(folder, n)).st_mode) == 0o644 for n in os.listdir(folder))
  # per-expert NVFP4 linears under Qwen3-MoE's names; the router is bf16 and excluded
  p = "model.layers.0.mlp."
  assert t[p + "experts.3.down_proj.weight"][:2] == ("U8", (64, 32))
  assert t[p + "experts.3.gate_proj.weight_scale"][:2] == ("F8_E4M3", (64, 4))
  assert t[p + "gate.weight"][:2] == ("BF16", (4, 64))
  with open(os.path.join(folder, "hf_quant_config.json"), encoding="utf-8") as f:
    q = json.load(f)["quantization"]
  assert q["quant_algo"] == "NVFP4" and {"lm_head", "model.embed_tokens", "model.layers.0.mlp.gate"} <= set(
      q["exclude_modules"])


def test_compressed_tensors_is_the_same_quantization_under_its_names(moe_exports):
  mo, ct = {}, {}
  for folder, into in ((moe_exports["modelopt"], mo), (moe_exports["ct"], ct)):
    for f in os.listdir(folder):
      if f.endswith(".safetensors"):
        into.update(_raw(os.path.join(folder, f)))
  n = "model.layers.1.mlp.experts.2.up_proj"
  np.testing.assert_array_equal(ct[n + ".weight_packed"], mo[n + ".weight"])
  np.testing.assert_array_equal(ct[n + ".weight_scale"].view(np.uint8), mo[n + ".weight_scale"].view(np.uint8))
  assert ct[n + ".weight_global_scale"].shape == (1,) and mo[n + ".weight_scale_2"].shape == ()
  assert ct[n + ".weight_global_scale"][0] == np.float32(1) / mo[n + ".weight_scale_2"]
  assert ct[n + ".input_global_scale"][0] == np.float32(1) / mo[n + ".input_scale"]
  with open(os.path.join(moe_exports["ct"], "config.json"), encoding="utf-8") as f:
    qc = json.load(f)["quantization_config"]
  assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
  assert qc["config_groups"]["config_group_0"]["input_activations"]["dynamic"] == "local"
  assert not os.path.exists(os.path.join(moe_exports["ct"], "hf_quant_config.json"))


def test_weights_only_writes_no_activation_scales(moe_exports):
  t = _tensors(moe_exports["ct-w4a16"])
  assert not any(k.endswith((".input_global_scale", ".input_scale")) for k in t)
  assert any(k.endswith(".weight_global_scale") for k in t)
  with open(os.path.join(moe_exports["ct-w4a16"], "config.json"), encoding="utf-8") as f:
    group = json.load(f)["quantization_config"]["config_groups"]["config_group_0"]
  assert group["input_activations"] is None and group["weights"]["group_size"] == 16
  with open(os.path.join(moe_exports["ct-w4a16"], "maxtext_nvfp4_export.json"), encoding="utf-8") as f:
    assert json.load(f)["calibration"] is None


_DT = {"U8": np.uint8, "F32": np.float32, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn}


def _raw(path):
  with open(path, "rb") as f:
    raw = f.read()
  n = struct.unpack("<Q", raw[:8])[0]
  header = json.loads(raw[8:8 + n])
  header.pop("__metadata__")
  return {k: np.frombuffer(raw[8 + n + h["data_offsets"][0]:8 + n + h["data_offsets"][1]], _DT[h["dtype"]]).reshape(
      h["shape"]) for k, h in header.items()}


def test_eval_quantized_serves_an_moe_checkpoint(checkpoints, tmp_path):
  from maxtext_nvfp4.tools import eval_quantized  # pylint: disable=import-outside-toplevel

  d = checkpoints["mixtral"]
  path = tmp_path / "e.json"
  assert eval_quantized.cli_main([d["ckpt"], "--eval-batches", "1", "--json", str(path), "--mode", "bf16", "--mode",
                                  "nvfp4-w4a4", *d["overrides"]]) == 0
  r = json.loads(path.read_text())
  assert r["served_linears"] == 2 * (4 + 4 * 3)  # q/k/v/o + 4 experts x w1/w3/w2, per layer; routers not served
  losses = r["losses"]
  assert all(np.isfinite(v) for v in losses.values()) and losses["bf16"] != losses["nvfp4-w4a4"]


@pytest.mark.parametrize("model,block,why", [("gpt3-52k", "gpt3", None),
                                             ("gpt-oss-20b", "gpt_oss", "_input_global_scale")])
def test_an_unsupported_family_is_one_line_naming_what_exports(tmp_path, model, block, why):
  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import export_arch  # pylint: disable=import-outside-toplevel

  config = checkpoint.load_config(export_families.overrides("llama2", str(tmp_path), model_name=model))
  with pytest.raises(export_arch.UnsupportedModel) as e:
    export_arch.check_supported(config)
  msg = str(e.value)
  assert "\n" not in msg and f"decoder_block={block} " in msg
  assert all(f in msg for f in export_families.FAMILIES)
  assert why is None or why in msg  # gpt_oss: the reason no NVFP4 layout of its experts loads


def test_a_gemma2_nvfp4_run_keeps_both_hf_layers_of_a_kept_maxtext_layer(tmp_path):
  """The plan counts MaxText's layers; gemma2's layer i is HF layers 2i (sliding) and 2i+1 (global)."""
  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import export_arch  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import hf_conversion  # pylint: disable=import-outside-toplevel

  config = checkpoint.load_config(export_families.overrides("gemma2", str(tmp_path), base_num_decoder_layers=2,
                                                            quantization="nvfp4", nvfp4_keep_last_layers=1))
  dims = {"num_decoder_layers": 2, "num_query_heads": 4, "num_kv_heads": 2, "head_dim": 32}
  shape = export_arch.forward_shape(config, dims)
  assert shape.num_layers == 4 and shape.sliding_layers == (0, 2)
  trained = hf_conversion.trained_nvfp4(config, shape)
  assert len(trained) == 4 * 7
  assert all(trained[n] == (int(n.split(".")[2]) < 2) for n in trained), trained


def test_a_scanned_olmo3_checkpoint_converts_to_what_maxtexts_forward_computes(tmp_path):
  """MaxText's default scan_layers=true: olmo3's scanned block holds one stacked ``layers_<k>`` per layer of its
  cycle (Olmo3ScannableBlock); 8 layers = 2 blocks of (3 sliding, 1 global). The dimensions come from the
  block, the layer types from each layer's place in it, the names from MaxText's scanned mapping."""
  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import hf_conversion  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import model_shapes  # pylint: disable=import-outside-toplevel

  d = export_families.make("olmo3", str(tmp_path), base_num_decoder_layers=8, scan_layers=True)
  items = checkpoint.find_items(d["ckpt"])
  dims = model_shapes.check(items, d["config"])
  assert dims["scan_layers"] and dims["num_decoder_layers"] == 8 and dims["num_query_heads"] == 4
  model = hf_conversion.to_hf(items, d["config"], dims)
  assert model.shape.sliding_layers == (0, 1, 2, 4, 5, 6)
  assert model.tensors["model.layers.7.self_attn.q_norm.weight"].shape == (4 * 32,)
  tokens = np.random.default_rng(1).integers(0, 256, (2, 32))
  _matches_maxtexts_forward("olmo3 scanned", d, model.tensors, model.shape, tokens)


def test_olmo3_exports_in_both_formats_with_a_config_transformers_reads_as_maxtexts_model(checkpoints):
  """Both formats: Olmo3ForCausalLM's tensor names (post-norm-only layers, full-width q/k norms kept bf16 and
  excluded), and a config.json that transformers' own Olmo3Config reads as the trained model: MaxText's layer
  types, its window, YaRN for both layer types with MaxText's cos/sin scale."""
  import transformers  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.tools import export  # pylint: disable=import-outside-toplevel

  d = checkpoints["olmo3"]
  base = os.path.dirname(d["ckpt"].rstrip("/"))
  for fmt, weight in (("modelopt", ".weight"), ("compressed-tensors", ".weight_packed")):
    out = os.path.join(base, f"hf_{fmt}")
    assert export.cli_main([d["ckpt"], "--out", out, "--format", fmt, "--calibration-batches", "1",
                            "--calibrate-on-synthetic", "--no-tokenizer", *d["overrides"]]) == 0, fmt
    t = _tensors(out)
    p = "model.layers.3."
    assert t[p + "self_attn.q_norm.weight"][:2] == ("BF16", (4 * 32,))
    assert t[p + "self_attn.k_norm.weight"][:2] == ("BF16", (2 * 32,))
    assert {p + n + ".weight" for n in ("post_attention_layernorm", "post_feedforward_layernorm")} <= set(t)
    assert not any("input_layernorm" in k or "pre_feedforward" in k for k in t)
    assert all(p + f"{m}.{n}{weight}" in t for m, ns in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down")))
               for n in ns for n in [n + "_proj"])
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
      raw = json.load(f)
    assert raw["quantization_config"]["quant_method"] in ("modelopt", "compressed-tensors")
    assert raw["architectures"] == ["Olmo3ForCausalLM"] and raw["model_type"] == "olmo3"
    cfg = transformers.Olmo3Config.from_pretrained(out)
    assert cfg.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    assert cfg.sliding_window == 8 and cfg.num_hidden_layers == 4 and cfg.head_dim == 32
    assert cfg.num_attention_heads == 4 and cfg.num_key_value_heads == 2 and cfg.rms_norm_eps == 1e-6
    assert cfg.max_position_embeddings == 64 and not cfg.tie_word_embeddings and not cfg.attention_bias
    for layer_type in ("full_attention", "sliding_attention"):  # MaxText's one rotary in every layer
      rope = cfg.rope_parameters[layer_type]
      assert rope["rope_type"] == "yarn" and rope["factor"] == 4 and rope["original_max_position_embeddings"] == 16
      assert rope["rope_theta"] == 500000 and rope["beta_fast"] == 32 and rope["beta_slow"] == 1
      assert rope["attention_factor"] == pytest.approx(0.1 * np.log(4) + 1, rel=1e-12)


@pytest.mark.parametrize("extra,why", [
    ({"model_name": "qwen3-0.6b", "decoder_block": "olmo3"}, "model_name=qwen3-0.6b"),
    ({"rope_interleave": True}, "rope_interleave=True"),
    ({"rope_truncate": False}, "rope_truncate=False"),
    ({"scan_layers": True, "base_num_decoder_layers": 6}, "not a multiple of inhomogeneous_layer_cycle_interval=4"),
    ({"use_qk_norm": False}, "use_qk_norm=false"),
    ({"attention_bias": True}, "attention_bias=true"),
])
def test_what_olmo3_forward_cannot_express_is_refused_in_one_line(tmp_path, extra, why):
  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import export_arch  # pylint: disable=import-outside-toplevel

  config = checkpoint.load_config(export_families.overrides("olmo3", str(tmp_path), **extra))
  with pytest.raises(export_arch.UnsupportedModel) as e:
    export_arch.check_supported(config)
  assert "\n" not in str(e.value) and why in str(e.value), str(e.value)


def test_llama4_temperature_tuning_score_placement_and_rope_frequencies_are_maxtexts(checkpoints, monkeypatch):
  """What the default positions cannot show: temperature tuning (NoPE queries * (0.1 ln(floor((pos + 1) / 8192)
  + 1) + 1): positions from 8176, a multiple of the chunk, so the chunks stay those of the token indices) and
  where the router score applies (the expert's input, not its output), both > 100x the tolerance; and the
  llama3 RoPE frequencies (they only move wavelengths > 2048 tokens, beyond any chunk of the tiny model) equal
  to 1 / MaxText's own LLaMARotaryEmbedding timescale."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from maxtext.layers import embeddings  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.core import hf_forward  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import hf_conversion  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import model_shapes  # pylint: disable=import-outside-toplevel

  d = checkpoints["llama4"]
  items = checkpoint.find_items(d["ckpt"])
  model = hf_conversion.to_hf(items, d["config"], model_shapes.check(items, d["config"]))
  tokens = np.random.default_rng(1).integers(0, 256, (2, 32))
  positions = np.broadcast_to(8176 + np.arange(32), (2, 32))
  config = checkpoint.load_config(d["overrides"] + ["dtype=float32", "matmul_precision=highest"])
  theirs = checkpoint.maxtext_logits(config, d["params"], tokens, positions=positions)
  scale = np.abs(theirs).max()

  def ours(shape):
    return np.asarray(hf_forward.decoder_forward(model.tensors, shape, tokens, positions=positions)[0])

  got = ours(model.shape)
  np.testing.assert_allclose(got, theirs, atol=2e-5 * scale, rtol=0)
  print(f"llama4 from position 8176: ours vs MaxText {np.abs(got - theirs).max() / scale:.3g} of max|logits|")
  moved = {"no temperature tuning": ours(dataclasses.replace(model.shape, attn_temperature=None))}
  # the score on the expert's output instead of its input (the expert is not linear: it differs)
  with monkeypatch.context() as m:
    m.setattr(hf_forward, "_route", lambda moe, logits, bias: (lambda v, e: (jax.nn.sigmoid(v), e))(
        *jax.lax.top_k(logits, moe.top_k)))
    moved["the score on the expert's output"] = ours(_off(moe__scoring="softmax")(model.shape))
  for op, logits in moved.items():
    assert np.abs(logits - theirs).max() > 100 * 2e-5 * scale, op
    print(f"llama4 with {op}: {np.abs(logits - theirs).max() / scale:.3g} of max|logits|")
  rope = model.shape.rope_llama3
  maxtext = embeddings.LLaMARotaryEmbedding(min_timescale=1, max_timescale=500000, mesh=None, embedding_dims=32,
                                            use_scale=True)
  theirs_inv = 1.0 / np.asarray(maxtext.timescale, np.float64).reshape(-1)[::2]
  ours_inv = np.asarray(hf_forward.llama3_inv_freq(32, 500000.0, rope), np.float64)
  np.testing.assert_allclose(ours_inv, theirs_inv, rtol=1e-6)
  unscaled = 1.0 / 500000.0 ** (np.arange(0, 32, 2) / 32)
  assert np.abs(unscaled / theirs_inv - 1).max() > 6  # the scaling bites: low frequencies / 8
  assert jnp.asarray(ours_inv).shape == (16,)


def test_llama4_exports_in_both_formats_with_a_config_transformers_reads_as_maxtexts_model(checkpoints):
  """ModelOpt (calibrated) and compressed-tensors (weights only): Llama4ForCausalLM's names -- per-expert NVFP4
  linears feed_forward.experts.<e>, the shared expert and the dense layers' feed_forward NVFP4, the router bf16
  and excluded -- and a config.json transformers' Llama4TextConfig reads as the trained model; vLLM's
  temperature-tuning switch in generation_config.json."""
  import transformers  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.tools import export  # pylint: disable=import-outside-toplevel

  d = checkpoints["llama4"]
  base = os.path.dirname(d["ckpt"].rstrip("/"))
  for fmt, weight, flags in (("modelopt", ".weight", ["--calibration-batches", "1", "--calibrate-on-synthetic"]),
                             ("compressed-tensors", ".weight_packed", ["--weights-only"])):
    out = os.path.join(base, f"hf_{fmt}")
    assert export.cli_main([d["ckpt"], "--out", out, "--format", fmt, "--no-tokenizer", *flags,
                            *d["overrides"]]) == 0, fmt
    t = _tensors(out)
    for layer in (1, 3):
      p = f"model.layers.{layer}.feed_forward."
      assert t[p + "router.weight"][:2] == ("BF16", (4, 64))
      assert t[p + "experts.3.down_proj" + weight][:2] == ("U8", (64, 32))
      assert all(p + f"{m}.{n}_proj{weight}" in t for m in ("experts.0", "shared_expert")
                 for n in ("gate", "up", "down"))
    assert all(f"model.layers.{i}.feed_forward.{n}_proj{weight}" in t for i in (0, 2) for n in ("gate", "up", "down"))
    assert not any("q_norm" in k or "k_norm" in k or "feed_forward.experts.gate_up_proj" in k for k in t)
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
      raw = json.load(f)
    q = raw["quantization_config"]
    assert {"model.layers.1.feed_forward.router", "model.layers.3.feed_forward.router"} <= set(
        q.get("ignore", q.get("exclude_modules", [])))
    assert raw["architectures"] == ["Llama4ForCausalLM"] and raw["model_type"] == "llama4_text"
    cfg = transformers.AutoConfig.from_pretrained(out)
    assert type(cfg).__name__ == "Llama4TextConfig"
    assert cfg.no_rope_layers == [1, 1, 1, 0] and cfg.moe_layers == [1, 3] and cfg.attention_chunk_size == 8
    assert cfg.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    assert cfg.num_local_experts == 4 and cfg.num_experts_per_tok == 1 and cfg.intermediate_size == 64
    assert cfg.intermediate_size_mlp == 64 and cfg.use_qk_norm and cfg.attn_temperature_tuning
    assert cfg.floor_scale == 8192 and cfg.attn_scale == 0.1 and cfg.head_dim == 32 and cfg.rms_norm_eps == 1e-5
    assert cfg.rope_parameters == {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}
    with open(os.path.join(out, "generation_config.json"), encoding="utf-8") as f:
      assert json.load(f) == {"attn_temperature_tuning": True}


@pytest.mark.parametrize("extra,why", [
    ({"rope_type": "default"}, "rope_type=default"),
    ({"shared_experts": 2}, "shared_experts=2"),
    ({"routed_score_func": "sigmoid"}, "routed_score_func='sigmoid'"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"scan_layers": True, "base_num_decoder_layers": 6}, "not a multiple of inhomogeneous_layer_cycle_interval=4"),
])
def test_what_llama4_forward_cannot_express_is_refused_in_one_line(tmp_path, extra, why):
  """(num_experts_per_tok > 1 is MaxText's own refusal for llama4: its config validation, top-1 only.)"""
  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import export_arch  # pylint: disable=import-outside-toplevel

  config = checkpoint.load_config(export_families.overrides("llama4", str(tmp_path), **extra))
  with pytest.raises(export_arch.UnsupportedModel) as e:
    export_arch.check_supported(config)
  assert "\n" not in str(e.value) and why in str(e.value), str(e.value)


def test_a_scanned_llama4_checkpoint_converts_to_what_maxtexts_forward_computes(tmp_path):
  """MaxText's default scan_layers=true: Llama4ScannableBlock stacks ``layers_<k>`` (sub-layer k of each block of
  inhomogeneous_layer_cycle_interval=4 layers); 8 layers = 2 blocks of (RoPE dense, RoPE MoE, RoPE dense, NoPE
  MoE). The routed experts stack (experts, blocks) leading."""
  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import hf_conversion  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import model_shapes  # pylint: disable=import-outside-toplevel

  d = export_families.make("llama4", str(tmp_path), base_num_decoder_layers=8, scan_layers=True)
  items = checkpoint.find_items(d["ckpt"])
  dims = model_shapes.check(items, d["config"])
  assert dims["scan_layers"] and dims["num_decoder_layers"] == 8 and dims["num_experts"] == 4
  assert dims["mlp_dim"] == 64 and dims["moe_mlp_dim"] == 64 and dims["shared_mlp_dim"] == 64
  model = hf_conversion.to_hf(items, d["config"], dims)
  assert model.shape.nope_layers == (3, 7) and model.shape.moe.layers == (1, 3, 5, 7)
  assert model.tensors["model.layers.7.feed_forward.experts.2.down_proj.weight"].shape == (64, 64)
  tokens = np.random.default_rng(1).integers(0, 256, (2, 32))
  _matches_maxtexts_forward("llama4 scanned", d, model.tensors, model.shape, tokens)


def test_a_llama4_nvfp4_run_keeps_every_linear_of_a_kept_moe_layer(tmp_path):
  """The plan's roles reach llama4's every linear: a kept last layer (NoPE, MoE) is bf16 in all 19 (q/k/v/o, 4
  experts x 3, the shared expert's 3), every other layer NVFP4 (its dense MLP's too)."""
  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import export_arch  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.integration import hf_conversion  # pylint: disable=import-outside-toplevel

  config = checkpoint.load_config(export_families.overrides("llama4", str(tmp_path), quantization="nvfp4",
                                                            nvfp4_keep_last_layers=1))
  dims = {"num_decoder_layers": 4, "num_query_heads": 4, "num_kv_heads": 2, "head_dim": 32, "num_experts": 4,
          "moe_mlp_dim": 64, "mlp_dim": 64}
  trained = hf_conversion.trained_nvfp4(config, export_arch.forward_shape(config, dims))
  assert len(trained) == 2 * 7 + 2 * 19
  assert all(trained[n] == (int(n.split(".")[2]) < 3) for n in trained), trained
  assert "model.layers.3.feed_forward.shared_expert.down_proj" in trained
