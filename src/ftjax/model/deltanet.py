"""Gated DeltaNet: the linear-attention mixer of the hybrid families (Qwen3-Next, Qwen3.5-MoE).

Glossary letters of this module (``ftjax/model/__init__.py`` has them all): J key heads, M
value heads (each key head serves M/J consecutive value heads), U key-head width, Y value-head
width, X conv channels (q, k and v: 2·J·U + M·Y), W conv width, Q chunk length, Z chunks.

Per token t and value head, with the state ``S [U, Y]``:

  S ← exp(g_t) · S                         g_t = -exp(A_log) · softplus(a_t + dt_bias) <= 0
  S ← S + k_t ⊗ β_t (v_t - Sᵀk_t)          β_t = sigmoid(b_t); the delta rule
  o_t = Sᵀ q_t                             q, k L2-normalised, q scaled by U^-1/2

``gated_delta_recurrent`` runs that loop (with ftjax's host kernels, a decode token runs the
same step as one op, ``ftjax.kernels.delta_rule_step``, which reads the state once and updates
it in place); ``gated_delta_chunked`` computes the same thing a
chunk of Q tokens at a time (the WY/UT form: a unit lower-triangular solve per chunk, then
matrix products), which is what prefill uses. A layer's decode state (``LinearState``) is the
last W-1 conv inputs and S: O(1) per token, whatever the context length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax import struct

from ftjax.kernels import delta_rule_step
from ftjax.model.layers import FFI_KERNELS, RMSNorm, f32, linear, normal_param

CHUNK = 64  # Q: tokens per chunk of the chunked form (transformers' and FLA's default)
# Up to this many tokens, a forward that keeps per-token states (a speculative verify step)
# runs the token loop: the chunked form pads to a chunk of CHUNK tokens and solves it (a
# one-token verify took 53 ms against 40 ms without snapshots on the 4-layer 35B-shaped model).
RECURRENT_SNAPSHOT_TOKENS = 8


@struct.dataclass
class LinearState:
  """Decode state of one Gated DeltaNet layer: ``conv [B, W-1, X]`` (the last W-1 inputs of
  the causal conv, oldest first) and ``recurrent [B, M, U, Y]`` (the delta-rule state)."""
  conv: jax.Array
  recurrent: jax.Array

  @classmethod
  def zeros(cls, batch: int, conv_width: int, conv_dim: int, value_heads: int, key_dim: int,
            value_dim: int, dtype=jnp.float32) -> "LinearState":
    return cls(conv=jnp.zeros((batch, conv_width - 1, conv_dim), dtype),
               recurrent=jnp.zeros((batch, value_heads, key_dim, value_dim), jnp.float32))


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """``x / sqrt(sum x² + eps)`` over the last axis (transformers' and FLA's form)."""
  return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + eps)


def gated_delta_recurrent(q, k, v, g, beta, state, snapshot_at=None):
  """The gated delta rule token by token.

  q, k [B, T, M, U] (normalised and scaled), v [B, T, M, Y], g, beta [B, T, M], state
  [B, M, U, Y] -> (out [B, T, M, Y], new state). All float32. With ``snapshot_at`` (int32
  [A] positions in [0, T]), also the state after each position's first tokens, [A, B, M, U,
  Y], as ``gated_delta_chunked`` gives it: the scan keeps each token's state, which for a few
  tokens (a speculative verify step) costs far less than the chunked form's padded chunk."""
  def step(s, inputs):
    q_t, k_t, v_t, g_t, b_t = inputs  # [B, M, U], [B, M, U], [B, M, Y], [B, M], [B, M]
    s = s * jnp.exp(g_t)[..., None, None]
    predicted = jnp.einsum("BMUY,BMU->BMY", s, k_t)
    delta = (v_t - predicted) * b_t[..., None]
    s = s + k_t[..., :, None] * delta[..., None, :]
    return s, jnp.einsum("BMUY,BMU->BMY", s, q_t)

  def step_keeping(s, inputs):
    s, out = step(s, inputs)
    return s, (out, s)

  xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
  if snapshot_at is None:
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1), state
  start = state
  state, (out, states) = jax.lax.scan(step_keeping, state, xs)
  states = jnp.concatenate([start[None], states])  # [T + 1, B, M, U, Y]: after 0 .. T tokens
  return jnp.moveaxis(out, 0, 1), state, states[jnp.asarray(snapshot_at, jnp.int32)]


