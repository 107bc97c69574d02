"""The Anthropic Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) as a
mapping onto the server's chat jobs: the request becomes a ``ChatSpec`` (messages and tools in
the shapes the chat template reads), and the job's deltas become Anthropic's content blocks,
whole or as the server-sent events Anthropic's SDKs parse. The scheduler, the sessions and the
engine never know which API a job came from.

Blocks map to the template's messages as follows:

- ``system`` (a string or text blocks) is the first, system, message; system messages among
  the turns (Claude Code sends them) stay where they are;
- a user message's ``text`` blocks are its content (joined by a newline); each ``tool_result``
  block becomes a tool message before it (``is_error`` results are prefixed ``Error: ``, as the
  template has no other way to say so); ``image`` and ``document`` blocks are refused (the
  served model reads text only);
- an assistant message's ``thinking`` blocks are its ``reasoning_content``, its ``text`` blocks
  its content and its ``tool_use`` blocks its tool calls; ``redacted_thinking`` (encrypted by
  Anthropic) cannot be rendered and is left out, as the template drops earlier turns' thinking
  anyway.

``usage.input_tokens`` counts the prompt tokens that were not reused, as Anthropic's does:
``cache_read_input_tokens`` are the tokens the session reused, and their sum is the prompt.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator, Literal

from pydantic import Field, field_validator, model_validator

from ftjax.server.outputs import Delta
from ftjax.server.protocol import ApiError, Body, ChatSpec, TextContent

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}


def error_body(error: ApiError) -> dict[str, Any]:
  """``error`` in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
  return {"type": "error", "error": {"type": ERROR_TYPES.get(error.status, "api_error"),
                                     "message": error.message}}


class Message(Body):
  # Claude Code (2.1) also sends system messages between the turns (agent listings, reminders).
  role: Literal["user", "assistant", "system"]
  content: str | list[dict[str, Any]]


class Tool(Body):
  name: str = Field(min_length=1)
  description: str | None = None
  input_schema: dict[str, Any] | None = None
  type: str | None = None

  @model_validator(mode="after")
  def _custom_only(self):
    if self.type not in (None, "custom"):
      raise ValueError(f"the server tool {self.type!r} is not supported by this server: give "
                       "client tools (name, description, input_schema)")
    if self.input_schema is None:
      raise ValueError(f"the tool {self.name!r} needs an 'input_schema'")
    return self


class CountTokensRequest(Body):
  model: str = Field(min_length=1)
  messages: list[Message] = Field(min_length=1)
  system: str | list[dict[str, Any]] | None = None
  tools: list[Tool] | None = None
  tool_choice: dict[str, Any] | None = None
  thinking: dict[str, Any] | None = None

  @field_validator("tool_choice")
  @classmethod
  def _tool_choice(cls, v):
    if v is None:
      return v
    kind = v.get("type")
    if kind in ("any", "tool"):
      raise ValueError(f"tool_choice {{'type': {kind!r}}} is not supported: the chat template "
                       "cannot force a tool call; use {'type': 'auto'} or {'type': 'none'}")
    if kind not in ("auto", "none"):
      raise ValueError(f"tool_choice type must be 'auto', 'none', 'any' or 'tool', got {kind!r}")
    return v

  @field_validator("thinking")
  @classmethod
  def _thinking(cls, v):
    if v is not None and v.get("type") not in ("enabled", "disabled", "adaptive"):
      raise ValueError(f"thinking type must be 'enabled', 'disabled' or 'adaptive', got "
                       f"{v.get('type')!r}")
    return v


class MessagesRequest(CountTokensRequest):
  max_tokens: int = Field(ge=1)
  stop_sequences: list[str] | None = None
  temperature: float | None = Field(default=None, ge=0, le=1)
  top_p: float | None = Field(default=None, gt=0, le=1)
  top_k: int | None = Field(default=None, ge=1)
  metadata: dict[str, Any] | None = None
  output_config: dict[str, Any] | None = None
  stream: bool = False

  @field_validator("output_config")
  @classmethod
  def _output_config(cls, v):
    if v and v.get("format") is not None:
      raise ValueError("output_config.format (structured outputs) is not supported by this "
                       "server: leave it out")
    return v

  @field_validator("stop_sequences")
  @classmethod
  def _stops(cls, v):
    if v is not None and any(not isinstance(s, str) or not s for s in v):
      raise ValueError("stop sequences must be non-empty strings")
    return v


