"""The online bound: the synthetic generator's next-step law equals the hand-derived one, no
policy beats the bound (and Belady beats it), the prescient placement reaches it, the best
split is the cost model's minimum, and the sweep's bound rows are those of the module."""

import dataclasses

import numpy as np
import pytest

from ftjax.cache import POLICIES
from ftjax.research import bound, cost, sweep, synthetic

# One layer of 3 experts, top-1, uniform popularity, no working set: after step t-1 routed
# expert a, step t keeps a with chance r, or else draws one of the other two evenly.
R = 0.6
TINY = synthetic.RoutingModel(num_layers=1, num_experts=3, top_k=1, skew=0.0, reuse=R,
                              working_set=0.0, working_set_decay=0.5, prefill_reuse=R,
                              prefill_shift=0.0)
SMALL = synthetic.RoutingModel(num_layers=4, num_experts=8, top_k=2, skew=0.6, reuse=0.35,
                               working_set=0.1, working_set_decay=0.8, prefill_reuse=0.35,
                               prefill_shift=0.3, drift=0.3, task_steps=60)
SHAPE = cost.ModelShape(name="small", num_layers=4, num_experts=8, top_k=2, hidden=64,
                        expert_ffn=32, bytes_per_param=2, dense_bytes_per_layer=1e5,
                        head_bytes=2e5)


def _hw(b_p, b_h, overlap=True):
  return cost.HardwareProfile(name=f"{b_p}-{b_h}", b_p=b_p, b_h=b_h, device_bw=500.0,
                              layer_overhead_s=1e-5, step_overhead_s=1e-4,
                              device_memory_gb=8.0, source="test", paths_overlap=overlap)


@pytest.fixture(scope="module")
def small():
  trace = synthetic.generate(SMALL, 400, seed=5, prefill_steps=8)
  return trace, synthetic.next_step_probabilities(trace, samples=512)


def test_next_step_law_is_the_hand_derived_one():
  trace = synthetic.generate(TINY, 60, seed=1)
  law = synthetic.next_step_probabilities(trace, samples=20000)
  exact = np.full((60, 1, 3), (1 - R) / 2)
  exact[0] = 1 / 3  # nothing routed before: the (uniform) popularity
  previous = trace.ids[:-1, 0, 0]
  exact[np.arange(1, 60), 0, previous] = R
  assert np.abs(law - exact).max() < 5 * 0.5 / np.sqrt(20000)  # 5 standard errors
  assert np.allclose(law.sum(-1), 1.0)
  # The bound with one slot: the likeliest expert at every step, max(R, (1 - R) / 2) = R.
  b = bound.online_bound(trace, exact, 1)
  assert b.miss_rate == pytest.approx(1 - (1 / 3 + 59 * R) / 60)


def test_the_law_follows_the_trace_and_tasks(small):
  trace, law = small
  assert law.shape == (trace.num_steps, 4, 8)
  assert np.allclose(law.sum(-1), 2.0)
  routed = np.zeros(law.shape, bool)
  np.put_along_axis(routed, trace.ids, True, -1)
  # Routed experts were likelier than the others (reuse and popularity both predict).
  assert law[routed].mean() > law[~routed].mean() + 0.05
  # The same trace gives the same law; another sampling seed only other noise.
  again = synthetic.next_step_probabilities(trace, samples=512)
  assert np.array_equal(law, again)
  other = synthetic.next_step_probabilities(trace, samples=512, seed=1)
  assert 0 < np.abs(law - other).max() < 0.15


