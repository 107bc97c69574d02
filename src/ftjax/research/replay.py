"""Replaying routing traces through the cache policies, and Belady's offline bound.

``replay`` runs exactly the engine's plan function (``ftjax.cache.policy.plan``) over a
trace with ``lax.scan`` (steps outside, layers inside), on a cache whose slots hold no data
(one element per slot): planning does not read slot contents, so the hit, fill and host
counts are those the engine would produce for the same routing, one token per step.

With ``prefetch=Prefetch(...)`` each layer-step is followed by a prefetch for the next one
(``ftjax.cache.policy.prefetch``, the engine's function) of the experts a predictor names:
by default as many as the link's idle time in the step holds under the cost model
(``budget="link"``: the copies of S bytes at B_P that fit in the step's modeled time after
its own fills, ``ftjax.research.cost.prefetch_room``), or up to an int ``budget`` minus the
step's own fills. A prefetched expert the next step routes is a hit (it arrived before use);
``prefetched`` / ``prefetch_used`` / ``prefetch_wasted`` count them, and ``predicted_named``
what the predictor named of each step's experts (``recall``). Predictors:

* ``trace``: the trace's own ``predicted`` ids (recorded by whoever made the trace, e.g.
  router-ahead: the next layer's router applied to an earlier hidden state);
* ``cooccurrence``: learned online from the ids alone, as the trace plays: a count per (layer
  l expert a, layer l + 1 expert b) of the tokens that routed both, decayed per token step
  (``decay``); layer l + 1's candidates are the experts with the most counts from layer l's
  selection (the last layer predicts the next token's first);
* ``last_token``: the experts the next layer-step's layer routed for the previous token.

``belady_misses`` is the offline optimum with bypass (Belady's MIN where an incoming expert
may also be the one dropped): a lower bound on the misses of every policy that starts from
an empty cache, each of which can be emulated request by request with the same misses.
With ``preload=True`` the optimum may also choose the initial contents for free, which
bounds the preloaded static policies too, and so every policy.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.cache.policy import (HALF_LIFE_128, PolicyConfig, get_policy, initial_cache, plan,
                                prefetch, top_indices)
from ftjax.research.cost import prefetch_room
from ftjax.research.traces import Trace
from ftjax.runtime.programs import return_free_heap


@dataclasses.dataclass
class ReplayResult:
  policy: str
  cache_slots: int
  hits: np.ndarray  # [S, L] distinct experts served from slots
  fills: np.ndarray  # [S, L] misses copied into slots
  host_runs: np.ndarray  # [S, L] misses run on the host
  prefetched: np.ndarray | None = None  # [S, L] experts prefetched after the layer-step
  prefetch_used: np.ndarray | None = None  # [S, L] hits on prefetched slots (first use)
  prefetch_wasted: np.ndarray | None = None  # [S, L] prefetched slots evicted unused
  # [S, L] of the layer-step's distinct routed experts, how many the predictor named for it
  # (its candidates, cached or not): recall = predicted_named / distinct routed
  predicted_named: np.ndarray | None = None

  def recall(self, trace: Trace) -> np.ndarray | None:
    """The predictor's recall per layer: the share of the routed experts (distinct per
    layer-step) that it named before the step; None without prefetch."""
    if self.predicted_named is None:
      return None
    routed = self.hits + self.fills + self.host_runs
    return self.predicted_named.sum(0) / np.maximum(routed.sum(0), 1)

  @property
  def prefetch_use_share(self) -> float | None:
    """The share of the prefetched experts that a step used before they were evicted (None
    without prefetch; those still cached at the end count as unused)."""
    if self.prefetched is None:
      return None
    total = int(self.prefetched.sum())
    return float(self.prefetch_used.sum() / total) if total else 0.0

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


PREDICTORS = ("trace", "cooccurrence", "last_token")


@dataclasses.dataclass(frozen=True)
class Prefetch:
  """Prefetch in a replay (module docstring): ``predictor`` (one of ``PREDICTORS``) names
  ``width`` candidates (default: the trace's top_k) for each next layer-step; ``budget`` is
  the fills the link makes per layer-step, the step's own fills first (an int; None: the
  trace's top_k), or ``"link"``: as many as the link's idle time in the step holds, from the
  cost model (``ftjax.research.cost.prefetch_room``; none on a CPU profile), which needs ``replay(..., cost=(hardware, shape))``;
  ``decay`` is the cooccurrence counts' factor per token step (default: a half-life
  of 128 tokens). ``Prefetch.parse("trace@8")`` reads the CLI's form PREDICTOR[@BUDGET]."""
  predictor: str
  budget: int | str | None = "link"
  width: int | None = None
  decay: float = HALF_LIFE_128

  def __post_init__(self):
    if self.predictor not in PREDICTORS:
      raise ValueError(f"unknown predictor {self.predictor!r}; choose one of "
                       f"{', '.join(PREDICTORS)}")
    if self.budget != "link" and (
        (self.budget is not None and not isinstance(self.budget, int)) or
        (self.budget is not None and self.budget < 0) or
        (self.width is not None and self.width < 1)):
      raise ValueError(f"prefetch budget must be 'link' or an int >= 0, and width >= 1, got "
                       f"{self.budget!r} and {self.width}")
    if not 0.0 < self.decay <= 1.0:
      raise ValueError(f"the cooccurrence decay must be in (0, 1], got {self.decay}")

  def __str__(self) -> str:
    return self.predictor if self.budget == "link" else f"{self.predictor}@{self.budget}"

  @classmethod
  def parse(cls, text: str) -> "Prefetch":
    """PREDICTOR[@BUDGET]: BUDGET an int or ``link`` (the default)."""
    predictor, _, budget = text.partition("@")
    try:
      return cls(predictor, "link" if budget in ("", "link") else int(budget))
    except ValueError as e:
      raise ValueError(f"bad prefetch {text!r} (PREDICTOR[@BUDGET], e.g. trace@8): {e}") from None


