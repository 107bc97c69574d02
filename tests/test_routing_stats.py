"""Routing statistics on hand-made traces whose answers are worked out by hand, and the
per-layer LRU against a request-by-request reference."""

import json

import numpy as np
import pytest

from ftjax.research import routing_stats
from ftjax.research.traces import Trace


def _trace(ids, num_experts=4, phase=None):
  ids = np.asarray(ids)
  return Trace.from_arrays(ids, np.ones(ids.shape, np.float32), num_experts, phase=phase)


def _one_layer(steps, num_experts=4, phase=None):
  """A one-layer trace from a list of route sets."""
  return _trace(np.asarray(steps)[:, None, :], num_experts, phase)


def test_consecutive_overlap_by_hand():
  # Layer 0: {0,1} {1,2} {2,3}: 1 of 2 shared, twice -> 0.5.
  # Layer 1: {0,1} {1,0} {1,0}: 2 of 2, twice -> 1.0.
  # Layer 2: {0,-} {0,1} {3,-}: 1 of 2, then 0 -> 0.25 (an absent route shares nothing).
  trace = _trace([[[0, 1], [0, 1], [0, -1]],
                  [[1, 2], [1, 0], [0, 1]],
                  [[2, 3], [1, 0], [3, -1]]])
  np.testing.assert_allclose(routing_stats.consecutive_overlap(trace), [0.5, 1.0, 0.25])


def test_overlap_pairs_stay_inside_the_phase():
  # Steps: prefill {0,1}, prefill {0,1}, decode {2,3}, decode {2,0}, prefill {2,0}, decode {2,0}.
  trace = _one_layer([[0, 1], [0, 1], [2, 3], [2, 0], [2, 0], [2, 0]],
                     phase=[0, 0, 1, 1, 0, 1])
  # Decode pairs: only (2, 3): {2,3} & {2,0} -> 1/2. Steps 3 and 5 are not adjacent.
  np.testing.assert_allclose(routing_stats.consecutive_overlap(trace), [0.5])
  # Prefill pairs: only (0, 1) -> 2/2.
  np.testing.assert_allclose(routing_stats.consecutive_overlap(trace, phase=0), [1.0])
  # All steps: 2/2, 0, 1/2, 2/2, 2/2 -> 3.5/5.
  np.testing.assert_allclose(routing_stats.consecutive_overlap(trace, phase=None), [0.7])
  # No pair at all: zeros, not NaN.
  np.testing.assert_allclose(routing_stats.consecutive_overlap(_one_layer([[0, 1]])), [0.0])


def test_lru_hit_rate_by_hand():
  # Recency is by step, then route position. Route sets {0,1} {1,2} {0,3} {0,1}:
  #   step 0: cold, 2 misses.
  #   step 1: recency 1 > 0. Expert 1 is the most recent: a hit for sizes 1, 2, 3.
  #   step 2: recency 2 > 1 > 0. Expert 0 is third: a hit for size 3 only.
  #   step 3: recency 3 > 0 > 2 > 1. Expert 0 is second (sizes 2, 3), 1 fourth (none).
  trace = _one_layer([[0, 1], [1, 2], [0, 3], [0, 1]])
  np.testing.assert_allclose(routing_stats.lru_hit_rate(trace, [1, 2, 3, 4]),
                             [[1 / 8], [2 / 8], [3 / 8], [4 / 8]])
  # Excluding a warm-up step: the same hits over 6 routed experts.
  np.testing.assert_allclose(routing_stats.lru_hit_rate(trace, [1, 2, 3], warmup_steps=1),
                             [[1 / 6], [2 / 6], [3 / 6]])
  np.testing.assert_allclose(routing_stats.lru_hit_rate(trace, [0]), [[0.0]])


def test_lru_counts_an_expert_once_per_step():
  # {2,2} is one routed expert; {2,-1} one more; the second step hits it.
  trace = _one_layer([[2, 2], [2, -1], [3, 2]])
  np.testing.assert_allclose(routing_stats.lru_hit_rate(trace, [1, 2]), [[2 / 4], [2 / 4]])


