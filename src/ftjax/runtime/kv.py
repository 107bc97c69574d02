"""KV sizing: how large a decode state is, which capacities it can have, and how a context is
read in fixed-size chunks.

Programs are compiled per KV capacity, and a state's KV buffer is addressed with its length, so
its capacity is not its context's. ``KVLayout`` (frozen, built once per engine by
``KVLayout.make``) holds the sizes every program of an engine shares:

* ``kv_capacities``: the capacities a state can have. ``kv_growth="max"``: one buffer of the
  whole context limit; ``"grow"``: 4096 rows, grown 4x (a compiled copy) up to the limit;
* ``chunk_sizes``: the chunk sizes of a prefill (the largest and its quarters down to 16);
* ``plan_chunks``: how ``n`` tokens after a held prefix are read, chunk by chunk;
* ``state_bytes``: the bytes of a decode state of ``batch`` rows at a capacity (the memory
  budget's unit).

No program is compiled here and nothing is allocated: the executor grows and allocates states
from these sizes (``ftjax.runtime.executor``).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from ftjax.model import ModelConfig

KV_DTYPES = ("float32", "bfloat16")
KV_GROWTHS = ("auto", "max", "grow")
MIN_KV_ROWS = 4096  # the smallest KV capacity of a state that grows (by 4x)
MIN_CHUNK = 16  # the smallest prefill chunk size
KV_MAX_AUTO_BYTES = 64 << 20  # kv_growth="auto": one buffer of the whole context up to this


class ContextLengthError(ValueError):
  pass


@dataclasses.dataclass(frozen=True)
class Chunk:
  """One extend program of a prefill: ``tokens`` real tokens from ``begin`` (counted in the
  tokens being read), padded to ``size``; ``anchors``: positions in the chunk at which the
  recurrent layers' states are kept."""
  begin: int
  tokens: int
  size: int
  anchors: tuple[int, ...] = ()


