"""Next-token choice on the device: greedy, or temperature with top-k and nucleus (top-p)
filtering, in JAX.

Runs inside the decode loop's program, so no logits row ever goes to the host. Sampling is
deterministic for a seed: token ``i`` of a request draws with ``fold_in(key(seed), i)``,
whatever the chunk length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ftjax.kernels import argmax as host_argmax
from ftjax.model.layers import FFI_KERNELS


def check_sampling_args(greedy: bool, temperature: float, top_p: float, top_k: int = 0) -> None:
  if not greedy and not temperature > 0:
    raise ValueError(f"--temperature must be > 0 when sampling (got {temperature}); "
                     "use --greedy for deterministic argmax decoding")
  if not 0 < top_p <= 1:
    raise ValueError(f"--top_p must be in (0, 1] (got {top_p})")
  if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
    raise ValueError(f"--top_k must be an int >= 0 (0: no top-k filter), got {top_k!r}")


@struct.dataclass
class Sampling:
  """How a request picks tokens. Every field is data, so one compiled program serves every
  request whatever its options: the device branches on ``greedy`` and ``nucleus`` (a
  conditional runs only the branch taken, so greedy decoding pays no sort). ``make`` builds
  it on the host (numpy leaves); the engine moves it to the device explicitly."""
  temperature: jax.Array  # float32 []
  top_p: jax.Array  # float32 []
  seed: jax.Array  # uint32 []
  top_k: jax.Array  # int32 []: keep the k most probable tokens (0: all)
  greedy: jax.Array  # bool []: argmax
  nucleus: jax.Array  # bool []: a filter applies (top_p < 1 or top_k > 0)

  @classmethod
  def make(cls, *, greedy: bool, temperature: float = 1.0, top_p: float = 1.0,
           seed: int = 0, top_k: int = 0) -> "Sampling":
    check_sampling_args(greedy, temperature, top_p, top_k)
    if not 0 <= seed < 2**32:
      raise ValueError(f"seed must be in [0, 2**32), got {seed}")
    return cls(temperature=np.float32(temperature), top_p=np.float32(top_p),
               seed=np.uint32(seed), top_k=np.int32(min(top_k, 2**31 - 1)),
               greedy=np.bool_(greedy),
               nucleus=np.bool_((not greedy) and (top_p < 1.0 or top_k > 0)))


def greedy_tokens(logits: jax.Array, kernels: str = "xla") -> jax.Array:
  """The argmax of each row: logits [R, V] -> int32 [R], the first of equal largest logits (a
  NaN counting as the largest). Where the kernels switch runs the host kernels, ftjax's
  (``ftjax.kernels.argmax``: one read of the row; XLA:CPU's ``jnp.argmax`` took 2.9 ms of a
  35B-shaped step of 8 rows), else ``jnp.argmax``: the same index either way."""
  logits = logits.astype(jnp.float32)
  if kernels in FFI_KERNELS:
    return host_argmax(logits)
  return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def sample(logits: jax.Array, sampling: Sampling, index: jax.Array, *,
           kernels: str = "xla") -> jax.Array:
  """logits [V] float32 -> token id (int32 []); ``index`` is the token's number in the
  request (0 for the first new token), which picks its random draw; ``kernels`` (the
  engine's switch) picks the argmax's implementation (``greedy_tokens``)."""
  logits = logits.astype(jnp.float32)

  def draw(z):
    z = jax.lax.cond(sampling.nucleus, _filtered, lambda z, s: z, z, sampling)
    key = jax.random.fold_in(jax.random.key(sampling.seed), index)
    return jax.random.categorical(key, z).astype(jnp.int32)

  return jax.lax.cond(sampling.greedy, lambda z: greedy_tokens(z[None], kernels)[0],
                      lambda z: draw(z / sampling.temperature), logits)


def distribution(logits: jax.Array, sampling: Sampling) -> jax.Array:
  """The probabilities ``sample`` draws from, for a request that samples: logits [R, V] ->
  float32 [R, V], each row the softmax of its logits over the temperature, zero outside the
  top-p / top-k set where a filter applies (``sampling``'s leaves are scalars). Speculative
  sampling's acceptance test compares these (``ftjax.runtime.speculative``)."""
  z = logits.astype(jnp.float32) / sampling.temperature
  z = jax.lax.cond(sampling.nucleus, jax.vmap(_filtered, in_axes=(0, None)), lambda z, s: z, z,
                   sampling)
  return jax.nn.softmax(z, axis=-1)


def _filtered(z: jax.Array, sampling: Sampling) -> jax.Array:
  """``z`` with -inf outside the smallest set of most probable tokens whose mass reaches
  top_p, and of those at most the top_k most probable (top_k 0: no limit)."""
  probs = jax.nn.softmax(z)
  order = jnp.argsort(-probs, stable=True)
  sorted_p = probs[order]
  keep_sorted = jnp.cumsum(sorted_p) - sorted_p < sampling.top_p
  rank = jnp.arange(z.shape[-1], dtype=jnp.int32)
  keep_sorted &= (sampling.top_k <= 0) | (rank < sampling.top_k)
  keep = jnp.zeros(z.shape, bool).at[order].set(keep_sorted)
  return jnp.where(keep, z, -jnp.inf)


def sample_rows(logits: jax.Array, sampling: Sampling, index: jax.Array, *,
                kernels: str = "xla") -> jax.Array:
  """``sample`` for each row of a batch: logits [B, V], sampling with leaves [B], index [B]
  -> tokens int32 [B], each row's token the one ``sample`` picks for it alone. The filter's
  sort runs only when some row needs it, and draws only when some row samples."""
  if logits.shape[0] == 1:
    return sample(logits[0], jax.tree.map(lambda x: x[0], sampling), index[0],
                  kernels=kernels)[None]
  logits = logits.astype(jnp.float32)
  greedy = greedy_tokens(logits, kernels)

  def draws(z):
    z = z / sampling.temperature[:, None]
    z = jax.lax.cond(jnp.any(sampling.nucleus),
                     lambda z: jnp.where(sampling.nucleus[:, None],
                                         jax.vmap(_filtered)(z, sampling), z),
                     lambda z: z, z)
    keys = jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.key(seed), i))(
        sampling.seed, index)
    return jax.vmap(jax.random.categorical)(keys, z).astype(jnp.int32)

  drawn = jax.lax.cond(jnp.all(sampling.greedy), lambda z: greedy, draws, logits)
  return jnp.where(sampling.greedy, greedy, drawn)
