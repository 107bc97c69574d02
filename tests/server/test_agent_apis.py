"""The APIs coding agents speak, through their real SDKs on a real server on 127.0.0.1: the
Anthropic Messages API (the ``anthropic`` client) and the OpenAI Responses API (the ``openai``
client's ``responses``), on both embedded models. Each maps to the same chat job as chat
completions: the same conversation gives the same prompt and the same greedy text. Tool round
trips through both are in test_tool_calls.py (a model fine-tuned to call tools)."""

from __future__ import annotations

import http.client
import json
import logging
import re
import socket
import time

import anthropic
import openai
import pytest

import ftjax
from ftjax.runtime.chat_template import load_chat_template
from ftjax.runtime.tokenizer import load_tokenizer
from ftjax.server import BackgroundServer, ServerConfig, create_app
from ftjax.server import anthropic as anthropic_api

MODELS = ("default", "default-hybrid")
SYSTEM = "You are a coding agent."
QUESTION = "def parse_args(argv):"
GREEDY = {"temperature": 0}  # Anthropic's SDK no longer sends temperature: a raw body field


@pytest.fixture(scope="module", params=MODELS)
def served(request):
  engine = ftjax.Engine(ftjax.load(request.param))
  server = BackgroundServer(create_app(engine, ServerConfig(model_name=request.param)))
  clients = (openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=120),
             anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0,
                                 timeout=120))
  yield request.param, engine, server, *clients
  server.stop()


def _chat_text(oai, name, messages, max_tokens=24):
  out = oai.chat.completions.create(model=name, messages=messages, max_tokens=max_tokens,
                                    temperature=0)
  return out.choices[0].message.content, out


