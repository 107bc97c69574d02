"""The decoder stack, its per-layer decode state, and its pure-functional step.

``Transformer(state, tokens, positions, experts, kernels=...) -> (new_state, experts,
logits)``: the model owns the per-layer decode state (``DecodeState``: each mixer's state plus
the length) and gets its routed experts from ``experts`` (``ftjax.model.moe.RoutedExperts``),
which it threads through the layers and returns. Where the routed experts' weights live, and
the jit programs around a step, are the runtime's (``ftjax.runtime``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from flax import struct

from ftjax.model.config import ModelConfig
from ftjax.model.deltanet import GatedDeltaNet, LinearState
from ftjax.model.layers import (MLP, Attention, KVCache, LatentAttention, MoE, RMSNorm,
                                embed_rows, linear, normal_param)
from ftjax.model.moe import RoutedExperts
from ftjax.utils.arrays import take


@struct.dataclass
class DecodeState:
  """Everything a decode step changes in the model.

  ``layers[i]`` is the state of layer i's mixer: a ``KVCache`` for an attention layer, a
  ``LinearState`` (conv inputs and delta-rule state, O(1) in the context length) for a Gated
  DeltaNet layer. ``length`` counts the tokens seen. The engine's state (expert cache,
  statistics, routing record) wraps this one (``ftjax.runtime.state.EngineState``).
  """
  layers: tuple[KVCache | LinearState, ...]
  # int32 []: rows [0, length) of every KV cache are filled; or int32 [B], each sequence's
  # own (a batch of sequences at different lengths, ``ftjax.runtime.executor``)
  length: jax.Array

  @property
  def capacity(self) -> int:
    """Tokens the state can hold (static; unbounded without attention layers, reported 0)."""
    kv = [s for s in self.layers if isinstance(s, KVCache)]
    return kv[0].k.shape[1] if kv else 0


def _layer_state(config: ModelConfig, kind: str, batch: int, max_len: int, dtype):
  c = config
  if kind == "linear_attention":
    return LinearState.zeros(batch, c.linear_conv_kernel, c.linear_conv_dim,
                             c.linear_num_value_heads, c.linear_key_head_dim,
                             c.linear_value_head_dim)
  g, k, v = c.kv_cache_shape
  return KVCache.zeros(batch, max_len, g, k, dtype, value_dim=v)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def init_state(config: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> DecodeState:
  """An empty decode state for ``batch`` rows of ``max_len`` tokens, allocated on the device
  (jitted: no host-to-device transfer)."""
  layers = tuple(_layer_state(config, kind, batch, max_len, dtype) for kind in config.layer_types)
  return DecodeState(layers=layers, length=jnp.zeros((), jnp.int32))


class DecoderLayer(nnx.Module):
  """A mixer (attention or Gated DeltaNet), then a feed-forward: a MoE (router, routed experts
  from the given function, shared experts) or, with ``dense_mlp``, a dense SwiGLU MLP of
  ``config.dense_intermediate_size`` (``ModelConfig.dense_layers``)."""

  def __init__(self, config: ModelConfig, layer_type: str, *, rngs: nnx.Rngs, dtype,
               dense_mlp: bool = False):
    c = config
    zc = c.norm_zero_centred
    self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, zero_centred=zc, dtype=dtype)
    self.linear = layer_type == "linear_attention"
    if self.linear:
      self.linear_attn = GatedDeltaNet(
          width=c.hidden_size, key_heads=c.linear_num_key_heads,
          value_heads=c.linear_num_value_heads, key_dim=c.linear_key_head_dim,
          value_dim=c.linear_value_head_dim, conv_width=c.linear_conv_kernel,
          eps=c.rms_norm_eps, rngs=rngs, dtype=dtype)
    elif c.latent_attention:
      self.attn = LatentAttention(
          width=c.hidden_size, num_heads=c.num_heads, q_lora_rank=c.q_lora_rank,
          kv_lora_rank=c.kv_lora_rank, nope_dim=c.qk_nope_head_dim, rope_dim=c.head_dim,
          v_dim=c.v_head_dim, rope_theta=c.rope_theta, eps=c.rms_norm_eps,
          interleave=c.rope_interleave, yarn=c.yarn, rngs=rngs, dtype=dtype,
          softmax_scale=(c.qk_nope_head_dim + c.head_dim) ** -0.5 * c.softmax_scale_factor)
    else:
      window = c.sliding_window if layer_type == "sliding_attention" else None
      self.attn = Attention(
          width=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
          head_dim=c.head_dim, rope_theta=c.rope_theta, eps=c.rms_norm_eps, qk_norm=c.qk_norm,
          qkv_bias=c.qkv_bias, o_bias=c.o_bias, clip_qkv=c.clip_qkv, window=window, rngs=rngs,
          sinks=c.attn_sinks, rotary_dim=c.rotary_dim, output_gate=c.attn_output_gate,
          zero_centred_norm=zc, yarn=c.yarn, dtype=dtype)
    self.mlp_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, zero_centred=zc, dtype=dtype)
    self.dense_mlp = dense_mlp
    if dense_mlp:
      self.mlp = MLP(width=c.hidden_size, hidden=c.dense_intermediate_size, rngs=rngs,
                     dtype=dtype)
      return
    self.moe = MoE(
        width=c.hidden_size, num_experts=c.num_experts, top_k=c.top_k,
        ffn_dim=c.moe_intermediate_size, router=c.router, norm_topk_prob=c.norm_topk_prob,
        shared_hidden=c.shared_expert_intermediate_size, shared_gate=c.shared_expert_gate,
        router_groups=c.router_groups, router_topk_groups=c.router_topk_groups,
        scaling=c.routed_scaling_factor, router_bias=c.router_bias, rngs=rngs, dtype=dtype)

  def __call__(self, x, cache, length, positions, layer, experts, *, kernels, fresh, valid,
               num_valid=None, sow_router_logits=False, snapshot_at=None, active=None):
    snaps = None
    if self.linear and snapshot_at is not None:
      cache, h, snaps = self.linear_attn(self.attn_norm(x), cache, kernels=kernels, valid=valid,
                                         num_valid=num_valid, snapshot_at=snapshot_at)
    elif self.linear:
      cache, h = self.linear_attn(self.attn_norm(x), cache, kernels=kernels, valid=valid,
                                  num_valid=num_valid, active=active)
    else:
      cache, h = self.attn(self.attn_norm(x), cache, length, positions, kernels=kernels,
                           fresh=fresh)
    x = x + h
    if self.dense_mlp:
      h = self.mlp(self.mlp_norm(x), kernels=kernels)
    else:
      experts, h = self.moe(self.mlp_norm(x), layer, experts, kernels=kernels, valid=valid,
                            sow_router_logits=sow_router_logits)
    if snapshot_at is not None:
      return cache, experts, x + h, snaps
    return cache, experts, x + h


class MTPHead(nnx.Module):
  """The multi-token-prediction (MTP) head of Qwen3-Next and Qwen3.5-MoE (``mtp.*``).

  From the model's hidden state h_p after its final norm at position p and the token
  x_{p+1} that follows, it predicts x_{p+2}:

    z = W_fc [embed_norm(embed(x_{p+1})); hidden_norm(h_p)]      W_fc [D, 2D]
    z = decoder layer j (gated full attention over its own KV cache at position p, MoE with
        routed experts from the bank layer after the decoder's MoE layers and j more, and
        the gated shared expert)
    h' = final_norm(z); logits = lm_head(h')

  h' is the hidden state of the next draft position (depth d uses layer d mod mtp_layers).
  The embedding and the lm_head are the model's. As llama.cpp and vLLM run it: the hidden
  state fed in is the one the lm_head reads.
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
    c = config
    zc = c.norm_zero_centred
    self.embed_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, zero_centred=zc, dtype=dtype)
    self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, zero_centred=zc, dtype=dtype)
    self.w_fc_dx = normal_param(rngs, (c.hidden_size, 2 * c.hidden_size), dtype)
    self.layers = nnx.List([DecoderLayer(c, "full_attention", rngs=rngs, dtype=dtype)
                            for _ in range(c.mtp_layers)])
    self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, zero_centred=zc, dtype=dtype)


