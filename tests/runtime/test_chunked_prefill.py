"""Chunked prefill and the bfloat16 KV cache: a prompt prefilled chunk by chunk into the KV
cache gives the logits of the unchunked prefill (float32 path, at chunk boundaries +-1), with
and without an expert cache and on the hybrid family; a bfloat16 KV cache changes the trained
default model's held-out loss and predictions by a bounded amount."""

import jax.numpy as jnp
import numpy as np
import pytest

import ftjax
from ftjax.runtime import model as model_lib
from ftjax.model import KV_BITS, kv_values

import tolerances
from conftest import scaled_params
from reference import mean_nll

CHUNK = 16
# Chunk boundaries +-1: one chunk, one and two whole chunks plus 0 or 1 token.
LENGTHS = (CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK - 1, 2 * CHUNK, 2 * CHUNK + 1)


@pytest.fixture(scope="module")
def model(tiny_config):
  return scaled_params(model_lib.random_model(tiny_config, seed=3, dtype="float32"), 4.0)


@pytest.fixture(scope="module")
def hybrid(tiny_hybrid_config):
  return scaled_params(model_lib.random_model(tiny_hybrid_config, seed=4, dtype="float32"), 4.0)


def _prompt(model, n, seed=0):
  return np.random.default_rng(seed).integers(0, model.config.vocab_size, n)


@pytest.mark.parametrize("kernels", ["ffi", "xla"])
def test_chunked_equals_unchunked_at_boundaries(model, kernels):
  whole = ftjax.Engine(model, kernels=kernels, prefill_chunk=4096)
  chunked = ftjax.Engine(model, kernels=kernels, prefill_chunk=CHUNK)
  assert whole.kv_dtype == chunked.kv_dtype == "float32"
  for n in LENGTHS:
    ids = _prompt(model, n, seed=n)
    reference = whole.prefill_logits(ids)
    tolerances.assert_close(chunked.prefill_logits(ids), reference, tolerances.F32, floor=1.0,
                            what=f"{n} tokens")
    # ... and the full teacher-forced forward's last row (an independent path).
    tolerances.assert_close(reference, whole.forward_logits(ids)[-1], tolerances.F32, floor=1.0,
                            what=f"{n} tokens, forward")


def test_chunked_generate_and_progress(model):
  ids = _prompt(model, 2 * CHUNK + 5)
  whole = ftjax.Engine(model, kernels="ffi", prefill_chunk=4096)
  chunked = ftjax.Engine(model, kernels="ffi", prefill_chunk=CHUNK)
  seen = []
  result = chunked.generate_timed(ids, 12, on_progress=lambda d, t: seen.append((d, t)))
  assert result.tokens == whole.generate(ids, 12)
  n = len(ids)
  assert seen == [(0, n), (CHUNK, n), (2 * CHUNK, n), (n, n)]
  # Three prefill chunks, the first token, two decode programs of 8 steps.
  assert result.programs == 3 + 1 + 2
  # A prompt within one chunk makes no progress calls.
  seen.clear()
  chunked.generate_timed(ids[:CHUNK], 2, on_progress=lambda d, t: seen.append((d, t)))
  assert seen == []


@pytest.mark.parametrize("policy", ["freetoken", "lru_fill"])
def test_chunked_through_the_expert_cache(model, policy):
  """Each chunk's routes go through the cache's policy; the logits stay the dense path's and
  every routed token is counted once."""
  ids = _prompt(model, 2 * CHUNK + 1, seed=11)
  dense = ftjax.Engine(model, kernels="ffi", prefill_chunk=4096).prefill_logits(ids)
  c = model.config
  engine = ftjax.Engine(model, kernels="ffi", prefill_chunk=CHUNK, policy=policy,
                        cache_slots=c.num_moe_layers * c.num_experts // 3, bandwidths=(10.0, 20.0),
                        record_routing=True)
  tolerances.assert_close(engine.prefill_logits(ids), dense, tolerances.F32, floor=1.0)
  steps = engine.stats()["per_step"]
  assert [s["tokens"] for s in steps] == [CHUNK, CHUNK, 1]
  # A layer-step counts each distinct expert its tokens select once (hit, fill or host run).
  routed = engine.routing_record()["ids"]  # [tokens, L, K]
  assert routed.shape[0] == len(ids)
  for step, (start, stop) in zip(steps, [(0, CHUNK), (CHUNK, 2 * CHUNK), (2 * CHUNK, len(ids))]):
    distinct = [len(np.unique(routed[start:stop, layer])) for layer in range(c.num_moe_layers)]
    assert (np.asarray(step["hits"]) + step["fills"] + step["host"]).tolist() == distinct


