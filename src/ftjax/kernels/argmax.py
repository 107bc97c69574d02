"""The greedy token of each row of logits on the host: the XLA FFI op `ftjax_argmax`
(xla_ffi/argmax.cc), KernelTable::argmax_f32 over parts of the rows on the threads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.kernels._registration import require, shape_and_dtype


def argmax(x):
  """The index of the largest value of each row, in ``jnp.argmax``'s order: the first of equal
  largest values, and a NaN counts as the largest (the row's first NaN).

  XLA:CPU runs ``jnp.argmax`` one (value, index) pair at a time (2.9 ms for 8 rows of 248,320
  logits on the Xeon VM); this reads each row once at the ISA's width.

  Args:
    x: [N, M] float32, 1 <= M < 2**31.

  Returns:
    int32 [N].

  Raises:
    ValueError: naming the argument whose shape or dtype is wrong.
  """
  shape, dtype = shape_and_dtype("x", x)
  if len(shape) != 2 or dtype != np.float32 or not 1 <= shape[1] < 2**31:
    raise ValueError(f"x must be float32 [N, M] with 1 <= M < 2**31, got {dtype} of shape "
                     f"{shape}")
  require("argmax")
  call = jax.ffi.ffi_call("ftjax_argmax", jax.ShapeDtypeStruct(shape[:1], jnp.int32),
                          vmap_method="sequential")
  return call(x)
