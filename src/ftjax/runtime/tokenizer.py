"""Tokenizers: the checkpoint's ``tokenizer.json`` via ``tokenizers``, else UTF-8 bytes."""

from __future__ import annotations

import functools
import json
import os
from typing import Protocol, Sequence


class Tokenizer(Protocol):
  name: str

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...

  def token_id(self, token: str) -> int | None: ...

  def token_bytes(self, token: int) -> bytes: ...


def _byte_alphabet() -> dict[str, int]:
  """Byte-level BPE's alphabet: the printable character each byte is written as (GPT-2's
  table: printable Latin-1 bytes as themselves, the others as U+0100 onwards), inverted."""
  printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
  chars = {b: chr(b) for b in printable}
  extra = 0
  for b in range(256):
    if b not in chars:
      chars[b] = chr(256 + extra)
      extra += 1
  return {c: b for b, c in chars.items()}


_BYTE_OF = _byte_alphabet()


class ByteTokenizer:
  """Token i is byte i (UTF-8); used when a model ships no tokenizer.json."""
  name = "bytes"

  def __init__(self, vocab_size: int):
    if vocab_size < 256:
      raise ValueError(f"the model has no tokenizer.json and its vocabulary ({vocab_size}) is "
                       "smaller than 256, so the byte-level fallback cannot encode text")

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids: Sequence[int]) -> str:
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

  def token_id(self, token: str) -> int | None:
    """Bytes have no special tokens: always None."""
    return None

  def token_bytes(self, token: int) -> bytes:
    return bytes([token]) if 0 <= token < 256 else b""


class HFTokenizer:
  name = "tokenizer.json"

  def __init__(self, path: str):
    from tokenizers import Tokenizer as _Tok  # noqa: PLC0415
    self._tok = _Tok.from_file(path)
    with open(path, encoding="utf-8") as f:
      decoder = json.load(f).get("decoder") or {}
    kinds = [d.get("type") for d in decoder.get("decoders", [])] + [decoder.get("type")]
    self._byte_level = "ByteLevel" in kinds
    self._added = set(self._tok.get_added_tokens_decoder())

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text).ids

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode(list(ids), skip_special_tokens=False)

  def token_id(self, token: str) -> int | None:
    """The id of ``token`` as one vocabulary entry (a special token such as ``<think>``), or
    None when the vocabulary has no such entry."""
    return self._tok.token_to_id(token)

  def token_bytes(self, token: int) -> bytes:
    """The bytes token ``token`` stands for (a byte-level vocabulary's piece of a multi-byte
    character too, which ``decode`` cannot show alone); b"" for an id with no entry."""
    piece = self._tok.id_to_token(token)
    if piece is None:
      return b""
    if self._byte_level and token not in self._added and all(c in _BYTE_OF for c in piece):
      return bytes(_BYTE_OF[c] for c in piece)
    return self.decode([token]).encode("utf-8")


@functools.lru_cache(maxsize=16)
def _hf_tokenizer(path: str, mtime_ns: int, size: int) -> HFTokenizer:
  del mtime_ns, size  # the cache key: a rewritten file is read again
  return HFTokenizer(path)


def load_tokenizer(model_dir: str | None, vocab_size: int) -> Tokenizer:
  """The model's ``tokenizer.json`` (parsed once per file and shared: a session or a server
  request does not read it again), else the UTF-8 byte fallback."""
  if model_dir:
    path = os.path.join(model_dir, "tokenizer.json")
    if os.path.isfile(path):
      st = os.stat(path)
      return _hf_tokenizer(os.path.abspath(path), st.st_mtime_ns, st.st_size)
  return ByteTokenizer(vocab_size)


class StreamDecoder:
  """Turns a growing list of ids into text increments, holding back incomplete characters."""

  def __init__(self, tokenizer: Tokenizer):
    self.tokenizer = tokenizer
    self.ids: list[int] = []
    self.emitted = ""

  def push(self, token: int) -> str:
    self.ids.append(token)
    text = self.tokenizer.decode(self.ids)
    if text.endswith("\ufffd"):
      return ""  # wait for the rest of a multi-byte character
    new, self.emitted = text[len(self.emitted):], text
    return new

  def flush(self) -> str:
    text = self.tokenizer.decode(self.ids)
    new, self.emitted = text[len(self.emitted):], text
    return new
