"""Log-probabilities through the server, with the real ``openai`` client and raw HTTP on a real
uvicorn server: completions with ``echo`` (the legacy shape lm-evaluation-harness reads, one
choice per prompt of a list), chat's ``logprobs``/``top_logprobs`` (whole and streamed) and the
Responses API's ``top_logprobs``, each equal to the JAX API's (``Engine.prompt_logprobs``,
``generate_timed(logprobs=True)``) on a separate engine; and their bad requests.

The engines run the float32-activation kernels: the server decodes in a batch of 4 rows, the
JAX API one row, and the bfloat16-activation dense kernels sum 4 rows in another order than one
(measured here 1.7e-3 on the hybrid model; within the server's batch a row is the same beside
any others: test_batch_invariance.py)."""

from __future__ import annotations

import http.client
import json

import numpy as np
import openai
import pytest

import ftjax
from ftjax.runtime.chat_template import load_chat_template
from ftjax.runtime.tokenizer import load_tokenizer
from ftjax.server import BackgroundServer, ServerConfig, create_app

TEXT = "def parse_args(argv):\n    parser = argparse.ArgumentParser()"
TOL = 1e-4  # another engine's programs, the same float32 arithmetic: log-probs agree to this


@pytest.fixture(scope="module", params=("default", "default-hybrid"))
def served(request):
  model = ftjax.load(request.param)
  engine = ftjax.Engine(model, kernels="ffi")
  server = BackgroundServer(create_app(engine, ServerConfig(model_name=request.param,
                                                            max_running=4)))
  client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)
  reference = ftjax.Engine(model, kernels="ffi")  # the JAX API, beside the server's engine
  tok = load_tokenizer(model.path, model.config.vocab_size)
  yield request.param, reference, tok, server, client
  server.stop()


def _post(server, path, body):
  conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
  conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
  resp = conn.getresponse()
  out = resp.status, json.loads(resp.read() or b"{}")
  conn.close()
  return out


def test_echo_gives_the_prompts_logprobs_as_the_jax_api(served):
  name, reference, tok, _, client = served
  ids = tok.encode(TEXT)
  out = client.completions.create(model=name, prompt=TEXT, echo=True, max_tokens=1,
                                  logprobs=3, temperature=0)
  choice = out.choices[0]
  lp = choice.logprobs
  assert choice.text.startswith(TEXT)
  assert len(lp.tokens) == len(ids) + 1 == out.usage.prompt_tokens + 1
  assert out.usage.completion_tokens == 1
  assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
  want = reference.prompt_logprobs(ids)
  np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], [e.logprob for e in want[1:]],
                             atol=TOL, rtol=0)
  for top, entry in zip(lp.top_logprobs[1:len(ids)], want[1:]):
    assert len(top) == 3
    np.testing.assert_allclose(sorted(top.values(), reverse=True), entry.top[:3], atol=TOL,
                               rtol=0)
  # The generated token: greedy, the JAX API's, with its log-prob.
  gen = reference.generate_timed(ids, 1, logprobs=True)
  assert lp.tokens[-1] == tok.decode(gen.tokens)
  assert abs(lp.token_logprobs[-1] - gen.logprobs[0].logprob) < TOL
  assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()), abs=1e-6)
  # The text offsets: each token's text starts where the offset says.
  text = choice.text
  for token, offset in zip(lp.tokens, lp.text_offset):
    if "\ufffd" not in token:
      assert text[offset:offset + len(token)] == token


def test_a_list_of_token_prompts_is_a_choice_each_as_lm_eval_sends(served):
  """lm-evaluation-harness's loglikelihood request: token ids, a batch of prompts,
  ``max_tokens`` 1, ``logprobs`` 1, ``echo``; its continuation's log-likelihood is the sum of
  ``token_logprobs[ctxlen:-1]``."""
  name, reference, tok, server, _ = served
  context = tok.encode("The answer is")
  prompts = [context + tok.encode(c) for c in (" yes", " no", " maybe not")]
  status, body = _post(server, "/v1/completions",
                       {"model": name, "prompt": prompts, "max_tokens": 1, "logprobs": 1,
                        "echo": True, "temperature": 0, "seed": 1234})
  assert status == 200, body
  assert [c["index"] for c in body["choices"]] == [0, 1, 2]
  assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))
  for prompt, choice in zip(prompts, body["choices"]):
    lps = choice["logprobs"]["token_logprobs"]
    assert len(lps) == len(prompt) + 1
    want = reference.prompt_logprobs(prompt)
    score = sum(lps[len(context):-1])
    assert score == pytest.approx(sum(e.logprob for e in want[len(context):]), abs=TOL)
  # max_tokens 0: the prompt alone (the form of the request).
  status, body = _post(server, "/v1/completions",
                       {"model": name, "prompt": prompts[0], "max_tokens": 0, "logprobs": 2,
                        "echo": True})
  assert status == 200, body
  lp = body["choices"][0]["logprobs"]
  assert len(lp["tokens"]) == len(prompts[0]) and body["usage"]["completion_tokens"] == 0
  assert body["choices"][0]["text"] == tok.decode(prompts[0])


