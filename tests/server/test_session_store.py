"""Sessions that survive a restart (``--session_dir``, ``ftjax.server.store``): a session the
pool drops is saved, and after a restart (new engine, store and pool on the same directory) a
prompt that extends it loads it, reuses its tokens and gives the same tokens as a fresh
prefill; partial, corrupt, foreign and malformed directories are skipped with a reason; and a
real server process saves its sessions at SIGTERM and serves the next turn from them after it
starts again (``cached_tokens`` > 0)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import openai
import pytest

import ftjax
from ftjax.runtime.tokenizer import load_tokenizer
from ftjax.server.pool import SessionPool
from ftjax.server.store import SessionStore

TURN = ("<|im_start|>system\nYou are a coding agent.<|im_end|>\n<|im_start|>user\n"
        "Write a function that parses argv.<|im_end|>\n<|im_start|>assistant\n")
OTHER = "<|im_start|>user\nSomething else entirely, about caches.<|im_end|>\n"


@pytest.fixture(scope="module", params=("default", "default-hybrid"))
def model(request):
  return ftjax.load(request.param)


def _ids(model, text):
  return load_tokenizer(model.path, model.config.vocab_size).encode(text)


def _first_run(model, root, max_new=8):
  """A server's life: a conversation's turn, then another prompt that drops it (one session
  at most in memory): the first is saved. Returns its context and reply."""
  engine = ftjax.Engine(model)
  pool = SessionPool(engine, max_sessions=1, store=SessionStore(root, engine, 1 << 30))
  ids = _ids(model, TURN)
  session = pool.take(ids)
  session.set_context(ids)
  reply = session.generate(max_new)
  pool.done(session)
  other = pool.take(_ids(model, OTHER))
  other.set_context(_ids(model, OTHER))
  pool.done(other)
  assert len(pool.store) == 1 and pool.store.saves == 1
  return ids, reply


def test_a_dropped_session_serves_the_next_turn_after_a_restart(model, tmp_path):
  ids, reply = _first_run(model, str(tmp_path))
  # The restart: everything new but the directory.
  engine = ftjax.Engine(model)
  store = SessionStore(str(tmp_path), engine, 1 << 30)
  assert len(store) == 1 and not store.skipped
  pool = SessionPool(engine, store=store)
  follow = ids + reply + _ids(model, "<|im_end|>\n<|im_start|>user\nNow test it.<|im_end|>\n"
                              "<|im_start|>assistant\n")
  session = pool.take(follow)
  assert store.loads == 1 and len(store) == 0  # in memory now
  read = session.set_context(follow)
  assert read.reused_tokens >= len(ids) // 2, read
  assert session.generate(6) == ftjax.Engine(model).generate(follow, 6)
  pool.done(session)
  assert pool.save_all() == 1 and len(store) == 1  # back on disk, in its own directory
  assert len(os.listdir(tmp_path)) == 1


def test_partial_corrupt_and_foreign_sessions_are_skipped(tmp_path):
  default = ftjax.load("default")
  root = str(tmp_path)
  ids, _ = _first_run(default, root)
  (name,) = os.listdir(root)
  # Partial: a save cut off leaves only orbax's temporary step.
  os.makedirs(os.path.join(root, "partial", "0.orbax-checkpoint-tmp-1234"))
  # Not a checkpoint at all.
  os.makedirs(os.path.join(root, "junk"))
  with open(os.path.join(root, "junk", "notes.txt"), "w") as f:
    f.write("hello")
  # Foreign: the hybrid model's store skips the default model's session.
  hybrid = ftjax.Engine(ftjax.load("default-hybrid"))
  foreign = SessionStore(root, hybrid, 1 << 30)
  assert len(foreign) == 0
  why = dict(foreign.skipped)
  assert "another model" in why[name]
  assert "no complete session checkpoint" in why["partial"]
  assert "junk" in why
  # Corrupt: a byte of an array file flipped; the meta still reads, the load fails its CRC.
  arrays = [os.path.join(d, n) for d, _, names in os.walk(os.path.join(root, name))
            for n in names if "arrays" in d and not n.endswith((".json", "_METADATA"))]
  target = max(arrays, key=os.path.getsize)
  with open(target, "r+b") as f:
    data = bytearray(f.read())
    data[len(data) // 2] ^= 0xFF
    f.seek(0)
    f.write(data)
  engine = ftjax.Engine(default)
  store = SessionStore(root, engine, 1 << 30)
  assert len(store) == 1
  pool = SessionPool(engine, store=store)
  session = pool.take(ids + [1, 2])
  assert store.loads == 0 and name in dict(store.skipped)
  assert session.set_context(ids + [1, 2]).reused_tokens == 0  # a new session, served
  assert session.generate(4) == engine.generate(ids + [1, 2], 4)


def test_the_disk_budget_keeps_the_newest(tmp_path):
  model = ftjax.load("default")
  engine = ftjax.Engine(model)
  store = SessionStore(str(tmp_path), engine, 1 << 30)
  pool = SessionPool(engine, max_sessions=1, store=store)
  for word in ("alpha", "beta", "gamma"):  # no common prefix: three sessions
    ids = _ids(model, f"{word}: a question about caches.")
    session = pool.take(ids)
    session.set_context(ids)
    pool.done(session)
  pool.save_all()
  sizes = sorted(s.nbytes for s in store.saved.values())
  assert len(store) == 3
  store.budget_bytes = sizes[-1] + sizes[-2] + 1  # room for two
  store.trim()
  assert len(store) == 2 and len(os.listdir(tmp_path)) == 2


def _start(root):
  proc = subprocess.Popen([sys.executable, "-m", "ftjax.serve", "--model=default", "--port=0",
                           "--served_model_name=tiny", "--noprecompile",
                           f"--session_dir={root}"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  line = proc.stdout.readline()
  match = re.search(r"on http://(127\.0\.0\.1):(\d+)/v1", line)
  assert match, (line, proc.stderr.read() if proc.poll() is not None else "")
  client = openai.OpenAI(base_url=f"http://127.0.0.1:{match.group(2)}/v1", api_key="none",
                         max_retries=0, timeout=120)
  deadline = time.monotonic() + 300
  while True:
    try:
      client.models.list()
      return proc, client
    except openai.APIError:
      assert time.monotonic() < deadline and proc.poll() is None, "the server did not start"
      time.sleep(0.3)


def _stop(proc) -> str:
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err
  return err


def test_a_real_server_restart_keeps_the_conversation(tmp_path):
  root = str(tmp_path / "sessions")
  messages = [{"role": "system", "content": "You are a coding agent."},
              {"role": "user", "content": "Write a function that parses argv."}]
  proc, client = _start(root)
  try:
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                           temperature=0)
  finally:
    err = _stop(proc)
  assert "saved 1 sessions" in err, err
  proc, client = _start(root)
  try:
    messages += [{"role": "assistant", "content": first.choices[0].message.content or ""},
                 {"role": "user", "content": "Now test it."}]
    second = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                            temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0, second.usage
  finally:
    _stop(proc)
