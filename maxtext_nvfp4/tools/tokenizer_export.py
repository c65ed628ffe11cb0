"""The tokenizer of an export, as a server needs it: Hugging Face files that encode a prompt the way
training began a document (BOS when ``add_bos``) and never append EOS, and the BOS/EOS ids the model
config states taken from the tokenizer itself.

By MaxText ``tokenizer_type`` (``input_pipeline/tokenizer.py`` ``build_tokenizer``):

  sentencepiece  ``tokenizer_path`` is a SentencePiece model file: copied as ``tokenizer.model`` with a
                 ``tokenizer_config.json`` (``LlamaTokenizer``, ``add_bos_token`` = the run's ``add_bos``,
                 ``add_eos_token`` false); ids from ``SentencePieceProcessor.bos_id()/eos_id()``.
  huggingface    ``tokenizer_path`` is a local folder with ``tokenizer.json``: its tokenizer files are
                 copied; ``tokenizer_config.json`` gets ``add_eos_token`` false and ``add_bos_token`` =
                 ``add_bos``; a ``TemplateProcessing`` post-processor is rewritten to ``[BOS] $A`` (training
                 appends EOS to every document; a prompt must not end with it); ids from the tokens the
                 config names (``bos_token`` / ``eos_token``) looked up in ``tokenizer.json``.
  tiktoken       refused (one line): no lossless conversion to Hugging Face files is shipped here.

Anything that cannot be served (a path that is not local, a tokenizer with more tokens than the model's
``vocab_size``) is a :class:`TokenizerError` raised before any weight is read; ``--no-tokenizer`` exports
the weights alone. ``generation_config.json`` carries the same ids.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Any

# Hugging Face tokenizer files copied from a tokenizer folder (the rest of the folder is not the tokenizer).
HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
            "tokenizer.model", "added_tokens.json")
NO_TOKENIZER_HINT = "pass --no-tokenizer to export the weights alone"


class TokenizerError(ValueError):
  """A run's tokenizer the export cannot serve (one line: the key, why, the fix)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerPlan:
  """What the export writes for the tokenizer."""

  # MaxText tokenizer_type: "sentencepiece" or "huggingface"
  kind: str
  # the run's tokenizer_path (a file for sentencepiece, a folder for huggingface)
  path: str
  # the run's add_bos: whether a prompt starts with BOS, as every training document did
  add_bos: bool
  # token ids read from the tokenizer (None when it has no such token)
  bos_token_id: int | None
  eos_token_id: int | None
  pad_token_id: int | None
  # the tokenizer's vocabulary size (<= the model's vocab_size)
  vocab_size: int


def _get(config, key, default=None):
  value = getattr(config, key, default)
  return getattr(value, "value", value)


def _hf_token_id(tok_json: dict, token: Any) -> int | None:
  if isinstance(token, dict):
    token = token.get("content")
  if not token:
    return None
  for added in tok_json.get("added_tokens", []):
    if added.get("content") == token:
      return int(added["id"])
  vocab = (tok_json.get("model") or {}).get("vocab")
  if isinstance(vocab, dict) and token in vocab:
    return int(vocab[token])
  return None


def _hf_vocab_size(tok_json: dict) -> int:
  vocab = (tok_json.get("model") or {}).get("vocab") or {}
  ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
  ids += [int(t["id"]) for t in tok_json.get("added_tokens", [])]
  return max(ids) + 1 if ids else 0


def _read_json(path: str) -> dict:
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise TokenizerError(f"tokenizer_path: cannot read {path} ({' '.join(str(e).split())[:160]});"
                         f" {NO_TOKENIZER_HINT}") from None


