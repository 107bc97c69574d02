"""Prefill through the expert cache: the per-layer choice between streaming a whole layer and
the sparse step (fills and host experts), as counts on the CPU backend and modelled time.

On the CPU backend nothing moves over a link, so this measures what the engine decides and
counts (``Engine.stats()``: per layer-step hits, fills, host experts, host routes, streamed),
and turns the counts into time with the cost model of one layer-step's expert traffic
(``ftjax.cache.streaming.prefill_layer_times``) for each GPU machine in ``configs/hardware/``.

Model: a random model with Qwen3-30B-A3B's routing shape (E = 128 experts, top-8) and small
experts whose FLOPs per byte equal Qwen3-30B-A3B's (6·F·D FLOPs per route over 6·F·D bytes of
a bf16 block, no padding). Every term of the cost model scales with the expert's bytes, so
the engine's choices on it are the ones it makes on Qwen3-30B-A3B for the same counts; the
times are modelled at Qwen3-30B-A3B's expert size (9.44 MB) and 48 layers (the mean over this
model's layer-steps, times 48).

Each setting: a fresh engine (``freetoken``, 37% of the experts cached) reads a 512-token
warm-up prompt, then the measured prompt of T tokens (a new sequence, the cache warm). Modes,
on the same plans (the streaming choice never changes a plan, so the static modes are
modelled on the ``per_layer`` run's counts):
- ``sparse``: never stream;
- ``stream_all``: every layer streams (the paper's pipelined full-layer loading);
- ``threshold``: every layer streams when T reaches the cold-layer threshold
  (``ftjax.cache.streaming.prefill_stream_threshold``), the engine's choice before;
- ``per_layer``: the engine's ``prefill_stream="cost"`` with the pool in ``device`` memory:
  each layer-step decides on its own counts (its recorded choices are used);
- ``per_layer_ahead``: the same with the pool in ``pinned_host`` memory: the next layer's
  transfer starts early, decided on a prediction from the previous layer's counts;
- ``best``: each layer-step's cheaper side on its own counts (the bound for a rule that
  decides each layer before its transfer must start).

The device's compute is left out (the same routes in every mode), so the numbers are the
expert traffic's modelled time, and ``stream_all`` gets no credit for hiding its transfer
behind compute: on a long prompt that hiding is what the pipelining adds.

  /work/venv/bin/python benchmarks/prefill_stream.py          # ~3 min on 2 cores

Writes ``results/prefill_stream.json`` and ``results/prefill_stream.png``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, machine_info, pyplot, write_results  # noqa: E402

import ftjax  # noqa: E402
from ftjax.cache.streaming import prefill_layer_times, prefill_stream_threshold  # noqa: E402
from ftjax.model.config import ModelConfig  # noqa: E402
from ftjax.research.cost import HardwareProfile  # noqa: E402
from ftjax.runtime import model as model_lib  # noqa: E402

HARDWARE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "hardware")
QWEN_EXPERT_BYTES = 3 * 768 * 2048 * 2
QWEN_LAYERS = 48
MODES = ("sparse", "stream_all", "threshold", "per_layer", "per_layer_ahead", "best")


def bench_model(layers: int) -> model_lib.Model:
  config = ModelConfig(
      model_type="qwen3_moe", vocab_size=512, hidden_size=64, num_layers=layers, num_heads=4,
      num_kv_heads=2, head_dim=16, num_experts=128, top_k=8, moe_intermediate_size=32,
      rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=8192,
      layer_types=("full_attention",) * layers, qk_norm="per_head", norm_topk_prob=True)
  model = model_lib.random_model(config, seed=0, dtype="bfloat16")
  c = config
  if model.bank.shape[2] != 3 * c.moe_intermediate_size * c.hidden_size:
    raise SystemExit("the bench model's expert blocks are padded: pick D and F whose 3·F·D "
                     "is aligned, so that its FLOPs per byte equal Qwen3-30B-A3B's")
  return model


def run(engine: ftjax.Engine, warmup: list[int], prompt: list[int]) -> dict:
  """Warm-up prompt, then the measured one (a new sequence; the cache stays warm): the
  measured prefill's per-layer counts."""
  for ids in (warmup, prompt):
    state = engine.new_state(1, len(ids) + 1)
    engine.step(state, jnp.asarray([ids], jnp.int32),
                jnp.arange(len(ids), dtype=jnp.int32)[None])
  step = engine.stats()["per_step"][-1]
  return {k: np.asarray(step[k]) for k in ("hits", "fills", "host", "host_routes", "streamed")}


