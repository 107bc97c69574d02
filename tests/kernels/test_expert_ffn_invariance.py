"""A token's experts give the same result whatever other tokens share the call (issue 54, item
5): in the decode form (T <= 8) each token's row of ``expert_ffn`` equals, bit for bit, the call
with that token alone, for every bank format, both activation kinds, every ISA and the kernel
tunings that change the one-token kernel's summation order (its accumulators). The server
decodes a batch of rows in one call, so without this a sequence's tokens depended on which
experts its neighbours chose."""

import numpy as np
import pytest

from ftjax.kernels import expert_ffn, tuning
from ftjax.utils import quant

from expert_cases import make_mxfp4_bank, make_routes, rng_for

E, K, L = 6, 3, 1  # few experts: most are chosen by several of the tokens
D, F = 1024, 96  # gate/up rows of 1024 inputs: several of the routes' sub-tiles in float32


def _bank(fmt, rng):
  if fmt == "mxfp4":
    return make_mxfp4_bank(rng, L=L, E=E, F=F, D=D)
  floats = (rng.standard_normal((L, E, 3 * F * D)) / np.sqrt(D)).astype(np.float32)
  if fmt == "int4":
    return quant.quantize_int4_bank(floats, F, D,
                                    block_bytes=-(-quant.int4_block_bytes(F, D) // 64) * 64)
  if fmt == "int8":
    offset = -(-3 * F * D // 64) * 64
    bank = np.zeros((L, E, offset + 64 * (-(-4 * (2 * F + D) // 64))), np.int8)
    bank[..., :3 * F * D] = rng.integers(-127, 128, (L, E, 3 * F * D))
    scales = (rng.uniform(0.5, 1.5, (L, E, 2 * F + D)) / (127 * np.sqrt(D))).astype(np.float32)
    bank[..., offset:offset + 4 * (2 * F + D)] = scales.view(np.int8)
    return bank
  return floats.astype(np.dtype(fmt))


@pytest.fixture(params=[4, 8], ids=["acc4", "acc8"])
def accumulators(request):
  before = tuning.current()
  tuning.apply(tuning.Tuning(row_accumulators=request.param))
  yield request.param
  tuning.apply(before)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "mxfp4", "int4"])
def test_a_token_gets_its_alone_result_beside_up_to_7_others(fmt, bf16_activations, isa,
                                                           accumulators):
  if bf16_activations and fmt not in ("bfloat16",):
    pytest.skip("bf16 activations in the decode form: bfloat16 banks")
  rng = rng_for("invariance", fmt)
  x = rng.standard_normal((8, D)).astype(np.float32)
  ids, weights = make_routes(rng, T=8, E=E, K=K, shared=True)
  bank = _bank(fmt, rng)

  def call(rows):
    return np.asarray(expert_ffn(x[rows], ids[rows], weights[rows], bank, 0, ffn_dim=F,
                                 bf16_activations=bf16_activations))

  alone = np.concatenate([call(slice(t, t + 1)) for t in range(8)])
  assert np.isfinite(alone).all() and np.abs(alone).max() > 0
  counts = np.bincount(ids.ravel()[ids.ravel() >= 0], minlength=E)
  assert counts.max() >= 4  # experts shared by several tokens
  for tokens in range(2, 9):
    np.testing.assert_array_equal(call(slice(0, tokens)), alone[:tokens],
                                  err_msg=f"{tokens} tokens")
  # The same tokens in another order: each row still its own.
  order = rng.permutation(8)
  np.testing.assert_array_equal(call(order), alone[order])
