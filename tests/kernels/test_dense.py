"""ftjax_dense (xla_ffi/dense.cc) against float64 numpy, on every ISA."""

import dataclasses
import functools
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.kernels import dense

BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(np.float32)
WEIGHT_DTYPES = [F32, BF16]


def rng_for(*labels):
  return np.random.default_rng(zlib.crc32(repr(labels).encode()))


def reference_dense(x, w):
  """float64 x @ w.T from the same (bf16-rounded) weights."""
  return np.asarray(x, np.float64) @ np.asarray(w).astype(np.float64).T


@dataclasses.dataclass(frozen=True)
class Case:
  x_shape: tuple  # [..., K]
  N: int


CASES = {
  # GEMV (decode)
  "tokens_1": Case((1, 64), 40),
  "vector_x": Case((96,), 24),
  "tokens_1_rows_not_multiple_of_8": Case((1, 2048), 1003),
  "tokens_1_odd_k": Case((1, 67), 37),
  "tokens_1_k_below_vector": Case((1, 5), 9),
  # small batches and GEMM (prefill): the dot kernels up to 8 tokens (AVX2) or 16 (AVX-512), the
  # packed-activation GEMM above, in groups of 16 tokens (the last one at most 8: a half group)
  # and tiles of 64; rows in blocks of 6 (AVX2) and 8 (AVX-512)
  "tokens_5": Case((5, 130), 70),
  "tokens_5_odd_k": Case((5, 33), 19),
  "tokens_9_odd_k": Case((9, 35), 31),
  "tokens_16": Case((16, 37), 23),
  "tokens_17_half_group": Case((17, 37), 23),
  "tokens_24_half_group": Case((24, 64), 13),
  "tokens_33_odd_k": Case((33, 19), 29),
  "tokens_65_second_tile": Case((65, 40), 11),
  "tokens_100_odd": Case((100, 51), 47),
  "tokens_300": Case((300, 96), 200),
  "tokens_300_odd": Case((300, 131), 77),
  "leading_dims": Case((2, 3, 48), 17),
  "wide_rows_few_outputs": Case((70, 2048), 3),
  # bf16 on AVX2: inputs widened 512 at a time (two whole blocks, then 76: a tail of 4)
  "tokens_40_input_blocks_odd_tail": Case((40, 1100), 13),
}


def make_inputs(case, dtype, *labels):
  rng = rng_for(case, dtype.name, *labels)
  K = case.x_shape[-1]
  x = rng.standard_normal(case.x_shape).astype(np.float32)
  w = (rng.standard_normal((case.N, K)) / np.sqrt(K)).astype(np.float32).astype(dtype)
  return x, w


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("case_name", CASES)
def test_matches_reference(case_name, dtype, bf16_activations, isa, assert_close):
  case = CASES[case_name]
  x, w = make_inputs(case, dtype)
  y = dense(x, w, bf16_activations=bf16_activations)
  assert y.shape == (*case.x_shape[:-1], case.N)
  assert_close(y, reference_dense(x, w), dtype, bf16_activations)


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=lambda d: d.name)
def test_zero_width_gives_zeros(dtype):
  y = dense(np.ones((3, 0), np.float32), np.ones((4, 0), dtype))
  np.testing.assert_array_equal(np.asarray(y), np.zeros((3, 4), np.float32))


def test_under_jit_no_retrace_on_new_data(assert_close):
  traces = 0

  @jax.jit
  def project(x, w):
    nonlocal traces
    traces += 1
    return dense(x, w)

  for call in range(2):
    x, w = make_inputs(CASES["tokens_5"], BF16, call)
    assert_close(project(x, w), reference_dense(x, w), BF16)
  assert traces == 1


@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=lambda d: d.name)
def test_vmap_over_x_is_one_call(dtype, assert_close):
  B = 3
  inputs = [make_inputs(CASES["tokens_5"], dtype, "vmap", b) for b in range(B)]
  x_btk = np.stack([x for x, _ in inputs])
  w = inputs[0][1]
  batched = jax.jit(jax.vmap(dense, in_axes=(0, None)))
  y_btn = batched(x_btk, w)
  for b in range(B):
    assert_close(y_btn[b], reference_dense(x_btk[b], w), dtype)
  jaxpr = str(jax.make_jaxpr(jax.vmap(dense, in_axes=(0, None)))(x_btk, w))
  assert jaxpr.count("ftjax_dense") == 1 and "while" not in jaxpr, jaxpr


def test_vmap_over_w(assert_close):
  B = 2
  inputs = [make_inputs(CASES["tokens_5_odd_k"], BF16, "vmap w", b) for b in range(B)]
  w_bnk = np.stack([w for _, w in inputs])
  x = inputs[0][0]
  y_btn = jax.vmap(dense, in_axes=(None, 0))(x, w_bnk)
  for b in range(B):
    assert_close(y_btn[b], reference_dense(x, w_bnk[b]), BF16)


# --- bad input --------------------------------------------------------------------------------

PYTHON_ERRORS = {
  "x_not_array": (dict(x=[1.0, 2.0]), "x must be an array"),
  "x_scalar": (dict(x=np.float32(1)), "x must have at least 1 dimension"),
  "x_not_float32": (dict(x=np.zeros((2, 4), np.float64)), "x must be float32"),
  "w_not_2d": (dict(w=np.zeros((3, 2, 4), np.float32)), "w must be 2-D [O, C]"),
  "w_dtype": (dict(w=np.zeros((3, 4), np.int8)), "w must be bfloat16 or float32"),
  "w_wrong_k": (dict(w=np.zeros((3, 5), np.float32)), "w must be [O, C] with C = 4"),
  "bf16_activations_not_bool": (dict(bf16_activations="yes"), "bf16_activations must be a bool"),
}


@pytest.mark.parametrize("error_name", PYTHON_ERRORS)
def test_python_side_rejects_bad_input(error_name):
  changes, message = PYTHON_ERRORS[error_name]
  arguments = dict(x=np.zeros((2, 4), np.float32), w=np.zeros((3, 4), np.float32)) | changes
  with pytest.raises(ValueError, match=re.escape(message)):
    dense(**arguments)


def call_kernel_directly(x, w, result_shape):
  call = jax.ffi.ffi_call(
    "ftjax_dense", jax.ShapeDtypeStruct(result_shape, jnp.float32), vmap_method="sequential"
  )
  return jax.block_until_ready(call(x, w, bf16_activations=False))


KERNEL_ERRORS = {
  "x_not_2d": (
    dict(x=np.zeros((1, 2, 4), np.float32)),
    "x must be 2-D [T, C], got shape [1, 2, 4]",
  ),
  "w_wrong_k": (dict(w=np.zeros((3, 5), np.float32)), "w must be [O, C] with C = 4 from x"),
  "w_not_2d": (dict(w=np.zeros((3,), np.float32)), "w must be [O, C] with C = 4 from x"),
  "w_dtype": (dict(w=np.zeros((3, 4), np.int32)), "w must be bfloat16 or float32"),
  "result_shape": (dict(result_shape=(2, 4)), "result y must be [T, O] = [2, 3], got [2, 4]"),
}


@pytest.mark.parametrize("error_name", KERNEL_ERRORS)
def test_kernel_rejects_bad_input(error_name):
  changes, message = KERNEL_ERRORS[error_name]
  arguments = dict(
    x=np.zeros((2, 4), np.float32), w=np.zeros((3, 4), np.float32), result_shape=(2, 3)
  ) | changes
  with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape("ftjax_dense: " + message)):
    call_kernel_directly(**arguments)
