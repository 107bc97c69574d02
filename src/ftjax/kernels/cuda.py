"""The GPU side of the two-tier expert memory: XLA FFI ops for the CUDA platform.

C++/CUDA sources in ``xla_ffi/cuda/``, built into ``ftjax._ffi_cuda`` when the CUDA toolkit
and a CUDA jaxlib plugin are present at install time (see README); a CPU-only install has no
such module, ``cuda_available()`` is False and ``require_cuda()`` says why and how to fix it.
Nothing here runs on the CPU backend: the ops lower for ``cuda`` only (``jax.export`` of a
GPU program works on any machine).

The host pool these ops read is *registered* (``register_pool``): its address, size and block
layout ``[L, E, P]`` are handed to the C++ side once, which pins it for DMA if it is not pinned
already (a ``pinned_host`` jax array is) and maps it into the device's address space. An op
names its pool by the integer handle, a static attribute, so the pool is read in place and
never becomes an operand of the program.

Ops:

* ``pool_fill(slots, src, dst, *, pool)``: a copy kernel on the compute stream that reads the
  planned (layer, expert) blocks straight from the mapped pool into their slots (the fill plan
  stays on the device: no host round trip). ``slots`` is aliased: donate it.
* ``fetch_layer_start(*, pool, layer)`` and ``fetch_layer_done(block)``: a whole layer of the
  pool (contiguous) copied into a device buffer on a side stream by the copy engine, so that a
  streamed prefill moves layer l+1 while layer l computes; done makes the compute stream wait.
* ``host_experts_start(x, ids, weights, *, pool, layer, ffn_dim)`` and
  ``host_experts_done(ticket, y)``: the host experts of one layer-step, overlapped with the
  device's hit and fill work. ``start`` copies x, ids and weights to pinned staging on the
  stream and posts the job to a host worker (``cudaLaunchHostFunc``; the worker runs ftjax's
  CPU expert kernel on the pool); it returns a ticket and ``x`` unchanged, which the device
  experts consume, so XLA orders start before them. ``done`` makes the stream wait for the
  worker's flag in mapped memory (``cuStreamWaitValue32``) and adds the host result to the
  device partial sum ``y`` (aliased).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.kernels._registration import shape_and_dtype as _shape_and_dtype
from ftjax.kernels.expert_ffn import SWIGLU, ExpertVariant

_FIX = ("Build ftjax on a machine with the CUDA toolkit (nvcc) and a CUDA jaxlib plugin "
        "(jax[cuda13] or jax[cuda12]): `pip install --no-build-isolation .` then compiles "
        "xla_ffi/cuda/ into ftjax._ffi_cuda (force it with `-C cmake.define.FTJAX_CUDA=ON`).")

try:
  import ftjax._ffi_cuda as _ffi_cuda
except ImportError as error:  # reported by require_cuda(), never swallowed
  _ffi_cuda = None
  _LOAD_ERROR: str | None = f"{type(error).__name__}: {error}"
else:
  _LOAD_ERROR = None
  for _name, _capsule in _ffi_cuda.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")
  del _name, _capsule

# Custom-call targets of this module, for jax.export's safety check (DisabledSafetyCheck).
TARGETS = ("ftjax_cuda_pool_fill", "ftjax_cuda_host_experts_start",
           "ftjax_cuda_host_experts_done", "ftjax_cuda_fetch_layer_start",
           "ftjax_cuda_fetch_layer_done")


def cuda_available() -> bool:
  """Whether ftjax's CUDA module is built and registered."""
  return _LOAD_ERROR is None


def cuda_load_error() -> str | None:
  return _LOAD_ERROR


def require_cuda(what: str = "the GPU expert path") -> None:
  """Raises ImportError (cause and fix) unless ``ftjax._ffi_cuda`` is loaded."""
  if _LOAD_ERROR is not None:
    raise ImportError(f"{what} needs ftjax's CUDA module ftjax._ffi_cuda, which could not be "
                      f"loaded ({_LOAD_ERROR}). {_FIX}")


@dataclasses.dataclass(frozen=True)
class PoolSpec:
  """A registered host pool: the handle ops name it by, and its block layout [L, E, P]."""
  handle: int
  shape: tuple[int, int, int]
  dtype: str


def register_pool(bank) -> PoolSpec:
  """Registers a host pool [L, E, P] (a ``pinned_host`` jax array, or a C-contiguous numpy
  array such as the memory-mapped FTW bank) with the CUDA module and returns its spec.

  The memory must stay alive and unchanged while programs that name the pool run: keep a
  reference to ``bank`` (the engine does). Registering the same address again returns the
  same handle."""
  require_cuda("register_pool")
  shape, dtype = _shape_and_dtype("bank", bank)
  if len(shape) != 3:
    raise ValueError(f"the pool must be [L, E, P], got shape {shape}")
  if dtype in (np.int8, np.uint8, np.uint16):
    raise ValueError("int8, int4 and mxfp4 expert pools are not supported by the CUDA host path "
                     "yet (its host "
                     "worker reads bfloat16 or float32 blocks): on a GPU serve a bfloat16 or "
                     "float32 conversion of the model, or run it on the CPU backend")
  if dtype not in (np.dtype(jnp.bfloat16), np.dtype(np.float32)):
    raise ValueError(f"the pool must be bfloat16 or float32, got {dtype}")
  if isinstance(bank, np.ndarray):
    if not bank.flags.c_contiguous:
      raise ValueError("the pool must be C-contiguous")
    address = bank.ctypes.data
  else:
    kind = bank.sharding.memory_kind
    if kind != "pinned_host":
      raise ValueError(f"a jax pool must live in pinned_host memory, got memory_kind={kind!r}: "
                       "place it with jax.device_put(bank, sharding.with_memory_kind("
                       "'pinned_host'))")
    address = bank.unsafe_buffer_pointer()
  nbytes = int(np.prod(shape)) * dtype.itemsize
  handle = _ffi_cuda.register_pool(int(address), nbytes, *shape, dtype.itemsize)
  return PoolSpec(handle=int(handle), shape=tuple(shape), dtype=dtype.name)


