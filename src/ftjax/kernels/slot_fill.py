"""Expert-cache fill: the XLA FFI op `ftjax_slot_fill` (C++ in xla_ffi/slot_fill.cc).

Copies expert blocks from the host bank [L, E, P] into slots of the device cache [N, P]:

    new_slots[dst[m]] = bank[src[m, 0], src[m, 1]]   for every m with dst[m] != -1

and leaves every other slot as it was. A fill plan has a static length M, padded with
dst = -1 rows (their src is not read).

In place, under one condition: the result aliases `slots` (input_output_aliases), so the
handler writes only the filled slots into the cache's own buffer, but XLA can hand it that
buffer only if the caller donates `slots`:

    @functools.partial(jax.jit, donate_argnames="slots")
    def fill(slots, bank, src, dst):
      return slot_fill(slots, bank, src, dst)

Without donation (an undonated jit argument, or an eager call) XLA silently copies the
whole cache into a fresh buffer first, and a fill of a few blocks costs a copy of all N.
"""

from __future__ import annotations

import jax
import numpy as np

# Registers every handler of ftjax._ffi with XLA:CPU, this one too.
from ftjax.kernels._registration import require
from ftjax.kernels._registration import shape_and_dtype as _shape_and_dtype

# Sub-byte types can be packed, so a block of P of them is not P whole elements in memory.
_SUB_BYTE_DTYPES = frozenset({"int2", "uint2", "int4", "uint4", "float4_e2m1fn"})


def slot_fill(slots, bank, src, dst):
  """Copies the bank's (layer, expert) blocks into cache slots; returns the new slots.

  Args:
    slots: [N, P] the expert cache, any dtype of whole bytes (bfloat16 or float32 today).
      Donate it under jit, or the whole cache is copied first (see the module docstring).
    bank: [L, E, P] expert blocks with the dtype of `slots` (may be traced).
    src: [M, 2] int32 (layer, expert) pairs, one block per row.
    dst: [M] int32 target slot per row in [-1, N); -1 skips the row. No slot may appear
      twice. Values of src and dst are checked by the kernel at run time (they may be
      traced): a bad plan fails the call with an error naming the row, and nothing is
      written.

  Returns:
    [N, P], `slots` with the filled rows replaced; the same buffer when `slots` is donated.

  Raises:
    ValueError: naming the argument whose shape or dtype is wrong.
  """
  slots_shape, slots_dtype = _shape_and_dtype("slots", slots)
  bank_shape, bank_dtype = _shape_and_dtype("bank", bank)
  src_shape, src_dtype = _shape_and_dtype("src", src)
  dst_shape, dst_dtype = _shape_and_dtype("dst", dst)

  if len(slots_shape) != 2:
    raise ValueError(f"slots must be 2-D [N, P], got shape {slots_shape}")
  if slots_dtype.name in _SUB_BYTE_DTYPES:
    raise ValueError(f"slots must have a dtype of one or more whole bytes, got {slots_dtype}")
  _, P = slots_shape

  if len(bank_shape) != 3 or bank_shape[2] != P:
    raise ValueError(f"bank must be [L, E, P] with P = {P} from slots, got shape {bank_shape}")
  if bank_dtype != slots_dtype:
    raise ValueError(f"bank must have the dtype of slots ({slots_dtype}), got {bank_dtype}")

  if len(src_shape) != 2 or src_shape[1] != 2:
    raise ValueError(f"src must be [M, 2] (layer, expert) pairs, got shape {src_shape}")
  if src_dtype != np.int32:
    raise ValueError(f"src must be int32, got {src_dtype}")
  M = src_shape[0]

  if dst_shape != (M,):
    raise ValueError(f"dst must be [M] with M = {M} from src, got shape {dst_shape}")
  if dst_dtype != np.int32:
    raise ValueError(f"dst must be int32, got {dst_dtype}")

  require("slot_fill")
  call = jax.ffi.ffi_call(
    "ftjax_slot_fill",
    jax.ShapeDtypeStruct(slots_shape, slots_dtype),
    input_output_aliases={0: 0},
    # Under vmap every batch member is a separate cache with its own plan: one call each.
    vmap_method="sequential",
  )
  return call(slots, bank, src, dst)

