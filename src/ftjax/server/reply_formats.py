"""Each model family's reply format: how its replies delimit reasoning and write tool calls, a
streaming parser for each (the ``Delta``s of ``ftjax.server.outputs``: ``reasoning``,
``content``, ``tool_call``), which format a model writes, and how its chat template takes the
calls back. The facts come from the families' chat templates.

- ``qwen`` (Qwen3, Qwen3-Next, Qwen3.5, Qwen2-MoE, Qwen3-Coder): reasoning in
  ``<think>...</think>``; a call is ``<tool_call>{"name": N, "arguments": {...}}</tool_call>``
  (Qwen3), or ``<tool_call><function=N><parameter=K>V</parameter>...</function></tool_call>``
  (Qwen3-Coder, Qwen3.5; a newline on each side of a value);
- ``glm`` (GLM-4.5, 4.6, 4.7, GLM-4.7-Flash): reasoning in ``<think>...</think>``; a call is
  ``<tool_call>N<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`` (newlines
  between the parts before GLM-4.7);
- ``minimax_m2`` (MiniMax-M2): reasoning in ``<think>...</think>``; calls are one
  ``<minimax:tool_call>`` block of ``<invoke name="N"><parameter name="K">V</parameter>...
  </invoke>`` items;
- ``deepseek_v3`` (DeepSeek-V3, V3.1, R1): reasoning in ``<think>...</think>``; calls are one
  ``<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>`` block of
  ``<｜tool▁call▁begin｜>N<｜tool▁sep｜>{JSON}<｜tool▁call▁end｜>`` items (V3.1), or of
  ``function<｜tool▁sep｜>N`` and the arguments in a fenced json block (V3, R1);
- ``kimi_k2`` (Kimi-K2, K2-Thinking): reasoning in ``<think>...</think>``; calls are one
  ``<|tool_calls_section_begin|>...<|tool_calls_section_end|>`` section of
  ``<|tool_call_begin|>functions.N:I<|tool_call_argument_begin|>{JSON}<|tool_call_end|>``
  items;
- ``harmony`` (gpt-oss): messages ``<|channel|>C<|message|>BODY<|end|>``, each but the first
  after ``<|start|>assistant``: reasoning on the ``analysis`` channel, content on ``final``
  (and ``commentary``), a call is a ``commentary`` message ``to=functions.N`` whose body is the
  JSON arguments;
- ``plain`` (anything else): all content, nothing split out.

The tag formats share ``outputs.ReplyParser``'s rules (the newlines next to a tag are dropped; a
call block that does not decode, or is unfinished, stays in the content whole, tags
included); a block that holds several calls (MiniMax's, DeepSeek's and Kimi's sections) gives
them all when it closes, or none (content) when one of them is malformed. ``HarmonyParser``
reads gpt-oss's messages by their headers; a reply that ends inside a function call's
body (gpt-oss's ``<|call|>`` is an end-of-turn token, so the text never shows it) is that call.

Arguments: where a format writes them as a JSON object (Qwen's JSON form, DeepSeek, Kimi,
harmony), they are taken as written. Where it writes each parameter's value as bare text
(Qwen's XML form, GLM, MiniMax: the templates write a string as it is and any other value as
JSON), the value is typed by the parameter's JSON schema in the request's tools: a parameter
whose schema allows a string, or that has no schema (no tool of that name, no such property,
no ``type``), stays the text as written; any other is parsed as JSON (``True``/``False`` and
``None``, as Qwen3.5's template writes Python's, are read for a boolean or null), and text
that does not parse stays text. Nothing is guessed from the text itself: ``"7"`` is a string
for a string parameter and ``7`` for an integer one. A parameter given twice is a malformed
call.

Choosing the format (``select_format``): ``ServerConfig.reply_format`` (``--reply_format``)
when given; else the chat template's tags (the safer signal: Kimi-K2 checkpoints load as
``deepseek_v3`` but write Kimi's format), the first format in the table whose tags the
template's text holds; else the model's ``model_type``; else ``plain``, and the server warns
at start-up what that means (``UNKNOWN_FORMAT``): plain content works, reasoning and tool
calls are not split out.

Rendering back (``fit_template``): a client sends the assistant's calls back as OpenAI's JSON
text, which some templates write as they are and others iterate as an object. At start-up the
server renders a probe call both ways and keeps the shape (``ChatTemplate.tool_arguments``)
in which the format's own parser reads the call back from the rendered prompt.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Sequence

from ftjax.runtime.chat_template import TOOL_ARGUMENTS, ChatTemplate, ChatTemplateError
from ftjax.server.outputs import (THINK_CLOSE, THINK_OPEN, Delta, ReplyParser, TagSyntax,
                                  ToolCall, decode_json_call, new_call, opens_thinking,
                                  partial_suffix)

Calls = list[tuple[str, str]] | None  # a block's (name, arguments as JSON text), None: malformed
THINK = (THINK_OPEN, THINK_CLOSE)
_NAME = re.compile(r"[^\s<>\"']+")  # a function name: no spaces, quotes or angle brackets


# -- Arguments ------------------------------------------------------------------------------------

def _properties(tools: Sequence[dict] | None, name: str) -> dict[str, Any]:
  """The JSON schemas of the parameters of the tool ``name`` among ``tools`` (OpenAI's
  ``{"type": "function", "function": {...}}`` or the bare function), {} when unknown."""
  for tool in tools or ():
    function = tool.get("function", tool) if isinstance(tool, dict) else None
    if isinstance(function, dict) and function.get("name") == name:
      parameters = function.get("parameters")
      properties = parameters.get("properties") if isinstance(parameters, dict) else None
      return properties if isinstance(properties, dict) else {}
  return {}


def _schema_types(schema: Any) -> set[str]:
  """The JSON types a schema allows (``type``, a list of them, or its ``anyOf``/``oneOf``)."""
  if not isinstance(schema, dict):
    return set()
  kind = schema.get("type")
  types = {kind} if isinstance(kind, str) else {
      t for t in kind if isinstance(t, str)} if isinstance(kind, list) else set()
  for key in ("anyOf", "oneOf"):
    for option in schema.get(key) or ():
      types |= _schema_types(option)
  return types


def parameter_value(text: str, schema: Any) -> Any:
  """A parameter's value written as bare text, typed by its JSON ``schema`` (the module's
  docstring: text unless the schema rules a string out)."""
  types = _schema_types(schema)
  if not types or "string" in types:
    return text
  stripped = text.strip()
  try:
    return json.loads(stripped)
  except ValueError:
    pass
  if "boolean" in types and stripped in ("True", "False"):
    return stripped == "True"
  if "null" in types and stripped == "None":
    return None
  return text


def typed_arguments(name: str, pairs: Sequence[tuple[str, str]],
                    tools: Sequence[dict] | None) -> str | None:
  """The JSON text of a call's ``(parameter, text)`` pairs, each typed by the tool's schema;
  None when a parameter is given twice."""
  schemas = _properties(tools, name)
  out: dict[str, Any] = {}
  for key, text in pairs:
    if key in out or not key:
      return None
    out[key] = parameter_value(text, schemas.get(key))
  return json.dumps(out, ensure_ascii=False)


def _json_object(text: str) -> str | None:
  """``text`` stripped, when it is a JSON object (a call's arguments as written), else None."""
  text = text.strip()
  try:
    value = json.loads(text)
  except ValueError:
    return None
  return text if isinstance(value, dict) else None


def _sequence(pattern: re.Pattern, text: str) -> list[re.Match] | None:
  """The consecutive matches of ``pattern`` that make up ``text`` (whitespace may follow the
  last), or None when anything else is in it."""
  out, pos = [], 0
  while pos < len(text):
    match = pattern.match(text, pos)
    if match is None or match.end() == pos:
      return out if not text[pos:].strip() else None
    out.append(match)
    pos = match.end()
  return out


# -- Call decoders, one per tag format ------------------------------------------------------------

_QWEN_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.S)
_QWEN_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def decode_qwen(body: str, tools: Sequence[dict] | None) -> Calls:
  """Qwen's ``<tool_call>`` body: a JSON object (Qwen3), or Qwen3-Coder's and Qwen3.5's
  ``<function=N>`` with ``<parameter=K>\\nV\\n</parameter>`` items (the newline the template
  writes on each side of a value is not part of it)."""
  function = _QWEN_FUNCTION.fullmatch(body)
  if function is None:
    return decode_json_call(body, tools)
  name = function.group(1)
  parameters = _sequence(_QWEN_PARAMETER, function.group(2))
  if parameters is None or not _NAME.fullmatch(name):
    return None
  pairs = []
  for p in parameters:
    value = p.group(2)
    value = value[1:] if value.startswith("\n") else value
    pairs.append((p.group(1), value[:-1] if value.endswith("\n") else value))
  arguments = typed_arguments(name, pairs, tools)
  return None if arguments is None else [(name, arguments)]


