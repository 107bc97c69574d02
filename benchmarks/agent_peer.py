"""A scripted coding-agent session on ftjax.serve and llama-server: TTFT per request.

The same session is served by ``python -m ftjax.serve`` and by llama.cpp's llama-server, side
by side, and each request's time to first token is measured.

The model is a random ``--layers``-layer (default 8) Qwen3.5-MoE-shaped hybrid checkpoint,
written by ``hybrid_e2e.py``'s ``write_hf_checkpoint`` with ``hidden_size=1024``,
``num_experts=64``, ``num_experts_per_tok=8`` (every fourth layer gated full attention, the rest
Gated DeltaNet: 6 + 2 at 8 layers; the other shapes are Qwen3.5-35B-A3B's: 16 query / 2 KV
heads of 256, linear attention 16 key / 32 value heads of 128, expert width 512, a shared
expert, vocab 248320), bfloat16, about 2.7 GB. Its tokenizer is the stand-in that
``hybrid_e2e.py`` gives it: the embedded default model's byte-level BPE. Written once under
``--cache_dir`` (default ``$FTJAX_CACHE_DIR/agent_peer``, else ``~/.cache/ftjax/agent_peer``;
each file is reused while the stamp beside it matches, ``--reconvert`` redoes the conversions):

- ``hf/``: the Hugging Face checkpoint (``write_hf_checkpoint``);
- ``ftw/``: ``ftjax.convert_hf(hf, ftw, dtype="bfloat16")``, run in a child process;
- ``model-bf16.gguf``: llama.cpp's own converter (``hybrid_e2e.convert_gguf``: bf16,
  ``--no-mtp``), run from a copy (``llama-convert/``) whose ``get_vocab_base_pre`` names the
  stand-in's pre-tokenizer ``"gpt-2"``: the stand-in splits with the GPT-2 regex, and with
  ``"default"`` (``../shared/PEERS.md``) llama.cpp would cut the same text into ~10% more
  tokens. The run checks that llama-server's ``/tokenize`` gives ftjax's token ids for every
  prompt. It needs ``pip install $SRC/gguf-py``.

The workload is a tool-using agent session (a variant of ``agent_sessions.conversation``, with
its ``Texts``): a system message with two tools and a user task, then each turn an assistant
message (reasoning of 100 tokens and a tool call) and a tool result of ``--result_tokens``
(default 800) tokens; a new user message every ``--user_every`` (6) turns; every
``--trim_every`` (10) requests the client trims the tool results older than the newest
``--keep_recent`` (6) to their first 40 tokens and a "[... truncated]" note, as
context-trimming clients do. The client sends every reasoning back; the embedded models' chat
template (``ftjax.runtime.chat_template``, Qwen3 format) drops the thinking of the turns before
the newest user query. So a request is either an append (the previous prompt + the newest
assistant message and tool result) or an edit (at a new user query the thinking of the
previous question's turns is dropped; at a trim old tool results shrink). With the default 20
turns: 20 requests, 15 appends and 4 edits (at requests 6, 10, 12 and 18), from 329 to 13,626
tokens of context. ``--small``: 6 requests up to 1,505 tokens, 3 appends and 2 edits.

Each request's messages are rendered to prompt text with that template, and both servers get
the identical text through their completion endpoints, asking for exactly one greedy token, so
a request's wall time in the client (``http.client``, body serialised beforehand, one kept-alive
connection) is its TTFT:

- ftjax: ``python -m ftjax.serve --model FTW --port P --max_seq_len CONTEXT`` (one sequence,
  its default threads, the same context as llama-server's; it compiles its programs at
  start-up, ``--precompile``),
  ``POST /v1/completions`` ``{"model", "prompt", "max_tokens": 1, "temperature": 0}``;
- llama-server: ``llama-server -m GGUF -t 2 -c CONTEXT -np 1 --host 127.0.0.1 --port P``
  (CONTEXT: 1.25x the longest prompt + 16, rounded up to 256; llama.cpp's own token counts
  from ``POST /tokenize`` are checked against it), ``POST /completion`` ``{"prompt",
  "n_predict": 1, "cache_prompt": true, "temperature": 0}``; ``timings.prompt_n`` is what it
  prefilled.

Each server is its own process, started fresh each round and timed from process start to
``GET /health`` answering 200 (the start-up time). The whole session runs on one server, then
on the other, alternating the order over ``--rounds`` rounds (default 2); per-request medians
over the rounds are reported. ftjax's ``GET /metrics`` is read before the first request and
after the last: ``ftjax_compiles_total`` and ``ftjax_compile_seconds_total`` deltas are the
compiles after start-up. Each session records ``other_load``, the cores other processes kept
busy meanwhile (``hybrid_e2e.with_other_load``); above 0.1 it is flagged.

Goals (issue 29), on the per-request medians:

- total TTFT over the session: ftjax >= 2x lower than llama-server's (<= 0.5x);
- the worst request: >= 2x lower than llama-server's worst (<= 0.5x);
- every append-only request no slower than llama-server's;
- zero compiles after start-up.

``results/agent_peer.json`` holds every request of every round; ``results/agent_peer.png``
plots TTFT per request for both servers. llama.cpp's build: ``../shared/PEERS.md`` (configure
with ``-DLLAMA_BUILD_SERVER=ON``, build ``--target llama-server``).

  /work/venv/bin/python benchmarks/agent_peer.py [--rounds 2] [--turns 20]
  /work/venv/bin/python benchmarks/agent_peer.py --small --rounds 1   # a quick smoke run
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from agent_sessions import TOOLS, Texts  # noqa: E402
from common import RESULTS_DIR, machine_info, pyplot, write_results  # noqa: E402
from hybrid_e2e import (  # noqa: E402
  convert_gguf,
  generator_stamp,
  hf_config,
  patched_converter,
  with_other_load,
  write_hf_checkpoint,
)

LLAMA_BUILD = "/work/scratch/llama/build"
LLAMA_SRC = "/work/scratch/llama/llama_cpp_python-0.3.36/vendor/llama.cpp"
OVERRIDES = {"hidden_size": 1024, "num_experts": 64, "num_experts_per_tok": 8}
SEED = 0
GOAL_TOTAL_RATIO = 0.5  # ftjax total TTFT / llama-server's, at most
GOAL_WORST_RATIO = 0.5  # ftjax worst-request TTFT / llama-server's worst, at most
SIDES = ("ftjax", "llama")
GGUF_PRE = "gpt-2"  # llama.cpp's pre-tokenizer for the stand-in (see gguf_converter)
HTTP_TIMEOUT_S = 3600
START_TIMEOUT_S = 900


def default_cache_dir() -> str:
  base = os.environ.get("FTJAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                           "ftjax")
  return os.path.join(base, "agent_peer")


# -- The model: HF checkpoint, FTW and GGUF, each reused while its stamp matches. ------------

def read_json(path: str):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def write_json(path: str, obj) -> None:
  with open(path, "w") as f:
    json.dump(obj, f, indent=1)


def prepare(args, need_ftjax: bool, need_llama: bool) -> tuple[str, str]:
  """(FTW dir, GGUF path) under the cache dir, written unless present and current."""
  d = args.cache_dir
  os.makedirs(d, exist_ok=True)
  hf_dir, ftw_dir = os.path.join(d, "hf"), os.path.join(d, "ftw")
  gguf = os.path.join(d, "model-bf16.gguf")
  stamp = generator_stamp(args.layers, SEED, OVERRIDES)
  if read_json(os.path.join(hf_dir, "generator.json")) != stamp:
    print(f"writing the random {args.layers}-layer checkpoint into {hf_dir}", flush=True)
    for old in (ftw_dir + ".stamp.json", gguf + ".stamp.json"):  # made from the old one
      if os.path.exists(old):
        os.remove(old)
    t0 = time.perf_counter()
    write_hf_checkpoint(hf_dir, args.layers, SEED, **OVERRIDES)
    print(f"  in {time.perf_counter() - t0:.0f} s", flush=True)
  if need_ftjax and (args.reconvert or read_json(ftw_dir + ".stamp.json") != stamp
                     or not os.path.isdir(ftw_dir)):
    log_path = os.path.join(d, "convert_ftw.log")
    print(f"converting to FTW with ftjax's converter into {ftw_dir} (log {log_path})",
          flush=True)
    t0 = time.perf_counter()
    code = ("import sys, ftjax; ftjax.convert_hf(sys.argv[1], sys.argv[2], dtype='bfloat16', "
            "overwrite=True)")
    with open(log_path, "w") as f:  # cwd outside the checkout: the installed ftjax
      proc = subprocess.run([sys.executable, "-c", code, hf_dir, ftw_dir], cwd=d,
                            env=server_env(), stdout=f, stderr=subprocess.STDOUT, check=False)
    if proc.returncode:
      with open(log_path) as f:
        raise RuntimeError(f"ftjax.convert_hf failed (exit {proc.returncode}):\n"
                           f"{f.read()[-3000:]}")
    write_json(ftw_dir + ".stamp.json", stamp)
    print(f"  in {time.perf_counter() - t0:.0f} s", flush=True)
  gguf_stamp = dict(stamp, llama_src=os.path.abspath(args.llama_src), pre_tokenizer=GGUF_PRE)
  if need_llama and (args.reconvert or read_json(gguf + ".stamp.json") != gguf_stamp
                     or not os.path.isfile(gguf)):
    if os.path.exists(gguf):
      os.remove(gguf)
    gguf_converter(args.llama_src, os.path.join(d, "llama-convert"))
    convert_gguf(args.llama_src, hf_dir, gguf, d)  # runs the copy made above
    write_json(gguf + ".stamp.json", gguf_stamp)
  return ftw_dir, gguf


def gguf_converter(llama_src: str, dest: str) -> str:
  """A fresh copy of llama.cpp's converter (``hybrid_e2e.patched_converter``) whose
  ``get_vocab_base_pre`` names the stand-in's pre-tokenizer ``GGUF_PRE`` instead of
  ``"default"``: the stand-in is a byte-level BPE with the GPT-2 split regex, and llama.cpp's
  ``"default"`` splits differently (about 10% more tokens on this workload), so the two
  servers would prefill different token sequences of the same text."""
  shutil.rmtree(dest, ignore_errors=True)
  script = patched_converter(llama_src, dest)
  base = os.path.join(dest, "conversion", "base.py")
  with open(base) as f:
    text = f.read()
  old = 'res = "default"  # patched by benchmarks/hybrid_e2e.py'
  if text.count(old) != 1:
    raise RuntimeError(f"{base}: expected one '{old}' to patch, found {text.count(old)}")
  with open(base, "w") as f:
    f.write(text.replace(old, f'res = "{GGUF_PRE}"  # patched by benchmarks/agent_peer.py'))
  return script


# -- The workload. -----------------------------------------------------------------------------

def agent_conversation(turns: int, tokenizer, result_tokens: int, user_every: int,
                       trim_every: int, keep_recent: int) -> list[list[dict]]:
  """The messages of each request as the client sends them: every reasoning kept (the chat
  template drops those before the newest user query), and every ``trim_every`` requests the
  tool results older than the newest ``keep_recent`` cut to 40 tokens (and kept so)."""
  texts = Texts(tokenizer)
  history = [{"role": "system", "content": "You are a coding agent. " + texts.take(30)},
             {"role": "user", "content": "Fix the failing test. " + texts.take(30)}]
  requests, results_at = [], []
  for turn in range(turns):
    if turn and trim_every and turn % trim_every == 0:
      for i in results_at[:-keep_recent] if keep_recent else results_at:
        m = history[i]
        if not m["content"].endswith("[... truncated]"):
          m["content"] = (tokenizer.decode(tokenizer.encode(m["content"])[:40])
                          + " [... truncated]")
    requests.append([dict(m) for m in history])
    name = "read_file" if turn % 2 == 0 else "run_tests"
    args = {"path": f"src/module_{turn}.py"} if name == "read_file" else {"pattern": f"t{turn}"}
    history.append({"role": "assistant", "content": "", "reasoning_content": texts.take(100),
                    "tool_calls": [{"type": "function",
                                    "function": {"name": name, "arguments": args}}]})
    history.append({"role": "tool", "content": texts.take(result_tokens)})
    results_at.append(len(history) - 1)
    if user_every and turn % user_every == user_every - 1:
      history.append({"role": "user", "content": "Also check this. " + texts.take(30)})
  return requests


def workload(args) -> list[dict]:
  """Each request's prompt text, its token count (the stand-in tokenizer, as ftjax counts),
  kind (first / append / edit) and, for an edit, the first token that differs."""
  from ftjax.assets import DEFAULT_HYBRID_MODEL_DIR  # noqa: PLC0415
  from ftjax.runtime.chat_template import load_chat_template  # noqa: PLC0415
  from ftjax.runtime.tokenizer import load_tokenizer  # noqa: PLC0415
  tokenizer = load_tokenizer(DEFAULT_HYBRID_MODEL_DIR, 4096)
  template = load_chat_template(DEFAULT_HYBRID_MODEL_DIR)
  out, prev_text, prev_ids = [], None, None
  for messages in agent_conversation(args.turns, tokenizer, args.result_tokens, args.user_every,
                                     args.trim_every, args.keep_recent):
    text = template.render(messages, tools=TOOLS, add_generation_prompt=True)
    ids = tokenizer.encode(text)
    if prev_text is None:
      kind, common = "first", 0
    else:
      kind = "append" if text.startswith(prev_text) else "edit"
      common = next((i for i, (a, b) in enumerate(zip(ids, prev_ids)) if a != b),
                    min(len(ids), len(prev_ids)))
    out.append({"prompt": text, "ids": ids, "tokens": len(ids), "kind": kind,
                "common_prefix": common})
    prev_text, prev_ids = text, ids
  return out


# -- The servers. ------------------------------------------------------------------------------

def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def server_env() -> dict:
  env = dict(os.environ)
  env.pop("PYTHONPATH", None)  # the installed ftjax
  return env


def get(port: int, path: str, timeout: float = 5) -> tuple[int, str]:
  conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
  try:
    conn.request("GET", path)
    r = conn.getresponse()
    return r.status, r.read().decode()
  finally:
    conn.close()


def post(conn: http.client.HTTPConnection, path: str, body: bytes) -> tuple[dict, float]:
  """The JSON answer and the wall time of one request."""
  t0 = time.perf_counter()
  conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
  r = conn.getresponse()
  data = r.read()
  wall = time.perf_counter() - t0
  if r.status != 200:
    raise RuntimeError(f"POST {path}: HTTP {r.status}: {data[:2000]!r}")
  return json.loads(data), wall


class Server:
  """A server process, started and waited for (``start_s``: process start to /health 200)."""

  def __init__(self, name: str, cmd: list[str], log_path: str, cwd: str):
    self.name, self.cmd, self.log_path = name, cmd, log_path
    self.port = int(cmd[cmd.index("--port") + 1])
    self.log = open(log_path, "w")  # noqa: SIM115 (closed by stop)
    t0 = time.perf_counter()
    self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=cwd,
                                 env=server_env())
    while True:
      if self.proc.poll() is not None:
        self.log.close()
        with open(log_path) as f:
          raise RuntimeError(f"{name} exited (code {self.proc.returncode}) before it was "
                             f"healthy; {log_path}:\n{f.read()[-3000:]}")
      try:
        if get(self.port, "/health")[0] == 200:
          break
      except OSError:
        pass
      if time.perf_counter() - t0 > START_TIMEOUT_S:
        self.stop()
        raise RuntimeError(f"{name} not healthy after {START_TIMEOUT_S} s; see {log_path}")
      time.sleep(0.05)
    self.start_s = time.perf_counter() - t0

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.terminate()
      try:
        self.proc.wait(timeout=30)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
    self.log.close()


def metric(text: str, name: str) -> float | None:
  """The value of an unlabelled Prometheus sample ``name`` in ``text``."""
  m = re.search(rf"^{re.escape(name)}(?:\{{\}})?\s+(\S+)", text, re.MULTILINE)
  return float(m.group(1)) if m else None


def compile_metrics(port: int) -> dict:
  status, text = get(port, "/metrics")
  if status != 200:
    raise RuntimeError(f"GET /metrics: HTTP {status}")
  return {"compiles": metric(text, "ftjax_compiles_total"),
          "compile_s": metric(text, "ftjax_compile_seconds_total")}


def run_ftjax(args, ftw_dir: str, reqs: list[dict], rnd: int, context: int) -> dict:
  cmd = [sys.executable, "-m", "ftjax.serve", "--model", ftw_dir, "--port", str(free_port()),
         "--max_seq_len", str(context)]
  server = Server("ftjax.serve", cmd, os.path.join(args.cache_dir, f"ftjax-round{rnd}.log"),
                  cwd=args.cache_dir)
  model = os.path.basename(os.path.normpath(ftw_dir))  # its default served name
  bodies = [json.dumps({"model": model, "prompt": r["prompt"], "max_tokens": 1,
                        "temperature": 0}).encode() for r in reqs]
  try:
    before = compile_metrics(server.port)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_TIMEOUT_S)
    rows = []

    def session():
      for i, body in enumerate(bodies):
        out, wall = post(conn, "/v1/completions", body)
        u = out["usage"]
        rows.append({"ttft_s": wall, "prompt_tokens": u["prompt_tokens"],
                     "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                     "text": out["choices"][0]["text"]})
        print(f"    ftjax  request {i:2d}: {wall:8.3f} s ({u['prompt_tokens']} tokens, "
              f"{u['prompt_tokens_details']['cached_tokens']} cached)", flush=True)
      return {}

    load = with_other_load(session, server.proc.pid)
    conn.close()
    after = compile_metrics(server.port)
  finally:
    server.stop()
  delta = {k: (after[k] - before[k] if after[k] is not None and before[k] is not None else None)
           for k in before}
  return {"start_s": server.start_s, "requests": rows, "other_load": load["other_load"],
          "metrics_before": before, "metrics_after": after,
          "compiles_after_start": delta["compiles"],
          "compile_s_after_start": delta["compile_s"]}


def llama_context(reqs: list[dict]) -> int:
  longest = max(r["tokens"] for r in reqs)
  return int(math.ceil((longest * 1.25 + 16) / 256) * 256)


def run_llama(args, gguf: str, reqs: list[dict], rnd: int, context: int) -> dict:
  cmd = [os.path.join(args.llama_build, "bin", "llama-server"), "-m", gguf, "-t", "2",
         "-c", str(context), "-np", "1", "--host", "127.0.0.1", "--port", str(free_port())]
  server = Server("llama-server", cmd, os.path.join(args.cache_dir, f"llama-round{rnd}.log"),
                  cwd=args.cache_dir)
  bodies = [json.dumps({"prompt": r["prompt"], "n_predict": 1, "cache_prompt": True,
                        "temperature": 0}).encode() for r in reqs]
  try:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=HTTP_TIMEOUT_S)
    # llama.cpp's own token counts (its tokenizer is its converter's reading of the stand-in):
    # /tokenize touches no slot, and runs before the timed session.
    ids = [post(conn, "/tokenize", json.dumps({"content": r["prompt"]}).encode())[0]["tokens"]
           for r in reqs]
    tokens = [len(x) for x in ids]
    if max(tokens) + 16 > context:
      raise RuntimeError(f"llama.cpp counts {max(tokens)} tokens in the longest prompt: more "
                         f"than the context of {context} - 16")
    rows = []

    def session():
      for i, body in enumerate(bodies):
        out, wall = post(conn, "/completion", body)
        t = out.get("timings", {})
        rows.append({"ttft_s": wall, "prompt_tokens": tokens[i], "prompt_n": t.get("prompt_n"),
                     "prompt_ms": t.get("prompt_ms"),
                     "tokens_evaluated": out.get("tokens_evaluated"),
                     "tokens_cached": out.get("tokens_cached"), "text": out.get("content")})
        print(f"    llama  request {i:2d}: {wall:8.3f} s ({tokens[i]} tokens, prefilled "
              f"{t.get('prompt_n')})", flush=True)
      return {}

    load = with_other_load(session, server.proc.pid)
    conn.close()
    _, props = get(server.port, "/props")
  finally:
    server.stop()
  try:
    props = json.loads(props)
    info = {k: props.get(k) for k in ("build_info", "total_slots", "model_path")}
  except ValueError:
    info = {}
  return {"start_s": server.start_s, "requests": rows, "other_load": load["other_load"],
          "server": info, "cmd": cmd,
          "same_token_ids": [a == r["ids"] for a, r in zip(ids, reqs)]}


# -- Report. -----------------------------------------------------------------------------------

def median_of(rounds: list[dict], key: str, i: int):
  values = [r["requests"][i][key] for r in rounds if r["requests"][i].get(key) is not None]
  return statistics.median(values) if values else None


def plot(reqs: list[dict], med: dict, path: str) -> str | None:
  plt = pyplot()
  if plt is None:
    return None
  fig, ax = plt.subplots(figsize=(8, 4.5))
  x = list(range(len(reqs)))
  for side, label in (("ftjax", "ftjax.serve"), ("llama", "llama-server")):
    if med.get(side):
      ax.plot(x, med[side], marker=".", label=label)
  edits = [i for i, r in enumerate(reqs) if r["kind"] == "edit"]
  for n, i in enumerate(edits):
    ax.axvline(i, color="0.8", linestyle="--", zorder=0,
               label="edit (thinking dropped / results trimmed)" if n == 0 else None)
  ax.set_yscale("log")
  ax.set_xlabel("request")
  ax.set_ylabel("TTFT (s, median of rounds)")
  ax.set_title(f"scripted agent session, {reqs[0]['tokens']} to "
               f"{max(r['tokens'] for r in reqs)} tokens of context")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--turns", type=int, default=None, help="requests (default 20; 6 with "
                      "--small)")
  parser.add_argument("--result_tokens", type=int, default=None,
                      help="tokens of each tool result (default 800; 200 with --small)")
  parser.add_argument("--user_every", type=int, default=None,
                      help="a new user message every N turns (default 6; 3 with --small)")
  parser.add_argument("--trim_every", type=int, default=None,
                      help="trim old tool results every N requests (default 10; 4 with --small)")
  parser.add_argument("--keep_recent", type=int, default=None,
                      help="tool results a trim leaves whole (default 6; 2 with --small)")
  parser.add_argument("--small", action="store_true",
                      help="a quick smoke run: 6 shorter requests (one edit of each kind)")
  parser.add_argument("--cache_dir", default=default_cache_dir(),
                      help="the HF checkpoint, FTW, GGUF, converter copy and server logs")
  parser.add_argument("--llama_build", default=LLAMA_BUILD, help="bin/llama-server in it")
  parser.add_argument("--llama_src", default=LLAMA_SRC,
                      help="llama.cpp's source tree (convert_hf_to_gguf.py, gguf-py)")
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--only", choices=SIDES, default=None, help="one server (debugging)")
  parser.add_argument("--reconvert", action="store_true",
                      help="convert to FTW and GGUF again (after a converter change)")
  args = parser.parse_args()
  small = {"turns": 6, "result_tokens": 200, "user_every": 3, "trim_every": 4, "keep_recent": 2}
  full = {"turns": 20, "result_tokens": 800, "user_every": 6, "trim_every": 10,
          "keep_recent": 6}
  for k, v in (small if args.small else full).items():
    if getattr(args, k) is None:
      setattr(args, k, v)
  sides = (args.only,) if args.only else SIDES
  args.cache_dir = os.path.abspath(args.cache_dir)
  t_start = time.perf_counter()

  if "llama" in sides and not os.path.isfile(os.path.join(args.llama_build, "bin",
                                                          "llama-server")):
    raise SystemExit(f"{args.llama_build}/bin/llama-server is missing: build it "
                     "(../shared/PEERS.md, -DLLAMA_BUILD_SERVER=ON)")
  ftw_dir, gguf = prepare(args, "ftjax" in sides, "llama" in sides)
  reqs = workload(args)
  context = llama_context(reqs)
  kinds = [r["kind"] for r in reqs]
  print(f"workload: {len(reqs)} requests, {reqs[0]['tokens']} to "
        f"{max(r['tokens'] for r in reqs)} tokens ({kinds.count('append')} appends, "
        f"{kinds.count('edit')} edits); llama-server context {context}", flush=True)

  rounds: dict[str, list[dict]] = {s: [] for s in sides}
  for rnd in range(args.rounds):
    order = sides if rnd % 2 == 0 else sides[::-1]
    for side in order:
      print(f"round {rnd + 1}: {side}", flush=True)
      if side == "ftjax":
        res = run_ftjax(args, ftw_dir, reqs, rnd, context)
        extra = (f", {res['compiles_after_start']:g} compiles after start-up "
                 f"({res['compile_s_after_start']:.2f} s)"
                 if res["compiles_after_start"] is not None else ", compile metrics missing")
      else:
        res = run_llama(args, gguf, reqs, rnd, context)
        extra = ""
      rounds[side].append(res)
      total = sum(r["ttft_s"] for r in res["requests"])
      print(f"  {side}: started in {res['start_s']:.1f} s, session TTFT total {total:.2f} s"
            + extra + (f"; CONTENDED: other work kept {res['other_load']:.2f} cores busy"
                       if res["other_load"] > 0.1 else ""), flush=True)

  n = len(reqs)
  med = {s: [median_of(rounds[s], "ttft_s", i) for i in range(n)] for s in sides}
  llama_prompt_n = ([median_of(rounds["llama"], "prompt_n", i) for i in range(n)]
                    if "llama" in sides else [None] * n)
  llama_tokens = ([rounds["llama"][0]["requests"][i]["prompt_tokens"] for i in range(n)]
                  if "llama" in sides else [None] * n)
  ftjax_cached = ([median_of(rounds["ftjax"], "cached_tokens", i) for i in range(n)]
                  if "ftjax" in sides else [None] * n)

  def fmt(v, spec):
    width = int(re.match(r"\d+", spec).group())
    return format(v, spec) if v is not None else "-".rjust(width)

  print(f"\nper-request medians over {args.rounds} round(s) (TTFT in seconds)")
  print(f"  {'#':>3} {'tokens':>7} {'kind':>6} {'ftjax':>9} {'cached':>7} {'llama':>9} "
        f"{'llama_tok':>9} {'prompt_n':>8} {'ratio':>6}")
  for i, r in enumerate(reqs):
    f, ll = med.get("ftjax", [None] * n)[i], med.get("llama", [None] * n)[i]
    ratio = f / ll if f is not None and ll else None
    print(f"  {i:3d} {r['tokens']:7d} {r['kind']:>6} {fmt(f, '9.3f')} "
          f"{fmt(ftjax_cached[i], '7.0f')} {fmt(ll, '9.3f')} {fmt(llama_tokens[i], '9d')} "
          f"{fmt(llama_prompt_n[i], '8.0f')} {fmt(ratio, '6.2f')}")

  summary: dict = {"total_ttft_s": {}, "worst_ttft_s": {}, "worst_request": {},
                   "start_s": {}}
  for s in sides:
    summary["total_ttft_s"][s] = sum(med[s])
    worst = max(range(n), key=lambda i: med[s][i])
    summary["worst_ttft_s"][s] = med[s][worst]
    summary["worst_request"][s] = worst
    summary["start_s"][s] = statistics.median(r["start_s"] for r in rounds[s])
    print(f"  {s:>5}: total {summary['total_ttft_s'][s]:8.2f} s, worst request #{worst} "
          f"{med[s][worst]:.3f} s, start-up {summary['start_s'][s]:.1f} s (median)")
  goals = {}
  if "ftjax" in sides:
    compiles = [r["compiles_after_start"] for r in rounds["ftjax"]]
    summary["compiles_after_start"] = compiles
    summary["compile_s_after_start"] = [r["compile_s_after_start"] for r in rounds["ftjax"]]
    goals["zero_compiles"] = {"goal": "0 compiles after start-up (every round)",
                              "value": compiles,
                              "met": all(c == 0 for c in compiles)}
  if len(sides) == 2:
    total_ratio = summary["total_ttft_s"]["ftjax"] / summary["total_ttft_s"]["llama"]
    worst_ratio = summary["worst_ttft_s"]["ftjax"] / summary["worst_ttft_s"]["llama"]
    appends = [i for i in range(n) if reqs[i]["kind"] == "append"]
    slower = [i for i in appends if med["ftjax"][i] > med["llama"][i]]
    summary["append_ratio"] = {i: med["ftjax"][i] / med["llama"][i] for i in appends}
    goals["total_ttft"] = {"goal": f"ftjax <= {GOAL_TOTAL_RATIO}x llama-server's",
                           "value": total_ratio, "met": total_ratio <= GOAL_TOTAL_RATIO}
    goals["worst_ttft"] = {"goal": f"ftjax worst <= {GOAL_WORST_RATIO}x llama-server's worst",
                           "value": worst_ratio, "met": worst_ratio <= GOAL_WORST_RATIO}
    goals["appends_no_slower"] = {"goal": "every append-only request: ftjax <= llama-server",
                                  "value": {"appends": len(appends), "slower": slower},
                                  "met": not slower}
  if "llama" in sides:
    same = rounds["llama"][0]["same_token_ids"]
    summary["llama_same_token_ids"] = sum(same)
    print(f"  llama.cpp tokenizes {sum(same)} of {n} prompts to ftjax's token ids"
          + ("" if all(same) else " (the others: see llama_tok; the servers prefill different "
             "token sequences of the same text)"))
  if len(sides) == 2:
    agree = sum(a["text"] == b["text"] for a, b in zip(rounds["ftjax"][0]["requests"],
                                                       rounds["llama"][0]["requests"]))
    summary["same_first_token"] = agree
    print(f"  the same first token from both servers in {agree} of {n} requests (round 1)")
  if goals:
    print("goals:")
    for name, g in goals.items():
      value = f"{g['value']:.3f}" if isinstance(g["value"], float) else g["value"]
      print(f"  {name:18s} {g['goal']}: {value} -> {'met' if g['met'] else 'NOT met'}")
  busy = [(s, i) for s in sides for i, r in enumerate(rounds[s]) if r["other_load"] > 0.1]
  if busy:
    print(f"WARNING: {len(busy)} session(s) ran while other work kept the CPUs busy "
          "(other_load > 0.1 cores); rerun on an idle machine")

  image = plot(reqs, med, os.path.join(RESULTS_DIR, "agent_peer.png"))
  runtime = time.perf_counter() - t_start
  out = write_results("agent_peer", {
      "machine": machine_info(), "args": vars(args),
      "config": {"layers": args.layers, "overrides": OVERRIDES, "seed": SEED,
                 "hf_config": hf_config(args.layers, **OVERRIDES), "llama_context": context},
      "workload": [{k: v for k, v in r.items() if k not in ("prompt", "ids")} for r in reqs],
      "median_ttft_s": med, "llama_prompt_n": llama_prompt_n, "llama_tokens": llama_tokens,
      "summary": summary, "goals": goals, "rounds": rounds, "plot": image,
      "runtime_s": runtime})
  print(f"wrote {out}" + (f" and {image}" if image else "") + f" ({runtime:.0f} s in all)")


if __name__ == "__main__":
  main()
