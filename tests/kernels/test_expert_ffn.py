"""ftjax_expert_ffn (xla_ffi/expert_ffn.cc) against the float64 reference (reference.py)."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.kernels import ExpertVariant, expert_ffn

import reference
from expert_cases import Case, make_routes, rng_for

BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(np.float32)
BANK_DTYPES = [F32, BF16]


def make_bank(rng, *, L, E, F, D, dtype, pad=0, layers_in_use=None):
  """[L, E, P] expert blocks, P = 3*F*D + pad.

  Padding, and every layer not in `layers_in_use`, is NaN: a kernel that reads them
  returns NaN.
  """
  gate_led = rng.standard_normal((L, E, F * D)) / np.sqrt(D)
  up_led = rng.standard_normal((L, E, F * D)) / np.sqrt(D)
  down_led = rng.standard_normal((L, E, D * F)) / np.sqrt(F)
  padding_lep = np.full((L, E, pad), np.nan)
  bank = np.concatenate([gate_led, up_led, down_led, padding_lep], axis=-1)
  if layers_in_use is not None:
    unused = np.setdiff1d(np.arange(L), layers_in_use)
    bank[unused] = np.nan
  return bank.astype(np.float32).astype(dtype)


CASES = {
  # decode form (T <= 8)
  "top_1": Case(T=5, K=1),
  "top_8": Case(T=6, K=8, E=16, skip_fraction=0.25),
  "tokens_1": Case(T=1, K=2),
  "tokens_1_top_8": Case(T=1, K=8, E=32, D=64, F=48),
  "tokens_3": Case(T=3, K=2),
  "duplicate_experts_across_tokens": Case(T=8, K=2, shared=True),
  "odd_widths": Case(T=4, K=3, E=5, D=67, F=45),
  "padded_blocks": Case(T=4, K=2, pad=7),
  "layer_2_of_4": Case(T=4, K=2, L=4, layer=2),
  "several_chunks": Case(T=3, K=2, D=256, F=96),
  # grouped prefill form (T > 8)
  "tokens_9": Case(T=9, K=2),
  "tokens_64": Case(T=64, K=2),
  "tokens_777": Case(T=777, K=2),  # ~194 tokens per expert: several token tiles
  "grouped_top_8": Case(T=40, K=8, E=16, skip_fraction=0.25),
  "grouped_duplicates": Case(T=70, K=2, E=4, shared=True),
  "grouped_odd_widths": Case(T=40, K=3, E=5, D=67, F=45),
  "grouped_padded_layer_1": Case(T=30, K=2, L=2, layer=1, pad=5),
  "grouped_several_chunks": Case(T=100, K=2, D=256, F=96),
}


def make_inputs(case, bank_dtype, *labels):
  rng = rng_for(case, bank_dtype.name, *labels)
  x = rng.standard_normal((case.T, case.D)).astype(np.float32)
  ids, weights = make_routes(
    rng, T=case.T, E=case.E, K=case.K, skip_fraction=case.skip_fraction, shared=case.shared
  )
  bank = make_bank(
    rng,
    L=case.L,
    E=case.E,
    F=case.F,
    D=case.D,
    dtype=bank_dtype,
    pad=case.pad,
    layers_in_use=[case.layer],
  )
  return x, ids, weights, bank


@pytest.mark.parametrize("bank_dtype", BANK_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("case_name", CASES)
def test_matches_reference(case_name, bank_dtype, bf16_activations, isa, assert_close):
  case = CASES[case_name]
  x, ids, weights, bank = make_inputs(case, bank_dtype)
  y = expert_ffn(
    x, ids, weights, bank, case.layer, ffn_dim=case.F, bf16_activations=bf16_activations
  )
  ref = reference.routed_experts(x, ids, weights, bank, case.layer, case.F)
  assert_close(y, ref, bank_dtype, bf16_activations)


@pytest.mark.parametrize("bank_dtype", BANK_DTYPES, ids=lambda d: d.name)
def test_grouped_route_counts_around_the_tiles(bank_dtype, bf16_activations, isa, assert_close):
  """Experts with 1..90 routes: every way a group of 16 and a tile of 64 routes can be cut
  (full groups, a last group of at most 8, the dot-product path up to 8 routes on AVX2 and 16 on
  AVX-512)."""
  counts = [1, 8, 9, 16, 17, 24, 25, 32, 40, 41, 48, 56, 57, 64, 65, 72, 90]
  E, D, F = len(counts), 41, 25  # odd: the last input pair is half padding
  ids = np.repeat(np.arange(E), counts).astype(np.int32)[:, None]  # K = 1
  rng = rng_for("route counts", bank_dtype.name)
  ids = ids[rng.permutation(len(ids))]
  T = len(ids)
  x = rng.standard_normal((T, D)).astype(np.float32)
  weights = rng.random((T, 1)).astype(np.float32)
  bank = make_bank(rng, L=1, E=E, F=F, D=D, dtype=bank_dtype)
  y = expert_ffn(x, ids, weights, bank, 0, ffn_dim=F, bf16_activations=bf16_activations)
  ref = reference.routed_experts(x, ids, weights, bank, 0, F)
  assert_close(y, ref, bank_dtype, bf16_activations)


@pytest.mark.parametrize("bank_dtype", BANK_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("T", [3, 20], ids=["decode", "grouped"])
def test_all_routes_skipped_gives_exact_zeros(bank_dtype, T, bf16_activations, isa):
  D, F, E, K = 16, 8, 4, 2
  x = rng_for("skipped").standard_normal((T, D)).astype(np.float32)
  ids = np.full((T, K), -1, np.int32)
  weights = np.ones((T, K), np.float32)
  bank = np.full((1, E, 3 * F * D), np.nan, np.float32).astype(bank_dtype)  # never read
  y = np.asarray(expert_ffn(x, ids, weights, bank, 0, ffn_dim=F, bf16_activations=bf16_activations))
  assert y.dtype == np.float32
  np.testing.assert_array_equal(y, np.zeros((T, D), np.float32))


@pytest.mark.parametrize("bank_dtype", BANK_DTYPES, ids=lambda d: d.name)
def test_under_jit_with_traced_bank_and_layer(bank_dtype, assert_close):
  case = CASES["layer_2_of_4"]
  x, ids, weights, bank = make_inputs(case, bank_dtype, "jit")
  jitted = jax.jit(functools.partial(expert_ffn, ffn_dim=case.F))
  y = jitted(x, ids, weights, jnp.asarray(bank), jnp.int32(case.layer))
  ref = reference.routed_experts(x, ids, weights, bank, case.layer, case.F)
  assert_close(y, ref, bank_dtype)


def test_second_jitted_call_with_new_data_does_not_retrace(assert_close):
  case = CASES["layer_2_of_4"]
  traces = 0

  @functools.partial(jax.jit, static_argnames="ffn_dim")
  def step(x, ids, weights, bank, layer, *, ffn_dim):
    nonlocal traces
    traces += 1
    return expert_ffn(x, ids, weights, bank, layer, ffn_dim=ffn_dim)

  for call, layer in enumerate([case.layer, case.L - 1]):
    x, ids, weights, bank = make_inputs(dataclasses.replace(case, layer=layer), BF16, call)
    y = step(x, ids, weights, bank, jnp.int32(layer), ffn_dim=case.F)
    ref = reference.routed_experts(x, ids, weights, bank, layer, case.F)
    assert_close(y, ref, BF16)
  assert traces == 1


@pytest.mark.parametrize("bank_dtype", BANK_DTYPES, ids=lambda d: d.name)
def test_vmap_over_a_leading_batch_axis(bank_dtype, assert_close):
  case = CASES["top_8"]
  B = 3
  inputs = [make_inputs(case, bank_dtype, "vmap", b) for b in range(B)]
  x_btd, ids_btk, weights_btk = (np.stack([inp[i] for inp in inputs]) for i in range(3))
  bank = inputs[0][3]
  batched = jax.vmap(functools.partial(expert_ffn, ffn_dim=case.F), in_axes=(0, 0, 0, None, None))
  y_btd = batched(x_btd, ids_btk, weights_btk, bank, case.layer)
  assert y_btd.shape == (B, case.T, case.D)
  # bank and layer unbatched: the batch joins the tokens of one call, no loop.
  jaxpr = str(jax.make_jaxpr(batched)(x_btd, ids_btk, weights_btk, bank, case.layer))
  assert jaxpr.count("ftjax_expert_ffn") == 1 and "while" not in jaxpr, jaxpr
  for b in range(B):
    ref = reference.routed_experts(x_btd[b], ids_btk[b], weights_btk[b], bank, case.layer, case.F)
    assert_close(y_btd[b], ref, bank_dtype)


def test_vmap_over_layer_under_jit(assert_close):
  case = Case(T=4, K=2, L=3)
  x, ids, weights, _ = make_inputs(case, BF16, "vmap layer")
  bank = make_bank(rng_for("vmap layer bank"), L=case.L, E=case.E, F=case.F, D=case.D, dtype=BF16)
  layers = jnp.array([2, 0, 1], jnp.int32)
  per_layer = jax.jit(
    jax.vmap(functools.partial(expert_ffn, ffn_dim=case.F), in_axes=(None, None, None, None, 0))
  )
  y_ltd = per_layer(x, ids, weights, bank, layers)
  for i, layer in enumerate(np.asarray(layers)):
    ref = reference.routed_experts(x, ids, weights, bank, layer, case.F)
    assert_close(y_ltd[i], ref, BF16)


# --- bad input --------------------------------------------------------------------------------

T, D, F, E, K, L = 3, 8, 4, 4, 2, 2


def good_arguments():
  rng = rng_for("good arguments")
  ids, weights = make_routes(rng, T=T, E=E, K=K)
  return dict(
    x=rng.standard_normal((T, D)).astype(np.float32),
    ids=ids,
    weights=weights,
    bank=make_bank(rng, L=L, E=E, F=F, D=D, dtype=F32),
    layer=1,
    ffn_dim=F,
  )


PYTHON_ERRORS = {
  "x_not_2d": (dict(x=np.zeros((1, T, D), np.float32)), "x must be 2-D [T, D]"),
  "x_not_float32": (dict(x=np.zeros((T, D), np.float64)), "x must be float32"),
  "ids_wrong_tokens": (dict(ids=np.zeros((T + 1, K), np.int32)), "ids must be [T, K] with T = 3"),
  "ids_not_int32": (dict(ids=np.zeros((T, K), np.int64)), "ids must be int32"),
  "weights_wrong_shape": (
    dict(weights=np.zeros((T, K + 1), np.float32)),
    "weights must be [T, K]",
  ),
  "weights_not_float32": (dict(weights=np.zeros((T, K), BF16)), "weights must be float32"),
  "bank_not_3d": (dict(bank=np.zeros((E, 3 * F * D), np.float32)), "bank must be 3-D"),
  "bank_dtype": (
    dict(bank=np.zeros((L, E, 3 * F * D), np.int16)),
    "bank must be bfloat16, float32, int8",
  ),
  "bank_too_narrow": (
    dict(bank=np.zeros((L, E, 3 * F * D - 1), np.float32)),
    "bank's last dimension P = 95 is smaller than 3 * ffn_dim * D",
  ),
  "ffn_dim_zero": (dict(ffn_dim=0), "ffn_dim must be positive"),
  "ffn_dim_not_int": (dict(ffn_dim=4.0), "ffn_dim must be a Python int"),
  "bf16_activations_not_bool": (dict(bf16_activations=1), "bf16_activations must be a bool"),
  "layer_too_large": (dict(layer=L), "layer = 2 is outside [0, L) with L = 2"),
  "layer_negative": (dict(layer=np.int32(-1)), "layer = -1 is outside [0, L) with L = 2"),
  "layer_not_scalar": (dict(layer=jnp.zeros((1,), jnp.int32)), "layer must be an integer scalar"),
  "layer_float": (dict(layer=jnp.float32(1)), "layer must be an integer scalar"),
  "no_room_for_biases": (
    dict(variant=ExpertVariant(bias=True)),
    "bank's last dimension P = 96 is smaller than 3 * ffn_dim * D = 3 * 4 * 8 plus the biases "
    "2 * ffn_dim + D = 16",
  ),
}


@pytest.mark.parametrize("error_name", PYTHON_ERRORS)
def test_python_side_rejects_bad_input(error_name):
  changes, message = PYTHON_ERRORS[error_name]
  arguments = good_arguments() | changes
  with pytest.raises(ValueError, match=re.escape(message)):
    expert_ffn(**arguments)


def call_kernel_directly(x, ids, weights, bank, layer, ffn_dim, result_shape=None,
                         activation="swiglu", biases=False):
  """Bypasses the Python checks, so that the C++ ones are the ones that fire."""
  call = jax.ffi.ffi_call(
    "ftjax_expert_ffn",
    jax.ShapeDtypeStruct(result_shape or x.shape, jnp.float32),
    vmap_method="sequential",
  )
  y = call(
    x, ids, weights, bank, jnp.asarray(layer, jnp.int32), ffn_dim=np.int64(ffn_dim),
    bf16_activations=False, int8_activations=False, activation=activation,
    alpha=np.float32(1.702), limit=np.float32(7.0), biases=biases,
  )
  return jax.block_until_ready(y)


KERNEL_ERRORS = {
  "id_too_large": (
    dict(ids=np.array([[0, 1], [E, 2], [3, -1]], np.int32)),
    "ids[1, 0] = 4 is outside [-1, E) with E = 4",
  ),
  "id_below_minus_one": (
    dict(ids=np.array([[0, 1], [2, 3], [3, -2]], np.int32)),
    "ids[2, 1] = -2 is outside [-1, E) with E = 4",
  ),
  "layer_too_large": (dict(layer=L), "layer = 2 is outside [0, L) with L = 2"),
  "layer_negative": (dict(layer=-1), "layer = -1 is outside [0, L) with L = 2"),
  "layer_not_scalar": (dict(layer=np.ones((1,), np.int32)), "layer must be an int32 scalar"),
  "x_not_2d": (
    dict(x=np.zeros((1, T, D), np.float32)),
    "x must be 2-D [T, D], got shape [1, 3, 8]",
  ),
  "ids_wrong_tokens": (
    dict(ids=np.zeros((T + 1, K), np.int32)),
    "ids must be [T, K] with T = 3 from x, got shape [4, 2]",
  ),
  "weights_wrong_shape": (
    dict(weights=np.zeros((T, K + 1), np.float32)),
    "weights must be [T, K] = [3, 2] like ids, got shape [3, 3]",
  ),
  "bank_not_3d": (
    dict(bank=np.zeros((E, 3 * F * D), np.float32)),
    "bank must be 3-D [L, E, P], got shape [4, 96]",
  ),
  "bank_dtype": (
    dict(bank=np.zeros((L, E, 3 * F * D), np.int16)),
    "bank must be bfloat16, float32, int8",
  ),
  "bank_too_narrow": (
    dict(bank=np.zeros((L, E, 3 * F * D - 1), np.float32)),
    "bank's last dimension P = 95 is smaller than 3 * ffn_dim * D = 3 * 4 * 8",
  ),
  "ffn_dim_zero": (dict(ffn_dim=0), "ffn_dim must be positive, got 0"),
  "ffn_dim_huge": (
    dict(ffn_dim=2**62),
    "bank's last dimension P = 96 is smaller than 3 * ffn_dim * D = 3 * 4611686018427387904 * 8",
  ),
  "result_shape": (
    dict(result_shape=(T, D + 1)),
    "result y must have x's shape [3, 8], got [3, 9]",
  ),
  "unknown_activation": (
    dict(activation="gelu"),
    'activation must be "swiglu" or "clamped_swiglu", got "gelu"',
  ),
  "no_room_for_biases": (
    dict(biases=True),
    "with biases the expert block needs 3 * F * D + 2 * F + D = 112 elements, but the bank's "
    "P = 96",
  ),
}


@pytest.mark.parametrize("error_name", KERNEL_ERRORS)
def test_kernel_rejects_bad_input(error_name):
  changes, message = KERNEL_ERRORS[error_name]
  arguments = good_arguments() | changes
  with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape("ftjax_expert_ffn: " + message)):
    call_kernel_directly(**arguments)


def test_traced_out_of_range_id_is_caught_by_the_kernel():
  """Python cannot see traced ids; the kernel's check reaches the caller through jit."""
  arguments = good_arguments()
  ffn_dim = arguments.pop("ffn_dim")
  arguments["ids"] = np.array([[0, 1], [2, 3], [E + 3, 0]], np.int32)
  jitted = jax.jit(functools.partial(expert_ffn, ffn_dim=ffn_dim))
  with pytest.raises(
    jax.errors.JaxRuntimeError, match=re.escape("ids[2, 0] = 7 is outside [-1, E)")
  ):
    jax.block_until_ready(jitted(**arguments))


