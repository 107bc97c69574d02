"""The GPU program, checked without a GPU (issue 14, DESIGN section 10).

* Its semantics on the CPU backend with memory kinds: the pool a ``pinned_host`` array, fills
  as in-program slices moved to device memory, host experts reading the pool in place. Every
  policy at sizes 0, 1, L·E/3 and L·E gives the dense reference's logits and tokens.
* The decode program with the CUDA ops (host experts by the start/done pair; fills by XLA
  slices or by the CUDA copy kernel) exports for ``cuda`` for every policy.
* Placement errors are clear.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export
from jax.sharding import SingleDeviceSharding

import ftjax
from ftjax.cache import POLICIES
from ftjax.cache.moe import Offload
from ftjax.cache.state import check_invariants
from ftjax.kernels import cuda
from ftjax.runtime import model as model_lib
from ftjax.runtime import programs

import tolerances
from conftest import scaled_params

STEPS = 12
PROMPT = 5


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe"])
def model(request, tiny_config, tiny_hybrid_config):
  config = tiny_config if request.param == "qwen3_moe" else tiny_hybrid_config
  return scaled_params(model_lib.random_model(config, seed=3), 8.0)


def _run(engine, prompt):
  state = engine.new_state(1, PROMPT + STEPS + 1)
  state, logits = engine.step(state, jnp.asarray([prompt], jnp.int32),
                              jnp.arange(PROMPT, dtype=jnp.int32)[None], last_only=True)
  out = [np.asarray(logits[0, -1])]
  for i in range(STEPS):
    token = np.int32(out[-1].argmax())
    state, logits = engine.step(state, jnp.full((1, 1), token, jnp.int32),
                                jnp.full((1, 1), PROMPT + i, jnp.int32), last_only=True)
    out.append(np.asarray(logits[0, -1]))
  return np.stack(out)


def test_pinned_host_pool_matches_the_dense_reference(model):
  c = model.config
  prompt = list(np.random.default_rng(1).integers(0, c.vocab_size, PROMPT))
  # The dense path with the same kernels: the split between slots and pool is what differs.
  reference = _run(ftjax.Engine(model, kernels="ffi"), prompt)
  total = c.num_layers * c.num_experts
  hot = np.arange(total)[::-1]
  # The pool's slices do not depend on the policy: the two fill rules' representatives at every
  # size, and on qwen3_moe a preloaded cache and an LRFU-scored one where slots and pool share
  # the work (CI time; every policy runs against the dense path in test_engine_cache).
  policies = ("freetoken", "lru_fill") + (
      ("static_hot", "freetoken_lrfu_cycle") if c.model_type == "qwen3_moe" else ())
  for policy in policies:
    sizes = (0, 1, total // 3, total) if policy in ("freetoken", "lru_fill") else (total // 3,)
    for slots in sizes:
      engine = ftjax.Engine(model, kernels="ffi", cache_slots=slots, policy=policy,
                            bandwidths=(12.0, 24.0), hot_experts=hot, pool="pinned_host",
                            cache_capacity=total)
      assert engine.placement.offload == Offload(fill="slices", host="kernels")
      assert engine.bank.sharding.memory_kind == "pinned_host"
      got = _run(engine, prompt)
      np.testing.assert_array_equal(got.argmax(-1), reference.argmax(-1))
      tolerances.assert_close(got, reference, tolerances.F32, floor=1.0)
      check_invariants(engine.cache)
      stats = engine.stats()
      if slots and policy in ("lru_fill", "freetoken"):
        assert stats["bytes"]["fill"] > 0  # the slices really filled slots
      if slots == 0 or policy in ("cpu_only", "static_hot", "static_layers"):
        assert stats["bytes"]["fill"] == 0


def test_slice_fills_copy_exactly_the_planned_blocks():
  bank = np.arange(3 * 5 * 4, dtype=np.float32).reshape(3, 5, 4)
  pinned = jax.device_put(bank, SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))
  slots = jnp.full((6, 4), -1.0)
  from ftjax.cache.moe import fill_slots  # noqa: PLC0415 (the function under test)
  fill = jax.jit(lambda s, b, e, d: fill_slots(s, b, 2, e, d, offload=Offload(fill="slices")),
                 donate_argnums=0)
  out = np.asarray(fill(slots, pinned, jnp.asarray([4, -1, 0], jnp.int32),
                        jnp.asarray([5, -1, 1], jnp.int32)))
  expect = np.full((6, 4), -1.0, np.float32)
  expect[5], expect[1] = bank[2, 4], bank[2, 0]
  np.testing.assert_array_equal(out, expect)


def _export_decode(engine, offload):
  """jax.export of the engine's decode program with ``offload``, for CUDA."""
  runner = dataclasses.replace(engine.runner, offload=offload)
  spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
  state = jax.tree.map(spec, engine.executor.engine_state(
      engine.executor.abstract_state(1, 256, rows=True)))
  bank = None
  if offload.fill == "slices":
    bank = jax.ShapeDtypeStruct(engine.model.bank.shape, engine.model.bank.dtype,
                                sharding=SingleDeviceSharding(jax.devices()[0],
                                                              memory_kind="pinned_host"))
  fn = jax.jit(lambda *a: programs.decode_program(runner, *a))
  checks = [export.DisabledSafetyCheck.custom_call(t) for t in cuda.TARGETS]
  return export.export(fn, platforms=["cuda"], disabled_checks=checks)(
      jax.tree.map(spec, engine.model.params), bank, state, *engine.executor.decode_specs(1))


