"""Router-ahead prefetch in the engine on this machine (issue 52, item 2): decode tok/s and
miss rate with ``prefetch=N`` against the same engine without it, on the embedded trained
models (real routing), in alternating rounds, medians.

On the CPU backend the expert cache is host memory like the pool: a hit and a host run read
the same memory at the same speed, and a prefetch is a copy the same cores make before the
layer runs. So prefetch can lower misses here but not time; this measures what its copies
and the router-ahead GEMV cost (the ratio with/without), which a GPU would overlap with the
attention (``benchmarks/gpu_check.py`` runs prefetch rows there).

  /work/venv/bin/python benchmarks/prefetch_engine.py [--rounds 3] [--tokens 96]

Writes ``results/prefetch_engine.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_results  # noqa: E402

import ftjax  # noqa: E402
from ftjax.runtime.tokenizer import load_tokenizer  # noqa: E402

PROMPT = "import os\n\n\ndef list_files(path):"


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--models", default="default,default-hybrid")
  p.add_argument("--policies", default="lru_fill,freetoken_cycle")
  p.add_argument("--fraction", type=float, default=0.37)
  p.add_argument("--prefetch", type=int, default=4)
  p.add_argument("--tokens", type=int, default=96)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--out", default=None)
  args = p.parse_args()
  runs = []
  for name in args.models.split(","):
    model = ftjax.load(name)
    prompt = load_tokenizer(model.path, model.config.vocab_size).encode(PROMPT)
    for policy in args.policies.split(","):
      engines = {n: ftjax.Engine(model, cache_fraction=args.fraction, policy=policy,
                                 bandwidths=(10.0, 30.0), prefetch=n)
                 for n in (0, args.prefetch)}
      for engine in engines.values():  # compile and warm the cache
        engine.generate_timed(prompt, args.tokens)
      tok_s = {n: [] for n in engines}
      stats = {}
      for r in range(args.rounds):  # alternating order
        for n in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
          engines[n].clear_history()
          tok_s[n].append(engines[n].generate_timed(prompt, args.tokens).decode_tok_s)
          st = engines[n].stats()
          stats[n] = {"miss_rate": st["miss_rate"], "prefetch": {
              k: v for k, v in st["prefetch"].items() if k != "per_layer"}}
      med = {n: statistics.median(v) for n, v in tok_s.items()}
      run = {"model": name, "policy": policy, "fraction": args.fraction,
             "kernels": engines[0].kernels, "tok_s_rounds": {str(n): v for n, v in tok_s.items()},
             "tok_s": {str(n): v for n, v in med.items()},
             "ratio_prefetch_over_none": med[args.prefetch] / med[0],
             "miss_rate": {str(n): stats[n]["miss_rate"] for n in engines},
             "prefetch": stats[args.prefetch]["prefetch"]}
      runs.append(run)
      print(f"{name} {policy} at {args.fraction:.0%} ({run['kernels']}): decode "
            f"{med[0]:.1f} -> {med[args.prefetch]:.1f} tok/s "
            f"(x{run['ratio_prefetch_over_none']:.3f}) with prefetch={args.prefetch}; misses {run['miss_rate']['0']:.3f} -> "
            f"{run['miss_rate'][str(args.prefetch)]:.3f}; prefetches used "
            f"{run['prefetch']['used_share'] or 0:.2f}", flush=True)
      for engine in engines.values():
        engine.close()
  results = {"benchmark": "prefetch_engine", "command": " ".join(sys.argv),
             "machine": machine_info(), "rounds": args.rounds, "tokens": args.tokens,
             "prefetch": args.prefetch, "runs": runs}
  print(f"results: {write_results('prefetch_engine', results, args.out)}")


if __name__ == "__main__":
  main()
