"""ftjax_expert_ffn on mxfp4 expert banks (docs/ftw.md, expert format mxfp4: gpt-oss's MXFP4
as shipped) against the float64 reference of the dequantised weights (reference.py, which
decodes E2M1 from its bits, element by element), on every ISA this CPU runs, with the gpt-oss
variant (clamped SwiGLU, biases; the clamps are reached).

The banks are built here byte by byte: every code byte value, E8M0 scales around the weight
scale the clamps need, float32 biases, random padding; layers not in use get the scale 255
(infinite weights), so a kernel reading the wrong layer fails.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.experts import routed_experts
from ftjax.kernels import ExpertVariant, expert_ffn
from ftjax.utils import quant

import reference
import tolerances
from expert_cases import Case, align64, block_bytes, make_mxfp4_bank, make_routes, rng_for

GPT_OSS = ExpertVariant(activation="clamped_swiglu", alpha=1.702, limit=7.0, bias=True)


CASES = {
  # decode form (T <= 8)
  "decode_tokens_1": Case(T=1, K=4, E=16, D=64, F=64),
  "decode_tokens_5_skips": Case(T=5, K=2, E=5, D=96, F=32, skip_fraction=0.2),
  "decode_two_chunks": Case(T=3, K=2, E=4, D=1056, F=32, pad=100),  # rows of > 1024 inputs
  "one_token_two_chunks": Case(T=1, K=2, E=3, D=4128, F=32),  # > 4096: the fused GEMV's chunks
  # 5 and 3 blocks of 32 inputs: the fused GEMVs' groups (4 blocks on AVX-512, then single
  # blocks; 2 on AVX2, a pair of groups or one, then an odd last block)
  "one_token_groups_and_blocks": Case(T=1, K=2, E=3, D=160, F=96),
  # grouped prefill form (T > 8)
  "grouped_tokens_41": Case(T=41, K=3, E=8, D=64, F=96, L=2, layer=1, skip_fraction=0.1),
  "grouped_tokens_150": Case(T=150, K=2, E=3, D=32, F=64),  # > 64 routes an expert: tiles
}


def make_inputs(case, *labels):
  rng = rng_for(case, "mxfp4", *labels)
  x = rng.standard_normal((case.T, case.D)).astype(np.float32)
  ids, weights = make_routes(rng, T=case.T, E=case.E, K=case.K,
                             skip_fraction=case.skip_fraction, shared=case.shared)
  bank = make_mxfp4_bank(rng, L=case.L, E=case.E, F=case.F, D=case.D, pad=case.pad,
                         layers_in_use=[case.layer])
  return x, ids, weights, bank


def gpt_oss_reference(case, x, ids, weights, bank):
  return reference.routed_experts(x, ids, weights, bank, case.layer, case.F,
                                  activation="clamped_swiglu", alpha=1.702, limit=7.0, bias=True)


@pytest.mark.parametrize("case_name", CASES)
def test_mxfp4_matches_dequantised_reference(case_name, isa):
  case = CASES[case_name]
  x, ids, weights, bank = make_inputs(case)
  if case_name == "decode_tokens_1":  # the clamps are reached: g above 7, u beyond +-7
    g, u = [], []
    for e in np.unique(ids[ids >= 0]):
      gate, up, _ = reference.split_block(bank[case.layer, e], case.F, case.D)
      b_gate, b_up, _ = reference.split_biases(bank[case.layer, e], case.F, case.D)
      g.append(x @ gate.T + b_gate)
      u.append(x @ up.T + b_up)
    assert np.max(g) > 7 and np.max(u) > 7 and np.min(u) < -7
  y = np.asarray(expert_ffn(x, ids, weights, bank, case.layer, ffn_dim=case.F, variant=GPT_OSS))
  assert y.dtype == np.float32
  ref = gpt_oss_reference(case, x, ids, weights, bank)
  tolerances.assert_close(y, ref, tolerances.F32)
  # The test can tell a wrong nibble order: swapping the nibbles of every code changes y.
  swapped = bank.copy()
  codes = 3 * case.F * case.D // 2
  swapped[..., :codes] = (bank[..., :codes] >> 4) | (bank[..., :codes] << 4)
  wrong = gpt_oss_reference(case, x, ids, weights, swapped)
  assert np.max(np.abs(wrong - ref)) > 0.1 * np.max(np.abs(ref))


@pytest.mark.parametrize("case_name", CASES)
def test_mxfp4_int8_activations(case_name, isa):
  """The opt-in int8_activations form (kernels="ffi_int8"): a decode call quantises x and h per
  block of 32 and sums integers, so it equals the float64 reference of those semantics to
  float32 rounding, and differs from the exact one by the 8-bit activations; a prefill call
  (T > 8) is the exact form, bit for bit."""
  case = CASES[case_name]
  x, ids, weights, bank = make_inputs(case, "int8 activations")
  y = np.asarray(expert_ffn(x, ids, weights, bank, case.layer, ffn_dim=case.F, variant=GPT_OSS,
                            int8_activations=True))
  exact = np.asarray(expert_ffn(x, ids, weights, bank, case.layer, ffn_dim=case.F,
                                variant=GPT_OSS))
  if case.T > 8:
    np.testing.assert_array_equal(y, exact)
    return
  ref = reference.routed_experts_quantised(x, ids, weights, bank, case.layer, case.F,
                                           reference.quantise_blocks, activation="clamped_swiglu",
                                           alpha=1.702, limit=7.0, bias=True)
  tolerances.assert_close(y, ref, tolerances.F32)
  exact_ref = gpt_oss_reference(case, x, ids, weights, bank)
  error = np.max(np.abs(y - exact_ref)) / np.max(np.abs(exact_ref))
  assert 1e-4 < error < 3e-2, error  # really quantised, by 8-bit activations' error


def without_biases(case, bank):
  """The bank's blocks cut after their scales: the layout of every family without expert
  biases (qwen3_moe, mixtral, ...), P the smallest multiple of 64 that holds them."""
  return np.ascontiguousarray(
      bank[..., :align64(quant.mxfp4_block_bytes(case.F, case.D, bias=False))])


@pytest.mark.parametrize("case_name", CASES)
def test_mxfp4_without_biases_swiglu(case_name, isa):
  """mxfp4 experts of a family without biases (the plain SwiGLU), decode and grouped forms."""
  case = CASES[case_name]
  x, ids, weights, bank = make_inputs(case, "no biases")
  bank = without_biases(case, bank)
  y = np.asarray(expert_ffn(x, ids, weights, bank, case.layer, ffn_dim=case.F))
  ref = reference.routed_experts(x, ids, weights, bank, case.layer, case.F)
  tolerances.assert_close(y, ref, tolerances.F32)
  run = jax.jit(lambda x, ids, w, b: routed_experts(x, ids, w, b, case.layer, ffn_dim=case.F))
  tolerances.assert_close(run(x, ids, weights, jnp.asarray(bank)), ref, tolerances.F32)


@pytest.mark.parametrize("case_name", ["grouped_tokens_41", "grouped_tokens_150",
                                       "decode_tokens_5_skips"])
def test_mxfp4_bf16_activations(case_name, isa):
  """bf16_activations (kernels="ffi_bf16", the default for mxfp4 banks): the grouped form
  multiplies x and h rounded to bf16 with rows decoded to bf16 on the bf16-pair GEMM, to the
  bf16-activation tolerance; the decode form, and ISAs without bf16 pairs, stay exact."""
  case = CASES[case_name]
  x, ids, weights, bank = make_inputs(case, "bf16 activations")
  y = np.asarray(expert_ffn(x, ids, weights, bank, case.layer, ffn_dim=case.F, variant=GPT_OSS,
                            bf16_activations=True))
  tolerances.assert_close(y, gpt_oss_reference(case, x, ids, weights, bank),
                          tolerances.BF16_ACTIVATIONS)
  exact = np.asarray(expert_ffn(x, ids, weights, bank, case.layer, ffn_dim=case.F,
                                variant=GPT_OSS))
  if isa != "avx512bf16" or case.T <= 8:
    np.testing.assert_array_equal(y, exact)
  else:  # the bf16 GEMM ran: not the float32 result
    assert not np.array_equal(y, exact)


def test_mxfp4_bank_quantised_without_biases_matches_float_bank():
  """quant.quantize_mxfp4_bank(bias=False) of a float bank: the kernel's result is that of the
  dequantised weights."""
  case = Case(T=3, K=2, E=4, D=64, F=32)
  rng = rng_for(case, "float bank")
  floats = rng.standard_normal((1, case.E, 3 * case.F * case.D)).astype(np.float32) * 0.1
  bank = quant.quantize_mxfp4_bank(floats, case.F, case.D, bias=False)
  assert bank.shape[-1] == align64(quant.mxfp4_block_bytes(case.F, case.D, bias=False))
  x = rng.standard_normal((case.T, case.D)).astype(np.float32)
  ids, weights = make_routes(rng, T=case.T, E=case.E, K=case.K)
  y = expert_ffn(x, ids, weights, bank, 0, ffn_dim=case.F)
  tolerances.assert_close(y, reference.routed_experts(x, ids, weights, bank, 0, case.F),
                          tolerances.F32)
  # and the quantisation is close to the float weights (4-bit error, not garbage)
  close = reference.routed_experts(x, ids, weights, floats, 0, case.F)
  assert np.max(np.abs(np.asarray(y) - close)) < 0.25 * np.max(np.abs(close))


@pytest.mark.parametrize("case_name", ["decode_tokens_5_skips", "grouped_tokens_41"])
def test_mxfp4_xla_path_dequantises(case_name):
  """routed_experts(kernels="xla"), the GPU path and the cache's slot experts, reads mxfp4 blocks
  too, under jit."""
  case = CASES[case_name]
  x, ids, weights, bank = make_inputs(case, "xla")
  run = jax.jit(lambda x, ids, w, b: routed_experts(x, ids, w, b, case.layer, ffn_dim=case.F,
                                                    variant=GPT_OSS))
  y = run(x, ids, weights, jnp.asarray(bank))
  tolerances.assert_close(y, gpt_oss_reference(case, x, ids, weights, bank), tolerances.F32)


# --- bad input --------------------------------------------------------------------------------

T, D, F, E, K, L = 3, 64, 32, 4, 2, 2
P = align64(block_bytes(F, D))


def good_arguments():
  x, ids, weights, bank = make_inputs(Case(T=T, K=K, E=E, D=D, F=F, L=L, layer=1), "bad")
  return dict(x=x, ids=ids, weights=weights, bank=bank, layer=1, ffn_dim=F, variant=GPT_OSS)


ERRORS = {
  "too_small": (
    dict(bank=np.zeros((L, E, P - 64), np.uint8)),
    f"mxfp4 bank's last dimension P = {P - 64} is smaller than the {block_bytes(F, D)} bytes",
  ),
  "not_a_multiple_of_64": (
    dict(bank=np.zeros((L, E, P + 8), np.uint8)),
    f"mxfp4 bank's last dimension P = {P + 8} must be a multiple of 64 bytes",
  ),
  "ffn_dim_not_a_multiple_of_32": (
    dict(ffn_dim=16, bank=np.zeros((L, E, 4 * P), np.uint8)),
    "needs ffn_dim and D to be multiples of 32, got ffn_dim = 16",
  ),
}


@pytest.mark.parametrize("error_name", ERRORS)
def test_mxfp4_python_side_rejects_bad_input(error_name):
  changes, message = ERRORS[error_name]
  with pytest.raises(ValueError, match=re.escape(message)):
    expert_ffn(**(good_arguments() | changes))


KERNEL_ERRORS = {
  "too_small": (dict(bank=np.zeros((L, E, P - 64), np.uint8)),
                f"mxfp4 bank's last dimension P = {P - 64} is smaller than the bytes"),
  "not_a_multiple_of_64": (dict(bank=np.zeros((L, E, P + 8), np.uint8)),
                           f"mxfp4 bank's last dimension P = {P + 8} must be a multiple of 64"),
  "ffn_dim_not_a_multiple_of_32": (dict(ffn_dim=16),
                                   "mxfp4 needs F and D to be multiples of 32, got F = 16"),
}


@pytest.mark.parametrize("error_name", KERNEL_ERRORS)
def test_mxfp4_kernel_rejects_bad_input(error_name):
  """The C++ checks, with the Python ones bypassed."""
  changes, message = KERNEL_ERRORS[error_name]
  args = good_arguments() | dict(biases=True) | changes
  call = jax.ffi.ffi_call("ftjax_expert_ffn", jax.ShapeDtypeStruct((T, D), jnp.float32),
                          vmap_method="sequential")
  with pytest.raises(Exception, match=re.escape(message)):
    jax.block_until_ready(call(args["x"], args["ids"], args["weights"], args["bank"],
                               jnp.int32(1), ffn_dim=np.int64(args["ffn_dim"]),
                               bf16_activations=False, int8_activations=False,
                               activation="clamped_swiglu", alpha=np.float32(1.702),
                               limit=np.float32(7.0), biases=args["biases"]))
