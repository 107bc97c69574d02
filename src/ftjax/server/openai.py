"""OpenAI's chat completions (``POST /v1/chat/completions``) and completions
(``POST /v1/completions``) as a mapping onto the server's jobs: a chat request becomes a
``ChatSpec`` (its messages and tools are already in the shapes the chat template reads), a
completion request's prompt becomes token ids (no template), and the job's deltas become a
``chat.completion`` or ``text_completion`` object, whole or as the ``data:`` chunks OpenAI's
SDKs parse, ending with ``data: [DONE]``. The request bodies are ``protocol``'s.

A chat reply's reasoning is its message's ``reasoning_content``, its tool calls
``tool_calls`` (``content`` is null when there are calls and no text);
``usage.prompt_tokens_details.cached_tokens`` are the prompt tokens the session reused.

Log-probabilities (of the model's distribution: the raw logits' log-softmax, whatever the
sampling options) come in each API's shape: a completion's legacy object (``tokens``,
``token_logprobs``, ``top_logprobs`` as {token: log-prob}, ``text_offset``; with ``echo``
the prompt's tokens first, the first of them with null), a chat choice's ``logprobs.content``
(every generated token's, reasoning included, with ``bytes`` and ``top_logprobs``). The end
token a reply stops at is listed too (an evaluation harness reads the token after the prompt).
A prompt given as a list is one choice per prompt, run side by side.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from ftjax.server.outputs import Delta, Logprob
from ftjax.server.protocol import (LEAST_LOGPROB, ApiError, ChatRequest, ChatSpec,
                                   CompletionRequest)


def to_spec(req: ChatRequest) -> ChatSpec:
  """The chat job's spec of a chat completions request."""
  tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
  return ChatSpec(model=req.model, messages=[m.for_template() for m in req.messages],
                  tools=tools, template_options=dict(req.chat_template_kwargs or {}),
                  parse_tool_calls=bool(tools) and req.tool_choice != "none",
                  max_tokens=req.limit, temperature=req.temperature, top_p=req.top_p,
                  seed=req.seed, stops=req.stops, stream=req.stream, logprobs=req.top)


def prompt_ids(prompt: str | list[int], tokenizer, vocab_size: int,
               param: str = "prompt") -> list[int]:
  """The token ids of a completions request's prompt: its text encoded, or its ids as given
  (a 400 for ids outside the vocabulary, or a text of no tokens)."""
  if isinstance(prompt, str):
    ids = tokenizer.encode(prompt)
    if not ids:
      raise ApiError(400, f"{param} encodes to no tokens", param=param)
    return ids
  ids = list(prompt)
  bad = [t for t in ids if not 0 <= t < vocab_size]
  if bad:
    raise ApiError(400, f"{param} token ids must be in [0, {vocab_size}); got {bad[:5]}",
                   param=param)
  return ids


def _finite(x: float | None) -> float | None:
  return None if x is None else max(float(x), LEAST_LOGPROB)


def legacy_logprobs(lps: list[Logprob]) -> dict[str, Any]:
  """A completion choice's ``logprobs`` (the legacy shape lm-evaluation-harness reads)."""
  return {"tokens": [lp.token for lp in lps],
          "token_logprobs": [_finite(lp.logprob) for lp in lps],
          "top_logprobs": [None if lp.logprob is None else
                           {token: _finite(v) for token, _, v in lp.top} for lp in lps],
          "text_offset": [lp.offset for lp in lps]}


def chat_logprobs(lps: list[Logprob]) -> dict[str, Any]:
  """A chat choice's ``logprobs``: each token's, with its bytes and alternatives."""
  return {"content": [{"token": lp.token, "logprob": _finite(lp.logprob),
                       "bytes": list(lp.bytes),
                       "top_logprobs": [{"token": t, "logprob": _finite(v), "bytes": list(b)}
                                        for t, b, v in lp.top]} for lp in lps],
          "refusal": None}


def _logprobs_of(deltas: list[Delta]) -> list[Logprob]:
  return [lp for d in deltas if d.kind == "logprobs" for lp in d.logprobs]


def include_usage(req: ChatRequest | CompletionRequest) -> bool:
  """Whether a streamed reply ends with a chunk of its usage (``stream_options``)."""
  return bool(req.stream_options and req.stream_options.include_usage)


def usage(outcome) -> dict[str, Any]:
  return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
          "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
          "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens}}


def tool_call_json(call, index: int | None = None) -> dict[str, Any]:
  """A tool call as OpenAI writes it (streamed, with the ``index`` of the reply's calls)."""
  out = {"id": call.id, "type": "function",
         "function": {"name": call.name, "arguments": call.arguments}}
  return out if index is None else {"index": index, **out}


