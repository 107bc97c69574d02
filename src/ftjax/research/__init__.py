"""Research tooling on top of the engine: what the cache policies would do, and what it costs.

* ``traces``: routing traces (``Trace``: ids and weights ``[steps, L, K]``), saved as ``.npz``;
  ``Trace.from_engine(engine)`` captures an engine's routing record.
* ``replay``: a trace through the engine's own plan function under ``lax.scan`` (with a
  ``Prefetch``: the engine's prefetch after each layer-step, from a predictor), and Belady's
  offline bound.
* ``routing_stats``: overlap, popularity and LRU statistics of a trace.
* ``synthetic``: a routing generator calibrated to Qwen3-30B-A3B and Mixtral-8x7B.
* ``cost``: the decode cost model with hardware profiles.
* ``bound``: on a synthetic trace, the least miss rate any online policy can expect, from the
  law of each step (``synthetic.next_step_probabilities``).
* ``sweep``: traces x policies x cache sizes x hardware (``python -m ftjax.sweep``).
* ``calibrate``: a machine's cost-model hardware profile from a measured bandwidth profile and
  a short decode (``python -m ftjax.profile --hardware_out``).

Imports run one way: research uses the runtime, the cache and the model; nothing below it
imports research. ``ftjax.traces`` and ``ftjax.sweep`` are the public aliases README names.
"""