def test_no_policy_beats_the_bound_and_belady_does(small):
  trace, law = small
  total = trace.num_layers * trace.num_experts
  for slots in (1, total // 3, total // 2, total - 1):
    b = bound.online_bound(trace, law, slots)
    requests = int(b.routed.sum())
    # Realised misses scatter around their expectation: 0.02 is > 3 standard deviations
    # over these ~3300 routed experts. Belady may choose its first contents, as the bound does.
    assert sweep.belady_misses(trace, slots, preload=True) / requests <= b.miss_rate + 0.02
    # The prescient placement realises about the bound.
    assert b.prescient_miss_rate == pytest.approx(b.miss_rate, abs=0.03)
    if slots == total // 3:  # every policy (a compile each: one size)
      for policy in POLICIES:
        if policy == "static_hot":  # its profile here is the replayed trace's own (an oracle)
          continue
        replayed = sweep.replay(trace, policy, slots, (10.0, 20.0))
        assert replayed.miss_rate >= b.miss_rate - 0.02, policy
  empty, full = bound.online_bound(trace, law, 0), bound.online_bound(trace, law, total)
  assert empty.miss_rate == empty.prescient_miss_rate == 1.0
  assert full.miss_rate == pytest.approx(0.0, abs=1e-6) and full.prescient_miss_rate == 0.0


@pytest.mark.parametrize("hw", [_hw(10.0, 40.0), _hw(30.0, 40.0), _hw(50.0, 40.0),
                                _hw(10.0, 40.0, overlap=False)])
def test_best_split_is_the_cost_models_minimum(hw):
  rng = np.random.default_rng(0)
  hits = rng.integers(0, 4, (50, 4))
  misses = rng.integers(0, 9, (50, 4))
  fills, host = bound.best_split(hw, SHAPE, hits, misses)
  assert np.array_equal(fills + host, misses) and (fills >= 0).all() and (host >= 0).all()
  best = cost.layer_step_time(hw, SHAPE, hits, fills, host)
  for q in range(9):
    f = np.minimum(q, misses)
    assert (best <= cost.layer_step_time(hw, SHAPE, hits, f, misses - f) + 1e-15).all()


def test_sweep_rows_are_the_modules(small):
  trace, _ = small
  hw = [_hw(10.0, 40.0), _hw(40.0, 40.0)]
  rows = sweep.sweep({"s": trace}, ["freetoken"], [0.25, 0.5], hw, {"s": SHAPE},
                     progress=False, belady=False, bound_samples=64)
  law = synthetic.next_step_probabilities(trace, samples=64)
  for fraction in (0.25, 0.5):
    b = bound.online_bound(trace, law, int(round(fraction * 32)))
    at = [r for r in rows if r.cache_fraction == fraction]
    assert [r.policy for r in at] == ["freetoken"] * 2 + [sweep.ONLINE_BOUND] + \
        [sweep.PRESCIENT] * 2
    assert at[2].miss_rate == pytest.approx(b.miss_rate) and at[2].hardware == ""
    for row, h in zip(at[3:], hw):
      assert row.miss_rate == pytest.approx(b.prescient_miss_rate)
      misses = b.routed - b.prescient_hits
      fills, host = bound.best_split(h, SHAPE, b.prescient_hits, misses)
      decode = trace.phase == 1
      expected = 1 / np.mean(cost.step_times(h, SHAPE, b.prescient_hits[decode],
                                             fills[decode], host[decode]))
      assert row.modeled_tok_s == pytest.approx(expected)
  # A trace of no known law gets no bound rows.
  plain = dataclasses.replace(trace, metadata={})
  rows = sweep.sweep({"p": plain}, ["freetoken"], [0.5], hw, {"p": SHAPE}, progress=False,
                     belady=False, bound_samples=64)
  assert {r.policy for r in rows} == {"freetoken"}


def test_errors_name_the_problem(small):
  trace, law = small
  with pytest.raises(ValueError, match="not sampled by ftjax.research.synthetic"):
    synthetic.next_step_probabilities(dataclasses.replace(trace, metadata={}))
  head, tail = sweep.split_warmup(trace, 0.25)
  with pytest.raises(ValueError, match="follows the first 102 steps of a generated trace"):
    synthetic.next_step_probabilities(tail)
  assert synthetic.next_step_probabilities(head, samples=64).shape == (102, 4, 8)
  with pytest.raises(ValueError, match="samples must be positive"):
    synthetic.next_step_probabilities(trace, samples=0)
  with pytest.raises(ValueError, match="probabilities must be"):
    bound.online_bound(trace, law[1:], 4)
  with pytest.raises(ValueError, match="cache_slots must be in"):
    bound.online_bound(trace, law, 33)
  with pytest.raises(ValueError, match="equal shapes"):
    bound.best_split(_hw(1.0, 2.0), SHAPE, np.zeros(3, int), np.zeros(4, int))
