"""The dense formats' host kernels (``ftjax.kernels.dense``) against the read bandwidth and each
other, measured in the same rounds (issue 51): bfloat16, int8, mxfp4 and int4 weights.

Each round, formats in an order that alternates from round to round:

  read     ftjax.kernels.read_probe over the largest weight (the read-bandwidth ceiling)
  gemv     x [1, 2048] @ w.T with w [131072, 2048] (about half the paper model's lm_head, far
           past the caches: 0.15 GB in int4, 0.54 GB in bf16): the decode GEMV, one stream of the
           weight's bytes. GB/s = the weight's bytes (data and scales) / seconds; its ratios to
           the bf16 GEMV's GB/s and to the read probe of the same round
  batch4   the same with x [4, 2048]: 4 requests decoding together (int8: rows dequantised to
           float32 per task, then the float32 dot kernel; 4-bit: the same, or the fused kernel
           per token where the decoded form is not taken)
  prefill  x [T, 2048] @ w.T with w [4096, 2048] (T = --prefill_tokens, 512), float32
           activations (exact) and bf16 activations (``bf16_activations=True``: vdpbf16ps / AMX
           where the CPU has them; the weights decoded to bf16 per task), GFLOP/s = 2 T O C / s

Weights are random normal / sqrt(C), quantised by ``ftjax.utils.dense_quant.quantize`` (int4's
fit of the GEMV weight takes about two minutes of numpy: once per run).

  python benchmarks/dense_formats.py [--rounds 5] [--isa avx2]

Writes ``results/dense_formats.json`` (``dense_formats_<isa>.json`` with ``--isa``), machine
and ISA included, medians over the rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

FORMATS = ("bf16", "int8", "mxfp4", "int4")
VOCAB, WIDTH, PREFILL_ROWS = 131072, 2048, 4096


def log(msg: str) -> None:
  print(f"[dense_formats] {msg}", file=sys.stderr, flush=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--calls", type=int, default=8, help="GEMV calls timed per round")
  parser.add_argument("--isa", default=None, help="FTJAX_ISA for this run (e.g. avx2)")
  parser.add_argument("--prefill_tokens", type=int, default=512)
  args = parser.parse_args()
  if args.isa:
    os.environ["FTJAX_ISA"] = args.isa

  import jax  # noqa: PLC0415 (FTJAX_ISA must be set before ftjax loads its kernels)
  import jax.numpy as jnp  # noqa: PLC0415
  import ml_dtypes  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from common import machine_info, write_results  # noqa: PLC0415
  from ftjax.kernels import dense, read_probe  # noqa: PLC0415
  from ftjax.utils import dense_quant  # noqa: PLC0415

  rng = np.random.default_rng(0)

  def weights(rows):
    w = (rng.standard_normal((rows, WIDTH), dtype=np.float32) / np.sqrt(WIDTH))
    out = {"bf16": jnp.asarray(w.astype(ml_dtypes.bfloat16))}
    for fmt in FORMATS[1:]:
      t0 = time.perf_counter()
      out[fmt] = jax.device_put(dense_quant.quantize(w, fmt, 1))
      log(f"[{rows}, {WIDTH}] {fmt} quantised in {time.perf_counter() - t0:.1f} s")
    return out

  def nbytes(w):
    return w.nbytes if hasattr(w, "nbytes") and not isinstance(w, dense_quant.QuantizedMatrix) \
        else w.data.nbytes + w.scales.nbytes

  head = weights(VOCAB)
  square = weights(PREFILL_ROWS)
  T = args.prefill_tokens
  x1 = jnp.asarray(rng.standard_normal((1, WIDTH), dtype=np.float32))
  x4 = jnp.asarray(rng.standard_normal((4, WIDTH), dtype=np.float32))
  xt = jnp.asarray(rng.standard_normal((T, WIDTH), dtype=np.float32))
  gemv = jax.jit(dense)
  prefill = jax.jit(dense, static_argnames=("bf16_activations",))
  probe = jax.jit(read_probe)
  largest = head["bf16"]
  jax.block_until_ready(probe(largest))
  for fmt in FORMATS:
    jax.block_until_ready(gemv(x1, head[fmt]))
    jax.block_until_ready(gemv(x4, head[fmt]))
    for fast in (False, True):
      jax.block_until_ready(prefill(xt, square[fmt], bf16_activations=fast))

  def timed(fn, calls):
    start = time.perf_counter()
    out = None
    for _ in range(calls):
      out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls

  flops = 2 * T * PREFILL_ROWS * WIDTH
  rounds = []
  for r in range(args.rounds):
    order = FORMATS if r % 2 == 0 else FORMATS[::-1]
    read = largest.nbytes / timed(lambda: probe(largest), 1) / 1e9
    row = {"read_GBps": read}
    for fmt in order:
      s = timed(lambda fmt=fmt: gemv(x1, head[fmt]), args.calls)
      row[f"{fmt}_gemv_ms"] = s * 1e3
      row[f"{fmt}_gemv_GBps"] = nbytes(head[fmt]) / s / 1e9
      row[f"{fmt}_gemv_over_read"] = row[f"{fmt}_gemv_GBps"] / read
      s = timed(lambda fmt=fmt: gemv(x4, head[fmt]), max(args.calls // 2, 1))
      row[f"{fmt}_batch4_ms"] = s * 1e3
      row[f"{fmt}_batch4_GBps"] = nbytes(head[fmt]) / s / 1e9
    for fmt in FORMATS:  # against the bf16 GEMV of the same round, which streams at the
      # machine's read rate (its GB/s is the ceiling the 4-bit ones are held to)
      row[f"{fmt}_gemv_over_bf16"] = row[f"{fmt}_gemv_GBps"] / row["bf16_gemv_GBps"]
    for fmt in order:
      for fast in (False, True):
        s = timed(lambda fmt=fmt, fast=fast: prefill(xt, square[fmt], bf16_activations=fast), 2)
        row[f"{fmt}_prefill{'_bf16' if fast else ''}_GFLOPps"] = flops / s / 1e9
    rounds.append(row)
    log(f"round {r + 1}/{args.rounds}: read {read:.1f} GB/s | " + " | ".join(
        f"{fmt} gemv {row[f'{fmt}_gemv_ms']:.1f} ms {row[f'{fmt}_gemv_over_read']:.2f}x read, "
        f"prefill {row[f'{fmt}_prefill_GFLOPps']:.0f}/{row[f'{fmt}_prefill_bf16_GFLOPps']:.0f} "
        "GFLOP/s" for fmt in FORMATS))
  medians = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
  results = {
      "what": __doc__.split("\n\n")[0],
      "machine": machine_info(),
      "shapes": {"gemv": [VOCAB, WIDTH], "prefill": [T, PREFILL_ROWS, WIDTH]},
      "bytes": {fmt: {"gemv": nbytes(head[fmt]), "prefill": nbytes(square[fmt])}
                for fmt in FORMATS},
      "rounds": rounds, "medians": medians,
  }
  for fmt in FORMATS:
    print(f"{fmt:6} gemv {medians[f'{fmt}_gemv_ms']:7.2f} ms {medians[f'{fmt}_gemv_GBps']:5.1f} "
          f"GB/s = {medians[f'{fmt}_gemv_over_bf16']:.2f} of bf16's, "
          f"{medians[f'{fmt}_gemv_over_read']:.2f} of the read probe "
          f"({medians['read_GBps']:.1f} GB/s); 4 tokens {medians[f'{fmt}_batch4_ms']:.2f} ms "
          f"({medians[f'{fmt}_batch4_GBps']:.1f} GB/s); prefill T={T}: "
          f"{medians[f'{fmt}_prefill_GFLOPps']:.0f} GFLOP/s exact, "
          f"{medians[f'{fmt}_prefill_bf16_GFLOPps']:.0f} with bf16 activations")
  name = "dense_formats" + (f"_{args.isa}" if args.isa else "")
  print(write_results(name, results))


if __name__ == "__main__":
  main()
