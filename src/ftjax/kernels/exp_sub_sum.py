"""The softmax primitive of the host attention kernel: the XLA FFI op `ftjax_exp_sub_sum`
(xla_ffi/exp_sub_sum.cc), KernelTable::exp_sub_sum of the chosen ISA row by row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.kernels._registration import require, shape_and_dtype


def exp_sub_sum(x, max):  # noqa: A002 (the primitive's own name for it)
  """exp(x - max) per row, and the row sums.

  Args:
    x: [N, M] float32.
    max: [N] float32, subtracted from row n of x.

  Returns:
    (out [N, M], sums [N]), float32: out[n, m] = exp(x[n, m] - max[n]), 0 where
    x[n, m] - max[n] < -87 (-inf included); sums[n] = sum_m out[n, m].

  Raises:
    ValueError: naming the argument whose shape or dtype is wrong.
  """
  x_shape, x_dtype = shape_and_dtype("x", x)
  max_shape, max_dtype = shape_and_dtype("max", max)
  if len(x_shape) != 2 or x_dtype != np.float32:
    raise ValueError(f"x must be float32 [N, M], got {x_dtype} of shape {x_shape}")
  if max_shape != x_shape[:1] or max_dtype != np.float32:
    raise ValueError(f"max must be float32 [N] with N = {x_shape[0]} from x, got {max_dtype} of "
                     f"shape {max_shape}")
  require("exp_sub_sum")
  call = jax.ffi.ffi_call(
    "ftjax_exp_sub_sum",
    (jax.ShapeDtypeStruct(x_shape, jnp.float32), jax.ShapeDtypeStruct(x_shape[:1], jnp.float32)),
    vmap_method="sequential",
  )
  return call(x, max)
