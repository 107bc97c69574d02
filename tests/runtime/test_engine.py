"""Engine: cached decode equals the full forward, no retrace, batching, clear errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ftjax
from ftjax.runtime import model as model_lib
from ftjax.runtime.kv import ContextLengthError, state_bytes
from ftjax.runtime.sampling import Sampling, sample

import tolerances
from conftest import scaled_params


@pytest.fixture(scope="module")
def model(tiny_config):
  # Large enough init that routing is not near-uniform and logits are not flat.
  return model_lib.random_model(tiny_config, seed=7, dtype="float32")


def _scale(model, factor):
  """The same model with every dense weight multiplied (sharper routing and logits)."""
  import jax  # noqa: PLC0415
  params = jax.tree.map(lambda x: x * factor, model.params)
  return model_lib.Model(config=model.config, graphdef=model.graphdef, params=params,
                         bank=model.bank * factor)


@pytest.mark.parametrize("kernels", ["xla", "ffi"])
@pytest.mark.parametrize("prefill", [1, 5])
def test_cached_decode_equals_full_forward(model, kernels, prefill):
  m = _scale(model, 10.0)
  engine = ftjax.Engine(m, kernels=kernels)
  ids = np.random.default_rng(0).integers(0, m.config.vocab_size, 13)
  full = engine.forward_logits(ids)
  state = engine.new_state(1, len(ids))
  state, logits = engine.step(state, jnp.asarray(ids[None, :prefill]),
                              jnp.arange(prefill, dtype=jnp.int32)[None])
  steps = [np.asarray(logits[0])]
  for t in range(prefill, len(ids)):
    state, logits = engine.step(state, jnp.asarray(ids[None, t:t + 1]),
                                jnp.full((1, 1), t, jnp.int32))
    steps.append(np.asarray(logits[0]))
  cached = np.concatenate(steps)
  assert int(state.length) == len(ids)
  tolerances.assert_close(cached, full, tolerances.F32, floor=1.0)


@pytest.fixture(scope="module")
def hybrid_model(tiny_hybrid_config):
  return scaled_params(model_lib.random_model(tiny_hybrid_config, seed=7, dtype="float32"), 10.0)


@pytest.mark.parametrize("kernels", ["xla", "ffi"])
@pytest.mark.parametrize("prefill", [1, 5, 66])
def test_hybrid_prefill_then_decode_equals_full_forward(hybrid_model, kernels, prefill):
  """Gated DeltaNet + attention: a prefill of any length (one token, a few, past a 64-token
  chunk) then single-token decode steps equal the full forward at every step."""
  engine = ftjax.Engine(hybrid_model, kernels=kernels)
  ids = np.random.default_rng(0).integers(0, hybrid_model.config.vocab_size, prefill + 9)
  full = engine.forward_logits(ids)
  state = engine.new_state(1, len(ids))
  state, logits = engine.step(state, jnp.asarray(ids[None, :prefill]),
                              jnp.arange(prefill, dtype=jnp.int32)[None])
  steps = [np.asarray(logits[0])]
  for t in range(prefill, len(ids)):
    state, logits = engine.step(state, jnp.asarray(ids[None, t:t + 1]),
                                jnp.full((1, 1), t, jnp.int32))
    steps.append(np.asarray(logits[0]))
  assert int(state.length) == len(ids)
  tolerances.assert_close(np.concatenate(steps), full, tolerances.F32, floor=1.0)
  # And the device loop (a bucket-padded prefill, then the while loop) gives the same tokens.
  greedy = [int(np.argmax(full[-1]))]
  assert engine.generate(ids.tolist(), 1, greedy=True) == greedy


@pytest.mark.parametrize("which", ["attention", "hybrid"])
def test_state_bytes_are_the_decode_states_bytes(model, hybrid_model, which):
  m = model if which == "attention" else hybrid_model
  state = ftjax.Engine(m).new_state(2, 300)
  real = sum(x.nbytes for x in jax.tree.leaves(state.layers))
  assert state_bytes(m.config, 2, state.capacity) == real


def test_vision_inputs_are_refused(hybrid_model):
  config = dataclasses.replace(hybrid_model.config, vision_token_ids=(60, 61))
  engine = ftjax.Engine(dataclasses.replace(hybrid_model, config=config))
  with pytest.raises(ValueError, match=r"vision token ids \[61\].*not supported"):
    engine.generate([1, 2, 61, 3], 2)


def test_batch_rows_equal_single_rows(model):
  engine = ftjax.Engine(_scale(model, 10.0), kernels="xla")
  ids = np.random.default_rng(1).integers(0, model.config.vocab_size, (3, 9))
  batched = engine.forward_logits(ids)
  for b in range(3):  # absolute: a row's logits must not depend on its batch
    np.testing.assert_allclose(batched[b], engine.forward_logits(ids[b]), rtol=0,
                               atol=tolerances.F32)


def test_second_call_with_new_data_does_not_retrace(model, fresh_programs):
  traces = fresh_programs
  engine = ftjax.Engine(model, kernels="xla")
  engine.generate([1, 2, 3, 4], 6)
  # An extend chunk, the first token (no model in it: not traced), the decode loop.
  assert engine.compile_count == 3 and len(traces) == 2
  out = engine.generate([9, 8, 7, 6], 6)
  assert engine.compile_count == 3 and len(traces) == 2 and len(out) == 6
  # Greedy or sampled, the temperature, the filters and the seed are data.
  engine.generate([9, 8, 7, 6], 6, greedy=False, temperature=0.7, seed=3)
  out = engine.generate([3, 1, 4, 1], 6, greedy=False, temperature=1.3, top_p=0.5, seed=5)
  assert engine.compile_count == 3 and len(traces) == 2 and len(out) == 6


def test_generation_is_deterministic_per_seed(model):
  engine = ftjax.Engine(_scale(model, 3.0))
  a = engine.generate([5, 6, 7], 12, greedy=False, temperature=1.0, top_p=0.9, seed=11)
  b = engine.generate([5, 6, 7], 12, greedy=False, temperature=1.0, top_p=0.9, seed=11)
  c = engine.generate([5, 6, 7], 12, greedy=False, temperature=1.0, top_p=0.9, seed=12)
  assert a == b and a != c


def test_stop_tokens_end_generation(model):
  engine = ftjax.Engine(_scale(model, 10.0))
  free = engine.generate([1, 2, 3], 8)
  stopped = engine.generate([1, 2, 3], 8, stop_tokens=(free[2],))
  assert stopped == free[:free.index(free[2]) + 1]


def test_context_and_input_errors(model):
  engine = ftjax.Engine(model, max_seq_len=16)
  with pytest.raises(ContextLengthError, match="exceeds the context of 16 tokens"):
    engine.generate(list(range(10)), 7)
  with pytest.raises(ContextLengthError):
    engine.forward_logits(np.zeros(17, np.int32))
  with pytest.raises(ValueError, match=r"token ids must be in \[0, 64\)"):
    engine.forward_logits([1, 64])
  with pytest.raises(ValueError, match="prompt is empty"):
    engine.generate([], 3)
  with pytest.raises(ValueError, match="temperature must be > 0"):
    engine.generate([1], 3, greedy=False, temperature=0.0)
  with pytest.raises(ValueError, match="top_p"):
    engine.generate([1], 3, greedy=False, top_p=1.5)
  with pytest.raises(ValueError, match="kernels"):
    ftjax.Engine(model, kernels="gpu")


def test_top_p_keeps_the_smallest_nucleus():
  logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05], jnp.float32))
  draw = jax.jit(sample)
  nucleus = Sampling.make(greedy=False, temperature=1.0, top_p=0.7, seed=0)
  draws = {int(draw(logits, nucleus, jnp.int32(i))) for i in range(300)}
  assert draws == {0, 1}  # 0.5 < 0.7 needs the second token; never the third
  narrow = Sampling.make(greedy=False, temperature=1.0, top_p=0.4, seed=0)
  draws = {int(draw(logits, narrow, jnp.int32(i))) for i in range(50)}
  assert draws == {0}


def test_top_k_keeps_the_k_most_probable():
  logits = jnp.log(jnp.array([0.3, 0.25, 0.2, 0.15, 0.1], jnp.float32))
  draw = jax.jit(sample)
  for k, expect in ((2, {0, 1}), (3, {0, 1, 2}), (0, {0, 1, 2, 3, 4})):
    top = Sampling.make(greedy=False, temperature=1.0, top_k=k, seed=0)
    assert {int(draw(logits, top, jnp.int32(i))) for i in range(300)} == expect
  # With top_p too, the smaller set wins: top_p 0.5 needs tokens 0 and 1; top_k 1 keeps 0.
  both = Sampling.make(greedy=False, temperature=1.0, top_p=0.5, top_k=1, seed=0)
  assert {int(draw(logits, both, jnp.int32(i))) for i in range(50)} == {0}
  with pytest.raises(ValueError, match="top_k"):
    Sampling.make(greedy=False, top_k=-1)


@pytest.mark.parametrize("window", [None, 3])
def test_fresh_prefill_equals_attending_over_the_whole_cache(tiny_config, window):
  import dataclasses  # noqa: PLC0415
  cfg = tiny_config if window is None else dataclasses.replace(
      tiny_config, layer_types=("sliding_attention",) * 2, sliding_window=window)
  engine = ftjax.Engine(_scale(model_lib.random_model(cfg, seed=2), 10.0), kernels="xla")
  ids = jnp.asarray(np.random.default_rng(5).integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
  _, fresh = engine.step(engine.new_state(2, 9), ids, pos, fresh=True)
  _, full = engine.step(engine.new_state(2, 9), ids, pos)
  tolerances.assert_close(fresh, full, tolerances.F32, floor=1.0)
  state, _ = engine.step(engine.new_state(2, 12), ids, pos)
  with pytest.raises(ValueError, match="fresh=True needs an empty state"):
    engine.step(state, ids[:, :1], pos[:, :1] + 9, fresh=True)
