"""The q* guard shown on a lie (issue 52, item 3): the engine started with a bandwidth profile
that overstates the host 25x, and with one that overstates the fill 25x, calibrates its split
while it decodes and switches strategy; each must come within 1.1x of the best of the three
strategies (the split, pure fill, pure host) within 64 decode steps.

The model: the 4-layer Qwen3-30B-A3B-shaped bench model (``cpu_peer.py``'s ``hf-4l``, bf16,
128 experts top-8), loaded through ftjax's converter. The cache: ``--cache_fraction`` of the
experts (0.37, the issue's size), policy ``freetoken`` (LRU victims, the q* fill rule),
``decode_chunk`` 8.

The profile: ``ftjax.runtime.profile.measure`` on the model's own bank (the truth), and two
lies made from it: ``concurrent.b_h_gb_s`` times 25 (FreeToken issue 151's CPU), and
``concurrent.b_p_gb_s`` times 25. Configurations, each a fresh engine whose first request is
the measured one (the programs are compiled before, by a warm-up engine that shares them):

  fill, host, split     the three strategies fixed (bandwidths (1, 1), (1e-6, 1), the true
                        profile's), no calibration: the references;
  host lie, fill lie    the lying profile, no calibration: what the split costs uncalibrated;
  host lie + guard,     the lying profile with ``calibrate_split="on"``;
  fill lie + guard,
  truth + guard

``--rounds`` rounds in alternating order; per configuration the median over rounds of each
step's seconds (a decode chunk's wall time over its steps: ``Engine.stats()["per_step"]``).
Each calibrated run reports the step from which its rolling median (over 2 chunks) stays within
1.1x of the best fixed strategy's median, its strategy per chunk (probes included) and its
switches. The step times, against the step, are plotted.

  /work/venv/bin/python benchmarks/split_guard.py [--rounds 3] [--tokens 160]

Results: ``benchmarks/results/split_guard.{json,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, pyplot, write_results  # noqa: E402

GOAL_RATIO = 1.1
GOAL_STEPS = 64
LIE = 25.0
PROMPT = 16


def log(msg: str) -> None:
  print(msg, file=sys.stderr, flush=True)


def decode_steps(engine) -> list[dict]:
  """The decode steps of the engine's record (one token a row), prefill left out."""
  return [s for s in engine.stats()["per_step"] if s["tokens"] == 1][1:]


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--hf_dir", default="/tmp/ftjax-cpu-peer/hf-4l",
                 help="the bench model (benchmarks/cpu_peer.py writes it)")
  p.add_argument("--cache_fraction", type=float, default=0.37)
  p.add_argument("--tokens", type=int, default=160)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--out", default=None)
  args = p.parse_args()
  if not os.path.isdir(args.hf_dir):
    raise SystemExit(f"{args.hf_dir} not found: write the bench model with "
                     "benchmarks/cpu_peer.py first (it keeps hf-4l in its --work_dir)")

  import ftjax  # noqa: PLC0415
  from ftjax.runtime.calibration import FILL_ALL, HOST_ALL  # noqa: PLC0415
  from ftjax.runtime.profile import (ExpertShape, expert_shape_bias, measure,  # noqa: PLC0415
                                     save_profile)

  model = ftjax.load(args.hf_dir, verify=False, populate=True)
  c = model.config
  shape = ExpertShape(c.hidden_size, c.moe_intermediate_size, model.expert_format, c.top_k,
                      bias=expert_shape_bias(c, model.expert_format))
  log("measuring the bandwidth profile on the model's bank")
  truth = measure(model.bank, shape)
  work = tempfile.mkdtemp(prefix="split_guard_")
  profiles = {"truth": truth}
  for name, key in (("host lie", "b_h_gb_s"), ("fill lie", "b_p_gb_s")):
    lie = json.loads(json.dumps(truth))
    lie["concurrent"][key] *= LIE
    lie[key] *= LIE
    profiles[name] = lie
  paths = {name: save_profile(prof, os.path.join(work, name.replace(" ", "_") + ".json"))
           for name, prof in profiles.items()}
  conc = truth["concurrent"]
  true_pair = (conc["b_p_gb_s"], conc["b_p_gb_s"] + conc["b_h_gb_s"])
  log(f"profile: B_P {conc['b_p_gb_s']:.1f}, B_res {conc['b_h_gb_s']:.1f} GB/s (concurrent)")

  common = dict(cache_fraction=args.cache_fraction, policy="freetoken", decode_chunk=8,
                max_seq_len=PROMPT + args.tokens + 64)
  configs = {
      "fill": dict(bandwidths=FILL_ALL, calibrate_split="off"),
      "host": dict(bandwidths=HOST_ALL, calibrate_split="off"),
      "split": dict(bandwidths=true_pair, calibrate_split="off"),
      "host lie": dict(profile=paths["host lie"], calibrate_split="off"),
      "fill lie": dict(profile=paths["fill lie"], calibrate_split="off"),
      "host lie + guard": dict(profile=paths["host lie"], calibrate_split="on"),
      "fill lie + guard": dict(profile=paths["fill lie"], calibrate_split="on"),
      "truth + guard": dict(profile=paths["truth"], calibrate_split="on"),
  }
  prompt = np.random.default_rng(0).integers(0, c.vocab_size, PROMPT)
  log("compiling (a warm-up engine; the others share its programs)")
  warm = ftjax.Engine(model, **common, **configs["split"])
  warm.generate(prompt, 24)
  warm.close()

  runs: dict[str, list] = {name: [] for name in configs}
  names = list(configs)
  for r in range(args.rounds):
    order = names if r % 2 == 0 else names[::-1]
    for name in order:
      engine = ftjax.Engine(model, **common, **configs[name])
      t0 = time.perf_counter()
      engine.generate(prompt, args.tokens)
      steps = decode_steps(engine)
      run = {"seconds": [s["seconds"] for s in steps], "wall_s": time.perf_counter() - t0,
             "compiles": engine.compile_count, "miss_rate": engine.stats()["miss_rate"]}
      cal = engine.calibration()
      if cal is not None:
        run["calibration"] = {k: cal[k] for k in ("strategy", "rates_gb_s", "costs_s",
                                                  "switches", "probes", "seconds_per_step")}
        run["chunks"] = [{"at_step": at, "steps": n, "strategy": s, "seconds": sec}
                         for at, n, s, sec in engine.executor.calibrator.trace]
      runs[name].append(run)
      log(f"round {r + 1} {name}: median step {np.median(run['seconds']) * 1e3:.1f} ms"
          + (f", strategy {cal['strategy']}, switches "
             f"{[(s['step'], s['after']) for s in cal['switches']]}" if cal else ""))
      engine.close()

  n = min(len(r["seconds"]) for rs in runs.values() for r in rs)
  per_step = {name: np.median([r["seconds"][:n] for r in rs], axis=0) for name, rs in runs.items()}
  fixed = {name: float(np.median(per_step[name][GOAL_STEPS:])) for name in ("fill", "host",
                                                                             "split")}
  best = min(fixed, key=fixed.get)
  summary = {}
  for name in configs:
    med = float(np.median(per_step[name][GOAL_STEPS:]))
    row = {"median_step_ms_after_64": med * 1e3, "of_best": med / fixed[best]}
    if "guard" in name:
      rolling = np.array([np.median(per_step[name][max(0, i - 15):i + 1]) for i in range(n)])
      within = rolling <= GOAL_RATIO * fixed[best]
      bad = np.flatnonzero(~within)
      row["within_1.1x_from_step"] = int(bad[-1] + 1) if len(bad) else 0
      row["goal_met"] = bool(row["within_1.1x_from_step"] <= GOAL_STEPS and
                             row["of_best"] <= GOAL_RATIO)
      row["final_strategies"] = [r["calibration"]["strategy"] for r in runs[name]]
    summary[name] = row
    log(f"{name}: {row}")
  results = {
      "benchmark": "split_guard", "machine": machine_info(),
      "model": {"dir": args.hf_dir, "layers": c.num_layers, "experts": c.num_experts,
                "top_k": c.top_k, "expert_bytes": model.expert_bytes,
                "expert_format": model.expert_format},
      "cache_fraction": args.cache_fraction, "policy": "freetoken", "decode_chunk": 8,
      "tokens": args.tokens, "rounds": args.rounds, "lie": LIE,
      "profile": {"b_p_gb_s": truth["b_p_gb_s"], "b_h_gb_s": truth["b_h_gb_s"],
                  "concurrent": truth["concurrent"]},
      "best_fixed": best, "fixed_median_step_ms": {k: v * 1e3 for k, v in fixed.items()},
      "summary": summary, "per_step_median_s": {k: v.tolist() for k, v in per_step.items()},
      "runs": runs,
  }
  out = write_results("split_guard", results, args.out)
  plot(per_step, fixed[best], os.path.splitext(out)[0] + ".png", results["machine"])
  log(f"wrote {out}")


def plot(per_step: dict, best: float, path: str, machine: dict) -> None:
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(9, 5))
  styles = {"fill": ":", "host": ":", "split": ":", "host lie": "--", "fill lie": "--"}
  for name, s in per_step.items():
    ax.plot(np.arange(len(s)), np.asarray(s) * 1e3, styles.get(name, "-"), label=name,
            linewidth=1.0 if name in styles else 1.8)
  ax.axhline(GOAL_RATIO * best * 1e3, color="k", linewidth=0.8, label="1.1x the best fixed")
  ax.axvline(GOAL_STEPS, color="grey", linewidth=0.8)
  ax.set_xlabel("decode step")
  ax.set_ylabel("ms a step (chunk of 8, median of rounds)")
  ax.set_ylim(bottom=0)
  ax.set_title(f"q* guard on a 25x lie: bench model, {machine['cpu_model']} "
               f"(f{machine['cpu_family']}m{machine['cpu_model_number']})", fontsize=9)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == "__main__":
  main()
