"""The decode loop on the device: the same tokens as a per-token reference loop for every
policy and cache size, deterministic sampling, bounded host round trips, no retrace within a
bucket, and no silent fallback when the compiled kernels are missing."""

import dataclasses
import gc
import math
import os
import subprocess
import sys
import textwrap
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ftjax
from ftjax.runtime import model as model_lib
from ftjax.runtime import programs
from ftjax.runtime.kv import chunk_sizes, split_tokens

PROMPT = [3, 1, 4, 1, 5, 9, 2]
NEW = 11
CHUNK = 3  # small, so that a request crosses several chunk boundaries


@pytest.fixture(scope="module")
def sharp_model(tiny_config):
  model = model_lib.random_model(tiny_config, seed=5)
  params = jax.tree.map(lambda x: x * 8.0, model.params)  # sharp routing, distinct logits
  return dataclasses.replace(model, params=params, bank=model.bank * 8.0)


def _options(model, policy, slots):
  if policy is None:
    return {}
  total = model.config.num_moe_layers * model.config.num_experts
  hot = np.arange(total)[::-1].reshape(model.config.num_moe_layers, -1)
  return dict(cache_slots=slots, policy=policy, bandwidths=(12.0, 24.0), hot_experts=hot)


def _reference_loop(engine, prompt, new):
  """Greedy decoding one ``engine.step`` per token, argmax on the host."""
  state = engine.new_state(1, len(prompt) + new)
  state, logits = engine.step(state, jnp.asarray([prompt], jnp.int32),
                              jnp.arange(len(prompt), dtype=jnp.int32)[None], last_only=True,
                              fresh=True)
  out = []
  for i in range(new):
    out.append(int(np.asarray(logits[0, -1]).argmax()))
    if i == new - 1:
      break
    state, logits = engine.step(state, jnp.asarray([[out[-1]]], jnp.int32),
                                jnp.asarray([[len(prompt) + i]], jnp.int32), last_only=True)
  return out


# With a third of the experts cached (where plans differ most): a policy of each kind of state
# the loop carries (recency, LRFU scores with the layer cycle, free-slot fills, a preloaded
# cache); empty and full caches for the two fill rules' representatives (q* and fill-all).
# The other policies differ only inside the plan function, the same in both loops (CI time).
_CASES = [(None, 0)] + [(p, "1/3") for p in ("freetoken", "lru_fill", "freetoken_lrfu_cycle",
                                            "freetoken_free", "static_hot")] + [
    (p, f) for p in ("freetoken", "lru_fill") for f in ("0", "1")]


