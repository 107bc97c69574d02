"""Programs have a bounded lifetime (issue 50): a sweep of 200 engine configurations in one
process runs to the end, and what an engine compiled goes when it does.

Before the fix every configuration left ~1,200 memory maps (XLA:CPU executables) and ~60 MB
behind, and a sweep died at about 55 configurations past ``vm.max_map_count``. The sweep runs in
a subprocess, so that the maps and RSS it reads are its own.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import weakref

import pytest

import ftjax
from ftjax.assets import DEFAULT_MODEL_DIR
from ftjax.runtime import programs

POLICIES = ("freetoken", "lru_fill", "cpu_only", "freetoken_lrfu", "static_layers")

SWEEP = textwrap.dedent("""
    import gc, json, sys, time
    import ftjax
    from ftjax.assets import DEFAULT_MODEL_DIR
    from ftjax.runtime import programs

    def maps():
      with open("/proc/self/maps") as f:
        return sum(1 for _ in f)

    def rss():
      with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

    policies, repeats = json.loads(sys.argv[1]), int(sys.argv[2])
    model = ftjax.load(DEFAULT_MODEL_DIR)
    total = model.config.num_moe_layers * model.config.num_experts
    sizes = [0, 1, 4, 12, 24, 48, 96, total]
    rows, compiles, tokens = [], 0, {}
    began = time.perf_counter()
    for policy in policies:
      for size in sizes:
        for _ in range(repeats):
          # Tiny shapes: one prefill chunk size, a short context, the slots of every size in
          # one buffer (cache_capacity), the built-in kernel variants (no tuning run).
          engine = ftjax.Engine(model, cache_slots=size, cache_capacity=total, policy=policy,
                                bandwidths=(10.0, 30.0), max_seq_len=64, prefill_chunk=16,
                                kernel_tuning="off")
          out = engine.generate([3, 17, 29, 4, 11], 12)
          tokens.setdefault(policy, set()).add(tuple(out))
          compiles += engine.compile_count
          del engine  # as a sweep drops it: no close(), no gc.collect()
          rows.append((maps(), rss()))
    after_sweep = rows[-1]
    programs.release_unused()
    gc.collect()
    print(json.dumps({"rows": rows, "compiles": compiles, "tables": programs.live_tables(),
                      "released": [maps(), rss()], "after_sweep": after_sweep,
                      "seconds": time.perf_counter() - began,
                      "distinct_outputs": {p: len(t) for p, t in tokens.items()}}))
""")


def _sweep(policies, repeats: int) -> dict:
  proc = subprocess.run([sys.executable, "-c", SWEEP, json.dumps(policies), str(repeats)],
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, f"the sweep died (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_sweep_of_200_engines_runs_to_the_end_in_bounded_memory():
  result = _sweep(list(POLICIES), repeats=5)
  rows = result["rows"]
  assert len(rows) == 200
  maps_10, rss_10 = rows[9]
  maps_end, rss_end = rows[-1]
  peak_maps = max(m for m, _ in rows)
  print(f"200 configurations in {result['seconds']:.0f} s: {result['compiles']} compiles; maps after the 10th {maps_10}, "
        f"after the last {maps_end}, peak {peak_maps}; RSS after the 10th "
        f"{rss_10 / 2**20:.0f} MiB, after the last {rss_end / 2**20:.0f} MiB; after "
        f"release_unused: {result['released'][0]} maps, {result['released'][1] / 2**20:.0f} MiB")
  assert maps_end <= 1.2 * maps_10 and peak_maps <= 1.2 * maps_10
  assert rss_end <= 1.2 * rss_10
  # Sizes share their programs (one slot buffer), repeats share them (the table of the last
  # engine is kept): one extend, first-token and decode program per table, where the sweep
  # moves to a policy of another plan program. cpu_only and static_layers share one program
  # but not in a row, so their table is compiled twice: 5 tables of 3 programs.
  assert result["compiles"] == 15
  # Every engine of a policy gave the same tokens, whatever its cache size (the cache
  # changes where experts run, not what they compute).
  assert all(n == 1 for n in result["distinct_outputs"].values())
  # Released: the kept table goes too, and with it its executables' code.
  assert result["tables"] == 0
  assert result["released"][0] < maps_10


def test_an_engine_releases_its_programs_when_it_goes():
  model = ftjax.load(DEFAULT_MODEL_DIR)
  # Options no other test's engine has, so that no live engine elsewhere shares the table.
  options = dict(kernel_tuning="off", max_seq_len=72, prefill_chunk=16, decode_chunk=11,
                 record_routing=True)
  kept = programs.keep_released()
  programs.keep_released(0)
  try:
    with ftjax.Engine(model, **options) as engine:
      engine.generate([1, 2, 3], 2)
      table = weakref.ref(engine.programs)
      assert len(table()) == 3  # extend, first, decode
    gc.collect()
    assert table() is None  # close() let go of the table, and nothing else held it
    with pytest.raises(RuntimeError, match="closed"):
      engine.generate([1, 2, 3], 2)
    first = ftjax.Engine(model, **options)
    second = ftjax.Engine(model, **options)
    assert first.programs is second.programs  # live engines of one runner share a table
    table = weakref.ref(first.programs)
    del first, second  # dropped: no close()
    gc.collect()
    assert table() is None
  finally:
    programs.keep_released(kept)
  with pytest.raises(ValueError, match="int >= 0"):
    programs.keep_released(-1)
