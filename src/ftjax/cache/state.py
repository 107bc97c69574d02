"""``ExpertCache``: N device slots shared by all layers, as an immutable pytree.

Fields (L layers, E experts per layer, N slots, P elements per expert block):

* ``slots [N, P]``: the cached expert blocks (same layout as the host bank's blocks);
* ``slot_of [L, E]``: the slot holding (l, e), or -1;
* ``owner [N]``: the flat id ``l·E + e`` a slot holds, or -1 when empty;
* ``slot_stamp [N]``: clock of the slot's last use (hit or fill), -1 when empty;
* ``expert_stamp [L, E]``: clock of the router's last selection of (l, e), -1 if never;
* ``expert_count [L, E]``: how often the router selected (l, e) (a routing profile, used to
  pick the pinned set of ``static_hot``);
* ``expert_score [L, E]``: float32, the decayed selection count of (l, e) as of its last
  selection (LRFU's combined recency-frequency value; read by the LRFU policies only);
* ``prefetched [N]``: bool, the slot was filled by a prefetch (``ftjax.cache.policy.prefetch``)
  and no step has used it yet; a use or an eviction clears it (counted as used or wasted);
* ``limit []``: slots ``[0, limit)`` are usable; the buffer may be larger (its size is
  bucketed so that a resize inside a bucket needs no recompile); slots past ``limit`` stay
  empty;
* ``clock []``: advanced once per layer-step.

Invariants (``check_invariants``): ``slot_of`` and ``owner`` are inverse maps, no slot has
two owners, stamps never decrease and never exceed the clock.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ftjax.utils.arrays import take


@struct.dataclass
class ExpertCache:
  slots: jax.Array
  slot_of: jax.Array
  owner: jax.Array
  slot_stamp: jax.Array
  expert_stamp: jax.Array
  expert_count: jax.Array
  expert_score: jax.Array
  prefetched: jax.Array
  limit: jax.Array
  clock: jax.Array

  @property
  def num_slots(self) -> int:
    """Usable slots (``limit``); a host-side read."""
    return int(self.limit)

  @property
  def num_layers(self) -> int:
    return self.slot_of.shape[0]

  @property
  def num_experts(self) -> int:
    return self.slot_of.shape[1]

  @property
  def capacity(self) -> int:
    """Size of the slot buffer (static); ``limit`` of them are usable."""
    return self.slots.shape[0]

  @classmethod
  def empty(cls, bank_shape: tuple[int, int, int], dtype, num_slots: int,
            capacity: int | None = None, *, slots: jax.Array | None = None) -> "ExpertCache":
    """An empty cache of ``num_slots`` usable slots (buffer ``capacity``) for a bank [L, E, P];
    ``slots``: the slot buffer to use (default: zeros), whose contents no slot owns yet."""
    layers, experts, block = bank_shape
    capacity = num_slots if capacity is None else capacity
    if not 0 <= num_slots <= capacity:
      raise ValueError(f"cache_slots must be in [0, capacity={capacity}], got {num_slots}")
    if slots is None:
      slots = jnp.zeros((capacity, block), dtype)
    elif slots.shape != (capacity, block):
      raise ValueError(f"a slot buffer of {(capacity, block)} was expected, got {slots.shape}")
    return cls(slots=slots,
               slot_of=jnp.full((layers, experts), -1, jnp.int32),
               owner=jnp.full((capacity,), -1, jnp.int32),
               slot_stamp=jnp.full((capacity,), -1, jnp.int32),
               expert_stamp=jnp.full((layers, experts), -1, jnp.int32),
               expert_count=jnp.zeros((layers, experts), jnp.int32),
               expert_score=jnp.zeros((layers, experts), jnp.float32),
               prefetched=jnp.zeros((capacity,), bool),
               limit=jnp.asarray(num_slots, jnp.int32),
               clock=jnp.zeros((), jnp.int32))

  @classmethod
  def preloaded(cls, bank: jax.Array, num_slots: int, flat_ids,
                capacity: int | None = None) -> "ExpertCache":
    """A cache whose first slots hold the experts ``flat_ids`` (``l·E + e``), e.g. the pinned
    set of the static policies. Extra ids beyond ``num_slots`` are an error. ``bank`` is a
    jax array or, for a pool in host memory, a numpy array (only the preloaded blocks are
    read)."""
    layers, experts, _ = bank.shape
    flat_ids = np.asarray(flat_ids, np.int64).reshape(-1)
    if len(flat_ids) > num_slots:
      raise ValueError(f"{len(flat_ids)} experts to preload but only {num_slots} slots")
    if len(set(flat_ids.tolist())) != len(flat_ids) or (
        len(flat_ids) and not (0 <= flat_ids.min() and flat_ids.max() < layers * experts)):
      raise ValueError("preloaded expert ids must be distinct and in [0, L·E)")
    n = len(flat_ids)
    if n == 0:
      return cls.empty(bank.shape, bank.dtype, num_slots, capacity)
    capacity = num_slots if capacity is None else capacity
    # Every array op has the buffer's shape, not the preloaded count's (a sweep over cache sizes
    # compiles no op per size), and the buffer is made once, by the gather: the slots past the
    # preloaded ones hold copies of the first block, which no owner points to.
    padded = np.zeros(capacity, np.int32)
    padded[:n] = flat_ids
    if isinstance(bank, np.ndarray):  # a host pool (GPU path): copy only the preloaded blocks
      blocks = np.zeros((capacity, bank.shape[2]), bank.dtype)
      blocks[:n] = bank.reshape(layers * experts, -1)[flat_ids]
      slots = jnp.asarray(blocks)
    else:
      slots = take(bank.reshape(layers * experts, -1), jnp.asarray(padded))
    slot_of = np.full(layers * experts, -1, np.int32)
    slot_of[flat_ids] = np.arange(n, dtype=np.int32)
    owner = np.full(capacity, -1, np.int32)
    owner[:n] = flat_ids
    stamp = np.where(np.arange(capacity) < n, 0, -1).astype(np.int32)
    return cls.empty(bank.shape, bank.dtype, num_slots, capacity, slots=slots).replace(
        slot_of=jnp.asarray(slot_of.reshape(layers, experts)), owner=jnp.asarray(owner),
        slot_stamp=jnp.asarray(stamp))

  def resized(self, num_slots: int, capacity: int | None = None) -> "ExpertCache":
    """``num_slots`` usable slots in a buffer of ``capacity``, keeping the most recently used
    cached experts (called between steps, never inside one). The host pool is untouched."""
    capacity = num_slots if capacity is None else capacity
    if not 0 <= num_slots <= capacity:
      raise ValueError(f"cache_slots must be in [0, capacity={capacity}], got {num_slots}")
    keep = min(num_slots, self.capacity)
    # Most recent first; empty slots (stamp -1) last. Stable: ties keep slot order.
    order = jnp.argsort(-self.slot_stamp, stable=True)[:keep]
    owner = jnp.full((capacity,), -1, jnp.int32).at[:keep].set(self.owner[order])
    stamp = jnp.full((capacity,), -1, jnp.int32).at[:keep].set(self.slot_stamp[order])
    prefetched = jnp.zeros((capacity,), bool).at[:keep].set(self.prefetched[order])
    slots = jnp.zeros((capacity, self.slots.shape[1]), self.slots.dtype)
    slots = slots.at[:keep].set(take(self.slots, order))
    flat = jnp.full((self.slot_of.size,), -1, jnp.int32)
    valid = owner >= 0
    flat = flat.at[jnp.where(valid, owner, flat.shape[0])].set(
        jnp.arange(capacity, dtype=jnp.int32), mode="drop")
    return self.replace(slots=slots, slot_of=flat.reshape(self.slot_of.shape), owner=owner,
                        slot_stamp=stamp, prefetched=prefetched,
                        limit=jnp.asarray(num_slots, jnp.int32))


def check_invariants(cache: ExpertCache, previous: ExpertCache | None = None) -> None:
  """Raises AssertionError when an invariant of the module docstring does not hold."""
  slot_of = np.asarray(cache.slot_of).reshape(-1)
  owner = np.asarray(cache.owner)
  clock = int(cache.clock)
  held = owner[owner >= 0]
  assert len(set(held.tolist())) == len(held), "an expert is held by two slots"
  for s, o in enumerate(owner):
    if o >= 0:
      assert slot_of[o] == s, f"slot {s} holds {o} but slot_of[{o}] = {slot_of[o]}"
  for flat, s in enumerate(slot_of):
    if s >= 0:
      assert owner[s] == flat, f"slot_of[{flat}] = {s} but owner[{s}] = {owner[s]}"
  stamp = np.asarray(cache.slot_stamp)
  assert np.all((owner >= 0) | (stamp == -1)), "an empty slot has a stamp"
  assert np.all(owner[int(cache.limit):] == -1), "a slot past the limit holds an expert"
  assert np.all(owner[np.asarray(cache.prefetched)] >= 0), "an empty slot is marked prefetched"
  assert np.all(stamp <= clock) and np.all(np.asarray(cache.expert_stamp) <= clock)
  if previous is not None:
    assert clock >= int(previous.clock)
    assert np.all(np.asarray(cache.expert_stamp) >= np.asarray(previous.expert_stamp))
