"""The GPU path on a real GPU (issue 14): skipped, with the reason, where there is none.

Run by ``benchmarks/gpu_check.py`` on a lent GPU machine. Checks:
* the CUDA copy kernel fills exactly the planned blocks from the mapped pool;
* the host-experts start/done pair adds the CPU kernel's result to the device part, against
  a float64 numpy reference, for decode (T = 1) and prefill-sized (T = 40) calls;
* the engine on both GPU placements (``pinned_host``: XLA slices; ``mapped``: the CUDA copy
  kernel), every policy at sizes 0, 1, L·E/3 and L·E, gives the dense path's tokens and logits;
* the side-stream layer fetch, and the streamed, double-buffered prefill on both placements
  (the dense path's logits, the sparse prefill's cache);
* no host job failed and the stream wait in use is reported.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ftjax
from ftjax.cache import POLICIES
from ftjax.cache.state import check_invariants
from ftjax.kernels import cuda
from ftjax.runtime import model as model_lib

import tolerances
from conftest import scaled_params

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() not in ("gpu", "cuda"),
                       reason=f"needs a GPU backend (this one is {jax.default_backend()})"),
    pytest.mark.skipif(not cuda.cuda_available(),
                       reason=f"ftjax._ffi_cuda is not built: {cuda.cuda_load_error()}"),
]


def _swiglu_reference(x, ids, weights, bank_layer, ffn_dim):
  """float64 sum over routes of w · down(silu(gate·x) * up·x)."""
  x = x.astype(np.float64)
  d = x.shape[1]
  out = np.zeros_like(x)
  for t in range(x.shape[0]):
    for e, w in zip(ids[t], weights[t]):
      if e < 0:
        continue
      block = bank_layer[e].astype(np.float64)
      gate = block[:ffn_dim * d].reshape(ffn_dim, d)
      up = block[ffn_dim * d:2 * ffn_dim * d].reshape(ffn_dim, d)
      down = block[2 * ffn_dim * d:3 * ffn_dim * d].reshape(d, ffn_dim)
      g = gate @ x[t]
      out[t] += w * (down @ ((g / (1 + np.exp(-g))) * (up @ x[t])))
  return out


def test_pool_fill_copies_the_planned_blocks():
  rng = np.random.default_rng(0)
  pool = rng.standard_normal((3, 5, 1024)).astype(np.float32)
  spec = cuda.register_pool(pool)
  fill = jax.jit(lambda s, src, dst: cuda.pool_fill(s, src, dst, pool=spec), donate_argnums=0)
  slots = jnp.full((4, 1024), -1.0, jnp.float32)
  src = jnp.asarray([[2, 4], [0, 0], [1, 3]], jnp.int32)
  dst = jnp.asarray([3, -1, 0], jnp.int32)
  out = np.asarray(fill(slots, src, dst))
  expect = np.full((4, 1024), -1.0, np.float32)
  expect[3], expect[0] = pool[2, 4], pool[1, 3]
  np.testing.assert_array_equal(out, expect)


@pytest.mark.parametrize("tokens", [1, 40])
def test_host_experts_pair_adds_the_host_result(tokens):
  rng = np.random.default_rng(tokens)
  d, f, e, k = 64, 32, 6, 2
  pool = (0.1 * rng.standard_normal((2, e, 3 * f * d + 256))).astype(np.float32)
  spec = cuda.register_pool(pool)
  x = rng.standard_normal((tokens, d)).astype(np.float32)
  ids = rng.integers(-1, e, (tokens, k)).astype(np.int32)
  weights = rng.random((tokens, k)).astype(np.float32)
  device_part = rng.standard_normal((tokens, d)).astype(np.float32)

  @jax.jit
  def run(x, ids, weights, device_part):
    ticket, x = cuda.host_experts_start(x, ids, weights, pool=spec, layer=1, ffn_dim=f)
    return cuda.host_experts_done(ticket, device_part + 0.0 * x[:, :1])

  got = np.asarray(run(x, ids, weights, device_part))
  ref = device_part + _swiglu_reference(x, ids, weights, pool[1], f)
  tolerances.assert_close(got, ref, tolerances.F32)
  assert cuda.pool_stats()["errors"] == 0


@pytest.fixture(scope="module")
def model(tiny_config):
  return scaled_params(model_lib.random_model(tiny_config, seed=3), 8.0)


def _run(engine, prompt, steps=8):
  state = engine.new_state(1, len(prompt) + steps + 1)
  state, logits = engine.step(state, jnp.asarray([prompt], jnp.int32),
                              jnp.arange(len(prompt), dtype=jnp.int32)[None], last_only=True)
  out = [np.asarray(logits[0, -1])]
  for i in range(steps):
    token = np.int32(out[-1].argmax())
    state, logits = engine.step(state, jnp.full((1, 1), token, jnp.int32),
                                jnp.full((1, 1), len(prompt) + i, jnp.int32), last_only=True)
    out.append(np.asarray(logits[0, -1]))
  return np.stack(out)


@pytest.mark.parametrize("pool", ["pinned_host", "mapped"])
def test_engine_on_the_gpu_matches_the_dense_path(model, pool):
  c = model.config
  prompt = [3, 14, 15, 9, 2]
  reference = _run(ftjax.Engine(model, kernels="xla", pool="device"), prompt)
  total = c.num_layers * c.num_experts
  for policy in POLICIES:
    for slots in (0, 1, total // 3, total):
      engine = ftjax.Engine(model, kernels="xla", cache_slots=slots, policy=policy,
                            bandwidths=(12.0, 24.0), hot_experts=np.arange(total)[::-1],
                            pool=pool, cache_capacity=total)
      got = _run(engine, prompt)
      np.testing.assert_array_equal(got.argmax(-1), reference.argmax(-1))
      tolerances.assert_close(got, reference, tolerances.F32, floor=1.0)
      check_invariants(engine.cache)
  stats = cuda.pool_stats()
  assert stats["errors"] == 0 and stats["bad_fill_rows"] == 0, stats
  print("stream wait:", stats["wait"])


def test_layer_fetch_on_the_side_stream():
  rng = np.random.default_rng(5)
  pool = rng.standard_normal((3, 4, 512)).astype(np.float32)
  spec = cuda.register_pool(pool)

  @jax.jit
  def fetch_two(scale):
    first = cuda.fetch_layer_start(pool=spec, layer=2)
    second = cuda.fetch_layer_start(pool=spec, layer=0)  # both in flight at once
    a = cuda.fetch_layer_done(first) * scale
    return a, cuda.fetch_layer_done(second) * scale

  a, b = fetch_two(jnp.float32(2.0))
  np.testing.assert_array_equal(np.asarray(a), 2.0 * pool[2])
  np.testing.assert_array_equal(np.asarray(b), 2.0 * pool[0])


@pytest.mark.parametrize("pool", ["pinned_host", "mapped"])
def test_streamed_prefill_on_the_gpu_matches_the_dense_path(model, pool):
  """Whole layers streamed (XLA slices, or the side-stream copy) and double-buffered: the
  dense path's logits, and the same cache as the sparse prefill."""
  c = model.config
  total = c.num_layers * c.num_experts
  prompt = list(np.random.default_rng(4).integers(0, c.vocab_size, 24))
  reference = _run(ftjax.Engine(model, kernels="xla", pool="device"), prompt, steps=2)
  engines = {stream: ftjax.Engine(model, kernels="xla", cache_slots=total // 3,
                                  policy="freetoken", bandwidths=(12.0, 24.0), pool=pool,
                                  stream_prefill_tokens=stream) for stream in (0, 16)}
  for stream, engine in engines.items():
    got = _run(engine, prompt, steps=2)
    tolerances.assert_close(got, reference, tolerances.F32, floor=1.0)
  assert engines[16].stats()["streamed_layer_steps"] == c.num_layers
  for field in ("owner", "slot_of", "slot_stamp", "slots"):
    np.testing.assert_array_equal(np.asarray(getattr(engines[16].cache, field)),
                                  np.asarray(getattr(engines[0].cache, field)), err_msg=field)
