"""The routed-experts protocol: how the model gets its routed experts.

The model computes the router (``ftjax.model.router``) and the shared expert itself, but not
the routed experts: their weights live outside the model (a host pool, a device cache, or
both), and how a layer-step is served is the runtime's choice. So every MoE layer calls a
function it is given, threaded through the whole step like a carry::

  experts, y = experts(x, weights, ids, layer)

* ``x [T, D]`` float32: the layer's normalised hidden states, tokens flattened;
* ``weights [T, K]`` float32 and ``ids [T, K]`` int32: the router's output; ``ids = -1``
  marks no route (padding tokens), and such a route must contribute nothing;
* ``layer``: the MoE layer's index, a Python int;
* returns the (possibly updated) function object and ``y [T, D]`` float32, the weighted sum
  of the routed experts' outputs.

Optionally, an object with a true ``prefetches`` attribute also has
``experts.ahead(ids, layer) -> experts``: before each MoE layer's mixer runs, the model
applies that layer's router to the residual entering it and passes the predicted ids
``[T, K]`` (router-ahead), so that the object can start fetching them (the expert cache's
prefetch). The prediction changes no output: the layer still routes on its own input.

The object is a pytree (a ``flax.struct.dataclass``): whatever state it carries (an expert
cache, per-layer statistics, a routing record) flows through ``jit`` and ``lax`` loops with
the step, and the model hands back the final object next to its new decode state. Options
that change the program (which kernels run the host work, the cache policy) are static
fields of the object. Implementations: ``ftjax.experts.BankExperts`` (every route from the
host bank: the reference), ``ftjax.cache.CachedExperts`` (the device cache and the host pool,
split by a cache policy). The model never imports them.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import jax

Self = TypeVar("Self", bound="RoutedExperts")


class RoutedExperts(Protocol):
  """``experts(x, weights, ids, layer) -> (experts, y)``; see the module docstring."""

  def __call__(self: Self, x: jax.Array, weights: jax.Array, ids: jax.Array,
               layer: int) -> tuple[Self, jax.Array]:
    ...
