"""A persistent XLA compilation cache for ftjax's commands: a restart compiles nothing it
compiled before.

``enable(directory=None)`` points JAX's persistent compilation cache at
``$FTJAX_CACHE_DIR/xla/<build>`` (``FTJAX_CACHE_DIR`` defaults to ``~/.cache/ftjax``, where
converted weights live too), and caches every program whatever its compile time. JAX's own key
already covers the program (its HLO, so the model's shapes and the runtime flags that change
it), jax and jaxlib, the backend, the device and XLA's flags. ``<build>`` adds what that key
cannot see: ftjax's version and its compiled C++ modules (the FFI kernels a program calls by
name), so a rebuilt ftjax never loads an executable made against another build, and the CPU's
model and instruction-set flags (XLA:CPU compiles for the host's ISA).

``python -m ftjax.decode``, ``ftjax.chat`` and ``ftjax.serve`` call it at start-up
(``--compilation_cache``, on by default; ``--nocompilation_cache`` turns it off). A
``JAX_COMPILATION_CACHE_DIR`` set in the environment wins: it is used as it is.
"""

from __future__ import annotations

import hashlib
import os

import jax

from ftjax.kernels.cpu_info import build_digest, cpu_identity, ftjax_version
from ftjax.utils import paths

__all__ = ["build_key", "cpu_identity", "default_root", "enable", "ftjax_version"]


def default_root() -> str:
  return paths.cache_root()


def build_key() -> str:
  """ftjax's version and a digest of its compiled modules (name, size, mtime) and of the CPU
  (its model and instruction-set flags: XLA:CPU compiles for the host's ISA, and a cache
  directory shared by machines with different ones must not hand an AVX-512 program to an
  AVX2 machine)."""
  version = ftjax_version()
  digest = hashlib.sha256(version.encode())
  digest.update(build_digest().encode())
  digest.update(cpu_identity().encode())
  return f"ftjax-{version}-{digest.hexdigest()[:16]}"


def enable(directory: str | None = None) -> str:
  """Turns the persistent compilation cache on and returns its directory (created)."""
  given = os.environ.get("JAX_COMPILATION_CACHE_DIR")
  if given:
    path = given
  else:
    path = directory or os.path.join(default_root(), "xla", build_key())
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  # Every program, however quick to compile: a server's start-up is made of many small ones.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return path