def test_messages_equal_chat_and_stream_equals_whole(served):
  name, _, _, oai, claude = served
  text, chat = _chat_text(oai, name, [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": QUESTION}])
  kwargs = dict(model=name, max_tokens=24, system=SYSTEM, extra_body=GREEDY,
                messages=[{"role": "user", "content": QUESTION}])
  whole = claude.messages.create(**kwargs)
  assert [b.type for b in whole.content] == ["text"]
  assert whole.content[0].text == text
  assert whole.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
      chat.choices[0].finish_reason]
  u = whole.usage
  assert u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens
  assert u.output_tokens == chat.usage.completion_tokens
  assert u.cache_read_input_tokens > 0  # the same conversation again: the session is reused

  with claude.messages.stream(**kwargs) as stream:
    streamed = "".join(stream.text_stream)
    final = stream.get_final_message()
  assert streamed == text
  assert final.content[0].text == text and final.stop_reason == whole.stop_reason
  assert final.usage.output_tokens == whole.usage.output_tokens

  assert claude.messages.count_tokens(model=name, system=SYSTEM, messages=[
      {"role": "user", "content": QUESTION}]).input_tokens == chat.usage.prompt_tokens


def test_messages_stop_sequence(served):
  name, _, _, oai, claude = served
  text, _ = _chat_text(oai, name, [{"role": "user", "content": QUESTION}], 32)
  stop = text[5:8]
  assert stop and stop not in text[:7]
  out = claude.messages.create(model=name, max_tokens=32, stop_sequences=[stop],
                               extra_body=GREEDY, messages=[{"role": "user", "content": QUESTION}])
  assert out.stop_reason == "stop_sequence" and out.stop_sequence == stop
  assert out.content[0].text == text[:text.index(stop)]


def test_responses_equal_chat_and_stream_equals_whole(served):
  name, _, _, oai, _ = served
  text, chat = _chat_text(oai, name, [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": QUESTION}])
  kwargs = dict(model=name, instructions=SYSTEM, input=QUESTION, max_output_tokens=24,
                temperature=0)
  whole = oai.responses.create(**kwargs)
  assert whole.output_text == text
  assert [item.type for item in whole.output] == ["message"]
  assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length"
                          else "completed")
  assert whole.usage.input_tokens == chat.usage.prompt_tokens
  assert whole.usage.output_tokens == chat.usage.completion_tokens
  assert whole.usage.input_tokens_details.cached_tokens > 0

  with oai.responses.stream(**kwargs) as stream:
    deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    final = stream.get_final_response()
  assert "".join(deltas) == text and final.output_text == text
  events = [e.type for e in oai.responses.create(**kwargs, stream=True)]
  assert events[:4] == ["response.created", "response.in_progress",
                        "response.output_item.added", "response.content_part.added"]
  assert events[-4:] == ["response.output_text.done", "response.content_part.done",
                         "response.output_item.done", "response.completed"]


# One conversation in the three APIs' shapes: reasoning, a text reply with a tool call, the
# tool's result (one an error), and the next question.
CHAT = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "content": "Let me look.", "reasoning_content": "I should read it.",
     "tool_calls": [{"id": "t1", "type": "function", "function": {
         "name": "read_file", "arguments": json.dumps({"path": "cli.py"})}}]},
    {"role": "tool", "tool_call_id": "t1", "content": "Error: no such file"},
    {"role": "user", "content": "Try args.py"},
]
TOOL = {"name": "read_file", "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}
ANTHROPIC = [
    {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "I should read it.", "signature": "abc"},
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "t1", "name": "read_file", "input": {"path": "cli.py"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "is_error": True,
         "content": [{"type": "text", "text": "no such file"}]},
        {"type": "text", "text": "Try args.py"}]},
]
RESPONSES = [
    {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
    {"type": "reasoning", "id": "rs_1", "summary": [],
     "content": [{"type": "reasoning_text", "text": "I should read it."}]},
    {"type": "message", "role": "assistant",
     "content": [{"type": "output_text", "text": "Let me look."}]},
    {"type": "function_call", "call_id": "t1", "name": "read_file",
     "arguments": json.dumps({"path": "cli.py"})},
    {"type": "function_call_output", "call_id": "t1", "output": "Error: no such file"},
    {"role": "user", "content": "Try args.py"},
]


def test_every_api_renders_the_conversation_as_chat_does(served):
  name, engine, _, oai, claude = served
  model = engine.model
  tools = [{"type": "function", "function": TOOL}]
  # The reference: the chat template rendered here, on the client's side.
  template = load_chat_template(model.path)
  tok = load_tokenizer(model.path, model.config.vocab_size)
  prompt = len(tok.encode(template.render(CHAT, tools=tools, add_generation_prompt=True)))
  anthropic_tools = [{"name": TOOL["name"], "description": TOOL["description"],
                      "input_schema": TOOL["parameters"]}]
  assert claude.messages.count_tokens(model=name, system=SYSTEM, messages=ANTHROPIC,
                                      tools=anthropic_tools).input_tokens == prompt
  claude_reply = claude.messages.create(model=name, max_tokens=24, system=SYSTEM,
                                        messages=ANTHROPIC, tools=anthropic_tools,
                                        extra_body=GREEDY)
  # Codex's shapes: the function inside a namespace, and a hosted tool nothing here runs.
  reply = oai.responses.create(model=name, instructions=SYSTEM, input=RESPONSES,
                               max_output_tokens=24, temperature=0,
                               tools=[{"type": "namespace", "name": "files", "description": "",
                                       "tools": [{"type": "function", **TOOL}]},
                                      {"type": "web_search", "external_web_access": False}])
  assert reply.usage.input_tokens == prompt
  with_tools = oai.chat.completions.create(model=name, messages=CHAT, max_tokens=24,
                                           temperature=0, tools=tools)
  assert with_tools.usage.prompt_tokens == prompt
  assert claude_reply.usage.input_tokens + claude_reply.usage.cache_read_input_tokens == prompt
  # The same prompt, the same greedy reply (the model's text carries no tags to parse).
  expected = with_tools.choices[0].message.content
  assert reply.output_text == expected
  assert "".join(b.text for b in claude_reply.content if b.type == "text") == expected


def test_the_thinking_switch(served):
  name, engine, _, oai, claude = served
  model = engine.model
  template = load_chat_template(model.path)
  tok = load_tokenizer(model.path, model.config.vocab_size)
  msgs = [{"role": "user", "content": QUESTION}]
  for enabled in (True, False):
    expect = len(tok.encode(template.render(msgs, add_generation_prompt=True,
                                            enable_thinking=enabled)))
    thinking = {"type": "enabled", "budget_tokens": 1024} if enabled else {"type": "disabled"}
    assert claude.messages.count_tokens(model=name, messages=msgs,
                                        thinking=thinking).input_tokens == expect
    effort = "medium" if enabled else "none"
    out = oai.responses.create(model=name, input=QUESTION, max_output_tokens=1,
                               reasoning={"effort": effort}, temperature=0)
    assert out.usage.input_tokens == expect


def _post(server, path, body, headers=None):
  conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
  raw = body if isinstance(body, bytes) else json.dumps(body).encode()
  conn.request("POST", path, raw, {"Content-Type": "application/json", **(headers or {})})
  r = conn.getresponse()
  out = r.status, r.read().decode()
  conn.close()
  return out


def _messages_bad(name):
  ok = {"model": name, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}

  def with_(**kw):
    return {**ok, **kw}

  user = lambda *blocks: [{"role": "user", "content": list(blocks)}]  # noqa: E731
  return [
      ("not json", b"{nope", 400),
      ("no max_tokens", {k: v for k, v in ok.items() if k != "max_tokens"}, 400),
      ("max_tokens 0", with_(max_tokens=0), 400),
      ("no messages", with_(messages=[]), 400),
      ("unknown model", with_(model="claude-opus"), 404),
      ("bad role", with_(messages=[{"role": "tool", "content": "x"}]), 400),
      ("image block", with_(messages=user({"type": "image", "source": {}})), 400),
      ("document block", with_(messages=user({"type": "document", "source": {}})), 400),
      ("unknown block", with_(messages=user({"type": "video"})), 400),
      ("text block without text", with_(messages=user({"type": "text"})), 400),
      ("tool_result without id", with_(messages=user({"type": "tool_result",
                                                      "content": "x"})), 400),
      ("tool_result with an image", with_(messages=user({
          "type": "tool_result", "tool_use_id": "a",
          "content": [{"type": "image", "source": {}}]})), 400),
      ("tool_use in a user turn", with_(messages=user({"type": "tool_use", "id": "a",
                                                       "name": "f", "input": {}})), 400),
      ("tool_use input not an object", with_(messages=[
          {"role": "user", "content": "hi"},
          {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "f",
                                             "input": "x"}]}]), 400),
      ("tool_choice any", with_(tool_choice={"type": "any"}), 400),
      ("tool_choice tool", with_(tool_choice={"type": "tool", "name": "f"}), 400),
      ("tool_choice unknown", with_(tool_choice={"type": "some"}), 400),
      ("tool without schema", with_(tools=[{"name": "f"}]), 400),
      ("server tool", with_(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
       400),
      ("thinking unknown", with_(thinking={"type": "maybe"}), 400),
      ("temperature 2", with_(temperature=2), 400),
      ("top_p 0", with_(top_p=0), 400),
      ("empty stop sequence", with_(stop_sequences=[""]), 400),
      ("structured output", with_(output_config={"format": {"type": "json_schema"}}), 400),
      ("system not text", with_(system=[{"type": "image"}]), 400),
      ("prompt past the context", with_(messages=[{"role": "user", "content": "x " * 70000}]),
       400),
  ]


