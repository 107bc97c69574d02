"""Host dense matmul y = x @ w.T: the XLA FFI op `ftjax_dense` (C++ in xla_ffi/dense.cc).

For the big dense weights on the CPU backend (q/k/v/o projections, routers, shared experts,
lm_head), where XLA:CPU's bf16 matrix-vector products reach only a few GB/s. Weights are
[out, in] = [O, C] as everywhere in ftjax (O output features, C contracted input features:
the glossary's letters for a generic matrix; K and N mean top-k and cache slots). Decode (one
token) streams w at memory bandwidth, split over O across the threads; prefill (many tokens) is a blocked GEMM. Accumulation is
float32 and products are exact (bf16 weights widened to float32) unless bf16_activations=True
asks for vdpbf16ps on AVX-512-BF16 CPUs (relative error ~1e-2 of max|y|).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.kernels._registration import require, shape_and_dtype
from ftjax.utils import quant
from ftjax.utils.dense_quant import QuantizedMatrix

_WEIGHT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float32))


def dense(x, w, *, bf16_activations=False):
  """y = x @ w.T on the host.

  Args:
    x: [..., C] float32; leading dimensions are flattened into T rows.
    w: [O, C] bfloat16 or float32, [out, in] (may be traced; never closed over); or a
      ``QuantizedMatrix`` (int8 rows with float32 scales, mxfp4 or int4:
      ``ftjax.utils.dense_quant``) of C inputs, which the op ``ftjax_dense_quantized`` reads as
      stored (int8 widened exactly to float32 and each output scaled once; mxfp4 codes decoded
      times their scale, exact; int4 codes times their block's scale plus its min): the result
      is that of the dequantised weights to float32 rounding. With bf16_activations, a call of
      more tokens than the bf16-pair GEMM's threshold decodes each task's rows to bf16 (exact
      for int8 and mxfp4; int4 weights rounded to bf16 as x is) and multiplies x rounded to
      bf16 on vdpbf16ps or AMX tiles, as for bf16 weights; decode calls stay exact.
    bf16_activations: for bf16 w on a CPU with AVX-512-BF16, round x to bf16 and multiply
      with vdpbf16ps (twice the multiply-add rate for many rows; relative error ~1e-2 of
      max|y|). When False (the default) the products are exact, to ~1e-5.

  Returns:
    y: [..., O] float32.

  Raises:
    ValueError: naming the argument whose shape or dtype is wrong.

  Under jax.vmap with w unbatched, the batch joins the rows of one call; with w batched the
  calls run one after the other.
  """
  if isinstance(w, QuantizedMatrix):
    return _dense_quantized(x, w, bf16_activations)
  x_shape, x_dtype = shape_and_dtype("x", x)
  w_shape, w_dtype = shape_and_dtype("w", w)
  if len(x_shape) < 1:
    raise ValueError(f"x must have at least 1 dimension [..., C], got shape {x_shape}")
  if x_dtype != np.float32:
    raise ValueError(f"x must be float32, got {x_dtype}")
  if len(w_shape) != 2:
    raise ValueError(f"w must be 2-D [O, C], got shape {w_shape}")
  if w_dtype not in _WEIGHT_DTYPES:
    raise ValueError(f"w must be bfloat16 or float32, got {w_dtype}")
  if w_shape[1] != x_shape[-1]:
    raise ValueError(
      f"w must be [O, C] with C = {x_shape[-1]} from x's last dimension, got shape {w_shape}"
    )
  if not isinstance(bf16_activations, (bool, np.bool_)):
    raise ValueError(f"bf16_activations must be a bool, got {bf16_activations!r}")
  C = x_shape[-1]
  T = math.prod(x_shape[:-1])
  require("dense")
  y_to = _batchable_call(bool(bf16_activations))(jnp.reshape(x, (T, C)), w)
  return jnp.reshape(y_to, (*x_shape[:-1], w_shape[0]))


def _dense_quantized(x, w: QuantizedMatrix, bf16_activations):
  x_shape, x_dtype = shape_and_dtype("x", x)
  if len(x_shape) < 1 or x_dtype != np.float32:
    raise ValueError(f"x must be float32 [..., C], got {x_dtype} of shape {x_shape}")
  if x_shape[-1] != w.cols:
    raise ValueError(f"x's last dimension {x_shape[-1]} is not the {w.cols} inputs of the "
                     f"quantised weight of shape {w.shape}")
  if not isinstance(bf16_activations, (bool, np.bool_)):
    raise ValueError(f"bf16_activations must be a bool, got {bf16_activations!r}")
  want = {
      "int8": {"data": (np.int8, (w.rows, w.cols)), "scales": (np.float32, (w.rows,))},
      "mxfp4": {"data": (np.uint8, (w.rows, w.cols // 2)),
                "scales": (np.uint8, (w.rows, w.cols // 32))},
      "int4": {"data": (np.uint8, (w.rows, w.cols // 2)),
               "scales": (np.uint8, (w.rows, quant.int4_param_bytes(w.cols)))},
  }[w.format]
  for name, (dtype, shape) in want.items():
    got_shape, got_dtype = shape_and_dtype(name, getattr(w, name))
    if got_dtype != np.dtype(dtype) or tuple(got_shape) != shape:
      raise ValueError(f"a {w.format} weight's {name} must be {np.dtype(dtype)} {shape}, got "
                       f"{got_dtype} {tuple(got_shape)}")
  T = math.prod(x_shape[:-1])
  require("dense")
  y = _batchable_call(bool(bf16_activations))(jnp.reshape(x, (T, w.cols)), w.data, w.scales)
  return jnp.reshape(y, (*x_shape[:-1], w.rows))


def _call(x_tc, w, bf16_activations):
  """The op on x [T, C] and the weight's arrays ``w``: (w [O, C],) for ``ftjax_dense``,
  (data, scales) for ``ftjax_dense_quantized``."""
  out = jax.ShapeDtypeStruct((x_tc.shape[0], w[0].shape[0]), jnp.float32)
  name = "ftjax_dense_quantized" if len(w) == 2 else "ftjax_dense"
  return jax.ffi.ffi_call(name, out, vmap_method="sequential")(
      x_tc, *w, bf16_activations=bf16_activations)


@functools.cache
def _batchable_call(bf16_activations):
  """The op, with a vmap rule: with the weight unbatched the batch joins the token rows of one
  call; with it batched the calls run one after the other."""

  @jax.custom_batching.custom_vmap
  def dense_2d(x_tc, *w):
    return _call(x_tc, w, bf16_activations)

  @dense_2d.def_vmap
  def dense_2d_vmap(axis_size, in_batched, x_btc, *w):
    x_batched, w_batched = in_batched[0], any(in_batched[1:])
    if not w_batched:
      B, T, C = x_btc.shape
      y = dense_2d(jnp.reshape(x_btc, (B * T, C)), *w)
      return jnp.reshape(y, (B, T, w[0].shape[0])), True
    if not x_batched:
      x_btc = jnp.broadcast_to(x_btc, (axis_size, *x_btc.shape))
    w = tuple(a if b else jnp.broadcast_to(a, (axis_size, *a.shape))
              for a, b in zip(w, in_batched[1:]))
    return jax.lax.map(lambda xw: dense_2d(xw[0], *xw[1]), (x_btc, w)), True

  return dense_2d
