"""The executor: every program a request runs, and the one loop that runs them.

An ``Executor`` belongs to one ``Engine`` and owns what the programs share: the compiled
executables (``compiled``, keyed by the program's name and bucketed sizes, with the compile
count and seconds), the hand-off of the engine's state to a program and back (``engine_state``
and ``keep``: the expert cache rides, donated, in every program), the per-step records
(``record``: cache counts and routing), and the two ways a sequence is run:

* ``extend`` (and ``extend_steps``, one chunk at a time): a context read into one sequence's
  state in the engine's fixed-size chunks (``Engine.plan_chunks``);
* ``run``: the decode loop. Sequences (``Generation``: a state that has read its context, and
  the logits after it) join a ``Batch`` of rows, decode together in one program per chunk
  (``programs.decode_program``: per-row lengths, sampling and stops), and leave it with their
  state when they finish. A lone request is a batch of one; the server's is ``max_running``
  rows, which sequences join and leave between chunks without a compile. A ``Feed`` (the
  server's scheduler) gives the loop new sequences and runs their prefills one chunk at a time
  between decode chunks, so a long prompt never stalls the running rows for more than a chunk.

Each decode chunk is dispatched before the previous one is read while nothing is about to
change (no row halted, left or joined), so the device does not wait for the host; a change is
applied once the chunks in flight are read.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ftjax.model import DecodeState, KVCache, init_state
from ftjax.runtime import programs
from ftjax.runtime.placement import EXPERT_AXIS
from ftjax.runtime.programs import Loop, Rows
from ftjax.runtime.sampling import Sampling
from ftjax.runtime.state import EngineState

STOP_BUCKET = 32  # stop-token lists are padded to a multiple of this (one size in practice)


@dataclasses.dataclass
class Extended:
  """What ``Executor.extend`` did: the state (donated in, returned), the logits [V] after the
  last token (on the device), the anchors' snapshots (position, {layer: LinearState of numpy
  arrays}), the seconds of its chunks and the programs run."""
  state: DecodeState
  logits: jax.Array
  snapshots: list[tuple[int, dict]]
  seconds: float
  programs: int


@dataclasses.dataclass(eq=False)
class Generation:
  """One sequence for the decode loop.

  state: its decode state, one row, having read its context (the loop takes it, and gives it
    back when the sequence leaves, having read every token but the last);
  logits: [V] after the context, from which the first token is sampled;
  max_new: tokens to generate at most; sampling: how (``Sampling.make``);
  stops: tokens at which the device halts the sequence's row (the host then decides);
  on_chunk(tokens, halted, layers) -> bool: told of each chunk's new tokens (the first token
    alone), whether the row halted, and ``layers()``, the recurrent layers' states of the row
    now ({layer index: LinearState} on the device; the state has read every token but the
    last). True: the sequence goes on (a halted row resumes); False: it leaves;
  on_leave(sequence): told when it has left (``state`` is its own again);
  cancel() -> bool: asked before each chunk is dispatched: True leaves without running
    another (the tokens of a chunk already in flight still come);
  owner: who holds its state's memory (``Engine.hold_memory``; None: the engine): the loop
    moves the count to the batch while the sequence is in one, and back when it leaves.
  stats: what its decode steps did: steps it stepped in, the rows that stepped with it
    (summed over those steps) and, with an expert cache, the hits, fills and host-run experts
    of those steps (shared with the rows beside it: a layer-step plans over the union of
    the batch's routed experts).
  """
  state: DecodeState | None
  logits: jax.Array
  max_new: int
  sampling: Sampling
  stops: Sequence[int] = ()
  on_chunk: Callable[[list[int], bool, Callable[[], dict]], bool] = (
      lambda tokens, halted, layers: not halted)  # default: leave at a stop or the limit
  on_leave: Callable[["Generation"], None] = lambda _: None
  cancel: Callable[[], bool] | None = None
  owner: Any = None
  tokens: list[int] = dataclasses.field(default_factory=list)  # delivered so far
  programs: int = 0  # programs it ran in (the first token's, and decode chunks)
  first_s: float = 0.0  # seconds of the first token's program and its read (not its compile)
  stats: dict[str, int] = dataclasses.field(default_factory=lambda: {
      "steps": 0, "batch_rows": 0, "hits": 0, "fills": 0, "host": 0})


class Feed:
  """What the decode loop asks of a source of sequences (the server's scheduler) between
  chunks. ``ready(free)``: sequences whose context is read, to join now (at most ``free``);
  ``pending()``: whether one is ready (the loop then stops dispatching ahead); ``work()``: run
  at most one prefill chunk, returning whether there was any to run."""

  def ready(self, free: int) -> list[Generation]:
    return []

  def pending(self) -> bool:
    return False

  def work(self) -> bool:
    return False


class Batch:
  """Rows of sequences that decode together: a decode state of ``size`` rows (each at its
  own length), the loop's carry, and the host's view of each row (its sequence, its stops,
  sampling and limit, and what the host decided after the last chunk read)."""

  def __init__(self, size: int, capacity: int, stop_width: int = STOP_BUCKET):
    self.size, self.capacity = size, capacity
    self.state: DecodeState | None = None  # allocated by the executor on first join
    self.rows: Rows | None = None
    self.seqs: list[Generation | None] = [None] * size
    self.max_new = np.zeros(size, np.int32)
    self.counts = np.zeros(size, np.int32)  # tokens of each row's sequence, as last read
    self.stop_ids = np.full((size, stop_width), -1, np.int32)
    self.sampling = jax.tree.map(lambda x: np.repeat(np.asarray(x)[None], size, 0),
                                 Sampling.make(greedy=True))
    self.resume = np.zeros(size, bool)  # rows whose halt the next chunk lifts
    self.leaving: set[int] = set()  # rows that leave once the chunks in flight are read
    self.decided: set[int] = set()  # rows the host has acted on since its last dispatch

  def free(self) -> int:
    return sum(s is None for s in self.seqs)

  def go(self) -> np.ndarray:
    return np.asarray([s is not None and r not in self.leaving
                       for r, s in enumerate(self.seqs)])

  def stepping(self) -> bool:
    """Whether a row runs (or is to be resumed or to leave)."""
    return bool(self.go().any() or self.leaving)


class Executor:
  """The programs and the loop of one engine (see the module's docstring)."""

  def __init__(self, engine, initial_cache=None):
    self.engine = engine
    self.cache = initial_cache  # the expert cache as of the last program (None: none)
    self.steps: list[dict[str, Any]] = []  # per step: cache counts and seconds
    self.routing: list[tuple[np.ndarray, np.ndarray, str]] = []  # ids, weights [L, t, K]
    self.totals = {"hits": 0, "fills": 0, "host": 0}  # over the engine's life
    self.compile_count = 0
    self.compile_s = 0.0
    # Told of each program compiled: (key: the program's name and bucketed sizes, seconds).
    self.compile_listener: Callable[[tuple, float], None] | None = None

  # -- Programs and state hand-off -------------------------------------------------------------

  def compiled(self, key: tuple, program, *args, **static):
    """The executable of ``program`` for ``key`` (compiled from ``args`` on first use,
    shared by the engines of one model), counted in ``compile_count`` and ``compile_s``."""
    def counted(seconds):
      self.compile_count += 1
      self.compile_s += seconds
      if self.compile_listener is not None:
        self.compile_listener(key, seconds)
    return self.engine.programs.compiled(key, program, *args, on_compile=counted, **static)

  def put(self, tree):
    """Program inputs to the device: replicated over the mesh when there is one."""
    mesh = self.engine.mesh
    if mesh is None:
      return jax.device_put(tree)
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))

  def slot_capacity(self) -> int:
    """The expert cache's slot buffer size (-1 without a cache): part of every program key."""
    return -1 if self.cache is None else self.cache.capacity

  def engine_state(self, decode: DecodeState) -> EngineState:
    """What a program takes: ``decode`` with the engine's expert cache and bandwidths."""
    if self.cache is None:
      return EngineState(decode=decode)
    engine = self.engine
    bandwidths = engine.bandwidths if engine.bandwidths is not None else np.ones(2, np.float32)
    state = EngineState(decode=decode, cache=self.cache,
                        bandwidths=jax.device_put(np.asarray(bandwidths, np.float32)))
    if engine.mesh is None:
      return state
    # Everything replicated but the slots, split along N: the compiled programs expect
    # exactly these shardings.
    slots = jax.device_put(self.cache.slots,
                           NamedSharding(engine.mesh, PartitionSpec(EXPERT_AXIS)))
    state = self.put(state.replace(cache=self.cache.replace(slots=None)))
    return state.replace(cache=state.cache.replace(slots=slots))

  def keep(self, state: EngineState) -> DecodeState:
    """Takes a program's output state: the executor keeps the newest expert cache."""
    if self.cache is not None:
      self.cache = state.cache
    return state.decode

  def record(self, record, seconds: float, phase: str, tokens: int = 1,
             stepped: np.ndarray | None = None) -> np.ndarray | None:
    """Host copies of a program's per-step record (one read per program). ``stepped``
    [steps, B] bool: a decode chunk's rows that stepped at each step (the record then has a
    leading steps axis); else one forward of ``tokens`` tokens. Returns a decode chunk's
    hits, fills and host-run experts per step ([steps, 3], summed over the layers; None
    without an expert cache)."""
    stats, routing = jax.device_get((record.stats, record.routing))
    if stepped is None:
      if stats is not None:
        for key in self.totals:
          self.totals[key] += int(np.sum(getattr(stats, key)))
        self.steps.append({"tokens": tokens, "hits": stats.hits, "fills": stats.fills,
                           "host": stats.host, "streamed": stats.streamed,
                           "host_routes": stats.host_routes, "seconds": seconds})
      if routing is not None:
        self.routing.append((routing.ids[:, :tokens], routing.weights[:, :tokens], phase))
      return None
    n = len(stepped)
    for i in range(n):
      if stats is not None:
        for key in self.totals:
          self.totals[key] += int(np.sum(getattr(stats, key)[i]))
        self.steps.append({"tokens": int(stepped[i].sum()), "hits": stats.hits[i],
                           "fills": stats.fills[i], "host": stats.host[i],
                           "streamed": stats.streamed[i], "host_routes": stats.host_routes[i],
                           "seconds": seconds / n})
      if routing is not None:
        rows = np.flatnonzero(stepped[i])
        self.routing.append((routing.ids[i][:, rows], routing.weights[i][:, rows], phase))
    if stats is None:
      return None
    per_step = [np.asarray(getattr(stats, k))[:n] for k in ("hits", "fills", "host")]
    return np.stack([x.sum(axis=tuple(range(1, x.ndim))) for x in per_step], axis=1)

  def clear_history(self) -> None:
    self.steps.clear()
    self.routing.clear()

  # -- Extend: a context in fixed-size chunks -------------------------------------------------

  def chunk_args(self, size: int, anchor_slots: int) -> tuple:
    """Abstract arguments of an extend program after the state: tokens [1, size], the count
    of real ones, and with ``anchor_slots`` the anchor positions."""
    mesh = self.engine.mesh
    sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    args = [jax.ShapeDtypeStruct((1, size), jnp.int32, sharding=sharding),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding)]
    if anchor_slots:
      args.append(jax.ShapeDtypeStruct((anchor_slots,), jnp.int32, sharding=sharding))
    return tuple(args)

  def extend_program(self, size: int, capacity: int, anchor_slots: int, state: EngineState):
    key = ("extend", size, capacity, self.slot_capacity(), anchor_slots)
    return self.compiled(key, programs.extend_program, self.engine.params, self.engine.bank,
                         state, *self.chunk_args(size, anchor_slots))

  def extend_steps(self, state: DecodeState, ids, *, anchors_at: Sequence[int] = (),
                   anchor_slots: int = 0, start: int | None = None,
                   on_progress: Callable[[int, int], None] | None = None
                   ) -> Iterator[int]:
    """``extend`` one chunk at a time: a generator that yields the tokens read so far after
    each chunk is dispatched and returns the ``Extended`` result (``yield from``)."""
    engine = self.engine
    ids = np.asarray(ids, np.int32).reshape(-1)
    n = len(ids)
    if n == 0:
      raise ValueError("extend needs at least one token to read")
    if start is None:
      start = int(state.length)
    plan = engine.plan_chunks(start, n, sorted(anchors_at), anchor_slots)
    last = plan[-1]
    state = engine.grow_state(state, start + last.begin + last.size)
    est = self.engine_state(state)
    fns = {}
    for chunk in plan:
      if chunk.size not in fns:
        fns[chunk.size] = self.extend_program(chunk.size, state.capacity, anchor_slots, est)
    progress = on_progress if len(plan) > 1 else None
    if progress is not None:
      progress(0, n)
    snapshots = []
    logits = None
    seconds = 0.0
    for chunk in plan:
      tokens = np.zeros((1, chunk.size), np.int32)
      tokens[0, :chunk.tokens] = ids[chunk.begin:chunk.begin + chunk.tokens]
      args = [tokens, np.int32(chunk.tokens)]
      if anchor_slots:
        at = np.zeros(anchor_slots, np.int32)
        at[:len(chunk.anchors)] = chunk.anchors
        args.append(at)
      begun = time.perf_counter()
      est, logits, record, snaps = fns[chunk.size](engine.params, engine.bank, est,
                                                   *self.put(tuple(args)))
      state = self.keep(est)  # the newest cache is kept, even if a read fails
      est = self.engine_state(state)
      self.record(record, time.perf_counter() - begun, "prefill", tokens=chunk.tokens)
      if chunk.anchors:
        host = jax.device_get([layer for layer in snaps if layer is not None])
        recurrent = [i for i, layer in enumerate(snaps) if layer is not None]
        for j, position in enumerate(chunk.anchors):
          snapshots.append((chunk.begin + position, {
              i: jax.tree.map(lambda x: np.array(x[j], copy=True), layer)
              for i, layer in zip(recurrent, host)}))
      if progress is not None:
        jax.block_until_ready(logits)
        progress(chunk.begin + chunk.tokens, n)
      seconds += time.perf_counter() - begun
      if chunk is not last:
        yield chunk.begin + chunk.tokens
    t0 = time.perf_counter()
    jax.block_until_ready(logits)
    seconds += time.perf_counter() - t0
    return Extended(state=state, logits=logits, snapshots=snapshots, seconds=seconds,
                    programs=len(plan))

  def extend(self, state: DecodeState, ids, **options) -> Extended:
    """Reads ``ids`` into ``state`` (donated) after the tokens it holds, in the chunks of
    ``Engine.plan_chunks``; the state grows first if its KV buffer is too small. Options:
    ``anchors_at`` and ``anchor_slots`` (every chunk keeps the recurrent layers' states at
    the ``anchors_at`` positions, counted in ``ids``, that fall in it), ``start`` (the tokens
    ``state`` holds, when the caller knows it) and ``on_progress(done, total)`` (told of each
    chunk as it completes, when there is more than one; ``done = 0`` first)."""
    steps = self.extend_steps(state, ids, **options)
    while True:
      try:
        next(steps)
      except StopIteration as end:
        return end.value

  # -- Decode: the loop ----------------------------------------------------------------------

  def stop_ids(self, stops: Sequence[int]) -> np.ndarray:
    """Stop tokens padded with -1 to a multiple of ``STOP_BUCKET`` (one size in practice)."""
    stops = np.asarray(list(stops), np.int32).reshape(-1)
    out = np.full(max(STOP_BUCKET, -(-len(stops) // STOP_BUCKET) * STOP_BUCKET), -1, np.int32)
    out[:len(stops)] = stops
    return out

  def first_program(self, logits, max_new, stop_ids, sampling):
    """The compiled program that samples the first new token from ``logits`` [V] and makes
    a sequence's starting carry."""
    return self.compiled(("first", len(stop_ids)), programs.first_program, logits, max_new,
                         stop_ids, sampling)

  def decode_program(self, state: EngineState, rows: Rows, stop_width: int = STOP_BUCKET):
    """The compiled decode chunk for a batch of ``rows``' size at ``state``'s KV capacity,
    with ``stop_width`` stop ids per row."""
    size = rows.token.shape[0]
    key = ("decode", size, state.decode.capacity, self.slot_capacity(), stop_width)
    mesh = self.engine.mesh
    sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    return self.compiled(key, programs.decode_program, self.engine.params, self.engine.bank,
                         state, rows, *self.decode_specs(size, stop_width, sharding)[1:])

  def decode_specs(self, size: int, stop_width: int = STOP_BUCKET, sharding=None) -> tuple:
    """The shapes of a decode chunk's arguments after the state, for a batch of ``size``:
    the carry (``Rows``), go and resume masks, max_new, stop ids and sampling."""
    def spec(shape, dtype):
      return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    mask = spec((size,), jnp.bool_)
    sampling = jax.tree.map(lambda x: spec((size,), np.asarray(x).dtype),
                            Sampling.make(greedy=True))
    rows = Rows(token=spec((size,), jnp.int32), count=spec((size,), jnp.int32),
                done=spec((size,), jnp.bool_))
    return (rows, mask, mask, spec((size,), jnp.int32), spec((size, stop_width), jnp.int32),
            sampling)

  def abstract_rows(self, size: int) -> Rows:
    return self.decode_specs(size)[0]

  def join_program(self, size: int, batch_capacity: int, capacity: int, batch=None,
                   rows=None, state=None, loop=None):
    key = ("join", size, batch_capacity, capacity)
    batch = batch if batch is not None else self.abstract_state(size, batch_capacity)
    state = state if state is not None else self.abstract_state(1, capacity)
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    loop = loop if loop is not None else Loop(token=scalar, count=scalar, max_new=scalar,
                                              done=jax.ShapeDtypeStruct((), jnp.bool_))
    rows = rows if rows is not None else self.abstract_rows(size)
    return self.compiled(key, programs.join_program, batch, rows, scalar, state, loop)

  def leave_program(self, size: int, batch_capacity: int, capacity: int, batch=None):
    key = ("leave", size, batch_capacity, capacity)
    batch = batch if batch is not None else self.abstract_state(size, batch_capacity)
    return self.compiled(key, programs.leave_program, batch,
                         jax.ShapeDtypeStruct((), jnp.int32), capacity=capacity)

  def abstract_state(self, batch: int, capacity: int, rows: bool | None = None) -> DecodeState:
    """The shapes of a decode state of ``batch`` rows of ``capacity`` KV rows (nothing
    allocated); with ``rows`` (default: for more than one row) one length per row, as a decode
    batch has."""
    engine = self.engine
    state = jax.eval_shape(lambda: init_state(engine.model.config, batch, capacity,
                                              jnp.dtype(engine.kv_dtype)))
    if rows or (rows is None and batch > 1):
      state = state.replace(length=jax.ShapeDtypeStruct((batch,), jnp.int32))
    return state

  def batch(self, size: int, stop_width: int = STOP_BUCKET) -> Batch:
    """An empty batch of ``size`` rows (its state is allocated when the first sequence
    joins, at the KV capacity that sequence needs)."""
    return Batch(size, 0, stop_width)

  def run_one(self, seq: Generation) -> float:
    """Runs one sequence to its end in a batch of one; returns the decode seconds (from its
    first decode chunk to its last, less the compiles on the way: those are ``compile_s``'s)."""
    batch = self.batch(1, len(self.stop_ids(seq.stops)))
    self.join(batch, seq)
    t0, compiled = time.perf_counter(), self.compile_s
    self.run(batch)
    seconds = time.perf_counter() - t0 - (self.compile_s - compiled)
    return seconds if len(seq.tokens) > 1 else 0.0

  def join(self, batch: Batch, seq: Generation) -> bool:
    """Samples ``seq``'s first token (told to ``seq.on_chunk``) and gives it a free row;
    False when it ended at its first token (it has then left)."""
    engine = self.engine
    row = batch.seqs.index(None)
    stops = self.stop_ids(seq.stops)
    max_new, stop_dev, sampling, logits = self.put(
        (np.int32(seq.max_new), stops, seq.sampling, seq.logits))
    t0, compiled = time.perf_counter(), self.compile_s
    loop = self.first_program(logits, max_new, stop_dev, sampling)(logits, max_new, stop_dev,
                                                                   sampling)
    first, halted = (int(x) for x in jax.device_get((loop.token, loop.done)))
    seq.first_s = time.perf_counter() - t0 - (self.compile_s - compiled)
    seq.tokens.append(first)
    seq.programs = 1
    state = seq.state
    if not seq.on_chunk([first], bool(halted), lambda: self._layers(state, None)):
      seq.on_leave(seq)
      return False
    needed = int(state.length) + seq.max_new + 1
    if batch.size == 1:  # a batch of one is the sequence's own state, its length [1]
      seq.state = None
      grown = engine.grow_state(state, needed, owner=seq.owner)
      batch.state, batch.capacity = grown.replace(length=grown.length.reshape(1)), grown.capacity
      batch.rows = self.put(Rows(token=loop.token.reshape(1), count=loop.count.reshape(1),
                                 done=np.zeros(1, bool)))
    else:
      self._room(batch, needed)
      seq.state = None
      fn = self.join_program(batch.size, batch.capacity, state.capacity, batch.state,
                             batch.rows, state, loop)
      batch.state, batch.rows = fn(batch.state, batch.rows, self.put(np.int32(row)), state,
                                   loop)
      del state  # its row is in the batch now, which holds the memory
      engine.hold_memory(engine if seq.owner is None else seq.owner, 0)
    batch.seqs[row] = seq
    batch.max_new[row] = seq.max_new
    batch.counts[row] = 1
    width = batch.stop_ids.shape[1]
    if len(stops) > width:
      raise ValueError(f"{len(stops)} stop ids do not fit the batch's {width}")
    batch.stop_ids[row] = np.pad(stops, (0, width - len(stops)), constant_values=-1)
    for leaf, value in zip(jax.tree.leaves(batch.sampling), jax.tree.leaves(seq.sampling)):
      leaf[row] = value
    return True

  def _room(self, batch: Batch, needed: int) -> None:
    """Allocates or grows a batch's state to hold ``needed`` KV rows per sequence."""
    engine = self.engine
    if batch.state is None:
      capacity = engine.kv_capacity(needed)
      engine.hold_memory(batch, engine.state_bytes(batch.size, capacity))
      state = init_state(engine.model.config, batch.size, capacity, jnp.dtype(engine.kv_dtype))
      batch.state = state.replace(length=jnp.zeros((batch.size,), jnp.int32))
      batch.rows = self.put(Rows(token=np.zeros(batch.size, np.int32),
                                 count=np.zeros(batch.size, np.int32),
                                 done=np.ones(batch.size, bool)))
      batch.capacity = capacity
    elif needed > batch.capacity:
      batch.state = engine.grow_state(batch.state, needed, batch=batch.size, owner=batch)
      batch.capacity = batch.state.capacity

  def _layers(self, state: DecodeState, row: int | None) -> dict:
    """The recurrent layers' states of one sequence (row ``row`` of a batch's state, or a
    sequence's own state for None), on the device."""
    out = {}
    for i, layer in enumerate(state.layers):
      if not isinstance(layer, KVCache):
        out[i] = layer if row is None else jax.tree.map(lambda x: x[row:row + 1], layer)
    return out

  def _leave(self, batch: Batch, row: int) -> None:
    seq = batch.seqs[row]
    length = int(jax.device_get(batch.state.length[row]))
    if batch.size == 1:
      state = batch.state.replace(length=batch.state.length[0])
      batch.state, batch.rows = None, None
    else:
      engine = self.engine
      capacity = engine.kv_capacity(length + 1)
      engine.hold_memory(engine if seq.owner is None else seq.owner,
                         engine.state_bytes(1, capacity))
      fn = self.leave_program(batch.size, batch.capacity, capacity, batch.state)
      state = fn(batch.state, self.put(np.int32(row)))
    seq.state = state
    batch.seqs[row] = None
    if batch.size > 1 and not any(s is not None for s in batch.seqs):
      # The last one left: the batch's rows go, and their memory back to the expert cache
      # (with a budget); the next sequence to join allocates them again.
      batch.state, batch.rows, batch.capacity = None, None, 0
      self.engine.hold_memory(batch, 0)
    batch.leaving.discard(row)
    batch.decided.discard(row)
    seq.on_leave(seq)

  def _dispatch(self, batch: Batch):
    engine = self.engine
    for row, seq in enumerate(batch.seqs):
      if seq is not None and seq.cancel is not None and row not in batch.leaving and (
          seq.cancel()):
        batch.leaving.add(row)
    est = self.engine_state(batch.state)
    fn = self.decode_program(est, batch.rows, batch.stop_ids.shape[1])
    go = batch.go()
    args = self.put((go, batch.resume.copy(), batch.max_new.copy(), batch.stop_ids.copy(),
                     jax.tree.map(np.copy, batch.sampling)))
    est, batch.rows, out, record = fn(engine.params, engine.bank, est, batch.rows, *args)
    batch.state = self.keep(est)
    for row, seq in enumerate(batch.seqs):
      if go[row]:
        seq.programs += 1
    batch.resume[:] = False
    batch.decided.clear()
    return out, batch.rows.done, record, list(batch.seqs), go

  def _read(self, batch: Batch, chunk, begun: float) -> None:
    """Reads a dispatched chunk: its tokens go to their sequences, which decide."""
    out, done, record, owners, go = chunk
    out, done = jax.device_get((out, done))
    stepped = out >= 0
    steps = int(stepped.any(axis=1).sum())
    counts = self.record(record, time.perf_counter() - begun, "decode", stepped=stepped[:steps])
    stepped = stepped[:steps]
    for row, seq in enumerate(owners):
      if seq is None or not go[row] or batch.seqs[row] is not seq:
        continue
      tokens = [int(t) for t in out[:, row] if t >= 0]
      mine = stepped[:, row]
      seq.stats["steps"] += int(mine.sum())
      seq.stats["batch_rows"] += int(stepped[mine].sum())
      if counts is not None:
        for k, key in enumerate(("hits", "fills", "host")):
          seq.stats[key] += int(counts[mine, k].sum())
      batch.counts[row] += len(tokens)
      seq.tokens.extend(tokens)
      if row in batch.decided or row in batch.leaving:
        if tokens:
          seq.on_chunk(tokens, False, lambda: {})
        continue
      halted = bool(done[row])
      go_on = seq.on_chunk(tokens, halted, lambda r=row: self._layers(batch.state, r))
      if not go_on:
        batch.leaving.add(row)
        batch.decided.add(row)
      elif halted:
        if batch.counts[row] >= batch.max_new[row]:
          raise RuntimeError(f"a sequence went on past its max_new ({batch.max_new[row]})")
        batch.resume[row] = True
        batch.decided.add(row)

  def run(self, batch: Batch, feed: Feed | None = None) -> None:
    """The decode loop: runs ``batch``'s rows chunk by chunk until none is running and
    ``feed`` (if any) has nothing left to give; between chunks, sequences leave, halted rows
    resume, ``feed``'s ready sequences join free rows and its prefills run a chunk each."""
    chunk = self.engine.options.decode_chunk
    while True:
      if feed is not None and batch.free():
        for seq in feed.ready(batch.free()):
          self.join(batch, seq)
      for row in sorted(batch.leaving):
        self._leave(batch, row)
      if not batch.go().any():
        if feed is not None and (feed.work() or feed.pending()):
          continue
        return
      inflight = self._dispatch(batch)
      begun = time.perf_counter()
      while inflight is not None:
        ahead = None
        go = batch.go()
        may_run = go & (batch.counts + chunk < batch.max_new)
        if (may_run.any() and not batch.decided and not batch.leaving
            and not (feed is not None and feed.pending())):
          ahead = self._dispatch(batch)
        self._read(batch, inflight, begun)
        begun = time.perf_counter()
        if feed is not None:
          feed.work()
        inflight = ahead
