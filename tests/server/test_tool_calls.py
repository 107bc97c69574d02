"""A tool-call round trip through the server with the ``openai`` client, on the embedded
default model.

The embedded models were trained on Python source, never on chat, so they do not call tools
by themselves. Here the model is fine-tuned (ftjax's own training step, 50 Adam steps, ~30 s) on
one rendered tool-using conversation, saved as FTW and served: its greedy replies are then the
conversation's, which makes the round trip exact to check. Everything on the server's side
is the real path: template rendering with tools, generation, parsing ``<tool_call>`` output
into ``tool_calls`` (whole and streamed), the assistant message and the tool result sent back,
and the session reuse of the second request.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import anthropic
import numpy as np
import openai
import optax
import pytest

import ftjax
from ftjax.runtime import model as model_lib
from ftjax.runtime.chat_template import load_chat_template
from ftjax.runtime.tokenizer import load_tokenizer
from ftjax.server import BackgroundServer, ServerConfig, create_app
from ftjax.tiny.train import make_step

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call_0", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
RESULT = {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21 C"}
ANSWER = {"role": "assistant", "content": "It is sunny in Paris."}


def fine_tuned(name: str, out_dir: str, steps: int = 50) -> str:
  """The embedded model ``name`` after ``steps`` Adam steps on the rendered conversation
  (float32), saved as a bf16 FTW directory with the original tokenizer and template."""
  model = ftjax.load(name)
  template = load_chat_template(model.path)
  tok = load_tokenizer(model.path, model.config.vocab_size)
  text = template.render(QUESTION + [CALL, RESULT, ANSWER], tools=[WEATHER],
                         add_generation_prompt=False)
  tokens = jnp.asarray(np.asarray(tok.encode(text), np.int32)[None])
  params, bank = jax.tree.map(lambda x: x.astype(jnp.float32), (model.params, model.bank))
  opt = optax.adam(optax.linear_schedule(1e-3, 1e-4, steps))
  opt_state = opt.init((params, bank))
  step, _, _ = make_step(model.graphdef, model.config, opt, 0.0)
  for _ in range(steps):
    params, bank, opt_state, _, ce, _ = step(params, bank, opt_state, tokens)
  assert float(ce) < 0.1, f"fine-tuning did not converge: cross-entropy {float(ce):.3f}"
  model_lib.save(dataclasses.replace(model, params=params, bank=bank), out_dir,
                 dtype="bfloat16", source={"kind": "fine-tuned", "from": name})
  for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(model.path, f), os.path.join(out_dir, f))
  return out_dir


# Both embedded models: the tool round trip through every API (the hybrid's second turn resumes
# its recurrent state from an anchor).
@pytest.fixture(scope="module", params=("default", "default-hybrid"))
def served(request, tmp_path_factory):
  path = fine_tuned(request.param, str(tmp_path_factory.mktemp("tools") / request.param))
  server = BackgroundServer(create_app(ftjax.Engine(ftjax.load(path)),
                                       ServerConfig(model_name="agent")))
  client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)
  client.anthropic = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0,
                                         timeout=120)
  yield client
  server.stop()


def test_tool_call_round_trip(served):
  client = served
  first = client.chat.completions.create(model="agent", messages=QUESTION, tools=[WEATHER],
                                         max_tokens=40, temperature=0)
  choice = first.choices[0]
  assert choice.finish_reason == "tool_calls"
  assert not choice.message.content
  (call,) = choice.message.tool_calls
  assert call.type == "function" and call.function.name == "get_weather"
  assert json.loads(call.function.arguments) == {"city": "Paris"}
  assert call.id.startswith("call_")

  # Streamed: the same call as one delta, and the same finish.
  chunks = list(client.chat.completions.create(
      model="agent", messages=QUESTION, tools=[WEATHER], max_tokens=40, temperature=0,
      stream=True))
  streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
  assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in streamed] \
      == [(0, "get_weather", {"city": "Paris"})]
  assert chunks[-1].choices[0].finish_reason == "tool_calls"
  assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""

  # The call's result goes back; the model answers, reusing the first request's state.
  assistant = choice.message.model_dump(exclude_none=True)
  tool = {"role": "tool", "tool_call_id": call.id, "content": RESULT["content"]}
  second = client.chat.completions.create(model="agent", messages=QUESTION + [assistant, tool],
                                          tools=[WEATHER], max_tokens=40, temperature=0)
  assert second.choices[0].message.content == ANSWER["content"]
  assert second.choices[0].finish_reason == "stop"
  assert not second.choices[0].message.tool_calls
  assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 2


def test_tool_choice_none_leaves_the_call_as_text(served):
  out = served.chat.completions.create(model="agent", messages=QUESTION, tools=[WEATHER],
                                       tool_choice="none", max_tokens=40, temperature=0)
  choice = out.choices[0]
  assert choice.finish_reason == "stop" and not choice.message.tool_calls
  assert choice.message.content.startswith('<tool_call>\n{"name": "get_weather"')


def test_anthropic_tool_use_round_trip(served):
  claude = served.anthropic
  tools = [{"name": "get_weather", "description": WEATHER["function"]["description"],
            "input_schema": WEATHER["function"]["parameters"]}]
  question = [{"role": "user", "content": QUESTION[1]["content"]}]
  kwargs = dict(model="agent", max_tokens=40, system=QUESTION[0]["content"], tools=tools,
                extra_body={"temperature": 0})
  first = claude.messages.create(messages=question, **kwargs)
  assert first.stop_reason == "tool_use"
  (use,) = [b for b in first.content if b.type == "tool_use"]
  assert use.name == "get_weather" and use.input == {"city": "Paris"}
  assert all(b.type == "tool_use" or (b.type == "text" and not b.text) for b in first.content)

  with claude.messages.stream(messages=question, **kwargs) as stream:  # the same, streamed
    events = list(stream)
    streamed = stream.get_final_message()
  assert [b.type for b in streamed.content] == [b.type for b in first.content]
  assert [b.input for b in streamed.content if b.type == "tool_use"] == [{"city": "Paris"}]
  assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta"
             for e in events)
  assert streamed.stop_reason == "tool_use"

  # The result goes back as a tool_result block; the answer reuses the first turn's state.
  turn = [*question, {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                       for b in first.content]},
          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                        "content": RESULT["content"]}]}]
  second = claude.messages.create(messages=turn, **kwargs)
  assert [b.type for b in second.content] == ["text"]
  assert second.content[0].text == ANSWER["content"]
  assert second.stop_reason == "end_turn"
  assert second.usage.cache_read_input_tokens >= first.usage.input_tokens // 2


def test_responses_function_call_round_trip(served):
  client = served
  tool = {"type": "function", **WEATHER["function"]}
  kwargs = dict(model="agent", instructions=QUESTION[0]["content"], tools=[tool],
                max_output_tokens=40, temperature=0)
  first = client.responses.create(input=QUESTION[1]["content"], **kwargs)
  (call,) = [item for item in first.output if item.type == "function_call"]
  assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
  assert first.status == "completed" and not first.output_text

  with client.responses.stream(input=QUESTION[1]["content"], **kwargs) as stream:
    done = [e for e in stream if e.type == "response.function_call_arguments.done"]
    streamed = stream.get_final_response()
  assert [json.loads(e.arguments) for e in done] == [{"city": "Paris"}]
  assert [i.type for i in streamed.output] == [i.type for i in first.output]

  # Stateless: the client sends the call and its output back as items.
  items = [{"role": "user", "content": QUESTION[1]["content"]},
           *[item.model_dump(exclude_none=True) for item in first.output],
           {"type": "function_call_output", "call_id": call.call_id,
            "output": RESULT["content"]}]
  second = client.responses.create(input=items, **kwargs)
  assert second.output_text == ANSWER["content"]
  assert [i.type for i in second.output] == ["message"]
  assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 2
