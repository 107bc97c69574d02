"""Chat templates render exactly as transformers' apply_chat_template (the reference), from
tokenizer_config.json, chat_template.jinja and named-template lists; the fallback and bad
messages behave as documented."""

import json
import shutil

import pytest

from ftjax.assets import DEFAULT_HYBRID_MODEL_DIR, DEFAULT_MODEL_DIR
from ftjax.runtime.chat_template import ChatTemplateError, load_chat_template

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Reads a file — «UTF-8» <text>",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}]

CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Sort a list."}],
    "system": [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "Sort a list."},
               {"role": "assistant", "content": "<think>\nuse sorted\n</think>\n\nsorted(x)"},
               {"role": "user", "content": [{"type": "text", "text": "And reversed?"}]}],
    "tools": [{"role": "system", "content": "You are an agent."},
              {"role": "user", "content": "What is in setup.py?"},
              {"role": "assistant", "content": "", "reasoning_content": "I should read it.",
               "tool_calls": [{"type": "function", "function": {
                   "name": "read_file", "arguments": {"path": "setup.py"}}}]},
              {"role": "tool", "content": "from setuptools import setup"},
              {"role": "tool", "content": "second result"},
              {"role": "assistant", "content": "It calls setup()."},
              {"role": "user", "content": "Thanks."}],
}


def _reference(template_text, messages, **kwargs):
  from transformers import PreTrainedTokenizerFast  # noqa: PLC0415
  tok = PreTrainedTokenizerFast(tokenizer_file=f"{DEFAULT_MODEL_DIR}/tokenizer.json")
  tok.chat_template = template_text
  return tok.apply_chat_template(messages, tokenize=False, **kwargs)


def _embedded_template(model_dir):
  with open(f"{model_dir}/tokenizer_config.json") as f:
    return json.load(f)["chat_template"]


@pytest.mark.parametrize("model_dir", [DEFAULT_MODEL_DIR, DEFAULT_HYBRID_MODEL_DIR])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("options", [dict(), dict(enable_thinking=False),
                                     dict(add_generation_prompt=False)])
def test_embedded_templates_equal_transformers(model_dir, name, options):
  template = load_chat_template(model_dir)
  assert template.source == "tokenizer_config.json"
  messages = CONVERSATIONS[name]
  tools = TOOLS if name == "tools" else None
  kwargs = {"add_generation_prompt": True, "tools": tools, **options}
  got = template.render(messages, **kwargs)
  assert got == _reference(_embedded_template(model_dir), messages, **kwargs)
  if name == "tools":
    assert "<tool_call>" in got and "<tool_response>" in got and "«UTF-8»" in got


def test_template_file_and_named_templates(tmp_path):
  shutil.copy(f"{DEFAULT_MODEL_DIR}/tokenizer.json", tmp_path)
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": "<s>"},
      "chat_template": [
          {"name": "default", "template": "{{ bos_token }}{% for m in messages %}"
                                          "[{{ m.role }}]{{ m.content }}{% endfor %}"},
          {"name": "tool_use", "template": "TOOLS {{ tools | tojson }}{{ messages[0].content }}"
                                           "{{ raise_exception('no') if messages | length > 1 }}"}
      ]}))
  template = load_chat_template(str(tmp_path))
  messages = [{"role": "user", "content": "hi"}]
  assert template.render(messages) == "<s>[user]hi"
  assert template.render(messages, tools=TOOLS).startswith('TOOLS [{"type": "function"')
  with pytest.raises(ChatTemplateError, match="refused the messages: no"):
    template.render(messages * 2, tools=TOOLS)
  (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}|"
                                                "{% endfor %}")
  template = load_chat_template(str(tmp_path))
  assert template.source == "chat_template.jinja"
  assert template.render(messages * 2) == "hi|hi|"


def test_fallback_and_bad_messages(tmp_path):
  template = load_chat_template(str(tmp_path))
  assert template.is_fallback
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
  assert template.render(messages) == "system: Be brief.\n\nuser: hi\n\nassistant:"
  with pytest.raises(ChatTemplateError, match="ships no chat template"):
    template.render(messages, tools=TOOLS)
  embedded = load_chat_template(DEFAULT_MODEL_DIR)
  for bad, match in [([], "non-empty list"), ([{"content": "x"}], "string 'role'"),
                     ([{"role": "user", "content": 3}], "content must be"),
                     ([{"role": "user", "content": ["x"]}], "parts must be dicts")]:
    with pytest.raises(ChatTemplateError, match=match):
      embedded.render(bad)
  with pytest.raises(ChatTemplateError, match="tools must be a list"):
    embedded.render(messages, tools="read_file")
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
  with pytest.raises(ChatTemplateError, match="does not parse"):
    load_chat_template(str(tmp_path))
