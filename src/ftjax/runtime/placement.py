"""Where the host expert pool lives, and so how fills and host experts run (DESIGN section 10).

``RuntimeOptions.pool`` names the placement:

* ``device``: the pool is an ordinary array of the default memory. On the CPU backend that is
  host memory (today's CPU path: fills by the FFI slot fill, host experts by the CPU kernel);
  on a GPU it puts the whole pool in HBM, for models that fit.
* ``pinned_host``: the pool is a jax array in ``pinned_host`` memory. Fills are in-program
  slices moved to device memory (asynchronous host-to-device copies on a GPU). Host experts
  run on the CPU kernel reading the pool in place: on the CPU backend through the FFI op, on a
  GPU through the CUDA start/done pair. XLA caps pinned memory on a GPU at
  ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB`` (64 GiB by default).
* ``mapped`` (GPU only): the pool stays the memory-mapped FTW bank, registered (pinned and
  mapped) by ftjax's CUDA module; fills are its copy kernel reading the mapped pool, host
  experts its start/done pair. Any size the host holds.
* ``auto``: ``device`` on the CPU backend; on a GPU with an expert cache ``pinned_host`` under
  the cap, else ``mapped``; on a GPU without one ``device`` when the pool fits (else an error
  asking for a cache size).

On the CPU backend ``pinned_host`` exists to run the GPU program's semantics, not for speed:
XLA:CPU widens a bfloat16 slice's source to float32 and hoists the widening of the whole pool
out of the decode loop (measured on a one-layer Qwen3-30B-A3B-shaped model: 7.5 tok/s against
53 with ``device``). ``benchmarks/gpu_check.py`` lists such whole-pool instructions of the
compiled decode program on the GPU.
"""

from __future__ import annotations

import dataclasses
import os
import weakref

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from ftjax.cache.moe import DEFAULT_OFFLOAD, Offload
from ftjax.kernels import cuda

POOLS = ("auto", "device", "pinned_host", "mapped")
EXPERT_AXIS = "experts"
_SHARD_MIN_ELEMENTS = 1 << 16  # dense weights below this stay replicated


def expert_mesh(devices: int | None) -> Mesh | None:
  """A one-axis mesh (``experts``) over the first ``devices`` local devices; None for one."""
  if devices is None or devices == 1:
    return None
  return Mesh(np.array(jax.devices()[:devices]), (EXPERT_AXIS,))


def shard_params(params, mesh: Mesh):
  """The dense parameters on ``mesh``: large weights split along their first axis where it
  divides evenly (embedding and lm_head over the vocabulary, projections over their output),
  the rest replicated. XLA's partitioner inserts the collectives; results equal one device's
  up to the order of float sums."""
  def place(x):
    spec = PartitionSpec()
    if x.ndim >= 1 and x.size >= _SHARD_MIN_ELEMENTS and x.shape[0] % mesh.size == 0:
      spec = PartitionSpec(EXPERT_AXIS)
    return jax.device_put(x, NamedSharding(mesh, spec))
  return jax.tree.map(place, params)


@dataclasses.dataclass
class Placement:
  offload: Offload  # static: how fills and host experts run
  bank: object  # what the programs receive as the bank (None for a mapped pool)
  host_bank: np.ndarray | None  # the pool as a host array (preloads, the mapped pool's memory)
  pool: str  # the placement resolved from "auto"
  description: str


def pinned_cap_bytes() -> int:
  """XLA's cap on pinned host memory of a GPU client."""
  return int(float(os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "64")) * 2**30)


# Per bank (by identity, while it lives): its host array, and its pinned_host copy while an
# engine holds it, so that the live engines of one model (a sweep over policies and cache
# sizes) share one pinned pool instead of a copy each. The copy is held weakly: it is as large
# as the pool, and it goes with the last engine that uses it, not with the model.
_PLACED: dict[int, dict] = {}


def _placed(bank) -> dict:
  key = id(bank)
  entry = _PLACED.get(key)
  if entry is None or entry["ref"]() is not bank:
    entry = _PLACED[key] = {"ref": weakref.ref(bank, lambda _: _PLACED.pop(key, None))}
  return entry


