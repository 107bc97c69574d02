"""Flax nnx layers: RMSNorm, rotary embedding, attention with a KV cache, SwiGLU MLP, MoE.

Layers receive the options they need, never the whole config; ``kernels`` (one of
``ftjax.experts.KERNELS``: "xla", "ffi", "ffi_bf16", "ffi_int8") is such an option, passed to
every call that does dense host work ("ffi_int8" quantises only the int8 or mxfp4 experts'
activations: the dense work runs as "ffi"). Activations are float32; weights are cast to float32 where they are
used (the params may be bfloat16). The MoE layer's routed experts come from the function it is
given (``ftjax.model.moe.RoutedExperts``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax import struct

from ftjax.kernels import attention, dense
from ftjax.model.config import Yarn
from ftjax.model.moe import RoutedExperts
from ftjax.model.router import route
from ftjax.utils.arrays import take
from ftjax.utils.dense_quant import QuantizedMatrix

_INIT_STD = 0.02
# The kernels switch's values that run ftjax's host kernels (the others: "xla").
FFI_KERNELS = ("ffi", "ffi_bf16", "ffi_int8")


def normal_param(rngs: nnx.Rngs, shape, dtype):
  return nnx.Param((_INIT_STD * jax.random.normal(rngs.params(), shape)).astype(dtype))


def embed_rows(table: nnx.Param, tokens: jax.Array) -> jax.Array:
  """The float32 embedding rows of ``tokens`` from a table ``[V, D]``: gathered (and a
  quantised table's rows dequantised), never the whole table converted."""
  value = table.get_value()
  if isinstance(value, QuantizedMatrix):
    # As utils.arrays.take: tied to the tokens, the gather is never hoisted out of a loop.
    value, ids = jax.lax.optimization_barrier((value, tokens))
    return value.take_rows(ids)
  return take(table[...], tokens).astype(jnp.float32)


def f32(p: nnx.Param) -> jax.Array:
  return p[...].astype(jnp.float32)


# The weights ``linear`` multiplies, by parameter name (the last part of its path), with their
# leading output axes: the matrices a converter may quantise (``--dense_dtype``;
# ``ftjax.utils.dense_quant``). Routers (``w_router_ed``: routing decisions, 0.1% of a layer's
# bytes) stay in the storage dtype, as do norms, biases, convolutions and the embedding (its
# rows are gathered, not multiplied; ``embed_rows``), unless tied to the lm_head.
LINEAR_OUT_AXES = {
    "w_q_had": 2, "w_gate_had": 2, "w_k_gad": 2, "w_v_gad": 2, "w_o_dha": 1,  # attention
    "w_gate_id": 1, "w_up_id": 1, "w_down_di": 1,  # shared experts (dense MLPs)
    "w_qkv_xd": 1, "w_z_myd": 2, "w_b_md": 1, "w_a_md": 1, "w_out_dmy": 1,  # Gated DeltaNet
    "w_fc_dx": 1,  # the MTP head's projection
    "w_qa_qd": 1, "w_qb_hcq": 2, "w_kva_ld": 1,  # latent attention (its W_kvb is absorbed)
    "w_lm_vd": 1, "embed_vd": 1,  # lm_head (the embedding when tied)
}


def linear(x: jax.Array, w: nnx.Param, out_axes: int, *, kernels: str) -> jax.Array:
  """``x [..., *in] -> [..., *out]`` for a weight stored ``[*out, *in]`` (``out_axes`` leading
  output axes, like torch's Linear), as the matrix ``[O, C]`` (O outputs, C contracted
  inputs). ``kernels="ffi"`` runs ftjax's host GEMV/GEMM kernel (bfloat16 weights are read
  as stored and widened exactly), ``"ffi_bf16"`` the same kernel with activations rounded to
  bfloat16 (``vdpbf16ps``: faster prefill, ~1e-2 relative error), ``"xla"`` a float32 einsum.
  A quantised weight (``QuantizedMatrix``: int8, int4 or mxfp4) runs its own host kernel under
  every ``ffi*`` value (exact to the dequantised weights; under ``"ffi_bf16"`` prefill rounds the
  activations to bfloat16 as for bf16 weights), and is dequantised to float32 under
  ``"xla"``."""
  value = w.get_value()
  if isinstance(value, QuantizedMatrix):
    if value.out_axes != out_axes:
      raise ValueError(f"a quantised weight of shape {value.shape} has {value.out_axes} output "
                       f"axes, but this layer multiplies it with {out_axes}")
    x2 = x.reshape(*x.shape[:x.ndim - (len(value.shape) - out_axes)], value.cols)
    if kernels in FFI_KERNELS:
      y = dense(x2.astype(jnp.float32), value, bf16_activations=kernels == "ffi_bf16")
    elif kernels == "xla":
      y = jnp.einsum("...C,OC->...O", x2, value.dequantize().reshape(value.rows, value.cols))
    else:
      raise ValueError(f"kernels must be 'xla', 'ffi', 'ffi_bf16' or 'ffi_int8', got {kernels!r}")
    return y.reshape(*x2.shape[:-1], *value.shape[:out_axes])
  w = w[...]
  out_shape, in_shape = w.shape[:out_axes], w.shape[out_axes:]
  n_in = int(np.prod(in_shape))
  x2 = x.reshape(*x.shape[:x.ndim - len(in_shape)], n_in)
  w2 = w.reshape(int(np.prod(out_shape)), n_in)
  if kernels in FFI_KERNELS:
    y = dense(x2.astype(jnp.float32), w2, bf16_activations=kernels == "ffi_bf16")
  elif kernels == "xla":
    y = jnp.einsum("...C,OC->...O", x2, w2.astype(jnp.float32))
  else:
    raise ValueError(f"kernels must be 'xla', 'ffi', 'ffi_bf16' or 'ffi_int8', got {kernels!r}")
  return y.reshape(*x2.shape[:-1], *out_shape)


class RMSNorm(nnx.Module):
  """``scale · x / rms(x)``. ``zero_centred`` stores w with scale = 1 + w (Qwen3-Next and
  Qwen3.5 keep their norm weights that way, initialised to 0)."""

  def __init__(self, dim: int, eps: float, *, zero_centred: bool = False, dtype=jnp.float32):
    self.scale = nnx.Param((jnp.zeros if zero_centred else jnp.ones)((dim,), dtype))
    self.eps = eps
    self.zero_centred = zero_centred

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    scale = f32(self.scale) + 1.0 if self.zero_centred else f32(self.scale)
    return scale * (x * jax.lax.rsqrt(var + self.eps))


def rope(x: jax.Array, positions: jax.Array, theta: float, rotary_dim: int | None = None,
         yarn: Yarn | None = None) -> jax.Array:
  """Rotary embedding, rotate-half convention, on the first ``rotary_dim`` dims of each head
  (all by default; the rest pass unchanged). x [B, T, H, A], positions [B, T]. ``yarn``
  rescales the frequencies and multiplies cos and sin by its attention factor (so q·k
  scales by its square), as transformers does."""
  width = x.shape[-1] if rotary_dim is None else rotary_dim
  if yarn is None:
    inv_freq = 1.0 / (theta ** (np.arange(0, width, 2, dtype=np.float32) / width))  # [A/2]
    scale = 1.0
  else:
    inv_freq, scale = yarn.inv_freq(theta, width), yarn.attention_factor
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, A/2]
  angles = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [B, T, 1, A]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  if scale != 1.0:
    cos, sin = cos * scale, sin * scale
  x_rot, x_pass = x[..., :width], x[..., width:]
  x1, x2 = jnp.split(x_rot, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  x_rot = x_rot * cos + rotated * sin
  return x_rot if width == x.shape[-1] else jnp.concatenate([x_rot, x_pass], axis=-1)


# A bfloat16 KV cache is held as its bits, uint16: XLA:CPU writes rows into a uint16 buffer in
# place, but runs a bfloat16 dynamic-update-slice or scatter over the whole buffer (widened to
# float32), and a bitcast of the buffer inside the program lets the B chained writes of a batch
# fuse into one loop over the whole buffer too. benchmarks/kv_write.py, Zen 5 VM, the default
# model's 12 KV buffers [4, 4096, 2, 64], one row per sequence at its own length: 46 ms a step
# through the bitcast on 1 CPU (`taskset -c 1`: the server decoded ~100 tok/s instead of
# 1,700) and 4.1 ms on 2, against 0.08-0.13 ms for one scatter into the bits. One sequence's
# row was in place either way (0.05-0.08 ms for the 12 buffers).
KV_BITS = jnp.uint16


def kv_storage_dtype(dtype) -> jnp.dtype:
  """The dtype a KV cache of ``dtype`` (float32 or bfloat16) is held in: KV_BITS for
  bfloat16."""
  return jnp.dtype(KV_BITS) if jnp.dtype(dtype) == jnp.bfloat16 else jnp.dtype(dtype)


def kv_value_dtype(storage) -> jnp.dtype:
  """The dtype of the values a KV buffer of dtype ``storage`` holds (bfloat16 for KV_BITS)."""
  return jnp.dtype(jnp.bfloat16) if jnp.dtype(storage) == KV_BITS else jnp.dtype(storage)


def kv_values(x):
  """A KV buffer (or rows of one) as its values: KV_BITS bitcast to bfloat16, else as is."""
  return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == KV_BITS else x


def kv_stored(rows, storage):
  """``rows`` (values, or already KV_BITS) as a KV buffer of dtype ``storage`` holds them: for
  KV_BITS rounded to bfloat16 and bitcast; else cast."""
  if jnp.dtype(storage) != KV_BITS:
    return rows.astype(storage)
  if rows.dtype == KV_BITS:
    return rows
  return jax.lax.bitcast_convert_type(jnp.asarray(rows).astype(jnp.bfloat16), KV_BITS)


def _kv_floats(x: jax.Array) -> jax.Array:
  return kv_values(x).astype(jnp.float32)


@struct.dataclass
class KVCache:
  """Keys and values of one attention layer, ``[B, S, G, A]`` each: float32, or a bfloat16
  cache's bits (``KV_BITS``; ``kv_values`` reads them as bfloat16)."""
  k: jax.Array
  v: jax.Array

  @classmethod
  def zeros(cls, batch: int, max_len: int, num_kv_heads: int, head_dim: int, dtype=jnp.float32,
            value_dim: int | None = None):
    """``dtype``: the values' (float32 or bfloat16, held as ``kv_storage_dtype(dtype)``).
    ``value_dim`` (default ``head_dim``): 0 for a latent attention's cache, whose values are
    its keys (``LatentAttention``)."""
    shape = (batch, max_len, num_kv_heads, head_dim)
    v_shape = shape[:3] + (head_dim if value_dim is None else value_dim,)
    storage = kv_storage_dtype(dtype)
    return cls(k=jnp.zeros(shape, storage), v=jnp.zeros(v_shape, storage))


def _allowed(q_rows: jax.Array, kv_rows: jax.Array, window: int | None) -> jax.Array:
  """[T, S] mask: query at cache row i attends rows s <= i (and s > i - window)."""
  allowed = kv_rows[None, :] <= q_rows[:, None]
  if window is not None:
    allowed &= kv_rows[None, :] > q_rows[:, None] - window
  return allowed


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array | int, *,
                    window: int | None, sinks: jax.Array | None,
                    scale: float | None = None) -> jax.Array:
  """Attention in XLA einsums: q [B, T, H, A] (queries at cache rows start + t) against every
  row of k, v [B, S, G, A] the mask allows (rows past the queries' are masked out, so S may
  be a whole cache). ``sinks`` [H]: per-head logits that join the softmax's denominator.
  ``scale`` of the scores: A ** -0.5 by default."""
  _, t, h, a = q.shape
  g = k.shape[2]
  q5 = q.reshape(*q.shape[:2], g, h // g, a)  # [B, T, G, R, A]
  scale = a ** -0.5 if scale is None else scale
  scores = jnp.einsum("BTGRA,BSGA->BGRTS", q5, _kv_floats(k)) * scale
  kv_rows = jnp.arange(k.shape[1])
  if jnp.ndim(start):  # one start per sequence: [B, 1, 1, T, S]
    allowed = jax.vmap(lambda s: _allowed(s + jnp.arange(t), kv_rows, window))(start)
    allowed = allowed[:, None, None]
  else:
    allowed = _allowed(start + jnp.arange(t), kv_rows, window)
  scores = jnp.where(allowed, scores, -jnp.inf)
  if sinks is not None:
    sink = sinks.reshape(g, -1)[None, :, :, None, None]  # [1, G, R, 1, 1]
    sink = jnp.broadcast_to(sink, (*scores.shape[:-1], 1))
    probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
  else:
    probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("BGRTS,BSGA->BTGRA", probs, _kv_floats(v))
  return out.reshape(*out.shape[:2], h, v.shape[-1])


def write_rows(buffer: jax.Array, rows: jax.Array, start) -> jax.Array:
  """``buffer`` with ``rows`` written at index tuple ``start`` (clamped as
  dynamic_update_slice clamps), in place: a KV_BITS buffer takes rows of values as their
  bfloat16 bits (``kv_stored``), any other buffer rows cast to its dtype. The KV writes and
  the batch's joins use it. A bfloat16 buffer (not a KV cache) is written through its uint16
  bits: XLA:CPU widens a bfloat16 dynamic-update-slice to float32, the whole buffer."""
  if buffer.dtype == KV_BITS and jnp.issubdtype(rows.dtype, jnp.floating):
    rows = kv_stored(rows, KV_BITS)
  rows = rows.astype(buffer.dtype)
  if buffer.dtype != jnp.bfloat16:
    return jax.lax.dynamic_update_slice(buffer, rows, start)
  bits = jax.lax.dynamic_update_slice(jax.lax.bitcast_convert_type(buffer, jnp.uint16),
                                      jax.lax.bitcast_convert_type(rows, jnp.uint16), start)
  return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


_ROWS_AT = jax.lax.ScatterDimensionNumbers(update_window_dims=(1, 2, 3),
                                           inserted_window_dims=(0,),
                                           scatter_dims_to_operand_dims=(0, 1))


def write_kv(buffer: jax.Array, rows: jax.Array, length: jax.Array) -> jax.Array:
  """``rows`` [B, T, G, A] (values) written into the cache ``buffer`` [B, S, G, A] at row
  ``length``: one row for every sequence (an int32 []), or each sequence's own (int32 [B], a
  batch of sequences at different lengths: one scatter of B windows, each clamped into the
  cache as dynamic_update_slice clamps, in place; B chained dynamic-update-slices fuse into a
  loop over the whole buffer)."""
  rows = kv_stored(rows, buffer.dtype)
  if not jnp.ndim(length):
    return write_rows(buffer, rows, (0, length, 0, 0))
  b, t = rows.shape[:2]
  start = jnp.clip(length.astype(jnp.int32), 0, buffer.shape[1] - t)
  where = jnp.stack([jnp.arange(b, dtype=jnp.int32), start], axis=1)  # [B, 2]: (row, first)
  return jax.lax.scatter(buffer, where, rows, _ROWS_AT, indices_are_sorted=True,
                         unique_indices=True, mode=jax.lax.GatherScatterMode.CLIP)


KV_BLOCK = 256  # cache rows per step of blocked_attention (KV capacities are multiples of it)


def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, length: jax.Array, *,
                      window: int | None, sinks: jax.Array | None,
                      block: int = KV_BLOCK, scale: float | None = None) -> jax.Array:
  """``dense_attention`` of T queries at cache rows [length, length + T) against a KV cache,
  walking only the blocks of ``block`` rows they may attend, with an online softmax: memory
  O(T · block) per head instead of O(T · S) (a prefill chunk against a long cache). A cache
  whose rows are not a multiple of ``block`` is walked in one block."""
  b, t, h, a = q.shape
  s_rows, g = k.shape[1], k.shape[2]
  block = block if s_rows % block == 0 else s_rows
  q5 = q.reshape(b, t, g, h // g, a) * (a ** -0.5 if scale is None else scale)
  a = v.shape[-1]
  q_rows = length + jnp.arange(t)
  first = 0 if window is None else jnp.maximum(length - window + 1, 0) // block
  last = (length + t + block - 1) // block  # one past the last block holding a query's row

  def body(i, carry):
    top, total, acc = carry  # [B, G, R, T], [B, G, R, T], [B, G, R, T, A]
    kb = _kv_floats(jax.lax.dynamic_slice_in_dim(k, i * block, block, axis=1))
    vb = _kv_floats(jax.lax.dynamic_slice_in_dim(v, i * block, block, axis=1))
    scores = jnp.einsum("BTGRA,BSGA->BGRTS", q5, kb)
    allowed = _allowed(q_rows, i * block + jnp.arange(block), window)
    scores = jnp.where(allowed, scores, -jnp.inf)
    new_top = jnp.maximum(top, scores.max(-1))
    safe = jnp.where(jnp.isfinite(new_top), new_top, 0.0)  # no row allowed yet: keep zeros
    p = jnp.exp(scores - safe[..., None])
    rescale = jnp.exp(top - safe)
    total = total * rescale + p.sum(-1)
    acc = acc * rescale[..., None] + jnp.einsum("BGRTS,BSGA->BGRTA", p, vb)
    return new_top, total, acc

  shape = (b, g, h // g, t)
  init = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros((*shape, a)))
  top, total, acc = jax.lax.fori_loop(first, last, body, init)
  if sinks is not None:
    sink = sinks.reshape(g, -1)[None, :, :, None]  # [1, G, R, 1]
    new_top = jnp.maximum(top, sink)
    total = total * jnp.exp(top - new_top) + jnp.exp(sink - new_top)
    acc = acc * jnp.exp(top - new_top)[..., None]
  out = acc / total[..., None]  # [B, G, R, T, A]
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, a)


