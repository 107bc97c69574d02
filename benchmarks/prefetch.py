"""Prefetch in replay (issue 52, item 2): misses with and without prefetch per predictor and
cache size, the share of prefetches used, and the modeled decode speed with the copies
charged.

Traces:

* ``default`` / ``default-hybrid``: the embedded trained models (real routing), teacher-forced
  over ``--tokens`` tokens of held-out standard-library source (``router_ahead.py``'s
  recording), each with the predictions of the real router-ahead predictor:
  ``ahead_1`` (layer l's router on the residual entering layer l - 1: a whole layer of lead)
  and ``ahead_0`` (on the residual entering layer l: one sublayer of lead). Layer 0's
  ahead_1 has no earlier layer: none.
* ``synthetic-*``: ``ftjax.research.synthetic``'s Qwen3-30B-A3B, Mixtral-8x7B and fine-grained
  (61 x 256) generators, ``--synthetic_steps`` decode steps; their ids carry no hidden state,
  so router-ahead is modelled (``synthetic.with_predictions``) at the recall measured above
  (``--recall``, default 0.71: a whole layer of lead). Their layers are independent by
  construction, so the cooccurrence predictor has nothing cross-layer to learn there.

Prefetch configurations per policy: none; ``cooccurrence@K`` (online, ids only);
``trace@K`` (the recorded / modelled router-ahead), K = the model's top_k, the step's own
fills first (``ftjax.research.replay.Prefetch``). The synthetic traces also run
``trace`` with the ``link`` budget: only the copies that fit in the link's idle time of each
layer-step under the cost model (``ftjax.research.cost.prefetch_room``), with the modeled
tok/s charging every prefetch (link time and host-memory contention), under the RTX 5090
server and H200 host profiles, with bf16 experts (the shapes' own) and again with MXFP4
experts (a quarter of the bytes: ``... (mxfp4 experts)`` rows, link budget only).

Goals (issue 52): prefetch cuts misses at 37% of the experts by >= 25% against the same
policy without it; the best online policy beats class-LRU by >= 10% fewer misses on every
trace.

  /work/venv/bin/python benchmarks/prefetch.py        # ~20 min on 2 cores

Writes ``results/prefetch.json`` and ``results/prefetch.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, pyplot, write_results  # noqa: E402
from router_ahead import _router_ids, heldout_tokens, record  # noqa: E402

import ftjax  # noqa: E402
from ftjax.research import synthetic  # noqa: E402
from ftjax.research.cost import HardwareProfile, ModelShape  # noqa: E402
from ftjax.research.replay import Prefetch, replay  # noqa: E402
from ftjax.research.sweep import sweep, trace_shape  # noqa: E402
from ftjax.research.traces import Trace  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICIES = ("lru_fill", "class_lru_fill", "freetoken_cycle", "class_cycle_fill")
FRACTIONS = (0.1, 0.37, 0.6)
HARDWARE = ("rtx5090-server", "h200-host")
AT = 0.37


def embedded_traces(name: str, tokens: int) -> dict[str, Trace]:
  """The model's teacher-forced routing over held-out text, once with ahead_1's predictions
  and once with ahead_0's: {f"{name}-ahead_1": ..., f"{name}-ahead_0": ...}."""
  model = ftjax.load(name)
  seq = heldout_tokens(model, tokens)
  net, inputs, chosen = record(model, seq)
  ids = np.asarray(chosen).transpose(1, 0, 2)  # [T, L, K]
  layers = model.config.num_layers
  out = {}
  for pred, lead in (("ahead_1", 1), ("ahead_0", 0)):
    predicted = np.full_like(ids, -1)
    for layer in range(lead, layers):
      target = net.layers[layer]
      x = inputs[layer - lead]
      predicted[:, layer] = np.asarray(_router_ids(target.moe, target.mlp_norm(x)))
    meta = {"source": f"benchmarks/prefetch.py: {name} teacher-forced on held-out text",
            "model_config": model.config.to_dict(), "predictor": pred}
    out[f"{name}-{pred}"] = Trace.from_arrays(ids, np.full(ids.shape, 1.0 / ids.shape[2]),
                                              model.config.num_experts, metadata=meta,
                                              predicted=predicted)
  return out