_GLM_CALL = re.compile(r"\s*([^\s<>]+)(.*)", re.S)
_GLM_ARGUMENT = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def decode_glm(body: str, tools: Sequence[dict] | None) -> Calls:
  """GLM's ``<tool_call>`` body: the name, then ``<arg_key>K</arg_key><arg_value>V</arg_value>``
  pairs (newlines between them with GLM-4.5/4.6, none with GLM-4.7)."""
  call = _GLM_CALL.fullmatch(body)
  if call is None or not _NAME.fullmatch(call.group(1)):
    return None
  arguments = _sequence(_GLM_ARGUMENT, call.group(2))
  if arguments is None:
    return None
  name = call.group(1)
  text = typed_arguments(name, [(a.group(1), a.group(2)) for a in arguments], tools)
  return None if text is None else [(name, text)]


_MINIMAX_INVOKE = re.compile(r"\s*<invoke name=\"([^\"]+)\">(.*?)</invoke>", re.S)
_MINIMAX_PARAMETER = re.compile(r"\s*<parameter name=\"([^\"]+)\">(.*?)</parameter>", re.S)


def decode_minimax(body: str, tools: Sequence[dict] | None) -> Calls:
  """MiniMax-M2's ``<minimax:tool_call>`` block: ``<invoke name="N">`` items, each with
  ``<parameter name="K">V</parameter>`` items (values as written)."""
  invokes = _sequence(_MINIMAX_INVOKE, body)
  if not invokes:
    return None
  calls = []
  for invoke in invokes:
    name, parameters = invoke.group(1), _sequence(_MINIMAX_PARAMETER, invoke.group(2))
    if parameters is None or not _NAME.fullmatch(name):
      return None
    arguments = typed_arguments(name, [(p.group(1), p.group(2)) for p in parameters], tools)
    if arguments is None:
      return None
    calls.append((name, arguments))
  return calls


