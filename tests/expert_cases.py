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


def align64(n):
  return -(-n // 64) * 64


def block_bytes(F, D):
  return align64(3 * F * D // 2) + align64(3 * F * D // 32) + 4 * (2 * F + D)


def make_mxfp4_bank(rng, *, L, E, F, D, pad=0, layers_in_use=(0,)):
  """[L, E, P] uint8 mxfp4 blocks. E2M1 codes average |v| ~ 2.6, so gate and up scales of
  2^-3 .. 2^-1 (D = 64) give pre-activations of std ~3 from unit x: past the limit 7 both ways."""
  fd = F * D
  scales_at = align64(3 * fd // 2)
  biases_at = scales_at + align64(3 * fd // 32)
  P = align64(block_bytes(F, D) + pad)
  bank = rng.integers(0, 256, (L, E, P), dtype=np.uint8)  # codes and random padding
  gate_up = np.round(127 - np.log2(D) / 2 + rng.integers(-1, 2, (L, E, 2 * fd // 32)))
  down = np.round(127 - np.log2(F) / 2 - 2 + rng.integers(-1, 2, (L, E, fd // 32)))
  scales = np.concatenate([gate_up, down], axis=-1).astype(np.uint8)
  scales[np.setdiff1d(np.arange(L), layers_in_use)] = 255
  bank[..., scales_at:scales_at + 3 * fd // 32] = scales
  bank[..., scales_at + 3 * fd // 32:biases_at] = 0
  biases = rng.standard_normal((L, E, 2 * F + D)).astype(np.float32)
  bank[..., biases_at:biases_at + 4 * (2 * F + D)] = biases.view(np.uint8)
  return bank
