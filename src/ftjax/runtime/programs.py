"""The engine's compiled programs, held by a frozen, hashable ``Runner``.

A request runs as three kinds of program, whose shapes do not depend on the request:

* ``extend``: a chunk of the context (a prompt, or a session's next segment), padded to one of
  a few chunk sizes (padding gets no expert route and does not count in the length), appended
  to a state that already holds a prefix (none for a prompt's first chunk), against a KV
  buffer of a fixed capacity addressed with the state's length;
* ``first``: the first new token, sampled on the device from the last chunk's logits;
* ``decode``: a ``lax.while_loop`` of up to ``Runner.chunk`` decode steps of a batch of
  sequences (one row each, at its own length; a batch of one for a lone request), each a
  forward pass plus sampling, each row stopped on the device by its stop tokens or its
  ``max_new_tokens``. Its outputs are the chunk's tokens and, per step, the cache counts (and
  the routing record when recording): the host reads them once per chunk, so text still
  streams. ``join`` and ``leave`` move a sequence's state into and out of a batch's row
  (``ftjax.runtime.executor`` runs the loop).

``step`` is one forward over given tokens (teacher forcing, tests, the per-token reference
loop). Every program takes the ``EngineState`` donated, so the KV cache and the expert cache
are updated in place.

A ``Runner`` holds what a program depends on besides the shapes of its arguments: the model
structure, the kernels, the policy's program, routing recording and the chunk length. Its
compiled executables are kept in a ``Programs`` table keyed by the program and a few bucketed
sizes; live engines with equal runners share one table (``Programs.shared``), so engines of one
model share their compiles, and a table is freed with its last engine.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools
import threading
import time
import weakref
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from flax import struct

from ftjax.cache import CachedExperts, PolicyConfig, StepStats
from ftjax.cache.moe import DEFAULT_OFFLOAD, Offload
from ftjax.experts import SWIGLU, BankExperts, ExpertVariant
from ftjax.model import DecodeState, KVCache, ModelConfig
from ftjax.model.layers import write_rows
from ftjax.runtime import compile_cache
from ftjax.runtime.sampling import Sampling, sample, sample_rows
from ftjax.runtime.state import EngineState, RecordingExperts, RoutingRecord


@struct.dataclass
class Loop:
  """The decode loop's carry between chunks (on the device)."""
  token: jax.Array  # int32 []: the last sampled token, fed to the next step
  count: jax.Array  # int32 []: new tokens so far
  max_new: jax.Array  # int32 []: max_new_tokens
  done: jax.Array  # bool []: a stop token was sampled or max_new reached


@struct.dataclass
class Rows:
  """The batched decode loop's carry between chunks (on the device), one entry per row."""
  token: jax.Array  # int32 [B]: the last sampled token, fed to the next step
  count: jax.Array  # int32 [B]: new tokens of the row's sequence so far
  done: jax.Array  # bool [B]: halted (a stop id sampled, or max_new reached)


# The most alternatives a token's log-probs list (OpenAI's limit for ``top_logprobs``): the
# programs always take this many (fewer for a smaller vocabulary); a request keeps its own N.
TOP_LOGPROBS = 20
# A prompt's log-probs are made this many positions at a time (``prompt_logprobs``).
SCORE_BLOCK = 64


@struct.dataclass
class TokenLogprobs:
  """Log-probabilities of tokens under the model's distribution (the log-softmax of the raw
  logits, float32), with leading axes of the tokens': the chosen token's, and the
  ``TOP_LOGPROBS`` most probable tokens' ids and log-probs, most probable first."""
  chosen: jax.Array  # float32 [...]
  top_ids: jax.Array  # int32 [..., k]
  top: jax.Array  # float32 [..., k]


@struct.dataclass
class StepRecord:
  """What each step of a program did: cache counts [steps, L] (None without a cache) and
  the router's output [steps, L, tokens, K] (None unless recording)."""
  stats: StepStats | None
  routing: RoutingRecord | None


