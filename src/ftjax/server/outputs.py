"""A reply's text, as it streams, split into reasoning, content and tool calls.

Qwen-style models write ``<think>\\nREASONING\\n</think>\\n\\nCONTENT`` and call tools with
``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``. ``ReplyParser`` turns the
text into ``Delta``s as it arrives, holding back only what could still be the start of a tag:

- reasoning is the text between ``<think>`` and ``</think>`` (the reply starts inside it when
  the prompt opened it: ``opens_thinking``), without the newlines next to the tags;
- each complete ``<tool_call>...</tool_call>`` whose body is a JSON object with a string
  ``name`` becomes a ``ToolCall`` (``arguments`` as JSON text, as OpenAI's API carries it);
  a body that is not becomes content, tags included, so nothing the model wrote is lost;
- everything else is content (the newlines next to a tag are dropped, as the chat template
  renders them back; a reply with no tags is its text unchanged).

``StopMatcher`` cuts the raw text at the first stop string. The streaming and the
non-streaming responses are both made of these deltas, so they always agree.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Sequence

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
TURN_START = "<|im_start|>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
  id: str
  name: str
  arguments: str  # a JSON object, as text


@dataclasses.dataclass(frozen=True)
class Delta:
  kind: str  # "reasoning", "content" or "tool_call"
  text: str = ""
  call: ToolCall | None = None


def opens_thinking(prompt: str) -> bool:
  """Whether the prompt's last turn opened a ``<think>`` block the reply continues (a template
  that starts the assistant turn with ``<think>\\n``)."""
  turn = prompt[prompt.rfind(TURN_START) + 1:] if TURN_START in prompt else prompt
  return turn.rfind(THINK_OPEN) > turn.rfind(THINK_CLOSE)


def _partial_suffix(text: str, tags: Sequence[str]) -> int:
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
    keep = _partial_suffix(held, self.stops)
    self._held = held[len(held) - keep:] if keep else ""
    return held[:len(held) - keep]

  def flush(self) -> str:
    out, self._held = ("" if self.stopped else self._held), ""
    return out


class ReplyParser:
  """``push(text)`` and, at the end, ``flush()`` give the reply's ``Delta``s in order.

  reasoning: the reply starts inside a ``<think>`` block. tool_calls: parse
  ``<tool_call>`` blocks (False: they are content, as for a request without tools)."""

  def __init__(self, *, reasoning: bool = False, tool_calls: bool = True):
    self.state = "reasoning" if reasoning else "content"
    self.tool_calls = tool_calls
    self.calls: list[ToolCall] = []
    self._buf = ""
    self._lead = reasoning  # drop the newlines that open a section (after a tag)

  def _tags(self) -> tuple[str, ...]:
    if self.state == "reasoning":
      return (THINK_CLOSE,)
    if self.state == "tool":
      return (CALL_CLOSE,)
    return (THINK_OPEN, CALL_OPEN) if self.tool_calls else (THINK_OPEN,)

  def _text(self, text: str) -> list[Delta]:
    if self._lead:
      text = text.lstrip("\n")
    if not text:
      return []
    self._lead = False
    return [Delta(self.state, text)]

  def _close_call(self, body: str) -> list[Delta]:
    try:
      value = json.loads(body)
    except ValueError:
      value = None
    if (isinstance(value, dict) and isinstance(value.get("name"), str)
        and isinstance(value.get("arguments", {}), (dict, str))):
      arguments = value.get("arguments", {})
      if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
      call = ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", name=value["name"],
                      arguments=arguments)
      self.calls.append(call)
      return [Delta("tool_call", call=call)]
    return [Delta("content", CALL_OPEN + body + CALL_CLOSE)]  # not a call: kept as text

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
        self.state = {THINK_OPEN: "reasoning", THINK_CLOSE: "content", CALL_OPEN: "tool"}[tag]
      self._lead = True
    if self.state != "tool":
      end = len(self._buf) - _partial_suffix(self._buf, self._tags())
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
      return [Delta("content", CALL_OPEN + rest)]
    return self._text(rest)
