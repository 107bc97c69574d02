"""``python -m ftjax.decode``: generate a completion and print a one-line summary.

With no flags it runs the embedded default model on a default prompt. ``run_decode`` is the
library behind it (load, tokenize, stream, summarise); the flags are defined only when the
module runs as a program (``cli``), so importing it defines none.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import TextIO

from absl import app, flags, logging

from ftjax import cli_flags
from ftjax.assets import EMBEDDED_MODELS
from ftjax.kernels import KernelsUnavailable
from ftjax.research.traces import Trace
from ftjax.runtime.engine import Engine, GenerateResult
from ftjax.runtime.model import load, prefault as prefault_weights, residency
from ftjax.runtime.sampling import check_sampling_args
from ftjax.runtime.speculative import SpeculativeResult
from ftjax.runtime.tokenizer import StreamDecoder, load_tokenizer

DEFAULT_PROMPT = "def fibonacci(n):"


@dataclasses.dataclass
class DecodeResult:
  prompt: str
  text: str
  generation: GenerateResult | SpeculativeResult
  model_path: str
  tokenizer: str
  kernels: str = ""  # the host-work path that ran, e.g. "ffi_bf16 (avx2, 2 threads)"
  stats: dict | None = None
  programs: tuple[int, int] = (0, 0)  # (programs made for this run, of them loaded untraced)

  def summary(self) -> str:
    g = self.generation
    return (f"prompt tokens: {g.prompt_tokens}, new tokens: {len(g.tokens)}, "
            f"prefill: {g.prefill_tok_s:.1f} tok/s, decode: {g.decode_tok_s:.1f} tok/s "
            f"(compile {g.compile_s:.1f} s, not included{self._programs()}), "
            f"kernels: {self.kernels}")

  def _programs(self) -> str:
    made, loaded = self.programs
    return f"; {loaded} of {made} programs loaded untraced from the executable store" if (
        loaded) else ""


def _placement_note(engine) -> str:
  """", pool: ..." when the pool is not in the default memory (the GPU path, or its semantics
  on the CPU backend)."""
  placement = engine.placement
  return "" if placement.pool == "device" else f", pool: {placement.description}"


def run_decode(model: str | None = None, prompt: str = DEFAULT_PROMPT, *, max_new_tokens: int = 64,
               greedy: bool = False, temperature: float = 0.8, top_p: float = 0.95, seed: int = 0,
               max_seq_len: int | None = None, kernels: str = "auto", show_stats: bool = False,
               trace_out: str | None = None, decode_chunk: int = 8, prefault: bool = True,
               load_mode: str = "auto",
               speculative: str = "none", draft_tokens: int = 2, adaptive_draft: bool = False,
               out: TextIO = sys.stdout, log: TextIO = sys.stderr,
               **cache_options) -> DecodeResult:
  """Generates a completion of ``prompt``, streaming text to ``out``; returns the result.

  ``cache_options`` are the expert-cache options of ``ftjax.runtime.engine.RuntimeOptions``
  (cache_slots, cache_fraction, cache_bytes, policy, bandwidths, profile). ``trace_out``
  saves the routing trace of the run (``ftjax.traces.Trace``). ``decode_chunk``: decode
  steps per device program (text streams once per chunk). ``load_mode``: how the weights are
  held (``ftjax.runtime.model.LOAD_MODES``: copied into memory, or mapped); ``prefault``: fault
  mapped weights in before the first step (``ftjax.runtime.model.prefault``). Which happened
  is said on ``log``.
  ``speculative="mtp"``: the model's multi-token-prediction head drafts ``draft_tokens`` tokens
  per verify step (greedy, or rejection sampling with the same sampling options;
  ``ftjax.runtime.speculative``); ``adaptive_draft``: each step drafts 0 .. ``draft_tokens``,
  the length with the most expected tokens per byte read."""
  if speculative not in ("none", "mtp"):
    raise ValueError(f"--speculative must be none or mtp, got {speculative!r}")
  if adaptive_draft and speculative != "mtp":
    raise ValueError("--adaptive_draft chooses the draft length of speculative decoding: pass "
                     "--speculative=mtp with it, or drop it")
  model = model or "default"
  loaded = load(model, load_mode=load_mode, show_progress=True)
  if model in EMBEDDED_MODELS and not os.path.exists(model):
    source = loaded.source or {}
    kind = ("random-initialised and untrained: its output is noise"
            if not source.get("trained", True) else
            f"trained: a small MoE trained on the {source.get('corpus', 'unknown data')}, see "
            "ftjax/tiny/README.md")
    log.write(f"ftjax: using the embedded default model {model!r} ({kind}); pass --model=DIR for a "
              "real one\n")
  log.write((prefault_weights(loaded) if prefault else residency(loaded)) + "\n")
  tokenizer = load_tokenizer(loaded.path, loaded.config.vocab_size)
  ids = tokenizer.encode(prompt)
  engine = Engine(loaded, max_seq_len=max_seq_len, kernels=kernels,
                  record_routing=trace_out is not None, decode_chunk=decode_chunk,
                  **cache_options)
  check_sampling_args(greedy, temperature, top_p)
  engine.check_context(len(ids), max_new_tokens)  # fail before printing anything
  stream = StreamDecoder(tokenizer)
  out.write(prompt)
  out.flush()

  def on_token(tok: int) -> None:
    out.write(stream.push(tok))
    out.flush()

  progress = _Progress(log)
  if speculative == "mtp":
    result = engine.generate_speculative(ids, max_new_tokens, greedy, temperature=temperature,
                                         top_p=top_p, seed=seed, draft_tokens=draft_tokens,
                                         stop_tokens=loaded.config.eos_token_ids,
                                         on_token=on_token, adaptive=adaptive_draft)
  else:
    result = engine.generate_timed(ids, max_new_tokens, greedy, temperature=temperature,
                                   top_p=top_p, seed=seed,
                                   stop_tokens=loaded.config.eos_token_ids, on_token=on_token,
                                   on_progress=progress)
  out.write(stream.flush() + "\n")
  out.flush()
  decoded = DecodeResult(prompt=prompt, text=tokenizer.decode(result.tokens),
                         generation=result, model_path=loaded.path or model,
                         tokenizer=tokenizer.name,
                         kernels=engine.kernels_path + _placement_note(engine),
                         programs=(engine.compile_count, engine.loaded_count))
  log.write(decoded.summary() + "\n")
  if speculative == "mtp":
    log.write(f"speculative: mtp, {result.draft_tokens} draft tokens, {result.steps} verify "
              f"steps, {result.tokens_per_step:.2f} tokens a step, acceptance per draft "
              f"position {[round(a, 2) for a in result.acceptance]}"
              + (f", steps with 0 .. {result.draft_tokens} drafts {result.lengths}"
                 if adaptive_draft else "") + "\n")
  if show_stats:
    log.write(format_stats(engine.stats()))
  if trace_out is not None:
    trace = Trace.from_engine(engine)
    log.write(f"routing trace ({trace.num_steps} tokens x {trace.num_layers} layers) written to "
              f"{trace.save(trace_out)}\n")
  decoded.stats = engine.stats()
  return decoded


class _Progress:
  """Prefill progress of a chunked prompt on ``log``: one line per chunk, rewritten in place
  on a terminal."""

  def __init__(self, log: TextIO):
    self.log = log
    self.tty = hasattr(log, "isatty") and log.isatty()
    self.t0 = time.perf_counter()

  def __call__(self, done: int, total: int) -> None:
    if done == 0:  # the prefill starts (its programs are compiled)
      self.t0 = time.perf_counter()
      return
    seconds = time.perf_counter() - self.t0
    start = "\r" if self.tty else ""
    end = "\n" if done == total or not self.tty else ""
    self.log.write(f"{start}prefill: {done}/{total} tokens ({100 * done / total:.0f}%), "
                   f"{done / max(seconds, 1e-9):.0f} tok/s{end}")
    self.log.flush()


def format_stats(stats: dict) -> str:
  """A short table of the expert cache's statistics."""
  if stats.get("cache") is None and "policy" not in stats:
    return "expert cache: none (every routed expert ran from the host pool)\n"
  bw = stats["bandwidths_gb_s"]
  lines = [f"expert cache: policy {stats['policy']}, {stats['slots']} slots "
           f"(buffer {stats['capacity']}, {stats['slot_bytes'] / 2**20:.2f} MiB each), "
           f"bandwidths {'n/a' if bw is None else f'B_P {bw[0]:.1f} B_H {bw[1]:.1f} GB/s'} from "
           f"{stats['bandwidth_source']}, {stats['steps']} steps, "
           f"{stats['compiles']} compiled programs",
           "layer   hits  fills   host  miss rate"]
  per = stats["per_layer"]
  for i, rate in enumerate(per["miss_rate"]):
    lines.append(f"{i:5d} {per['hits'][i]:6d} {per['fills'][i]:6d} {per['host'][i]:6d}"
                 f"  {rate:9.3f}")
  b = stats["bytes"]
  lines.append(f"total miss rate {stats['miss_rate']:.3f}; bytes filled {b['fill'] / 1e6:.1f} MB, "
               f"run on host {b['host'] / 1e6:.1f} MB, read from slots {b['device'] / 1e6:.1f} MB")
  pf = stats.get("prefetch")
  if pf is not None and pf["experts"]:
    share = "-" if pf["used_share"] is None else f"{pf['used_share']:.2f}"
    lines.append(f"router-ahead prefetch (up to {pf['experts']} a layer-step): "
                 f"{pf['prefetched']} experts prefetched ({pf['bytes'] / 1e6:.1f} MB), "
                 f"{pf['used']} used (share {share}), {pf['wasted']} evicted unused")
  cal = stats.get("calibration")
  if cal is not None:
    rates = cal["rates_gb_s"]
    measured = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in cal["seconds_per_step"].items())
    lines.append(f"q* split calibrated: strategy {cal['strategy']}, rates B_P {rates[0]:.1f} "
                 f"B_H {rates[1]:.1f} GB/s ({'fitted' if cal['fitted'] else 'the profile'}), "
                 f"ms a step {{{measured}}}, {len(cal['switches'])} switches, "
                 f"{cal['probes']} probes")
    lines.extend(f"  {s['before']} -> {s['after']} at step {s['step']}" for s in cal["switches"])
  return "\n".join(lines) + "\n"


