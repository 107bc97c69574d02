"""Kernel tuning on this machine (ftjax.kernels.tuning): each variant's ratio to the read
bandwidth, the tuner's choice, and a check that the choice is the fastest.

1. The tuner, as ``python -m ftjax.profile`` runs it, on Qwen3-30B-A3B's shapes (D = 2048,
   F = 768, top-8; ``tuning.workload_bytes()`` of weights: twice the last-level cache, 128 MiB
   to 1 GiB): every variant of its three stages
   (one token: prefetch distance x hint x accumulators, on the GEMV and the decode expert FFN;
   the GEMV's rows per task; rows per register block at 4 and 8 tokens), with its time relative
   to the stage's baseline and its ratio to the read probe of the same rounds.
2. The check, in separate alternating rounds (more of them): the chosen tuning against the
   built-in default and against each stage's runner-up and worst variant (each applied on top of
   the choice), on all four workloads. The choice should be the fastest within the noise.

Writes benchmarks/results/kernel_tuning_<isa>.json and a plot of stage 1 (.png).

  python benchmarks/kernel_tuning.py [--rounds 7] [--check_rounds 9]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

import numpy as np

from ftjax.kernels import tuning

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, machine_info, pyplot, write_results  # noqa: E402

SHAPES = tuning.Shapes(2048, 768, 8)
WORKLOADS = ("gemv", "experts", "batch4", "batch8")


def contenders(record):
  """The chosen tuning, the default, and per stage its runner-up and worst variant (each with the
  stage's fields on top of the choice)."""
  chosen = tuning.Tuning.from_dict(record["chosen"])
  out = {"chosen": chosen, "default": tuning.DEFAULT}
  for stage, rows in record["stages"].items():
    ranked = sorted(rows, key=lambda row: row["score"])
    # The stage's own fields from each variant, the rest from the choice.
    on_choice = [dataclasses.replace(chosen, **{
        name: value for name, value in row["fields"].items() if _stage_field(stage, name)})
                 for row in ranked]
    others = [v for v in on_choice if v != chosen]
    out[f"{stage} runner-up"], out[f"{stage} worst"] = others[0], others[-1]
  return out


def _stage_field(stage, name):
  return {"one_token": ("prefetch_bytes", "prefetch_hint", "row_accumulators"),
          "gemv_tasks": ("gemv_task_kib",), "blocks": ("block_rows",)}[stage].count(name) > 0


def check(record, rounds, bf16_activations):
  """Alternating rounds of every contender on every workload: median ms and time relative to
  the choice."""
  work = tuning.Workloads(SHAPES.clamped(), record["bytes_each"], bf16_activations)
  entries = contenders(record)
  names = list(entries)
  times = {(n, w): [] for n in names for w in WORKLOADS}
  reads = []
  rng = np.random.default_rng(0)
  for w in WORKLOADS:  # compile, pre-fault
    work.seconds(w)
  for r in range(rounds):
    reads.append(work.read_gb_s())
    for i in rng.permutation(len(names)):
      tuning.apply(entries[names[i]])
      for w in WORKLOADS:
        times[(names[i], w)].append(work.seconds(w))
    print(f"\rcheck round {r + 1}/{rounds}", end="", file=sys.stderr, flush=True)
  print(file=sys.stderr)
  tuning.apply(entries["chosen"])
  read = statistics.median(reads)
  out = {}
  for n in names:
    med = {w: statistics.median(times[(n, w)]) for w in WORKLOADS}
    rel = statistics.fmean(med[w] / statistics.median(times[("chosen", w)]) for w in WORKLOADS)
    out[n] = {"variant": entries[n].name, "time_vs_chosen": rel,
              **{f"{w}_ms": 1e3 * med[w] for w in WORKLOADS},
              **{f"{w}_to_read": work.bytes[w] / med[w] / 1e9 / read for w in WORKLOADS}}
  return out, read


def plot(record, path):
  plt = pyplot()
  if plt is None:
    return None
  rows = record["stages"]["one_token"]
  fig, ax = plt.subplots(figsize=(10, 4.5))
  xs = np.arange(len(rows))
  ax.bar(xs - 0.2, [r["gemv_to_read"] for r in rows], 0.4, label="GEMV / read")
  ax.bar(xs + 0.2, [r["experts_to_read"] for r in rows], 0.4, label="decode experts / read")
  ax.axhline(1.0, color="k", lw=0.8)
  ax.set_xticks(xs, [r["variant"] for r in rows], rotation=60, ha="right", fontsize=7)
  ax.set_ylabel("ratio to the read probe")
  key = record["key"]
  ax.set_title(f"one-token variants, {key['cpu']} (family {key['family']} model {key['model']}), "
               f"{key['isa']}, {key['threads']} threads; chosen: {record['name']}", fontsize=9)
  ax.legend(fontsize=8, loc="lower right")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=7, help="the tuner's rounds")
  parser.add_argument("--check_rounds", type=int, default=9)
  parser.add_argument("--bf16_activations", action="store_true",
                      help="as the engine's ffi_bf16 (the default for bf16 models)")
  parser.add_argument("--out", default=None,
                      help="results name under benchmarks/results/ (default kernel_tuning_<isa>, "
                      "with _bf16_activations when given): name another machine's run apart")
  args = parser.parse_args(argv)
  info = machine_info()
  print(f"machine: {info['cpu_model']} (family {info['cpu_family']} model "
        f"{info['cpu_model_number']}), {info['nproc']} CPUs, kernels {info['ftjax_kernels']}")
  record = tuning.measure(SHAPES, rounds=args.rounds, bf16_activations=args.bf16_activations)
  print(f"tuner ({record['seconds']:.1f} s, read {record['read_gb_s']:.1f} GB/s): "
        f"chose {record['name']}")
  for stage, rows in record["stages"].items():
    for row in rows:
      ratios = ", ".join(f"{k[:-8]} {v:.2f}" for k, v in row.items() if k.endswith("_to_read"))
      print(f"  {stage:10s} {row['variant']:34s} time {row['score']:.3f} of baseline | "
            f"to read: {ratios}")
  checked, read = check(record, args.check_rounds, args.bf16_activations)
  print(f"check ({args.check_rounds} alternating rounds, read {read:.1f} GB/s): mean time over "
        f"{', '.join(WORKLOADS)} relative to the choice")
  for name, row in checked.items():
    print(f"  {name:22s} {row['variant']:34s} {row['time_vs_chosen']:.3f}")
  fastest = min(checked, key=lambda n: checked[n]["time_vs_chosen"])
  print(f"fastest in the check: {fastest} ({checked[fastest]['variant']})")
  isa = record["key"]["isa"]
  results = {"machine": info, "shapes": dataclasses.asdict(SHAPES), "tuner": record,
             "check": {"rounds": args.check_rounds, "read_gb_s": read, "contenders": checked,
                       "fastest": fastest}}
  name = args.out or f"kernel_tuning_{isa}" + ("_bf16_activations" if args.bf16_activations
                                                else "")
  print(f"wrote {write_results(name, results)}")
  # Identical settings measured apart differ by the noise: the spread of the check says how much.
  png = plot(record, os.path.join(RESULTS_DIR, f"{name}.png"))
  if png:
    print(f"wrote {png}")


if __name__ == "__main__":
  main()
