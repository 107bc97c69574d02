"""Plan functions: q* worked examples, the fill/victim rules, and properties on random
routing streams (hypothesis)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ftjax.cache import POLICIES, ExpertCache, fill_count, get_policy, plan
from ftjax.cache import policy as policy_lib
from ftjax.cache.policy import CYCLE_DECAY
from ftjax.cache.state import check_invariants

import tolerances

BW = jnp.array([12.0, 24.0])


@pytest.mark.parametrize("m, b_p, b_h, q", [
    (2, 12.0, 24.0, 1),  # the paper's first example
    (3, 4.0, 8.0, 2),    # q* = 1.5, both roundings cost 0.5 s for 1 GB experts: ties go up
    (4, 11.8, 47.5, 1),  # RTX 4060 laptop: q* = 0.99
    (8, 52.7, 77.3, 6),  # q* = 5.45: 6 -> max(0.114, 0.081) beats 5 -> max(0.095, 0.122)
    (5, 30.0, 30.0, 5),  # B_P >= B_H fills everything
    (5, 40.0, 30.0, 5),
    (0, 12.0, 24.0, 0),
])
def test_fill_count(m, b_p, b_h, q):
  assert int(fill_count(m, b_p, b_h)) == q


def test_fill_count_minimises_the_slower_path():
  rng = np.random.default_rng(0)
  for _ in range(200):
    m = int(rng.integers(0, 17))
    b_h = float(rng.uniform(10, 200))
    b_p = float(rng.uniform(1, b_h * 0.99))
    q = int(fill_count(m, b_p, b_h))
    cost = lambda q: max(q / b_p, (m - q) / (b_h - b_p))  # noqa: E731
    best = min(cost(c) for c in range(m + 1))
    assert cost(q) <= best * (1 + tolerances.F32)
    assert abs(q - m * b_p / b_h) < 1 + tolerances.F32_ROUNDING


def _cache(slots, layers=2, experts=8, block=4):
  return ExpertCache.empty((layers, experts, block), jnp.float32, slots)


def _step(cache, layer, ids, policy="lru_fill", bw=BW):
  return plan(cache, layer, jnp.asarray(ids, jnp.int32), bw, get_policy(policy))


def test_fills_take_lru_slots_and_most_recent_misses_first():
  cache = _cache(3)
  cache, _ = _step(cache, 0, [[1, 2]])  # slots 0, 1 <- e1, e2 (empty slots first, low id)
  cache, _ = _step(cache, 1, [[5, -1]])  # slot 2 <- (1, e5)
  cache, p = _step(cache, 0, [[2, 3]])  # hit e2; e3 misses: victim is the LRU unused slot 0
  assert int(p.hits) == 1 and int(p.fills) == 1
  assert p.fill_slot.tolist()[:1] == [0] and p.fill_expert.tolist()[:1] == [3]
  assert int(cache.slot_of[0, 1]) == -1 and int(cache.slot_of[0, 3]) == 0
  # freetoken with m=2, B_P/B_H = 1/2 fills one: the more recently routed miss (e1, routed at
  # clock 1) before e7 (never routed), although 7 > 1 only matters for ties.
  cache, p = _step(cache, 0, [[7, 1]], "freetoken")
  assert int(p.fills) == 1 and p.fill_expert.tolist()[0] == 1 and int(p.host) == 1
  check_invariants(cache)


def test_ties_in_recency_go_to_the_lower_expert_id():
  cache, p = _step(_cache(1), 0, [[6, 4]])  # both never routed: e4 is filled
  assert p.fill_expert.tolist() == [4] and p.route_slot.tolist() == [[-1, 0]]


def test_a_prefill_step_fills_its_most_routed_misses():
  """Several tokens: the misses most of them route to are filled first (here 1 slot:
  e6, routed by three tokens, over e2, routed by one but more recently before the step);
  equal counts fall back to recency, then the lower id."""
  cache = _cache(1)
  cache, _ = _step(cache, 0, [[2, -1]], "cpu_only")  # e2 routed (not filled): more recent
  cache, p = _step(cache, 0, [[2, 6], [6, 5], [6, 3]])
  assert p.fill_expert.tolist() == [6] and int(p.host) == 3
  cache, p = _step(_cache(2), 0, [[2, 7], [7, 2], [4, 5]])  # e2, e7 twice: both filled
  assert sorted(p.fill_expert.tolist()) == [2, 7]
  cache = _cache(1)
  cache, _ = _step(cache, 0, [[5, -1]], "cpu_only")
  cache, p = _step(cache, 0, [[3, 5], [1, 6]])  # all once: e5 (recent), not the lower e1
  assert p.fill_expert.tolist() == [5]
  cache, p = _step(_cache(1), 0, [[6, 3], [1, 4]])  # all once, never routed: e1
  assert p.fill_expert.tolist() == [1]


def test_a_slot_used_in_this_step_is_never_evicted():
  cache = _cache(2)
  cache, _ = _step(cache, 0, [[0, 1]])
  cache, p = _step(cache, 0, [[0, 1], [2, 3]])  # 2 hits fill the cache: misses go to the host
  assert int(p.hits) == 2 and int(p.fills) == 0 and int(p.host) == 2
  assert p.route_slot.tolist() == [[0, 1], [-1, -1]]


def test_duplicates_across_a_batch_count_once():
  cache, p = _step(_cache(4), 0, [[3, 5], [5, 3], [3, -1]])
  assert int(p.fills) == 2 and int(p.hits) == 0
  assert sorted(p.fill_expert.tolist()[:2]) == [3, 5]


def test_zero_slots_runs_everything_on_the_host():
  cache, p = _step(_cache(0), 1, [[3, 5]])
  assert p.route_slot.tolist() == [[-1, -1]] and int(p.host) == 2 and int(p.fills) == 0


def test_static_policies_never_fill_or_evict():
  bank = jnp.arange(2 * 8 * 4, dtype=jnp.float32).reshape(2, 8, 4)
  cache = ExpertCache.preloaded(bank, 3, [1, 9, 4])  # (0,1), (1,1), (0,4)
  for name in ("cpu_only", "static_hot", "static_layers"):
    new, p = _step(cache, 0, [[1, 2], [4, 7]], name)
    assert int(p.fills) == 0 and int(p.hits) == 2 and int(p.host) == 2
    assert p.route_slot.tolist() == [[0, -1], [2, -1]]
    np.testing.assert_array_equal(new.owner, cache.owner)


def test_preloaded_slots_hold_the_bank_blocks():
  bank = jnp.arange(2 * 8 * 4, dtype=jnp.float32).reshape(2, 8, 4)
  cache = ExpertCache.preloaded(bank, 4, [9, 2])
  np.testing.assert_array_equal(cache.slots[0], bank[1, 1])
  np.testing.assert_array_equal(cache.slots[1], bank[0, 2])
  check_invariants(cache)


routing = st.lists(st.lists(st.integers(-1, 7), min_size=6, max_size=6), min_size=1,
                   max_size=30)


@settings(max_examples=8, deadline=None)
@given(stream=routing, slots=st.integers(0, 10), policy=st.sampled_from(list(POLICIES)),
       b_p=st.floats(1.0, 60.0))
def test_skipping_idle_victim_searches_changes_nothing(stream, slots, policy, b_p):
  """plan(skip_idle=True) (the replays') equals the engine's plan step for step."""
  step = jax.jit(plan, static_argnames=("policy", "skip_idle"))
  a = b = _cache(slots)
  bw = jnp.array([b_p, 30.0], jnp.float32)
  for i, row in enumerate(stream):
    ids = jnp.asarray(row, jnp.int32).reshape(3, 2)
    a, pa = step(a, i % 2, ids, bw, policy=get_policy(policy))
    b, pb = step(b, i % 2, ids, bw, policy=get_policy(policy), skip_idle=True)
    for x, y in zip(jax.tree.leaves((a, pa)), jax.tree.leaves((b, pb))):
      np.testing.assert_array_equal(x, y)


@settings(max_examples=40, deadline=None)
@given(stream=routing, slots=st.integers(0, 10), policy=st.sampled_from(list(POLICIES)),
       b_p=st.floats(1.0, 100.0), b_h=st.floats(1.0, 100.0))
def test_invariants_hold_on_random_streams(stream, slots, policy, b_p, b_h):
  step = jax.jit(plan, static_argnames="policy")
  cache = _cache(slots)
  bw = jnp.array([b_p, b_h], jnp.float32)
  for i, row in enumerate(stream):
    layer = i % 2
    ids = jnp.asarray(row, jnp.int32).reshape(3, 2)
    before = cache
    cache, p = step(cache, layer, ids, bw, policy=get_policy(policy))
    check_invariants(cache, before)
    selected = {e for e in row if e >= 0}
    hits = {e for e in selected if int(before.slot_of[layer, e]) >= 0}
    assert int(p.hits) == len(hits) and int(p.fills) + int(p.host) == len(selected - hits)
    # A slot used by a hit in this step keeps its expert.
    for e in hits:
      assert int(cache.slot_of[layer, e]) == int(before.slot_of[layer, e])
    # Every device route reads the slot that holds its expert after the step.
    rs = np.asarray(p.route_slot)
    for (t, k), s in np.ndenumerate(rs):
      if s >= 0:
        assert int(cache.owner[s]) == layer * 8 + int(ids[t, k])
    # Victims are the lowest-ranked of the slots this step did not use: least recently used,
    # or for LRFU, lowest decayed count (empty slots first in both).
    filled = [s for s in np.asarray(p.fill_slot) if s >= 0]
    if filled:
      unused = [s for s in range(slots) if s not in
                {int(before.slot_of[layer, e]) for e in hits}]
      replacement, decay = get_policy(policy).replacement, get_policy(policy).decay
      if replacement != "lru":
        rank = {s: _victim_log_value(before, s, layer, replacement, decay) for s in unused}
        want = sorted(rank.values())[:len(filled)]
        np.testing.assert_allclose(sorted(rank[s] for s in filled), want, rtol=tolerances.F32)
      else:
        stamps = sorted(int(before.slot_stamp[s]) for s in unused)
        assert sorted(int(before.slot_stamp[s]) for s in filled) == stamps[:len(filled)]


def _lrfu_log_value(cache, slot, decay):
  """log(score · decay^(steps since its last selection)) of a slot's owner, at the next
  clock (the one the plan runs at); -inf for an empty slot. float64 reference."""
  owner = int(cache.owner[slot])
  if owner < 0:
    return -np.inf
  layers, experts = cache.slot_of.shape
  score = float(cache.expert_score.reshape(-1)[owner])
  age = int(cache.clock) + 1 - int(cache.expert_stamp.reshape(-1)[owner])
  return np.log(score) + age * np.log(decay) / layers


def _victim_log_value(cache, slot, layer, replacement, decay):
  """The log value a replacement keeps a slot by (lowest evicted first), float64 reference:
  lrfu as ``_lrfu_log_value``; cycle: decay^(visits of the owner's layer since the slot's
  last use) per layer-step until that layer's next visit; lrfu_cycle: the LRFU value at the
  next visit per layer-step until it; class and class_cycle below. -inf for an empty slot."""
  owner = int(cache.owner[slot])
  if owner < 0:
    return -np.inf
  layers, experts = cache.slot_of.shape
  until = (owner // experts - layer - 1) % layers + 1
  if replacement == "lrfu":
    return _lrfu_log_value(cache, slot, decay)
  if replacement == "cycle":
    unused_visits = (int(cache.clock) - int(cache.slot_stamp[slot])) // layers
    return unused_visits * np.log(decay) - np.log(until)
  if replacement in ("class", "class_cycle"):
    # class-LRU: 2^class / age kept, class = floor(log2) of the owner's decayed count (0
    # below 1), age the layer-steps since the slot's last use at the plan's clock;
    # class_cycle: 2^class times cycle's reuse chance (CYCLE_DECAY) per layer-step until use.
    with np.errstate(divide="ignore"):
      klass = max(np.floor(_lrfu_log_value(cache, slot, decay) / np.log(2.0)), 0.0)
    if replacement == "class":
      age = max(int(cache.clock) + 1 - int(cache.slot_stamp[slot]), 1)
      return klass * np.log(2.0) - np.log(age)
    unused_visits = (int(cache.clock) - int(cache.slot_stamp[slot])) // layers
    return klass * np.log(2.0) + unused_visits * np.log(CYCLE_DECAY) - np.log(until)
  assert replacement == "lrfu_cycle", replacement
  return (_lrfu_log_value(cache, slot, decay) + (until - 1) * np.log(decay) / layers -
          np.log(until))


@settings(max_examples=15, deadline=None)
@given(stream=st.lists(st.lists(st.integers(0, 7), min_size=4, max_size=4), min_size=1,
                       max_size=8))
def test_lru_fill_with_enough_slots_ends_with_no_misses_on_a_repeated_stream(stream):
  cache = _cache(16)
  step = jax.jit(plan, static_argnames="policy")
  for _ in range(2):
    misses = 0
    for i, row in enumerate(stream):
      cache, p = step(cache, i % 2, jnp.asarray(row, jnp.int32).reshape(2, 2), BW,
                      policy=get_policy("lru_fill"))
      misses += int(p.misses)
  assert misses == 0


def test_no_retrace_per_step():
  traces = []

  def counted(cache, layer, ids, bw):
    traces.append(1)
    return plan(cache, layer, ids, bw, get_policy("freetoken"))

  step = jax.jit(counted)
  cache = _cache(4)
  rng = np.random.default_rng(0)
  for i in range(10):
    cache, _ = step(cache, i % 2, jnp.asarray(rng.integers(0, 8, (1, 2)), jnp.int32), BW)
  assert len(traces) == 1


def test_plan_runs_inside_lax_scan():
  stream = jnp.asarray(np.random.default_rng(1).integers(0, 8, (12, 1, 2)), jnp.int32)

  def body(cache, ids):
    cache, p = plan(cache, 0, ids, BW, get_policy("freetoken"))
    return cache, p.hits

  cache, hits = jax.lax.scan(body, _cache(3), stream)
  check_invariants(cache)
  assert hits.shape == (12,)


@pytest.mark.parametrize("k", [0, 1, 5, 16, 17])
def test_top_indices_matches_lax_top_k_order(k):
  """The argmax path gives lax.top_k's indices (largest first, ties to the lower index)."""
  rng = np.random.default_rng(k)
  for _ in range(20):
    values = jnp.asarray(rng.integers(-3, 4, size=40), jnp.int32)  # many ties
    got = np.asarray(policy_lib.top_indices(values, k))
    want = np.asarray(jax.lax.top_k(values, k)[1])
    np.testing.assert_array_equal(got, want)
    floats = jnp.asarray(rng.choice([-np.inf, -2.5, -0.0, 0.0, 1e-30, 3.0, np.inf], size=40),
                         jnp.float32)
    got = np.asarray(policy_lib.top_indices(floats, k))
    # lax.top_k orders -0.0 and 0.0 as equal; the int keys put -0.0 just below 0.0
    want = np.asarray(jax.lax.top_k(floats + 0.0, k)[1]) if k else np.zeros(0, int)
    assert np.asarray(floats)[got].tolist() == np.asarray(floats)[want].tolist()


def test_lrfu_keeps_the_frequently_routed_expert_where_lru_evicts_it():
  """One layer, 2 slots, routes A, A, B, then C misses. LRU evicts A (least recent);
  LRFU (decay 0.9 per step) values A at (0.9 + 1)·0.9² = 1.539 and B at 0.9, evicting B."""
  a, b, c = 1, 2, 3
  fill_all = jnp.array([2.0, 1.0])  # B_P >= B_H: q* fills every miss
  victims = {}
  for name in ("freetoken", "freetoken_lrfu"):
    cache = _cache(2, layers=1)
    for e in (a, a, b):
      cache, _ = _step(cache, 0, [[e]], name, fill_all)
    cache, p = _step(cache, 0, [[c]], name, fill_all)
    check_invariants(cache)
    assert int(p.fills) == 1
    victims[name] = {a, b} - {int(e) for e in np.flatnonzero(np.asarray(cache.slot_of[0]) >= 0)}
  assert victims == {"freetoken": {a}, "freetoken_lrfu": {b}}
  np.testing.assert_allclose(float(cache.expert_score[0, a]), 1.9, rtol=tolerances.F32_ROUNDING)


@pytest.mark.parametrize("name", ["freetoken_cycle", "freetoken_lrfu_cycle"])
def test_cycle_policies_do_not_evict_the_layer_that_runs_next(name):
  """4 layers, 3 slots; every token routes e1, e2, e3, e4 in layers 0-3. Global LRU thrashes:
  each miss evicts the least recently used slot, which belongs to the layer that runs next,
  so it never hits. freetoken_cycle evicts, among slots unused for equally many visits of
  their layer, the one whose layer runs furthest ahead: token 1 evicts e3 at layer 3 (its
  layer runs in 3 layer-steps, e1's in 1); token 2 hits e1, e2, evicts e2 for e3, hits e4;
  token 3 hits e1, evicts e1 for e2, hits e3, e4: 3 hits per token, Belady's optimum for 3
  slots."""
  fill_all = jnp.array([2.0, 1.0])  # B_P >= B_H: q* fills every miss
  hits = {}
  for policy in ("freetoken", name):
    cache, hits[policy] = _cache(3, layers=4), 0
    for token in range(3):
      for layer, e in enumerate((1, 2, 3, 4)):
        cache, p = _step(cache, layer, [[e]], policy, fill_all)
        hits[policy] += int(p.hits) if token else 0
      check_invariants(cache)
  assert hits["freetoken"] == 0
  assert hits[name] == 6 if name == "freetoken_cycle" else hits[name] >= 4, hits


def test_free_slot_fills_fill_empty_slots_only():
  """B_P/B_H = 0.25: q* fills nothing for one miss (q* = 0.25 rounds to 0), so freetoken
  leaves a cache with room empty; freetoken_free fills the empty slots, then, once they are
  full, follows q* (no fill, nothing evicted)."""
  low = jnp.array([10.0, 40.0])
  for name, fills in (("freetoken", [0, 0, 0]), ("freetoken_free", [1, 1, 0])):
    cache, got = _cache(2, layers=1), []
    for e in (1, 2, 3):
      cache, p = _step(cache, 0, [[e]], name, low)
      got.append(int(p.fills))
      check_invariants(cache)
    assert got == fills, (name, got)
  assert {int(e) for e in np.flatnonzero(np.asarray(cache.slot_of[0]) >= 0)} == {1, 2}
  # Two misses, one empty slot: one fill (the most recent miss), one host run.
  cache, _ = _step(_cache(2, layers=1), 0, [[5]], "freetoken_free", low)
  cache, p = _step(cache, 0, [[6], [7]], "freetoken_free", low)
  assert int(p.fills) == 1 and int(p.host) == 1


def test_lrfu_decay_must_be_a_fraction():
  with pytest.raises(ValueError, match="decay"):
    get_policy("freetoken_lrfu", decay=1.0)
