"""The reply parser and stop matcher (the same deltas however the text is cut into pieces), the
per-turn prompt encoder (the same ids as encoding the whole text), and the one reader of
string-or-text-blocks content the Anthropic and Responses mappings share."""

from __future__ import annotations

import json

import pytest

from ftjax.assets import DEFAULT_HYBRID_MODEL_DIR
from ftjax.runtime.chat_template import load_chat_template
from ftjax.runtime.tokenizer import load_tokenizer
from ftjax.server import anthropic, responses
from ftjax.server.anthropic import tool_input
from ftjax.server.app import TurnEncoder
from ftjax.server.outputs import ReplyParser, StopMatcher, opens_thinking
from ftjax.server.protocol import ApiError


def run(pieces, **options):
  parser = ReplyParser(**options)
  out = []
  for piece in pieces:
    out += parser.push(piece)
  out += parser.flush()
  return out, parser


def merged(deltas):
  """Consecutive text deltas of one kind joined; tool calls as (name, arguments dict)."""
  out = []
  for d in deltas:
    if d.kind == "tool_call":
      out.append(("tool_call", d.call.name, json.loads(d.call.arguments)))
    elif out and out[-1][0] == d.kind:
      out[-1] = (d.kind, out[-1][1] + d.text)
    else:
      out.append((d.kind, d.text))
  return out


def cuts(text):
  """The text whole, one character at a time, and in pieces of 2, 3 and 5."""
  yield [text]
  yield list(text)
  for n in (2, 3, 5):
    yield [text[i:i + n] for i in range(0, len(text), n)]


