"""Cost-model validation: modeled vs measured decode step time on this machine (CPU backend).

The 4-layer Qwen3-30B-A3B-shaped model of ``decode_e2e.py`` (random bfloat16 weights,
generated once into ``--model_dir``). Each of ``--rounds`` alternating rounds:

1. measures this machine's profile on the model's own bank (``ftjax.runtime.profile.measure``)
   and turns it into a ``HardwareProfile``: b_p = slot fill, b_h = host expert kernel,
   device_bw = read ceiling;
2. calibrates the two fixed overheads from ONE setting, a cpu_only decode
   (``ftjax.research.calibrate.measure_overheads``): the forward time of each step minus the
   modeled time of its bytes, averaged and divided over the layers, is ``layer_overhead_s``;
   the wall time per token outside the forward (sampling, the host loop) is
   ``step_overhead_s``;
3. decodes ``--tokens`` tokens in each validation setting (a second cpu_only run, then
   freetoken and lru_fill at each cache fraction, and static_hot pinning the experts that
   served half of a warm-up decode's routes of the same prompt), each on a fresh engine
   with an empty (or, for static_hot, pinned) cache, and feeds the engine's own per-step
   counts (hits, fills, host runs per layer) to ``ftjax.research.cost.step_times``. The
   modeled mean step time is compared with the measured wall time per decoded token
   (1 / decode tok/s).

Reported per setting: the ratio modeled / measured (median over rounds) with the profile as
``ftjax.profile`` writes it for a CPU-only machine (``paths_overlap: false``: the device path
and the host kernel are added, since the same two cores run both), and the same ratio with
the GPU machines' assumption that the two paths overlap (``ratio_overlap``): the settings
that split a layer's experts between slots and the host show the difference.

  /work/venv/bin/python benchmarks/cost_model.py        # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_results  # noqa: E402
from decode_e2e import load_bench_model  # noqa: E402

import ftjax  # noqa: E402
from ftjax.research import cost  # noqa: E402
from ftjax.research import calibrate  # noqa: E402
from ftjax.runtime import profile as profile_lib  # noqa: E402


def validate(engine: ftjax.Engine, hw: cost.HardwareProfile, shape: cost.ModelShape,
             prompt: list[int], tokens: int) -> dict:
  run = calibrate.decode_counts(engine, prompt, tokens)
  counts = (run["hits"], run["fills"], run["host"])
  modeled = float(np.mean(cost.step_times(hw, shape, *counts)))  # paths added (CPU profile)
  overlap = float(np.mean(cost.step_times(dataclasses.replace(hw, paths_overlap=True), shape,
                                          *counts)))
  per_step = {k: float(run[k].sum(-1).mean()) for k in ("hits", "fills", "host")}
  # The modeled time by part: the rest is the expert paths (device + host per layer).
  fixed = {"dense_s": shape.num_layers * shape.dense_bytes_per_layer / (hw.device_bw * cost.GB),
           "head_s": shape.head_bytes / (hw.device_bw * cost.GB),
           "overheads_s": shape.num_layers * hw.layer_overhead_s + hw.step_overhead_s}
  return {"measured_s": run["token_s"], "measured_forward_s": float(np.mean(run["forward_s"])),
          "modeled_s": modeled, "modeled_overlap_s": overlap,
          "ratio": modeled / run["token_s"], "ratio_overlap": overlap / run["token_s"],
          "modeled_parts": {"experts_s": modeled - sum(fixed.values()), **fixed},
          "experts_per_step": per_step, "steps": len(run["forward_s"])}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--model_dir", default="/tmp/ftjax-bench/qwen3-30b-a3b-shape")
  parser.add_argument("--fractions", default="0.1,0.37,1.0")
  parser.add_argument("--policies", default="freetoken,lru_fill")
  parser.add_argument("--static_hot_share", type=float, default=0.5,
                      help="also run static_hot with the fewest hot experts that serve this "
                      "share of a warm-up decode's routes (0: skip): the layers then split "
                      "their experts between slots and the host, the case where the overlap "
                      "assumption matters most")
  parser.add_argument("--tokens", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()

  model = load_bench_model(args.layers, args.model_dir)
  c = model.config
  expert = profile_lib.ExpertShape(c.hidden_size, c.moe_intermediate_size, model.expert_format,
                                   c.top_k)
  shape = cost.ModelShape.from_config(c, name=f"qwen3-30b-a3b-{args.layers}l",
                                      bytes_per_param=model.dtype.itemsize,
                                      expert_format=model.expert_format)
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, c.vocab_size, 16).tolist()
  settings = [("cpu_only", 0.0)] + [(p, float(f)) for f in args.fractions.split(",")
                                    for p in args.policies.split(",")]
  hot = None
  if args.static_hot_share:
    warm = ftjax.Engine(model, cache_fraction=0.1, policy="lru_fill")
    warm.generate(prompt, args.tokens)
    hot = warm.routing_counts()  # the pinned set: the experts this prompt's decode routes to
    del warm
    share = np.cumsum(np.sort(hot.reshape(-1))[::-1]) / hot.sum()
    pinned = int(np.searchsorted(share, args.static_hot_share)) + 1
    settings.append(("static_hot", pinned / hot.size))
  profile_path = os.path.join(args.model_dir, "cost_model_profile.json")

  rounds = []
  t_start = time.perf_counter()
  for r in range(args.rounds):
    measured = profile_lib.measure(model.bank, expert, rounds=3, calls=40, show_progress=False)
    profile_lib.save_profile(measured, profile_path)  # the q* rule's bandwidths (freetoken)
    bare = calibrate.hardware_profile(measured, "this-machine")
    over = calibrate.measure_overheads(model, bare, tokens=args.tokens, seed=r)
    hw = calibrate.hardware_profile(
        measured, "this-machine", layer_overhead_s=over["layer_overhead_s"],
        step_overhead_s=over["step_overhead_s"],
        source=f"overheads calibrated from {over['steps']} cpu_only decode steps of {model.path}")
    row = {"hardware": hw.to_dict(), "calibration": over, "settings": {},
           "load_average_1min": os.getloadavg()[0]}  # other processes share these 2 cores
    print(f"round {r}: read {hw.device_bw:.1f}, B_H {hw.b_h:.1f}, B_P {hw.b_p:.1f} GB/s; "
          f"overheads {hw.layer_overhead_s * 1e3:.2f} ms/layer, {hw.step_overhead_s * 1e3:.2f} "
          f"ms/token; load average {row['load_average_1min']:.1f}")
    for policy, fraction in settings:
      engine = ftjax.Engine(model, cache_fraction=fraction, policy=policy, profile=profile_path,
                            hot_experts=hot)
      v = validate(engine, hw, shape, prompt, args.tokens)
      del engine
      key = f"{policy}@{fraction:.3g}"
      row["settings"][key] = v
      e = v["experts_per_step"]
      parts = ", ".join(f"{k[:-2]} {t * 1e3:.1f}" for k, t in v["modeled_parts"].items())
      print(f"  {key:>15}: measured {v['measured_s'] * 1e3:6.1f} ms/token, modeled "
            f"{v['modeled_s'] * 1e3:6.1f} (ratio {v['ratio']:.2f}; {parts}), if overlapped "
            f"{v['modeled_overlap_s'] * 1e3:6.1f} ({v['ratio_overlap']:.2f}); per step: "
            f"{e['hits']:.1f} hits, {e['fills']:.1f} fills, {e['host']:.1f} host")
    rounds.append(row)

  keys = list(rounds[0]["settings"])
  for r in rounds:  # each setting's change from cpu_only in the same round: the expert terms
    base = r["settings"]["cpu_only@0"]
    for v in r["settings"].values():
      for m in ("measured_s", "modeled_s", "modeled_overlap_s"):
        v[f"{m[:-2]}_vs_cpu_only_s"] = v[m] - base[m]
  summary = {k: {m: statistics.median(r["settings"][k][m] for r in rounds)
                 for m in ("ratio", "ratio_overlap", "measured_s", "modeled_s",
                           "modeled_overlap_s",
                           "measured_vs_cpu_only_s", "modeled_vs_cpu_only_s",
                           "modeled_overlap_vs_cpu_only_s")}
             for k in keys}
  print(f"\nmedians over {args.rounds} rounds (modeled / measured time per token; {args.tokens} "
        f"tokens, {args.layers} layers, {time.perf_counter() - t_start:.0f} s):")
  for k, s in summary.items():
    ms = {m: s[m] * 1e3 for m in s if m.endswith("_s")}
    print(f"  {k:>15}: {s['ratio']:.2f} (if overlapped {s['ratio_overlap']:.2f}), measured "
          f"{ms['measured_s']:.1f} ms; change from cpu_only: measured "
          f"{ms['measured_vs_cpu_only_s']:+.1f} ms, modeled {ms['modeled_vs_cpu_only_s']:+.1f} "
          f"(if overlapped {ms['modeled_overlap_vs_cpu_only_s']:+.1f})")
  out = write_results("cost_model", {
      "machine": machine_info(), "model_shape": shape.to_dict(), "summary": summary,
      "rounds": rounds, "args": vars(args)})
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