def expert_variant(config: ModelConfig) -> ExpertVariant:
  """The routed experts' function of a model (its activation and expert biases)."""
  return ExpertVariant(activation=config.expert_activation, alpha=config.swiglu_alpha,
                       limit=config.swiglu_limit, bias=config.expert_bias)


@dataclasses.dataclass(frozen=True)
class Runner:
  """What the compiled programs depend on besides argument shapes (hashable, static)."""
  graphdef: nnx.GraphDef
  signature: tuple  # shapes and dtypes of the bank and the parameters
  num_layers: int  # MoE layers L (of the bank: the decoder's, then the MTP head's)
  top_k: int
  ffn_dim: int
  kernels: str  # "xla", "ffi", "ffi_bf16", "ffi_int8"
  policy: PolicyConfig | None  # the policy's program part; None = no cache
  record_routing: bool = False
  chunk: int = 8  # decode steps per decode program
  offload: Offload = DEFAULT_OFFLOAD  # where the pool lives; how fills and host experts run
  # Prefill and extend programs of at least this many tokens stream whole layers (0: never),
  # as ``prefill_stream`` says: "always" (every layer) or "cost" (each layer by the cost
  # model, which reads ``offload.host_gflops``); see ``ftjax.cache.moe.Offload``.
  stream_min_tokens: int = 0
  prefill_stream: str = "always"
  kv_dtype: str = "float32"  # the decode state's KV caches (programs of other dtypes differ)
  variant: ExpertVariant = SWIGLU  # the routed experts' activation and biases
  # The decoder's layers, which a forward visits in order (0: all num_layers); the MTP head's
  # after them are not fetched ahead by a streamed prefill.
  pass_layers: int = 0
  # Router-ahead prefetch in one-token-per-row forwards (decode steps, batches, verifies of
  # one token): at most this many experts per MoE layer-step (0: none); ``CachedExperts``.
  prefetch: int = 0
  vocab_size: int = 0  # the logits' width (a decode chunk's log-probs are laid out before it)

  # -- Tracing ---------------------------------------------------------------------------------

  def forward(self, params, bank, state: EngineState, tokens, positions, *, last_only: bool,
              fresh: bool, num_valid=None, snapshot_at=None, active=None,
              keep_hidden: bool = False):
    """One forward pass of the model over ``tokens [B, T]`` (traced inside a program):
    (state, logits, record, snapshots: the recurrent layers' states at ``snapshot_at``, ()
    without; ``Transformer.__call__``). ``active`` [B]: the rows of a batch that step.
    ``keep_hidden`` adds a fifth result: every position's hidden state before the final norm
    [B, T, D] (``head`` gives their logits)."""
    model = nnx.merge(self.graphdef, params)
    experts = self.routed_experts(bank, state, tokens.shape)
    outs = model(state.decode, tokens, positions, experts, kernels=self.kernels,
                 last_only=last_only, fresh=fresh, num_valid=num_valid, snapshot_at=snapshot_at,
                 active=active, keep_hidden=keep_hidden)
    decode, experts, logits = outs[:3]
    state, record = self.settle(experts, state)
    snapshots = () if snapshot_at is None else outs[3]
    if keep_hidden:
      return state.replace(decode=decode), logits, record, snapshots, outs[-1]
    return state.replace(decode=decode), logits, record, snapshots

  def head(self, params, x):
    """The logits [B, T, V] float32 of hidden states ``x`` [B, T, D] before the final norm
    (``Transformer.head``), traced inside a program."""
    return nnx.merge(self.graphdef, params).head(x, kernels=self.kernels)

  def forward_hidden(self, params, bank, state: EngineState, tokens, positions, *, fresh: bool,
                     snapshot_at=None):
    """``forward`` that also returns the hidden states after the final norm, which seed the
    MTP head: (state, hidden [B, T, D], logits [B, T, V], record, snapshots)."""
    model = nnx.merge(self.graphdef, params)
    experts = self.routed_experts(bank, state, tokens.shape)
    decode, experts, hidden, logits, snapshots = model.hidden_and_logits(
        state.decode, tokens, positions, experts, kernels=self.kernels, fresh=fresh,
        snapshot_at=snapshot_at)
    state, record = self.settle(experts, state)
    return state.replace(decode=decode), hidden, logits, record, snapshots

  def mtp_step(self, params, bank, state: EngineState, caches, length, hidden, tokens,
               positions, *, depth: int = 0, fresh: bool = False, num_valid=None,
               logits: bool = True):
    """One step of the MTP head (``Transformer.mtp_step``, whose ``num_valid`` and
    ``logits`` it passes on), its routed experts served as the model's: (state, caches,
    hidden' [B, T, D], logits [B, T, V] or None, record)."""
    model = nnx.merge(self.graphdef, params)
    experts = self.routed_experts(bank, state, tokens.shape)
    caches, experts, out, logits = model.mtp_step(caches, length, hidden, tokens, positions,
                                                  experts, kernels=self.kernels, depth=depth,
                                                  fresh=fresh, num_valid=num_valid,
                                                  logits=logits)
    state, record = self.settle(experts, state)
    return state, caches, out, logits, record

  def routed_experts(self, bank, state: EngineState, token_shape: tuple[int, ...]):
    """The routed-experts function (``ftjax.model.moe``) of a forward over tokens of
    ``token_shape`` [B, T]: the host bank's without a cache, else the cache's (a prefill of
    at least ``stream_min_tokens`` streams layers), recording when the runner records."""
    if self.policy is None:
      experts = BankExperts(bank=bank, ffn_dim=self.ffn_dim, kernels=self.kernels,
                            variant=self.variant)
    else:
      offload = self.offload
      size = token_shape[0] * token_shape[1]
      if token_shape[1] > 1 and 0 < self.stream_min_tokens <= size:  # prefills only
        offload = dataclasses.replace(offload, stream=self.prefill_stream)
      experts = CachedExperts(bank=bank, cache=state.cache, bandwidths=state.bandwidths,
                              stats=StepStats.zeros(self.num_layers), ffn_dim=self.ffn_dim,
                              policy=self.policy, kernels=self.kernels, offload=offload,
                              variant=self.variant,
                              pass_layers=self.pass_layers or self.num_layers,
                              prefetch=self.prefetch if token_shape[1] == 1 else 0)
    if self.record_routing:
      experts = RecordingExperts(experts, RoutingRecord.empty(
          self.num_layers, token_shape[0] * token_shape[1], self.top_k))
    return experts

  def settle(self, experts, state: EngineState) -> tuple[EngineState, "StepRecord"]:
    """The state with the expert cache ``experts`` left (``routed_experts``), and the step's
    record."""
    routing = None
    if self.record_routing:
      routing, experts = experts.routing, experts.inner
    stats = None
    if self.policy is not None:
      state = state.replace(cache=experts.cache)
      stats = experts.stats
    return state, StepRecord(stats=stats, routing=routing)


