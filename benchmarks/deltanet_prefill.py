"""Does the chunked gated delta rule need an FFI kernel? Its XLA:CPU time in a prefill, next to
the same layer's dense projections.

For a Gated DeltaNet layer with Qwen3.5-35B-A3B's shapes (hidden 2048, 16 key / 32 value heads
of 128, batch 1), at each prompt length T in ``--lengths``:

- ``rule``: ``ftjax.model.deltanet.gated_delta_chunked`` (chunk 64), jitted, in float32;
- ``recurrent``: ``gated_delta_recurrent`` (the token-by-token scan) on the same inputs, for
  comparison;
- ``projections``: the layer's dense GEMMs for T tokens through ftjax's host kernel
  (``ftjax.kernels.dense``, bfloat16 weights, float32 activations): in_proj_qkv, z, b, a and
  out_proj, 34 M parameters. In a prefill the layer also runs its MoE block (router, shared
  expert, 8 of 256 routed experts per token), which this leaves out, so ``share`` below is an
  upper bound of the rule's part of a real layer's time.

It prints, per length, the medians over ``--repeats`` alternating runs, the rule's achieved
GFLOP/s (its multiply-adds counted by hand below) and ``share`` = rule / (rule + projections).
The decision rule of the issue ("an FFI kernel where XLA:CPU is too slow"): a kernel is worth
writing when ``share`` exceeds 0.15. Results go to ``benchmarks/results/deltanet_prefill.json``
with the machine.

  /work/venv/bin/python benchmarks/deltanet_prefill.py            # about 2 minutes
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ftjax.kernels import dense
from ftjax.model.deltanet import CHUNK, gated_delta_chunked, gated_delta_recurrent, l2_normalize

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_results  # noqa: E402

D, J, M, U, Y = 2048, 16, 32, 128, 128
SHARE_LIMIT = 0.15


def rule_flops(t: int) -> float:
  """Multiply-adds x 2 of the chunked rule for t tokens (padded to whole chunks), per layer:
  per chunk and value head, k_beta kᵀ and q kᵀ (2·Q²·U), the triangular solve for u and w
  (Q²/2·(Y + U)), intra·v' (Q²·Y) and w·S, q·S, kᵀ·v' (3·Q·U·Y)."""
  q = CHUNK
  chunks = -(-t // q)
  per = 2 * q * q * U + q * q / 2 * (Y + U) + q * q * Y + 3 * q * U * Y
  return 2.0 * per * chunks * M


def inputs(t: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
  q = l2_normalize(f(1, t, M, U)) * U ** -0.5
  k = l2_normalize(f(1, t, M, U))
  v = f(1, t, M, Y)
  g = -jnp.asarray(rng.uniform(0.0, 0.3, (1, t, M)), jnp.float32)
  beta = jnp.asarray(rng.uniform(0.0, 1.0, (1, t, M)), jnp.float32)
  return q, k, v, g, beta, jnp.zeros((1, M, U, Y), jnp.float32)


def timed(fn, *args) -> float:
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return time.perf_counter() - t0


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--lengths", default="512,2048")
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  key_all, value_all = J * U, M * Y
  rows = {"qkv": 2 * key_all + value_all, "z": value_all, "b": M, "a": M}
  weights = {n: jnp.asarray((0.02 * rng.standard_normal((r, D))).astype(ml_dtypes.bfloat16))
             for n, r in rows.items()}
  w_out = jnp.asarray((0.02 * rng.standard_normal((D, value_all))).astype(ml_dtypes.bfloat16))

  @jax.jit
  def projections(x):
    outs = [dense(x, w) for w in weights.values()]
    return dense(outs[1], w_out), outs

  chunked = jax.jit(gated_delta_chunked)
  recurrent = jax.jit(gated_delta_recurrent)
  results = {"machine": machine_info(), "shapes": dict(D=D, J=J, M=M, U=U, Y=Y, chunk=CHUNK),
             "share_limit": SHARE_LIMIT, "lengths": {}}
  for t in [int(s) for s in args.lengths.split(",")]:
    xs = inputs(t)
    x = jnp.asarray(rng.standard_normal((t, D)), jnp.float32)
    for fn, a in ((chunked, xs), (recurrent, xs), (projections, (x,))):
      timed(fn, *a)  # compile
    times = {"rule": [], "recurrent": [], "projections": []}
    for _ in range(args.repeats):  # alternating
      times["rule"].append(timed(chunked, *xs))
      times["recurrent"].append(timed(recurrent, *xs))
      times["projections"].append(timed(projections, x))
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {f"{k}_s": v for k, v in med.items()}
    row["rule_gflop_s"] = rule_flops(t) / med["rule"] / 1e9
    row["share"] = med["rule"] / (med["rule"] + med["projections"])
    row["chunked_speedup_over_recurrent"] = med["recurrent"] / med["rule"]
    results["lengths"][str(t)] = row
    print(f"T={t}: chunked rule {med['rule'] * 1e3:.1f} ms ({row['rule_gflop_s']:.1f} GFLOP/s), "
          f"recurrent {med['recurrent'] * 1e3:.1f} ms ({row['chunked_speedup_over_recurrent']:.1f}x "
          f"slower), projections {med['projections'] * 1e3:.1f} ms; rule share {row['share']:.3f} "
          f"(an FFI kernel pays off above {SHARE_LIMIT})")
  verdict = max(r["share"] for r in results["lengths"].values()) <= SHARE_LIMIT
  results["xla_is_enough"] = verdict
  print("verdict: the chunked rule stays in JAX (XLA:CPU)" if verdict else
        "verdict: the chunked rule needs an FFI kernel")
  print("wrote", write_results("deltanet_prefill", results))


if __name__ == "__main__":
  main()
