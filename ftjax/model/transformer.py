"""The decoder stack and its pure-functional step.

``forward(graphdef, params, bank, state, tokens, positions) -> (new_state, logits)`` is the
jit boundary: the dense parameters and the expert bank are arguments (never closed over),
the decode state is donated and threaded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from flax import struct

from ftjax.cache.moe import ExpertRunner, RoutingRecord, StepStats
from ftjax.cache.policy import PolicyConfig
from ftjax.cache.state import ExpertCache
from ftjax.model.config import ModelConfig
from ftjax.model.layers import Attention, KVCache, MoE, RMSNorm, _normal, linear


@struct.dataclass
class DecodeState:
  """Everything a decode step changes.

  ``layers[i]`` is the state of layer i's mixer (a ``KVCache`` for attention layers; linear
  attention layers will carry conv and recurrent state here); ``length`` counts the cached
  tokens. With an expert cache, ``experts`` is it, ``bandwidths`` the (B_P, B_H) its policy
  plans with, and ``stats`` what the last step did per layer.
  """
  layers: tuple[KVCache, ...]
  length: jax.Array  # int32 [], rows [0, length) of every cache are filled
  experts: ExpertCache | None = None
  bandwidths: jax.Array | None = None  # [2] float32 GB/s
  stats: StepStats | None = None
  routing: RoutingRecord | None = None  # the last step's router output, when recording


def init_state(config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, *,
               experts: ExpertCache | None = None, bandwidths=None) -> DecodeState:
  layers = tuple(
      KVCache.zeros(batch, max_len, config.num_kv_heads, config.head_dim, dtype)
      for _ in config.layer_types)
  if experts is None:
    return DecodeState(layers=layers, length=jnp.zeros((), jnp.int32))
  return DecodeState(layers=layers, length=jnp.zeros((), jnp.int32), experts=experts,
                     bandwidths=jnp.asarray(bandwidths, jnp.float32),
                     stats=StepStats.zeros(config.num_moe_layers))


class DecoderLayer(nnx.Module):

  def __init__(self, config: ModelConfig, layer_type: str, *, rngs: nnx.Rngs, dtype):
    c = config
    window = c.sliding_window if layer_type == "sliding_attention" else None
    self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
    self.attn = Attention(
        width=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim, rope_theta=c.rope_theta, eps=c.rms_norm_eps, qk_norm=c.qk_norm,
        qkv_bias=c.qkv_bias, o_bias=c.o_bias, clip_qkv=c.clip_qkv, window=window, rngs=rngs,
        sinks=c.attn_sinks, dtype=dtype)
    self.mlp_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
    self.moe = MoE(
        width=c.hidden_size, num_experts=c.num_experts, top_k=c.top_k,
        ffn_dim=c.moe_intermediate_size, router=c.router, norm_topk_prob=c.norm_topk_prob,
        shared_hidden=c.shared_expert_intermediate_size, shared_gate=c.shared_expert_gate,
        router_groups=c.router_groups, router_topk_groups=c.router_topk_groups,
        scaling=c.routed_scaling_factor, rngs=rngs, dtype=dtype)

  def __call__(self, x, cache, length, positions, layer, experts, fresh,
               sow_router_logits=False):
    cache, h = self.attn(self.attn_norm(x), cache, length, positions, impl=experts.impl,
                         fresh=fresh)
    x = x + h
    experts, h = self.moe(self.mlp_norm(x), layer, experts, sow_router_logits=sow_router_logits)
    return cache, experts, x + h


class Transformer(nnx.Module):
  """Embedding, decoder layers, final norm, lm_head (tied to the embedding when configured)."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
    c = config
    self.embed_vd = _normal(rngs, (c.vocab_size, c.hidden_size), dtype)
    self.layers = nnx.List([DecoderLayer(c, kind, rngs=rngs, dtype=dtype)
                            for kind in c.layer_types])
    self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
    if not c.tie_word_embeddings:
      self.w_lm_vd = _normal(rngs, (c.vocab_size, c.hidden_size), dtype)
    self.tie_word_embeddings = c.tie_word_embeddings

  def __call__(self, state: DecodeState, tokens: jax.Array, positions: jax.Array,
               bank: jax.Array, *, last_only: bool = False, kernels: str = "xla",
               policy: PolicyConfig | None = None, fresh: bool = False,
               record_routing: bool = False, sow_router_logits: bool = False
               ) -> tuple[DecodeState, jax.Array]:
    """tokens, positions [B, T] -> (new state, logits [B, T or 1, V] float32).

    ``fresh`` (static) promises an empty state (``length == 0``), as in a prefill;
    ``record_routing`` (static) returns the router's output in ``new_state.routing``;
    ``sow_router_logits`` sows each layer's router logits (``nnx.capture``, training)."""
    x = jnp.take(self.embed_vd[...], tokens, axis=0).astype(jnp.float32)  # [B, T, D]
    first_moe = self.layers[0].moe
    routing = (RoutingRecord.zeros(len(self.layers), tokens.size, first_moe.top_k)
               if record_routing else None)
    experts = ExpertRunner(bank=bank, cache=state.experts, bandwidths=state.bandwidths,
                           stats=state.stats, routing=routing, impl=kernels, policy=policy)
    caches = []
    for i, layer in enumerate(self.layers):
      cache, experts, x = layer(x, state.layers[i], state.length, positions, i, experts, fresh,
                                sow_router_logits)
      caches.append(cache)
    if last_only:
      x = x[:, -1:]
    x = self.final_norm(x)
    w_lm = self.embed_vd if self.tie_word_embeddings else self.w_lm_vd
    logits = linear(x, w_lm, 1, impl=kernels)  # [B, T, V]
    new_state = state.replace(layers=tuple(caches), length=state.length + tokens.shape[1],
                              experts=experts.cache, stats=experts.stats,
                              routing=experts.routing)
    return new_state, logits


@functools.partial(jax.jit,
                   static_argnames=("graphdef", "last_only", "kernels", "policy", "fresh",
                                    "record_routing"),
                   donate_argnames=("state",))
def forward(graphdef: nnx.GraphDef, params: nnx.State, bank: jax.Array, state: DecodeState,
            tokens: jax.Array, positions: jax.Array, *, last_only: bool = False,
            kernels: str = "xla", policy: PolicyConfig | None = None, fresh: bool = False,
            record_routing: bool = False) -> tuple[DecodeState, jax.Array]:
  """One jitted step over all layers: ``(new_state, logits)``. ``state`` is donated (with
  the expert cache in it, so fills update the slot buffer in place)."""
  model = nnx.merge(graphdef, params)
  return model(state, tokens, positions, bank, last_only=last_only, kernels=kernels,
               policy=policy, fresh=fresh, record_routing=record_routing)