@dataclasses.dataclass(frozen=True, eq=False)
class ProgramKind:
  """One kind of program: its body (a pure function of a ``Runner`` and arrays), the names of
  its static keyword options and of its donated arguments. ``model``: it takes the parameters,
  the host pool and the ``EngineState`` after the runner, and returns the state first;
  ``record_at``: where its ``StepRecord`` sits among the outputs after the state (None: it
  keeps none, or the caller reads it later)."""
  name: str
  body: Callable
  static: tuple[str, ...] = ()
  donate: tuple[str, ...] = ()
  model: bool = False
  record_at: int | None = None


def _owned(body: Callable) -> Callable:
  """A new function object that calls ``body``: what a table hands to ``jax.jit``. JAX keeps
  its traces, lowerings and executables in caches keyed weakly by the function it was given
  (and strongly by static arguments such as the runner), so a body shared by every table
  would keep every program ever compiled alive; one function per table is released with it."""
  @functools.wraps(body)
  def program(*args, **kwargs):
    return body(*args, **kwargs)
  return program


class Programs:
  """The compiled executables of one ``Runner``, keyed by the program's name and bucketed
  sizes (``ftjax.runtime.executor.Executor.key`` builds every key).

  The table lives as long as an engine holds it, plus a short while: ``Programs.shared(runner)``
  is the table of every live engine with an equal runner (engines of one model share their
  compiles), and the ``keep_released()`` tables acquired last (default 1) are kept after their
  engines are gone, so that a sweep whose consecutive engines share a runner (cache sizes
  within one slot-buffer capacity, repeats) compiles once. Any other table is released with its
  last engine: its executables, JIT code and buffers go with it. That needs the table's own
  ``jax.jit`` of each program body (``_owned``): JAX's own caches hold what they compiled for as
  long as the function they were given lives. Without that release a process that makes many
  engines keeps every program it compiled, and XLA:CPU maps each executable's code into
  memory: past ``vm.max_map_count`` (65530 by default) the next compile crashes inside LLVM
  (issue 50: a sweep died at about 55 configurations).

  The table is kept apart from the runner on purpose: each executable refers to its runner (a
  static argument), so a table held by the runner would never be freed.
  """

  def __init__(self, runner: Runner):
    self.runner = runner
    self._table: dict[tuple, Callable] = {}
    self.loaded: set[tuple] = set()  # keys whose executable came from the store, not a compile
    self._jitted: dict[str, Callable] = {}  # kind name -> this table's jax.jit of its body
    self._lock = threading.Lock()  # guards _table's writes, _pending and _jitted
    self._pending: dict[tuple, threading.Lock] = {}  # a lock per key being prepared
    self._compiling = threading.Lock()  # one XLA compile at a time

  @classmethod
  def shared(cls, runner: Runner) -> "Programs":
    """The table of ``runner`` (see the class docstring), made the most recently acquired."""
    with _SHARED_LOCK:
      if _RELEASED[0]:  # a table went since: its executables' heap goes back to the system
        _RELEASED[0] = False
        return_free_heap()
      programs = _SHARED.get(runner)
      if programs is None:
        programs = _SHARED[runner] = cls(runner)
        weakref.finalize(programs, _RELEASED.__setitem__, 0, True)
      _RECENT.pop(runner, None)
      _RECENT[runner] = programs
      while len(_RECENT) > _KEEP[0]:
        _RECENT.popitem(last=False)
      return programs

  def __contains__(self, key: tuple) -> bool:
    return key in self._table

  def __len__(self) -> int:
    return len(self._table)

  def items(self) -> list[tuple[tuple, Callable]]:
    """(key, executable) of every program compiled so far."""
    return list(self._table.items())

  def get(self, key: tuple) -> Callable | None:
    """The executable of ``key`` when it is compiled, else None."""
    return self._table.get(key)

  def compile(self, key: tuple, kind: ProgramKind, args: tuple, static: dict,
              on_compile: Callable[[tuple, float], None] | None = None) -> Callable:
    """The executable of ``key``: ``kind``'s body compiled ahead of time for ``args`` (arrays or
    ``jax.ShapeDtypeStruct``s) and its ``static`` options, unless another thread compiled it
    first; loaded instead, untraced, where ``compile_cache``'s store holds it (the key goes in
    ``loaded``), and stored after a compile. ``on_compile(key, seconds)`` is told of either.

    Threads may prepare different keys at once: loads from the store run side by side
    (XLA's deserialization overlaps in part: 2 loads in 0.74x the time of one after the other,
    on 2 busy cores), compiles one at a time (each takes the compiler's memory); a thread that
    asks for a key another is preparing waits for it."""
    fn = self._table.get(key)
    if fn is not None:
      return fn
    with self._lock:
      gate = self._pending.setdefault(key, threading.Lock())
    with gate:
      fn = self._table.get(key)
      if fn is not None:
        return fn
      t0 = time.perf_counter()
      digest = compile_cache.fingerprint(kind, self.runner, args, static)
      fn = compile_cache.load_executable(digest)
      if fn is None:
        with self._compiling:
          fn = compile_cache.compile_program(
              self._jit(kind).lower(self.runner, *args, **static), digest)
      else:
        self.loaded.add(key)
      check_host_memory(key, fn, self.runner)
      with self._lock:
        self._table[key] = fn
        self._pending.pop(key, None)
      seconds = time.perf_counter() - t0
      return_free_heap()  # what the compiler used and freed
      if on_compile is not None:
        on_compile(key, seconds)
    return fn

  def stored(self, kind: ProgramKind, args: tuple, static: dict) -> bool:
    """Whether ``compile`` would load this program from the store instead of compiling it."""
    return compile_cache.is_stored(compile_cache.fingerprint(kind, self.runner, args, static))

  def _jit(self, kind: ProgramKind) -> Callable:
    with self._lock:
      fn = self._jitted.get(kind.name)
      if fn is None:
        fn = self._jitted[kind.name] = jax.jit(
            _owned(kind.body), static_argnums=0, static_argnames=kind.static,
            donate_argnames=kind.donate)
    return fn


