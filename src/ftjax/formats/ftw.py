"""FTW ("FreeToken weights"): ftjax's weight format, memory-mapped with no repacking.

The format is specified in ``docs/ftw.md`` (precisely enough to write a reader in another
language). In short: a directory with ``ftw.json`` (format version, model config, dtype,
alignment 4096, tensor table with CRC-32s, source fingerprint), ``dense.bin`` (every tensor
that is not a routed expert, each 4096-aligned) and ``experts.bin`` (the expert bank:
layer-major, then expert; each block is ``gate [F, D]; up [F, D]; down [D, F]`` contiguous
and 4096-aligned, so one expert and one layer are each one contiguous copy). The bank's
expert format is ``bfloat16``, ``float32``, ``int8`` (symmetric per output channel, float32
row scales inside each block: ``ftjax.utils.quant``) or ``mxfp4`` (gpt-oss's 4-bit E2M1 codes
with an E8M0 scale per 32 inputs, then float32 biases: ``ftjax.utils.quant``). A model with expert biases (gpt-oss:
``ModelConfig.expert_bias``; bf16 or float32 only) continues each block with ``gate_bias [F];
up_bias [F]; down_bias [D]`` in the same dtype. Version 2 records the format and the block's
parts; version 1 files (format = the bank dtype, no biases) still load.

Errors (all subclasses of ``FTWError``, a ``ValueError``): ``FTWVersionError`` for a newer
format, ``FTWTruncatedError`` for a missing or short file, ``FTWChecksumError`` for a CRC
mismatch, ``FTWConfigMismatchError`` when the tensors do not have the shapes the config
implies.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import mmap
import os
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import ml_dtypes
import numpy as np

from ftjax.model.config import ModelConfig
from ftjax.model.layers import LINEAR_OUT_AXES
from ftjax.utils import dense_quant, paths, quant
from ftjax.utils.dense_quant import QuantizedMatrix

# 2: the expert bank's format (``experts.format``) and block parts; 3: quantised dense tensors
# (a tensor entry's ``format``), and mxfp4 expert blocks without biases.
FORMAT_VERSION = 3
READ_VERSIONS = (1, 2, 3)
ALIGNMENT = 4096
INDEX_NAME = "ftw.json"
DENSE_FILE = "dense.bin"
EXPERTS_FILE = "experts.bin"
EXPERT_PARTS = ("gate", "up", "down")
EXPERT_BIAS_PARTS = ("gate_bias", "up_bias", "down_bias")
_RACY_NS = 3_000_000_000  # files changed this recently get no verified stamp (see there)

DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}


class FTWError(ValueError):
  """Base class of every FTW load error."""


class FTWVersionError(FTWError):
  pass


class FTWTruncatedError(FTWError):
  pass


class FTWChecksumError(FTWError):
  pass


class FTWConfigMismatchError(FTWError):
  pass


def align(n: int, alignment: int = ALIGNMENT) -> int:
  return (n + alignment - 1) // alignment * alignment


def storage_dtype(name: str) -> np.dtype:
  if name not in DTYPES:
    raise ValueError(f"unsupported FTW dtype {name!r}; choose one of {', '.join(DTYPES)}")
  return DTYPES[name]


# --dense_dtype: which format each quantisable dense weight (LINEAR_OUT_AXES) gets. The presets
# follow llama.cpp's Q4_K_M, which keeps its output in Q6_K and attn_v and ffn_down in Q6_K:
# 4-bit input projections (q, k, gate; Gated DeltaNet's qkv, z, b, a; the shared experts' gate
# and up), 8-bit value and output projections (v, o, the Gated DeltaNet output, the shared
# experts' down), lm_head and embedding. "mixed_int4" takes int4 for the 4-bit ones (the
# quality preset: on the embedded models its KL to bfloat16 was 0.4x mixed4's,
# benchmarks/dense_quality.py), "mixed4" mxfp4 (4.25 bits, power-of-two block scales). With
# mxfp4, 4-bit value and output projections had cost 1.6x and 3.6x Q4_K_M's KL.
DENSE_DTYPES = ("int8", "int4", "mxfp4", "mixed4", "mixed_int4")
_HEAD_NAMES = ("w_lm_vd", "embed_vd")
_MIXED4_INT8 = (*_HEAD_NAMES, "w_v_gad", "w_o_dha", "w_out_dmy", "w_down_di")
_MIXED_4BIT = {"mixed4": "mxfp4", "mixed_int4": "int4"}


def dense_format(dense_dtype: str | None, name: str, shape: tuple[int, ...],
                 tied_embeddings: bool) -> tuple[str | None, str]:
  """``(format, why)`` for dense tensor ``name`` under ``--dense_dtype=dense_dtype``: the
  quantised format it is written in (None: the storage dtype) and, for a quantisable weight
  that stays float or is not in the asked format, why (for the converter's summary)."""
  if dense_dtype is None:
    return None, ""
  if dense_dtype not in DENSE_DTYPES:
    raise ValueError(f"dense_dtype must be one of {', '.join(DENSE_DTYPES)} (or None), got "
                     f"{dense_dtype!r}")
  leaf = name.rsplit(".", 1)[-1]
  if leaf not in LINEAR_OUT_AXES:
    return None, ""
  if leaf == "embed_vd" and not tied_embeddings and dense_dtype != "int8":
    fmt = "int8"  # an untied embedding is only gathered: 8 bits save half its memory
  elif dense_dtype in _MIXED_4BIT:
    fmt = "int8" if leaf in _MIXED4_INT8 else _MIXED_4BIT[dense_dtype]
  else:
    fmt = dense_dtype
  problem = dense_quant.check_format(fmt, shape, LINEAR_OUT_AXES[leaf])
  if problem and fmt in ("mxfp4", "int4"):
    fmt, why = "int8", f"int8, not {fmt}: {problem}"
    problem = dense_quant.check_format(fmt, shape, LINEAR_OUT_AXES[leaf])
    return (None, problem) if problem else (fmt, why)
  return (None, problem) if problem else (fmt, "")


def expert_storage_dtype(expert_format: str) -> np.dtype:
  """The dtype of the bank array ``[L, E, P]`` of an expert format (int8: P is in bytes)."""
  if expert_format not in quant.EXPERT_FORMATS:
    raise ValueError(f"unsupported FTW expert format {expert_format!r}; choose one of "
                     f"{', '.join(quant.EXPERT_FORMATS)}")
  if expert_format == "mxfp4":
    return np.dtype(np.uint8)
  if expert_format == "int4":  # uint16 words: the dtype names the format (quant, int4 blocks)
    return np.dtype(np.uint16)
  return np.dtype(np.int8) if expert_format == "int8" else DTYPES[expert_format]


def expert_content_bytes(config: ModelConfig, expert_format: str) -> int:
  """Bytes of one expert block's content (weights, and scales for int8), before padding:
  what a fill or a host kernel reads for one expert."""
  if expert_format == "int8":
    return quant.int8_block_bytes(config.moe_intermediate_size, config.hidden_size)
  if expert_format == "mxfp4":
    return quant.mxfp4_block_bytes(config.moe_intermediate_size, config.hidden_size,
                                   config.expert_bias)
  if expert_format == "int4":
    return quant.int4_block_bytes(config.moe_intermediate_size, config.hidden_size)
  return config.expert_block_elems * expert_storage_dtype(expert_format).itemsize


def _quantized_layout(fmt: str, rows: int, cols: int):
  """``(data dtype, data shape, scales dtype, scales shape)`` of a quantised [rows, cols]."""
  if fmt == "int8":
    return np.dtype(np.int8), (rows, cols), np.dtype(np.float32), (rows,)
  if fmt == "int4":
    return (np.dtype(np.uint8), (rows, cols // 2), np.dtype(np.uint8),
            (rows, quant.int4_param_bytes(cols)))
  return (np.dtype(np.uint8), (rows, cols // 2), np.dtype(np.uint8),
          (rows, cols // quant.MXFP4_BLOCK))


def _check_quantized(name: str, q: QuantizedMatrix) -> None:
  problem = dense_quant.check_format(q.format, tuple(q.shape), q.out_axes)
  if problem:
    raise FTWError(f"tensor {name}: {problem}")
  data_dtype, data_shape, scales_dtype, scales_shape = _quantized_layout(q.format, q.rows, q.cols)
  if np.dtype(q.data.dtype) != data_dtype or tuple(q.data.shape) != data_shape or \
      np.dtype(q.scales.dtype) != scales_dtype or tuple(q.scales.shape) != scales_shape:
    raise FTWError(f"tensor {name}: a {q.format} weight of shape {q.shape} needs data "
                   f"{data_dtype} {data_shape} and scales {scales_dtype} {scales_shape}, got "
                   f"{q.data.dtype} {tuple(q.data.shape)} and {q.scales.dtype} "
                   f"{tuple(q.scales.shape)}")
  if q.format == "mxfp4" and np.any(np.asarray(q.scales) == quant.MXFP4_SCALE_NAN):
    raise FTWError(f"{name}: an E8M0 scale of 255 (NaN in the OCP MX format)")
  if q.format == "int4":
    d, dm, _, _ = quant.int4_parts(np.asarray(q.scales))
    if not (np.all(np.isfinite(d)) and np.all(np.isfinite(dm))):
      raise FTWError(f"{name}: an int4 row's steps (d, dm) are not finite")


def _bytes_view(array: np.ndarray) -> memoryview:
  """The bytes of a C-contiguous array without a copy (bfloat16 has no buffer format)."""
  return memoryview(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


_COPY_PIECE = 64 << 20


def read_into_memory(file_path: str, size: int,
                      on_bytes: Callable[[int], None] | None = None) -> np.ndarray:
  """The first ``size`` bytes of ``file_path`` in a new read-only uint8 array of anonymous
  memory, read in 64 MiB pieces by up to four threads (``os.preadv`` releases the GIL). No
  transparent huge pages are asked for: on the Xeon VM, 4.7 GB took 3.6-3.8 s to copy with
  ``MADV_HUGEPAGE`` (the kernel compacts memory for each 2 MiB page) and 1.0-1.4 s without,
  and both read at 31.8-32.4 GB/s."""
  if size == 0:
    return np.zeros((0,), np.uint8)
  buf = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  view = memoryview(buf)
  fd = os.open(file_path, os.O_RDONLY)

  def piece(start: int) -> None:
    end = min(start + _COPY_PIECE, size)
    at = start
    while at < end:
      n = os.preadv(fd, [view[at:end]], at)
      if n <= 0:
        raise FTWTruncatedError(f"{file_path} ended at byte {at} while copying it into memory; "
                                f"the index expects {size} bytes: copy or convert it again")
      at += n
    if on_bytes is not None:
      on_bytes(end - start)

  try:
    workers = max(1, min(4, os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
      for future in [pool.submit(piece, at) for at in range(0, size, _COPY_PIECE)]:
        future.result()
  finally:
    os.close(fd)
    view.release()
  out = np.frombuffer(buf, np.uint8)  # keeps ``buf`` alive
  out.flags.writeable = False
  return out


def _crc32(buf, chunk: int = 1 << 26) -> int:
  if isinstance(buf, np.ndarray):
    buf = _bytes_view(buf)
  view = memoryview(buf).cast("B")
  crc = 0
  for start in range(0, len(view), chunk):
    crc = zlib.crc32(view[start:start + chunk], crc)
  return crc


def _file_crc32(fd: int, offset: int, length: int, chunk: int = 1 << 24) -> int:
  """CRC-32 of a file range, read in chunks (no mapping of the whole file)."""
  crc = 0
  buf = bytearray(chunk)
  view = memoryview(buf)
  end = offset + length
  while offset < end:
    n = os.preadv(fd, [view[:min(chunk, end - offset)]], offset)
    if n <= 0:
      raise FTWTruncatedError(f"short read at byte {offset} while checksumming")
    crc = zlib.crc32(view[:n], crc)
    offset += n
  return crc


def is_ftw_dir(path: str | os.PathLike) -> bool:
  return os.path.isfile(os.path.join(path, INDEX_NAME))


def expert_parts(config: ModelConfig) -> tuple[str, ...]:
  """The parts of an expert block, in storage order."""
  return EXPERT_PARTS + (EXPERT_BIAS_PARTS if config.expert_bias else ())


def expert_part_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  f, d = config.moe_intermediate_size, config.hidden_size
  shapes = {"gate": (f, d), "up": (f, d), "down": (d, f),
            "gate_bias": (f,), "up_bias": (f,), "down_bias": (d,)}
  return {part: shapes[part] for part in expert_parts(config)}


def expert_part_starts(config: ModelConfig) -> dict[str, int]:
  """Element offset of each part inside an expert block (any dtype)."""
  starts, offset = {}, 0
  for part, shape in expert_part_shapes(config).items():
    starts[part] = offset
    offset += int(np.prod(shape))
  return starts


class FTWWriter:
  """Writes an FTW directory, tensor by tensor, in any order.

  ``add_tensor`` appends a dense tensor; ``add_expert_part`` writes one part of one expert
  at its place in the preallocated bank. ``close`` checks that every part was written, then
  computes the layer checksums and writes the index last, so a directory with an
  ``ftw.json`` is always complete. ``dtype`` is the dense tensors' storage dtype;
  ``expert_format`` the bank's (default: ``dtype``); with ``"int8"`` float expert parts are
  quantised per row as they are written (``ftjax.utils.quant``).
  """

  def __init__(self, out_dir: str | os.PathLike, config: ModelConfig, dtype: str,
               source: dict[str, Any], *, expert_format: str | None = None,
               dense_dtype: str | None = None):
    self.out_dir = os.fspath(out_dir)
    self.config = config
    self.dtype_name = dtype
    self.dtype = storage_dtype(dtype)
    self.source = source
    dense_format(dense_dtype, "", (), False)  # checks the name
    self.dense_dtype = dense_dtype
    # What --dense_dtype did: {tensor name: why it is not in the asked format} (e.g. mxfp4
    # rows whose length is not a multiple of 32), for the converter to say.
    self.dense_notes: dict[str, str] = {}
    os.makedirs(self.out_dir, exist_ok=True)
    self.tensors: dict[str, dict[str, Any]] = {}
    self._dense = open(os.path.join(self.out_dir, DENSE_FILE), "wb")
    self._dense_size = 0
    c = config
    self.expert_format = expert_format or dtype
    if self.expert_format in ("int8", "int4") and c.expert_bias:
      raise FTWError(f"{self.expert_format} experts carry no biases (the block ends with the "
                     f"row scales): keep this {c.model_type} model's experts in bfloat16"
                     + (" or mxfp4" if c.model_type == "gpt_oss" else ""))
    if self.expert_format == "int4":
      quant.check_int4_shape(c.moe_intermediate_size, c.hidden_size)
    self.expert_dtype = expert_storage_dtype(self.expert_format)
    self.part_shapes = expert_part_shapes(c)
    itemsize = self.expert_dtype.itemsize
    self.part_offsets = {k: v * itemsize for k, v in expert_part_starts(c).items()}  # bytes
    if self.expert_format == "mxfp4":  # codes, then scales, then float32 biases (if any)
      at = quant.mxfp4_offsets(c.moe_intermediate_size, c.hidden_size)
      self.part_offsets = {**at["codes"], **{f"{k}_bias": v for k, v in at["biases"].items()}}
      self.mxfp4_scale_offsets = at["scales"]
    if self.expert_format == "int4":  # codes, then each row's parameters
      at = quant.int4_offsets(c.moe_intermediate_size, c.hidden_size)
      self.part_offsets = dict(at["codes"])
      self.int4_param_offsets = at["params"]
    self.block_bytes = align(expert_content_bytes(c, self.expert_format))
    # int8: byte offset of each part's float32 row scales in a block
    scales = quant.int8_scales_offset(c.moe_intermediate_size, c.hidden_size)
    f = c.moe_intermediate_size
    self.scale_offsets = {"gate": scales, "up": scales + 4 * f, "down": scales + 8 * f}
    self._bank_size = c.num_moe_layers * c.num_experts * self.block_bytes
    self._experts = open(os.path.join(self.out_dir, EXPERTS_FILE), "wb+")
    self._experts.truncate(self._bank_size)  # sparse, zero-filled
    self.parts = expert_parts(c)
    self._written = np.zeros((c.num_moe_layers, c.num_experts, len(self.parts)), bool)

  def _cast(self, name: str, array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if tuple(array.shape) != tuple(shape):
      raise FTWConfigMismatchError(
          f"tensor {name} has shape {tuple(array.shape)} but the model config implies {tuple(shape)}")
    if not (np.issubdtype(array.dtype, np.floating) or array.dtype in DTYPES.values()):
      raise FTWError(f"tensor {name} has non-float dtype {array.dtype}")
    return np.ascontiguousarray(array.astype(self.dtype, copy=False))

  def add_tensor(self, name: str, array: np.ndarray | QuantizedMatrix,
                 shape: tuple[int, ...] | None = None) -> None:
    """Appends a dense tensor: a float array (cast to the storage dtype, or quantised when
    ``dense_dtype`` says so) or a ``QuantizedMatrix`` (written as it is)."""
    if name in self.tensors:
      raise FTWError(f"tensor {name} written twice")
    shape = tuple(shape if shape is not None else array.shape)
    if isinstance(array, QuantizedMatrix):
      if tuple(array.shape) != shape:
        raise FTWConfigMismatchError(
            f"tensor {name} has shape {tuple(array.shape)} but the model config implies {shape}")
      return self._add_quantized(name, array)
    fmt, why = dense_format(self.dense_dtype, name, shape, self.config.tie_word_embeddings)
    if why:
      self.dense_notes[name] = why
    if fmt is not None:
      if tuple(array.shape) != shape:
        raise FTWConfigMismatchError(
            f"tensor {name} has shape {tuple(array.shape)} but the model config implies {shape}")
      leaf = name.rsplit(".", 1)[-1]
      return self._add_quantized(name, dense_quant.quantize(array, fmt, LINEAR_OUT_AXES[leaf]))
    data = self._cast(name, array, shape)
    offset = self._append(data)
    self.tensors[name] = {"file": DENSE_FILE, "offset": offset, "nbytes": data.nbytes,
                          "shape": list(data.shape), "dtype": self.dtype_name,
                          "crc32": _crc32(data)}

  def _append(self, data: np.ndarray) -> int:
    """Writes ``data`` at the next aligned offset of the dense file; returns the offset."""
    offset = align(self._dense_size)
    self._dense.write(b"\0" * (offset - self._dense_size))
    self._dense.write(_bytes_view(data))
    self._dense_size = offset + data.nbytes
    return offset

  def _add_quantized(self, name: str, q: QuantizedMatrix) -> None:
    """A quantised tensor (docs/ftw.md, "Dense formats"): its data, then from the next
    multiple of 64 bytes its scales, as one entry of the dense file."""
    data = np.ascontiguousarray(np.asarray(q.data)).reshape(-1).view(np.uint8)
    scales = np.ascontiguousarray(np.asarray(q.scales)).reshape(-1).view(np.uint8)
    _check_quantized(name, q)
    scales_at = -(-data.nbytes // quant.MXFP4_ALIGNMENT) * quant.MXFP4_ALIGNMENT
    blob = np.zeros(scales_at + scales.nbytes, np.uint8)
    blob[:data.nbytes] = data
    blob[scales_at:] = scales
    offset = self._append(blob)
    self.tensors[name] = {
        "file": DENSE_FILE, "offset": offset, "nbytes": blob.nbytes, "shape": list(q.shape),
        "format": q.format, "out_axes": q.out_axes,
        "dtype": "int8" if q.format == "int8" else "uint8",
        "data_shape": list(np.shape(q.data)), "scales_offset": scales_at,
        "scales_shape": list(np.shape(q.scales)),
        "scales_dtype": "float32" if q.format == "int8" else "e8m0",
        "crc32": _crc32(blob)}

  def add_expert_part(self, layer: int, expert: int, part: str, array: np.ndarray,
                      scale: np.ndarray | None = None) -> None:
    """Writes one part. For an int8 bank, ``array`` is float (quantised here) or int8 with
    its float32 row ``scale`` (already quantised, e.g. read from another int8 FTW); for an
    int4 bank float, or uint8 codes with their row parameters as ``scale``; for mxfp4 float,
    or uint8 codes with their E8M0 scales."""
    c = self.config
    if not (0 <= layer < c.num_moe_layers and 0 <= expert < c.num_experts):
      raise FTWConfigMismatchError(
          f"expert ({layer}, {expert}) is outside the config's {c.num_moe_layers} layers x "
          f"{c.num_experts} experts")
    if part not in self.parts:
      raise FTWConfigMismatchError(
          f"expert part {part!r} is not one of this config's block parts {self.parts}")
    p = self.parts.index(part)
    if self._written[layer, expert, p]:
      raise FTWError(f"expert part layer {layer} expert {expert} {part} written twice")
    name = f"expert[{layer},{expert}].{part}"
    start = (layer * c.num_experts + expert) * self.block_bytes
    if self.expert_format == "int8":
      data, scale = self._quantised(name, array, scale)
      os.pwrite(self._experts.fileno(), _bytes_view(scale), start + self.scale_offsets[part])
    elif self.expert_format == "int4":
      data, params = self._int4(name, part, array, scale)
      os.pwrite(self._experts.fileno(), _bytes_view(params),
                start + self.int4_param_offsets[part])
    elif self.expert_format == "mxfp4":
      data, scale = self._mxfp4(name, part, array, scale)
      if scale is not None:
        os.pwrite(self._experts.fileno(), _bytes_view(scale),
                  start + self.mxfp4_scale_offsets[part])
    else:
      if scale is not None:
        raise FTWError(f"{name}: a scale is only written with int8 experts, not "
                       f"{self.expert_format}")
      data = self._cast(name, array, self.part_shapes[part])
    os.pwrite(self._experts.fileno(), _bytes_view(data), start + self.part_offsets[part])
    self._written[layer, expert, p] = True

  def _quantised(self, name: str, array: np.ndarray, scale: np.ndarray | None):
    shape = self.part_shapes[name.rsplit(".", 1)[1]]
    if tuple(array.shape) != tuple(shape):
      raise FTWConfigMismatchError(
          f"tensor {name} has shape {tuple(array.shape)} but the model config implies {shape}")
    if array.dtype == np.int8:
      if scale is None or np.shape(scale) != (shape[0],):
        raise FTWError(f"{name} is int8: pass its float32 row scales, shape ({shape[0]},)")
      return np.ascontiguousarray(array), np.ascontiguousarray(scale, np.float32)
    if scale is not None:
      raise FTWError(f"{name} is {array.dtype}: it is quantised here, pass no scale")
    if not (np.issubdtype(array.dtype, np.floating) or array.dtype == DTYPES["bfloat16"]):
      raise FTWError(f"tensor {name} has non-float dtype {array.dtype}")
    return quant.quantize_rows(array)

  def _int4(self, name: str, part: str, array: np.ndarray, params: np.ndarray | None):
    """An int4 part: float weights (quantised here: ``quant.quantize_int4``), or, as an int4
    model stores them, uint8 codes [out, in/2] with their uint8 row parameters
    [out, 8 + in/16] (written as they are)."""
    rows, cols = self.part_shapes[part]
    if params is None:
      if tuple(array.shape) != (rows, cols):
        raise FTWConfigMismatchError(f"tensor {name} has shape {tuple(array.shape)} but the "
                                     f"model config implies {(rows, cols)}")
      if not (np.issubdtype(array.dtype, np.floating) or array.dtype == DTYPES["bfloat16"]):
        raise FTWError(f"tensor {name} has non-float dtype {array.dtype}")
      return quant.quantize_int4(array)
    want = ((rows, cols // 2), (rows, quant.int4_param_bytes(cols)))
    params = np.asarray(params)
    if array.dtype != np.uint8 or params.dtype != np.uint8 or \
        (tuple(array.shape), tuple(params.shape)) != want:
      raise FTWError(f"{name}: an int4 bank takes float weights {(rows, cols)} (quantised here) "
                     f"or uint8 codes {want[0]} with uint8 row parameters {want[1]}, got "
                     f"{array.dtype} {tuple(array.shape)} with {params.dtype} "
                     f"{tuple(params.shape)}")
    return np.ascontiguousarray(array), np.ascontiguousarray(params)

  def _mxfp4(self, name: str, part: str, array: np.ndarray, scale: np.ndarray | None):
    """An mxfp4 part: a weight as its uint8 codes [out, in/2] with E8M0 scales [out, in/32]
    (kept as shipped), or float (quantised here: ``quant.quantize_mxfp4``); a bias as float32."""
    shape = self.part_shapes[part]
    if part.endswith("_bias"):
      if scale is not None:
        raise FTWError(f"{name}: a bias has no scale")
      if tuple(array.shape) != tuple(shape):
        raise FTWConfigMismatchError(f"tensor {name} has shape {tuple(array.shape)} but the "
                                     f"model config implies {tuple(shape)}")
      return np.ascontiguousarray(np.asarray(array).astype(np.float32)), None
    rows, cols = shape
    want = {"codes": (rows, cols // 2), "scales": (rows, cols // quant.MXFP4_BLOCK)}
    if array.dtype != np.uint8 and scale is None:  # float weights: quantised here
      if tuple(array.shape) != tuple(shape):
        raise FTWConfigMismatchError(f"tensor {name} has shape {tuple(array.shape)} but the "
                                     f"model config implies {tuple(shape)}")
      if not (np.issubdtype(array.dtype, np.floating) or array.dtype == DTYPES["bfloat16"]):
        raise FTWError(f"tensor {name} has non-float dtype {array.dtype}")
      return quant.quantize_mxfp4(array)
    if array.dtype != np.uint8 or scale is None:
      raise FTWError(f"{name}: an mxfp4 bank takes each weight as uint8 E2M1 codes {want['codes']}"
                     f" with uint8 E8M0 scales {want['scales']} (as gpt-oss ships them), or as "
                     f"float weights without scales (quantised here), got {array.dtype} "
                     f"{tuple(array.shape)}{' with scales' if scale is not None else ''}")
    scale = np.asarray(scale)
    if tuple(array.shape) != want["codes"] or tuple(scale.shape) != want["scales"] or \
        scale.dtype != np.uint8:
      raise FTWConfigMismatchError(
          f"{name}: codes {tuple(array.shape)} and scales {scale.dtype} {tuple(scale.shape)} do "
          f"not match the config's {shape} weight: codes {want['codes']}, uint8 scales "
          f"{want['scales']}")
    if np.any(scale == quant.MXFP4_SCALE_NAN):
      raise FTWError(f"{name}: an E8M0 scale of 255 (NaN in the OCP MX format); the checkpoint "
                     "is damaged")
    return np.ascontiguousarray(array), np.ascontiguousarray(scale)

  def close(self, extra_index: dict[str, Any] | None = None) -> str:
    missing = np.argwhere(~self._written)
    if len(missing):
      l, e, p = missing[0]
      raise FTWError(f"{len(missing)} expert parts were never written, first: layer {l} expert "
                     f"{e} {self.parts[p]}")
    self._dense.close()
    self._experts.flush()
    os.fsync(self._experts.fileno())
    c = self.config
    layer_bytes = c.num_experts * self.block_bytes
    layer_crc = [_file_crc32(self._experts.fileno(), l * layer_bytes, layer_bytes)
                 for l in range(c.num_moe_layers)]
    self._experts.close()
    index = {
        "format": "ftw",
        "format_version": FORMAT_VERSION,
        "alignment": ALIGNMENT,
        "dtype": self.dtype_name,
        "model_config": c.to_dict(),
        "source": self.source,
        "files": {DENSE_FILE: self._dense_size, EXPERTS_FILE: self._bank_size},
        "tensors": self.tensors,
        "experts": {
            "file": EXPERTS_FILE, "offset": 0, "format": self.expert_format,
            "dtype": str(self.expert_dtype),
            "num_layers": c.num_moe_layers, "num_experts": c.num_experts,
            "ffn_dim": c.moe_intermediate_size, "width": c.hidden_size,
            "block_bytes": self.block_bytes,
            "parts": [{"name": n, "shape": list(self.part_shapes[n]), "offset": self.part_offsets[n]}
                      for n in self.parts],
            **({"scales": [{"name": n, "shape": [self.part_shapes[n][0]], "dtype": "float32",
                            "offset": self.scale_offsets[n]} for n in EXPERT_PARTS]}
               if self.expert_format == "int8" else {}),
            **({"scales": [{"name": n, "shape": [self.part_shapes[n][0],
                                                 self.part_shapes[n][1] // quant.MXFP4_BLOCK],
                            "dtype": "e8m0", "offset": self.mxfp4_scale_offsets[n]}
                           for n in EXPERT_PARTS]}
               if self.expert_format == "mxfp4" else {}),
            **({"params": [{"name": n, "shape": [self.part_shapes[n][0],
                                                 quant.int4_param_bytes(self.part_shapes[n][1])],
                            "dtype": "int4_row_params", "offset": self.int4_param_offsets[n]}
                           for n in EXPERT_PARTS]}
               if self.expert_format == "int4" else {}),
            "layer_crc32": layer_crc,
        },
        **(extra_index or {}),
    }
    tmp = os.path.join(self.out_dir, INDEX_NAME + ".tmp")
    with open(tmp, "w") as f:
      json.dump(index, f, indent=1)
    os.replace(tmp, os.path.join(self.out_dir, INDEX_NAME))
    return self.out_dir


@dataclass
class FTWFile:
  """An opened FTW directory: the index and read-only buffers of its files: memory maps of the
  files as opened, or copies in this process's memory after ``copy_to_memory``."""
  path: str
  index: dict[str, Any]
  config: ModelConfig
  dtype: np.dtype
  _maps: dict[str, np.ndarray]

  # What ``open`` did with the CRC-32s: "verified", "verified before, unchanged since (DATE)"
  # or "not verified" (its ``verify``).
  verification: str = "not verified"
  # "mapped" (the files' pages, from the page cache) or "copied" (``copy_to_memory``, which
  # took ``copy_s`` seconds).
  residency: str = "mapped"
  copy_s: float = 0.0

  @classmethod
  def open(cls, path: str | os.PathLike, *, verify: bool | str = True,
           progress: Callable[[Iterable], Iterable] | None = None) -> "FTWFile":
    """Opens and validates an FTW directory. ``verify``: True checks every CRC-32; ``"once"``
    checks them the first time these files are opened on this machine and records their
    identity under ``$FTJAX_CACHE_DIR/verified/``, so that a later open of the same unchanged
    files skips the check (a full read of the weights: about 4 s for 13 GB); False checks
    none. ``verification`` says which happened."""
    if verify not in (True, False, "once"):
      raise ValueError(f"verify must be True, False or 'once', got {verify!r}")
    path = os.fspath(path)
    index_path = os.path.join(path, INDEX_NAME)
    if not os.path.isfile(index_path):
      raise FileNotFoundError(
          f"{index_path} not found: {path} is not an FTW directory (convert a Hugging Face "
          "checkpoint with `python -m ftjax.convert --hf_dir=... --out=...`)")
    try:
      with open(index_path) as f:
        index = json.load(f)
    except json.JSONDecodeError as e:
      raise FTWTruncatedError(f"{index_path} is not valid JSON ({e}); the file is damaged or "
                              "was cut short: convert the model again") from e
    if index.get("format") != "ftw":
      raise FTWError(f"{index_path} is not an FTW index (format={index.get('format')!r})")
    version = index.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
      raise FTWVersionError(
          f"{path} uses FTW format version {version}, newer than the {FORMAT_VERSION} this ftjax "
          "reads: upgrade ftjax, or convert the checkpoint again with this version")
    if version not in READ_VERSIONS:
      raise FTWVersionError(f"{path} has FTW format version {version}, which this ftjax does "
                            f"not read (it reads {READ_VERSIONS}): convert the checkpoint again")
    experts = index.get("experts", {})
    if version == 1:  # before version 2 the bank's format was its dtype
      experts["format"] = experts.get("dtype")
    if experts.get("format") not in quant.EXPERT_FORMATS:
      raise FTWVersionError(
          f"{path} stores its experts in format {experts.get('format')!r}, which this ftjax "
          f"does not know (it reads {', '.join(quant.EXPERT_FORMATS)}): upgrade ftjax, or "
          "convert the checkpoint again with --expert_dtype set to one of those")
    config = ModelConfig.from_dict(index["model_config"])
    dtype = storage_dtype(index["dtype"])
    maps = {}
    for name, size in index["files"].items():
      file_path = os.path.join(path, name)
      actual = os.path.getsize(file_path) if os.path.isfile(file_path) else None
      if actual is None or actual < size:
        raise FTWTruncatedError(
            f"{file_path} is {'missing' if actual is None else f'{actual} bytes'} but the index "
            f"expects {size} bytes: the file was truncated or not fully copied; copy or convert "
            "it again")
      maps[name] = (np.memmap(file_path, dtype=np.uint8, mode="r", shape=(size,)) if size
                    else np.zeros((0,), np.uint8))  # np.memmap cannot map an empty file
    ftw = cls(path=path, index=index, config=config, dtype=dtype, _maps=maps)
    ftw.check_layout()
    if verify == "once":
      stamp = ftw.verified_stamp()
      if stamp is not None:
        ftw.verification = f"verified before, unchanged since ({stamp})"
        return ftw
    if verify:
      ftw.verify(progress=progress)
      ftw.verification = "verified"
      ftw.write_verified_stamp()
    return ftw

  def _identity(self) -> dict[str, list[int]]:
    """What changes when any of the files is rewritten, replaced or touched: per file its
    device, inode, size, modification and status-change times (ns)."""
    out = {}
    for name in (INDEX_NAME, *self._maps):
      st = os.stat(os.path.join(self.path, name))
      out[name] = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    return out

  def _stamp_path(self) -> str:
    key = hashlib.sha256(os.path.realpath(self.path).encode()).hexdigest()[:24]
    return os.path.join(paths.cache_root(), "verified", f"{key}.json")

  def verified_stamp(self) -> str | None:
    """When these unchanged files' CRC-32s were checked, or None (never, or changed since)."""
    try:
      with open(self._stamp_path()) as f:
        stamp = json.load(f)
    except (OSError, ValueError):
      return None
    if (stamp.get("path") != os.path.realpath(self.path) or
        stamp.get("files") != self._identity()):
      return None
    return stamp.get("verified")

  def write_verified_stamp(self) -> None:
    """Records that these files passed ``verify`` (best effort: a cache directory that cannot
    be written only means the next ``verify="once"`` checks again). Files changed in the last
    few seconds get no record: a file system's clock ticks coarsely, so a write within the same
    tick could leave their times as recorded (git's "racy" index entries)."""
    files = self._identity()
    if max(max(f[3], f[4]) for f in files.values()) > time.time_ns() - _RACY_NS:
      return
    stamp = {"path": os.path.realpath(self.path), "files": files,
             "verified": time.strftime("%Y-%m-%d %H:%M:%S")}
    target = self._stamp_path()
    try:
      os.makedirs(os.path.dirname(target), exist_ok=True)
      tmp = f"{target}.{os.getpid()}.tmp"
      with open(tmp, "w") as f:
        json.dump(stamp, f)
      os.replace(tmp, target)
    except OSError:
      pass

  def check_layout(self) -> None:
    """Every tensor and the bank lie inside their files and agree with the config."""
    for name, t in self.index["tensors"].items():
      end = t["offset"] + t["nbytes"]
      if "format" in t:
        if t["format"] not in dense_quant.DENSE_FORMATS:
          raise FTWVersionError(
              f"tensor {name} of {self.path} is stored in format {t['format']!r}, which this "
              f"ftjax does not know (it reads {', '.join(dense_quant.DENSE_FORMATS)}): upgrade "
              "ftjax, or convert the checkpoint again")
        rows = int(np.prod(t["shape"][:t["out_axes"]]))
        layout = _quantized_layout(t["format"], rows, int(np.prod(t["shape"])) // max(rows, 1))
        expect = t["scales_offset"] + layout[2].itemsize * int(np.prod(layout[3]))
        if list(layout[1]) != t["data_shape"] or list(layout[3]) != t["scales_shape"] or \
            t["scales_offset"] < layout[0].itemsize * int(np.prod(layout[1])):
          raise FTWConfigMismatchError(f"tensor {name}'s {t['format']} layout does not match "
                                       f"its shape {t['shape']} in {self.path}")
      else:
        expect = int(np.prod(t["shape"])) * storage_dtype(t["dtype"]).itemsize
      if t["nbytes"] != expect or end > len(self._maps[t["file"]]):
        raise FTWTruncatedError(f"tensor {name} does not fit its file in {self.path}")
    c, ex = self.config, self.index["experts"]
    want = {"num_layers": c.num_moe_layers, "num_experts": c.num_experts,
            "ffn_dim": c.moe_intermediate_size, "width": c.hidden_size}
    for key, value in want.items():
      if ex[key] != value:
        raise FTWConfigMismatchError(
            f"expert bank has {key}={ex[key]} but the model config implies {value} in {self.path}")
    names = tuple(part["name"] for part in ex["parts"])
    if names != expert_parts(c):
      raise FTWConfigMismatchError(
          f"expert blocks hold the parts {names} but the model config implies "
          f"{expert_parts(c)} in {self.path}")
    if ex["dtype"] != str(expert_storage_dtype(ex["format"])):
      raise FTWConfigMismatchError(f"expert bank dtype {ex['dtype']} does not match its format "
                                   f"{ex['format']} in {self.path}")
    if ex["block_bytes"] < expert_content_bytes(c, ex["format"]):
      raise FTWConfigMismatchError(f"expert block_bytes={ex['block_bytes']} is too small for "
                                   f"the config's expert shape in {self.path}")

  def mapped_bytes(self) -> int:
    """Bytes of every file (mapped or copied)."""
    return sum(len(m) for m in self._maps.values())

  def copy_to_memory(self, on_bytes: Callable[[int], None] | None = None) -> int:
    """Reads every file into this process's own memory (anonymous pages) and drops the
    mappings; later views (``tensor``, ``expert_bank``) are of the copies. Returns the bytes
    copied; ``on_bytes(n)`` is told of each piece read.

    Why: the same bytes read slower from a file's mapped pages than from the process's own
    memory on some machines. On this project's Intel Xeon VM (2026-12-03) the read probe over
    the 4-layer bench model's mapped experts (resident, mapped as 2 MiB pages) ran at 16.9-17.2
    GB/s one hour and 25.3-25.4 GB/s the next, and over a copy of them at 30.6-32.4 GB/s: it
    depends on where the page cache's pages sit. llama.cpp's ``--load-mode none`` reads its
    weights the same way."""
    if self.residency == "copied":
      return 0
    t0 = time.perf_counter()
    copies, total = {}, 0
    for name, mapped in self._maps.items():
      size = len(mapped)
      copies[name] = read_into_memory(os.path.join(self.path, name), size, on_bytes)
      total += size
    self._maps = copies
    self.residency = "copied"
    self.copy_s = time.perf_counter() - t0
    return total

  def populate(self) -> int:
    """Faults every page of every mapped file into memory (touches one byte per page), so
    that timing starts with the weights resident. Returns the number of bytes mapped."""
    total = 0
    for m in self._maps.values():
      if len(m):
        int(np.sum(m[::4096], dtype=np.uint64))  # one read per 4 KiB page
        total += len(m)
    return total

  def tensor(self, name: str) -> np.ndarray | QuantizedMatrix:
    """A read-only view into the mapped file (no copy); a quantised tensor as a
    ``QuantizedMatrix`` of views."""
    t = self.index["tensors"][name]
    raw = self._maps[t["file"]][t["offset"]:t["offset"] + t["nbytes"]]
    if "format" in t:
      rows = int(np.prod(t["shape"][:t["out_axes"]]))
      data_dtype, data_shape, scales_dtype, _ = _quantized_layout(
          t["format"], rows, int(np.prod(t["shape"])) // max(rows, 1))
      data = raw[:data_dtype.itemsize * int(np.prod(data_shape))].view(data_dtype)
      scales = raw[t["scales_offset"]:].view(scales_dtype)
      return QuantizedMatrix(data.reshape(data_shape), scales.reshape(t["scales_shape"]),
                             t["format"], tuple(t["shape"]), t["out_axes"])
    return raw.view(storage_dtype(t["dtype"])).reshape(t["shape"])

  def dense_formats(self) -> dict[str, int]:
    """How many dense tensors each format holds: ``{"bfloat16": n, "mxfp4": m, ...}``."""
    counts: dict[str, int] = {}
    for t in self.index["tensors"].values():
      fmt = t.get("format", t["dtype"])
      counts[fmt] = counts.get(fmt, 0) + 1
    return counts

  def tensor_names(self) -> list[str]:
    return list(self.index["tensors"])

  def expert_bank(self) -> np.ndarray:
    """The bank as ``[L, E, P]`` in the storage dtype, a view into the mapped file."""
    ex = self.index["experts"]
    num = ex["num_layers"] * ex["num_experts"] * ex["block_bytes"]
    raw = self._maps[ex["file"]][ex["offset"]:ex["offset"] + num]
    dtype = expert_storage_dtype(ex["format"])
    return raw.view(dtype).reshape(
        ex["num_layers"], ex["num_experts"], ex["block_bytes"] // dtype.itemsize)

  @property
  def expert_format(self) -> str:
    """``bfloat16``, ``float32``, ``int8`` or ``mxfp4``."""
    return self.index["experts"]["format"]

  def expert_part(self, layer: int, expert: int, part: str) -> np.ndarray:
    """One part as stored (int8 for an int8 bank: see ``expert_scale``; for an mxfp4 bank a
    weight's uint8 codes [out, in/2] and a bias in float32)."""
    ex = self.index["experts"]
    meta = next(p for p in ex["parts"] if p["name"] == part)
    n = int(np.prod(meta["shape"]))
    block = self.expert_bank()[layer, expert]
    if ex["format"] == "mxfp4":
      if part.endswith("_bias"):
        return block[meta["offset"]:meta["offset"] + 4 * n].view(np.float32)
      rows, cols = meta["shape"]
      return block[meta["offset"]:meta["offset"] + n // 2].reshape(rows, cols // 2)
    if ex["format"] == "int4":  # its codes [out, in/2]; expert_scale: its row parameters
      rows, cols = meta["shape"]
      return block.view(np.uint8)[meta["offset"]:meta["offset"] + n // 2].reshape(rows, cols // 2)
    start = meta["offset"] // block.dtype.itemsize
    return block[start:start + n].reshape(meta["shape"])

  def expert_scale(self, layer: int, expert: int, part: str) -> np.ndarray:
    """The float32 row scales of one part of an int8 bank, the uint8 E8M0 block scales
    [out, in/32] of an mxfp4 bank, or the uint8 row parameters [out, 8 + in/16] of an int4
    bank (``quant.int4_parts``)."""
    ex = self.index["experts"]
    if ex["format"] == "int4":
      meta = next(p for p in ex["params"] if p["name"] == part)
      rows, width = meta["shape"]
      block = self.expert_bank()[layer, expert].view(np.uint8)
      return block[meta["offset"]:meta["offset"] + rows * width].reshape(rows, width)
    if ex["format"] not in ("int8", "mxfp4"):
      raise FTWError(f"{self.path} stores {ex['format']} experts, which have no scales")
    meta = next(p for p in ex["scales"] if p["name"] == part)
    block = self.expert_bank()[layer, expert].view(np.uint8)
    if ex["format"] == "mxfp4":
      rows, blocks = meta["shape"]
      return block[meta["offset"]:meta["offset"] + rows * blocks].reshape(rows, blocks)
    return block[meta["offset"]:meta["offset"] + 4 * meta["shape"][0]].view(np.float32)

  def verify(self, progress: Callable[[Iterable], Iterable] | None = None) -> None:
    """Checks every CRC-32; raises FTWChecksumError naming the first bad tensor or layer."""
    progress = progress or (lambda x: x)
    for name in progress(list(self.index["tensors"])):
      t = self.index["tensors"][name]
      raw = self._maps[t["file"]][t["offset"]:t["offset"] + t["nbytes"]]
      if _crc32(raw) != t["crc32"]:
        raise FTWChecksumError(
            f"checksum mismatch in tensor {name} of {self.path}: the file is corrupt; convert "
            "the checkpoint again")
    ex = self.index["experts"]
    layer_bytes = ex["num_experts"] * ex["block_bytes"]
    bank = self._maps[ex["file"]]
    for layer in range(ex["num_layers"]):
      start = ex["offset"] + layer * layer_bytes
      if _crc32(bank[start:start + layer_bytes]) != ex["layer_crc32"][layer]:
        raise FTWChecksumError(
            f"checksum mismatch in the experts of layer {layer} of {self.path}: the file is "
            "corrupt; convert the checkpoint again")

  @property
  def fingerprint(self) -> str | None:
    return self.index.get("source", {}).get("fingerprint")
