"""An agent's next turn after the server restarts, with and without ``--session_dir``.

A conversation whose user message is ``--context`` tokens of held-out code (the embedded
models' training corpus's held-out files) gets a reply from ``python -m ftjax.serve``; the
server is stopped with SIGTERM (with ``--session_dir`` it saves its sessions then) and started
again on the same directory; the conversation's next turn (the reply and a short user message
added) is then sent streamed, and its time to first token (from the request to the first
streamed delta) and ``cached_tokens`` are measured. Without ``--session_dir`` the next turn
prefills its whole prompt. Rounds alternate the two ways (``--rounds``, medians), each round
with a new directory; each start prepares its programs before ``/health`` answers 200 (after
a warm-up start they load from the executable store, the same for both ways), and the clock
starts once it does.

Also reported: the shutdown's save seconds (from the server's log), the directory's bytes,
and the whole restart's seconds (SIGTERM to the next start's first answer).

Run: ``python benchmarks/session_restart.py`` (``--models``, ``--context``, ``--rounds``).
Writes ``results/session_restart.json`` with the machine.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np
import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_info, write_results  # noqa: E402

import ftjax  # noqa: E402
from ftjax.runtime.tokenizer import load_tokenizer  # noqa: E402
from ftjax.tiny import train  # noqa: E402


def held_out_code(tok, tokens: int) -> str:
  root = train.stdlib_root()
  _, held = train.corpus_files(root)
  text = ""
  for t in train.read_texts(root, held, limit_bytes=8 * tokens):
    text += t
    if len(tok.encode(text)) >= tokens:
      break
  ids = tok.encode(text)[:tokens]
  return tok.decode(ids)


def start(model: str, flags: list[str]):
  t0 = time.perf_counter()
  proc = subprocess.Popen([sys.executable, "-m", "ftjax.serve", f"--model={model}", "--port=0",
                           "--served_model_name=m", *flags],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  line = proc.stdout.readline()
  match = re.search(r"on http://(127\.0\.0\.1):(\d+)/v1", line)
  if not match:
    raise RuntimeError(f"ftjax.serve did not start: {line} {proc.stderr.read()}")
  client = openai.OpenAI(base_url=f"http://127.0.0.1:{match.group(2)}/v1", api_key="none",
                         max_retries=0, timeout=600)
  health = f"http://127.0.0.1:{match.group(2)}/health"
  while True:
    try:
      with urllib.request.urlopen(health, timeout=5) as r:
        if r.status == 200:
          return proc, client, time.perf_counter() - t0
    except OSError:
      pass
    if proc.poll() is not None:
      raise RuntimeError(f"ftjax.serve exited: {proc.stderr.read()}")
    time.sleep(0.1)


def stop(proc) -> tuple[str, float]:
  t0 = time.perf_counter()
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=300)
  if proc.returncode != 0:
    raise RuntimeError(f"ftjax.serve exited {proc.returncode}: {err}")
  return err, time.perf_counter() - t0


def next_turn_ttft(client, messages) -> tuple[float, int]:
  t0 = time.perf_counter()
  first = None
  cached = 0
  for chunk in client.chat.completions.create(
      model="m", messages=messages, max_tokens=8, temperature=0, stream=True,
      stream_options={"include_usage": True}):
    if first is None and chunk.choices and (chunk.choices[0].delta.content
                                            or getattr(chunk.choices[0].delta,
                                                       "reasoning_content", None)):
      first = time.perf_counter() - t0
    if chunk.usage is not None:
      cached = chunk.usage.prompt_tokens_details.cached_tokens
  return first if first is not None else time.perf_counter() - t0, cached


def one_round(model: str, context: str, keep: bool, work: str) -> dict:
  root = os.path.join(work, "sessions")
  shutil.rmtree(root, ignore_errors=True)
  flags = [f"--session_dir={root}"] if keep else []
  messages = [{"role": "system", "content": "You are a coding agent."},
              {"role": "user", "content": f"Review this code:\n{context}"}]
  proc, client, _ = start(model, flags)
  try:
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=16,
                                           temperature=0)
  finally:
    err, stop_s = stop(proc)
  saved = re.search(r"saved (\d+) sessions to .* in ([0-9.]+) s", err)
  t0 = time.perf_counter()
  proc, client, start_s = start(model, flags)
  try:
    messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                 {"role": "user", "content": "Now write a test for it."}]
    ttft, cached = next_turn_ttft(client, messages)
    restart_s = stop_s + (time.perf_counter() - t0)
  finally:
    stop(proc)
  return {"ttft_s": ttft, "cached_tokens": cached, "prompt_tokens": reply.usage.prompt_tokens,
          "save_s": float(saved.group(2)) if saved else None,
          "saved_sessions": int(saved.group(1)) if saved else 0,
          "dir_bytes": sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(root)
                           for n in ns) if keep else 0,
          "start_s": start_s, "restart_to_first_token_s": restart_s}


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--models", default="default,default-hybrid")
  p.add_argument("--context", type=int, default=8000, help="tokens of the first user message")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--out", default=None)
  args = p.parse_args()
  work = tempfile.mkdtemp(prefix="ftjax-restart-")
  report = {"machine": machine_info(), "context_tokens": args.context, "rounds": args.rounds,
            "models": {}}
  for name in args.models.split(","):
    model = ftjax.load(name)
    context = held_out_code(load_tokenizer(model.path, model.config.vocab_size), args.context)
    one_round(name, context[:2000], True, work)  # warm-up: programs into the store
    rows = {"session_dir": [], "none": []}
    for r in range(args.rounds):
      for way in ("session_dir", "none"):
        row = one_round(name, context, way == "session_dir", work)
        rows[way].append(row)
        print(f"{name} round {r} {way}: TTFT {row['ttft_s']:.2f} s, cached "
              f"{row['cached_tokens']} of {row['prompt_tokens']}+, save {row['save_s']} s",
              flush=True)
    med = {way: {k: float(np.median([x[k] for x in v])) for k in ("ttft_s", "start_s",
                                                                  "restart_to_first_token_s")}
           for way, v in rows.items()}
    report["models"][name] = {"rounds": rows, "median": med,
                              "ttft_ratio": med["none"]["ttft_s"] / med["session_dir"]["ttft_s"]}
    print(f"{name}: next turn after a restart, TTFT {med['session_dir']['ttft_s']:.2f} s with "
          f"--session_dir vs {med['none']['ttft_s']:.2f} s without "
          f"({report['models'][name]['ttft_ratio']:.1f}x)", flush=True)
  shutil.rmtree(work, ignore_errors=True)
  print(f"wrote {write_results('session_restart', report, args.out)}")


if __name__ == "__main__":
  main()
