"""When a prefill streams whole layers (``ftjax.cache.streaming``): the host/DMA contention
formula worked by hand and shared with the decode cost model, the cold-layer threshold against
a brute-force scan of the same formulas in float64 numpy, and the engine's decisions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ftjax
from ftjax.cache.streaming import (host_read_time, prefill_layer_times, prefill_stream_mode,
                                   prefill_stream_threshold, stream_costs, stream_min_tokens)
from ftjax.research import cost
from ftjax.runtime import model as model_lib

import tolerances

QWEN3 = dict(experts=128, top_k=8, expert_bytes=3 * 768 * 2048 * 2,
             flops_per_route=6.0 * 768 * 2048)


def test_host_read_time_by_hand():
  # B_P 10, B_H 20 GB/s, fills' DMA 0.6 ms: the host has B_res = 10 GB/s during it.
  b_p, b_h, dma = 10e9, 20e9, 0.6e-3
  # 12 MB: 6 MB during the DMA, the other 6 MB at 20 GB/s after it (0.3 ms): 0.9 ms.
  np.testing.assert_allclose(host_read_time(12e6, dma, b_p, b_h), 0.9e-3, rtol=tolerances.F64)
  # 3 MB: all read during the DMA, at 10 GB/s: 0.3 ms.
  np.testing.assert_allclose(host_read_time(3e6, dma, b_p, b_h), 0.3e-3, rtol=tolerances.F64)
  assert host_read_time(0.0, dma, b_p, b_h) == 0.0
  # B_P >= B_H: nothing for the host while the DMA runs; 3 MB at 20 GB/s after it.
  np.testing.assert_allclose(host_read_time(3e6, dma, 20e9, b_h), 0.75e-3, rtol=tolerances.F64)
  # The same numbers traced (the per-layer choice runs inside a program), in float32.
  traced = jax.jit(host_read_time)(jnp.float32(12e6), jnp.float32(dma), jnp.float32(b_p),
                                   jnp.float32(b_h))
  np.testing.assert_allclose(float(traced), 0.9e-3, rtol=tolerances.F32_ROUNDING)


def test_decode_and_prefill_cost_models_share_the_contention_formula():
  """``research.cost.layer_step_time``'s host term and ``prefill_layer_times``'s sparse read are
  the one ``host_read_time``: with the device path's compute, the dense weights and the
  overheads made negligible, both are max(DMA, host read) for the same counts."""
  # S = 3 · 1000 · 500 · 2 = 3 MB per expert; the device reads at 1e9 GB/s (negligible).
  shape = cost.ModelShape(name="hand", num_layers=1, num_experts=8, top_k=2, hidden=1000,
                          expert_ffn=500, bytes_per_param=2, dense_bytes_per_layer=0.0,
                          head_bytes=0.0)
  s = shape.expert_bytes
  assert s == 3_000_000

  def both(b_p, b_h, fills, host):
    hw = cost.HardwareProfile(name="hand", b_p=b_p, b_h=b_h, device_bw=1e9,
                              layer_overhead_s=0.0, step_overhead_s=0.0, device_memory_gb=16.0,
                              source="test")
    decode = cost.layer_step_time(hw, shape, np.zeros_like(fills), fills, host)
    sparse, _ = prefill_layer_times(fills, host, np.zeros_like(fills), experts=8,
                                    expert_bytes=s, flops_per_route=1.0, b_p=b_p, b_h=b_h,
                                    host_gflops=1.0)
    return decode, sparse

  # By hand: B_P 10, B_H 20 GB/s, 2 fills (DMA 0.6 ms), 4 host experts (12 MB): the host reads
  # 6 MB at B_res = 10 GB/s during the DMA and 6 MB at 20 GB/s after it: 0.9 ms > the DMA.
  decode, sparse = both(10.0, 20.0, 2, 4)
  np.testing.assert_allclose(decode, 0.9e-3, rtol=tolerances.F32_ROUNDING)
  np.testing.assert_allclose(sparse, 0.9e-3, rtol=tolerances.F32_ROUNDING)
  # Every split of up to 4 fills and 6 host experts, with B_P below, at and above B_H.
  fills, host = (a.ravel().astype(np.float64) for a in np.meshgrid(np.arange(5), np.arange(7)))
  for b_p, b_h in [(10.0, 20.0), (25.0, 63.0), (20.0, 20.0), (50.0, 40.0)]:
    decode, sparse = both(b_p, b_h, fills, host)
    dma = fills * s / (b_p * 1e9)
    np.testing.assert_allclose(decode, np.maximum(dma, host_read_time(host * s, dma, b_p * 1e9,
                                                                      b_h * 1e9)),
                               rtol=1e-6, err_msg=str((b_p, b_h)))
    np.testing.assert_allclose(sparse, decode, rtol=tolerances.F32_ROUNDING,
                               err_msg=str((b_p, b_h)))


def _brute_force(experts, top_k, expert_bytes, flops_per_route, b_p, b_h, host_gflops,
                 max_tokens=4096):
  tokens = np.arange(1, max_tokens + 1, dtype=np.float64)
  distinct = experts * (1 - (1 - top_k / experts) ** tokens)
  filled = distinct if b_p >= b_h else distinct * b_p / b_h
  host = distinct - filled
  sparse = np.maximum.reduce([
      filled * expert_bytes / (b_p * 1e9),
      np.zeros_like(host) if b_p >= b_h else host * expert_bytes / ((b_h - b_p) * 1e9),
      tokens * top_k * (host / distinct) * flops_per_route / (host_gflops * 1e9)])
  stream = experts * expert_bytes / (b_p * 1e9)
  cheaper = np.nonzero(sparse > stream)[0]
  return 0 if len(cheaper) == 0 else int(tokens[cheaper[0]])


def test_the_worked_example():
  # Streaming a layer: 128 x 9.44 MB at 50 GB/s = 24.2 ms. Sparse, once T >= 256 makes every
  # expert distinct: half filled (B_P/B_H = 0.5), 12.1 ms each way, and the host's half of the
  # T·8 routes at 500 GFLOP/s: T·4·9.44 MFLOP / 500 GFLOP/s = 75.5 us per token, equal to the
  # stream at T = 320. So 256 tokens stay sparse (19.3 ms) and 512 stream (38.7 ms).
  t = prefill_stream_threshold(**QWEN3, b_p=50.0, b_h=100.0, host_gflops=500.0)
  assert t in (320, 321)
  assert t == _brute_force(**QWEN3, b_p=50.0, b_h=100.0, host_gflops=500.0)


def test_other_regimes_match_the_brute_force():
  for b_p, b_h, gflops in [(25.0, 63.2, 300.0), (52.7, 77.3, 2000.0), (11.8, 47.5, 150.0),
                           (51.5, 178.0, 5000.0), (12.0, 24.0, 1.0)]:
    assert prefill_stream_threshold(**QWEN3, b_p=b_p, b_h=b_h, host_gflops=gflops) == \
        _brute_force(**QWEN3, b_p=b_p, b_h=b_h, host_gflops=gflops), (b_p, b_h, gflops)
  # A host so slow that one token's routes take longer than the stream: stream from T = 1.
  assert prefill_stream_threshold(**QWEN3, b_p=50.0, b_h=100.0, host_gflops=1.0) == 1
  # B_P >= B_H: every miss is filled (no host part), and u <= E experts never cost more than
  # all E: never stream.
  assert prefill_stream_threshold(**QWEN3, b_p=100.0, b_h=50.0, host_gflops=500.0) == 0


def test_the_cpu_backend_never_streams_unless_asked(tiny_config):
  model = model_lib.random_model(tiny_config, seed=0)
  engine = ftjax.Engine(model, cache_slots=4, policy="lru_fill")
  assert engine.runner.stream_min_tokens == 0 and engine.stream_source.startswith("never")
  engine = ftjax.Engine(model, cache_slots=4, policy="lru_fill", stream_prefill_tokens=64)
  assert engine.runner.stream_min_tokens == 64 and engine.stream_source == "given; every layer"


def test_stream_costs_and_the_engine_decisions():
  costs = stream_costs((48, 128, 3 * 768 * 2048), jnp.bfloat16, ffn_dim=768, width=2048,
                       host_gflops=500.0)
  assert costs == dict(experts=128, expert_bytes=QWEN3["expert_bytes"],
                       flops_per_route=QWEN3["flops_per_route"], host_gflops=500.0)
  where = dict(caching=True, pool_on_device=False, expert_parallel=False, top_k=8,
               bandwidths=(50.0, 100.0), **costs)
  tokens, source = stream_min_tokens(None, **where)
  assert tokens == prefill_stream_threshold(**QWEN3, b_p=50.0, b_h=100.0, host_gflops=500.0)
  assert source == "cost model (B_P 50.0, B_H 100.0 GB/s, host 500 GFLOP/s)"
  assert stream_min_tokens(None, **{**where, "host_gflops": None})[0] == 16  # T·K >= E
  assert stream_min_tokens(None, **{**where, "pool_on_device": True}) == (
      0, "never (the pool is in device memory)")
  assert stream_min_tokens(None, **{**where, "expert_parallel": True})[0] == 0
  assert stream_min_tokens(64, **{**where, "pool_on_device": True}) == (64, "given")
  with pytest.raises(ValueError, match="give a cache size"):
    stream_min_tokens(64, **{**where, "caching": False})
  with pytest.raises(ValueError, match="devices="):
    stream_min_tokens(64, **{**where, "expert_parallel": True})
  assert prefill_stream_mode("auto", cost_known=True) == ("cost", "each layer by the cost model")
  assert prefill_stream_mode("auto", cost_known=False) == ("always", "every layer")
  assert prefill_stream_mode("always", cost_known=True) == ("always", "every layer")
  with pytest.raises(ValueError, match="give bandwidths"):
    prefill_stream_mode("cost", cost_known=False)
