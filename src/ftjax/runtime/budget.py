"""One device-memory budget for the decode states and the expert cache, elastic as the paper's.

With ``device_budget_bytes`` (``RuntimeOptions``; at run time ``Engine.set_budget``, the
server's ``POST /v1/cache``), the expert cache gets what the decode states leave:
``slots = floor((budget − state bytes) / slot bytes)`` (``slots_for_budget``; the paper's
example: 8 GB, 0.5 GB slots: 2 GB of KV gives 12 slots, 4 GB gives 8). The state bytes are
the sum over every holder of device state, each counted by its owner:

* a ``Session`` (or, for ``Engine.generate`` and a caller's ``Engine.new_state``, the engine
  itself) holds its one-row state, at the KV capacity allocated;
* a decode ``Batch`` of more than one row holds its state of ``size`` rows while a sequence is
  in it; a sequence that joins hands its own row over (its owner then holds nothing until the
  sequence leaves with a state of its own again).

An owner's count changes when its state is allocated, grown, handed over or dropped (the
executor tells the budget, ``hold``, before the new state is allocated); the budget tells its
listener (``listen``: the engine, which re-divides it and resizes the expert cache), so that
the cache gives up its slots first. That is between programs: the expert
cache is resized at a safe point (``Engine.resize_cache``), and a sequence's outputs do not
depend on the cache's size. When a state goes (a finished batch, a session dropped by the
server's pool), its bytes go back to the cache.

``fits(nbytes)`` is the admission question of a server: whether ``nbytes`` more state fits
the budget (with no budget, everything does: the caller sized the cache itself).
"""

from __future__ import annotations

import collections
import time
import weakref
from typing import Any, Callable


def slots_for_budget(budget_bytes: int, state_bytes: int, slot_bytes: int) -> int:
  """N = floor((budget - states) / slot): e.g. 8 GB budget, 0.5 GB slots: KV 3 GB -> 10 slots,
  KV 4 GB -> 8, KV 2 GB -> 12 (the paper's example)."""
  return max(0, (budget_bytes - state_bytes) // slot_bytes)


class MemoryBudget:
  """The bytes of device state each owner holds, and the budget they share with the expert
  cache (``total``: None when the cache was sized on its own). The owner None is the engine
  itself (``Engine.generate``'s states and a caller's ``Engine.new_state``)."""

  def __init__(self, total: int | None):
    self.total = total
    self._held: dict[int, int] = {}  # id(owner) -> bytes
    self._finalizers: dict[int, weakref.finalize] = {}
    self.resizes: collections.deque[dict[str, Any]] = collections.deque(maxlen=16)  # latest
    self._listener: weakref.WeakMethod | None = None

  def listen(self, method: Callable[[str], None]) -> None:
    """``method(reason)`` (a bound method, held weakly) is told each time the state held
    changes, before the new state is allocated."""
    self._listener = weakref.WeakMethod(method)

  def hold(self, owner: Any, nbytes: int) -> bool:
    """``owner`` now holds ``nbytes`` of device state (0: none); whether that changed, which the
    listener hears. The count goes when the owner is garbage-collected."""
    key = id(self if owner is None else owner)
    before = self._held.get(key, 0)
    if nbytes:
      self._held[key] = int(nbytes)
      if owner is not None and key not in self._finalizers:
        try:
          self._finalizers[key] = weakref.finalize(owner, self._forget, key)
        except TypeError:  # not weakly referable: released explicitly only
          pass
    else:
      self._held.pop(key, None)
      finalizer = self._finalizers.pop(key, None)
      if finalizer is not None:
        finalizer.detach()
    changed = before != int(nbytes)
    listener = None if self._listener is None else self._listener()
    if changed and listener is not None:
      listener(f"decode states now {self.state_bytes} bytes ({self.holders} holders)")
    return changed

  def _forget(self, key: int) -> None:
    self._held.pop(key, None)
    self._finalizers.pop(key, None)

  def held_by(self, owner: Any) -> int:
    return self._held.get(id(self if owner is None else owner), 0)

  @property
  def state_bytes(self) -> int:
    """Device state held, over all owners."""
    return sum(self._held.values())

  @property
  def holders(self) -> int:
    return len(self._held)

  def free_bytes(self) -> int | None:
    """What the budget leaves for more state (the expert cache's share; None: no budget)."""
    return None if self.total is None else self.total - self.state_bytes

  def fits(self, nbytes: int, freed: int = 0) -> bool:
    """Whether ``nbytes`` more state fits the budget (after ``freed`` bytes are given up)."""
    return self.total is None or self.state_bytes - freed + nbytes <= self.total

  @property
  def last_resize(self) -> dict[str, Any] | None:
    return self.resizes[-1] if self.resizes else None

  def resized(self, before: int, after: int, reason: str) -> None:
    self.resizes.append({"time": time.time(), "slots_before": int(before), "slots": int(after),
                         "state_bytes": self.state_bytes, "reason": reason})
