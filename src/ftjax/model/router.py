"""Routers: router logits -> (weights [.., K], expert ids [.., K]).

Each family's router exactly as the family defines it, selected by a named option:

* ``softmax_topk``: softmax over all experts in float32, then the top-k probabilities;
  renormalised to sum to one when ``norm_topk_prob`` (Qwen3-MoE, Qwen2-MoE, OLMoE; Mixtral
  always renormalises).
* ``topk_softmax``: top-k of the raw logits, then a softmax over those k (gpt-oss).
* ``sigmoid_group``: sigmoid scores; experts are chosen on ``score + bias`` (a learned
  load-balancing correction) within the ``topk_group`` best of ``n_group`` groups (a group
  scores the sum of its two best biased scores); the weights are the unbiased scores of the
  chosen experts, renormalised when ``norm_topk_prob``, times ``scaling`` (DeepSeek-V3).

Ties in ``lax.top_k`` go to the lower expert id, as in ``torch.topk`` on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(logits: jax.Array, *, kind: str, top_k: int, norm_topk_prob: bool,
          bias: jax.Array | None = None, n_group: int = 1, topk_group: int = 1,
          scaling: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """Returns ``(weights, ids)``, both ``[..., K]``; weights float32, ids int32.

  ``bias``, ``n_group``, ``topk_group`` and ``scaling`` are used by ``sigmoid_group`` only.
  """
  logits = logits.astype(jnp.float32)
  if kind == "softmax_topk":
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  elif kind == "topk_softmax":
    top_logits, ids = jax.lax.top_k(logits, top_k)
    weights = jax.nn.softmax(top_logits, axis=-1)
  elif kind == "sigmoid_group":
    scores = jax.nn.sigmoid(logits)  # [..., E]
    biased = scores if bias is None else scores + bias.astype(jnp.float32)
    num_experts = logits.shape[-1]
    grouped = biased.reshape(*biased.shape[:-1], n_group, num_experts // n_group)
    group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [..., n_group]
    _, best_groups = jax.lax.top_k(group_score, topk_group)
    keep = jnp.any(best_groups[..., :, None] == jnp.arange(n_group), axis=-2)  # [..., n_group]
    keep = jnp.repeat(keep, num_experts // n_group, axis=-1)  # [..., E]
    _, ids = jax.lax.top_k(jnp.where(keep, biased, -jnp.inf), top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if norm_topk_prob:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights * scaling
  else:
    raise ValueError(f"unknown router kind {kind!r}; expected softmax_topk, topk_softmax or "
                     "sigmoid_group")
  return weights, ids.astype(jnp.int32)
