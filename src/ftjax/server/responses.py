"""The OpenAI Responses API (``POST /v1/responses``) as a mapping onto the server's chat jobs.

Stateless: the server keeps no responses, so ``previous_response_id`` is a 400 that says to
send the whole conversation in ``input`` (what Codex does, with ``store: false``); ``store``
is accepted and nothing is stored.

Input items map to the chat template's messages: ``instructions`` is the system message;
``message`` items (``input_text`` / ``output_text`` parts; ``developer`` is rendered as
``system``) are messages; ``function_call`` items are the tool calls of the assistant message
they follow (or of a new one); ``function_call_output`` items are tool messages; a
``reasoning`` item's text is the ``reasoning_content`` of the assistant message after it.
Images, files and references to stored items are refused with a 400 naming the item.

Tools: ``function`` tools, and the functions inside ``namespace`` tools under their own names,
are offered to the model; hosted tools (``web_search``, ``file_search``, ... : ``HOSTED_TOOLS``)
are not, since nothing here runs them, and the request is served without them (Codex sends
``web_search`` with every request). Any other tool type is a 400.

The reply's deltas become output items in order: ``reasoning`` (``reasoning_text`` content),
``message`` (one ``output_text`` part) and ``function_call`` (``call_id``, ``arguments`` as
JSON text); streamed, as the events the ``openai`` SDK parses, each with its
``sequence_number``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Literal

from pydantic import Field, field_validator, model_validator

from ftjax.server.outputs import Delta, Logprob
from ftjax.server.protocol import LEAST_LOGPROB, MAX_LOGPROBS, ApiError, Body, ChatSpec, TextContent

LOGPROBS_ITEM = "message.output_text.logprobs"  # what ``include`` names to get them
THINKING_OFF = ("none", "minimal")  # reasoning.effort values that switch thinking off
# Tools that OpenAI's servers run themselves (or, for custom and local_shell, that take
# free-form input the chat template has no syntax for): not offered to the model here. Codex
# sends web_search with every request, so refusing them would refuse Codex.
HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter",
                "image_generation", "computer_use_preview", "mcp", "local_shell", "custom")


def function_tools(tools: list[dict[str, Any]], where: str = "tools") -> list[dict[str, Any]]:
  """The function tools the model is offered, in the chat template's shape (hosted tools are
  left out). A ``namespace`` tool's functions are offered under their own names (Codex groups
  its sub-agent tools so). Raises ValueError for a tool it cannot read."""
  out = []
  for i, tool in enumerate(tools):
    at = f"{where}.{i}"
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind == "function":
      if not isinstance(tool.get("name"), str) or not tool["name"]:
        raise ValueError(f"{at}: a function tool needs a 'name'")
      out.append({"type": "function", "function": {
          k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}})
    elif kind == "namespace":
      out += function_tools(tool.get("tools") or [], f"{at}.tools")
    elif kind in HOSTED_TOOLS:
      continue
    else:
      raise ValueError(f"{at}: tools of type {kind!r} are not supported by this server: give "
                       "function tools ({'type': 'function', 'name', 'parameters'})")
  return out


class Request(Body):
  model: str = Field(min_length=1)
  input: str | list[dict[str, Any]]
  instructions: str | None = None
  tools: list[dict[str, Any]] | None = None
  tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
  max_output_tokens: int | None = Field(default=None, ge=1)
  temperature: float | None = Field(default=None, ge=0, le=2)
  top_p: float | None = Field(default=None, gt=0, le=1)
  parallel_tool_calls: bool | None = None
  reasoning: dict[str, Any] | None = None
  text: dict[str, Any] | None = None
  stream: bool = False
  store: bool | None = None
  previous_response_id: str | None = None
  conversation: Any = None
  background: bool | None = None
  top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
  include: list[str] | None = None
  metadata: dict[str, Any] | None = None

  @field_validator("tools")
  @classmethod
  def _function_tools(cls, v):
    function_tools(v or [])  # raises ValueError naming the tool
    return v

  @model_validator(mode="after")
  def _supported(self):
    if self.previous_response_id is not None:
      raise ValueError("previous_response_id is not supported: this server keeps no responses; "
                       "send the whole conversation in 'input' (and store: false)")
    if self.conversation is not None:
      raise ValueError("conversation is not supported: this server keeps no conversations; "
                       "send the whole conversation in 'input'")
    if self.background:
      raise ValueError("background responses are not supported by this server")
    if self.tool_choice == "required" or isinstance(self.tool_choice, dict):
      raise ValueError("tool_choice forcing a tool call is not supported: the chat template "
                       "cannot force one; use 'auto' or 'none'")
    fmt = ((self.text or {}).get("format") or {}).get("type", "text")
    if fmt != "text":
      raise ValueError(f"text.format {fmt!r} is not supported by this server: only 'text'")
    effort = (self.reasoning or {}).get("effort")
    if effort is not None and effort not in (*THINKING_OFF, "low", "medium", "high", "xhigh"):
      raise ValueError(f"reasoning.effort must be none, minimal, low, medium, high or xhigh, "
                       f"got {effort!r}")
    return self


def _parts(kinds: tuple[str, ...]) -> TextContent:
  """The reader of content that is a string or a list of ``kinds`` parts (and refusals)."""
  return TextContent(noun="part", fields=(*((k, "text") for k in kinds), ("refusal", "refusal")),
                     expected=", ".join(kinds), media=("input_image", "input_file", "input_audio"))


MESSAGE_TEXT = _parts(("input_text", "output_text", "text"))  # a message's, a tool output's
REASONING_TEXT = _parts(("reasoning_text", "summary_text", "text"))  # a reasoning item's


def _field(item: dict, name: str, where: str) -> str:
  value = item.get(name)
  if not isinstance(value, str):
    raise ApiError(400, f"{where}: a {item.get('type')} item needs '{name}' (a string)",
                   param=where)
  return value


def _messages(req: Request) -> list[dict[str, Any]]:
  messages: list[dict[str, Any]] = []
  if req.instructions:
    messages.append({"role": "system", "content": req.instructions})
  if isinstance(req.input, str):
    messages.append({"role": "user", "content": req.input})
    return messages
  reasoning: list[str] = []  # for the next assistant message

  def assistant() -> dict[str, Any]:
    """The assistant message that takes the next tool call or text."""
    if not (messages and messages[-1]["role"] == "assistant"):
      messages.append({"role": "assistant", "content": ""})
    if reasoning:
      messages[-1]["reasoning_content"] = "\n".join(reasoning)
      reasoning.clear()
    return messages[-1]

  for i, item in enumerate(req.input):
    where = f"input.{i}"
    if not isinstance(item, dict):
      raise ApiError(400, f"{where}: an input item must be an object", param=where)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
      role = item.get("role")
      if role not in ("user", "system", "developer", "assistant"):
        raise ApiError(400, f"{where}: role must be user, system, developer or assistant, got "
                       f"{role!r}", param=f"{where}.role")
      text = MESSAGE_TEXT.read(item.get("content"), f"{where}.content")
      if role == "assistant":
        messages.append({"role": "assistant", "content": text})
        assistant()  # takes the reasoning items before it
      else:
        messages.append({"role": "system" if role == "developer" else role, "content": text})
    elif kind == "function_call":
      message = assistant()
      message.setdefault("tool_calls", []).append({
          "id": _field(item, "call_id", where), "type": "function",
          "function": {"name": _field(item, "name", where),
                       "arguments": _field(item, "arguments", where)}})
    elif kind == "function_call_output":
      text = MESSAGE_TEXT.read(item.get("output"), f"{where}.output")
      messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                       "content": text})
    elif kind == "reasoning":
      parts = item.get("content") or item.get("summary") or []
      reasoning.append(REASONING_TEXT.read(parts, f"{where}.content"))
    elif kind == "item_reference":
      raise ApiError(400, f"{where}: item references are not supported: this server keeps no "
                     "items; send the item itself", param=where)
    else:
      raise ApiError(400, f"{where}: input items of type {kind!r} are not supported: give "
                     "message, function_call, function_call_output or reasoning items",
                     param=where)
  return messages


def to_spec(req: Request) -> ChatSpec:
  """The chat job's spec of a Responses request."""
  tools = function_tools(req.tools or []) or None
  options = {}
  effort = (req.reasoning or {}).get("effort")
  if effort is not None:
    options["enable_thinking"] = effort not in THINKING_OFF
  return ChatSpec(model=req.model, messages=_messages(req), tools=tools,
                  template_options=options,
                  parse_tool_calls=bool(tools) and req.tool_choice != "none",
                  max_tokens=req.max_output_tokens, temperature=req.temperature,
                  top_p=req.top_p, stream=req.stream, logprobs=logprobs_wanted(req))


