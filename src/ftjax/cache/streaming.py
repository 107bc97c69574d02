"""When a prefill streams whole layers to the device: the cost model and the decisions it makes.

A long prefill's MoE layer-step can move its whole layer [E, P] to the device and compute
every route there instead of filling some misses and running the rest on the host (DESIGN
section 4; ``Offload.stream`` in ``ftjax.cache.moe``). Everything that weighs the two lives
here, on one contention formula:

* ``host_read_time``: the host kernel reading its experts while the fills' DMA takes B_P of
  host memory (B_res = B_H − B_P during it, B_H after it). The q* fill rule is derived from it,
  and the decode cost model (``ftjax.research.cost.layer_step_time``) uses it too.
* ``prefill_layer_times``: one layer-step's ``(sparse, streamed)`` seconds;
  ``worth_streaming`` the per-layer choice inside a program (``stream="cost"``), on the shape
  arguments that ``stream_costs`` gives for a pool and a model.
* ``prefill_stream_threshold``: the shortest prefill that streams a cold layer;
  ``stream_min_tokens`` and ``prefill_stream_mode``: the engine's choices
  (``RuntimeOptions.stream_prefill_tokens`` and ``prefill_stream``) from its options, its
  bandwidths and the host kernel's rate, each with the description ``engine.stream_source``
  shows.

Bandwidths are GB/s (1e9 bytes) except in ``host_read_time``, which works in bytes per second
like the callers' arithmetic. Every function takes numpy values (the engine's threshold, the
cost model, benchmarks) or jax values (the choice inside a program), as their docstrings say.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.cache.policy import Plan

GB = 1e9  # bandwidths are GB/s of 1e9 bytes
PREFILL_STREAM_MODES = ("auto", "always", "cost")


def _array_module(*values):
  """``jnp`` when any value is a jax array (or a tracer), else ``np``."""
  return jnp if any(isinstance(v, jax.Array) for v in values) else np


def host_read_time(host_bytes, dma_s, b_p, b_h):
  """Seconds the host kernel takes to read ``host_bytes`` of experts while the fills' DMA,
  which runs for ``dma_s`` seconds from the start, takes ``b_p`` of the host's ``b_h`` bytes
  per second of memory bandwidth (bytes/s, not GB/s)::

    B_res = max(B_H − B_P, 0)              # what the host kernel has while the DMA runs
    read  = host_bytes / B_res             if host_bytes <= dma_s·B_res  (done during it)
            dma_s + (host_bytes − dma_s·B_res) / B_H                     otherwise

  This is the contention behind the q* fill rule (DESIGN section 2): ``q/B_P = (m − q)/B_res``
  gives ``q* = m·B_P/B_H``. With B_P >= B_H the host reads nothing during the DMA. Elementwise
  over broadcastable values, computed in their dtype: numpy values give numpy, jax values
  (traced too) give jax.

  Example: B_P 10, B_H 20 GB/s, a 0.6 ms DMA: 12 MB take 0.9 ms (6 MB at 10 GB/s during the
  DMA, 6 MB at 20 GB/s after it); 3 MB take 0.3 ms, all during it.
  """
  xp = _array_module(host_bytes, dma_s, b_p, b_h)
  b_res = xp.maximum(b_h - b_p, 0.0)
  during = dma_s * b_res  # bytes the host kernel reads while the DMA runs
  # The first branch is taken only when B_res > 0 or there is nothing to read; the floor of
  # 1 byte/s keeps the other branch's division finite.
  return xp.where(host_bytes <= during, host_bytes / xp.maximum(b_res, 1.0),
                  dma_s + (host_bytes - during) / b_h)


def prefill_layer_times(fills, host, host_routes, *, experts: int, expert_bytes: int,
                        flops_per_route: float, b_p, b_h, host_gflops: float):
  """The cost model of one layer-step's expert traffic: ``(sparse, streamed)`` seconds.

  S = ``expert_bytes``, bandwidths in GB/s (1e9 bytes), ``host_gflops`` in 1e9 FLOP/s::

    streamed = E·S / B_P                         # the whole layer over the link
    sparse   = max(fills·S / B_P,                # the fills over the link
                   host_read, host_routes·flops_per_route / host_gflops)

  ``host_read`` is ``host_read_time`` of the ``host`` experts' bytes under the fills' DMA: at
  B_res = B_H − B_P while the DMA runs, at B_H after it. The device's compute is left out: it
  is the same routes either way. Computes in float32; takes and returns numpy values (the
  engine's threshold, the benchmark's modelled times) or jax values (the per-layer choice
  inside a program).

  Example (tests/cache/test_prefill_stream.py): E = 128 experts of S = 9.44 MB (a
  Qwen3-30B-A3B layer), B_P 25, B_H 63 GB/s. Streaming takes 48.3 ms. 40 fills take 15.1 ms,
  during which the host reads 574 MB of its 70 experts (661 MB) at B_res 38 GB/s, and the
  rest at B_H: 16.5 ms; so the layer stays sparse unless its host routes need more than
  48.3 ms of compute.
  """
  values = (fills, host, host_routes, b_p, b_h)
  xp = _array_module(*values)
  fills, host, host_routes, b_p, b_h = (xp.asarray(v, xp.float32) for v in values)
  b_p, b_h = b_p * GB, b_h * GB
  dma = fills * expert_bytes / b_p
  read = host_read_time(host * expert_bytes, dma, b_p, b_h)
  compute = host_routes * flops_per_route / (host_gflops * GB)
  sparse = xp.maximum(dma, xp.maximum(read, compute))
  streamed = xp.asarray(experts * expert_bytes, xp.float32) / b_p
  return sparse, streamed


def stream_costs(pool_shape, dtype, *, ffn_dim: int, width: int,
                 host_gflops: float | None) -> dict:
  """``prefill_layer_times``'s shape arguments (``experts``, ``expert_bytes``,
  ``flops_per_route``, ``host_gflops``) for a pool [L, E, P] of ``dtype`` holding experts
  D = ``width`` -> F = ``ffn_dim``: a route costs 6·F·D FLOPs (gate, up and down, a
  multiply-add being two)."""
  _, experts, elems = pool_shape
  return dict(experts=int(experts), expert_bytes=int(elems) * np.dtype(dtype).itemsize,
              flops_per_route=6.0 * ffn_dim * width, host_gflops=host_gflops)


def worth_streaming(p: Plan, host_routes, bandwidths: jax.Array, *, experts: int,
                    expert_bytes: int, flops_per_route: float, host_gflops: float) -> jax.Array:
  """[] bool: whether the cost model makes streaming the layer cheaper than ``p``'s sparse
  step (``prefill_layer_times`` of its fills, its host experts and their ``host_routes``
  routes). ``bandwidths``: [2] (B_P, B_H) in GB/s; the rest as ``stream_costs`` gives it."""
  sparse, streamed = prefill_layer_times(
      p.fills, p.host, host_routes, experts=experts, expert_bytes=expert_bytes,
      flops_per_route=flops_per_route, b_p=bandwidths[0], b_h=bandwidths[1],
      host_gflops=host_gflops)
  return streamed < sparse


def prefill_stream_threshold(*, experts: int, top_k: int, expert_bytes: int,
                             flops_per_route: float, b_p: float, b_h: float,
                             host_gflops: float, max_tokens: int = 1 << 17) -> int:
  """The shortest prefill (tokens T) whose MoE layer-step the cost model makes cheaper with the
  whole layer streamed to the device than with sparse fills and host experts, for a cold
  layer (no hits); 0 if none up to ``max_tokens``. Bandwidths in GB/s, bytes and FLOPs per
  expert and per route.

  A cold layer under uniform routing sees u = E·(1 − (1 − K/E)^T) distinct experts, all
  misses; the q* rule fills q = u·B_P/B_H of them (all when B_P >= B_H) and the host runs the
  rest with its share of the T·K routes. ``prefill_layer_times`` gives both sides' times. The
  sparse time grows with T and streaming's does not, so the threshold is found by bisection.
  It bounds every layer: one with experts in the cache misses fewer (the engine's
  ``stream="cost"`` then decides each layer on its own counts).

  Example (a Qwen3-30B-A3B layer, B_P 50, B_H 100 GB/s, a host at 500 GFLOP/s): streaming the
  layer takes 24 ms; at 256 tokens the sparse path's host compute is ~19 ms, at 512 ~39 ms, so
  the threshold lies between (tests/cache/test_streaming.py works it through)."""
  def sparse_over_stream(tokens: int) -> float:
    distinct = experts * (1.0 - (1.0 - top_k / experts) ** tokens)
    filled = distinct if b_p >= b_h else distinct * b_p / b_h
    on_host = distinct - filled
    sparse, stream = prefill_layer_times(
        filled, on_host, tokens * top_k * (on_host / distinct), experts=experts,
        expert_bytes=expert_bytes, flops_per_route=flops_per_route, b_p=b_p, b_h=b_h,
        host_gflops=host_gflops)
    return float(sparse / stream)

  if sparse_over_stream(max_tokens) <= 1.0:
    return 0
  low, high = 1, max_tokens  # sparse(low) <= stream < sparse(high)
  if sparse_over_stream(low) > 1.0:
    return low
  while high - low > 1:
    mid = (low + high) // 2
    low, high = (mid, high) if sparse_over_stream(mid) <= 1.0 else (low, mid)
  return high


def stream_min_tokens(stream_prefill_tokens: int | None, *, caching: bool,
                      pool_on_device: bool, expert_parallel: bool, top_k: int, bandwidths,
                      experts: int, expert_bytes: int, flops_per_route: float,
                      host_gflops: float | None) -> tuple[int, str]:
  """The engine's streaming threshold: prefills of at least this many tokens stream whole
  layers (0: never), and where the number comes from (``engine.stream_source``).

  stream_prefill_tokens: the option as given (None: decide here); caching: the engine has an
    expert cache (streaming runs through its layer-step); pool_on_device: the pool is in
    memory the device reads in place (the CPU backend, or ``pool="device"``), so streaming
    moves nothing; expert_parallel: the slots are split over devices (``devices=``);
    bandwidths: (B_P, B_H) in GB/s or None; the rest as ``stream_costs`` gives it, with
    ``host_gflops`` None or 0 when the host kernel's grouped rate is unknown.

  In that order: the given number; never without a cache or with the pool on the device;
  never with expert-parallel slots; ``prefill_stream_threshold`` when the bandwidths and the
  host's rate are known; else T·K >= E (about 63% of a layer's experts then distinct under
  uniform routing). A given number that cannot stream raises ``ValueError``.
  """
  if stream_prefill_tokens is not None:
    if stream_prefill_tokens and not caching:
      raise ValueError("stream_prefill_tokens streams layers through the expert cache's "
                       "layer-step: give a cache size (cache_slots=0 for none)")
    if stream_prefill_tokens and expert_parallel:
      raise ValueError("stream_prefill_tokens does not combine with devices= (each device "
                       "would fetch whole layers for routes it does not hold)")
    return stream_prefill_tokens, "given"
  if not caching or pool_on_device:
    return 0, "never (the pool is in device memory)"
  if expert_parallel:
    return 0, "never (expert-parallel slots)"
  if bandwidths is None or not host_gflops:
    return -(-experts // top_k), ("T·K >= E (no profile with the host's grouped rate: run "
                                  "python -m ftjax.profile and pass profile=)")
  b_p, b_h = (float(b) for b in bandwidths)
  tokens = prefill_stream_threshold(
      experts=experts, top_k=top_k, expert_bytes=expert_bytes, flops_per_route=flops_per_route,
      b_p=b_p, b_h=b_h, host_gflops=host_gflops)
  return tokens, (f"cost model (B_P {b_p:.1f}, B_H {b_h:.1f} GB/s, host "
                  f"{host_gflops:.0f} GFLOP/s)")


def prefill_stream_mode(requested: str, *, cost_known: bool) -> tuple[str, str]:
  """How a prefill that streams does it (``RuntimeOptions.prefill_stream``): ``(mode,
  description)``, the mode ``Offload.stream`` takes.

  ``auto`` is ``cost`` (each layer-step by ``worth_streaming``) when ``cost_known`` (the
  bandwidths and the host kernel's grouped rate), else ``always`` (every layer); ``cost``
  without them raises ``ValueError``.
  """
  if requested not in PREFILL_STREAM_MODES:
    raise ValueError(f"prefill_stream must be one of {PREFILL_STREAM_MODES}, got {requested!r}")
  mode = requested
  if mode == "auto":
    mode = "cost" if cost_known else "always"
  if mode == "cost" and not cost_known:
    raise ValueError("prefill_stream='cost' weighs fills, host experts and streaming by the "
                     "cost model: give bandwidths=(B_P, B_H) and host_gflops=, or a profile= "
                     "from python -m ftjax.profile")
  return mode, "each layer by the cost model" if mode == "cost" else "every layer"