def main(argv):
  logging.set_verbosity(logging.WARNING)  # keep JAX's backend probing out of the output
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; pass the prompt with --prompt")
  compiled_in = cli_flags.start_compilation_cache(_ENGINE)
  print(f"compilation cache: {compiled_in}", file=sys.stderr, flush=True)
  cache = cli_flags.cache_options(_ENGINE)
  prompt = _PROMPT.value
  if _PROMPT_FILE.value is not None:
    if _PROMPT.value != DEFAULT_PROMPT:
      raise app.UsageError("give --prompt or --prompt_file, not both")
    try:
      with open(_PROMPT_FILE.value, encoding="utf-8") as f:
        prompt = f.read()
    except OSError as e:
      raise SystemExit(f"ftjax.decode: error: cannot read --prompt_file: {e}") from None
  try:
    run_decode(_ENGINE["model"].value, prompt,
               max_new_tokens=_SAMPLING["max_new_tokens"].value,
               greedy=_SAMPLING["greedy"].value, temperature=_SAMPLING["temperature"].value,
               top_p=_SAMPLING["top_p"].value, seed=_SAMPLING["seed"].value,
               max_seq_len=_ENGINE["max_seq_len"].value, kernels=_ENGINE["kernels"].value,
               show_stats=_STATS.value, trace_out=_TRACE_OUT.value,
               decode_chunk=_ENGINE["decode_chunk"].value, prefault=_ENGINE["prefault"].value,
               load_mode=_ENGINE["load_mode"].value,
               speculative=_SPECULATIVE.value, draft_tokens=_DRAFT_TOKENS.value,
               adaptive_draft=_ADAPTIVE_DRAFT.value, **cache)
  except (ValueError, FileNotFoundError, KernelsUnavailable) as e:
    raise SystemExit(f"ftjax.decode: error: {e}") from None