def test_chunked_hybrid(hybrid):
  """Gated DeltaNet layers carry their recurrent state from chunk to chunk."""
  whole = ftjax.Engine(hybrid, kernels="ffi", prefill_chunk=4096)
  chunked = ftjax.Engine(hybrid, kernels="ffi", prefill_chunk=CHUNK)
  for n in (CHUNK + 1, 2 * CHUNK):
    ids = _prompt(hybrid, n, seed=n)
    tolerances.assert_close(chunked.prefill_logits(ids), whole.prefill_logits(ids),
                            tolerances.F32, floor=1.0, what=f"{n} tokens")


@pytest.fixture(scope="module")
def heldout_ids():
  """Two 384-token windows of the default model's held-out code (its training split)."""
  from ftjax.runtime.tokenizer import load_tokenizer  # noqa: PLC0415
  from ftjax.tiny import train  # noqa: PLC0415
  default = ftjax.load("default")
  tok = load_tokenizer(default.path, default.config.vocab_size)
  root = train.stdlib_root()
  _, held = train.corpus_files(root)
  stream = tok.encode("\n".join(train.read_texts(root, held, limit_bytes=40_000)))
  assert len(stream) >= 2000
  return default, [stream[:384], stream[1000:1384]]


@pytest.mark.parametrize("kernels", ["ffi", "xla"])
def test_bf16_kv_cache_bounded_by_the_float32_one(heldout_ids, kernels):
  """The trained default model on held-out code: a bfloat16 KV cache (its default) changes
  the held-out loss by < 0.1% and keeps >= 99% of the float32 cache's top-1 predictions."""
  default, windows = heldout_ids
  f32 = ftjax.Engine(default, kernels=kernels, kv_dtype="float32")
  bf16 = ftjax.Engine(default, kernels=kernels)
  assert bf16.kv_dtype == "bfloat16"
  assert bf16.new_state(1, 8).layers[0].k.dtype == KV_BITS  # held as its bits
  for ids in windows:
    reference, got = f32.forward_logits(ids), bf16.forward_logits(ids)
    assert np.max(np.abs(got - reference)) > 0  # the cache really is bfloat16
    assert abs(mean_nll(got, ids) - mean_nll(reference, ids)) <= 1e-3 * mean_nll(reference, ids)
    assert np.mean(got.argmax(-1) == reference.argmax(-1)) >= 0.99


def test_kv_dtype_default_and_errors(model, tiny_config):
  bf16_model = model_lib.random_model(tiny_config, seed=3, dtype="bfloat16")
  assert ftjax.Engine(bf16_model, kernels="ffi").kv_dtype == "bfloat16"
  layer = ftjax.Engine(bf16_model, kernels="ffi").new_state(1, 8).layers[0]
  assert layer.k.dtype == KV_BITS and kv_values(layer.k).dtype == jnp.bfloat16
  assert ftjax.Engine(model, kernels="ffi").kv_dtype == "float32"
  assert ftjax.Engine(bf16_model, kernels="ffi", kv_dtype="float32").kv_dtype == "float32"
  with pytest.raises(ValueError, match="kv_dtype must be one of"):
    ftjax.Engine(model, kv_dtype="float16")
  with pytest.raises(ValueError, match="prefill_chunk must be a positive int"):
    ftjax.Engine(model, prefill_chunk=0)
