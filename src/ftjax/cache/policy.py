"""Cache policies as pure plan functions with static shapes.

For one layer-step, ``plan(cache, layer, ids, bandwidths, policy) -> (new_cache, Plan)``
decides, for the distinct experts the router selected:

* hits: experts already in a slot (served on the device);
* fills: misses copied into slots, then served on the device (``q`` of the ``m`` misses);
* host: the other misses, run in place by the host kernel, never copied.

All policies share this mechanism; a policy is data (``PolicyConfig``: fill rule,
replacement, preload) registered by name in ``POLICIES``:

* ``freetoken``: ``q`` from the q* rule (DESIGN section 2, ``fill_count``);
* ``lru_fill``: every miss (a classic expert cache);
* ``cpu_only``, ``static_hot``, ``static_layers``: none (the cache keeps what it was
  preloaded with: nothing, a hot set from a routing profile, or whole layers);
* ``freetoken_lrfu``: the q* rule, with LRFU replacement instead of LRU (below);
* ``freetoken_cycle``, ``freetoken_lrfu_cycle``: the q* rule, with victims ranked by their
  expected reuse per layer-step until their layer's next visit (below);
* ``freetoken_free``: the q* rule, and misses also fill empty slots (``fill_free``);
* ``class_lru_fill``: llama.cpp's ``--moe-cache`` eviction as its documentation describes it
  (class-LRU, below), every miss filled: the baseline of issue 52; ``freetoken_class``: the
  same victims under the q* rule;
* ``class_cycle_fill``, ``freetoken_class_cycle``: class-LRU's frequency classes in the
  cycle-aware victim value (below), every miss filled or the q* rule.

Class-LRU keeps a selection count per (layer, expert) that decays with a half-life of 128
tokens and survives evictions (``ExpertCache.expert_score``), and puts each slot in the class
floor(log2 count) of its owner (0 below 1): the victim is the slot with the largest age /
2^class, its age the layer-steps since its last use. ``class_cycle`` multiplies that class
into the cycle rule's reuse chance (``CYCLE_DECAY ** a``, ``a`` the visits of the owner's layer
that skipped it) per layer-step until its layer's next visit: global recency ranks the slots
of the layers that run next as the oldest, which a layer-cycle-aware value does not.

Which misses are filled: the most recently routed before this step (``expert_stamp``), ties
to the lower expert id; in a step of several tokens (a prefill chunk, a batch) first those
that most of its tokens route to, so that a prompt leaves its hottest experts in the cache
when decode starts. Victims: the least recently used slots not used in this step (empty
slots first, ties to the lower slot), chosen in one pass for the whole layer-step. Recency
changes only through router selections (``expert_stamp``) and slot use (``slot_stamp``).

``freetoken_lrfu`` ranks experts by their LRFU value (Lee et al., 2001) instead of recency:
each selection adds 1 to a count that decays by ``PolicyConfig.decay`` per token step
(``ExpertCache.expert_score``), so an expert that many recent tokens chose outranks one that
a single token chose slightly later. It fills the highest-valued misses and evicts the
lowest-valued slots; how many it fills is freetoken's q*. ``decay -> 0`` approaches LRU.
``benchmarks/sweep.py`` measures it against ``freetoken`` (results in
``benchmarks/results/sweep``).

The cycle-aware replacements (``docs/cache.md`` has the reasoning) fix global LRU's failure
on the layer cycle of a decode step: the least recently used slots belong to the layers that
run next. A slot's value is its reuse estimate at its layer's next visit divided by ``d``,
the layer-steps until that visit (1 for the next layer, L for the current one); the lowest
values are the victims. ``cycle``: ``decay ** a`` with ``a`` the visits of its layer that did
not use it (from ``slot_stamp``); ``lrfu_cycle``: the owner's LRFU value carried to that
visit. Fill candidates are ranked as in LRU and LRFU respectively.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ftjax.cache.state import ExpertCache

FILL_RULES = ("q*", "all", "none")  # how many misses a layer-step fills
# how fills and victims are ranked
REPLACEMENTS = ("lru", "lrfu", "cycle", "lrfu_cycle", "class", "class_cycle")
PRELOADS = ("none", "hot", "layers")  # what the cache holds before the first step


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
  """A cache policy as data (hashable; a jit static argument).

  fill_rule: "q*" (the q* rule from the bandwidths, ``fill_count``), "all" (every miss) or
    "none" (misses run on the host; the cache keeps what it was preloaded with).
  replacement: "lru" (recency stamps), "lrfu" (decayed selection counts, ``decay`` per
    token step, in (0, 1)), "cycle" (LRU fills; victims by their reuse chance ``decay ** a``,
    ``a`` visits of their layer unused, per layer-step until their layer's next visit) or
    "lrfu_cycle" (LRFU fills; victims by their LRFU value at their layer's next visit per
    layer-step until it) or "class" (llama.cpp's class-LRU: LRU fills; victims by the largest
    age / 2^class, class = floor(log2) of the owner's decayed selection count, ``decay`` per
    token step) or "class_cycle" (LRU fills; victims by cycle's reuse chance,
    ``CYCLE_DECAY ** a``, times 2^class, per layer-step until their layer's next visit).
  preload: "none" (starts empty), "hot" (the most selected experts of a routing profile,
    ``hot_experts=``), "layers" (whole layers, first layers first). The engine reads it to
    build the initial cache, and again after a resize.
  name: the registry name, for messages and statistics.
  fill_free: also fill misses into empty slots beyond the fill rule's count (as many as there
    are empty usable slots): with a low B_P/B_H the q* rule fills nothing for one or two
    misses, and a cache with room would otherwise stay empty (``freetoken_free``).

  The plan program depends on ``program()`` only: policies that differ only in their preload
  (``cpu_only``, ``static_hot``, ``static_layers``) share one compiled step.
  """
  fill_rule: str
  replacement: str = "lru"
  preload: str = "none"
  decay: float = 0.9
  name: str | None = None
  fill_free: bool = False

  def __post_init__(self):
    for field, value, allowed in (("fill_rule", self.fill_rule, FILL_RULES),
                                  ("replacement", self.replacement, REPLACEMENTS),
                                  ("preload", self.preload, PRELOADS)):
      if value not in allowed:
        hint = (f"; {value!r} is a policy name: use get_policy({value!r})"
                if value in POLICIES else "")
        raise ValueError(f"PolicyConfig {field} must be one of {', '.join(allowed)}, got "
                         f"{value!r}{hint}")
    if not 0.0 < self.decay < 1.0:
      raise ValueError(f"the LRFU decay must be in (0, 1), got {self.decay}")

  def program(self) -> "PolicyConfig":
    """The part of the policy the plan program depends on (equal programs share a compile)."""
    decay = self.decay if self.replacement != "lru" else 0.9
    return PolicyConfig(self.fill_rule, self.replacement, "none", decay,
                        fill_free=self.fill_free)

  def __str__(self) -> str:
    return self.name or f"{self.fill_rule}/{self.replacement}/{self.preload}"


HALF_LIFE_128 = 0.5 ** (1 / 128)  # a count's decay per token step, halved in 128 tokens
CYCLE_DECAY = 0.5  # class_cycle: a slot's reuse chance per visit of its layer that skipped it

# The registry: adding a policy is one entry here plus, for a new rule, its plan code below.
POLICIES: dict[str, PolicyConfig] = {
    "freetoken": PolicyConfig("q*", "lru", "none", name="freetoken"),
    "lru_fill": PolicyConfig("all", "lru", "none", name="lru_fill"),
    "cpu_only": PolicyConfig("none", "lru", "none", name="cpu_only"),
    "static_hot": PolicyConfig("none", "lru", "hot", name="static_hot"),
    "static_layers": PolicyConfig("none", "lru", "layers", name="static_layers"),
    "freetoken_lrfu": PolicyConfig("q*", "lrfu", "none", name="freetoken_lrfu"),
    "freetoken_cycle": PolicyConfig("q*", "cycle", "none", decay=0.5, name="freetoken_cycle"),
    "freetoken_lrfu_cycle": PolicyConfig("q*", "lrfu_cycle", "none",
                                         name="freetoken_lrfu_cycle"),
    "freetoken_free": PolicyConfig("q*", "lru", "none", name="freetoken_free", fill_free=True),
    # llama.cpp's --moe-cache eviction as its docs describe it (issue 52's baseline): counts
    # decayed with a half-life of 128 tokens, kept across evictions; every miss filled.
    "class_lru_fill": PolicyConfig("all", "class", decay=HALF_LIFE_128, name="class_lru_fill"),
    "freetoken_class": PolicyConfig("q*", "class", decay=HALF_LIFE_128, name="freetoken_class"),
    # The frequency classes of class-LRU in the cycle-aware victim value (``class_cycle``).
    "freetoken_class_cycle": PolicyConfig("q*", "class_cycle", decay=HALF_LIFE_128,
                                          name="freetoken_class_cycle"),
    "class_cycle_fill": PolicyConfig("all", "class_cycle", decay=HALF_LIFE_128,
                                     name="class_cycle_fill"),
}


def get_policy(policy: "str | PolicyConfig", **overrides) -> PolicyConfig:
  """A registered policy by name (``overrides`` replace fields, e.g. ``decay=0.8``), or a
  ``PolicyConfig`` as given."""
  if isinstance(policy, PolicyConfig):
    return dataclasses.replace(policy, **overrides) if overrides else policy
  if policy not in POLICIES:
    raise ValueError(f"unknown cache policy {policy!r}; choose one of {', '.join(POLICIES)}")
  return dataclasses.replace(POLICIES[policy], **overrides) if overrides else POLICIES[policy]


def initial_cache(policy: PolicyConfig, bank: jax.Array, num_slots: int,
                  capacity: int | None = None, *, hot_experts=None) -> ExpertCache:
  """The cache a policy starts from (its ``preload``): empty, the ``num_slots`` most selected
  experts of the routing profile ``hot_experts`` ([L, E] counts), or whole layers (first
  layers first). ``bank`` [L, E, P] supplies the preloaded blocks (its shape and dtype only
  when nothing is preloaded)."""
  layers, experts = bank.shape[0], bank.shape[1]
  if policy.preload == "hot":
    if hot_experts is None:
      raise ValueError(f"the {policy} policy pins the hottest experts of a routing profile: "
                       "pass hot_experts=counts [L, E] (e.g. engine.routing_counts() of a "
                       "warm-up run with another policy)")
    counts = np.asarray(hot_experts, np.float64).reshape(-1)
    if counts.size != layers * experts:
      raise ValueError(f"hot_experts must have L·E = {layers * experts} counts, got "
                       f"{counts.size}")
    pinned = np.argsort(-counts, kind="stable")[:num_slots]
    return ExpertCache.preloaded(bank, num_slots, pinned, capacity)
  if policy.preload == "layers":
    whole = (num_slots // experts) * experts
    return ExpertCache.preloaded(bank, num_slots, np.arange(whole), capacity)
  return ExpertCache.empty(bank.shape, bank.dtype, num_slots, capacity)


@struct.dataclass
class Plan:
  """What one layer-step does. Shapes are static; Q = min(N, E, T·K)."""
  route_slot: jax.Array  # [T, K] int32: the slot serving this route on the device, or -1 (host)
  fill_expert: jax.Array  # [Q] int32: expert (of this layer) to copy into a slot, or -1
  fill_slot: jax.Array  # [Q] int32: its destination slot, or -1
  hits: jax.Array  # [] int32: distinct selected experts already cached
  fills: jax.Array  # [] int32: misses filled (q)
  host: jax.Array  # [] int32: misses run on the host (m - q)
  prefetch_used: jax.Array  # [] int32: hits on slots a prefetch filled (their first use)
  prefetch_wasted: jax.Array  # [] int32: prefetched slots evicted by this step, never used

  @property
  def misses(self) -> jax.Array:
    return self.fills + self.host


def fill_count(m: jax.Array, b_p: jax.Array, b_h: jax.Array) -> jax.Array:
  """The q* rule: how many of ``m`` misses to fill, from bandwidths B_P (fill) and B_H (host).

  Balances ``q/B_P = (m - q)/B_res`` with ``B_res = B_H - B_P``: ``q* = m·B_P/B_H``, rounded to
  the floor or ceiling that minimises ``max(q/B_P, (m - q)/B_res)``, ties to the larger (a
  fill also warms the cache); everything is filled when ``B_P >= B_H``.
  """
  m = jnp.asarray(m, jnp.float32)
  b_p = jnp.asarray(b_p, jnp.float32)
  b_h = jnp.asarray(b_h, jnp.float32)
  q_star = m * b_p / b_h
  b_res = jnp.maximum(b_h - b_p, jnp.finfo(jnp.float32).tiny)

  def cost(q):
    return jnp.maximum(q / b_p, (m - q) / b_res)

  lo, hi = jnp.floor(q_star), jnp.ceil(q_star)
  q = jnp.where(cost(hi) <= cost(lo), hi, lo)
  q = jnp.where(b_p >= b_h, m, q)
  return jnp.clip(q, 0, m).astype(jnp.int32)


_NEVER = -1e30  # LRFU log value of an expert never selected (below any real one)
_ARGMAX_TOP_K = 16  # up to this k, top_indices runs k argmax passes instead of lax.top_k


def top_indices(values: jax.Array, k: int) -> jax.Array:
  """Indices of the ``k`` largest of ``values [n]`` (int32 or float32 without NaN), largest
  first, ties to the lower index: the order of ``lax.top_k``. For small ``k`` it takes ``k``
  argmax passes, each masking its pick: on XLA:CPU ``lax.top_k`` sorts, which made it most
  of a decode step's planning time (8 of 2273 slots: 250 µs vs 30 µs); float keys become
  order-preserving int32 first (float argmax is ~6x slower). Entries past the number of
  values above the dtype's minimum may repeat; callers use only those."""
  if k > _ARGMAX_TOP_K:
    return jax.lax.top_k(values, k)[1]
  if values.dtype == jnp.float32:  # argmax over int32 is ~6x faster on XLA:CPU
    bits = jax.lax.bitcast_convert_type(values, jnp.int32)
    values = jnp.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # same order as the floats
  floor = jnp.iinfo(values.dtype).min
  picks = []
  for _ in range(k):
    i = jnp.argmax(values).astype(jnp.int32)
    picks.append(i)
    values = values.at[i].set(floor)
  return jnp.stack(picks) if picks else jnp.zeros((0,), jnp.int32)


def _steps_to_next_visit(owner: jax.Array, layer: jax.Array, num_experts: int,
                         num_layers: int) -> jax.Array:
  """Layer-steps from the current one (``layer``) to the next visit of each slot's owner's
  layer, in [1, L] (its own layer: L, the next step's visit); empty slots: L. [N] int32."""
  owner_layer = jnp.where(owner >= 0, owner // num_experts, layer)
  return (owner_layer - layer - 1) % num_layers + 1


def _log_value(score, stamp, clock, policy: PolicyConfig, num_layers: int) -> jax.Array:
  """LRFU values (log domain) as of ``clock``: log(score) + (clock - stamp)·log(decay)/L, the
  clock advancing L times per token step; never selected: a finite floor (-inf masks)."""
  log_decay_tick = jnp.log(jnp.float32(policy.decay)) / num_layers
  return jnp.where(score > 0, jnp.log(jnp.maximum(score, 1e-30)) +
                   (clock - stamp).astype(jnp.float32) * log_decay_tick, _NEVER)


def _victims(cache: ExpertCache, layer: jax.Array, clock: jax.Array, policy: PolicyConfig,
             protected: jax.Array, count: int) -> jax.Array:
  """The ``count`` slots the policy's replacement gives up first at layer-step ``clock`` of
  ``layer``, never a ``protected`` one ([N] bool) while others are left: empty slots first,
  then by the replacement's rule (module docstring). [count] int32."""
  num_layers, num_experts = cache.slot_of.shape
  replacement = policy.replacement
  cycle = replacement in ("cycle", "lrfu_cycle", "class_cycle")
  if replacement == "lru":
    return top_indices(jnp.where(protected, jnp.iinfo(jnp.int32).min, -cache.slot_stamp), count)
  until = _steps_to_next_visit(cache.owner, layer, num_experts, num_layers) if cycle else None
  if replacement in ("lrfu", "lrfu_cycle", "class", "class_cycle"):
    flat_owner = jnp.maximum(cache.owner, 0)
    owner_log = _log_value(cache.expert_score.reshape(-1)[flat_owner],
                           cache.expert_stamp.reshape(-1)[flat_owner], clock, policy,
                           num_layers)
  if replacement in ("lrfu", "lrfu_cycle"):
    # Lowest-valued slots go; cycle: the value at the owner's next visit, per layer-step
    # until it.
    value = owner_log
    if cycle:
      log_decay_tick = jnp.log(jnp.float32(policy.decay)) / num_layers
      value = (value + (until - 1).astype(jnp.float32) * log_decay_tick -
               jnp.log(until.astype(jnp.float32)))
    evict = -value
  elif replacement in ("class", "class_cycle"):
    # llama.cpp's class-LRU: the largest age / 2^class goes, age the layer-steps since the
    # slot's last use, class = floor(log2 c) of the owner's decayed count c (0 below 1).
    # class_cycle: the reuse chance of "cycle" (decay ** a) times 2^class, per layer-step
    # until the owner's layer's next visit.
    klass = jnp.maximum(jnp.floor(owner_log / jnp.log(2.0)), 0.0)
    if cycle:
      unused_visits = (clock - cache.slot_stamp - 1) // num_layers
      evict = (jnp.log(until.astype(jnp.float32)) - klass * jnp.log(2.0)
               - unused_visits.astype(jnp.float32) * jnp.log(jnp.float32(CYCLE_DECAY)))
    else:
      age = jnp.maximum(clock - cache.slot_stamp, 1).astype(jnp.float32)
      evict = jnp.log(age) - klass * jnp.log(2.0)
  else:  # cycle: reuse chance decay ** a, a = visits of the owner's layer since the slot's
    # last use (0: used at the layer's latest visit), per layer-step until its next visit.
    unused_visits = (clock - cache.slot_stamp - 1) // num_layers
    keep = (unused_visits.astype(jnp.float32) * jnp.log(jnp.float32(policy.decay)) -
            jnp.log(until.astype(jnp.float32)))
    evict = -keep
  return top_indices(jnp.where(protected, -jnp.inf,
                               jnp.where(cache.owner >= 0, evict, jnp.inf)), count)


def plan(cache: ExpertCache, layer: jax.Array | int, ids: jax.Array, bandwidths: jax.Array,
         policy: PolicyConfig, *, skip_idle: bool = False) -> tuple[ExpertCache, Plan]:
  """Plans one layer-step. ``ids [T, K]`` int32 (-1 = no route); ``bandwidths`` = (B_P, B_H).
  ``skip_idle`` (static) skips the victim search of layer-steps that fill nothing: the same
  plan, faster on XLA:CPU (trace replays), a host synchronisation on a GPU."""
  num_layers, num_experts = cache.slot_of.shape
  num_slots = cache.capacity
  t, k = ids.shape
  q_max = max(0, min(num_slots, num_experts, t * k))
  clock = cache.clock + 1
  layer = jnp.asarray(layer, jnp.int32)
  expert_range = jnp.arange(num_experts, dtype=jnp.int32)

  selected = jnp.any(ids.reshape(-1, 1) == expert_range, axis=0)  # [E], deduplicated
  slot_of_l = cache.slot_of[layer]  # [E]
  hit = selected & (slot_of_l >= 0)
  miss = selected & (slot_of_l < 0)
  m = jnp.sum(miss, dtype=jnp.int32)
  hits = jnp.sum(hit, dtype=jnp.int32)

  # Slots used by this step's hits are never victims; the others are, least recent first.
  used = jnp.zeros((num_slots,), bool).at[jnp.where(hit, slot_of_l, num_slots)].set(
      True, mode="drop")
  usable = jnp.arange(num_slots) < cache.limit
  available = cache.limit - hits
  if policy.fill_rule == "q*":
    q = fill_count(m, bandwidths[0], bandwidths[1])
  elif policy.fill_rule == "all":
    q = m
  else:
    q = jnp.zeros((), jnp.int32)
  if policy.fill_free:  # misses go to empty slots whatever the fill rule says
    empty = jnp.sum((cache.owner < 0) & usable, dtype=jnp.int32)
    q = jnp.maximum(q, jnp.minimum(m, empty))
  q = jnp.minimum(q, available) if q_max else jnp.zeros((), jnp.int32)

  def log_value(score, stamp):
    return _log_value(score, stamp, clock, policy, num_layers)

  lrfu = policy.replacement in ("lrfu", "lrfu_cycle")
  classes = policy.replacement in ("class", "class_cycle")
  scored = lrfu or classes  # decayed selection counts; the others never touch the scores
  prev_value = (log_value(cache.expert_score[layer], cache.expert_stamp[layer]) if scored
                else None)

  if q_max:
    def with_fills(_):
      if lrfu:  # highest-valued misses first
        fill_cand = top_indices(jnp.where(miss, prev_value, -jnp.inf), q_max)
      else:
        prev_stamp = cache.expert_stamp[layer]
        if t == 1:
          # Most recently routed misses first; ties toward the lower index.
          key = prev_stamp
        else:
          # Several tokens (a prefill chunk, a batch): the misses most of them route to first,
          # then the most recent, then the lower index, so that a prompt leaves its hottest
          # experts in the cache. recency: E - 1 for the latest stamp, lower ids first on ties.
          routes = jnp.sum(ids.reshape(-1, 1) == expert_range, axis=0, dtype=jnp.int32)  # [E]
          latest_first = jnp.argsort(-prev_stamp, stable=True)
          recency = num_experts - 1 - jnp.argsort(latest_first, stable=True).astype(jnp.int32)
          key = routes * num_experts + recency
        fill_cand = top_indices(jnp.where(miss, key, jnp.iinfo(jnp.int32).min), q_max)
      victim = _victims(cache, layer, clock, policy, used | ~usable, q_max)
      active = jnp.arange(q_max) < q
      fill_expert = jnp.where(active, fill_cand, -1).astype(jnp.int32)
      fill_slot = jnp.where(active, victim, -1).astype(jnp.int32)
      # Evict the victims' owners, then install the fills.
      flat_slot_of = cache.slot_of.reshape(-1)
      evicted = jnp.where(active, cache.owner[victim], -1)
      out_of_range = flat_slot_of.shape[0]
      flat_slot_of = flat_slot_of.at[jnp.where(evicted >= 0, evicted, out_of_range)].set(
          -1, mode="drop")
      new_owner_flat = layer * num_experts + fill_expert
      flat_slot_of = flat_slot_of.at[jnp.where(active, new_owner_flat, out_of_range)].set(
          fill_slot, mode="drop")
      slot_of = flat_slot_of.reshape(num_layers, num_experts)
      owner = cache.owner.at[jnp.where(active, fill_slot, num_slots)].set(
          new_owner_flat, mode="drop")
      stamped = used.at[jnp.where(active, fill_slot, num_slots)].set(True, mode="drop")
      slot_stamp = jnp.where(stamped, clock, cache.slot_stamp)
      return fill_expert, fill_slot, slot_of, owner, slot_stamp

    def without_fills(_):  # nothing to fill: only the hits' slots are stamped
      none = jnp.full((q_max,), -1, jnp.int32)
      return none, none, cache.slot_of, cache.owner, jnp.where(used, clock, cache.slot_stamp)

    # skip_idle: a conditional skips the victim search when nothing is filled (XLA:CPU runs
    # one branch; the replays use it; the engine does not: on a GPU a conditional reads its
    # predicate on the host, a synchronisation per layer).
    fill_expert, fill_slot, slot_of, owner, slot_stamp = (
        jax.lax.cond(q > 0, with_fills, without_fills, None) if skip_idle else
        with_fills(None))
  else:
    fill_expert = fill_slot = jnp.zeros((0,), jnp.int32)
    slot_of, owner, slot_stamp = cache.slot_of, cache.owner, cache.slot_stamp

  expert_stamp = cache.expert_stamp.at[layer].set(
      jnp.where(selected, clock, cache.expert_stamp[layer]))
  expert_count = cache.expert_count.at[layer].add(selected.astype(jnp.int32))
  expert_score = cache.expert_score
  if scored:
    expert_score = expert_score.at[layer].set(jnp.where(
        selected, jnp.exp(jnp.logaddexp(prev_value, 0.0)), expert_score[layer]))
  new_slot_of_l = slot_of[layer]
  route_slot = jnp.where(ids >= 0, new_slot_of_l[jnp.maximum(ids, 0)], -1)
  # Prefetched slots: a hit uses one, a fill's victim wastes one; both clear the mark.
  prefetch_used = jnp.sum(used & cache.prefetched, dtype=jnp.int32)
  filled = jnp.zeros((num_slots,), bool).at[jnp.where(fill_slot >= 0, fill_slot, num_slots)].set(
      True, mode="drop")
  prefetch_wasted = jnp.sum(filled & cache.prefetched, dtype=jnp.int32)
  prefetched = cache.prefetched & ~used & ~filled
  new_cache = cache.replace(slot_of=slot_of, owner=owner, slot_stamp=slot_stamp,
                            expert_stamp=expert_stamp, expert_count=expert_count,
                            expert_score=expert_score, prefetched=prefetched, clock=clock)
  return new_cache, Plan(route_slot=route_slot.astype(jnp.int32), fill_expert=fill_expert,
                         fill_slot=fill_slot, hits=hits, fills=q, host=m - q,
                         prefetch_used=prefetch_used, prefetch_wasted=prefetch_wasted)


@struct.dataclass
class PrefetchPlan:
  """What one prefetch does (shapes static; P = the candidates given)."""
  fill_expert: jax.Array  # [P] int32: expert (of the target layer) to copy into a slot, or -1
  fill_slot: jax.Array  # [P] int32: its destination slot, or -1
  count: jax.Array  # [] int32: experts prefetched
  wasted: jax.Array  # [] int32: earlier prefetched slots it evicted, never used


def prefetch(cache: ExpertCache, layer: jax.Array | int, candidates: jax.Array,
             budget: jax.Array | int, policy: PolicyConfig) -> tuple[ExpertCache, PrefetchPlan]:
  """Fills up to ``budget`` of ``candidates [P]`` (experts of ``layer`` predicted for its next
  layer-step, best first; -1 = none) that no slot holds, before that step plans.

  It runs between layer-steps (the clock does not advance: the victims are ranked as of the
  layer-step just planned, the one before ``layer``'s) and never evicts what the step just
  planned used or filled (slots stamped at the current clock), a candidate already cached, or
  a slot past the limit. The prefetched slots are stamped at the current clock and marked
  ``prefetched`` until a step uses them (``Plan.prefetch_used``) or evicts them unused
  (``Plan.prefetch_wasted`` / ``PrefetchPlan.wasted``). Router statistics (``expert_stamp``,
  counts, scores) are untouched: a prediction is not a selection. Copying the blocks is the
  caller's (``fill_expert`` into ``fill_slot``, as a plan's fills)."""
  num_layers, num_experts = cache.slot_of.shape
  num_slots = cache.capacity
  candidates = jnp.asarray(candidates, jnp.int32).reshape(-1)
  width = candidates.shape[0]
  layer = jnp.asarray(layer, jnp.int32)
  if width == 0 or num_slots == 0:
    none = jnp.full((width,), -1, jnp.int32)
    zero = jnp.zeros((), jnp.int32)
    return cache, PrefetchPlan(fill_expert=none, fill_slot=none, count=zero, wasted=zero)
  slot_of_l = cache.slot_of[layer]
  valid = candidates >= 0
  held = valid & (slot_of_l[jnp.maximum(candidates, 0)] >= 0)
  earlier = jnp.tril(candidates[:, None] == candidates[None, :], -1).any(1)  # a repeat
  want = valid & ~held & ~earlier
  usable = jnp.arange(num_slots) < cache.limit
  protected = ~usable | (cache.slot_stamp >= cache.clock)
  protected = protected.at[jnp.where(held, slot_of_l[jnp.maximum(candidates, 0)],
                                     num_slots)].set(True, mode="drop")
  room = jnp.sum(~protected, dtype=jnp.int32)
  n = jnp.minimum(jnp.minimum(jnp.sum(want, dtype=jnp.int32), jnp.maximum(budget, 0)), room)
  order = jnp.argsort(~want, stable=True)  # wanted first, in the predictor's order
  active = jnp.arange(width) < n
  fill_expert = jnp.where(active, candidates[order], -1).astype(jnp.int32)
  current = (layer - 1) % num_layers  # the layer-step just planned
  victim = _victims(cache, current, cache.clock, policy, protected, width)
  fill_slot = jnp.where(active, victim, -1).astype(jnp.int32)
  flat_slot_of = cache.slot_of.reshape(-1)
  out_of_range = flat_slot_of.shape[0]
  evicted = jnp.where(active, cache.owner[jnp.maximum(victim, 0)], -1)
  flat_slot_of = flat_slot_of.at[jnp.where(evicted >= 0, evicted, out_of_range)].set(
      -1, mode="drop")
  new_owner_flat = layer * num_experts + fill_expert
  flat_slot_of = flat_slot_of.at[jnp.where(active, new_owner_flat, out_of_range)].set(
      fill_slot, mode="drop")
  target = jnp.where(active, fill_slot, num_slots)
  wasted = jnp.sum(active & cache.prefetched[jnp.maximum(victim, 0)], dtype=jnp.int32)
  new_cache = cache.replace(
      slot_of=flat_slot_of.reshape(num_layers, num_experts),
      owner=cache.owner.at[target].set(new_owner_flat, mode="drop"),
      slot_stamp=cache.slot_stamp.at[target].set(cache.clock, mode="drop"),
      prefetched=cache.prefetched.at[target].set(True, mode="drop"))
  return new_cache, PrefetchPlan(fill_expert=fill_expert, fill_slot=fill_slot, count=n,
                                 wasted=wasted)
