"""Layers against float64 numpy references: attention (GQA, window, sinks, cache offset),
the sigmoid-group router (``reference.route``); and a model using both keeps cached decode
equal to full forward."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import ftjax
from ftjax.model import layers
from ftjax.model.layers import Attention, KVCache, blocked_attention, dense_attention
from ftjax.model.router import route
from ftjax.runtime import model as model_lib

import reference
import tolerances


def _rope_ref(x, pos, theta):
  a = x.shape[-1]
  inv = 1.0 / theta ** (np.arange(0, a, 2) / a)
  ang = np.concatenate([pos[:, None] * inv, pos[:, None] * inv], -1)[:, None, :]  # [T, 1, A]
  rot = np.concatenate([-x[..., a // 2:], x[..., :a // 2]], -1)
  return x * np.cos(ang) + rot * np.sin(ang)


def _attention_ref(attn, x, window, sinks):
  """Single sequence, no cache: x [T, D] -> [T, D] in float64."""
  p = {k: np.asarray(v.get_value(), np.float64) for k, v in nnx.to_flat_state(nnx.state(attn))
       for k in [".".join(map(str, k))]}
  t = x.shape[0]
  q = np.einsum("td,had->tha", x, p["w_q_had"])
  k = np.einsum("td,gad->tga", x, p["w_k_gad"])
  v = np.einsum("td,gad->tga", x, p["w_v_gad"])
  pos = np.arange(t, dtype=np.float64)
  q, k = _rope_ref(q, pos, attn.rope_theta), _rope_ref(k, pos, attn.rope_theta)
  h, g = q.shape[1], k.shape[1]
  out = np.zeros_like(q)
  for head in range(h):
    kv = head // (h // g)
    for i in range(t):
      s = [q[i, head] @ k[j, kv] / np.sqrt(q.shape[-1]) for j in range(t)
           if j <= i and (window is None or j > i - window)]
      js = [j for j in range(t) if j <= i and (window is None or j > i - window)]
      logits = np.array(s + ([p["sinks_h"][head]] if sinks else []))
      w = np.exp(logits - logits.max())
      w /= w.sum()
      out[i, head] = sum(w[n] * v[j, kv] for n, j in enumerate(js))
  return np.einsum("tha,dha->td", out, p["w_o_dha"])


@pytest.mark.parametrize("window, sinks", [(None, False), (3, False), (None, True), (4, True)])
def test_attention_matches_numpy(window, sinks):
  attn = Attention(width=16, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=100.0, eps=1e-6,
                   qk_norm=None, qkv_bias=False, o_bias=False, clip_qkv=None, window=window,
                   sinks=sinks, rngs=nnx.Rngs(0))
  if sinks:
    attn.sinks_h[...] = jnp.array([0.5, -1.0, 2.0, 0.0])
  for name in ("w_q_had", "w_k_gad", "w_v_gad", "w_o_dha"):
    getattr(attn, name)[...] = getattr(attn, name)[...] * 20  # sharp attention
  x = np.random.default_rng(0).normal(size=(9, 16)).astype(np.float32)
  ref = _attention_ref(attn, x.astype(np.float64), window, sinks)
  # Split into a 5-token chunk and 4 single steps through the cache.
  cache = KVCache.zeros(1, 16, 2, 8)
  outs = []
  for lo, hi in [(0, 5), (5, 6), (6, 7), (7, 8), (8, 9)]:
    cache, y = attn(jnp.asarray(x[None, lo:hi]), cache, jnp.int32(lo),
                    jnp.arange(lo, hi, dtype=jnp.int32)[None])
    outs.append(np.asarray(y[0]))
  tolerances.assert_close(np.concatenate(outs), ref, tolerances.F32)


@pytest.mark.parametrize("norm", [False, True])
def test_sigmoid_group_router_matches_numpy(norm):
  rng = np.random.default_rng(2)
  logits = rng.normal(size=(6, 16)).astype(np.float32)
  bias = rng.normal(size=16).astype(np.float32) * 0.5
  w, ids = route(jnp.asarray(logits), kind="sigmoid_group", top_k=3, norm_topk_prob=norm,
                 bias=jnp.asarray(bias), n_group=4, topk_group=2, scaling=2.5)
  rw, rids = reference.route(logits, kind="sigmoid_group", top_k=3, norm_topk_prob=norm,
                             bias=bias, n_group=4, topk_group=2, scaling=2.5)
  np.testing.assert_array_equal(np.asarray(ids), rids)
  np.testing.assert_allclose(np.asarray(w), rw, rtol=tolerances.F32_ROUNDING)
  assert set(np.asarray(ids).reshape(-1) // 4).__len__() <= 4


def test_model_with_sinks_and_group_router_caches_consistently(tiny_config):
  cfg = dataclasses.replace(tiny_config, attn_sinks=True, router="sigmoid_group",
                            router_groups=4, router_topk_groups=2, routed_scaling_factor=1.5,
                            layer_types=("sliding_attention", "full_attention"),
                            sliding_window=4)
  model = model_lib.random_model(cfg, seed=5)
  params = jax.tree.map(lambda x: x * 10 + 0.1, model.params)  # non-zero sinks and biases
  model = dataclasses.replace(model, params=params, bank=model.bank * 10)
  engine = ftjax.Engine(model, kernels="xla")
  ids = list(np.random.default_rng(3).integers(0, cfg.vocab_size, 6))
  new = engine.generate(ids, 8)
  full = engine.forward_logits(ids + new)
  assert [int(t) for t in full[len(ids) - 1:-1].argmax(-1)] == new


@pytest.mark.parametrize("window,sinks", [(None, False), (5, False), (None, True), (20, True)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_blocked_attention_matches_numpy(window, sinks, dtype):
  """The XLA path of a prefill chunk after others: the cache walked in blocks (here 16 rows,
  queries spanning blocks, a cache of 4 blocks, the last partly past the queries) equals the
  float64 reference, for float32 and bfloat16 caches (the reference reads the same rounded
  values)."""
  rng = np.random.default_rng(3)
  b, t, h, g, a, s, length = 2, 11, 4, 2, 8, 64, 29
  q = rng.standard_normal((b, t, h, a)).astype(np.float32)
  k = jnp.asarray(rng.standard_normal((b, s, g, a)), dtype)
  v = jnp.asarray(rng.standard_normal((b, s, g, a)), dtype)
  sink = (2 * rng.standard_normal(h)).astype(np.float32) if sinks else None
  ref = reference.attention(q, np.asarray(k, np.float32), np.asarray(v, np.float32), length + t,
                            scale=a ** -0.5, window=window, sinks=sink)
  blocked = blocked_attention(jnp.asarray(q), k, v, jnp.int32(length), window=window,
                              sinks=None if sink is None else jnp.asarray(sink), block=16)
  tolerances.assert_close(blocked, ref, tolerances.F32)
  dense = dense_attention(jnp.asarray(q), k, v, jnp.int32(length), window=window,
                          sinks=None if sink is None else jnp.asarray(sink))
  tolerances.assert_close(dense, ref, tolerances.F32)


# --- the KV cache's writes ---------------------------------------------------------------------


def _written(buffer, rows, length):
  """numpy: each sequence b's rows at [clamp(length[b], 0, S - T), + T), as
  dynamic_update_slice places them."""
  out = buffer.copy()
  s, t = buffer.shape[1], rows.shape[1]
  for b, at in enumerate(np.broadcast_to(length, (buffer.shape[0],))):
    at = min(max(int(at), 0), s - t)
    out[b, at:at + t] = rows[b]
  return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("t", [1, 3])
def test_kv_rows_land_where_each_sequence_is(dtype, t):
  """A batch's keys at each sequence's own length (and at one length for all), past the end
  clamped into the cache; a bfloat16 cache is held as its bits (KV_BITS) and reads back the
  rows rounded to bfloat16."""
  rng = np.random.default_rng(7)
  cache = KVCache.zeros(4, 16, 2, 8, dtype)
  assert cache.k.dtype == (layers.KV_BITS if dtype == jnp.bfloat16 else jnp.float32)
  start = rng.standard_normal(cache.k.shape).astype(np.float32)
  buffer = layers.kv_stored(jnp.asarray(start), cache.k.dtype)
  rows = rng.standard_normal((4, t, 2, 8)).astype(np.float32)
  values = np.asarray(jnp.asarray(start).astype(dtype).astype(jnp.float32))
  rounded = np.asarray(jnp.asarray(rows).astype(dtype).astype(jnp.float32))
  for length in (np.array([0, 5, 15, 40], np.int32), np.int32(6)):
    got = layers.write_kv(buffer, jnp.asarray(rows), jnp.asarray(length))
    assert got.dtype == buffer.dtype
    np.testing.assert_array_equal(np.asarray(layers.kv_values(got)).astype(np.float32),
                                  _written(values, rounded, length), err_msg=str(length))


def test_a_batch_writes_its_kv_rows_in_place():
  """The batched decode step's write (one row per sequence, each at its own length) compiles to
  ops on the rows alone: no op outputs a whole cache but the in-place scatter (B chained
  dynamic-update-slices of a bitcast bfloat16 cache fused into a loop over every element,
  which ran 38-57 ms a step on one CPU for the default model's 12 caches)."""
  cache = KVCache.zeros(4, 4096, 2, 64, jnp.bfloat16)
  write = jax.jit(layers.write_kv, donate_argnums=0)
  rows = jnp.ones((4, 1, 2, 64), jnp.float32)
  text = write.lower(cache.k, rows, jnp.array([3, 9, 100, 7], jnp.int32)).compile().as_text()
  whole = re.findall(r"%([\w.-]+) = u16\[4,4096,2,64\]\S* ([\w-]+)\(", text)
  assert whole, "the cache's type as XLA prints it"
  others = [(name, op) for name, op in whole if op not in ("parameter", "scatter", "bitcast")
            and not (op == "fusion" and name.startswith("wrapped_scatter"))]
  assert not others, whole
