"""An agent's main conversation and three subagent conversations at once on ftjax.serve:
TTFT and tok/s per conversation, batched (``--max_running 4``) against one request at a time
(``--max_running 1``) (issue 33).

Claude Code's subagents and OpenCode's task tool run conversations beside the main one; with
one request at a time, each waits for the others' turns. The workload (token ids, the same
for both servers; the 4-layer Qwen3-30B-A3B-shaped checkpoint of ``cpu_peer.py``, random
bfloat16, written once into ``--work_dir``):

- main: a 384-token prompt (system prompt and task), then ``--main_turns`` turns; each turn
  appends 48 tokens (a tool result) to the previous prompt and asks for 32 tokens;
- 3 subagents, started together with the main conversation: a 160-token prompt each, then
  ``--sub_turns`` turns of 32 appended tokens and 32 generated.

Each conversation runs its turns one after the other in its own client thread (``POST
/v1/completions``, token ids, ``temperature`` 0, streamed); the four run at once. A turn's
next prompt extends the last (the session pool reuses the common prefix). Two servers on the
same weights, both running the whole time, each measured in turn (alternating order,
``--rounds`` rounds after a warm-up round each): ``python -m ftjax.serve --max_running 4`` and
the same with ``--max_running 1``. Per conversation: median TTFT over its turns (to its first
streamed chunk), decode tok/s (tokens after the first / the time from the first chunk to the
end of the stream, median over turns) and
its wall time; and the whole workload's wall time. Medians over rounds.

  /work/venv/bin/python benchmarks/agent_batch.py    # after serve_batch.py wrote the weights
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from agent_peer import Server, free_port  # noqa: E402
from common import machine_info, pyplot, write_results  # noqa: E402
from cpu_peer import write_checkpoint  # noqa: E402
from serve_batch import stream  # noqa: E402

SIDES = ("batched", "one_at_a_time")
VOCAB = 4096  # the stand-in tokenizer's ids


def log(msg: str) -> None:
  print(f"[agent_batch] {msg}", file=sys.stderr, flush=True)


def conversations(args, rng) -> list[list[tuple[list[int], int]]]:
  """Per conversation, its turns: (prompt ids, tokens to generate)."""
  def turns(first: int, appended: int, n: int, new: int):
    prompt = rng.integers(2, VOCAB, first).tolist()
    out = []
    for _ in range(n):
      out.append((list(prompt), new))
      prompt = prompt + rng.integers(2, VOCAB, appended).tolist()
    return out
  main = turns(384, 48, args.main_turns, 32)
  return [main] + [turns(160, 32, args.sub_turns, 32) for _ in range(3)]


def turn(port: int, prompt: list[int], new: int) -> dict:
  out: dict = {}
  stream(port, {"model": "bench", "prompt": prompt, "max_tokens": new, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}, out)
  # A random model's tokens past the stand-in tokenizer's 4096 have no text, so text events
  # are few and can come together: the first chunk (with text or not) starts the turn's decode
  # and the end of its stream ends it (the usage chunk counts its tokens).
  first = min([*out["events"][:1], out.get("first_empty", out["done"])])
  tokens = out["tokens"]
  return {"ttft_s": first - out["sent"], "tokens": tokens,
          "decode_tok_s": (tokens - 1) / (out["done"] - first) if tokens > 1 and
          out["done"] > first else None, "end": out["done"], "sent": out["sent"]}


def workload(port: int, convs) -> dict:
  results: list[list[dict]] = [[] for _ in convs]

  def run(i: int) -> None:
    for prompt, new in convs[i]:
      results[i].append(turn(port, prompt, new))

  t0 = time.perf_counter()
  threads = [threading.Thread(target=run, args=(i,)) for i in range(len(convs))]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  if any(len(r) != len(c) for r, c in zip(results, convs)):
    raise RuntimeError("a conversation did not finish")
  per = []
  for r in results:
    rates = [x["decode_tok_s"] for x in r if x["decode_tok_s"]]
    per.append({"ttft_s": statistics.median(x["ttft_s"] for x in r),
                "decode_tok_s": statistics.median(rates) if rates else None,
                "wall_s": r[-1]["end"] - r[0]["sent"]})
  return {"wall_s": time.perf_counter() - t0, "conversations": per}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--main_turns", type=int, default=4)
  p.add_argument("--sub_turns", type=int, default=3)
  p.add_argument("--work_dir", default="/tmp/ftjax-cpu-peer")
  p.add_argument("--out", default=None)
  args = p.parse_args()
  import numpy as np  # noqa: PLC0415
  hf_dir = write_checkpoint(4, os.path.join(args.work_dir, "hf-4l"))
  convs = conversations(args, np.random.default_rng(2))
  servers = {}
  for side, running in (("batched", 4), ("one_at_a_time", 1)):
    cmd = [sys.executable, "-m", "ftjax.serve", "--model", hf_dir, "--port", str(free_port()),
           "--max_running", str(running), "--max_seq_len", "1024", "--served_model_name",
           "bench"]
    log(f"starting ftjax.serve --max_running {running}")
    servers[side] = Server(f"ftjax.serve ({side})", cmd,
                           os.path.join(args.work_dir, f"agent_batch_{side}.log"), "/tmp")
  try:
    for side in SIDES:
      workload(servers[side].port, convs)  # warm-up: first touches, the sessions' shapes
    rounds = []
    for r in range(args.rounds):
      row = {}
      for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
        row[side] = workload(servers[side].port, convs)
        log(f"round {r + 1}: {side}: {row[side]['wall_s']:.1f} s")
      rounds.append(row)
  finally:
    for s in servers.values():
      s.stop()
  names = ["main"] + [f"subagent {i}" for i in (1, 2, 3)]
  summary = {}
  for side in SIDES:
    convs_out = []
    for i, name in enumerate(names):
      rs = [r[side]["conversations"][i] for r in rounds]
      rates = [x["decode_tok_s"] for x in rs if x["decode_tok_s"]]
      convs_out.append({"name": name,
                        "ttft_s": statistics.median(x["ttft_s"] for x in rs),
                        "decode_tok_s": statistics.median(rates) if rates else None,
                        "wall_s": statistics.median(x["wall_s"] for x in rs)})
    summary[side] = {"wall_s": statistics.median(r[side]["wall_s"] for r in rounds),
                     "conversations": convs_out}
  results = {"benchmark": "agent_batch", "machine": machine_info(),
             "turns": [len(c) for c in convs],
             "prompt_tokens": [[len(t[0]) for t in c] for c in convs],
             "summary": summary, "rounds": rounds,
             "wall_ratio": summary["batched"]["wall_s"] / summary["one_at_a_time"]["wall_s"]}
  print(f"\n{'conversation':12} {'TTFT batched':>12} {'one at a time':>13} "
        f"{'tok/s batched':>13} {'one at a time':>13} {'wall batched':>12} {'one at a time':>13}")
  for b, o in zip(summary["batched"]["conversations"],
                  summary["one_at_a_time"]["conversations"]):
    print(f"{b['name']:12} {b['ttft_s']:11.2f}s {o['ttft_s']:12.2f}s "
          f"{b['decode_tok_s'] or 0:13.1f} {o['decode_tok_s'] or 0:13.1f} "
          f"{b['wall_s']:11.1f}s {o['wall_s']:12.1f}s")
  print(f"workload: batched {summary['batched']['wall_s']:.1f} s, one at a time "
        f"{summary['one_at_a_time']['wall_s']:.1f} s ({results['wall_ratio']:.2f}x the time)")
  path = write_results("agent_batch", results, args.out)
  plt = pyplot()
  if plt is not None:
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(names))
    for k, side in enumerate(SIDES):
      ax.bar(x + 0.4 * k, [c["wall_s"] for c in summary[side]["conversations"]], 0.4,
             label=side.replace("_", " "))
    ax.set_xticks(x + 0.2, names)
    ax.set_ylabel("conversation wall time (s)")
    ax.set_title("main + 3 subagents on ftjax.serve")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.splitext(path)[0] + ".png", dpi=100)
  print(f"wrote {path}")


if __name__ == "__main__":
  main()
