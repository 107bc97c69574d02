"""The embedded default model: held-out loss, samples, decode speed and routing statistics,
each next to a random-initialised model of the same shape (the numbers of its model card,
``ftjax/tiny/README.md``).

Routing is compared on the same natural code: the first ``--tokens`` tokens of the first
``--sequences`` held-out files of the training corpus (files the model never trained on), run
through the trained model, its random initialisation, and compared with routing drawn
uniformly at random; ``ftjax.research.routing_stats`` over all of them (sequences concatenated, one
step per token).

  /work/venv/bin/python benchmarks/default_model.py      # ~2 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_results  # noqa: E402

import ftjax  # noqa: E402
from ftjax.research import routing_stats  # noqa: E402
from ftjax.runtime import model as model_lib  # noqa: E402
from ftjax.runtime.tokenizer import load_tokenizer  # noqa: E402
from ftjax.assets import DEFAULT_MODEL_DIR
from ftjax.tiny import train  # noqa: E402
from ftjax.research.traces import Trace  # noqa: E402

SAMPLE_PROMPTS = ("def fibonacci(n):", "class Stack:\n    def __init__(self):",
                  "def read_lines(path):\n    with open(path) as f:")


def routing_of(model, sequences) -> Trace:
  engine = ftjax.Engine(model, kernels="xla", record_routing=True)
  for seq in sequences:
    engine.forward_logits(seq)
  return Trace.from_engine(engine)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tokens", type=int, default=512, help="tokens per sequence")
  parser.add_argument("--sequences", type=int, default=8, help="held-out files to route")
  parser.add_argument("--model", default=DEFAULT_MODEL_DIR, help="a model written by "
                      "ftjax.tiny.train (default: the embedded one)")
  parser.add_argument("--no_write", action="store_true", help="print only (trials)")
  args = parser.parse_args()
  model = ftjax.load(args.model)
  c = model.config
  tok = load_tokenizer(model.path, c.vocab_size)
  with open(os.path.join(args.model, "train_log.json")) as f:
    log = json.load(f)

  engine = ftjax.Engine(model)
  samples = {}
  for p in SAMPLE_PROMPTS:
    samples[p] = tok.decode(engine.generate(tok.encode(p), 64, greedy=True))
  speed = engine.generate_timed(tok.encode(SAMPLE_PROMPTS[0]), 128, greedy=True)

  # Natural code the model never trained on: the first --tokens tokens of held-out files.
  root = train.stdlib_root()
  _, held = train.corpus_files(root)
  sequences = []
  for text in train.read_texts(root, held):
    ids = tok.encode(text)
    if len(ids) >= args.tokens:
      sequences.append(ids[:args.tokens])
    if len(sequences) == args.sequences:
      break
  random = model_lib.random_model(c, seed=0, dtype="bfloat16")  # the trained model's init
  sizes = routing_stats.default_sizes(c.num_experts)  # 1/16, 1/8, 1/4, 1/2 of the experts
  top_n = max(1, c.num_experts // 8)  # as the top 16 of 128
  stats = {}
  for name, m in (("trained", model), ("random-init", random)):
    t0 = time.perf_counter()
    trace = routing_of(m, sequences)
    s = routing_stats.summary(trace, sizes=sizes, top_n=top_n, phase=None)
    s["seconds"] = time.perf_counter() - t0
    stats[name] = s

  # Reference: routing drawn uniformly at random for every token (no locality, no skew).
  rng = np.random.default_rng(0)
  steps = sum(map(len, sequences))
  uniform_ids = np.argsort(rng.random((steps, c.num_layers, c.num_experts)), -1)[..., :c.top_k]
  uniform = Trace.from_arrays(uniform_ids, np.full(uniform_ids.shape, 1 / c.top_k), c.num_experts)
  stats["uniform"] = routing_stats.summary(uniform, sizes=sizes, top_n=top_n, phase=None)
  print(f"held-out loss {log['heldout_loss']:.3f} nats/token = {log['heldout_bits_per_byte']:.3f}"
        f" bits/byte (unigram {log['unigram_heldout_loss']:.3f} = "
        f"{log['unigram_bits_per_byte']:.3f}); trained {log['train_seconds'] / 60:.0f} min")
  print(f"decode {speed.decode_tok_s:.0f} tok/s, prefill {speed.prefill_tok_s:.0f} tok/s\n")
  rows = _table(stats, sizes, top_n)
  for r in rows:
    print(r)
  for p, text in samples.items():
    print(f"\n--- {p!r} ->\n{p}{text}")
  if args.no_write:
    return
  path = write_results("default_model", {
      "machine": machine_info(), "model": c.to_dict(), "train_log": {
          k: v for k, v in log.items() if k != "history"}, "history": log["history"],
      "samples_greedy_64": samples,
      "decode_tok_s": speed.decode_tok_s, "prefill_tok_s": speed.prefill_tok_s,
      "routing": stats, "routing_sequences": {"source": "held-out stdlib files",
                                              "sequences": len(sequences),
                                              "tokens": args.tokens,
                                              "steps": sum(map(len, sequences))},
      "table": rows})
  print(f"wrote {path}")


def _table(stats, sizes, top_n) -> list[str]:
  """Markdown rows: per-layer values of the trained model, means of both."""
  t, r = stats["trained"], stats["random-init"]
  rows = ["| statistic (%) | trained, per layer | trained, mean | random-init, mean | "
          "uniform routing, mean |", "| --- | --- | --- | --- | --- |"]

  u = stats.get("uniform")

  def fmt(v):
    return " / ".join(f"{100 * x:.0f}" for x in v)

  def row(label, get):
    tv, rv, uv = get(t), get(r), get(u)
    rows.append(f"| {label} | {fmt(tv)} | {100 * np.mean(tv):.1f} | {100 * np.mean(rv):.1f} | "
                f"{100 * np.mean(uv):.1f} |")

  row("consecutive-token expert overlap", lambda x: x["consecutive_overlap"]["per_layer"])
  for i, n in enumerate(sizes):
    row(f"per-layer LRU hit rate, {n} of {t['num_experts']} cached",
        lambda x, i=i: x["lru_hit_rate"]["per_layer"][i])
  row(f"share of the top {top_n} experts", lambda x: x["top_share"]["per_layer"])
  return rows


if __name__ == "__main__":
  main()
