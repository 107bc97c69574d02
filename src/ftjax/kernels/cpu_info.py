"""What the host kernels run with: the XLA FFI op `ftjax_cpu_info` (xla_ffi/cpu_info.cc)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.kernels._registration import require

ISAS = ("scalar", "avx2", "avx512", "avx512bf16")  # ordered: each implies those before it
_POOLS = ("own", "xla")  # as numbered by xla_ffi/cpu_info.cc


def cpu_info() -> dict:
  """The instruction set and threads a host kernel called now would use.

  Honours FTJAX_ISA, FTJAX_THREAD_POOL and (at the pool's creation) FTJAX_NUM_THREADS.

  Returns:
    {"isa": ISA in use, "best_isa": best supported, "threads": workers, "pool": "xla"|"own"}.
  """
  require("cpu_info")
  call = jax.ffi.ffi_call(
    "ftjax_cpu_info", jax.ShapeDtypeStruct((4,), jnp.int32), vmap_method="sequential"
  )
  isa, best, threads, pool = (int(v) for v in np.asarray(call()))
  return {"isa": ISAS[isa], "best_isa": ISAS[best], "threads": threads, "pool": _POOLS[pool]}
