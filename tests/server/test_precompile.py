"""Compile-free serving (issue 29): a server started with ``precompile`` compiles every program
a request can run before it reports ready, and then a scripted agent session, whose context
grows past KV capacities and chunk sizes, with dropped thinking, trimmed tool results,
sampled and greedy replies and stop strings, compiles nothing more. Through a real server
on 127.0.0.1 and the ``openai`` client."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import sysconfig
import time

import numpy as np
import openai
import pytest

import ftjax
from ftjax.runtime import compile_cache, programs
from ftjax.runtime.tokenizer import load_tokenizer
from ftjax.server import BackgroundServer, ServerConfig, create_app

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]


def _get(server, path):
  conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
  conn.request("GET", path)
  response = conn.getresponse()
  body = response.read().decode()
  conn.close()
  return response.status, body


def _texts(tokenizer):
  """Windows of standard-library source of a given token count."""
  source = open(sysconfig.get_paths()["stdlib"] + "/argparse.py", encoding="utf-8").read()
  offset = 0

  def take(tokens):
    nonlocal offset
    ids = tokenizer.encode(source[offset:offset + 8 * tokens])[:tokens]
    offset += 8 * tokens
    return tokenizer.decode(ids)
  return take


def _requests(take, turns):
  """An agent's requests: each turn appends a reply (reasoning and a tool call) and its tool
  result; only the newest reply keeps its reasoning, and every third request the result two
  turns back is cut short, as context-trimming clients do."""
  history = [{"role": "system", "content": "You are a coding agent. " + take(20)},
             {"role": "user", "content": "Fix the failing test. " + take(20)}]
  results, out = [], []
  for turn in range(turns):
    request = [dict(m) for m in history]
    replies = [i for i, m in enumerate(request) if m["role"] == "assistant"]
    for i in replies[:-1]:
      request[i].pop("reasoning_content", None)
    if len(results) >= 2 and turn % 3 == 2:
      history[results[-2]]["content"] = history[results[-2]]["content"][:60] + " [cut]"
      request[results[-2]] = dict(history[results[-2]])
    out.append(request)
    history.append({"role": "assistant", "content": "", "reasoning_content": take(40),
                    "tool_calls": [{"id": f"c{turn}", "type": "function", "function": {
                        "name": "read_file",
                        "arguments": json.dumps({"path": f"src/m{turn}.py"})}}]})
    history.append({"role": "tool", "tool_call_id": f"c{turn}", "content": take(450)})
    results.append(len(history) - 1)
  return out


def test_a_precompiled_server_compiles_nothing_while_serving():
  # Small chunks and two capacities, so that a short session crosses them: KV buffers of
  # 4096 and 16384 + 16 rows (grown with a copy), chunks of 256, 64 and 16 tokens.
  engine = ftjax.Engine(ftjax.load("default-hybrid"), max_seq_len=16384, prefill_chunk=256,
                        kv_growth="grow", decode_chunk=4)
  assert engine.kv_capacities == (4096, 16384 + 16) and engine.chunk_sizes == (256, 64, 16)
  server = BackgroundServer(create_app(engine, ServerConfig(model_name="m", precompile=True)))
  try:
    statuses = []
    deadline = time.monotonic() + 600
    while True:
      status, body = _get(server, "/health")
      statuses.append(status)
      if status == 200 or time.monotonic() > deadline:
        break
      assert status == 503 and json.loads(body)["status"] == "starting"
      time.sleep(0.05)
    startup = json.loads(body)["startup"]
    assert statuses[-1] == 200 and startup["done"] and startup["error"] is None
    # A hybrid model's sessions take anchors; requests decode in a batch of max_running rows.
    needed = engine.programs_needed(anchor_slots=8, batch=ServerConfig().max_running,
                                    decode_alone=False)
    # Per capacity: 3 chunk sizes and the batch's decode loop (a server decodes every request
    # in its batch); the first token; the growth of a state and of a batch; joins and leaves
    # for each capacity pair.
    assert len(needed) == 2 * (3 + 1) + 1 + 2 + 2 * 2 * 2
    assert len(engine.programs_needed(anchor_slots=8, batch=4)) == len(needed) + 2
    assert all(key in engine.programs for key in needed)
    compiled = engine.compile_count
    assert startup["compiled"] == compiled <= len(needed)

    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                        timeout=300)
    take = _texts(load_tokenizer(engine.model.path, engine.model.config.vocab_size))
    options = [dict(temperature=0), dict(temperature=0.8, top_p=0.9, seed=1),
               dict(temperature=0.7, seed=2, stop=["\n\n"]),
               dict(temperature=1.0, extra_body={"top_k": 5}, seed=3)]
    longest = 0
    for i, messages in enumerate(_requests(take, 13)):
      out = oai.chat.completions.create(model="m", messages=messages, tools=TOOLS,
                                        max_tokens=3 + 5 * (i % 3), **options[i % 4])
      longest = max(longest, out.usage.prompt_tokens)
    # Raw completions that start new conversations, a short and a long one.
    oai.completions.create(model="m", prompt=take(300), max_tokens=2, temperature=0)
    oai.completions.create(model="m", prompt=take(5000), max_tokens=1, temperature=0)
    assert longest > 4096  # the session outgrew the first KV buffer
    assert engine.compile_count == compiled, "a request compiled a program"
    _, text = _get(server, "/metrics")
    assert float(re.search(r"^ftjax_compiles_total (\S+)$", text, re.M).group(1)) == compiled
    assert float(re.search(r"^ftjax_startup_done (\S+)$", text, re.M).group(1)) == 1
  finally:
    server.stop()


def _post(server, path, body):
  conn = http.client.HTTPConnection(server.host, server.port, timeout=300)
  conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
  response = conn.getresponse()
  out = response.read().decode()
  conn.close()
  return response.status, out


_COLD = """
import json, sys
import numpy as np
import ftjax
from ftjax.runtime import compile_cache
compile_cache.enable_executables(sys.argv[1])
engine = ftjax.Engine(ftjax.load("default-hybrid"), **json.loads(sys.argv[2]))
engine.precompile(anchor_slots=8, batch=int(sys.argv[3]))
prompts = json.loads(sys.argv[4])
print(json.dumps([engine.loaded_count, {k: engine.generate(v, 3, greedy=True)
                                        for k, v in prompts.items()}]))
