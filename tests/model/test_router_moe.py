"""Routers and the routed-expert sum against float64 numpy loops."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ftjax.experts import routed_experts
from ftjax.model.router import route

import reference
import tolerances


@pytest.mark.parametrize("kind, norm", [("softmax_topk", False), ("softmax_topk", True),
                                        ("topk_softmax", False)])
@pytest.mark.parametrize("k", [1, 3])
def test_router_matches_numpy(kind, norm, k):
  logits = np.random.default_rng(0).normal(size=(7, 8)).astype(np.float32)
  w, ids = route(jnp.asarray(logits), kind=kind, top_k=k, norm_topk_prob=norm)
  rw, rids = reference.route(logits, kind=kind, top_k=k, norm_topk_prob=norm)
  np.testing.assert_array_equal(np.asarray(ids), rids)
  tolerances.assert_close(w, rw, tolerances.F32, floor=1.0)


def _bank(rng, layers, experts, f, d, pad, dtype):
  bank = rng.normal(size=(layers, experts, 3 * f * d + pad)).astype(np.float32)
  bank[..., 3 * f * d:] = 0
  return bank.astype(dtype)


CASES = {
    "top1": dict(t=3, k=1),
    "topk": dict(t=3, k=4),
    "duplicates_across_tokens": dict(t=5, k=2, ids=[[1, 2], [2, 1], [1, 2], [7, 1], [2, 2]]),
    "skipped_routes": dict(t=3, k=2, ids=[[-1, 3], [-1, -1], [4, -1]]),
    "many_tokens_scan_path": dict(t=40, k=2),
}


@pytest.mark.parametrize("kernels", ["xla", "ffi"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_routed_experts_match_numpy(case, dtype, kernels):
  c = CASES[case]
  rng = np.random.default_rng(hash(case) % 2**32)
  f, d, experts = 12, 16, 8
  np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
  bank = _bank(rng, 2, experts, f, d, 32, np_dtype)
  x = rng.normal(size=(c["t"], d)).astype(np.float32)
  ids = np.array(c["ids"], np.int32) if "ids" in c else np.stack(
      [rng.choice(experts, c["k"], replace=False) for _ in range(c["t"])]).astype(np.int32)
  weights = rng.uniform(0.1, 1, size=ids.shape).astype(np.float32)
  fn = jax.jit(lambda *a: routed_experts(*a, 1, ffn_dim=f, kernels=kernels))
  got = fn(x, ids, weights, bank)
  ref = reference.routed_experts(x, ids, weights, bank, 1, f)
  # bf16 banks too: the reference uses the same bf16 weights, widened exactly.
  tolerances.assert_close(got, ref, tolerances.F32, floor=1.0)
  if case == "skipped_routes":
    assert np.all(np.asarray(got)[1] == 0)
