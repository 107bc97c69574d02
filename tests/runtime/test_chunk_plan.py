"""The prefill chunk planner (``ftjax.runtime.kv.plan_sizes``, ``KVLayout.plan_chunks``): the
least-cost plan under ``overhead + size`` a chunk, never dearer than ``split_tokens``' plan,
only precompiled sizes, anchors and the KV buffer's end respected, and an engine that reads
every prompt length with the programs it precompiled, giving the full forward's logits."""

import numpy as np
import pytest

import ftjax
from ftjax.runtime import model as model_lib
from ftjax.runtime.kv import (CHUNK_OVERHEAD, KVLayout, chunk_sizes, first_chunk, plan_sizes,
                              split_tokens)

import tolerances
from conftest import scaled_params

SIZES = [chunk_sizes(1024), chunk_sizes(2048), chunk_sizes(1000), chunk_sizes(64), (16,)]


def _cost(plan, overhead):
  return sum(overhead + size for _, size in plan)


def _least_cost(n, sizes, overhead):
  """The least cost of any plan of n tokens: a DP over every length up to n."""
  best = [0.0] * (n + 1)
  for r in range(1, n + 1):
    best[r] = min(overhead + size + best[max(r - size, 0)] for size in sizes)
  return best[n]


def test_697_tokens_are_not_read_as_1024():
  """Issue 51: 697 tokens were one 1024-chunk (327 slots of padding)."""
  sizes = chunk_sizes(1024)
  assert split_tokens(697, sizes) == [(697, 1024)]
  plan = plan_sizes(697, sizes)
  assert plan == [(256, 256), (256, 256), (185, 256)]
  assert sum(size for _, size in plan) - 697 == 71
  assert _cost(plan, CHUNK_OVERHEAD) < _cost(split_tokens(697, sizes), CHUNK_OVERHEAD)
  # Lengths the plans keep: whole chunks and a tail that a small chunk holds.
  for n, want in [(64, [64]), (200, [256]), (1500, [1024, 256, 256]), (2048, [1024, 1024])]:
    assert [size for _, size in plan_sizes(n, sizes)] == want, n


@pytest.mark.parametrize("sizes", SIZES, ids=str)
@pytest.mark.parametrize("overhead", [0, 16, CHUNK_OVERHEAD, 200])
def test_least_cost_and_never_dearer_than_split_tokens(sizes, overhead):
  divisible = all(a % b == 0 for a, b in zip(sizes, sizes[1:]))
  for n in range(1, 4 * sizes[0] + 3, max(1, sizes[0] // 150)):
    plan = plan_sizes(n, sizes, overhead)
    assert sum(t for t, _ in plan) == n and all(0 < t <= s for t, s in plan)
    assert all(t == s for t, s in plan[:-1])  # only the last chunk is padded
    assert {s for _, s in plan} <= set(sizes)  # only compiled sizes
    assert plan[0] == first_chunk(n, sizes, overhead)
    cost = _cost(plan, overhead)
    assert cost <= _cost(split_tokens(n, sizes), overhead), n
    if divisible:
      assert cost == _least_cost(n, sizes, overhead), n


def test_overhead_trades_padding_for_chunks():
  sizes = chunk_sizes(1024)
  for n in range(1, 3000, 13):
    # No fixed cost: the least padding (under the smallest size) whatever the chunk count.
    assert sum(s for _, s in plan_sizes(n, sizes, 0)) - n < sizes[-1]
    # A fixed cost above any padding: the fewest chunks.
    assert len(plan_sizes(n, sizes, 1e6)) == -(-n // sizes[0])


def _layout(config, **options):
  options = dict(kv_dtype="float32", max_seq_len=3000, kv_growth="grow", prefill_chunk=1024,
                 shares_budget=False) | options
  return KVLayout.make(config, **options)


def test_layout_overhead(tiny_config):
  assert _layout(tiny_config).chunk_overhead == CHUNK_OVERHEAD
  layout = _layout(tiny_config, chunk_overhead=1e6)
  assert [c.size for c in layout.plan_chunks(0, 697)] == [1024]
  with pytest.raises(ValueError, match="chunk_overhead must be >= 0"):
    _layout(tiny_config, chunk_overhead=-1)


@pytest.mark.parametrize("growth", ["grow", "max"])
def test_plan_chunks_sizes_limit_and_anchors(tiny_config, growth):
  layout = _layout(tiny_config, kv_growth=growth)
  assert layout.chunk_sizes == (1024, 256, 64, 16)
  limit = layout.kv_capacities[-1]
  rng = np.random.default_rng(0)
  for _ in range(300):
    start = int(rng.integers(0, 2990))
    n = int(rng.integers(1, 3000 - start + 1))
    slots = int(rng.choice([0, 2, 8]))
    anchors = sorted(set(rng.integers(0, n, int(rng.integers(0, 40))).tolist()))
    plan = layout.plan_chunks(start, n, anchors, anchor_slots=slots)
    assert [c.begin for c in plan] == list(np.cumsum([0] + [c.tokens for c in plan[:-1]]))
    assert sum(c.tokens for c in plan) == n
    assert all(0 < c.tokens <= c.size and c.size in layout.chunk_sizes for c in plan)
    assert all(start + c.begin + c.size <= limit for c in plan)  # padding within the buffer
    if slots:
      assert all(len(c.anchors) <= slots for c in plan)
      assert [c.begin + p for c in plan for p in c.anchors] == anchors
      assert all(0 <= p < c.tokens for c in plan for p in c.anchors)
    else:
      assert all(c.anchors == () for c in plan)
    if not anchors or not slots:
      if start + n + layout.chunk_sizes[0] <= limit:  # far from the end: the plan of n tokens
        assert [(c.tokens, c.size) for c in plan] == plan_sizes(n, layout.chunk_sizes)


@pytest.fixture(scope="module")
def model(tiny_config):
  return scaled_params(model_lib.random_model(tiny_config, seed=3, dtype="float32"), 4.0)


def test_every_length_runs_precompiled_programs(model):
  """Chunks of (64, 16) at every prompt length up to the context limit: no compile after
  ``precompile``, the full forward's last logits."""
  engine = ftjax.Engine(model, kernels="ffi", prefill_chunk=64, max_seq_len=128)
  assert engine.chunk_sizes == (64, 16)
  engine.precompile()
  compiled = engine.compile_count
  rng = np.random.default_rng(1)
  for n in (1, 17, 20, 37, 64, 70, 100, 127, 128):
    plan = engine.plan_chunks(0, n)
    if n in (17, 20):  # one padded 64-chunk, not two 16-chunks (split_tokens' plan)
      assert [c.size for c in plan] == [64] and len(split_tokens(n, (64, 16))) == 2
    ids = rng.integers(0, model.config.vocab_size, n)
    got = engine.prefill_logits(ids)
    assert engine.compile_count == compiled, n
    tolerances.assert_close(got, engine.forward_logits(ids)[-1], tolerances.F32, floor=1.0,
                            what=f"{n} tokens")
    compiled = engine.compile_count  # forward_logits compiles its own program
