"""Registers every XLA FFI handler of ftjax's compiled module (ftjax._ffi) with XLA:CPU.

Imported by each op's wrapper module; registration happens once, at the first import. When
the module is missing or cannot be loaded, importing still works (so that the engine can say
so clearly, and ``kernels="xla"`` stays usable), but every op raises ``KernelsUnavailable``
naming the cause and the fix, and ``available()`` is False. Nothing falls back silently.
"""

from __future__ import annotations

import jax
import numpy as np

from ftjax.utils import quant

_FIX = ("Install ftjax with README's first command (`pip install --no-build-isolation .` "
        "after installing jax, scikit-build-core and nanobind), which builds the C++ kernels "
        "of xla_ffi/ into ftjax._ffi, and run from anywhere: the checkout keeps the package in "
        "src/, so the installed package is the one imported. To run the slow XLA:CPU path "
        "knowingly instead, pass kernels='xla' (--kernels=xla).")


class KernelsUnavailable(ImportError):
  """ftjax's compiled kernel module could not be loaded."""


try:
  import ftjax._ffi as _ffi
except ImportError as error:  # reported by require() and by the engine, never swallowed
  _ffi = None
  _LOAD_ERROR: str | None = f"{type(error).__name__}: {error}"
else:
  _LOAD_ERROR = None
  for _name, _capsule in _ffi.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
  del _name, _capsule
  # The converter's int4 quantiser in C++ (ftjax.utils.quant.quantize_int4 runs it from now on).
  quant.set_native_int4(_ffi.quantize_int4)


def ffi_module():
  """The loaded ftjax._ffi (call ``require()`` first): its functions beside the handlers, such
  as the kernel tuning's setter (ftjax/kernels/tuning.py)."""
  return _ffi


def available() -> bool:
  """Whether the compiled kernels are loaded and registered."""
  return _LOAD_ERROR is None


def load_error() -> str | None:
  """Why the compiled kernels could not be loaded (None when they were)."""
  return _LOAD_ERROR


def require(what: str = "ftjax's C++ kernels") -> None:
  """Raises ``KernelsUnavailable`` (cause and fix) unless the compiled module is loaded."""
  if _LOAD_ERROR is not None:
    raise KernelsUnavailable(f"{what} need ftjax's compiled module ftjax._ffi, which could not be "
                             f"loaded ({_LOAD_ERROR}). {_FIX}")


def shape_and_dtype(name, array):
  """(shape, numpy dtype) of an array-like, or ValueError naming the argument."""
  try:
    return tuple(array.shape), np.dtype(array.dtype)
  except AttributeError:
    raise ValueError(f"{name} must be an array, got {type(array).__name__}") from None
