"""One decode token of the gated delta rule on the host: the XLA FFI op
`ftjax_delta_rule_step` (xla_ffi/delta_rule.cc), the Gated DeltaNet layers' recurrence for a
batch of sequences, the state read once and updated in place."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.kernels._registration import require, shape_and_dtype


def delta_rule_step(q, k, v, g, beta, state):
  """One token of ``S <- exp(g) S; delta = beta (v - S^T k); S <- S + k delta^T; out = S^T q``
  per sequence and head (``ftjax.model.deltanet.gated_delta_recurrent`` at one token).

  Args:
    q, k: [B, M, U] float32 (normalised and scaled as the layer does).
    v: [B, M, Y] float32.
    g: [B, M] float32, the log of the decay (<= 0); beta: [B, M] float32. A row with g = 0
      and beta = 0 (a padded row of a batch) keeps its state as it is.
    state: [B, M, U, Y] float32. The result aliases it: under jit with the state donated (or
      carried by a loop) it is updated in place.

  Returns:
    (out [B, M, Y], new state [B, M, U, Y]), float32.

  Raises:
    ValueError: naming the argument whose shape or dtype is wrong.
  """
  s_shape, s_dtype = shape_and_dtype("state", state)
  if len(s_shape) != 4 or s_dtype != np.float32:
    raise ValueError(f"state must be float32 [B, M, U, Y], got {s_dtype} of shape {s_shape}")
  b, m, u, y = s_shape
  want = {"q": (b, m, u), "k": (b, m, u), "v": (b, m, y), "g": (b, m), "beta": (b, m)}
  for name, array in zip(want, (q, k, v, g, beta)):
    shape, dtype = shape_and_dtype(name, array)
    if shape != want[name] or dtype != np.float32:
      raise ValueError(f"{name} must be float32 {list(want[name])} (from state's [B, M, U, Y] = "
                       f"{list(s_shape)}), got {dtype} of shape {shape}")
  require("delta_rule_step")
  call = jax.ffi.ffi_call(
    "ftjax_delta_rule_step",
    (jax.ShapeDtypeStruct((b, m, y), jnp.float32), jax.ShapeDtypeStruct(s_shape, jnp.float32)),
    vmap_method="sequential",
    input_output_aliases={5: 1},
  )
  return call(q, k, v, g, beta, state)
