"""Decode throughput per cache policy and cache size on the CPU backend.

The 4-layer Qwen3-30B-A3B-shaped model of ``decode_e2e.py`` (random bfloat16 weights,
generated once into ``--model_dir``), decoded with ``kernels=ffi`` for each policy in
``ftjax.cache.POLICIES`` at cache fractions 0, 0.1, 0.37 and 1.0 of all L·E experts.
Reported per run: decode tok/s, miss rate, and bytes per path per token (filled into slots,
run on the host, read from slots). Bandwidths for the q* rule come from
``ftjax.runtime.profile.measure`` on the model's own bank, in the same run.

On a machine without an accelerator the "device" cache is host memory: a fill is a memcpy
and a slot is computed by the same host kernel as the pool, so caching cannot beat
``cache_slots=0``; this benchmark measures the cost of the cache machinery and checks that
the policies behave as designed (fills, miss rates) on real shapes. Random routers have no
temporal locality, so LRU hit rates here are close to the cache fraction.

  /work/venv/bin/python benchmarks/cache_policies.py        # ~10 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_results  # noqa: E402
from decode_e2e import qwen3_30b_shape, write_model  # noqa: E402

import ftjax  # noqa: E402
from ftjax.cache import POLICIES  # noqa: E402
from ftjax.formats import ftw  # noqa: E402
from ftjax.runtime import profile as profile_lib  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--model_dir", default="/tmp/ftjax-bench/qwen3-30b-a3b-shape")
  parser.add_argument("--fractions", default="0,0.1,0.37,1.0")
  parser.add_argument("--policies", default=",".join(POLICIES))
  parser.add_argument("--tokens", type=int, default=24)
  args = parser.parse_args()

  config = qwen3_30b_shape(args.layers)
  path = os.path.join(args.model_dir, f"{args.layers}l")
  if not (ftw.is_ftw_dir(path) and ftw.FTWFile.open(path, verify=False).config == config):
    write_model(config, path)
  model = ftjax.load(path, verify=False, populate=True)
  c = model.config
  shape = profile_lib.ExpertShape(c.hidden_size, c.moe_intermediate_size, str(model.dtype),
                                  c.top_k)
  prof = profile_lib.measure(model.bank, shape, rounds=3, calls=16)
  conc = prof["concurrent"]
  bandwidths = (conc["b_p_gb_s"], conc["b_p_gb_s"] + conc["b_h_gb_s"])
  print(f"bandwidths (concurrent profile): B_P {bandwidths[0]:.1f}, B_H {bandwidths[1]:.1f} GB/s; "
        f"read ceiling {prof['read_gb_s']:.1f} GB/s")

  rng = np.random.default_rng(0)
  prompt = rng.integers(0, c.vocab_size, 16).tolist()
  warm = ftjax.Engine(model, kernels="ffi", cache_fraction=0.1, policy="lru_fill")
  warm.generate(rng.integers(0, c.vocab_size, 16).tolist(), args.tokens)
  hot = warm.routing_counts()  # the routing profile static_hot pins from
  del warm

  expert_bytes = c.expert_block_elems * model.dtype.itemsize
  runs = []
  for fraction in (float(f) for f in args.fractions.split(",")):
    for policy in args.policies.split(","):
      engine = ftjax.Engine(model, kernels="ffi", cache_fraction=fraction, policy=policy,
                            bandwidths=bandwidths, hot_experts=hot)
      engine.generate(prompt[:4], 2)  # compile
      steps_before = len(engine.stats()["per_step"])
      t0 = time.perf_counter()
      result = engine.generate_timed(prompt, args.tokens + 1, greedy=True)
      wall = time.perf_counter() - t0
      st = engine.stats()
      decode_steps = st["per_step"][steps_before + 1:]  # skip this request's prefill
      hits = sum(int(s["hits"].sum()) for s in decode_steps)
      fills = sum(int(s["fills"].sum()) for s in decode_steps)
      host = sum(int(s["host"].sum()) for s in decode_steps)
      n = max(len(decode_steps), 1)
      row = {"policy": policy, "fraction": fraction, "slots": st["slots"],
             "decode_tok_s": result.decode_tok_s, "wall_s": wall,
             "miss_rate": (fills + host) / max(hits + fills + host, 1),
             "fill_mb_per_token": fills * expert_bytes / n / 1e6,
             "host_mb_per_token": host * expert_bytes / n / 1e6,
             "slot_mb_per_token": (hits + fills) * expert_bytes / n / 1e6}
      runs.append(row)
      print(f"{policy:>13} {fraction:5.2f} ({row['slots']:4d} slots): "
            f"{row['decode_tok_s']:6.2f} tok/s, miss {row['miss_rate']:.3f}, per token: fill "
            f"{row['fill_mb_per_token']:6.1f} MB, host {row['host_mb_per_token']:6.1f} MB, "
            f"slots {row['slot_mb_per_token']:6.1f} MB")
      del engine
  out = write_results("cache_policies", {"machine": machine_info(), "profile": prof,
                                         "bandwidths_used": bandwidths, "runs": runs,
                                         "args": vars(args)})
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
