"""The device expert cache: state, policies, and the offloaded MoE layer.

* ``ExpertCache`` (``state.py``): N slots shared by all layers plus the tables that map
  (layer, expert) <-> slot and the recency stamps; an immutable pytree.
* ``PolicyConfig``, ``POLICIES``, ``get_policy`` (``policy.py``): policies as data (fill
  rule, replacement, preload), registered by name.
* ``plan`` (``policy.py``): for one layer-step, which routes the cache serves, which misses
  are filled (and into which slots), which run on the host. Pure, static shapes, usable in
  ``jit`` and ``lax.scan``; every policy shares one mechanism and one ``Plan`` format.
* ``prefetch`` (``policy.py``): fills predicted experts of the next layer-step ahead of it,
  with the policy's victims, marked until used (``Plan.prefetch_used``) or evicted unused.
* ``offloaded_moe`` (``moe.py``): the public layer function JAX users call in their own
  models: ``(new_cache, y, plan)``; ``CachedExperts`` is it as the model's routed-experts
  function, ``StepStats`` its per-layer counts.
* ``streaming.py``: when a prefill's layer-step streams its whole layer to the device: the
  host/DMA contention formula (``host_read_time``), one layer-step's cost
  (``prefill_layer_times``) and the threshold the engine takes from it.

Imports run ``cache -> experts -> kernels``; the cache never imports the model.
"""

from ftjax.cache.moe import CachedExperts, StepStats, fill_slots, offloaded_moe
from ftjax.cache.policy import (POLICIES, Plan, PolicyConfig, PrefetchPlan, fill_count,
                                get_policy, plan, prefetch)
from ftjax.cache.state import ExpertCache

__all__ = ["CachedExperts", "ExpertCache", "Plan", "PolicyConfig", "POLICIES", "StepStats",
           "PrefetchPlan", "fill_count", "fill_slots", "get_policy", "offloaded_moe", "plan",
           "prefetch"]
