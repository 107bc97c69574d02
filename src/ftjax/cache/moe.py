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

Where the pool lives and how the two host-side paths run is the static ``Offload``: by default
the step's kernels do both (the CPU backend, where "device" memory is host memory too); with
the pool in ``pinned_host`` memory fills are in-program slices that XLA turns into
host-to-device copies; on a GPU the CUDA ops of ``ftjax.kernels.cuda`` fill from and run host
experts on a registered pool (DESIGN section 10).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from ftjax.cache.policy import Plan, PolicyConfig, PrefetchPlan, plan, prefetch
from ftjax.cache.state import ExpertCache
from ftjax.cache.streaming import prefill_layer_times, stream_costs, worth_streaming
from ftjax.experts import SWIGLU, ExpertVariant, routed_experts
from ftjax.kernels import slot_fill
from ftjax.kernels.cuda import PoolSpec, host_experts_done, host_experts_start, pool_fill
from ftjax.kernels.cuda import fetch_layer_done as fetch_layer_done_cuda
from ftjax.kernels.cuda import fetch_layer_start as fetch_layer_start_cuda
from ftjax.utils.arrays import take

FILLS = ("kernels", "slices", "cuda")
HOSTS = ("kernels", "cuda")
STREAMS = ("never", "always", "cost")


@dataclasses.dataclass(frozen=True)
class Offload:
  """Where the host pool lives and how fills and host experts run (static, hashable).

  fill:
    ``kernels``: by the step's kernels (the FFI slot fill, or an XLA scatter), the pool an
      ordinary array (the CPU backend);
    ``slices``: the pool is a ``pinned_host`` array and each planned fill is a dynamic slice of
      it moved to device memory inside the program, masked by the plan (a static number of
      them: a gather across memory spaces does not lower, and a scatter into ``pinned_host``
      fails on CUDA); on a GPU XLA runs them as asynchronous host-to-device copies;
    ``cuda``: the CUDA copy kernel reading the registered pool (``pool``).
  host:
    ``kernels``: host routes by the step's kernels on the pool in place (the CPU backend);
    ``cuda``: the CUDA start/done pair on the registered pool, overlapped with the device's
      hit and fill work.
  pool: the registered pool (``ftjax.kernels.cuda.register_pool``) for the CUDA paths.
  stream: whether a layer-step moves its whole layer [E, P] to the device (one transfer by
    the ``fill`` mechanism) and computes every route from it; the plan is made and its fills
    copied from the streamed layer as usual, so the cache ends as warm as the sparse step
    leaves it (DESIGN section 4). ``never``; ``always`` (every layer-step of the program,
    each layer's transfer started during the previous layer-step: double buffering); or
    ``cost``: each layer-step streams when the cost model (``prefill_layer_times`` in
    ``ftjax.cache.streaming``) makes streaming its layer cheaper than the sparse step, see
    ``CachedExperts``. The engine sets it per program (prompt length). ``True``/``False``
    mean ``always``/``never``.
  host_gflops: the host expert kernel's grouped rate (1e9 FLOP/s, a multiply-add being two),
    which ``cost`` weighs (``python -m ftjax.profile`` measures it).
  """
  fill: str = "kernels"
  host: str = "kernels"
  pool: PoolSpec | None = None
  stream: str = "never"  # whole layers to the device (prefills): see ``offloaded_moe``
  host_gflops: float = 0.0
  # Expert-parallel slots: the slot buffer is split along N over this one-axis mesh (one
  # contiguous block of slots per device); see ``offloaded_moe``.
  mesh: Mesh | None = None

  def __post_init__(self):
    if isinstance(self.stream, bool):
      object.__setattr__(self, "stream", "always" if self.stream else "never")
    if self.stream not in STREAMS:
      raise ValueError(f"stream must be one of {STREAMS}, got {self.stream!r}")
    if self.stream == "cost" and not self.host_gflops > 0:
      raise ValueError("stream='cost' weighs the host kernel's compute: give host_gflops > 0 "
                       "(the grouped rate that python -m ftjax.profile measures)")
    if self.fill not in FILLS:
      raise ValueError(f"fill must be one of {FILLS}, got {self.fill!r}")
    if self.host not in HOSTS:
      raise ValueError(f"host must be one of {HOSTS}, got {self.host!r}")
    if "cuda" in (self.fill, self.host) and self.pool is None:
      raise ValueError("the CUDA fill and host paths need a registered pool (pool=)")
    if self.mesh is not None and self.stream != "never":
      raise ValueError("expert-parallel slots (mesh=) do not stream whole layers: each device "
                       "would fetch the layer for routes it does not hold")


