"""ftjax_dense_quantized (xla_ffi/dense.cc): int8, int4 and mxfp4 dense weights against float64
numpy on the dequantised weights, on every ISA; the XLA dequantisation; bad input."""

import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.kernels import dense
from ftjax.utils import dense_quant
from ftjax.utils.dense_quant import QuantizedMatrix

F32 = np.dtype(np.float32)
FORMATS = ("int8", "int4", "mxfp4")

# (tokens, C, O): C a multiple of 32 (mxfp4, int4); the dot kernels up to the packed GEMM's
# threshold
# (8 to 16 tokens by ISA), the packed GEMM above it (groups of 16, tiles of 64, a half group);
# O not a multiple of the row tiles; one GEMV long enough for several tasks per worker.
CASES = {
    "gemv": (1, 64, 40),
    "gemv_rows_odd": (1, 2048, 1003),
    "gemv_many_tasks": (1, 512, 9000),
    "tokens_5": (5, 96, 70),
    # the 4-bit fused kernels for up to 8 tokens (AVX-512): passes of up to 4 tokens, chunks of
    # 2048 inputs, each with a tail of blocks short of a group of 4
    "tokens_2_chunks": (2, 4160, 19),
    "tokens_4_chunks": (4, 2080, 37),
    "tokens_7": (7, 1056, 21),
    "tokens_8": (8, 160, 33),
    "tokens_17_half_group": (17, 64, 23),
    "tokens_65_second_tile": (65, 128, 11),
    "tokens_300": (300, 96, 200),
    "wide_rows": (70, 2048, 3),
    # int8 beyond 2^20 weights: a few tokens take the int8 dot kernel and the scales after
    # the sums (smaller ones, the rows dequantised to float32 first)
    "tokens_5_large": (5, 1024, 1100),
}


def rng_for(*labels):
  return np.random.default_rng(zlib.crc32(repr(labels).encode()))


def make(case, fmt, *labels):
  T, C, O = CASES[case]
  rng = rng_for(case, fmt, *labels)
  x = rng.standard_normal((T, C)).astype(np.float32)
  w = (rng.standard_normal((O, C)) / np.sqrt(C)).astype(np.float32)
  w[0] = 0.0  # an all-zero row: scale 0 (int8), exponent 127 (mxfp4), min 0 (int4)
  return x, dense_quant.quantize(w, fmt, 1)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_matches_float64_reference(case, fmt, isa, assert_close):
  x, q = make(case, fmt)
  y = dense(x, q)
  ref = x.astype(np.float64) @ dense_quant.dequantize_np(q).T
  assert y.shape == ref.shape
  assert_close(y, ref, F32)


@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
@pytest.mark.parametrize("isa", ["avx512"], indirect=True)
def test_a_token_gets_the_same_sums_beside_up_to_7_others(fmt, isa):
  """AVX-512's fused 4-bit kernels give each token the sums it gets alone, bit for bit,
  whatever pass it falls in (1 to 8 tokens: passes of 1-4): a speculative verify of k + 1
  tokens and a batch of up to 8 decode the same token as one-token steps."""
  del isa
  x, q = make("tokens_4_chunks", fmt)
  rng = rng_for("invariance", fmt)
  xs = rng.standard_normal((8, x.shape[1])).astype(np.float32)
  alone = np.stack([np.asarray(dense(xs[i:i + 1], q))[0] for i in range(8)])
  for tokens in range(2, 9):
    together = np.asarray(dense(xs[:tokens], q))
    np.testing.assert_array_equal(together, alone[:tokens], err_msg=f"{tokens} tokens")