@jax.custom_vjp
def unit_lower_inverse(strict: jax.Array) -> jax.Array:
  """``(I + L)^-1`` for strictly lower-triangular ``L [..., Q, Q]``, by forward substitution
  one row at a time: row i of the inverse is e_i - Σ_{j<i} L[i, j] · (row j of the inverse).
  (XLA:CPU's batched triangular solve is several times slower than this loop of Q small
  vector-matrix products.) Its gradient is the closed form of a matrix inverse's,
  ``dL = -(X^T G X^T)`` on the strictly lower triangle, two matrix products instead of
  differentiating through the loop (which made a training step ~2x slower)."""
  return _forward_substitution(strict)


def _forward_substitution(strict: jax.Array) -> jax.Array:
  q = strict.shape[-1]

  def row(i, acc):  # rows < i of acc hold the inverse minus I; rows >= i hold -L
    r = jax.lax.dynamic_index_in_dim(acc, i, axis=-2, keepdims=False)  # [..., Q]
    r = r + jnp.einsum("...J,...JQ->...Q", r, acc)
    return jax.lax.dynamic_update_index_in_dim(acc, r, i, axis=-2)

  return jax.lax.fori_loop(1, q, row, -strict) + jnp.eye(q, dtype=strict.dtype)


def _inverse_fwd(strict):
  inverse = _forward_substitution(strict)
  return inverse, inverse


def _inverse_bwd(inverse, g):
  t = jnp.swapaxes(inverse, -1, -2)
  grad = -jnp.einsum("...IJ,...JK,...KL->...IL", t, g, t)
  q = inverse.shape[-1]
  return (jnp.where(jnp.tril(jnp.ones((q, q), bool), -1), grad, 0.0),)


unit_lower_inverse.defvjp(_inverse_fwd, _inverse_bwd)


