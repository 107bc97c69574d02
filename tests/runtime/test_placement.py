"""When a prefill streams whole layers: the cost model's threshold, worked by hand, against a
brute-force scan of the same formulas in float64 numpy."""

import numpy as np

import ftjax
from ftjax.runtime import model as model_lib
from ftjax.runtime.placement import prefill_stream_threshold

QWEN3 = dict(experts=128, top_k=8, expert_bytes=3 * 768 * 2048 * 2,
             flops_per_route=6.0 * 768 * 2048)


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
