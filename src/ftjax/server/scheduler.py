"""The server's scheduler: the one thread that runs the engine, and the jobs it runs.

Requests become jobs (``Job``) on the event loop and queue for the engine thread (``Worker``),
which runs the engine's decode loop (``Executor.run``) with itself as the loop's ``Feed``: up
to ``max_running`` jobs at once, first come first served. A job takes a session
(``SessionPool``), reads its context between the decode chunks of the jobs already running (up
to one prefill chunk's worth of prompt tokens between two: several short prompts, or one chunk
of a long one), then joins the decode batch; its reply's deltas (parsed in the model's
reply format: ``reply_formats``) go back to the request's task as they come, a decode chunk
at a time. At most ``max_queue`` jobs wait; past that the answer is 429 with ``Retry-After``. A
streaming client that goes away cancels its job: a waiting job is dropped, a running one
leaves the batch after the current decode chunk.

Memory: with a device budget (``--device_budget_bytes``; ``ftjax.runtime.budget``), a job is
admitted when its decode state (KV rows for its prompt and ``max_tokens``, the recurrent
states, and the batch rows it grows) fits what the budget leaves beside the states already
held; idle sessions of the pool are dropped first (least recently used) to make room. A job
that does not fit waits, first in line, until running jobs finish; one that would not fit
even with nothing else held is a 400 that says how much it needs. Controls (``control``: the
``POST /v1/cache`` resize) run on the engine thread between decode chunks.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import math
import queue
import threading
import time
import weakref
from typing import Any, Callable, Iterator

from ftjax.runtime.engine import Engine
from ftjax.runtime.executor import PREPARE_WORKERS, Batch, Feed, Generation, TokenLogprob
from ftjax.runtime.programs import return_free_heap
from ftjax.runtime.session import DEFAULT_ANCHOR_BUDGET_BYTES, ContextResult, Session
from ftjax.runtime.tokenizer import StreamDecoder, load_tokenizer
from ftjax.server.auth import check_key
from ftjax.server.outputs import Delta, Logprob, StopMatcher
from ftjax.server.pool import SessionPool
from ftjax.server.protocol import ApiError
from ftjax.server.store import SessionStore
from ftjax.server.reply_formats import QWEN, ReplyFormat, check_name

_LOG = logging.getLogger("uvicorn.error")  # where uvicorn's own messages go
_WAKE = object()  # in the job queue: a control is waiting (the engine thread may be idle)
MB = 1 << 20
# A warm start's later programs load once the engine has been idle this long (seconds).
LATER_GRACE_S = 1.0
# Once the engine has been idle this long after work, the C heap's free pages go back to the
# system (``return_free_heap``). A load run's requests leave glibc's arenas holding ~80 MiB
# they freed (measured: 256 completions on the default model, RSS +95 MiB idle, +13 MiB after
# a trim), so RSS returns to its level before the load rather than staying at its peak.
TRIM_IDLE_S = 2.0


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """model_name: the id clients send as ``model`` (and ``/v1/models`` lists).
  max_queue: requests that may wait behind the running ones (more: 429).
  max_running: sequences that decode together in one batch (continuous batching: requests
    join and leave between decode chunks; new prompts are read between them, up to one
    prefill chunk's worth of tokens at a time); 1 runs one request at a time.
  max_body_bytes: the largest request body (more: 413).
  default_max_tokens: the completion limit of a chat request that gives none (clipped to the
    context left).
  session_budget_bytes, max_sessions, session_reuse, anchor_budget_bytes: the session pool
    (``session_reuse=False``: a fresh session per request, nothing reused).
  precompile: compile every program a request can run (``Engine.programs_needed``) before
    the first request is served, so that no request waits for a compile; ``GET /health``
    answers 503 with the progress until then. ``python -m ftjax.serve`` does by default.
  api_keys, admin_keys: the keys every route but ``/health`` needs, and those the controls
    (``POST /v1/cache``) need (``ftjax.server.auth``); none: open.
  reply_format: the format replies are parsed in (a name of ``reply_formats.FORMATS``); None:
    chosen by the chat template's tags and the model's ``model_type``.
  session_dir, session_disk_bytes: sessions kept on disk across restarts (``store``): the
    pool saves those it drops and, at shutdown, those it holds, within the byte budget; None:
    none kept."""
  model_name: str = "default"
  max_queue: int = 16
  max_running: int = 4
  max_body_bytes: int = 8 << 20
  default_max_tokens: int = 512
  session_budget_bytes: int = 4 << 30
  max_sessions: int = 8
  session_reuse: bool = True
  anchor_budget_bytes: int = DEFAULT_ANCHOR_BUDGET_BYTES
  precompile: bool = False
  api_keys: tuple[str, ...] = ()
  admin_keys: tuple[str, ...] = ()
  reply_format: str | None = None
  session_dir: str | None = None
  session_disk_bytes: int = 16 << 30

  def __post_init__(self):
    check_name(self.reply_format)
    for name in ("api_keys", "admin_keys"):
      keys = getattr(self, name)
      if isinstance(keys, str):
        raise ValueError(f"{name} must be a sequence of keys, got one string")
      for key in keys:
        check_key(key, name)
    for name in ("max_queue", "default_max_tokens", "max_sessions", "max_body_bytes",
                 "max_running"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")



@dataclasses.dataclass
class Job:
  """One request's generation, as the worker runs it."""
  ids: list[int]
  max_tokens: int
  sampling: dict[str, Any]
  stops: list[str]
  stream: bool  # send the deltas as they come (else all at once, with the outcome)
  chat: bool  # parse reasoning and tool calls (False: raw text, /v1/completions)
  reasoning: bool  # the reply starts inside a think block the prompt opened
  tool_calls: bool
  loop: asyncio.AbstractEventLoop
  received: float
  reply_format: ReplyFormat = QWEN  # how the model writes reasoning and tool calls
  tools: list[dict[str, Any]] | None = None  # the request's (some formats type arguments by them)
  # Log-probs of the reply's tokens with this many alternatives each (None: none), and with
  # ``echo`` the prompt's (``echo_text`` the prompt as the reply repeats it): its context is
  # then read whole, as a prompt's log-probs come from the forward that reads it.
  logprobs: int | None = None
  echo: bool = False
  echo_text: str = ""
  events: asyncio.Queue = dataclasses.field(default_factory=asyncio.Queue)
  cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)

  @property
  def scores_prompt(self) -> bool:
    return self.echo and self.logprobs is not None

  def send(self, kind: str, payload: Any = None) -> None:
    try:
      self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
    except RuntimeError:  # the event loop is closed (the server stopped): nobody waits
      self.cancelled.set()