@struct.dataclass
class Inflight:
  """A whole layer on its way to the device: a streamed prefill's prefetch of the next layer."""
  layer: int = struct.field(pytree_node=False)
  block: jax.Array  # [E, P]: the layer, or (CUDA) the buffer its copy is landing in
  # stream="cost": [] bool, whether the transfer was started (``block`` is zeros otherwise).
  started: jax.Array | None = None


def fetch_layer_start(bank: jax.Array, layer: int, offload: Offload) -> Inflight:
  """Starts moving the whole layer ``bank[layer]`` [E, P] to device memory by
  ``offload.fill``'s mechanism: a slice of the pool (``kernels``), one host-to-device slice of
  a pinned_host pool (``slices``: XLA runs it as an asynchronous copy), or a copy-engine
  transfer of the registered pool on a side stream (``cuda``)."""
  if offload.fill == "cuda":
    return Inflight(layer, fetch_layer_start_cuda(pool=offload.pool, layer=layer))
  if offload.fill == "slices":
    bits = jnp.dtype(f"uint{8 * bank.dtype.itemsize}")
    block = jax.lax.dynamic_index_in_dim(bank, jnp.asarray(layer, jnp.int32), 0, keepdims=False)
    block = jax.device_put(jax.lax.bitcast_convert_type(block, bits), jax.memory.Space.Device)
    return Inflight(layer, jax.lax.bitcast_convert_type(block, bank.dtype))
  return Inflight(layer, bank[layer])


def fetch_layer_done(inflight: Inflight, offload: Offload) -> jax.Array:
  """The layer of ``fetch_layer_start``, landed (CUDA: the compute stream waits for it)."""
  if offload.fill == "cuda":
    return fetch_layer_done_cuda(inflight.block)
  return inflight.block


def fetch_layer(bank: jax.Array, layer: int, offload: Offload) -> jax.Array:
  """The whole layer ``bank[layer]`` [E, P] in device memory (start and done at once)."""
  return fetch_layer_done(fetch_layer_start(bank, layer, offload), offload)


DEFAULT_OFFLOAD = Offload()


@struct.dataclass
class StepStats:
  """Per layer of one step: distinct experts hit, filled, and run on the host."""
  hits: jax.Array  # [L] int32
  fills: jax.Array  # [L] int32 (q)
  host: jax.Array  # [L] int32 (m - q)
  # [L] int32: 1 where the layer-step streamed its whole layer to the device (prefill): its
  # ``host`` misses then ran on the device from the streamed layer, not on the host.
  streamed: jax.Array
  # [L] int32: routes (token, expert pairs) served by the plan's ``host`` experts; on a
  # streamed layer-step they ran on the device too.
  host_routes: jax.Array
  # [L] int32: router-ahead prefetch (``CachedExperts.ahead``): experts prefetched for the
  # layer-step, hits on prefetched slots (their first use), prefetched slots evicted unused.
  prefetched: jax.Array
  prefetch_used: jax.Array
  prefetch_wasted: jax.Array

  @classmethod
  def zeros(cls, num_layers: int, steps: tuple[int, ...] = ()) -> "StepStats":
    # Distinct buffers: the state is donated, and one buffer cannot be donated twice.
    return cls(*(jnp.zeros((*steps, num_layers), jnp.int32) for _ in range(8)))

  def record(self, layer, p: Plan, streamed=False, host_routes=0) -> "StepStats":
    return self.replace(hits=self.hits.at[layer].set(p.hits),
                        fills=self.fills.at[layer].set(p.fills),
                        host=self.host.at[layer].set(p.host),
                        streamed=self.streamed.at[layer].set(jnp.asarray(streamed, jnp.int32)),
                        host_routes=self.host_routes.at[layer].set(host_routes),
                        prefetch_used=self.prefetch_used.at[layer].set(p.prefetch_used),
                        prefetch_wasted=self.prefetch_wasted.at[layer].add(p.prefetch_wasted))

  def record_prefetch(self, layer, p: PrefetchPlan) -> "StepStats":
    return self.replace(prefetched=self.prefetched.at[layer].set(p.count),
                        prefetch_wasted=self.prefetch_wasted.at[layer].add(p.wasted))