def _responses_bad(name):
  ok = {"model": name, "input": "hi", "max_output_tokens": 8}

  def with_(**kw):
    return {**ok, **kw}

  return [
      ("not json", b"[1,", 400),
      ("no input", {"model": name}, 400),
      ("no model", {"input": "hi"}, 400),
      ("unknown model", with_(model="gpt-5"), 404),
      ("max_output_tokens 0", with_(max_output_tokens=0), 400),
      ("previous_response_id", with_(previous_response_id="resp_1"), 400),
      ("conversation", with_(conversation="conv_1"), 400),
      ("background", with_(background=True), 400),
      ("tool_choice required", with_(tool_choice="required"), 400),
      ("tool_choice forced", with_(tool_choice={"type": "function", "name": "f"}), 400),
      ("unknown tool type", with_(tools=[{"type": "teleport"}]), 400),
      ("namespace with a bad tool", with_(tools=[{"type": "namespace", "name": "n",
                                                  "tools": [{"type": "function"}]}]), 400),
      ("function tool without name", with_(tools=[{"type": "function"}]), 400),
      ("json output", with_(text={"format": {"type": "json_object"}}), 400),
      ("unknown effort", with_(reasoning={"effort": "max"}), 400),
      ("input image", with_(input=[{"role": "user", "content": [
          {"type": "input_image", "image_url": "x"}]}]), 400),
      ("input file", with_(input=[{"role": "user", "content": [{"type": "input_file"}]}]), 400),
      ("unknown item", with_(input=[{"type": "computer_call"}]), 400),
      ("item reference", with_(input=[{"type": "item_reference", "id": "msg_1"}]), 400),
      ("bad role", with_(input=[{"role": "tool", "content": "x"}]), 400),
      ("function_call without call_id", with_(input=[{"type": "function_call", "name": "f",
                                                      "arguments": "{}"}]), 400),
      ("function_call_output without call_id", with_(input=[
          {"type": "function_call_output", "output": "x"}]), 400),
      ("item not an object", with_(input=["hi"]), 400),
      ("temperature 3", with_(temperature=3), 400),
      ("top_logprobs 21", with_(top_logprobs=21), 400),
      ("prompt past the context", with_(input="x " * 70000), 400),
  ]


