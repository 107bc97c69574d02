"""An int8-expert model (docs/ftw.md) through the engine and the expert cache: every cache size
(0, 1, some, all) with freetoken and lru_fill, host kernel and XLA, gives the logits and greedy
tokens of the dense reference of the same model with its experts dequantised to float32."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import ftjax
from ftjax.cache.state import check_invariants
from ftjax.runtime import model as model_lib

import reference
import tolerances
from conftest import greedy_run, scaled_params

STEPS = 8
PROMPT = 5


@pytest.fixture(scope="module")
def models(tiny_config):
  """(int8 model, the same model with a float32 bank of the dequantised experts)."""
  model = scaled_params(model_lib.random_model(tiny_config, seed=11), 8.0)
  int8 = model_lib.quantize_experts(model)
  c = int8.config
  bank = np.asarray(int8.bank)
  assert bank.dtype == np.int8
  deq = np.stack([np.stack([np.concatenate([p.reshape(-1) for p in reference.split_block(
      block, c.moe_intermediate_size, c.hidden_size)]) for block in layer]) for layer in bank])
  return int8, dataclasses.replace(int8, bank=jnp.asarray(deq.astype(np.float32)))


def _run(engine, prompts):
  """Prefill, then STEPS greedy single-token steps: (logits per step, tokens)."""
  return greedy_run(engine, prompts, STEPS)


@pytest.fixture(scope="module")
def dense_reference(models):
  """kernels -> (prompts, run of the dequantised model with no cache on those kernels)."""
  _, deq = models
  prompts = np.random.default_rng(0).integers(0, deq.config.vocab_size, (3, PROMPT))
  return {k: (prompts, _run(ftjax.Engine(deq, kernels=k), prompts)) for k in ("ffi", "xla")}


@pytest.mark.parametrize("kernels", ["ffi", "xla"])
@pytest.mark.parametrize("policy", ["freetoken", "lru_fill"])
def test_int8_engine_matches_the_dequantised_reference(models, dense_reference, policy, kernels):
  int8, _ = models
  prompts, (ref_logits, ref_tokens) = dense_reference[kernels]
  c = int8.config
  total = c.num_layers * c.num_experts
  for slots in (0, 1, total // 3, total):
    engine = ftjax.Engine(int8, kernels=kernels, cache_slots=slots, policy=policy,
                          bandwidths=(12.0, 24.0), cache_capacity=total)
    logits, tokens = _run(engine, prompts)
    np.testing.assert_array_equal(tokens, ref_tokens)
    tolerances.assert_close(logits, ref_logits, tolerances.F32, floor=1.0,
                            what=f"{policy} {kernels} {slots} slots")
    check_invariants(engine.cache)
    assert engine.cache.slots.dtype == np.int8  # slots hold the quantised bytes
    st = engine.stats()
    assert st["slot_bytes"] == int8.bank.shape[2]
    per_layer = st["per_layer"]
    assert st["bytes"]["fill"] == sum(per_layer["fills"]) * int8.expert_bytes
    if slots == total and policy == "lru_fill":
      assert sum(per_layer["fills"]) > 0


def test_int8_trace_sweeps_with_int8_expert_bytes(models, dense_reference):
  """A routing trace captured on the int8 model carries its expert format, so the sweep's cost
  model charges the bytes of int8 experts (weights and scales), not of bf16 ones."""
  from ftjax.research import cost, sweep  # noqa: PLC0415
  from ftjax.research.traces import Trace  # noqa: PLC0415
  int8, _ = models
  c = int8.config
  engine = ftjax.Engine(int8, kernels="ffi", cache_slots=4, policy="freetoken",
                        bandwidths=(12.0, 24.0), cache_capacity=c.num_layers * c.num_experts,
                        record_routing=True)
  _run(engine, dense_reference["ffi"][0])
  trace = Trace.from_engine(engine)
  assert trace.metadata["expert_format"] == "int8"
  shape = sweep.trace_shape(trace, None)
  assert shape.expert_format == "int8" and shape.expert_bytes == int8.expert_bytes
  hw = cost.HardwareProfile(name="hand", b_p=10.0, b_h=20.0, device_bw=100.0,
                            layer_overhead_s=0.0, step_overhead_s=0.0, device_memory_gb=1.0,
                            source="test")
  rows = sweep.sweep({"t": trace}, ["freetoken"], [0.5], [hw], {"t": shape}, belady=False,
                     progress=False)
  (row,) = rows
  assert row.fills_per_step > 0
  tolerances.assert_close(row.fill_gb_per_step, row.fills_per_step * int8.expert_bytes / 1e9,
                          tolerances.F64)


def test_int8_pinned_host_pool_fills_by_slices(models, dense_reference):
  """The pinned_host pool (the GPU program's fills, as host-to-device slices of the pool's
  bytes) with an int8 bank: the same logits."""
  int8, _ = models
  prompts, (ref_logits, ref_tokens) = dense_reference["ffi"]
  c = int8.config
  total = c.num_layers * c.num_experts
  engine = ftjax.Engine(int8, kernels="ffi", cache_slots=total // 3, policy="freetoken",
                        bandwidths=(12.0, 24.0), pool="pinned_host", cache_capacity=total)
  assert engine.bank.sharding.memory_kind == "pinned_host"
  logits, tokens = _run(engine, prompts)
  np.testing.assert_array_equal(tokens, ref_tokens)
  tolerances.assert_close(logits, ref_logits, tolerances.F32, floor=1.0)
  assert engine.stats()["bytes"]["fill"] > 0


def test_ffi_int8_gives_the_same_tokens_at_every_cache_size(models, dense_reference):
  """kernels="ffi_int8" (opt-in, AVX-512-VNNI): slot experts and host experts run the same
  int8-activation kernel, so the cache size does not change the result."""
  from ftjax.kernels import cpu_info  # noqa: PLC0415
  if cpu_info()["isa"] != "avx512bf16":
    pytest.skip("ffi_int8 needs the avx512bf16 (AVX-512-VNNI) kernels")
  int8, _ = models
  prompts = dense_reference["ffi"][0]
  c = int8.config
  total = c.num_layers * c.num_experts
  ref_logits, ref_tokens = _run(ftjax.Engine(int8, kernels="ffi_int8"), prompts)
  for slots in (1, total // 3, total):
    engine = ftjax.Engine(int8, kernels="ffi_int8", cache_slots=slots, policy="freetoken",
                          bandwidths=(12.0, 24.0), cache_capacity=total)
    logits, tokens = _run(engine, prompts)
    np.testing.assert_array_equal(tokens, ref_tokens)
    tolerances.assert_close(logits, ref_logits, tolerances.F32, floor=1.0, what=f"{slots} slots")