def gated_delta_chunked(q, k, v, g, beta, state, chunk: int = CHUNK, snapshot_at=None):
  """The gated delta rule, ``chunk`` tokens at a time; same arguments and result as
  ``gated_delta_recurrent``. With ``snapshot_at`` (int32 [A] positions in [0, T]), also the
  state after each position's first tokens, [A, B, M, U, Y] (see below).

  Within a chunk, with c the cumulative log-decay from the chunk start and
  Γ[i, j] = exp(c_i - c_j) for j <= i (0 above the diagonal), the chunk's updates are
  condensed by the unit lower-triangular system (I + tril(β k kᵀ ∘ Γ, -1)) X = R, solved
  for R = β v (giving u) and R = β k exp(c) (giving w) through its inverse
  (``unit_lower_inverse``). Then, chunk by chunk:

    v' = u - w S            the part of u the incoming state does not predict
    o  = (q exp(c)) S + (q kᵀ ∘ Γ) v'
    S ← exp(c_last) S + (k exp(c_last - c))ᵀ v'

  Tokens are padded to a multiple of ``chunk`` with β = 0 and g = 0, which leaves the state
  untouched (so callers pad their own padding tokens the same way).

  A snapshot after p tokens, in chunk z = p // Q at offset r = p - z·Q, comes from that chunk's
  incoming state S_z and its v' (both kept from the scan), at no extra pass over the tokens:

    S_p = exp(c_{r-1}) S_z + Σ_{j<r} exp(c_{r-1} - c_j) k_j ⊗ v'_j      (c_{-1} = 0)

  (p = T on a chunk boundary is the last chunk with r = Q.)"""
  b, t, m, u = k.shape
  y = v.shape[-1]
  pad = (-t) % chunk
  if pad:
    def pad_t(a):
      return jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
    q, k, v, g, beta = (pad_t(a) for a in (q, k, v, g, beta))
  z = (t + pad) // chunk

  def chunks(a):  # [B, Z·Q, M, ...] -> [B, M, Z, Q, ...]
    a = a.reshape(b, z, chunk, m, *a.shape[3:])
    return jnp.moveaxis(a, 3, 1)

  q, k, v, g, beta = (chunks(a) for a in (q, k, v, g, beta))
  cum = jnp.cumsum(g, axis=-1)  # [B, M, Z, Q]
  lower = jnp.tril(jnp.ones((chunk, chunk), bool))
  gamma = jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # [.., Q, Q]
  k_beta = k * beta[..., None]
  strict = jnp.einsum("BMZIU,BMZJU->BMZIJ", k_beta, k) * gamma
  strict = jnp.where(jnp.tril(lower, -1), strict, 0.0)  # [B, M, Z, Q, Q]
  inverse = unit_lower_inverse(strict)
  u_new = jnp.einsum("BMZIJ,BMZJY->BMZIY", inverse, v * beta[..., None])
  w = jnp.einsum("BMZIJ,BMZJU->BMZIU", inverse, k_beta * jnp.exp(cum)[..., None])
  intra = jnp.einsum("BMZIU,BMZJU->BMZIJ", q, k) * gamma
  q_decayed = q * jnp.exp(cum)[..., None]
  k_decayed = k * jnp.exp(cum[..., -1:] - cum)[..., None]
  chunk_decay = jnp.exp(cum[..., -1])  # [B, M, Z]

  keep = snapshot_at is not None

  def step(s, inputs):  # s [B, M, U, Y]
    u_c, w_c, q_c, k_c, intra_c, decay_c = inputs
    v_c = u_c - jnp.einsum("BMQU,BMUY->BMQY", w_c, s)
    out = jnp.einsum("BMQU,BMUY->BMQY", q_c, s) + jnp.einsum("BMIJ,BMJY->BMIY", intra_c, v_c)
    new = s * decay_c[..., None, None] + jnp.einsum("BMQU,BMQY->BMUY", k_c, v_c)
    return new, ((out, s, v_c) if keep else out)

  xs = tuple(jnp.moveaxis(a, 2, 0) for a in (u_new, w, q_decayed, k_decayed, intra, chunk_decay))
  state, ys = jax.lax.scan(step, state, xs)  # out [Z, B, M, Q, Y]
  out = ys[0] if keep else ys
  out = jnp.moveaxis(jnp.moveaxis(out, 0, 2).reshape(b, m, z * chunk, y)[:, :, :t], 1, 2)
  if not keep:
    return out, state
  starts, v_prime = ys[1], ys[2]  # [Z, B, M, U, Y], [Z, B, M, Q, Y]

  def snapshot(p):
    zi = jnp.minimum(p // chunk, z - 1)
    r = p - zi * chunk  # tokens of chunk zi read, in [0, Q]
    cum_z = jax.lax.dynamic_index_in_dim(cum, zi, axis=2, keepdims=False)  # [B, M, Q]
    last = jnp.where(r > 0, jax.lax.dynamic_index_in_dim(cum_z, jnp.maximum(r - 1, 0), axis=2,
                                                         keepdims=False), 0.0)  # [B, M]
    j = jnp.arange(chunk)
    weight = jnp.where(j < r, jnp.exp(jnp.where(j < r, last[..., None] - cum_z, 0.0)), 0.0)
    k_z = jax.lax.dynamic_index_in_dim(k, zi, axis=2, keepdims=False)  # [B, M, Q, U]
    return (jnp.exp(last)[..., None, None] * starts[zi]
            + jnp.einsum("BMJU,BMJY->BMUY", k_z * weight[..., None], v_prime[zi]))

  return out, state, jax.vmap(snapshot)(jnp.asarray(snapshot_at, jnp.int32))


class GatedDeltaNet(nnx.Module):
  """Qwen3-Next / Qwen3.5 ``linear_attn``: projections, causal depthwise conv (SiLU), the
  gated delta rule, a gated RMSNorm (``norm(o) · silu(z)``) and the output projection."""

  def __init__(self, *, width: int, key_heads: int, value_heads: int, key_dim: int,
               value_dim: int, conv_width: int, eps: float, rngs: nnx.Rngs, dtype=jnp.float32):
    d, j, m, u, y, w = width, key_heads, value_heads, key_dim, value_dim, conv_width
    x = 2 * j * u + m * y
    self.w_qkv_xd = normal_param(rngs, (x, d), dtype)
    self.w_z_myd = normal_param(rngs, (m, y, d), dtype)
    self.w_b_md = normal_param(rngs, (m, d), dtype)
    self.w_a_md = normal_param(rngs, (m, d), dtype)
    self.conv_xw = nnx.Param((0.3 * jax.random.normal(rngs.params(), (x, w))).astype(dtype))
    self.dt_bias_m = nnx.Param(jnp.ones((m,), dtype))
    self.a_log_m = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (m,), minval=1.0,
                                                        maxval=16.0)).astype(dtype))
    self.norm = RMSNorm(y, eps, dtype=dtype)  # plain scale (init 1), not zero-centred
    self.w_out_dmy = normal_param(rngs, (d, m, y), dtype)
    self.key_heads, self.value_heads, self.key_dim, self.value_dim = j, m, u, y
    self.conv_width = w

  def __call__(self, x: jax.Array, state: LinearState, *, kernels: str = "xla",
               valid: jax.Array | None = None, num_valid: jax.Array | None = None,
               snapshot_at: jax.Array | None = None, active: jax.Array | None = None):
    """x [B, T, D] -> (new state, y [B, T, D]).

    ``valid [B, T]`` marks real tokens and ``num_valid`` counts them (padding comes last):
    padding neither decays nor updates the recurrent state, and the conv state keeps the last
    real inputs. One token runs the recurrent form, more the chunked form. With
    ``snapshot_at`` (int32 [A] positions in [0, T]) a third result holds the state after each
    position's first tokens (a ``LinearState`` with a leading [A] axis), from the chunked
    form's own intermediates (the anchors of ``ftjax.Session``). ``active`` (bool [B]): the
    sequences that read their tokens; the others' states stay as they are (with ``valid``
    false for them)."""
    bsz, t, _ = x.shape
    j, m, u, y = self.key_heads, self.value_heads, self.key_dim, self.value_dim
    qkv = linear(x, self.w_qkv_xd, 1, kernels=kernels)  # [B, T, X]
    z = linear(x, self.w_z_myd, 2, kernels=kernels)  # [B, T, M, Y]
    b = linear(x, self.w_b_md, 1, kernels=kernels)  # [B, T, M]
    a = linear(x, self.w_a_md, 1, kernels=kernels)

    # Causal depthwise conv over [the last W-1 inputs, this chunk].
    w = self.conv_width
    ext = jnp.concatenate([state.conv.astype(jnp.float32), qkv], axis=1)  # [B, W-1+T, X]
    kernel = f32(self.conv_xw)  # [X, W]
    conv = sum(ext[:, i:i + t] * kernel[:, i] for i in range(w))
    qkv = jax.nn.silu(conv)
    start = t if num_valid is None else num_valid
    new_conv = jax.lax.dynamic_slice_in_dim(ext, start, w - 1, axis=1).astype(state.conv.dtype)
    if active is not None:
      new_conv = jnp.where(active[:, None, None], new_conv, state.conv)
    snap_conv = None
    if snapshot_at is not None:  # the W-1 inputs before each position
      snap_conv = jax.vmap(lambda p: jax.lax.dynamic_slice_in_dim(ext, p, w - 1, axis=1))(
          jnp.asarray(snapshot_at, jnp.int32)).astype(state.conv.dtype)

    q = qkv[..., :j * u].reshape(bsz, t, j, u)
    k = qkv[..., j * u:2 * j * u].reshape(bsz, t, j, u)
    v = qkv[..., 2 * j * u:].reshape(bsz, t, m, y)
    q = l2_normalize(q) * (u ** -0.5)
    k = l2_normalize(k)
    if m != j:  # each key head serves M/J consecutive value heads
      q, k = jnp.repeat(q, m // j, axis=2), jnp.repeat(k, m // j, axis=2)
    beta = jax.nn.sigmoid(b)
    g = -jnp.exp(f32(self.a_log_m)) * jax.nn.softplus(a + f32(self.dt_bias_m))
    if valid is not None:
      beta = jnp.where(valid[..., None], beta, 0.0)
      g = jnp.where(valid[..., None], g, 0.0)
    snaps = None
    if snapshot_at is not None:
      rule = gated_delta_recurrent if t <= RECURRENT_SNAPSHOT_TOKENS else gated_delta_chunked
      out, recurrent, snap_rec = rule(q, k, v, g, beta, state.recurrent,
                                      snapshot_at=snapshot_at)
      snaps = LinearState(conv=snap_conv, recurrent=snap_rec)
    elif t == 1 and kernels in FFI_KERNELS:  # one pass over the state, in place
      out, recurrent = delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0],
                                       state.recurrent)
      out = out[:, None]
    else:
      rule = gated_delta_recurrent if t == 1 else gated_delta_chunked
      out, recurrent = rule(q, k, v, g, beta, state.recurrent)

    out = self.norm(out) * jax.nn.silu(z)  # [B, T, M, Y]
    new_state = LinearState(conv=new_conv, recurrent=recurrent)
    y = linear(out, self.w_out_dmy, 1, kernels=kernels)
    return (new_state, y) if snapshot_at is None else (new_state, y, snaps)
