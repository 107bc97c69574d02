"""ftjax_read_probe, ftjax_peak_probe and ftjax_cpu_info."""

import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.kernels import cpu_info, peak_probe, read_probe


def numpy_checksum(buf):
  """XOR of the little-endian 32-bit words of buf's bytes, zero-padded to a multiple of 4."""
  data = np.ascontiguousarray(buf).tobytes()
  data += b"\0" * (-len(data) % 4)
  return int(np.bitwise_xor.reduce(np.frombuffer(data, "<u4"), initial=np.uint32(0)))


def random_bytes(n, label):
  return np.random.default_rng(zlib.crc32(repr((n, label)).encode())).integers(
    0, 256, n, dtype=np.uint8
  )


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 255, 4096 + 7, (3 << 20) + 11])
def test_checksum_of_bytes_equals_numpy(n, isa):
  buf = random_bytes(n, "bytes")
  checksum = read_probe(buf)
  assert checksum.dtype == jnp.uint32 and checksum.shape == ()
  assert int(checksum) == numpy_checksum(buf)


@pytest.mark.parametrize(
  "make",
  [
    lambda b: b.view(np.float32).reshape(4, -1),
    lambda b: b.view(jnp.bfloat16),
    lambda b: b[:-6].view(np.int16).reshape(-1, 3),  # 23994 bytes: a half word at the end
  ],
  ids=["float32_2d", "bfloat16", "int16_half_word_tail"],
)
def test_checksum_of_other_dtypes_equals_numpy(make):
  buf = make(random_bytes(4 * 6000, "dtypes"))
  assert int(read_probe(buf)) == numpy_checksum(buf)


def test_python_side_rejects_non_arrays():
  with pytest.raises(ValueError, match="buf must be an array"):
    read_probe([1, 2, 3])


def test_peak_probe_counts_its_flops(isa):
  checksum, flops = np.asarray(peak_probe(tasks=4, iterations=1000))
  assert np.isfinite(checksum)
  per_iteration = {"scalar": 16, "avx2": 192, "avx512": 384, "avx512bf16": 768}[isa]
  assert flops == 4 * 1000 * per_iteration


@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_peak_probe_rejects_bad_counts(value):
  with pytest.raises(ValueError, match="tasks must be"):
    peak_probe(tasks=value, iterations=10)


def test_cpu_info_honours_the_environment(monkeypatch):
  best = cpu_info()["best_isa"]
  monkeypatch.setenv("FTJAX_ISA", "scalar")
  info = cpu_info()
  assert info["isa"] == "scalar" and info["best_isa"] == best
  assert info["threads"] >= 1 and info["pool"] == "xla"
  monkeypatch.setenv("FTJAX_ISA", "avx512bf16")  # never above what the CPU has
  assert cpu_info()["isa"] == best
  monkeypatch.setenv("FTJAX_THREAD_POOL", "own")
  assert cpu_info()["pool"] == "own"


@pytest.mark.parametrize(
  "target, result, attributes, message",
  [
    ("ftjax_read_probe", jax.ShapeDtypeStruct((2,), jnp.uint32), {},
     "ftjax_read_probe: result checksum must be a scalar, got [2]"),
    ("ftjax_peak_probe", jax.ShapeDtypeStruct((2,), jnp.float32),
     dict(tasks=np.int64(0), iterations=np.int64(5)),
     "ftjax_peak_probe: tasks and iterations must be positive"),
    ("ftjax_peak_probe", jax.ShapeDtypeStruct((3,), jnp.float32),
     dict(tasks=np.int64(1), iterations=np.int64(5)), "ftjax_peak_probe: result must be [2], got [3]"),
    ("ftjax_cpu_info", jax.ShapeDtypeStruct((3,), jnp.int32), {},
     "ftjax_cpu_info: result must be [5], got [3]"),
  ],
  ids=["read_probe_result", "peak_probe_counts", "peak_probe_result", "cpu_info_result"],
)
def test_kernels_reject_bad_calls(target, result, attributes, message):
  call = jax.ffi.ffi_call(target, result, vmap_method="sequential")
  args = (np.zeros(8, np.uint8),) if target == "ftjax_read_probe" else ()
  with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(message)):
    jax.block_until_ready(call(*args, **attributes))