"""


def test_a_warm_server_is_ready_after_a_short_requests_programs(tmp_path, fresh_programs):
  """Where the executable store holds every program (a warm start), the server is ready once
  a short request's programs are loaded; the others load in the background, from the store:
  nothing is compiled, and each prompt gives the tokens the engine gave before the restart."""
  options = dict(max_seq_len=4096, prefill_chunk=256, decode_chunk=4)
  model = ftjax.load("default-hybrid")
  rng = np.random.default_rng(0)
  prompts = {"short": rng.integers(0, model.config.vocab_size, 5).tolist(),
             "long": rng.integers(0, model.config.vocab_size, 300).tolist()}  # 256 + 64
  batch = ServerConfig().max_running
  # The cold start in a process of its own, without JAX's persistent cache: a program that
  # cache served would not be stored.
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  done = subprocess.run([sys.executable, "-c", _COLD, str(tmp_path), json.dumps(options),
                         str(batch), json.dumps(prompts)], capture_output=True, text=True,
                        env=env, timeout=600, check=False)
  assert done.returncode == 0, done.stderr
  loaded, expected = json.loads(done.stdout.strip().splitlines()[-1])
  assert loaded == 0  # every program compiled, and stored
  compile_cache.enable_executables(str(tmp_path))
  try:
    engine = ftjax.Engine(model, **options)
    assert engine.compile_count == 0
    needed = engine.programs_needed(anchor_slots=8, batch=batch, decode_alone=False)
    first = engine.executor.first_needed(needed)
    tokenizer = load_tokenizer(model.path, model.config.vocab_size)
    # The first token, the smallest chunk, the batch's decode loop, join and leave.
    assert len(first) == 5 and len(needed) == 7
    server = BackgroundServer(create_app(engine, ServerConfig(model_name="m", precompile=True)))
    try:
      deadline = time.monotonic() + 300
      while (status := _get(server, "/health"))[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
      startup = json.loads(status[1])["startup"]
      assert status[0] == 200 and startup["error"] is None, status
      assert startup["programs"] == len(first)
      assert startup["background"] <= len(needed) - len(first)
      for name, ids in prompts.items():
        code, body = _post(server, "/v1/completions", {"model": "m", "prompt": ids,
                                                       "max_tokens": 3, "temperature": 0})
        assert code == 200, body
        got = json.loads(body)["choices"][0]["text"]
        assert got == tokenizer.decode(expected[name]), name
      while startup["background"] and time.monotonic() < deadline:
        time.sleep(0.05)
        startup = json.loads(_get(server, "/health")[1])["startup"]
      assert startup["background"] == 0
      assert all(key in engine.programs for key in needed)
      assert engine.compile_count == engine.loaded_count == len(needed)  # none compiled
    finally:
      server.stop()
  finally:
    compile_cache.disable_executables()