def host_route_count(p: Plan, ids: jax.Array) -> jax.Array:
  """[] int32: the routes of ``ids [T, K]`` that ``p`` sends to the host."""
  return jnp.sum((ids >= 0) & (p.route_slot < 0)).astype(jnp.int32)


def _fill_by_slices(slots, bank, layer, fill_expert, fill_slot):
  """One masked dynamic slice per plan row: pinned_host block -> device -> its slot.

  The copies and the mask work on the blocks' bits as unsigned integers: on bfloat16, XLA:CPU
  widens a select's operands to float32, and the widening of the whole bank is then hoisted
  out of the decode loop (a full-pool convert per program)."""
  width = slots.shape[1]
  bits = jnp.dtype(f"uint{8 * slots.dtype.itemsize}")
  out = jax.lax.bitcast_convert_type(slots, bits)
  for i in range(fill_expert.shape[0]):
    active = fill_slot[i] >= 0
    dst = jnp.maximum(fill_slot[i], 0)
    block = jax.lax.dynamic_slice(bank, (jnp.asarray(layer, jnp.int32),
                                         jnp.maximum(fill_expert[i], 0), jnp.int32(0)),
                                  (1, 1, width)).reshape(1, width)
    block = jax.device_put(jax.lax.bitcast_convert_type(block, bits), jax.memory.Space.Device)
    current = jax.lax.dynamic_slice(out, (dst, jnp.int32(0)), (1, width))
    out = jax.lax.dynamic_update_slice(out, jnp.where(active, block, current),
                                       (dst, jnp.int32(0)))
  return jax.lax.bitcast_convert_type(out, slots.dtype)


def fill_slots(slots: jax.Array, bank: jax.Array, layer, fill_expert: jax.Array,
               fill_slot: jax.Array, *, kernels: str = "xla",
               offload: Offload = DEFAULT_OFFLOAD) -> jax.Array:
  """Copies bank[layer, fill_expert[i]] into slots[fill_slot[i]] (rows with -1 skipped).

  In place when ``slots`` is donated by the caller's jit. ``offload.fill`` chooses the copy
  (see ``Offload``); with ``kernels`` it follows ``kernels=``: the FFI slot fill for the host
  kernels (``ffi*``), else an XLA scatter.
  """
  if fill_expert.shape[0] == 0:
    return slots
  if offload.fill == "slices":
    return _fill_by_slices(slots, bank, layer, fill_expert, fill_slot)
  if offload.fill == "cuda":
    src = jnp.stack([jnp.full_like(fill_expert, layer), jnp.maximum(fill_expert, 0)], axis=1)
    return pool_fill(slots, src, fill_slot, pool=offload.pool)
  if kernels in ("ffi", "ffi_bf16", "ffi_int8"):
    src = jnp.stack([jnp.full_like(fill_expert, layer), jnp.maximum(fill_expert, 0)], axis=1)
    return slot_fill(slots, bank, src, fill_slot)
  blocks = take(bank[layer], jnp.maximum(fill_expert, 0))  # [Q, P]
  return slots.at[jnp.where(fill_slot >= 0, fill_slot, slots.shape[0])].set(blocks, mode="drop")