def _candidates(trace: Trace, predictor: str, width: int) -> np.ndarray:
  """[S, L, width] the static predictors' candidates for the layer-step after each (s, l)."""
  steps, layers = trace.num_steps, trace.num_layers
  if predictor == "trace":
    if trace.predicted is None:
      raise ValueError("Prefetch(predictor='trace') needs a trace with predicted ids "
                       "(Trace.predicted); this one has none: use predictor='cooccurrence'")
    source = trace.predicted[:, :, :width]
    nxt = np.concatenate([source[:, 1:], np.concatenate(
        [source[1:, :1], np.full((1, 1, source.shape[2]), -1, np.int32)])], axis=1)
  else:  # last_token: layer l + 1's experts of the previous step
    prev = np.concatenate([np.full((1,) + trace.ids.shape[1:], -1, np.int32), trace.ids[:-1]])
    nxt = np.concatenate([prev[:, 1:], trace.ids[:, :1]], axis=1)[:, :, :width]
  out = np.full((steps, layers, width), -1, np.int32)
  out[:, :, :nxt.shape[2]] = nxt
  return out


def _prefetch_scan(cache, ids, candidates, bandwidths, budget, decay, policy, predictor, width,
                   cost):
  num_layers, num_experts = cache.slot_of.shape
  layers = jnp.arange(ids.shape[1])
  expert_range = jnp.arange(num_experts, dtype=jnp.int32)
  learned = predictor == "cooccurrence"
  counts = jnp.zeros((num_layers, num_experts, num_experts) if learned else (0,), jnp.float32)

  def step(carry, inputs):
    def layer(carry, inputs):
      cache, counts, prev_selected, named_before = carry
      index, layer_ids, cand = inputs
      cache, p = plan(cache, index, layer_ids[None], bandwidths, policy, skip_idle=True)
      selected = jnp.any(layer_ids.reshape(-1, 1) == expert_range, axis=0)
      # How many of this step's experts the candidates made before it named.
      named = jnp.sum(selected & named_before, dtype=jnp.int32)
      if learned:  # count the pair (previous layer-step, this one), then predict the next
        prev = (index - 1) % num_layers
        counts = counts.at[prev].set(counts[prev] * decay + (
            prev_selected[:, None] & selected[None, :]).astype(jnp.float32))
        scores = selected.astype(jnp.float32) @ counts[index]
        top = top_indices(scores, width)
        cand = jnp.where(scores[top] > 0, top, -1)
      room = (jnp.maximum(budget - p.fills, 0) if cost is None else
              prefetch_room(*cost, p.hits, p.fills, p.host, width))
      cache, pp = prefetch(cache, (index + 1) % num_layers, cand, room, policy)
      named_next = jnp.any(cand.reshape(-1, 1) == expert_range, axis=0)
      return (cache, counts, selected, named_next), (
          p.hits, p.fills, p.host, pp.count, p.prefetch_used, p.prefetch_wasted + pp.wasted,
          named)
    return jax.lax.scan(layer, carry, (layers,) + inputs)

  carry = (cache, counts, jnp.zeros((num_experts,), bool), jnp.zeros((num_experts,), bool))
  return jax.lax.scan(step, carry, (ids, candidates))[1]


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
           bandwidths: tuple[float, float] = (1.0, 1.0), *, hot_experts=None,
           prefetch: Prefetch | None = None, cost=None) -> ReplayResult:
  """Replays ``trace`` through ``policy`` with ``cache_slots`` slots shared by all layers.

  ``bandwidths`` (B_P, B_H) in GB/s matter to the q* policies only; ``hot_experts`` ([L, E]
  counts) chooses the pinned set of ``static_hot`` (default: the trace's own counts, an
  oracle profile); ``prefetch`` adds a prefetch after each layer-step (module docstring);
  ``cost`` = (``HardwareProfile``, ``ModelShape``) sizes its ``"link"`` budget.
  """
  return replay_many(trace, policy, cache_slots, [bandwidths], hot_experts=hot_experts,
                     prefetch=prefetch, cost=cost)[0]


