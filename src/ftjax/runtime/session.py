"""Sessions: one conversation's state, reused across turns.

A ``Session`` holds a context (token ids) and the model state that has read it. Each turn,
``set_context(ids)`` makes the context exactly ``ids``: it keeps the longest common prefix of
``ids`` with the tokens already read and prefills only the rest.

- Attention layers rewind by truncation: KV rows before any position stay valid.
- Recurrent layers (Gated DeltaNet) cannot rewind. The session restores the nearest *anchor*
  at or before the common prefix instead: a snapshot of every recurrent layer's state (conv
  inputs and delta-rule state). Without one there, a model with recurrent layers prefills from
  the start.

Anchors are taken at semantic boundaries, the positions of the tokenizer's special tokens that
agent clients edit around: a turn start (``<|im_start|>``), ``<think>``, ``</think>``,
``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>`` (configurable).
An anchor at position ``a`` holds the state after ``tokens[:a]``, where ``tokens[a]`` is the
boundary token: an edit starts at a boundary (a dropped ``<think>`` block begins at its
``<think>``), so the anchor just before the edited region survives the edit.

- During prefill: by default the rest of the context runs as one program, and the anchors
  come from the chunked gated delta rule's intermediate states (``anchor_prefill="inside"``);
  ``"split"`` runs segments that end at the boundaries and copies the state between them.
- At the end of each context, where the reply starts: clients that drop the reply's thinking
  or rewrite it edit from there.
- During generation, the decode loop pauses when it samples a boundary token (before feeding
  it), the state is snapshotted, and the loop goes on.

Anchors live in host memory under a byte budget (``anchor_budget_bytes``). Over budget, the
oldest anchor that is not the newest of its turn goes first, then the oldest of the rest. They
are on by default for models with recurrent layers and unused for the others.

One session drives one engine at a time; the engine's expert cache and statistics are shared
with its other requests.

``session.save(directory)`` and ``Session.restore(engine, directory)`` keep a session across
restarts with orbax (``ftjax.runtime.checkpoint``): the context, the KV rows and recurrent
states that hold it, the anchors and the last logits. Saves are atomic, optionally
asynchronous, and tied to the model's fingerprint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import weakref
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.model import DecodeState, KVCache, LinearState, kv_stored, kv_values
from ftjax.runtime import checkpoint, executor
from ftjax.runtime.checkpoint import CheckpointError
from ftjax.runtime.engine import Engine
from ftjax.runtime.executor import TokenLogprob
from ftjax.runtime.sampling import Sampling
from ftjax.runtime.tokenizer import load_tokenizer

# Special tokens at which anchors are taken by default (Qwen's chat tokens), and the one that
# starts a turn (anchors are grouped by turn for eviction).
DEFAULT_ANCHOR_TOKENS = ("<|im_start|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
                         "<tool_response>", "</tool_response>")
TURN_TOKEN = "<|im_start|>"
DEFAULT_ANCHOR_BUDGET_BYTES = 1 << 30
# Anchors one prefill chunk can take (its program's fixed count): a chunk that would hold more
# ends before the next.
ANCHOR_SLOTS = 8


@dataclasses.dataclass(frozen=True)
class ContextResult:
  """What ``Session.set_context`` did.

  reused_tokens: tokens kept from the state (the restore point); prefilled_tokens: tokens
  run now; anchor_position: the anchor restored (None: none was needed, or none existed);
  last_logits: [V] float32 after the last token; seconds: wall time of the call (compiles
  included; the engine reports them apart in ``engine.compile_s``); logprobs (asked for with
  ``logprobs=True``): each context token's ``TokenLogprob`` given the tokens before it (None
  for the first), as ``Engine.prompt_logprobs`` gives them."""
  reused_tokens: int
  prefilled_tokens: int
  anchor_position: int | None
  last_logits: np.ndarray
  seconds: float
  logprobs: list[TokenLogprob | None] | None = None


@dataclasses.dataclass
class Anchor:
  """The recurrent layers' state after ``position`` tokens, on the host."""
  position: int
  turn: int  # turn-start tokens in tokens[:position + 1]
  serial: int  # order of taking
  layers: dict[int, LinearState]  # layer index -> its state (numpy arrays)
  nbytes: int
  uses: int = 0


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
  n = min(len(a), len(b))
  if n == 0:
    return 0
  diff = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
  return int(diff[0]) if diff.size else n


