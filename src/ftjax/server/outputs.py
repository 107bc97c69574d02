"""A reply's text, as it streams, split into reasoning, content and tool calls.

``ReplyParser`` turns the text into ``Delta``s as it arrives, holding back only what could still
be the start of a tag. What the tags are is a ``TagSyntax``: how reasoning is delimited, how a
tool-call block opens and closes, and how a block's body decodes into calls. Each model family's
syntax is in ``ftjax.server.reply_formats`` (the table of reply formats); the default here is
Qwen's, ``<think>\\nREASONING\\n</think>\\n\\nCONTENT`` and
``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``:

- reasoning is the text between the syntax's think tags (the reply starts inside it when the
  prompt opened it: ``opens_thinking``), without the newlines next to the tags;
- each complete call block whose body decodes becomes one ``ToolCall`` per call it holds
  (``arguments`` as JSON text, as OpenAI's API carries it); a body that does not becomes
  content, tags included, so nothing the model wrote is lost (an unfinished block at the end
  of the reply too);
- everything else is content (the newlines next to a tag are dropped, as the chat templates
  render them back; a reply with no tags is its text unchanged).

``StopMatcher`` cuts the raw text at the first stop string. The streaming and the
non-streaming responses are both made of these deltas, so they always agree.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Callable, Sequence

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
TURN_START = "<|im_start|>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
  id: str
  name: str
  arguments: str  # a JSON object, as text


@dataclasses.dataclass(frozen=True)
class Logprob:
  """A token's log-probability as the APIs write it: its text and bytes, its log-prob under
  the model's distribution (None: a prompt's first token, which has no context), the most
  probable tokens' (text, bytes, log-prob), and where its text starts in the choice's text
  (legacy completions' ``text_offset``)."""
  token: str
  bytes: bytes
  logprob: float | None
  top: tuple[tuple[str, bytes, float], ...]
  offset: int


@dataclasses.dataclass(frozen=True)
class Delta:
  kind: str  # "reasoning", "content", "tool_call" or "logprobs" (of the tokens before it)
  text: str = ""
  call: ToolCall | None = None
  logprobs: tuple[Logprob, ...] = ()


def new_call(name: str, arguments: str) -> ToolCall:
  """A ``ToolCall`` with a fresh OpenAI-style id (the models' own ids, where a format has
  them, are not unique across turns; the chat templates number calls themselves)."""
  return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=name, arguments=arguments)


# A call block's body (the text between its tags) and the request's tools -> the calls it holds,
# as (name, arguments as JSON text), or None when it is not a well-formed block.
Decoder = Callable[[str, Sequence[dict] | None], list[tuple[str, str]] | None]


@dataclasses.dataclass(frozen=True)
class TagSyntax:
  """How a reply format marks its parts with tags: ``think`` (open, close) around reasoning,
  ``call`` (open, close) around a block of tool calls, and ``decode`` of a block's body. None
  where the format has no such part (both None: everything is content)."""
  think: tuple[str, str] | None
  call: tuple[str, str] | None = None
  decode: Decoder | None = None

  @property
  def think_open(self) -> str | None:
    return self.think[0] if self.think else None


def opens_thinking(prompt: str, think: tuple[str, str] | None = (THINK_OPEN, THINK_CLOSE),
                   turn: str | None = TURN_START) -> bool:
  """Whether the prompt's last turn (the text after the last ``turn`` marker) opened a ``think``
  block the reply continues (a template that starts the assistant turn with ``<think>\\n``)."""
  if think is None:
    return False
  if turn and turn in prompt:
    prompt = prompt[prompt.rfind(turn) + len(turn):]
  return prompt.rfind(think[0]) > prompt.rfind(think[1])


def partial_suffix(text: str, tags: Sequence[str]) -> int:
  """Length of the longest suffix of ``text`` that is a proper prefix of one of ``tags``."""
  best = 0
  for tag in tags:
    for k in range(min(len(tag) - 1, len(text)), best, -1):
      if text.endswith(tag[:k]):
        best = k
        break
  return best


class StopMatcher:
  """Passes text through until the first of ``stops`` (not included), then nothing."""

  def __init__(self, stops: Sequence[str] = ()):
    self.stops = [s for s in stops if s]
    self.stopped = False
    self.matched: str | None = None  # the stop string that ended the text
    self._held = ""

  def push(self, text: str) -> str:
    if self.stopped:
      return ""
    held = self._held + text
    if not self.stops:
      return held
    hits = [(i, s) for i, s in ((held.find(s), s) for s in self.stops) if i >= 0]
    if hits:
      at, self.matched = min(hits, key=lambda hit: hit[0])
      self.stopped, self._held = True, ""
      return held[:at]
    keep = partial_suffix(held, self.stops)
    self._held = held[len(held) - keep:] if keep else ""
    return held[:len(held) - keep]

  def flush(self) -> str:
    out, self._held = ("" if self.stopped else self._held), ""
    return out