def logprobs_wanted(req: Request) -> int | None:
  """Alternatives per output token's log-probs (None: none): asked for with
  ``top_logprobs`` or ``include: ["message.output_text.logprobs"]``."""
  if req.top_logprobs is None and LOGPROBS_ITEM not in (req.include or []):
    return None
  return req.top_logprobs or 0


def _logprob_json(lp: Logprob) -> dict[str, Any]:
  return {"token": lp.token, "logprob": max(lp.logprob, LEAST_LOGPROB), "bytes": list(lp.bytes),
          "top_logprobs": [{"token": t, "logprob": max(v, LEAST_LOGPROB), "bytes": list(b)}
                           for t, b, v in lp.top]}


def response_id() -> str:
  return "resp_" + uuid.uuid4().hex


class Builder:
  """A response's output items, built from the reply's deltas in order, and the response
  object around them. ``push`` returns the streaming events each delta makes; ``finish`` the
  closing ones."""

  def __init__(self, rid: str, req: Request, model: str):
    self.rid, self.req, self.model = rid, req, model
    self.created = int(time.time())
    self.items: list[dict[str, Any]] = []
    self.open = False  # the last item is still receiving text
    self.sequence = 0

  def response(self, status: str, outcome=None) -> dict[str, Any]:
    r = self.req
    body = {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
            "error": None, "incomplete_details": None, "model": self.model,
            "output": self.items if status != "in_progress" else [],
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "parallel_tool_calls": True if r.parallel_tool_calls is None
            else r.parallel_tool_calls,
            "temperature": 1.0 if r.temperature is None else r.temperature,
            "top_p": 1.0 if r.top_p is None else r.top_p,
            "tool_choice": r.tool_choice or "auto", "tools": r.tools or [],
            "reasoning": r.reasoning or {"effort": None, "summary": None},
            "text": {"format": {"type": "text"}}, "store": False, "metadata": r.metadata or {},
            "usage": None}
    if outcome is not None:
      if outcome.finish_reason == "length":
        body["incomplete_details"] = {"reason": "max_output_tokens"}
      body["usage"] = {"input_tokens": outcome.prompt_tokens,
                       "input_tokens_details": {"cached_tokens": outcome.cached_tokens},
                       "output_tokens": outcome.completion_tokens,
                       "total_tokens": outcome.prompt_tokens + outcome.completion_tokens}
    return body

  def event(self, kind: str, **fields) -> str:
    body = {"type": kind, "sequence_number": self.sequence, **fields}
    self.sequence += 1
    return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

  def _close(self) -> list[str]:
    if not self.open:
      return []
    self.open = False
    index, item = len(self.items) - 1, self.items[-1]
    item["status"] = "completed"
    out = []
    if item["type"] == "message":
      part = item["content"][0]
      out.append(self.event("response.output_text.done", item_id=item["id"], output_index=index,
                            content_index=0, text=part["text"], logprobs=part["logprobs"]))
      out.append(self.event("response.content_part.done", item_id=item["id"],
                            output_index=index, content_index=0, part=part))
    else:
      out.append(self.event("response.reasoning_text.done", item_id=item["id"],
                            output_index=index, content_index=0,
                            text=item["content"][0]["text"]))
    out.append(self.event("response.output_item.done", output_index=index, item=item))
    return out

  def push(self, d: Delta) -> list[str]:
    out: list[str] = []
    if d.kind == "logprobs":  # of the tokens before it: kept with the open message's text
      if self.open and self.items[-1]["type"] == "message":
        self.items[-1]["content"][0]["logprobs"] += [_logprob_json(lp) for lp in d.logprobs]
      return out
    if d.kind == "tool_call":
      out += self._close()
      item = {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": d.call.id,
              "name": d.call.name, "arguments": "", "status": "in_progress"}
      self.items.append(item)
      index = len(self.items) - 1
      out.append(self.event("response.output_item.added", output_index=index, item=dict(item)))
      out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=index, delta=d.call.arguments))
      item["arguments"], item["status"] = d.call.arguments, "completed"
      out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=index, name=d.call.name,
                            arguments=d.call.arguments))
      out.append(self.event("response.output_item.done", output_index=index, item=item))
      return out
    kind = "reasoning" if d.kind == "reasoning" else "message"
    if not (self.open and self.items[-1]["type"] == kind):
      out += self._close()
      if kind == "message":
        item = {"type": "message", "id": "msg_" + uuid.uuid4().hex, "status": "in_progress",
                "role": "assistant", "content": []}
      else:
        item = {"type": "reasoning", "id": "rs_" + uuid.uuid4().hex, "summary": [],
                "content": [], "status": "in_progress"}
      self.items.append(item)
      index = len(self.items) - 1
      out.append(self.event("response.output_item.added", output_index=index,
                            item=json.loads(json.dumps(item))))
      if kind == "message":
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        out.append(self.event("response.content_part.added", item_id=item["id"],
                              output_index=index, content_index=0, part=dict(part)))
      else:
        part = {"type": "reasoning_text", "text": ""}
      item["content"].append(part)
      self.open = True
    index, item = len(self.items) - 1, self.items[-1]
    item["content"][0]["text"] += d.text
    name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
    extra = {"logprobs": []} if kind == "message" else {}
    out.append(self.event(name, item_id=item["id"], output_index=index, content_index=0,
                          delta=d.text, **extra))
    return out

  def finish(self) -> list[str]:
    return self._close()


