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
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ftjax import kernels as host_kernels
from ftjax.kernels import tuning
from ftjax.cache import ExpertCache, PolicyConfig, get_policy
from ftjax.cache.policy import initial_cache
from ftjax.cache.streaming import (PREFILL_STREAM_MODES, prefill_stream_mode, stream_costs,
                                   stream_min_tokens)
from ftjax.experts import KERNELS
from ftjax.model import DecodeState, init_state
from ftjax.runtime import programs, speculative
from ftjax.runtime.budget import MemoryBudget, slots_for_budget
from ftjax.runtime.executor import STOP_BUCKET, Executor, Generation
from ftjax.runtime.model import Model
from ftjax.runtime.placement import POOLS, expert_mesh, resolve_pool, shard_params
from ftjax.runtime.profile import ExpertShape, load_profile
from ftjax.runtime.programs import Programs, Runner, expert_variant
from ftjax.runtime.sampling import Sampling

KV_DTYPES = ("float32", "bfloat16")
KV_GROWTHS = ("auto", "max", "grow")
MIN_KV_ROWS = 4096  # the smallest KV capacity of a state that grows (by 4x)
MIN_CHUNK = 16  # the smallest prefill chunk size
KV_MAX_AUTO_BYTES = 64 << 20  # kv_growth="auto": one buffer of the whole context up to this


class ContextLengthError(ValueError):
  pass


@dataclasses.dataclass(frozen=True)
class Chunk:
  """One extend program of a prefill: ``tokens`` real tokens from ``begin`` (counted in the
  tokens being read), padded to ``size``; ``anchors``: positions in the chunk at which the
  recurrent layers' states are kept."""
  begin: int
  tokens: int
  size: int
  anchors: tuple[int, ...] = ()