# --- gpt-oss: the clamped SwiGLU with biases ----------------------------------------------------

GPT_OSS = ExpertVariant(activation="clamped_swiglu", alpha=1.702, limit=7.0, bias=True)
GPT_OSS_CASES = {
  "decode_tokens_1": Case(T=1, K=4, E=16, D=64, F=48),
  "decode_tokens_5": Case(T=5, K=2, E=5, D=67, F=45, skip_fraction=0.2),
  "grouped_tokens_40": Case(T=40, K=3, E=8, D=67, F=45, L=2, layer=1),
  "grouped_packed": Case(T=160, K=2, D=64, F=96),  # ~40 routes per expert: packed GEMM
}


def gpt_oss_inputs(case, bank_dtype):
  """Inputs whose gate and up pre-activations pass the limit (7) both ways: x has unit rows, the
  weights std 3 / sqrt(D), so g and u have std ~3; biases std 1. Returns the inputs and the
  pre-activations of the routed experts (float64, from the reference's split)."""
  rng = rng_for("gpt-oss", case, bank_dtype.name)
  x = rng.standard_normal((case.T, case.D)).astype(np.float32)
  ids, weights = make_routes(rng, T=case.T, E=case.E, K=case.K, skip_fraction=case.skip_fraction)
  F, D = case.F, case.D
  pad = rng.integers(0, 5)
  blocks = np.concatenate([3 * rng.standard_normal((case.L, case.E, 2 * F * D)) / np.sqrt(D),
                           rng.standard_normal((case.L, case.E, D * F)) / np.sqrt(F),
                           rng.standard_normal((case.L, case.E, 2 * F + D)),
                           np.full((case.L, case.E, pad), np.nan)], axis=-1)
  bank = blocks.astype(np.float32).astype(bank_dtype)
  routed = np.unique(ids[ids >= 0])
  pre = []
  for e in routed:
    gate, up, _ = reference.split_block(bank[case.layer, e], F, D)
    b_gate, b_up, _ = reference.split_biases(bank[case.layer, e], F, D)
    pre.append((x @ gate.T + b_gate, x @ up.T + b_up))
  return (x, ids, weights, bank), pre