def _host_array(bank) -> np.ndarray:
  entry = _placed(bank)
  if "host" not in entry:
    entry["host"] = bank if isinstance(bank, np.ndarray) else np.asarray(bank)
  return entry["host"]


def _pinned(bank) -> jax.Array:
  entry = _placed(bank)
  pinned = entry["pinned"]() if "pinned" in entry else None
  if pinned is None:
    sharding = SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    pinned = jax.device_put(bank, sharding)
    entry["pinned"] = weakref.ref(pinned)
  return pinned


def resolve_pool(requested: str, bank, kernels: str, *, caching: bool) -> Placement:
  """The placement for ``requested`` (one of ``POOLS``) of ``bank`` [L, E, P] on this
  process's default backend. Clear errors for combinations that cannot run."""
  if requested not in POOLS:
    raise ValueError(f"pool must be one of {POOLS}, got {requested!r}")
  backend = jax.default_backend()
  gpu = backend != "cpu"
  nbytes = int(np.prod(bank.shape)) * np.dtype(bank.dtype).itemsize
  pool = requested
  if pool == "auto":
    if not gpu:
      pool = "device"
    elif not caching:
      # No expert cache asked for: the whole pool in device memory, if it fits.
      limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
      if limit is not None and nbytes > 0.8 * limit:
        raise ValueError(f"the expert pool ({nbytes / 2**30:.1f} GiB) does not fit in device "
                         f"memory ({limit / 2**30:.1f} GiB) without an expert cache: give a "
                         "cache size (cache_fraction=, cache_bytes=, device_budget_bytes=; "
                         "cache_slots=0 runs every routed expert on the host)")
      pool = "device"
    else:
      pool = "pinned_host" if nbytes <= pinned_cap_bytes() else "mapped"
  if pool == "device":
    if gpu:
      return Placement(DEFAULT_OFFLOAD, jax.device_put(bank), None, pool,
                       f"device memory ({backend}: the whole pool in device memory)")
    return Placement(DEFAULT_OFFLOAD, bank, None, pool, "device (host memory on the CPU backend)")
  if not caching:
    raise ValueError(f"pool={pool!r} serves routed experts through the expert cache: give a "
                     "cache size (cache_slots=0 runs every routed expert on the host)")
  if pool == "mapped" and not gpu:
    raise ValueError("pool='mapped' is the GPU path's pool, registered by ftjax's CUDA module; "
                     "on the CPU backend use pool='device' or pool='pinned_host'")
  if gpu:
    cuda.require_cuda(f"pool={pool!r} on the {backend} backend")
  host_bank = _host_array(bank)
  if pool == "pinned_host":
    if gpu and nbytes > pinned_cap_bytes():
      raise ValueError(f"the pool ({nbytes / 2**30:.1f} GiB) exceeds XLA's pinned host memory "
                       f"cap ({pinned_cap_bytes() / 2**30:.0f} GiB, "
                       "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB): use pool='mapped' or raise the cap")
    pinned = _pinned(bank)
    if not gpu:
      if kernels == "xla":
        raise ValueError("pool='pinned_host' on the CPU backend runs host experts with ftjax's "
                         "kernels, which read pinned_host memory in place; kernels='xla' cannot "
                         "(a gather across memory spaces does not lower): use kernels='auto'")
      return Placement(Offload(fill="slices", host="kernels"), pinned, host_bank, pool,
                       "pinned_host (fills: in-program slices; host experts: ftjax's CPU "
                       "kernel on the pool in place)")
    spec = cuda.register_pool(pinned)
    return Placement(Offload(fill="slices", host="cuda", pool=spec), pinned, host_bank, pool,
                     "pinned_host (fills: XLA async slices; host experts: CUDA start/done "
                     "pair on the CPU kernel)")
  spec = cuda.register_pool(host_bank)
  return Placement(Offload(fill="cuda", host="cuda", pool=spec), None, host_bank, pool,
                   "mapped (fills: CUDA copy kernel from the mapped pool; host experts: CUDA "
                   "start/done pair on the CPU kernel)")
