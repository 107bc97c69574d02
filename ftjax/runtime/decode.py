"""The library behind ``python -m ftjax.decode``: load, tokenize, stream, summarise."""

from __future__ import annotations

import dataclasses
import sys
from typing import TextIO

from ftjax.runtime.engine import Engine, GenerateResult
from ftjax.runtime.model import load
from ftjax.runtime.sampling import check_sampling_args
from ftjax.runtime.tokenizer import StreamDecoder, load_tokenizer
from ftjax.tiny import DEFAULT_MODEL_DIR

DEFAULT_PROMPT = "def fibonacci(n):"


@dataclasses.dataclass
class DecodeResult:
  prompt: str
  text: str
  generation: GenerateResult
  model_path: str
  tokenizer: str

  def summary(self) -> str:
    g = self.generation
    return (f"prompt tokens: {g.prompt_tokens}, new tokens: {len(g.tokens)}, "
            f"prefill: {g.prefill_tok_s:.1f} tok/s, decode: {g.decode_tok_s:.1f} tok/s "
            f"(compile {g.compile_s:.1f} s, not included)")


def run_decode(model: str | None = None, prompt: str = DEFAULT_PROMPT, *, max_new_tokens: int = 64,
               greedy: bool = False, temperature: float = 0.8, top_p: float = 0.95, seed: int = 0,
               max_seq_len: int | None = None, kernels: str = "auto",
               out: TextIO = sys.stdout, log: TextIO = sys.stderr) -> DecodeResult:
  """Generates a completion of ``prompt``, streaming text to ``out``; returns the result."""
  path = model or DEFAULT_MODEL_DIR
  loaded = load(path)
  if model is None:
    source = loaded.source or {}
    kind = "random-initialised and untrained: its output is noise" if not source.get(
        "trained", True) else "trained"
    log.write(f"ftjax: using the embedded default model ({kind}); pass --model=DIR for a real "
              "one\n")
  tokenizer = load_tokenizer(loaded.path, loaded.config.vocab_size)
  ids = tokenizer.encode(prompt)
  engine = Engine(loaded, max_seq_len=max_seq_len, kernels=kernels)
  check_sampling_args(greedy, temperature, top_p)
  engine.check_context(len(ids), max_new_tokens)  # fail before printing anything
  stream = StreamDecoder(tokenizer)
  out.write(prompt)
  out.flush()

  def on_token(tok: int) -> None:
    out.write(stream.push(tok))
    out.flush()

  result = engine.generate_timed(ids, max_new_tokens, greedy, temperature=temperature,
                                 top_p=top_p, seed=seed, stop_tokens=loaded.config.eos_token_ids,
                                 on_token=on_token)
  out.write(stream.flush() + "\n")
  out.flush()
  decoded = DecodeResult(prompt=prompt, text=tokenizer.decode(result.tokens),
                         generation=result, model_path=loaded.path or path,
                         tokenizer=tokenizer.name)
  log.write(decoded.summary() + "\n")
  return decoded