def decode_json_call(body: str,
                     tools: Sequence[dict] | None = None) -> list[tuple[str, str]] | None:
  """Qwen's JSON call body, ``{"name": NAME, "arguments": {...}}`` (``arguments`` may also be
  a string of JSON text, or missing: ``{}``); the arguments come back re-serialized."""
  del tools  # JSON arguments carry their own types
  try:
    value = json.loads(body)
  except ValueError:
    return None
  if not (isinstance(value, dict) and isinstance(value.get("name"), str)
          and isinstance(value.get("arguments", {}), (dict, str))):
    return None
  arguments = value.get("arguments", {})
  if not isinstance(arguments, str):
    arguments = json.dumps(arguments, ensure_ascii=False)
  return [(value["name"], arguments)]


QWEN_JSON = TagSyntax(think=(THINK_OPEN, THINK_CLOSE), call=(CALL_OPEN, CALL_CLOSE),
                      decode=decode_json_call)


class ReplyParser:
  """``push(text)`` and, at the end, ``flush()`` give the reply's ``Delta``s in order.

  syntax: the format's tags (default: Qwen's JSON tool calls). reasoning: the reply starts
  inside a think block. tool_calls: parse call blocks (False: they are content, as for a
  request without tools). tools: the request's tools (OpenAI's shape), which formats whose
  arguments are untyped text read the parameters' types from."""

  def __init__(self, syntax: TagSyntax = QWEN_JSON, *, reasoning: bool = False,
               tool_calls: bool = True, tools: Sequence[dict] | None = None):
    self.syntax, self.tools = syntax, tools
    self.state = "reasoning" if reasoning and syntax.think else "content"
    self.tool_calls = tool_calls and syntax.call is not None and syntax.decode is not None
    self.calls: list[ToolCall] = []
    self._buf = ""
    self._lead = self.state == "reasoning"  # drop the newlines that open a section (after a tag)

  def _tags(self) -> tuple[str, ...]:
    think, call = self.syntax.think, self.syntax.call
    if self.state == "reasoning":
      return (think[1],)
    if self.state == "tool":
      return (call[1],)
    return ((think[0],) if think else ()) + ((call[0],) if self.tool_calls else ())

  def _text(self, text: str) -> list[Delta]:
    if self._lead:
      text = text.lstrip("\n")
    if not text:
      return []
    self._lead = False
    return [Delta(self.state, text)]

  def _close_call(self, body: str) -> list[Delta]:
    decoded = self.syntax.decode(body, self.tools)
    if not decoded:  # not a call: kept as text
      return [Delta("content", self.syntax.call[0] + body + self.syntax.call[1])]
    calls = [new_call(name, arguments) for name, arguments in decoded]
    self.calls += calls
    return [Delta("tool_call", call=call) for call in calls]

  def push(self, text: str) -> list[Delta]:
    self._buf += text
    out: list[Delta] = []
    while True:
      tags = self._tags()
      found = [(self._buf.find(t), t) for t in tags]
      found = [(i, t) for i, t in found if i >= 0]
      if not found:
        break
      i, tag = min(found)
      before, self._buf = self._buf[:i], self._buf[i + len(tag):]
      if self.state == "tool":
        out += self._close_call(before)
        self.state = "content"
      else:
        out += self._text(before.rstrip("\n"))
        if self.state == "reasoning":  # the think block's close
          self.state = "content"
        else:  # in content: a think block or a call block opens
          self.state = "reasoning" if tag == self.syntax.think_open else "tool"
      self._lead = True
    if self.state != "tool":
      end = len(self._buf) - partial_suffix(self._buf, self._tags())
      while end > 0 and self._buf[end - 1] == "\n":
        end -= 1  # perhaps the newline before a tag
      out += self._text(self._buf[:end])
      self._buf = self._buf[end:]
    return out

  def flush(self) -> list[Delta]:
    """The held text at the end of the reply (an unfinished tool call becomes content)."""
    rest, self._buf = self._buf, ""
    if self.state == "tool":
      self.state = "content"
      return [Delta("content", self.syntax.call[0] + rest)]
    return self._text(rest)