def init_mtp_state(config: ModelConfig, batch: int, max_len: int,
                   dtype=jnp.float32) -> tuple[KVCache, ...]:
  """Empty KV caches of the MTP layers (``Transformer.mtp_step``)."""
  if not config.mtp_layers:
    raise ValueError(f"this {config.model_type} model has no multi-token-prediction (MTP) layers")
  g, k, v = config.kv_cache_shape
  return tuple(KVCache.zeros(batch, max_len, g, k, dtype, value_dim=v)
               for _ in range(config.mtp_layers))


class Transformer(nnx.Module):
  """Embedding, decoder layers, final norm, lm_head (tied to the embedding when configured);
  the MTP head (``MTPHead``) when the config has MTP layers."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
    c = config
    self.embed_vd = normal_param(rngs, (c.vocab_size, c.hidden_size), dtype)
    self.layers = nnx.List([DecoderLayer(c, kind, rngs=rngs, dtype=dtype,
                                         dense_mlp=i in c.dense_layers)
                            for i, kind in enumerate(c.layer_types)])
    self.final_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, zero_centred=c.norm_zero_centred,
                              dtype=dtype)
    if not c.tie_word_embeddings:
      self.w_lm_vd = normal_param(rngs, (c.vocab_size, c.hidden_size), dtype)
    self.tie_word_embeddings = c.tie_word_embeddings
    self.num_layers = c.num_layers
    self.bank_layers = tuple(c.bank_layer(i) for i in range(c.num_layers + c.mtp_layers))
    self.mtp = MTPHead(c, rngs=rngs, dtype=dtype) if c.mtp_layers else None

  def lm_head(self, x: jax.Array, *, kernels: str) -> jax.Array:
    """Normed hidden states [..., D] -> logits [..., V] float32."""
    w_lm = self.embed_vd if self.tie_word_embeddings else self.w_lm_vd
    return linear(x, w_lm, 1, kernels=kernels)

  def mtp_step(self, caches: tuple[KVCache, ...], length: jax.Array, hidden: jax.Array,
               tokens: jax.Array, positions: jax.Array, experts: RoutedExperts, *,
               kernels: str = "xla", depth: int = 0, fresh: bool = False,
               num_valid: jax.Array | None = None, logits: bool = True):
    """One MTP step (``MTPHead``): ``hidden [B, T, D]`` (the model's hidden states after its
    final norm, or an earlier MTP step's), ``tokens [B, T]`` (the token after each),
    ``positions [B, T]`` (those of ``hidden``) -> (caches, experts, hidden' [B, T, D],
    logits [B, T, V] float32, or None where ``logits`` (static) is False). ``caches`` are the
    MTP layers' KV caches (``init_mtp_state``), holding ``length`` rows; only layer
    ``depth % mtp_layers``'s changes. ``fresh`` (static) promises ``length == 0``.
    ``num_valid`` (int32 scalar): only the first ``num_valid`` tokens are real, the rest
    padding whose routes read no experts (their KV rows are written and overwritten later)."""
    if self.mtp is None:
      raise ValueError("this model has no multi-token-prediction (MTP) layers: its checkpoint "
                       "ships none; speculative decoding with MTP needs a Qwen3-Next, Qwen3.5-MoE, "
                       "GLM-4.5+ or DeepSeek-V3 checkpoint that has them")
    head = self.mtp
    e = head.embed_norm(embed_rows(self.embed_vd, tokens))
    z = linear(jnp.concatenate([e, head.hidden_norm(hidden)], axis=-1), head.w_fc_dx, 1,
               kernels=kernels)
    j = depth % len(head.layers)
    valid = None
    if num_valid is not None:
      valid = jnp.broadcast_to(jnp.arange(tokens.shape[1]) < num_valid, tokens.shape)
    cache, experts, z = head.layers[j](z, caches[j], length, positions,
                                       self.bank_layers[self.num_layers + j], experts,
                                       kernels=kernels, fresh=fresh, valid=valid)
    out = head.final_norm(z)
    caches = caches[:j] + (cache,) + caches[j + 1:]
    return caches, experts, out, self.lm_head(out, kernels=kernels) if logits else None

  def __call__(self, state: DecodeState, tokens: jax.Array, positions: jax.Array,
               experts: RoutedExperts, *, kernels: str = "xla", last_only: bool = False,
               fresh: bool = False, num_valid: jax.Array | None = None,
               sow_router_logits: bool = False, snapshot_at: jax.Array | None = None,
               active: jax.Array | None = None, keep_hidden: bool = False):
    """tokens, positions [B, T] -> (new state, experts, logits [B, T or 1, V] float32).

    ``experts`` serves every MoE layer's routed experts (``ftjax.model.moe``) and comes back
    as the last layer left it. ``kernels`` (static) chooses the dense host work ("xla",
    "ffi", "ffi_bf16", "ffi_int8"). ``fresh`` (static) promises an empty state (``length == 0``), as in
    a prefill. ``num_valid`` (an int32 scalar, may be traced) says that only the first
    ``num_valid`` tokens are real and the rest padding (a prompt padded to a length bucket):
    padding gets no expert route, does not count in the new length, and with ``last_only``
    the logits are those of the last real token. ``sow_router_logits`` sows each layer's
    router logits (``nnx.capture``, training). ``snapshot_at`` (int32 [A] positions in
    [0, T]) adds a fourth result: per layer, the recurrent state after each position's first
    tokens (a ``LinearState`` with a leading [A] axis; None for attention layers).
    ``keep_hidden`` (static) adds a last result: the hidden states of every position before
    the final norm, [B, T, D], which ``head`` turns into logits (a prompt's log-probs).

    A batch of sequences at their own lengths (``state.length`` int32 [B]) steps one token
    each: ``active`` (bool [B]) marks the sequences that read theirs; the others' states,
    lengths and expert routes are left alone (a batched decode step with idle rows)."""
    new_state, experts, x, snapshots = self._decoder(
        state, tokens, positions, experts, kernels=kernels, fresh=fresh, num_valid=num_valid,
        sow_router_logits=sow_router_logits, snapshot_at=snapshot_at, active=active)
    hidden = x
    if last_only:
      if num_valid is None:
        x = x[:, -1:]
      else:
        x = jax.lax.dynamic_slice_in_dim(x, jnp.maximum(num_valid - 1, 0), 1, axis=1)
    logits = self.head(x, kernels=kernels)  # [B, T, V]
    outs = (new_state, experts, logits)
    if snapshot_at is not None:
      outs += (snapshots,)
    if keep_hidden:
      outs += (hidden,)
    return outs

  def head(self, x: jax.Array, *, kernels: str) -> jax.Array:
    """The logits [..., V] float32 of hidden states ``x`` [B, T, D] before the final norm."""
    return self.lm_head(self.final_norm(x), kernels=kernels)

  def hidden_and_logits(self, state: DecodeState, tokens: jax.Array, positions: jax.Array,
                        experts: RoutedExperts, *, kernels: str = "xla", fresh: bool = False,
                        snapshot_at: jax.Array | None = None):
    """tokens, positions [B, T] -> (new state, experts, hidden [B, T, D] after the final norm,
    logits [B, T, V] float32, snapshots): the forward whose hidden states seed the MTP head
    (``mtp_step``). ``snapshot_at`` as for ``__call__`` (a speculative verify step keeps the
    recurrent states after each of its tokens); snapshots are () without it."""
    new_state, experts, x, snapshots = self._decoder(state, tokens, positions, experts,
                                                     kernels=kernels, fresh=fresh,
                                                     snapshot_at=snapshot_at)
    hidden = self.final_norm(x)
    return new_state, experts, hidden, self.lm_head(hidden, kernels=kernels), snapshots

  def _decoder(self, state, tokens, positions, experts, *, kernels, fresh, num_valid=None,
               sow_router_logits=False, snapshot_at=None, active=None):
    """The embedding and the decoder layers: (new state, experts, x [B, T, D] before the
    final norm, per-layer snapshots or ())."""
    t = tokens.shape[1]
    if jnp.ndim(state.length) and t != 1:
      raise ValueError(f"a state with one length per sequence steps one token each, got {t}")
    x = embed_rows(self.embed_vd, tokens)  # [B, T, D]
    valid = None
    if num_valid is not None:
      valid = jnp.broadcast_to(jnp.arange(t) < num_valid, tokens.shape)  # [B, T]
    if active is not None:
      valid = jnp.broadcast_to(active[:, None], tokens.shape)
    caches, snapshots = [], []
    for i, layer in enumerate(self.layers):
      if getattr(experts, "prefetches", False) and not layer.dense_mlp:
        # Router-ahead: this layer's router on the residual entering it (before its mixer)
        # names the experts its MoE will likely route, so that their fills start now.
        experts = experts.ahead(layer.moe.predict(layer.mlp_norm(x), kernels=kernels,
                                                  valid=valid), self.bank_layers[i])
      outs = layer(x, state.layers[i], state.length, positions, self.bank_layers[i], experts,
                   kernels=kernels,
                   fresh=fresh, valid=valid, num_valid=num_valid,
                   sow_router_logits=sow_router_logits, snapshot_at=snapshot_at,
                   active=active)
      cache, experts, x = outs[:3]
      caches.append(cache)
      if snapshot_at is not None:
        snapshots.append(outs[3])
    added = t if num_valid is None else num_valid
    if active is not None:
      added = jnp.where(active, added, 0).astype(state.length.dtype)
    new_state = state.replace(layers=tuple(caches), length=state.length + added)
    return new_state, experts, x, tuple(snapshots)


def param_name(path: tuple) -> str:
  """The FTW name of a parameter path: ``("layers", 0, "attn", "w_q_had")`` ->
  ``layers.0.attn.w_q_had``."""
  return ".".join(str(p) for p in path)


class _OneKey:
  """An ``nnx.Rngs`` stand-in for building a model's structure only: ``params()`` is always
  the same key and no counter is kept. Under ``nnx.eval_shape`` each draw of a real
  ``nnx.Rngs`` stores its traced counter, and JAX 0.10 looks up that tracer's sharding on
  each store, walking the whole jaxpr traced so far: quadratic in the parameters, 2.2 s of a
  load of the 40-layer paper model (0.03 s with this)."""

  def params(self) -> jax.Array:
    return jax.random.key(0)


def abstract_model(config: ModelConfig, dtype=jnp.float32) -> Transformer:
  """The model's structure with abstract parameters (``jax.ShapeDtypeStruct``s): nothing is
  allocated or drawn."""
  return nnx.eval_shape(lambda: Transformer(config, rngs=_OneKey(), dtype=dtype))


def abstract_params(config: ModelConfig, dtype=jnp.float32) -> dict[str, jax.ShapeDtypeStruct]:
  """Parameter name (``layers.0.attn.w_q_had``) -> abstract array, without allocating."""
  _, state = nnx.split(abstract_model(config, dtype))
  return {param_name(path): var.get_value() for path, var in nnx.to_flat_state(state)}
