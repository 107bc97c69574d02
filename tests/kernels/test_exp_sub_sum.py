"""KernelTable::exp_sub_sum (through ftjax_exp_sub_sum) against numpy in float64, on every ISA."""

import numpy as np
import pytest

import tolerances
from ftjax.kernels import exp_sub_sum

# Row lengths around the vector widths (8, 16): tails, one vector, several.
LENGTHS = (1, 3, 8, 15, 16, 17, 40, 128, 131)


def reference(x, max):  # noqa: A002
  """From the float32 differences x - max, as the kernels take them (that rounding alone moves
  exp by up to |x - max| * 2^-24, ~5e-6 at -87), exponentiated in float64."""
  shifted = (x - max[:, None]).astype(np.float64)
  out = np.where(shifted < -87.0, 0.0, np.exp(shifted))
  return out, out.sum(axis=1)


@pytest.mark.parametrize("length", LENGTHS)
def test_matches_numpy(length, isa):
  """Scores as in attention (max = the row's max): the max element gives exactly 1; values
  spread over [-100, 0] below it, so some fall under -87 and give 0."""
  rng = np.random.default_rng(length)
  x = rng.uniform(-60.0, 40.0, (5, length)).astype(np.float32)
  max = x.max(axis=1)
  out, sums = exp_sub_sum(x, max)
  out, sums = np.asarray(out), np.asarray(sums)
  ref_out, ref_sums = reference(x, max)
  tolerances.assert_close(out, ref_out, tolerances.F32_ROUNDING)
  np.testing.assert_allclose(out, ref_out, rtol=1e-6, atol=0.0)  # relative, for the small ones
  np.testing.assert_allclose(sums, ref_sums, rtol=1e-6)
  np.testing.assert_array_equal(out[np.arange(5), x.argmax(axis=1)], 1.0)


def test_large_negative_and_infinite_inputs_give_zero(isa):
  x = np.array([[0.0, -86.9, -87.5, -200.0, -1e30, -np.inf, -np.inf, 0.0, -3.0, -1e4, -88.0,
                 -np.inf, -500.0, -90.0, -87.01, -np.inf, -1e38]], np.float32)
  out, sums = exp_sub_sum(x, np.zeros(1, np.float32))
  out = np.asarray(out)[0]
  expected = np.where(x[0] < -87.0, 0.0, np.exp(x[0].astype(np.float64)))
  np.testing.assert_array_equal(out[x[0] < -87.0], 0.0)
  np.testing.assert_allclose(out, expected, rtol=1e-6, atol=0.0)
  np.testing.assert_allclose(np.asarray(sums)[0], expected.sum(), rtol=1e-6)


def test_rejects_bad_shapes():
  with pytest.raises(ValueError, match="max must be float32"):
    exp_sub_sum(np.zeros((2, 3), np.float32), np.zeros(3, np.float32))
  with pytest.raises(ValueError, match="x must be float32"):
    exp_sub_sum(np.zeros(3, np.float32), np.zeros(3, np.float32))
