"""int8-expert decode against llama.cpp's Q8_0 of the same weights, side by side (issue 16).

The model is ``cpu_peer.py``'s: Qwen3-30B-A3B's layer shapes at ``--layers`` layers (4), random
bfloat16 weights written once as a Hugging Face checkpoint (``--hf_dir``; made by
``cpu_peer.write_checkpoint`` when missing). Each side quantises those weights with its own
converter:

  ftjax      ``ftjax.convert_hf(..., dtype="bfloat16", expert_dtype="int8")``: routed experts
             int8, symmetric per output channel with float32 row scales (docs/ftw.md); dense
             weights bfloat16. Measured twice, in one worker process:
               ftjax          kernels ``auto``: the exact int8 host kernel (int8 weights
                              widened to float32, float32 activations);
               ftjax_int8act  kernels ``ffi_int8``, the opt-in: activations quantised to int8
                              per token (per route for the expert's hidden), vpdpbusd; only on
                              AVX-512-VNNI CPUs (skipped elsewhere, and said so).
  llama.cpp  ``convert_hf_to_gguf.py --outtype q8_0`` (the copy patched as ``cpu_peer.py``
             does): Q8_0 blocks of 32 weights with one float16 scale (34 bytes per 32 weights)
             for every matrix (attention and lm_head too), float32 norms; activations
             quantised to 8 bits for its dot products. Measured twice:
               q8_0          that file as converted (llama.cpp's usual Q8_0 model: it reads
                             fewer dense bytes than ftjax, whose dense weights stay bf16);
               q8_0_experts  the same split as ftjax's: the routed experts (``*_exps``) of
                             the Q8_0 file with every other tensor of ``--outtype bf16``'s
                             file, combined tensor by tensor with ``gguf-py``.

Rounds alternate the two sides (``--rounds``, medians reported), 2 threads, weights in RAM
(llama-bench ``-lm none``; ftjax faults its mapping back in before each round). Each measures
decode: ``--tokens`` new tokens after a short prompt (ftjax: 8 prompt tokens, greedy; llama-bench
``-p 0 -n N``). Every round also measures the machine's read bandwidth
(``ftjax.kernels.read_probe`` over one layer's experts) and reports each side's decode as a
ratio to its own roofline: tok/s x the bytes that side reads per token / read bandwidth. Bytes
per token: the tensors read for one token (everything but the embedding table, whose one row is
negligible; the routed experts top_k of E per layer), from ftjax's FTW index and from the GGUF's
tensor table (``gguf-py``).

  python benchmarks/quant_peer.py --llama_src SRC --llama_build BUILD [--rounds 5]

Results: ``benchmarks/results/quant_peer.json`` (machine and ISA included) for a run of at least
3 rounds; ``--smoke`` (1 round, 16 tokens) checks the whole pipeline and writes
``WORK_DIR/quant_peer-smoke.json`` instead, never the committed file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_results  # noqa: E402
from cpu_peer import (RoundWorker, add_peer_arguments, check_llama_args,  # noqa: E402
                      convert_gguf, llama_bench, read_gb_s, serve_rounds, write_checkpoint)
from hybrid_e2e import contended, with_other_load  # noqa: E402

THREADS = 2
GOAL = 1.1  # issue 16: int8 decode >= 1.1x llama.cpp Q8_0


def log(msg: str) -> None:
  print(f"[quant_peer] {msg}", file=sys.stderr, flush=True)


def convert_ftjax_int8(hf_dir: str, work_dir: str) -> str:
  """The checkpoint as an int8-expert FTW in the work dir, converted once per checkpoint."""
  import ftjax  # noqa: PLC0415
  from ftjax.formats import ftw, hf  # noqa: PLC0415
  out = os.path.join(work_dir, "ftw-int8")
  if ftw.is_ftw_dir(out):
    index = ftw.FTWFile.open(out, verify=False).index
    if (index["source"].get("fingerprint") == hf.fingerprint(hf_dir)
        and index["experts"].get("format") == "int8"):
      return out
  log(f"converting to FTW with int8 experts -> {out}")
  return ftjax.convert_hf(hf_dir, out, dtype="bfloat16", expert_dtype="int8", overwrite=True)


def experts_only_gguf(bf16: str, q8: str, src: str, work_dir: str) -> str:
  """A GGUF with the Q8_0 file's routed experts (``*_exps``) and the bf16 file's other
  tensors and metadata; made once."""
  out = os.path.join(work_dir, "model-q8_0-experts.gguf")
  if os.path.exists(out) and os.path.getmtime(out) > max(os.path.getmtime(bf16),
                                                         os.path.getmtime(q8)):
    return out
  sys.path.insert(0, os.path.join(src, "gguf-py"))
  import gguf  # noqa: PLC0415
  dense, quantised = gguf.GGUFReader(bf16), gguf.GGUFReader(q8)
  experts = {t.name: t for t in quantised.tensors if "_exps" in t.name}
  arch = dense.fields[gguf.Keys.General.ARCHITECTURE].contents()
  log(f"combining {len(experts)} Q8_0 expert tensors with the bf16 rest -> {out}")
  writer = gguf.GGUFWriter(out + ".partial", arch=arch)
  for field in dense.fields.values():  # GGUF.* and the architecture are the writer's own
    if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
      continue
    kind = field.types[0]
    writer.add_key_value(field.name, field.contents(), kind,
                         sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
  tensors = [experts.get(t.name, t) for t in dense.tensors]
  for t in tensors:
    writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_ti_data_to_file()
  for t in tensors:
    writer.write_tensor_data(t.data)
  writer.close()
  os.replace(out + ".partial", out)
  return out


def gguf_bytes_per_token(gguf: str, src: str, top_k: int) -> int:
  """Bytes llama.cpp reads for one decoded token: every tensor of the GGUF but the embedding
  table, the routed expert tensors (``*_exps``, [E, ...]) counted for top_k of their E
  experts."""
  sys.path.insert(0, os.path.join(src, "gguf-py"))
  from gguf import GGUFReader  # noqa: PLC0415
  total = 0
  for t in GGUFReader(gguf).tensors:
    if t.name == "token_embd.weight":
      continue
    if "_exps" in t.name:
      experts = int(t.shape[-1])  # gguf-py lists dimensions innermost first
      total += int(t.n_bytes) * top_k // experts
    else:
      total += int(t.n_bytes)
  return total


# -- ftjax side (a worker process) ----------------------------------------------------------------

def ftjax_bytes_per_token(model) -> int:
  """The FTW's dense tensors but the embedding, plus top_k int8 experts (weights and scales)
  per MoE layer."""
  c = model.config
  dense = sum(t["nbytes"] for n, t in model.storage.index["tensors"].items() if n != "embed_vd")
  return dense + c.num_moe_layers * c.top_k * model.expert_bytes


def worker(ftw_dir: str, tokens: int) -> None:
  """Round after round on request (stdin lines), one JSON line each on stdout."""
  import numpy as np  # noqa: PLC0415

  import ftjax  # noqa: PLC0415
  from ftjax.kernels import cpu_info  # noqa: PLC0415
  t0 = time.perf_counter()
  model = ftjax.load(ftw_dir, verify=False, populate=True)
  if model.expert_format != "int8":
    raise SystemExit(f"{ftw_dir} holds {model.expert_format} experts, not int8")
  log(f"ftjax: loaded (weights {model.storage.residency}) in {time.perf_counter() - t0:.1f} s")
  engines = {"ftjax": ftjax.Engine(model)}
  if cpu_info()["isa"] == "avx512bf16":  # the AVX-512-VNNI kernels
    engines["ftjax_int8act"] = ftjax.Engine(model, kernels="ffi_int8")
  else:
    log(f"no AVX-512-VNNI kernels ({cpu_info()['isa']}): ftjax_int8act is not measured")
  prompt = np.random.default_rng(0).integers(0, model.config.vocab_size, 8)
  experts = model.bank[0]  # one layer's expert blocks, for the read probe

  def measure() -> dict:
    model.storage.populate()  # llama.cpp's run may have pushed the mapping out of the cache
    out = {"read_GBps": read_gb_s(experts)}
    for name, engine in engines.items():
      out[name] = engine.generate_timed(prompt, tokens + 1).decode_tok_s
    return out

  serve_rounds(measure, {"kernels": {k: e.kernels_path for k, e in engines.items()},
                         "bytes_per_token": ftjax_bytes_per_token(model)})


# -- Driver ---------------------------------------------------------------------------------------

def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  add_peer_arguments(
      p, hf_dir="/tmp/ftjax-cpu-peer/hf-4l", work_dir="/tmp/ftjax-quant-peer",
      hf_help="the random bf16 checkpoint (written by cpu_peer.py's code if missing)",
      smoke_help="1 round of 16 tokens; results to WORK_DIR, never the committed file",
      results="quant_peer")
  args = p.parse_args()
  if args.worker:
    worker(args.ftw_dir, args.tokens)
    return
  if args.smoke:
    args.rounds, args.tokens = 1, 16
  check_llama_args(p, args)
  out = args.out
  if out is None and (args.smoke or args.rounds < 3):
    out = os.path.join(args.work_dir, "quant_peer-smoke.json")  # not results worth committing
  os.makedirs(args.work_dir, exist_ok=True)
  hf_dir = write_checkpoint(args.layers, args.hf_dir)
  q8 = convert_gguf(hf_dir, args.llama_src, args.work_dir, outtype="q8_0")
  # cpu_peer.py's bf16 conversion next to the checkpoint (made there when missing)
  bf16 = convert_gguf(hf_dir, args.llama_src, os.path.dirname(os.path.abspath(hf_dir)))
  ggufs = {"q8_0": q8, "q8_0_experts": experts_only_gguf(bf16, q8, args.llama_src,
                                                         args.work_dir)}
  ftw_dir = convert_ftjax_int8(hf_dir, args.work_dir)
  with open(os.path.join(hf_dir, "config.json")) as f:
    top_k = json.load(f)["num_experts_per_tok"]
  llama_bytes = {k: gguf_bytes_per_token(g, args.llama_src, top_k) for k, g in ggufs.items()}
  machine = machine_info()
  log(f"machine: {machine['cpu_model']}, kernels {machine['ftjax_kernels']}")
  ftjax_worker = RoundWorker(__file__, "--ftw_dir", ftw_dir, "--tokens", str(args.tokens))
  ready, proc = ftjax_worker.ready, ftjax_worker.proc
  log(f"ftjax worker ready: {ready}; llama.cpp reads " + ", ".join(
      f"{k} {b / 1e9:.3f}" for k, b in llama_bytes.items()) + " GB per token")

  configs = list(ready["kernels"])  # ftjax, and ftjax_int8act where the CPU has VNNI
  sides = ["ftjax", *ggufs]
  rounds = []
  for r in range(args.rounds):
    row = {"llama_cpp": {}}
    for side in (sides if r % 2 == 0 else sides[::-1]):  # alternate the order every round
      if side == "ftjax":
        row["ftjax"] = with_other_load(ftjax_worker.ask, proc.pid)
      else:
        row["llama_cpp"][side] = with_other_load(lambda g=ggufs[side]: {"decode": llama_bench(
            args.llama_build, g, "-p", "0", "-n", str(args.tokens))["avg_ts"]}, proc.pid)
    ours, read = row["ftjax"], row["ftjax"]["read_GBps"]
    row["ratio"] = {f"{c}/{k}": ours[c] / v["decode"] for c in configs
                    for k, v in row["llama_cpp"].items()}
    row["roofline"] = {**{c: ours[c] * ready["bytes_per_token"] / 1e9 / read for c in configs},
                       **{k: v["decode"] * llama_bytes[k] / 1e9 / read
                          for k, v in row["llama_cpp"].items()}}
    rounds.append(row)
    log(f"round {r + 1}/{args.rounds}: read {read:.1f} GB/s" + "".join(
        f", {c} {ours[c]:.1f} tok/s ({row['roofline'][c]:.2f} of its roofline)" for c in configs)
        + contended(ours) + "".join(
            f"; llama.cpp {k} {v['decode']:.1f} tok/s ({row['roofline'][k]:.2f} of its "
            f"roofline)" + contended(v) for k, v in row["llama_cpp"].items())
        + "; ratios " + ", ".join(f"{k} {x:.2f}" for k, x in row["ratio"].items()))
  ftjax_worker.close()
  med = {**{c: statistics.median(r["ftjax"][c] for r in rounds) for c in configs},
         **{k: statistics.median(r["llama_cpp"][k]["decode"] for r in rounds) for k in ggufs}}
  ratio = {k: statistics.median(r["ratio"][k] for r in rounds) for k in rounds[0]["ratio"]}
  roofline = {k: statistics.median(r["roofline"][k] for r in rounds) for k in [*configs, *ggufs]}
  results = {
      "benchmark": "quant_peer", "command": " ".join(sys.argv), "smoke": args.smoke,
      "machine": machine,
      "model": {"shape": "Qwen3-30B-A3B", "layers": args.layers, "source_dtype": "bfloat16"},
      "ftjax": {"format": "int8 experts (per-channel float32 scales), bfloat16 dense",
                "kernels": ready["kernels"], "bytes_per_token": ready["bytes_per_token"]},
      "llama_cpp": {"build": args.llama_build,
                    "flags": f"-t {THREADS} -r 1 -lm none -p 0 -n {args.tokens}",
                    "q8_0": {"gguf": "convert_hf_to_gguf.py --outtype q8_0",
                             "bytes_per_token": llama_bytes["q8_0"]},
                    "q8_0_experts": {"gguf": "*_exps of the q8_0 file, the rest of the bf16 file",
                                     "bytes_per_token": llama_bytes["q8_0_experts"]}},
      "threads": THREADS, "decode_tokens": args.tokens, "rounds": rounds,
      "decode_tok_s_medians": med,
      "read_GBps_median": statistics.median(r["ftjax"]["read_GBps"] for r in rounds),
      "ratio_medians": ratio, "roofline_ratio_medians": roofline,
      "goal": GOAL, "goal_met": {k: v >= GOAL for k, v in ratio.items()},
      "contended_measurements": sum(
          side["other_load"] > 0.1 for r in rounds
          for side in (r["ftjax"], *r["llama_cpp"].values())),
  }
  print("decode tok/s (medians): " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
  print("ratios (medians; goal " + f"{GOAL}): " + ", ".join(
      f"{k} {v:.2f}" for k, v in ratio.items()))
  print(f"of the roofline (read {results['read_GBps_median']:.1f} GB/s; ftjax reads "
        f"{ready['bytes_per_token'] / 1e9:.3f} GB per token, llama.cpp " + ", ".join(
            f"{k} {b / 1e9:.3f}" for k, b in llama_bytes.items()) + "): " + ", ".join(
                f"{k} {v:.2f}" for k, v in roofline.items()))
  print(f"results: {write_results('quant_peer', results, out)}")


if __name__ == "__main__":
  main()