def offloaded_moe(x: jax.Array, weights: jax.Array, ids: jax.Array, cache: ExpertCache,
                  bank: jax.Array, layer, *, bandwidths: jax.Array, policy: PolicyConfig,
                  ffn_dim: int, kernels: str = "xla", offload: Offload = DEFAULT_OFFLOAD,
                  layer_block: jax.Array | None = None, variant: ExpertVariant = SWIGLU
                  ) -> tuple[ExpertCache, jax.Array, Plan]:
  """Routed-expert output for x [T, D] with router output ``weights``/``ids`` [T, K].

  Args:
    x: [T, D] float32 tokens; weights [T, K] float32, ids [T, K] int32 (-1 = no route).
    cache: the expert cache (donate it in the caller's jit so fills are in place).
    bank: [L, E, P] the host pool; layer: this layer's index into it (may be traced).
    bandwidths: [2] float32 (B_P, B_H) in GB/s, read by the q* fill rule.
    policy: a ``PolicyConfig`` (``get_policy(name)``); static.
    ffn_dim: F; kernels: "xla", or "ffi", "ffi_bf16" or "ffi_int8" (the host kernels), static.
    offload: where the pool lives and how fills and host routes run (``Offload``), static.
      With ``stream="cost"`` the layer-step streams when ``prefill_layer_times`` of its own
      plan says so (``CachedExperts`` also starts the next layer early).
    layer_block: with ``offload.stream="always"``, this layer [E, P] already on the device
      (a prefetch, see ``CachedExperts``); fetched here when None.
    variant: the experts' activation and biases (``ftjax.experts.ExpertVariant``), static;
      every path (slots, host pool, streamed layer) computes the same function.

  Returns:
    ``(new_cache, y, plan)``: the cache after this layer-step (plan applied, fills copied
    into their slots), ``y`` [T, D] float32 (equal to the dense MoE output), and the
    layer-step's ``Plan`` (routes, fills, and the counts ``hits``, ``fills``, ``host``).
  """
  cache, p = plan(cache, layer, ids, bandwidths, policy)
  if offload.mesh is not None:
    return _expert_parallel(x, weights, ids, cache, bank, layer, p, ffn_dim, kernels, offload,
                            variant)
  stream = offload.stream != "never"
  if offload.stream == "cost":
    stream = worth_streaming(p, host_route_count(p, ids), bandwidths,
                             **_stream_costs(bank, offload, ffn_dim, x.shape[-1]))
  slots, y = execute_plan(x, weights, ids, cache.slots, bank, layer, p, stream=stream,
                          ffn_dim=ffn_dim, kernels=kernels, offload=offload,
                          layer_block=layer_block, variant=variant)
  return cache.replace(slots=slots), y, p


def _pool_layout(bank, offload: Offload) -> tuple[tuple[int, int, int], jnp.dtype]:
  """The pool's [L, E, P] and dtype: the bank's, or (a registered pool, no operand) its spec's."""
  if bank is None:
    return tuple(offload.pool.shape), jnp.dtype(offload.pool.dtype)
  return tuple(bank.shape), bank.dtype


def _stream_costs(bank, offload: Offload, ffn_dim: int, width: int) -> dict:
  """``stream_costs`` (``prefill_layer_times``'s shape arguments) for this pool and model."""
  return stream_costs(*_pool_layout(bank, offload), ffn_dim=ffn_dim, width=width,
                      host_gflops=offload.host_gflops)


def execute_plan(x, weights, ids, slots, bank, layer, p: Plan, *, stream, ffn_dim: int,
                 kernels: str, offload: Offload, layer_block: jax.Array | None = None,
                 variant: ExpertVariant = SWIGLU):
  """Runs a planned layer-step: ``(slots, y)``. ``stream`` (a Python bool, or a traced []
  bool choosing between the two at run time) computes every route from the whole layer
  (``layer_block`` when it is already on the device, else fetched here) instead of from the
  slots and the host pool; either way the plan's fills land in their slots."""
  if isinstance(stream, bool):
    run = _streamed_step if stream else _sparse_step
    return run(x, weights, ids, slots, bank, layer, p, ffn_dim, kernels, offload, layer_block,
               variant)
  operands = (x, weights, ids, slots, p)

  def branch(run):
    return lambda x, weights, ids, slots, p: run(x, weights, ids, slots, bank, layer, p,
                                                  ffn_dim, kernels, offload, layer_block, variant)

  return jax.lax.cond(stream, branch(_streamed_step), branch(_sparse_step), *operands)