class Attention(nnx.Module):
  """Grouped-query attention with optional q/k norm, qkv/o bias, clipping, a sliding window,
  attention sinks (a learned per-head logit that takes probability mass but no value), partial
  rotary embedding and a sigmoid output gate.

  ``qk_norm``: ``"per_head"`` normalises each head over A (Qwen3), ``"full"`` normalises the
  whole projection over H·A (OLMoE), None for no norm. ``output_gate``: each head's output is
  scaled by ``sigmoid(x · w_gate)`` before the output projection (Qwen3-Next, Qwen3.5).
  """

  def __init__(self, *, width: int, num_heads: int, num_kv_heads: int, head_dim: int,
               rope_theta: float, eps: float, qk_norm: str | None, qkv_bias: bool, o_bias: bool,
               clip_qkv: float | None, window: int | None, rngs: nnx.Rngs, sinks: bool = False,
               rotary_dim: int | None = None, output_gate: bool = False,
               zero_centred_norm: bool = False, yarn: Yarn | None = None, dtype=jnp.float32):
    h, g, a, d = num_heads, num_kv_heads, head_dim, width
    self.yarn = yarn
    self.w_q_had = normal_param(rngs, (h, a, d), dtype)
    if output_gate:
      self.w_gate_had = normal_param(rngs, (h, a, d), dtype)
    self.output_gate = output_gate
    self.rotary_dim = None if rotary_dim in (None, a) else rotary_dim
    self.w_k_gad = normal_param(rngs, (g, a, d), dtype)
    self.w_v_gad = normal_param(rngs, (g, a, d), dtype)
    self.w_o_dha = normal_param(rngs, (d, h, a), dtype)
    if qkv_bias:
      self.b_q_ha = nnx.Param(jnp.zeros((h, a), dtype))
      self.b_k_ga = nnx.Param(jnp.zeros((g, a), dtype))
      self.b_v_ga = nnx.Param(jnp.zeros((g, a), dtype))
    if o_bias:
      self.b_o_d = nnx.Param(jnp.zeros((d,), dtype))
    zc = zero_centred_norm
    if qk_norm == "per_head":
      self.q_norm = RMSNorm(a, eps, zero_centred=zc, dtype=dtype)
      self.k_norm = RMSNorm(a, eps, zero_centred=zc, dtype=dtype)
    elif qk_norm == "full":
      self.q_norm = RMSNorm(h * a, eps, zero_centred=zc, dtype=dtype)
      self.k_norm = RMSNorm(g * a, eps, zero_centred=zc, dtype=dtype)
    if sinks:
      self.sinks_h = nnx.Param(jnp.zeros((h,), dtype))
    self.sinks = sinks
    self.qk_norm = qk_norm
    self.qkv_bias = qkv_bias
    self.o_bias = o_bias
    self.clip_qkv = clip_qkv
    self.window = window
    self.rope_theta = rope_theta
    self.head_dim = a

  def _project(self, x, kernels):
    q = linear(x, self.w_q_had, 2, kernels=kernels)  # [B, T, H, A]
    k = linear(x, self.w_k_gad, 2, kernels=kernels)  # [B, T, G, A]
    v = linear(x, self.w_v_gad, 2, kernels=kernels)
    if self.qkv_bias:
      q, k, v = q + f32(self.b_q_ha), k + f32(self.b_k_ga), v + f32(self.b_v_ga)
    if self.qk_norm == "per_head":
      q, k = self.q_norm(q), self.k_norm(k)
    elif self.qk_norm == "full":
      q = self.q_norm(q.reshape(*q.shape[:2], -1)).reshape(q.shape)
      k = self.k_norm(k.reshape(*k.shape[:2], -1)).reshape(k.shape)
    if self.clip_qkv is not None:
      c = self.clip_qkv
      q, k, v = jnp.clip(q, -c, c), jnp.clip(k, -c, c), jnp.clip(v, -c, c)
    return q, k, v

  def __call__(self, x: jax.Array, cache: KVCache, length: jax.Array, positions: jax.Array,
               *, kernels: str = "xla", fresh: bool = False) -> tuple[KVCache, jax.Array]:
    """x [B, T, D]; writes the T new keys/values at cache rows [length, length + T).
    ``length``: int32 [] (every sequence at one length), or int32 [B] (a batch of sequences
    at their own lengths, one token each: a batched decode step).

    With the FFI kernels the host attention op (``ftjax.kernels.attention``, blocked flash
    form) reads the cache in place: in the decode loop XLA's einsums would copy and transpose
    the whole cache at every step, and a prefill chunk never holds its T x S scores. On the
    XLA path ``fresh`` (static) promises ``length == 0``: the queries then attend to this
    chunk's keys only (T x T scores), not to the whole (empty) cache; a later chunk walks
    the cache in blocks (``blocked_attention``).
    """
    _, t, _ = x.shape
    q, k, v = self._project(x, kernels)
    q = rope(q, positions, self.rope_theta, self.rotary_dim, self.yarn)
    k = rope(k, positions, self.rope_theta, self.rotary_dim, self.yarn)
    gate = (jax.nn.sigmoid(linear(x, self.w_gate_had, 2, kernels=kernels))  # [B, T, H, A]
            if self.output_gate else None)
    # Keys and values as the cache stores them (rounded once for a bfloat16 cache): a fresh
    # prefill attends to exactly what later chunks and decode steps read back.
    k, v = k.astype(kv_value_dtype(cache.k.dtype)), v.astype(kv_value_dtype(cache.v.dtype))
    cache = KVCache(k=write_kv(cache.k, k, length), v=write_kv(cache.v, v, length))
    sinks = f32(self.sinks_h) if self.sinks else None
    if kernels in FFI_KERNELS:  # fresh or not: no T x S scores in memory
      scale = self.head_dim ** -0.5
      if jnp.ndim(length) and length.shape[0] == 1:
        length = length[0]
      # A batch at different lengths passes one per sequence: one call (under jax.vmap the calls
      # would run in an XLA loop that copies every sequence's cache to float32 each layer).
      out = attention(q, cache.k, cache.v, length + t, scale=scale, window=self.window,
                      sinks=sinks)
    # XLA (float32 einsums; keys and values widened from the cache's dtype).
    elif fresh:  # the chunk's own keys and values: T x T scores
      out = dense_attention(q, k, v, 0, window=self.window, sinks=sinks)
    elif t == 1:  # decode: one query per sequence against the cache
      out = dense_attention(q, cache.k, cache.v, length, window=self.window, sinks=sinks)
    else:  # a chunk after others: the cache in blocks, T x block scores at a time
      out = blocked_attention(q, cache.k, cache.v, length, window=self.window, sinks=sinks)
    return cache, self._output(out, gate, kernels)

  def _output(self, out: jax.Array, gate: jax.Array | None, kernels: str) -> jax.Array:
    """[B, T, H, A] -> [B, T, D]: the output gate, projection and bias."""
    if gate is not None:
      out = out * gate
    y = linear(out, self.w_o_dha, 1, kernels=kernels)
    if self.o_bias:
      y = y + f32(self.b_o_d)
    return y


