"""What the host kernels run with: the XLA FFI op `ftjax_cpu_info` (xla_ffi/cpu_info.cc); and
what identifies the machine and the build, for what is kept per machine (compiled programs,
kernel tuning)."""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import os

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.kernels._registration import require

ISAS = ("scalar", "avx2", "avx512", "avx512bf16")  # ordered: each implies those before it
_POOLS = ("own", "xla")  # as numbered by xla_ffi/cpu_info.cc


def cpu_info() -> dict:
  """The instruction set and threads a host kernel called now would use.

  Honours FTJAX_ISA, FTJAX_AMX, FTJAX_THREAD_POOL and (at the pool's creation)
  FTJAX_NUM_THREADS.

  Returns:
    {"isa": ISA in use, "best_isa": best supported, "threads": workers, "pool": "xla"|"own",
     "amx": whether the bf16-activation GEMMs (prefill, batches) run on AMX tiles}.
  """
  require("cpu_info")
  call = jax.ffi.ffi_call(
    "ftjax_cpu_info", jax.ShapeDtypeStruct((5,), jnp.int32), vmap_method="sequential"
  )
  isa, best, threads, pool, amx = (int(v) for v in np.asarray(call()))
  return {"isa": ISAS[isa], "best_isa": ISAS[best], "threads": threads, "pool": _POOLS[pool],
          "amx": bool(amx)}


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ftjax/


def cpu_identity() -> str:
  """The first processor's model name and flags from /proc/cpuinfo ('' where unreadable)."""
  keep = []
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if not line.strip():
          break  # the first processor only
        if line.startswith(("model name", "flags", "vendor_id", "cpu family", "model\t")):
          keep.append(line.strip())
  except OSError:
    pass
  return "\n".join(keep)


def cpu_model() -> dict:
  """{"name", "family", "model"} of the first processor (/proc/cpuinfo; "" where unknown)."""
  fields = {"model name": "name", "cpu family": "family", "model": "model"}
  out = dict.fromkeys(fields.values(), "")
  for line in cpu_identity().splitlines():
    key, _, value = line.partition(":")
    if key.strip() in fields:
      out[fields[key.strip()]] = value.strip()
  return out


def last_level_cache_bytes() -> int:
  """The largest CPU cache of the first processor, in bytes (sysfs; 0 where unknown)."""
  best = 0
  for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
    try:
      with open(os.path.join(index, "type")) as f:
        if f.read().strip() == "Instruction":
          continue
      with open(os.path.join(index, "size")) as f:
        size = f.read().strip()
    except OSError:
      continue
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
    digits = size.rstrip("KMGkmg")
    if digits.isdigit():
      best = max(best, int(digits) * scale)
  return best


def build_digest() -> str:
  """A digest of ftjax's compiled modules (name, size, mtime): changes with every rebuild."""
  digest = hashlib.sha256()
  for path in sorted(set(glob.glob(os.path.join(_PACKAGE, "_ffi*")))):
    st = os.stat(path)
    digest.update(f"{os.path.basename(path)}:{st.st_size}:{st.st_mtime_ns}".encode())
  return digest.hexdigest()[:16]


def ftjax_version() -> str:
  try:
    return importlib.metadata.version("ftjax")
  except importlib.metadata.PackageNotFoundError:  # a source tree on the path
    return "unknown"
