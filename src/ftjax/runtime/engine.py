"""The engine: a request is a prefill in fixed-size chunks, a first-token program and a decode
loop on the device.

Without an expert cache every routed expert is computed from the host expert bank (the
reference execution); with one, each layer-step is planned by the cache policy and split
between slots and the bank (``ftjax.cache``). The decode loop runs ``chunk`` tokens per
program (``ftjax.runtime.programs``): sampling, stop checks, cache statistics and the routing
record all stay on the device, and the host reads them once per chunk to stream the text.
No program's shapes depend on the request: a few chunk sizes, a few KV capacities addressed
with the sequence's length, sampling options as data (``Engine.programs_needed`` lists them
all, ``Engine.precompile`` compiles them). Programs are compiled ahead of time, shared by the
engines of the process, and their compile time is reported separately, so throughput numbers
measure execution only.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ftjax import kernels as host_kernels
from ftjax.kernels import tuning
from ftjax.cache import ExpertCache, get_policy
from ftjax.cache.policy import initial_cache
from ftjax.cache.streaming import prefill_stream_mode, stream_costs, stream_min_tokens
from ftjax.model import DecodeState
from ftjax.runtime import speculative
from ftjax.runtime.budget import MemoryBudget, slots_for_budget
from ftjax.runtime.executor import Executor, ExecutorSpec, Generation, TokenLogprob
from ftjax.runtime.kv import Chunk, KVLayout
from ftjax.runtime.options import RuntimeOptions
from ftjax.runtime.model import Model
from ftjax.runtime.placement import expert_mesh, resolve_pool, shard_params
from ftjax.runtime.calibration import SplitCalibrator
from ftjax.runtime.profile import ExpertShape, expert_shape_bias, load_profile
from ftjax.runtime.programs import Programs, Runner, expert_variant, return_free_heap
from ftjax.runtime.sampling import Sampling

def resolve_kernels(requested: str, bank_dtype) -> tuple[str, str]:
  """The kernels a step runs with and a description of that path for the summary line.

  ``auto`` is ftjax's C++ kernels on the CPU backend (``ffi_bf16`` for bfloat16, mxfp4 and
  int4 banks, ``ffi`` otherwise) and XLA elsewhere. When the compiled module is missing or unusable,
  ``auto`` and ``ffi*`` raise ``ftjax.kernels.KernelsUnavailable`` with the cause and the
  fix: never a silent fall back to XLA:CPU, which is 10-20x slower there."""
  backend = jax.default_backend()
  chosen = requested
  if requested == "auto":
    if backend != "cpu":
      return "xla", (f"xla ({backend}: dense work and slot experts; fills and host experts by "
                     "the pool's placement)")
    host_kernels.require("kernels='auto' on the CPU backend")
    # bf16 activations in prefill where the weights are bf16 values: bfloat16 and mxfp4 banks
    # (E2M1 times a power of two is a bf16 value), and int4 banks (uint16 words), whose weights
    # round to bf16 at <= 2^-9 of themselves, far inside the format's own step: prefill on the
    # bf16-pair GEMM (AMX tiles where the CPU has them) instead of float32 FMA, 1.6x on the
    # paper's model (benchmarks/paper_model.py). The decode forms stay exact either way.
    chosen = "ffi_bf16" if np.dtype(bank_dtype) in (
        np.dtype(jnp.bfloat16), np.dtype(np.uint8), np.dtype(np.uint16)) else "ffi"
  elif requested in ("ffi", "ffi_bf16", "ffi_int8"):
    if backend != "cpu":
      raise ValueError(f"kernels={requested!r} names the CPU backend's kernels; on {backend} use "
                       "kernels='auto' (dense work in XLA; host experts on ftjax's CPU kernel "
                       "through ftjax._ffi_cuda, see docs/gpu.md)")
    host_kernels.require(f"kernels={requested!r}")
    if requested == "ffi_int8" and np.dtype(bank_dtype) not in (np.int8, np.uint8):
      raise ValueError(f"kernels='ffi_int8' quantises the activations of int8 and mxfp4 "
                       f"experts; this model's experts are {np.dtype(bank_dtype)}: convert it "
                       "with --expert_dtype=int8, or use kernels='ffi'")
  if chosen == "xla":
    return chosen, f"xla ({backend}, requested)" if requested == "xla" else f"xla ({backend})"
  info = host_kernels.cpu_info()
  # AMX runs the GEMMs of bf16 weights with bf16-rounded activations: prefill under ffi_bf16.
  amx = "+amx" if info["amx"] and chosen == "ffi_bf16" else ""
  return chosen, f"{chosen} ({info['isa']}{amx}, {info['threads']} threads)"


def slot_bucket(num_slots: int) -> int:
  """Buffer capacity for ``num_slots``: the next power of two, so that resizes within a
  bucket reuse the compiled step (one compile per bucket)."""
  return 0 if num_slots == 0 else 1 << (num_slots - 1).bit_length()


@dataclasses.dataclass
class GenerateResult:
  tokens: list[int]  # new tokens only
  prompt_tokens: int
  prefill_s: float
  decode_s: float
  compile_s: float
  programs: int = 0  # programs executed for the request (prefill + decode chunks)
  # With ``logprobs=True``: each new token's log-probs (``TokenLogprob``), else None.
  logprobs: list[TokenLogprob] | None = None

  @property
  def prefill_tok_s(self) -> float:
    return self.prompt_tokens / self.prefill_s if self.prefill_s else float("nan")

  @property
  def decode_tok_s(self) -> float:
    # The first new token comes from the prefill; the others from decode steps.
    steps = max(len(self.tokens) - 1, 0)
    return steps / self.decode_s if self.decode_s else float("nan")


def _engine_gone(executor: Executor) -> None:
  """An engine was closed or collected: its executor lets go of its programs and its expert
  cache, and the heap they held goes back to the system (without it glibc keeps the freed
  pages, and a sweep's RSS grew by a third over 200 engines)."""
  executor.release()
  return_free_heap()


class _Closed:
  """What a closed engine has for an executor: every use says so."""

  def __getattr__(self, name: str):
    raise RuntimeError(f"this Engine was closed (Engine.close()): its programs and state are "
                       f"gone; create a new Engine to use {name!r}")


def _context_limit(config, max_seq_len: int | None) -> int:
  """The context an engine serves: ``max_seq_len``, else the model's; for a DeepSeek Sparse
  Attention model at most its ``index_topk``, the context that dense latent attention serves
  exactly (a larger ``max_seq_len`` is refused, the default is lowered and said on stderr)."""
  limit = config.sparse_attention_topk
  wanted = max_seq_len or config.max_position_embeddings
  if not limit or wanted <= limit:
    return wanted
  why = (f"{config.model_type} selects its index_topk={limit} earlier tokens per query with "
         "DeepSeek Sparse Attention's indexer, which ftjax does not run; up to that context "
         "every earlier token is selected, and ftjax's dense latent attention is exact")
  if max_seq_len:
    raise ValueError(f"max_seq_len={max_seq_len} exceeds {limit}: {why}; give max_seq_len <= "
                     f"{limit}")
  print(f"ftjax: context limited to {limit} tokens (the model's is {wanted}): {why}",
        file=sys.stderr)
  return limit


class Engine:
  """``Engine(model, **runtime_options)``; see ``RuntimeOptions`` for the options.

  The engine owns the expert cache: it persists across requests, rides (donated) in the
  ``EngineState`` of every program, and is resized only between programs. One sequence
  runs at a time. ``engine.cache`` is the current ``ExpertCache`` (None without one),
  ``engine.compile_count`` the programs this engine had to compile (``compile_s`` their
  seconds, ``compile_listener`` told of each), ``engine.kernels_path``
  the host-work path that runs (``"ffi_bf16 (avx2, 2 threads)"``), ``engine.placement`` where
  the pool lives and how fills and host experts run, ``engine.stream_source`` why long
  prefills do or do not stream whole layers, ``engine.mesh`` the devices the slots are split
  over (None for one).
  """

  def __init__(self, model: Model, **runtime_options):
    self.model = model
    self.options = opts = RuntimeOptions(**runtime_options)
    self.kernels, self.kernels_path = resolve_kernels(opts.kernels, model.bank.dtype)
    self.kernel_tuning = None  # the C++ kernels' variant (ftjax.kernels.tuning), when they run
    if self.kernels != "xla":
      c = model.config
      self.kernel_tuning, described = tuning.resolve(
          opts.kernel_tuning, tuning.Shapes(c.hidden_size, c.moe_intermediate_size, c.top_k),
          bf16_activations=self.kernels == "ffi_bf16")
      self.kernels_path = f"{self.kernels_path[:-1]}, tuning {described})"
    self.placement = resolve_pool(opts.pool, model.bank, self.kernels, caching=opts.caching)
    self.mesh = expert_mesh(opts.devices)
    if self.mesh is not None:
      self.placement = dataclasses.replace(
          self.placement, offload=dataclasses.replace(self.placement.offload, mesh=self.mesh))
    # What the programs receive: the parameters and the host pool (placed on the mesh: every
    # device reads the whole pool, in its memory kind).
    self.params = model.params if self.mesh is None else shard_params(model.params, self.mesh)
    self.bank = self.placement.bank
    if self.mesh is not None and self.bank is not None:
      kind = self.bank.sharding.memory_kind if hasattr(self.bank, "sharding") else None
      self.bank = jax.device_put(self.bank, NamedSharding(self.mesh, PartitionSpec(),
                                                          memory_kind=kind))
    kv_dtype = opts.kv_dtype or (
        "bfloat16" if np.dtype(model.dtype) == np.dtype(jnp.bfloat16) else "float32")
    self.kv = KVLayout.make(model.config, kv_dtype=kv_dtype,
                            max_seq_len=_context_limit(model.config, opts.max_seq_len),
                            kv_growth=opts.kv_growth, prefill_chunk=opts.prefill_chunk,
                            shares_budget=opts.device_budget_bytes is not None,
                            chunk_overhead=opts.prefill_chunk_overhead)
    kv = self.kv
    self.max_seq_len, self.kv_dtype, self.kv_growth = kv.max_seq_len, kv.kv_dtype, kv.kv_growth
    self.chunk_sizes, self.kv_capacities = kv.chunk_sizes, kv.kv_capacities
    self.policy = get_policy(opts.policy) if opts.caching else None
    self._profile: dict | None = None  # the bandwidth profile, when one was given
    self.bandwidths, self.bandwidth_source = self._bandwidths()
    c = model.config
    stream_min = self._stream_min_tokens()
    self.runner = Runner(
        graphdef=model.graphdef, signature=_signature(model), num_layers=c.num_moe_layers,
        pass_layers=c.num_decoder_moe_layers,
        top_k=c.top_k, ffn_dim=c.moe_intermediate_size, kernels=self.kernels,
        policy=self.policy.program() if self.policy is not None else None,
        record_routing=opts.record_routing, chunk=opts.decode_chunk,
        offload=dataclasses.replace(self.placement.offload,
                                    host_gflops=self._host_gflops() or 0.0),
        stream_min_tokens=stream_min, prefill_stream=self._prefill_stream(stream_min),
        kv_dtype=self.kv_dtype, variant=expert_variant(c), prefetch=opts.prefetch,
        vocab_size=c.vocab_size)
    # Device state (KV caches, recurrent states) by owner, and the budget it shares with the
    # expert cache (ftjax.runtime.budget); the engine listens and resizes the cache.
    self.memory = MemoryBudget(opts.device_budget_bytes)
    self.memory.listen(self._refit)
    # The programs, their protocol, the expert cache, per-step records and the decode loop.
    spec = ExecutorSpec(params=self.params, bank=self.bank, kv=kv, mesh=self.mesh,
                        decode_chunk=opts.decode_chunk, bandwidths=self.bandwidths)
    self.executor = Executor(spec, Programs.shared(self.runner), self.memory,
                             self._initial_cache(self._requested_slots(kv_bytes=0))
                             if opts.caching else None, calibrator=self._calibrator())
    self._release = weakref.finalize(self, _engine_gone, self.executor)

  @property
  def programs(self) -> Programs:
    """The table of compiled programs this engine uses (shared with equal engines)."""
    return self.executor.table

  def close(self) -> None:
    """Lets go of the engine's programs, expert cache and decode states now, instead of when
    the engine is garbage-collected. Its table of programs is then released unless another
    live engine uses it, or it is one of those kept after their engines
    (``ftjax.runtime.programs.keep_released``; ``release_unused`` drops those too). Using the
    engine afterwards raises an error that says so."""
    self._release()
    self.executor = _Closed()
    self.params = self.bank = None

  def __enter__(self) -> "Engine":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # The executor's compile counters, read and set through the engine.
  @property
  def compile_count(self) -> int:
    """Programs this engine had to compile (``compile_s``: their seconds)."""
    return self.executor.compile_count

  @property
  def compile_s(self) -> float:
    return self.executor.compile_s

  @property
  def loaded_count(self) -> int:
    """Of ``compile_count``, the programs loaded untraced from the executable store
    (``ftjax.runtime.compile_cache``) instead of compiled."""
    return self.executor.loaded_count

  @property
  def compile_listener(self) -> Callable[[tuple, float], None] | None:
    """Told of each program this engine compiles: (key: the program's name and bucketed
    sizes, seconds). The server logs the compiles that happen while it serves."""
    return self.executor.compile_listener

  @compile_listener.setter
  def compile_listener(self, listener: Callable[[tuple, float], None] | None) -> None:
    self.executor.compile_listener = listener

  def _stream_min_tokens(self) -> int:
    """Prefills of at least this many tokens stream whole layers (0: never); says why in
    ``self.stream_source`` (``ftjax.cache.streaming.stream_min_tokens`` decides)."""
    o, c = self.options, self.model.config
    bank = self.model.bank
    tokens, self.stream_source = stream_min_tokens(
        o.stream_prefill_tokens, caching=o.caching,
        pool_on_device=jax.default_backend() == "cpu" or self.placement.pool == "device",
        expert_parallel=self.mesh is not None, top_k=c.top_k, bandwidths=self.bandwidths,
        **stream_costs(bank.shape, bank.dtype, ffn_dim=c.moe_intermediate_size,
                       width=c.hidden_size, host_gflops=self._host_gflops()))
    return tokens

  def _host_gflops(self) -> float | None:
    """The host kernel's grouped rate (GFLOP/s): given, or the profile's; None if unknown."""
    if self.options.host_gflops is not None:
      return float(self.options.host_gflops)
    return (self._profile or {}).get("host_grouped_gflops") or None

  def _prefill_stream(self, stream_min: int) -> str:
    """How prefills that stream do it (``RuntimeOptions.prefill_stream``, resolved by
    ``ftjax.cache.streaming.prefill_stream_mode``); appended to ``self.stream_source``."""
    mode, how = prefill_stream_mode(
        self.options.prefill_stream,
        cost_known=bool(self._host_gflops()) and self.bandwidths is not None)
    if stream_min:
      self.stream_source += f"; {how}"
    return mode

  # -- Expert cache ---------------------------------------------------------------------------

  @property
  def cache(self) -> ExpertCache | None:
    """The expert cache as of the last program (None when the engine has none)."""
    return self.executor.cache

  @property
  def slot_bytes(self) -> int:
    return int(self.model.bank.shape[2]) * self.model.bank.dtype.itemsize

  @property
  def total_experts(self) -> int:
    c = self.model.config
    return c.num_moe_layers * c.num_experts

  def _requested_slots(self, kv_bytes: int) -> int:
    o = self.options
    if self.memory.total is not None:
      n = slots_for_budget(self.memory.total, kv_bytes, self.slot_bytes)
    elif o.cache_slots is not None:
      n = o.cache_slots
    elif o.cache_fraction is not None:
      n = int(o.cache_fraction * self.total_experts)
    elif o.cache_bytes is not None:
      n = o.cache_bytes // self.slot_bytes
    else:
      raise AssertionError("an engine with a cache has a cache size")
    return min(n, self.total_experts)  # more slots than experts would never be used

  def _bandwidths(self) -> tuple[np.ndarray | None, str]:
    o = self.options
    if o.bandwidths is not None:
      return np.asarray(o.bandwidths, np.float32), "given (B_P, B_H)"
    if o.profile is not None:
      c = self.model.config
      prof = self._profile = load_profile(
          o.profile, ExpertShape(c.hidden_size, c.moe_intermediate_size, self.model.expert_format,
                                 c.top_k, bias=expert_shape_bias(c, self.model.expert_format)))
      # Measured concurrently: B_P while the host kernel runs, and the host kernel's residual
      # bandwidth B_res while a fill runs, so B_H = B_P + B_res (DESIGN section 2).
      conc = prof["concurrent"]
      return (np.asarray([conc["b_p_gb_s"], conc["b_p_gb_s"] + conc["b_h_gb_s"]], np.float32),
              f"profile {o.profile} (concurrent)")
    if self.policy is not None and self.policy.fill_rule == "q*":
      raise ValueError(f"the {self.policy} policy needs bandwidths: pass bandwidths=(B_P, "
                       "B_H) in GB/s or profile=PATH (write one with `python -m ftjax.profile`)")
    return None, "none (not needed by this policy)"

  def _calibrator(self) -> SplitCalibrator | None:
    """The q* split's calibrator and guard (``ftjax.runtime.calibration``) when
    ``calibrate_split`` asks for one: "auto" with a profile, "on" with any bandwidths; only a
    q* policy has a split to calibrate."""
    want = self.options.calibrate_split
    if want == "off" or self.policy is None or self.policy.fill_rule != "q*":
      if want == "on" and (self.policy is None or self.policy.fill_rule != "q*"):
        raise ValueError(f"calibrate_split='on' calibrates the q* split; the "
                         f"{self.policy or 'no-cache'} policy has none (use a q* policy such as "
                         "freetoken, or calibrate_split='auto')")
      return None
    if want == "auto" and self.options.profile is None:
      return None
    return SplitCalibrator(self.bandwidths, self.model.expert_bytes)

  def _capacity(self, num_slots: int) -> int:
    fixed = self.options.cache_capacity
    shards = 1 if self.mesh is None else self.mesh.size
    if fixed is None:
      # With a mesh, at least one slot per device: an empty buffer would not stay split.
      return max(-(-slot_bucket(num_slots) // shards) * shards, 0 if shards == 1 else shards)
    if num_slots > fixed:
      raise ValueError(f"{num_slots} slots exceed cache_capacity={fixed}")
    if fixed % shards:
      raise ValueError(f"cache_capacity={fixed} must be a multiple of devices={shards}")
    return fixed

  def _initial_cache(self, num_slots: int) -> ExpertCache:
    source = self.placement.host_bank if self.placement.host_bank is not None else self.bank
    return initial_cache(self.policy, source, num_slots, self._capacity(num_slots),
                         hot_experts=self.options.hot_experts)

  def resize_cache(self, slots: int | None = None, bytes: int | None = None,  # noqa: A002
                   reason: str = "resize_cache") -> int:
    """Resizes the expert cache between programs; keeps the most recently used slots. The
    host pool is not reloaded and nothing restarts. Returns the new slot count. With a
    device budget, the next change of the decode states' memory re-divides it again
    (``set_budget`` changes the budget itself)."""
    if self.executor.cache is None:
      raise ValueError("this engine has no expert cache: create it with cache_slots=, "
                       "cache_fraction=, cache_bytes= or device_budget_bytes=")
    if (slots is None) == (bytes is None):
      raise ValueError("give exactly one of slots= or bytes=")
    n = slots if slots is not None else bytes // self.slot_bytes
    if n < 0:
      raise ValueError(f"the cache size must be >= 0, got {n} slots")
    n = min(n, self.total_experts)
    before = int(self.executor.cache.limit)
    if self.policy.preload != "none":
      cache = self._initial_cache(n)  # the preloaded set is recomputed for the new size
    else:
      cache = self.executor.cache.resized(n, self._capacity(n))
    self.executor.cache = cache
    if n != before:
      self.memory.resized(before, n, reason)
    return n

  # -- One memory budget for the decode states and the expert cache ----------------------------

  def set_budget(self, budget_bytes: int) -> int:
    """Makes ``budget_bytes`` the device budget shared by the decode states and the expert
    cache (``ftjax.runtime.budget``), at run time: the cache is resized now to what the states
    held leave (between programs). Returns the new slot count."""
    if self.executor.cache is None:
      raise ValueError("this engine has no expert cache to share a budget with: create it "
                       "with a cache size (device_budget_bytes=, cache_slots=, ...)")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, (int, np.integer)) or (
        budget_bytes < 0):
      raise ValueError(f"the budget must be an int number of bytes >= 0, got {budget_bytes!r}")
    self.memory.total = int(budget_bytes)
    self._refit("budget set to %d bytes" % budget_bytes)
    return int(self.executor.cache.limit)

  def hold_memory(self, owner: Any, nbytes: int) -> None:
    """``owner`` (a session, a decode batch, the engine) now holds ``nbytes`` of decode state
    on the device (0: none). With a budget, the expert cache is re-divided at once: call it
    before allocating a larger state, so that the cache gives up its slots first."""
    self.memory.hold(self._owner(owner), nbytes)

  def _owner(self, owner: Any) -> Any:
    """The budget's owner: None for the engine itself."""
    return None if owner is self else owner

  def _refit(self, reason: str) -> None:
    """The budget's listener: the cache gets what the decode states leave."""
    cache = self.executor.cache
    if cache is None or self.memory.total is None:
      return
    n = self._requested_slots(self.memory.state_bytes)
    if n != int(cache.limit):
      self.resize_cache(slots=n, reason=reason)

  # -- KV sizes (``self.kv``: ``ftjax.runtime.kv.KVLayout``) -----------------------------------

  def state_bytes(self, batch: int, capacity: int) -> int:
    """Bytes of a decode state of ``batch`` rows of ``capacity`` KV rows on this engine."""
    return self.kv.state_bytes(batch, capacity)

  def kv_capacity(self, rows: int) -> int:
    """The smallest of ``kv_capacities`` that holds ``rows`` rows."""
    return self.kv.capacity(rows)

  def plan_chunks(self, start: int, n: int, anchors_at: Sequence[int] = (),
                  anchor_slots: int = 0) -> list[Chunk]:
    """How ``n`` tokens after ``start`` are read (``KVLayout.plan_chunks``)."""
    return self.kv.plan_chunks(start, n, anchors_at, anchor_slots)

  def check_context(self, prompt_len: int, new: int) -> None:
    self.kv.check_context(prompt_len, new)

  def check_ids(self, ids: np.ndarray) -> None:
    """Raises a clear error for token ids outside the vocabulary or of vision inputs."""
    self.kv.check_ids(ids)

  def cache_info(self) -> dict[str, Any]:
    """The expert cache and the budget now: slots (in use of the buffer's capacity), bytes,
    the decode states' bytes, hits/fills/host-run experts over the engine's life, the last
    resize (None yet) and the last 16. The server's ``GET /v1/cache``."""
    cache = self.executor.cache
    slots = 0 if cache is None else int(cache.limit)
    return {"policy": None if self.policy is None else self.policy.name,
            "slots": slots, "slot_capacity": 0 if cache is None else int(cache.capacity),
            "slot_bytes": self.slot_bytes, "cache_bytes": slots * self.slot_bytes,
            "experts": self.total_experts, "budget_bytes": self.memory.total,
            "state_bytes": self.memory.state_bytes, "state_holders": self.memory.holders,
            **self.cache_totals(), "last_resize": self.memory.last_resize,
            "resizes": list(self.memory.resizes)}

  def routing_counts(self) -> np.ndarray:
    """How often the router selected each (layer, expert) so far: [L, E]."""
    if self.cache is None:
      raise ValueError("routing counts are kept by the expert cache; this engine has none")
    return np.asarray(self.cache.expert_count)

  def stats(self) -> dict[str, Any]:
    """Per step and layer (hits, fills, host-run experts) and cumulative per layer.

    Decode steps run ``decode_chunk`` to a program: a decode step's ``seconds`` is its
    chunk's wall time divided by the chunk's steps."""
    cache, steps = self.executor.cache, self.executor.steps
    if cache is None:
      return {"cache": None, "compiles": self.compile_count}
    layers = self.model.config.num_moe_layers
    total = {k: np.zeros(layers, np.int64) for k in ("hits", "fills", "host", "prefetched",
                                                       "prefetch_used", "prefetch_wasted")}
    host_run = np.zeros(layers, np.int64)  # host misses that ran on the host (not streamed)
    streamed = np.zeros(layers, np.int64)  # layer-steps that streamed their whole layer
    for step in steps:
      for k in total:
        total[k] += step[k]
      host_run += np.where(step["streamed"], 0, step["host"])
      streamed += step["streamed"]
    prefetch = {k: total.pop(k) for k in ("prefetched", "prefetch_used", "prefetch_wasted")}
    misses = total["fills"] + total["host"]
    selected = total["hits"] + misses
    eb = self.model.expert_bytes
    prefetched = int(prefetch["prefetched"].sum())
    return {
        "policy": str(self.policy), "slots": int(cache.limit),
        "capacity": cache.capacity, "slot_bytes": self.slot_bytes,
        "bandwidths_gb_s": None if self.bandwidths is None else self.bandwidths.tolist(),
        "bandwidth_source": self.bandwidth_source, "steps": len(steps),
        "per_step": steps,
        "per_layer": {**{k: v.tolist() for k, v in total.items()}, "misses": misses.tolist(),
                      "miss_rate": np.where(selected > 0, misses / np.maximum(selected, 1),
                                            0.0).tolist()},
        "miss_rate": float(misses.sum() / max(selected.sum(), 1)),
        "bytes": {"fill": int(total["fills"].sum() * eb), "host": int(host_run.sum() * eb),
                  "device": int((total["hits"] + total["fills"]).sum() * eb),
                  "stream": int(streamed.sum() * self.model.config.num_experts * eb)},
        "streamed_layer_steps": int(streamed.sum()),
        # Router-ahead prefetch (``prefetch=``): experts prefetched, those a step used (a hit
        # on their slot, counted in "hits"), those evicted unused; the share used.
        "prefetch": {"experts": self.options.prefetch, "prefetched": prefetched,
                     "used": int(prefetch["prefetch_used"].sum()),
                     "wasted": int(prefetch["prefetch_wasted"].sum()),
                     "used_share": (float(prefetch["prefetch_used"].sum() / prefetched)
                                    if prefetched else None),
                     "bytes": prefetched * eb,
                     "per_layer": {k: v.tolist() for k, v in prefetch.items()}},
        "calibration": self.calibration(),
        "compiles": self.compile_count,
    }

  def calibration(self) -> dict[str, Any] | None:
    """The q* split's calibration and guard (``ftjax.runtime.calibration``): the strategy in
    use, the measured costs and rates, the switches; None when the split is not calibrated
    (``calibrate_split``)."""
    calibrator = self.executor.calibrator
    return None if calibrator is None else calibrator.summary()

  def cache_totals(self) -> dict[str, int]:
    """Expert-cache hits, fills and host-run experts over the engine's life (all zero without
    an expert cache); unlike ``stats()``, kept when the history is cleared."""
    return dict(self.executor.totals)

  def clear_history(self) -> None:
    """Forgets the per-step statistics and routing record kept so far (``stats()`` and
    ``routing_record()`` start again empty): a long-running process (the server) calls it so
    that they do not grow without bound. ``cache_totals()`` keeps counting."""
    self.executor.clear_history()

  def routing_record(self) -> dict[str, np.ndarray]:
    """Every routed token so far (needs record_routing=True): ``ids`` and ``weights``
    [steps, L, K] (one step per token, -1 = no route) and ``phase`` [steps] (1 = decode).
    L is the decoder's MoE layers: a multi-token-prediction head's layers, which only
    speculative decoding runs (and keeps no record of), are left out.
    ``ftjax.traces.Trace.from_engine(engine)`` makes a trace of it."""
    if not self.options.record_routing:
      raise ValueError("create the engine with record_routing=True to capture routing traces")
    c = self.model.config
    routing = self.executor.routing
    if not routing:
      empty = np.zeros((0, c.num_decoder_moe_layers, c.top_k))
      return {"ids": empty.astype(np.int32), "weights": empty.astype(np.float32),
              "phase": np.zeros((0,), np.uint8)}
    layers = c.num_decoder_moe_layers
    return {"ids": np.concatenate([r[0][:layers].transpose(1, 0, 2) for r in routing]),
            "weights": np.concatenate([r[1][:layers].transpose(1, 0, 2) for r in routing]),
            "phase": np.concatenate([np.full(r[0].shape[1], r[2] == "decode", np.uint8)
                                     for r in routing])}

  # -- Programs (the executor's) and decode states --------------------------------------------

  def step(self, state: DecodeState, tokens: jax.Array, positions: jax.Array, *,
           last_only: bool = False, fresh: bool = False) -> tuple[DecodeState, jax.Array]:
    """One forward: tokens/positions [B, T] -> (new state, logits). Donates state.

    The per-token reference path (teacher forcing, tests); ``generate`` runs the device
    loop instead. ``fresh=True`` is for the first step of a new state (a prefill): attention
    then covers only the new tokens. With an expert cache, the engine's current cache
    (resized since, perhaps) rides along and comes back updated."""
    if fresh and int(state.length) != 0:
      raise ValueError(f"fresh=True needs an empty state, but it holds {int(state.length)} tokens")
    return self.executor.step(state, tokens, positions, last_only=last_only, fresh=fresh)

  def new_state(self, batch: int, capacity: int, owner: Any = None) -> DecodeState:
    """An empty decode state for ``capacity`` tokens (rounded up to one of
    ``kv_capacities``, at most the largest), held by ``owner`` (default: the engine; see
    ``hold_memory``): with a device budget, the cache is re-divided first."""
    capacity = self.kv.capacity(min(capacity, self.kv_capacities[-1]))
    return self.executor.new_state(batch, capacity, self._owner(owner))

  def grow_state(self, state: DecodeState, rows: int, batch: int = 1,
                 owner: Any = None) -> DecodeState:
    """``state`` (donated; ``batch`` rows) with a KV capacity of at least ``rows`` rows
    (``Executor.grow``), held by ``owner`` (default: the engine)."""
    return self.executor.grow(state, rows, batch, self._owner(owner))

  def extend(self, state: DecodeState, ids: Sequence[int] | np.ndarray, **options):
    """Reads ``ids`` into ``state`` (donated) after the tokens it holds
    (``Executor.extend``: the options, and the ``Extended`` result)."""
    return self.executor.extend(state, ids, **options)

  def programs_needed(self, anchor_slots: int = 0, batch: int = 1,
                      decode_alone: bool = True) -> list[tuple]:
    """The keys of every program a request can run (``Executor.programs_needed``)."""
    return self.executor.programs_needed(anchor_slots, batch, decode_alone)

  def precompile(self, anchor_slots: int = 0,
                 on_progress: Callable[[int, int, tuple], None] | None = None,
                 batch: int = 1, keys: list[tuple] | None = None,
                 workers: int = 1) -> list[tuple]:
    """Compiles every program of ``keys`` (default ``programs_needed(anchor_slots, batch)``)
    not compiled yet (from abstract shapes: no state is allocated), so that no request
    compiles; ``workers`` threads load stored ones side by side (``Executor.precompile``).
    Returns the keys prepared now; ``on_progress(done, total, key)`` is told before each."""
    return self.executor.precompile(anchor_slots, on_progress, batch, keys, workers)

  # -- Public API ----------------------------------------------------------------------------

  def forward_logits(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Teacher-forced logits over the whole sequence: [T] -> [T, V] (or [B, T] -> [B, T, V])."""
    ids = np.asarray(token_ids, np.int32)
    batched = ids.ndim == 2
    ids2 = ids if batched else ids[None]
    self.check_ids(ids2)
    self.check_context(ids2.shape[1], 0)
    state = self.new_state(ids2.shape[0], ids2.shape[1])
    positions = np.broadcast_to(np.arange(ids2.shape[1], dtype=np.int32), ids2.shape)
    _, logits = self.step(state, jnp.asarray(ids2), jnp.asarray(positions), fresh=True)
    out = np.asarray(logits, np.float32)
    return out if batched else out[0]

  def prefill_logits(self, token_ids: Sequence[int],
                     on_progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """The logits [V] after the prompt's last token, by the prefill ``generate`` runs (in
    chunks, ``plan_chunks``); the expert cache is used and updated as by a request."""
    ids = np.asarray(token_ids, np.int32).reshape(-1)
    self.check_ids(ids)
    self.check_context(len(ids), 0)
    last = self.plan_chunks(0, len(ids))[-1]
    state = self.executor.new_state(1, self.kv.capacity(last.begin + last.size))
    read = self.executor.extend(state, ids, on_progress=on_progress, start=0)
    return np.asarray(read.logits, np.float32)

  def prompt_logprobs(self, token_ids: Sequence[int],
                      on_progress: Callable[[int, int], None] | None = None
                      ) -> list[TokenLogprob | None]:
    """Each token's log-probability given the tokens before it, with the most probable
    alternatives (``TokenLogprob``; None for the first token, which has no context): the
    log-softmax of the model's raw logits, made on the device by the prefill's own programs
    from the same forward (the chunks ``generate`` runs; no logits row leaves the device).
    What an evaluation harness scores: a continuation's log-likelihood is the sum of its
    tokens' ``logprob``."""
    ids = np.asarray(token_ids, np.int32).reshape(-1)
    self.check_ids(ids)
    self.check_context(len(ids), 0)
    last = self.plan_chunks(0, len(ids))[-1]
    state = self.executor.new_state(1, self.kv.capacity(last.begin + last.size))
    targets = np.append(ids[1:], -1).astype(np.int32)
    read = self.executor.extend(state, ids, on_progress=on_progress, start=0, targets=targets)
    return [None] + read.logprobs[:-1]

  def generate_speculative(self, token_ids: Sequence[int], max_new_tokens: int,
                           greedy: bool = True, *, temperature: float = 1.0, top_p: float = 1.0,
                           seed: int = 0, top_k: int = 0, draft_tokens: int = 2,
                           stop_tokens: Sequence[int] = (),
                           forced_drafts: Sequence[int] | None = None,
                           on_token: Callable[[int], None] | None = None,
                           adaptive: bool = False, draft_costs: str = "measured"
                           ) -> speculative.SpeculativeResult:
    """Decoding with the model's multi-token-prediction head drafting ``draft_tokens`` (1 .. 4)
    tokens per verify step (``ftjax.runtime.speculative``; ``Executor.speculate`` runs it),
    with each draft position's acceptance. Greedy: the same tokens as ``generate(...,
    greedy=True)``; sampled (``greedy=False``, the options of ``generate``): rejection
    sampling, tokens that follow the distribution ``generate`` samples from (not its draws).
    ``adaptive``: each step drafts 0 .. ``draft_tokens`` tokens, the length with the most
    expected tokens per second (``speculative.choose_draft_length``) from the acceptance
    measured so far and each length's seconds a step, measured by this engine as it runs them
    (``Executor.verify_seconds``; bytes read, ``step_costs``, scaled to seconds before), or
    with ``draft_costs="modelled"`` the bytes alone (the rule before measurement, for
    ablations: deterministic, where measured seconds are not). ``forced_drafts`` (research: a verify step's cost at a
    chosen acceptance): per emitted token i, a token >= 0 that the draft proposing it is
    forced to (the head still runs), or -1 for the head's own draft. ``on_token`` hears each
    new token as its chunk of verify steps comes back."""
    speculative.check_request(self.model.config, draft_tokens, max_new_tokens)
    if draft_costs not in ("measured", "modelled"):
      raise ValueError(f"draft_costs must be 'measured' or 'modelled', got {draft_costs!r}")
    sampling = Sampling.make(greedy=greedy, temperature=temperature, top_p=top_p, seed=seed,
                             top_k=top_k)
    ids = np.asarray(token_ids, np.int32).reshape(1, -1)
    self.check_ids(ids)
    self.check_context(ids.shape[1], max_new_tokens + draft_tokens)
    return self.executor.speculate(ids, max_new_tokens, k=draft_tokens, sampling=sampling,
                                   stop_tokens=stop_tokens, forced_drafts=forced_drafts,
                                   cost=speculative.step_costs(self.model, draft_tokens),
                                   on_token=on_token, adaptive=adaptive,
                                   measured_costs=draft_costs == "measured")

  def generate(self, token_ids: Sequence[int], max_new_tokens: int, greedy: bool = True, *,
               temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, top_k: int = 0,
               stop_tokens: Sequence[int] = (), on_token: Callable[[int], None] | None = None
               ) -> list[int]:
    """New tokens after ``token_ids`` (the prefill's chunks, then the decode loop);
    ``generate_timed`` gives their log-probs too."""
    return self.generate_timed(token_ids, max_new_tokens, greedy, temperature=temperature,
                               top_p=top_p, seed=seed, top_k=top_k, stop_tokens=stop_tokens,
                               on_token=on_token).tokens

  def generate_timed(self, token_ids: Sequence[int], max_new_tokens: int, greedy: bool = True,
                     *, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                     top_k: int = 0,
                     stop_tokens: Sequence[int] = (),
                     on_token: Callable[[int], None] | None = None,
                     on_progress: Callable[[int, int], None] | None = None,
                     logprobs: bool = False) -> GenerateResult:
    """``generate`` with timings: prefill and decode seconds (compiles excluded and reported
    apart), and the number of programs the request executed. ``on_progress(done, total)``
    is told of each prefill chunk as it completes (prompts longer than ``prefill_chunk``;
    ``done = 0`` when the first starts, after the compiles). ``logprobs``: each new token's
    log-probs under the model's distribution (``TokenLogprob``: the raw logits' log-softmax,
    whatever the sampling options), made by the decode programs themselves."""
    sampling = Sampling.make(greedy=greedy, temperature=temperature, top_p=top_p, seed=seed,
                             top_k=top_k)
    if max_new_tokens < 0:
      raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    ids = np.asarray(token_ids, np.int32).reshape(-1)
    self.check_ids(ids)
    self.check_context(len(ids), max_new_tokens)
    last = self.plan_chunks(0, len(ids))[-1]
    capacity = self.kv_capacity(max(last.begin + last.size, len(ids) + max_new_tokens))
    compile_before = self.compile_s
    read = self.executor.extend(self.executor.new_state(1, capacity), ids, on_progress=on_progress,
                                start=0)
    delivered = 0

    def on_chunk(tokens, halted, layers) -> bool:
      nonlocal delivered
      for tok in tokens[:max_new_tokens - delivered]:
        delivered += 1
        if on_token is not None:
          on_token(tok)
      return not halted and delivered < max_new_tokens

    seq = Generation(state=read.state, logits=read.logits, max_new=max(max_new_tokens, 1),
                     sampling=sampling, stops=stop_tokens, on_chunk=on_chunk,
                     logprobs=[] if logprobs else None)
    decode_s = self.executor.run_one(seq)
    return GenerateResult(tokens=seq.tokens[:max_new_tokens], prompt_tokens=len(ids),
                          prefill_s=read.seconds + seq.first_s, decode_s=decode_s,
                          compile_s=self.compile_s - compile_before,
                          programs=read.programs + seq.programs,
                          logprobs=seq.logprobs[:max_new_tokens] if logprobs else None)


def _signature(model: Model) -> tuple:
  """The shapes and dtypes of a model's arrays (equal graphdefs of other dtypes must not
  share compiled programs)."""
  leaves = jax.tree.leaves(model.params)
  return (tuple(model.bank.shape), str(model.bank.dtype),
          tuple((tuple(x.shape), str(x.dtype)) for x in leaves))
