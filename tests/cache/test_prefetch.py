"""Prefetch: the plan-level function (what it fills, what it never evicts, the used / wasted
marks) and prefetch in trace replay (a perfect predictor leaves only the first layer-step's
misses; the cooccurrence predictor learns a cross-layer map from the ids alone)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.cache.policy import POLICIES, get_policy, plan, prefetch
from ftjax.cache.state import ExpertCache, check_invariants
from ftjax.research import synthetic
from ftjax.research.cost import HardwareProfile, ModelShape
from ftjax.research.replay import Prefetch, replay
from ftjax.research.traces import Trace

EMPTY_START = [p for p, c in POLICIES.items() if c.preload == "none"]


def _cache(slots, layers=3, experts=8):
  return ExpertCache.empty((layers, experts, 1), jnp.float32, slots)


def _plan(cache, layer, ids, policy="lru_fill"):
  return plan(cache, layer, jnp.asarray([ids], jnp.int32), jnp.asarray([10.0, 30.0]),
              get_policy(policy))


@pytest.mark.parametrize("policy", EMPTY_START)
def test_prefetch_fills_predicted_misses_and_spares_the_step_just_planned(policy):
  cache, _ = _plan(_cache(4), 0, [1, 2], policy)  # layer 0 routes 1, 2
  if get_policy(policy).fill_rule != "all":  # q* may leave misses on the host: fill them
    cache = cache.replace(slot_of=cache.slot_of.at[0, 1].set(0).at[0, 2].set(1),
                          owner=cache.owner.at[0].set(1).at[1].set(2),
                          slot_stamp=cache.slot_stamp.at[0].set(cache.clock).at[1].set(
                              cache.clock))
  before = cache
  # Candidates for layer 1: 5, 5 again, 6, 7 with room for 3 of them but only 2 free slots.
  cache, p = prefetch(cache, 1, jnp.asarray([5, 5, 6, -1, 7]), 3, get_policy(policy))
  check_invariants(cache, before)
  assert int(p.count) == 2 and int(p.wasted) == 0
  assert p.fill_expert.tolist()[:2] == [5, 6] and set(p.fill_expert.tolist()[2:]) == {-1}
  assert int(cache.slot_of[1, 5]) >= 0 and int(cache.slot_of[1, 6]) >= 0
  assert int(cache.slot_of[0, 1]) >= 0 and int(cache.slot_of[0, 2]) >= 0  # spared
  assert int(cache.prefetched.sum()) == 2
  assert int(cache.clock) == int(before.clock)  # no layer-step passed
  assert np.array_equal(np.asarray(cache.expert_stamp), np.asarray(before.expert_stamp))
  # The next step of layer 1 routes 5 and 4: 5 is a hit on a prefetched slot (used once).
  cache, q = _plan(cache, 1, [5, 4], policy)
  check_invariants(cache)
  assert int(q.hits) == 1 and int(q.prefetch_used) == 1
  assert int(cache.prefetched.sum()) == 1 - int(q.prefetch_wasted)


def test_an_unused_prefetch_evicted_counts_as_wasted():
  cache = _cache(2, layers=2, experts=4)
  cache, _ = _plan(cache, 0, [0])
  cache, p = prefetch(cache, 1, jnp.asarray([3]), 1, get_policy("lru_fill"))
  assert int(p.count) == 1
  cache, q = _plan(cache, 1, [1])  # mispredicted: 1 fills the free slot
  assert int(q.prefetch_used) == 0 and int(q.prefetch_wasted) == 0
  cache, q = _plan(cache, 0, [2])  # a miss with no free slot: LRU evicts the prefetched 3
  assert int(q.prefetch_wasted) == 1 and int(cache.slot_of[1, 3]) == -1
  assert not bool(cache.prefetched.any())
  check_invariants(cache)


def test_prefetch_holds_back_with_no_room_or_no_budget():
  cache, _ = _plan(_cache(2, layers=2, experts=4), 0, [0, 1])  # both slots just used
  for budget in (0, 2):
    after, p = prefetch(cache, 1, jnp.asarray([2, 3]), budget, get_policy("lru_fill"))
    assert int(p.count) == 0 and after.owner.tolist() == cache.owner.tolist()


def _trace(ids, experts, predicted=None):
  ids = np.asarray(ids, np.int32)
  return Trace.from_arrays(ids, np.full(ids.shape, 1.0 / ids.shape[2]), experts,
                           predicted=predicted)


@pytest.mark.parametrize("policy", ["lru_fill", "freetoken", "class_lru_fill",
                                    "freetoken_cycle"])
def test_a_perfect_predictor_leaves_only_the_first_layer_steps_misses(policy):
  rng = np.random.default_rng(0)
  ids = np.stack([[rng.choice(16, 2, replace=False) for _ in range(3)] for _ in range(40)])
  trace = _trace(ids, 16, predicted=ids)
  base = replay(trace, policy, 6, (10.0, 30.0))
  # A budget of 2 is spent on the first step's own fills (4 misses after the first
  # layer-step); 4 leaves room for the prefetches too.
  two = replay(trace, policy, 6, (10.0, 30.0), prefetch=Prefetch("trace", 2)).misses
  if get_policy(policy).fill_rule == "all":
    assert two[0].sum() == 6 and two[1:].sum() == 0
  result = replay(trace, policy, 6, (10.0, 30.0), prefetch=Prefetch("trace", 4))
  misses = result.misses
  assert misses[0, 0] == 2 and misses.sum() == 2, misses.sum()
  assert base.misses.sum() > 20
  # Each layer-step but the first is prefetched whole, and used before any eviction.
  assert result.prefetched.sum() == base.hits.size * 2 - 2 - (result.hits.sum() -
                                                                result.prefetch_used.sum())
  assert result.prefetch_use_share == 1.0 and result.prefetch_wasted.sum() == 0
  recall = result.recall(trace)  # every layer-step named, but the very first
  assert recall[1:].tolist() == [1.0, 1.0] and recall[0] == pytest.approx(39 / 40)


def test_cooccurrence_learns_a_cross_layer_map_from_the_ids():
  # Layer 0 routes at random; layer l + 1 routes (e + 3) % 32 for each e of layer l: after a
  # few tokens the cooccurrence predictor names layers 1-3.
  rng = np.random.default_rng(1)
  first = np.stack([rng.choice(32, 2, replace=False) for _ in range(300)])
  ids = np.stack([(first + 3 * l) % 32 for l in range(4)], axis=1)
  trace = _trace(ids, 32)
  base = replay(trace, "lru_fill", 16, prefetch=None)
  result = replay(trace, "lru_fill", 16, prefetch=Prefetch("cooccurrence", 4))
  late = slice(100, None)
  assert base.misses[late, 1:].mean() > 1.0  # 16 slots hold ~2 tokens: most routes miss
  # Nearly all: a pair of layer-0 experts that came together often can tie a true successor.
  assert result.misses[late, 1:].sum() <= 0.01 * result.misses[late, 1:].size * 2
  assert result.recall(trace)[1:].min() > 0.9 and result.recall(trace)[0] < 0.2
  # Prefetches for layers 1-3 are used; those for the next token's random layer 0 mostly not.
  assert (result.prefetch_used[late, 1:].sum() / result.prefetched[late, :-1].sum()) > 0.95


def test_modelled_predictions_have_the_recall_asked():
  trace = synthetic.generate(synthetic.qwen3_30b_a3b(), 200, seed=0)
  for recall in (0.0, 0.5, 0.9):
    t = synthetic.with_predictions(trace, recall, seed=2)
    named = (t.predicted[:, :, :, None] == t.ids[:, :, None, :]).any(-1)  # [S, L, K]
    assert abs(named.mean() - recall) < 0.01
    assert all(len(set(r)) == len(r) for r in t.predicted.reshape(-1, t.top_k))  # distinct
  with pytest.raises(ValueError, match="recall"):
    synthetic.with_predictions(trace, 1.5)


def test_prefetch_options_and_the_link_budget():
  ids = np.zeros((4, 2, 1), np.int32)
  trace = _trace(ids, 4)
  with pytest.raises(ValueError, match="predicted ids"):
    replay(trace, "lru_fill", 2, prefetch=Prefetch("trace", 1))
  with pytest.raises(ValueError, match="cost model"):
    replay(trace, "lru_fill", 2, prefetch=Prefetch("last_token"))
  with pytest.raises(ValueError, match="unknown predictor"):
    Prefetch("oracle", 1)
  assert Prefetch.parse("trace@4") == Prefetch("trace", 4)
  assert Prefetch.parse("cooccurrence") == Prefetch("cooccurrence", "link")
  with pytest.raises(ValueError, match="PREDICTOR"):
    Prefetch.parse("trace@many")
  # The link budget: a CPU profile (paths do not overlap) never prefetches.
  hw = HardwareProfile(name="cpu", b_p=10.0, b_h=20.0, device_bw=20.0, layer_overhead_s=0.0,
                       step_overhead_s=0.0, device_memory_gb=1.0, source="test",
                       paths_overlap=False)
  shape = ModelShape(name="s", num_layers=2, num_experts=4, top_k=1, hidden=8, expert_ffn=4,
                     bytes_per_param=2, dense_bytes_per_layer=1e6, head_bytes=1e6)
  ids = np.arange(8).reshape(4, 2, 1) % 4
  result = replay(_trace(ids, 4, ids), "lru_fill", 2, prefetch=Prefetch("trace"),
                  cost=(hw, shape))
  assert result.prefetched.sum() == 0
  overlap = dataclasses.replace(hw, paths_overlap=True)  # 1 MB dense at 20 GB/s idles the link
  result = replay(_trace(ids, 4, ids), "lru_fill", 2, prefetch=Prefetch("trace"),
                  cost=(overlap, shape))
  assert result.prefetched[:, :].sum() == 7 and result.misses.sum() == 1


def test_predictions_survive_save_load_and_slicing(tmp_path):
  ids = np.arange(24).reshape(4, 3, 2) % 8
  trace = _trace(ids, 8, predicted=(ids[:, :, :1] + 1) % 8)
  back = Trace.load(trace.save(tmp_path / "p.npz"))
  np.testing.assert_array_equal(back.predicted, trace.predicted)
  with pytest.raises(ValueError, match="predicted"):
    _trace(ids, 8, predicted=ids[:2])
  with pytest.raises(ValueError, match="predicted ids"):
    _trace(ids, 8, predicted=ids + 8)
