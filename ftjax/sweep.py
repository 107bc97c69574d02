"""Replaying routing traces through the cache policies (the sweep CLI is not written yet).

  result = ftjax.sweep.replay(trace, "freetoken", cache_slots=64, bandwidths=(12.0, 24.0))
  result.miss_rate, result.per_layer_miss_rate, result.fills, result.host_runs
  ftjax.sweep.belady_misses(trace, cache_slots=64)   # the offline lower bound
"""

from ftjax.cache.replay import ReplayResult, belady_misses, expert_counts, replay

__all__ = ["ReplayResult", "belady_misses", "expert_counts", "replay"]


if __name__ == "__main__":
  raise SystemExit("python -m ftjax.sweep is not implemented yet: use ftjax.sweep.replay from "
                   "Python (issue 5 is open)")