class LatentAttention(nnx.Module):
  """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2), run in its absorbed form.

  Per token: ``[c; k_r] = W_kva x`` with c [R] (kv_lora_rank) normed, k_r [P] one rotary key
  shared by all heads; queries ``[q_n; q_r]`` per head ([N] unrotated, [P] rotary) from ``x``
  (through a normed rank-Q bottleneck when ``q_lora_rank``). Head h's key is
  ``[W_uk[h] c; k_r]`` and its value ``W_uv[h] c`` (``W_kvb`` [H, N + V, R] holds both).

  The cache holds ``[c; k_r]`` (R + P per token, one "head", as key; an empty value), and each
  query is absorbed instead of each key expanded: ``q' = [W_uk[h]^T q_n; q_r]`` against the
  cached rows gives the same scores, the probabilities average the rows, and the first R dims
  of that, times ``W_uv[h]``, are the head's output. So decode reads R + P numbers per cached
  token for all heads (576 for DeepSeek-V3, against 2 x 128 heads x 128 dims expanded), and the
  host attention kernel runs it as one KV head of width R + P whose values are its keys.
  """

  def __init__(self, *, width: int, num_heads: int, q_lora_rank: int, kv_lora_rank: int,
               nope_dim: int, rope_dim: int, v_dim: int, rope_theta: float, eps: float,
               interleave: bool, softmax_scale: float, rngs: nnx.Rngs, yarn: Yarn | None = None,
               dtype=jnp.float32):
    h, d, c = num_heads, width, nope_dim + rope_dim
    if q_lora_rank:
      self.w_qa_qd = normal_param(rngs, (q_lora_rank, d), dtype)
      self.q_a_norm = RMSNorm(q_lora_rank, eps, dtype=dtype)
      self.w_qb_hcq = normal_param(rngs, (h, c, q_lora_rank), dtype)
    else:
      self.w_q_had = normal_param(rngs, (h, c, d), dtype)
    self.w_kva_ld = normal_param(rngs, (kv_lora_rank + rope_dim, d), dtype)
    self.kv_a_norm = RMSNorm(kv_lora_rank, eps, dtype=dtype)
    self.w_kvb_hnr = normal_param(rngs, (h, nope_dim + v_dim, kv_lora_rank), dtype)
    self.w_o_dha = normal_param(rngs, (d, h, v_dim), dtype)
    self.q_lora = bool(q_lora_rank)
    self.latent, self.nope, self.rope_dim = kv_lora_rank, nope_dim, rope_dim
    self.interleave, self.scale = interleave, softmax_scale
    self.rope_theta, self.yarn = rope_theta, yarn

  def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    if self.interleave:  # pairs (0, 1), (2, 3), ..: the same rotation on [evens; odds]
      x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return rope(x, positions, self.rope_theta, None, self.yarn)

  def __call__(self, x: jax.Array, cache: KVCache, length: jax.Array, positions: jax.Array,
               *, kernels: str = "xla", fresh: bool = False) -> tuple[KVCache, jax.Array]:
    """As ``Attention.__call__``; the cache is ``[B, S, 1, R + P]`` keys, ``[B, S, 1, 0]``
    values."""
    _, t, _ = x.shape
    if self.q_lora:
      q = linear(self.q_a_norm(linear(x, self.w_qa_qd, 1, kernels=kernels)), self.w_qb_hcq, 2,
                 kernels=kernels)
    else:
      q = linear(x, self.w_q_had, 2, kernels=kernels)  # [B, T, H, N + P]
    kv = linear(x, self.w_kva_ld, 1, kernels=kernels)  # [B, T, R + P]
    latent = self.kv_a_norm(kv[..., :self.latent])
    k_rope = self._rope(kv[..., None, self.latent:], positions)  # [B, T, 1, P]
    q_rope = self._rope(q[..., self.nope:], positions)  # [B, T, H, P]
    w_kvb = f32(self.w_kvb_hnr)
    w_uk, w_uv = w_kvb[:, :self.nope], w_kvb[:, self.nope:]  # [H, N, R], [H, V, R]
    q_latent = jnp.einsum("BTHN,HNR->BTHR", q[..., :self.nope], w_uk)
    q_abs = jnp.concatenate([q_latent, q_rope], axis=-1)  # [B, T, H, R + P]
    rows = jnp.concatenate([latent[:, :, None, :], k_rope], axis=-1).astype(
        kv_value_dtype(cache.k.dtype))
    cache = KVCache(k=write_kv(cache.k, rows, length), v=cache.v)
    if kernels in FFI_KERNELS:
      if jnp.ndim(length) and length.shape[0] == 1:
        length = length[0]
      out = attention(q_abs, cache.k, cache.k, length + t, scale=self.scale)
    elif fresh:
      out = dense_attention(q_abs, rows, rows, 0, window=None, sinks=None, scale=self.scale)
    elif t == 1:
      out = dense_attention(q_abs, cache.k, cache.k, length, window=None, sinks=None,
                            scale=self.scale)
    else:
      out = blocked_attention(q_abs, cache.k, cache.k, length, window=None, sinks=None,
                              scale=self.scale)
    heads = jnp.einsum("BTHR,HVR->BTHV", out[..., :self.latent], w_uv)  # [B, T, H, V]
    return cache, linear(heads, self.w_o_dha, 1, kernels=kernels)


