"""Sharded safetensors written tensor by tensor, with Hugging Face's index (bounded memory).

A safetensors file is ``u64 header length | JSON header | data``, the header naming each tensor's dtype,
shape and byte range and ``"__metadata__": {"format": "pt"}`` (transformers loads only "pt" files). Its
size is only known once every tensor is in, so each tensor's bytes go straight to a data file beside the
shard, and closing the shard writes header + data (copied in 64 MiB chunks): nothing but the tensor being
added is ever held in memory.

Shards: a new one starts when the next tensor would take the current one past ``max_shard_size`` bytes
(a tensor larger than that gets a shard of its own). One shard is ``model.safetensors``; several are
``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json`` (``{"metadata":
{"total_size": bytes of tensor data}, "weight_map": {name: file}}``), what ``from_pretrained`` and vLLM
read. The writer works inside the export's temporary folder (:mod:`maxtext_nvfp4.tools.outputs`).
"""

from __future__ import annotations

import json
import os
import re
import struct

import numpy as np

# numpy dtype name -> safetensors dtype
_DTYPES = {"uint8": "U8", "int8": "I8", "int32": "I32", "int64": "I64", "float32": "F32", "float16": "F16",
           "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3"}
_CHUNK = 64 << 20
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str) -> int:
  """Bytes of ``"5GB"`` / ``"500MiB"`` / ``"1048576"`` (HF's convention: GB = 10**9); ValueError otherwise."""
  m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
  if not m or m.group(2) not in _UNITS:
    raise ValueError(f"{text!r} is not a size (e.g. 5GB, 500MB, 2GiB, or bytes)")
  size = int(float(m.group(1)) * _UNITS[m.group(2)])
  if size < 1:
    raise ValueError(f"{text!r}: the size must be at least 1 byte")
  return size


class ShardWriter:
  """``add(name, array)`` tensors in order, then ``close()`` (module docstring)."""

  def __init__(self, folder: str, max_shard_size: int):
    self.folder, self.max = folder, int(max_shard_size)
    self.shards: list[tuple[str, dict]] = []  # (temporary file name, header) of closed shards
    self.header: dict = {}
    self.offset = 0
    self.total = 0
    self.data = None

  def _open(self):
    self.data = open(os.path.join(self.folder, f".shard-{len(self.shards)}.data"), "wb")  # pylint: disable=consider-using-with

  def _close_shard(self):
    if self.data is None:
      return
    data_path = self.data.name
    self.data.close()
    name = f".shard-{len(self.shards)}.safetensors"
    header = {**self.header, "__metadata__": {"format": "pt"}}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # 8-byte aligned data, as the safetensors writers do
    with open(os.path.join(self.folder, name), "wb") as out, open(data_path, "rb") as src:
      out.write(struct.pack("<Q", len(raw)))
      out.write(raw)
      while chunk := src.read(_CHUNK):
        out.write(chunk)
    os.unlink(data_path)
    self.shards.append((name, self.header))
    self.header, self.offset, self.data = {}, 0, None

  def add(self, name: str, array) -> None:
    a = np.asarray(array)
    if not a.flags.c_contiguous:  # (np.ascontiguousarray would also turn a 0-d scale into shape [1])
      a = np.ascontiguousarray(a)
    dtype = _DTYPES.get(a.dtype.name)
    if dtype is None:
      raise ValueError(f"{name}: dtype {a.dtype} has no safetensors name")
    n = a.nbytes
    if self.data is not None and self.offset and self.offset + n > self.max:
      self._close_shard()
    if self.data is None:
      self._open()
    self.data.write(a.tobytes())
    self.header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [self.offset, self.offset + n]}
    self.offset += n
    self.total += n

  def close(self) -> list[str]:
    """Finish the last shard, give the shards their final names (and the index when several); returns the
    file names written."""
    self._close_shard()
    if not self.shards:
      raise ValueError("no tensor was written")
    count = len(self.shards)
    final = ["model.safetensors"] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors"
                                                       for i in range(count)]
    weight_map = {}
    for (tmp, header), name in zip(self.shards, final):
      os.rename(os.path.join(self.folder, tmp), os.path.join(self.folder, name))
      weight_map.update({k: name for k in header})
    if count > 1:
      with open(os.path.join(self.folder, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
      final.append("model.safetensors.index.json")
    return final
