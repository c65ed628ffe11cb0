"""Serving oracles: ModelOpt, vLLM and transformers (the real code, in the peer env) on our export.

One module-scoped fixture trains a tiny GQA Llama for 2 steps in NVFP4 (the last layer kept in bf16),
exports it with ``maxtext-nvfp4 export`` and runs ``peer_side/serving_run.py`` on it once. The checks
are functions of ``(exported dir, family)`` plus the peer's answers, so that other families and formats
can be added with a row in ``serving_run.FAMILIES`` and a fixture here:

* ModelOpt's ``NVFP4QTensor.quantize`` of the trained fp32 weights, given the export's global scale,
  reproduces the exported codes and block scales byte for byte; ModelOpt's own global scale of each fused
  group's weights equals the exported ``weight_scale_2`` bit for bit.
* vLLM's ``dequantize_to_dtype`` of the exported tensors equals our W4A16 weights
  (``core.serving.served_weights(..., "nvfp4-w4a16")``) bit for bit, in fp32 and in bf16.
* transformers' ``LlamaForCausalLM`` with those weights matches our forward (``core.serving.llama_forward``,
  the forward ``eval-quantized`` runs) of the same weights to fp32 rounding: |diff| <= 1e-5 * max|logits|.
  Both are fp32 with the same weights; they differ only in operation order (attention einsums vs bmm,
  softmax and RMSNorm reductions, RoPE's cos/sin computed by different code), i.e. a few fp32 ulps per op
  over 3 layers: 3.9e-7 of max|logits| measured (2026-12-01), so 1e-5 leaves a 25x margin. Using the
  trained fp32 tensors instead of the export's bf16 ones for the non-NVFP4 weights moved it to 4e-3; a
  layout error (a swapped or transposed projection, RoPE halves vs pairs, a missing query scale) moves
  the logits by O(1) (``test_transformers_check_catches_a_layout_error``).
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest

import maxtext_nvfp4  # pylint: disable=unused-import  (registers the plugin)
import peer_support
from maxtext_helpers import tiny_argv

MODEL = dict(base_emb_dim=64, base_num_query_heads=4, base_num_kv_heads=2, head_dim=32, base_mlp_dim=128,
             base_num_decoder_layers=3, vocab_size=256)
TRAIN = dict(steps=2, enable_checkpointing=True, async_checkpointing=False, checkpoint_period=1,
             quantization="nvfp4", nvfp4_keep_last_layers=1, learning_rate=1e-2)
LOGITS_RTOL = 1e-5  # of max |logits|; see the module docstring (measured: 3.9e-7)


_DTYPES = {"U8": np.uint8, "U16": np.uint16, "I64": np.int64, "F32": np.float32, "BF16": ml_dtypes.bfloat16,
           "F8_E4M3": ml_dtypes.float8_e4m3fn}


def _read_safetensors(path):
  """``{name: numpy array}`` from the raw file (u64 header length, JSON header, data): bf16/fp8 included."""
  with open(path, "rb") as f:
    raw = f.read()
  n = struct.unpack("<Q", raw[:8])[0]
  header = json.loads(raw[8 : 8 + n])
  header.pop("__metadata__", None)
  return {name: np.frombuffer(raw[8 + n + h["data_offsets"][0] : 8 + n + h["data_offsets"][1]],
                              dtype=_DTYPES[h["dtype"]]).reshape(h["shape"]) for name, h in header.items()}


def _overrides(out):
  return tiny_argv(out, run_name="run", **MODEL, **TRAIN, skip_jax_distributed_system=True)[2:]


def run_serving_peer(export_dir, family, trained_tensors, tokens, work):
  """ModelOpt / vLLM / transformers answers for an exported dir (see peer_side/serving_run.py)."""
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel
  trained = os.path.join(work, "trained_hf.safetensors")
  save_file({k: np.ascontiguousarray(v, np.float32) for k, v in trained_tensors.items()}, trained)
  np.save(os.path.join(work, "tokens.npy"), np.asarray(tokens, np.int64))
  out = os.path.join(work, "peer.safetensors")
  peer_support.run_peer("serving_run.py", export_dir, family, trained, os.path.join(work, "tokens.npy"), out)
  return _read_safetensors(out)


@pytest.fixture(scope="module")
def llama_export(tmp_path_factory):
  from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel

  from maxtext_nvfp4.integration import checkpoint  # pylint: disable=import-outside-toplevel
  from maxtext_nvfp4.tools import export  # pylint: disable=import-outside-toplevel

  out = str(tmp_path_factory.mktemp("serving"))
  train.main(tiny_argv(out, run_name="run", **MODEL, **TRAIN, skip_jax_distributed_system=True))
  hf_dir = os.path.join(out, "hf")
  ckpt = os.path.join(out, "run", "checkpoints")
  assert export.cli_main([ckpt, "--out", hf_dir, "--calibration-batches", "1", "--calibrate-on-synthetic",
                          *_overrides(out)]) == 0
  config = checkpoint.load_config(_overrides(out))
  model = checkpoint.to_hf(checkpoint.find_items(ckpt), config)
  tokens = np.random.default_rng(0).integers(0, MODEL["vocab_size"], (2, 32))
  peer = run_serving_peer(hf_dir, "llama", model.tensors, tokens, out)
  return dict(dir=hf_dir, family="llama", model=model, tokens=tokens, peer=peer)


def nvfp4_linears(export_dir):
  t = _read_safetensors(os.path.join(export_dir, "model.safetensors"))
  return t, sorted(k[: -len(".weight_scale")] for k in t if k.endswith(".weight_scale"))


def check_modelopt_reproduces_export(export_dir, family, peer):
  """ModelOpt's quantizer of the trained weights == the exported codes, block scales, global scales."""
  t, names = nvfp4_linears(export_dir)
  assert names, f"{export_dir}: no NVFP4 linear"
  for n in names:
    np.testing.assert_array_equal(peer[f"modelopt.{n}.weight"], t[n + ".weight"], err_msg=f"{family} {n} codes")
    np.testing.assert_array_equal(peer[f"modelopt.{n}.weight_scale"], t[n + ".weight_scale"].view(np.uint8),
                                  err_msg=f"{family} {n} block scales")
  groups = [k for k in peer if k.startswith("modelopt_global.")]
  assert groups
  for key in groups:  # modelopt_global.<layer prefix>|<member>+<member>...
    prefix, joined = key[len("modelopt_global."):].split("|")
    for m in joined.split("+"):
      got = np.asarray(t[f"{prefix}.{m}.weight_scale_2"], np.float32)
      assert got.view(np.uint32) == np.asarray(peer[key], np.float32).view(np.uint32), (family, key, m)
  return len(names)


