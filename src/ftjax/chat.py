"""``python -m ftjax.chat``: an interactive multi-turn chat in the terminal, on a Session.

Each line you type is a user message. The conversation is rendered with the model's chat
template (``ftjax.runtime.chat_template``) and set as the session's context, so every turn
reuses what the last one left (the KV cache up to the first changed token, and anchors for
the recurrent layers of hybrid models); the reply streams as it is generated. After each reply
a line on stderr gives the time to the first token, the decode speed and what was reused.

Commands: ``/reset`` (a new conversation), ``/save PATH`` and ``/load PATH`` (the session and
its messages, with orbax: ``Session.save``/``Session.restore``), ``/stats`` (anchors and
per-turn reuse), ``/quit`` (or end of input). ``python -m ftjax.decode`` stays the one-shot
command. ``ChatLoop`` is the library behind it: give it lines, it writes the replies.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Iterable, TextIO

from absl import app, flags, logging

from ftjax import cli_flags
from ftjax.kernels import KernelsUnavailable
from ftjax.runtime.chat_template import ChatTemplateError, load_chat_template
from ftjax.runtime.checkpoint import CheckpointError
from ftjax.runtime.session import DEFAULT_ANCHOR_BUDGET_BYTES, Session
from ftjax.runtime.tokenizer import StreamDecoder, load_tokenizer

HELP = "commands: /reset, /save PATH, /load PATH, /stats, /quit"


class ChatLoop:
  """One conversation on ``session``: ``handle(line)`` runs a command or a user turn."""

  def __init__(self, session: Session, *, system: str | None = None, max_new_tokens: int = 256,
               sampling: dict | None = None, thinking: bool = True, anchor_budget_bytes: int =
               DEFAULT_ANCHOR_BUDGET_BYTES, out: TextIO = sys.stdout, log: TextIO = sys.stderr):
    self.session = session
    self.engine = session.engine
    model = self.engine.model
    self.tokenizer = load_tokenizer(model.path, model.config.vocab_size)
    self.template = load_chat_template(model.path)
    self.system = system
    self.max_new_tokens = max_new_tokens
    self.sampling = dict(sampling or {"greedy": True})
    self.thinking = thinking
    self.anchor_budget_bytes = anchor_budget_bytes
    self.out, self.log = out, log
    self.messages: list[dict] = []
    self.reset()
    if self.template.is_fallback:
      log.write("ftjax.chat: the model ships no chat template; using the plain fallback "
                "(ROLE: CONTENT lines)\n")

  def reset(self) -> None:
    self.messages = [{"role": "system", "content": self.system}] if self.system else []

  def handle(self, line: str) -> bool:
    """Runs one input line; returns False when the chat should end."""
    text = line.rstrip("\n")
    if not text.strip():
      return True
    if text.startswith("/"):
      return self._command(text)
    self.turn(text)
    return True

  def _command(self, text: str) -> bool:
    name, _, arg = text.partition(" ")
    arg = arg.strip()
    if name in ("/quit", "/exit"):
      return False
    if name == "/reset":
      self.reset()
      self.session = Session(self.engine, anchor_budget_bytes=self.anchor_budget_bytes)
      self.log.write("new conversation\n")
    elif name == "/stats":
      stats = self.session.stats()
      turns = stats.pop("turns")
      stats.pop("anchor_list")
      self.log.write(json.dumps(stats) + "\n")
      for i, t in enumerate(turns):
        self.log.write(f"  turn {i}: {t['context_tokens']} context tokens, {t['reused_tokens']} "
                       f"reused, {t['prefilled_tokens']} prefilled, {t['generated_tokens']} "
                       f"generated, anchor {t['anchor_position']}\n")
    elif name == "/save" and arg:
      step = self.session.save(arg, metadata={"messages": self.messages})
      self.log.write(f"saved to {arg} (step {step})\n")
    elif name == "/load" and arg:
      try:
        session = Session.restore(self.engine, arg, anchor_budget_bytes=self.anchor_budget_bytes)
      except (CheckpointError, FileNotFoundError) as e:
        self.log.write(f"ftjax.chat: cannot load: {e}\n")
        return True
      self.session = session
      self.messages = list((session.metadata or {}).get("messages", []))
      self.log.write(f"loaded {arg}: {len(self.messages)} messages, "
                     f"{len(session.tokens)} tokens\n")
    else:
      self.log.write(f"unknown command {text!r}; {HELP}\n")
    return True

  def turn(self, user_text: str) -> str:
    """A user message and the streamed reply; returns the reply's text."""
    t0 = time.perf_counter()
    messages = self.messages + [{"role": "user", "content": user_text}]
    try:
      prompt = self.template.render(messages, add_generation_prompt=True,
                                    enable_thinking=self.thinking)
    except ChatTemplateError as e:
      self.log.write(f"ftjax.chat: {e}\n")
      return ""
    ids = self.tokenizer.encode(prompt)
    context = self.session.set_context(ids)
    stops = set(self.engine.model.config.eos_token_ids)
    stream = StreamDecoder(self.tokenizer)
    first_token_at = []

    def on_token(tok: int) -> None:
      if not first_token_at:
        first_token_at.append(time.perf_counter())
      if tok not in stops:
        self.out.write(stream.push(tok))
        self.out.flush()

    new = self.session.generate(self.max_new_tokens, on_token=on_token, stop_tokens=stops,
                                **self.sampling)
    done = time.perf_counter()
    self.out.write(stream.flush() + "\n")
    self.out.flush()
    reply = self.tokenizer.decode([t for t in new if t not in stops])
    self.messages = messages + [{"role": "assistant", "content": reply}]
    ttft = (first_token_at[0] if first_token_at else done) - t0
    steps = max(len(new) - 1, 0)
    rate = steps / (done - first_token_at[0]) if steps and first_token_at else float("nan")
    anchor = (f", from the anchor at {context.anchor_position}"
              if context.anchor_position is not None else "")
    self.log.write(f"[TTFT {ttft:.2f} s, {len(new)} tokens at {rate:.1f} tok/s; context "
                   f"{len(ids)} tokens: {context.reused_tokens} reused{anchor}, "
                   f"{context.prefilled_tokens} prefilled]\n")
    return reply

  def run(self, lines: Iterable[str]) -> None:
    for line in lines:
      if not self.handle(line):
        break


