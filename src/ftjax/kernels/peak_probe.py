"""Host multiply-add peak: the XLA FFI op `ftjax_peak_probe` (xla_ffi/peak_probe.cc).

Runs a register-only multiply-add loop (vdpbf16ps on AVX-512-BF16 CPUs, float32 FMA otherwise)
on the threads of the other host kernels. Timing a call gives the compute ceiling that the
grouped expert kernel and the dense GEMM are compared with.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.kernels._registration import require


def peak_probe(*, tasks: int, iterations: int):
  """Runs `tasks` rounds of `iterations` iterations; returns float32 [checksum, flops done].

  Raises:
    ValueError: if tasks or iterations is not a positive int.
  """
  for name, value in (("tasks", tasks), ("iterations", iterations)):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
      raise ValueError(f"{name} must be a Python int, got {value!r}")
    if value < 1:
      raise ValueError(f"{name} must be positive, got {value}")
  require("peak_probe")
  call = jax.ffi.ffi_call(
    "ftjax_peak_probe", jax.ShapeDtypeStruct((2,), jnp.float32), vmap_method="sequential"
  )
  return call(tasks=np.int64(tasks), iterations=np.int64(iterations))