@pytest.mark.parametrize("policy", POLICIES)
def test_the_gpu_decode_step_exports_for_cuda(tiny_config, policy):
  model = model_lib.random_model(tiny_config, seed=0, dtype="bfloat16")
  total = tiny_config.num_layers * tiny_config.num_experts
  engine = ftjax.Engine(model, kernels="xla", cache_slots=total // 3, policy=policy,
                        bandwidths=(12.0, 24.0), hot_experts=np.arange(total))
  pool = cuda.PoolSpec(handle=0, shape=tuple(model.bank.shape), dtype="bfloat16")
  layers = tiny_config.num_layers
  for fill in ("slices", "cuda"):
    exported = _export_decode(engine, Offload(fill=fill, host="cuda", pool=pool))
    assert exported.platforms == ("cuda",)
    text = exported.mlir_module()
    # One start/done pair per MoE layer; fills from the pool by its kind.
    assert text.count("ftjax_cuda_host_experts_start") == layers
    assert text.count("ftjax_cuda_host_experts_done") == layers
    assert text.count("ftjax_cuda_pool_fill") == (layers if fill == "cuda" else 0)
    assert ("pinned_host" in text) == (fill == "slices")


def test_gpt_oss_host_experts_export_with_their_variant(tiny_config):
  """The CUDA host-experts op carries the experts' activation and biases (gpt-oss)."""
  config = dataclasses.replace(tiny_config, expert_activation="clamped_swiglu", expert_bias=True,
                               swiglu_limit=6.5)
  model = model_lib.random_model(config, seed=0, dtype="bfloat16")
  engine = ftjax.Engine(model, kernels="xla", cache_slots=5, policy="freetoken",
                        bandwidths=(12.0, 24.0))
  pool = cuda.PoolSpec(handle=0, shape=tuple(model.bank.shape), dtype="bfloat16")
  text = _export_decode(engine, Offload(fill="cuda", host="cuda", pool=pool)).mlir_module()
  starts = [line for line in text.splitlines() if "ftjax_cuda_host_experts_start" in line]
  assert len(starts) == config.num_layers
  for line in starts:
    assert 'activation = "clamped_swiglu"' in line and "biases = true" in line, line
    assert "limit = 6.5" in line, line