def _lines(interactive: bool):
  while True:
    try:
      yield input("> ") if interactive else next(sys.stdin)
    except (EOFError, StopIteration):
      return


def main(argv):
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  cli_flags.check_speculative(_SPECULATIVE, "ftjax.chat")
  print(f"compilation cache: {cli_flags.start_compilation_cache(_ENGINE)}", file=sys.stderr,
        flush=True)
  try:
    engine = cli_flags.build_engine(_ENGINE)
    model = engine.model
    session = Session(engine, anchor_budget_bytes=_ANCHOR_BUDGET.value)
    sampling = {k: _SAMPLING[k].value for k in ("greedy", "temperature", "top_p", "seed")}
    loop = ChatLoop(session, system=_SYSTEM.value, max_new_tokens=_SAMPLING["max_new_tokens"].value,
                    sampling=sampling, thinking=_THINKING.value,
                    anchor_budget_bytes=_ANCHOR_BUDGET.value)
    if _PRECOMPILE.value:
      cli_flags.precompile(engine, session.anchor_slots, "ftjax.chat")
  except (ValueError, FileNotFoundError, KernelsUnavailable, MemoryError) as e:
    raise SystemExit(f"ftjax.chat: error: {e}") from None
  interactive = sys.stdin.isatty()
  sys.stderr.write(f"ftjax.chat: {model.path} ({model.config.model_type}), kernels "
                   f"{engine.kernels_path}, anchors {'on' if session.anchoring else 'off'}; "
                   f"{HELP}\n")
  try:
    loop.run(_lines(interactive))
  except (ValueError, CheckpointError) as e:
    raise SystemExit(f"ftjax.chat: error: {e}") from None


def cli() -> None:
  """Defines the flags and runs ``main`` (``python -m ftjax.chat``)."""
  global _ENGINE, _SAMPLING, _SYSTEM, _THINKING, _ANCHOR_BUDGET, _PRECOMPILE, _SPECULATIVE
  _ENGINE = cli_flags.define_engine_flags()
  _PRECOMPILE = cli_flags.define_precompile_flag(False)
  _SPECULATIVE = cli_flags.define_unsupported_speculative_flag("ftjax.chat")
  _SAMPLING = cli_flags.define_sampling_flags(max_new_tokens=256, greedy=False)
  _SYSTEM = flags.DEFINE_string("system", None, "a system message opening the conversation")
  _THINKING = flags.DEFINE_boolean("thinking", True, "let the model think first (the "
                                   "template's enable_thinking)")
  _ANCHOR_BUDGET = flags.DEFINE_integer(
      "anchor_budget_bytes", DEFAULT_ANCHOR_BUDGET_BYTES,
      "host memory for recurrent-state anchors (0: none)", lower_bound=0)
  app.run(main)


if __name__ == "__main__":
  cli()
