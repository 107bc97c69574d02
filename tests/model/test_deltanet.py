"""Gated DeltaNet: the chunked and recurrent gated delta rule against a float64 loop, and the
layer's decode state (conv inputs, recurrent state) across splits and padding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ftjax.model.deltanet import (GatedDeltaNet, LinearState, gated_delta_chunked,
                                  gated_delta_recurrent, l2_normalize, unit_lower_inverse)

import tolerances

B, M, U, Y = 2, 3, 8, 5


def _inputs(t, seed=0):
  rng = np.random.default_rng(seed)
  q = l2_normalize(jnp.asarray(rng.standard_normal((B, t, M, U)), jnp.float32)) * U ** -0.5
  k = l2_normalize(jnp.asarray(rng.standard_normal((B, t, M, U)), jnp.float32))
  v = jnp.asarray(rng.standard_normal((B, t, M, Y)), jnp.float32)
  g = -jnp.asarray(rng.uniform(0.0, 0.5, (B, t, M)), jnp.float32)
  beta = jnp.asarray(rng.uniform(0.0, 1.0, (B, t, M)), jnp.float32)
  state = jnp.asarray(0.3 * rng.standard_normal((B, M, U, Y)), jnp.float32)
  return q, k, v, g, beta, state


def _reference(q, k, v, g, beta, state):
  """The gated delta rule, token by token, in float64 numpy."""
  q, k, v, g, beta, s = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, state))
  out = np.zeros(v.shape)
  for t in range(q.shape[1]):
    for b in range(B):
      for m in range(M):
        s[b, m] *= np.exp(g[b, t, m])
        delta = beta[b, t, m] * (v[b, t, m] - s[b, m].T @ k[b, t, m])
        s[b, m] += np.outer(k[b, t, m], delta)
        out[b, t, m] = s[b, m].T @ q[b, t, m]
  return out, s


@pytest.mark.parametrize("t", [1, 5, 63, 64, 65, 130])
def test_recurrent_and_chunked_forms_equal_the_float64_loop(t):
  args = _inputs(t, seed=t)
  ref_out, ref_state = _reference(*args)
  rec_out, rec_state = gated_delta_recurrent(*args)
  chunk_out, chunk_state = gated_delta_chunked(*args)
  tolerances.assert_close(rec_out, ref_out, tolerances.F32, floor=1.0, what="recurrent out")
  tolerances.assert_close(rec_state, ref_state, tolerances.F32, floor=1.0, what="recurrent state")
  tolerances.assert_close(chunk_out, ref_out, tolerances.F32, floor=1.0, what="chunked out")
  tolerances.assert_close(chunk_state, ref_state, tolerances.F32, floor=1.0, what="chunked state")
  # The bound: the two float32 forms agree to 1e-5.
  np.testing.assert_allclose(chunk_out, rec_out, rtol=0, atol=1e-5)
  np.testing.assert_allclose(chunk_state, rec_state, rtol=0, atol=1e-5)


def test_chunk_sizes_agree():
  args = _inputs(100, seed=3)
  out64, s64 = gated_delta_chunked(*args)
  out16, s16 = gated_delta_chunked(*args, chunk=16)
  np.testing.assert_allclose(out16, out64, rtol=0, atol=1e-5)
  np.testing.assert_allclose(s16, s64, rtol=0, atol=1e-5)


def test_zero_beta_and_decay_leave_the_state_untouched():
  q, k, v, g, beta, state = _inputs(70, seed=4)
  _, s = gated_delta_chunked(q, k, v, jnp.zeros_like(g), jnp.zeros_like(beta), state)
  np.testing.assert_array_equal(s, state)


@pytest.fixture(scope="module")
def layer():
  return GatedDeltaNet(width=16, key_heads=2, value_heads=4, key_dim=8, value_dim=6,
                       conv_width=4, eps=1e-6, rngs=nnx.Rngs(0))


def _x(t, seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((2, t, 16)), jnp.float32)


def _empty():
  return LinearState.zeros(2, 4, 2 * 2 * 8 + 4 * 6, 4, 8, 6)


@pytest.mark.parametrize("split", [1, 2, 3, 40, 69])
def test_state_carries_across_splits(layer, split):
  """A prompt in two pieces (any split, shorter or longer than the conv) equals one piece;
  decoding token by token equals both."""
  x = _x(70)
  whole_state, whole = layer(x, _empty())
  s, first = layer(x[:, :split], _empty())
  s, second = layer(x[:, split:], s)
  tolerances.assert_close(jnp.concatenate([first, second], 1), whole, tolerances.F32, floor=1.0)
  tolerances.assert_close(s.recurrent, whole_state.recurrent, tolerances.F32, floor=1.0)
  np.testing.assert_array_equal(s.conv, whole_state.conv)
  s, outs = _empty(), []
  for t in range(12):
    s, y = layer(x[:, t:t + 1], s)
    outs.append(y)
  tolerances.assert_close(jnp.concatenate(outs, 1), whole[:, :12], tolerances.F32, floor=1.0)


def test_padding_neither_updates_nor_shifts_the_state(layer):
  x = _x(11)
  real = 7
  padded = x.at[:, real:].set(100.0)  # garbage in the padding must not matter
  valid = jnp.broadcast_to(jnp.arange(11) < real, (2, 11))
  s_pad, y_pad = layer(padded, _empty(), valid=valid, num_valid=jnp.int32(real))
  s_ref, y_ref = layer(x[:, :real], _empty())
  np.testing.assert_array_equal(s_pad.conv, s_ref.conv)
  tolerances.assert_close(s_pad.recurrent, s_ref.recurrent, tolerances.F32, floor=1.0)
  tolerances.assert_close(y_pad[:, :real], y_ref, tolerances.F32, floor=1.0)


def test_decode_step_is_constant_size(layer):
  """The decode state does not grow with the context: one token's program is the same at
  any length."""
  s = _empty()
  step = jax.jit(lambda s, x: layer(x, s))
  for t in range(3):
    s, _ = step(s, _x(1, seed=t))
  assert step._cache_size() == 1
  assert s.conv.shape == (2, 3, 56) and s.recurrent.shape == (2, 4, 8, 6)


def test_unit_lower_inverse_and_its_gradient():
  rng = np.random.default_rng(5)
  strict = jnp.asarray(np.tril(0.3 * rng.standard_normal((3, 16, 16)), -1), jnp.float32)
  eye = jnp.eye(16)
  inv = unit_lower_inverse(strict)
  tolerances.assert_close(inv @ (eye + strict), jnp.broadcast_to(eye, inv.shape), tolerances.F32,
                          floor=1.0)
  probe = jnp.asarray(rng.standard_normal((3, 16, 16)), jnp.float32)

  def reference(s):  # differentiates through XLA's triangular solve
    return jnp.sum(probe * jax.scipy.linalg.solve_triangular(
        eye + jnp.tril(s, -1), jnp.broadcast_to(eye, s.shape), lower=True, unit_diagonal=True))

  got = jax.grad(lambda s: jnp.sum(probe * unit_lower_inverse(s)))(strict)
  tolerances.assert_close(got, jax.grad(reference)(strict), tolerances.F32, floor=1.0)
  assert np.all(np.triu(np.asarray(got)) == 0)


@pytest.mark.parametrize("t", [5, 64, 130])
def test_snapshots_equal_the_float64_loop_after_each_prefix(t):
  """The chunked form's states after p tokens (any p in [0, T], chunk boundaries included)
  equal the float64 loop run on the first p tokens."""
  q, k, v, g, beta, state = _inputs(t, seed=3)
  positions = sorted({0, 1, t // 2, t - 1, t} | ({63, 64, 65} if t > 65 else set()))
  out, final, snaps = gated_delta_chunked(q, k, v, g, beta, state,
                                          snapshot_at=jnp.asarray(positions))
  ref_out, ref_final = gated_delta_chunked(q, k, v, g, beta, state)
  np.testing.assert_array_equal(out, ref_out)  # snapshots change nothing else
  np.testing.assert_array_equal(final, ref_final)
  assert snaps.shape == (len(positions), B, M, U, Y)
  for i, p in enumerate(positions):
    _, ref = _reference(q[:, :p], k[:, :p], v[:, :p], g[:, :p], beta[:, :p], state)
    tolerances.assert_close(snaps[i], ref, tolerances.F32, floor=1.0, what=f"T={t} p={p}")


@pytest.mark.parametrize("t", [1, 3, 8])
def test_recurrent_snapshots_equal_the_float64_loop_after_each_prefix(t):
  """The token loop's states after p tokens (what a speculative verify step of t tokens keeps)
  equal the float64 loop run on the first p tokens, for every p in [0, T]."""
  q, k, v, g, beta, state = _inputs(t, seed=5)
  positions = list(range(t + 1))
  out, final, snaps = gated_delta_recurrent(q, k, v, g, beta, state,
                                            snapshot_at=jnp.asarray(positions))
  ref_out, ref_final = gated_delta_recurrent(q, k, v, g, beta, state)
  np.testing.assert_array_equal(out, ref_out)  # snapshots change nothing else
  np.testing.assert_array_equal(final, ref_final)
  np.testing.assert_array_equal(snaps[-1], final)
  assert snaps.shape == (t + 1, B, M, U, Y)
  for p in positions:
    _, ref = _reference(q[:, :p], k[:, :p], v[:, :p], g[:, :p], beta[:, :p], state)
    tolerances.assert_close(snaps[p], ref, tolerances.F32, floor=1.0, what=f"T={t} p={p}")


def test_layer_snapshots_equal_splitting_there(layer):
  """The layer's snapshots (conv inputs and delta state) equal the state of a prompt split at
  each position, also with padding after the real tokens."""
  x = _x(70, seed=4)
  positions = jnp.asarray([3, 20, 64, 69])
  valid = jnp.broadcast_to(jnp.arange(80) < 70, (2, 80))
  padded = jnp.concatenate([x, jnp.full((2, 10, 16), 50.0)], axis=1)
  state, y, snaps = layer(padded, _empty(), valid=valid, num_valid=jnp.int32(70),
                          snapshot_at=positions)
  ref_state, ref_y = layer(x, _empty())
  tolerances.assert_close(y[:, :70], ref_y, tolerances.F32, floor=1.0)
  np.testing.assert_array_equal(state.conv, ref_state.conv)
  for i, p in enumerate(np.asarray(positions)):
    split, _ = layer(x[:, :p], _empty())
    np.testing.assert_array_equal(snaps.conv[i], split.conv)
    tolerances.assert_close(snaps.recurrent[i], split.recurrent, tolerances.F32, floor=1.0,
                            what=f"p={p}")