def test_chat_logprobs_equal_the_jax_api_whole_and_streamed(served):
  name, reference, tok, _, client = served
  msgs = [{"role": "user", "content": "Write a haiku about caches."}]
  whole = client.chat.completions.create(model=name, messages=msgs, max_tokens=12,
                                         temperature=0, logprobs=True, top_logprobs=2)
  content = whole.choices[0].logprobs.content
  assert len(content) == whole.usage.completion_tokens
  template = load_chat_template(reference.model.path)
  ids = tok.encode(template.render(msgs, add_generation_prompt=True))
  gen = reference.generate_timed(ids, len(content), logprobs=True)
  np.testing.assert_allclose([c.logprob for c in content],
                             [e.logprob for e in gen.logprobs], atol=TOL, rtol=0)
  for c, e in zip(content, gen.logprobs):
    assert c.token == tok.decode([e.token]) and bytes(c.bytes) == tok.token_bytes(e.token)
    assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
  chunks = list(client.chat.completions.create(model=name, messages=msgs, max_tokens=12,
                                               temperature=0, logprobs=True, top_logprobs=2,
                                               stream=True))
  streamed = [c for chunk in chunks for choice in chunk.choices if choice.logprobs
              for c in choice.logprobs.content]
  # The same tokens; the second request reads its prompt's last token again from the first's
  # session (another chunk), so its log-probs agree to TOL, not bit for bit.
  assert [c.token for c in streamed] == [c.token for c in content]
  np.testing.assert_allclose([c.logprob for c in streamed], [c.logprob for c in content],
                             atol=TOL, rtol=0)
  plain = client.chat.completions.create(model=name, messages=msgs, max_tokens=12,
                                         temperature=0)
  assert plain.choices[0].logprobs is None
  assert plain.choices[0].message.content == whole.choices[0].message.content


def test_responses_top_logprobs(served):
  name, _, _, _, client = served
  out = client.responses.create(model=name, input="Name a prime.", max_output_tokens=8,
                                temperature=0, top_logprobs=2)
  parts = [p for item in out.output if item.type == "message" for p in item.content]
  assert parts and parts[0].logprobs
  assert all(len(lp.top_logprobs) == 2 for lp in parts[0].logprobs)
  assert "".join(lp.token for lp in parts[0].logprobs).startswith(parts[0].text[:4])


BAD = [
    ({"prompt": "x", "logprobs": 21}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": ["a", "b"], "stream": True}, "one prompt"),
    ({"prompt": ["a", ""]}, "non-empty"),
    ({"prompt": [[1, 2], []]}, "non-empty"),
    ({"prompt": [[1, 2], [10 ** 9]]}, "prompt.1"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "echo": [1]}, "echo"),
]
BAD_CHAT = [
    ({"top_logprobs": 2}, "needs logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
]


def test_bad_logprob_requests_are_400s_that_say_why(served):
  name, _, _, server, _ = served
  for extra, needle in BAD:
    status, body = _post(server, "/v1/completions", {"model": name, **extra})
    assert status == 400, (extra, body)
    assert needle in body["error"]["message"], (extra, body)
  for extra, needle in BAD_CHAT:
    status, body = _post(server, "/v1/chat/completions",
                         {"model": name, "messages": [{"role": "user", "content": "hi"}],
                          **extra})
    assert status == 400, (extra, body)
    assert needle in body["error"]["message"], (extra, body)
  status, body = _post(server, "/v1/responses", {"model": name, "input": "hi",
                                                 "top_logprobs": 50})
  assert status == 400 and "top_logprobs" in body["error"]["message"], body
  status, _ = _post(server, "/v1/completions", {"model": name, "prompt": "ok", "max_tokens": 2})
  assert status == 200
