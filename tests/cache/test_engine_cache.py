"""Every policy and cache size gives the dense reference's logits and greedy tokens at batch 1
and 3 (on qwen3_moe; freetoken and lru_fill also on a hybrid family and on qwen2_moe), and
across resizes in the middle of generation."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import ftjax
from ftjax.cache import POLICIES
from ftjax.cache.state import check_invariants
from ftjax.runtime import model as model_lib
from ftjax.runtime.budget import slots_for_budget
from ftjax.runtime.engine import slot_bucket
from ftjax.runtime.kv import state_bytes

import tolerances
from conftest import greedy_run, scaled_params

STEPS = 32  # the reference's decode steps (the resize test uses all of them)
POLICY_STEPS = 16  # each policy and size compares this many (CI time)
PROMPT = 5


def _family(tiny_config, tiny_hybrid_config, name):
  if name == "qwen3_moe":
    return tiny_config
  if name == "qwen3_5_moe":
    return tiny_hybrid_config
  return dataclasses.replace(tiny_config, model_type="qwen2_moe", qk_norm=None, qkv_bias=True,
                             norm_topk_prob=False, shared_expert_intermediate_size=24,
                             shared_expert_gate=True)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe", "qwen3_5_moe"])
def family_model(request, tiny_config, tiny_hybrid_config):
  model = model_lib.random_model(_family(tiny_config, tiny_hybrid_config, request.param), seed=11)
  return scaled_params(model, 8.0)  # sharp routing, distinct logits


def _run(engine, prompts, tokens_per_step=None, steps=STEPS):
  """Prefill, then ``steps`` single-token steps; feeds ``tokens_per_step`` if given (teacher
  forcing), else the engine's own greedy tokens. Returns (logits per step, tokens)."""
  return greedy_run(engine, prompts, steps, tokens_per_step)


def _assert_same_as_reference(ref, got):
  ref_logits, ref_tokens = ref
  logits, tokens = got
  np.testing.assert_array_equal(tokens, ref_tokens)
  tolerances.assert_close(logits, ref_logits, tolerances.F32, floor=1.0)


@pytest.fixture(scope="module")
def references(family_model):
  rng = np.random.default_rng(0)
  out = {}
  for batch in (1, 3):
    prompts = rng.integers(0, family_model.config.vocab_size, (batch, PROMPT))
    engine = ftjax.Engine(family_model, kernels="xla")
    out[batch] = (prompts, _run(engine, prompts))
  return out


def _engine_logic_only(model):
  """Resizes and retracing are engine logic, the same for every family: checked on the hybrid
  one, whose MoE layers take the plain families' cache path next to a recurrent state
  (qwen3_moe and qwen2_moe change no code path of these tests; their dense-reference tests
  above stay; CI time)."""
  if model.config.model_type != "qwen3_5_moe":
    pytest.skip("engine logic: covered by the qwen3_5_moe case (CI time)")


