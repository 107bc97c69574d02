"""Sessions kept on disk across restarts (``--session_dir``): the session pool's tier below
memory.

Each session is one checkpoint directory under the root (``Session.save``: orbax, each step
written under a temporary name and renamed when complete, every array's CRC-32 in its meta),
holding its KV rows, recurrent states and anchors. The pool saves a session here when it drops
it from memory (least recently used, or over its budget) and, at shutdown, every session it
holds. At start-up the store reads each directory's meta only (its tokens, anchors and model),
and a request whose prompt shares a longer reusable prefix with a saved session than with any
session in memory gets that session loaded instead of a prefill.

A directory that is partial (a save cut off leaves no complete step), unreadable, corrupt (an
array fails its CRC-32 when loaded), from another model (its fingerprint) or from another
ftjax version is skipped with a warning in the log, never loaded and never a crash; it is left
where it is. Saved sessions are kept within ``budget_bytes`` on disk, the least recently saved
deleted first.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
import uuid
import weakref
from typing import Sequence

import numpy as np

from ftjax.runtime import checkpoint
from ftjax.runtime.engine import Engine
from ftjax.runtime.session import Session

_LOG = logging.getLogger("uvicorn.error")  # the server's log


@dataclasses.dataclass
class Saved:
  """A session on disk, as its meta says."""
  name: str  # its directory under the root
  tokens: np.ndarray  # int32: the context it holds
  anchors: list[int]  # positions a recurrent model's state can be put back to
  nbytes: int
  saved_at: float


def _bytes(path: str) -> int:
  total = 0
  for d, _, names in os.walk(path):
    for n in names:
      try:
        total += os.path.getsize(os.path.join(d, n))
      except OSError:
        pass
  return total


def _common(a: np.ndarray, b: np.ndarray) -> int:
  """The length of the common prefix of two int32 arrays."""
  n = min(len(a), len(b))
  differ = np.flatnonzero(a[:n] != b[:n])
  return int(differ[0]) if len(differ) else n


class SessionStore:
  """Sessions on disk under ``root`` for ``engine``'s model, within ``budget_bytes``."""

  def __init__(self, root: str, engine: Engine, budget_bytes: int, *,
               anchor_budget_bytes: int | None = None):
    if budget_bytes < 0:
      raise ValueError(f"session_disk_bytes must be >= 0, got {budget_bytes}")
    self.root = os.path.abspath(root)
    os.makedirs(self.root, exist_ok=True)
    self.engine, self.budget_bytes = engine, int(budget_bytes)
    self.options = ({} if anchor_budget_bytes is None
                    else {"anchor_budget_bytes": anchor_budget_bytes})
    self.fingerprint = checkpoint.model_fingerprint(engine.model)
    self.recurrent = "linear_attention" in engine.model.config.layer_types
    self.saved: dict[str, Saved] = {}
    self._names: weakref.WeakKeyDictionary[Session, str] = weakref.WeakKeyDictionary()
    self.skipped: list[tuple[str, str]] = []  # (directory, why), at start-up or on load
    self.loads = self.saves = 0
    self._scan()

  def _skip(self, name: str, why: str) -> None:
    self.skipped.append((name, why))
    _LOG.warning("ftjax.serve: the saved session %s is skipped: %s",
                 os.path.join(self.root, name), why)

  def _scan(self) -> None:
    for name in sorted(os.listdir(self.root)):
      path = os.path.join(self.root, name)
      if not os.path.isdir(path):
        continue
      try:
        meta, _ = checkpoint.read_meta(path)
      except Exception as e:  # noqa: BLE001 - any damage: skipped, never a crash
        self._skip(name, str(e))
        continue
      if meta.get("model_fingerprint") != self.fingerprint:
        self._skip(name, f"it was saved from another model ({meta.get('model_type')}, "
                   f"fingerprint {meta.get('model_fingerprint')}; this server runs "
                   f"{self.fingerprint})")
        continue
      if meta.get("ftjax_version") != checkpoint.writer_version():
        self._skip(name, f"it was saved by ftjax {meta.get('ftjax_version')}, this is "
                   f"{checkpoint.writer_version()}")
        continue
      try:
        tokens = np.asarray([int(t) for t in meta["tokens"]], np.int32)
        anchors = sorted(int(a["position"]) for a in meta.get("anchors", []))
      except (KeyError, TypeError, ValueError) as e:
        self._skip(name, f"its meta is malformed ({e})")
        continue
      self.saved[name] = Saved(name, tokens, anchors, _bytes(path), os.path.getmtime(path))

  def __len__(self) -> int:
    return len(self.saved)

  @property
  def nbytes(self) -> int:
    return sum(s.nbytes for s in self.saved.values())

  def reusable(self, saved: Saved, token_ids: Sequence[int]) -> int:
    """The tokens a saved session would keep of ``token_ids`` (``Session.reusable_tokens``)."""
    ids = np.asarray(token_ids, np.int32)
    limit = min(_common(saved.tokens, ids), len(ids) - 1)
    if not self.recurrent or len(saved.tokens) <= limit:
      return max(0, min(limit, len(saved.tokens)))
    return max([a for a in saved.anchors if a <= limit], default=0)

  def best(self, token_ids: Sequence[int]) -> tuple[str | None, int]:
    """The saved session that keeps the most of ``token_ids``, and how many it keeps."""
    best, most = None, 0
    ids = np.asarray(token_ids, np.int32)
    for name, saved in self.saved.items():
      n = self.reusable(saved, ids)
      if n > most:
        best, most = name, n
    return best, most

  def load(self, name: str) -> Session | None:
    """The saved session ``name`` in memory (None, with a warning, when it cannot be: it is
    then forgotten). It leaves the index while in memory; ``save`` puts it back."""
    saved = self.saved.pop(name)
    try:
      session = Session.restore(self.engine, os.path.join(self.root, name), **self.options)
    except Exception as e:  # noqa: BLE001 - corrupt or unreadable: never a crash
      self._skip(name, str(e))
      return None
    del saved
    self._names[session] = name
    self.loads += 1
    return session

  def save(self, session: Session) -> bool:
    """Writes ``session`` (idle, with a context) to disk, under its directory if it came from
    one; False (with a warning) when it cannot be. Then trims the store to its budget."""
    if not session.tokens or session.generating:
      return False
    name = self._names.get(session) or uuid.uuid4().hex
    path = os.path.join(self.root, name)
    try:
      session.save(path)
      session.wait_for_saves()
    except Exception as e:  # noqa: BLE001 - a full disk, say: the session is only dropped
      _LOG.warning("ftjax.serve: saving a session to %s failed: %s", path, e)
      return False
    self._names[session] = name
    self.saved[name] = Saved(name, np.asarray(session.read_tokens, np.int32),
                             session.anchor_positions,
                             _bytes(path), time.time())
    self.saves += 1
    self.trim()
    return True

  def trim(self) -> None:
    """Deletes the least recently saved sessions until the store is within its budget (the
    session just saved goes last: only when it is larger than the budget alone)."""
    while self.nbytes > self.budget_bytes and self.saved:
      oldest = min(self.saved.values(), key=lambda s: s.saved_at)
      if len(self.saved) == 1:
        _LOG.warning("ftjax.serve: a saved session of %.1f MiB is larger than "
                     "--session_disk_bytes (%.1f MiB): deleted", oldest.nbytes / 2**20,
                     self.budget_bytes / 2**20)
      self.saved.pop(oldest.name)
      shutil.rmtree(os.path.join(self.root, oldest.name), ignore_errors=True)

  def stats(self) -> dict:
    return {"dir": self.root, "saved": len(self.saved), "bytes": self.nbytes,
            "budget_bytes": self.budget_bytes, "loads": self.loads, "saves": self.saves,
            "skipped": len(self.skipped)}
