"""python -m ftjax.chat: replies equal the engine's on the rendered conversation, later turns
reuse the earlier ones, and the commands work (a real subprocess with piped input)."""

import io
import re
import subprocess
import sys

import ftjax
from ftjax.chat import ChatLoop
from ftjax.runtime.chat_template import load_chat_template
from ftjax.runtime.tokenizer import load_tokenizer


def test_turns_equal_the_engine_on_the_rendered_conversation():
  model = ftjax.load("default-hybrid")
  engine = ftjax.Engine(model, kernels="ffi")
  out, log = io.StringIO(), io.StringIO()
  loop = ChatLoop(ftjax.Session(engine), system="Write Python.", max_new_tokens=12, out=out,
                  log=log)
  tok = load_tokenizer(model.path, model.config.vocab_size)
  template = load_chat_template(model.path)
  stops = set(model.config.eos_token_ids)
  for i, text in enumerate(["sort a list", "and reverse it"]):
    expected_prompt = template.render(loop.messages + [{"role": "user", "content": text}],
                                      add_generation_prompt=True, enable_thinking=True)
    ref = engine.generate(tok.encode(expected_prompt), 12, stop_tokens=list(stops))
    reply = loop.turn(text)
    assert reply == tok.decode([t for t in ref if t not in stops])
    assert loop.messages[-1] == {"role": "assistant", "content": reply}
  lines = re.findall(r"\[TTFT .* (\d+) reused.*\]", log.getvalue())
  assert len(lines) == 2 and int(lines[0]) == 0 and int(lines[1]) > 0


def test_cli_commands(tmp_path):
  ckpt = tmp_path / "chat"
  script = (f"sort a list\n/stats\n/save {ckpt}\n/reset\n/stats\n/load {ckpt}\nthanks\n"
            f"/load {tmp_path / 'missing'}\n/bogus\n/quit\nnever read\n")
  run = subprocess.run([sys.executable, "-m", "ftjax.chat", "--model=default-hybrid",
                        "--max_new_tokens=6", "--greedy", "--kernels=ffi"], input=script,
                       capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  err = run.stderr
  assert "anchors on" in err
  assert len(re.findall(r"\[TTFT", err)) == 2  # "never read" comes after /quit
  assert "saved to" in err and "new conversation" in err
  assert re.search(r"loaded .*: 2 messages", err)  # the user turn and the reply
  turns = re.findall(r"context (\d+) tokens: (\d+) reused", err)
  assert int(turns[1][1]) > 0  # the turn after /load reuses the restored state
  assert "cannot load: no session checkpoint" in err
  assert "unknown command '/bogus'" in err
