"""The server's Prometheus metrics (``GET /metrics``), in their own registry.

Counters: requests by endpoint and status, prompt/completion/cached tokens, expert-cache hits,
fills and host-run experts (``Engine.cache_totals``), the engine's compiles and their seconds,
the q* guard's switches and probes (``Engine.calibration``). Histograms: time to first token (queue
wait included) and decode tokens per second. Gauges, read at scrape time: requests waiting,
sessions held and their memory, anchors and their bytes, the q* split's strategy and rates.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


_LOG = logging.getLogger("uvicorn.error")


class EngineTotals(Collector):
  """The engine's counters (cache, programs) and the q* calibration, read at scrape time."""

  def __init__(self, engine):
    self.engine = engine

  def collect(self):
    totals = self.engine.cache_totals()
    for key, help_ in (("hits", "routed experts found in the expert cache"),
                       ("fills", "routed experts copied into the expert cache"),
                       ("host", "routed experts run in place on the host"),
                       ("prefetched", "experts router-ahead prefetched into the expert cache "
                        "(--prefetch)"),
                       ("prefetch_used", "prefetched experts a step used (counted in hits)"),
                       ("prefetch_wasted", "prefetched experts evicted before any use")):
      family = CounterMetricFamily(f"ftjax_expert_cache_{key}", help_)
      family.add_metric([], totals[key])
      yield family
    # The engine's programs prepared: compiled by XLA (a persistent-cache hit is a quick one),
    # or loaded whole from the executable store (a warm start; ftjax_programs_loaded).
    compiles = CounterMetricFamily("ftjax_compiles", "programs the engine prepared: compiled, "
                                   "or loaded from the executable store")
    compiles.add_metric([], self.engine.compile_count)
    yield compiles
    loaded = CounterMetricFamily("ftjax_programs_loaded", "programs loaded whole from the "
                                 "executable store, untraced (counted in ftjax_compiles too)")
    loaded.add_metric([], self.engine.loaded_count)
    yield loaded
    seconds = CounterMetricFamily("ftjax_compile_seconds", "seconds spent compiling programs")
    seconds.add_metric([], self.engine.compile_s)
    yield seconds
    # The q* split's calibration and guard (ftjax.runtime.calibration), when it runs.
    calibration = self.engine.calibration()
    if calibration is not None:
      strategy = GaugeMetricFamily("ftjax_split_strategy", "1 for the strategy decode runs "
                                   "with: the calibrated q* split, pure fill or pure host",
                                   labels=["strategy"])
      for name in ("split", "fill", "host"):
        strategy.add_metric([name], int(calibration["strategy"] == name))
      yield strategy
      switches = CounterMetricFamily("ftjax_split_switches", "strategy changes by the q* "
                                     "guard (each logged with what the strategies measured)")
      switches.add_metric([], len(calibration["switches"]))
      yield switches
      probes = CounterMetricFamily("ftjax_split_probes", "decode programs run with a strategy "
                                   "other than the one in use, to measure it")
      probes.add_metric([], calibration["probes"])
      yield probes
      rates = GaugeMetricFamily("ftjax_split_rate_gb_s", "the fill (B_P) and host (B_H) "
                                "bandwidths the split plans with, measured while serving",
                                labels=["rate"])
      for name, value in zip(("fill", "host"), calibration["rates_gb_s"]):
        rates.add_metric([name], value)
      yield rates


class Metrics:

  def __init__(self):
    r = self.registry = CollectorRegistry()
    self.requests = Counter("ftjax_requests", "HTTP requests answered", ["endpoint", "status"],
                            registry=r)
    self.prompt_tokens = Counter("ftjax_prompt_tokens", "prompt tokens of finished requests",
                                 registry=r)
    self.completion_tokens = Counter("ftjax_completion_tokens", "tokens generated", registry=r)
    self.cached_tokens = Counter("ftjax_cached_tokens",
                                 "prompt tokens reused from a session (not prefilled)",
                                 registry=r)
    self.ttft = Histogram("ftjax_time_to_first_token_seconds",
                          "from the request's arrival to its first token", ["endpoint"],
                          buckets=TTFT_BUCKETS, registry=r)
    self.rate = Histogram("ftjax_decode_tokens_per_second",
                          "decode speed of a request after its first token", ["endpoint"],
                          buckets=RATE_BUCKETS, registry=r)

  def bind(self, worker, engine) -> None:
    """Gauges over the worker's queue and session pool, counters over the engine's cache."""
    r = self.registry
    Gauge("ftjax_requests_waiting", "requests queued behind the running one",
          registry=r).set_function(lambda: worker.waiting)
    Gauge("ftjax_requests_running", "1 while the engine runs a request",
          registry=r).set_function(lambda: int(worker.running))
    pool = worker.pool
    Gauge("ftjax_sessions", "sessions held", registry=r).set_function(lambda: len(pool))
    Gauge("ftjax_session_bytes", "memory of the sessions held (KV, states, anchors)",
          registry=r).set_function(pool.memory_bytes)
    Gauge("ftjax_anchors", "recurrent-state anchors held",
          registry=r).set_function(lambda: pool.stats()["anchors"])
    Gauge("ftjax_anchor_bytes", "bytes of the anchors held",
          registry=r).set_function(lambda: pool.stats()["anchor_bytes"])
    Gauge("ftjax_startup_done", "1 once start-up compilation is done (or not asked for)",
          registry=r).set_function(lambda: int(worker.startup["done"]))
    Gauge("ftjax_startup_programs", "programs compiled at start-up",
          registry=r).set_function(lambda: worker.startup["compiled"])
    Gauge("ftjax_startup_seconds", "seconds of start-up compilation",
          registry=r).set_function(lambda: worker.startup["seconds"])
    Gauge("ftjax_heap_trims", "times the engine, idle after work, gave the C heap's free "
          "pages back to the system", registry=r).set_function(lambda: worker.heap_trims)
    r.register(EngineTotals(engine))

  def finished(self, endpoint: str, outcome) -> None:
    # One line a request at --log_level=info (uvicorn's logger, so it goes where uvicorn's
    # access lines go); benchmarks/agent_clients.py reads TTFT and reuse from it.
    _LOG.info("ftjax request: endpoint=%s prompt=%d reused=%d generated=%d ttft_s=%.3f "
              "finish=%s", endpoint, outcome.prompt_tokens, outcome.cached_tokens,
              outcome.completion_tokens, outcome.ttft_s, outcome.finish_reason)
    self.requests.labels(endpoint, "200").inc()
    self.prompt_tokens.inc(outcome.prompt_tokens)
    self.completion_tokens.inc(outcome.completion_tokens)
    self.cached_tokens.inc(outcome.cached_tokens)
    self.ttft.labels(endpoint).observe(outcome.ttft_s)
    if outcome.decode_tok_s is not None:
      self.rate.labels(endpoint).observe(outcome.decode_tok_s)

  def rejected(self, path: str, status: int) -> None:
    endpoint = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
                "/v1/messages": "messages", "/v1/messages/count_tokens": "count_tokens",
                "/v1/responses": "responses"}.get(path, "other")
    self.requests.labels(endpoint, str(status)).inc()
