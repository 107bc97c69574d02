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


def online_estimate(step_log, expert_bytes: int, profiled) -> dict | None:
  """Fits step time = a + fill_bytes / B_P + host_bytes / B_H + slot_bytes · s over the logged
  decode steps (least squares; hits cost time too), and compares the q* decisions that the
  fitted pair and the profile make."""
  from ftjax.cache import fill_count  # noqa: PLC0415
  rows = np.array(step_log, np.float64)
  if len(rows) < 8 or rows[:, 0].std() == 0 or rows[:, 1].std() == 0:
    return None
  design = np.stack([np.ones(len(rows)), rows[:, 0] * expert_bytes, rows[:, 1] * expert_bytes,
                     rows[:, 2] * expert_bytes], 1)
  (a, per_fill_byte, per_host_byte, _), *_ = np.linalg.lstsq(design, rows[:, 3], rcond=None)
  if per_fill_byte <= 0 or per_host_byte <= 0:
    return {"fit": [a, per_fill_byte, per_host_byte], "usable": False}
  est = (1 / per_fill_byte / 1e9, 1 / per_host_byte / 1e9)
  differs = sum(int(fill_count(m, *est)) != int(fill_count(m, *profiled)) for m in range(1, 17))
  return {"bandwidths": est, "fixed_s": a, "usable": True, "q_differs_for_m": differs,
          "steps": len(rows)}


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
  shape = profile_lib.ExpertShape(c.hidden_size, c.moe_intermediate_size, model.expert_format,
                                  c.top_k)
  prof = profile_lib.measure(model.bank, shape, rounds=3, calls=16)
  profile_path = profile_lib.save_profile(prof, os.path.join(args.model_dir, "profile.json"))
  bandwidths = tuple(ftjax.Engine(model, cache_slots=0, profile=profile_path).bandwidths.tolist())
  print(f"bandwidths (concurrent profile): B_P {bandwidths[0]:.1f}, B_H {bandwidths[1]:.1f} GB/s; "
        f"read ceiling {prof['read_gb_s']:.1f} GB/s")

  rng = np.random.default_rng(0)
  prompt = rng.integers(0, c.vocab_size, 16).tolist()
  warm = ftjax.Engine(model, kernels="ffi", cache_fraction=0.1, policy="lru_fill")
  warm.generate(rng.integers(0, c.vocab_size, 16).tolist(), args.tokens)
  hot = warm.routing_counts()  # the routing profile static_hot pins from
  del warm

  expert_bytes = c.expert_block_elems * model.dtype.itemsize
  runs, step_log = [], []
  for fraction in (float(f) for f in args.fractions.split(",")):
    for policy in args.policies.split(","):
      engine = ftjax.Engine(model, kernels="ffi", cache_fraction=fraction, policy=policy,
                            profile=profile_path, hot_experts=hot)
      engine.generate(prompt[:4], 2)  # compile
      steps_before = len(engine.stats()["per_step"])
      t0 = time.perf_counter()
      result = engine.generate_timed(prompt, args.tokens + 1, greedy=True)
      wall = time.perf_counter() - t0
      st = engine.stats()
      decode_steps = st["per_step"][steps_before + 1:]  # skip this request's prefill
      step_log.extend((int(s["fills"].sum()), int(s["host"].sum()), int(s["hits"].sum()),
                       s["seconds"]) for s in decode_steps)
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
  online = online_estimate(step_log, expert_bytes, bandwidths)
  if online is not None:
    est = online["bandwidths"]
    engine = ftjax.Engine(model, kernels="ffi", cache_fraction=0.37, policy="freetoken",
                          bandwidths=est)
    engine.generate(prompt[:4], 2)
    online["freetoken_0.37_tok_s_with_estimate"] = engine.generate_timed(
        prompt, args.tokens + 1, greedy=True).decode_tok_s
    online["freetoken_0.37_tok_s_with_profile"] = next(
        r["decode_tok_s"] for r in runs if r["policy"] == "freetoken" and r["fraction"] == 0.37)
    print(f"online estimate from step timings: B_P {est[0]:.1f}, B_H {est[1]:.1f} GB/s; q* "
          f"differs from the profile's for {online['q_differs_for_m']} of m = 1..16; freetoken at "
          f"0.37: {online['freetoken_0.37_tok_s_with_estimate']:.2f} tok/s with it vs "
          f"{online['freetoken_0.37_tok_s_with_profile']:.2f} with the profile")
  out = write_results("cache_policies", {"machine": machine_info(), "profile": prof,
                                         "bandwidths_used": bandwidths, "runs": runs,
                                         "online_estimate": online, "args": vars(args)})
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