DEEPSEEK_CALLS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
_DEEPSEEK_CALL = re.compile(r"\s*<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>",
                            re.S)
_DEEPSEEK_FENCED = re.compile(r"([^\n]+)\n```(?:json)?\n(.*)\n```\s*", re.S)


def decode_deepseek(body: str, tools: Sequence[dict] | None) -> Calls:
  """DeepSeek's ``<｜tool▁calls▁begin｜>`` block: ``<｜tool▁call▁begin｜>N<｜tool▁sep｜>{JSON}
  <｜tool▁call▁end｜>`` items (V3.1), or ``function<｜tool▁sep｜>N`` and the arguments in a
  fenced json block (V3, R1)."""
  del tools  # JSON arguments carry their own types
  items = _sequence(_DEEPSEEK_CALL, body)
  if not items:
    return None
  calls = []
  for item in items:
    name, arguments = item.group(1).strip(), item.group(2)
    fenced = _DEEPSEEK_FENCED.fullmatch(arguments) if name == "function" else None
    if fenced is not None:
      name, arguments = fenced.group(1).strip(), fenced.group(2)
    arguments = _json_object(arguments)
    if arguments is None or not _NAME.fullmatch(name):
      return None
    calls.append((name, arguments))
  return calls


KIMI_CALLS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
_KIMI_CALL = re.compile(
    r"\s*<\|tool_call_begin\|>(.*?)<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.S)
_KIMI_ID = re.compile(r"\s*(?:functions\.)?(.+?)(?::\d+)?\s*")


def decode_kimi(body: str, tools: Sequence[dict] | None) -> Calls:
  """Kimi-K2's tool-call section: ``<|tool_call_begin|>functions.N:I
  <|tool_call_argument_begin|>{JSON}<|tool_call_end|>`` items (the name is the id's middle)."""
  del tools  # JSON arguments carry their own types
  items = _sequence(_KIMI_CALL, body)
  if not items:
    return None
  calls = []
  for item in items:
    name = _KIMI_ID.fullmatch(item.group(1))
    arguments = _json_object(item.group(2))
    if name is None or arguments is None or not _NAME.fullmatch(name.group(1)):
      return None
    calls.append((name.group(1), arguments))
  return calls


# -- gpt-oss's harmony ----------------------------------------------------------------------------

START, END, CALL, RETURN = "<|start|>", "<|end|>", "<|call|>", "<|return|>"
CHANNEL, MESSAGE, CONSTRAIN = "<|channel|>", "<|message|>", "<|constrain|>"
_MESSAGE_ENDS = (END, CALL, RETURN, START)
# How the reply's first header goes on after the prompt's ``<|start|>assistant``.
_FIRST_HEADER = (CHANNEL, " to=", CONSTRAIN, MESSAGE)
MAX_HEADER_CHARS = 512  # a longer "header" is not one: released as content
_CHANNEL_KINDS = {"analysis": "reasoning", "final": "content", "commentary": "content"}


class HarmonyParser:
  """gpt-oss's replies, a sequence of harmony messages: ``[<|start|>assistant]<|channel|>C
  [ to=R][ <|constrain|>json]<|message|>BODY`` ended by ``<|end|>``, ``<|call|>`` or
  ``<|return|>`` (the reply's first message continues the prompt's ``<|start|>assistant``).
  Channel ``analysis`` is reasoning, ``final`` and ``commentary`` content; a message to
  ``functions.N`` is a tool call whose body is its JSON arguments. Anything else (another
  recipient, another role, an unknown channel, a body that is not a JSON object, text outside
  a message) is content as written, tags included. The same interface as ``ReplyParser``."""

  def __init__(self, *, reasoning: bool = False, tool_calls: bool = True,
               tools: Sequence[dict] | None = None):
    del reasoning, tools  # no prompt opens a channel; the arguments are JSON
    self.tool_calls = tool_calls
    self.calls: list[ToolCall] = []
    self._buf = ""
    self._state = "first"  # first (after the prompt), header, body, between (messages)
    self._opened = ""  # the message's text so far as written: <|start|>, its header, <|message|>
    self._kind = "content"  # the body's: reasoning, content, call, raw (content, tags kept)
    self._name = ""  # the function a call body is for
    self._body = ""  # a call's body so far

  def push(self, text: str) -> list[Delta]:
    self._buf += text
    out: list[Delta] = []
    while self._step(out):
      pass
    return out

  def flush(self) -> list[Delta]:
    """The held text at the end of the reply: a call's body ends here (gpt-oss's ``<|call|>``
    is an end-of-turn token), an unfinished header is content."""
    out: list[Delta] = []
    rest, self._buf = self._buf, ""
    if self._state == "body":
      self._finish(rest, "", out)
    elif self._state == "header":
      self._emit(out, "content", self._opened + rest)
    elif rest.strip():
      self._emit(out, "content", rest)
    self._state = "between"
    return out

  @staticmethod
  def _emit(out: list[Delta], kind: str, text: str) -> None:
    if text:
      out.append(Delta("content" if kind == "raw" else kind, text))

  def _step(self, out: list[Delta]) -> bool:
    """Reads what it can of the buffer; False when it needs more text."""
    buf = self._buf
    if self._state == "first":
      if any(buf.startswith(tag) for tag in _FIRST_HEADER):
        self._state, self._opened = "header", ""
        return True
      if buf and any(tag.startswith(buf) for tag in _FIRST_HEADER):
        return False  # perhaps a header's start
      self._state = "between" if buf else "first"
      return bool(buf)
    if self._state == "header":
      at, restart = buf.find(MESSAGE), buf.find(START)
      restarts = restart >= 0 and (at < 0 or restart < at)  # a new message before this opened
      if restarts or (at < 0 and len(buf) > MAX_HEADER_CHARS):
        cut = restart if restarts else len(buf)  # not a header: text as written
        self._emit(out, "content", self._opened + buf[:cut])
        self._buf, self._state = buf[cut:], "between"
        return True
      if at < 0:
        return False
      self._begin(buf[:at])
      self._buf, self._state = buf[at + len(MESSAGE):], "body"
      if self._kind == "raw":
        self._emit(out, "raw", self._opened)
      return True
    if self._state == "body":
      found = [(buf.find(tag), tag) for tag in _MESSAGE_ENDS]
      found = [(i, tag) for i, tag in found if i >= 0]
      if found:
        at, tag = min(found)
        self._buf = buf[at:] if tag == START else buf[at + len(tag):]
        self._finish(buf[:at], "" if tag == START else tag, out)
        self._state = "between"
        return True
      keep = len(buf) - partial_suffix(buf, _MESSAGE_ENDS)
      if self._kind == "call":
        self._body += buf[:keep]
      else:
        self._emit(out, self._kind, buf[:keep])
      self._buf = buf[keep:]
      return False
    # Between messages: the next one's <|start|>; other text is content (whitespace is held).
    at = buf.find(START)
    if at >= 0:
      if buf[:at].strip():
        self._emit(out, "content", buf[:at])
      self._buf, self._state, self._opened = buf[at + len(START):], "header", START
      return True
    keep = len(buf) - partial_suffix(buf, (START,))
    if buf[:keep].strip():
      self._emit(out, "content", buf[:keep])
      self._buf = buf[keep:]
    return False

  def _begin(self, header: str) -> None:
    """The message whose header (between ``<|start|>`` and ``<|message|>``) is ``header``."""
    self._opened += header + MESSAGE
    role = re.split(r" to=|<\|", header, maxsplit=1)[0].strip() or "assistant"
    channel = re.match(r"\s*(\w+)", header.split(CHANNEL, 1)[1]) if CHANNEL in header else None
    recipient = re.search(r"to=([^\s<]+)", header)
    self._body, self._name = "", ""
    if role != "assistant" or channel is None:
      self._kind = "raw"
    elif recipient is not None:
      name = recipient.group(1)
      self._kind = "raw"
      if self.tool_calls and name.startswith("functions.") and _NAME.fullmatch(name[10:]):
        self._kind, self._name = "call", name[10:]
    else:
      self._kind = _CHANNEL_KINDS.get(channel.group(1), "raw")

  def _finish(self, text: str, tag: str, out: list[Delta]) -> None:
    """The message's body ends with ``text`` and the end ``tag`` ("" at the reply's end)."""
    if self._kind != "call":
      self._emit(out, self._kind, text + (tag if self._kind == "raw" else ""))
      return
    body = self._body + text
    arguments = _json_object(body)
    if arguments is None:  # not a call: the message as written
      self._emit(out, "content", self._opened + body + tag)
      return
    call = new_call(self._name, arguments)
    self.calls.append(call)
    out.append(Delta("tool_call", call=call))


# -- The table ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ReplyFormat:
  """One reply format: ``syntax`` (its tags; None: harmony's channels), ``turn`` (the marker
  that opens an assistant turn, to see whether the prompt left a think block open), ``tags``
  (chat-template text that identifies it: all of them must be there) and ``model_types`` (the
  config's, when the template does not say). ``reasoning`` and ``tool_calls`` describe it."""
  name: str
  families: str
  reasoning: str
  tool_calls: str
  syntax: TagSyntax | None
  turn: str | None = None
  tags: tuple[str, ...] = ()
  model_types: tuple[str, ...] = ()

  @property
  def parses_tool_calls(self) -> bool:
    """Whether the format has tool calls to parse (``plain`` has none)."""
    return self.syntax is None or self.syntax.call is not None

  def parser(self, *, reasoning: bool = False, tool_calls: bool = True,
             tools: Sequence[dict] | None = None) -> ReplyParser | HarmonyParser:
    """A parser for one reply (``ReplyParser``'s arguments)."""
    if self.syntax is None:
      return HarmonyParser(tool_calls=tool_calls, tools=tools)
    return ReplyParser(self.syntax, reasoning=reasoning, tool_calls=tool_calls, tools=tools)

  def opens_thinking(self, prompt: str) -> bool:
    """Whether ``prompt`` (a rendered prompt) leaves the reply inside a think block."""
    return self.syntax is not None and opens_thinking(prompt, self.syntax.think, self.turn)


QWEN = ReplyFormat(
    "qwen", "Qwen3, Qwen3-Next, Qwen3.5, Qwen2-MoE, Qwen3-Coder", "<think>...</think>",
    '<tool_call>{"name": ..., "arguments": {...}}</tool_call> or <tool_call><function=...>'
    "<parameter=...>...</parameter></function></tool_call>",
    TagSyntax(THINK, ("<tool_call>", "</tool_call>"), decode_qwen), turn="<|im_start|>",
    tags=("<tool_call>",),
    model_types=("qwen3_moe", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "qwen2_moe"))
FORMATS: dict[str, ReplyFormat] = {f.name: f for f in (
    ReplyFormat("harmony", "gpt-oss", "the analysis channel",
                "commentary messages to=functions.NAME with JSON arguments", None,
                tags=(CHANNEL, MESSAGE), model_types=("gpt_oss",)),
    ReplyFormat("kimi_k2", "Kimi-K2, Kimi-K2-Thinking", "<think>...</think>",
                "<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:I"
                "<|tool_call_argument_begin|>{...}<|tool_call_end|>...",
                TagSyntax(THINK, KIMI_CALLS, decode_kimi), turn="<|im_assistant|>",
                tags=(KIMI_CALLS[0],), model_types=("kimi_k2",)),
    ReplyFormat("deepseek_v3", "DeepSeek-V3, V3.1, R1", "<think>...</think>",
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}"
                "<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>",
                TagSyntax(THINK, DEEPSEEK_CALLS, decode_deepseek), turn="<｜Assistant｜>",
                tags=(DEEPSEEK_CALLS[0],), model_types=("deepseek_v3",)),
    ReplyFormat("minimax_m2", "MiniMax-M2", "<think>...</think>",
                '<minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE'
                "</parameter></invoke>...</minimax:tool_call>",
                TagSyntax(THINK, ("<minimax:tool_call>", "</minimax:tool_call>"),
                          decode_minimax), turn="]~b]ai",
                tags=("<minimax:tool_call>",), model_types=("minimax_m2",)),
    ReplyFormat("glm", "GLM-4.5, 4.6, 4.7, GLM-4.7-Flash", "<think>...</think>",
                "<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>",
                TagSyntax(THINK, ("<tool_call>", "</tool_call>"), decode_glm),
                turn="<|assistant|>", tags=("<arg_key>",),
                model_types=("glm4_moe", "glm4_moe_lite")),
    QWEN,
    ReplyFormat("plain", "any other", "not split out", "not parsed", TagSyntax(None)),
)}
PLAIN = FORMATS["plain"]