def test_the_streamed_prefill_exports_for_cuda(tiny_config):
  model = model_lib.random_model(tiny_config, seed=0, dtype="bfloat16")
  engine = ftjax.Engine(model, kernels="xla", cache_slots=5, policy="freetoken",
                        bandwidths=(12.0, 24.0))
  pool = cuda.PoolSpec(handle=0, shape=tuple(model.bank.shape), dtype="bfloat16")
  spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
  for fill in ("slices", "cuda"):
    runner = dataclasses.replace(engine.runner, stream_min_tokens=16,
                                 offload=Offload(fill=fill, host="cuda", pool=pool))
    bank = None
    if fill == "slices":
      bank = jax.ShapeDtypeStruct(model.bank.shape, model.bank.dtype,
                                  sharding=SingleDeviceSharding(jax.devices()[0],
                                                                memory_kind="pinned_host"))
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    fn = jax.jit(lambda *a: programs.extend_program(runner, *a))
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in cuda.TARGETS]
    exported = export.export(fn, platforms=["cuda"], disabled_checks=checks)(
        jax.tree.map(spec, model.params), bank,
        jax.tree.map(spec, engine.executor.engine_state(engine.executor.abstract_state(1, 256))),
        jax.ShapeDtypeStruct((1, 32), jnp.int32), scalar,
        jax.ShapeDtypeStruct((1, 32), jnp.int32), jax.ShapeDtypeStruct((), jnp.bool_))
    text = exported.mlir_module()
    # Streamed: no host experts; each whole layer comes by the fill mechanism, started one
    # layer ahead (CUDA: a side-stream copy whose done the layer's compute waits for).
    layers = tiny_config.num_layers
    assert "ftjax_cuda_host_experts_start" not in text
    assert "ftjax_cuda_pool_fill" not in text
    assert text.count("ftjax_cuda_fetch_layer_start") == (layers if fill == "cuda" else 0)
    assert text.count("ftjax_cuda_fetch_layer_done") == (layers if fill == "cuda" else 0)
    if fill == "cuda":  # double buffering: layer 1's copy is started before layer 0 waits
      second_start = text.index("ftjax_cuda_fetch_layer_start",
                                text.index("ftjax_cuda_fetch_layer_start") + 1)
      assert second_start < text.index("ftjax_cuda_fetch_layer_done")
    if fill == "slices":
      assert "pinned_host" in text


def test_the_per_layer_stream_choice_exports_for_cuda(tiny_config):
  """prefill_stream="cost": each layer-step holds both the sparse step (host experts posted
  and waited for) and the streamed one under a conditional; layer 0 fetches in its branch,
  the later layers' transfers start (conditionally) one layer-step early."""
  model = model_lib.random_model(tiny_config, seed=0, dtype="bfloat16")
  engine = ftjax.Engine(model, kernels="xla", cache_slots=5, policy="freetoken",
                        bandwidths=(12.0, 24.0))
  pool = cuda.PoolSpec(handle=0, shape=tuple(model.bank.shape), dtype="bfloat16")
  spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
  runner = dataclasses.replace(engine.runner, stream_min_tokens=16, prefill_stream="cost",
                               offload=Offload(fill="cuda", host="cuda", pool=pool,
                                               host_gflops=100.0))
  scalar = jax.ShapeDtypeStruct((), jnp.int32)
  fn = jax.jit(lambda *a: programs.extend_program(runner, *a))
  checks = [export.DisabledSafetyCheck.custom_call(t) for t in cuda.TARGETS]
  exported = export.export(fn, platforms=["cuda"], disabled_checks=checks)(
      jax.tree.map(spec, model.params), None,
      jax.tree.map(spec, engine.executor.engine_state(engine.executor.abstract_state(1, 256))),
      jax.ShapeDtypeStruct((1, 32), jnp.int32), scalar,
      jax.ShapeDtypeStruct((1, 32), jnp.int32), jax.ShapeDtypeStruct((), jnp.bool_))
  text = exported.mlir_module()
  layers = tiny_config.num_layers
  for target in ("ftjax_cuda_host_experts_start", "ftjax_cuda_host_experts_done",
                 "ftjax_cuda_fetch_layer_start", "ftjax_cuda_fetch_layer_done"):
    assert text.count(target) == layers, target
  assert text.count("stablehlo.case") + text.count("stablehlo.if") >= 2 * layers - 1


