"""``tools/tokenizer_export.py``: the exported tokenizer serves prompts as training began documents (BOS
when add_bos), never appends EOS, and its ids are the tokenizer's own; what cannot be served is one line.

Tokenizers used: MaxText's shipped SentencePiece model (the tests' default tokenizer_path) and a BPE
tokenizer trained by prepare-data's own function (the demo recipes' tokenizer_type=huggingface), whose
post-processor appends ``</s>`` for training.
"""

from __future__ import annotations

import json
import os
import types

import pytest

from maxtext_helpers import TOKENIZER
from maxtext_nvfp4.tools import tokenizer_export

DOCS = ["hello world, this is a small corpus", "the quick brown fox jumps over the lazy dog"] * 20


def _config(**kw):
  return types.SimpleNamespace(**{"tokenizer_type": "sentencepiece", "tokenizer_path": TOKENIZER, "add_bos": True, **kw})


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
  from maxtext_nvfp4.tools import data  # pylint: disable=import-outside-toplevel

  out = str(tmp_path_factory.mktemp("bpe") / "tokenizer")
  info = data._train_bpe(out, DOCS, 300, recorded_dir=out)  # pylint: disable=protected-access
  return out, info


def test_sentencepiece_exports_with_its_own_ids_and_no_eos(tmp_path):
  import sentencepiece  # pylint: disable=import-outside-toplevel

  sp = sentencepiece.SentencePieceProcessor()
  sp.Load(TOKENIZER)
  p = tokenizer_export.plan(_config(), 32000)
  ids = tokenizer_export.write(p, str(tmp_path))
  assert (ids["bos_token_id"], ids["eos_token_id"]) == (sp.bos_id(), sp.eos_id())
  with open(tmp_path / "tokenizer.model", "rb") as f, open(TOKENIZER, "rb") as g:
    assert f.read() == g.read()
  cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
  assert cfg["add_eos_token"] is False and cfg["add_bos_token"] is True and cfg["tokenizer_class"] == "LlamaTokenizer"
  assert (cfg["bos_token"], cfg["eos_token"]) == (sp.IdToPiece(sp.bos_id()), sp.IdToPiece(sp.eos_id()))
  gen = json.loads((tmp_path / "generation_config.json").read_text())
  assert (gen["bos_token_id"], gen["eos_token_id"]) == (sp.bos_id(), sp.eos_id())


@pytest.mark.parametrize("add_bos", [True, False])
def test_prepare_data_tokenizer_exports_without_the_training_eos(bpe_dir, tmp_path, add_bos):
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel

  src, info = bpe_dir
  trained = Tokenizer.from_file(os.path.join(src, "tokenizer.json")).encode("hello world").ids
  assert trained[0] == info["bos_id"] and trained[-1] == info["eos_id"]  # what training appends
  p = tokenizer_export.plan(_config(tokenizer_type="huggingface", tokenizer_path=src, add_bos=add_bos), 512)
  ids = tokenizer_export.write(p, str(tmp_path))
  served = Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode("hello world").ids
  assert served == (trained[:-1] if add_bos else trained[1:-1])
  assert (ids["bos_token_id"], ids["eos_token_id"], ids["pad_token_id"]) == (info["bos_id"], info["eos_id"], info["pad_id"])
  cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
  assert cfg["add_eos_token"] is False and cfg["add_bos_token"] is add_bos


REFUSALS = [  # (row, config keys, model vocab, words)
    ("tiktoken", {"tokenizer_type": "tiktoken", "tokenizer_path": "/x/tokenizer_llama3.tiktoken"}, 128256,
     ["tokenizer_type=tiktoken", "tokenizer_type=huggingface", "--no-tokenizer"]),
    ("hub-name", {"tokenizer_type": "huggingface", "tokenizer_path": "meta-llama/Llama-3.1-8B"}, 128256,
     ["not a local folder", "Hugging Face Hub name", "--no-tokenizer"]),
    ("gcs", {"tokenizer_path": "gs://bucket/tokenizer.model"}, 32000, ["not a local path"]),
    ("sp-missing", {"tokenizer_path": "/no/such/tokenizer.model"}, 32000, ["no such file"]),
    ("sp-not-a-model", {"tokenizer_path": __file__}, 32000, ["not a SentencePiece model"]),
    ("vocab-too-big", {}, 256, ["has 32000 tokens", "vocab_size is 256"]),
    ("unknown-type", {"tokenizer_type": "bytes"}, 256, ["tokenizer_type=bytes"]),
]


@pytest.mark.parametrize("row, keys, vocab, words", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_unservable_tokenizers_are_one_line(row, keys, vocab, words):
  with pytest.raises(tokenizer_export.TokenizerError) as e:
    tokenizer_export.plan(_config(**keys), vocab)
  msg = str(e.value)
  assert "\n" not in msg and all(w in msg for w in words), msg


def test_hf_folder_without_tokenizer_json_is_one_line(tmp_path):
  with pytest.raises(tokenizer_export.TokenizerError) as e:
    tokenizer_export.plan(_config(tokenizer_type="huggingface", tokenizer_path=str(tmp_path)), 512)
  assert "no tokenizer.json" in str(e.value)
