"""Next-token choice from one row of logits: greedy, or temperature with nucleus (top-p)."""

from __future__ import annotations

import numpy as np


def check_sampling_args(greedy: bool, temperature: float, top_p: float) -> None:
  if not greedy and not temperature > 0:
    raise ValueError(f"--temperature must be > 0 when sampling (got {temperature}); "
                     "use --greedy for deterministic argmax decoding")
  if not 0 < top_p <= 1:
    raise ValueError(f"--top_p must be in (0, 1] (got {top_p})")


def sample(logits: np.ndarray, rng: np.random.Generator, *, greedy: bool, temperature: float,
           top_p: float) -> int:
  """logits [V] float32 -> token id."""
  if greedy:
    return int(np.argmax(logits))
  z = logits.astype(np.float64) / temperature
  p = np.exp(z - z.max())
  p /= p.sum()
  if top_p < 1.0:
    order = np.argsort(-p, kind="stable")
    keep = np.cumsum(p[order]) - p[order] < top_p  # smallest prefix whose mass reaches top_p
    mask = np.zeros_like(p, dtype=bool)
    mask[order[keep]] = True
    p = np.where(mask, p, 0.0)
    p /= p.sum()
  return int(rng.choice(len(p), p=p))
