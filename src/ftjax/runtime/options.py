"""``RuntimeOptions``: an engine's runtime choices (kernels, expert cache, policy, bandwidths,
KV sizes, prefill chunks, streaming, devices), separate from the model config and checked
when they are made."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from ftjax.cache import PolicyConfig, get_policy
from ftjax.cache.streaming import PREFILL_STREAM_MODES
from ftjax.experts import KERNELS
from ftjax.runtime.kv import KV_DTYPES, KV_GROWTHS
from ftjax.runtime.placement import POOLS

CALIBRATE_SPLIT = ("auto", "on", "off")


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
    (plain jnp), or "auto" (on the CPU backend with the compiled module: ffi_bf16 for bfloat16,
    mxfp4 and int4 experts, ffi otherwise, int8 experts included; else xla).
  Expert cache (at most one of the four sizes; none = no cache, every routed expert runs
  from the host pool):
    cache_slots: number of slots; cache_fraction: of all L·E experts; cache_bytes: a memory
    size; device_budget_bytes: a budget shared with the KV cache, re-divided automatically
    as the KV cache grows or shrinks (DESIGN section 5).
  policy: a name in ``ftjax.cache.POLICIES`` or a ``PolicyConfig``.
  bandwidths: (B_P, B_H) in GB/s, or profile: a ``python -m ftjax.profile`` JSON. Needed by
    the freetoken policy.
  calibrate_split: for a q* policy, whether decode re-solves the split from the fills' and
    host runs' costs measured while it runs, with a guard that switches to pure fill or pure
    host when the split measures over 1.1x the best of the three (``ftjax.runtime.
    calibration``): "on", "off", or "auto" (on with a ``profile``, whose numbers were measured
    apart from serving; off with ``bandwidths`` given, which a sweep sets on purpose).
  prefetch: router-ahead prefetch in decode (one token per sequence a step, batches too): at
    most this many experts per MoE layer-step, named by the layer's router applied to the
    residual entering it, before its mixer, are filled into the cache ahead of the layer's
    plan (``ftjax.cache.moe.CachedExperts.ahead``; the policy's victims); 0 (default) none.
    Outputs are unchanged; ``engine.stats()["prefetch"]`` and ``/metrics`` count the
    prefetched experts, those a step used and those evicted unused. On a GPU the copies can
    overlap the mixer; on the CPU backend they are work of the same cores.
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
    runs the same compiled programs. A length is split by ``KVLayout.plan_chunks`` into the
    plan of least modelled cost, ``prefill_chunk_overhead`` per chunk plus its size (padding
    included): 697 tokens run as 3 x 256, not 1024. 1024 was the fastest of 256-2048 for
    suffixes of 60-2000 tokens (``benchmarks/prefill_chunks.py``).
  prefill_chunk_overhead: a prefill chunk's fixed cost (its weight reads, dispatch) in token
    slots of compute, which the chunk planner trades against padding; default (None)
    ``kv.CHUNK_OVERHEAD`` (64, from per-chunk timings of the bench and default models).
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
  calibrate_split: str = "auto"
  prefetch: int = 0
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
  prefill_chunk_overhead: float | None = None
  kv_dtype: str | None = None
  kv_growth: str = "auto"
  kernel_tuning: str = "auto"

  def __post_init__(self):
    if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
      raise ValueError(f"prefetch must be an int >= 0 (experts prefetched per layer-step by "
                       f"router-ahead; 0: none), got {self.prefetch!r}")
    if self.calibrate_split not in CALIBRATE_SPLIT:
      raise ValueError(f"calibrate_split must be one of {CALIBRATE_SPLIT}, got "
                       f"{self.calibrate_split!r}")
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
    if self.prefetch and not self.caching:
      raise ValueError("prefetch= fills the expert cache ahead of each layer: give a cache "
                       "size (cache_slots, cache_fraction, cache_bytes or device_budget_bytes)")
    if self.prefetch and self.devices is not None and self.devices > 1:
      raise ValueError("prefetch= is not built for expert-parallel slots (devices > 1): "
                       "leave one of them out")
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
