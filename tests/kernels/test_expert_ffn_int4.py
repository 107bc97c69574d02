"""ftjax_expert_ffn on int4 expert banks (docs/ftw.md, expert format int4: uint16 words, 4-bit
codes with a scale and a min per 32 inputs) against the float64 reference of the dequantised
weights (reference.int4_parts, written from the spec), on every ISA this CPU runs; the XLA
path's dequantisation; the layout; bad input.

Banks come from ``quant.quantize_int4_bank`` of random float blocks; layers not in use get
steps of infinity, so a kernel reading the wrong layer fails; padding past the content is
random.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.experts import routed
from ftjax.kernels import ExpertVariant, expert_ffn
from ftjax.utils import quant

import reference
import tolerances
from expert_cases import Case, make_routes, rng_for

CASES = {
  # decode form (T <= 8)
  "decode_tokens_1": Case(T=1, K=4, E=16, D=64, F=64),
  "decode_tokens_5_skips": Case(T=5, K=2, E=5, D=96, F=32, skip_fraction=0.2),
  "decode_two_chunks": Case(T=3, K=2, E=4, D=1056, F=32, pad=128),  # rows of > 1024 inputs
  "one_token_two_chunks": Case(T=1, K=2, E=3, D=4128, F=32),  # > 4096: the fused GEMV's chunks
  # 5 and 3 blocks of 32: the fused GEMVs' groups, then single blocks / an odd last block
  "one_token_groups_and_blocks": Case(T=1, K=2, E=3, D=160, F=96),
  # grouped prefill form (T > 8): rows decoded to float32, the packed GEMM
  "grouped_tokens_41": Case(T=41, K=3, E=8, D=64, F=96, L=2, layer=1, skip_fraction=0.1),
  "grouped_tokens_150": Case(T=150, K=2, E=3, D=32, F=64),  # > 64 routes an expert: tiles
}


def make_bank(rng, case):
  content = quant.int4_block_bytes(case.F, case.D)
  block_bytes = -(-(content + case.pad) // 64) * 64
  floats = (rng.standard_normal((case.L, case.E, 3 * case.F * case.D)) * 0.1).astype(np.float32)
  bank = quant.quantize_int4_bank(floats, case.F, case.D, block_bytes=block_bytes)
  raw = bank.view(np.uint8)
  raw[..., content:] = rng.integers(0, 256, raw[..., content:].shape, dtype=np.uint8)
  at = quant.int4_offsets(case.F, case.D)["params"]
  for layer in range(case.L):
    if layer == case.layer:
      continue
    for part, (rows, n) in (("gate", (case.F, case.D)), ("up", (case.F, case.D)),
                            ("down", (case.D, case.F))):
      width = quant.int4_param_bytes(n)
      params = raw[layer, :, at[part]:at[part] + rows * width].reshape(case.E, rows, width)
      params[..., :4] = np.array([np.inf], "<f4").view(np.uint8)
  return bank


def make_inputs(case, *labels):
  rng = rng_for(case, "int4", *labels)
  x = rng.standard_normal((case.T, case.D)).astype(np.float32)
  ids, weights = make_routes(rng, T=case.T, E=case.E, K=case.K,
                             skip_fraction=case.skip_fraction, shared=case.shared)
  return x, ids, weights, make_bank(rng, case)


@pytest.mark.parametrize("case_name", CASES)
def test_int4_matches_dequantised_reference(case_name, isa):
  case = CASES[case_name]
  x, ids, weights, bank = make_inputs(case)
  y = expert_ffn(x, ids, weights, jnp.asarray(bank), case.layer, ffn_dim=case.F)
  ref = reference.routed_experts(x, ids, weights, bank, case.layer, case.F)
  assert np.all(np.isfinite(np.asarray(y)))
  tolerances.assert_close(y, ref, tolerances.F32)


@pytest.mark.parametrize("case_name", ["grouped_tokens_41", "grouped_tokens_150",
                                       "decode_tokens_5_skips"])
def test_int4_bf16_activations(case_name, isa):
  """bf16_activations (kernels="ffi_bf16", the default for int4 banks): the grouped form
  multiplies x and h rounded to bf16 with rows decoded and rounded to bf16 on the bf16-pair GEMM
  (AMX tiles where the CPU has them), to the bf16-activation tolerance of the float64 reference;
  the decode form, and ISAs without bf16 pairs, stay exact."""
  case = CASES[case_name]
  x, ids, weights, bank = make_inputs(case, "bf16 activations")
  y = np.asarray(expert_ffn(x, ids, weights, bank, case.layer, ffn_dim=case.F,
                            bf16_activations=True))
  ref = reference.routed_experts(x, ids, weights, bank, case.layer, case.F)
  assert np.all(np.isfinite(y))
  tolerances.assert_close(y, ref, tolerances.BF16_ACTIVATIONS)
  exact = np.asarray(expert_ffn(x, ids, weights, bank, case.layer, ffn_dim=case.F))
  if isa != "avx512bf16" or case.T <= 8:
    np.testing.assert_array_equal(y, exact)
  else:  # the bf16 GEMM ran: not the float32 result
    assert not np.array_equal(y, exact)


def test_xla_path_dequantises_exactly():
  """routed.split_block gives the float32 weights of the spec bit for bit, and the XLA path's
  sum is the reference's."""
  case = CASES["grouped_tokens_41"]
  x, ids, weights, bank = make_inputs(case, "xla")
  gate, up, down = jax.jit(lambda b: routed.split_block(b, case.F, case.D))(
      jnp.asarray(bank[case.layer]))
  for e in range(case.E):
    want = reference.int4_parts(bank[case.layer, e], case.F, case.D)
    for got, ref in zip((gate[e], up[e], down[e]), want):
      np.testing.assert_array_equal(np.asarray(got), ref.astype(np.float32))
  y = routed.routed_experts(x, ids, weights, jnp.asarray(bank), case.layer, ffn_dim=case.F,
                            kernels="xla")
  tolerances.assert_close(y, reference.routed_experts(x, ids, weights, bank, case.layer, case.F),
                          tolerances.F32)


