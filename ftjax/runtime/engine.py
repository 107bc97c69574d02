"""The engine: prefill + token-by-token decode over a loaded model.

This is the reference execution of the foundation: every routed expert is computed from the
host expert bank (no device cache yet). Compilation is done ahead of time per shape and
reported separately, so throughput numbers measure execution only.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.model.transformer import DecodeState, forward, init_state
from ftjax.runtime.model import Model
from ftjax.runtime.sampling import check_sampling_args, sample

_STATE_BUCKET = 256  # KV capacity is rounded up to this, so nearby lengths share a compile


class ContextLengthError(ValueError):
  pass


def _ffi_available() -> bool:
  try:
    import ftjax.kernels  # noqa: F401, PLC0415
  except ImportError:
    return False
  return True


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
  """Runtime choices, separate from the model config.

  max_seq_len: context limit (prompt + new tokens); default the model's
    ``max_position_embeddings``.
  kernels: how host-side work runs: "ffi" (ftjax's C++ kernels, CPU backend), "xla" (plain
    jnp), or "auto" (ffi on the CPU backend when the compiled module is present, else xla).
  """
  max_seq_len: int | None = None
  kernels: str = "auto"

  def __post_init__(self):
    if self.kernels not in ("auto", "xla", "ffi"):
      raise ValueError(f"kernels must be 'auto', 'xla' or 'ffi', got {self.kernels!r}")
    if self.max_seq_len is not None and self.max_seq_len < 1:
      raise ValueError(f"max_seq_len must be positive, got {self.max_seq_len}")


@dataclasses.dataclass
class GenerateResult:
  tokens: list[int]  # new tokens only
  prompt_tokens: int
  prefill_s: float
  decode_s: float
  compile_s: float

  @property
  def prefill_tok_s(self) -> float:
    return self.prompt_tokens / self.prefill_s if self.prefill_s else float("nan")

  @property
  def decode_tok_s(self) -> float:
    # The first new token comes from the prefill; the others from decode steps.
    steps = max(len(self.tokens) - 1, 0)
    return steps / self.decode_s if self.decode_s else float("nan")


class Engine:
  """``Engine(model, **runtime_options)``; see ``RuntimeOptions`` for the options."""

  def __init__(self, model: Model, **runtime_options):
    self.model = model
    self.options = RuntimeOptions(**runtime_options)
    impl = self.options.kernels
    if impl == "auto":
      impl = "ffi" if jax.default_backend() == "cpu" and _ffi_available() else "xla"
    elif impl == "ffi" and jax.default_backend() != "cpu":
      raise ValueError("kernels='ffi' needs the CPU backend; the GPU kernels are not built yet")
    self.kernels = impl
    self.max_seq_len = self.options.max_seq_len or model.config.max_position_embeddings
    self._compiled: dict[tuple, Callable] = {}
    self.compile_s = 0.0

  # -- Steps ---------------------------------------------------------------------------------

  def _step_fn(self, state: DecodeState, tokens, positions, last_only: bool):
    key = (tokens.shape, tuple(x.shape for x in jax.tree.leaves(state)), last_only)
    fn = self._compiled.get(key)
    if fn is None:
      t0 = time.perf_counter()
      fn = forward.lower(self.model.graphdef, self.model.params, self.model.bank, state, tokens,
                         positions, last_only=last_only, kernels=self.kernels).compile()
      self.compile_s += time.perf_counter() - t0
      self._compiled[key] = fn
    return fn

  def step(self, state: DecodeState, tokens: jax.Array, positions: jax.Array, *,
           last_only: bool = False) -> tuple[DecodeState, jax.Array]:
    """One jitted forward: tokens/positions [B, T] -> (new state, logits). Donates state."""
    fn = self._step_fn(state, tokens, positions, last_only)
    return fn(self.model.params, self.model.bank, state, tokens, positions)

  def new_state(self, batch: int, capacity: int) -> DecodeState:
    capacity = min(-(-capacity // _STATE_BUCKET) * _STATE_BUCKET, self.max_seq_len)
    return init_state(self.model.config, batch, capacity)

  def check_context(self, prompt_len: int, new: int) -> None:
    if prompt_len < 1:
      raise ValueError("the prompt is empty: give at least one token")
    if prompt_len + new > self.max_seq_len:
      raise ContextLengthError(
          f"prompt ({prompt_len} tokens) + max_new_tokens ({new}) = {prompt_len + new} exceeds the "
          f"context of {self.max_seq_len} tokens: shorten the prompt or lower max_new_tokens")

  def _check_ids(self, ids: np.ndarray) -> None:
    vocab = self.model.config.vocab_size
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
      raise ValueError(f"token ids must be in [0, {vocab}); got min {ids.min()}, max {ids.max()}")

  # -- Public API ----------------------------------------------------------------------------

  def forward_logits(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Teacher-forced logits over the whole sequence: [T] -> [T, V] (or [B, T] -> [B, T, V])."""
    ids = np.asarray(token_ids, np.int32)
    batched = ids.ndim == 2
    ids2 = ids if batched else ids[None]
    self._check_ids(ids2)
    self.check_context(ids2.shape[1], 0)
    state = self.new_state(ids2.shape[0], ids2.shape[1])
    positions = np.broadcast_to(np.arange(ids2.shape[1], dtype=np.int32), ids2.shape)
    _, logits = self.step(state, jnp.asarray(ids2), jnp.asarray(positions))
    out = np.asarray(logits, np.float32)
    return out if batched else out[0]

  def generate(self, token_ids: Sequence[int], max_new_tokens: int, greedy: bool = True, *,
               temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
               stop_tokens: Sequence[int] = (), on_token: Callable[[int], None] | None = None
               ) -> list[int]:
    """New tokens after ``token_ids`` (prefill, then one token per step)."""
    return self.generate_timed(token_ids, max_new_tokens, greedy, temperature=temperature,
                               top_p=top_p, seed=seed, stop_tokens=stop_tokens,
                               on_token=on_token).tokens

  def generate_timed(self, token_ids: Sequence[int], max_new_tokens: int, greedy: bool = True,
                     *, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                     stop_tokens: Sequence[int] = (),
                     on_token: Callable[[int], None] | None = None) -> GenerateResult:
    check_sampling_args(greedy, temperature, top_p)
    if max_new_tokens < 0:
      raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    ids = np.asarray(token_ids, np.int32).reshape(-1)
    self._check_ids(ids)
    self.check_context(len(ids), max_new_tokens)
    rng = np.random.default_rng(seed)
    compile_before = self.compile_s
    state = self.new_state(1, len(ids) + max_new_tokens)
    tokens = jnp.asarray(ids[None])
    positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
    one = jnp.zeros((1, 1), jnp.int32)
    if max_new_tokens > 1:  # compile the decode step before any timing
      self._step_fn(state, one, one, True)
    self._step_fn(state, tokens, positions, True)

    out: list[int] = []
    t0 = time.perf_counter()
    state, logits = self.step(state, tokens, positions, last_only=True)
    logits = np.asarray(logits[0, -1], np.float32)
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    pos = len(ids)
    for _ in range(max_new_tokens):
      tok = sample(logits, rng, greedy=greedy, temperature=temperature, top_p=top_p)
      out.append(tok)
      if on_token is not None:
        on_token(tok)
      if tok in stop_tokens or len(out) == max_new_tokens:
        break
      state, logits = self.step(state, jnp.full((1, 1), tok, jnp.int32),
                                jnp.full((1, 1), pos, jnp.int32), last_only=True)
      logits = np.asarray(logits[0, -1], np.float32)
      pos += 1
    decode_s = time.perf_counter() - t0
    return GenerateResult(tokens=out, prompt_tokens=len(ids), prefill_s=prefill_s,
                          decode_s=decode_s, compile_s=self.compile_s - compile_before)
