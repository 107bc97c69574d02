"""Continuous batching: aggregate decode tok/s of N sequences in one batch, against the bound
that the bytes allow (issue 33).

Two 4-layer bench models with random bfloat16 weights, written once as FTW into
``--model_dir`` (never committed):

- ``qwen3``: Qwen3-30B-A3B's layer shapes (``decode_e2e.qwen3_30b_shape``: 128 experts, top-8,
  vocab 151936; 1.08 GB read per token, 0.77 GB of it the lm_head and attention);
- ``hybrid``: Qwen3.5-35B-A3B's (``hybrid_e2e.hf_config``: three Gated-DeltaNet layers and one
  gated full-attention layer, 256 experts, top-8, a shared expert, vocab 248320).

For N in 1, 2, 4 and 8, N sequences with different prompts (8 to 8 + 5·N random tokens, so
that they sit at different positions) read their prompts, join a batch of N rows
(``Executor.join``) and decode ``--tokens`` greedy tokens each in one loop
(``Executor.run``: one program step for all rows). Aggregate tok/s = the tokens the loop
decoded / its seconds (the first tokens, sampled at join, are left out). Each round runs the
four sizes, in alternating order from round to round; medians over ``--rounds``, after one
discarded round that compiles.

Bytes: a step of N rows reads the dense weights once (every dense tensor but the embedding
table, plus one embedding row per row) and each distinct routed expert of each layer once
(the host kernel finds the distinct experts of its tokens and reads each once:
``xla_ffi/expert_ffn.cc``). The distinct experts are counted from the router's output in a
counting run of the same sequences (``record_routing=True``, a separate engine, not timed).
The bound on the speedup over one sequence is N · (bytes one token reads) / (bytes a step of
N reads); the measured speedup is aggregate tok/s (N) / tok/s (1), and its ratio to the bound
is how much of what the bytes allow the batch gets. Attention's KV reads are left out of the
bytes (a few hundred rows of context here).

A batch also multiplies each weight it reads with N rows: 2 FLOPs per weight per row for the
dense weights, 2 · 3 · F · D per route. Where the host's multiply-add peak (``peak_probe``:
float32 FMA, or vdpbf16ps on AVX-512-BF16) is low against its read bandwidth
(``read_probe``), both measured in the same round, a step of N rows is compute-bound before it
is bandwidth-bound. The roofline bound is N · t(1) / t(N) with t(N) = max(bytes / read
bandwidth, FLOPs / peak), the ceiling that this machine's cores allow; the results give both.

Goals (the issue): speedup >= 0.9 of the bound at every N; on the hybrid model, 4 sequences
>= 2.5x one.

  /work/venv/bin/python benchmarks/batch_decode.py            # both models, ~15 min first
  /work/venv/bin/python benchmarks/batch_decode.py --models qwen3 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, pyplot, write_results  # noqa: E402

SIZES = (1, 2, 4, 8)
GOAL_OF_BOUND = 0.9
GOAL_HYBRID_4 = 2.5


def log(msg: str) -> None:
  print(f"[batch_decode] {msg}", file=sys.stderr, flush=True)


def bench_config(kind: str, layers: int):
  from ftjax.model.config import ModelConfig  # noqa: PLC0415
  if kind == "qwen3":
    from decode_e2e import qwen3_30b_shape  # noqa: PLC0415
    return qwen3_30b_shape(layers)
  from hybrid_e2e import hf_config  # noqa: PLC0415
  return ModelConfig.from_hf_config(hf_config(layers))


def load(kind: str, layers: int, model_dir: str):
  """The bench model, written into ``model_dir/KIND-Ll`` first if missing or stale, loaded
  pre-faulted."""
  return load_or_write(bench_config(kind, layers), os.path.join(model_dir, f"{kind}-{layers}l"),
                       log)


def load_or_write(config, path: str, log):
  """The random bfloat16 model of ``config`` at ``path`` (``decode_e2e.write_model``), written
  first if missing or its config differs; loaded pre-faulted. ``log`` hears what it does."""
  import ftjax  # noqa: PLC0415
  from decode_e2e import write_model  # noqa: PLC0415
  from ftjax.formats import ftw  # noqa: PLC0415
  if not (ftw.is_ftw_dir(path) and ftw.FTWFile.open(path, verify=False).config == config):
    shutil.rmtree(path, ignore_errors=True)
    log(f"writing the random model into {path}")
    write_model(config, path)
  t0 = time.perf_counter()
  model = ftjax.load(path, verify=False, populate=True)
  log(f"loaded and pre-faulted {path} in {time.perf_counter() - t0:.1f} s")
  return model


def dense_bytes(model) -> int:
  """Bytes of the weights every step reads once: every dense tensor but the embedding table."""
  tensors = model.storage.index["tensors"]
  return sum(t["nbytes"] for n, t in tensors.items() if not n.startswith("embed"))


class Runner:
  """One model, its timing engine and its counting engine."""

  def __init__(self, kind: str, args):
    import numpy as np  # noqa: PLC0415

    import ftjax  # noqa: PLC0415
    self.kind, self.args = kind, args
    self.model = load(kind, args.layers, args.model_dir)
    c = self.model.config
    options = dict(kernels=args.kernels, max_seq_len=1024)
    self.engine = ftjax.Engine(self.model, **options)
    self.counter = ftjax.Engine(self.model, record_routing=True, **options)
    rng = np.random.default_rng(0)
    self.prompts = [rng.integers(0, c.vocab_size, 8 + 5 * i).tolist() for i in range(max(SIZES))]
    self.expert_bytes = c.expert_block_elems * self.model.dtype.itemsize
    self.dense = dense_bytes(self.model)
    self.row = c.hidden_size * self.model.dtype.itemsize  # one embedding row per token
    self.one_token = self.dense + self.row + c.num_moe_layers * c.top_k * self.expert_bytes
    # FLOPs per row of a step: every dense weight once, each route's gate, up and down.
    dense_params = self.dense // self.model.dtype.itemsize
    self.flops_per_row = 2 * dense_params + c.num_moe_layers * c.top_k * (
        6 * c.moe_intermediate_size * c.hidden_size)
    self.probe = self.model.bank[0]  # one layer's experts, far larger than the caches

  def decode(self, engine, n: int) -> tuple[float, int, list[list[int]]]:
    """N sequences decoded in one batch: (seconds of the loop, tokens it decoded, tokens)."""
    from ftjax.runtime.executor import Generation  # noqa: PLC0415
    from ftjax.runtime.sampling import Sampling  # noqa: PLC0415
    ex = engine.executor
    batch = ex.batch(n)
    seqs = []
    for ids in self.prompts[:n]:
      state = engine.new_state(1, len(ids) + self.args.tokens + 1)
      read = ex.extend(state, ids, start=0)
      seq = Generation(state=read.state, logits=read.logits, max_new=self.args.tokens,
                       sampling=Sampling.make(greedy=True))
      ex.join(batch, seq)
      seqs.append(seq)
    t0 = time.perf_counter()
    ex.run(batch)
    seconds = time.perf_counter() - t0
    return seconds, sum(len(s.tokens) - 1 for s in seqs), [s.tokens for s in seqs]

  def step_bytes(self, n: int) -> dict:
    """The bytes a step of N rows reads, from the router's output of a counting run."""
    import numpy as np  # noqa: PLC0415
    self.counter.clear_history()
    _, _, tokens = self.decode(self.counter, n)
    distinct = []  # per decode step: distinct experts summed over the layers
    for ids, _, phase in self.counter.executor.routing:
      if phase == "decode" and ids.shape[1] == n:  # steps where every row stepped
        distinct.append(sum(len(np.unique(layer[layer >= 0])) for layer in ids))
    experts = float(np.mean(distinct))
    step = self.dense + n * self.row + experts * self.expert_bytes
    return {"distinct_experts_per_step": experts, "bytes_per_step": step,
            "bound": n * self.one_token / step, "steps_counted": len(distinct),
            "tokens": tokens}

  def ceilings(self) -> tuple[float, float]:
    """(read bandwidth in bytes/s, multiply-add peak in FLOP/s) of this round."""
    import jax  # noqa: PLC0415

    from decode_e2e import read_bandwidth  # noqa: PLC0415
    from ftjax import kernels  # noqa: PLC0415
    bw = read_bandwidth(self.probe)
    tasks, iterations = 4 * kernels.cpu_info()["threads"], 2_000_000
    kernels.peak_probe(tasks=tasks, iterations=iterations).block_until_ready()
    best = 0.0
    for _ in range(3):
      t0 = time.perf_counter()
      out = jax.device_get(kernels.peak_probe(tasks=tasks, iterations=iterations))
      best = max(best, float(out[1]) / (time.perf_counter() - t0))
    return bw, best

  def run(self) -> dict:
    c = self.model.config
    log(f"{self.kind}: counting the distinct experts per step")
    bytes_ = {n: self.step_bytes(n) for n in SIZES}
    log(f"{self.kind}: warm-up round (compiles)")
    for n in SIZES:
      _, _, tokens = self.decode(self.engine, n)
      if tokens != bytes_[n]["tokens"]:
        raise RuntimeError(f"{self.kind}: N={n}: the counting engine decoded other tokens")
    rounds, ceilings = [], []
    for r in range(self.args.rounds):
      row = {}
      for n in (SIZES if r % 2 == 0 else SIZES[::-1]):
        seconds, decoded, _ = self.decode(self.engine, n)
        row[n] = decoded / seconds
      ceilings.append(self.ceilings())
      log(f"{self.kind}: round {r + 1}: " + ", ".join(f"N={n} {row[n]:.1f}" for n in SIZES)
          + f" tok/s; read {ceilings[-1][0] / 1e9:.1f} GB/s, peak "
          f"{ceilings[-1][1] / 1e9:.0f} GFLOP/s")
      rounds.append(row)
    bw = statistics.median(b for b, _ in ceilings)
    peak = statistics.median(p for _, p in ceilings)

    def roofline_s(n: int) -> float:
      return max(bytes_[n]["bytes_per_step"] / bw, n * self.flops_per_row / peak)
    # Every sequence decodes the same tokens alone and in a batch (greedy), with the timed
    # kernels and, where those round activations to bf16, with the exact ones: the bf16
    # rounding turns the last-bit differences between a one-row and an N-row kernel's sums
    # into other tokens of a random model, where the exact kernels' sums stay within them.
    exact = self.batched_equals_alone(self.engine, {n: bytes_[n]["tokens"] for n in SIZES})
    exact_kernels = exact
    if self.engine.kernels != "ffi":
      import ftjax  # noqa: PLC0415
      log(f"{self.kind}: batched against alone with the exact kernels (ffi)")
      exact_kernels = self.batched_equals_alone(
          ftjax.Engine(self.model, kernels="ffi", max_seq_len=1024), None)
    one = statistics.median(r[1] for r in rounds)
    sizes = {}
    for n in SIZES:
      agg = statistics.median(r[n] for r in rounds)
      b = {k: v for k, v in bytes_[n].items() if k != "tokens"}
      speedup = agg / one
      roofline = n * roofline_s(1) / roofline_s(n)
      sizes[str(n)] = dict(b, aggregate_tok_s=agg, per_sequence_tok_s=agg / n,
                           speedup=speedup, of_bound=speedup / b["bound"],
                           flops_per_step=n * self.flops_per_row,
                           roofline_step_s=roofline_s(n), roofline_bound=roofline,
                           of_roofline_bound=speedup / roofline,
                           tok_s_of_roofline=agg * roofline_s(n) / n,
                           rounds=[r[n] for r in rounds])
    return {"model": self.kind, "layers": c.num_layers, "experts": c.num_experts,
            "top_k": c.top_k, "bytes_per_token": self.one_token, "dense_bytes": self.dense,
            "expert_bytes": self.expert_bytes, "kernels": self.engine.kernels,
            "kernels_path": self.engine.kernels_path, "tokens_per_sequence": self.args.tokens,
            "read_gb_s": bw / 1e9, "peak_gflop_s": peak / 1e9,
            "flops_per_row": self.flops_per_row,
            "batched_equals_alone": exact, "batched_equals_alone_ffi": exact_kernels,
            "sizes": sizes}

  def batched_equals_alone(self, engine, batched: dict | None) -> bool:
    """Whether each sequence's greedy tokens in batches of every size (``batched``: N ->
    tokens, decoded here where None) equal the sequence decoded alone."""
    alone = [engine.generate(ids, self.args.tokens) for ids in self.prompts]
    if batched is None:
      batched = {n: self.decode(engine, n)[2] for n in SIZES}
    return all(batched[n][i] == alone[i] for n in SIZES for i in range(n))