def cli() -> None:
  """Defines the flags and runs ``main`` (``python -m ftjax.decode``)."""
  global _ENGINE, _SAMPLING, _PROMPT, _PROMPT_FILE, _STATS, _TRACE_OUT, _SPECULATIVE
  global _DRAFT_TOKENS, _ADAPTIVE_DRAFT
  _ENGINE = cli_flags.define_engine_flags()
  _SAMPLING = cli_flags.define_sampling_flags(max_new_tokens=64, greedy=False)
  _PROMPT = flags.DEFINE_string("prompt", DEFAULT_PROMPT, "text to complete")
  _PROMPT_FILE = flags.DEFINE_string("prompt_file", None,
                                     "read the text to complete from this file (long prompts)")
  _STATS = flags.DEFINE_boolean("stats", False, "print the expert cache statistics at the end")
  _TRACE_OUT = flags.DEFINE_string("trace_out", None, "write the routing trace (.npz) here")
  _SPECULATIVE = flags.DEFINE_enum(
      "speculative", "none", ["none", "mtp"],
      "mtp: speculative decoding, the model's multi-token-prediction head drafting "
      "--draft_tokens tokens a step (Qwen3-Next / Qwen3.5-MoE checkpoints with mtp.*; greedy, or "
      "rejection sampling that keeps the sampled distribution)")
  _DRAFT_TOKENS = flags.DEFINE_integer("draft_tokens", 2, "draft tokens a verify step (1-4)",
                                       lower_bound=1, upper_bound=4)
  _ADAPTIVE_DRAFT = flags.DEFINE_boolean(
      "adaptive_draft", False, "with --speculative=mtp: each verify step drafts 0 .. "
      "--draft_tokens tokens, the length with the most expected tokens per byte read from the "
      "acceptance measured so far (each step then also copies the KV caches, which costs "
      "more as the context grows: at long contexts a fixed --draft_tokens is faster)")
  app.run(main)


if __name__ == "__main__":
  cli()