def chunk_sizes(largest: int) -> tuple[int, ...]:
  """The chunk sizes of a prefill whose chunks hold at most ``largest`` tokens: ``largest``
  and its quarters down to ``MIN_CHUNK`` (1024: 1024, 256, 64, 16), largest first. Each size is one
  compiled extend program per KV capacity."""
  sizes = [largest]
  while sizes[-1] // 4 >= MIN_CHUNK:
    sizes.append(sizes[-1] // 4)
  return tuple(sizes)


def split_tokens(n: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
  """``n`` tokens as (tokens, size) chunks of ``sizes`` (largest first): whole chunks of the
  largest size, then the rest in the smallest size that holds it when that size is less than
  twice the rest, else in chunks of the next size down, and so on. Padding stays under the
  rest's own length (the last chunk at most doubles), in few chunks."""
  out = []
  while n > 0:
    if n >= sizes[0]:
      out.append((sizes[0], sizes[0]))
      n -= sizes[0]
      continue
    i = max(j for j, size in enumerate(sizes) if size >= n)  # the smallest size that holds n
    if 2 * n > sizes[i] or i == len(sizes) - 1:
      out.append((n, sizes[i]))
      break
    whole = n // sizes[i + 1]  # 1 or 2: n > sizes[i + 1] and 2n <= sizes[i] = 4 sizes[i + 1]
    out += [(sizes[i + 1], sizes[i + 1])] * whole
    n -= whole * sizes[i + 1]
  return out


def state_bytes(config, batch: int, capacity: int, kv_dtype: str = "float32") -> int:
  """Bytes of a decode state: KV caches of the attention layers (in ``kv_dtype``), conv and
  recurrent state of the Gated DeltaNet layers (float32)."""
  c = config
  linear = sum(t == "linear_attention" for t in c.layer_types)
  kv = 2 * (c.num_layers - linear) * batch * capacity * c.num_kv_heads * c.head_dim
  rec = linear * batch * (c.linear_num_value_heads * c.linear_key_head_dim
                          * c.linear_value_head_dim
                          + max(c.linear_conv_kernel - 1, 0) * c.linear_conv_dim)
  return np.dtype(jnp.dtype(kv_dtype)).itemsize * kv + 4 * rec


@dataclasses.dataclass(frozen=True)
class KVLayout:
  """The KV sizes of one engine (see the module's docstring)."""
  config: ModelConfig
  kv_dtype: str  # "float32" or "bfloat16"
  max_seq_len: int  # the context limit (prompt + new tokens)
  kv_growth: str  # "max" or "grow" (resolved)
  chunk_sizes: tuple[int, ...]  # largest first
  kv_capacities: tuple[int, ...]  # ascending

  @classmethod
  def make(cls, config: ModelConfig, *, kv_dtype: str, max_seq_len: int, kv_growth: str,
           prefill_chunk: int, shares_budget: bool) -> "KVLayout":
    """The layout of ``RuntimeOptions``' KV fields. ``kv_growth="auto"``: "max" when one buffer
    of the whole context (with the recurrent states) takes at most 64 MiB and no device budget
    is shared with it (``shares_budget``), else "grow"."""
    if kv_growth == "auto":
      small = state_bytes(config, 1, max_seq_len + MIN_CHUNK, kv_dtype) <= KV_MAX_AUTO_BYTES
      kv_growth = "max" if small and not shares_budget else "grow"
    # A chunk fits the smallest KV buffer: at most the context limit, and with "grow" at most
    # the first capacity.
    largest = min(prefill_chunk, max_seq_len)
    if kv_growth == "grow":
      largest = min(largest, MIN_KV_ROWS)
    sizes = chunk_sizes(largest)
    # The KV rows a state can need: the context limit, plus the padding of a last chunk that
    # ends past it (``plan_chunks`` keeps that under the smallest chunk size).
    top = max_seq_len + sizes[-1]
    capacities = [top]
    if kv_growth == "grow":  # 4096, 16384, ... while the next still fits, then the limit
      capacities = [MIN_KV_ROWS << 2 * i for i in range(32) if MIN_KV_ROWS << 2 * i + 1 <= top]
      capacities.append(top)
    return cls(config=config, kv_dtype=kv_dtype, max_seq_len=max_seq_len, kv_growth=kv_growth,
               chunk_sizes=sizes, kv_capacities=tuple(capacities))

  def capacity(self, rows: int) -> int:
    """The KV capacity of a state that must hold ``rows`` rows: the smallest of
    ``kv_capacities`` that does."""
    for capacity in self.kv_capacities:
      if capacity >= rows:
        return capacity
    raise ContextLengthError(f"{rows} KV rows exceed the context limit of {self.max_seq_len} "
                             "tokens")

  def state_bytes(self, batch: int, capacity: int) -> int:
    """Bytes of a decode state of ``batch`` rows of ``capacity`` KV rows."""
    return state_bytes(self.config, batch, capacity, self.kv_dtype)

  def check_context(self, prompt_len: int, new: int) -> None:
    if prompt_len < 1:
      raise ValueError("the prompt is empty: give at least one token")
    if prompt_len + new > self.max_seq_len:
      raise ContextLengthError(
          f"prompt ({prompt_len} tokens) + max_new_tokens ({new}) = {prompt_len + new} exceeds the "
          f"context of {self.max_seq_len} tokens: shorten the prompt or lower max_new_tokens")

  def check_ids(self, ids: np.ndarray) -> None:
    """Raises a clear error for token ids outside the vocabulary or of vision inputs."""
    vocab = self.config.vocab_size
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
      raise ValueError(f"token ids must be in [0, {vocab}); got min {ids.min()}, max {ids.max()}")
    vision = np.intersect1d(ids, np.asarray(self.config.vision_token_ids, np.int32))
    if vision.size:
      raise ValueError(
          f"the prompt holds vision token ids {vision.tolist()} (image/video placeholders of "
          f"this {self.config.model_type} checkpoint): ftjax runs the text model only, so "
          "image and video inputs are not supported; remove them from the prompt")

  def plan_chunks(self, start: int, n: int, anchors_at: Sequence[int] = (),
                  anchor_slots: int = 0) -> list[Chunk]:
    """How ``n`` tokens after ``start`` held tokens are read: chunks of ``chunk_sizes``
    (``split_tokens``), each with the ``anchors_at`` positions (counted in the ``n`` tokens,
    ascending) that fall in it. A chunk holds at most ``anchor_slots`` of them (0: none are
    taken): one that would hold more ends before the next. Near the context limit the last
    chunks take the smallest size, so that no chunk's padding runs past the KV buffer."""
    limit = self.kv_capacities[-1]
    out: list[Chunk] = []
    begin = 0
    while begin < n:
      tokens, size = split_tokens(n - begin, self.chunk_sizes)[0]
      inside = [p - begin for p in anchors_at if begin <= p < begin + tokens]
      if anchor_slots and len(inside) > anchor_slots:
        tokens, size = split_tokens(inside[anchor_slots], self.chunk_sizes)[0]
      if start + begin + size > limit:
        size = self.chunk_sizes[-1]
        tokens = min(tokens, size)
      inside = [p for p in inside if p < tokens]
      out.append(Chunk(begin=begin, tokens=tokens, size=size,
                       anchors=tuple(inside) if anchor_slots else ()))
      begin += tokens
    return out