def test_bad_requests_answer_in_each_apis_error_shape(served):
  name, engine, server, oai, claude = served
  assert engine.max_seq_len < 70000  # "x " * 70000 does not fit
  cases = [("/v1/messages", c) for c in _messages_bad(name)]
  cases += [("/v1/messages/count_tokens", ("count_tokens: image", {
      "model": name, "messages": [{"role": "user", "content": [{"type": "image"}]}]}, 400))]
  cases += [("/v1/responses", c) for c in _responses_bad(name)]
  assert len([c for c in cases if c[0] == "/v1/messages"]) >= 20
  assert len([c for c in cases if c[0] == "/v1/responses"]) >= 20
  for path, (what, body, status) in cases:
    got, text = _post(server, path, body, {"anthropic-version": "2023-06-01",
                                           "anthropic-beta": "x"})
    assert got == status, (path, what, got, text[:300])
    error = json.loads(text)
    if path.startswith("/v1/messages"):
      assert error["type"] == "error", (what, error)
      assert error["error"]["type"] == anthropic_api.ERROR_TYPES[status]
      assert error["error"]["message"], what
    else:
      assert error["error"]["message"] and error["error"]["type"], (what, error)
  # Still healthy, and the SDKs raise their own error types on these.
  with pytest.raises(anthropic.NotFoundError):
    claude.messages.create(model="other", max_tokens=4, messages=[{"role": "user",
                                                                   "content": "x"}])
  with pytest.raises(openai.BadRequestError, match="previous_response_id"):
    oai.responses.create(model=name, input="x", previous_response_id="resp_x")
  assert claude.messages.create(model=name, max_tokens=2, messages=[
      {"role": "user", "content": "x"}]).usage.output_tokens == 2
  conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
  for method in ("HEAD", "GET"):  # Claude Code probes HEAD /
    conn.request(method, "/?beta=true")
    r = conn.getresponse()
    r.read()
    assert r.status == 200, method
  conn.close()


