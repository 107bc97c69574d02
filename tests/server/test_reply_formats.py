"""Each model family's reply format (``ftjax.server.reply_formats``).

For every format, a conversation with reasoning and tool calls is rendered by a chat template
in that format; the assistant's turn (the text between the generation prompt and the
end-of-turn token, which is what the model writes) is parsed back by the format's parser,
turned into each API's reply (OpenAI chat completions, Anthropic Messages, Responses), sent
back as the client would, and rendered again: the text must be the same. The parse must not
depend on how the text is cut into pieces, and a call that is not well formed stays content.

The templates in ``templates/`` are this suite's own, written to render each family's format
as the family's published template does. The published templates themselves (llama.cpp's
vendored copies under ``/tmp/llama``) are run too where that directory exists. The last test
serves a tiny model fine-tuned on a Kimi-K2 conversation through the real HTTP server.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import openai as openai_sdk
import optax
import pytest

import ftjax
from ftjax.runtime import model as model_lib
from ftjax.runtime.chat_template import ChatTemplate, ChatTemplateError
from ftjax.runtime.tokenizer import load_tokenizer
from ftjax.server import BackgroundServer, ServerConfig, anthropic, create_app, openai, responses
from ftjax.server.protocol import Message
from ftjax.server.reply_formats import (FORMATS, PLAIN, HarmonyParser, fit_template,
                                        parameter_value, select_format)
from ftjax.server.scheduler import Outcome
from ftjax.tiny.train import make_step

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")
VENDORED = "/tmp/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates"

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"},
            "units": {"type": "object"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "save_note", "description": "Saves a note.",
        "parameters": {"type": "object", "properties": {
            "text": {"type": "string"}, "pinned": {"type": "boolean"}}}}},
]
HISTORY = [{"role": "system", "content": "You are terse."},
           {"role": "user", "content": "The weather in Paris and Lyon? Then note it."}]


def call(i: int, name: str, arguments: dict) -> dict:
  return {"id": f"call_{i}", "type": "function",
          "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


# Three calls: a string that looks like a number ("7" for a string parameter must stay one), an
# integer, an object and a boolean, which the formats that write bare values must type back.
ASSISTANT = {"role": "assistant", "content": "Checking both cities.",
             "reasoning_content": "Two cities: two calls,\nthen the note.",
             "tool_calls": [call(0, "get_weather", {"city": "Paris", "days": 3}),
                            call(1, "get_weather", {"city": "Lyon", "days": 1,
                                                    "units": {"temp": "C", "wind": "km/h"}}),
                            call(2, "save_note", {"text": "7", "pinned": True})]}
# gpt-oss's template renders one call per assistant message, and no content beside reasoning.
ONE_CALL = {"role": "assistant", "content": "", "reasoning_content": "The user wants Paris.",
            "tool_calls": [call(0, "get_weather", {"city": "Paris", "days": 3})]}
OUTCOME = Outcome(prompt_tokens=1, completion_tokens=1, cached_tokens=0,
                  finish_reason="tool_calls", ttft_s=0.0, decode_tok_s=None)


@dataclasses.dataclass(frozen=True)
class Case:
  """A template, the format it is chosen as, the arguments shape it takes, and the text that
  ends an assistant turn (the model's end-of-turn token, not part of its reply)."""
  template: str
  format: str
  shape: str
  ends: tuple[str, ...] = ()
  assistant: dict = dataclasses.field(default_factory=lambda: ASSISTANT)

  def __str__(self) -> str:
    return self.template


OWN = [
    Case("qwen3.jinja", "qwen", "text", ("<|im_end|>\n",)),
    Case("qwen3_xml.jinja", "qwen", "object", ("<|im_end|>\n",)),
    Case("glm45.jinja", "glm", "object"),
    Case("glm47.jinja", "glm", "object"),
    Case("minimax_m2.jinja", "minimax_m2", "object", ("[e~[\n",)),
    Case("deepseek_v31.jinja", "deepseek_v3", "text", ("<｜end▁of▁sentence｜>",)),
    Case("kimi_k2.jinja", "kimi_k2", "text", ("<|im_end|>",)),
    Case("gpt_oss.jinja", "harmony", "object", ("<|call|>",), ONE_CALL),
]
REAL = [
    Case("Qwen3.5-4B.jinja", "qwen", "object", ("<|im_end|>\n",)),
    Case("Qwen-Qwen3-0.6B.jinja", "qwen", "text", ("<|im_end|>\n",)),
    Case("Qwen3-Coder.jinja", "qwen", "object", ("<|im_end|>\n",)),
    Case("GLM-4.6.jinja", "glm", "object"),
    Case("GLM-4.7-Flash.jinja", "glm", "object"),
    Case("MiniMax-M2.jinja", "minimax_m2", "object", ("[e~[\n",)),
    Case("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek_v3", "object", ("<｜end▁of▁sentence｜>",)),
    Case("moonshotai-Kimi-K2.jinja", "kimi_k2", "object", ("<|im_end|>",)),
    Case("Kimi-K2-Instruct.jinja", "kimi_k2", "text", ("<|im_end|>",)),
    Case("Kimi-K2-Thinking.jinja", "kimi_k2", "text", ("<|im_end|>",)),
    Case("openai-gpt-oss-120b.jinja", "harmony", "object", ("<|call|>",), ONE_CALL),
]
needs_vendored = pytest.mark.skipif(
    not os.path.isdir(VENDORED), reason=f"the published chat templates are not at {VENDORED}")


def load(folder: str, name: str) -> ChatTemplate:
  with open(os.path.join(folder, name), encoding="utf-8") as f:
    return ChatTemplate({"default": f.read()}, source=name, bos_token="<｜begin▁of▁sentence｜>",
                        eos_token="<|endoftext|>")


def fitted(folder: str, case: Case) -> tuple[ChatTemplate, object]:
  """The case's template, its format chosen by its text and fitted, as the server does."""
  template = load(folder, case.template)
  selection = select_format(None, template.text)
  assert selection.format.name == case.format, selection
  assert fit_template(template, selection.format) is None
  assert template.tool_arguments == case.shape
  return template, selection.format


def model_turn(template: ChatTemplate, case: Case, assistant: dict,
               **options) -> tuple[str, str, str]:
  """(the prompt, the reply the model writes, the whole conversation) for ``assistant``."""
  prompt = template.render(HISTORY, tools=TOOLS, add_generation_prompt=True, **options)
  whole = template.render(HISTORY + [assistant], tools=TOOLS, add_generation_prompt=False,
                          **options)
  assert whole.startswith(prompt), (prompt, whole)
  reply = whole[len(prompt):]
  for end in case.ends:
    if reply.endswith(end):
      return prompt, reply[:-len(end)], whole
  assert not case.ends, f"the turn does not end with one of {case.ends}: {reply!r}"
  return prompt, reply, whole


def parse(fmt, pieces, **options):
  parser = fmt.parser(**options)
  out = []
  for piece in pieces:
    out += parser.push(piece)
  return out + parser.flush(), parser


def merged(deltas):
  """Consecutive text deltas of one kind joined; tool calls as (name, arguments object)."""
  out = []
  for d in deltas:
    if d.kind == "tool_call":
      out.append(("tool_call", d.call.name, json.loads(d.call.arguments)))
    elif out and out[-1][0] == d.kind:
      out[-1] = (d.kind, out[-1][1] + d.text)
    else:
      out.append((d.kind, d.text))
  return out


def sent_back(api: str, deltas) -> dict:
  """The assistant message a client sends back after the reply ``deltas``, through ``api``'s
  reply object and request mapping, as the chat template reads it."""
  if api == "openai":
    body = openai.completion_body("chatcmpl-1", "m", "fp", True, deltas, OUTCOME)
    return Message(**body["choices"][0]["message"]).for_template()
  if api == "anthropic":
    blocks = anthropic.message_body("msg_1", "m", deltas, OUTCOME)["content"]
    request = anthropic.CountTokensRequest(model="m", messages=[
        {"role": "user", "content": "q"}, {"role": "assistant", "content": blocks}])
    return anthropic.to_spec(request).messages[-1]
  request = responses.Request(model="m", input="q")
  items = responses.response_body("resp_1", request, "m", deltas, OUTCOME)["output"]
  request = responses.Request(model="m", input=[{"role": "user", "content": "q"}, *items])
  return responses.to_spec(request).messages[-1]


def check_round_trip(template: ChatTemplate, fmt, case: Case, api: str) -> None:
  prompt, reply, whole = model_turn(template, case, case.assistant)
  deltas, parser = parse(fmt, [reply], reasoning=fmt.opens_thinking(prompt), tools=TOOLS)
  calls = case.assistant["tool_calls"]
  assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [
      (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
  message = sent_back(api, deltas)
  again = template.render(HISTORY + [message], tools=TOOLS, add_generation_prompt=False)
  assert again == whole


@pytest.mark.parametrize("api", ["openai", "anthropic", "responses"])
@pytest.mark.parametrize("case", OWN, ids=str)
def test_round_trip(case, api):
  template, fmt = fitted(HERE, case)
  check_round_trip(template, fmt, case, api)


@needs_vendored
@pytest.mark.parametrize("api", ["openai", "anthropic", "responses"])
@pytest.mark.parametrize("case", REAL, ids=str)
def test_round_trip_with_the_published_templates(case, api):
  template, fmt = fitted(VENDORED, case)
  check_round_trip(template, fmt, case, api)


def expected(case: Case, fmt) -> list[tuple]:
  """What the reply of ``case.assistant`` parses to, as ``merged`` writes it (DeepSeek-V3.1's
  template does not send reasoning back, so its turn has none)."""
  a = case.assistant
  out = [] if fmt.name == "deepseek_v3" else [("reasoning", a["reasoning_content"])]
  out += [("content", a["content"])] if a["content"] else []
  return out + [("tool_call", c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in a["tool_calls"]]


@pytest.mark.parametrize("case", OWN, ids=str)
def test_the_same_deltas_however_the_reply_is_cut(case):
  template, fmt = fitted(HERE, case)
  prompt, reply, _ = model_turn(template, case, case.assistant)
  options = dict(reasoning=fmt.opens_thinking(prompt), tools=TOOLS)
  whole = merged(parse(fmt, [reply], **options)[0])
  assert whole == expected(case, fmt)
  for i in range(len(reply) + 1):
    assert merged(parse(fmt, [reply[:i], reply[i:]], **options)[0]) == whole, i
  assert merged(parse(fmt, list(reply), **options)[0]) == whole
  assert merged(parse(fmt, [reply[i:i + 7] for i in range(0, len(reply), 7)],
                      **options)[0]) == whole


@pytest.mark.parametrize("case", OWN, ids=str)
def test_text_is_released_at_once_unless_it_could_start_a_tag(case):
  """Plain text streams as it comes; only a possible tag start (``<``) waits for more."""
  _, fmt = fitted(HERE, case)
  parser = fmt.parser(tools=TOOLS)
  if fmt.name == "harmony":  # the answer's channel first
    assert parser.push("<|channel|>final<|message|>") == []
  assert merged(parser.push("Sunny in Paris, ")) == [("content", "Sunny in Paris, ")]
  assert merged(parser.push("so go <")) == [("content", "so go ")]
  assert merged(parser.push("3 km> ")) == [("content", "<3 km> ")]
  assert merged(parser.flush()) == []


@pytest.mark.parametrize("case", OWN, ids=str)
def test_without_tools_the_calls_stay_content(case):
  template, fmt = fitted(HERE, case)
  prompt, reply, _ = model_turn(template, case, case.assistant)
  deltas, parser = parse(fmt, [reply], reasoning=fmt.opens_thinking(prompt), tool_calls=False)
  assert not parser.calls and all(d.kind != "tool_call" for d in deltas)
  content = "".join(d.text for d in deltas if d.kind == "content")
  assert "get_weather" in content and "Paris" in content


# Per format, replies with calls that are not well formed: each stays content exactly as
# written (no newline next to a tag, which the parsers drop).
MALFORMED = {
    "qwen": ['<tool_call><function=get_weather><parameter=city>Paris</function></tool_call>',
             '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',
             "<tool_call><function=get weather></function></tool_call>",
             '<tool_call>{"name": "get_weather", "argu'],
    "glm": ["<tool_call>get_weather<arg_key>city</arg_key></tool_call>",
            "<tool_call>get weather<arg_key>city</arg_key><arg_value>P</arg_value></tool_call>",
            "<tool_call>f<arg_key>a</arg_key><arg_value>1</arg_value>"
            "<arg_key>a</arg_key><arg_value>2</arg_value></tool_call>",  # a key given twice
            "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Pa"],
    "minimax_m2": ['<minimax:tool_call><invoke name="get_weather"><parameter name="city">Paris'
                   "</invoke></minimax:tool_call>",
                   # one good call and one bad: the block stays whole
                   '<minimax:tool_call><invoke name="f"></invoke><invoke>x</invoke>'
                   "</minimax:tool_call>",
                   "<minimax:tool_call></minimax:tool_call>"],
    "deepseek_v3": ["<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
                    '{"city": <｜tool▁call▁end｜><｜tool▁calls▁end｜>',
                    "<｜tool▁calls▁begin｜>get_weather{}<｜tool▁calls▁end｜>",
                    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}"],
    "kimi_k2": ["<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
                "<|tool_call_argument_begin|>[1]<|tool_call_end|><|tool_calls_section_end|>",
                "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0"
                "<|tool_call_argument_begin|>{}<|tool_calls_section_end|>"],
    "harmony": ["<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                '{"city": "Par',
                "<|channel|>commentary to=functions.get_weather<|message|>[1, 2]<|end|>",
                "<|channel|>commentary to=browser.search<|message|>{}<|call|>",
                "<|channel|>commentary to=functions.get weather<|message|>{}<|call|>"],
}


@pytest.mark.parametrize("name,text", [(n, t) for n, texts in MALFORMED.items() for t in texts])
def test_a_malformed_call_stays_content(name, text):
  fmt = FORMATS[name]
  for pieces in ([text], list(text)):
    deltas, parser = parse(fmt, ["Let me see. ", *pieces], tools=TOOLS)
    assert not parser.calls
    assert [d.kind for d in deltas] == ["content"] * len(deltas)
    assert "".join(d.text for d in deltas) == "Let me see. " + text


@pytest.mark.parametrize("schema,text,value", [
    ({"type": "string"}, "7", "7"),
    ({"type": "integer"}, "7", 7),
    ({"type": "number"}, " 2.5\n", 2.5),
    ({"type": "boolean"}, "true", True),
    ({"type": "boolean"}, "False", False),  # Python's, as Qwen3.5's template writes it
    ({"type": "array"}, "[1, \"a\"]", [1, "a"]),
    ({"type": "object"}, '{"a": null}', {"a": None}),
    ({"type": ["integer", "null"]}, "None", None),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "7", "7"),
    ({"type": "integer"}, "seven", "seven"),  # not JSON: kept as written
    ({}, "7", "7"),  # no type: text
    (None, "{\"a\": 1}", "{\"a\": 1}"),  # no schema: text
])
def test_parameter_values_are_typed_by_the_schema(schema, text, value):
  assert parameter_value(text, schema) == value


def test_glm_arguments_are_typed_by_the_request_tools():
  text = ("<tool_call>save_note<arg_key>text</arg_key><arg_value>true</arg_value>"
          "<arg_key>pinned</arg_key><arg_value>true</arg_value>"
          "<arg_key>extra</arg_key><arg_value>3</arg_value></tool_call>")
  _, parser = parse(FORMATS["glm"], [text], tools=TOOLS)
  assert json.loads(parser.calls[0].arguments) == {"text": "true", "pinned": True, "extra": "3"}
  _, parser = parse(FORMATS["glm"], [text])  # no tools: every value is text
  assert json.loads(parser.calls[0].arguments) == {"text": "true", "pinned": "true",
                                                   "extra": "3"}


def test_deepseek_v3_and_r1_write_the_arguments_in_a_fenced_block():
  text = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
          '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function'
          '<｜tool▁sep｜>save_note\n```json\n{"text": "x"}\n```<｜tool▁call▁end｜>'
          "<｜tool▁calls▁end｜>")
  deltas, _ = parse(FORMATS["deepseek_v3"], ["Sure.", text])
  assert merged(deltas) == [("content", "Sure."), ("tool_call", "get_weather", {"city": "Paris"}),
                            ("tool_call", "save_note", {"text": "x"})]


def test_deepseek_thinking_reply():
  """With thinking on, DeepSeek-V3.1's prompt opens <think>: the reply is reasoning up to
  </think> (the template never sends it back, so it is not in a rendered turn)."""
  template, fmt = fitted(HERE, OWN[5])
  prompt = template.render(HISTORY, tools=TOOLS, add_generation_prompt=True, thinking=True)
  assert fmt.opens_thinking(prompt)
  assert not fmt.opens_thinking(template.render(HISTORY, tools=TOOLS,
                                                add_generation_prompt=True))
  _, reply, _ = model_turn(template, OWN[5], ASSISTANT)
  reply = "Paris first.</think>" + reply
  for pieces in ([reply], list(reply)):
    deltas, _ = parse(fmt, pieces, reasoning=True, tools=TOOLS)
    assert merged(deltas)[:2] == [("reasoning", "Paris first."),
                                  ("content", "Checking both cities.")]


def test_harmony_channels():
  fmt = FORMATS["harmony"]
  reply = ("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>commentary"
           "<|message|>Looking it up.<|end|><|start|>assistant<|channel|>commentary "
           'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')
  for pieces in ([reply], list(reply)):
    deltas, parser = parse(fmt, pieces)
    assert merged(deltas) == [("reasoning", "Think."), ("content", "Looking it up."),
                              ("tool_call", "get_weather", {"city": "Paris"})]
  answer = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final" \
           "<|message|>It is sunny."
  assert merged(parse(fmt, [answer])[0]) == [("reasoning", "Easy."), ("content", "It is sunny.")]
  # A reply with no harmony markup at all is its text; a message to another role stays whole.
  assert merged(parse(fmt, ["Just text <3"])[0]) == [("content", "Just text <3")]
  odd = "<|start|>user<|message|>hi<|end|>"
  assert merged(parse(fmt, [odd])[0]) == [("content", odd)]
  # With tool calls off, a call is its message as written.
  deltas, parser = parse(fmt, [reply], tool_calls=False)
  assert not parser.calls and merged(deltas) == [("reasoning", "Think."), (
      "content", 'Looking it up.<|start|>assistant<|channel|>commentary to=functions.get_weather '
      '<|constrain|>json<|message|>{"city": "Paris"}')]
  assert isinstance(fmt.parser(), HarmonyParser) and not fmt.opens_thinking("<|start|>assistant")


@pytest.mark.parametrize("model_type,name", [
    ("qwen3_moe", "qwen"), ("qwen3_5_moe", "qwen"), ("qwen3_next", "qwen"), ("gpt_oss", "harmony"),
    ("glm4_moe", "glm"), ("glm4_moe_lite", "glm"), ("minimax_m2", "minimax_m2"),
    ("deepseek_v3", "deepseek_v3"), ("kimi_k2", "kimi_k2")])
def test_a_template_without_tags_falls_back_to_model_type(model_type, name):
  selection = select_format(model_type, "{{ messages[0].content }}")
  assert selection.format.name == name and selection.warning(model_type, "x") is None


def test_the_template_wins_over_model_type():
  """A Kimi-K2 checkpoint loads as deepseek_v3 but writes Kimi's format, as its template says."""
  kimi = load(HERE, "kimi_k2.jinja").text
  assert select_format("deepseek_v3", kimi).format.name == "kimi_k2"
  assert select_format("deepseek_v3", kimi, "deepseek_v3").format.name == "deepseek_v3"


def test_an_unknown_format_is_plain_content_and_says_so():
  selection = select_format("mixtral", "{% for m in messages %}{{ m.content }}{% endfor %}")
  assert selection.format is PLAIN and selection.reason is None
  warning = selection.warning("mixtral", "tokenizer_config.json")
  for words in ("model_type mixtral", "tokenizer_config.json", "plain content",
                "reasoning is not split out", "tool calls are not parsed", "--reply_format"):
    assert words in warning, words
  text = "<think>x</think> <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>\n"
  for pieces in ([text], list(text)):
    deltas, parser = parse(PLAIN, pieces, reasoning=True, tools=TOOLS)
    assert merged(deltas) == [("content", text)] and not parser.calls
  assert not PLAIN.opens_thinking("<think>")
  assert fit_template(load(HERE, "qwen3.jinja"), PLAIN) is None  # nothing to fit


def test_every_format_is_documented():
  docs = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "serve.md")
  with open(docs, encoding="utf-8") as f:
    rows = [line for line in f if line.startswith("| `")]
  for name in FORMATS:
    assert any(row.startswith(f"| `{name}` |") for row in rows), name
    assert ServerConfig(reply_format=name).reply_format == name


def test_a_reply_format_that_does_not_exist_is_refused():
  with pytest.raises(ValueError, match="unknown reply format 'qwen4'.*harmony.*plain"):
    select_format("qwen3_moe", None, "qwen4")
  with pytest.raises(ValueError, match="unknown reply format"):
    ServerConfig(reply_format="qwen4")


def test_arguments_are_rendered_in_the_shape_the_template_reads():
  """Qwen3.5's template iterates the arguments' items: as OpenAI's JSON text they are a 400
  that names the template's failure (not a crash), as the object the turn the model wrote."""
  template = load(HERE, "qwen3_xml.jinja")
  messages = HISTORY + [ASSISTANT]
  with pytest.raises(ChatTemplateError, match="failed on these messages: TypeError"):
    template.render(messages)
  assert fit_template(template, FORMATS["qwen"]) is None and template.tool_arguments == "object"
  assert "<parameter=days>\n3\n</parameter>" in template.render(messages)
  assert isinstance(messages[-1]["tool_calls"][0]["function"]["arguments"], str)  # untouched


def test_a_template_that_cannot_render_the_calls_back_is_reported():
  template = ChatTemplate({"default": "{% for m in messages %}{{ m.content }}{% endfor %}"},
                          source="tokenizer_config.json")
  warning = fit_template(template, FORMATS["glm"])
  assert "renders no assistant tool call that the glm format reads back" in warning
  assert template.tool_arguments == "text"


def test_reasoning_goes_where_the_template_reads_it():
  """gpt-oss's template reads an assistant's reasoning from ``thinking``."""
  assert load(HERE, "gpt_oss.jinja").reasoning_field == "thinking"
  assert all(load(HERE, c.template).reasoning_field == "reasoning_content" for c in OWN[:-1])


def test_templates_may_append_to_lists_without_touching_the_messages():
  """Kimi-K2's templates number calls in a list they append to (transformers' immutable
  sandbox refuses that); the caller's messages stay as they were."""
  template = load(HERE, "kimi_k2.jinja")
  messages = HISTORY + [ASSISTANT, {"role": "tool", "tool_call_id": "call_0", "content": "21"}]
  before = json.dumps(messages)
  text = template.render(messages, tools=TOOLS, add_generation_prompt=True)
  assert "## Return of functions.get_weather:0\n21<|im_end|>" in text
  assert json.dumps(messages) == before


# -- End to end: a tiny model that writes Kimi-K2's format, through the HTTP server -------------

E2E_QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the weather in Paris?"}]
E2E_CALL = {"role": "assistant", "content": "", "reasoning_content": "Ask the tool.",
            "tool_calls": [call(0, "get_weather", {"city": "Paris", "days": 2})]}
E2E_RESULT = {"role": "tool", "tool_call_id": "call_0", "content": "sunny, 21 C"}
E2E_ANSWER = {"role": "assistant", "content": "It is sunny in Paris.", "reasoning_content": ""}


@pytest.fixture(scope="module")
def kimi_server(tmp_path_factory):
  """The embedded default model fine-tuned (60 Adam steps) on one conversation rendered by
  ``templates/kimi_k2.jinja``, saved with that template as its ``chat_template.jinja``, and
  served: its greedy replies are then the conversation's, in Kimi's format."""
  out_dir = str(tmp_path_factory.mktemp("kimi") / "model")
  model = ftjax.load("default")
  template = load(HERE, "kimi_k2.jinja")
  tok = load_tokenizer(model.path, model.config.vocab_size)
  text = template.render(E2E_QUESTION + [E2E_CALL, E2E_RESULT, E2E_ANSWER], tools=TOOLS[:1],
                         add_generation_prompt=False)
  tokens = jnp.asarray(np.asarray(tok.encode(text), np.int32)[None])
  params, bank = jax.tree.map(lambda x: x.astype(jnp.float32), (model.params, model.bank))
  steps = 60
  opt = optax.adam(optax.linear_schedule(1e-3, 1e-4, steps))
  opt_state = opt.init((params, bank))
  step, _, _ = make_step(model.graphdef, model.config, opt, 0.0)
  for _ in range(steps):
    params, bank, opt_state, _, ce, _ = step(params, bank, opt_state, tokens)
  assert float(ce) < 0.1, f"fine-tuning did not converge: cross-entropy {float(ce):.3f}"
  model_lib.save(dataclasses.replace(model, params=params, bank=bank), out_dir,
                 dtype="bfloat16", source={"kind": "fine-tuned", "from": "default"})
  for f in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(model.path, f), os.path.join(out_dir, f))
  shutil.copy(os.path.join(HERE, "kimi_k2.jinja"), os.path.join(out_dir, "chat_template.jinja"))
  server = BackgroundServer(create_app(ftjax.Engine(ftjax.load(out_dir)),
                                       ServerConfig(model_name="kimi")))
  yield server
  server.stop()


