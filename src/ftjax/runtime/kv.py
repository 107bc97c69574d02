"""KV sizing: how large a decode state is, which capacities it can have, and how a context is
read in chunks of a few fixed sizes.

Programs are compiled per KV capacity, and a state's KV buffer is addressed with its length, so
its capacity is not its context's. ``KVLayout`` (frozen, built once per engine by
``KVLayout.make``) holds the sizes every program of an engine shares:

* ``kv_capacities``: the capacities a state can have. ``kv_growth="max"``: one buffer of the
  whole context limit; ``"grow"``: 4096 rows, grown 4x (a compiled copy) up to the limit;
* ``chunk_sizes``: the chunk sizes of a prefill (the largest and its quarters down to 16);
* ``plan_chunks``: how ``n`` tokens after a held prefix are read, chunk by chunk, in the plan
  of least modelled cost (``plan_sizes``) among those sizes;
* ``state_bytes``: the bytes of a decode state of ``batch`` rows at a capacity (the memory
  budget's unit).

No program is compiled here and nothing is allocated: the executor grows and allocates states
from these sizes (``ftjax.runtime.executor``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from ftjax.model import ModelConfig

KV_DTYPES = ("float32", "bfloat16")
KV_GROWTHS = ("auto", "max", "grow")
MIN_KV_ROWS = 4096  # the smallest KV capacity of a state that grows (by 4x)
MIN_CHUNK = 16  # the smallest prefill chunk size
KV_MAX_AUTO_BYTES = 64 << 20  # kv_growth="auto": one buffer of the whole context up to this
# The fixed cost of one prefill chunk, in padded token slots (``plan_sizes``). A chunk of ``size``
# slots holding ``tokens`` tokens costs about a + b * size + beta * tokens: a, each program's
# fixed work (the LM head, the weights a chunk reads that its compute does not hide, the
# dispatch); b, a slot's dense work (projections, attention), which padding pays too (it gets
# no expert route); beta, a real token's expert work, the same in every plan. Measured, one
# extend program at each size full and a quarter full (2-core Xeon, bf16, KV capacity 4112):
# the 4-layer Qwen3-30B-A3B-shaped bench model, a = 46 ms and b = 0.55 ms a slot between the
# 256- and 1024-chunks (a/b = 83), small chunks dearer (a 16-chunk 98 ms: weight reads); the
# default model, a = 0-1.8 ms and b = 0.033-0.043 ms (a/b up to 40). Over prompts of 1-4096
# tokens, costed by those measurements, 64 brings both models' plans within 1.01x (bench) and
# 1.04x (default) of the least measured cost on average (the old plans, 1.02x and 1.09x).
CHUNK_OVERHEAD = 64


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


def plan_sizes(n: int, sizes: Sequence[int],
               overhead: float = CHUNK_OVERHEAD) -> list[tuple[int, int]]:
  """``n`` tokens as (tokens, size) chunks of ``sizes`` (largest first) in the plan of least
  modelled cost: a chunk costs ``overhead + size`` (in padded token slots, ``CHUNK_OVERHEAD``;
  its real tokens' expert work is the same in every plan). Whole chunks of the largest size
  while at least twice it remains, then the least-cost plan of the rest (``_first_sizes``);
  only the last chunk is padded. With sizes that divide each other (``chunk_sizes`` of a
  power of 4 times 16) no plan of ``n`` tokens costs less, and none costs more than
  ``split_tokens``'. 697 tokens in (1024, 256, 64, 16): three 256-chunks (71 slots of
  padding), not one 1024-chunk (327): costed by ``CHUNK_OVERHEAD``'s per-chunk measurements,
  0.79 s instead of 0.84 s on the bench model; measured end to end (``generate_timed``'s
  prefill, median of 14) on the default model, 49 ms instead of 55 ms."""
  out = []
  while n > 0:
    out.append(first_chunk(n, sizes, overhead))
    n -= out[-1][0]
  return out


def first_chunk(n: int, sizes: Sequence[int],
                overhead: float = CHUNK_OVERHEAD) -> tuple[int, int]:
  """The first (tokens, size) chunk of ``plan_sizes(n, sizes, overhead)``, in constant time."""
  first = _first_sizes(tuple(sizes), float(overhead))
  size = sizes[0] if n >= len(first) else first[n]
  return min(n, size), size


@functools.lru_cache(maxsize=64)
def _first_sizes(sizes: tuple[int, ...], overhead: float) -> tuple[int, ...]:
  """For each length r below twice the largest size, the first chunk's size in a least-cost
  plan of r tokens (``plan_sizes``' cost; index 0 unused): a table of 2 * sizes[0] entries,
  computed once per sizes and overhead. Ties keep the larger chunk first."""
  top = 2 * sizes[0]
  cost = [0.0] * top
  first = [0] * top
  for r in range(1, top):
    best = None
    for size in sizes:  # largest first
      c = overhead + size + cost[max(r - size, 0)]
      if best is None or c < best:
        best, first[r] = c, size
    cost[r] = best
  return tuple(first)


def state_bytes(config, batch: int, capacity: int, kv_dtype: str = "float32") -> int:
  """Bytes of a decode state: KV caches of the attention layers (in ``kv_dtype``), conv and
  recurrent state of the Gated DeltaNet layers (float32)."""
  c = config
  linear = sum(t == "linear_attention" for t in c.layer_types)
  kv = (c.num_layers - linear) * batch * capacity * c.kv_elements_per_token
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
  chunk_overhead: float = CHUNK_OVERHEAD  # a chunk's fixed cost in padded slots (plan_sizes)

  @classmethod
  def make(cls, config: ModelConfig, *, kv_dtype: str, max_seq_len: int, kv_growth: str,
           prefill_chunk: int, shares_budget: bool,
           chunk_overhead: float | None = None) -> "KVLayout":
    """The layout of ``RuntimeOptions``' KV fields. ``kv_growth="auto"``: "max" when one buffer
    of the whole context (with the recurrent states) takes at most 64 MiB and no device budget
    is shared with it (``shares_budget``), else "grow". ``chunk_overhead`` (None:
    ``CHUNK_OVERHEAD``): a prefill chunk's fixed cost in padded slots, which ``plan_chunks``
    weighs against padding."""
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
    if chunk_overhead is None:
      chunk_overhead = CHUNK_OVERHEAD
    if not chunk_overhead >= 0:
      raise ValueError(f"chunk_overhead must be >= 0, got {chunk_overhead}")
    return cls(config=config, kv_dtype=kv_dtype, max_seq_len=max_seq_len, kv_growth=kv_growth,
               chunk_sizes=sizes, kv_capacities=tuple(capacities),
               chunk_overhead=float(chunk_overhead))

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
    """How ``n`` tokens after ``start`` held tokens are read: chunks of ``chunk_sizes`` in the
    plan of least modelled cost (``plan_sizes`` at ``chunk_overhead``), each with the
    ``anchors_at`` positions (counted in the ``n`` tokens, ascending) that fall in it. A chunk
    holds at most ``anchor_slots`` of them (0: none are taken): one that would hold more ends
    before the next, in the first chunk of the least-cost plan up to it. No chunk's padding
    runs past the KV buffer: near the context limit a chunk takes only the sizes that fit
    (the smallest always does)."""
    limit = self.kv_capacities[-1]
    out: list[Chunk] = []
    begin = 0
    while begin < n:
      room = limit - start - begin
      sizes = [size for size in self.chunk_sizes if size <= room] or self.chunk_sizes[-1:]
      tokens, size = first_chunk(n - begin, sizes, self.chunk_overhead)
      inside = [p - begin for p in anchors_at if begin <= p < begin + tokens]
      if anchor_slots and len(inside) > anchor_slots:
        tokens, size = first_chunk(inside[anchor_slots], sizes, self.chunk_overhead)
      inside = [p for p in inside if p < tokens]
      out.append(Chunk(begin=begin, tokens=tokens, size=size,
                       anchors=tuple(inside) if anchor_slots else ()))
      begin += tokens
    return out
