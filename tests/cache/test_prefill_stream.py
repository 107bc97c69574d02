"""The per-layer choice between streaming a whole layer and the sparse step in prefill.

``prefill_layer_times`` (the cost model of one layer-step's expert traffic) against hand-worked
numbers, and ``stream="cost"`` in the engine: each layer-step decides on its own counts (or,
where the next layer's transfer starts early, on the previous layer's), the logits equal the
dense path's, and the cache ends as the sparse prefill leaves it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import ftjax
from ftjax.cache.moe import Offload
from ftjax.cache.streaming import prefill_layer_times
from ftjax.runtime import model as model_lib

import tolerances

S = 3 * 768 * 2048 * 2  # a Qwen3-30B-A3B expert in bf16: 9.44 MB
QWEN = dict(experts=128, expert_bytes=S, flops_per_route=6.0 * 768 * 2048)


def test_layer_times_by_hand():
  # The docstring's example: B_P 25, B_H 63 GB/s; 40 fills and 70 host experts.
  sparse, streamed = prefill_layer_times(40, 70, 0, b_p=25.0, b_h=63.0, host_gflops=500.0,
                                         **QWEN)
  assert streamed == pytest.approx(128 * S / 25e9)  # 48.3 ms
  dma = 40 * S / 25e9  # 15.1 ms; the host reads 15.1 ms x 38 GB/s = 574 MB meanwhile
  read = dma + (70 * S - dma * 38e9) / 63e9  # then the other 87 MB at B_H: 16.5 ms
  assert sparse == pytest.approx(read, rel=1e-6)
  assert 16.4e-3 < float(sparse) < 16.6e-3
  # Few host experts: read entirely while the DMA runs, at B_res.
  sparse, _ = prefill_layer_times(40, 20, 0, b_p=25.0, b_h=63.0, host_gflops=500.0, **QWEN)
  assert sparse == pytest.approx(dma)  # 20 experts at B_res take 5 ms < the DMA's 15 ms
  sparse, _ = prefill_layer_times(0, 20, 0, b_p=25.0, b_h=63.0, host_gflops=500.0, **QWEN)
  assert sparse == pytest.approx(20 * S / 63e9, rel=1e-6)  # no DMA: the host has all of B_H
  # B_P >= B_H: nothing is left for the host while the DMA runs; it reads after it.
  sparse, _ = prefill_layer_times(10, 10, 0, b_p=50.0, b_h=40.0, host_gflops=500.0, **QWEN)
  assert sparse == pytest.approx(10 * S / 50e9 + 10 * S / 40e9, rel=1e-6)
  # Compute-bound host: 4096 routes of 9.4 MFLOP at 500 GFLOP/s = 77 ms > streaming's 48 ms.
  sparse, streamed = prefill_layer_times(40, 70, 4096, b_p=25.0, b_h=63.0, host_gflops=500.0,
                                         **QWEN)
  assert sparse == pytest.approx(4096 * QWEN["flops_per_route"] / 500e9, rel=1e-6)
  assert sparse > streamed
  # The same numbers traced (the engine's choice runs inside a program).
  traced = prefill_layer_times(jnp.int32(40), jnp.int32(70), jnp.int32(4096), b_p=jnp.float32(25),
                               b_h=jnp.float32(63), host_gflops=500.0, **QWEN)
  np.testing.assert_allclose([float(t) for t in traced], [float(sparse), float(streamed)],
                             rtol=1e-6)


def test_bad_stream_options_are_clear(tiny_config):
  with pytest.raises(ValueError, match="stream must be one of"):
    Offload(stream="sometimes")
  with pytest.raises(ValueError, match="host_gflops > 0"):
    Offload(stream="cost")
  assert Offload(stream=True).stream == "always" and Offload(stream=False).stream == "never"
  model = model_lib.random_model(tiny_config, seed=0)
  with pytest.raises(ValueError, match="prefill_stream must be one of"):
    ftjax.Engine(model, cache_slots=2, policy="lru_fill", prefill_stream="sometimes")
  with pytest.raises(ValueError, match="host_gflops must be a positive number"):
    ftjax.Engine(model, cache_slots=2, policy="lru_fill", host_gflops=-1.0)
  with pytest.raises(ValueError, match="give bandwidths=.*host_gflops="):
    ftjax.Engine(model, cache_slots=2, policy="lru_fill", stream_prefill_tokens=4,
                 prefill_stream="cost")


@pytest.fixture(scope="module")
def four_layers(tiny_config):
  config = dataclasses.replace(tiny_config, num_layers=4, layer_types=("full_attention",) * 4)
  return model_lib.random_model(config, seed=3)


def _prefill(engine, prompt):
  state = engine.new_state(1, len(prompt) + 1)
  _, logits = engine.step(state, jnp.asarray([prompt], jnp.int32),
                          jnp.arange(len(prompt), dtype=jnp.int32)[None])
  return np.asarray(logits[0])


@pytest.mark.parametrize("pool", ["device", "pinned_host"])
def test_each_layer_streams_by_the_cost_model(four_layers, pool):
  """Layers 0 and 1 are held whole in the cache (static_hot), layers 2 and 3 not at all:
  with a host too slow to compute its routes, only the two cold layers stream. With the pool
  in ``pinned_host`` memory the next layer's transfer starts early, on a prediction from the
  previous layer's counts; in device memory every layer decides on its own counts."""
  model = four_layers
  c = model.config
  hot = np.zeros((c.num_layers, c.num_experts), np.int64)
  hot[:2] = 1  # the pinned set: all of layers 0 and 1
  prompt = list(np.random.default_rng(5).integers(0, c.vocab_size, 24))
  reference = _prefill(ftjax.Engine(model, kernels="ffi"), prompt)
  kwargs = dict(kernels="ffi", cache_slots=2 * c.num_experts, policy="static_hot",
                hot_experts=hot, bandwidths=(12.0, 24.0), pool=pool)
  chosen = ftjax.Engine(model, stream_prefill_tokens=16, prefill_stream="cost",
                        host_gflops=1e-6, **kwargs)
  assert chosen.runner.prefill_stream == "cost"
  assert chosen.stream_source == "given; each layer by the cost model"
  logits = _prefill(chosen, prompt)
  tolerances.assert_close(logits, reference, tolerances.F32, floor=1.0)
  (step,) = chosen.stats()["per_step"]
  np.testing.assert_array_equal(step["streamed"], [0, 0, 1, 1])
  np.testing.assert_array_equal(step["host"][:2], [0, 0])
  assert (step["host"][2:] > 0).all()
  assert chosen.stats()["streamed_layer_steps"] == 2
  # A fast host keeps every layer sparse: its few routes cost less than moving 8 experts.
  fast = ftjax.Engine(model, stream_prefill_tokens=16, prefill_stream="cost", host_gflops=1e6,
                      **kwargs)
  tolerances.assert_close(_prefill(fast, prompt), reference, tolerances.F32, floor=1.0)
  assert fast.stats()["streamed_layer_steps"] == 0