# A string or a list of text blocks: the system prompt, a tool result's content.
TEXT = TextContent(noun="block", fields=(("text", "text"),),
                   expected="{'type': 'text', 'text': ...}", media=("image", "document"),
                   none_is_empty=True)


def _block_field(block: dict, name: str, kind: type, where: str):
  value = block.get(name)
  if not isinstance(value, kind):
    raise ApiError(400, f"{where}: a {block.get('type')} block needs '{name}' "
                   f"({kind.__name__})", param=where)
  return value


def _user_messages(blocks: list, where: str) -> list[dict[str, Any]]:
  out, texts = [], []
  for i, block in enumerate(blocks):
    at = f"{where}.{i}"
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text":
      texts.append(_block_field(block, "text", str, at))
    elif kind == "tool_result":
      text = TEXT.read(block.get("content"), f"{at}.content")
      if block.get("is_error"):
        text = "Error: " + text
      out.append({"role": "tool", "tool_call_id": _block_field(block, "tool_use_id", str, at),
                  "content": text})
    elif kind in ("image", "document"):
      raise ApiError(400, f"{at}: {kind} blocks are not supported: this server's model reads "
                     "text only", param=at)
    else:
      raise ApiError(400, f"{at}: a user message's blocks are text, tool_result, image or "
                     f"document; got type {kind!r}", param=at)
  if texts:
    out.append({"role": "user", "content": "\n".join(texts)})
  return out


def _assistant_message(blocks: list, where: str) -> dict[str, Any]:
  texts, thinking, calls = [], [], []
  for i, block in enumerate(blocks):
    at = f"{where}.{i}"
    kind = block.get("type") if isinstance(block, dict) else None
    if kind == "text":
      texts.append(_block_field(block, "text", str, at))
    elif kind == "thinking":
      thinking.append(_block_field(block, "thinking", str, at))
    elif kind == "redacted_thinking":
      continue  # encrypted by Anthropic: nothing to render
    elif kind == "tool_use":
      calls.append({"id": _block_field(block, "id", str, at), "type": "function",
                    "function": {"name": _block_field(block, "name", str, at),
                                 "arguments": json.dumps(_block_field(block, "input", dict, at),
                                                         ensure_ascii=False)}})
    else:
      raise ApiError(400, f"{at}: an assistant message's blocks are text, thinking, "
                     f"redacted_thinking or tool_use; got type {kind!r}", param=at)
  message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
  if thinking:
    message["reasoning_content"] = "\n".join(thinking)
  if calls:
    message["tool_calls"] = calls
  return message


def to_spec(req: CountTokensRequest) -> ChatSpec:
  """The chat job's spec of a Messages (or count_tokens) request; a 400 naming the block for
  content the server cannot take."""
  messages: list[dict[str, Any]] = []
  system = TEXT.read(req.system, "system")
  if system:
    messages.append({"role": "system", "content": system})
  for i, m in enumerate(req.messages):
    where = f"messages.{i}.content"
    if m.role == "system":
      messages.append({"role": "system", "content": TEXT.read(m.content, where)})
    elif isinstance(m.content, str):
      messages.append({"role": m.role, "content": m.content})
    elif m.role == "user":
      messages += _user_messages(m.content, where)
    else:
      messages.append(_assistant_message(m.content, where))
  tools = None
  if req.tools:
    tools = [{"type": "function", "function": {
        "name": t.name, **({"description": t.description} if t.description else {}),
        "parameters": t.input_schema}} for t in req.tools]
  options = {}
  if req.thinking is not None:
    options["enable_thinking"] = req.thinking["type"] != "disabled"
  none = req.tool_choice is not None and req.tool_choice.get("type") == "none"
  spec = ChatSpec(model=req.model, messages=messages, tools=tools, template_options=options,
                  parse_tool_calls=bool(tools) and not none)
  if isinstance(req, MessagesRequest):
    spec.max_tokens = req.max_tokens
    spec.temperature = 1.0 if req.temperature is None else req.temperature
    spec.top_p, spec.top_k = req.top_p, req.top_k
    spec.stops = list(req.stop_sequences or [])
    spec.stream = req.stream
  return spec


def stop_reason(outcome) -> str:
  if outcome.finish_reason == "tool_calls":
    return "tool_use"
  if outcome.finish_reason == "length":
    return "max_tokens"
  return "stop_sequence" if outcome.stop_sequence is not None else "end_turn"


