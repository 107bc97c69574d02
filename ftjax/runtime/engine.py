"""The engine: prefill + token-by-token decode over a loaded model.

Without an expert cache every routed expert is computed from the host expert bank (the
reference execution); with one, each layer-step is planned by the cache policy and split
between slots and the bank (``ftjax.cache``). Compilation is done ahead of time per shape,
shared by all engines of the process, and reported separately, so throughput numbers
measure execution only.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.cache.policy import PolicyConfig
from ftjax.cache.state import ExpertCache
from ftjax.model.transformer import DecodeState, forward, init_state
from ftjax.runtime.model import Model
from ftjax.runtime.sampling import check_sampling_args, sample

_STATE_BUCKET = 256  # KV capacity is rounded up to this, so nearby lengths share a compile


class ContextLengthError(ValueError):
  pass


# Compiled steps, shared by every engine in the process: keyed by everything the program
# depends on (graph, static options, and the shapes and dtypes of all arguments).
_COMPILED: dict[tuple, Callable] = {}


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
  kernels: how host-side work runs: "ffi" (ftjax's C++ kernels, CPU backend; bfloat16
    weights widened exactly to float32), "ffi_bf16" (the same, with activations rounded to
    bfloat16 for bfloat16 weights: about 1.8x faster prefill, ~1e-2 relative error, as
    llama.cpp does), "xla" (plain jnp), or "auto" (on the CPU backend with the compiled
    module: ffi_bf16 for bfloat16 models, ffi otherwise; else xla).
  Expert cache (at most one of the four sizes; none = no cache, every routed expert runs
  from the host pool):
    cache_slots: number of slots; cache_fraction: of all L·E experts; cache_bytes: a memory
    size; device_budget_bytes: a budget shared with the KV cache, re-divided automatically
    as the KV cache grows or shrinks (DESIGN section 5).
  policy: one of ``ftjax.cache.POLICIES``.
  bandwidths: (B_P, B_H) in GB/s, or profile: a ``python -m ftjax.profile`` JSON. Needed by
    the freetoken policy.
  hot_experts: routing counts [L, E] choosing the pinned set of ``static_hot``.
  cache_capacity: a fixed slot-buffer size (default: the power-of-two bucket of the slot
    count). Sizes up to it then share one compiled step: sweeps over cache sizes compile once.
  record_routing: keep every step's router output (``engine.routing_trace()``).
  """
  max_seq_len: int | None = None
  kernels: str = "auto"
  cache_slots: int | None = None
  cache_fraction: float | None = None
  cache_bytes: int | None = None
  device_budget_bytes: int | None = None
  policy: str = "freetoken"
  bandwidths: tuple[float, float] | None = None
  profile: str | None = None
  hot_experts: Any = None
  cache_capacity: int | None = None
  record_routing: bool = False

  def __post_init__(self):
    if self.kernels not in ("auto", "xla", "ffi", "ffi_bf16"):
      raise ValueError(f"kernels must be 'auto', 'xla', 'ffi' or 'ffi_bf16', got "
                       f"{self.kernels!r}")
    if self.max_seq_len is not None and self.max_seq_len < 1:
      raise ValueError(f"max_seq_len must be positive, got {self.max_seq_len}")
    sizes = {k: getattr(self, k) for k in ("cache_slots", "cache_fraction", "cache_bytes",
                                           "device_budget_bytes") if getattr(self, k) is not None}
    if len(sizes) > 1:
      raise ValueError(f"give at most one cache size, got {', '.join(sizes)}")
    for key, value in sizes.items():
      if value < 0 or (key == "cache_fraction" and value > 1):
        raise ValueError(f"{key} must be {'in [0, 1]' if key == 'cache_fraction' else '>= 0'}, "
                         f"got {value}")
    PolicyConfig(self.policy)  # validates the name
    if self.bandwidths is not None and self.profile is not None:
      raise ValueError("give bandwidths or profile, not both")
    if self.bandwidths is not None:
      if len(self.bandwidths) != 2 or min(self.bandwidths) <= 0:
        raise ValueError(f"bandwidths must be two positive GB/s numbers (B_P, B_H), got "
                         f"{self.bandwidths}")

  @property
  def caching(self) -> bool:
    return any(getattr(self, k) is not None for k in ("cache_slots", "cache_fraction",
                                                      "cache_bytes", "device_budget_bytes"))


