"""End-to-end decode and prefill throughput on a Qwen3-30B-A3B-shaped model, against the
memory-bandwidth roofline measured in the same run.

The model has Qwen3-30B-A3B's layer shapes (hidden 2048, 32 query / 4 KV heads, head_dim
128, 128 experts, top-8, expert width 768, vocab 151936, bfloat16) and ``--layers`` layers
(4 by default: 6.2 GB), with random weights written by this script into ``--model_dir``
(generated once, reused while its config matches; never committed).

Roofline: a decoded token reads every dense weight but the embedding (one row) plus
``top_k`` experts per layer; bytes per token / host read bandwidth (``ftjax.kernels
.read_probe`` over a buffer larger than the caches, same threads) is the fastest decode this
machine allows. Reported: decode tok/s and its ratio to that roofline, 512-token prefill
tok/s, both as medians over alternating rounds with the bandwidth probe; and the reference
numbers of llama.cpp (BF16, 2 threads, weights in RAM) on the same shape and machine class,
which the project issue gives: 52 tok/s decode (0.73 of the roofline), 640 tok/s prefill.

  /work/venv/bin/python benchmarks/decode_e2e.py            # ~3 min the first time
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_results  # noqa: E402

import ftjax  # noqa: E402
from ftjax.formats import ftw  # noqa: E402
from ftjax.model.config import ModelConfig  # noqa: E402
from ftjax.model import abstract_params  # noqa: E402
from ftjax.utils.progress import Progress  # noqa: E402

LLAMA_CPP_DECODE_TOK_S = 52.0  # issue 3: llama.cpp BF16, 2 threads, this shape, these machines
LLAMA_CPP_PREFILL_TOK_S = 640.0


def qwen3_30b_shape(layers: int) -> ModelConfig:
  return ModelConfig(
      model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_layers=layers,
      num_heads=32, num_kv_heads=4, head_dim=128, num_experts=128, top_k=8,
      moe_intermediate_size=768, rms_norm_eps=1e-6, rope_theta=1e6,
      max_position_embeddings=40960, layer_types=("full_attention",) * layers,
      qk_norm="per_head", norm_topk_prob=True, source_dtype="bfloat16")


def write_model(config: ModelConfig, out_dir: str, seed: int = 0) -> str:
  """Random bfloat16 weights, written tensor by tensor (slices of one random pool)."""
  import ml_dtypes  # noqa: PLC0415
  rng = np.random.default_rng(seed)
  pool = (rng.standard_normal(1 << 24, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
  norms = (1.0 + 0.1 * rng.standard_normal(1 << 16, np.float32))

  def take(shape, name):
    n = int(np.prod(shape))
    if "norm" in name:
      return np.resize(norms, n).reshape(shape)
    start = int(rng.integers(0, pool.size))
    return np.resize(np.roll(pool, -start)[: min(n, pool.size)], n).reshape(shape)

  writer = ftw.FTWWriter(out_dir, config, "bfloat16", {"kind": "random-init", "seed": seed,
                                                       "generator": "benchmarks/decode_e2e.py"})
  shapes = {n: tuple(a.shape) for n, a in abstract_params(config).items()}
  parts = ftw.expert_part_shapes(config)
  bar = Progress(len(shapes) + config.num_layers * config.num_experts, desc="write model")
  for name, shape in shapes.items():
    writer.add_tensor(name, take(shape, name))
    bar.update()
  for layer in range(config.num_layers):
    for expert in range(config.num_experts):
      for part, shape in parts.items():
        writer.add_expert_part(layer, expert, part, take(shape, part))
      bar.update()
  bar.close()
  return writer.close()


def load_bench_model(layers: int, model_dir: str) -> ftjax.Model:
  """The ``layers``-layer Qwen3-30B-A3B-shaped model in ``model_dir``, written there first if
  it is missing or its config differs; loaded pre-faulted (every page read before timing)."""
  config = qwen3_30b_shape(layers)
  path = os.path.join(model_dir, f"{layers}l")
  if ftw.is_ftw_dir(path) and ftw.FTWFile.open(path, verify=False).config == config:
    print(f"reusing {path}")
  else:
    import shutil  # noqa: PLC0415
    shutil.rmtree(path, ignore_errors=True)
    write_model(config, path)
  t0 = time.perf_counter()
  model = ftjax.load(path, verify=False, populate=True)
  print(f"loaded and pre-faulted {path} in {time.perf_counter() - t0:.1f} s")
  return model


def bytes_per_token(model: ftjax.Model) -> int:
  """Weights one decode step reads: all dense tensors but the embedding, top-k experts."""
  c = model.config
  dense = sum(t["nbytes"] for n, t in model.storage.index["tensors"].items() if n != "embed_vd")
  expert = c.expert_block_elems * model.dtype.itemsize
  return dense + c.num_layers * c.top_k * expert


def read_bandwidth(buf: jax.Array, repeats: int = 3) -> float:
  from ftjax.kernels import read_probe  # noqa: PLC0415
  read_probe(buf).block_until_ready()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    read_probe(buf).block_until_ready()
    times.append(time.perf_counter() - t0)
  return buf.nbytes / min(times)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--model_dir", default="/tmp/ftjax-bench/qwen3-30b-a3b-shape")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--decode_tokens", type=int, default=32)
  parser.add_argument("--prefill_tokens", type=int, default=512)
  parser.add_argument("--kernels", default="ffi_bf16", choices=["ffi", "ffi_bf16"],
                      help="ffi_bf16 (the default for bf16 models): bf16 activations")
  parser.add_argument("--xla_decode_tokens", type=int, default=4,
                      help="decode tokens with kernels=xla, for comparison (0 to skip)")
  args = parser.parse_args()

  model = load_bench_model(args.layers, args.model_dir)
  config = model.config
  per_token = bytes_per_token(model)
  # The probe buffer: one whole layer of experts (1.2 GB), far larger than the 32 MiB L3.
  probe = model.bank[0]

  engine = ftjax.Engine(model, kernels=args.kernels, max_seq_len=4096)
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, config.vocab_size, args.prefill_tokens).tolist()
  short = prompt[:8]
  engine.generate(short, 2)  # compile the decode shapes
  engine.generate(prompt, 1)  # compile the prefill shape

  rounds = []
  for r in range(args.rounds):
    bw = read_bandwidth(probe)
    dec = engine.generate_timed(short, args.decode_tokens + 1, greedy=True)
    pre = engine.generate_timed(prompt, 1, greedy=True)
    row = {"read_gb_s": bw / 1e9, "decode_tok_s": dec.decode_tok_s,
           "prefill_tok_s": pre.prefill_tok_s, "roofline_tok_s": bw / per_token}
    row["decode_vs_roofline"] = row["decode_tok_s"] / row["roofline_tok_s"]
    rounds.append(row)
    print(f"round {r}: read {row['read_gb_s']:.1f} GB/s, roofline {row['roofline_tok_s']:.1f} "
          f"tok/s, decode {row['decode_tok_s']:.1f} tok/s ({row['decode_vs_roofline']:.2f}), "
          f"prefill {row['prefill_tok_s']:.0f} tok/s")

  med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
  xla = None
  if args.xla_decode_tokens:
    xla_engine = ftjax.Engine(model, kernels="xla", max_seq_len=4096)
    xla_engine.generate(short, 2)
    xla = xla_engine.generate_timed(short, args.xla_decode_tokens + 1).decode_tok_s
  print(f"\nmedians over {args.rounds} rounds ({config.num_layers} layers, "
        f"{per_token / 1e9:.3f} GB read per decoded token):")
  print(f"  host read bandwidth        {med['read_gb_s']:.1f} GB/s")
  print(f"  roofline decode            {med['roofline_tok_s']:.1f} tok/s")
  print(f"  decode (kernels={args.kernels}) {med['decode_tok_s']:.1f} tok/s = "
        f"{med['decode_vs_roofline']:.2f} of the roofline (goal 0.80; llama.cpp "
        f"{LLAMA_CPP_DECODE_TOK_S:.0f} tok/s = 0.73)")
  print(f"  prefill {args.prefill_tokens} tokens         {med['prefill_tok_s']:.0f} tok/s = "
        f"{med['prefill_tok_s'] / LLAMA_CPP_PREFILL_TOK_S:.2f} x llama.cpp's "
        f"{LLAMA_CPP_PREFILL_TOK_S:.0f}")
  if xla is not None:
    print(f"  decode (kernels=xla)       {xla:.2f} tok/s")
  out = write_results("decode_e2e", {
      "machine": machine_info(), "config": dataclasses.asdict(config),
      "bytes_per_token": per_token, "rounds": rounds, "median": med,
      "decode_tok_s_xla": xla, "llama_cpp_reference": {
          "decode_tok_s": LLAMA_CPP_DECODE_TOK_S, "prefill_tok_s": LLAMA_CPP_PREFILL_TOK_S,
          "source": "project issue 3 (measured on these machines, not in this run)"},
      "args": vars(args)})
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