REPLY = ("<think>\nI should read the file.\n</think>\n\nLet me look.\n<tool_call>\n"
         '{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n<tool_call>\n'
         '{"name": "run_tests", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("i", range(5))
def test_reasoning_content_and_tool_calls(i):
  pieces = list(cuts(REPLY))[i]
  deltas, parser = run(pieces)
  assert merged(deltas) == [("reasoning", "I should read the file."), ("content", "Let me look."),
                            ("tool_call", "read_file", {"path": "a.py"}),
                            ("tool_call", "run_tests", {})]
  assert [c.name for c in parser.calls] == ["read_file", "run_tests"]
  assert len({c.id for c in parser.calls}) == 2


def test_reply_that_starts_inside_thinking():
  for pieces in cuts("plan it\n</think>\n\nDone.\n"):
    deltas, _ = run(pieces, reasoning=True)
    assert merged(deltas) == [("reasoning", "plan it"), ("content", "Done.\n")]


def test_without_tools_a_tool_call_is_text():
  text = 'x <tool_call>{"name": "f", "arguments": {}}</tool_call>'
  for pieces in cuts(text):
    deltas, parser = run(pieces, tool_calls=False)
    assert merged(deltas) == [("content", text)] and not parser.calls


@pytest.mark.parametrize("body", ['{"name": 3}', "not json", '["a"]', '{"arguments": {}}'])
def test_a_malformed_call_stays_as_content(body):
  text = f"a<tool_call>{body}</tool_call>b"
  deltas, parser = run([text])
  assert "".join(d.text for d in deltas) == text and not parser.calls


def test_unfinished_reasoning_and_call_at_the_end():
  deltas, _ = run(["<think>\nstill thinking"])
  assert merged(deltas) == [("reasoning", "still thinking")]
  deltas, parser = run(['ok\n<tool_call>\n{"name": "f", "argu'])
  assert merged(deltas) == [("content", 'ok<tool_call>\n{"name": "f", "argu')]
  assert not parser.calls


def test_string_arguments_pass_through():
  _, parser = run(['<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'])
  assert parser.calls[0].arguments == '{"a": 1}'


def test_a_reply_without_tags_is_unchanged():
  text = "\n\nx = 1\n\n"
  for pieces in cuts(text):
    assert merged(run(pieces)[0]) == [("content", text)]


def test_text_that_only_looks_like_a_tag_start_is_released():
  deltas, _ = run(["a <thin", "g> b <", "tool", " c"])
  assert merged(deltas) == [("content", "a <thing> b <tool c")]


@pytest.mark.parametrize("stops,text,expected,stopped", [
    (["END"], "abcENDdef", "abc", True),
    (["END", "bc"], "abcENDdef", "a", True),
    (["xyz"], "abcxy", "abcxy", False),
    ([], "abc", "abc", False),
    (["\n\n"], "one\ntwo\n\nthree", "one\ntwo", True),
])
def test_stop_matcher(stops, text, expected, stopped):
  for pieces in cuts(text):
    m = StopMatcher(stops)
    out = "".join(m.push(p) for p in pieces) + m.flush()
    assert (out, m.stopped) == (expected, stopped)


def test_opens_thinking():
  assert opens_thinking("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
  assert not opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
  assert not opens_thinking("<|im_start|>user\n<think>x</think><|im_end|>\n"
                            "<|im_start|>assistant\n")


def test_turn_encoder_equals_whole_text_encoding():
  tok = load_tokenizer(DEFAULT_HYBRID_MODEL_DIR, 4096)
  template = load_chat_template(DEFAULT_HYBRID_MODEL_DIR)
  encoder = TurnEncoder(tok)
  assert encoder.per_turn
  messages = [{"role": "system", "content": "Be brief.  "},
              {"role": "user", "content": "x = [1,\n 2]<|im_start|>"}]
  for turn in range(4):
    text = template.render(messages, add_generation_prompt=True)
    assert encoder.encode(text) == tok.encode(text)
    messages += [{"role": "assistant", "content": f" reply {turn}\n\n", "reasoning_content": "hm"},
                 {"role": "user", "content": f"\tnext {turn} <|im_end|> café"}]
  assert encoder.encode("no marker at all") == tok.encode("no marker at all")


def test_turn_encoder_refuses_a_tokenizer_that_adds_tokens():
  class WithBos:
    def encode(self, text):
      return [1] + [ord(c) for c in text]

    def token_id(self, token):
      return 7

  encoder = TurnEncoder(WithBos())
  assert not encoder.per_turn
  assert encoder.encode("a<|im_start|>b") == WithBos().encode("a<|im_start|>b")


def test_anthropic_tool_input_is_always_an_object():
  assert tool_input('{"city": "Paris"}') == {"city": "Paris"}
  # A model that wrote its arguments as a string that is not an object: kept whole.
  assert tool_input("Paris") == {"arguments": "Paris"}
  assert tool_input('"Paris"') == {"arguments": '"Paris"'}
  assert tool_input("[1, 2]") == {"arguments": "[1, 2]"}


@pytest.mark.parametrize("reader,content,expected", [
    (anthropic.TEXT, None, ""),
    (anthropic.TEXT, "plain", "plain"),
    (anthropic.TEXT, [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "a\nb"),
    (anthropic.TEXT, 5, "w: content must be a string or a list of blocks"),
    (anthropic.TEXT, [{"type": "image"}], "w.0: image blocks are not supported: this server's "
     "model reads text only"),
    (anthropic.TEXT, [{"type": "text", "text": "a"}, {"type": "tool_use"}],
     "w.1: expected a text block ({'type': 'text', 'text': ...}), got type 'tool_use'"),
    (responses.MESSAGE_TEXT, [{"type": "input_text", "text": "a"},
                              {"type": "refusal", "refusal": "no"}], "a\nno"),
    (responses.MESSAGE_TEXT, None, "w: content must be a string or a list of parts"),
    (responses.MESSAGE_TEXT, [{"type": "input_file"}], "w.0: input_file parts are not "
     "supported: this server's model reads text only"),
    (responses.REASONING_TEXT, [{"type": "input_text", "text": "a"}], "w.0: expected a text "
     "part (reasoning_text, summary_text, text), got type 'input_text'"),
])
def test_text_content_reader(reader, content, expected):
  """Each API's content that is a string or a list of text blocks: its text, or a 400 that
  names the block, in the API's words."""
  try:
    assert reader.read(content, "w") == expected
  except ApiError as e:
    assert (e.status, e.message, e.param) == (400, expected, expected.split(":")[0])
