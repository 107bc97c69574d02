"""The device expert cache: state, policies, and the offloaded MoE layer.

* ``ExpertCache`` (``state.py``): N slots shared by all layers plus the tables that map
  (layer, expert) <-> slot and the recency stamps; an immutable pytree.
* ``plan`` (``policy.py``): for one layer-step, which routes the cache serves, which misses
  are filled (and into which slots), which run on the host. Pure, static shapes, usable in
  ``jit`` and ``lax.scan``; the six policies share one mechanism and one ``Plan`` format.
* ``offloaded_moe`` (``moe.py``): the public layer function JAX users call in their own
  models: ``(new_cache, y)``.
"""

from ftjax.cache.policy import POLICIES, Plan, PolicyConfig, fill_count, plan
from ftjax.cache.state import ExpertCache

__all__ = ["ExpertCache", "Plan", "PolicyConfig", "POLICIES", "fill_count", "plan"]