def available_host_bytes() -> int | None:
  """The kernel's estimate of memory that new allocations can take without swapping or the
  OOM killer (``MemAvailable``); None where /proc/meminfo does not say."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def check_host_memory(key: tuple, compiled, runner: Runner) -> None:
  """On the CPU backend a program's buffers are host memory: refuses, with the cause and the
  fix, a compiled program whose new buffers (temporaries and outputs that do not reuse a
  donated input) exceed the memory available now, instead of letting the OOM killer end the
  process half-way through it."""
  if jax.default_backend() != "cpu":
    return  # device memory: XLA's allocator reports its own out-of-memory error
  available = available_host_bytes()
  analysis = compiled.memory_analysis()
  if available is None or analysis is None:
    return
  needed = (analysis.temp_size_in_bytes + analysis.output_size_in_bytes
            - analysis.alias_size_in_bytes)
  if needed <= available:
    return
  if runner.offload.fill == "slices":
    fix = ("The pool is in pinned_host memory, which on the CPU backend runs the GPU "
           "program's semantics, not for speed: XLA:CPU widens the whole bfloat16 pool to "
           "float32 for its slices. Use pool='device' (the CPU backend's default)")
  else:
    fix = "Lower max_seq_len, prefill_chunk or the cache size, or free memory"
  raise MemoryError(
      f"the compiled {key[0]} program needs {needed / 2**30:.1f} GiB of new buffers, but "
      f"{available / 2**30:.1f} GiB of host memory is available: running it would get the "
      f"process killed. {fix}")


# Values are weak: a table goes when its last engine does, unless it is one of the
# ``keep_released()`` tables acquired last (``_RECENT``, strong).
_SHARED: weakref.WeakValueDictionary[Runner, Programs] = weakref.WeakValueDictionary()
_RECENT: collections.OrderedDict[Runner, Programs] = collections.OrderedDict()
_KEEP = [1]
_RELEASED = [False]  # a table was released since the heap was last returned
_SHARED_LOCK = threading.Lock()


def keep_released(tables: int | None = None) -> int:
  """How many of the tables acquired last are kept when no engine holds them (default 1);
  with ``tables``, sets it first (0: every table goes with its last engine). Returns it."""
  if tables is not None:
    if isinstance(tables, bool) or not isinstance(tables, int) or tables < 0:
      raise ValueError(f"keep_released takes an int >= 0 (tables), got {tables!r}")
    with _SHARED_LOCK:
      _KEEP[0] = tables
      while len(_RECENT) > tables:
        _RECENT.popitem(last=False)
  return _KEEP[0]


def release_unused() -> None:
  """Releases every table no live engine holds now (their executables and JIT code), and hands
  the heap they held back to the system."""
  with _SHARED_LOCK:
    _RECENT.clear()
  return_free_heap()


def _malloc_trim() -> Callable[[int], int] | None:
  try:
    return ctypes.CDLL(None).malloc_trim
  except (OSError, AttributeError):  # not glibc: the heap keeps what it freed
    return None


_TRIM = _malloc_trim()


def return_free_heap() -> None:
  """Hands the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing
  elsewhere). XLA:CPU's compiler frees most of what a compile used, and a released table its
  executables, but glibc's arenas keep those pages: without this a process's RSS keeps the
  high-water mark of its compiles (measured: a sweep's RSS 0.63 -> 0.92 GB over 200 engines,
  ~0.42 GB with it). It takes about a millisecond, after a compile of seconds."""
  if _TRIM is not None:
    _TRIM(0)


def live_tables() -> int:
  """Tables alive now: those of live engines and those kept after them."""
  return len(_SHARED)


def clear_compiled() -> None:
  """Forgets every shared and kept table (tests that count compiles start from here); engines
  that hold a table keep it."""
  with _SHARED_LOCK:
    _SHARED.clear()
    _RECENT.clear()


# Programs: pure functions of (runner, arrays); ``runner`` is static, ``state`` donated.


def step_program(runner: Runner, params, bank, state: EngineState, tokens, positions, *,
                 last_only: bool = False, fresh: bool = False):
  """One forward over ``tokens [B, T]`` -> (state, logits, record)."""
  state, logits, record, _ = runner.forward(params, bank, state, tokens, positions,
                                            last_only=last_only, fresh=fresh)
  return state, logits, record


def _stopped(token, count, max_new, stop_ids):
  return jnp.any(token == stop_ids) | (count >= max_new)


def _top_count(vocab: int) -> int:
  return min(TOP_LOGPROBS, vocab)


def token_logprobs(logits, tokens) -> TokenLogprobs:
  """Log-probabilities of the model's distribution (the softmax of the raw logits, before any
  temperature or filter): logits [..., V], tokens int32 [...] (ids outside [0, V): their
  ``chosen`` is meaningless) -> ``TokenLogprobs`` with leading [...]."""
  z = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(z, axis=-1, keepdims=True)
  top, ids = jax.lax.top_k(z, _top_count(z.shape[-1]))
  picked = jnp.take_along_axis(z, jnp.clip(tokens, 0, z.shape[-1] - 1)[..., None], axis=-1)
  return TokenLogprobs(chosen=(picked - lse)[..., 0], top_ids=ids.astype(jnp.int32),
                       top=top - lse)


def _no_logprobs(shape: tuple[int, ...], vocab: int) -> TokenLogprobs:
  k = _top_count(vocab)
  return TokenLogprobs(chosen=jnp.zeros(shape, jnp.float32),
                       top_ids=jnp.zeros(shape + (k,), jnp.int32),
                       top=jnp.zeros(shape + (k,), jnp.float32))


def prompt_logprobs(runner: Runner, params, hidden, targets) -> TokenLogprobs:
  """Each position's log-probs: hidden [1, T, D] (before the final norm), targets int32
  [1, T] (the token that follows each position) -> ``TokenLogprobs`` [T]. The logits are made
  ``SCORE_BLOCK`` positions at a time, so that a chunk's [T, V] logits never exist at once."""
  t, d = hidden.shape[1], hidden.shape[2]
  block = min(t, SCORE_BLOCK)
  n = -(-t // block)
  pad = n * block - t
  x = jnp.pad(hidden[0], ((0, pad), (0, 0))).reshape(n, block, d)
  y = jnp.pad(targets[0], (0, pad)).reshape(n, block)

  def one(args):
    xb, yb = args
    return token_logprobs(runner.head(params, xb[None])[0], yb)

  out = jax.lax.map(one, (x, y))
  return jax.tree.map(lambda a: a.reshape((n * block,) + a.shape[2:])[:t], out)


def first_program(runner: Runner, logits, max_new, stop_ids, sampling: Sampling, want
                  ) -> tuple[Loop, TokenLogprobs]:
  """The first new token, sampled from ``logits [V]`` (after a prompt's last token): the
  decode loop's starting carry, and the token's log-probs (``token_logprobs``; zeros unless
  ``want``, a bool [])."""
  token = sample(logits, sampling, jnp.zeros((), jnp.int32), kernels=runner.kernels)
  count = jnp.ones((), jnp.int32)
  logprobs = jax.lax.cond(want, lambda: token_logprobs(logits, token),
                          lambda: _no_logprobs((), logits.shape[-1]))
  return Loop(token=token, count=count, max_new=max_new,
              done=_stopped(token, count, max_new, stop_ids)), logprobs


def extend_program(runner: Runner, params, bank, state: EngineState, tokens, num_valid,
                   targets, scored, snapshot_at=None):
  """``tokens [1, size]`` (the first ``num_valid`` real) appended to a state that already
  holds ``state.decode.length`` tokens (a prompt's chunk, or a session's next segment of
  context). The state's KV capacity must hold the whole chunk past that length. Returns
  (state, logits [V] float32 after the last real token, record, snapshots, logprobs): with
  ``snapshot_at`` (int32 [A] positions in the chunk) the recurrent layers' states after that
  many of its tokens (per layer, a ``LinearState`` with a leading [A] axis, None for attention
  layers), else (); with ``scored`` (bool []) each position's log-probs of ``targets`` (int32
  [1, size], the token after each position: ``prompt_logprobs``), from the same forward,
  else zeros (the branch not taken costs nothing)."""
  positions = state.decode.length + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
  state, logits, record, snapshots, hidden = runner.forward(
      params, bank, state, tokens, positions, last_only=True, fresh=False, num_valid=num_valid,
      snapshot_at=snapshot_at, keep_hidden=True)
  logprobs = jax.lax.cond(scored, lambda h: prompt_logprobs(runner, params, h, targets),
                          lambda h: _no_logprobs((tokens.shape[1],), logits.shape[-1]), hidden)
  return state, logits[0, -1], record, snapshots, logprobs


def grow_program(runner: Runner, state: DecodeState, *, capacity: int) -> DecodeState:
  """The decode state with every KV cache padded to ``capacity`` rows (the rows held are
  kept): a session's context outgrew its allocation."""
  del runner  # the table's key; the program needs only the state

  def grow(layer):
    if not isinstance(layer, KVCache):
      return layer
    pad = [(0, 0), (0, capacity - layer.k.shape[1]), (0, 0), (0, 0)]
    return KVCache(k=jnp.pad(layer.k, pad), v=jnp.pad(layer.v, pad))
  return state.replace(layers=tuple(grow(layer) for layer in state.layers))


def decode_program(runner: Runner, params, bank, state: EngineState, rows: Rows, go, resume,
                   max_new, stop_ids, sampling: Sampling, want):
  """Up to ``runner.chunk`` decode steps of a batch of B sequences (one row each, at its own
  length: ``state.decode.length`` int32 [B]), stopping on the device.

  go bool [B]: the rows that hold a running sequence; resume bool [B]: rows whose halt the
  host lifts before the first step; max_new int32 [B], stop_ids int32 [B, S] and sampling
  (leaves [B]): each row's own. A row steps while it goes and has not halted (on one of its
  stop ids, or at its max_new); the others' states stay as they are. The loop ends after
  ``chunk`` steps or when no row steps. want bool [B]: rows that want their tokens'
  log-probs (``token_logprobs``: computed in a step only when a row stepping wants them).

  Returns (state, rows, tokens [chunk, B] int32 (-1 where a row did not step), record with a
  leading [chunk] axis, over the rows that stepped, logprobs [chunk, B])."""
  n = runner.chunk
  layers = runner.num_layers
  size = rows.token.shape[0]
  stats = StepStats.zeros(layers, (n,)) if runner.policy is not None else None
  routing = (RoutingRecord(ids=jnp.full((n, layers, size, runner.top_k), -1, jnp.int32),
                           weights=jnp.zeros((n, layers, size, runner.top_k), jnp.float32))
             if runner.record_routing else None)
  out = jnp.full((n, size), -1, jnp.int32)
  vocab = runner.vocab_size
  logprobs = _no_logprobs((n, size), vocab)
  rows = rows.replace(done=rows.done & ~resume)

  def cond(carry):
    i, _, rows, _, _, _ = carry
    return (i < n) & jnp.any(go & ~rows.done)

  def body(carry):
    i, state, rows, out, record, logprobs = carry
    step = go & ~rows.done
    state, logits, record_i, _ = runner.forward(
        params, bank, state, rows.token[:, None], state.decode.length[:, None],
        last_only=True, fresh=False, active=step)
    token = sample_rows(logits[:, -1], sampling, rows.count, kernels=runner.kernels)
    token = jnp.where(step, token, rows.token)
    count = rows.count + step.astype(jnp.int32)
    halted = jax.vmap(_stopped)(token, count, max_new, stop_ids)
    rows = Rows(token=token, count=count, done=rows.done | (step & halted))
    record = jax.tree.map(lambda whole, one: whole.at[i].set(one), record, record_i)
    lp = jax.lax.cond(jnp.any(step & want), lambda: token_logprobs(logits[:, -1], token),
                      lambda: _no_logprobs((size,), vocab))
    logprobs = jax.tree.map(lambda whole, one: whole.at[i].set(one), logprobs, lp)
    return i + 1, state, rows, out.at[i].set(jnp.where(step, token, -1)), record, logprobs

  _, state, rows, out, record, logprobs = jax.lax.while_loop(
      cond, body, (jnp.zeros((), jnp.int32), state, rows, out, StepRecord(stats, routing),
                   logprobs))
  return state, rows, out, record, logprobs


def join_program(runner: Runner, batch: DecodeState, rows: Rows, row, state: DecodeState,
                 loop: Loop):
  """A batch (decode state of B rows, one length each, and the loop's carry) with one
  sequence's ``state`` (one row, its length a scalar) and its first token (``loop``) in row
  ``row``. KV rows past the smaller capacity are not copied (the batch holds the sequence)."""
  del runner  # the table's key

  def put(whole, one):
    if isinstance(whole, KVCache):
      m = min(whole.k.shape[1], one.k.shape[1])
      return KVCache(k=write_rows(whole.k, one.k[:, :m], (row, 0, 0, 0)),
                     v=write_rows(whole.v, one.v[:, :m], (row, 0, 0, 0)))
    return jax.tree.map(lambda w, o: write_rows(w, o, (row,) + (0,) * (w.ndim - 1)), whole, one)

  layers = tuple(put(w, o) for w, o in zip(batch.layers, state.layers))
  batch = DecodeState(layers=layers, length=batch.length.at[row].set(state.length))
  rows = Rows(token=rows.token.at[row].set(loop.token), count=rows.count.at[row].set(loop.count),
              done=rows.done.at[row].set(False))
  return batch, rows


def leave_program(runner: Runner, batch: DecodeState, row, *, capacity: int) -> DecodeState:
  """Row ``row`` of a batch as one sequence's state of ``capacity`` KV rows (its length a
  scalar); the batch is left as it is."""
  del runner

  def take(whole):
    if isinstance(whole, KVCache):
      m = min(whole.k.shape[1], capacity)

      def one(x):
        x = jax.lax.dynamic_slice_in_dim(x, row, 1, axis=0)[:, :m]
        return jnp.pad(x, [(0, 0), (0, capacity - m), (0, 0), (0, 0)])
      return KVCache(k=one(whole.k), v=one(whole.v))
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, row, 1, axis=0), whole)

  return DecodeState(layers=tuple(take(w) for w in batch.layers), length=batch.length[row])


# The kinds (``ftjax.runtime.executor.KEY_FIELDS`` names their compile keys' sizes).
STEP = ProgramKind("step", step_program, static=("last_only", "fresh"), donate=("state",),
                   model=True, record_at=1)
FIRST = ProgramKind("first", first_program)
EXTEND = ProgramKind("extend", extend_program, donate=("state",), model=True, record_at=1)
GROW = ProgramKind("grow", grow_program, static=("capacity",))
DECODE = ProgramKind("decode", decode_program, donate=("state",), model=True)
JOIN = ProgramKind("join", join_program, donate=("batch", "rows"))
LEAVE = ProgramKind("leave", leave_program, static=("capacity",))
