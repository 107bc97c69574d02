"""Host read-bandwidth probe: the XLA FFI op `ftjax_read_probe` (xla_ffi/read_probe.cc).

Reads a whole buffer with the threads and instruction set of the other host kernels and
returns the XOR of its little-endian 32-bit words (the last one zero-padded) as a uint32
scalar, so that the read cannot be optimised away. Timing it on a buffer much larger than the
caches gives the host's read-bandwidth ceiling, which benchmarks/expert_kernel.py (and
`python -m ftjax.profile`) compare the expert kernel and the GEMV with.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ftjax.kernels._registration import require, shape_and_dtype


def read_probe(buf):
  """XOR checksum of all 32-bit words of `buf` (any shape and dtype), read at full speed.

  Returns:
    A uint32 scalar jax.Array; equal to
    `np.bitwise_xor.reduce(np.frombuffer(bytes zero-padded to 4, '<u4'))`.

  Raises:
    ValueError: if `buf` is not an array.
  """
  shape_and_dtype("buf", buf)
  require("read_probe")
  call = jax.ffi.ffi_call(
    "ftjax_read_probe", jax.ShapeDtypeStruct((), jnp.uint32), vmap_method="sequential"
  )
  return call(buf)