def _sizes(config):
  total = config.num_layers * config.num_experts
  return [0, 1, total // 3, total]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("batch", [1, 3])
def test_every_policy_and_size_matches_the_dense_reference(family_model, references, policy,
                                                           batch):
  # Every policy at every size on qwen3_moe, at batch 1 and 3; on the hybrid (whose MoE layers
  # take the same cache path; its rows differ in the recurrent state) and on qwen2_moe (its
  # shared expert and biases sit outside the routed experts) the two fill rules'
  # representatives, freetoken and lru_fill, at batch 1, and on the hybrid at batch 3 too. The
  # policies that never fill (cpu_only, static_hot, static_layers) at batch 1 only: at batch 3
  # they run only the hit/miss lookup that every filling policy's batch-3 case runs. CI time.
  family = family_model.config.model_type
  if family != "qwen3_moe" and (policy not in ("freetoken", "lru_fill") or (
      family == "qwen2_moe" and batch > 1)):
    pytest.skip("covered by the qwen3_moe and qwen3_5_moe cases (CI time)")
  if batch > 1 and policy in ("cpu_only", "static_hot", "static_layers"):
    pytest.skip("never fills: its batch-3 lookup is the filling policies' (CI time)")
  prompts, ref = references[batch]
  hot = np.arange(family_model.config.num_layers * family_model.config.num_experts)[::-1]
  for slots in _sizes(family_model.config):
    # One buffer size for all sizes: the sweep compiles once per policy rule.
    engine = ftjax.Engine(family_model, kernels="xla", cache_slots=slots, policy=policy,
                          bandwidths=(12.0, 24.0), hot_experts=hot,
                          cache_capacity=_sizes(family_model.config)[-1])
    got = _run(engine, prompts, steps=POLICY_STEPS)
    _assert_same_as_reference((ref[0][:POLICY_STEPS + 1], ref[1][:POLICY_STEPS]), got)
    check_invariants(engine.cache)
    st = engine.stats()
    assert st["steps"] == POLICY_STEPS + 1 and st["slots"] == slots
    if slots == 0 or policy in ("cpu_only", "static_hot", "static_layers"):
      assert st["bytes"]["fill"] == 0
    if slots == 0:
      assert st["miss_rate"] == 1.0


def test_resizes_in_the_middle_of_generation(family_model, references, fresh_programs):
  _engine_logic_only(family_model)
  prompts, ref = references[3]
  total = family_model.config.num_layers * family_model.config.num_experts
  engine = ftjax.Engine(family_model, kernels="xla", cache_slots=4, policy="freetoken",
                        bandwidths=(20.0, 24.0))
  resizes = [total, 1, 7, 0, 3, total // 2]
  sizes = iter(resizes)
  ref_logits, ref_tokens = ref
  state = engine.new_state(3, PROMPT + STEPS + 1)
  ids = jnp.asarray(np.array(prompts, np.int32))
  pos = jnp.broadcast_to(jnp.arange(PROMPT, dtype=jnp.int32), (3, PROMPT))
  state, logits = engine.step(state, ids, pos, last_only=True)
  for i in range(STEPS):
    if i % 5 == 4:
      before = engine.cache
      kept = np.asarray(before.owner)[np.argsort(-np.asarray(before.slot_stamp), kind="stable")]
      n = engine.resize_cache(slots=next(sizes))
      check_invariants(engine.cache)
      # Shrinking keeps the most recently used experts.
      expect = [o for o in kept[:n] if o >= 0]
      assert sorted(o for o in np.asarray(engine.cache.owner) if o >= 0) == sorted(expect)
    tok = ref_tokens[i]
    state, logits = engine.step(state, jnp.asarray(tok)[:, None],
                                jnp.full((3, 1), PROMPT + i, jnp.int32), last_only=True)
    np.testing.assert_allclose(np.asarray(logits[:, -1]), ref_logits[i + 1], rtol=0,
                               atol=tolerances.F32 * max(1.0, np.abs(ref_logits).max()))
  # One prefill compile, then one decode compile per bucket, not per size (3 shares 4's,
  # 7 shares 8's).
  buckets = {slot_bucket(n) for n in [4, *resizes]}
  assert engine.compile_count == 1 + len(buckets) < 1 + len(resizes) + 1


def test_slot_buckets_and_the_paper_budget_example():
  assert [slot_bucket(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [0, 1, 2, 4, 8, 8, 16]
  gb = 10**9
  assert slots_for_budget(8 * gb, 3 * gb, gb // 2) == 10
  assert slots_for_budget(8 * gb, 4 * gb, gb // 2) == 8
  assert slots_for_budget(8 * gb, 2 * gb, gb // 2) == 12


def test_device_budget_rebalances_as_the_kv_cache_grows(family_model):
  if family_model.config.model_type == "qwen2_moe":  # a plain family (the slot arithmetic)
    pytest.skip("budgets: covered by the qwen3_moe and qwen3_5_moe cases (CI time)")
  c = family_model.config
  slot = int(family_model.bank.shape[2]) * family_model.bank.dtype.itemsize
  kv_rows = 4096  # the first KV capacity of a state that grows
  budget = state_bytes(c, 1, 16384 + 16) + 6 * slot  # 6 slots beside the larger state
  engine = ftjax.Engine(family_model, kernels="ffi", device_budget_bytes=budget,
                        policy="lru_fill", max_seq_len=16384, prefill_chunk=1024)
  assert engine.kv_growth == "grow" and engine.kv_capacities[:2] == (kv_rows, 16384 + 16)
  engine.generate([1, 2, 3], 4)  # KV capacity 4096 tokens
  small = engine.stats()["slots"]
  engine.generate([i % c.vocab_size for i in range(kv_rows + 10)], 4)  # 16400: fewer slots
  large_kv = engine.stats()["slots"]
  engine.generate([1, 2, 3], 4)  # back to 4096: the slots return
  # The decode state: KV caches of the attention layers (a hybrid's linear layers hold a
  # constant-size state instead), so N = floor((budget - state) / slot).
  total = c.num_layers * c.num_experts  # the cache never holds more than every expert
  assert small == min(total, slots_for_budget(budget, state_bytes(c, 1, kv_rows), slot))
  assert large_kv == min(total, slots_for_budget(budget, state_bytes(c, 1, 16384 + 16),
                                                slot)) < small
  assert small == engine.stats()["slots"]


def test_bad_cache_options_are_clear_errors(family_model):
  with pytest.raises(ValueError, match="at most one cache size"):
    ftjax.Engine(family_model, cache_slots=2, cache_bytes=10)
  with pytest.raises(ValueError, match="needs bandwidths"):
    ftjax.Engine(family_model, cache_slots=2, policy="freetoken")
  with pytest.raises(ValueError, match="unknown cache policy"):
    ftjax.Engine(family_model, cache_slots=2, policy="mru")
  with pytest.raises(ValueError,
                     match="static_hot policy pins the hottest experts of a routing profile"):
    ftjax.Engine(family_model, cache_slots=2, policy="static_hot")
  with pytest.raises(ValueError, match="cache_fraction"):
    ftjax.Engine(family_model, cache_fraction=1.5)
  with pytest.raises(ValueError, match="no expert cache"):
    ftjax.Engine(family_model).resize_cache(slots=3)


def test_cached_decode_does_not_retrace(family_model, fresh_programs):
  _engine_logic_only(family_model)
  traces = fresh_programs
  engine = ftjax.Engine(family_model, kernels="xla", cache_slots=5, policy="freetoken",
                        bandwidths=(10.0, 30.0))
  engine.generate([1, 2, 3], 8)
  assert engine.compile_count == 3 and len(traces) == 2  # extend, first token (no model), decode
  engine.generate([7, 8, 9], 8)
  engine.resize_cache(slots=6)  # same bucket (8): no new program
  engine.generate([4, 5, 6], 8)
  assert engine.compile_count == 3 and len(traces) == 2
  # Sampling instead of greedy, the temperature, the seed and a resize within the bucket
  # are data.
  engine.generate([7, 8, 9], 8, greedy=False, temperature=1.0, seed=4)
  engine.resize_cache(slots=7)
  engine.generate([4, 5, 6], 8, greedy=False, temperature=0.5, seed=5)
  assert engine.compile_count == 3 and len(traces) == 2
