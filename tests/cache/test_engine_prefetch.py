"""Router-ahead prefetch in the engine: the dense reference's logits and greedy tokens with
prefetch on, for two policies (a q* and a fill-all rule) and cache sizes, at batch 1 and 3,
on an attention and a hybrid family, across a resize, and in the decode loop while the
calibrated split probes its strategies; the counts (prefetched, used, wasted) agree with each other
and with the cache, and prefetch lowers the misses of a trained model's real routing."""

import jax.numpy as jnp
import numpy as np
import pytest

from prometheus_client import CollectorRegistry, generate_latest

import ftjax
from ftjax.cache.state import check_invariants
from ftjax.runtime import model as model_lib
from ftjax.runtime.calibration import SplitCalibrator
from ftjax.server.metrics import EngineTotals

import tolerances
from conftest import greedy_run, scaled_params

STEPS = 12
PROMPT = 5


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def family_model(request, tiny_config, tiny_hybrid_config):
  config = tiny_config if request.param == "qwen3_moe" else tiny_hybrid_config
  return scaled_params(model_lib.random_model(config, seed=11), 8.0)


@pytest.fixture(scope="module")
def references(family_model):
  rng = np.random.default_rng(0)
  out = {}
  for batch in (1, 3):
    prompts = rng.integers(0, family_model.config.vocab_size, (batch, PROMPT))
    out[batch] = (prompts, greedy_run(ftjax.Engine(family_model, kernels="xla"), prompts,
                                      STEPS, None))
  return out


@pytest.mark.parametrize("policy", ["freetoken", "class_cycle_fill"])
@pytest.mark.parametrize("batch", [1, 3])
def test_prefetch_matches_the_dense_reference(family_model, references, policy, batch):
  if family_model.config.model_type != "qwen3_moe" and policy != "freetoken":
    pytest.skip("the hybrid's MoE layers take the same cache path: one policy (CI time)")
  prompts, (ref_logits, ref_tokens) = references[batch]
  total = family_model.config.num_layers * family_model.config.num_experts
  seen = 0
  for slots in (1, total // 3):
    engine = ftjax.Engine(family_model, kernels="xla", cache_slots=slots, policy=policy,
                          bandwidths=(12.0, 24.0), prefetch=2, cache_capacity=total)
    logits, tokens = greedy_run(engine, prompts, STEPS, None)
    np.testing.assert_array_equal(tokens, ref_tokens)
    tolerances.assert_close(logits, ref_logits, tolerances.F32, floor=1.0)
    check_invariants(engine.cache)
    st = engine.stats()["prefetch"]
    assert st["experts"] == 2
    assert 0 <= st["used"] + st["wasted"] <= st["prefetched"]
    held = int(np.asarray(engine.cache.prefetched).sum())  # prefetched, not yet used
    assert st["used"] + st["wasted"] + held == st["prefetched"]
    assert engine.cache_totals()["prefetched"] == st["prefetched"]
    seen += st["prefetched"]
  assert seen > 0  # the smaller caches miss what the router predicts


def test_prefetch_across_a_resize(family_model, references):
  prompts, (ref_logits, ref_tokens) = references[3]
  total = family_model.config.num_layers * family_model.config.num_experts
  engine = ftjax.Engine(family_model, kernels="xla", cache_slots=total // 2, policy="lru_fill",
                        prefetch=3)
  state = engine.new_state(3, PROMPT + STEPS + 1)
  pos = jnp.broadcast_to(jnp.arange(PROMPT, dtype=jnp.int32), (3, PROMPT))
  state, logits = engine.step(state, jnp.asarray(np.array(prompts, np.int32)), pos,
                              last_only=True)
  for i, slots in zip(range(STEPS), [None, 2, None, total, None, 1, 0, None, 5] + [None] * 9):
    if slots is not None:
      engine.resize_cache(slots=slots)
      check_invariants(engine.cache)
    state, logits = engine.step(state, jnp.asarray(ref_tokens[i])[:, None],
                                jnp.full((3, 1), PROMPT + i, jnp.int32), last_only=True)
    np.testing.assert_allclose(np.asarray(logits[:, -1]), ref_logits[i + 1], rtol=0,
                               atol=tolerances.F32 * max(1.0, np.abs(ref_logits).max()))


def test_prefetch_with_the_calibrated_split_in_the_decode_loop(family_model):
  """The decode programs (generate) with prefetch while the q* split's guard probes every
  strategy (pure fill, pure host, the split) chunk after chunk: the dense path's tokens, and
  the counts reach the server's /metrics."""
  c = family_model.config
  prompt = np.random.default_rng(1).integers(0, c.vocab_size, 6)
  ref = ftjax.Engine(family_model, kernels="xla").generate(prompt, 20)
  engine = ftjax.Engine(family_model, kernels="xla",
                        cache_slots=c.num_layers * c.num_experts // 3, policy="freetoken", bandwidths=(12.0, 24.0), calibrate_split="on",
                        decode_chunk=2, prefetch=2)
  engine.executor.calibrator = SplitCalibrator((12.0, 24.0), family_model.expert_bytes,
                                               probe_every=2, margin=1.0)
  assert engine.generate(prompt, 20) == ref
  assert engine.stats()["calibration"]["probes"] >= 2
  totals = engine.cache_totals()
  assert totals["prefetched"] > 0 and totals["prefetch_used"] <= totals["prefetched"]
  registry = CollectorRegistry()
  registry.register(EngineTotals(engine))
  text = generate_latest(registry).decode()
  for key in ("prefetched", "prefetch_used", "prefetch_wasted"):
    assert f"ftjax_expert_cache_{key}_total {float(totals[key])}" in text


def test_prefetch_lowers_the_misses_of_real_routing():
  # The embedded trained model: its routing is real, and its router a layer's mixer early
  # names most of the experts (benchmarks/router_ahead.py: ahead_0 recall 0.87-0.90).
  model = ftjax.load("default")
  prompt = [1, 2, 3, 4, 5]
  rates = {}
  for prefetch in (0, 4):
    engine = ftjax.Engine(model, kernels="xla", cache_fraction=0.3, policy="lru_fill",
                          prefetch=prefetch)
    engine.generate(prompt, 24, greedy=True)
    rates[prefetch] = engine.stats()
  assert rates[4]["miss_rate"] < 0.75 * rates[0]["miss_rate"]
  assert rates[4]["prefetch"]["used_share"] > 0.5
  assert rates[0]["prefetch"]["prefetched"] == 0


def test_prefetch_options_are_checked(family_model):
  with pytest.raises(ValueError, match="give a cache size"):
    ftjax.Engine(family_model, kernels="xla", prefetch=2)
  with pytest.raises(ValueError, match="prefetch must be an int"):
    ftjax.Engine(family_model, kernels="xla", cache_slots=4, prefetch=-1)