def worker_main(args) -> None:
  out = Runner(args.worker, args).run()
  print(json.dumps(out), flush=True)


def plot(results: dict, path: str) -> str | None:
  plt = pyplot()
  if plt is None:
    return None
  fig, axes = plt.subplots(1, len(results["models"]), figsize=(5 * len(results["models"]), 4))
  axes = axes if len(results["models"]) > 1 else [axes]
  for ax, m in zip(axes, results["models"]):
    ns = [int(n) for n in m["sizes"]]
    ax.plot(ns, [m["sizes"][str(n)]["speedup"] for n in ns], "o-", label="measured")
    ax.plot(ns, [m["sizes"][str(n)]["bound"] for n in ns], "k--", label="bytes bound")
    ax.plot(ns, [m["sizes"][str(n)]["roofline_bound"] for n in ns], "k:",
            label="roofline bound (bytes and FLOPs)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("sequences in the batch")
    ax.set_ylabel("aggregate tok/s / one sequence's")
    ax.set_title(f"{m['model']} ({m['experts']} experts, top-{m['top_k']})")
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  return path


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--models", default="qwen3,hybrid")
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--tokens", type=int, default=48, help="decoded tokens per sequence")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--kernels", default="auto")
  p.add_argument("--model_dir", default="/tmp/ftjax-batch-bench")
  p.add_argument("--out", default=None)
  p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  args = p.parse_args()
  if args.worker:
    worker_main(args)
    return
  os.makedirs(args.model_dir, exist_ok=True)
  models = []
  for kind in args.models.split(","):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--layers",
           str(args.layers), "--tokens", str(args.tokens), "--rounds", str(args.rounds),
           "--kernels", args.kernels, "--model_dir", args.model_dir]
    # A process per model: each model's memory goes with it; run from outside the checkout
    # so that the installed package (with its compiled kernels) is imported.
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd="/tmp", check=True)
    models.append(json.loads(proc.stdout.strip().splitlines()[-1]))
  results = {"benchmark": "batch_decode", "machine": machine_info(), "models": models,
             "goals": {"of_bound_at_every_n": GOAL_OF_BOUND, "hybrid_4_speedup": GOAL_HYBRID_4}}
  print(f"\n{'model':8} {'N':>2} {'tok/s':>7} {'per seq':>8} {'speedup':>8} {'bound':>6} "
        f"{'of bound':>8} {'roofline':>8} {'of it':>6} {'experts/step':>12} {'GB/step':>8}")
  for m in models:
    for n, s in m["sizes"].items():
      print(f"{m['model']:8} {n:>2} {s['aggregate_tok_s']:7.2f} {s['per_sequence_tok_s']:8.2f} "
            f"{s['speedup']:8.2f} {s['bound']:6.2f} {s['of_bound']:8.2f} "
            f"{s['roofline_bound']:8.2f} {s['of_roofline_bound']:6.2f} "
            f"{s['distinct_experts_per_step']:12.1f} {s['bytes_per_step'] / 1e9:8.3f}")
    print(f"{m['model']}: read {m['read_gb_s']:.1f} GB/s, multiply-add peak "
          f"{m['peak_gflop_s']:.0f} GFLOP/s ({m['kernels_path']})")
    print(f"{m['model']}: batched greedy tokens equal each sequence alone: "
          f"{m['batched_equals_alone']} ({m['kernels']}), "
          f"{m['batched_equals_alone_ffi']} (ffi, exact)")
  met = {"of_bound": all(s["of_bound"] >= GOAL_OF_BOUND for m in models
                         for s in m["sizes"].values())}
  hybrid = [m for m in models if m["model"] == "hybrid"]
  if hybrid:
    met["hybrid_4"] = hybrid[0]["sizes"]["4"]["speedup"] >= GOAL_HYBRID_4
  results["met"] = met
  print(f"goals met: {met}")
  path = write_results("batch_decode", results, args.out)
  png = plot(results, os.path.splitext(path)[0] + ".png")
  print(f"wrote {path}" + (f" and {png}" if png else ""))


if __name__ == "__main__":
  main()
