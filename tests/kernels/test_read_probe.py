"""ftjax_read_probe, ftjax_peak_probe and ftjax_cpu_info."""

import zlib

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