def recall(trace: Trace) -> float:
  """Mean share of each layer-step's true experts the trace's predictions name (layer-steps
  with predictions only)."""
  has = (trace.predicted >= 0).any(-1)
  named = (trace.predicted[:, :, :, None] == trace.ids[:, :, None, :]).any(-1).mean(-1)
  return float(named[has].mean())


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--tokens", type=int, default=2048, help="held-out tokens per embedded model")
  p.add_argument("--synthetic_steps", type=int, default=400)
  p.add_argument("--recall", type=float, default=0.71,
                 help="the modelled router-ahead's recall on the synthetic traces")
  p.add_argument("--out", default=None)
  args = p.parse_args()
  start = time.time()
  traces: dict[str, Trace] = {}
  shapes: dict[str, ModelShape] = {}
  for name in ("default", "default-hybrid"):
    for key, trace in embedded_traces(name, args.tokens).items():
      traces[key] = trace
      shapes[key] = ModelShape.from_config(ftjax.load(name).config, name=name)
  for name, maker in (("qwen3-30b-a3b", synthetic.qwen3_30b_a3b),
                      ("mixtral-8x7b", synthetic.mixtral_8x7b),
                      ("fine-grained-61x256", synthetic.fine_grained)):
    trace = synthetic.generate(maker(), args.synthetic_steps, seed=0)
    trace.metadata["model_shape"] = name
    key = f"synthetic-{name}"
    traces[key] = synthetic.with_predictions(trace, args.recall, seed=0)
    shapes[key] = trace_shape(traces[key], None, (os.path.join(REPO, "configs", "models"),))
  hardware = [HardwareProfile.load(os.path.join(REPO, "configs", "hardware", f"{h}.yaml"))
              for h in HARDWARE]
  rows = []
  for key, trace in traces.items():
    k = trace.top_k
    prefetch = [Prefetch("cooccurrence", k), Prefetch("trace", k)]
    if key.startswith("synthetic-"):
      prefetch.append(Prefetch("trace", "link"))
    print(f"{key}: {trace.num_steps} steps x {trace.num_layers} layers x top-{k} of "
          f"{trace.num_experts}; prediction recall {recall(trace):.3f}", flush=True)
    rows += sweep({key: trace}, POLICIES, FRACTIONS, hardware, {key: shapes[key]},
                  prefetch=prefetch, progress=True)
    if key.startswith("synthetic-"):
      quarter = f"{key} (mxfp4 experts)"
      shapes[quarter] = dataclasses.replace(shapes[key], expert_format="mxfp4")
      rows += sweep({quarter: trace}, POLICIES, (AT,), hardware, {quarter: shapes[quarter]},
                    prefetch=[Prefetch("trace", "link")], belady=False, progress=True)
  elapsed = time.time() - start

  def miss(trace, policy, fraction, hw=HARDWARE[0]):
    for r in rows:
      if (r.trace, r.policy, r.cache_fraction) == (trace, policy, fraction) and (
          r.hardware in (hw, "")):
        return r
    return None

  summary = {}
  for key, trace in traces.items():
    k = trace.top_k
    entry = {"recall": recall(trace), "at": AT, "policies": {}}
    for policy in POLICIES:
      base = miss(key, policy, AT)
      per = {"none": base.miss_rate}
      for pf in (f"cooccurrence@{k}", f"trace@{k}"):
        r = miss(key, f"{policy}+{pf}", AT)
        per[pf] = r.miss_rate
        per[f"{pf} drop"] = 1.0 - r.miss_rate / base.miss_rate if base.miss_rate else 0.0
        per[f"{pf} used"] = r.prefetch_use_share
      entry["policies"][policy] = per
    belady = miss(key, "belady", AT)
    entry["belady"] = belady.miss_rate if belady else None
    class_lru = entry["policies"]["class_lru_fill"]["none"]
    best = min(entry["policies"][p][f"trace@{k}"] for p in POLICIES)
    entry["best_with_prediction"] = best
    entry["best_vs_class_lru_without_prefetch"] = 1.0 - best / class_lru
    if key.startswith("synthetic-"):
      # Modeled tok/s at 37% with every prefetch charged: none, the int budget (top_k a
      # layer-step), the link's idle time; and with MXFP4 experts, none and the link budget.
      quarter = f"{key} (mxfp4 experts)"
      entry["tok_s"] = {hw: {p: {
          "none": miss(key, p, AT, hw).modeled_tok_s,
          f"trace@{k}": miss(key, f"{p}+trace@{k}", AT, hw).modeled_tok_s,
          "trace (link)": miss(key, f"{p}+trace", AT, hw).modeled_tok_s,
          "mxfp4 none": miss(quarter, p, AT, hw).modeled_tok_s,
          "mxfp4 trace (link)": miss(quarter, f"{p}+trace", AT, hw).modeled_tok_s,
          "mxfp4 link prefetches per step": miss(quarter, f"{p}+trace", AT,
                                                 hw).prefetches_per_step,
          "mxfp4 link miss rate": miss(quarter, f"{p}+trace", AT, hw).miss_rate,
      } for p in POLICIES} for hw in HARDWARE}
    # Each predictor's recall per layer (the share of a layer-step's experts it named before
    # the step), from one replay at 37% (the predictors do not depend on the cache).
    slots = int(round(AT * trace.num_layers * trace.num_experts))
    entry["recall_per_layer"] = {
        name: replay(trace, "class_lru_fill", slots, prefetch=Prefetch(name, k)).recall(
            trace).tolist() for name in ("trace", "cooccurrence", "last_token")}
    summary[key] = entry
    drops = {p: entry["policies"][p][f"trace@{k}"] for p in POLICIES}
    print(f"  {key}: recall (mean over layers) " + ", ".join(
        f"{n} {np.mean(v):.3f}" for n, v in entry["recall_per_layer"].items()))
    print(f"  {key} at {AT:.0%}: " + ", ".join(
        f"{p} {entry['policies'][p]['none']:.3f}->{drops[p]:.3f}" for p in POLICIES) +
        f"; Belady {entry['belady']:.3f}")
  results = {"benchmark": "prefetch", "command": " ".join(sys.argv), "machine": machine_info(),
             "seconds": elapsed, "policies": POLICIES, "fractions": FRACTIONS,
             "hardware": HARDWARE, "recall_modelled": args.recall, "summary": summary,
             "rows": [dict(r.__dict__, per_layer_miss_rate=None) for r in rows]}
  path = write_results("prefetch", results, args.out)
  plt = pyplot()
  if plt is not None:
    names = list(traces)
    cols = 4
    fig, axes = plt.subplots(-(-len(names) // cols), cols, figsize=(4.2 * cols, 3.4 * 2),
                             squeeze=False)
    for ax, key in zip(axes.flat, names):
      k = traces[key].top_k
      for policy, color in zip(("lru_fill", "class_lru_fill", "class_cycle_fill"),
                               ("C0", "C1", "C2")):
        for cfg, style in (("", "-"), (f"+cooccurrence@{k}", ":"), (f"+trace@{k}", "--")):
          pts = [(f, miss(key, policy + cfg, f).miss_rate) for f in FRACTIONS]
          ax.plot([100 * f for f, _ in pts], [m for _, m in pts], style, color=color,
                  marker="o", ms=3, label=f"{policy}{cfg}")
      pts = [(f, miss(key, "belady", f).miss_rate) for f in FRACTIONS]
      ax.plot([100 * f for f, _ in pts], [m for _, m in pts], color="black", ls="-.",
              label="belady")
      ax.set_title(f"{key} (recall {recall(traces[key]):.2f})", fontsize=8)
      ax.set_xlabel("cache (% of experts)", fontsize=8)
      ax.set_ylabel("miss rate", fontsize=8)
      ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names):]:
      ax.axis("off")
    axes.flat[0].legend(fontsize=5)
    fig.suptitle("Misses with and without prefetch (solid: none, dotted: cooccurrence, "
                 "dashed: router-ahead)", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.path.splitext(path)[0] + ".png", dpi=110)
  print(f"{elapsed:.0f} s; results: {path}")


if __name__ == "__main__":
  main()
