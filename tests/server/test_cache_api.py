"""``GET /v1/cache`` and ``POST /v1/cache``: the expert cache and the one device budget it
shares with the decode states, on a real server on 127.0.0.1 with requests running in a batch.
Outputs are the same whatever the cache's size (the lru_fill policy's outputs equal the dense
path's), across the resizes the budget makes as the batch's rows come and go, and across a
budget set at run time; a request that cannot fit the budget gets a clear 400."""

from __future__ import annotations

import concurrent.futures
import http.client
import json

import openai
import pytest

import ftjax
from ftjax.runtime.tokenizer import load_tokenizer
from ftjax.server import BackgroundServer, ServerConfig, create_app

PROMPTS = ["def parse_args(argv):", "class Stack:", "import os\n\ndef walk(", "for i in range("]


def _call(server, method, path, body=None):
  conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
  conn.request(method, path, body=None if body is None else json.dumps(body),
               headers={"Content-Type": "application/json"})
  resp = conn.getresponse()
  data = json.loads(resp.read())
  conn.close()
  return resp.status, data


def _slots(engine, budget, state_bytes):
  return min(engine.total_experts, max(0, (budget - state_bytes) // engine.slot_bytes))


@pytest.fixture(scope="module")
def served():
  model = ftjax.load("default")
  probe = ftjax.Engine(model, device_budget_bytes=0, policy="lru_fill")
  cap = probe.kv_capacities[0]
  # Room for the batch's 4 rows, 4 sessions' own states and 40 slots beside them (a KV row
  # of 4096 tokens is larger than many slots: with fewer states held, every expert fits).
  budget = probe.state_bytes(4, cap) + 4 * probe.state_bytes(1, cap) + 40 * probe.slot_bytes
  engine = ftjax.Engine(model, device_budget_bytes=budget, policy="lru_fill")
  server = BackgroundServer(create_app(engine, ServerConfig(model_name="default",
                                                            max_running=4)))
  client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)
  yield engine, server, client, budget
  server.stop()


def _complete(client, prompt, n=12):
  r = client.completions.create(model="default", prompt=prompt, max_tokens=n, temperature=0)
  return r.choices[0].text


def test_the_budget_shrinks_the_cache_for_the_batch_and_outputs_do_not_change(served):
  engine, server, client, budget = served
  status, info = _call(server, "GET", "/v1/cache")
  assert status == 200 and info["object"] == "cache" and info["policy"] == "lru_fill"
  assert info["budget_bytes"] == budget and info["slot_bytes"] == engine.slot_bytes
  assert info["slots"] == _slots(engine, budget, info["state_bytes"])
  assert info["cache_bytes"] == info["slots"] * engine.slot_bytes
  before = info["slots"]

  reference = ftjax.Engine(engine.model)  # no cache: the dense path
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    got = list(pool.map(lambda p: _complete(client, p), PROMPTS))
  tok = load_tokenizer(engine.model.path, engine.model.config.vocab_size)
  for prompt, text in zip(PROMPTS, got):
    assert text == tok.decode(reference.generate(tok.encode(prompt), 12))

  status, info = _call(server, "GET", "/v1/cache")
  # The batch's rows took slots while they ran and gave them back when the last left; the
  # pool's idle sessions still hold their own states.
  assert info["slots"] == _slots(engine, budget, info["state_bytes"])
  assert info["state_bytes"] == 4 * engine.state_bytes(1, engine.kv_capacities[0])
  resizes = info["resizes"]
  assert info["last_resize"] == resizes[-1] and resizes[-1]["slots"] > resizes[-1]["slots_before"]
  assert min(r["slots"] for r in resizes) < before
  for r in resizes:
    assert r["slots"] == _slots(engine, budget, r["state_bytes"])
  assert len(info["sequences"]) == 4
  for seq in info["sequences"]:
    assert seq["steps"] >= 11 and seq["batch_rows"] >= seq["steps"]
    assert seq["hits"] + seq["fills"] + seq["host"] > 0
  assert max(s["batch_rows"] / s["steps"] for s in info["sequences"]) > 1  # they shared steps
  assert info["hits"] + info["fills"] + info["host"] > 0


def test_a_budget_set_at_run_time(served):
  engine, server, client, budget = served
  first = _complete(client, PROMPTS[0], 16)
  held = _call(server, "GET", "/v1/cache")[1]["state_bytes"]
  cap = engine.kv_capacities[0]
  # What one request needs at most (its own state while it reads its prompt, and the batch's
  # rows), and 20 slots: fewer than now beside the sessions the pool holds.
  smaller = engine.state_bytes(1, cap) + engine.state_bytes(4, cap) + 20 * engine.slot_bytes
  status, info = _call(server, "POST", "/v1/cache", {"budget_bytes": smaller})
  assert status == 200 and info["budget_bytes"] == smaller and info["state_bytes"] == held
  assert info["slots"] == _slots(engine, smaller, held) < engine.total_experts
  assert info["last_resize"]["reason"] == f"budget set to {smaller} bytes"
  assert _complete(client, PROMPTS[0], 16) == first
  status, info = _call(server, "POST", "/v1/cache", {"slots": 3})
  assert status == 200 and info["slots"] == 3 and info["budget_bytes"] is None
  assert _complete(client, PROMPTS[0], 16) == first
  for body in ({}, {"slots": 2, "budget_bytes": 10}, {"budget_bytes": -1}, {"size": 4}):
    status, err = _call(server, "POST", "/v1/cache", body)
    assert status == 400, body
    assert err["error"]["message"]
  status, info = _call(server, "POST", "/v1/cache", {"budget_bytes": budget})
  assert status == 200 and info["budget_bytes"] == budget


def test_a_request_that_cannot_fit_the_budget_is_a_clear_error(served):
  engine, server, client, budget = served
  tiny = engine.state_bytes(1, engine.kv_capacities[0]) // 2
  assert _call(server, "POST", "/v1/cache", {"budget_bytes": tiny})[0] == 200
  try:
    with pytest.raises(openai.BadRequestError) as err:
      _complete(client, PROMPTS[1])
    assert err.value.code == "insufficient_memory"
    assert "MiB of decode state" in str(err.value) and "budget_bytes" in str(err.value)
  finally:
    assert _call(server, "POST", "/v1/cache", {"budget_bytes": budget})[0] == 200
  assert _complete(client, PROMPTS[1])  # the server goes on serving