def test_quantised_bank_is_close_to_the_floats():
  """Each weight within its block's cut range plus half a step (test_dense_quantized's bound),
  and the codes and parameters where int4_offsets puts them."""
  rng = rng_for("int4 bank")
  F, D = 32, 64
  floats = rng.standard_normal((1, 2, 3 * F * D)).astype(np.float32)
  bank = quant.quantize_int4_bank(floats, F, D)
  assert bank.dtype == np.uint16
  assert bank.shape[-1] * 2 == -(-quant.int4_block_bytes(F, D) // 64) * 64
  gate, up, down = reference.int4_parts(bank[0, 1], F, D)
  for got, want in ((gate, floats[0, 1, :F * D].reshape(F, D)),
                    (down, floats[0, 1, 2 * F * D:].reshape(D, F))):
    blocks = want.reshape(want.shape[0], -1, 32)
    span = np.maximum(blocks.max(-1), 0) - np.minimum(blocks.min(-1), 0)
    assert np.all(np.abs(got - want) <= np.repeat(span * (0.1 + 1 / 15), 32, axis=1))
    codes, params = quant.int4_part(bank[0, 1], F, D, "gate" if got is gate else "down")
    np.testing.assert_array_equal(quant.dequantize_int4(codes, params), got)


BAD = {
  "biases": (dict(variant=ExpertVariant(bias=True)), "int4 expert blocks carry no biases"),
  "int8_activations": (dict(int8_activations=True), "int8_activations applies to int8 and "
                       "mxfp4"),
  "short_blocks": (dict(bank_words=-32), "smaller than the"),
  "unaligned": (dict(bank_words=8), "multiple of 64"),
  "ffn_not_32": (dict(ffn_dim=48), "multiples of 32"),
}


@pytest.mark.parametrize("bad", BAD)
def test_bad_input_is_named(bad):
  case = CASES["decode_tokens_1"]
  x, ids, weights, bank = make_inputs(case, "bad")
  kwargs, message = BAD[bad]
  kwargs = dict(kwargs)
  words = kwargs.pop("bank_words", 0)
  if words < 0:
    bank = bank[..., :bank.shape[-1] + words]
  elif words:
    bank = np.concatenate([bank, np.zeros((*bank.shape[:2], words), np.uint16)], axis=-1)
  with pytest.raises(ValueError, match=message):
    expert_ffn(x, ids, weights, jnp.asarray(bank), case.layer,
               **{"ffn_dim": case.F, **kwargs})
