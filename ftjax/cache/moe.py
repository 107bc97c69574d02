"""The offloaded MoE layer: routed experts served from the device cache and the host pool.

``offloaded_moe`` is a public, pure function that JAX users call inside their own jitted
models (see ``docs/cache.md``)::

  new_cache, y, plan = offloaded_moe(x, weights, ids, cache, bank, layer,
                                     bandwidths=jnp.array([B_P, B_H]),
                                     policy=PolicyConfig("freetoken"), ffn_dim=F)

For one layer-step it plans (``ftjax.cache.policy.plan``), copies the fills from the host
bank into their slots, computes the device routes (hits and fills) from the slots and the
host routes from the bank, and adds the two partial sums: the result equals the dense MoE
output for every policy and cache size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ftjax.cache.policy import Plan, PolicyConfig, plan
from ftjax.cache.state import ExpertCache
from ftjax.model.moe import routed_experts


@struct.dataclass
class StepStats:
  """Per layer of the last step: distinct experts hit, filled, and run on the host."""
  hits: jax.Array  # [L] int32
  fills: jax.Array  # [L] int32 (q)
  host: jax.Array  # [L] int32 (m - q)

  @classmethod
  def zeros(cls, num_layers: int) -> "StepStats":
    # Three distinct buffers: the state is donated, and one buffer cannot be donated twice.
    return cls(*(jnp.zeros((num_layers,), jnp.int32) for _ in range(3)))

  def record(self, layer, p: Plan) -> "StepStats":
    return StepStats(hits=self.hits.at[layer].set(p.hits), fills=self.fills.at[layer].set(p.fills),
                     host=self.host.at[layer].set(p.host))


@struct.dataclass
class RoutingRecord:
  """The router's output of one step, per layer: ids and weights [L, tokens, K]."""
  ids: jax.Array
  weights: jax.Array

  @classmethod
  def zeros(cls, num_layers: int, tokens: int, top_k: int) -> "RoutingRecord":
    return cls(ids=jnp.full((num_layers, tokens, top_k), -1, jnp.int32),
               weights=jnp.zeros((num_layers, tokens, top_k), jnp.float32))

  def record(self, layer, ids, weights) -> "RoutingRecord":
    return RoutingRecord(ids=self.ids.at[layer].set(ids), weights=self.weights.at[layer].set(
        weights.astype(jnp.float32)))


@struct.dataclass
class ExpertRunner:
  """How a model's MoE layers get their routed experts, threaded through one step.

  Without a cache, every routed expert runs from the host bank (the reference path). With
  one, each layer-step is planned by ``policy`` and split between slots and the bank.
  """
  bank: jax.Array  # [L, E, P] host pool
  cache: ExpertCache | None = None
  bandwidths: jax.Array | None = None  # [2] float32: B_P, B_H in GB/s
  stats: StepStats | None = None
  routing: RoutingRecord | None = None  # filled when the step records routing (traces)
  impl: str = struct.field(pytree_node=False, default="xla")
  policy: PolicyConfig | None = struct.field(pytree_node=False, default=None)

  def __call__(self, x, weights, ids, layer: int, *, ffn_dim: int
               ) -> tuple["ExpertRunner", jax.Array]:
    if self.routing is not None:
      self = self.replace(routing=self.routing.record(layer, ids, weights))  # noqa: PLW0642
    if self.cache is None:
      return self, routed_experts(x, ids, weights, self.bank, layer, ffn_dim=ffn_dim,
                                  impl=self.impl)
    cache, y, p = offloaded_moe(x, weights, ids, self.cache, self.bank, layer,
                                bandwidths=self.bandwidths, policy=self.policy, ffn_dim=ffn_dim,
                                impl=self.impl)
    return self.replace(cache=cache, stats=self.stats.record(layer, p)), y


def fill_slots(slots: jax.Array, bank: jax.Array, layer, fill_expert: jax.Array,
               fill_slot: jax.Array, *, impl: str = "xla") -> jax.Array:
  """Copies bank[layer, fill_expert[i]] into slots[fill_slot[i]] (rows with -1 skipped).

  In place when ``slots`` is donated by the caller's jit.
  """
  if fill_expert.shape[0] == 0:
    return slots
  if impl in ("ffi", "ffi_bf16"):
    from ftjax.kernels import slot_fill  # noqa: PLC0415
    src = jnp.stack([jnp.full_like(fill_expert, layer), jnp.maximum(fill_expert, 0)], axis=1)
    return slot_fill(slots, bank, src, fill_slot)
  blocks = bank[layer][jnp.maximum(fill_expert, 0)]  # [Q, P]
  return slots.at[jnp.where(fill_slot >= 0, fill_slot, slots.shape[0])].set(blocks, mode="drop")


def offloaded_moe(x: jax.Array, weights: jax.Array, ids: jax.Array, cache: ExpertCache,
                  bank: jax.Array, layer, *, bandwidths: jax.Array, policy: PolicyConfig,
                  ffn_dim: int, impl: str = "xla") -> tuple[ExpertCache, jax.Array, Plan]:
  """Routed-expert output for x [T, D] with router output ``weights``/``ids`` [T, K].

  Returns ``(new_cache, y [T, D] float32, plan)``; ``plan`` carries the step's statistics.
  """
  cache, p = plan(cache, layer, ids, bandwidths, policy)
  on_device = p.route_slot >= 0
  slots = fill_slots(cache.slots, bank, layer, p.fill_expert, p.fill_slot, impl=impl)
  y = jnp.zeros(x.shape, jnp.float32)
  if cache.capacity:
    y = y + routed_experts(x, p.route_slot, jnp.where(on_device, weights, 0.0), slots[None], 0,
                           ffn_dim=ffn_dim, impl=impl)
  host_ids = jnp.where(on_device, -1, ids)
  y = y + routed_experts(x, host_ids, jnp.where(on_device, 0.0, weights), bank, layer,
                         ffn_dim=ffn_dim, impl=impl)
  return cache.replace(slots=slots), y, p