def usage(outcome) -> dict[str, int]:
  return {"input_tokens": outcome.prompt_tokens - outcome.cached_tokens,
          "cache_creation_input_tokens": 0, "cache_read_input_tokens": outcome.cached_tokens,
          "output_tokens": outcome.completion_tokens}


def tool_input(arguments: str) -> dict[str, Any]:
  """A tool call's ``input`` object: its arguments, which the model wrote as a JSON object (or,
  rarely, as a string that is not one: then kept whole as ``{"arguments": TEXT}``, since
  Anthropic's ``input`` must be an object)."""
  try:
    value = json.loads(arguments)
  except ValueError:
    value = None
  return value if isinstance(value, dict) else {"arguments": arguments}


def content_blocks(deltas: list[Delta]) -> list[dict[str, Any]]:
  """The reply's deltas as content blocks, in order (consecutive text merged)."""
  blocks: list[dict[str, Any]] = []
  for d in deltas:
    if d.kind == "tool_call":
      blocks.append({"type": "tool_use", "id": d.call.id, "name": d.call.name,
                     "input": tool_input(d.call.arguments)})
      continue
    kind, field = ("thinking", "thinking") if d.kind == "reasoning" else ("text", "text")
    if blocks and blocks[-1]["type"] == kind:
      blocks[-1][field] += d.text
    else:
      blocks.append({"type": kind, field: d.text, **({"signature": ""} if kind == "thinking"
                                                      else {})})
  return blocks


def message_id() -> str:
  return "msg_" + uuid.uuid4().hex


def message_body(rid: str, model: str, deltas: list[Delta], outcome) -> dict[str, Any]:
  return {"id": rid, "type": "message", "role": "assistant", "model": model,
          "content": content_blocks(deltas), "stop_reason": stop_reason(outcome),
          "stop_sequence": outcome.stop_sequence, "usage": usage(outcome)}


def _event(kind: str, body: dict[str, Any]) -> str:
  return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=False)}\n\n"


async def stream(events: AsyncIterator[tuple[str, Any]], rid: str, model: str,
                 prompt_tokens: int, on_done) -> AsyncIterator[str]:
  """Anthropic's server-sent events of a job's ``events`` (``("ping", None)`` while it waits,
  ``("deltas", [Delta])``, then ``("done", outcome)`` or ``("error", exception)``).
  ``on_done(outcome)`` is told of a finished reply."""
  yield _event("message_start", {"message": {
      "id": rid, "type": "message", "role": "assistant", "model": model, "content": [],
      "stop_reason": None, "stop_sequence": None,
      "usage": {"input_tokens": prompt_tokens, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0, "output_tokens": 0}}})
  yield _event("ping", {})
  index, open_kind = -1, None  # the block being streamed: its index and type

  def close() -> list[str]:
    nonlocal open_kind
    if open_kind is None:
      return []
    open_kind = None
    return [_event("content_block_stop", {"index": index})]

  async for kind, payload in events:
    if kind == "ping":
      yield _event("ping", {})
    elif kind == "deltas":
      for d in payload:
        if d.kind == "tool_call":
          for out in close():
            yield out
          index += 1
          yield _event("content_block_start", {"index": index, "content_block": {
              "type": "tool_use", "id": d.call.id, "name": d.call.name, "input": {}}})
          yield _event("content_block_delta", {"index": index, "delta": {
              "type": "input_json_delta",
              "partial_json": json.dumps(tool_input(d.call.arguments), ensure_ascii=False)}})
          yield _event("content_block_stop", {"index": index})
          continue
        block = "thinking" if d.kind == "reasoning" else "text"
        if open_kind != block:
          for out in close():
            yield out
          index += 1
          open_kind = block
          start = ({"type": "thinking", "thinking": "", "signature": ""} if block == "thinking"
                   else {"type": "text", "text": ""})
          yield _event("content_block_start", {"index": index, "content_block": start})
        delta = ({"type": "thinking_delta", "thinking": d.text} if block == "thinking"
                 else {"type": "text_delta", "text": d.text})
        yield _event("content_block_delta", {"index": index, "delta": delta})
    elif kind == "error":
      error = ApiError(500, f"generation failed: {type(payload).__name__}: {payload}")
      yield _event("error", {"error": error_body(error)["error"]})
      return
    elif kind == "done":
      for out in close():
        yield out
      on_done(payload)
      yield _event("message_delta", {"delta": {"stop_reason": stop_reason(payload),
                                               "stop_sequence": payload.stop_sequence},
                                     "usage": usage(payload)})
      yield _event("message_stop", {})
