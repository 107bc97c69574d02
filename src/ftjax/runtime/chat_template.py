"""Chat templates: a checkpoint's Jinja ``chat_template``, rendered as transformers renders it.

``load_chat_template(model_dir)`` finds the template:

1. ``chat_template.jinja`` in the model directory (how transformers 5 saves it);
2. ``chat_template`` in ``tokenizer_config.json``: a string, or a list of named templates
   (``"tool_use"`` is taken when tools are given and it exists, else ``"default"``);
3. otherwise the plain fallback below.

Rendering uses a sandboxed Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that does not escape HTML or non-ASCII
characters (and takes ``indent``, ``separators`` and ``sort_keys``), and the globals
``raise_exception(message)`` and ``strftime_now(format)``. The context holds ``messages``,
``tools``, ``add_generation_prompt``, the tokenizer config's ``bos_token`` and ``eos_token``,
and any extra options (Qwen's ``enable_thinking``, for instance). Unlike transformers' sandbox,
a template may append to and pop from lists (Kimi-K2's number their tool calls that way); it
renders a deep copy of the messages and tools, so it cannot change the caller's.

Messages come in OpenAI's shapes, and each template reads an assistant turn's parts its own
way, so ``render`` hands them over as the template reads them:

- a tool call's ``arguments`` are JSON text in OpenAI's API; templates that write the
  arguments themselves (``tool_call.arguments.items()``, ``| tojson``) need the object.
  ``tool_arguments`` says which: ``"text"`` (as given; the default) or ``"object"`` (the JSON
  text parsed; text that is not a JSON object is passed as it is). The server sets it at
  start-up by rendering a probe call (``ftjax.server.reply_formats.fit_template``);
- reasoning is ``reasoning_content``; a template that reads ``thinking`` instead (gpt-oss)
  gets it there too (``reasoning_field``, found in the template's text).

The plain fallback, for models that ship no template: each message as ``ROLE: CONTENT`` and a
blank line, then ``assistant:`` with a generation prompt. It cannot render tools (an error
says so).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import re
from typing import Any, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import SandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
TOOL_ARGUMENTS = ("text", "object")  # the shapes a tool call's arguments can be rendered in
# A template that reads an assistant message's ``thinking`` (``message.thinking``,
# ``message['thinking']``, ``"thinking" in message``).
_READS_THINKING = re.compile(r"""\.thinking\b|\[\s*['"]thinking['"]\s*\]|['"]thinking['"]\s+in\s""")


class ChatTemplateError(ValueError):
  """The template cannot render these messages (bad messages, or the template refused)."""


def _tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
  return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                    ensure_ascii=ensure_ascii)


def _raise_exception(message):
  raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _strftime_now(fmt):
  return datetime.datetime.now().strftime(fmt)


def _environment() -> jinja2.Environment:
  env = SandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                             extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env


def _special(value) -> str | None:
  """A tokenizer config's special token: a string, or a dict with ``content``."""
  if isinstance(value, dict):
    return value.get("content")
  return value


class ChatTemplate:
  """A model's chat template. ``source`` says where it came from: ``chat_template.jinja``,
  ``tokenizer_config.json`` or ``fallback``; ``text`` is its Jinja source (all the named
  templates', joined; empty for the fallback). ``tool_arguments`` and ``reasoning_field``:
  how assistant turns are handed to it (the module's docstring)."""

  def __init__(self, templates: dict[str, str] | None, *, source: str,
               bos_token: str | None = None, eos_token: str | None = None):
    self.source = source
    self.bos_token, self.eos_token = bos_token, eos_token
    self.text = "\n".join((templates or {}).values())
    self.tool_arguments = "text"
    self.reasoning_field = ("thinking" if "reasoning_content" not in self.text
                            and _READS_THINKING.search(self.text) else "reasoning_content")
    self._env = _environment()
    self._compiled = {}
    for name, text in (templates or {}).items():
      try:
        self._compiled[name] = self._env.from_string(text)
      except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template {name!r} from {source} does not parse: "
                                f"{e.message} (line {e.lineno})") from e

  @property
  def is_fallback(self) -> bool:
    return not self._compiled

  def render(self, messages: Sequence[dict[str, Any]], *, tools: Sequence[dict] | None = None,
             add_generation_prompt: bool = True, **options) -> str:
    """The prompt text of ``messages`` (dicts with ``role`` and ``content``, and for
    assistants optionally ``tool_calls`` and ``reasoning_content``)."""
    _check_messages(messages)
    if tools is not None and (not isinstance(tools, (list, tuple))
                              or not all(isinstance(t, dict) for t in tools)):
      raise ChatTemplateError("tools must be a list of JSON objects (dicts)")
    if self.is_fallback:
      if tools:
        raise ChatTemplateError("this model ships no chat template, so tools cannot be rendered; "
                                "add a chat_template to its tokenizer_config.json")
      text = "".join(f"{m['role']}: {_text(m.get('content'))}\n\n" for m in messages)
      return text + ("assistant:" if add_generation_prompt else "")
    if self.tool_arguments not in TOOL_ARGUMENTS:
      raise ValueError(f"tool_arguments must be one of {TOOL_ARGUMENTS}, got "
                       f"{self.tool_arguments!r}")
    template = self._compiled.get("tool_use") if tools else None
    template = template or self._compiled.get("default") or next(iter(self._compiled.values()))
    context = dict(messages=[self._message(m) for m in copy.deepcopy(list(messages))],
                   tools=copy.deepcopy(list(tools)) if tools else None,
                   add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
                   eos_token=self.eos_token or "", **options)
    try:
      return template.render(**context)
    except ChatTemplateError:
      raise
    except jinja2.TemplateError as e:
      raise ChatTemplateError(f"the chat template from {self.source} failed on these messages: "
                              f"{e}") from e
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
      # A filter or method the template applied to a value of another type (``items`` on
      # text, say): the messages do not have the shape this template reads.
      raise ChatTemplateError(f"the chat template from {self.source} failed on these messages: "
                              f"{type(e).__name__}: {e}") from e

  def _message(self, message: dict[str, Any]) -> dict[str, Any]:
    """``message`` (a copy) as the template reads it: an assistant's tool-call arguments in
    the ``tool_arguments`` shape, its reasoning under ``reasoning_field`` too."""
    if message.get("role") != "assistant":
      return message
    reasoning = message.get("reasoning_content")
    if self.reasoning_field != "reasoning_content" and reasoning is not None:
      message[self.reasoning_field] = reasoning
    if self.tool_arguments == "object":
      for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str):
          try:
            value = json.loads(arguments)
          except ValueError:
            continue  # not JSON: passed as it is (the template says what it wants)
          if isinstance(value, dict):
            function["arguments"] = value
    return message