def plan(config, model_vocab_size: int) -> TokenizerPlan:
  """The tokenizer the run trained with, checked for serving; :class:`TokenizerError` otherwise."""
  kind = str(_get(config, "tokenizer_type", "sentencepiece") or "sentencepiece")
  path = os.path.expanduser(str(_get(config, "tokenizer_path", "") or ""))
  add_bos = bool(_get(config, "add_bos", True))
  where = f"tokenizer_path={path} (tokenizer_type={kind})"
  if kind == "tiktoken":
    raise TokenizerError(f"{where}: the export cannot write a tiktoken tokenizer as Hugging Face files; convert it"
                         " (transformers' TikTokenConverter) and pass tokenizer_path=<that folder>"
                         f" tokenizer_type=huggingface, or {NO_TOKENIZER_HINT}")
  if kind not in ("sentencepiece", "huggingface"):
    raise TokenizerError(f"tokenizer_type={kind}: not a MaxText tokenizer type the export knows (sentencepiece,"
                         f" huggingface); {NO_TOKENIZER_HINT}")
  if not path or "://" in path:
    raise TokenizerError(f"{where}: not a local path; copy the tokenizer here and pass tokenizer_path=<local path>,"
                         f" or {NO_TOKENIZER_HINT}")
  if kind == "sentencepiece":
    if not os.path.isfile(path):
      raise TokenizerError(f"{where}: no such file (a SentencePiece model); pass the run's tokenizer_path, or"
                           f" {NO_TOKENIZER_HINT}")
    import sentencepiece  # pylint: disable=import-outside-toplevel

    sp = sentencepiece.SentencePieceProcessor()
    try:
      sp.Load(path)
    except Exception as e:  # pylint: disable=broad-exception-caught  (sentencepiece raises OSError/RuntimeError)
      raise TokenizerError(f"{where}: not a SentencePiece model ({' '.join(str(e).split())[:120]}); set"
                           f" tokenizer_type to the run's, or {NO_TOKENIZER_HINT}") from None
    ids = [sp.bos_id(), sp.eos_id(), sp.pad_id()]
    bos, eos, pad = (i if i >= 0 else None for i in ids)
    size = sp.GetPieceSize()
  else:
    if not os.path.isdir(path):
      hint = " (a Hugging Face Hub name? download it and pass the local folder)" if not os.path.exists(path) else ""
      raise TokenizerError(f"{where}: not a local folder{hint}; pass tokenizer_path=<folder with tokenizer.json>, or"
                           f" {NO_TOKENIZER_HINT}")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
      raise TokenizerError(f"{where}: the folder has no tokenizer.json; save the tokenizer with save_pretrained"
                           f" there, or {NO_TOKENIZER_HINT}")
    tok_json = _read_json(os.path.join(path, "tokenizer.json"))
    tok_cfg = (_read_json(os.path.join(path, "tokenizer_config.json"))
               if os.path.isfile(os.path.join(path, "tokenizer_config.json")) else {})
    bos, eos = _hf_token_id(tok_json, tok_cfg.get("bos_token")), _hf_token_id(tok_json, tok_cfg.get("eos_token"))
    pad = _hf_token_id(tok_json, tok_cfg.get("pad_token"))
    size = _hf_vocab_size(tok_json)
    if add_bos and bos is None:
      raise TokenizerError(f"{where}: add_bos=true but tokenizer_config.json names no bos_token found in"
                           f" tokenizer.json; fix the tokenizer folder, or {NO_TOKENIZER_HINT}")
  if size > int(model_vocab_size):
    raise TokenizerError(f"{where}: the tokenizer has {size} tokens but the checkpoint's vocab_size is"
                         f" {model_vocab_size}; pass the tokenizer the run trained with, or {NO_TOKENIZER_HINT}")
  return TokenizerPlan(kind=kind, path=path, add_bos=add_bos, bos_token_id=bos, eos_token_id=eos,
                       pad_token_id=pad, vocab_size=size)


def _serving_post_processor(processor: dict | None, bos_token: str | None, bos_id: int | None,
                            add_bos: bool) -> dict | None:
  """``[BOS] $A`` (pair: ``[BOS] $A [BOS] $B``) for a TemplateProcessing one; any other kind unchanged
  unless it appends tokens (then dropped: the config's add_bos_token decides)."""
  if not processor:
    return processor
  kind = processor.get("type")
  if kind == "Sequence":
    inner = [_serving_post_processor(p, bos_token, bos_id, add_bos) for p in processor.get("processors", [])]
    return {**processor, "processors": [p for p in inner if p]}
  if kind != "TemplateProcessing":
    return processor
  if not add_bos or bos_token is None:
    return None
  single = [{"SpecialToken": {"id": bos_token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]
  pair = single + [{"SpecialToken": {"id": bos_token, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}]
  return {"type": "TemplateProcessing", "single": single, "pair": pair,
          "special_tokens": {bos_token: {"id": bos_token, "ids": [bos_id], "tokens": [bos_token]}}}


def write(p: TokenizerPlan, out_dir: str) -> dict[str, int | None]:
  """Write the tokenizer files and ``generation_config.json`` into ``out_dir``; returns
  ``{"bos_token_id": .., "eos_token_id": .., "pad_token_id": ..}`` for config.json."""
  ids = {"bos_token_id": p.bos_token_id, "eos_token_id": p.eos_token_id, "pad_token_id": p.pad_token_id}
  if p.kind == "sentencepiece":
    shutil.copyfile(p.path, os.path.join(out_dir, "tokenizer.model"))
    cfg = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
           "add_bos_token": p.add_bos, "add_eos_token": False, "legacy": True}
    import sentencepiece  # pylint: disable=import-outside-toplevel

    sp = sentencepiece.SentencePieceProcessor()
    sp.Load(p.path)
    for key, i in (("bos_token", p.bos_token_id), ("eos_token", p.eos_token_id), ("unk_token", sp.unk_id())):
      if i is not None and i >= 0:
        cfg[key] = sp.IdToPiece(i)
    if p.pad_token_id is not None:
      cfg["pad_token"] = sp.IdToPiece(p.pad_token_id)
  else:
    for name in HF_FILES:
      src = os.path.join(p.path, name)
      if os.path.isfile(src) and name not in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src, os.path.join(out_dir, name))
    tok_json = _read_json(os.path.join(p.path, "tokenizer.json"))
    cfg_path = os.path.join(p.path, "tokenizer_config.json")
    cfg = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
    bos_token = cfg.get("bos_token")
    bos_token = bos_token.get("content") if isinstance(bos_token, dict) else bos_token
    tok_json["post_processor"] = _serving_post_processor(tok_json.get("post_processor"), bos_token,
                                                         p.bos_token_id, p.add_bos)
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
      json.dump(tok_json, f, ensure_ascii=False)
    cfg = {**cfg, "add_bos_token": p.add_bos, "add_eos_token": False}
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
    json.dump(cfg, f, indent=2)
  with open(os.path.join(out_dir, "generation_config.json"), "w", encoding="utf-8") as f:
    json.dump({k: v for k, v in ids.items() if v is not None}, f, indent=2)
  return ids
