"""The executor: every program a request runs, the one protocol that runs them, and the loop.

An ``Executor`` is built from a frozen ``ExecutorSpec`` (the parameters and the host pool as
placed, the KV sizes, the decode chunk, the bandwidths), a table of compiled programs
(``ftjax.runtime.programs.Programs``) and a ``MemoryBudget``; it never calls back into the
engine that made it. It owns:

* **the program protocol.** ``key(kind, **sizes)`` builds the compile key of every kind of
  program, in one place (``KEY_FIELDS``); ``program(key)`` takes the executable from the table
  or compiles it from abstract arguments built from the key alone (``precompile`` is a loop
  over ``programs_needed``); ``execute(key, *args, state=...)`` runs it: a program of the model
  gets the decode state with the expert cache and the bandwidths (donated), the executor keeps
  the cache it returns, and the step's record (cache counts, routing) is kept
  (``record``). Extend, first, decode, join, leave, grow, step and the speculative verify
  loop all run through it;
* **decode states**: allocated (``new_state``) and grown (``grow``) at the capacities of
  ``ftjax.runtime.kv.KVLayout``, each held in the budget by its owner before it is allocated
  (the engine listens to the budget and gives up expert-cache slots first);
* **the ways a sequence is run**: ``extend`` (and ``extend_steps``, one chunk at a time), a
  context read into one sequence's state in fixed-size chunks (``KVLayout.plan_chunks``);
  ``run``, the decode loop: sequences (``Generation``: a state that has read its context, and
  the logits after it) join a ``Batch`` of rows, decode together in one program per chunk
  (``programs.decode_program``: per-row lengths, sampling and stops), and leave it with their
  state when they finish. A lone request is a batch of one; the server's is ``max_running``
  rows, which sequences join and leave between chunks without a compile. A ``Feed`` (the
  server's scheduler) gives the loop new sequences and runs their prefills one chunk at a time
  between decode chunks, so a long prompt never stalls the running rows for more than a chunk.
  ``speculate``: the MTP head's verify loop (``ftjax.runtime.speculative``'s programs).

Each decode chunk is dispatched before the previous one is read while nothing is about to
change (no row halted, left or joined), so the device does not wait for the host; a change is
applied once the chunks in flight are read.

With a ``SplitCalibrator`` (``ftjax.runtime.calibration``: the engine's ``calibrate_split``),
each decode chunk's seconds and cache counts go to it when the chunk is read, and each program
plans with the bandwidths it gives (``bandwidths``): a decode chunk with its guard's strategy,
any other program with the fitted rates.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ftjax.model import DecodeState, KVCache, ModelConfig, init_state
from ftjax.model.transformer import init_mtp_state
from ftjax.runtime import programs, speculative
from ftjax.runtime.budget import MemoryBudget
from ftjax.runtime.calibration import SplitCalibrator
from ftjax.runtime.kv import KVLayout
from ftjax.runtime.placement import EXPERT_AXIS
from ftjax.runtime.programs import Loop, ProgramKind, Programs, Rows, TokenLogprobs
from ftjax.runtime.sampling import Sampling
from ftjax.runtime.state import EngineState

STOP_BUCKET = 32  # stop-token lists are padded to a multiple of this (one size in practice)
COST_SAMPLES = 8  # a draft length's measured cost: the median of its last programs' seconds


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
  """One token's log-probabilities, on the host: the log-prob of ``token`` under the model's
  distribution (the log-softmax of its raw logits) and the most probable tokens' ids and
  log-probs (``programs.TOP_LOGPROBS`` of them, most probable first)."""
  token: int
  logprob: float
  top_ids: np.ndarray  # int32 [k]
  top: np.ndarray  # float32 [k]


def _entries(tokens: Sequence[int], logprobs) -> list[TokenLogprob]:
  """``TokenLogprob``s of ``tokens`` from host arrays laid out as ``TokenLogprobs`` [n]."""
  return [TokenLogprob(int(t), float(logprobs.chosen[i]), logprobs.top_ids[i].copy(),
                       logprobs.top[i].copy()) for i, t in enumerate(tokens)]


@dataclasses.dataclass
class Extended:
  """What ``Executor.extend`` did: the state (donated in, returned), the logits [V] after the
  last token (on the device), the anchors' snapshots (position, {layer: LinearState of numpy
  arrays}), the seconds of its chunks and the programs run; with ``targets``, ``logprobs``:
  each target's ``TokenLogprob`` (the prompt's log-probs; None where a position had none)."""
  state: DecodeState
  logits: jax.Array
  snapshots: list[tuple[int, dict]]
  seconds: float
  programs: int
  logprobs: list[TokenLogprob | None] | None = None


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
  logprobs: None, or a list to which each new token's ``TokenLogprob`` is appended (computed
    in the same programs), before ``on_chunk`` is told of the token.
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
  logprobs: list[TokenLogprob] | None = None
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
    self.want = np.zeros(size, bool)  # rows whose sequence wants its tokens' log-probs
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


@dataclasses.dataclass(frozen=True)
class ExecutorSpec:
  """What the programs of one engine run on, fixed for its life: the model's parameters and
  host expert pool as the programs receive them (placed on ``mesh`` when there is one), the
  KV sizes (``ftjax.runtime.kv.KVLayout``), the decode steps per decode program, and the
  bandwidths (B_P, B_H) the cache policy plans with (None when it needs none)."""
  params: Any
  bank: Any
  kv: KVLayout
  mesh: Mesh | None = None
  decode_chunk: int = 8
  bandwidths: np.ndarray | None = None

  @property
  def config(self) -> ModelConfig:
    return self.kv.config


_COUNTING = threading.Lock()  # the executors' compile counters (``_counted``)
# Threads that prepare start-up programs side by side (``precompile``): loads from the
# executable store overlap; compiles run one at a time whatever this is.
PREPARE_WORKERS = max(1, min(4, len(os.sched_getaffinity(0))))

# The programs, by kind: the program (``ftjax.runtime.programs.ProgramKind``) and the names of
# the sizes that follow the kind in its compile key. ``Executor.key`` builds every key from
# these; ``Executor.program`` compiles any key from its sizes alone.
KEY_FIELDS: dict[str, tuple[ProgramKind, tuple[str, ...]]] = {
    "extend": (programs.EXTEND, ("size", "capacity", "slots", "anchor_slots")),
    "first": (programs.FIRST, ("stop_width",)),
    "decode": (programs.DECODE, ("batch", "capacity", "slots", "stop_width")),
    "grow": (programs.GROW, ("batch", "held", "capacity")),
    "join": (programs.JOIN, ("batch", "batch_capacity", "capacity")),
    "leave": (programs.LEAVE, ("batch", "batch_capacity", "capacity")),
    "step": (programs.STEP, ("shape", "capacity", "slots", "last_only", "fresh")),
    "mtp_prefill": (speculative.PREFILL, ("size", "capacity", "slots", "k")),
    "mtp_decode": (speculative.VERIFY, ("capacity", "slots", "k", "m", "chunk", "stop_width",
                                        "sampled", "adaptive")),
}


class Executor:
  """The programs and the loop of one engine (see the module's docstring).

  Built from an ``ExecutorSpec``, the engine's ``Programs`` table (``ftjax.runtime.programs``),
  the ``MemoryBudget`` its states are held in (``ftjax.runtime.budget``: the engine listens to
  it and resizes the expert cache) and the expert cache to start from (None: none). It knows
  nothing of the engine that made it."""

  def __init__(self, spec: ExecutorSpec, table: Programs, memory: MemoryBudget,
               initial_cache=None, calibrator: SplitCalibrator | None = None):
    self.spec = spec
    # The q* split measured while decoding, and its guard (None: the spec's bandwidths, fixed).
    self.calibrator = calibrator
    self._strategy: str | None = None  # the calibrator's strategy of the last program run
    self.kv = spec.kv
    self.table = table
    self.memory = memory
    self.cache = initial_cache  # the expert cache as of the last program (None: none)
    self.steps: list[dict[str, Any]] = []  # per step: cache counts and seconds
    self.routing: list[tuple[np.ndarray, np.ndarray, str]] = []  # ids, weights [L, t, K]
    # Over the engine's life; the prefetch counts stay 0 without router-ahead prefetch.
    self.totals = {"hits": 0, "fills": 0, "host": 0, "prefetched": 0, "prefetch_used": 0,
                   "prefetch_wasted": 0}
    self.compile_count = 0  # programs added to the table: compiled, or loaded from the store
    self.compile_s = 0.0
    self.loaded_count = 0  # of compile_count, those loaded untraced (``compile_cache``)
    # (draft tokens k, sampled) -> float [k + 1]: seconds a verify step with 0 .. k drafts has
    # taken on this engine (the median of its last COST_SAMPLES whole programs' seconds a
    # step; NaN: not measured yet), from those samples
    self.verify_seconds: dict[tuple[int, bool], np.ndarray] = {}
    self._verify_samples: dict[tuple[int, bool, int], collections.deque] = {}
    self._ran: set[tuple] = set()  # program keys run at least once
    # Told of each program compiled: (key: the program's name and bucketed sizes, seconds).
    self.compile_listener: Callable[[tuple, float], None] | None = None

  # -- The program protocol: keys, compiles, runs ----------------------------------------------

  def key(self, kind: str, **sizes) -> tuple:
    """The compile key of a ``kind`` program (``KEY_FIELDS``): the kind, then its sizes in
    order; ``slots`` defaults to the expert cache's buffer now (``slot_capacity``)."""
    if "slots" in KEY_FIELDS[kind][1]:
      sizes.setdefault("slots", self.slot_capacity())
    return (kind, *(sizes[name] for name in KEY_FIELDS[kind][1]))

  def program(self, key: tuple) -> Callable:
    """The executable of ``key``: from the table, or compiled from abstract arguments built
    from the key's sizes (nothing is allocated), counted in ``compile_count`` and
    ``compile_s`` and told to ``compile_listener``."""
    fn = self.table.get(key)
    if fn is not None:
      return fn
    kind, names = KEY_FIELDS[key[0]]
    args, static = getattr(self, f"_abstract_{key[0]}")(**dict(zip(names, key[1:])))
    return self.table.compile(key, kind, args, static, on_compile=self._counted)

  def execute(self, key: tuple, *args, state: DecodeState | None = None,
              record: dict | None = None) -> tuple:
    """Runs the program of ``key`` (``program``) on ``args``. A program of the model takes
    ``state`` with the expert cache and the bandwidths (donated), and the executor keeps the
    expert cache it returns: the result is (``state`` after it, its other outputs...).
    ``record`` (a forward's ``phase`` and ``tokens``): its step record is kept now
    (``record``); a decode chunk's is read with its tokens (``run``)."""
    fn = self.program(key)
    kind = KEY_FIELDS[key[0]][0]
    if not kind.model:
      return fn(*args)
    begun = time.perf_counter()
    est, *outs = fn(self.spec.params, self.spec.bank,
                    self.engine_state(state, decode_program=key[0] == "decode"), *args)
    state = self.keep(est)  # the newest cache is kept, even if a read fails
    if record is not None:
      self.record(outs[kind.record_at], time.perf_counter() - begun, **record)
    return (state, *outs)

  def release(self) -> None:
    """Lets go of the programs' table, the expert cache and the step history (the engine
    that made this executor was closed or collected)."""
    self.cache, self.table = None, None
    self.clear_history()

  def _counted(self, key: tuple, seconds: float) -> None:
    with _COUNTING:  # programs may be prepared by several threads (``precompile``)
      self.compile_count += 1
      self.loaded_count += key in self.table.loaded
      self.compile_s += seconds
    if self.compile_listener is not None:
      self.compile_listener(key, seconds)

  def programs_needed(self, anchor_slots: int = 0, batch: int = 1,
                      decode_alone: bool = True) -> list[tuple]:
    """The keys of every program a request (or a session with ``anchor_slots``) can run, in a
    decode batch of one and of ``batch`` rows: per KV capacity, one extend program per chunk
    size and the decode loop; the first-token program; the copies between consecutive
    capacities; with ``batch`` > 1, the batch's decode loop and growth, and the copies of a
    sequence into and out of a row for each pair of capacities. ``decode_alone=False``
    leaves out the decode loop of one row when ``batch`` > 1: a server decodes every request
    in its batch (``Engine.generate`` and ``Session.generate`` decode alone). A request never
    compiles another, unless the expert cache is resized past its buffer or more than
    ``STOP_BUCKET`` stop tokens are given."""
    capacities = self.kv.kv_capacities
    sizes = [1] + ([batch] if batch > 1 else [])
    keys = [self.key("first", stop_width=STOP_BUCKET)]
    for i, capacity in enumerate(capacities):
      keys += [self.key("extend", size=size, capacity=capacity, anchor_slots=anchor_slots)
               for size in self.kv.chunk_sizes]
      for size in sizes:
        if decode_alone or size == batch:
          keys.append(self.key("decode", batch=size, capacity=capacity,
                               stop_width=STOP_BUCKET))
        if i:
          keys.append(self.key("grow", batch=size, held=capacities[i - 1], capacity=capacity))
    if batch > 1:
      for held in capacities:
        for capacity in capacities:
          keys += [self.key(kind, batch=batch, batch_capacity=held, capacity=capacity)
                   for kind in ("join", "leave")]
    return keys

  def precompile(self, anchor_slots: int = 0,
                 on_progress: Callable[[int, int, tuple], None] | None = None,
                 batch: int = 1, keys: list[tuple] | None = None,
                 workers: int = 1) -> list[tuple]:
    """Compiles every program of ``keys`` (default ``programs_needed(anchor_slots, batch)``)
    not compiled yet, so that no request compiles. Returns the keys prepared now;
    ``on_progress(done, total, key)`` is told before each. ``workers`` threads prepare them
    side by side: loads from the executable store overlap, compiles still run one at a time
    (``Programs.compile``)."""
    if keys is None:
      keys = self.programs_needed(anchor_slots, batch)
    keys = [key for key in keys if key not in self.table]
    if workers <= 1 or len(keys) <= 1:
      for done, key in enumerate(keys):
        if on_progress is not None:
          on_progress(done, len(keys), key)
        self.program(key)
      return keys
    started = iter(range(len(keys)))
    lock = threading.Lock()

    def prepare(key: tuple) -> None:
      with lock:
        done = next(started)
      if on_progress is not None:
        on_progress(done, len(keys), key)
      self.program(key)

    with concurrent.futures.ThreadPoolExecutor(workers, "ftjax-prepare") as pool:
      for future in [pool.submit(prepare, key) for key in keys]:
        future.result()  # the first failure is raised here
    return keys

  def stored(self, key: tuple) -> bool:
    """Whether ``program(key)`` would load ``key`` from the executable store, untraced (false
    when it is already in the table, or would be compiled)."""
    if key in self.table:
      return False
    kind, names = KEY_FIELDS[key[0]]
    args, static = getattr(self, f"_abstract_{key[0]}")(**dict(zip(names, key[1:])))
    return self.table.stored(kind, args, static)

  def first_needed(self, keys: list[tuple]) -> list[tuple]:
    """Of ``keys`` (``programs_needed``), those a short request runs: its first token, a
    prompt's smallest chunk, and decoding, joining and leaving at the smallest KV capacity."""
    smallest = self.kv.kv_capacities[0]
    chunk = min(self.kv.chunk_sizes)

    def short(key: tuple) -> bool:
      fields = dict(zip(KEY_FIELDS[key[0]][1], key[1:]))
      if fields.get("size", chunk) != chunk:
        return False
      return all(fields.get(name, smallest) == smallest
                 for name in ("capacity", "batch_capacity", "held"))

    return [key for key in keys if short(key)]

  # -- Abstract arguments of each kind (the shapes a key names; nothing allocated) -------------

  def _spec(self, shape, dtype) -> jax.ShapeDtypeStruct:
    """A replicated argument's shape (over the mesh, when there is one)."""
    mesh = self.spec.mesh
    sharding = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

  def _model_args(self, decode: DecodeState) -> tuple:
    """The parameters, the pool and the shapes of the ``EngineState`` around ``decode``: the
    expert cache's and the bandwidths' as ``engine_state`` places them."""
    state = EngineState(decode=decode)
    if self.cache is not None:
      cache = jax.tree.map(lambda x: self._spec(x.shape, x.dtype), self.cache)
      if self.spec.mesh is not None:  # the slots split along N, as engine_state puts them
        slots = self.cache.slots
        cache = cache.replace(slots=jax.ShapeDtypeStruct(
            slots.shape, slots.dtype, sharding=NamedSharding(self.spec.mesh,
                                                             PartitionSpec(EXPERT_AXIS))))
      state = state.replace(cache=cache, bandwidths=self._spec((2,), jnp.float32))
    return (self.spec.params, self.spec.bank, state)

  def _check_slots(self, slots: int) -> None:
    if slots != self.slot_capacity():
      raise ValueError(f"a program for {slots} cache slots, but the expert cache's buffer "
                       f"holds {self.slot_capacity()}: compile it after resizing the cache")

  def _abstract_extend(self, size, capacity, slots, anchor_slots):
    self._check_slots(slots)
    args = [self._spec((1, size), jnp.int32), self._spec((), jnp.int32),
            self._spec((1, size), jnp.int32), self._spec((), jnp.bool_)]
    if anchor_slots:
      args.append(self._spec((anchor_slots,), jnp.int32))
    return (*self._model_args(self.abstract_state(1, capacity)), *args), {}

  def _abstract_first(self, stop_width):
    sampling = jax.tree.map(lambda x: self._spec(np.shape(x), np.asarray(x).dtype),
                            Sampling.make(greedy=True))
    return (self._spec((self.spec.config.vocab_size,), jnp.float32), self._spec((), jnp.int32),
            self._spec((stop_width,), jnp.int32), sampling, self._spec((), jnp.bool_)), {}

  def _abstract_decode(self, batch, capacity, slots, stop_width):
    self._check_slots(slots)
    state = self.abstract_state(batch, capacity, rows=True)
    return (*self._model_args(state), *self.decode_specs(batch, stop_width)), {}

  def _abstract_grow(self, batch, held, capacity):
    return (self.abstract_state(batch, held),), {"capacity": capacity}

  def _abstract_join(self, batch, batch_capacity, capacity):
    scalar = self._spec((), jnp.int32)
    loop = Loop(token=scalar, count=scalar, max_new=scalar, done=self._spec((), jnp.bool_))
    return (self.abstract_state(batch, batch_capacity), self.decode_specs(batch)[0], scalar,
            self.abstract_state(1, capacity), loop), {}

  def _abstract_leave(self, batch, batch_capacity, capacity):
    return ((self.abstract_state(batch, batch_capacity), self._spec((), jnp.int32)),
            {"capacity": capacity})

  def _abstract_step(self, shape, capacity, slots, last_only, fresh):
    self._check_slots(slots)
    state = self.abstract_state(shape[0], capacity, rows=False)
    tokens = self._spec(shape, jnp.int32)
    return ((*self._model_args(state), tokens, tokens),
            {"last_only": last_only, "fresh": fresh})

  def _mtp_prefill_specs(self, size, capacity, k):
    """The MTP prefill's arguments after the engine state (``speculative.prefill_program``)."""
    config = self.spec.config
    caches = jax.eval_shape(lambda: init_mtp_state(config, 1, capacity,
                                                   jnp.dtype(self.kv.kv_dtype)))
    caches = jax.tree.map(lambda x: self._spec(x.shape, x.dtype), caches)
    sampling = self._abstract_first(STOP_BUCKET)[0][3]
    return (caches, self._spec((1, size), jnp.int32), self._spec((), jnp.int32),
            self._spec((STOP_BUCKET,), jnp.int32), self._spec((capacity + k,), jnp.int32),
            sampling)

  def _abstract_mtp_prefill(self, size, capacity, slots, k):
    self._check_slots(slots)
    state = self.abstract_state(1, capacity, rows=False)
    return (*self._model_args(state), *self._mtp_prefill_specs(size, capacity, k)), {"k": k}

  def _abstract_mtp_decode(self, capacity, slots, k, m, chunk, stop_width, sampled, adaptive):
    args, static = self._abstract_mtp_prefill(1, capacity, slots, k)
    draft = jax.eval_shape(functools.partial(speculative.prefill_program, self.table.runner,
                                             **static), *args)[1]
    draft = jax.tree.map(lambda x: self._spec(x.shape, x.dtype), draft)
    _, tokens, max_new, _, _, sampling = self._mtp_prefill_specs(1, capacity, k)
    return ((*args[:3], draft, max_new, self._spec((stop_width,), jnp.int32), sampling,
             self._spec((k + 1,), jnp.float32)),
            {"k": k, "m": m, "chunk": chunk, "sampled": sampled, "adaptive": adaptive})

  # -- State hand-off ----------------------------------------------------------------------------

  def put(self, tree):
    """Program inputs to the device: replicated over the mesh when there is one."""
    mesh = self.spec.mesh
    if mesh is None:
      return jax.device_put(tree)
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))

  def slot_capacity(self) -> int:
    """The expert cache's slot buffer size (-1 without a cache): part of every program key."""
    return -1 if self.cache is None else self.cache.capacity

  def bandwidths(self, decode: bool = False) -> np.ndarray:
    """The (B_P, B_H) a program plans with: the spec's, or with a calibrator its measured
    rates, and for a decode program (``decode``) the strategy its guard runs next (a pure
    fill or pure host pair, or the split)."""
    self._strategy = None
    if self.calibrator is not None:
      if decode:
        self._strategy, bandwidths = self.calibrator.decode_bandwidths()
        return bandwidths
      return self.calibrator.rates()
    if self.spec.bandwidths is not None:
      return np.asarray(self.spec.bandwidths, np.float32)
    return np.ones(2, np.float32)

  def engine_state(self, decode: DecodeState, *, decode_program: bool = False) -> EngineState:
    """What a program takes: ``decode`` with the engine's expert cache and the bandwidths
    (``bandwidths``) of a decode program (``decode_program``) or another."""
    if self.cache is None:
      return EngineState(decode=decode)
    spec = self.spec
    bandwidths = self.bandwidths(decode_program)
    state = EngineState(decode=decode, cache=self.cache,
                        bandwidths=jax.device_put(np.asarray(bandwidths, np.float32)))
    if spec.mesh is None:
      return state
    # Everything replicated but the slots, split along N: the compiled programs expect
    # exactly these shardings.
    slots = jax.device_put(self.cache.slots,
                           NamedSharding(spec.mesh, PartitionSpec(EXPERT_AXIS)))
    state = self.put(state.replace(cache=self.cache.replace(slots=None)))
    return state.replace(cache=state.cache.replace(slots=slots))

  def keep(self, state: EngineState) -> DecodeState:
    """Takes a program's output state: the executor keeps the newest expert cache."""
    if self.cache is not None:
      self.cache = state.cache
    return state.decode

  def abstract_state(self, batch: int, capacity: int, rows: bool | None = None) -> DecodeState:
    """The shapes of a decode state of ``batch`` rows of ``capacity`` KV rows (nothing
    allocated); with ``rows`` (default: for more than one row) one length per row, as a decode
    batch has."""
    kv = self.kv
    state = jax.eval_shape(lambda: init_state(kv.config, batch, capacity,
                                              jnp.dtype(kv.kv_dtype)))
    if rows or (rows is None and batch > 1):
      state = state.replace(length=jax.ShapeDtypeStruct((batch,), jnp.int32))
    if self.spec.mesh is None:
      return state
    return jax.tree.map(lambda x: self._spec(x.shape, x.dtype), state)

  # -- Decode states: allocation and growth, held in the memory budget -----------------------

  def new_state(self, batch: int, capacity: int, owner: Any = None) -> DecodeState:
    """An empty decode state of exactly ``capacity`` KV rows (one of ``kv_capacities``), held
    by ``owner`` (None: the engine): the budget hears of it before it is allocated."""
    self.memory.hold(owner, self.kv.state_bytes(batch, capacity))
    return init_state(self.kv.config, batch, capacity, jnp.dtype(self.kv.kv_dtype))

  def grow(self, state: DecodeState, rows: int, batch: int = 1,
           owner: Any = None) -> DecodeState:
    """``state`` (donated; ``batch`` rows) with a KV capacity of at least ``rows`` rows: the
    same state when it has room, else grown through ``kv_capacities`` (each step one ``grow``
    program) to the first that holds them, held by ``owner`` (None: the engine)."""
    held = state.capacity
    if not held or held >= rows:
      return state
    target = self.kv.capacity(rows)
    self.memory.hold(owner, self.kv.state_bytes(batch, target))
    for capacity in self.kv.kv_capacities:
      if held < capacity <= target:
        state = self.execute(self.key("grow", batch=batch, held=held, capacity=capacity), state)
        held = capacity
    return state

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
                           "host_routes": stats.host_routes, "prefetched": stats.prefetched,
                           "prefetch_used": stats.prefetch_used,
                           "prefetch_wasted": stats.prefetch_wasted, "seconds": seconds})
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
                           "prefetched": stats.prefetched[i],
                           "prefetch_used": stats.prefetch_used[i],
                           "prefetch_wasted": stats.prefetch_wasted[i],
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

  # -- One forward (teacher forcing, tests) ------------------------------------------------------

  def step(self, state: DecodeState, tokens, positions, *, last_only: bool = False,
           fresh: bool = False) -> tuple[DecodeState, jax.Array]:
    """One forward of ``tokens``/``positions`` [B, T] -> (state, logits); ``state`` donated."""
    tokens, positions = self.put((jnp.asarray(tokens, jnp.int32),
                                  jnp.asarray(positions, jnp.int32)))
    key = self.key("step", shape=tuple(tokens.shape), capacity=state.capacity,
                   last_only=last_only, fresh=fresh)
    recording = self.cache is not None or self.table.runner.record_routing
    phase = "prefill" if tokens.shape[1] > 1 else "decode"
    state, logits, _ = self.execute(key, tokens, positions, state=state, record=(
        {"phase": phase, "tokens": int(tokens.size)} if recording else None))
    return state, logits

  # -- Extend: a context in fixed-size chunks -------------------------------------------------

  def extend_steps(self, state: DecodeState, ids, *, anchors_at: Sequence[int] = (),
                   anchor_slots: int = 0, start: int | None = None,
                   on_progress: Callable[[int, int], None] | None = None,
                   owner: Any = None, targets=None) -> Iterator[int]:
    """``extend`` one chunk at a time: a generator that yields the tokens read so far after
    each chunk is dispatched and returns the ``Extended`` result (``yield from``)."""
    ids = np.asarray(ids, np.int32).reshape(-1)
    n = len(ids)
    if n == 0:
      raise ValueError("extend needs at least one token to read")
    if targets is not None:
      targets = np.asarray(targets, np.int32).reshape(-1)
      if len(targets) != n:
        raise ValueError(f"targets must give one token per token read ({n}), got "
                         f"{len(targets)}")
    if start is None:
      start = int(state.length)
    plan = self.kv.plan_chunks(start, n, sorted(anchors_at), anchor_slots)
    last = plan[-1]
    state = self.grow(state, start + last.begin + last.size, owner=owner)
    for size in {chunk.size for chunk in plan}:  # compiled before the first chunk runs
      self.program(self.key("extend", size=size, capacity=state.capacity,
                            anchor_slots=anchor_slots))
    progress = on_progress if len(plan) > 1 else None
    if progress is not None:
      progress(0, n)
    snapshots = []
    logits = None
    seconds = 0.0
    scored = []  # per chunk: its log-probs on the device (with targets)
    for chunk in plan:
      tokens = np.zeros((1, chunk.size), np.int32)
      tokens[0, :chunk.tokens] = ids[chunk.begin:chunk.begin + chunk.tokens]
      wanted = np.full((1, chunk.size), -1, np.int32)
      if targets is not None:
        wanted[0, :chunk.tokens] = targets[chunk.begin:chunk.begin + chunk.tokens]
      args = [tokens, np.int32(chunk.tokens), wanted, np.bool_(targets is not None)]
      if anchor_slots:
        at = np.zeros(anchor_slots, np.int32)
        at[:len(chunk.anchors)] = chunk.anchors
        args.append(at)
      begun = time.perf_counter()
      key = self.key("extend", size=chunk.size, capacity=state.capacity,
                     anchor_slots=anchor_slots)
      state, logits, _, snaps, logprobs = self.execute(
          key, *self.put(tuple(args)), state=state,
          record={"phase": "prefill", "tokens": chunk.tokens})
      if targets is not None:
        scored.append((chunk, logprobs))
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
    entries = None
    if targets is not None:
      entries = []
      for chunk, logprobs in scored:
        host = jax.device_get(logprobs)
        part = targets[chunk.begin:chunk.begin + chunk.tokens]
        entries += [entry if t >= 0 else None
                    for t, entry in zip(part, _entries(part, host))]
    return Extended(state=state, logits=logits, snapshots=snapshots, seconds=seconds,
                    programs=len(plan), logprobs=entries)

  def extend(self, state: DecodeState, ids, **options) -> Extended:
    """Reads ``ids`` into ``state`` (donated) after the tokens it holds, in the chunks of
    ``KVLayout.plan_chunks``; the state grows first if its KV buffer is too small. Options:
    ``anchors_at`` and ``anchor_slots`` (every chunk keeps the recurrent layers' states at
    the ``anchors_at`` positions, counted in ``ids``, that fall in it), ``start`` (the tokens
    ``state`` holds, when the caller knows it), ``on_progress(done, total)`` (told of each
    chunk as it completes, when there is more than one; ``done = 0`` first) and ``owner`` (who
    holds the state's memory when it grows; None: the engine) and ``targets`` (int32 [n]: the
    token that follows each position, -1 for none: their log-probs come back in
    ``Extended.logprobs``, made by the same programs from the same forward)."""
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

  def decode_specs(self, size: int, stop_width: int = STOP_BUCKET) -> tuple:
    """The shapes of a decode chunk's arguments after the state, for a batch of ``size``:
    the carry (``Rows``), go and resume masks, max_new, stop ids, sampling and the rows that
    want log-probs."""
    spec = self._spec
    mask = spec((size,), jnp.bool_)
    sampling = jax.tree.map(lambda x: spec((size,), np.asarray(x).dtype),
                            Sampling.make(greedy=True))
    rows = Rows(token=spec((size,), jnp.int32), count=spec((size,), jnp.int32),
                done=spec((size,), jnp.bool_))
    return (rows, mask, mask, spec((size,), jnp.int32), spec((size, stop_width), jnp.int32),
            sampling, mask)


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
    row = batch.seqs.index(None)
    stops = self.stop_ids(seq.stops)
    want = seq.logprobs is not None
    max_new, stop_dev, sampling, logits, want_dev = self.put(
        (np.int32(seq.max_new), stops, seq.sampling, seq.logits, np.bool_(want)))
    t0, compiled = time.perf_counter(), self.compile_s
    loop, logprobs = self.execute(self.key("first", stop_width=len(stops)), logits, max_new,
                                  stop_dev, sampling, want_dev)
    first, halted = (int(x) for x in jax.device_get((loop.token, loop.done)))
    if want:
      host = jax.tree.map(lambda x: np.asarray(x)[None], jax.device_get(logprobs))
      seq.logprobs += _entries([first], host)
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
      grown = self.grow(state, needed, owner=seq.owner)
      batch.state, batch.capacity = grown.replace(length=grown.length.reshape(1)), grown.capacity
      batch.rows = self.put(Rows(token=loop.token.reshape(1), count=loop.count.reshape(1),
                                 done=np.zeros(1, bool)))
    else:
      self._room(batch, needed)
      seq.state = None
      key = self.key("join", batch=batch.size, batch_capacity=batch.capacity,
                     capacity=state.capacity)
      batch.state, batch.rows = self.execute(key, batch.state, batch.rows,
                                             self.put(np.int32(row)), state, loop)
      del state  # its row is in the batch now, which holds the memory
      self.memory.hold(seq.owner, 0)
    batch.seqs[row] = seq
    batch.want[row] = want
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
    if batch.state is None:
      capacity = self.kv.capacity(needed)
      state = self.new_state(batch.size, capacity, owner=batch)
      batch.state = state.replace(length=jnp.zeros((batch.size,), jnp.int32))
      batch.rows = self.put(Rows(token=np.zeros(batch.size, np.int32),
                                 count=np.zeros(batch.size, np.int32),
                                 done=np.ones(batch.size, bool)))
      batch.capacity = capacity
    elif needed > batch.capacity:
      batch.state = self.grow(batch.state, needed, batch=batch.size, owner=batch)
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
      capacity = self.kv.capacity(length + 1)
      self.memory.hold(seq.owner, self.kv.state_bytes(1, capacity))
      key = self.key("leave", batch=batch.size, batch_capacity=batch.capacity, capacity=capacity)
      state = self.execute(key, batch.state, self.put(np.int32(row)))
    seq.state = state
    batch.seqs[row] = None
    if batch.size > 1 and not any(s is not None for s in batch.seqs):
      # The last one left: the batch's rows go, and their memory back to the expert cache
      # (with a budget); the next sequence to join allocates them again.
      batch.state, batch.rows, batch.capacity = None, None, 0
      self.memory.hold(batch, 0)
    batch.leaving.discard(row)
    batch.decided.discard(row)
    batch.want[row] = False
    seq.on_leave(seq)

  def _dispatch(self, batch: Batch):
    for row, seq in enumerate(batch.seqs):
      if seq is not None and seq.cancel is not None and row not in batch.leaving and (
          seq.cancel()):
        batch.leaving.add(row)
    key = self.key("decode", batch=batch.size, capacity=batch.state.capacity,
                   stop_width=batch.stop_ids.shape[1])
    go = batch.go()
    args = self.put((go, batch.resume.copy(), batch.max_new.copy(), batch.stop_ids.copy(),
                     jax.tree.map(np.copy, batch.sampling), batch.want.copy()))
    batch.state, batch.rows, out, record, logprobs = self.execute(key, batch.rows, *args,
                                                                  state=batch.state)
    strategy = self._strategy
    for row, seq in enumerate(batch.seqs):
      if go[row]:
        seq.programs += 1
    batch.resume[:] = False
    batch.decided.clear()
    if not (go & batch.want).any():
      logprobs = None  # not read back
    return out, batch.rows.done, record, list(batch.seqs), go, strategy, logprobs

  def _read(self, batch: Batch, chunk, begun: float) -> None:
    """Reads a dispatched chunk: its tokens go to their sequences, which decide."""
    out, done, record, owners, go, strategy, logprobs = chunk
    out, done, logprobs = jax.device_get((out, done, logprobs))
    stepped = out >= 0
    steps = int(stepped.any(axis=1).sum())
    seconds = time.perf_counter() - begun
    counts = self.record(record, seconds, "decode", stepped=stepped[:steps])
    if self.calibrator is not None and counts is not None and steps:
      hits, fills, host = (int(n) for n in counts.sum(axis=0))
      self.calibrator.observe(seconds, steps, hits, fills, host, strategy=strategy)
    stepped = stepped[:steps]
    for row, seq in enumerate(owners):
      if seq is None or not go[row] or batch.seqs[row] is not seq:
        continue
      tokens = [int(t) for t in out[:, row] if t >= 0]
      if seq.logprobs is not None and logprobs is not None:
        took = out[:, row] >= 0
        seq.logprobs += _entries(tokens, jax.tree.map(lambda x: x[took, row], logprobs))
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
    chunk = self.spec.decode_chunk
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

  # -- Speculative decoding: the MTP head's verify loop -----------------------------------------

  def speculate(self, ids: np.ndarray, max_new_tokens: int, *, k: int, sampling: Sampling,
                stop_tokens: Sequence[int] = (), forced_drafts: Sequence[int] | None = None,
                cost: np.ndarray, on_token: Callable[[int], None] | None = None,
                adaptive: bool = False, chunk: int = 8,
                measured_costs: bool = True) -> speculative.SpeculativeResult:
    """Speculative decoding of one prompt ``ids`` [1, n] (``ftjax.runtime.speculative``): the
    ``mtp_prefill`` program, then ``mtp_decode`` programs of up to ``chunk`` verify steps each
    (a different program body from the decode loop's, run by the same protocol), until the
    device says done. ``cost``: the verify step's modelled cost per draft length (bytes,
    ``speculative.step_costs``), which the adaptive rule (``adaptive``) ranks with until this
    engine has measured the lengths' seconds (``verify_seconds``, ``calibrated_costs``), unless
    not ``measured_costs`` (the modelled costs throughout; the seconds are still recorded)."""
    config = self.spec.config
    sampled = not bool(sampling.greedy)
    rows = ids.shape[1] + max_new_tokens + k + 1  # the verify reads k + 1 past the last token
    capacity = self.kv.capacity(min(rows, self.kv.kv_capacities[-1]))
    if capacity < rows:
      raise ValueError(f"speculative decoding needs {rows} KV rows (prompt + max_new_tokens + "
                       f"draft_tokens + 1), the engine's largest state holds {capacity}: raise "
                       "max_seq_len or lower max_new_tokens")
    state = self.new_state(1, capacity)
    caches = init_mtp_state(config, 1, capacity, jnp.dtype(self.kv.kv_dtype))
    stop_ids = self.stop_ids(stop_tokens)
    forced = np.full(capacity + k, -1, np.int32)  # read up to count + k - 1 <= max_new + k
    if forced_drafts is not None:
      given = np.asarray(forced_drafts, np.int32).reshape(-1)[:max_new_tokens]
      if given.size and given.max() >= config.vocab_size:
        raise ValueError(f"forced_drafts must be token ids below {config.vocab_size} or -1")
      forced[:given.size] = given
    compile_start = self.compile_s
    tokens, max_new, stops, forced, sampling = self.put((
        jnp.asarray(ids), jnp.asarray(max_new_tokens, jnp.int32), jnp.asarray(stop_ids),
        jnp.asarray(forced), sampling))
    t0, compiled = time.perf_counter(), self.compile_s
    key = self.key("mtp_prefill", size=ids.shape[1], capacity=capacity, k=k)
    state, draft, first = self.execute(key, caches, tokens, max_new, stops, forced, sampling,
                                       state=state)
    out = [int(first)]
    prefill_s = time.perf_counter() - t0 - (self.compile_s - compiled)
    if on_token is not None:
      on_token(out[0])
    t0, compiled = time.perf_counter(), self.compile_s
    # One program per draft length m; the adaptive rule's programs return when the rule picks
    # another length (speculative.decode_program), and the next runs the length it picked.
    # Each program's seconds per verify step (compiles left out) are this engine's measured
    # cost of its length, which the rule ranks with from the next program on.
    measured = self.verify_seconds.setdefault((k, sampled), np.full(k + 1, np.nan))
    modelled = np.asarray(cost, np.float32)
    costs = speculative.calibrated_costs(modelled, measured if measured_costs else
                                         np.full(k + 1, np.nan))
    m, steps = k, 0
    while not bool(draft.done):
      key = self.key("mtp_decode", capacity=capacity, k=k, m=m, chunk=chunk,
                     stop_width=stop_ids.shape[0], sampled=sampled, adaptive=adaptive)
      began, compile_before = time.perf_counter(), self.compile_s
      state, draft, chunk_out, next_m = self.execute(
          key, draft, max_new, stops, sampling, self.put(jnp.asarray(costs)), state=state)
      ran, steps = int(draft.steps) - steps, int(draft.steps)
      # A sample: a program that ran its whole chunk (a short one's call overhead, split over
      # fewer steps, would rank its length as dearer), not an executable's first run (which
      # pays its set-up).
      if ran == chunk and key in self._ran:
        recent = self._verify_samples.setdefault((k, sampled, m),
                                                 collections.deque(maxlen=COST_SAMPLES))
        recent.append((time.perf_counter() - began - (self.compile_s - compile_before)) / ran)
        measured[m] = float(np.median(recent))
        if measured_costs:
          costs = speculative.calibrated_costs(modelled, measured)
      self._ran.add(key)
      m = int(next_m)
      got = np.asarray(chunk_out)
      for t in got[got >= 0]:
        out.append(int(t))
        if on_token is not None:
          on_token(out[-1])
    decode_s = time.perf_counter() - t0 - (self.compile_s - compiled)
    return speculative.SpeculativeResult(
        tokens=out, draft_tokens=k, steps=int(draft.steps),
        accepted=[int(a) for a in np.asarray(draft.accepted)], prompt_tokens=ids.shape[1],
        prefill_s=prefill_s, decode_s=decode_s, compile_s=self.compile_s - compile_start,
        lengths=[int(x) for x in np.asarray(draft.chosen)], costs=[float(c) for c in costs])
