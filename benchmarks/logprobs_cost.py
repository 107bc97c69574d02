"""What asking for log-probabilities costs, on the embedded models: a prompt read with its
log-probs (``Engine.prompt_logprobs``: each prefill chunk's positions through the lm_head,
64 at a time, log-softmax, the 20 most probable) against the same prompt read for its last
logits alone (``prefill_logits``), and decoding with each token's log-probs
(``generate_timed(logprobs=True)``) against decoding without. The same engine and programs
run both sides (the log-probs are a branch the programs take when asked); rounds alternate,
medians are reported, with the ratio asked / not asked.

Run: ``python benchmarks/logprobs_cost.py`` (``--prompt``, ``--new``, ``--rounds``). Writes
``results/logprobs_cost.json`` with the machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_results  # noqa: E402

import ftjax  # noqa: E402


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--models", default="default,default-hybrid")
  p.add_argument("--prompt", type=int, default=2048)
  p.add_argument("--new", type=int, default=128)
  p.add_argument("--rounds", type=int, default=7)
  p.add_argument("--out", default=None)
  args = p.parse_args()
  report = {"machine": machine_info(), "prompt_tokens": args.prompt, "new_tokens": args.new,
            "rounds": args.rounds, "models": {}}
  for name in args.models.split(","):
    model = ftjax.load(name)
    engine = ftjax.Engine(model)
    ids = np.random.default_rng(0).integers(10, model.config.vocab_size - 20,
                                            args.prompt).tolist()
    engine.prefill_logits(ids)  # compiles, both branches
    engine.prompt_logprobs(ids)
    engine.generate_timed(ids[:64], args.new)
    engine.generate_timed(ids[:64], args.new, logprobs=True)
    times = {"prefill": [], "prefill_logprobs": [], "decode": [], "decode_logprobs": []}
    for _ in range(args.rounds):
      t0 = time.perf_counter()
      engine.prefill_logits(ids)
      times["prefill"].append(time.perf_counter() - t0)
      t0 = time.perf_counter()
      engine.prompt_logprobs(ids)
      times["prefill_logprobs"].append(time.perf_counter() - t0)
      for key, lp in (("decode", False), ("decode_logprobs", True)):
        r = engine.generate_timed(ids[:64], args.new, logprobs=lp)
        times[key].append(r.decode_s / max(len(r.tokens) - 1, 1))
    med = {k: float(np.median(v)) for k, v in times.items()}
    entry = {"kernels": engine.kernels, "vocab": model.config.vocab_size,
             "prefill_tok_s": args.prompt / med["prefill"],
             "prefill_logprobs_tok_s": args.prompt / med["prefill_logprobs"],
             "prefill_ratio": med["prefill_logprobs"] / med["prefill"],
             "decode_tok_s": 1 / med["decode"],
             "decode_logprobs_tok_s": 1 / med["decode_logprobs"],
             "decode_ratio": med["decode_logprobs"] / med["decode"], "seconds": times}
    report["models"][name] = entry
    print(f"{name} ({engine.kernels}, vocabulary {model.config.vocab_size}): prefill "
          f"{entry['prefill_tok_s']:.0f} tok/s, with log-probs {entry['prefill_logprobs_tok_s']:.0f}"
          f" (x{entry['prefill_ratio']:.2f} the time); decode {entry['decode_tok_s']:.0f} tok/s, "
          f"with log-probs {entry['decode_logprobs_tok_s']:.0f} (x{entry['decode_ratio']:.2f})",
          flush=True)
  print(f"wrote {write_results('logprobs_cost', report, args.out)}")


if __name__ == "__main__":
  main()
