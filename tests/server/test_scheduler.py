"""The server's worker (``ftjax.server.scheduler.Worker``) on a real engine, without HTTP:
how requests that arrive together are admitted into the decode batch."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading
import time

import jax

import ftjax
from ftjax.runtime.tokenizer import load_tokenizer
from ftjax.server import ServerConfig
from ftjax.server.scheduler import TRIM_IDLE_S, Job, Worker

PROMPTS = ("def parse_args(argv):", "import numpy as np\n\n", "class Tree:\n  def __init__(",
           "for i in range(10):")


def _job(ids, loop) -> Job:
  return Job(ids=ids, max_tokens=12, sampling={"greedy": True, "seed": 0}, stops=[],
             stream=True, chat=False, reasoning=False, tool_calls=False, loop=loop,
             received=time.perf_counter())


def test_short_prompts_that_arrive_together_decode_together():
  """Four short prompts queued at once are all read before the first decode chunk (one
  prefill chunk's worth of tokens between two decode chunks), so the first decode step runs
  all four rows; an earlier worker read one prompt per decode chunk, and the fourth request
  waited three chunks for its first token."""
  engine = ftjax.Engine(ftjax.load("default"))
  tokenizer = load_tokenizer(engine.model.path, engine.model.config.vocab_size)
  worker = Worker(engine, ServerConfig(max_running=4))
  loop = asyncio.new_event_loop()
  thread = threading.Thread(target=loop.run_forever, daemon=True)
  thread.start()
  try:
    gate = threading.Event()
    held = worker.control(gate.wait)  # the engine thread waits here while the jobs queue up
    jobs = [_job(tokenizer.encode(p), loop) for p in PROMPTS]
    assert sum(len(j.ids) for j in jobs) <= engine.options.prefill_chunk
    for job in jobs:
      worker.submit(job)
    gate.set()
    held.result(timeout=60)

    def outcome(job):
      while True:
        kind, payload = asyncio.run_coroutine_threadsafe(job.events.get(), loop).result(120)
        if kind == "done":
          return payload
        assert kind == "deltas", (kind, payload)

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
      outcomes = list(pool.map(outcome, jobs))
  finally:
    worker.stop()
    loop.call_soon_threadsafe(loop.stop)
  assert [o.completion_tokens for o in outcomes] == [12] * 4  # none stopped early
  # Each job's decode steps all ran the four rows: they joined and left together.
  stats = list(worker.recent)
  assert len(stats) == 4 and all(s["steps"] == 11 for s in stats), stats
  assert all(s["batch_rows"] == 4 * s["steps"] for s in stats), stats


def test_a_dropped_sessions_decode_state_goes_without_a_collection():
  """A finished job's objects refer to each other (its reply and its generation, the
  generation's callbacks and the job): the worker unlinks them, so the decode state of a
  session the pool drops goes by reference counting. With Python's collector off, no KV
  buffer outlives the sessions the pool holds. (It did: a load run kept 23 dropped
  sessions' states, 276 MiB, until a full collection, which counts objects, not bytes.)
  Then, idle, the engine trims the C heap once."""
  engine = ftjax.Engine(ftjax.load("default"))
  tokenizer = load_tokenizer(engine.model.path, engine.model.config.vocab_size)
  worker = Worker(engine, ServerConfig(max_running=2, max_sessions=1))
  loop = asyncio.new_event_loop()
  thread = threading.Thread(target=loop.run_forever, daemon=True)
  thread.start()
  kv = lambda: {id(a): a for a in jax.live_arrays() if a.ndim == 4}  # noqa: E731
  weights = set(kv())
  gc.collect()
  gc.disable()
  try:
    jobs = [_job(tokenizer.encode(p), loop) for p in PROMPTS]
    for job in jobs:
      worker.submit(job)
    for job in jobs:
      while (kind := asyncio.run_coroutine_threadsafe(job.events.get(), loop).result(120)[0]
             ) != "done":
        assert kind == "deltas", kind
    worker.control(lambda: None).result(timeout=60)  # the engine thread is past the last job
    held = {id(a) for s in worker.pool._sessions.values() for a in jax.tree.leaves(s._state)
            if a.ndim == 4}
    alive = set(kv()) - weights
    # Idle after work, the engine gives the C heap's free pages back, and not again while it
    # stays idle (one trim after the jobs, one after the control, as the timing falls).
    deadline = time.monotonic() + 30
    while worker.heap_trims == 0 and time.monotonic() < deadline:
      time.sleep(0.1)
    time.sleep(2 * TRIM_IDLE_S)
    trims = worker.heap_trims
    time.sleep(2 * TRIM_IDLE_S)
    trims_later = worker.heap_trims
  finally:
    gc.enable()
    worker.stop()
    loop.call_soon_threadsafe(loop.stop)
  assert len(worker.pool) == 1 and held
  assert alive == held, (len(alive), len(held))
  assert 1 <= trims <= 2 and trims_later == trims, (trims, trims_later)
