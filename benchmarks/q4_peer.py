"""4-bit decode and prefill against llama.cpp's Q4_K_M of the same weights, side by side (issue
51): what a CPU user of each engine runs, every matrix quantised, not only the experts.

The model is ``cpu_peer.py``'s: Qwen3-30B-A3B's layer shapes at ``--layers`` layers (4), random
bfloat16 weights written once as a Hugging Face checkpoint. Each side quantises them with its
own tools:

  ftjax      ``ftjax.convert_hf(..., expert_dtype="mxfp4", dense_dtype="mixed4")``: routed
             experts MXFP4 (E2M1, an E8M0 scale per 32 inputs: 4.25 bits), attention
             projections MXFP4, lm_head and embedding int8 with float32 row scales (docs/ftw.md,
             "Dense formats"); routers and norms bfloat16. Kernels ``auto`` (exact: float32
             activations, the dequantised weights' products).
  llama.cpp  ``convert_hf_to_gguf.py --outtype bf16`` (cpu_peer.py's patched copy), then
             ``llama-quantize ... Q4_K_M`` (Q4_K, some tensors Q6_K: about 4.9 bits a weight at
             full size) and, where this llama.cpp has it, ``MXFP4_MOE`` (MXFP4 experts, the rest
             Q8_0). Activations quantised to 8 bits for its dot products.

Rounds alternate the sides (``--rounds``, medians reported), 2 threads, weights in RAM
(llama-bench ``-lm none``; ftjax faults its mapping in before each round; a llama-bench run that
crashes with its weight repacking runs again with ``--repack 0``, recorded in ``how``). Each
round measures
decode (``--tokens`` new tokens after 8 prompt tokens; llama-bench ``-p 0 -n N``) and the prefill
of ``--prefill`` tokens (llama-bench ``-p N -n 0``), and the machine's read bandwidth
(``read_probe`` over one layer's experts): each side's decode is also given as a ratio to its own
roofline (tok/s x bytes read per token / read bandwidth), bytes per token from ftjax's FTW index
and the GGUF's tensor table (``quant_peer.gguf_bytes_per_token``).

  python benchmarks/q4_peer.py --llama_src SRC --llama_build BUILD [--rounds 3]

Results: ``benchmarks/results/q4_peer.json`` (machine and ISA included) for 3 or more rounds;
``--smoke`` (1 round, 16 tokens, 128-token prefill) writes ``WORK_DIR/q4_peer-smoke.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_results  # noqa: E402
from cpu_peer import (RoundWorker, add_peer_arguments, check_llama_args,  # noqa: E402
                      convert_gguf, llama_bench, read_gb_s, serve_rounds, write_checkpoint)
from hybrid_e2e import contended, with_other_load  # noqa: E402
from quant_peer import gguf_bytes_per_token  # noqa: E402

THREADS = 2
GOAL = 1.0  # issue 51: decode >= 1.0x llama.cpp on the format of equal or more bits
PREFILL_GOAL = 1.2
# --ftjax_format: ftjax's 4-bit presets (docs/ftw.md): "mxfp4" (experts mxfp4, dense mixed4:
# 4.25-bit E2M1 with power-of-two scales) and "int4" (experts int4, dense mixed_int4: 4.5 bits,
# a scale and a min per 32 weights, the quality preset of benchmarks/dense_quality.py).
FTJAX_FORMATS = {
    "mxfp4": {"expert_dtype": "mxfp4", "dense_dtype": "mixed4"},
    "int4": {"expert_dtype": "int4", "dense_dtype": "mixed_int4"},
}
FTJAX_DESCRIPTIONS = {
    "mxfp4": "experts mxfp4; --dense_dtype=mixed4 (mxfp4 input projections; int8 value and "
             "output projections, lm_head and embedding); routers and norms bfloat16",
    "int4": "experts int4; --dense_dtype=mixed_int4 (int4 input projections; int8 value and "
            "output projections, lm_head and embedding); routers and norms bfloat16",
}


def log(msg: str) -> None:
  print(f"[q4_peer] {msg}", file=sys.stderr, flush=True)


def convert_ftjax(hf_dir: str, work_dir: str, fmt: str = "mxfp4") -> str:
  """The checkpoint in ftjax's 4-bit preset ``fmt``, converted once per checkpoint."""
  import ftjax  # noqa: PLC0415
  from ftjax.formats import ftw, hf  # noqa: PLC0415
  out = os.path.join(work_dir, "ftw-q4" if fmt == "mxfp4" else f"ftw-q4-{fmt}")
  spec = FTJAX_FORMATS[fmt]
  if ftw.is_ftw_dir(out):
    f = ftw.FTWFile.open(out, verify=False)
    if f.fingerprint == hf.fingerprint(hf_dir) and f.expert_format == fmt and \
        fmt in f.dense_formats():
      return out
  log(f"converting to FTW ({spec}) -> {out}")
  t0 = time.perf_counter()
  path = ftjax.convert_hf(hf_dir, out, dtype="bfloat16", overwrite=True, show_progress=False,
                          **spec)
  log(f"converted in {time.perf_counter() - t0:.0f} s")
  return path