def _reference_lru(ids, size):
  """Request-by-request per-layer LRU (lookups of a step before its insertions): [L]."""
  rates = []
  for layer in range(ids.shape[1]):
    recency, hits, routed = [], 0, 0  # most recent first
    for step in ids[:, layer]:
      experts = list(dict.fromkeys(int(e) for e in step if e >= 0))
      hits += sum(e in recency[:size] for e in experts)
      routed += len(experts)
      for e in experts:  # route order: the last route is the most recent
        if e in recency:
          recency.remove(e)
        recency.insert(0, e)
    rates.append(hits / max(routed, 1))
  return np.array(rates)


@pytest.mark.parametrize("seed", [0, 1])
def test_lru_matches_the_reference_and_size_top_k_is_the_overlap(seed):
  rng = np.random.default_rng(seed)
  steps, layers, top_k, experts = 60, 3, 3, 9
  ids = np.stack([[rng.choice(experts, top_k, replace=False) for _ in range(layers)]
                  for _ in range(steps)])
  ids[rng.random(ids.shape) < 0.1] = -1
  trace = _trace(ids, experts)
  sizes = [1, 2, 3, 5, 9]
  got = routing_stats.lru_hit_rate(trace, sizes)
  for row, size in zip(got, sizes):
    np.testing.assert_allclose(row, _reference_lru(ids, size))
  # With all routes present, a top_k-sized cache holds exactly the previous step.
  full = _trace(np.stack([[rng.choice(experts, top_k, replace=False) for _ in range(layers)]
                          for _ in range(steps)]), experts)
  np.testing.assert_allclose(routing_stats.lru_hit_rate(full, [top_k])[0] * steps / (steps - 1),
                             routing_stats.consecutive_overlap(full))


def test_top_share_by_hand():
  # Selections of expert 0: 4, expert 1: 2, experts 2 and 3: 1 each; 8 in all.
  trace = _one_layer([[0, 1], [0, 2], [0, 3], [0, 1]])
  np.testing.assert_allclose(routing_stats.top_share(trace, 1), [4 / 8])
  np.testing.assert_allclose(routing_stats.top_share(trace, 2), [6 / 8])
  np.testing.assert_allclose(routing_stats.top_share(trace, 4), [1.0])
  # Prefill steps are left out by default.
  trace = _one_layer([[2, 3], [2, 3], [0, 1]], phase=[0, 0, 1])
  np.testing.assert_allclose(routing_stats.top_share(trace, 1), [1 / 2])
  np.testing.assert_allclose(routing_stats.top_share(trace, 2, phase=0), [1.0])


def test_summary_is_json_and_combines_the_statistics():
  trace = _one_layer([[0, 1], [1, 2], [0, 3], [0, 1]], num_experts=16)
  stats = json.loads(json.dumps(routing_stats.summary(trace)))
  assert stats["phase"] == "decode" and stats["steps"] == 4
  assert stats["lru_hit_rate"]["sizes"] == [1, 2, 4, 8]  # 1/16 .. 1/2 of 16 experts
  assert stats["top_share"]["n"] == 2
  np.testing.assert_allclose(stats["lru_hit_rate"]["per_layer"], [[1 / 8], [2 / 8], [4 / 8],
                                                                  [4 / 8]])
  np.testing.assert_allclose(stats["consecutive_overlap"]["mean"], (1 + 0 + 1) / 2 / 3)
  np.testing.assert_allclose(stats["top_share"]["per_layer"], [6 / 8])  # experts 0 and 1: 3 each


def test_bad_arguments_say_what_to_pass():
  trace = _one_layer([[0, 1], [1, 2]])
  with pytest.raises(ValueError, match="phase must be 0"):
    routing_stats.consecutive_overlap(trace, phase=2)
  with pytest.raises(ValueError, match="non-negative"):
    routing_stats.lru_hit_rate(trace, [-1])
  with pytest.raises(ValueError, match="non-negative"):
    routing_stats.top_share(trace, -1)