@pytest.mark.parametrize("policy,size", _CASES, ids=[f"{p}-{s}" for p, s in _CASES])
def test_greedy_device_loop_equals_per_token_loop(sharp_model, policy, size):
  c = sharp_model.config
  total = c.num_moe_layers * c.num_experts
  slots = {"0": 0, "1/3": total // 3, "1": total}.get(size, 0)
  opts = _options(sharp_model, policy, slots)
  device = ftjax.Engine(sharp_model, kernels="ffi", decode_chunk=CHUNK, **opts)
  reference = ftjax.Engine(sharp_model, kernels="ffi", **opts)
  got = device.generate(PROMPT, NEW)
  want = _reference_loop(reference, PROMPT, NEW)
  assert got == want
  assert len(set(got)) > 1  # not a degenerate model
  if policy is not None:
    # The cache went through the same plans: same contents, same per-step counts.
    np.testing.assert_array_equal(np.asarray(device.cache.owner), np.asarray(reference.cache.owner))
    np.testing.assert_array_equal(np.asarray(device.cache.slots), np.asarray(reference.cache.slots))
    a, b = device.stats(), reference.stats()
    assert a["steps"] == b["steps"] == NEW
    for key in ("hits", "fills", "host"):
      np.testing.assert_array_equal([s[key] for s in a["per_step"]],
                                    [s[key] for s in b["per_step"]])


def test_xla_kernels_device_loop_equals_per_token_loop(sharp_model):
  opts = _options(sharp_model, "freetoken", 5)
  got = ftjax.Engine(sharp_model, kernels="xla", decode_chunk=CHUNK, **opts).generate(PROMPT, NEW)
  assert got == _reference_loop(ftjax.Engine(sharp_model, kernels="xla", **opts), PROMPT, NEW)


def test_stop_token_and_max_new_tokens_end_on_the_device(sharp_model):
  engine = ftjax.Engine(sharp_model, kernels="ffi", decode_chunk=CHUNK)
  free = engine.generate(PROMPT, NEW)
  stop = free[4]
  stopped = engine.generate(PROMPT, NEW, stop_tokens=(stop,))
  assert stopped == free[:free.index(stop) + 1]
  for n in (0, 1, 2, CHUNK, CHUNK + 1, 2 * CHUNK + 1):
    assert engine.generate(PROMPT, n) == free[:n]


def test_sampling_is_deterministic_per_seed(sharp_model):
  model = dataclasses.replace(sharp_model, params=jax.tree.map(lambda x: x / 8.0,
                                                                  sharp_model.params))
  engine = ftjax.Engine(model, kernels="ffi", decode_chunk=CHUNK)
  kw = dict(greedy=False, temperature=1.5, top_p=0.95)
  a = engine.generate(PROMPT, 16, seed=11, **kw)
  assert a == engine.generate(PROMPT, 16, seed=11, **kw)
  assert a != engine.generate(PROMPT, 16, seed=12, **kw)
  # The chunk length changes when the host reads, not what is drawn.
  assert a == ftjax.Engine(model, kernels="ffi", decode_chunk=5).generate(PROMPT, 16, seed=11,
                                                                            **kw)


def test_tiny_top_p_keeps_only_the_most_likely_token(sharp_model):
  engine = ftjax.Engine(sharp_model, kernels="ffi", decode_chunk=CHUNK)
  greedy = engine.generate(PROMPT, NEW)
  for seed in range(3):
    assert engine.generate(PROMPT, NEW, greedy=False, temperature=2.0, top_p=1e-6,
                           seed=seed) == greedy


def test_sampled_tokens_follow_the_distribution(sharp_model):
  """One sampled token per seed: frequencies match softmax(logits / temperature) (a float64
  numpy reference), and tokens outside the top-p nucleus never appear."""
  model = dataclasses.replace(sharp_model, params=jax.tree.map(lambda x: x / 4.0,
                                                                  sharp_model.params))
  engine = ftjax.Engine(model, kernels="ffi")
  logits = engine.forward_logits(PROMPT)[-1].astype(np.float64)
  temperature, top_p = 1.3, 0.8
  p = np.exp((logits - logits.max()) / temperature)
  p /= p.sum()
  order = np.argsort(-p, kind="stable")
  nucleus = set(order[np.cumsum(p[order]) - p[order] < top_p].tolist())
  draws = 300
  counts = np.zeros(len(p))
  for seed in range(draws):
    counts[engine.generate(PROMPT, 1, greedy=False, temperature=temperature, top_p=top_p,
                           seed=seed)[0]] += 1
  assert set(np.nonzero(counts)[0].tolist()) <= nucleus
  q = np.where(np.isin(np.arange(len(p)), list(nucleus)), p, 0.0)
  q /= q.sum()
  # Every token's count within 5 standard deviations of its binomial expectation.
  sd = np.sqrt(draws * q * (1 - q)) + 1.0
  assert np.all(np.abs(counts - draws * q) <= 5 * sd)


@pytest.mark.parametrize("policy", [None, "freetoken"])
def test_host_round_trips_are_bounded(sharp_model, policy):
  engine = ftjax.Engine(sharp_model, kernels="ffi", decode_chunk=CHUNK,
                        **_options(sharp_model, policy, 5), record_routing=True)
  engine.generate(PROMPT, NEW)  # compiles
  executed = []

  def counting(fn):
    def run(*args):
      executed.append(1)
      return fn(*args)
    return run

  table = engine.programs._table
  saved = dict(table)
  try:
    for key, fn in saved.items():
      table[key] = counting(fn)
    for new in (1, 2, CHUNK + 1, NEW, 3 * CHUNK + 1):
      executed.clear()
      with jax.transfer_guard("disallow"):  # no implicit transfer between the programs
        result = engine.generate_timed(PROMPT, new)
      assert len(result.tokens) == new
      assert len(executed) == result.programs
      # One extend chunk, the first token, the decode chunks and one dispatched ahead.
      assert result.programs <= 2 + math.ceil(new / CHUNK) + 1
  finally:
    table.update(saved)
  # The routing record and the stats came back once per chunk, complete.
  record = engine.routing_record()
  assert record["ids"].shape[0] == record["phase"].shape[0]
  assert int(record["phase"].sum()) == sum(n - 1 for n in (NEW, 1, 2, CHUNK + 1, NEW,
                                                           3 * CHUNK + 1))


def test_requests_of_any_length_and_sampling_do_not_recompile(sharp_model):
  programs.clear_compiled()  # earlier tests compiled these programs already
  engine = ftjax.Engine(sharp_model, kernels="ffi", decode_chunk=CHUNK,
                        **_options(sharp_model, "freetoken", 5))
  engine.generate([1, 2, 3], 5)
  assert engine.compile_count == 3  # an extend chunk, the first token, the decode loop
  assert sorted(key[0] for key in engine.programs_needed()) == ["decode"] + ["extend"] * len(
      engine.chunk_sizes) + ["first"]
  engine.precompile()  # the other chunk sizes
  first = engine.compile_count
  assert first == len(engine.programs_needed())
  # Other prompt lengths (one to three chunks), lengths, stop lists, greedy and sampled with
  # and without a top-p or top-k filter: the same programs.
  engine.generate([7] * 11, 9, stop_tokens=(5,))
  engine.generate([4, 5], 1, greedy=True)
  engine.generate([4, 5, 6], 6, greedy=False, temperature=0.7, top_p=0.9, seed=1)
  engine.generate([9] * 40, 4, greedy=False, temperature=1.7, top_k=3, seed=2)
  engine.generate([9] * 100, 4, greedy=False, temperature=1.7, seed=2)
  assert engine.compile_count == first
  # A second engine of the same model and options shares the compiled programs.
  other = ftjax.Engine(sharp_model, kernels="ffi", decode_chunk=CHUNK,
                       **_options(sharp_model, "freetoken", 5))
  other.generate([1, 2], 3)
  assert other.compile_count == 0


def test_compiled_programs_go_with_their_last_engine(sharp_model):
  """A sweep that makes engine after engine must not keep every program it compiled: each
  executable's code is mapped into memory, and past vm.max_map_count a compile crashes."""
  opts = dict(kernels="ffi", decode_chunk=CHUNK, **_options(sharp_model, "lru_fill", 4))
  engine = ftjax.Engine(sharp_model, **opts)
  engine.generate(PROMPT, 4)
  other = ftjax.Engine(sharp_model, **opts)
  assert other.programs is engine.programs  # shared while both live
  table = weakref.ref(engine.programs)
  del engine, other
  gc.collect()
  assert table() is not None  # the last table acquired is kept for the next engine (a sweep)
  programs.release_unused()
  gc.collect()
  assert table() is None
  fresh = ftjax.Engine(sharp_model, **opts)
  fresh.generate(PROMPT, 4)
  assert fresh.compile_count == 3  # compiled again: nothing was kept


def _memory_mappings() -> int:
  with open("/proc/self/maps") as f:
    return sum(1 for _ in f)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc")
def test_dropped_engines_return_their_code_mappings(sharp_model):
  """A script that builds engine after engine: once the engines are gone and the kept table is
  released (``programs.release_unused``; the next engine of another runner does it too), the
  process holds no more memory mappings than before: JAX's own caches let go of what the
  table compiled (issue 50)."""
  def run(slots):
    engine = ftjax.Engine(sharp_model, kernels="ffi", decode_chunk=CHUNK,
                          **_options(sharp_model, "lru_fill", slots))
    engine.generate(PROMPT, 4)

  run(2)
  programs.release_unused()
  gc.collect()
  before = _memory_mappings()
  for slots in (3, 5, 7):  # other cache sizes: other programs
    run(slots)
  assert _memory_mappings() > before + 100  # each engine's programs mapped code
  programs.release_unused()
  gc.collect()
  assert _memory_mappings() <= before + 16


def test_chunk_sizes_and_splits():
  assert chunk_sizes(2048) == (2048, 512, 128, 32)
  assert chunk_sizes(1000) == (1000, 250, 62)
  assert chunk_sizes(8) == (8,)
  sizes = chunk_sizes(2048)
  assert split_tokens(5, sizes) == [(5, 32)]
  assert split_tokens(130, sizes) == [(128, 128), (2, 32)]
  assert split_tokens(300, sizes) == [(300, 512)]
  assert split_tokens(4100, sizes) == [(2048, 2048), (2048, 2048), (4, 32)]
  for n in range(1, 5000, 7):
    chunks = split_tokens(n, sizes)
    assert sum(t for t, _ in chunks) == n and all(0 < t <= s for t, s in chunks)
    assert all(t == s for t, s in chunks[:-1])  # only the last chunk is padded
    tail = n % 2048 or 2048
    assert sum(s for _, s in chunks) - n < max(tail, 32)  # padding under the tail's length
    assert len(chunks) <= n // 2048 + 5


def test_plan_chunks_bounds_anchors_and_the_kv_buffer(sharp_model):
  engine = ftjax.Engine(sharp_model, kernels="ffi", prefill_chunk=64, max_seq_len=200,
                        kv_growth="max")
  assert engine.chunk_sizes == (64, 16) and engine.kv_capacities == (216,)

  def check(start, n, plan, anchors=()):
    assert [c.begin for c in plan] == list(np.cumsum([0] + [c.tokens for c in plan[:-1]]))
    assert sum(c.tokens for c in plan) == n
    assert all(0 < c.tokens <= c.size for c in plan)
    assert all(start + c.begin + c.size <= engine.kv_capacities[-1] for c in plan)
    assert [c.begin + p for c in plan for p in c.anchors] == sorted(anchors)

  plan = engine.plan_chunks(0, 100)
  assert [(c.tokens, c.size) for c in plan] == [(64, 64), (36, 64)]
  check(0, 100, plan)
  # Near the limit the padding of a 64-chunk would run past the buffer: 16-chunks instead.
  plan = engine.plan_chunks(100, 100)
  assert [(c.tokens, c.size) for c in plan] == [(64, 64), (16, 16), (16, 16), (4, 16)]
  check(100, 100, plan)
  # At most 8 anchors a chunk: a chunk that would hold more ends before the ninth.
  anchors = list(range(0, 100, 3))
  plan = engine.plan_chunks(0, 100, anchors, anchor_slots=8)
  assert all(len(c.anchors) <= 8 for c in plan) and len(plan) > 2
  check(0, 100, plan, anchors)
  plan = engine.plan_chunks(150, 50, anchors[:17], anchor_slots=8)
  check(150, 50, plan, [p for p in anchors[:17] if p < 50])


_NO_FFI = textwrap.dedent("""
    import sys
    sys.modules["ftjax._ffi"] = None  # the compiled module cannot be imported
    import ftjax, ftjax.kernels
    from ftjax.model.config import ModelConfig
    from ftjax.runtime import model as model_lib
    assert not ftjax.kernels.available()
    config = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=8, num_experts=4, top_k=2,
                         moe_intermediate_size=16, rms_norm_eps=1e-6, rope_theta=1e4,
                         max_position_embeddings=64, layer_types=("full_attention",),
                         qk_norm="per_head", norm_topk_prob=True)
    model = model_lib.random_model(config, seed=0)
    for kernels in ("auto", "ffi", "ffi_bf16"):
      try:
        ftjax.Engine(model, kernels=kernels)
      except ftjax.kernels.KernelsUnavailable as e:
        print("refused", kernels, "|", e)
      else:
        print("ran", kernels)
    engine = ftjax.Engine(model, kernels="xla")
    print("xla path:", engine.kernels_path, engine.generate([1, 2, 3], 2))
""")


def test_missing_kernel_module_is_reported_never_a_silent_fallback():
  run = subprocess.run([sys.executable, "-c", _NO_FFI], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.abspath(__file__)), timeout=300)
  assert run.returncode == 0, run.stderr
  lines = run.stdout.splitlines()
  for kernels in ("auto", "ffi", "ffi_bf16"):
    line = next(l for l in lines if l.split()[1] == kernels)
    assert line.startswith("refused"), line
    assert "ftjax._ffi" in line and "pip install --no-build-isolation" in line
    assert "kernels='xla'" in line  # the way to run the slow path knowingly
  assert any(l.startswith("xla path: xla (cpu, requested)") for l in lines)


def test_decode_cli_without_the_kernel_module_fails_with_the_fix():
  code = ("import sys; sys.modules['ftjax._ffi'] = None; sys.argv = ['ftjax.decode']; "
          "from ftjax.decode import cli; cli()")
  run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.abspath(__file__)), timeout=300)
  assert run.returncode != 0
  assert "ftjax.decode: error:" in run.stderr and "pip install --no-build-isolation" in run.stderr
