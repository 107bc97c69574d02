"""Routed-expert test cases shared by the expert kernel tests (tests/kernels/test_expert_ffn*.py):
the case shape, random routes, and a deterministic generator per case."""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np


def make_routes(rng, *, T, E, K, skip_fraction=0.0, shared=False):
  """ids [T, K] (distinct experts within a token, some -1), weights [T, K]."""
  if shared:  # every token picks the same experts: duplicates across tokens
    ids = np.tile(rng.permutation(E)[:K], (T, 1))
  else:
    ids = np.stack([rng.permutation(E)[:K] for _ in range(T)])
  ids = np.where(rng.random((T, K)) < skip_fraction, -1, ids).astype(np.int32)
  weights = rng.random((T, K)).astype(np.float32)
  return ids, weights


def rng_for(*labels):
  return np.random.default_rng(zlib.crc32(repr(labels).encode()))


@dataclasses.dataclass(frozen=True)
class Case:
  T: int
  K: int
  E: int = 8
  D: int = 32
  F: int = 16
  L: int = 1
  layer: int = 0
  pad: int = 0
  skip_fraction: float = 0.0
  shared: bool = False