@pytest.mark.parametrize("bank_dtype", BANK_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("case_name", GPT_OSS_CASES)
def test_gpt_oss_variant_matches_reference(case_name, bank_dtype, bf16_activations, isa,
                                           assert_close):
  case = GPT_OSS_CASES[case_name]
  (x, ids, weights, bank), pre = gpt_oss_inputs(case, bank_dtype)
  # The clamps are reached: the gate above the limit, the up on both sides.
  assert max(g.max() for g, _ in pre) > 7 and max(u.max() for _, u in pre) > 7
  assert min(u.min() for _, u in pre) < -7
  y = expert_ffn(x, ids, weights, bank, case.layer, ffn_dim=case.F,
                 bf16_activations=bf16_activations, variant=GPT_OSS)
  ref = reference.routed_experts(x, ids, weights, bank, case.layer, case.F,
                                 activation="clamped_swiglu", alpha=1.702, limit=7.0, bias=True)
  assert_close(y, ref, bank_dtype, bf16_activations)
  # Not the plain SwiGLU, and not the clamped one without biases: the test can tell.
  for other in (dict(), dict(activation="clamped_swiglu")):
    wrong = reference.routed_experts(x, ids, weights, bank, case.layer, case.F, **other)
    assert np.max(np.abs(wrong - ref)) > 0.1 * np.max(np.abs(ref))
