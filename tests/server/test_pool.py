"""The session pool: requests matched by reusable prefix, forks for partial matches, LRU
eviction under the session count and the memory budget; and ``Session.fork`` itself."""

from __future__ import annotations

import numpy as np
import pytest

import ftjax
from ftjax.server import SessionPool


@pytest.fixture(scope="module")
def engine():
  # The exact float32 path (a float32 KV cache too: forks and fresh sessions prefill in
  # different splits, and a bfloat16 cache can round a key differently between them).
  return ftjax.Engine(ftjax.load("default-hybrid"), kernels="ffi", kv_dtype="float32")


def ids(seed, n, prefix=()):
  rng = np.random.default_rng(seed)
  return list(prefix) + rng.integers(5, 4000, n).tolist()


def serve(pool, request):
  session = pool.take(request)
  result = session.set_context(request)
  session.generate(2)
  pool.done(session)
  return session, result


def test_fork_is_independent_and_exact(engine):
  boundary = ftjax.Session(engine).turn_id  # an anchor is taken at each turn start
  base = ids(0, 40) + [boundary] + ids(1, 30)
  a = ftjax.Session(engine)
  a.set_context(base)
  b = a.fork()
  assert b.tokens == a.tokens and b.stats()["anchors"] == a.stats()["anchors"]
  longer = base + ids(2, 20)
  edited = base[:41] + ids(3, 25)  # changes the tokens after the boundary: an anchor restore
  ra, rb = a.set_context(longer), b.set_context(edited)
  assert ra.reused_tokens == len(base) and rb.anchor_position == 40  # before the boundary
  for session, context in ((a, longer), (b, edited)):
    fresh = ftjax.Session(engine).set_context(context).last_logits
    np.testing.assert_allclose(session.set_context(context).last_logits, fresh, atol=1e-5)
  assert a.tokens == longer and b.tokens == edited


def test_matching_forking_and_eviction(engine):
  pool = SessionPool(engine, max_sessions=2)
  system = ids(10, 30) + [ftjax.Session(engine).turn_id]  # an anchor before the next turn
  a1 = ids(11, 20, system)
  sa, _ = serve(pool, a1)
  # A's next turn extends its context: the same session, in place.
  a2 = sa.tokens + ids(12, 10)
  sa2, r = serve(pool, a2)
  assert sa2 is sa and r.reused_tokens > len(a1) // 2
  # B shares only the system prompt: a fork of A, and A keeps its state.
  b1 = ids(13, 60, system)
  sb, r = serve(pool, b1)
  assert sb is not sa and pool.forked == 1 and r.reused_tokens <= len(system)
  assert pool.take(sa.tokens + [7]) is sa
  pool.done(sa)
  # C shares nothing: a new session; with two at most, the least recently used (B) goes.
  sc, r = serve(pool, ids(14, 25))
  assert r.reused_tokens == 0 and pool.stats()["sessions"] == 2 and pool.evicted == 1
  assert all(s is not sb for s in pool._sessions.values())


def test_memory_budget_and_no_reuse(engine):
  pool = SessionPool(engine, budget_bytes=1)  # nothing fits: only the session in use stays
  serve(pool, ids(20, 30))
  serve(pool, ids(21, 30))
  assert pool.stats()["sessions"] == 1 and pool.evicted == 1
  off = SessionPool(engine, reuse=False)
  s1, _ = serve(off, ids(22, 30))
  s2, r = serve(off, s1.tokens)
  assert s2 is not s1 and r.reused_tokens == 0 and off.stats()["sessions"] == 0
