"""A small progress bar on stderr (no dependency), for conversion, profiling and sweeps."""

from __future__ import annotations

import sys
import time


def _human(n: float, unit: str) -> str:
  if unit != "B":
    return f"{n:.0f}"
  for suffix in ("B", "KiB", "MiB", "GiB", "TiB"):
    if n < 1024 or suffix == "TiB":
      return f"{n:.1f} {suffix}"
    n /= 1024
  return f"{n:.1f}"


class Progress:
  """``update(n)`` advances; redraws at most 10 times a second; ``close()`` ends the line."""

  def __init__(self, total: float, desc: str = "", unit: str = "", enabled: bool = True,
               stream=None):
    self.total, self.desc, self.unit, self.enabled = total, desc, unit, enabled
    self.stream = stream or sys.stderr
    self.done = 0.0
    self.start = self._last = time.perf_counter()

  def update(self, n: float = 1) -> None:
    self.done += n
    now = time.perf_counter()
    if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
      self._last = now
      self._draw(now)

  def _draw(self, now: float) -> None:
    frac = self.done / self.total if self.total else 1.0
    bar = "#" * int(30 * frac)
    rate = self.done / max(now - self.start, 1e-9)
    rate_unit = f"{_human(rate, self.unit)}/s" if self.unit == "B" else f"{rate:.1f} it/s"
    self.stream.write(f"\r{self.desc} [{bar:<30}] {100 * frac:5.1f}% "
                      f"{_human(self.done, self.unit)}/{_human(self.total, self.unit)} {rate_unit}")
    self.stream.flush()

  def close(self) -> None:
    if self.enabled:
      self._draw(time.perf_counter())
      self.stream.write("\n")
      self.stream.flush()
