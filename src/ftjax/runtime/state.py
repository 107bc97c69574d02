"""The engine's state: the model's decode state plus what the runtime adds around it.

``EngineState`` is what every compiled program takes (donated) and returns: the per-layer
decode state (``ftjax.model.DecodeState``, the model's), the expert cache and the bandwidths
its policy plans with. ``RoutingRecord`` and ``RecordingExperts`` capture the router's output
of a step when the engine records routing (traces); per-step cache counts come back as
``ftjax.cache.StepStats``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ftjax.cache import ExpertCache
from ftjax.model import DecodeState, RoutedExperts


@struct.dataclass
class EngineState:
  """Everything the engine threads through its programs (donated)."""
  decode: DecodeState
  cache: ExpertCache | None = None  # None: every routed expert runs from the host pool
  bandwidths: jax.Array | None = None  # [2] float32 (B_P, B_H) in GB/s, with a cache


@struct.dataclass
class RoutingRecord:
  """The router's output of one step, per layer: ids and weights [L, tokens, K]."""
  ids: jax.Array
  weights: jax.Array

  @classmethod
  def empty(cls, num_layers: int, tokens: int, top_k: int) -> "RoutingRecord":
    return cls(ids=jnp.full((num_layers, tokens, top_k), -1, jnp.int32),
               weights=jnp.zeros((num_layers, tokens, top_k), jnp.float32))

  def record(self, layer, ids, weights) -> "RoutingRecord":
    return RoutingRecord(ids=self.ids.at[layer].set(ids), weights=self.weights.at[layer].set(
        weights.astype(jnp.float32)))


@struct.dataclass
class RecordingExperts:
  """A routed-experts function that records the router's output, then delegates."""
  inner: RoutedExperts
  routing: RoutingRecord

  def __call__(self, x, weights, ids, layer: int) -> tuple["RecordingExperts", jax.Array]:
    routing = self.routing.record(layer, ids, weights)
    inner, y = self.inner(x, weights, ids, layer)
    return RecordingExperts(inner=inner, routing=routing), y

  @property
  def prefetches(self) -> bool:
    return getattr(self.inner, "prefetches", False)

  def ahead(self, ids, layer: int) -> "RecordingExperts":
    return RecordingExperts(inner=self.inner.ahead(ids, layer), routing=self.routing)