def pool_stats() -> dict:
  """The CUDA module's counters (jobs run, host seconds, bytes filled) for benchmarks."""
  require_cuda("pool_stats")
  return dict(_ffi_cuda.stats())


def _check(name, value, shape, dtype):
  got_shape, got_dtype = _shape_and_dtype(name, value)
  if shape is not None and got_shape != shape:
    raise ValueError(f"{name} must have shape {shape}, got {got_shape}")
  if got_dtype != np.dtype(dtype):
    raise ValueError(f"{name} must be {np.dtype(dtype)}, got {got_dtype}")
  return got_shape


def pool_fill(slots, src, dst, *, pool: PoolSpec):
  """``slots[dst[m]] = pool[src[m, 0], src[m, 1]]`` for rows with ``dst[m] >= 0``.

  slots [N, P] with the pool's dtype (donate it), src [M, 2] int32 (layer, expert), dst [M]
  int32 in [-1, N). Returns the new slots (the same buffer)."""
  L, E, P = pool.shape
  (n, p) = _check("slots", slots, None, pool.dtype)
  if p != P:
    raise ValueError(f"slots must be [N, {P}] like the pool's blocks, got {(n, p)}")
  (m, two) = _check("src", src, None, np.int32)
  if two != 2:
    raise ValueError(f"src must be [M, 2] (layer, expert), got {(m, two)}")
  _check("dst", dst, (m,), np.int32)
  call = jax.ffi.ffi_call("ftjax_cuda_pool_fill", jax.ShapeDtypeStruct(slots.shape, slots.dtype),
                          input_output_aliases={0: 0})
  return call(slots, src, dst, pool=np.int64(pool.handle))


def host_experts_start(x, ids, weights, *, pool: PoolSpec, layer: int, ffn_dim: int,
                       bf16_activations: bool = False, variant: ExpertVariant = SWIGLU):
  """Posts the host experts ``ids``/``weights`` [T, K] of tokens x [T, D] (float32) of layer
  ``layer`` (a Python int) to the host worker; ``variant`` is the experts' activation and
  biases (``ftjax.kernels.expert_ffn``). Returns (ticket, x): use the returned ``x`` for the
  device's work, and pass the ticket to ``host_experts_done``."""
  L, E, P = pool.shape
  (t, d) = _check("x", x, None, np.float32)
  (_, k) = _check("ids", ids, None, np.int32)
  _check("ids", ids, (t, k), np.int32)
  _check("weights", weights, (t, k), np.float32)
  if not isinstance(layer, (int, np.integer)) or not 0 <= int(layer) < L:
    raise ValueError(f"layer must be a Python int in [0, {L}) on the GPU path, got {layer!r}")
  if variant.block_elems(ffn_dim, d) > P:
    raise ValueError(f"an expert block of ffn_dim={ffn_dim}, D={d}"
                     f"{' with biases' if variant.bias else ''} needs "
                     f"{variant.block_elems(ffn_dim, d)} elements, more than the pool's P = {P}")
  call = jax.ffi.ffi_call(
      "ftjax_cuda_host_experts_start",
      (jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct(x.shape, x.dtype)),
      input_output_aliases={0: 1}, has_side_effect=True)
  ticket, x = call(x, ids, weights, pool=np.int64(pool.handle), layer=np.int64(layer),
                   ffn_dim=np.int64(ffn_dim), bf16_activations=bool(bf16_activations),
                   activation=variant.activation, alpha=np.float32(variant.alpha),
                   limit=np.float32(variant.limit), biases=bool(variant.bias))
  return ticket, x


def host_experts_done(ticket, y):
  """``y`` (the device partial sum, [T, D] float32) plus the host result of ``ticket``'s job,
  once the host worker has finished it (the stream waits; the launch thread does not)."""
  _check("ticket", ticket, (2,), np.int32)
  _check("y", y, None, np.float32)
  call = jax.ffi.ffi_call("ftjax_cuda_host_experts_done",
                          jax.ShapeDtypeStruct(y.shape, y.dtype),
                          input_output_aliases={1: 0}, has_side_effect=True)
  return call(ticket, y)


def fetch_layer_start(*, pool: PoolSpec, layer: int):
  """Starts copying layer ``layer`` of the pool [E, P] to the device on a side stream; returns
  the block, to be passed unchanged to ``fetch_layer_done`` before it is read."""
  L, E, P = pool.shape
  if not isinstance(layer, (int, np.integer)) or not 0 <= int(layer) < L:
    raise ValueError(f"layer must be a Python int in [0, {L}), got {layer!r}")
  call = jax.ffi.ffi_call("ftjax_cuda_fetch_layer_start",
                          jax.ShapeDtypeStruct((E, P), np.dtype(pool.dtype)),
                          has_side_effect=True)
  return call(pool=np.int64(pool.handle), layer=np.int64(layer))


def fetch_layer_done(block):
  """The block of ``fetch_layer_start``, once its copy has landed (the stream waits)."""
  call = jax.ffi.ffi_call("ftjax_cuda_fetch_layer_done",
                          jax.ShapeDtypeStruct(block.shape, block.dtype),
                          input_output_aliases={0: 0}, has_side_effect=True)
  return call(block)