BF16 = np.dtype(jnp.bfloat16)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", ["gemv", "tokens_17_half_group", "tokens_300", "wide_rows"])
def test_bf16_activations(case, fmt, isa, assert_close):
  """bf16_activations: prefill calls (above the bf16-pair GEMM's threshold) multiply x rounded
  to bf16 with the rows decoded to bf16, to the bf16-activation tolerance; where the ISA has
  no bf16 pairs, and for decode calls, the exact path."""
  x, q = make(case, fmt, "bf16")
  y = dense(x, q, bf16_activations=True)
  ref = x.astype(np.float64) @ dense_quant.dequantize_np(q).T
  assert_close(y, ref, BF16, bf16_activations=True)
  if isa != "avx512bf16" or CASES[case][0] == 1:
    np.testing.assert_array_equal(np.asarray(y), np.asarray(dense(x, q)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_xla_dequantisation_is_exact(fmt):
  _, q = make("tokens_5", fmt)
  np.testing.assert_array_equal(np.asarray(jax.jit(lambda q: q.dequantize())(q)),
                                dense_quant.dequantize_np(q, np.float32))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantisation_error_is_bounded(fmt):
  """int8: half a step of max|row| / 127 per weight; mxfp4: half the widest E2M1 gap (2 at
  scale 1, between 4 and 6) times the block's scale, itself at most max|block| / 3; int4: the
  search cuts at most 10% off either end of a block's range, so a weight is off by at most
  that cut plus half a step of the range / 15 (refits only lower the error they weigh)."""
  rng = rng_for("bound", fmt)
  w = rng.standard_normal((37, 128)).astype(np.float32)
  err = np.abs(dense_quant.dequantize_np(dense_quant.quantize(w, fmt, 1)) - w)
  if fmt == "int8":
    bound = np.abs(w).max(axis=1, keepdims=True) / 127 / 2 * (1 + 1e-6)
  elif fmt == "int4":
    blocks = w.reshape(37, 4, 32)
    span = np.maximum(blocks.max(axis=2), 0) - np.minimum(blocks.min(axis=2), 0)
    bound = np.repeat(span * (0.1 + 1 / 15), 32, axis=1)
  else:
    bound = np.repeat(np.abs(w).reshape(37, 4, 32).max(axis=2) / 3, 32, axis=1)
  assert np.all(err <= bound)


def test_int4_error_is_below_mxfp4s():
  """What int4 is for: its error, weighted as it is fitted, well under mxfp4's at 0.25 bits a
  weight more (measured 0.36x on Gaussian rows of varied scale)."""
  rng = rng_for("int4 vs mxfp4")
  w = (rng.standard_normal((64, 512)) * np.exp(rng.standard_normal((64, 1)))).astype(np.float32)
  mse = {fmt: np.mean((dense_quant.dequantize_np(dense_quant.quantize(w, fmt, 1)) - w) ** 2)
         for fmt in ("int4", "mxfp4")}
  assert mse["int4"] < 0.45 * mse["mxfp4"], mse


def test_multi_axis_weight_and_leading_dims(assert_close):
  """A weight [H, A, D] (two output axes) is the matrix [H·A, D]; x [B, T, D]."""
  rng = rng_for("axes")
  w = rng.standard_normal((4, 8, 64)).astype(np.float32)
  x = rng.standard_normal((2, 3, 64)).astype(np.float32)
  q = dense_quant.quantize(w, "mxfp4", 2)
  assert (q.rows, q.cols, q.shape) == (32, 64, (4, 8, 64))
  y = dense(x, q)
  ref = x.astype(np.float64) @ dense_quant.dequantize_np(q).reshape(32, 64).T
  assert y.shape == (2, 3, 32)
  assert_close(y, ref, F32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_vmap_over_x_is_one_call(fmt, assert_close):
  x, q = make("tokens_5", fmt)
  xb = np.stack([x, 2 * x, -x])
  jitted = jax.jit(jax.vmap(dense, in_axes=(0, None)))
  y = jitted(xb, q)
  for b in range(3):
    assert_close(y[b], xb[b].astype(np.float64) @ dense_quant.dequantize_np(q).T, F32)
  jaxpr = str(jax.make_jaxpr(jax.vmap(dense, in_axes=(0, None)))(xb, q))
  assert jaxpr.count("ftjax_dense_quantized") == 1 and "while" not in jaxpr, jaxpr


def test_embedding_rows_are_gathered_and_dequantised():
  rng = rng_for("rows")
  table = rng.standard_normal((50, 64)).astype(np.float32)
  q = jax.device_put(dense_quant.quantize(table, "int8", 1))
  ids = np.array([[3, 49], [0, 3]], np.int32)
  rows = jax.jit(lambda q, i: q.take_rows(i))(q, ids)
  np.testing.assert_array_equal(np.asarray(rows),
                                dense_quant.dequantize_np(q, np.float32)[ids])


BAD = {
    "x_width": (lambda x, q: (x[:, :32], q), "is not the 64 inputs"),
    "x_dtype": (lambda x, q: (x.astype(np.float64), q), "x must be float32"),
    "scales_shape": (lambda x, q: (x, QuantizedMatrix(q.data, q.scales[:-1], q.format, q.shape,
                                                       q.out_axes)), "scales must be"),
    "data_dtype": (lambda x, q: (x, QuantizedMatrix(q.data.view(np.int8), q.scales, "mxfp4",
                                                     q.shape, q.out_axes)), "data must be uint8"),
}


@pytest.mark.parametrize("bad", BAD)
def test_bad_input_is_named(bad):
  x, q = make("gemv", "mxfp4")
  change, message = BAD[bad]
  with pytest.raises(ValueError, match=message):
    dense(*change(x, q))


def test_formats_refuse_what_they_cannot_hold():
  with pytest.raises(ValueError, match="multiple of 32"):
    dense_quant.quantize(np.ones((4, 40), np.float32), "mxfp4", 1)
  with pytest.raises(ValueError, match="unknown dense format"):
    dense_quant.quantize(np.ones((4, 64), np.float32), "int3", 1)
  with pytest.raises(ValueError, match="multiple of 32"):
    dense_quant.quantize(np.ones((4, 40), np.float32), "int4", 1)
  with pytest.raises(ValueError, match="not finite"):
    dense_quant.quantize(np.full((4, 64), np.nan, np.float32), "int8", 1)
  assert dense_quant.quantize(np.ones((4, 40), jnp.bfloat16), "int8", 1).data.shape == (4, 40)