def modelled(counts: dict, streamed: np.ndarray, hw: HardwareProfile, rate: float,
             model) -> float:
  """Seconds of a Qwen3-30B-A3B prefill's expert traffic: mean layer-step x 48."""
  c = model.config
  sparse, stream = prefill_layer_times(
      counts["fills"], counts["host"], counts["host_routes"], experts=c.num_experts,
      expert_bytes=QWEN_EXPERT_BYTES, flops_per_route=float(QWEN_EXPERT_BYTES),
      b_p=hw.b_p, b_h=hw.b_h, host_gflops=rate)
  return float(np.mean(np.where(streamed > 0, stream, sparse))) * QWEN_LAYERS


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--lengths", default="16,64,256,1024,4096")
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--fraction", type=float, default=0.37)
  parser.add_argument("--host_gflops", type=float, default=1000.0,
                      help="the GPU machines' host expert kernel, grouped (assumed)")
  parser.add_argument("--out", default="prefill_stream")
  parser.add_argument("--replot", action="store_true",
                      help="only redraw the plot from the results file")
  args = parser.parse_args()
  if args.replot:
    with open(os.path.join(RESULTS_DIR, f"{args.out}.json")) as f:
      rows = json.load(f)["rows"]
    lengths = sorted({r["tokens"] for r in rows})
    plot(rows, lengths, os.path.join(RESULTS_DIR, f"{args.out}.png"))
    return
  lengths = [int(t) for t in args.lengths.split(",")]
  profiles = sorted((HardwareProfile.load(p) for p in glob.glob(os.path.join(HARDWARE, "*.yaml"))),
                    key=lambda hw: hw.name)
  model = bench_model(args.layers)
  c = model.config
  rng = np.random.default_rng(0)
  warmup = [int(t) for t in rng.integers(0, c.vocab_size, 512)]
  slots = int(args.fraction * c.num_layers * c.num_experts)
  rate = args.host_gflops
  started = time.perf_counter()
  rows = []
  for n, hw in enumerate(profiles):
    threshold = prefill_stream_threshold(
        experts=c.num_experts, top_k=c.top_k, expert_bytes=QWEN_EXPERT_BYTES,
        flops_per_route=float(QWEN_EXPERT_BYTES), b_p=hw.b_p, b_h=hw.b_h, host_gflops=rate)
    for tokens in lengths:
      prompt = [int(t) for t in rng.integers(0, c.vocab_size, tokens)]
      common = dict(kernels="ffi", cache_slots=slots, policy="freetoken",
                    bandwidths=(hw.b_p, hw.b_h), host_gflops=rate)
      counts = own = run(ftjax.Engine(model, stream_prefill_tokens=2, prefill_stream="cost",
                                      pool="device", **common), warmup, prompt)
      ahead = run(ftjax.Engine(model, stream_prefill_tokens=2, prefill_stream="cost",
                               pool="pinned_host", **common), warmup, prompt)
      # The choice never changes a plan, but a streamed layer sums its routes in another
      # order, so a later layer's router may break a near-tie the other way: the predicted
      # run's time is modelled on its own counts, and the largest difference is recorded.
      drift = max(abs(int(ahead[k][i]) - int(own[k][i])) / max(int(own[k][i]), 1)
                  for k in ("hits", "fills", "host", "host_routes") for i in range(c.num_layers))
      sparse_t, stream_t = prefill_layer_times(
          counts["fills"], counts["host"], counts["host_routes"], experts=c.num_experts,
          expert_bytes=QWEN_EXPERT_BYTES, flops_per_route=float(QWEN_EXPERT_BYTES),
          b_p=hw.b_p, b_h=hw.b_h, host_gflops=rate)
      choices = {
          "sparse": np.zeros(c.num_layers), "stream_all": np.ones(c.num_layers),
          "threshold": np.full(c.num_layers, float(0 < threshold <= tokens)),
          "per_layer": own["streamed"], "per_layer_ahead": ahead["streamed"],
          "best": (stream_t < sparse_t).astype(np.float64)}
      seconds = {m: modelled(ahead if m == "per_layer_ahead" else counts, choices[m], hw, rate,
                             model) for m in MODES}
      row = {"hardware": hw.name, "b_p": hw.b_p, "b_h": hw.b_h, "tokens": tokens,
             "threshold_tokens": threshold,
             "counts_per_layer": {k: counts[k].tolist() for k in ("hits", "fills", "host",
                                                                   "host_routes")},
             "streamed_layers": {m: int(np.sum(choices[m])) for m in MODES},
             "count_drift_between_runs": drift,
             "modelled_s": seconds,
             "per_layer_vs_best_static": seconds["per_layer"] / min(
                 seconds["sparse"], seconds["stream_all"], seconds["threshold"]),
             "per_layer_ahead_vs_best_static": seconds["per_layer_ahead"] / min(
                 seconds["sparse"], seconds["stream_all"], seconds["threshold"])}
      rows.append(row)
      print(f"[{n + 1}/{len(profiles)}] {hw.name:16s} T={tokens:5d} streamed "
            f"{row['streamed_layers']['per_layer']}/{c.num_layers} (ahead "
            f"{row['streamed_layers']['per_layer_ahead']}) | " + " ".join(
                f"{m} {1e3 * s:7.1f}" for m, s in seconds.items()) + " ms", flush=True)
  results = {
      "benchmark": "prefill_stream", "machine": machine_info(),
      "setup": {"model": f"random, E={c.num_experts}, top-{c.top_k}, {c.num_layers} layers, "
                         "bf16, unpadded blocks (Qwen3-30B-A3B's FLOPs per byte)",
                "modelled_at": f"Qwen3-30B-A3B: {QWEN_EXPERT_BYTES} B per expert, "
                               f"{QWEN_LAYERS} layers",
                "policy": "freetoken", "cache_fraction": args.fraction, "cache_slots": slots,
                "warmup_tokens": len(warmup), "host_gflops": rate,
                "host_gflops_source": "assumed (--host_gflops), the same for every machine",
                "time": "expert traffic only (device compute left out)"},
      "rows": rows, "wall_s": time.perf_counter() - started}
  print(f"results: {write_results(args.out, results)}")
  plot(rows, lengths, os.path.join(RESULTS_DIR, f"{args.out}.png"))


def plot(rows, lengths, path) -> None:
  plt = pyplot()
  if plt is None:
    return
  names = sorted({r["hardware"] for r in rows})
  cols = 4
  fig, axes = plt.subplots(-(-len(names) // cols), cols, figsize=(3.3 * cols, 6.4))
  axes = np.atleast_1d(axes).ravel()
  for ax, name in zip(axes, names):
    mine = sorted((r for r in rows if r["hardware"] == name), key=lambda r: r["tokens"])
    for mode in MODES:
      ax.plot(lengths, [1e3 * r["modelled_s"][mode] for r in mine], marker="o", ms=3,
              label=mode, linestyle="--" if mode == "best" else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("prompt tokens", fontsize=8)
    ax.set_ylabel("modelled expert traffic (ms)", fontsize=8)
  for ax in axes[len(names):]:
    ax.axis("off")
  handles, labels = axes[0].get_legend_handles_labels()
  axes[-1].legend(handles, labels, loc="center", fontsize=8,
                  title="Qwen3-30B-A3B prefill, 37% cached")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  print(f"plot: {path}")


if __name__ == "__main__":
  main()