def completion_id(chat: bool) -> str:
  return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def text_choice(index: int, deltas: list[Delta], outcome, logprobs: bool) -> dict[str, Any]:
  """One choice of a ``text_completion``."""
  text = "".join(d.text for d in deltas if d.kind == "content")
  return {"index": index, "text": text,
          "logprobs": legacy_logprobs(_logprobs_of(deltas)) if logprobs else None,
          "finish_reason": outcome.finish_reason}


def completions_body(rid: str, model: str, fingerprint: str,
                     results: list[tuple[list[Delta], Any]], logprobs: bool) -> dict[str, Any]:
  """A ``text_completion`` of several prompts: a choice each, the usage summed."""
  total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0,
           "prompt_tokens_details": {"cached_tokens": 0}}
  for _, outcome in results:
    one = usage(outcome)
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
      total[key] += one[key]
    total["prompt_tokens_details"]["cached_tokens"] += outcome.cached_tokens
  return {"id": rid, "created": int(time.time()), "model": model,
          "system_fingerprint": fingerprint, "usage": total, "object": "text_completion",
          "choices": [text_choice(i, deltas, outcome, logprobs)
                      for i, (deltas, outcome) in enumerate(results)]}


def completion_body(rid: str, model: str, fingerprint: str, chat: bool, deltas: list[Delta],
                    outcome, logprobs: bool = False) -> dict[str, Any]:
  """The whole reply: a ``chat.completion`` (``chat``) or a ``text_completion``; with the
  tokens' log-probs when ``logprobs``."""
  base = {"id": rid, "created": int(time.time()), "model": model,
          "system_fingerprint": fingerprint, "usage": usage(outcome)}
  text = "".join(d.text for d in deltas if d.kind == "content")
  if not chat:
    return {**base, "object": "text_completion",
            "choices": [text_choice(0, deltas, outcome, logprobs)]}
  reasoning = [d.text for d in deltas if d.kind == "reasoning"]
  calls = [d.call for d in deltas if d.kind == "tool_call"]
  message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls
                             else None}
  if reasoning:
    message["reasoning_content"] = "".join(reasoning)
  if calls:
    message["tool_calls"] = [tool_call_json(c) for c in calls]
  return {**base, "object": "chat.completion",
          "choices": [{"index": 0, "message": message,
                       "logprobs": chat_logprobs(_logprobs_of(deltas)) if logprobs else None,
                       "finish_reason": outcome.finish_reason}]}


async def stream(events: AsyncIterator[tuple[str, Any]], rid: str, model: str, fingerprint: str,
                 chat: bool, include_usage: bool, on_done) -> AsyncIterator[str]:
  """OpenAI's server-sent chunks of a job's ``events`` (``("deltas", [Delta])``, then
  ``("done", outcome)`` or ``("error", exception)``), ending with ``data: [DONE]``.
  ``on_done(outcome)`` is told of a finished reply."""
  base = {"id": rid, "created": int(time.time()), "model": model,
          "system_fingerprint": fingerprint}
  if include_usage:
    base["usage"] = None
  kind_of = "chat.completion.chunk" if chat else "text_completion"

  def chunk(delta=None, finish=None, text=None, logprobs=None) -> str:
    if chat:
      choice = {"index": 0, "delta": delta or {}, "logprobs": logprobs, "finish_reason": finish}
    else:
      choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    body = {**base, "object": kind_of, "choices": [choice]}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

  if chat:
    yield chunk({"role": "assistant", "content": ""})
  calls = 0
  async for kind, payload in events:
    if kind == "deltas":
      for d in payload:
        if d.kind == "logprobs":
          lps = list(d.logprobs)
          yield chunk(logprobs=chat_logprobs(lps) if chat else legacy_logprobs(lps))
        elif not chat:
          yield chunk(text=d.text)
        elif d.kind == "content":
          yield chunk({"content": d.text})
        elif d.kind == "reasoning":
          yield chunk({"reasoning_content": d.text})
        else:
          yield chunk({"tool_calls": [tool_call_json(d.call, calls)]})
          calls += 1
    elif kind == "error":
      error = ApiError(500, f"generation failed: {type(payload).__name__}: {payload}")
      yield f"data: {json.dumps(error.body())}\n\n"
      return
    elif kind == "done":
      on_done(payload)
      yield chunk(finish=payload.finish_reason)
      if include_usage:
        body = {**base, "object": kind_of, "choices": [], "usage": usage(payload)}
        yield f"data: {json.dumps(body)}\n\n"
      yield "data: [DONE]\n\n"