def _finish(steps: Iterator):
  """Runs a generator to its end; returns its result."""
  while True:
    try:
      next(steps)
    except StopIteration as end:
      return end.value


def _close_writers(writers: dict) -> None:
  for writer in writers.values():
    writer.wait()
    writer.close()


class Session:
  """``Session(engine, anchor_budget_bytes=1 GiB, anchor_tokens=None)``.

  anchor_tokens: the boundary tokens, as ids or as token strings of the model's tokenizer;
    None takes ``DEFAULT_ANCHOR_TOKENS`` that the tokenizer has (none for a model without a
    ``tokenizer.json``: pass ids then). Used only by models with recurrent layers.
  anchor_budget_bytes: host memory for anchors. 0 (or less than one anchor) takes none: the
    session still works, and a model with recurrent layers then reuses its state only when the
    new context extends the one already read.
  turn_token: the token that starts a turn (an id or a string), which groups anchors for
    eviction; None takes the tokenizer's ``<|im_start|>``. Without one, every anchor is of
    one turn and eviction keeps the newest.
  anchor_prefill: how anchors are taken inside a prefill. "inside" (default): one program
    for the whole rest of the context, the anchors computed from the chunked form's
    intermediate states; "split": the context runs in segments that end at the boundaries,
    and the state is copied between them.
  """

  def __init__(self, engine: Engine, *, anchor_budget_bytes: int = DEFAULT_ANCHOR_BUDGET_BYTES,
               anchor_tokens: Sequence[int | str] | None = None,
               anchor_prefill: str = "inside", turn_token: int | str | None = None):
    if not isinstance(engine, Engine):
      raise TypeError(f"Session needs an ftjax.Engine, got {type(engine).__name__}")
    if engine.mesh is not None:
      raise ValueError("sessions run on one device for now: make the engine without devices= "
                       "(its expert-parallel slots serve Engine.generate and Engine.step)")
    if not isinstance(anchor_budget_bytes, (int, np.integer)) or anchor_budget_bytes < 0:
      raise ValueError(f"anchor_budget_bytes must be an int >= 0, got {anchor_budget_bytes!r}")
    if anchor_prefill not in ("inside", "split"):
      raise ValueError(f"anchor_prefill must be 'inside' or 'split', got {anchor_prefill!r}")
    self.engine = engine
    self.anchor_prefill = anchor_prefill
    config = engine.model.config
    self._recurrent = tuple(i for i, kind in enumerate(config.layer_types)
                            if kind == "linear_attention")
    self.anchor_budget_bytes = int(anchor_budget_bytes)
    tokenizer = self._tokenizer()
    self.anchor_ids = self._anchor_ids(anchor_tokens, tokenizer)
    if turn_token is None:
      self.turn_id = tokenizer.token_id(TURN_TOKEN) if tokenizer is not None else None
    else:
      self.turn_id = next(iter(self._anchor_ids([turn_token], tokenizer)))
    self.anchor_bytes = 4 * len(self._recurrent) * (
        config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
        + max(config.linear_conv_kernel - 1, 0) * config.linear_conv_dim)
    self._state: DecodeState | None = None
    self._generating = False  # its state is in the engine's decode loop
    self._fed: list[int] = []  # tokens the state has read
    self._pending: int | None = None  # a generated token not read yet
    self._logits: np.ndarray | None = None  # after self._fed (when nothing is pending)
    self._anchors: dict[int, Anchor] = {}
    self._serial = 0
    self._restores = 0  # anchors restored, over the session's life
    self._turns: list[dict[str, Any]] = []
    self._writers: dict[str, checkpoint.Writer] = {}
    weakref.finalize(self, _close_writers, self._writers)  # pending saves finish first
    self._fingerprint: str | None = None
    self.metadata: dict | None = None  # what the last save or restore carried

  # -- Configuration --------------------------------------------------------------------------

  def _tokenizer(self):
    path = self.engine.model.path
    if path and os.path.isfile(os.path.join(path, "tokenizer.json")):
      return load_tokenizer(path, self.engine.model.config.vocab_size)
    return None

  def _anchor_ids(self, tokens, tokenizer) -> frozenset[int]:
    vocab = self.engine.model.config.vocab_size
    if tokens is None:
      if tokenizer is None:
        return frozenset()
      ids = (tokenizer.token_id(t) for t in DEFAULT_ANCHOR_TOKENS)
      return frozenset(i for i in ids if i is not None)
    out = set()
    for t in tokens:
      if isinstance(t, str):
        i = tokenizer.token_id(t) if tokenizer is not None else None
        if i is None:
          raise ValueError(f"anchor token {t!r} is not one entry of this model's vocabulary"
                           + ("" if tokenizer is not None else " (the model has no "
                              "tokenizer.json): pass token ids instead"))
        out.add(int(i))
      elif isinstance(t, (int, np.integer)) and 0 <= t < vocab:
        out.add(int(t))
      else:
        raise ValueError(f"anchor tokens must be token strings or ids in [0, {vocab}), got {t!r}")
    return frozenset(out)

  @property
  def anchoring(self) -> bool:
    """Whether this session takes anchors: the model has recurrent layers, there are boundary
    tokens, and one anchor fits the budget."""
    return bool(self._recurrent and self.anchor_ids
                and self.anchor_bytes <= self.anchor_budget_bytes)

  @property
  def anchor_slots(self) -> int:
    """Anchors each prefill chunk's program can take (0 when this session takes none inside
    a prefill): with the engine's ``programs_needed(anchor_slots)``, every program this
    session can run."""
    return ANCHOR_SLOTS if self.anchoring and self.anchor_prefill == "inside" else 0

  # -- State ----------------------------------------------------------------------------------

  @property
  def generating(self) -> bool:
    """Whether a generation of this session is running (its state is in the decode loop)."""
    return self._generating

  @property
  def tokens(self) -> list[int]:
    """The current context: what was set plus what was generated since."""
    return self._fed + ([self._pending] if self._pending is not None else [])

  @property
  def read_tokens(self) -> list[int]:
    """The tokens the state has read (``tokens`` but a last generated one not read yet)."""
    return list(self._fed)

  @property
  def anchor_positions(self) -> list[int]:
    """The positions the recurrent layers' state can be put back to (its anchors)."""
    return sorted(self._anchors)

  def _ensure_capacity(self, needed: int) -> None:
    """A state whose KV caches hold at least ``needed`` rows (one of the engine's
    ``kv_capacities``)."""
    if self._state is None:
      self._state = self.engine.new_state(1, needed, owner=self)
    else:
      self._state = self.engine.grow_state(self._state, needed, owner=self)

  def close(self) -> None:
    """Drops the decode state (its device memory goes back to the engine's budget), the
    context and the anchors; the turn history is kept. The next ``set_context`` starts from
    nothing. The server's pool closes the sessions it drops (idle ones, or one whose state a
    failed decode loop lost)."""
    self._state, self._generating = None, False
    self._fed.clear()
    self._pending, self._logits = None, None
    self._anchors.clear()
    self.engine.hold_memory(self, 0)

  def _rewind(self, position: int, anchor: Anchor | None) -> None:
    """The state after ``self._fed[:position]``: KV caches truncated; recurrent layers from
    ``anchor`` (or zero at position 0)."""
    layers = list(self._state.layers)
    for i in self._recurrent:
      if anchor is not None:
        layers[i] = jax.device_put(anchor.layers[i])
      else:
        if position != 0:
          raise AssertionError("a recurrent state can only restart at 0 without an anchor")
        layers[i] = jax.tree.map(jnp.zeros_like, layers[i])
    self._state = DecodeState(layers=tuple(layers), length=jnp.asarray(position, jnp.int32))
    del self._fed[position:]

  def reusable_tokens(self, token_ids: Sequence[int]) -> int:
    """How many tokens ``set_context(token_ids)`` would keep rather than prefill: the common
    prefix for attention-only models, the restore point (an anchor, or the whole context
    when ``token_ids`` extends it) for models with recurrent layers."""
    new = [int(t) for t in token_ids]
    if not new or self._state is None:
      return 0
    common = _common_prefix(self._fed, new)
    return self._restore_point(min(common, len(new) - 1))[0]

  def fork(self) -> "Session":
    """An independent copy of this session: the same options, context, state (copied) and
    anchors (shared: they are never written), with no turn history. The server forks a
    session whose prefix a request shares, so that both conversations keep their state."""
    other = Session(self.engine, anchor_budget_bytes=self.anchor_budget_bytes,
                    anchor_tokens=sorted(self.anchor_ids), anchor_prefill=self.anchor_prefill,
                    turn_token=self.turn_id)
    state = None
    if self._state is not None:
      self.engine.hold_memory(other, self.engine.state_bytes(1, self._state.capacity))
      state = jax.tree.map(jnp.copy, self._state)
    other.take_over(state, list(self._fed), self._pending,
                    None if self._logits is None else self._logits.copy(),
                    {p: dataclasses.replace(a, uses=0) for p, a in self._anchors.items()},
                    self._serial)
    return other

  def take_over(self, state, fed: list[int], pending, logits, anchors: dict,
                serial: int) -> None:
    """Makes this new session hold a context: its decode state (already held in the engine's
    budget by this session), the tokens fed and the one pending, the logits after them, the
    anchors and their serial (``fork``)."""
    self._state, self._fed, self._pending, self._logits = state, fed, pending, logits
    self._anchors, self._serial = anchors, serial

  def memory_bytes(self) -> int:
    """Host/device memory this session holds: its decode state (KV rows allocated, recurrent
    states) and its anchors."""
    held = 0 if self._state is None else self.engine.state_bytes(1, self._state.capacity)
    return held + sum(a.nbytes for a in self._anchors.values())

  def _restore_point(self, limit: int) -> tuple[int, Anchor | None]:
    """The largest position <= ``limit`` the state can be put back to, and its anchor."""
    if not self._recurrent or len(self._fed) <= limit:
      return min(limit, len(self._fed)), None
    usable = [a for a in self._anchors if a <= limit]
    if not usable:
      return 0, None
    return max(usable), self._anchors[max(usable)]

  def _snapshot(self, boundary: int | None, layers: dict | None = None) -> None:
    """Takes an anchor of the current state, which has read ``self._fed`` (``layers``: its
    recurrent layers' states on the device, when the state is in a decode batch);
    ``boundary`` is the token that comes next (None at the end of a context, where
    generation starts)."""
    position = len(self._fed)
    if position == 0 or position in self._anchors:
      return
    if layers is None:
      layers = {i: self._state.layers[i] for i in self._recurrent}
    layers = {i: jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(layers[i]))
              for i in self._recurrent}
    self._store(position, layers, self._fed, boundary)

  def _store(self, position: int, layers: dict[int, LinearState], tokens: Sequence[int],
             boundary: int | None) -> None:
    """Keeps ``layers`` (numpy) as the anchor after ``tokens[:position]``."""
    turn = 0
    if self.turn_id is not None:
      turn = list(tokens[:position]).count(self.turn_id) + (boundary == self.turn_id)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(layers))
    self._anchors[position] = Anchor(position=position, turn=turn, serial=self._serial,
                                     layers=layers, nbytes=nbytes)
    self._serial += 1
    self._evict()

  def _evict(self) -> None:
    while sum(a.nbytes for a in self._anchors.values()) > self.anchor_budget_bytes:
      newest = {}
      for a in self._anchors.values():
        if a.turn not in newest or a.serial > newest[a.turn]:
          newest[a.turn] = a.serial
      older = [a for a in self._anchors.values() if a.serial != newest[a.turn]]
      victim = min(older or self._anchors.values(), key=lambda a: a.serial)
      del self._anchors[victim.position]

  def _extend(self, segment: Sequence[int], anchors_at: Sequence[int] = (), targets=None,
              scored: list | None = None):
    """Reads ``segment`` after the tokens already read, in the engine's fixed-size chunks
    (``Executor.extend_steps``: yields after each chunk but the last); returns the logits
    after it. Anchors are taken inside it at the positions ``anchors_at`` (counted in the
    context; the token at each is a boundary). With ``targets`` (the token after each of the
    segment's), their log-probs are appended to ``scored``."""
    engine = self.engine
    first = len(self._fed)
    last = engine.plan_chunks(first, len(segment))[-1]
    self._ensure_capacity(first + last.begin + last.size)
    state, self._state = self._state, None  # donated to the programs
    try:
      read = yield from engine.executor.extend_steps(
          state, segment, anchors_at=[p - first for p in anchors_at],
          anchor_slots=self.anchor_slots, start=first, targets=targets)
    except BaseException:  # the state is gone: the session starts again from no context
      self.engine.hold_memory(self, 0)
      self._fed.clear()
      self._anchors.clear()
      self._pending, self._logits = None, None
      raise
    self._state = read.state
    if targets is not None:
      scored += read.logprobs
    self._fed.extend(int(t) for t in segment)
    for position, layers in read.snapshots:
      self._store(first + position, layers, self._fed, self._fed[first + position])
    return read.logits

  # -- Public API -----------------------------------------------------------------------------

  def set_context(self, token_ids: Sequence[int] | np.ndarray, *,
                  logprobs: bool = False) -> ContextResult:
    """Makes the context exactly ``token_ids`` (at least one token), reusing what it can.
    ``logprobs``: each token's log-probs too (``ContextResult.logprobs``); the whole context
    is then read again, as log-probs are made by the forward that reads a token."""
    return _finish(self.context_steps(token_ids, logprobs=logprobs))

  def context_steps(self, token_ids: Sequence[int] | np.ndarray, *, logprobs: bool = False
                    ) -> Iterator[int]:
    """``set_context`` one prefill chunk at a time: a generator that yields after each chunk
    it dispatches but the last, and returns the ``ContextResult``. The server runs it between
    the decode chunks of the sequences already running."""
    return self._context_steps(token_ids, turn=True, logprobs=logprobs)

  def _context_steps(self, token_ids, *, turn: bool, logprobs: bool = False):
    t0 = time.perf_counter()
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
      raise ValueError(f"token_ids must be a flat sequence of ints, got an array of "
                       f"{ids.dtype} with shape {ids.shape}")
    ids = ids.astype(np.int32)
    self.engine.check_ids(ids)
    self.engine.check_context(len(ids), 0)
    new = ids.tolist()
    if self._generating:
      raise RuntimeError("the session is generating (its state is in a decode batch): set "
                         "its context once the generation has ended")
    if new == self._fed and self._pending is None and self._logits is not None and (
        not logprobs):
      return self._record_turn(ContextResult(
          reused_tokens=len(new), prefilled_tokens=0, anchor_position=None,
          last_logits=self._logits, seconds=time.perf_counter() - t0), turn)
    common = 0 if logprobs else _common_prefix(self._fed, new)
    for position in [a for a in self._anchors if a > common]:
      del self._anchors[position]  # their prefix changed
    start, anchor = self._restore_point(min(common, len(new) - 1))
    if self._state is not None and (start != len(self._fed) or anchor is not None):
      self._rewind(start, anchor)
    if anchor is not None:
      anchor.uses += 1
      self._restores += 1
    self._pending, self._logits = None, None
    ends = []
    if self.anchoring:
      ends = [q for q in range(start + 1, len(new)) if new[q] in self.anchor_ids
              and q not in self._anchors]
    if self._state is not None and self.anchoring and new[start] in self.anchor_ids:
      self._snapshot(new[start])
    targets = np.append(np.asarray(new[1:], np.int32), -1) if logprobs else None
    scored: list = []
    if self.anchor_prefill == "inside":
      logits = yield from self._extend(new[start:], ends,
                                       None if targets is None else targets[start:], scored)
    else:
      begin = start
      for end in ends + [len(new)]:
        logits = yield from self._extend(
            new[begin:end], (), None if targets is None else targets[begin:end], scored)
        if end < len(new):
          self._snapshot(new[end])
        begin = end
    self._logits = np.asarray(logits, np.float32)
    if self.anchoring:
      self._snapshot(None)  # where the reply starts: clients edit it (dropped thinking)
    return self._record_turn(ContextResult(
        reused_tokens=start, prefilled_tokens=len(new) - start,
        anchor_position=anchor.position if anchor is not None else None,
        last_logits=self._logits, seconds=time.perf_counter() - t0,
        logprobs=[None] + scored[:-1] if logprobs else None), turn)

  def _record_turn(self, result: ContextResult, turn: bool) -> ContextResult:
    if turn:
      self._turns.append({"context_tokens": result.reused_tokens + result.prefilled_tokens,
                          "reused_tokens": result.reused_tokens,
                          "prefilled_tokens": result.prefilled_tokens,
                          "anchor_position": result.anchor_position,
                          "seconds": result.seconds, "generated_tokens": 0})
    return result

  def generate(self, max_new_tokens: int, greedy: bool = True, *, temperature: float = 1.0,
               top_p: float = 1.0, seed: int = 0, top_k: int = 0,
               stop_tokens: Sequence[int] = (), on_token: Callable[[int], None] | None = None,
               cancel: Callable[[], bool] | None = None) -> list[int]:
    """Continues the context by up to ``max_new_tokens`` tokens (sampled as
    ``Engine.generate`` samples them: the same tokens for the same seed) and returns them;
    they become part of the context. Generation stops after a token of ``stop_tokens``.

    on_token: called with each new token as it arrives (a decode program's tokens arrive
      together, ``decode_chunk`` at a time). cancel: checked after each decode program; when
      it returns True generation stops there (a client that went away): the tokens so far are
      returned and kept."""
    seq = self.generation(max_new_tokens, greedy, temperature=temperature, top_p=top_p,
                          seed=seed, top_k=top_k, stop_tokens=stop_tokens, on_token=on_token,
                          cancel=cancel)
    if seq is None:
      return []
    self.engine.executor.run_one(seq)
    return list(seq.tokens)

  def generation(self, max_new_tokens: int, greedy: bool = True, *, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int = 0, top_k: int = 0,
                 stop_tokens: Sequence[int] = (),
                 on_token: Callable[[int], None] | None = None,
                 cancel: Callable[[], bool] | None = None,
                 on_done: Callable[[list[int]], None] | None = None,
                 logprobs: bool = False) -> executor.Generation | None:
    """``generate`` as a sequence for the engine's decode loop (``Executor.run``), which the
    server runs in a batch with other sessions' sequences; None for ``max_new_tokens = 0``.
    ``on_done(tokens)`` is told when it has ended and the session has its state back.
    ``logprobs``: the sequence's ``logprobs`` list gets each new token's ``TokenLogprob``
    before ``on_token`` hears of the token."""
    engine = self.engine
    if not self.tokens:
      raise ValueError("the session has no context: call set_context(token_ids) first")
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 0:
      raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    sampling = Sampling.make(greedy=greedy, temperature=temperature, top_p=top_p, seed=seed,
                             top_k=top_k)
    user_stops = {int(t) for t in stop_tokens}
    if self._pending is not None:  # read the last generated token first
      _finish(self._context_steps(self.tokens, turn=False))
    engine.check_context(len(self._fed), max_new_tokens)
    if max_new_tokens == 0:
      return None
    pause = sorted(user_stops | (self.anchor_ids if self.anchoring else set()))
    self._ensure_capacity(len(self._fed) + max_new_tokens)
    out: list[int] = []

    def on_chunk(tokens: list[int], halted: bool, layers) -> bool:
      for tok in tokens:
        if self._pending is not None:
          self._fed.append(self._pending)
        self._pending, self._logits = tok, None
        out.append(tok)
        if on_token is not None:
          on_token(tok)
      if self._pending in user_stops or len(out) >= max_new_tokens:
        return False
      if cancel is not None and cancel():
        return False
      if halted and self.anchoring and self._pending in self.anchor_ids:
        self._snapshot(self._pending, layers())  # before the boundary token is read
      return True

    def on_leave(seq: executor.Generation) -> None:
      # The session takes its state back, and the generation lets go of it: a generation
      # kept past its end (a server's reply refers to it) must not hold a dropped session's
      # KV buffers until Python's next full collection.
      self._state, seq.state, self._generating = seq.state, None, False
      if self._turns:
        turn = self._turns[-1]
        turn["generated_tokens"] += len(out)
        for key, value in seq.stats.items():  # its decode steps (shared with a batch's rows)
          turn.setdefault("decode", {}).setdefault(key, 0)
          turn["decode"][key] += value
      if on_done is not None:
        on_done(out)

    state, self._state, self._generating = self._state, None, True
    return executor.Generation(state=state, logits=jax.device_put(self._logits),
                             max_new=int(max_new_tokens), sampling=sampling, stops=pause,
                             on_chunk=on_chunk, on_leave=on_leave, cancel=cancel, owner=self,
                             logprobs=[] if logprobs else None)

  def stats(self) -> dict[str, Any]:
    """Anchors held (positions, turns, bytes, and how often each was restored), anchors
    restored over the session's life, the budget, and per turn: tokens reused, prefilled and
    generated, the anchor restored, the seconds of ``set_context`` and ``decode``: the
    generation's decode steps (``Generation.stats``: steps, rows beside it summed over them,
    and the expert cache's hits, fills and host-run experts of those steps)."""
    anchors = sorted(self._anchors.values(), key=lambda a: a.position)
    return {
        "context_tokens": len(self.tokens),
        "recurrent_layers": len(self._recurrent),
        "anchoring": self.anchoring,
        "anchor_token_ids": sorted(self.anchor_ids),
        "anchor_budget_bytes": self.anchor_budget_bytes,
        "anchors": len(anchors),
        "anchor_bytes": sum(a.nbytes for a in anchors),
        "anchor_restores": self._restores,
        "anchor_list": [{"position": a.position, "turn": a.turn, "bytes": a.nbytes,
                         "uses": a.uses} for a in anchors],
        "turns": [dict(t) for t in self._turns],
        "reused_tokens": sum(t["reused_tokens"] for t in self._turns),
        "prefilled_tokens": sum(t["prefilled_tokens"] for t in self._turns),
    }

  # -- Persistence ----------------------------------------------------------------------------

  @property
  def model_fingerprint(self) -> str:
    if self._fingerprint is None:
      self._fingerprint = checkpoint.model_fingerprint(self.engine.model)
    return self._fingerprint

  def save(self, directory: str | os.PathLike, *, wait: bool = True,
           metadata: dict | None = None) -> int:
    """Saves the session as a new step of the checkpoint directory ``directory`` (created if
    needed); returns the step. ``metadata`` (JSON-serialisable; a chat's messages, say) is
    saved with it and comes back as ``restored.metadata``. The previous step stays restorable until this one is complete,
    whatever happens to the process. ``wait=False`` returns once the arrays are copied to host
    memory and writes them in the background: call ``wait_for_saves()`` before relying on the
    files (and before the process exits)."""
    if not self._fed:
      raise ValueError("the session has no context to save: call set_context(token_ids) first")
    n = len(self._fed)

    def host(x):
      return np.array(jax.device_get(x), copy=True)

    layers = {}
    for i, layer in enumerate(self._state.layers):
      if isinstance(layer, KVCache):
        # A latent attention's values are its keys: its empty value rows are not saved (orbax
        # refuses zero-size arrays).
        # A bfloat16 cache is held as its bits (KV_BITS): saved as its bfloat16 values.
        layers[str(i)] = {"k": host(kv_values(layer.k[:, :n]))}
        if layer.v.size:
          layers[str(i)]["v"] = host(kv_values(layer.v[:, :n]))
      else:
        layers[str(i)] = {"conv": host(layer.conv), "recurrent": host(layer.recurrent)}
    arrays: dict[str, Any] = {"layers": layers}
    if self._logits is not None:
      arrays["logits"] = np.array(self._logits, copy=True)
    if self._anchors:
      arrays["anchors"] = {str(a.position): {str(i): {"conv": s.conv, "recurrent": s.recurrent}
                                             for i, s in a.layers.items()}
                           for a in self._anchors.values()}
    c = self.engine.model.config
    meta = {
        "model_fingerprint": self.model_fingerprint, "model_type": c.model_type,
        "tokens": list(self._fed), "pending": self._pending,
        "anchors": [{"position": a.position, "turn": a.turn, "serial": a.serial,
                     "uses": a.uses} for a in self._anchors.values()],
        "serial": self._serial, "restores": self._restores, "turns": self._turns,
        "metadata": metadata, "ftjax_version": checkpoint.writer_version(),
    }
    try:
      json.dumps(metadata)
    except (TypeError, ValueError) as e:
      raise ValueError(f"metadata must be JSON-serialisable: {e}") from None
    self.metadata = metadata
    path = os.path.abspath(os.fspath(directory))
    writer = self._writers.get(path)
    if writer is None:
      writer = self._writers[path] = checkpoint.Writer(path, asynchronous=True)
    step = writer.save(arrays, meta)
    if wait:
      writer.wait()
    return step

  def wait_for_saves(self) -> None:
    """Blocks until every save of this session is committed."""
    for writer in self._writers.values():
      writer.wait()

  @classmethod
  def restore(cls, engine: Engine, directory: str | os.PathLike, **options) -> "Session":
    """The session saved in ``directory`` (its newest complete step), on ``engine``, which must
    run the model it was saved from. ``options`` are the constructor's (anchor budget and
    tokens); anchors over the budget are evicted as usual."""
    arrays, meta, step = checkpoint.read(directory)
    session = cls(engine, **options)
    where = f"{os.path.abspath(os.fspath(directory))} (step {step})"
    if meta.get("model_fingerprint") != session.model_fingerprint:
      raise CheckpointError(
          f"the session checkpoint {where} was saved from another model ({meta.get('model_type')}"
          f", fingerprint {meta.get('model_fingerprint')}); this engine runs "
          f"{engine.model.config.model_type}, fingerprint {session.model_fingerprint}: restore it "
          "into an engine of the model it was saved from")
    session.read_checkpoint(arrays, meta, where)
    return session

  def read_checkpoint(self, arrays: dict, meta: dict, where: str) -> None:
    """Makes this new session's context and state the checkpoint's (``restore``: ``arrays``
    and ``meta`` as ``checkpoint.read`` gives them; ``where`` names it in errors)."""
    fed = [int(t) for t in meta["tokens"]]
    self.engine.check_ids(np.asarray(fed, np.int32))
    n = len(fed)
    self._ensure_capacity(n)
    layers = []
    for i, layer in enumerate(self._state.layers):
      saved = arrays["layers"].get(str(i), {})
      if isinstance(layer, KVCache):
        shape = (layer.k.shape[0], n, *layer.k.shape[2:])
        v_shape = (layer.v.shape[0], n, *layer.v.shape[2:])
        v_saved = np.shape(saved.get("v")) if layer.v.size else v_shape
        if tuple(np.shape(saved.get("k"))) != shape or tuple(v_saved) != v_shape:
          raise CheckpointError(f"the session checkpoint {where} has KV rows of layer {i} that do "
                                f"not fit the model (expected {shape} and {v_shape})")
        layers.append(KVCache(
            k=layer.k.at[:, :n].set(kv_stored(jnp.asarray(saved["k"]), layer.k.dtype)),
            v=(layer.v.at[:, :n].set(kv_stored(jnp.asarray(saved["v"]), layer.v.dtype))
               if layer.v.size else layer.v)))
      else:
        layers.append(jax.device_put(self._linear_state(saved, layer, f"layer {i}", where)))
    self._state = DecodeState(layers=tuple(layers), length=jnp.asarray(n, jnp.int32))
    self._fed = fed
    self._pending = None if meta["pending"] is None else int(meta["pending"])
    self._logits = np.asarray(arrays["logits"], np.float32) if "logits" in arrays else None
    template = {i: self._state.layers[i] for i in self._recurrent}
    for info in sorted(meta["anchors"], key=lambda a: a["serial"]):
      saved = arrays["anchors"][str(info["position"])]
      states = {i: self._linear_state(saved.get(str(i), {}), template[i],
                                      f"anchor {info['position']}", where)
                for i in self._recurrent}
      self._anchors[info["position"]] = Anchor(
          position=info["position"], turn=info["turn"], serial=info["serial"], layers=states,
          nbytes=sum(x.nbytes for x in jax.tree.leaves(states)), uses=info["uses"])
    self._serial, self._restores = meta["serial"], meta["restores"]
    self._turns = [dict(t) for t in meta["turns"]]
    self.metadata = meta.get("metadata")
    self._evict()

  @staticmethod
  def _linear_state(saved: dict, like: LinearState, what: str, where: str) -> LinearState:
    """The saved state of one recurrent layer (numpy), checked against ``like``'s shapes."""
    for key in ("conv", "recurrent"):
      if tuple(np.shape(saved.get(key))) != tuple(getattr(like, key).shape):
        raise CheckpointError(f"the session checkpoint {where} has a {key} state of {what} that "
                              f"does not fit the model (expected {getattr(like, key).shape})")
    return LinearState(conv=np.array(saved["conv"], like.conv.dtype),
                       recurrent=np.array(saved["recurrent"], like.recurrent.dtype))
