"""offloaded_moe inside a JAX model that is not ftjax's, under jit and lax.scan, against a
float64 numpy loop of the same model (``reference.moe_layer``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.cache import ExpertCache, get_policy, offloaded_moe
from ftjax.cache.state import check_invariants

import reference
import tolerances

L, E, K, D, F, T = 3, 6, 2, 8, 5, 2


def _weights(seed=0):
  rng = np.random.default_rng(seed)
  router = rng.normal(size=(L, E, D)).astype(np.float32)
  bank = np.zeros((L, E, 3 * F * D + 7), np.float32)
  bank[..., :3 * F * D] = rng.normal(size=(L, E, 3 * F * D)) * 0.5
  return router, bank


def _reference(x, router, bank):
  """The same model in float64: softmax router, top-K, weighted SwiGLU experts, residual."""
  x = x.astype(np.float64)
  for layer in range(L):
    x = x + reference.moe_layer(x, router[layer], bank, layer, F, top_k=K)
  return x


@pytest.mark.parametrize("policy, slots", [("freetoken", 4), ("lru_fill", 3), ("cpu_only", 0),
                                           ("lru_fill", L * E)])
def test_foreign_model_under_jit_and_scan(policy, slots):
  router, bank = _weights()
  bank_j, router_j = jnp.asarray(bank), jnp.asarray(router)
  cfg = get_policy(policy)

  @jax.jit
  def model_step(cache, x):
    def body(carry, layer):
      cache, x = carry
      weights, ids = jax.lax.top_k(jax.nn.softmax(x @ router_j[layer].T), K)
      cache, y, plan = offloaded_moe(x, weights, ids, cache, bank_j, layer,
                                     bandwidths=jnp.array([10.0, 30.0]), policy=cfg, ffn_dim=F)
      return (cache, x + y), plan.hits + plan.fills
    (cache, x), served = jax.lax.scan(body, (cache, x), jnp.arange(L))
    return cache, x, served

  cache = ExpertCache.empty(bank.shape, bank_j.dtype, slots)
  rng = np.random.default_rng(1)
  for _ in range(6):  # several steps: the cache warms, fills and evicts
    x = rng.normal(size=(T, D)).astype(np.float32)
    cache, y, served = model_step(cache, jnp.asarray(x))
    ref = _reference(x, router, bank)
    tolerances.assert_close(y, ref, tolerances.F32)
    check_invariants(cache)
  if slots == L * E and policy == "lru_fill":
    assert int(served.sum()) > 0
  if slots == 0:
    assert int(served.sum()) == 0