def test_placement_errors_are_clear(model):
  with pytest.raises(ValueError, match="pool must be one of"):
    ftjax.Engine(model, cache_slots=2, policy="lru_fill", pool="hbm")
  with pytest.raises(ValueError, match="kernels='xla' cannot"):
    ftjax.Engine(model, kernels="xla", cache_slots=2, policy="lru_fill", pool="pinned_host")
  with pytest.raises(ValueError, match="GPU path's pool"):
    ftjax.Engine(model, cache_slots=2, policy="lru_fill", pool="mapped")
  with pytest.raises(ValueError, match="give a cache size"):
    ftjax.Engine(model, pool="pinned_host")
  with pytest.raises(ValueError, match="registered pool"):
    Offload(fill="cuda")
  if not cuda.cuda_available():
    with pytest.raises(ImportError, match="ftjax._ffi_cuda"):
      cuda.register_pool(np.zeros((1, 2, 3), np.float32))


@pytest.mark.parametrize("pool", ["device", "pinned_host"])
def test_streamed_prefill_matches_and_leaves_the_cache_as_warm(model, pool):
  """Long prefills stream each layer whole (DESIGN section 4): same logits as the dense path,
  and the same cache afterwards as the sparse prefill (the plan's fills, copied from the
  streamed layer)."""
  c = model.config
  total = c.num_layers * c.num_experts
  prompt = list(np.random.default_rng(2).integers(0, c.vocab_size, 24))
  reference = _prefill(ftjax.Engine(model, kernels="ffi"), prompt)
  for policy in ("freetoken", "static_hot"):
    engines = {
        stream: ftjax.Engine(model, kernels="ffi", cache_slots=total // 3, policy=policy,
                             bandwidths=(12.0, 24.0), hot_experts=np.arange(total)[::-1],
                             pool=pool, stream_prefill_tokens=stream)
        for stream in (0, 16)}
    logits = {stream: _prefill(engine, prompt) for stream, engine in engines.items()}
    tolerances.assert_close(logits[16], reference, tolerances.F32, floor=1.0)
    sparse, streamed = engines[0].cache, engines[16].cache
    for field in ("owner", "slot_of", "slot_stamp", "expert_stamp", "expert_count", "slots"):
      np.testing.assert_array_equal(np.asarray(getattr(streamed, field)),
                                    np.asarray(getattr(sparse, field)), err_msg=field)
    stats = engines[16].stats()
    assert stats["streamed_layer_steps"] == c.num_layers
    assert stats["bytes"]["host"] == 0 and stats["bytes"]["stream"] > 0
    assert engines[0].stats()["streamed_layer_steps"] == 0


def _prefill(engine, prompt):
  state = engine.new_state(1, len(prompt) + 1)
  state, logits = engine.step(state, jnp.asarray([prompt], jnp.int32),
                              jnp.arange(len(prompt), dtype=jnp.int32)[None])
  return np.asarray(logits[0])


def test_only_prefills_stream(tiny_config):
  """A decode step of a batch holds several tokens but no prefill: it never streams."""
  model = model_lib.random_model(tiny_config, seed=1)
  engine = ftjax.Engine(model, kernels="ffi", cache_slots=4, policy="lru_fill",
                        stream_prefill_tokens=2)
  state = engine.new_state(3, 8)
  engine.step(state, jnp.ones((3, 1), jnp.int32), jnp.zeros((3, 1), jnp.int32))
  assert engine.stats()["streamed_layer_steps"] == 0
  state = engine.new_state(1, 8)
  engine.step(state, jnp.ones((1, 4), jnp.int32), jnp.arange(4, dtype=jnp.int32)[None])
  assert engine.stats()["streamed_layer_steps"] == tiny_config.num_layers
