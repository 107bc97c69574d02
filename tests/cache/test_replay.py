"""Traces and replay: capture from the engine, replay equals the engine's counts, Belady
bounds every policy, the trace file round-trips."""

import dataclasses
import json

import jax
import numpy as np
import pytest

import ftjax
from ftjax.cache import POLICIES
from ftjax.runtime import model as model_lib
from ftjax.research.sweep import belady_misses, replay
from ftjax.research.traces import Trace

import tolerances


@pytest.fixture(scope="module")
def sharp_model(tiny_config):
  model = model_lib.random_model(tiny_config, seed=21)
  return dataclasses.replace(model, params=jax.tree.map(lambda x: x * 8.0, model.params),
                             bank=model.bank * 8.0)


@pytest.mark.parametrize("policy, slots", [("freetoken", 5), ("lru_fill", 3), ("lru_fill", 16),
                                           ("cpu_only", 0), ("static_layers", 8),
                                           ("freetoken_lrfu", 5), ("freetoken_cycle", 5),
                                           ("freetoken_lrfu_cycle", 5)])
def test_replay_gives_the_engines_counts(sharp_model, policy, slots):
  engine = ftjax.Engine(sharp_model, kernels="xla", cache_slots=slots, policy=policy,
                        bandwidths=(10.0, 30.0), record_routing=True)
  engine.generate([7], 24, greedy=False, temperature=1.0, seed=3)  # one token per step
  trace = Trace.from_engine(engine)
  assert trace.num_steps == 24 and trace.num_layers == 2 and trace.top_k == 2
  steps = engine.stats()["per_step"]
  result = replay(trace, policy, slots, bandwidths=(10.0, 30.0))
  np.testing.assert_array_equal(result.hits, np.stack([s["hits"] for s in steps]))
  np.testing.assert_array_equal(result.fills, np.stack([s["fills"] for s in steps]))
  np.testing.assert_array_equal(result.host_runs, np.stack([s["host"] for s in steps]))
  assert result.miss_rate == pytest.approx(engine.stats()["miss_rate"])


def test_capture_without_a_cache_and_with_prefill(sharp_model):
  engine = ftjax.Engine(sharp_model, kernels="xla", record_routing=True)
  engine.generate([1, 2, 3, 4, 5], 4)
  trace = Trace.from_engine(engine)
  assert trace.num_steps == 5 + 3 and trace.phase.tolist() == [0] * 5 + [1] * 3
  assert np.all(trace.ids >= 0) and np.allclose(trace.weights.sum(-1), 1.0, atol=tolerances.F32)
  with pytest.raises(ValueError, match="record_routing=True"):
    Trace.from_engine(ftjax.Engine(sharp_model))


def _random_trace(seed, steps=60, layers=3, experts=8, k=2, skew=1.5):
  rng = np.random.default_rng(seed)
  p = 1.0 / np.arange(1, experts + 1) ** skew
  p /= p.sum()
  ids = np.stack([[rng.choice(experts, k, replace=False, p=p) for _ in range(layers)]
                  for _ in range(steps)])
  return Trace.from_arrays(ids, np.full(ids.shape, 1.0 / k), experts)


@pytest.mark.parametrize("seed", range(2))  # 2 random traces x 5 sizes (CI time)
@pytest.mark.parametrize("slots", [0, 1, 4, 9, 24])
def test_belady_never_exceeds_any_policy(seed, slots):
  trace = _random_trace(seed)
  cold = belady_misses(trace, slots)
  warm = belady_misses(trace, slots, preload=True)  # may also choose the initial contents
  assert warm <= cold
  for policy in POLICIES:
    misses = int(replay(trace, policy, slots, bandwidths=(10.0, 30.0)).misses.sum())
    assert warm <= misses, policy
    if policy not in ("static_hot", "static_layers"):  # these start preloaded
      assert cold <= misses, policy
  if slots == 0:
    assert cold == warm == int(replay(trace, "cpu_only", 0).misses.sum())


def test_belady_bypasses_when_that_is_better():
  # One slot, A B A B A: keeping A and bypassing B misses 3 times (plain MIN would miss 5).
  trace = Trace.from_arrays(np.array([[[0]], [[1]], [[0]], [[1]], [[0]]]), np.ones((5, 1, 1)),
                            2)
  assert belady_misses(trace, 1) == 3
  assert belady_misses(trace, 2) == 2
  assert belady_misses(trace, 2, preload=True) == 0


def test_trace_file_round_trip_and_errors(tmp_path):
  trace = _random_trace(0, steps=7)
  path = trace.save(tmp_path / "t.npz")
  back = Trace.load(path)
  np.testing.assert_array_equal(back.ids, trace.ids)
  np.testing.assert_array_equal(back.weights, trace.weights)
  assert back.num_experts == 8 and back.phase.tolist() == [1] * 7
  with pytest.raises(ValueError, match=r"ids must be in \[-1, 8\)"):
    Trace.from_arrays(np.full((2, 1, 1), 8), np.ones((2, 1, 1)), 8)
  with pytest.raises(ValueError, match="steps, layers, top_k"):
    Trace.from_arrays(np.zeros((2, 2)), np.zeros((2, 2)), 4)
  newer = dict(np.load(path))
  meta = json.loads(bytes(newer["meta"]).decode()) | {"format_version": 99}
  newer["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
  np.savez(tmp_path / "new.npz", **newer)
  with pytest.raises(ValueError, match="newer than"):
    Trace.load(tmp_path / "new.npz")
  with pytest.raises(ValueError, match="cache_slots"):
    replay(trace, "lru_fill", 25)
