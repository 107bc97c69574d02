"""KernelTable::argmax_f32 (through ftjax_argmax) against numpy's argmax, on every ISA: the
first index of each row's largest value, a NaN counting as the largest (the row's first NaN),
as jnp.argmax orders them; and greedy sampling with the host kernels against jnp.argmax."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.kernels import argmax
from ftjax.runtime.sampling import Sampling, greedy_tokens, sample, sample_rows


def rows_with_edge_cases(rows, columns, seed):
  """Random rows, then (where the row is long enough): a tie of the largest in row 0, two NaNs
  in row 1, row 2 all -inf, two +inf in row 3, and -0.0 / +0.0 as the largest in row 4."""
  x = np.random.default_rng(seed).standard_normal((rows, columns)).astype(np.float32)
  if columns < 8:
    return x
  top = x[0].max()
  x[0, columns // 3] = x[0, columns - 1] = top + 1
  if rows > 1:
    x[1, columns - 2] = x[1, columns // 2] = np.nan
  if rows > 2:
    x[2] = -np.inf
  if rows > 3:
    x[3, 5] = x[3, columns - 3] = np.inf
  if rows > 4:
    x[4] = -1.0
    x[4, columns // 4], x[4, columns // 2] = -0.0, 0.0
  return x


# Widths around the lanes (4, 8, 16) and the kernel's blocks of 2048; the row split over the
# threads (parts of >= 16384 values); the 35B-shaped model's 248,320 logits.
@pytest.mark.parametrize("rows,columns", [(1, 1), (3, 7), (5, 16), (5, 17), (6, 2047),
                                          (5, 2049), (2, 40000), (1, 248320), (8, 248320)])
def test_matches_numpy(rows, columns, isa):
  x = rows_with_edge_cases(rows, columns, seed=rows * columns)
  got = np.asarray(argmax(x))
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, np.argmax(x, axis=-1))
  np.testing.assert_array_equal(got, np.asarray(jnp.argmax(x, axis=-1)))


def test_the_first_nan_wins_over_a_later_part_of_the_row(isa):
  """A row split over the threads: a NaN in the second part, a larger value in neither."""
  x = np.zeros((1, 70000), np.float32)
  x[0, 50000] = np.nan
  x[0, 60000] = np.nan
  x[0, 10] = 5.0
  assert int(argmax(x)[0]) == 50000


def test_bad_input_names_the_problem():
  with pytest.raises(ValueError, match="float32"):
    argmax(np.zeros((2, 3), np.float64))
  with pytest.raises(ValueError, match=r"\[N, M\]"):
    argmax(np.zeros((6,), np.float32))
  with pytest.raises(ValueError, match="M < 2\\*\\*31"):
    argmax(np.zeros((2, 0), np.float32))


@pytest.mark.parametrize("kernels", ["xla", "ffi"])
def test_greedy_sampling_takes_the_same_token_either_way(kernels):
  logits = rows_with_edge_cases(5, 3000, seed=3)
  greedy = Sampling.make(greedy=True)
  rows = jax.tree.map(lambda v: np.repeat(np.asarray(v)[None], 5, 0), greedy)
  want = np.argmax(logits, axis=-1)
  np.testing.assert_array_equal(np.asarray(jax.jit(greedy_tokens, static_argnums=1)(
      logits, kernels)), want)
  got = jax.jit(lambda z: sample_rows(z, rows, jnp.zeros(5, jnp.int32), kernels=kernels))(logits)
  np.testing.assert_array_equal(np.asarray(got), want)
  one = jax.jit(lambda z: sample(z, greedy, jnp.zeros((), jnp.int32), kernels=kernels))(logits[1])
  assert int(one) == want[1]