def llama_quantize(build: str, bf16: str, kind: str, work_dir: str) -> str | None:
  """``llama-quantize bf16 -> kind`` once; None when this llama.cpp does not know ``kind``."""
  out = os.path.join(work_dir, f"model-{kind}.gguf")
  if os.path.exists(out) and os.path.getmtime(out) > os.path.getmtime(bf16):
    return out
  tool = os.path.join(build, "bin", "llama-quantize")
  log(f"llama-quantize {kind} -> {out}")
  done = subprocess.run([tool, bf16, out + ".partial", kind, str(THREADS)],
                        capture_output=True, text=True)
  if done.returncode != 0:
    log(f"llama-quantize {kind} failed ({done.returncode}): {done.stderr.strip()[-300:]}")
    return None
  os.replace(out + ".partial", out)
  return out


def llama_measure(build: str, gguf: str, *args: str) -> dict:
  """llama-bench's tok/s for ``args``, with its default weight repacking; where that run
  crashes, again with ``--repack 0``, and the crash recorded. (On this project's Xeon with
  AMX, llama.cpp 0.3.36's repacked prefill died with SIGSEGV on Q4_K_M and SIGILL on
  MXFP4_MOE; decode ran.)"""
  try:
    return {"tok_s": llama_bench(build, gguf, *args)["avg_ts"], "repack": True}
  except subprocess.CalledProcessError as e:
    if e.returncode >= 0:
      raise
    crash = f"signal {-e.returncode} with repacking"
  return {"tok_s": llama_bench(build, gguf, *args, "--repack", "0")["avg_ts"], "repack": False,
          "crash": crash}


def ftjax_bytes_per_token(model) -> int:
  """The FTW's dense tensors but the embedding, plus top_k experts per MoE layer."""
  c = model.config
  dense = sum(t["nbytes"] for n, t in model.storage.index["tensors"].items() if n != "embed_vd")
  return dense + c.num_moe_layers * c.top_k * model.expert_bytes