def test_max_tokens_past_the_context_is_clipped():
  """Agents ask for more than the room left (OpenCode: max_tokens 32000): the reply ends at
  the context's end with ``length`` / ``max_tokens``, as llama-server's does."""
  window = 64
  engine = ftjax.Engine(ftjax.load("default"), max_seq_len=window)
  server = BackgroundServer(create_app(engine, ServerConfig(model_name="m")))
  try:
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    msgs = [{"role": "user", "content": QUESTION}]
    chat = oai.chat.completions.create(model="m", messages=msgs, max_tokens=32000,
                                       temperature=0, stop=["\x00"])
    room = window - chat.usage.prompt_tokens
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == room
    out = claude.messages.create(model="m", max_tokens=32000, messages=msgs, extra_body=GREEDY,
                                 timeout=120)  # the SDK wants one for a large max_tokens
    assert out.stop_reason == "max_tokens" and out.usage.output_tokens == room
    assert out.content[0].text == chat.choices[0].message.content
    reply = oai.responses.create(model="m", input=QUESTION, max_output_tokens=32000,
                                 temperature=0)
    assert reply.status == "incomplete" and reply.usage.output_tokens == room
  finally:
    server.stop()


def _stream_then_hang_up(server, path: str, body: dict, events: int = 3) -> None:
  """Sends a streamed request on a raw socket, reads a few events, and closes the socket."""
  sock = socket.create_connection((server.host, server.port), timeout=60)
  data = json.dumps(body).encode()
  sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
  got = b""
  while got.count(b"data: ") < events:
    got += sock.recv(65536)
  sock.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_a_closed_stream_stops_within_a_chunk_and_keeps_its_context(served, path):
  """Every API: a client that closes its stream stops the generation after the decode chunk in
  progress, and the session keeps what was computed (the next turn reuses it)."""
  name, engine, server, oai, _ = served
  if name != MODELS[0]:
    pytest.skip("server logic: one model is enough (CI time)")
  prompt = [{"role": "user", "content": QUESTION + " # cancelled " + path}]
  body = {"model": name, "stream": True, "temperature": 0, "messages": prompt}
  if path == "/v1/responses":
    body = {"model": name, "stream": True, "temperature": 0, "input": prompt,
            "max_output_tokens": 3000}
  else:
    body["max_tokens"] = 3000
  worker = server.app.state.server.worker
  worker.last_outcome = None
  _stream_then_hang_up(server, path, body)
  deadline = time.monotonic() + 120
  while worker.last_outcome is None and time.monotonic() < deadline:
    time.sleep(0.02)
  outcome = worker.last_outcome
  assert outcome is not None and outcome.cancelled, outcome
  assert outcome.completion_tokens < 3000
  # The chunk in progress and the one the decode loop dispatched behind it, at most.
  assert outcome.after_cancel <= 2 * engine.options.decode_chunk, outcome
  # The next request of the same conversation reuses the prompt and what was generated.
  again = oai.chat.completions.create(model=name, messages=prompt, max_tokens=1, temperature=0)
  assert again.usage.prompt_tokens_details.cached_tokens >= outcome.prompt_tokens - 1


def test_compiles_while_serving_are_counted_and_logged():
  """Until every program is compiled at start-up (issue 29), a request can wait for a compile:
  each one is a warning naming the program and its sizes, and /metrics counts them."""
  records = []

  class Keep(logging.Handler):
    def emit(self, record):
      records.append(record.getMessage())

  handler = Keep(level=logging.WARNING)
  # decode_chunk 3: a runner of its own, so no live engine has compiled its programs before.
  engine = ftjax.Engine(ftjax.load("default"), max_seq_len=384, decode_chunk=3)
  server = BackgroundServer(create_app(engine, ServerConfig(model_name="m")))
  logging.getLogger("uvicorn.error").addHandler(handler)  # after uvicorn configured logging
  try:
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    oai.chat.completions.create(model="m", max_tokens=12, temperature=0,
                                messages=[{"role": "user", "content": QUESTION}])
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
  finally:
    server.stop()
    logging.getLogger("uvicorn.error").removeHandler(handler)
  counted = float(re.search(r"^ftjax_compiles_total (\S+)$", text, re.M).group(1))
  seconds = float(re.search(r"^ftjax_compile_seconds_total (\S+)$", text, re.M).group(1))
  assert counted == engine.compile_count >= 2 and seconds > 0  # an extend and a decode program
  compiled = [r for r in records if "while serving" in r]
  assert len(compiled) == engine.compile_count
  assert any("the extend program" in r for r in compiled), compiled  # the session's prefill
