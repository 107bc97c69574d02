"""KernelTable::delta_rule_step (through ftjax_delta_rule_step) against a float64 numpy loop of
the gated delta rule, on every ISA; and the Gated DeltaNet layer's decode token with the host
kernels against its XLA form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tolerances
from ftjax.kernels import delta_rule_step
from ftjax.model.deltanet import GatedDeltaNet, LinearState, gated_delta_recurrent, l2_normalize


def reference(q, k, v, g, beta, state):
  """The delta rule in float64, head by head: decay, predict, correct, read."""
  s = state.astype(np.float64).copy()
  out = np.zeros(v.shape, np.float64)
  b_, m_ = g.shape
  for b in range(b_):
    for m in range(m_):
      h = s[b, m] * np.exp(np.float64(g[b, m]))
      delta = np.float64(beta[b, m]) * (v[b, m] - h.T @ k[b, m].astype(np.float64))
      h = h + np.outer(k[b, m], delta)
      s[b, m] = h
      out[b, m] = h.T @ q[b, m].astype(np.float64)
  return out, s


def problem(shape, seed=0):
  b, m, u, y = shape
  rng = np.random.default_rng(seed)
  q = l2_normalize(rng.standard_normal((b, m, u))).astype(np.float32) * np.float32(u ** -0.5)
  k = np.asarray(l2_normalize(rng.standard_normal((b, m, u))), np.float32)
  v = rng.standard_normal((b, m, y)).astype(np.float32)
  g = -rng.uniform(0.01, 2.0, (b, m)).astype(np.float32)
  beta = rng.uniform(0.0, 1.0, (b, m)).astype(np.float32)
  state = rng.standard_normal((b, m, u, y)).astype(np.float32)
  return np.asarray(q, np.float32), k, v, g, beta, state


# Widths around the vector widths (8, 16 lanes): tails, one vector, the models' 128.
@pytest.mark.parametrize("shape", [(1, 1, 4, 3), (2, 3, 16, 17), (3, 4, 32, 128), (1, 2, 128, 40)])
def test_matches_numpy(shape, isa):
  args = problem(shape, seed=sum(shape))
  out, state = delta_rule_step(*args)
  ref_out, ref_state = reference(*args)
  tolerances.assert_close(np.asarray(out), ref_out, tolerances.F32, what="out")
  tolerances.assert_close(np.asarray(state), ref_state, tolerances.F32, what="state")


def test_a_row_that_neither_decays_nor_updates_keeps_its_state_bitwise(isa):
  """A padded row of a batch (the decode loop's inactive rows): g = 0, beta = 0."""
  q, k, v, g, beta, state = problem((3, 2, 16, 24), seed=7)
  g[1], beta[1] = 0.0, 0.0
  out, new = delta_rule_step(q, k, v, g, beta, state)
  np.testing.assert_array_equal(np.asarray(new)[1], state[1])
  ref_out, ref_state = reference(q, k, v, g, beta, state)
  tolerances.assert_close(np.asarray(out), ref_out, tolerances.F32)
  tolerances.assert_close(np.asarray(new), ref_state, tolerances.F32)


def test_in_place_under_jit_with_the_state_donated():
  args = problem((2, 4, 32, 32), seed=3)
  ref_out, ref_state = reference(*args)
  state = jnp.asarray(args[-1])
  step = jax.jit(delta_rule_step, donate_argnums=5)
  out, new = step(*args[:-1], state)
  assert state.is_deleted()  # donated, and its buffer reused for the result
  tolerances.assert_close(np.asarray(new), ref_state, tolerances.F32)
  tolerances.assert_close(np.asarray(out), ref_out, tolerances.F32)


def test_agrees_with_the_xla_recurrence():
  q, k, v, g, beta, state = problem((2, 4, 16, 16), seed=5)
  xla_out, xla_state = gated_delta_recurrent(q[:, None], k[:, None], v[:, None], g[:, None],
                                             beta[:, None], state)
  out, new = delta_rule_step(q, k, v, g, beta, state)
  tolerances.assert_close(np.asarray(out), np.asarray(xla_out)[:, 0], tolerances.F32)
  tolerances.assert_close(np.asarray(new), np.asarray(xla_state), tolerances.F32)


def test_the_layer_decode_token_on_the_host_kernels_matches_xla():
  """GatedDeltaNet with kernels="ffi" runs its one-token step on ftjax_delta_rule_step; the
  state and output equal the XLA form's, including a row that does not step (active)."""
  layer = GatedDeltaNet(width=32, key_heads=2, value_heads=4, key_dim=16, value_dim=8,
                        conv_width=4, eps=1e-6, rngs=nnx.Rngs(0), dtype=jnp.float32)
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((3, 1, 32)), jnp.float32)
  state = LinearState(conv=jnp.asarray(rng.standard_normal((3, 3, 2 * 2 * 16 + 4 * 8)),
                                       jnp.float32),
                      recurrent=jnp.asarray(rng.standard_normal((3, 4, 16, 8)), jnp.float32))
  active = jnp.asarray([True, False, True])
  valid = active[:, None]
  got = layer(x, state, kernels="ffi", valid=valid, active=active)
  want = layer(x, state, kernels="xla", valid=valid, active=active)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    tolerances.assert_close(np.asarray(a), np.asarray(b), tolerances.F32)
  np.testing.assert_array_equal(np.asarray(got[0].recurrent)[1], np.asarray(state.recurrent)[1])


def test_rejects_bad_shapes():
  q, k, v, g, beta, state = problem((1, 2, 4, 4))
  with pytest.raises(ValueError, match=r"k must be float32 \[1, 2, 4\]"):
    delta_rule_step(q, k[:, :1], v, g, beta, state)
  with pytest.raises(ValueError, match="state must be float32"):
    delta_rule_step(q, k, v, g, beta, state[0])
  with pytest.raises(ValueError, match=r"beta must be float32 \[1, 2\]"):
    delta_rule_step(q, k, v, g, beta.astype(np.float64), state)
