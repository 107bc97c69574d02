"""Routers: router logits -> (weights [.., K], expert ids [.., K]).

Each family's router exactly as the family defines it, selected by a named option:

* ``softmax_topk``: softmax over all experts in float32, then the top-k probabilities;
  renormalised to sum to one when ``norm_topk_prob`` (Qwen3-MoE, Qwen2-MoE, OLMoE; Mixtral
  always renormalises).
* ``topk_softmax``: top-k of the raw logits, then a softmax over those k (gpt-oss).

Ties in ``lax.top_k`` go to the lower expert id, as in ``torch.topk`` on CPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def route(logits: jax.Array, *, kind: str, top_k: int, norm_topk_prob: bool
          ) -> tuple[jax.Array, jax.Array]:
  """Returns ``(weights, ids)``, both ``[..., K]``; weights float32, ids int32."""
  logits = logits.astype(jnp.float32)
  if kind == "softmax_topk":
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if norm_topk_prob:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  elif kind == "topk_softmax":
    top_logits, ids = jax.lax.top_k(logits, top_k)
    weights = jax.nn.softmax(top_logits, axis=-1)
  else:
    raise ValueError(f"unknown router kind {kind!r}; expected softmax_topk or topk_softmax")
  return weights, ids.astype(jnp.int32)
