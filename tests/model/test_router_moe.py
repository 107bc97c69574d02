"""Routers and the routed-expert sum against float64 numpy loops."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ftjax.experts import routed_experts
from ftjax.model.router import route

# One place for tolerances, by weight dtype (relative to max |reference|).
TOL = {"float32": 1e-5, "bfloat16": 1e-5}  # bf16 refs use the same bf16-rounded weights


def assert_close(got, ref, dtype="float32"):
  got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
  scale = max(1.0, np.max(np.abs(ref)))
  err = np.max(np.abs(got - ref))
  assert err <= TOL[dtype] * scale, f"max error {err} > {TOL[dtype]} * {scale}"


def _softmax(z):
  z = z - z.max(-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(-1, keepdims=True)


def _ref_route(logits, kind, k, norm):
  logits = logits.astype(np.float64)
  ids = np.zeros(logits.shape[:-1] + (k,), np.int64)
  weights = np.zeros_like(ids, dtype=np.float64)
  for t in range(logits.shape[0]):
    if kind == "softmax_topk":
      p = _softmax(logits[t])
      order = np.argsort(-p, kind="stable")[:k]
      w = p[order]
      if norm:
        w = w / w.sum()
    else:
      order = np.argsort(-logits[t], kind="stable")[:k]
      w = _softmax(logits[t][order])
    ids[t], weights[t] = order, w
  return weights, ids


@pytest.mark.parametrize("kind, norm", [("softmax_topk", False), ("softmax_topk", True),
                                        ("topk_softmax", False)])
@pytest.mark.parametrize("k", [1, 3])
def test_router_matches_numpy(kind, norm, k):
  logits = np.random.default_rng(0).normal(size=(7, 8)).astype(np.float32)
  w, ids = route(jnp.asarray(logits), kind=kind, top_k=k, norm_topk_prob=norm)
  rw, rids = _ref_route(logits, kind, k, norm)
  np.testing.assert_array_equal(np.asarray(ids), rids)
  assert_close(w, rw)


def _bank(rng, layers, experts, f, d, pad, dtype):
  bank = rng.normal(size=(layers, experts, 3 * f * d + pad)).astype(np.float32)
  bank[..., 3 * f * d:] = 0
  return bank.astype(dtype)


def ref_routed(x, ids, weights, bank, layer, f):
  """float64 loop over tokens and routes."""
  d = x.shape[1]
  y = np.zeros(x.shape, np.float64)
  for t in range(x.shape[0]):
    for k in range(ids.shape[1]):
      e = ids[t, k]
      if e < 0:
        continue
      blk = bank[layer, e].astype(np.float64)
      gate, up = blk[:f * d].reshape(f, d), blk[f * d:2 * f * d].reshape(f, d)
      down = blk[2 * f * d:3 * f * d].reshape(d, f)
      g = gate @ x[t]
      h = g / (1 + np.exp(-g)) * (up @ x[t])
      y[t] += weights[t, k] * (down @ h)
  return y


CASES = {
    "top1": dict(t=3, k=1),
    "topk": dict(t=3, k=4),
    "duplicates_across_tokens": dict(t=5, k=2, ids=[[1, 2], [2, 1], [1, 2], [7, 1], [2, 2]]),
    "skipped_routes": dict(t=3, k=2, ids=[[-1, 3], [-1, -1], [4, -1]]),
    "many_tokens_scan_path": dict(t=40, k=2),
}


@pytest.mark.parametrize("impl", ["xla", "ffi"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_routed_experts_match_numpy(case, dtype, impl):
  c = CASES[case]
  rng = np.random.default_rng(hash(case) % 2**32)
  f, d, experts = 12, 16, 8
  np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
  bank = _bank(rng, 2, experts, f, d, 32, np_dtype)
  x = rng.normal(size=(c["t"], d)).astype(np.float32)
  ids = np.array(c["ids"], np.int32) if "ids" in c else np.stack(
      [rng.choice(experts, c["k"], replace=False) for _ in range(c["t"])]).astype(np.int32)
  weights = rng.uniform(0.1, 1, size=ids.shape).astype(np.float32)
  fn = jax.jit(lambda *a: routed_experts(*a, 1, ffn_dim=f, impl=impl))
  got = fn(x, ids, weights, bank)
  ref = ref_routed(x, ids, weights, bank, 1, f)
  assert_close(got, ref, dtype)
  if case == "skipped_routes":
    assert np.all(np.asarray(got)[1] == 0)