UNKNOWN_FORMAT = (
    "ftjax.serve: this model's reply format is not one ftjax knows (model_type {model_type}; "
    "its chat template from {source} has none of the tags of the formats {names}): replies are "
    "served as plain content, the text exactly as the model writes it, but reasoning is not "
    "split out (no reasoning_content or thinking blocks) and tool calls are not parsed (they "
    "stay in the content, and a reply never ends with tool_calls). If the model writes one of "
    "those formats, name it with --reply_format (ServerConfig.reply_format).")
PROBE_FAILED = (
    "ftjax.serve: the chat template (from {source}) renders no assistant tool call that the "
    "{name} format reads back, with the arguments as JSON text or as an object: a client's "
    "tool calls sent back in later turns reach the model as the template renders them, which "
    "may not be how the model writes them.")


@dataclasses.dataclass(frozen=True)
class Selection:
  """The format a server parses replies with, and why (``reason``; None: unknown, ``plain``)."""
  format: ReplyFormat
  reason: str | None

  def warning(self, model_type: str | None, source: str) -> str | None:
    """The start-up warning of an unknown format (None when the format is known)."""
    if self.reason is not None:
      return None
    names = ", ".join(n for n in FORMATS if n != PLAIN.name)
    return UNKNOWN_FORMAT.format(model_type=model_type, source=source, names=names)