@pytest.mark.parametrize("pool", ["device", "pinned_host"])
def test_a_chosen_stream_leaves_the_cache_as_the_sparse_prefill(four_layers, pool):
  """freetoken with a third of the experts cached: whatever each layer chose, the plans and
  fills are the sparse prefill's, so the caches end equal; the recorded choices are the cost
  model's on each layer's recorded counts (device pool: no early starts)."""
  model = four_layers
  c = model.config
  prompt = list(np.random.default_rng(6).integers(0, c.vocab_size, 20))
  reference = _prefill(ftjax.Engine(model, kernels="ffi"), prompt)
  kwargs = dict(kernels="ffi", cache_slots=c.num_layers * c.num_experts // 3,
                policy="freetoken", bandwidths=(12.0, 24.0), pool=pool)
  sparse = ftjax.Engine(model, **kwargs)
  _prefill(sparse, prompt)
  # GFLOP/s: where this tiny model's layers (all misses, 11 or 12 host routes) differ: those
  # with 12 routes stream (sparse/stream 1.04), those with 11 stay sparse (0.95).
  rate = 6.5
  chosen = ftjax.Engine(model, stream_prefill_tokens=16, prefill_stream="cost",
                        host_gflops=rate, **kwargs)
  tolerances.assert_close(_prefill(chosen, prompt), reference, tolerances.F32, floor=1.0)
  for field in ("owner", "slot_of", "slot_stamp", "expert_stamp", "expert_count", "slots"):
    np.testing.assert_array_equal(np.asarray(getattr(chosen.cache, field)),
                                  np.asarray(getattr(sparse.cache, field)), err_msg=field)
  (step,) = chosen.stats()["per_step"]
  t_sparse, t_stream = prefill_layer_times(
      step["fills"], step["host"], step["host_routes"], experts=c.num_experts,
      expert_bytes=chosen.slot_bytes, flops_per_route=6.0 * c.moe_intermediate_size * c.hidden_size,
      b_p=12.0, b_h=24.0, host_gflops=rate)
  wanted = (t_stream < t_sparse).astype(np.int32)
  if pool == "device":
    np.testing.assert_array_equal(step["streamed"], wanted)
    assert 0 < wanted.sum() < c.num_layers  # the layers did choose differently
  else:  # layer 0 on its own counts, the rest predicted one layer ahead
    assert step["streamed"][0] == wanted[0]
  print("streamed per layer:", step["streamed"], "cost model on own counts:", wanted)
