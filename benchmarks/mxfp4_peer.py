"""MXFP4-expert decode against llama.cpp's MXFP4 GGUF of the same weights, side by side
(issue 16).

The model: gpt-oss-20b's shapes (configs/models/gpt-oss-20b.json) at ``--layers`` layers (4),
random weights written once as a Hugging Face checkpoint the way gpt-oss ships: bfloat16 dense
tensors and expert biases, experts as MXFP4 ``*_blocks`` (uint8 E2M1 codes, random) and
``*_scales`` (E8M0 exponents 118-121: weights of rms ~0.02), ``quantization_config`` mxfp4.
Neither side quantises anything; each repacks the shipped bytes with its own converter:

  ftjax      ``ftjax.convert_hf(..., dtype="bfloat16")``: an FTW ``mxfp4`` bank (codes, scales,
             float32 biases; docs/ftw.md), dense weights bfloat16; kernels ``auto`` (the mxfp4
             host kernel: codes decoded exactly, float32 activations and FMA).
  llama.cpp  ``convert_hf_to_gguf.py --outtype bf16`` (the copy patched as ``cpu_peer.py``
             does): its gpt-oss path repacks the MXFP4 experts losslessly into ``block_mxfp4``
             (file type MOSTLY_MXFP4_MOE), the other tensors bfloat16: the same bytes.

Rounds alternate the two sides (``--rounds``, medians), 2 threads, weights in RAM (llama-bench
``-lm none``; ftjax faults its mapping back in before each round), decode of ``--tokens`` new
tokens after a short prompt. Every round measures the read bandwidth (``read_probe`` over one
layer's experts) and each side's decode as a ratio to its own roofline: tok/s x bytes read per
token / read bandwidth, the bytes from ftjax's FTW index and from the GGUF's tensor table
(``quant_peer.py``'s counting: everything but the embedding, top_k of E experts).

  python benchmarks/mxfp4_peer.py --llama_src SRC --llama_build BUILD [--rounds 5]

Results: ``benchmarks/results/mxfp4_peer.json`` (machine and ISA included) for a run of at
least 3 rounds. ``--smoke`` checks the whole pipeline on a small variant (1 layer, vocabulary
32768, 1 round of 16 tokens, its own checkpoint and work dirs) and writes
``WORK_DIR-smoke/mxfp4_peer-smoke.json``, never the committed file.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_results  # noqa: E402
from cpu_peer import (RoundWorker, add_peer_arguments, check_llama_args,  # noqa: E402
                      convert_gguf, llama_bench, pool_slice, read_gb_s, serve_rounds,
                      write_config_and_tokenizer)
from hybrid_e2e import contended, with_other_load  # noqa: E402
from quant_peer import ftjax_bytes_per_token, gguf_bytes_per_token  # noqa: E402

THREADS = 2
GOAL = 1.1  # issue 16: MXFP4 decode >= 1.1x llama.cpp's MXFP4
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPE = os.path.join(REPO, "configs", "models", "gpt-oss-20b.json")
SCALE_EXPONENTS = (118, 122)  # [low, high): E2M1 rms ~2.9 x 2^-7 ~ 0.02


def log(msg: str) -> None:
  print(f"[mxfp4_peer] {msg}", file=sys.stderr, flush=True)


# -- The checkpoint -------------------------------------------------------------------------------

def hf_config(layers: int, vocab: int | None) -> dict:
  with open(SHAPE) as f:
    config = json.load(f)
  config["num_hidden_layers"] = layers
  config["layer_types"] = config["layer_types"][:layers]
  if vocab is not None:
    config.update(vocab_size=vocab, eos_token_id=1, pad_token_id=0)
  config["bos_token_id"] = 0
  return config


def tensor_specs(c: dict) -> dict[str, tuple[str, tuple[int, ...]]]:
  """name -> (safetensors dtype, shape) of a gpt-oss checkpoint with MXFP4 experts."""
  d, v, e = c["hidden_size"], c["vocab_size"], c["num_local_experts"]
  f, a = c["intermediate_size"], c["head_dim"]
  h, g = c["num_attention_heads"], c["num_key_value_heads"]
  specs = {"model.embed_tokens.weight": ("BF16", (v, d)), "model.norm.weight": ("BF16", (d,)),
           "lm_head.weight": ("BF16", (v, d))}
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}."
    specs.update({
        p + "input_layernorm.weight": ("BF16", (d,)),
        p + "post_attention_layernorm.weight": ("BF16", (d,)),
        p + "self_attn.q_proj.weight": ("BF16", (h * a, d)),
        p + "self_attn.q_proj.bias": ("BF16", (h * a,)),
        p + "self_attn.k_proj.weight": ("BF16", (g * a, d)),
        p + "self_attn.k_proj.bias": ("BF16", (g * a,)),
        p + "self_attn.v_proj.weight": ("BF16", (g * a, d)),
        p + "self_attn.v_proj.bias": ("BF16", (g * a,)),
        p + "self_attn.o_proj.weight": ("BF16", (d, h * a)),
        p + "self_attn.o_proj.bias": ("BF16", (d,)),
        p + "self_attn.sinks": ("BF16", (h,)),
        p + "mlp.router.weight": ("BF16", (e, d)),
        p + "mlp.router.bias": ("BF16", (e,)),
        p + "mlp.experts.gate_up_proj_blocks": ("U8", (e, 2 * f, d // 32, 16)),
        p + "mlp.experts.gate_up_proj_scales": ("U8", (e, 2 * f, d // 32)),
        p + "mlp.experts.gate_up_proj_bias": ("BF16", (e, 2 * f)),
        p + "mlp.experts.down_proj_blocks": ("U8", (e, d, f // 32, 16)),
        p + "mlp.experts.down_proj_scales": ("U8", (e, d, f // 32)),
        p + "mlp.experts.down_proj_bias": ("BF16", (e, d)),
    })
  return specs


def write_checkpoint(layers: int, vocab: int | None, out_dir: str, seed: int = 0) -> str:
  """Random weights as one safetensors file (header + raw bytes, names sorted as llama.cpp's
  converter reads them), the config and the default model's tokenizer as a stand-in. Skipped
  when already there."""
  import ml_dtypes  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  marker = os.path.join(out_dir, "written.json")
  stamp = {"layers": layers, "vocab": vocab, "seed": seed, "format": 1}
  if os.path.exists(marker) and json.load(open(marker)) == stamp:
    return out_dir
  shutil.rmtree(out_dir, ignore_errors=True)
  os.makedirs(out_dir)
  config = hf_config(layers, vocab)
  specs = dict(sorted(tensor_specs(config).items()))
  header, offset = {}, 0
  for name, (dtype, shape) in specs.items():
    n = (2 if dtype == "BF16" else 1) * int(np.prod(shape))
    header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
    offset += n
  blob = json.dumps(header).encode()
  blob += b" " * (-len(blob) % 8)
  rng = np.random.default_rng(seed)
  pool = (rng.standard_normal(1 << 24, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
  codes = rng.integers(0, 256, 1 << 24, dtype=np.uint8)
  log(f"writing {offset / 1e9:.2f} GB of random weights (MXFP4 experts) to {out_dir}")
  with open(os.path.join(out_dir, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name, (dtype, shape) in specs.items():
      n = int(np.prod(shape))
      if name.endswith("_scales"):
        x = rng.integers(*SCALE_EXPONENTS, n, dtype=np.uint8)
      elif name.endswith("_blocks"):
        x = pool_slice(codes, n, rng)
      elif "norm" in name:
        x = (1.0 + 0.1 * rng.standard_normal(n, np.float32)).astype(ml_dtypes.bfloat16)
      else:
        x = pool_slice(pool, n, rng)
      f.write(x.tobytes())
  write_config_and_tokenizer(out_dir, config)
  with open(marker, "w") as f:
    json.dump(stamp, f)
  return out_dir


def convert_ftjax(hf_dir: str, work_dir: str) -> str:
  """The checkpoint as an mxfp4-expert FTW in the work dir, converted once per checkpoint."""
  import ftjax  # noqa: PLC0415
  from ftjax.formats import ftw, hf  # noqa: PLC0415
  out = os.path.join(work_dir, "ftw-mxfp4")
  if ftw.is_ftw_dir(out):
    index = ftw.FTWFile.open(out, verify=False).index
    if index["source"].get("fingerprint") == hf.fingerprint(hf_dir):
      return out
  log(f"converting to FTW with mxfp4 experts -> {out}")
  return ftjax.convert_hf(hf_dir, out, dtype="bfloat16", overwrite=True)


# -- ftjax side (a worker process) ----------------------------------------------------------------

def worker(ftw_dir: str, tokens: int) -> None:
  """Round after round on request (stdin lines), one JSON line each on stdout."""
  import numpy as np  # noqa: PLC0415

  import ftjax  # noqa: PLC0415
  t0 = time.perf_counter()
  model = ftjax.load(ftw_dir, verify=False, populate=True)
  if model.expert_format != "mxfp4":
    raise SystemExit(f"{ftw_dir} holds {model.expert_format} experts, not mxfp4")
  log(f"ftjax: loaded (weights {model.storage.residency}) in {time.perf_counter() - t0:.1f} s")
  engine = ftjax.Engine(model)
  prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, 8)
  experts = model.bank[0]  # one layer's expert blocks, for the read probe

  def measure() -> dict:
    model.storage.populate()  # llama.cpp's run may have pushed the mapping out of the cache
    return {"read_GBps": read_gb_s(experts),
            "ftjax": engine.generate_timed(prompt, tokens + 1).decode_tok_s}

  serve_rounds(measure, {"kernels": engine.kernels_path,
                         "bytes_per_token": ftjax_bytes_per_token(model)})


# -- Driver ---------------------------------------------------------------------------------------

def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  add_peer_arguments(
      p, hf_dir="/tmp/ftjax-mxfp4-peer/hf", work_dir="/tmp/ftjax-mxfp4-peer/work",
      hf_help="the random MXFP4 checkpoint (written here when missing)",
      smoke_help="1 layer, vocabulary 32768, 1 round of 16 tokens, own dirs; results to "
                 "WORK_DIR-smoke, never the committed file", results="mxfp4_peer")
  args = p.parse_args()
  if args.worker:
    worker(args.ftw_dir, args.tokens)
    return
  vocab = None
  if args.smoke:
    args.rounds, args.tokens, args.layers, vocab = 1, 16, 1, 32768
    args.hf_dir, args.work_dir = args.hf_dir + "-smoke", args.work_dir + "-smoke"
  check_llama_args(p, args)
  out = args.out
  if out is None and (args.smoke or args.rounds < 3):
    out = os.path.join(args.work_dir, "mxfp4_peer-smoke.json")  # not results worth committing
  os.makedirs(args.work_dir, exist_ok=True)
  hf_dir = write_checkpoint(args.layers, vocab, args.hf_dir)
  gguf = convert_gguf(hf_dir, args.llama_src, args.work_dir, outtype="bf16")
  ftw_dir = convert_ftjax(hf_dir, args.work_dir)
  with open(os.path.join(hf_dir, "config.json")) as f:
    top_k = json.load(f)["num_experts_per_tok"]
  llama_bytes = gguf_bytes_per_token(gguf, args.llama_src, top_k)
  machine = machine_info()
  log(f"machine: {machine['cpu_model']}, kernels {machine['ftjax_kernels']}")
  ftjax_worker = RoundWorker(__file__, "--ftw_dir", ftw_dir, "--tokens", str(args.tokens))
  ready, proc = ftjax_worker.ready, ftjax_worker.proc
  log(f"ftjax worker ready: {ready}; llama.cpp reads {llama_bytes / 1e9:.3f} GB per token")

  rounds = []
  for r in range(args.rounds):
    row = {}
    for side in (("ftjax", "llama_cpp") if r % 2 == 0 else ("llama_cpp", "ftjax")):
      if side == "ftjax":
        row["ftjax"] = with_other_load(ftjax_worker.ask, proc.pid)
      else:
        row["llama_cpp"] = with_other_load(lambda: {"decode": llama_bench(
            args.llama_build, gguf, "-p", "0", "-n", str(args.tokens))["avg_ts"]}, proc.pid)
    ours, theirs, read = row["ftjax"]["ftjax"], row["llama_cpp"]["decode"], row["ftjax"]["read_GBps"]
    row["ratio"] = ours / theirs
    row["roofline"] = {"ftjax": ours * ready["bytes_per_token"] / 1e9 / read,
                       "llama_cpp": theirs * llama_bytes / 1e9 / read}
    rounds.append(row)
    log(f"round {r + 1}/{args.rounds}: read {read:.1f} GB/s, ftjax {ours:.1f} tok/s "
        f"({row['roofline']['ftjax']:.2f} of its roofline){contended(row['ftjax'])}; llama.cpp "
        f"{theirs:.1f} tok/s ({row['roofline']['llama_cpp']:.2f}){contended(row['llama_cpp'])}; "
        f"ratio {row['ratio']:.2f}")
  ftjax_worker.close()
  med = {"ftjax": statistics.median(r["ftjax"]["ftjax"] for r in rounds),
         "llama_cpp": statistics.median(r["llama_cpp"]["decode"] for r in rounds)}
  ratio = statistics.median(r["ratio"] for r in rounds)
  roofline = {k: statistics.median(r["roofline"][k] for r in rounds) for k in med}
  results = {
      "benchmark": "mxfp4_peer", "command": " ".join(sys.argv), "smoke": args.smoke,
      "machine": machine,
      "model": {"shape": "gpt-oss-20b", "layers": args.layers,
                "vocab": vocab or hf_config(args.layers, None)["vocab_size"],
                "experts": "MXFP4 as shipped (random codes, E8M0 118-121)",
                "dense": "bfloat16"},
      "ftjax": {"format": "mxfp4 experts (codes, E8M0 scales, float32 biases), bfloat16 dense",
                "kernels": ready["kernels"], "bytes_per_token": ready["bytes_per_token"]},
      "llama_cpp": {"build": args.llama_build, "gguf": "convert_hf_to_gguf.py --outtype bf16 "
                    "(MXFP4 experts repacked, MOSTLY_MXFP4_MOE)",
                    "flags": f"-t {THREADS} -r 1 -lm none -p 0 -n {args.tokens}",
                    "bytes_per_token": llama_bytes},
      "threads": THREADS, "decode_tokens": args.tokens, "rounds": rounds,
      "decode_tok_s_medians": med,
      "read_GBps_median": statistics.median(r["ftjax"]["read_GBps"] for r in rounds),
      "ratio_median": ratio, "roofline_ratio_medians": roofline,
      "goal": GOAL, "goal_met": ratio >= GOAL,
      "contended_measurements": sum(r[s]["other_load"] > 0.1 for r in rounds
                                    for s in ("ftjax", "llama_cpp")),
  }
  print(f"decode tok/s (medians): ftjax {med['ftjax']:.1f}, llama.cpp {med['llama_cpp']:.1f}; "
        f"ratio {ratio:.2f} (goal {GOAL})")
  print(f"of the roofline (read {results['read_GBps_median']:.1f} GB/s; ftjax reads "
        f"{ready['bytes_per_token'] / 1e9:.3f} GB per token, llama.cpp {llama_bytes / 1e9:.3f}): "
        f"ftjax {roofline['ftjax']:.2f}, llama.cpp {roofline['llama_cpp']:.2f}")
  print(f"results: {write_results('mxfp4_peer', results, out)}")


if __name__ == "__main__":
  main()
