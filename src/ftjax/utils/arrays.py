"""Array helpers shared by the layers."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def take(table: jax.Array, indices: jax.Array, axis: int = 0) -> jax.Array:
  """``jnp.take(table, indices, axis)`` that stays a gather of the selected rows inside loops.

  XLA:CPU gathers bfloat16 by converting the table to float32 inside the gather's fusion,
  which reads only the selected rows. Inside a ``while`` loop, though, that conversion of a
  loop-invariant table is hoisted out of the loop and materialised: the whole embedding (or
  expert bank) converted to float32 by every decode program. Tying the table to the
  (loop-variant) indices with an optimization barrier keeps the gather and its conversion
  together, at no cost.
  """
  table, indices = jax.lax.optimization_barrier((table, indices))
  return jnp.take(table, indices, axis=axis)