def replay_many(trace: Trace, policy: str | PolicyConfig, cache_slots: int,
                bandwidths: list[tuple[float, float]], *, hot_experts=None,
                prefetch: Prefetch | None = None, cost=None) -> list[ReplayResult]:
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
  program = policy.program()
  if prefetch is not None and prefetch.budget == "link" and cost is None:
    raise ValueError(f"prefetch {prefetch}'s budget is the link's idle time, which needs the "
                     "cost model: pass cost=(HardwareProfile, ModelShape), or an int budget "
                     "(Prefetch(predictor, budget=8))")
  cost = tuple(cost) if prefetch is not None and prefetch.budget == "link" else None
  shapes = (cache.capacity, trace.ids.shape)  # one compiled program per table entry
  replay_scan = _scan(shapes, "replay", program)
  prefetch_scan = (None if prefetch is None else
                   _scan(shapes, "prefetch", program, prefetch.predictor,
                         prefetch.width or trace.top_k, cost))
  return _replay_all(trace, policy, cache, ids, bandwidths, prefetch, cost, cache_slots,
                     replay_scan, prefetch_scan)


_KEEP_SCANS = 16  # compiled replay programs kept; the one used longest ago goes first
_SCANS: collections.OrderedDict = collections.OrderedDict()


def _scan(shapes: tuple, kind: str, *static) -> Callable:
  """The jitted replay scan of ``kind`` for its static options and argument ``shapes``,
  from a table of the ``_KEEP_SCANS`` used last (one compiled program each). JAX keeps a
  program as long as the function it compiled lives, and XLA:CPU maps each program's code
  into memory: jits at module level would keep every (policy, prefetch, size) program of a
  long sweep until the process passes vm.max_map_count and LLVM fails (issue 50's crash,
  here in replay). A scan dropped from the table takes its program with it."""
  key = (shapes, kind, *static)
  fn = _SCANS.pop(key, None)
  if fn is None:
    body = _replay_scan if kind == "replay" else _prefetch_scan
    names = ("policy",) if kind == "replay" else ("policy", "predictor", "width", "cost")
    fn = jax.jit(partial(body, **dict(zip(names, static))))
  _SCANS[key] = fn
  while len(_SCANS) > _KEEP_SCANS:
    _SCANS.popitem(last=False)
    return_free_heap()
  return fn


def _replay_all(trace, policy, cache, ids, bandwidths, prefetch, cost, cache_slots,
                replay_scan, prefetch_scan) -> list[ReplayResult]:
  layers = trace.num_layers
  results = []
  if prefetch is not None:
    width = prefetch.width or trace.top_k
    budget = trace.top_k if prefetch.budget in (None, "link") else prefetch.budget
    candidates = jnp.asarray(
        np.full((trace.num_steps, layers, width), -1, np.int32)
        if prefetch.predictor == "cooccurrence" else _candidates(trace, prefetch.predictor,
                                                                 width))
    for pair in bandwidths:
      out = prefetch_scan(cache, ids, candidates, jnp.asarray(pair, jnp.float32),
                          jnp.asarray(budget, jnp.int32),
                          jnp.asarray(prefetch.decay, jnp.float32))
      hits, fills, host, count, used, wasted, named = (np.asarray(a, np.int64) for a in out)
      results.append(ReplayResult(f"{policy}+{prefetch}", cache_slots, hits, fills, host,
                                  count, used, wasted, named))
    return results
  for pair in bandwidths:
    hits, fills, host = replay_scan(cache, ids, jnp.asarray(pair, jnp.float32))
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
