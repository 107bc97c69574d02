"""MXFP4 expert kernel benchmark: the decode form (one token) against the host's read bandwidth,
measured in the same rounds.

Shapes are gpt-oss-20b's: D = F = 2880, 4 experts per token, an mxfp4 bank (docs/ftw.md: E2M1
codes, E8M0 scales per 32 inputs, float32 biases) of 32 experts x 2 layers (848 MB), random
codes, scales 118-121, in a jax host buffer (pre-faulted by a read before any timing). Each
round, one after the other:

  read    ftjax.kernels.read_probe over the whole bank (the read-bandwidth ceiling)
  decode  ftjax.kernels.expert_ffn at T = 1 with gpt-oss's expert (clamped SwiGLU, biases),
          4 experts per call (53 MB of codes, scales and biases), the 4 rotating over all 64
          (layer, expert) blocks so that nothing is served from the caches
  decode_int8  the same with int8_activations=True (kernels="ffi_int8": the activations
          quantised per block of 32 as llama.cpp's Q8_0, integer sums; opt-in), alternating
          with the exact decode's place in the round

  prefill ftjax.kernels.expert_ffn at T = --prefill_tokens (512), top-4 over the 32 experts of
          layer 0 (the grouped form: ~64 routes an expert, the packed GEMM), and as its peer the
          same call on a bf16 bank of the same shape (3 x 2880 x 2880 weights and the biases
          an expert: what a bf16 checkpoint runs), alternating

GB/s = bytes of the 4 blocks read / seconds per call. The ratio to the read probe is taken
within each round; the summary reports medians over the rounds. Prefill GFLOP/s = 2 x 3 x F x
D x routes / seconds, its ratio the mxfp4 call's to the bf16 call's in the same round.

  python benchmarks/mxfp4_kernel.py [--rounds 9] [--isa avx2] [--prefill_tokens 512]

Writes ``results/mxfp4_kernel.json`` (``mxfp4_kernel_avx2.json`` with ``--isa avx2``: the
kernels of that ISA, chosen with FTJAX_ISA before ftjax is imported), machine and ISA
included.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=9)
  parser.add_argument("--calls", type=int, default=32, help="decode calls timed per round")
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
  from ftjax.kernels import ExpertVariant, expert_ffn, read_probe  # noqa: PLC0415

  from ftjax.utils.quant import mxfp4_block_bytes, mxfp4_offsets  # noqa: PLC0415

  D = F = 2880
  layers, experts, top_k = 2, 32, 4
  offsets = mxfp4_offsets(F, D)
  scales_at, biases_at = offsets["scales"]["gate"], offsets["biases"]["gate"]
  block = -(-mxfp4_block_bytes(F, D) // 64) * 64  # blocks padded to 64 bytes
  rng = np.random.default_rng(0)
  bank_np = rng.integers(0, 256, (layers, experts, block), dtype=np.uint8)
  bank_np[..., scales_at:scales_at + 3 * F * D // 32] = rng.integers(
      118, 122, (layers, experts, 3 * F * D // 32), dtype=np.uint8)
  bank_np[..., biases_at:biases_at + 4 * (2 * F + D)] = (
      rng.standard_normal((layers, experts, 2 * F + D)).astype(np.float32) * 0.01).view(np.uint8)
  bank = jnp.asarray(bank_np)
  del bank_np
  variant = ExpertVariant(activation="clamped_swiglu", alpha=1.702, limit=7.0, bias=True)
  x = jnp.asarray(rng.standard_normal((1, D)).astype(np.float32))
  weights = jnp.full((1, top_k), 1.0 / top_k, jnp.float32)
  decode = {form: [jax.jit(lambda x, ids, layer=layer, q=q: expert_ffn(
      x, ids, weights, bank, layer, ffn_dim=F, variant=variant, int8_activations=q))
                    for layer in range(layers)]
            for form, q in (("exact", False), ("int8", True))}
  order = [(l, jnp.asarray(np.arange(e, e + top_k, dtype=np.int32)[None] % experts))
           for l in range(layers) for e in range(0, experts, top_k)]
  probe = jax.jit(read_probe)
  jax.block_until_ready(probe(bank))  # faults the bank in
  for l, ids in order:
    for form in decode:
      jax.block_until_ready(decode[form][l](x, ids))  # compiles
  call_bytes = top_k * block

  # Prefill: layer 0's experts, mxfp4 and a bf16 bank of the same shape.
  T = args.prefill_tokens
  bf16_bank = jnp.asarray((rng.standard_normal((1, experts, 3 * F * D + 2 * F + D)) * 0.02)
                          .astype(ml_dtypes.bfloat16))
  x_t = jnp.asarray(rng.standard_normal((T, D)).astype(np.float32))
  ids_t = jnp.asarray(np.argsort(rng.random((T, experts)), axis=1)[:, :top_k].astype(np.int32))
  weights_t = jnp.full((T, top_k), 1.0 / top_k, jnp.float32)
  prefill = {name: jax.jit(lambda x, b=b: expert_ffn(x, ids_t, weights_t, b, 0, ffn_dim=F,
                                                       variant=variant))
             for name, b in (("mxfp4", bank), ("bf16", bf16_bank))}
  for f in prefill.values():
    jax.block_until_ready(f(x_t))  # compiles
  prefill_flops = 2 * 3 * F * D * T * top_k

  def timed_prefill(name, calls=2):
    start = time.perf_counter()
    for _ in range(calls):
      out = prefill[name](x_t)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls

  def timed_decode(form):
    start = time.perf_counter()
    out = None
    for i in range(args.calls):
      l, ids = order[i % len(order)]
      out = decode[form][l](x, ids)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / args.calls

  def timed_read():
    start = time.perf_counter()
    jax.block_until_ready(probe(bank))
    return time.perf_counter() - start

  rounds = []
  for r in range(args.rounds):
    read = bank.nbytes / timed_read() / 1e9
    forms = ("exact", "int8") if r % 2 == 0 else ("int8", "exact")
    decode_s = {form: timed_decode(form) for form in forms}
    seconds = decode_s["exact"]
    gbps = call_bytes / seconds / 1e9
    int8_gbps = call_bytes / decode_s["int8"] / 1e9
    order_names = ("mxfp4", "bf16") if r % 2 == 0 else ("bf16", "mxfp4")
    prefill_s = {name: timed_prefill(name) for name in order_names}
    gflops = {name: prefill_flops / sec / 1e9 for name, sec in prefill_s.items()}
    rounds.append({"read_GBps": read, "decode_ms": seconds * 1e3, "decode_GBps": gbps,
                   "decode_over_read": gbps / read,
                   "decode_int8_ms": decode_s["int8"] * 1e3, "decode_int8_GBps": int8_gbps,
                   "decode_int8_over_read": int8_gbps / read,
                   "prefill_mxfp4_GFLOPs": gflops["mxfp4"], "prefill_bf16_GFLOPs": gflops["bf16"],
                   "prefill_mxfp4_over_bf16": gflops["mxfp4"] / gflops["bf16"]})
    print(f"round {r + 1}/{args.rounds}: read {read:.1f} GB/s, decode {seconds * 1e3:.3f} ms "
          f"= {gbps:.1f} GB/s ({gbps / read:.2f} of read), int8 activations "
          f"{int8_gbps:.1f} GB/s ({int8_gbps / read:.2f}); prefill T={T} mxfp4 "
          f"{gflops['mxfp4']:.0f} GFLOP/s, bf16 {gflops['bf16']:.0f} "
          f"({gflops['mxfp4'] / gflops['bf16']:.2f})", flush=True)
  med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
  info = machine_info()
  print(f"medians: read {med['read_GBps']:.1f} GB/s, decode {med['decode_GBps']:.1f} GB/s, "
        f"{med['decode_over_read']:.2f} of read; with int8 activations "
        f"{med['decode_int8_GBps']:.1f} GB/s, {med['decode_int8_over_read']:.2f} of read; prefill mxfp4 {med['prefill_mxfp4_GFLOPs']:.0f} "
        f"GFLOP/s, {med['prefill_mxfp4_over_bf16']:.2f} of bf16's "
        f"({info['ftjax_kernels']['isa']} kernels)")
  name = "mxfp4_kernel" + (f"_{args.isa}" if args.isa else "")
  path = write_results(name, {
      "machine": info, "shape": {"D": D, "F": F, "top_k": top_k, "layers": layers,
                                 "experts": experts, "block_bytes": block,
                                 "bank_bytes": int(bank.nbytes), "prefill_tokens": T},
      "variant": "gpt-oss clamped SwiGLU with biases", "calls_per_round": args.calls,
      "rounds": rounds, "medians": med})
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
