"""Slot-fill bandwidth on the CPU backend (B_P there), and what not donating the cache costs.

``ftjax.kernels.slot_fill`` copies expert blocks from the bank into cache slots, writing into
the cache's own buffer when the caller donates it. This benchmark measures, for Qwen3-30B-A3B
expert blocks (D=2048, F=768, bfloat16: 3*F*D elements, 9.44 MB each) and ``--fills`` blocks
per call (default 8, one decode step's misses at top-8), for each cache size in ``--slots``:

- ``donated``: a jitted fill with ``donate_argnames="slots"``, the cache threaded through;
- ``numpy``: the peer, ``np.copyto`` of the same blocks between numpy arrays (one memcpy per
  block, one thread, as in the kernel): the ceiling for a single-threaded fill;
- ``not_donated``: the same jitted fill without donation, where XLA first copies the whole
  cache, so its time grows with N.

Each call reads ``--fills`` blocks that the previous calls did not touch (the bank holds
``--bank_blocks`` blocks, 604 MB by default, far more than the CPU caches) and writes them to
the next slots round-robin. The three methods alternate within each of ``--rounds`` rounds;
each round times ``--calls`` calls per method. Reported: medians over rounds of the per-round
median, GB/s = bytes filled / time (1 GB = 1e9 B), and the ratios donated / numpy and
not_donated / donated (time). Results go to ``benchmarks/results/slot_fill.json``.

  /work/venv/bin/python benchmarks/slot_fill.py          # about 30 s on 2 cores
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from ftjax.kernels import slot_fill

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "slot_fill.json")
GB = 1e9


@functools.partial(jax.jit, donate_argnames="slots")
def fill_donated(slots, bank, src, dst):
  return slot_fill(slots, bank, src, dst)


@jax.jit
def fill_not_donated(slots, bank, src, dst):
  return slot_fill(slots, bank, src, dst)


def plans(num_calls, fills, num_slots, layers, experts):
  """Per call: src [fills, 2] of blocks not read by the previous calls, dst [fills]."""
  out = []
  for call in range(num_calls):
    blocks = (call * fills + np.arange(fills)) % (layers * experts)
    src = np.stack([blocks // experts, blocks % experts], axis=1).astype(np.int32)
    dst = ((call * fills + np.arange(fills)) % num_slots).astype(np.int32)
    out.append((src, dst))
  return out


def time_calls(run, num_calls):
  """Median seconds of run(i) for i in range(num_calls); run blocks until done."""
  seconds = []
  for i in range(num_calls):
    start = time.perf_counter()
    run(i)
    seconds.append(time.perf_counter() - start)
  return statistics.median(seconds)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model_dim", type=int, default=2048)
  parser.add_argument("--ffn_dim", type=int, default=768)
  parser.add_argument("--fills", type=int, default=8)
  parser.add_argument("--bank_blocks", type=int, default=64)
  parser.add_argument("--slots", type=int, nargs="+", default=[16, 64])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--calls", type=int, default=8)
  parser.add_argument("--out", default=RESULTS)
  args = parser.parse_args()

  P = 3 * args.ffn_dim * args.model_dim
  L, E = 2, args.bank_blocks // 2
  block_bytes = P * 2
  filled_bytes = args.fills * block_bytes
  print(f"expert block {block_bytes / 1e6:.2f} MB, {args.fills} per call "
        f"({filled_bytes / 1e6:.1f} MB), bank {L * E} blocks ({L * E * block_bytes / 1e9:.2f} GB)")

  rng = np.random.default_rng(0)
  # Random bits (every value is touched, so every page is faulted in before timing).
  bank_bits = rng.integers(0, 1 << 16, size=(L, E, P), dtype=np.uint16)
  bank_np = bank_bits.view(jnp.bfloat16)
  bank = jnp.asarray(bank_np)

  # One cache per N, allocated and written once: timings never include first-touch page faults
  # of the cache itself (not_donated allocates its fresh copy on every call; that is its cost).
  setups = {}
  for n in args.slots:
    calls = plans(args.calls, args.fills, n, L, E)
    setups[n] = {
        "calls": calls,
        "device_calls": [(jnp.asarray(src), jnp.asarray(dst)) for src, dst in calls],
        "slots_np": np.ones((n, P), np.uint16),
        "slots": jnp.ones((n, P), jnp.bfloat16),  # donated and replaced on every call
        "kept": jnp.ones((n, P), jnp.bfloat16),  # never donated
    }

  def run_donated(setup, i):
    setup["slots"] = fill_donated(setup["slots"], bank, *setup["device_calls"][i])
    setup["slots"].block_until_ready()

  def run_numpy(setup, i):
    src, dst = setup["calls"][i]
    for (layer, expert), slot in zip(src, dst):
      np.copyto(setup["slots_np"][slot], bank_bits[layer, expert])

  def run_not_donated(setup, i):
    fill_not_donated(setup["kept"], bank, *setup["device_calls"][i]).block_until_ready()

  methods = {"donated": run_donated, "numpy": run_numpy, "not_donated": run_not_donated}
  per_round = {n: {name: [] for name in methods} for n in args.slots}
  for round_index in range(args.rounds + 1):  # round 0 is warm-up (compiles), not recorded
    for n in args.slots:
      times = {name: time_calls(functools.partial(run, setups[n]), args.calls)
               for name, run in methods.items()}
      if round_index == 0:
        continue
      for name, seconds in times.items():
        per_round[n][name].append(seconds)
      print(f"round {round_index} N={n:3d}: " + ", ".join(
          f"{name} {filled_bytes / s / GB:5.1f} GB/s ({s * 1e3:6.2f} ms)"
          for name, s in times.items()))

  results = {}
  print(f"\nmedians of {args.rounds} rounds, {args.fills} blocks of {block_bytes / 1e6:.2f} MB "
        "per call:")
  print("    N   donated GB/s   numpy GB/s   donated/numpy   not_donated ms   not_donated/donated")
  for n in args.slots:
    rounds = per_round[n]
    median = {name: statistics.median(values) for name, values in rounds.items()}
    ratio_to_numpy = statistics.median(
        [b / a for a, b in zip(rounds["donated"], rounds["numpy"])])  # time ratio inverted
    cost_of_copy = statistics.median(
        [b / a for a, b in zip(rounds["donated"], rounds["not_donated"])])
    results[str(n)] = {
        "seconds": median,
        "gb_per_s": {name: filled_bytes / s / GB for name, s in median.items()},
        "donated_over_numpy_bandwidth": ratio_to_numpy,
        "not_donated_over_donated_time": cost_of_copy,
        "cache_bytes": n * block_bytes,
        "per_round_seconds": rounds,
    }
    print(f"  {n:3d}   {filled_bytes / median['donated'] / GB:12.1f}   "
          f"{filled_bytes / median['numpy'] / GB:10.1f}   {ratio_to_numpy:13.2f}   "
          f"{median['not_donated'] * 1e3:14.1f}   {cost_of_copy:19.1f}")

  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({
        "benchmark": "slot_fill",
        "description": (
            "ftjax.kernels.slot_fill of Qwen3-30B-A3B expert blocks (bfloat16, 3*F*D elements) "
            "on the CPU backend: jitted with the cache donated, vs np.copyto of the same "
            "blocks (single-threaded memcpy peer), vs jitted without donation (XLA copies "
            "the whole cache first). Each call fills blocks not read by the previous calls. "
            "GB/s = bytes filled / seconds (1 GB = 1e9 B); medians over rounds of per-round "
            "medians."),
        "machine": machine_info(),
        "config": vars(args) | {"block_bytes": block_bytes, "filled_bytes_per_call": filled_bytes},
        "results": results,
    }, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
