"""Routed-expert execution from the host expert bank (the reference path).

The bank is one array ``[L, E, P]`` (see ``ftjax.formats.ftw``): block ``bank[l, e]`` holds
``gate [F, D]`` at element 0, ``up [F, D]`` at ``F·D`` and ``down [D, F]`` at ``2·F·D``;
the tail up to ``P`` is alignment padding. Every routed expert is read from this bank: there
is no device cache on this path. Two implementations compute the same sum:

* ``xla``: plain jnp. Few routes (decode): gather the routed blocks. Many routes (prefill):
  scan over experts with per-token combine weights, so memory stays ``O(T·F)``.
* ``ffi``: the host kernel ``ftjax_expert_ffn`` (CPU backend only); ``ffi_bf16`` rounds the
  activations to bfloat16 for bfloat16 banks (faster grouped prefill, ~1e-2 relative error).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _split_block(block: jax.Array, ffn_dim: int, width: int):
  """[..., P] -> gate [..., F, D], up [..., F, D], down [..., D, F]."""
  fd = ffn_dim * width
  lead = block.shape[:-1]
  gate = block[..., :fd].reshape(*lead, ffn_dim, width)
  up = block[..., fd:2 * fd].reshape(*lead, ffn_dim, width)
  down = block[..., 2 * fd:3 * fd].reshape(*lead, width, ffn_dim)
  return gate, up, down


def _routed_gather(x, ids, weights, bank_ep, ffn_dim):
  """Few routes: gather each routed block. x [T, D], ids/weights [T, K]."""
  width = x.shape[-1]
  valid = ids >= 0
  blocks = bank_ep[jnp.where(valid, ids, 0)]  # [T, K, P]
  gate, up, down = _split_block(blocks, ffn_dim, width)
  gate, up, down = (w.astype(jnp.float32) for w in (gate, up, down))
  h = jax.nn.silu(jnp.einsum("TD,TKFD->TKF", x, gate)) * jnp.einsum("TD,TKFD->TKF", x, up)
  w = jnp.where(valid, weights, 0.0)
  return jnp.einsum("TKF,TKDF,TK->TD", h, down, w)


def _routed_scan(x, ids, weights, bank_ep, ffn_dim):
  """Many routes: one pass per expert over all tokens, with per-token combine weights."""
  num_experts = bank_ep.shape[0]
  width = x.shape[-1]
  # combine[e, t] = sum_k weights[t, k] * (ids[t, k] == e)
  onehot = ids[None, :, :] == jnp.arange(num_experts, dtype=ids.dtype)[:, None, None]  # [E, T, K]
  combine = jnp.sum(jnp.where(onehot, weights[None], 0.0), axis=-1)  # [E, T]

  def one_expert(y, inputs):
    block, comb = inputs
    gate, up, down = (w.astype(jnp.float32) for w in _split_block(block, ffn_dim, width))
    h = jax.nn.silu(jnp.einsum("TD,FD->TF", x, gate)) * jnp.einsum("TD,FD->TF", x, up)
    return y + jnp.einsum("TF,DF,T->TD", h, down, comb), None

  y, _ = jax.lax.scan(one_expert, jnp.zeros_like(x), (bank_ep, combine))
  return y


def routed_experts(x: jax.Array, ids: jax.Array, weights: jax.Array, bank: jax.Array,
                   layer: int, *, ffn_dim: int, impl: str = "xla") -> jax.Array:
  """``sum_k weights[t,k] · expert_{ids[t,k]}(x[t])`` over layer ``layer`` of ``bank``.

  x [T, D] float32, ids [T, K] int32 (-1 = no route), weights [T, K] float32,
  bank [L, E, P]. Returns [T, D] float32.
  """
  if impl in ("ffi", "ffi_bf16"):
    from ftjax.kernels import expert_ffn  # noqa: PLC0415 (needs the compiled module)
    return expert_ffn(x, ids, weights, bank, layer, ffn_dim=ffn_dim,
                      bf16_activations=impl == "ffi_bf16")
  if impl != "xla":
    raise ValueError(f"unknown MoE implementation {impl!r}; expected 'xla', 'ffi' or 'ffi_bf16'")
  bank_ep = bank[layer]
  if ids.size <= bank_ep.shape[0]:
    return _routed_gather(x, ids, weights, bank_ep, ffn_dim)
  return _routed_scan(x, ids, weights, bank_ep, ffn_dim)
