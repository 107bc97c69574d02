"""The server's sessions: one ``ftjax.Session`` per conversation, matched to each request by
the longest reusable token prefix, under a memory budget with LRU eviction.

A request's prompt is matched against every held session (``Session.reusable_tokens``: the
common prefix for attention layers, the nearest anchor for recurrent ones). The best match is
used in place when it keeps at least ``min_share`` of that session's context (an agent's next
turn, or its edit of an earlier one). A shorter match is forked (``Session.fork``: the state
is copied), so that a conversation that shares only a system prompt with another, or a
regenerated reply, does not wipe out the other's state; no match at all gets a new session.
After each request the least recently used sessions are dropped until the pool holds at most
``max_sessions`` and ``budget_bytes`` (the session just used is always kept).

With a ``SessionStore`` (``--session_dir``), a session the pool drops is saved to disk first,
``save_all`` saves those it holds (at shutdown), and a prompt that a saved session serves
better than any in memory gets it loaded (``ftjax.server.store``).

A session is busy from ``take`` to ``done``: the requests that run at once (in one decode
batch) never share one, and a busy session is neither matched, forked nor evicted. The pool
is used from the server's one engine thread only and needs no locks.
"""

from __future__ import annotations

import collections
import itertools
from typing import Any, Sequence

from ftjax.runtime.engine import Engine
from ftjax.runtime.session import DEFAULT_ANCHOR_BUDGET_BYTES, Session
from ftjax.server.store import SessionStore


class SessionPool:

  def __init__(self, engine: Engine, *, budget_bytes: int = 4 << 30, max_sessions: int = 8,
               reuse: bool = True, min_share: float = 0.5,
               anchor_budget_bytes: int = DEFAULT_ANCHOR_BUDGET_BYTES,
               store: SessionStore | None = None):
    if max_sessions < 1:
      raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
    if budget_bytes < 0:
      raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
    self.engine = engine
    self.budget_bytes, self.max_sessions = int(budget_bytes), int(max_sessions)
    self.reuse, self.min_share = reuse, float(min_share)
    self.anchor_budget_bytes = int(anchor_budget_bytes)
    self.store = store
    self._sessions: collections.OrderedDict[int, Session] = collections.OrderedDict()  # LRU first
    self._serial = itertools.count()
    self._busy: set[int] = set()  # ids of the sessions taken and not done yet
    self.created = 0
    self.forked = 0
    self.evicted = 0

  def new_session(self) -> Session:
    """A session as the pool makes them (not held by the pool)."""
    return Session(self.engine, anchor_budget_bytes=self.anchor_budget_bytes)

  def _new(self) -> Session:
    self.created += 1
    return self.new_session()

  def take(self, token_ids: Sequence[int], *, reuse: bool = True) -> Session:
    """The session to serve ``token_ids`` with (the best match, or a new one); it becomes the
    most recently used. ``reuse=False``: a new one, held by the pool like the others (a
    request that reads its whole prompt again: its log-probs)."""
    if not self.reuse:
      return self._new()
    if not reuse:
      return self._hold(self._new())
    best_key, best = None, 0
    for key, session in self._sessions.items():  # later = more recent: wins ties
      if id(session) in self._busy:
        continue
      reusable = session.reusable_tokens(token_ids)
      if reusable >= best and reusable > 0:
        best_key, best = key, reusable
    if self.store is not None:
      name, saved = self.store.best(token_ids)
      if saved > best:  # a session on disk keeps more of the prompt than any in memory
        session = self.store.load(name)
        if session is not None:
          return self._hold(session)
    if best_key is not None and best >= self.min_share * len(self._sessions[best_key].tokens):
      self._sessions.move_to_end(best_key)
      self._busy.add(id(self._sessions[best_key]))
      return self._sessions[best_key]
    if best_key is not None:
      session = self._sessions[best_key].fork()
      self.forked += 1
    else:
      session = self._new()
    return self._hold(session)

  def _hold(self, session: Session) -> Session:
    """Adds ``session`` (busy) to the pool, evicting idle ones over ``max_sessions``."""
    idle = [k for k, s in self._sessions.items() if id(s) not in self._busy]
    while len(self._sessions) >= self.max_sessions and idle:
      self._drop(idle.pop(0))
    self._sessions[next(self._serial)] = session
    self._busy.add(id(session))
    return session

  def done(self, session: Session) -> None:
    """After a request on ``session``: evicts idle sessions over the limits (LRU first)."""
    self._busy.discard(id(session))
    keep = next((k for k, s in self._sessions.items() if s is session), None)
    while len(self._sessions) > 1 and (len(self._sessions) > self.max_sessions
                                       or self.memory_bytes() > self.budget_bytes):
      idle = [k for k, s in self._sessions.items() if k != keep and id(s) not in self._busy]
      if not idle:
        break
      self._drop(idle[0])

  def evict_idle(self) -> bool:
    """Drops the least recently used idle session (its decode state goes back to the
    device budget); False when every held session is busy."""
    for key, session in self._sessions.items():
      if id(session) not in self._busy:
        self._drop(key)
        return True
    return False

  def _drop(self, key: int) -> None:
    """Drops an idle session from memory (saved to disk first, with a store)."""
    session = self._sessions.pop(key)
    if self.store is not None:
      self.store.save(session)
    session.close()
    self.evicted += 1

  def save_all(self) -> int:
    """Saves every idle session held to the store (at shutdown); returns how many."""
    if self.store is None:
      return 0
    return sum(self.store.save(s) for s in self._sessions.values()
               if id(s) not in self._busy)

  def discard(self, session: Session) -> None:
    """Drops ``session`` (its state was lost: a failed decode loop)."""
    self._busy.discard(id(session))
    for key in [k for k, s in self._sessions.items() if s is session]:
      del self._sessions[key]
    session.close()

  def __len__(self) -> int:
    """Sessions held."""
    return len(self._sessions)

  def memory_bytes(self) -> int:
    return sum(s.memory_bytes() for s in self._sessions.values())

  def stats(self) -> dict[str, Any]:
    sessions = list(self._sessions.values())
    return {"sessions": len(sessions), "memory_bytes": self.memory_bytes(),
            "anchors": sum(s.stats()["anchors"] for s in sessions),
            "anchor_bytes": sum(s.stats()["anchor_bytes"] for s in sessions),
            "created": self.created, "forked": self.forked, "evicted": self.evicted,
            **({"disk": self.store.stats()} if self.store is not None else {})}