@dataclasses.dataclass
class Outcome:
  prompt_tokens: int
  completion_tokens: int
  cached_tokens: int
  finish_reason: str
  ttft_s: float
  decode_tok_s: float | None
  cancelled: bool = False  # the client went away before the reply was complete
  after_cancel: int = 0  # tokens generated after the client went away (at most two chunks)
  stop_sequence: str | None = None  # the request's stop string that ended the reply


def _chars(raw: bytes) -> int:
  """Characters a token's bytes start (UTF-8 lead bytes): a text's length, summed."""
  return sum((b & 0xC0) != 0x80 for b in raw)


class Reply:
  """A running job's reply: turns its tokens into deltas (text, reasoning, tool calls),
  matches its stop strings and makes its outcome."""

  def __init__(self, job: Job, tokenizer, eos: set[int]):
    self.job, self.eos, self.tokenizer = job, eos, tokenizer
    self.decoder = StreamDecoder(tokenizer)
    self.stops = StopMatcher(job.stops)
    self.parser = job.reply_format.parser(reasoning=job.reasoning, tool_calls=job.tool_calls,
                                          tools=job.tools) if job.chat else None
    self.count, self.first_at, self.finish, self.after_cancel = 0, None, "length", 0
    self.held: list[Delta] = []  # a non-streaming reply's deltas, sent once at the end
    self.cached_tokens = 0
    self.generation: Generation | None = None  # its sequence (log-probs are read from it)
    self.seen = 0  # tokens heard (``on_token``), past a stop too
    self.chars = 0  # characters of the choice's text so far (``Logprob.offset``)
    self._texts: dict[int, tuple[str, bytes]] = {}

  def _token(self, token: int) -> tuple[str, bytes]:
    if token not in self._texts:
      self._texts[token] = (self.tokenizer.decode([token]), self.tokenizer.token_bytes(token))
    return self._texts[token]

  def logprob(self, entry: TokenLogprob | None, token: int, offset: int) -> Logprob:
    """The API's form of a token's log-probs (``entry`` None: a prompt's first token)."""
    text, raw = self._token(token)
    if entry is None:
      return Logprob(text, raw, None, (), offset)
    n = self.job.logprobs or 0
    top = tuple((*self._token(int(i)), float(lp))
                for i, lp in zip(entry.top_ids[:n], entry.top[:n]))
    return Logprob(text, raw, entry.logprob, top, offset)

  def start(self, context: ContextResult) -> None:
    """The prompt has been read: an echoed prompt's text (and log-probs) come first."""
    if not self.job.echo:
      return
    out = [Delta("content", self.job.echo_text)] if self.job.echo_text else []
    if context.logprobs is not None:
      chars, lps = 0, []
      for token, entry in zip(self.job.ids, context.logprobs):
        lps.append(self.logprob(entry, token, chars))
        chars += _chars(self._token(token)[1])
      out.append(Delta("logprobs", logprobs=tuple(lps)))
    self.chars = len(self.job.echo_text)
    self.send(out)

  def send(self, out: list[Delta]) -> None:
    if not out:
      return
    if self.job.stream:
      self.job.send("deltas", out)
    else:
      self.held.extend(out)

  def deltas(self, text: str) -> list[Delta]:
    if self.parser is None:
      return [Delta("content", text)] if text else []
    return self.parser.push(text)

  def on_token(self, tok: int) -> None:
    entry = None
    if self.job.logprobs is not None and self.generation is not None:
      entry = self.generation.logprobs[self.seen]
    self.seen += 1
    if self.job.cancelled.is_set():
      self.after_cancel += 1
    if self.stops.stopped or self.finish == "stop":
      return  # past a stop string: generated but not part of the reply
    self.count += 1
    if self.first_at is None:
      self.first_at = time.perf_counter()
    offset = self.chars
    lp = [] if entry is None else [Delta("logprobs", logprobs=(self.logprob(entry, tok,
                                                                              offset),))]
    if tok in self.eos:
      self.finish = "stop"
      self.send(lp)  # the end token's log-prob too (a harness reads the token it scores)
      return
    piece = self.decoder.push(tok)
    self.chars += len(piece)
    out = self.deltas(self.stops.push(piece))
    if self.stops.stopped:
      self.finish = "stop"
    self.send(out + lp)

  def cancel(self) -> bool:
    return self.job.cancelled.is_set() or self.stops.stopped

  def outcome(self) -> Outcome:
    done = time.perf_counter()
    tail = self.stops.push(self.decoder.flush()) if not self.stops.stopped else ""
    tail += self.stops.flush()
    self.send(self.deltas(tail) + (self.parser.flush() if self.parser is not None else []))
    if self.held:
      self.job.send("deltas", self.held)
    finish = self.finish
    if self.parser is not None and self.parser.calls:
      finish = "tool_calls"
    first_at = self.first_at
    ttft = (first_at or done) - self.job.received
    rate = ((self.count - 1) / (done - first_at) if first_at is not None and self.count > 1
            else None)
    return Outcome(prompt_tokens=len(self.job.ids), completion_tokens=self.count,
                   cached_tokens=self.cached_tokens, finish_reason=finish, ttft_s=ttft,
                   decode_tok_s=rate, cancelled=self.job.cancelled.is_set(),
                   after_cancel=self.after_cancel, stop_sequence=self.stops.matched)


