"""The offloaded MoE layer: routed experts served from the device cache and the host pool.

``offloaded_moe`` is a public, pure function that JAX users call inside their own jitted
models (see ``docs/cache.md``)::

  new_cache, y, plan = offloaded_moe(x, weights, ids, cache, bank, layer,
                                     bandwidths=jnp.array([B_P, B_H]),
                                     policy=get_policy("freetoken"), ffn_dim=F)

For one layer-step it plans (``ftjax.cache.policy.plan``), copies the fills from the host
bank into their slots, computes the device routes (hits and fills) from the slots and the
host routes from the bank, and adds the two partial sums: ``y`` equals the dense MoE output
for every policy and cache size.

``CachedExperts`` wraps it as the model's routed-experts function
(``ftjax.model.moe.RoutedExperts``): it carries the cache through a step and records each
layer's counts in ``StepStats``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ftjax.cache.policy import Plan, PolicyConfig, plan
from ftjax.cache.state import ExpertCache
from ftjax.experts import routed_experts
from ftjax.kernels import slot_fill
from ftjax.utils.arrays import take


@struct.dataclass
class StepStats:
  """Per layer of one step: distinct experts hit, filled, and run on the host."""
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


def fill_slots(slots: jax.Array, bank: jax.Array, layer, fill_expert: jax.Array,
               fill_slot: jax.Array, *, impl: str = "xla") -> jax.Array:
  """Copies bank[layer, fill_expert[i]] into slots[fill_slot[i]] (rows with -1 skipped).

  In place when ``slots`` is donated by the caller's jit.
  """
  if fill_expert.shape[0] == 0:
    return slots
  if impl in ("ffi", "ffi_bf16"):
    src = jnp.stack([jnp.full_like(fill_expert, layer), jnp.maximum(fill_expert, 0)], axis=1)
    return slot_fill(slots, bank, src, fill_slot)
  blocks = take(bank[layer], jnp.maximum(fill_expert, 0))  # [Q, P]
  return slots.at[jnp.where(fill_slot >= 0, fill_slot, slots.shape[0])].set(blocks, mode="drop")


def offloaded_moe(x: jax.Array, weights: jax.Array, ids: jax.Array, cache: ExpertCache,
                  bank: jax.Array, layer, *, bandwidths: jax.Array, policy: PolicyConfig,
                  ffn_dim: int, impl: str = "xla") -> tuple[ExpertCache, jax.Array, Plan]:
  """Routed-expert output for x [T, D] with router output ``weights``/``ids`` [T, K].

  Args:
    x: [T, D] float32 tokens; weights [T, K] float32, ids [T, K] int32 (-1 = no route).
    cache: the expert cache (donate it in the caller's jit so fills are in place).
    bank: [L, E, P] the host pool; layer: this layer's index into it (may be traced).
    bandwidths: [2] float32 (B_P, B_H) in GB/s, read by the q* fill rule.
    policy: a ``PolicyConfig`` (``get_policy(name)``); static.
    ffn_dim: F; impl: "xla", "ffi" or "ffi_bf16" (the host kernels), static.

  Returns:
    ``(new_cache, y, plan)``: the cache after this layer-step (plan applied, fills copied
    into their slots), ``y`` [T, D] float32 (equal to the dense MoE output), and the
    layer-step's ``Plan`` (routes, fills, and the counts ``hits``, ``fills``, ``host``).
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


@struct.dataclass
class CachedExperts:
  """The model's routed-experts function with an expert cache (``ftjax.model.moe``).

  Each layer-step runs ``offloaded_moe``: planned by ``policy``, split between the slots and
  the host pool. Carries the cache through the step; ``stats`` holds each layer's counts.
  """
  bank: jax.Array  # [L, E, P] host pool
  cache: ExpertCache
  bandwidths: jax.Array  # [2] float32: B_P, B_H in GB/s
  stats: StepStats
  ffn_dim: int = struct.field(pytree_node=False)
  policy: PolicyConfig = struct.field(pytree_node=False)
  kernels: str = struct.field(pytree_node=False, default="xla")

  def __call__(self, x, weights, ids, layer: int) -> tuple["CachedExperts", jax.Array]:
    cache, y, p = offloaded_moe(x, weights, ids, self.cache, self.bank, layer,
                                bandwidths=self.bandwidths, policy=self.policy,
                                ffn_dim=self.ffn_dim, impl=self.kernels)
    return self.replace(cache=cache, stats=self.stats.record(layer, p)), y