def chunk_sizes(largest: int) -> tuple[int, ...]:
  """The chunk sizes of a prefill whose chunks hold at most ``largest`` tokens: ``largest``
  and its quarters down to ``MIN_CHUNK`` (1024: 1024, 256, 64, 16), largest first. Each size is one
  compiled extend program per KV capacity."""
  sizes = [largest]
  while sizes[-1] // 4 >= MIN_CHUNK:
    sizes.append(sizes[-1] // 4)
  return tuple(sizes)


def split_tokens(n: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
  """``n`` tokens as (tokens, size) chunks of ``sizes`` (largest first): whole chunks of the
  largest size, then the rest in the smallest size that holds it when that size is less than
  twice the rest, else in chunks of the next size down, and so on. Padding stays under the
  rest's own length (the last chunk at most doubles), in few chunks."""
  out = []
  while n > 0:
    if n >= sizes[0]:
      out.append((sizes[0], sizes[0]))
      n -= sizes[0]
      continue
    i = max(j for j, size in enumerate(sizes) if size >= n)  # the smallest size that holds n
    if 2 * n > sizes[i] or i == len(sizes) - 1:
      out.append((n, sizes[i]))
      break
    whole = n // sizes[i + 1]  # 1 or 2: n > sizes[i + 1] and 2n <= sizes[i] = 4 sizes[i + 1]
    out += [(sizes[i + 1], sizes[i + 1])] * whole
    n -= whole * sizes[i + 1]
  return out


def resolve_kernels(requested: str, bank_dtype) -> tuple[str, str]:
  """The kernels a step runs with and a description of that path for the summary line.

  ``auto`` is ftjax's C++ kernels on the CPU backend (``ffi_bf16`` for bfloat16 banks,
  ``ffi`` otherwise) and XLA elsewhere. When the compiled module is missing or unusable,
  ``auto`` and ``ffi*`` raise ``ftjax.kernels.KernelsUnavailable`` with the cause and the
  fix: never a silent fall back to XLA:CPU, which is 10-20x slower there."""
  backend = jax.default_backend()
  chosen = requested
  if requested == "auto":
    if backend != "cpu":
      return "xla", (f"xla ({backend}: dense work and slot experts; fills and host experts by "
                     "the pool's placement)")
    host_kernels.require("kernels='auto' on the CPU backend")
    chosen = "ffi_bf16" if np.dtype(bank_dtype) == np.dtype(jnp.bfloat16) else "ffi"
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


@dataclasses.dataclass(frozen=True)
class RuntimeOptions:
  """Runtime choices, separate from the model config.

  max_seq_len: context limit (prompt + new tokens); default the model's
    ``max_position_embeddings``.
  kernels: how host-side work runs: "ffi" (ftjax's C++ kernels, CPU backend; bfloat16
    weights widened exactly to float32), "ffi_bf16" (the same, with activations rounded to
    bfloat16 for bfloat16 weights: about 1.8x faster prefill, ~1e-2 relative error, as
    llama.cpp does), "ffi_int8" (int8 and mxfp4 experts only, opt-in: their activations
    quantised to int8, ~1e-2 relative error; int8 experts for vpdpbusd on AVX-512-VNNI CPUs,
    mxfp4 experts per block of 32 as llama.cpp's Q8_0, in decode steps only, on any CPU; dense
    work as "ffi"), "xla"
    (plain jnp), or "auto" (on the CPU backend with the compiled module: ffi_bf16 for bfloat16
    models, ffi otherwise, int8 experts included; else xla).
  Expert cache (at most one of the four sizes; none = no cache, every routed expert runs
  from the host pool):
    cache_slots: number of slots; cache_fraction: of all L·E experts; cache_bytes: a memory
    size; device_budget_bytes: a budget shared with the KV cache, re-divided automatically
    as the KV cache grows or shrinks (DESIGN section 5).
  policy: a name in ``ftjax.cache.POLICIES`` or a ``PolicyConfig``.
  bandwidths: (B_P, B_H) in GB/s, or profile: a ``python -m ftjax.profile`` JSON. Needed by
    the freetoken policy.
  hot_experts: routing counts [L, E] choosing the pinned set of ``static_hot``.
  cache_capacity: a fixed slot-buffer size (default: the power-of-two bucket of the slot
    count). Sizes up to it then share one compiled step: sweeps over cache sizes compile once.
  record_routing: keep every step's router output (``engine.routing_record()``;
    ``ftjax.traces.Trace.from_engine(engine)``).
  decode_chunk: decode steps per decode program (N): the host reads the new tokens, the
    cache counts and the routing record once per chunk, so text streams every N tokens.
  pool: where the host expert pool lives and so how fills and host experts run: "device",
    "pinned_host", "mapped" (GPU) or "auto" (``ftjax.runtime.placement``).
  stream_prefill_tokens: prefills (and session segments) of at least this many tokens move
    each MoE layer whole to the device and compute every route there (DESIGN section 4);
    0 never does. Default (None): on an accelerator with the pool off the device, when the
    tokens' routes (T·K) reach the layer's E experts (about 63% of them then distinct under
    uniform routing); never on the CPU backend, where device memory is host memory and the
    grouped host kernel reads the pool in place. With a ``profile`` that has the host's
    grouped rate, the threshold comes from the cost model instead
    (``ftjax.cache.streaming.prefill_stream_threshold``); ``engine.stream_source`` says which.
  prefill_stream: how a prefill at or past that threshold streams: "always" (every MoE
    layer, each layer's transfer started during the previous layer-step) or "cost" (each
    layer-step streams when the cost model, ``ftjax.cache.streaming.prefill_layer_times``, makes
    streaming that layer cheaper than its sparse fills and host experts: a layer whose
    experts are in the cache stays sparse; ``ftjax.cache.moe.CachedExperts``). Default
    "auto": "cost" when the host's grouped rate is known (``host_gflops`` or a ``profile``),
    else "always". ``engine.stats()`` counts the layer-steps that streamed.
  host_gflops: the host expert kernel's grouped rate in GFLOP/s, which the cost model weighs
    against streaming; default: the ``profile``'s ``host_grouped_gflops``.
  devices: split the expert cache's slots over this many local devices (expert-parallel, one
    contiguous block of slots each) and the large dense weights along their first axis, with
    ``jax.sharding``; None or 1: one device. Every placement works (the pool is read by every
    device); long prefills do not stream. Test it on a CPU with ``JAX_NUM_CPU_DEVICES=4``.
  prefill_chunk: the most tokens one prefill program reads (at most ``max_seq_len``, and 4096
    when the KV buffer grows: ``engine.chunk_sizes`` says what runs). A prompt (or a session's next
    segment) is read in chunks of a few fixed sizes, this one and its quarters down to 16
    (``chunk_sizes``; 1024, 256, 64, 16), each chunk's queries attending the KV cache written
    so far: a prefill's activation memory is bounded by one chunk, and a context of any length
    runs the same compiled programs (``split_tokens`` says how a length is split). 1024 was
    the fastest of 256-2048 for suffixes of 60-2000 tokens (``benchmarks/prefill_chunks.py``).
  kv_growth: how a decode state's KV buffer is sized. Programs are compiled per KV capacity,
    and the buffer is addressed with the state's length, so its capacity is not the context's.
    "max": one buffer of the whole context limit (``max_seq_len`` plus one small chunk's
    padding) from the first token: one set of programs for every request. "grow": 4096 rows,
    grown 4x (with a copy) as a context outgrows them, up to the limit: about
    ``log4(max_seq_len / 4096) + 1`` sets of programs (3 for 65536 tokens), memory within 4x
    of the context's. "auto" (default): "max" when that buffer (with the recurrent states)
    takes at most 64 MiB and no ``device_budget_bytes`` shares memory with it, else "grow".
    ``engine.kv_capacities`` lists the capacities a state can have.
  kv_dtype: the KV cache's dtype, "float32" or "bfloat16". Default (None): bfloat16 for
    bfloat16 models, float32 otherwise. Keys and values are rounded once when written;
    attention reads them widened and accumulates in float32.
  kernel_tuning: the C++ kernels' per-machine variant (``ftjax.kernels.tuning``): "auto"
    (default: this machine's tuning file under ``$FTJAX_CACHE_DIR/kernel_tuning``, measured on
    this model's shapes, a few seconds, when there is none), "off" (the built-in defaults), or
    the path of a tuning file. The tuning is the process's: it holds for every engine in it.
    ``engine.kernels_path`` names the variant in use.
  """
  max_seq_len: int | None = None
  kernels: str = "auto"
  cache_slots: int | None = None
  cache_fraction: float | None = None
  cache_bytes: int | None = None
  device_budget_bytes: int | None = None
  policy: str | PolicyConfig = "freetoken"
  bandwidths: tuple[float, float] | None = None
  profile: str | None = None
  hot_experts: Any = None
  cache_capacity: int | None = None
  record_routing: bool = False
  decode_chunk: int = 8
  pool: str = "auto"
  stream_prefill_tokens: int | None = None
  prefill_stream: str = "auto"
  host_gflops: float | None = None
  devices: int | None = None
  prefill_chunk: int = 1024
  kv_dtype: str | None = None
  kv_growth: str = "auto"
  kernel_tuning: str = "auto"

  def __post_init__(self):
    if (isinstance(self.prefill_chunk, bool) or not isinstance(self.prefill_chunk, int)
        or self.prefill_chunk < 1):
      raise ValueError(f"prefill_chunk must be a positive int (tokens per prefill chunk), got "
                       f"{self.prefill_chunk!r}")
    if self.kv_growth not in KV_GROWTHS:
      raise ValueError(f"kv_growth must be one of {KV_GROWTHS}, got {self.kv_growth!r}")
    if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
      raise ValueError(f"kv_dtype must be one of {KV_DTYPES} (or None: bfloat16 for bfloat16 "
                       f"models), got {self.kv_dtype!r}")
    if self.prefill_stream not in PREFILL_STREAM_MODES:
      raise ValueError(f"prefill_stream must be one of {PREFILL_STREAM_MODES}, got "
                       f"{self.prefill_stream!r}")
    if self.host_gflops is not None and (isinstance(self.host_gflops, bool) or not isinstance(
        self.host_gflops, (int, float)) or not self.host_gflops > 0):
      raise ValueError(f"host_gflops must be a positive number (GFLOP/s of the host expert "
                       f"kernel's grouped form), got {self.host_gflops!r}")
    if self.stream_prefill_tokens is not None and (
        not isinstance(self.stream_prefill_tokens, int) or self.stream_prefill_tokens < 0):
      raise ValueError(f"stream_prefill_tokens must be an int >= 0 (0: never), got "
                       f"{self.stream_prefill_tokens!r}")
    if self.pool not in POOLS:
      raise ValueError(f"pool must be one of {POOLS}, got {self.pool!r}")
    if self.devices is not None:
      if not isinstance(self.devices, int) or not 1 <= self.devices <= len(jax.devices()):
        raise ValueError(f"devices must be an int in [1, {len(jax.devices())}] (the local "
                         f"devices; more CPU devices with JAX_NUM_CPU_DEVICES=n before jax "
                         f"starts), got {self.devices!r}")
      if self.devices > 1 and not self.caching:
        raise ValueError("devices= splits the expert cache's slots: give a cache size")
    if self.kernels != "auto" and self.kernels not in KERNELS:
      raise ValueError(f"kernels must be 'auto' or one of {KERNELS}, got {self.kernels!r}")
    if not isinstance(self.decode_chunk, int) or self.decode_chunk < 1:
      raise ValueError(f"decode_chunk must be a positive int, got {self.decode_chunk!r}")
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
    get_policy(self.policy)  # validates the name
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


def state_bytes(config, batch: int, capacity: int, kv_dtype: str = "float32") -> int:
  """Bytes of a decode state: KV caches of the attention layers (in ``kv_dtype``), conv and
  recurrent state of the Gated DeltaNet layers (float32)."""
  c = config
  linear = sum(t == "linear_attention" for t in c.layer_types)
  kv = 2 * (c.num_layers - linear) * batch * capacity * c.num_kv_heads * c.head_dim
  rec = linear * batch * (c.linear_num_value_heads * c.linear_key_head_dim
                          * c.linear_value_head_dim
                          + max(c.linear_conv_kernel - 1, 0) * c.linear_conv_dim)
  return np.dtype(jnp.dtype(kv_dtype)).itemsize * kv + 4 * rec


@dataclasses.dataclass
class GenerateResult:
  tokens: list[int]  # new tokens only
  prompt_tokens: int
  prefill_s: float
  decode_s: float
  compile_s: float
  programs: int = 0  # programs executed for the request (prefill + decode chunks)

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
    self.max_seq_len = opts.max_seq_len or model.config.max_position_embeddings
    self.kv_dtype = opts.kv_dtype or (
        "bfloat16" if np.dtype(model.dtype) == np.dtype(jnp.bfloat16) else "float32")
    self.kv_growth = opts.kv_growth
    if self.kv_growth == "auto":
      small = (state_bytes(model.config, 1, self.max_seq_len + MIN_CHUNK, self.kv_dtype)
               <= KV_MAX_AUTO_BYTES)
      self.kv_growth = "max" if small and opts.device_budget_bytes is None else "grow"
    # A chunk fits the smallest KV buffer: at most the context limit, and with "grow" at most
    # the first capacity.
    largest = min(opts.prefill_chunk, self.max_seq_len)
    if self.kv_growth == "grow":
      largest = min(largest, MIN_KV_ROWS)
    self.chunk_sizes = chunk_sizes(largest)
    # The KV rows a state can need: the context limit, plus the padding of a last chunk that
    # ends past it (``plan_chunks`` keeps that under the smallest chunk size).
    top = self.max_seq_len + self.chunk_sizes[-1]
    capacities = [top]
    if self.kv_growth == "grow":  # 4096, 16384, ... while the next still fits, then the limit
      capacities = [MIN_KV_ROWS << 2 * i for i in range(32) if MIN_KV_ROWS << 2 * i + 1 <= top]
      capacities.append(top)
    self.kv_capacities = tuple(capacities)
    self.policy = get_policy(opts.policy) if opts.caching else None
    self._profile: dict | None = None  # the bandwidth profile, when one was given
    self.bandwidths, self.bandwidth_source = self._bandwidths()
    c = model.config
    stream_min = self._stream_min_tokens()
    self.runner = Runner(
        graphdef=model.graphdef, signature=_signature(model), num_layers=c.num_moe_layers,
        pass_layers=c.num_layers,
        top_k=c.top_k, ffn_dim=c.moe_intermediate_size, kernels=self.kernels,
        policy=self.policy.program() if self.policy is not None else None,
        record_routing=opts.record_routing, chunk=opts.decode_chunk,
        offload=dataclasses.replace(self.placement.offload,
                                    host_gflops=self._host_gflops() or 0.0),
        stream_min_tokens=stream_min, prefill_stream=self._prefill_stream(stream_min),
        kv_dtype=self.kv_dtype, variant=expert_variant(c))
    self.programs = Programs.shared(self.runner)
    # Device state (KV caches, recurrent states) by owner, and the budget it shares with the
    # expert cache (ftjax.runtime.budget).
    self.memory = MemoryBudget(opts.device_budget_bytes)
    # The programs' runner: compiles, the expert cache, per-step records and the decode loop.
    self.executor = Executor(self, self._initial_cache(self._requested_slots(kv_bytes=0))
                             if opts.caching else None)

  # The executor's compile counters, read and set through the engine.
  @property
  def compile_count(self) -> int:
    """Programs this engine had to compile (``compile_s``: their seconds)."""
    return self.executor.compile_count

  @property
  def compile_s(self) -> float:
    return self.executor.compile_s

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
                                 c.top_k))
      # Measured concurrently: B_P while the host kernel runs, and the host kernel's residual
      # bandwidth B_res while a fill runs, so B_H = B_P + B_res (DESIGN section 2).
      conc = prof["concurrent"]
      return (np.asarray([conc["b_p_gb_s"], conc["b_p_gb_s"] + conc["b_h_gb_s"]], np.float32),
              f"profile {o.profile} (concurrent)")
    if self.policy is not None and self.policy.fill_rule == "q*":
      raise ValueError(f"the {self.policy} policy needs bandwidths: pass bandwidths=(B_P, "
                       "B_H) in GB/s or profile=PATH (write one with `python -m ftjax.profile`)")
    return None, "none (not needed by this policy)"

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
    if self.memory.hold(owner, nbytes):
      self._refit(f"decode states now {self.memory.state_bytes} bytes "
                  f"({self.memory.holders} holders)")

  def state_bytes(self, batch: int, capacity: int) -> int:
    """Bytes of a decode state of ``batch`` rows of ``capacity`` KV rows on this engine."""
    return state_bytes(self.model.config, batch, capacity, self.kv_dtype)

  def _refit(self, reason: str) -> None:
    cache = self.executor.cache
    if cache is None or self.memory.total is None:
      return
    n = self._requested_slots(self.memory.state_bytes)
    if n != int(cache.limit):
      self.resize_cache(slots=n, reason=reason)

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
    total = {k: np.zeros(layers, np.int64) for k in ("hits", "fills", "host")}
    host_run = np.zeros(layers, np.int64)  # host misses that ran on the host (not streamed)
    streamed = np.zeros(layers, np.int64)  # layer-steps that streamed their whole layer
    for step in steps:
      for k in total:
        total[k] += step[k]
      host_run += np.where(step["streamed"], 0, step["host"])
      streamed += step["streamed"]
    misses = total["fills"] + total["host"]
    selected = total["hits"] + misses
    eb = self.model.expert_bytes
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
        "compiles": self.compile_count,
    }

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
      empty = np.zeros((0, c.num_layers, c.top_k))
      return {"ids": empty.astype(np.int32), "weights": empty.astype(np.float32),
              "phase": np.zeros((0,), np.uint8)}
    layers = c.num_layers
    return {"ids": np.concatenate([r[0][:layers].transpose(1, 0, 2) for r in routing]),
            "weights": np.concatenate([r[1][:layers].transpose(1, 0, 2) for r in routing]),
            "phase": np.concatenate([np.full(r[0].shape[1], r[2] == "decode", np.uint8)
                                     for r in routing])}

  # -- Programs ------------------------------------------------------------------------------

  def step(self, state: DecodeState, tokens: jax.Array, positions: jax.Array, *,
           last_only: bool = False, fresh: bool = False) -> tuple[DecodeState, jax.Array]:
    """One forward: tokens/positions [B, T] -> (new state, logits). Donates state.

    The per-token reference path (teacher forcing, tests); ``generate`` runs the device
    loop instead. ``fresh=True`` is for the first step of a new state (a prefill): attention
    then covers only the new tokens. With an expert cache, the engine's current cache
    (resized since, perhaps) rides along and comes back updated."""
    if fresh and int(state.length) != 0:
      raise ValueError(f"fresh=True needs an empty state, but it holds {int(state.length)} tokens")
    ex = self.executor
    tokens, positions = ex.put((jnp.asarray(tokens, jnp.int32),
                                jnp.asarray(positions, jnp.int32)))
    est = ex.engine_state(state)
    key = ("step", tokens.shape, state.capacity, ex.slot_capacity(), last_only, fresh)
    fn = ex.compiled(key, programs.step_program, self.params, self.bank, est,
                     tokens, positions, last_only=last_only, fresh=fresh)
    t0 = time.perf_counter()
    est, logits, record = fn(self.params, self.bank, est, tokens, positions)
    decode = ex.keep(est)
    if record.stats is not None or record.routing is not None:
      jax.block_until_ready(logits)
      ex.record(record, time.perf_counter() - t0,
                "prefill" if tokens.shape[1] > 1 else "decode", tokens=int(tokens.size))
    return decode, logits

  def kv_capacity(self, rows: int) -> int:
    """The KV capacity of a state that must hold ``rows`` rows: the smallest of
    ``kv_capacities`` that does."""
    for capacity in self.kv_capacities:
      if capacity >= rows:
        return capacity
    raise ContextLengthError(f"{rows} KV rows exceed the context limit of {self.max_seq_len} "
                             "tokens")

  def new_state(self, batch: int, capacity: int, owner: Any = None) -> DecodeState:
    """An empty decode state for ``capacity`` tokens (rounded up to one of
    ``kv_capacities``, at most the largest), held by ``owner`` (default: the engine; see
    ``hold_memory``): with a device budget, the cache is re-divided first."""
    return self._new_state(batch, self.kv_capacity(min(capacity, self.kv_capacities[-1])),
                           owner)

  def _new_state(self, batch: int, capacity: int, owner: Any = None) -> DecodeState:
    self.hold_memory(self if owner is None else owner, self.state_bytes(batch, capacity))
    return init_state(self.model.config, batch, capacity, jnp.dtype(self.kv_dtype))

  def grow_state(self, state: DecodeState, rows: int, batch: int = 1,
                 owner: Any = None) -> DecodeState:
    """``state`` (donated; ``batch`` rows) with a KV capacity of at least ``rows`` rows: the
    same state when it has room, else grown through ``kv_capacities`` (each step one compiled
    copy) to the first that holds them, held by ``owner`` (default: the engine): with a
    device budget, the cache is re-divided first."""
    held = state.capacity
    if not held or held >= rows:
      return state
    target = self.kv_capacity(rows)
    self.hold_memory(self if owner is None else owner, self.state_bytes(batch, target))
    for capacity in self.kv_capacities:
      if held < capacity <= target:
        grow = self.executor.compiled(("grow", batch, held, capacity), programs.grow_program,
                                      state, capacity=capacity)
        state, held = grow(state), capacity
    return state

  def check_context(self, prompt_len: int, new: int) -> None:
    if prompt_len < 1:
      raise ValueError("the prompt is empty: give at least one token")
    if prompt_len + new > self.max_seq_len:
      raise ContextLengthError(
          f"prompt ({prompt_len} tokens) + max_new_tokens ({new}) = {prompt_len + new} exceeds the "
          f"context of {self.max_seq_len} tokens: shorten the prompt or lower max_new_tokens")

  def check_ids(self, ids: np.ndarray) -> None:
    """Raises a clear error for token ids outside the vocabulary or of vision inputs."""
    vocab = self.model.config.vocab_size
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
      raise ValueError(f"token ids must be in [0, {vocab}); got min {ids.min()}, max {ids.max()}")
    vision = np.intersect1d(ids, np.asarray(self.model.config.vision_token_ids, np.int32))
    if vision.size:
      raise ValueError(
          f"the prompt holds vision token ids {vision.tolist()} (image/video placeholders of "
          f"this {self.model.config.model_type} checkpoint): ftjax runs the text model only, so "
          "image and video inputs are not supported; remove them from the prompt")

  # -- Prefill: fixed-size chunks ----------------------------------------------------------------

  def plan_chunks(self, start: int, n: int, anchors_at: Sequence[int] = (),
                  anchor_slots: int = 0) -> list[Chunk]:
    """How ``n`` tokens after ``start`` held tokens are read: chunks of ``chunk_sizes``
    (``split_tokens``), each with the ``anchors_at`` positions (counted in the ``n`` tokens,
    ascending) that fall in it. A chunk holds at most ``anchor_slots`` of them (0: none are
    taken): one that would hold more ends before the next. Near the context limit the last
    chunks take the smallest size, so that no chunk's padding runs past the KV buffer."""
    limit = self.kv_capacities[-1]
    out: list[Chunk] = []
    begin = 0
    while begin < n:
      tokens, size = split_tokens(n - begin, self.chunk_sizes)[0]
      inside = [p - begin for p in anchors_at if begin <= p < begin + tokens]
      if anchor_slots and len(inside) > anchor_slots:
        tokens, size = split_tokens(inside[anchor_slots], self.chunk_sizes)[0]
      if start + begin + size > limit:
        size = self.chunk_sizes[-1]
        tokens = min(tokens, size)
      inside = [p for p in inside if p < tokens]
      out.append(Chunk(begin=begin, tokens=tokens, size=size,
                       anchors=tuple(inside) if anchor_slots else ()))
      begin += tokens
    return out

  def extend(self, state: DecodeState, ids: Sequence[int] | np.ndarray, **options):
    """Reads ``ids`` into ``state`` (donated) after the tokens it holds
    (``Executor.extend``: the options, and the ``Extended`` result)."""
    return self.executor.extend(state, ids, **options)

  def programs_needed(self, anchor_slots: int = 0, batch: int = 1) -> list[tuple]:
    """The keys of every program a request (or a session with ``anchor_slots``) can run on
    this engine, in a decode batch of one and of ``batch`` rows: per KV capacity, one extend
    program per chunk size and the decode loop; the first-token program; the copies between
    consecutive capacities; with ``batch`` > 1, the batch's decode loop and growth, and the
    copies of a sequence into and out of a row for each pair of capacities. A request never
    compiles another, unless the expert cache is resized past its buffer or more than
    ``STOP_BUCKET`` stop tokens are given."""
    slots = self.executor.slot_capacity()
    sizes = [1] + ([batch] if batch > 1 else [])
    keys = [("first", STOP_BUCKET)]
    for i, capacity in enumerate(self.kv_capacities):
      keys += [("extend", size, capacity, slots, anchor_slots) for size in self.chunk_sizes]
      for size in sizes:
        keys.append(("decode", size, capacity, slots, STOP_BUCKET))
        if i:
          keys.append(("grow", size, self.kv_capacities[i - 1], capacity))
    if batch > 1:
      for held in self.kv_capacities:
        for capacity in self.kv_capacities:
          keys += [("join", batch, held, capacity), ("leave", batch, held, capacity)]
    return keys

  def precompile(self, anchor_slots: int = 0,
                 on_progress: Callable[[int, int, tuple], None] | None = None,
                 batch: int = 1) -> list[tuple]:
    """Compiles every program of ``programs_needed(anchor_slots, batch)`` not compiled yet
    (from abstract shapes: no state is allocated), so that no request compiles. Returns the
    keys compiled now; ``on_progress(done, total, key)`` is told before each."""
    if self.mesh is not None:
      raise ValueError("precompile compiles one device's programs; an engine with devices= "
                       "compiles its programs on first use")
    ex = self.executor
    keys = [key for key in self.programs_needed(anchor_slots, batch) if key not in self.programs]
    spec = jax.ShapeDtypeStruct
    sampling = jax.tree.map(lambda x: spec(np.shape(x), np.asarray(x).dtype),
                            Sampling.make(greedy=True))
    stop_ids, scalar = spec((STOP_BUCKET,), jnp.int32), spec((), jnp.int32)
    logits = spec((self.model.config.vocab_size,), jnp.float32)
    for done, key in enumerate(keys):
      if on_progress is not None:
        on_progress(done, len(keys), key)
      kind = key[0]
      if kind == "first":
        ex.first_program(logits, scalar, stop_ids, sampling)
      elif kind == "extend":
        ex.extend_program(key[1], key[2], anchor_slots,
                          ex.engine_state(ex.abstract_state(1, key[2])))
      elif kind == "decode":
        ex.decode_program(ex.engine_state(ex.abstract_state(key[1], key[2], rows=True)),
                          ex.abstract_rows(key[1]))
      elif kind == "grow":
        ex.compiled(key, programs.grow_program, ex.abstract_state(key[1], key[2]),
                    capacity=key[3])
      elif kind == "join":
        ex.join_program(key[1], key[2], key[3])
      else:
        ex.leave_program(key[1], key[2], key[3])
    return keys

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
    state = self._new_state(1, self.kv_capacity(last.begin + last.size))
    read = self.executor.extend(state, ids, on_progress=on_progress, start=0)
    return np.asarray(read.logits, np.float32)

  def generate_speculative(self, token_ids: Sequence[int], max_new_tokens: int,
                           greedy: bool = True, *, temperature: float = 1.0, top_p: float = 1.0,
                           seed: int = 0, top_k: int = 0, draft_tokens: int = 2,
                           stop_tokens: Sequence[int] = (),
                           forced_drafts: Sequence[int] | None = None,
                           on_token: Callable[[int], None] | None = None,
                           adaptive: bool = False) -> speculative.SpeculativeResult:
    """Decoding with the model's multi-token-prediction head drafting ``draft_tokens`` tokens
    per verify step (``ftjax.runtime.speculative``), with each draft position's acceptance.
    Greedy: the same tokens as ``generate(..., greedy=True)``; sampled (``greedy=False``,
    the options of ``generate``): rejection sampling, tokens that follow the distribution
    ``generate`` samples from. ``adaptive``: each step drafts 0 .. ``draft_tokens`` tokens,
    the length with the most expected tokens per byte read; ``forced_drafts``: research
    (``speculative.generate_speculative``)."""
    sampling = Sampling.make(greedy=greedy, temperature=temperature, top_p=top_p, seed=seed,
                             top_k=top_k)
    return speculative.generate_speculative(self, token_ids, max_new_tokens,
                                            draft_tokens=draft_tokens, stop_tokens=stop_tokens,
                                            sampling=sampling, forced_drafts=forced_drafts,
                                            on_token=on_token, adaptive=adaptive)

  def generate(self, token_ids: Sequence[int], max_new_tokens: int, greedy: bool = True, *,
               temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, top_k: int = 0,
               stop_tokens: Sequence[int] = (), on_token: Callable[[int], None] | None = None
               ) -> list[int]:
    """New tokens after ``token_ids`` (the prefill's chunks, then the decode loop)."""
    return self.generate_timed(token_ids, max_new_tokens, greedy, temperature=temperature,
                               top_p=top_p, seed=seed, top_k=top_k, stop_tokens=stop_tokens,
                               on_token=on_token).tokens

  def generate_timed(self, token_ids: Sequence[int], max_new_tokens: int, greedy: bool = True,
                     *, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
                     top_k: int = 0,
                     stop_tokens: Sequence[int] = (),
                     on_token: Callable[[int], None] | None = None,
                     on_progress: Callable[[int, int], None] | None = None) -> GenerateResult:
    """``generate`` with timings: prefill and decode seconds (compiles excluded and reported
    apart), and the number of programs the request executed. ``on_progress(done, total)``
    is told of each prefill chunk as it completes (prompts longer than ``prefill_chunk``;
    ``done = 0`` when the first starts, after the compiles)."""
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
    read = self.executor.extend(self._new_state(1, capacity), ids, on_progress=on_progress,
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
                   sampling=sampling, stops=stop_tokens, on_chunk=on_chunk)
    decode_s = self.executor.run_one(seq)
    return GenerateResult(tokens=seq.tokens[:max_new_tokens], prompt_tokens=len(ids),
                          prefill_s=read.seconds + seq.first_s, decode_s=decode_s,
                          compile_s=self.compile_s - compile_before,
                          programs=read.programs + seq.programs)


def _signature(model: Model) -> tuple:
  """The shapes and dtypes of a model's arrays (equal graphdefs of other dtypes must not
  share compiled programs)."""
  leaves = jax.tree.leaves(model.params)
  return (tuple(model.bank.shape), str(model.bank.dtype),
          tuple((tuple(x.shape), str(x.dtype)) for x in leaves))
