"""Tokenizers: the checkpoint's ``tokenizer.json`` via ``tokenizers``, else UTF-8 bytes."""

from __future__ import annotations

import functools
import os
from typing import Protocol, Sequence


class Tokenizer(Protocol):
  name: str

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: Sequence[int]) -> str: ...

  def token_id(self, token: str) -> int | None: ...


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


class HFTokenizer:
  name = "tokenizer.json"

  def __init__(self, path: str):
    from tokenizers import Tokenizer as _Tok  # noqa: PLC0415
    self._tok = _Tok.from_file(path)

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text).ids

  def decode(self, ids: Sequence[int]) -> str:
    return self._tok.decode(list(ids), skip_special_tokens=False)

  def token_id(self, token: str) -> int | None:
    """The id of ``token`` as one vocabulary entry (a special token such as ``<think>``), or
    None when the vocabulary has no such entry."""
    return self._tok.token_to_id(token)


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