def test_a_kimi_tool_call_through_the_server(kimi_server):
  state = kimi_server.app.state.server
  assert state.engine.model.config.model_type == "qwen3_moe"  # the template decides
  assert state.reply_format.name == "kimi_k2" and state.template.tool_arguments == "text"
  client = openai_sdk.OpenAI(base_url=kimi_server.url + "/v1", api_key="none", max_retries=0,
                             timeout=120)
  kwargs = dict(model="kimi", tools=TOOLS[:1], max_tokens=160, temperature=0)
  first = client.chat.completions.create(messages=E2E_QUESTION, **kwargs)
  choice = first.choices[0]
  assert choice.finish_reason == "tool_calls" and not choice.message.content
  assert choice.message.model_extra["reasoning_content"] == "Ask the tool."
  (tool_call,) = choice.message.tool_calls
  assert tool_call.function.name == "get_weather"
  assert json.loads(tool_call.function.arguments) == {"city": "Paris", "days": 2}

  chunks = list(client.chat.completions.create(messages=E2E_QUESTION, stream=True, **kwargs))
  streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
  assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in streamed] == [
      ("get_weather", {"city": "Paris", "days": 2})]
  assert "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                 for c in chunks if c.choices) == "Ask the tool."

  # The call goes back as the client got it and renders as the model wrote it: the second
  # request reuses the whole first turn (its prompt and its reply) from the session.
  assistant = choice.message.model_dump(exclude_none=True)
  result = {"role": "tool", "tool_call_id": tool_call.id, "content": E2E_RESULT["content"]}
  second = client.chat.completions.create(messages=E2E_QUESTION + [assistant, result], **kwargs)
  assert second.choices[0].message.content == E2E_ANSWER["content"]
  assert second.choices[0].finish_reason == "stop"
  reused = second.usage.prompt_tokens_details.cached_tokens
  assert reused >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