def check_name(name: str | None) -> None:
  """A ValueError naming the formats, for a ``reply_format`` that is none of them."""
  if name is not None and name not in FORMATS:
    raise ValueError(f"unknown reply format {name!r}: choose one of {', '.join(FORMATS)} (or "
                     "leave it out to choose by the chat template and model_type)")


def select_format(model_type: str | None, template_text: str | None,
                  name: str | None = None) -> Selection:
  """The format of a model (the module's docstring: ``name`` if given, else the chat
  template's tags, else ``model_type``, else ``plain`` with no reason)."""
  check_name(name)
  if name is not None:
    return Selection(FORMATS[name], "named in the server's configuration")
  for fmt in FORMATS.values():
    if template_text and fmt.tags and all(tag in template_text for tag in fmt.tags):
      return Selection(fmt, f"the chat template writes {fmt.tags[0]}")
  for fmt in FORMATS.values():
    if model_type in fmt.model_types:
      return Selection(fmt, f"model_type {model_type}")
  return Selection(PLAIN, None)


# The probe call ``fit_template`` renders: a string and an integer parameter, so that formats
# that write bare values read them back typed.
PROBE_NAME = "ftjax_probe"
PROBE_ARGUMENTS = {"text": "two words", "count": 7}
PROBE_TOOLS = [{"type": "function", "function": {
    "name": PROBE_NAME, "parameters": {"type": "object", "properties": {
        "text": {"type": "string"}, "count": {"type": "integer"}}}}}]