def _streamed_step(x, weights, ids, slots, bank, layer, p, ffn_dim, kernels, offload, layer_block,
                   variant):
  routed = functools.partial(routed_experts, ffn_dim=ffn_dim, kernels=kernels, variant=variant)
  if offload.fill == "kernels" and layer_block is None:
    # The pool is in memory the kernels read (the CPU backend): "moving the layer to the
    # device" moves nothing, so the routes run from the pool in place (same numbers).
    slots = fill_slots(slots, bank, layer, p.fill_expert, p.fill_slot, kernels=kernels)
    return slots, routed(x, ids, weights, bank, layer)
  if layer_block is None:
    layer_block = fetch_layer(bank, layer, offload)
  streamed = layer_block[None]  # [1, E, P] on the device
  slots = fill_slots(slots, streamed, 0, p.fill_expert, p.fill_slot, kernels=kernels)
  return slots, routed(x, ids, weights, streamed, 0)


def _sparse_step(x, weights, ids, slots, bank, layer, p, ffn_dim, kernels, offload, layer_block,
                 variant):
  routed = functools.partial(routed_experts, ffn_dim=ffn_dim, kernels=kernels, variant=variant)
  on_device = p.route_slot >= 0
  host_ids = jnp.where(on_device, -1, ids)
  host_weights = jnp.where(on_device, 0.0, weights)
  if offload.host == "cuda":
    # Posted before the device work: the routes consume the returned x, and the barrier ties
    # the slots to it too, so the fills are also scheduled after the post and the host kernel
    # runs while the device fills and computes its routes.
    ticket, x = host_experts_start(x, host_ids, host_weights, pool=offload.pool, layer=layer,
                                   ffn_dim=ffn_dim, bf16_activations=kernels == "ffi_bf16",
                                   variant=variant)
    slots, x = jax.lax.optimization_barrier((slots, x))
  slots = fill_slots(slots, bank, layer, p.fill_expert, p.fill_slot, kernels=kernels,
                     offload=offload)
  y = jnp.zeros(x.shape, jnp.float32)
  if slots.shape[0]:
    y = y + routed(x, p.route_slot, jnp.where(on_device, weights, 0.0), slots[None], 0)
  if offload.host == "cuda":
    y = host_experts_done(ticket, y)
  else:
    y = y + routed(x, host_ids, host_weights, bank, layer)
  return slots, y


