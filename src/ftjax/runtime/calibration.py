"""The q* split calibrated while serving, with a guard (issue 52, item 3).

The q* rule (``ftjax.cache.policy.fill_count``) splits each layer-step's misses between cache
fills and host runs from two bandwidths, B_P (fill) and B_H (host). They come from
``ftjax.profile``, measured alone: a field report (FreeToken issue 151) chose the split from a
microbenchmark that put the CPU at 56 GB/s, got 2 GB/s of it while serving, and decoded 8.3x
slower than plain offload. A ``SplitCalibrator`` makes the profile only the starting point:

* **Rates from the engine's own records.** Every decode program (a chunk of steps) reports
  its wall time and its layer-steps' hits, fills and host-run experts. A least-squares fit
  over the recent chunks, ``seconds = a·steps + b·hits + c·fills + d·host`` (non-negative,
  pulled gently toward the profile's costs), gives what one fill (``c``: the copy and its
  run from the slot) and one host run (``d``) cost now. The split is re-solved from them:
  B_P = S / c and B_res = S / d for an expert of S bytes, B_H = B_P + B_res (the form in
  which ``fill_count`` balances q / B_P against (m - q) / B_res).
* **A guard over three strategies.** The split, "fill" (every miss filled: q = m) and "host"
  (no miss filled: q = 0, bar the empty slots a ``fill_free`` policy fills anyway). Each is
  just a bandwidth pair the decode programs already take as an input, so switching never
  compiles. The guard keeps each strategy's seconds a step over its last chunks; a strategy
  not measured for ``probe_every`` chunks is run for one chunk (a probe), so all three stay
  known. When the strategy in use measures more than ``margin`` (1.1) times the best, the
  guard switches to the best, logs why (``ftjax.runtime.calibration`` at WARNING) and counts
  the switch; the fit's chunks include the probes, whose pure fill and pure host counts are
  what separate ``c`` from ``d``.

On the CPU backend both paths are real work on the same memory: a fill copies an expert into
the slot array and then runs it there, a host run reads it where it lies; the guard measures
which wins rather than assuming it. Only decode programs follow the guard's strategy; prefill
(extend) programs plan with the re-solved rates (a pure strategy measured on one-token steps
says nothing about a 512-token chunk's streaming choice).

Numbers only: the engine's executor feeds ``observe`` and reads ``decode_bandwidths`` and
``rates`` (``ftjax.runtime.executor``); ``summary`` is what ``Engine.stats()`` and the
server's ``/metrics`` report.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

STRATEGIES = ("split", "fill", "host")
# The bandwidth pairs of the pure strategies (GB/s; only their ratio matters to fill_count):
# B_P >= B_H fills every miss; a B_P a millionth of B_H fills none.
FILL_ALL = (1.0, 1.0)
HOST_ALL = (1e-6, 1.0)
MARGIN = 1.1  # the guard switches when the strategy in use measures above MARGIN x the best
PROBE_EVERY = 32  # chunks after which a strategy's measurement is stale and is probed again
SAMPLES = 3  # chunks a strategy's seconds a step are the median of
WINDOW = 48  # chunks the rates are fitted over
PRIOR_WEIGHT = 0.05  # the profile's costs, as this many chunks' worth of evidence


@dataclasses.dataclass
class Switch:
  """One change of strategy: at ``chunk`` (decode programs observed), from ``before`` to
  ``after``, with the seconds a step each measured then."""
  chunk: int
  step: int
  before: str
  after: str
  seconds_per_step: dict[str, float]

  def describe(self) -> str:
    times = ", ".join(f"{name} {s * 1e3:.2f} ms" for name, s in self.seconds_per_step.items())
    return (f"q* guard: {self.before} measured {self.seconds_per_step[self.before] * 1e3:.2f} "
            f"ms a decode step, over {MARGIN:.1f}x the best ({times}): switching to "
            f"{self.after} at step {self.step}")


class SplitCalibrator:
  """Measured fill and host costs, the split they give, and the guard (module docstring).

  ``bandwidths``: the profile's (B_P, B_H) in GB/s, where the split starts; ``expert_bytes``:
  S, one expert's bytes (the rates' unit)."""

  def __init__(self, bandwidths, expert_bytes: int, *, margin: float = MARGIN,
               probe_every: int = PROBE_EVERY, samples: int = SAMPLES, window: int = WINDOW):
    b_p, b_h = (float(b) for b in bandwidths)
    if not (b_p > 0 and b_h > 0):
      raise ValueError(f"bandwidths must be two positive GB/s numbers, got {bandwidths}")
    if expert_bytes <= 0:
      raise ValueError(f"expert_bytes must be positive, got {expert_bytes}")
    self.initial = (b_p, b_h)
    self.expert_bytes = int(expert_bytes)
    self.margin, self.probe_every, self.samples = margin, probe_every, samples
    # The profile's costs in seconds per expert: a fill at B_P, a host run at B_res.
    gb = self.expert_bytes / 1e9
    self.prior = np.array([0.0, 0.0, gb / b_p, gb / max(b_h - b_p, 1e-3 * b_h)])
    self.costs = self.prior.copy()  # a (per step), b (hit), c (fill), d (host), seconds
    self.fitted = False
    self.mode = "split"  # the strategy decode programs run with
    self.chunks = 0  # decode programs observed
    self.steps = 0  # decode steps observed
    self.last_seen = {name: -(10 ** 9) for name in STRATEGIES}
    self.last_seen["split"] = 0
    self.per_step = {name: collections.deque(maxlen=samples) for name in STRATEGIES}
    self.history: collections.deque = collections.deque(maxlen=window)
    self.switches: list[Switch] = []
    self.probes = 0
    # The last chunks: (steps observed before it, its steps, strategy, seconds) for plots.
    self.trace: collections.deque = collections.deque(maxlen=4096)
    # observe (the engine's thread) against summary (a server's /metrics, another thread)
    self._lock = threading.Lock()

  # -- What the programs run with ------------------------------------------------------------

  def rates(self) -> np.ndarray:
    """(B_P, B_H) in GB/s from the measured costs (the profile's until a fit): what the split
    and prefill plan with."""
    if not self.fitted:
      return np.asarray(self.initial, np.float32)
    gb = self.expert_bytes / 1e9
    fill_s, host_s = max(self.costs[2], 1e-9), max(self.costs[3], 1e-9)
    b_p = gb / fill_s
    return np.asarray([b_p, b_p + gb / host_s], np.float32)

  def strategy(self) -> str:
    """The strategy of the next decode program: a probe of a stale one, else the guard's."""
    if self.chunks >= 1:  # the first chunk (a fresh program's first run) is not compared
      for name in STRATEGIES:
        if name != self.mode and self.chunks - self.last_seen[name] >= self.probe_every:
          self.last_seen[name] = self.chunks  # one probe at a time, even with chunks in flight
          return name
    return self.mode

  def decode_bandwidths(self) -> tuple[str, np.ndarray]:
    """The strategy of the next decode program (``strategy``) and its bandwidth pair; the
    strategy goes back to ``observe`` with the program's record."""
    name = self.strategy()
    if name == "fill":
      return name, np.asarray(FILL_ALL, np.float32)
    if name == "host":
      return name, np.asarray(HOST_ALL, np.float32)
    return name, self.rates()

  # -- What the programs did -----------------------------------------------------------------

  def observe(self, seconds: float, steps: int, hits: int, fills: int, host: int,
              strategy: str | None = None) -> Switch | None:
    """One decode program: its wall ``seconds`` for ``steps`` decode steps, whose layer-steps
    hit ``hits`` cached experts, filled ``fills`` and ran ``host`` on the host, under
    ``strategy`` (the one ``decode_bandwidths`` gave it; default: the strategy in use).
    Returns the switch this made, if any."""
    if steps <= 0 or not np.isfinite(seconds) or seconds <= 0:
      return None
    with self._lock:
      return self._observe(seconds, steps, hits, fills, host, strategy)

  def _observe(self, seconds, steps, hits, fills, host, strategy) -> Switch | None:
    name = strategy or self.mode
    self.probes += name != self.mode
    self.trace.append((self.steps, steps, name, seconds))
    self.chunks += 1
    self.steps += steps
    self.last_seen[name] = self.chunks
    if self.chunks > 1:  # the first program's run carries one-time costs
      self.per_step[name].append(seconds / steps)
      self.history.append((steps, hits, fills, host, seconds))
      self._fit()
    return self._guard()

  def _fit(self) -> None:
    """Non-negative least squares (by active set: a negative cost is dropped and the rest
    refitted) of the chunks' seconds on their steps, hits, fills and host runs, with the
    profile's costs as ``PRIOR_WEIGHT`` chunks of evidence (a ridge toward them)."""
    rows = np.asarray([h[:4] for h in self.history], np.float64)
    seconds = np.asarray([h[4] for h in self.history], np.float64)
    if len(rows) < 2 or not rows[:, 2:].any():
      return
    # Each column scaled to a mean of 1, so that one ridge row weighs about one chunk; the
    # ridge holds the fill and host costs toward the profile's (the per-step and per-hit costs
    # have no prior: none is pulled toward zero).
    scale = np.maximum(np.abs(rows).mean(axis=0), 1e-9)
    x = rows / scale
    prior = self.prior * scale
    weight = np.sqrt(np.array([0.0, 0.0, PRIOR_WEIGHT, PRIOR_WEIGHT]))
    active = np.ones(4, bool)
    coef = np.zeros(4)
    for _ in range(4):
      a = np.vstack([x[:, active], np.diag(weight[active])])
      b = np.concatenate([seconds, weight[active] * prior[active]])
      sol = np.linalg.lstsq(a, b, rcond=None)[0]
      coef[:] = 0.0
      coef[active] = sol
      if (coef >= 0).all():
        break
      active &= coef > 0
    self.costs = np.maximum(coef, 0.0) / scale
    # A fill's cost is its copy plus its run from the slot: never below a hit's.
    self.costs[2] = max(self.costs[2], self.costs[1])
    self.fitted = True

  def _measured(self) -> dict[str, float]:
    return {name: float(np.median(s)) for name, s in self.per_step.items() if s}

  def _guard(self) -> Switch | None:
    measured = self._measured()
    if len(measured) < len(STRATEGIES) or self.mode not in measured:
      return None
    best = min(measured, key=measured.get)
    if best == self.mode or measured[self.mode] <= self.margin * measured[best]:
      return None
    switch = Switch(self.chunks, self.steps, self.mode, best, measured)
    self.switches.append(switch)
    log.warning("%s", switch.describe())
    self.mode = best
    self.per_step[best].clear()  # measured afresh as the strategy in use
    self.last_seen[best] = self.chunks
    return switch

  # -- What it reports -----------------------------------------------------------------------

  def summary(self) -> dict[str, Any]:
    """The strategy in use, the measured costs and rates, the seconds a decode step each
    strategy measured, and every switch."""
    with self._lock:
      return self._summary()

  def _summary(self) -> dict[str, Any]:
    return {
        "strategy": self.mode, "chunks": self.chunks, "steps": self.steps,
        "profile_gb_s": list(self.initial), "rates_gb_s": self.rates().tolist(),
        "fitted": self.fitted,
        "costs_s": {"step": float(self.costs[0]), "hit": float(self.costs[1]),
                    "fill": float(self.costs[2]), "host": float(self.costs[3])},
        "seconds_per_step": self._measured(), "probes": self.probes,
        "switches": [dataclasses.asdict(s) for s in self.switches],
    }