@dataclasses.dataclass(eq=False)
class Running:
  """A job admitted by the worker: its session, its prefill (a generator of chunks, None once
  read), its generation (once its context is read) and its reply."""
  job: Job
  session: Session
  reply: Reply
  prefill: Iterator | None
  generation: Generation | None = None
  started: float = 0.0
  read: int = 0  # prompt tokens read so far (counted as its prefill chunks are dispatched)


class Worker(Feed):
  """The one thread that runs the engine: the decode loop, fed with jobs in arrival order."""

  def __init__(self, engine: Engine, config: ServerConfig):
    self.engine = engine
    model = engine.model
    self.tokenizer = load_tokenizer(model.path, model.config.vocab_size)
    self.eos = set(model.config.eos_token_ids)
    store = None
    if config.session_dir is not None:
      store = SessionStore(config.session_dir, engine, config.session_disk_bytes,
                           anchor_budget_bytes=config.anchor_budget_bytes)
      _LOG.warning("ftjax.serve: %d saved sessions in %s (%.1f MiB; %d skipped)", len(store),
                   store.root, store.nbytes / MB, len(store.skipped))
    self.pool = SessionPool(engine, budget_bytes=config.session_budget_bytes,
                            max_sessions=config.max_sessions, reuse=config.session_reuse,
                            anchor_budget_bytes=config.anchor_budget_bytes, store=store)
    self.max_queue = config.max_queue
    self.max_running = config.max_running
    self._jobs: queue.Queue[Job | None] = queue.Queue()
    self._lock = threading.Lock()
    self.waiting = 0
    self.running = 0  # jobs admitted (reading their context or decoding)
    self.draining = False  # a graceful shutdown began: no job is admitted (``drain``)
    self._submitted: list[weakref.ref] = []  # the jobs submitted, for ``cancel_all``
    self.drain_deadline = 0.0
    self.mean_job_s = 1.0  # running mean of a job's seconds, for Retry-After
    self.last_outcome: Outcome | None = None
    self._admitted: collections.deque[Running] = collections.deque()  # prefilling, in order
    self._ready: collections.deque[Running] = collections.deque()  # context read, to join
    self._active: list[Running] = []
    self._blocked: Job | None = None  # first in line, waiting for memory
    self._controls: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
        queue.Queue())
    self.batch: Batch | None = None
    self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=16)
    self._stopping = False
    # Start-up compilation: programs to compile, compiled so far, seconds, done, error.
    self.startup: dict[str, Any] = {"precompile": config.precompile, "programs": 0,
                                    "compiled": 0, "seconds": 0.0,
                                    "done": not config.precompile, "error": None,
                                    "background": 0}
    self._idle = threading.Event()  # set while the engine thread waits for a job
    self._closed = threading.Event()  # stop() was called
    self._woken = 0  # times the engine thread took a job after waiting
    self.heap_trims = 0  # times the engine, idle after work, gave the C heap's free pages back
    self._trimmed_at = 0  # ``_woken`` at the last trim (no work since: no trim)
    self._thread = threading.Thread(target=self._run, name="ftjax-engine", daemon=True)
    self._thread.start()

  def drain(self, grace_s: float) -> None:
    """Stops admitting jobs: ``submit`` answers 503 with ``Retry-After`` from now on, while
    the jobs admitted or waiting run on (``idle`` says when they are done). A graceful
    shutdown (``ftjax.serve`` on SIGTERM) drains, waits up to ``grace_s``, then stops."""
    with self._lock:
      self.draining = True
      self.drain_deadline = time.monotonic() + grace_s

  def idle(self) -> bool:
    """No job waits or runs."""
    with self._lock:
      return self.waiting == 0 and self.running == 0

  def cancel_all(self) -> int:
    """Cancels every job that waits or runs (a shutdown whose grace ended, or a second
    signal): a waiting one is dropped, a running one ends at its next decode chunk, and each
    reply ends as if its client had gone. Returns how many were cancelled."""
    with self._lock:
      refs, self._submitted = self._submitted, []
    jobs = [job for job in (ref() for ref in refs)
            if job is not None and not job.cancelled.is_set()]
    for job in jobs:
      job.cancelled.set()
    self._jobs.put(_WAKE)
    return len(jobs)

  def submit(self, job: Job) -> None:
    with self._lock:
      if self.draining:
        retry = max(1, math.ceil(self.drain_deadline - time.monotonic()) + 1)
        raise ApiError(503, "the server is shutting down: it admits no new request and "
                       "finishes the running ones; retry against its next start",
                       code="shutting_down", headers={"Retry-After": str(retry)})
      if self.waiting >= self.max_queue:
        slots = max(self.max_running, 1)
        retry = max(1, math.ceil(self.mean_job_s * (self.waiting // slots + 1)))
        raise ApiError(429, f"the server is busy: {self.waiting} requests are waiting (the "
                       f"limit is {self.max_queue}); retry in about {retry} s",
                       code="queue_full", headers={"Retry-After": str(retry)})
      self.waiting += 1
      self._submitted = [r for r in self._submitted if r() is not None] + [weakref.ref(job)]
    self._jobs.put(job)

  def stop(self) -> None:
    """Stops the engine thread (after the jobs it runs), then saves the sessions held to the
    session store, if there is one."""
    if self._closed.is_set():
      return
    self._closed.set()
    self._idle.set()  # the background loader sees the stop
    self._jobs.put(None)
    self._thread.join(timeout=60)
    if self.pool.store is not None and not self._thread.is_alive():
      t0 = time.perf_counter()
      saved = self.pool.save_all()
      _LOG.warning("ftjax.serve: saved %d sessions to %s in %.2f s", saved,
                   self.pool.store.root, time.perf_counter() - t0)

  def control(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
    """Runs ``fn`` on the engine thread at the next safe point (between decode chunks, or at
    once when idle); the future has its result or exception."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    self._controls.put((fn, future))
    self._jobs.put(_WAKE)
    return future

  def _run_controls(self) -> None:
    while True:
      try:
        fn, future = self._controls.get_nowait()
      except queue.Empty:
        return
      try:
        future.set_result(fn())
      except Exception as e:  # noqa: BLE001 - the caller gets it
        future.set_exception(e)

  def _precompile(self) -> None:
    """Prepares the programs a request can run before taking the first job, with progress in
    ``startup`` and the log. Where the executable store holds every one of them (a warm
    start), only those of a short request (``Executor.first_needed``) are loaded before the
    server is ready; the others are loaded, untraced, by a background thread while the engine
    is idle (a request that needs one first loads it itself: a load, never a compile). A cold
    start compiles them all first."""
    anchor_slots = self.pool.new_session().anchor_slots
    executor = self.engine.executor
    t0 = time.perf_counter()
    # The server decodes every request in its batch of max_running rows.
    needed = [key for key in self.engine.programs_needed(anchor_slots, self.max_running,
                                                         decode_alone=False)
              if key not in executor.table]
    try:
      warm = bool(needed) and all(executor.stored(key) for key in needed)
    except Exception:  # noqa: BLE001 - prepared below the usual way, which reports it
      warm = False
    first = executor.first_needed(needed) if warm else needed
    later = [key for key in needed if key not in set(first)]

    def progress(done: int, total: int, key: tuple) -> None:
      self.startup.update(programs=total, compiled=done, seconds=time.perf_counter() - t0)
      if done == 0:
        _LOG.warning("ftjax.serve: preparing the %d programs %s before serving (each loaded "
                     "whole from the executable store where it holds it, else compiled; a "
                     "later start loads them)", total,
                     f"a short request runs ({len(later)} more load in the background)"
                     if later else "a request can run")
      _LOG.warning("ftjax.serve: preparing %d/%d: the %s program for %s", done + 1, total,
                   key[0], key[1:])

    try:
      keys = self.engine.precompile(anchor_slots, progress, batch=self.max_running,
                                    keys=first, workers=PREPARE_WORKERS)
    except Exception as e:  # noqa: BLE001 - the server still serves, compiling as it goes
      self.startup.update(error=f"{type(e).__name__}: {e}")
      _LOG.error("ftjax.serve: start-up compilation failed (%s): requests compile as they "
                 "come", self.startup["error"])
      later = []
    else:
      self.startup.update(programs=len(keys), compiled=len(keys), background=len(later))
      _LOG.warning("ftjax.serve: prepared %d programs in %.1f s (%d loaded untraced from the "
                   "executable store, the others compiled); ready (%d held in all%s)",
                   len(keys), time.perf_counter() - t0, self.engine.loaded_count,
                   len(executor.table),
                   f"; {len(later)} more load in the background while idle" if later else "")
    self.startup.update(seconds=time.perf_counter() - t0, done=True)
    if later:
      threading.Thread(target=self._load_later, args=(later,), name="ftjax-prepare-later",
                       daemon=True).start()

  def _load_later(self, keys: list[tuple]) -> None:
    """Loads ``keys`` from the executable store one by one, each only once the engine thread
    has been idle for ``LATER_GRACE_S`` (so that a running request keeps the cores)."""
    executor = self.engine.executor
    t0 = time.perf_counter()
    try:
      for key in keys:
        while True:  # idle for a while: a client's first request often follows /health
          self._idle.wait()
          seen = self._woken
          if self._closed.wait(LATER_GRACE_S) or (self._idle.is_set() and seen == self._woken):
            break
        if self._closed.is_set() or executor.table is None:
          return
        executor.program(key)
        self.startup["background"] -= 1
    except Exception as e:  # noqa: BLE001 - a request that needs it prepares it itself
      _LOG.error("ftjax.serve: loading a program in the background failed (%s: %s); a "
                 "request that needs it prepares it", type(e).__name__, e)
      return
    _LOG.warning("ftjax.serve: the %d other programs loaded in the background in %.1f s "
                 "(%d held in all)", len(keys), time.perf_counter() - t0, len(executor.table))

  # -- The engine thread ------------------------------------------------------------------------

  def _next_job(self):
    """The next job, waited for; after work, once idle for ``TRIM_IDLE_S``, the C heap's
    free pages go back to the system first."""
    if self._woken > self._trimmed_at:
      try:
        return self._jobs.get(timeout=TRIM_IDLE_S)
      except queue.Empty:
        return_free_heap()
        self.heap_trims += 1
        self._trimmed_at = self._woken
    return self._jobs.get()

  def _run(self) -> None:
    if not self.startup["done"]:
      self._precompile()
    executor = self.engine.executor
    batch = self.batch = executor.batch(self.max_running)
    while not self._stopping:
      job = self._blocked
      if job is None:
        self._idle.set()
        job = self._next_job()
        self._idle.clear()
        self._woken += 1
      self._run_controls()
      if job is _WAKE:
        continue
      if job is None:
        return
      self._admit(job)
      try:
        executor.run(batch, feed=self)
      except Exception as e:  # noqa: BLE001 - every job in the loop gets it as a 500
        _LOG.exception("ftjax.serve: the decode loop failed")
        for running in [*self._admitted, *self._ready, *self._active]:
          self._end(running, error=e, lost=True)
        self._admitted.clear()
        self._ready.clear()
        batch = self.batch = executor.batch(self.max_running)
      self.engine.clear_history()

  def _memory_need(self, job: Job) -> int:
    """Bytes of decode state ``job`` adds: its own state (KV rows for the prompt and its
    tokens) and the rows the batch grows by to take it."""
    e = self.engine
    capacity = e.kv_capacity(min(len(job.ids) + job.max_tokens + 1, e.kv_capacities[-1]))
    need = e.state_bytes(1, capacity)
    batch = self.batch
    if self.max_running > 1 and batch is not None:
      if batch.state is None:
        need += e.state_bytes(batch.size, capacity)
      elif capacity > batch.capacity:
        need += e.state_bytes(batch.size, capacity) - e.state_bytes(batch.size, batch.capacity)
    return need

  def _fits(self, job: Job) -> bool | None:
    """Whether ``job``'s memory fits the budget now (dropping idle sessions to make room);
    None when it cannot fit even with nothing else held."""
    memory = self.engine.memory
    if memory.total is None:
      return True
    need = self._memory_need(job)
    # Sessions admitted whose state is not allocated yet will take theirs.
    reserved = sum(self._memory_need(r.job) for r in self._admitted
                   if not memory.held_by(r.session))
    while not memory.fits(need + reserved):
      if not self.pool.evict_idle():
        break
    if memory.fits(need + reserved):
      return True
    if self.running == 0 and need > memory.total:
      return None
    return False

  def _admit(self, job: Job) -> bool:
    """Takes ``job`` from the queue: a cancelled one is dropped, one whose memory does not
    fit yet waits (False: it is held first in line), the others get a session and start
    reading their context."""
    if job.cancelled.is_set():
      self._unqueue(job)
      job.send("cancelled")
      return True
    try:
      fits = self._fits(job)
    except Exception as e:  # noqa: BLE001 - a context too long for the engine: a 400 later
      fits = True
      _LOG.debug("ftjax.serve: no memory estimate for a job (%s)", e)
    if fits is False and self.running:
      self._blocked = job
      return False
    if not fits:
      self._unqueue(job)
      memory = self.engine.memory
      need = self._memory_need(job)
      job.send("error", ApiError(
          400, f"this request needs {need / MB:.1f} MiB of decode state (the KV cache and "
          f"recurrent state for {len(job.ids)} prompt tokens and max_tokens={job.max_tokens}"
          f"{', and the batch rows beside it' if self.max_running > 1 else ''}); the device "
          f"budget is {memory.total / MB:.1f} MiB, {memory.state_bytes / MB:.1f} MiB of it held "
          "by other decode states. Lower max_tokens, shorten the prompt, or "
          "raise the budget (POST /v1/cache with {\"budget_bytes\": N}, or "
          "--device_budget_bytes)", code="insufficient_memory"))
      return True
    self._unqueue(job, running=True)
    try:
      session = self.pool.take(job.ids, reuse=not job.scores_prompt)
    except Exception as e:  # noqa: BLE001 - reported to the client as a 500
      with self._lock:
        self.running -= 1
      job.send("error", e)
      return True
    running = Running(job=job, session=session, reply=Reply(job, self.tokenizer, self.eos),
                      prefill=session.context_steps(job.ids, logprobs=job.scores_prompt),
                      started=time.perf_counter())
    self._admitted.append(running)
    return True

  def _unqueue(self, job: Job, *, running: bool = False) -> None:
    """``job`` leaves the queue (admitted, dropped or refused); ``running``: admitted, counted
    as running in the same step (``idle`` never sees it in neither count)."""
    if self._blocked is job:
      self._blocked = None
    with self._lock:
      self.waiting -= 1
      self.running += int(running)

  def _end(self, running: Running, *, error: Exception | None = None,
           lost: bool = False) -> None:
    """A job is over: its outcome (or error) goes to its request, its session back to the
    pool (or out of it, when its state was ``lost`` with a failed loop)."""
    if running in self._active:
      self._active.remove(running)
    if error is None:
      self.last_outcome = running.reply.outcome()
      running.job.send("done", self.last_outcome)
      if running.generation is not None:
        self.recent.append({"prompt_tokens": len(running.job.ids),
                            "completion_tokens": self.last_outcome.completion_tokens,
                            "ttft_s": self.last_outcome.ttft_s,
                            "decode_tok_s": self.last_outcome.decode_tok_s,
                            **running.generation.stats})
    else:
      running.job.send("error", error)
    if lost:
      self.pool.discard(running.session)
    else:
      self.pool.done(running.session)
    self.mean_job_s = 0.8 * self.mean_job_s + 0.2 * (time.perf_counter() - running.started)
    # The job's objects refer to each other in cycles (its reply and generation through
    # ``on_token``, the generation's callbacks and ``on_done`` back to ``running``): unlinked
    # here, they go by reference counting, with the first token's logits, at once. Left to
    # Python's full collections, which count objects and not the memory they hold, a load
    # run kept 23 sessions' decode states (276 MiB) alive after the pool had dropped them.
    running.generation = running.reply.generation = running.prefill = None
    with self._lock:
      self.running -= 1

  # -- The decode loop's feed -------------------------------------------------------------------

  def ready(self, free: int) -> list[Generation]:
    out = []
    while self._ready and len(out) < free:
      running = self._ready.popleft()
      self._active.append(running)
      out.append(running.generation)
    return out

  def pending(self) -> bool:
    return bool(self._ready)

  def work(self) -> bool:
    """Admits waiting jobs while fewer than ``max_running`` are in, then reads the contexts
    of the oldest jobs still reading theirs, a prefill chunk at a time, up to one prefill
    chunk's worth of tokens (``prefill_chunk``) in all: several short prompts are read
    between two decode chunks, a long one a chunk at a time, so the streams already running
    never wait for more than about one chunk."""
    self._run_controls()
    while self.running < self.max_running and not self._stopping:
      if self._blocked is not None:
        job = self._blocked
      else:
        try:
          job = self._jobs.get_nowait()
        except queue.Empty:
          break
      if job is _WAKE:
        continue
      if job is None:  # stop: finish what runs, then the thread ends
        self._stopping = True
        break
      if not self._admit(job):
        break  # first in line waits for memory; the jobs behind it wait too (FCFS)
    budget, spent, worked = self.engine.options.prefill_chunk, 0, False
    while self._admitted:
      running = self._admitted[0]
      left = max(0, len(running.job.ids) - running.read)
      if worked and spent + min(left, budget) > budget:
        break
      spent += self._prefill_step(running)
      worked = True
    return worked

  def _prefill_step(self, running: Running) -> int:
    """One prefill chunk of ``running`` (the oldest job reading its context), and its
    generation set up when that was the last; returns the prompt tokens it accounts for."""
    before = running.read
    if running.job.cancelled.is_set():
      self._admitted.popleft()
      self._end(running)
      return 0
    try:
      running.read = next(running.prefill)
      return max(0, running.read - before)
    except StopIteration as end:
      context = end.value
    except Exception as e:  # noqa: BLE001 - reported to the client as a 500
      self._admitted.popleft()
      self._end(running, error=e)
      return len(running.job.ids) - before
    self._admitted.popleft()
    running.prefill = None
    running.reply.cached_tokens = context.reused_tokens
    reply = running.reply
    try:
      reply.start(context)
      running.generation = reply.generation = running.session.generation(
          running.job.max_tokens, stop_tokens=self.eos, on_token=reply.on_token,
          cancel=reply.cancel, on_done=lambda _, r=running: self._end(r),
          logprobs=running.job.logprobs is not None, **running.job.sampling)
    except Exception as e:  # noqa: BLE001
      self._end(running, error=e)
      return len(running.job.ids) - before
    if running.generation is None:
      self._end(running)
    else:
      self._ready.append(running)
    return max(0, context.prefilled_tokens - before)
