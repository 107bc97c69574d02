"""Routing statistics of a trace: temporal reuse, per-layer LRU hit rates, popularity skew.

Pure numpy over a ``ftjax.research.traces.Trace``. They calibrate the synthetic routing generator
(``ftjax.research.synthetic``) against published statistics and describe the routing of any
captured trace (the model card of a trained model, for instance).

Every function looks at the steps of one phase, decode (``phase=1``) by default; pass
``phase=0`` for prefill or ``phase=None`` for all steps. An expert counts once per step and
layer however many of the step's routes chose it; ``-1`` routes are ignored.

  stats = summary(trace)                 # JSON-serialisable dict
  consecutive_overlap(trace)             # [L] fraction of top_k shared by consecutive steps
  lru_hit_rate(trace, sizes=(8, 16))     # [2, L] hit rate of a per-layer LRU
  top_share(trace, 16)                   # [L] share of selections of the 16 most selected
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ftjax.research.traces import Trace

DECODE = 1
PREFILL = 0
_CHUNK = 1024  # steps per block where a [steps, L, E] membership array is built


def _selected_steps(trace: Trace, phase: int | None) -> np.ndarray:
  """The step indices of ``phase`` (all steps for ``None``): [S'] int."""
  if phase is None:
    return np.arange(trace.num_steps)
  if phase not in (PREFILL, DECODE):
    raise ValueError(f"phase must be 0 (prefill), 1 (decode) or None (all steps), got {phase!r}")
  return np.flatnonzero(trace.phase == phase)


def _membership(ids: np.ndarray, num_experts: int) -> np.ndarray:
  """Which experts each step-layer routed to: ids [S, L, K] -> [S, L, E] bool."""
  steps, layers, _ = ids.shape
  member = np.zeros((steps, layers, num_experts + 1), bool)  # column E absorbs the -1 routes
  s, l = np.indices(ids.shape[:2])
  member[s[..., None], l[..., None], np.where(ids >= 0, ids, num_experts)] = True
  return member[..., :num_experts]


def consecutive_overlap(trace: Trace, *, phase: int | None = DECODE) -> np.ndarray:
  """Per layer, the mean over consecutive step pairs ``(t, t+1)`` of
  ``|experts(t) ∩ experts(t+1)| / top_k``: [L] float64 in [0, 1].

  A pair counts only when both steps are adjacent in the trace and belong to ``phase``, so
  the first decode step is not paired with the last prefill step (nor the steps of two
  requests concatenated in one trace across a prefill). Layers get 0 when no pair exists.
  """
  steps = _selected_steps(trace, phase)
  pairs = steps[:-1][np.diff(steps) == 1]  # t with t and t+1 both in the phase
  if len(pairs) == 0:
    return np.zeros(trace.num_layers)
  shared = np.zeros(trace.num_layers, np.int64)
  for start in range(0, len(pairs), _CHUNK):  # bounded memory: [chunk, L, E] at a time
    chunk = pairs[start:start + _CHUNK]
    shared += (_membership(trace.ids[chunk], trace.num_experts)
               & _membership(trace.ids[chunk + 1], trace.num_experts)).sum((0, 2))
  return shared / (len(pairs) * trace.top_k)


def lru_hit_rate(trace: Trace, sizes: Sequence[int], *, phase: int | None = DECODE,
                 warmup_steps: int = 0) -> np.ndarray:
  """Hit rate of a separate LRU cache of ``size`` experts per layer: [len(sizes), L] float64.

  Each layer has its own cache (the per-layer statistic of the expert-offloading literature,
  not ftjax's global cache shared by all layers). A step's distinct experts are looked up
  before any of them is inserted, and a fill never evicts an expert of the same step (as the
  engine's plan does): an expert is a hit exactly when it is among the ``size`` most
  recently routed distinct experts of its layer before this step. Recency is by step, then
  by route position within the step. With ``size >= top_k`` a size-``top_k`` cache therefore
  hits exactly the experts shared with the previous step.

  The cache sees only the steps of ``phase`` and starts cold (empty): first uses are misses.
  ``warmup_steps`` of those steps update the caches but are not counted (default 0: the
  hit rate is counted from a cold start). The rate is hits over routed distinct experts.
  """
  sizes = np.asarray(sizes, np.int64).reshape(-1)
  if sizes.size and sizes.min() < 0:
    raise ValueError(f"LRU sizes must be non-negative, got {sizes.tolist()}")
  if warmup_steps < 0:
    raise ValueError(f"warmup_steps must be non-negative, got {warmup_steps}")
  ids = trace.ids[_selected_steps(trace, phase)]  # [S, L, K]
  steps, layers, top_k = ids.shape
  hits = np.zeros((len(sizes), layers), np.int64)
  routed = np.zeros(layers, np.int64)
  never = np.iinfo(np.int64).min
  last_use = np.full((layers, trace.num_experts), never, np.int64)  # recency stamp per expert
  rows = np.arange(layers)[:, None]
  for t in range(steps):
    step_ids = ids[t]  # [L, K]
    # Count each expert once per step: later duplicates of an id in a row become absent.
    order = np.argsort(step_ids, axis=1, kind="stable")
    sorted_ids = np.take_along_axis(step_ids, order, 1)
    repeat = np.zeros_like(step_ids, bool)
    np.put_along_axis(repeat, order[:, 1:], sorted_ids[:, 1:] == sorted_ids[:, :-1], 1)
    valid = (step_ids >= 0) & ~repeat  # [L, K]
    safe = np.where(valid, step_ids, 0)
    stamp = last_use[rows, safe]  # [L, K]
    # Recency rank: how many distinct experts were routed more recently; < size means cached.
    rank = (last_use[:, None, :] > stamp[:, :, None]).sum(-1)  # [L, K]
    counted = valid & (stamp != never) & (t >= warmup_steps)
    hits += (counted[None] & (rank[None] < sizes[:, None, None])).sum(-1)
    if t >= warmup_steps:
      routed += valid.sum(1)
    routed_rows, routed_cols = np.nonzero(valid)
    last_use[routed_rows, step_ids[routed_rows, routed_cols]] = t * top_k + routed_cols
  return hits / np.maximum(routed, 1)[None]


def top_share(trace: Trace, n: int, *, phase: int | None = DECODE) -> np.ndarray:
  """Per layer, the share of the layer's selections taken by its ``n`` most-selected experts:
  [L] float64 in [0, 1] (0 for a layer with no selection)."""
  if n < 0:
    raise ValueError(f"n must be non-negative, got {n}")
  steps = _selected_steps(trace, phase)
  counts = np.zeros((trace.num_layers, trace.num_experts), np.int64)
  for start in range(0, len(steps), _CHUNK):  # bounded memory: [chunk, L, E] at a time
    counts += _membership(trace.ids[steps[start:start + _CHUNK]], trace.num_experts).sum(0)
  top = -np.sort(-counts, axis=1)[:, :n].sum(1)
  total = counts.sum(1)
  return np.where(total > 0, top / np.maximum(total, 1), 0.0)


def default_sizes(num_experts: int) -> tuple[int, ...]:
  """LRU sizes 1/16, 1/8, 1/4 and 1/2 of the experts (8, 16, 32, 64 of 128), each >= 1."""
  return tuple(sorted({max(1, num_experts // d) for d in (16, 8, 4, 2)}))


def summary(trace: Trace, *, sizes: Sequence[int] | None = None, top_n: int | None = None,
            phase: int | None = DECODE, warmup_steps: int = 0) -> dict[str, Any]:
  """All statistics of ``trace`` in one JSON-serialisable dict.

  ``sizes`` default to ``default_sizes(num_experts)``; ``top_n`` to an eighth of the experts
  (16 of 128). Per-layer values are lists indexed by layer; ``mean`` is the unweighted mean
  over layers (as the published per-layer averages are).
  """
  sizes = tuple(int(s) for s in (default_sizes(trace.num_experts) if sizes is None else sizes))
  top_n = max(1, trace.num_experts // 8) if top_n is None else int(top_n)
  overlap = consecutive_overlap(trace, phase=phase)
  lru = lru_hit_rate(trace, sizes, phase=phase, warmup_steps=warmup_steps)
  share = top_share(trace, top_n, phase=phase)
  return {
      "phase": {None: "all", PREFILL: "prefill", DECODE: "decode"}[phase],
      "steps": int(len(_selected_steps(trace, phase))),
      "num_layers": trace.num_layers,
      "num_experts": trace.num_experts,
      "top_k": trace.top_k,
      "consecutive_overlap": {"mean": float(overlap.mean()), "per_layer": overlap.tolist()},
      "lru_hit_rate": {"sizes": list(sizes), "warmup_steps": warmup_steps,
                       "cold_start": warmup_steps == 0,
                       "mean": lru.mean(1).tolist(), "per_layer": lru.tolist()},
      "top_share": {"n": top_n, "mean": float(share.mean()), "min": float(share.min()),
                    "max": float(share.max()), "per_layer": share.tolist()},
  }
