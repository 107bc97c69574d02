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
and any extra options (Qwen's ``enable_thinking``, for instance).

The plain fallback, for models that ship no template: each message as ``ROLE: CONTENT`` and a
blank line, then ``assistant:`` with a generation prompt. It cannot render tools (an error
says so).
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any, Sequence

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"


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
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
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
  ``tokenizer_config.json`` or ``fallback``."""

  def __init__(self, templates: dict[str, str] | None, *, source: str,
               bos_token: str | None = None, eos_token: str | None = None):
    self.source = source
    self.bos_token, self.eos_token = bos_token, eos_token
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
    template = self._compiled.get("tool_use") if tools else None
    template = template or self._compiled.get("default") or next(iter(self._compiled.values()))
    context = dict(messages=[dict(m) for m in messages], tools=list(tools) if tools else None,
                   add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
                   eos_token=self.eos_token or "", **options)
    try:
      return template.render(**context)
    except ChatTemplateError:
      raise
    except jinja2.TemplateError as e:
      raise ChatTemplateError(f"the chat template from {self.source} failed on these messages: "
                              f"{e}") from e


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
