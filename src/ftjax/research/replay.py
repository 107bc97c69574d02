"""Replaying routing traces through the cache policies, and Belady's offline bound.

``replay`` runs exactly the engine's plan function (``ftjax.cache.policy.plan``) over a
trace with ``lax.scan`` (steps outside, layers inside), on a cache whose slots hold no data
(one element per slot): planning does not read slot contents, so the hit, fill and host
counts are those the engine would produce for the same routing, one token per step.

``belady_misses`` is the offline optimum with bypass (Belady's MIN where an incoming expert
may also be the one dropped): a lower bound on the misses of every policy that starts from
an empty cache, each of which can be emulated request by request with the same misses.
With ``preload=True`` the optimum may also choose the initial contents for free, which
bounds the preloaded static policies too, and so every policy.
"""

from __future__ import annotations

import dataclasses
import heapq
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.cache.policy import PolicyConfig, get_policy, initial_cache, plan
from ftjax.research.traces import Trace


@dataclasses.dataclass
class ReplayResult:
  policy: str
  cache_slots: int
  hits: np.ndarray  # [S, L] distinct experts served from slots
  fills: np.ndarray  # [S, L] misses copied into slots
  host_runs: np.ndarray  # [S, L] misses run on the host

  @property
  def misses(self) -> np.ndarray:
    return self.fills + self.host_runs

  @property
  def miss_rate(self) -> float:
    total = self.hits.sum() + self.misses.sum()
    return float(self.misses.sum() / total) if total else 0.0

  @property
  def per_layer_miss_rate(self) -> np.ndarray:
    total = self.hits.sum(0) + self.misses.sum(0)
    return np.where(total > 0, self.misses.sum(0) / np.maximum(total, 1), 0.0)

  @property
  def fills_per_step(self) -> float:
    return float(self.fills.sum(1).mean()) if len(self.fills) else 0.0

  @property
  def host_runs_per_step(self) -> float:
    return float(self.host_runs.sum(1).mean()) if len(self.host_runs) else 0.0


@partial(jax.jit, static_argnames=("policy",))
def _replay_scan(cache, ids, bandwidths, policy):
  layers = jnp.arange(ids.shape[1])

  def step(cache, ids_lk):  # [L, K]
    def layer(cache, inputs):
      index, layer_ids = inputs
      cache, p = plan(cache, index, layer_ids[None], bandwidths, policy, skip_idle=True)
      return cache, (p.hits, p.fills, p.host)
    return jax.lax.scan(layer, cache, (layers, ids_lk))

  return jax.lax.scan(step, cache, ids)[1]


def replay(trace: Trace, policy: str | PolicyConfig, cache_slots: int,
           bandwidths: tuple[float, float] = (1.0, 1.0), *, hot_experts=None) -> ReplayResult:
  """Replays ``trace`` through ``policy`` with ``cache_slots`` slots shared by all layers.

  ``bandwidths`` (B_P, B_H) in GB/s matter to the q* policies only; ``hot_experts`` ([L, E]
  counts) chooses the pinned set of ``static_hot`` (default: the trace's own counts, an
  oracle profile).
  """
  return replay_many(trace, policy, cache_slots, [bandwidths], hot_experts=hot_experts)[0]


def replay_many(trace: Trace, policy: str | PolicyConfig, cache_slots: int,
                bandwidths: list[tuple[float, float]], *, hot_experts=None
                ) -> list[ReplayResult]:
  """``replay`` under each of several (B_P, B_H) pairs (the sweep's groups of hardware
  profiles), sharing the initial cache and one compiled scan; results in order. The scans
  run one after the other: each skips the victim search of layer-steps that fill nothing
  (``plan(..., skip_idle=True)``), which a vmapped scan would not (a batched conditional
  runs both branches), ~5x faster at the sweep's sizes."""
  policy = get_policy(policy)
  layers, experts = trace.num_layers, trace.num_experts
  total = layers * experts
  if not 0 <= cache_slots <= total:
    raise ValueError(f"cache_slots must be in [0, {total}], got {cache_slots}")
  dummy_bank = jnp.zeros((layers, experts, 1), jnp.float32)
  if policy.preload == "hot" and hot_experts is None:
    hot_experts = expert_counts(trace)
  cache = initial_cache(policy, dummy_bank, cache_slots, hot_experts=hot_experts)
  if not bandwidths:
    raise ValueError("bandwidths must hold at least one (B_P, B_H) pair")
  if trace.num_steps == 0:
    z = np.zeros((0, layers), np.int64)
    return [ReplayResult(str(policy), cache_slots, z, z, z) for _ in bandwidths]
  ids = jnp.asarray(trace.ids)
  results = []
  for pair in bandwidths:
    hits, fills, host = _replay_scan(cache, ids, jnp.asarray(pair, jnp.float32),
                                     policy.program())
    results.append(ReplayResult(str(policy), cache_slots, np.asarray(hits, np.int64),
                                np.asarray(fills, np.int64), np.asarray(host, np.int64)))
  return results


def expert_counts(trace: Trace) -> np.ndarray:
  """How often each (layer, expert) was routed: [L, E]."""
  counts = np.zeros((trace.num_layers, trace.num_experts), np.int64)
  for layer in range(trace.num_layers):
    ids = trace.ids[:, layer].reshape(-1)
    np.add.at(counts[layer], ids[ids >= 0], 1)
  return counts


def belady_misses(trace: Trace, cache_slots: int, *, preload: bool = False) -> int:
  """Misses of the offline optimum (Belady with bypass) over the trace's distinct
  per-layer-step requests, in step, then layer, then route order; ``preload`` lets it start
  with the best initial contents (the first ``cache_slots`` distinct experts requested)."""
  requests = []
  for step in range(trace.num_steps):
    for layer in range(trace.num_layers):
      seen = set()
      for e in trace.ids[step, layer]:
        if e >= 0 and e not in seen:
          seen.add(int(e))
          requests.append(layer * trace.num_experts + int(e))
  never = len(requests) + 1
  next_use = [never] * len(requests)
  last: dict[int, int] = {}
  for i in range(len(requests) - 1, -1, -1):
    next_use[i] = last.get(requests[i], never)
    last[requests[i]] = i
  cached: dict[int, int] = {}  # expert -> its next use
  heap: list[tuple[int, int]] = []  # (-next use, expert), lazily cleaned
  if preload:
    for i, item in enumerate(requests):
      if len(cached) == cache_slots:
        break
      if item not in cached:
        cached[item] = i  # its first request, which is then a hit
        heapq.heappush(heap, (-i, item))
  misses = 0
  for i, item in enumerate(requests):
    if item in cached:
      cached[item] = next_use[i]
      heapq.heappush(heap, (-next_use[i], item))
      continue
    misses += 1
    if cache_slots == 0:
      continue
    if len(cached) < cache_slots:
      cached[item] = next_use[i]
      heapq.heappush(heap, (-next_use[i], item))
      continue
    while True:  # the cached expert used furthest in the future
      neg, victim = heap[0]
      if victim in cached and cached[victim] == -neg:
        break
      heapq.heappop(heap)
    if -neg > next_use[i]:  # evict it for the incoming one; otherwise bypass
      heapq.heappop(heap)
      del cached[victim]
      cached[item] = next_use[i]
      heapq.heappush(heap, (-next_use[i], item))
  return misses