def check_vllm_decodes_our_w4a16(export_dir, family, peer, trained_tensors):
  """vLLM's decode of the export == our W4A16 weights (core.serving), fp32 and bf16, bit for bit."""
  from maxtext_nvfp4.core import serving  # pylint: disable=import-outside-toplevel
  _, names = nvfp4_linears(export_dir)
  ours = serving.served_weights(trained_tensors, names, "nvfp4-w4a16")
  for n in names:
    mine = np.asarray(ours[n + ".weight"], np.float32)
    np.testing.assert_array_equal(peer[f"vllm_f32.{n}"].view(np.uint32), mine.view(np.uint32), err_msg=f"{family} {n}")
    np.testing.assert_array_equal(peer[f"vllm_bf16.{n}"].view(np.uint16),
                                  mine.astype(ml_dtypes.bfloat16).view(np.uint16), err_msg=f"{family} {n} bf16")
  return ours


def check_transformers_matches_our_forward(export_dir, family, peer, trained_tensors, tokens):
  """transformers' model of the decoded export vs our forward of the same weights (fp32)."""
  from maxtext_nvfp4.core import serving  # pylint: disable=import-outside-toplevel
  t, names = nvfp4_linears(export_dir)
  with open(os.path.join(export_dir, "config.json"), encoding="utf-8") as f:
    c = json.load(f)
  # The export's own bf16 tensors (embeddings, norms, excluded linears) and our W4A16 NVFP4 linears.
  weights = {k: np.asarray(v, np.float32) for k, v in t.items() if k.endswith(".weight") and v.dtype != np.uint8}
  served = serving.served_weights(trained_tensors, names, "nvfp4-w4a16")
  weights.update({n + ".weight": served[n + ".weight"] for n in names})
  shape = serving.LlamaShape(num_layers=c["num_hidden_layers"], num_heads=c["num_attention_heads"],
                             num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                             rms_norm_eps=c["rms_norm_eps"], rope_theta=c["rope_theta"])
  ours = np.asarray(serving.llama_forward(weights, shape, tokens)[0])
  theirs = peer["hf.logits"]
  scale = np.abs(ours).max()
  err = np.abs(theirs - ours).max()
  assert scale > 1.0, f"{family}: degenerate logits"
  assert err <= LOGITS_RTOL * scale, f"{family}: transformers vs ours max |diff| {err:.3g} (max |logits| {scale:.3g})"
  return err / scale


def test_modelopt_quantizer_reproduces_the_export(llama_export):
  n = check_modelopt_reproduces_export(llama_export["dir"], llama_export["family"], llama_export["peer"])
  assert n == 14  # 7 linears in each of the 2 NVFP4 layers


def test_vllm_decode_recovers_our_w4a16_weights_bit_for_bit(llama_export):
  check_vllm_decodes_our_w4a16(llama_export["dir"], llama_export["family"], llama_export["peer"],
                               llama_export["model"].tensors)


def test_transformers_llama_matches_our_forward(llama_export):
  rel = check_transformers_matches_our_forward(llama_export["dir"], llama_export["family"], llama_export["peer"],
                                               llama_export["model"].tensors, llama_export["tokens"])
  print(f"transformers vs ours: max |diff| / max |logits| = {rel:.3g}")


def test_transformers_check_catches_a_layout_error(llama_export, tmp_path):
  """The tolerance is tight enough: swapping the k/v projections of layer 0 (a plausible layout bug in
  the export) fails the transformers check."""
  d = llama_export["dir"]
  tensors = dict(llama_export["model"].tensors)
  p = "model.layers.0.self_attn."
  tensors[p + "k_proj.weight"], tensors[p + "v_proj.weight"] = tensors[p + "v_proj.weight"], tensors[p + "k_proj.weight"]
  with pytest.raises(AssertionError, match="transformers vs ours"):
    check_transformers_matches_our_forward(d, llama_export["family"], llama_export["peer"], tensors,
                                           llama_export["tokens"])