def _text(content) -> str:
  if content is None:
    return ""
  if isinstance(content, str):
    return content
  return "".join(p.get("text", "") for p in content if p.get("type") == "text")


def _check_messages(messages) -> None:
  if not isinstance(messages, (list, tuple)) or not messages:
    raise ChatTemplateError("messages must be a non-empty list of {'role': ..., 'content': ...}")
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
      raise ChatTemplateError(f"message {i} must be a dict with a string 'role', got {m!r:.80}")
    content = m.get("content")
    if content is not None and not isinstance(content, (str, list)):
      raise ChatTemplateError(f"message {i}'s content must be a string, a list of parts or "
                              f"None, got {type(content).__name__}")
    if isinstance(content, list) and not all(isinstance(p, dict) for p in content):
      raise ChatTemplateError(f"message {i}'s content parts must be dicts like "
                              "{'type': 'text', 'text': ...}")


def load_chat_template(model_dir: str | None) -> ChatTemplate:
  """The chat template of the model in ``model_dir`` (None: the plain fallback)."""
  config = {}
  if model_dir:
    path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(path):
      with open(path) as f:
        config = json.load(f)
  specials = dict(bos_token=_special(config.get("bos_token")),
                  eos_token=_special(config.get("eos_token")))
  if model_dir and os.path.isfile(os.path.join(model_dir, TEMPLATE_FILE)):
    with open(os.path.join(model_dir, TEMPLATE_FILE)) as f:
      return ChatTemplate({"default": f.read()}, source=TEMPLATE_FILE, **specials)
  template = config.get("chat_template")
  if isinstance(template, str):
    return ChatTemplate({"default": template}, source="tokenizer_config.json", **specials)
  if isinstance(template, list):
    named = {t["name"]: t["template"] for t in template
             if isinstance(t, dict) and "name" in t and "template" in t}
    if named:
      return ChatTemplate(named, source="tokenizer_config.json", **specials)
  return ChatTemplate(None, source="fallback", **specials)
