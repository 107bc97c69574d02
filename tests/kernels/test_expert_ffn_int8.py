"""ftjax_expert_ffn on int8 expert banks (docs/ftw.md, expert format int8) against the float64
reference of the dequantised weights (reference.py), on every ISA this CPU runs.

The banks are built here byte by byte (random int8 weights, random positive float32 row
scales, one all-zero row with scale 0), independently of ftjax's quantiser. The kernel widens
the int8 weights exactly and scales each output row once: the float32 limit holds.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.experts import routed_experts
from ftjax.kernels import expert_ffn

import reference
import tolerances
from expert_cases import Case, make_routes, rng_for

I8 = np.dtype(np.int8)


def scales_offset(F, D):
  return -(-3 * F * D // 64) * 64


def make_int8_bank(rng, *, L, E, F, D, pad=0, layers_in_use=None):
  """[L, E, P] int8 blocks: weights in [-127, 127], scales ~ 1/(127 sqrt(fan-in)) with
  jitter, then `pad` extra bytes rounded up to 64. Unused layers get NaN scales (a kernel
  that reads them returns NaN); padding is random bytes."""
  offset = scales_offset(F, D)
  P = -(-(offset + 4 * (2 * F + D) + pad) // 64) * 64
  bank = rng.integers(-128, 128, (L, E, P), dtype=np.int16).astype(np.int8)
  bank[..., :3 * F * D] = rng.integers(-127, 128, (L, E, 3 * F * D))
  scales = np.concatenate([np.full(2 * F, 1 / np.sqrt(D)), np.full(D, 1 / np.sqrt(F))]) / 127
  scales = (scales * rng.uniform(0.5, 1.5, (L, E, 2 * F + D))).astype(np.float32)
  bank[:, :, :F * D][:, :, -D:] = 0  # the last gate row is all zeros, with scale 0
  scales[:, :, F - 1] = 0
  if layers_in_use is not None:
    scales[np.setdiff1d(np.arange(L), layers_in_use)] = np.nan
  bank[..., offset:offset + 4 * (2 * F + D)] = scales.view(np.int8)
  return bank


CASES = {
  # decode form (T <= 8)
  "tokens_1": Case(T=1, K=2),
  "tokens_1_top_8": Case(T=1, K=8, E=32, D=64, F=48),
  "top_8_skips": Case(T=6, K=8, E=16, skip_fraction=0.25),
  "duplicate_experts_across_tokens": Case(T=8, K=2, shared=True),
  "odd_widths": Case(T=4, K=3, E=5, D=67, F=45),
  "padded_layer_2_of_4": Case(T=4, K=2, L=4, layer=2, pad=100),
  "several_chunks": Case(T=1, K=2, D=320, F=272),  # > 256 rows of F and of D: several tasks
  # grouped prefill form (T > 8): dot kernels, and packed GEMMs above 8/16 routes an expert
  "tokens_9": Case(T=9, K=2),
  "tokens_200": Case(T=200, K=2),
  "grouped_top_8_skips": Case(T=40, K=8, E=16, skip_fraction=0.25),
  "grouped_odd_widths": Case(T=60, K=3, E=5, D=67, F=45),
  "grouped_several_chunks": Case(T=100, K=2, D=256, F=144, L=2, layer=1),
}


def make_inputs(case, *labels):
  rng = rng_for(case, "int8", *labels)
  x = rng.standard_normal((case.T, case.D)).astype(np.float32)
  ids, weights = make_routes(rng, T=case.T, E=case.E, K=case.K,
                             skip_fraction=case.skip_fraction, shared=case.shared)
  bank = make_int8_bank(rng, L=case.L, E=case.E, F=case.F, D=case.D, pad=case.pad,
                        layers_in_use=[case.layer])
  return x, ids, weights, bank


@pytest.mark.parametrize("case_name", CASES)
def test_int8_matches_dequantised_reference(case_name, isa):
  case = CASES[case_name]
  x, ids, weights, bank = make_inputs(case)
  y = np.asarray(expert_ffn(x, ids, weights, bank, case.layer, ffn_dim=case.F))
  assert y.dtype == np.float32
  ref = reference.routed_experts(x, ids, weights, bank, case.layer, case.F)
  tolerances.assert_close(y, ref, tolerances.F32)


def test_int8_bf16_activations_flag_keeps_the_exact_path(isa):
  """bf16_activations applies to bf16 banks only: an int8 bank stays exact with it."""
  case = CASES["tokens_200"]
  x, ids, weights, bank = make_inputs(case, "flag")
  y = expert_ffn(x, ids, weights, bank, case.layer, ffn_dim=case.F, bf16_activations=True)
  ref = reference.routed_experts(x, ids, weights, bank, case.layer, case.F)
  tolerances.assert_close(y, ref, tolerances.F32)


@pytest.mark.parametrize("case_name", ["tokens_1_top_8", "odd_widths", "grouped_odd_widths"])
def test_int8_xla_path_dequantises(case_name):
  """routed_experts(kernels="xla"), the GPU path, reads int8 blocks too, under jit."""
  case = CASES[case_name]
  x, ids, weights, bank = make_inputs(case, "xla")
  run = jax.jit(lambda x, ids, w, b: routed_experts(x, ids, w, b, case.layer, ffn_dim=case.F))
  y = run(x, ids, weights, jnp.asarray(bank))
  ref = reference.routed_experts(x, ids, weights, bank, case.layer, case.F)
  tolerances.assert_close(y, ref, tolerances.F32)


@pytest.mark.parametrize("case_name", CASES)
def test_int8_activations_match_their_reference(case_name, isa):
  """The opt-in vpdpbusd form: x per token and h per route quantised to int8, exact integer
  sums, so it equals the float64 reference of those semantics to float32 rounding (against the
  exact reference it is off by the 8-bit activations, ~1-2% of max|y| on these cases). Only
  AVX-512-VNNI CPUs (the avx512bf16 kernels) run it; elsewhere the call names the fix."""
  case = CASES[case_name]
  x, ids, weights, bank = make_inputs(case, "int8 activations")
  run = lambda: expert_ffn(x, ids, weights, bank, case.layer, ffn_dim=case.F,  # noqa: E731
                           int8_activations=True)
  if isa != "avx512bf16":
    with pytest.raises(Exception, match="int8_activations needs AVX-512-VNNI"):
      jax.block_until_ready(run())
    return
  y = np.asarray(run())
  ref = reference.routed_experts_int8_activations(x, ids, weights, bank, case.layer, case.F)
  tolerances.assert_close(y, ref, tolerances.F32)
  exact = reference.routed_experts(x, ids, weights, bank, case.layer, case.F)
  assert np.max(np.abs(y - exact)) > 1e-3 * np.max(np.abs(exact))  # really quantised


# --- bad input --------------------------------------------------------------------------------

T, D, F, E, K, L = 3, 8, 4, 4, 2, 2
P = -(-(scales_offset(F, D) + 4 * (2 * F + D)) // 64) * 64  # 192 bytes: 96 weights to byte 128, 64 of scales


def good_arguments():
  x, ids, weights, bank = make_inputs(Case(T=T, K=K, E=E, D=D, F=F, L=L, layer=1), "bad")
  return dict(x=x, ids=ids, weights=weights, bank=bank, layer=1, ffn_dim=F)


ERRORS = {
  "too_small_for_the_scales": (
    dict(bank=np.zeros((L, E, 128), np.int8)),
    "int8 bank's last dimension P = 128 is smaller than the 192 bytes of an int8 block",
  ),
  "not_a_multiple_of_64": (
    dict(bank=np.zeros((L, E, P + 8), np.int8)),
    f"int8 bank's last dimension P = {P + 8} must be a multiple of 64 bytes",
  ),
  "int16_bank": (dict(bank=np.zeros((L, E, P), np.int16)), "bank must be bfloat16, float32, int8"),
  "int8_activations_of_a_float_bank": (
    dict(bank=np.zeros((L, E, 3 * F * D), np.float32), int8_activations=True),
    "int8_activations applies to int8 and mxfp4 banks only, got a float32 bank",
  ),
  "int8_activations_not_bool": (dict(int8_activations=1), "int8_activations must be a bool"),
}


@pytest.mark.parametrize("error_name", ERRORS)
def test_int8_python_side_rejects_bad_input(error_name):
  changes, message = ERRORS[error_name]
  with pytest.raises(ValueError, match=re.escape(message)):
    expert_ffn(**(good_arguments() | changes))


@pytest.mark.parametrize("error_name", ["too_small_for_the_scales", "not_a_multiple_of_64"])
def test_int8_kernel_rejects_bad_input(error_name):
  """The C++ checks, with the Python ones bypassed."""
  changes, message = ERRORS[error_name]
  args = good_arguments() | changes
  call = jax.ffi.ffi_call("ftjax_expert_ffn", jax.ShapeDtypeStruct((T, D), jnp.float32),
                          vmap_method="sequential")
  with pytest.raises(Exception, match=re.escape(message)):
    jax.block_until_ready(call(args["x"], args["ids"], args["weights"], args["bank"],
                               jnp.int32(1), ffn_dim=np.int64(F), bf16_activations=False,
                               int8_activations=False, activation="swiglu",
                               alpha=np.float32(1.702), limit=np.float32(7.0), biases=False))
