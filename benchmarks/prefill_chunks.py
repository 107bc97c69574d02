"""Prefill of a suffix against a long context, by chunk size, beside llama.cpp: which
``prefill_chunk`` to ship, and whether an agent's append is read as fast as llama.cpp reads it.

  python benchmarks/prefill_chunks.py [--model FTW] [--context 6000] [--rounds 3]

The model is the hybrid Qwen3.5-MoE-shaped bench model of ``agent_peer.py`` (8 layers, 6 Gated
DeltaNet + 2 attention, 64 experts top-8, hidden 1024, bf16; run ``agent_peer.py`` once to
write it and its GGUF). A session reads ``--context`` tokens of text, then each suffix length
in ``--suffixes`` is appended to that context (the session restores its anchor at the
context's end, as after an agent's earlier turn, and reads the suffix): the time of
``set_context``, compiles excluded (every program is compiled first, ``Engine.precompile``).
One engine per ``prefill_chunk`` in ``--chunks``, alternating within each round; medians over
rounds.

The peer is ``llama-bench -p SUFFIX -n 0 -d CONTEXT`` (prompt processing of SUFFIX tokens at a
depth of CONTEXT tokens: the same work), 2 threads, weights in RAM, on the same weights,
alternating with ftjax. Writes ``results/prefill_chunks.json``: tok/s per chunk size and suffix,
llama.cpp's, and the ratio of the shipped default to llama.cpp (issue 29's goal: >= 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import ftjax
from ftjax.runtime.options import RuntimeOptions
from ftjax.runtime.tokenizer import load_tokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from agent_peer import default_cache_dir  # noqa: E402
from agent_sessions import Texts  # noqa: E402
from common import machine_info, write_results  # noqa: E402


def llama_pp(build: str, gguf: str, suffix: int, depth: int) -> float:
  cmd = [os.path.join(build, "bin", "llama-bench"), "-m", gguf, "-p", str(suffix), "-n", "0",
         "-d", str(depth), "-t", "2", "-r", "1", "-lm", "none", "-o", "json"]
  proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
  return float(json.loads(proc.stdout)[0]["avg_ts"])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--model", default=os.path.join(default_cache_dir(), "ftw"))
  parser.add_argument("--gguf", default=os.path.join(default_cache_dir(), "model-bf16.gguf"))
  parser.add_argument("--llama_build", default="/work/scratch/llama/build")
  parser.add_argument("--context", type=int, default=6000)
  parser.add_argument("--suffixes", default="60,300,900,2000")
  parser.add_argument("--chunks", default="256,512,1024,2048")
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args()
  suffixes = [int(x) for x in args.suffixes.split(",")]
  chunks = [int(x) for x in args.chunks.split(",")]
  model = ftjax.load(args.model)
  tokenizer = load_tokenizer(model.path, model.config.vocab_size)
  texts = Texts(tokenizer, seed=1)
  base = tokenizer.encode(texts.take(args.context))[:args.context]
  tails = {n: tokenizer.encode(texts.take(n))[:n] for n in suffixes}
  limit = args.context + max(suffixes) + 64
  sessions = {}
  for chunk in chunks:
    engine = ftjax.Engine(model, prefill_chunk=chunk, max_seq_len=limit)
    t0 = time.perf_counter()
    engine.precompile(anchor_slots=8)
    session = ftjax.Session(engine)
    session.set_context(base)
    print(f"prefill_chunk {chunk}: compiled in {time.perf_counter() - t0:.1f} s "
          f"({engine.chunk_sizes}, KV {engine.kv_capacities})", flush=True)
    sessions[chunk] = session
  have_llama = os.path.exists(args.gguf) and os.path.exists(
      os.path.join(args.llama_build, "bin", "llama-bench"))
  rows = {chunk: {n: [] for n in suffixes} for chunk in chunks}
  llama = {n: [] for n in suffixes}
  for r in range(args.rounds):
    for chunk in (chunks if r % 2 == 0 else chunks[::-1]):
      session = sessions[chunk]
      for n in suffixes:
        result = session.set_context(base + tails[n])
        assert result.reused_tokens == len(base) and result.prefilled_tokens == n, result
        rows[chunk][n].append(n / result.seconds)
      print(f"round {r + 1} prefill_chunk {chunk}: " + ", ".join(
          f"{n}: {rows[chunk][n][-1]:.0f}" for n in suffixes) + " tok/s", flush=True)
    if have_llama:
      for n in suffixes:
        llama[n].append(llama_pp(args.llama_build, args.gguf, n, len(base)))
      print(f"round {r + 1} llama.cpp: " + ", ".join(f"{n}: {llama[n][-1]:.0f}"
                                                     for n in suffixes) + " tok/s", flush=True)
  default = RuntimeOptions().prefill_chunk
  med = {chunk: {n: statistics.median(v) for n, v in per.items()} for chunk, per in rows.items()}
  llama_med = {n: statistics.median(v) for n, v in llama.items() if v}
  print(f"\nsuffix tok/s at a context of {len(base)} tokens (medians of {args.rounds}):")
  print("  prefill_chunk " + "".join(f"{n:>9}" for n in suffixes))
  for chunk in chunks:
    mark = " (default)" if chunk == default else ""
    print(f"  {chunk:>13} " + "".join(f"{med[chunk][n]:9.0f}" for n in suffixes) + mark)
  if llama_med:
    print("  {:>13} ".format("llama.cpp") + "".join(f"{llama_med[n]:9.0f}" for n in suffixes))
    for chunk in chunks:
      mark = " (default)" if chunk == default else ""
      print(f"  ratio to llama.cpp, prefill_chunk {chunk}{mark}: " + ", ".join(
          f"{n}: {med[chunk][n] / llama_med[n]:.2f}" for n in suffixes))
  results = {"machine": machine_info(), "model": args.model, "context": len(base),
             "suffixes": suffixes, "rounds": args.rounds, "default_prefill_chunk": default,
             "ftjax_tok_s": {str(c): {str(n): v for n, v in per.items()} for c, per in med.items()},
             "ftjax_rounds": {str(c): {str(n): v for n, v in per.items()}
                              for c, per in rows.items()},
             "llama_tok_s": {str(n): v for n, v in llama_med.items()},
             "llama_rounds": {str(n): v for n, v in llama.items()},
             "ratio_to_llama": ({str(c): {str(n): med[c][n] / llama_med[n] for n in suffixes}
                                 for c in chunks} if llama_med else None)}
  print("wrote", write_results("prefill_chunks", results))


if __name__ == "__main__":
  main()
