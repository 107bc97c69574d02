"""Four concurrent requests on ftjax.serve and on llama-server ``-np 4``: aggregate tok/s and
inter-token latency, on the same weights (issue 33).

Weights: the 4-layer Qwen3-30B-A3B-shaped checkpoint of ``cpu_peer.py`` (random bfloat16,
written once in the Hugging Face layout into ``--work_dir``, never committed); ftjax serves it
through its own converter (``ftjax.serve --model HF_DIR``: converted once into the cache),
llama-server through llama.cpp's converter (``cpu_peer.convert_gguf``, bf16 GGUF). Both
servers run at once (each idle while the other is measured):

- ftjax: ``python -m ftjax.serve --model HF_DIR --max_running 4 --max_seq_len 1024`` (its
  default threads and kernels, start-up compilation);
- llama-server: ``llama-server -m GGUF -t 2 -c 4096 -np 4 -lm none`` (4 slots of 1024 tokens,
  continuous batching, weights read into RAM).

A round sends the same 4 requests to one server at once: ``POST /v1/completions`` with a
different random prompt of 24 to 96 token ids each (the same ids on both; the stand-in
tokenizer is shared), ``max_tokens`` ``--tokens``, ``temperature`` 0, ``stream`` with usage
(llama-server also gets ``ignore_eos``). Measured in the client, per request: the arrival
time of every streamed event with text, and the completion tokens. Per side and round:

- aggregate tok/s: all completion tokens (from the usage chunks) / (the end of the last
  stream − the first request sent);
- decode tok/s: all tokens after each request's first / the span from the earliest first
  text event to the end of the last stream;
- ITL: a request's mean inter-token latency, (last text event − first) / (tokens − 1), over
  the requests with two text events or more; p50 and p99 over the requests and rounds; and the gaps between consecutive events
  (p50, p99): a stall shows there. ftjax streams once per decode chunk (8 tokens), so its
  gaps are a chunk's time. Caveat: the random model mostly generates ids past the stand-in
  tokenizer's 4096, which have no text; llama-server sends no text event for them (1 to 5
  events per request were seen), so its event-based ITL and gaps are not comparable, and the
  aggregate tok/s (from the usage token counts) is the measure to compare.

Rounds alternate the order of the two sides (``--rounds``, default 3, after one discarded
warm-up round each); medians. Goal (the issue): ftjax aggregate tok/s >= 1.0x llama-server's.

  /work/venv/bin/python benchmarks/serve_batch.py   # ~15 min the first time (writes, converts)
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from agent_peer import Server, free_port  # noqa: E402
from common import machine_info, write_results  # noqa: E402
from cpu_peer import convert_gguf, write_checkpoint  # noqa: E402

LLAMA_BUILD = "/work/scratch/llama/build"
LLAMA_SRC = "/work/scratch/llama/llama_cpp_python-0.3.36/vendor/llama.cpp"
REQUESTS = 4
GOAL_AGGREGATE = 1.0
SIDES = ("ftjax", "llama")


def log(msg: str) -> None:
  print(f"[serve_batch] {msg}", file=sys.stderr, flush=True)


def stream(port: int, body: dict, out: dict) -> None:
  """One streamed completion: ``out`` gets the send time, each text event's arrival time and
  the completion tokens (from the usage chunk)."""
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
  data = json.dumps(body).encode()
  out["sent"] = time.perf_counter()
  conn.request("POST", "/v1/completions", data, {"Content-Type": "application/json"})
  resp = conn.getresponse()
  if resp.status != 200:
    raise RuntimeError(f"port {port}: {resp.status} {resp.read()[:500]!r}")
  events, tokens = [], None
  for raw in resp:
    line = raw.decode().strip()
    if not line.startswith("data:") or line == "data: [DONE]":
      continue
    chunk = json.loads(line[5:])
    if chunk.get("choices") and chunk["choices"][0].get("text"):
      events.append(time.perf_counter())
    elif chunk.get("choices") and not events:
      out.setdefault("first_empty", time.perf_counter())
    if chunk.get("usage"):
      tokens = chunk["usage"]["completion_tokens"]
  conn.close()
  out["events"], out["tokens"], out["done"] = events, tokens, time.perf_counter()


def round_of(port: int, prompts: list[list[int]], tokens: int, extra: dict) -> dict:
  outs = [{} for _ in prompts]
  threads = [threading.Thread(target=stream, args=(port, dict(
      {"model": "bench", "prompt": p, "max_tokens": tokens, "temperature": 0, "stream": True,
       "stream_options": {"include_usage": True}}, **extra), o)) for p, o in zip(prompts, outs)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  if any(o.get("tokens") is None for o in outs):
    raise RuntimeError(f"port {port}: a stream ended without its usage chunk: {outs}")
  # The end of each stream (its usage chunk and [DONE]) rather than its last text event: the
  # random model's ids past the stand-in tokenizer's 4096 carry no text, so a request can
  # stream few text events, or none (which broke an earlier version of this script).
  start = min(o["sent"] for o in outs)
  end = max(o["done"] for o in outs)
  firsts = [o["events"][0] for o in outs if o["events"]]
  total = sum(o["tokens"] for o in outs)
  timed = [o for o in outs if len(o["events"]) >= 2]
  itl = [(o["events"][-1] - o["events"][0]) / max(o["tokens"] - 1, 1) for o in timed]
  gaps = [b - a for o in outs for a, b in zip(o["events"], o["events"][1:])]
  return {"aggregate_tok_s": total / (end - start),
          "decode_tok_s": (sum(o["tokens"] - 1 for o in outs) / (end - min(firsts))
                           if firsts else None),
          "tokens": [o["tokens"] for o in outs],
          "ttft_s": [o["events"][0] - o["sent"] for o in outs if o["events"]],
          "itl_s": itl, "event_gaps_s": gaps, "events": [len(o["events"]) for o in outs]}


def median_or_none(values: list) -> float | None:
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else None


def pct(values: list[float], q: float) -> float | None:
  if not values:
    return None
  values = sorted(values)
  return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--tokens", type=int, default=64, help="completion tokens per request")
  p.add_argument("--work_dir", default="/tmp/ftjax-cpu-peer")
  p.add_argument("--llama_build", default=LLAMA_BUILD)
  p.add_argument("--llama_src", default=LLAMA_SRC)
  p.add_argument("--out", default=None)
  args = p.parse_args()
  import numpy as np  # noqa: PLC0415
  os.makedirs(args.work_dir, exist_ok=True)
  hf_dir = write_checkpoint(4, os.path.join(args.work_dir, "hf-4l"))
  gguf = convert_gguf(hf_dir, args.llama_src, args.work_dir)
  rng = np.random.default_rng(1)
  vocab = 4096  # the stand-in tokenizer's ids, valid for both servers
  prompts = [rng.integers(2, vocab, 24 + 24 * i).tolist() for i in range(REQUESTS)]

  env_note = "ftjax.serve from the installed package (run from outside the checkout)"
  ftjax_cmd = [sys.executable, "-m", "ftjax.serve", "--model", hf_dir, "--port",
               str(free_port()), "--max_running", str(REQUESTS), "--max_seq_len", "1024",
               "--served_model_name", "bench"]
  llama_cmd = [os.path.join(args.llama_build, "bin", "llama-server"), "-m", gguf, "-t", "2",
               "-c", str(1024 * REQUESTS), "-np", str(REQUESTS), "-lm", "none", "--host",
               "127.0.0.1", "--port", str(free_port())]
  log("starting ftjax.serve (converts once, compiles at start-up) and llama-server")
  servers = {"ftjax": Server("ftjax.serve", ftjax_cmd, os.path.join(args.work_dir,
                                                                   "serve_batch_ftjax.log"), "/tmp"),
             "llama": Server("llama-server", llama_cmd,
                             os.path.join(args.work_dir, "serve_batch_llama.log"), "/tmp")}
  extra = {"ftjax": {}, "llama": {"ignore_eos": True}}
  try:
    for side in SIDES:  # warm-up: compiles, first touches
      round_of(servers[side].port, prompts, args.tokens, extra[side])
    rounds = []
    for r in range(args.rounds):
      row = {}
      for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
        row[side] = round_of(servers[side].port, prompts, args.tokens, extra[side])
      log(f"round {r + 1}: aggregate ftjax {row['ftjax']['aggregate_tok_s']:.1f}, llama-server "
          f"{row['llama']['aggregate_tok_s']:.1f} tok/s")
      rounds.append(row)
  finally:
    for s in servers.values():
      s.stop()
  summary = {}
  for side in SIDES:
    rs = [r[side] for r in rounds]
    itl = [x for r in rs for x in r["itl_s"]]
    gaps = [x for r in rs for x in r["event_gaps_s"]]
    summary[side] = {
        "aggregate_tok_s": statistics.median(r["aggregate_tok_s"] for r in rs),
        "decode_tok_s": median_or_none([r["decode_tok_s"] for r in rs]),
        "itl_p50_s": pct(itl, 0.5), "itl_p99_s": pct(itl, 0.99),
        "event_gap_p50_s": pct(gaps, 0.5), "event_gap_p99_s": pct(gaps, 0.99),
        "ttft_p50_s": pct([x for r in rs for x in r["ttft_s"]], 0.5),
        "tokens": rs[0]["tokens"], "events": rs[0]["events"]}
  ratio = summary["ftjax"]["aggregate_tok_s"] / summary["llama"]["aggregate_tok_s"]
  results = {"benchmark": "serve_batch", "machine": machine_info(), "requests": REQUESTS,
             "tokens_per_request": args.tokens, "prompt_tokens": [len(x) for x in prompts],
             "ftjax_cmd": ftjax_cmd, "llama_cmd": llama_cmd, "note": env_note,
             "summary": summary, "aggregate_ratio": ratio,
             "per_round_ratio": [r["ftjax"]["aggregate_tok_s"] / r["llama"]["aggregate_tok_s"]
                                 for r in rounds],
             "goal_aggregate_ratio": GOAL_AGGREGATE, "met": ratio >= GOAL_AGGREGATE,
             "rounds": rounds}
  print(f"\n{'':14} {'aggregate':>9} {'decode':>7} {'ITL p50':>8} {'ITL p99':>8} "
        f"{'gap p50':>8} {'gap p99':>8} {'TTFT p50':>8}")
  for side, label in (("ftjax", "ftjax.serve"), ("llama", "llama-server")):
    s = summary[side]

    def ms(key: str) -> str:
      return "     -  " if s[key] is None else f"{s[key] * 1e3:6.1f}ms"
    decode = "      -" if s["decode_tok_s"] is None else f"{s['decode_tok_s']:7.1f}"
    print(f"{label:14} {s['aggregate_tok_s']:9.1f} {decode} {ms('itl_p50_s')} "
          f"{ms('itl_p99_s')} {ms('event_gap_p50_s')} {ms('event_gap_p99_s')} "
          f"{ms('ttft_p50_s')}")
  print(f"aggregate tok/s, ftjax / llama-server: {ratio:.2f} (goal >= {GOAL_AGGREGATE})")
  print(f"wrote {write_results('serve_batch', results, args.out)}")


if __name__ == "__main__":
  main()