def worker(ftw_dir: str, tokens: int, prefill: int) -> None:
  import numpy as np  # noqa: PLC0415

  import ftjax  # noqa: PLC0415
  t0 = time.perf_counter()
  model = ftjax.load(ftw_dir, verify=False, populate=True)
  log(f"ftjax: loaded (weights {model.storage.residency}, dense {model.dense_formats}, experts "
      f"{model.expert_format}) in {time.perf_counter() - t0:.1f} s")
  engine = ftjax.Engine(model, max_seq_len=prefill + 64)
  rng = np.random.default_rng(0)
  prompt = rng.integers(0, model.config.vocab_size, 8)
  long_prompt = rng.integers(0, model.config.vocab_size, prefill)
  experts = model.bank[0]

  def measure() -> dict:
    model.storage.populate()
    out = {"read_GBps": read_gb_s(experts)}
    out["decode"] = engine.generate_timed(prompt, tokens + 1).decode_tok_s
    out["prefill"] = engine.generate_timed(long_prompt, 1).prefill_tok_s
    return out

  serve_rounds(measure, {"kernels": engine.kernels_path,
                         "bytes_per_token": ftjax_bytes_per_token(model)})


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  add_peer_arguments(
      p, hf_dir="/tmp/ftjax-cpu-peer/hf-4l", work_dir="/tmp/ftjax-q4-peer",
      hf_help="the random bf16 checkpoint (written by cpu_peer.py's code if missing)",
      smoke_help="1 round, 16 tokens, 128-token prefill; results to WORK_DIR",
      results="q4_peer")
  p.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill measure")
  p.add_argument("--ftjax_format", choices=sorted(FTJAX_FORMATS), default="mxfp4",
                 help="ftjax's 4-bit preset (results: q4_peer.json for mxfp4, "
                 "q4_peer_int4.json for int4)")
  args = p.parse_args()
  if args.worker:
    worker(args.ftw_dir, args.tokens, args.prefill)
    return
  if args.smoke:
    args.rounds, args.tokens, args.prefill = 1, 16, 128
  check_llama_args(p, args)
  out = args.out
  if out is None and (args.smoke or args.rounds < 3):
    out = os.path.join(args.work_dir, "q4_peer-smoke.json")
  os.makedirs(args.work_dir, exist_ok=True)
  hf_dir = write_checkpoint(args.layers, args.hf_dir)
  bf16 = convert_gguf(hf_dir, args.llama_src, os.path.dirname(os.path.abspath(hf_dir)))
  ggufs = {k: g for k in ("Q4_K_M", "MXFP4_MOE")
           if (g := llama_quantize(args.llama_build, bf16, k, args.work_dir)) is not None}
  ftw_dir = convert_ftjax(hf_dir, args.work_dir, args.ftjax_format)
  with open(os.path.join(hf_dir, "config.json")) as f:
    top_k = json.load(f)["num_experts_per_tok"]
  llama_bytes = {k: gguf_bytes_per_token(g, args.llama_src, top_k) for k, g in ggufs.items()}
  machine = machine_info()
  log(f"machine: {machine['cpu_model']}, kernels {machine['ftjax_kernels']}")
  ftjax_worker = RoundWorker(__file__, "--ftw_dir", ftw_dir, "--tokens", str(args.tokens),
                             "--prefill", str(args.prefill))
  ready, proc = ftjax_worker.ready, ftjax_worker.proc
  log(f"ftjax reads {ready['bytes_per_token'] / 1e9:.3f} GB per token; llama.cpp " + ", ".join(
      f"{k} {b / 1e9:.3f}" for k, b in llama_bytes.items()))
  sides = ["ftjax", *ggufs]
  rounds = []
  for r in range(args.rounds):
    row = {"llama_cpp": {}}
    for side in (sides if r % 2 == 0 else sides[::-1]):
      if side == "ftjax":
        row["ftjax"] = with_other_load(ftjax_worker.ask, proc.pid)
        continue
      g = ggufs[side]
      def llama_side(g=g):
        decode = llama_measure(args.llama_build, g, "-p", "0", "-n", str(args.tokens))
        prefill = llama_measure(args.llama_build, g, "-p", str(args.prefill), "-n", "0")
        return {"decode": decode.pop("tok_s"), "prefill": prefill.pop("tok_s"),
                "how": {"decode": decode, "prefill": prefill}}
      row["llama_cpp"][side] = with_other_load(llama_side, proc.pid)
    ours, read = row["ftjax"], row["ftjax"]["read_GBps"]
    row["ratio"] = {f"{m}/{k}": ours[m] / v[m] for k, v in row["llama_cpp"].items()
                    for m in ("decode", "prefill")}
    row["roofline"] = {"ftjax": ours["decode"] * ready["bytes_per_token"] / 1e9 / read,
                       **{k: v["decode"] * llama_bytes[k] / 1e9 / read
                          for k, v in row["llama_cpp"].items()}}
    rounds.append(row)
    log(f"round {r + 1}/{args.rounds}: read {read:.1f} GB/s, ftjax decode {ours['decode']:.1f} "
        f"tok/s ({row['roofline']['ftjax']:.2f} of its roofline), prefill "
        f"{ours['prefill']:.0f}" + contended(ours) + "".join(
            f"; {k} decode {v['decode']:.1f} ({row['roofline'][k]:.2f}), prefill "
            f"{v['prefill']:.0f}" + contended(v) for k, v in row["llama_cpp"].items())
        + "; ratios " + ", ".join(f"{k} {x:.2f}" for k, x in row["ratio"].items()))
  ftjax_worker.close()

  def med(fn):
    return statistics.median(fn(r) for r in rounds)

  results = {
      "benchmark": "q4_peer", "command": " ".join(sys.argv), "smoke": args.smoke,
      "machine": machine,
      "model": {"shape": "Qwen3-30B-A3B", "layers": args.layers, "source_dtype": "bfloat16"},
      "ftjax": {"format": FTJAX_DESCRIPTIONS[args.ftjax_format],
                "convert": FTJAX_FORMATS[args.ftjax_format], "kernels": ready["kernels"],
                "bytes_per_token": ready["bytes_per_token"]},
      "llama_cpp": {"build": args.llama_build, "flags": f"-t {THREADS} -r 1 -lm none",
                    "formats": {k: {"gguf": f"llama-quantize BF16 -> {k}",
                                    "bytes_per_token": llama_bytes[k]} for k in ggufs}},
      "threads": THREADS, "decode_tokens": args.tokens, "prefill_tokens": args.prefill,
      "rounds": rounds,
      "medians": {"ftjax": {m: med(lambda r, m=m: r["ftjax"][m]) for m in ("decode", "prefill")},
                  **{k: {m: med(lambda r, k=k, m=m: r["llama_cpp"][k][m])
                         for m in ("decode", "prefill")} for k in ggufs}},
      "read_GBps_median": med(lambda r: r["ftjax"]["read_GBps"]),
      "ratio_medians": {k: med(lambda r, k=k: r["ratio"][k]) for k in rounds[0]["ratio"]},
      "roofline_ratio_medians": {k: med(lambda r, k=k: r["roofline"][k])
                                 for k in rounds[0]["roofline"]},
      "goals": {"decode": GOAL, "prefill": PREFILL_GOAL},
      "contended_measurements": sum(side["other_load"] > 0.1 for r in rounds
                                    for side in (r["ftjax"], *r["llama_cpp"].values())),
  }
  results["goal_met"] = {k: v >= (GOAL if k.startswith("decode") else PREFILL_GOAL)
                         for k, v in results["ratio_medians"].items()}
  for side, m in results["medians"].items():
    print(f"{side}: decode {m['decode']:.1f} tok/s, prefill {m['prefill']:.0f} tok/s")
  print("ratios (medians; goals decode 1.0, prefill 1.2): " + ", ".join(
      f"{k} {v:.2f}" for k, v in results["ratio_medians"].items()))
  print(f"of the roofline (read {results['read_GBps_median']:.1f} GB/s): " + ", ".join(
      f"{k} {v:.2f}" for k, v in results["roofline_ratio_medians"].items()))
  name = "q4_peer" if args.ftjax_format == "mxfp4" else f"q4_peer_{args.ftjax_format}"
  print(f"results: {write_results(name, results, out)}")


if __name__ == "__main__":
  main()
