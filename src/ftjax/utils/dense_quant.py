"""Quantised dense weights: the matrices outside the routed experts (attention and Gated
DeltaNet projections, shared experts, the MTP projection, lm_head, embeddings) stored in 8 or 4
bits (docs/ftw.md, "Dense formats").

A weight of logical shape ``[*out, *in]`` (``out_axes`` leading output axes, as
``ftjax.model.layers.linear`` takes it) is quantised as the matrix ``[O, C]`` (O = prod(out),
C = prod(in)), row by row:

* ``int8``: ``data`` int8 ``[O, C]`` and ``scales`` float32 ``[O]``, one per output row,
  symmetric (``ftjax.utils.quant.quantize_rows``, the int8 experts' rule): ``w[r, i] =
  scales[r] · data[r, i]``. 8.0 bits a weight plus 32 per row.
* ``mxfp4``: ``data`` uint8 ``[O, C/2]`` of E2M1 codes and ``scales`` uint8 ``[O, C/32]`` of
  E8M0 exponents, one per 32 inputs (``ftjax.utils.quant.quantize_mxfp4``, the mxfp4 experts'
  layout): ``w[r, i] = E2M1[code] · 2**(e - 127)``. 4.25 bits a weight; C must be a multiple
  of 32.
* ``int4``: ``data`` uint8 ``[O, C/2]`` of unsigned 4-bit codes q and ``scales`` uint8
  ``[O, 8 + C/16]`` of each row's parameters: float32 steps d and dm, then a uint8 scale s and an
  int8 min m per 32 inputs (``ftjax.utils.quant.quantize_int4``): ``w[r, i] = d·s·q + dm·m``.
  4.5 bits a weight plus 64 per row, as llama.cpp's Q4_K; C must be a multiple of 32.

``QuantizedMatrix`` is the pytree that stands for such a weight in a model's parameters (an
``nnx.Param``'s value): its arrays are the leaves, its format and shapes static. The host kernel
(``ftjax.kernels.dense``) reads it as stored; the XLA path dequantises it (``dequantize``):
exactly: every dequantised weight is a float32 value (int4's by its definition,
``ftjax.utils.quant``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.utils import quant

DENSE_FORMATS = ("int8", "int4", "mxfp4")


@dataclasses.dataclass(frozen=True)
class QuantizedMatrix:
  """A quantised weight of logical shape ``shape`` = ``[*out, *in]`` (module docstring)."""
  data: jax.Array | np.ndarray
  scales: jax.Array | np.ndarray
  format: str
  shape: tuple[int, ...]
  out_axes: int

  @property
  def rows(self) -> int:
    return math.prod(self.shape[:self.out_axes])

  @property
  def cols(self) -> int:
    return math.prod(self.shape[self.out_axes:])

  @property
  def dtype(self) -> np.dtype:
    """The dtype a float weight of this shape would have after dequantisation: float32."""
    return np.dtype(np.float32)

  @property
  def nbytes(self) -> int:
    return int(np.dtype(self.data.dtype).itemsize * math.prod(self.data.shape) +
               np.dtype(self.scales.dtype).itemsize * math.prod(self.scales.shape))

  def dequantize(self) -> jax.Array:
    """The float32 weights ``[*out, *in]`` (exact), in XLA."""
    if self.format == "int8":
      w = (self.data.reshape(self.rows, self.cols).astype(jnp.float32) *
           self.scales.reshape(self.rows, 1))
    elif self.format == "int4":
      blocks = self.cols // quant.INT4_BLOCK
      params = self.scales.reshape(self.rows, quant.int4_param_bytes(self.cols))
      steps = jax.lax.bitcast_convert_type(params[:, :8].reshape(self.rows, 2, 4), jnp.float32)
      s = params[:, 8:8 + blocks].astype(jnp.float32)
      m = jax.lax.bitcast_convert_type(params[:, 8 + blocks:], jnp.int8).astype(jnp.float32)
      scale = steps[:, 0:1] * s  # [rows, blocks], exact (quant: d has 12 significant bits)
      offset = steps[:, 1:2] * m  # exact: dm has 16
      codes = self.data.reshape(self.rows, blocks, quant.INT4_BLOCK // 2)
      q = jnp.stack([codes & 15, codes >> 4], axis=-1).reshape(
          self.rows, blocks, quant.INT4_BLOCK).astype(jnp.float32)
      w = scale[..., None] * q + offset[..., None]
    else:
      lut = jnp.asarray(quant.E2M1_VALUES)
      codes = self.data.reshape(self.rows, self.cols // quant.MXFP4_BLOCK, quant.MXFP4_BLOCK // 2)
      values = jnp.stack([lut[codes & 15], lut[codes >> 4]], axis=-1)
      exponents = self.scales.reshape(self.rows, self.cols // quant.MXFP4_BLOCK)
      scale = jnp.ldexp(jnp.float32(1), exponents.astype(jnp.int32) - 127)
      w = values * scale[..., None, None]
    return w.reshape(self.shape)

  def take_rows(self, ids: jax.Array) -> jax.Array:
    """Rows ``ids`` of a weight with one output axis (an embedding table ``[V, D]``),
    dequantised to float32 ``[*ids.shape, D]``: only those rows are read."""
    if self.out_axes != 1:
      raise ValueError(f"take_rows needs a weight with one output axis, got shape {self.shape} "
                       f"with {self.out_axes}")
    data = jnp.take(self.data, ids, axis=0)
    scales = jnp.take(self.scales, ids, axis=0)
    return dataclasses.replace(self, data=data, scales=scales,
                               shape=(*ids.shape, self.cols), out_axes=ids.ndim).dequantize()


jax.tree_util.register_dataclass(QuantizedMatrix, data_fields=["data", "scales"],
                                 meta_fields=["format", "shape", "out_axes"])


def check_format(fmt: str, shape: tuple[int, ...], out_axes: int) -> str | None:
  """Why ``fmt`` cannot hold a weight of ``shape`` (None when it can)."""
  if fmt not in DENSE_FORMATS:
    return f"unknown dense format {fmt!r}; choose one of {', '.join(DENSE_FORMATS)}"
  if not 1 <= out_axes < len(shape):
    return f"a weight of shape {shape} with {out_axes} output axes is not a matrix"
  cols = math.prod(shape[out_axes:])
  if fmt in ("mxfp4", "int4") and cols % quant.MXFP4_BLOCK:
    return (f"{fmt} needs the inputs of each row (here {cols}) to be a multiple of "
            f"{quant.MXFP4_BLOCK}")
  return None


def quantize(w: np.ndarray, fmt: str, out_axes: int) -> QuantizedMatrix:
  """A float weight ``[*out, *in]`` (bfloat16, float32 or float64 numpy) quantised to ``fmt``
  (numpy arrays; module docstring for the rules)."""
  w = np.asarray(w)
  problem = check_format(fmt, tuple(w.shape), out_axes)
  if problem:
    raise ValueError(problem)
  rows = math.prod(w.shape[:out_axes])
  matrix = w.reshape(rows, -1)
  if fmt == "int8":
    data, scales = quant.quantize_rows(matrix)
  elif fmt == "int4":
    data, scales = quant.quantize_int4(matrix)
  else:
    data, scales = quant.quantize_mxfp4(matrix)
  return QuantizedMatrix(data, scales, fmt, tuple(int(n) for n in w.shape), out_axes)


def dequantize_np(q: QuantizedMatrix, dtype=np.float64) -> np.ndarray:
  """The weights of ``q`` (numpy arrays or concrete jax arrays) in ``dtype``, exact: the
  reference the kernels are checked against."""
  data = np.asarray(q.data)
  scales = np.asarray(q.scales)
  if q.format == "int8":
    w = data.astype(dtype) * scales.astype(dtype)[:, None]
  elif q.format == "int4":
    w = quant.dequantize_int4(data.reshape(q.rows, -1), scales.reshape(q.rows, -1), dtype)
  else:
    codes = np.stack([data & 15, data >> 4], axis=-1).reshape(q.rows, q.cols)
    values = quant.E2M1_VALUES[codes].astype(dtype)
    scale = np.ldexp(1.0, scales.astype(np.int64) - 127).astype(dtype)
    w = values * np.repeat(scale, quant.MXFP4_BLOCK, axis=1)
  return w.reshape(q.shape)
