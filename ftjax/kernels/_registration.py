"""Registers every XLA FFI handler of ftjax's compiled module (ftjax._ffi) with XLA:CPU.

Imported by each op's wrapper module; registration happens once, at the first import.
"""

from __future__ import annotations

import jax

try:
  import ftjax._ffi as _ffi
except ImportError as error:
  raise ImportError(
    "ftjax's compiled module ftjax._ffi is missing. ftjax must be installed with "
    "`pip install --no-build-isolation .` (after installing jax, scikit-build-core and "
    "nanobind), which builds the C++ kernels in xla_ffi/. Running from a source checkout "
    "without installing does not work."
  ) from error

for _name, _capsule in _ffi.registrations().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
del _name, _capsule


def shape_and_dtype(name, array):
  """(shape, numpy dtype) of an array-like, or ValueError naming the argument."""
  import numpy as np  # noqa: PLC0415

  try:
    return tuple(array.shape), np.dtype(array.dtype)
  except AttributeError:
    raise ValueError(f"{name} must be an array, got {type(array).__name__}") from None
