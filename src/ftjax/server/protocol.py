"""OpenAI's request bodies as pydantic models, and its error format; with what every API's
mapping shares: ``ChatSpec`` (what a chat request becomes), ``Body`` and ``TextContent`` (the
reader of "a string or a list of text blocks" content).

Fields the server does not use (``user``, ``metadata``, ``parallel_tool_calls``, ...) are
accepted and ignored, as OpenAI-compatible servers do; fields whose meaning the server cannot
honour (``n`` > 1, penalties, a JSON ``response_format``, a forced ``tool_choice``) are a
400 that says so, never silently dropped. Log-probabilities are served: completions'
``logprobs`` (0 .. ``MAX_LOGPROBS`` alternatives, in the legacy shape) with ``echo`` (the
prompt's too), chat's ``logprobs`` / ``top_logprobs``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOPS = 4
MAX_LOGPROBS = 20  # alternatives a token's log-probs may list (``programs.TOP_LOGPROBS``)
LEAST_LOGPROB = -9999.0  # what a log-prob of -inf is written as (JSON has no infinity)


class ApiError(Exception):
  """An error answered in OpenAI's format: ``{"error": {"message", "type", "param",
  "code"}}`` with HTTP ``status``."""

  TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
           403: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
           413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
           503: "server_error"}

  def __init__(self, status: int, message: str, *, param: str | None = None,
               code: str | None = None, headers: dict[str, str] | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code = status, message, param, code
    self.headers = headers or {}

  def body(self) -> dict[str, Any]:
    return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                      "param": self.param, "code": self.code}}


@dataclasses.dataclass
class ChatSpec:
  """What every chat API's request maps to (OpenAI chat completions, Anthropic Messages, OpenAI
  Responses): the messages and tools as the chat template reads them (OpenAI's shapes), the
  template's options, and how to generate. The server makes one job of it, whichever API."""
  model: str
  messages: list[dict[str, Any]]
  tools: list[dict[str, Any]] | None = None
  template_options: dict[str, Any] = dataclasses.field(default_factory=dict)
  parse_tool_calls: bool = False  # parse the reply's tool calls (tools given, not "none")
  max_tokens: int | None = None  # None: the server's default (clipped to the context left)
  temperature: float | None = None
  top_p: float | None = None
  top_k: int | None = None
  seed: int | None = None
  stops: list[str] = dataclasses.field(default_factory=list)
  stream: bool = False
  logprobs: int | None = None  # the tokens' log-probs with this many alternatives (None: none)


@dataclasses.dataclass(frozen=True)
class TextContent:
  """How an API writes content that is a string or a list of text blocks (Anthropic's system
  prompt and tool results, the Responses API's message parts): ``read`` gives its text, the
  blocks' joined by a newline, or a 400 naming the block it cannot take."""
  noun: str  # what the API calls a block ("block", "part"), as its errors say
  fields: tuple[tuple[str, str], ...]  # (block type, the field holding its text) of those read
  expected: str  # the text blocks wanted, as an error names them
  media: tuple[str, ...]  # block types refused as not text (images, files)
  none_is_empty: bool = False  # missing content (None) reads as "" (else it is refused)

  def read(self, content, where: str) -> str:
    if content is None and self.none_is_empty:
      return ""
    if isinstance(content, str):
      return content
    if not isinstance(content, list):
      raise ApiError(400, f"{where}: content must be a string or a list of {self.noun}s",
                     param=where)
    texts = []
    for i, block in enumerate(content):
      kind = block.get("type") if isinstance(block, dict) else None
      field = next((f for k, f in self.fields if kind == k), None)
      if field is not None and isinstance(block.get(field), str):
        texts.append(block[field])
      elif kind in self.media:
        raise ApiError(400, f"{where}.{i}: {kind} {self.noun}s are not supported: this "
                       "server's model reads text only", param=f"{where}.{i}")
      else:
        raise ApiError(400, f"{where}.{i}: expected a text {self.noun} ({self.expected}), got "
                       f"type {kind!r}", param=f"{where}.{i}")
    return "\n".join(texts)


class Body(BaseModel):
  """A request body: fields the server does not use are accepted and ignored."""
  model_config = ConfigDict(extra="ignore")


class CacheRequest(BaseModel):
  """``POST /v1/cache``: a new device budget shared by the decode states and the expert cache
  (``budget_bytes``; the cache gets what the states leave, re-divided as they grow and
  shrink), or a fixed number of expert-cache slots (``slots``; no budget then). Exactly one."""
  model_config = ConfigDict(extra="forbid")
  budget_bytes: int | None = Field(default=None, ge=0)
  slots: int | None = Field(default=None, ge=0)

  @model_validator(mode="after")
  def _one(self):
    if (self.budget_bytes is None) == (self.slots is None):
      raise ValueError("give exactly one of budget_bytes (a device budget for the decode "
                       "states and the expert cache) or slots (a fixed cache size)")
    return self


class FunctionDef(Body):
  name: str = Field(min_length=1)
  description: str | None = None
  parameters: dict[str, Any] | None = None
  strict: bool | None = None


class Tool(Body):
  type: Literal["function"]
  function: FunctionDef


class CalledFunction(Body):
  name: str
  arguments: str  # JSON text, as OpenAI sends it


class ToolCallIn(Body):
  id: str | None = None
  type: Literal["function"] = "function"
  function: CalledFunction


class TextPart(Body):
  type: Literal["text"]
  text: str


class Message(Body):
  role: Literal["system", "developer", "user", "assistant", "tool"]
  content: str | list[TextPart] | None = None
  name: str | None = None
  tool_calls: list[ToolCallIn] | None = None
  tool_call_id: str | None = None
  reasoning_content: str | None = None

  @model_validator(mode="after")
  def _content_needed(self):
    if self.content is None and self.role != "assistant":
      raise ValueError(f"a {self.role} message needs 'content'")
    if self.tool_calls and self.role != "assistant":
      raise ValueError("only assistant messages carry 'tool_calls'")
    return self

  def for_template(self) -> dict[str, Any]:
    """The dict the chat template reads (``developer`` is rendered as ``system``)."""
    out = self.model_dump(exclude_none=True)
    if out["role"] == "developer":
      out["role"] = "system"
    return out


class StreamOptions(Body):
  include_usage: bool = False


class _Sampling(Body):
  model: str = Field(min_length=1)
  temperature: float | None = Field(default=None, ge=0, le=2)
  top_p: float | None = Field(default=None, gt=0, le=1)
  seed: int | None = None
  stop: str | list[str] | None = None
  n: int | None = None
  stream: bool = False
  stream_options: StreamOptions | None = None
  presence_penalty: float | None = None
  frequency_penalty: float | None = None
  logit_bias: dict[str, float] | None = None

  @field_validator("stop")
  @classmethod
  def _stops(cls, v):
    if isinstance(v, list):
      if len(v) > MAX_STOPS:
        raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(v)}")
      if any(not s for s in v):
        raise ValueError("stop sequences must be non-empty strings")
    elif v == "":
      raise ValueError("a stop sequence must be a non-empty string")
    return v

  @model_validator(mode="after")
  def _supported(self):
    if self.n not in (None, 1):
      raise ValueError(f"n={self.n} is not supported: this server returns one choice (n=1)")
    for name in ("presence_penalty", "frequency_penalty"):
      if getattr(self, name) not in (None, 0):
        raise ValueError(f"{name} is not supported by this server: leave it out or 0")
    if self.logit_bias:
      raise ValueError("logit_bias is not supported by this server: leave it out")
    if self.stream_options is not None and not self.stream:
      raise ValueError("stream_options is only allowed with stream=true")
    return self

  @property
  def stops(self) -> list[str]:
    return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(_Sampling):
  messages: list[Message] = Field(min_length=1)
  tools: list[Tool] | None = None
  tool_choice: Literal["auto", "none"] | dict[str, Any] | None = None
  max_tokens: int | None = Field(default=None, ge=1)
  max_completion_tokens: int | None = Field(default=None, ge=1)
  response_format: dict[str, Any] | None = None
  chat_template_kwargs: dict[str, Any] | None = None
  logprobs: bool | None = None
  top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

  @model_validator(mode="after")
  def _chat_supported(self):
    if self.top_logprobs is not None and not self.logprobs:
      raise ValueError("top_logprobs needs logprobs=true")
    if isinstance(self.tool_choice, dict):
      raise ValueError("tool_choice forcing a function is not supported by this server: use "
                       "'auto' or 'none'")
    if self.response_format not in (None, {"type": "text"}):
      raise ValueError("response_format other than {'type': 'text'} is not supported by this "
                       "server")
    return self

  @property
  def limit(self) -> int | None:
    return self.max_completion_tokens if self.max_completion_tokens is not None \
        else self.max_tokens

  @property
  def top(self) -> int | None:
    """Alternatives per token's log-probs (None: no log-probs)."""
    return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
  """A prompt is a text or token ids, or a list of either: each its own choice (``index`` in
  order), run as requests side by side."""
  prompt: str | list[int] | list[str] | list[list[int]] = Field(min_length=1)
  max_tokens: int | None = Field(default=16, ge=0)
  echo: bool = False
  logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
  suffix: str | None = None
  best_of: int | None = None

  @field_validator("prompt")
  @classmethod
  def _prompts(cls, v):
    if isinstance(v, list) and any(isinstance(p, (str, list)) and len(p) == 0 for p in v):
      raise ValueError("each prompt of a list must be a non-empty text or list of token ids")
    return v

  @property
  def prompts(self) -> list[str | list[int]]:
    """The prompts, each a text or a list of token ids."""
    if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
      return [self.prompt]
    return list(self.prompt)

  @model_validator(mode="after")
  def _completion_supported(self):
    if len(self.prompts) > 1 and self.stream:
      raise ValueError("stream=true takes one prompt: send a list of prompts unstreamed, or "
                       "one request per prompt")
    if self.suffix:
      raise ValueError("suffix (insertion) is not supported by this server")
    if self.best_of not in (None, 1):
      raise ValueError("best_of is not supported by this server")
    return self

  @property
  def limit(self) -> int | None:
    return self.max_tokens