def response_body(rid: str, req: Request, model: str, deltas: list[Delta], outcome
                  ) -> dict[str, Any]:
  builder = Builder(rid, req, model)
  for d in deltas:
    builder.push(d)
  builder.finish()
  return builder.response("incomplete" if outcome.finish_reason == "length" else "completed",
                          outcome)


async def stream(events: AsyncIterator[tuple[str, Any]], rid: str, req: Request, model: str,
                 on_done) -> AsyncIterator[str]:
  """The Responses API's server-sent events of a job's ``events``."""
  builder = Builder(rid, req, model)
  yield builder.event("response.created", response=builder.response("in_progress"))
  yield builder.event("response.in_progress", response=builder.response("in_progress"))
  async for kind, payload in events:
    if kind == "deltas":
      for d in payload:
        for out in builder.push(d):
          yield out
    elif kind == "error":
      for out in builder.finish():
        yield out
      body = builder.response("failed")
      body["error"] = {"code": "server_error",
                       "message": f"generation failed: {type(payload).__name__}: {payload}"}
      yield builder.event("response.failed", response=body)
      return
    elif kind == "done":
      for out in builder.finish():
        yield out
      on_done(payload)
      # Always response.completed, its status "incomplete" where max_output_tokens cut the
      # reply: the openai SDK's stream helper and Codex end a turn on that event only.
      status = "incomplete" if payload.finish_reason == "length" else "completed"
      yield builder.event("response.completed", response=builder.response(status, payload))