def slot_bucket(num_slots: int) -> int:
  """Buffer capacity for ``num_slots``: the next power of two, so that resizes within a
  bucket reuse the compiled step (one compile per bucket)."""
  return 0 if num_slots == 0 else 1 << (num_slots - 1).bit_length()


def slots_for_budget(budget_bytes: int, kv_bytes: int, slot_bytes: int) -> int:
  """N = floor((budget - KV) / slot): e.g. 8 GB budget, 0.5 GB slots: KV 3 GB -> 10 slots,
  KV 4 GB -> 8, KV 2 GB -> 12 (the paper's example)."""
  return max(0, (budget_bytes - kv_bytes) // slot_bytes)


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
  """``Engine(model, **runtime_options)``; see ``RuntimeOptions`` for the options.

  The engine owns the expert cache: it persists across requests, is threaded through every
  step inside the (donated) decode state, and is resized only between steps. One sequence
  runs at a time.
  """

  def __init__(self, model: Model, **runtime_options):
    self.model = model
    self.options = opts = RuntimeOptions(**runtime_options)
    impl = opts.kernels
    if impl == "auto":
      impl = "xla"
      if jax.default_backend() == "cpu" and _ffi_available():
        impl = "ffi_bf16" if model.bank.dtype == jnp.bfloat16 else "ffi"
    elif impl.startswith("ffi") and jax.default_backend() != "cpu":
      raise ValueError(f"kernels={impl!r} needs the CPU backend; the GPU kernels are not "
                       "built yet")
    self.kernels = impl
    self.max_seq_len = opts.max_seq_len or model.config.max_position_embeddings
    self._compiled: set[tuple] = set()  # this engine's share of _COMPILED
    self.compile_s = 0.0
    self.policy = PolicyConfig(opts.policy) if opts.caching else None
    self.bandwidths, self.bandwidth_source = self._bandwidths()
    self._experts: ExpertCache | None = None
    self._steps: list[dict[str, Any]] = []
    self._routing: list[tuple[np.ndarray, np.ndarray, str]] = []  # ids, weights [L, t, K]
    if opts.caching:
      self._experts = self._initial_cache(self._requested_slots(kv_bytes=0))

  # -- Expert cache ---------------------------------------------------------------------------

  @property
  def slot_bytes(self) -> int:
    return int(self.model.bank.shape[2]) * self.model.bank.dtype.itemsize

  @property
  def total_experts(self) -> int:
    c = self.model.config
    return c.num_moe_layers * c.num_experts

  def _requested_slots(self, kv_bytes: int) -> int:
    o = self.options
    if o.cache_slots is not None:
      n = o.cache_slots
    elif o.cache_fraction is not None:
      n = int(o.cache_fraction * self.total_experts)
    elif o.cache_bytes is not None:
      n = o.cache_bytes // self.slot_bytes
    else:
      n = slots_for_budget(o.device_budget_bytes, kv_bytes, self.slot_bytes)
    return min(n, self.total_experts)  # more slots than experts would never be used

  def _bandwidths(self) -> tuple[np.ndarray | None, str]:
    o = self.options
    if o.bandwidths is not None:
      return np.asarray(o.bandwidths, np.float32), "given (B_P, B_H)"
    if o.profile is not None:
      from ftjax.runtime.profile import ExpertShape, load_profile  # noqa: PLC0415
      c = self.model.config
      prof = load_profile(o.profile, ExpertShape(c.hidden_size, c.moe_intermediate_size,
                                                 str(self.model.dtype), c.top_k))
      # Measured concurrently: B_P while the host kernel runs, and the host kernel's residual
      # bandwidth B_res while a fill runs, so B_H = B_P + B_res (DESIGN section 2).
      conc = prof["concurrent"]
      return (np.asarray([conc["b_p_gb_s"], conc["b_p_gb_s"] + conc["b_h_gb_s"]], np.float32),
              f"profile {o.profile} (concurrent)")
    if self.policy is not None and self.policy.fill_rule == "q*":
      raise ValueError(f"the {self.policy.name} policy needs bandwidths: pass bandwidths=(B_P, "
                       "B_H) in GB/s or profile=PATH (write one with `python -m ftjax.profile`)")
    return None, "none (not needed by this policy)"

  def _capacity(self, num_slots: int) -> int:
    fixed = self.options.cache_capacity
    if fixed is None:
      return slot_bucket(num_slots)
    if num_slots > fixed:
      raise ValueError(f"{num_slots} slots exceed cache_capacity={fixed}")
    return fixed

  def _initial_cache(self, num_slots: int) -> ExpertCache:
    bank, c = self.model.bank, self.model.config
    capacity = self._capacity(num_slots)
    name = self.policy.name
    if name == "static_hot":
      if self.options.hot_experts is None:
        raise ValueError("static_hot needs a routing profile: pass hot_experts=counts [L, E] "
                         "(e.g. engine.routing_counts() of a warm-up run with another policy)")
      counts = np.asarray(self.options.hot_experts, np.float64).reshape(-1)
      if counts.size != self.total_experts:
        raise ValueError(f"hot_experts must have L·E = {self.total_experts} counts, got "
                         f"{counts.size}")
      pinned = np.argsort(-counts, kind="stable")[:num_slots]
      return ExpertCache.preloaded(bank, num_slots, pinned, capacity)
    if name == "static_layers":
      whole = (num_slots // c.num_experts) * c.num_experts
      return ExpertCache.preloaded(bank, num_slots, np.arange(whole), capacity)
    return ExpertCache.empty(bank.shape, bank.dtype, num_slots, capacity)

  def resize_cache(self, slots: int | None = None, bytes: int | None = None) -> int:  # noqa: A002
    """Resizes the expert cache between steps; keeps the most recently used slots. The host
    pool is not reloaded and nothing restarts. Returns the new slot count."""
    if self._experts is None:
      raise ValueError("this engine has no expert cache: create it with cache_slots=, "
                       "cache_fraction=, cache_bytes= or device_budget_bytes=")
    if (slots is None) == (bytes is None):
      raise ValueError("give exactly one of slots= or bytes=")
    n = slots if slots is not None else bytes // self.slot_bytes
    if n < 0:
      raise ValueError(f"the cache size must be >= 0, got {n} slots")
    n = min(n, self.total_experts)
    if self.policy.name in ("static_hot", "static_layers"):
      self._experts = self._initial_cache(n)  # the pinned set is recomputed for the new size
    else:
      self._experts = self._experts.resized(n, self._capacity(n))
    return n

  def routing_counts(self) -> np.ndarray:
    """How often the router selected each (layer, expert) so far: [L, E]."""
    if self._experts is None:
      raise ValueError("routing counts are kept by the expert cache; this engine has none")
    return np.asarray(self._experts.expert_count)

  def stats(self) -> dict[str, Any]:
    """Per step and layer (hits, fills, host-run experts, q) and cumulative per layer."""
    if self._experts is None:
      return {"cache": None}
    layers = self.model.config.num_moe_layers
    total = {k: np.zeros(layers, np.int64) for k in ("hits", "fills", "host")}
    for step in self._steps:
      for k in total:
        total[k] += step[k]
    misses = total["fills"] + total["host"]
    selected = total["hits"] + misses
    eb = self.model.config.expert_block_elems * self.model.bank.dtype.itemsize
    return {
        "policy": self.policy.name, "slots": int(self._experts.limit),
        "capacity": self._experts.capacity, "slot_bytes": self.slot_bytes,
        "bandwidths_gb_s": None if self.bandwidths is None else self.bandwidths.tolist(),
        "bandwidth_source": self.bandwidth_source, "steps": len(self._steps),
        "per_step": self._steps,
        "per_layer": {**{k: v.tolist() for k, v in total.items()}, "misses": misses.tolist(),
                      "miss_rate": np.where(selected > 0, misses / np.maximum(selected, 1),
                                            0.0).tolist()},
        "miss_rate": float(misses.sum() / max(selected.sum(), 1)),
        "bytes": {"fill": int(total["fills"].sum() * eb), "host": int(total["host"].sum() * eb),
                  "device": int((total["hits"] + total["fills"]).sum() * eb)},
        "compiles": len(self._compiled),
    }

  # -- Steps ---------------------------------------------------------------------------------

  def _step_fn(self, state: DecodeState, tokens, positions, last_only: bool, fresh: bool):
    policy = self.policy.traced() if self.policy is not None else None
    args = (self.model.params, self.model.bank, state, tokens, positions)
    record = self.options.record_routing
    key = (self.model.graphdef, self.kernels, policy, last_only, fresh, record,
           jax.tree.structure(args), tuple((x.shape, x.dtype) for x in jax.tree.leaves(args)))
    fn = _COMPILED.get(key)
    if fn is None:
      t0 = time.perf_counter()
      fn = forward.lower(self.model.graphdef, *args, last_only=last_only, kernels=self.kernels,
                         policy=policy, fresh=fresh, record_routing=record).compile()
      self.compile_s += time.perf_counter() - t0
      _COMPILED[key] = fn
    self._compiled.add(key)
    return fn

  def step(self, state: DecodeState, tokens: jax.Array, positions: jax.Array, *,
           last_only: bool = False, fresh: bool = False) -> tuple[DecodeState, jax.Array]:
    """One jitted forward: tokens/positions [B, T] -> (new state, logits). Donates state.

    ``fresh=True`` is for the first step of a new state (a prefill): attention then covers
    only the new tokens. With an expert cache, the engine's current cache (resized since,
    perhaps) rides in the state and comes back updated."""
    if fresh and int(state.length) != 0:
      raise ValueError(f"fresh=True needs an empty state, but it holds {int(state.length)} tokens")
    if self._experts is not None:
      state = state.replace(experts=self._experts)
    state = state.replace(routing=None)  # an output only
    fn = self._step_fn(state, tokens, positions, last_only, fresh)
    t0 = time.perf_counter()
    state, logits = fn(self.model.params, self.model.bank, state, tokens, positions)
    if self._experts is not None:
      self._experts = state.experts
      s = jax.device_get(state.stats)  # waits for the step: the time below is the step's
      self._steps.append({"tokens": int(tokens.size), "hits": s.hits, "fills": s.fills,
                          "host": s.host, "seconds": time.perf_counter() - t0})
    if state.routing is not None:
      r = jax.device_get(state.routing)
      self._routing.append((r.ids, r.weights, "prefill" if tokens.shape[1] > 1 else "decode"))
    return state, logits

  def routing_trace(self):
    """Every routed token so far as a ``ftjax.traces.Trace`` (needs record_routing=True)."""
    from ftjax.traces import Trace  # noqa: PLC0415
    if not self.options.record_routing:
      raise ValueError("create the engine with record_routing=True to capture routing traces")
    c = self.model.config
    if not self._routing:
      empty = np.zeros((0, c.num_moe_layers, c.top_k))
      return Trace.from_arrays(empty.astype(np.int32), empty.astype(np.float32), c.num_experts)
    ids = np.concatenate([r[0].transpose(1, 0, 2) for r in self._routing])  # [S, L, K]
    weights = np.concatenate([r[1].transpose(1, 0, 2) for r in self._routing])
    phase = np.concatenate([np.full(r[0].shape[1], r[2] == "decode", np.uint8)
                            for r in self._routing])
    return Trace.from_arrays(ids, weights, c.num_experts, phase=phase,
                             metadata={"model_config": c.to_dict(), "source": self.model.path})

  def new_state(self, batch: int, capacity: int) -> DecodeState:
    capacity = min(-(-capacity // _STATE_BUCKET) * _STATE_BUCKET, self.max_seq_len)
    if self._experts is None:
      return init_state(self.model.config, batch, capacity)
    if self.options.device_budget_bytes is not None:  # re-divide the budget for this KV size
      c = self.model.config
      kv_bytes = 2 * c.num_layers * batch * capacity * c.num_kv_heads * c.head_dim * 4
      n = self._requested_slots(kv_bytes)
      if n != int(self._experts.limit):
        self.resize_cache(slots=n)
    return init_state(self.model.config, batch, capacity, experts=self._experts,
                      bandwidths=self.bandwidths if self.bandwidths is not None else [1.0, 1.0])

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
    _, logits = self.step(state, jnp.asarray(ids2), jnp.asarray(positions), fresh=True)
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
      self._step_fn(state, one, one, True, False)
    self._step_fn(state, tokens, positions, True, True)

    out: list[int] = []
    t0 = time.perf_counter()
    state, logits = self.step(state, tokens, positions, last_only=True, fresh=True)
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