def _reads_back(template: ChatTemplate, fmt: ReplyFormat) -> bool:
  """Whether ``template`` renders the probe call so that ``fmt``'s parser finds it again."""
  call = {"id": "call_probe", "type": "function",
          "function": {"name": PROBE_NAME, "arguments": json.dumps(PROBE_ARGUMENTS)}}
  messages = [{"role": "user", "content": "Call the probe."},
              {"role": "assistant", "content": "", "tool_calls": [call]},
              {"role": "tool", "tool_call_id": "call_probe", "content": "done"}]
  try:
    text = template.render(messages, add_generation_prompt=True)
  except ChatTemplateError:
    return False
  parser = fmt.parser(tool_calls=True, tools=PROBE_TOOLS)
  parser.push(text)
  parser.flush()
  for found in parser.calls:
    try:
      if found.name == PROBE_NAME and json.loads(found.arguments) == PROBE_ARGUMENTS:
        return True
    except ValueError:
      continue
  return False


def fit_template(template: ChatTemplate, fmt: ReplyFormat) -> str | None:
  """Sets ``template.tool_arguments`` to the first shape (JSON text, then the object) in which
  the template renders an assistant's tool call as ``fmt`` writes it; returns a warning when
  neither does (the shape is then left as JSON text), None otherwise (or when there is
  nothing to fit: no template, or a format without tool calls)."""
  if template.is_fallback or not fmt.parses_tool_calls:
    return None
  for shape in TOOL_ARGUMENTS:
    template.tool_arguments = shape
    if _reads_back(template, fmt):
      return None
  template.tool_arguments = TOOL_ARGUMENTS[0]
  return PROBE_FAILED.format(source=template.source, name=fmt.name)