class MLP(nnx.Module):
  """Dense SwiGLU MLP (the shared expert of Qwen2-MoE)."""

  def __init__(self, *, width: int, hidden: int, rngs: nnx.Rngs, dtype=jnp.float32):
    self.w_gate_id = normal_param(rngs, (hidden, width), dtype)
    self.w_up_id = normal_param(rngs, (hidden, width), dtype)
    self.w_down_di = normal_param(rngs, (width, hidden), dtype)

  def __call__(self, x: jax.Array, *, kernels: str = "xla") -> jax.Array:
    h = jax.nn.silu(linear(x, self.w_gate_id, 1, kernels=kernels))
    h = h * linear(x, self.w_up_id, 1, kernels=kernels)
    return linear(h, self.w_down_di, 1, kernels=kernels)


class MoE(nnx.Module):
  """Router plus routed experts (read from the bank) plus an optional gated shared expert.

  The routed experts' weights are not parameters of this module: the routed experts come
  from the ``RoutedExperts`` function the step is given (``ftjax.model.moe``).
  """

  def __init__(self, *, width: int, num_experts: int, top_k: int, ffn_dim: int, router: str,
               norm_topk_prob: bool, shared_hidden: int, shared_gate: bool, rngs: nnx.Rngs,
               router_groups: int = 1, router_topk_groups: int = 1, scaling: float = 1.0,
               router_bias: bool = False, dtype=jnp.float32):
    self.w_router_ed = normal_param(rngs, (num_experts, width), dtype)
    if router_bias:
      self.b_logits_e = nnx.Param(jnp.zeros((num_experts,), dtype))  # added to the logits
    self.router_bias = router_bias
    if router == "sigmoid_group":
      self.b_router_e = nnx.Param(jnp.zeros((num_experts,), dtype))  # selection-only bias
    self.router_groups, self.router_topk_groups, self.scaling = (
        router_groups, router_topk_groups, scaling)
    if shared_hidden:
      self.shared = MLP(width=width, hidden=shared_hidden, rngs=rngs, dtype=dtype)
    if shared_gate:
      self.w_shared_gate_d = normal_param(rngs, (width,), dtype)
    self.has_shared = bool(shared_hidden)
    self.shared_gate = shared_gate
    self.top_k = top_k
    self.ffn_dim = ffn_dim
    self.router = router
    self.norm_topk_prob = norm_topk_prob

  def __call__(self, x: jax.Array, layer: int, experts: RoutedExperts, *, kernels: str = "xla",
               valid: jax.Array | None = None, sow_router_logits: bool = False
               ) -> tuple[RoutedExperts, jax.Array]:
    """x [B, T, D] -> (experts, y): ``experts`` is the routed-experts function threaded
    through the step. ``valid [B, T]`` bool marks real tokens: padding tokens get no route
    (``ids = -1``), so they touch no expert and no cache statistic. ``sow_router_logits``
    sows the router logits [B·T, E] as ``nnx.Intermediate`` "router_logits" (read them with
    ``nnx.capture``; the training losses of ``ftjax.tiny.train`` do)."""
    lead, width = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, width)  # [B·T, D]
    weights, ids = self._route(x2, kernels=kernels, valid=valid,
                               sow_router_logits=sow_router_logits)
    experts, y = experts(x2, weights, ids, layer)
    if self.has_shared:
      shared = self.shared(x2, kernels=kernels)
      if self.shared_gate:
        shared = jax.nn.sigmoid(x2 @ f32(self.w_shared_gate_d))[:, None] * shared
      y = y + shared
    return experts, y.reshape(*lead, width)

  def predict(self, x: jax.Array, *, kernels: str = "xla", valid: jax.Array | None = None
              ) -> jax.Array:
    """The experts this router picks for x [B, T, D]: ids [B·T, K] (-1 where ``valid`` is
    false). Router-ahead prefetch calls it on an earlier hidden state than the layer's own
    (``Transformer``), to name the experts before the layer runs."""
    return self._route(x.reshape(-1, x.shape[-1]), kernels=kernels, valid=valid)[1]

  def _route(self, x2, *, kernels, valid, sow_router_logits=False):
    """(weights, ids) [T, K] of the router on x2 [T, D]; padding (``valid`` false) gets
    ``ids = -1`` and weight 0."""
    logits = linear(x2, self.w_router_ed, 1, kernels=kernels)  # [T, E]
    if self.router_bias:
      logits = logits + f32(self.b_logits_e)
    if sow_router_logits:
      self.sow(nnx.Intermediate, "router_logits", logits)
    weights, ids = route(
        logits, kind=self.router, top_k=self.top_k, norm_topk_prob=self.norm_topk_prob,
        bias=f32(self.b_router_e) if self.router == "sigmoid_group" else None,
        n_group=self.router_groups, topk_group=self.router_topk_groups, scaling=self.scaling)
    if valid is not None:
      keep = valid.reshape(-1, 1)
      ids = jnp.where(keep, ids, -1)
      weights = jnp.where(keep, weights, 0.0)
    return weights, ids
