"""``python -m ftjax.sweep`` and the public alias of ``ftjax.research.sweep`` (documented in
README as ``ftjax.sweep.replay``, ``ftjax.sweep.belady_misses``, ``ftjax.sweep.sweep``)."""

from ftjax.research.sweep import (DEFAULT_FRACTIONS, ReplayResult, SweepRow, belady_misses, cli,
                                  expert_counts, load_hardware, load_traces, plot, replay, sweep,
                                  write_csv)

__all__ = ["DEFAULT_FRACTIONS", "ReplayResult", "SweepRow", "belady_misses", "expert_counts",
           "load_hardware", "load_traces", "plot", "replay", "sweep", "write_csv"]

if __name__ == "__main__":
  cli()
