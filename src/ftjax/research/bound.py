"""An upper bound on the hits of every online cache policy, on a synthetic trace.

Belady's bound (``replay.belady_misses``) knows the routing to come, so it says little about
what an online policy, which must guess it, can still gain. A trace of
``ftjax.research.synthetic`` comes with the law of each of its steps given the steps before
(``synthetic.next_step_probabilities``: p[t, l, e], the chance that step t routes layer l to
expert e), and that bounds every online policy:

* Every ftjax policy fills only misses of the layer-step it plans (demand fills: ``plan``
  copies in nothing that was not just routed). So the experts of layer l that are cached when
  step t reaches layer l entered at a visit of layer l no later than step t-1 and stayed:
  they were all in the cache at the end of step t-1. Together the layers' sets hold at most
  C experts (C = the cache slots).
* Layer l's expected hits at step t are the sum of p[t, l, e] over its cached experts. The
  generator's layers are independent, so what step t routed at earlier layers does not change
  p[t, l], whatever the policy saw of it.
* So the expected hits of step t are at most the sum of the C largest p[t, l, e] over all
  (l, e), and no online policy's expected miss rate is below
  ``1 - sum_t top_C(p[t]) / (experts routed)``: ``OnlineBound.miss_rate``.

p is a Monte Carlo estimate; the sum of the C largest estimates is biased upward (noise
lifts some values over the C-th), so the estimate errs toward too many hits, that is toward a
lower miss rate, the safe side for saying that a target is out of reach.

The *prescient* placement holds at every step the C experts with the largest p, rearranged
for free between steps (no real cache can): its realised hits show how close the bound is to
something a placement can reach on the trace, and ``best_split`` gives its layer-steps the
split of misses into fills and host runs that the cost model finds fastest, so that its
modeled tok/s bounds (up to sampling) what knowing the trace's law could be worth.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ftjax.research.cost import HardwareProfile, ModelShape, layer_step_time
from ftjax.research.traces import Trace


@dataclasses.dataclass
class OnlineBound:
  cache_slots: int
  routed: np.ndarray  # [S, L] distinct experts routed per layer-step
  bound_hits: np.ndarray  # [S] the upper bound on a step's expected hits (sum of top-C p)
  prescient_hits: np.ndarray  # [S, L] hits of the prescient placement

  @property
  def miss_rate(self) -> float:
    """The least expected miss rate of an online (demand-fill) policy."""
    total = self.routed.sum()
    return float(1.0 - self.bound_hits.sum() / total) if total else 0.0

  @property
  def prescient_miss_rate(self) -> float:
    total = self.routed.sum()
    return float(1.0 - self.prescient_hits.sum() / total) if total else 0.0

  @property
  def per_layer_prescient_miss_rate(self) -> np.ndarray:
    total = self.routed.sum(0)
    return np.where(total > 0, 1.0 - self.prescient_hits.sum(0) / np.maximum(total, 1), 0.0)


def online_bound(trace: Trace, probabilities: np.ndarray, cache_slots: int) -> OnlineBound:
  """The bound and the prescient placement with ``cache_slots`` slots, from
  ``probabilities`` [S, L, E] (``synthetic.next_step_probabilities(trace)``)."""
  steps, layers, experts = trace.num_steps, trace.num_layers, trace.num_experts
  p = np.asarray(probabilities, np.float64)
  if p.shape != (steps, layers, experts):
    raise ValueError(f"probabilities must be [steps, layers, experts] = {(steps, layers, experts)}"
                     f" for this trace, got {p.shape}")
  total = layers * experts
  if not 0 <= cache_slots <= total:
    raise ValueError(f"cache_slots must be in [0, {total}], got {cache_slots}")
  routed_mask = np.zeros((steps, layers, experts), bool)
  valid = trace.ids >= 0
  s, l, _ = np.nonzero(valid)
  routed_mask[s, l, trace.ids[valid]] = True
  routed = routed_mask.sum(-1)
  if cache_slots == 0:
    return OnlineBound(0, routed, np.zeros(steps), np.zeros((steps, layers), np.int64))
  flat = p.reshape(steps, total)
  top = np.argpartition(-flat, cache_slots - 1, axis=1)[:, :cache_slots]  # [S, C]
  bound_hits = np.take_along_axis(flat, top, 1).sum(1)
  hit = np.take_along_axis(routed_mask.reshape(steps, total), top, 1)  # [S, C]
  prescient = np.zeros((steps, layers), np.int64)
  rows = np.broadcast_to(np.arange(steps)[:, None], top.shape)
  np.add.at(prescient, (rows[hit], top[hit] // experts), 1)
  return OnlineBound(cache_slots, routed, bound_hits, prescient)


def best_split(hw: HardwareProfile, shape: ModelShape, hits, misses
               ) -> tuple[np.ndarray, np.ndarray]:
  """(fills, host runs) of each layer-step: the split of its ``misses`` that the cost model
  (``layer_step_time``) finds fastest given its ``hits``, ties to more fills. Elementwise
  over equal-shaped integer arrays."""
  hits = np.asarray(hits, np.int64)
  misses = np.asarray(misses, np.int64)
  if hits.shape != misses.shape:
    raise ValueError(f"hits and misses must have equal shapes, got {hits.shape} and "
                     f"{misses.shape}")
  if (hits < 0).any() or (misses < 0).any():
    raise ValueError("expert counts must be >= 0")
  most = int(misses.max(initial=0))
  q = np.arange(most + 1).reshape((-1,) + (1,) * misses.ndim)  # [Q, ...]
  fills = np.minimum(q, misses)
  times = layer_step_time(hw, shape, np.broadcast_to(hits, fills.shape), fills, misses - fills)
  times = np.where(q <= misses, times, np.inf)
  best = (most - np.argmin(times[::-1], axis=0))  # the last minimum: the most fills
  return best, misses - best
