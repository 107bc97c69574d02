"""A minimal, streaming safetensors reader (numpy memmap; bfloat16 and float8 via ml_dtypes).

Format: 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the
data; offsets are relative to the end of the header. Reading a tensor maps only its bytes,
and the mapping lives as long as the returned array, so a converter that drops each tensor
after writing it keeps neither the data nor the page cache of the whole file resident.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
    # float8: block-scaled FP8 checkpoints (ftjax.formats.fp8) ship e4m3 weights; E5M2 and
    # E8M0 (power-of-two scales) are read so that the converter can name them when it
    # refuses them.
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "F8_E8M0": ml_dtypes.float8_e8m0fnu,
}


class SafetensorsError(ValueError):
  pass


class SafetensorsFile:

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    size = os.path.getsize(self.path)
    with open(self.path, "rb") as f:
      head = f.read(8)
      if len(head) < 8:
        raise SafetensorsError(f"{self.path} is too short to be a safetensors file")
      (n,) = struct.unpack("<Q", head)
      if n > size - 8:
        raise SafetensorsError(f"{self.path}: header length {n} exceeds the file size {size}")
      self.header_bytes = f.read(n)
    try:
      header = json.loads(self.header_bytes)
    except json.JSONDecodeError as e:
      raise SafetensorsError(f"{self.path}: damaged safetensors header ({e})") from e
    self.metadata = header.pop("__metadata__", None)
    self.entries = header
    self.data_start = 8 + n
    for name, e in header.items():
      if e["dtype"] not in _DTYPES:
        raise SafetensorsError(f"{self.path}: tensor {name} has unsupported dtype {e['dtype']}")
      if self.data_start + e["data_offsets"][1] > size:
        raise SafetensorsError(f"{self.path} is truncated: tensor {name} runs past the end")

  def keys(self) -> list[str]:
    return list(self.entries)

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.entries[name]["shape"])

  def dtype(self, name: str) -> str:
    """The tensor's safetensors dtype name (``"BF16"``, ``"F8_E4M3"``, ...)."""
    return self.entries[name]["dtype"]

  def nbytes(self, name: str) -> int:
    begin, end = self.entries[name]["data_offsets"]
    return end - begin

  def get(self, name: str) -> np.ndarray:
    """A read-only memory map of one tensor (no copy; pages are read when touched)."""
    e = self.entries[name]
    begin, end = e["data_offsets"]
    dtype = np.dtype(_DTYPES[e["dtype"]])
    if end == begin:
      return np.zeros(e["shape"], dtype)  # np.memmap cannot map zero bytes
    if (end - begin) != int(np.prod(e["shape"])) * dtype.itemsize:
      raise SafetensorsError(f"{self.path}: tensor {name} has {end - begin} bytes, which does not "
                             f"match its shape {e['shape']} and dtype {e['dtype']}")
    return np.memmap(self.path, dtype=dtype, mode="r", offset=self.data_start + begin,
                     shape=tuple(e["shape"]))