def _expert_parallel(x, weights, ids, cache, bank, layer, p, ffn_dim, kernels, offload, variant):
  """The layer-step with the slot buffer split over ``offload.mesh``: each device fills the
  planned slots it holds (by the placement's fill) and computes the routes served by them; the
  host routes run once, posted by the first device; a ``psum`` adds the partial outputs. The
  plan and the cache's tables are computed identically on every device (replicated)."""
  (axis,) = offload.mesh.axis_names
  local_offload = dataclasses.replace(offload, mesh=None)
  routed = functools.partial(routed_experts, ffn_dim=ffn_dim, kernels=kernels, variant=variant)
  on_device = p.route_slot >= 0
  host_ids = jnp.where(on_device, -1, ids)
  host_weights = jnp.where(on_device, 0.0, weights)
  device_weights = jnp.where(on_device, weights, 0.0)

  def local(slots, x, route_slot, device_weights, host_ids, host_weights, fill_expert,
            fill_slot, *bank):
    bank = bank[0] if bank else None  # an operand, unless the pool is a registered one
    n = slots.shape[0]
    index = jax.lax.axis_index(axis)
    first = index * n
    host_ids = jnp.where(index == 0, host_ids, -1)
    if local_offload.host == "cuda":  # posted first, as in offloaded_moe
      ticket, x = host_experts_start(x, host_ids, host_weights, pool=local_offload.pool,
                                     layer=layer, ffn_dim=ffn_dim,
                                     bf16_activations=kernels == "ffi_bf16", variant=variant)
      slots, x = jax.lax.optimization_barrier((slots, x))
    mine = (fill_slot >= first) & (fill_slot < first + n)
    slots = fill_slots(slots, bank, layer, fill_expert, jnp.where(mine, fill_slot - first, -1),
                       kernels=kernels, offload=local_offload)
    y = jnp.zeros(x.shape, jnp.float32)
    if n:
      held = (route_slot >= first) & (route_slot < first + n)
      y = y + routed(x, jnp.where(held, route_slot - first, -1),
                     jnp.where(held, device_weights, 0.0), slots[None], 0)
    if local_offload.host == "cuda":
      y = host_experts_done(ticket, y)
    else:
      y = y + routed(x, host_ids, host_weights, bank, layer)
    return slots, jax.lax.psum(y, axis)

  operands = (cache.slots, x, p.route_slot, device_weights, host_ids, host_weights,
              p.fill_expert, p.fill_slot) + (() if bank is None else (bank,))
  sharded = jax.shard_map(local, mesh=offload.mesh,
                          in_specs=(P(axis),) + (P(),) * (len(operands) - 1),
                          out_specs=(P(axis), P()),
                          # The shared routed-expert code (a scan over experts) is written
                          # without varying-axis annotations; the psum makes y replicated.
                          check_vma=False)
  slots, y = sharded(*operands)
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
  offload: Offload = struct.field(pytree_node=False, default=DEFAULT_OFFLOAD)
  inflight: Inflight | None = None  # streamed prefill: the next layer, already on its way
  variant: ExpertVariant = struct.field(pytree_node=False, default=SWIGLU)
  # Layers a forward visits in order: a streamed prefill fetches layer l + 1 ahead only below
  # it (the MTP head's layers after the decoder's are not next). 0: all the cache's layers.
  pass_layers: int = struct.field(pytree_node=False, default=0)
  # Router-ahead prefetch: at most this many experts per layer-step, from the ids the model
  # predicts before the layer's mixer (``ahead``); 0: none.
  prefetch: int = struct.field(pytree_node=False, default=0)

  @property
  def prefetches(self) -> bool:
    """Whether the model should call ``ahead`` (the routed-experts protocol)."""
    return self.prefetch > 0

  def ahead(self, ids, layer: int) -> "CachedExperts":
    """Router-ahead prefetch: before ``layer``'s mixer runs, copies up to ``prefetch`` of the
    experts ``ids [T, K]`` predicts (tokens in order, each token's experts by rank) that no
    slot holds into slots (``ftjax.cache.policy.prefetch``: the policy's victims, never what
    the previous layer-step used). The copies are the plan's fill mechanism (``fill_slots``):
    on a GPU asynchronous host-to-device copies that XLA can overlap with the mixer; on the
    CPU backend a copy into the slot array. Outputs are unchanged; ``stats`` counts the
    prefetched experts and, at their layer-step, those used and those evicted unused."""
    cache, p = prefetch(self.cache, layer, ids.reshape(-1), self.prefetch, self.policy)
    slots = fill_slots(cache.slots, self.bank, layer, p.fill_expert[:self.prefetch],
                       p.fill_slot[:self.prefetch], kernels=self.kernels, offload=self.offload)
    return self.replace(cache=cache.replace(slots=slots),
                        stats=self.stats.record_prefetch(layer, p))

  def __call__(self, x, weights, ids, layer: int) -> tuple["CachedExperts", jax.Array]:
    if self.offload.stream == "cost":
      return self._chosen_step(x, weights, ids, layer)
    block, inflight = None, None
    if self.offload.stream == "always" and self.offload.fill != "kernels":
      # Double buffering: this layer was started by the previous layer-step (or starts now),
      # and the next layer starts before this one computes, so its transfer runs meanwhile.
      # (With the kernels' fill the pool is memory the kernels read in place: nothing moves.)
      current = self.inflight
      if current is None or current.layer != layer:
        current = fetch_layer_start(self.bank, layer, self.offload)
      if layer + 1 < (self.pass_layers or self.cache.num_layers):
        inflight = fetch_layer_start(self.bank, layer + 1, self.offload)
      block = fetch_layer_done(current, self.offload)
    cache, y, p = offloaded_moe(x, weights, ids, self.cache, self.bank, layer,
                                bandwidths=self.bandwidths, policy=self.policy,
                                ffn_dim=self.ffn_dim, kernels=self.kernels, offload=self.offload,
                                layer_block=block, variant=self.variant)
    return self.replace(cache=cache, stats=self.stats.record(
        layer, p, self.offload.stream == "always", host_route_count(p, ids)),
        inflight=inflight), y

  def _chosen_step(self, x, weights, ids, layer: int):
    """``stream="cost"``: each layer-step streams its layer or runs sparse, as the cost model
    (``prefill_layer_times``) finds cheaper.

    A layer whose transfer can start early is decided one layer ahead, so that it moves
    while the previous layer computes (double buffering): right after layer l's plan, layer
    l+1's counts are predicted from layer l's (its distinct experts, its split between fills
    and host, the routes per host expert) and layer l+1's share of experts in the cache:
    ``m = distinct_l · (1 − resident_{l+1} / E)`` misses. The first layer of a program, and
    every layer when the pool is read in place (the kernels' fill: nothing moves early), is
    decided on its own plan's counts. Either way ``StepStats.streamed`` records what ran.
    """
    o, bank = self.offload, self.bank
    costs = _stream_costs(bank, o, self.ffn_dim, x.shape[-1])
    cache, p = plan(self.cache, layer, ids, self.bandwidths, self.policy)
    routes = host_route_count(p, ids)
    block, inflight = None, None
    current = self.inflight
    if current is not None and current.layer == layer:
      stream = current.started
      block = jax.lax.cond(stream, lambda b: fetch_layer_done(Inflight(layer, b), o),
                           lambda b: b, current.block)
    else:
      stream = worth_streaming(p, routes, self.bandwidths, **costs)
    if o.fill != "kernels" and layer + 1 < (self.pass_layers or cache.num_layers):
      ahead = self._predict(p, ids, routes, cache, layer + 1, **costs)
      (_, experts, elems), dtype = _pool_layout(bank, o)
      started = jax.lax.cond(ahead, lambda: fetch_layer_start(bank, layer + 1, o).block,
                             lambda: jnp.zeros((experts, elems), dtype))
      inflight = Inflight(layer + 1, started, ahead)
    slots, y = execute_plan(x, weights, ids, cache.slots, bank, layer, p, stream=stream,
                            ffn_dim=self.ffn_dim, kernels=self.kernels, offload=o,
                            layer_block=block, variant=self.variant)
    return self.replace(cache=cache.replace(slots=slots),
                        stats=self.stats.record(layer, p, stream, routes), inflight=inflight), y

  def _predict(self, p: Plan, ids, routes, cache: ExpertCache, layer: int,
               **costs) -> jax.Array:
    """[] bool: ``_chosen_step``'s early choice for ``layer`` from the previous plan ``p``
    (``routes``: its host routes)."""
    f32 = jnp.float32
    num_experts = costs["experts"]
    distinct = (p.hits + p.fills + p.host).astype(f32)
    misses = p.misses.astype(f32)
    resident = jnp.sum(cache.slot_of[layer] >= 0).astype(f32)
    expect = distinct * (1.0 - resident / num_experts)
    b_p, b_h = self.bandwidths[0], self.bandwidths[1]
    fill_share = jnp.where(misses > 0, p.fills / jnp.maximum(misses, 1.0),
                           jnp.minimum(b_p / b_h, 1.0))  # no misses: the q* share
    # Routes per host expert as the previous layer's host experts had them (the policy fills
    # the most-routed misses first, so they take fewer routes than the average expert), or
    # the average over its distinct experts when it ran none on the host.
    host_prev = p.host.astype(f32)
    per_host = jnp.where(host_prev > 0, routes / jnp.maximum(host_prev, 1.0),
                         jnp.sum(ids >= 0).astype(f32) / jnp.maximum(distinct, 1.0))
    fills = expect * fill_share
    host = expect - fills
    sparse, streamed = prefill_layer_times(fills, host, host * per_host, b_p=b_p, b_h=b_h,
                                           **costs)
    return streamed < sparse
