"""Flags shared by the programs that run an engine (``ftjax.decode``, ``ftjax.chat``,
``ftjax.serve``).

Each program calls ``define_engine_flags()`` and ``define_sampling_flags()`` from its ``cli()``
(so importing a program defines no flags), then ``engine_options(holders)`` for the keyword
arguments of ``ftjax.Engine``.
"""

from __future__ import annotations

import sys
import time

from absl import app, flags

from ftjax.cache import POLICIES
from ftjax.kernels import tuning
from ftjax.runtime import compile_cache
from ftjax.runtime.engine import Engine
from ftjax.runtime.executor import PREPARE_WORKERS
from ftjax.runtime.model import LOAD_MODES, LOAD_MODES_HELP, load, prefault, residency

MODEL_HELP = ("FTW directory, a Hugging Face checkpoint directory (converted once into "
              "$FTJAX_CACHE_DIR, default ~/.cache/ftjax), or an embedded model: 'default' (the "
              "default when omitted) or 'default-hybrid' (Gated DeltaNet + attention).")


def define_engine_flags() -> dict[str, flags.FlagHolder]:
  """--model, --max_seq_len, --kernels, --kernel_tuning, --load_mode, --prefault,
  --decode_chunk, the expert-cache flags, --pool, --prefill_chunk, --kv_dtype, --devices, --compilation_cache and --executable_store."""
  return {
      "model": flags.DEFINE_string("model", None, MODEL_HELP),
      "max_seq_len": flags.DEFINE_integer("max_seq_len", None,
                                          "context limit; default the model's", lower_bound=1),
      "kernels": flags.DEFINE_enum(
          "kernels", "auto", ["auto", "xla", "ffi", "ffi_bf16", "ffi_int8"],
          "host kernels: ffi (C++, exact), ffi_bf16 (C++, bf16 activations: faster prefill), "
          "ffi_int8 (C++, int8 activations for int8 experts on AVX-512-VNNI and for mxfp4 "
          "experts' decode on any CPU, as llama.cpp's Q8_0; opt-in), xla; auto "
          "picks ffi_bf16 for bf16, mxfp4 and int4 experts on CPU, ffi otherwise"),
      "load_mode": flags.DEFINE_enum("load_mode", "auto", list(LOAD_MODES), LOAD_MODES_HELP),
      "prefault": flags.DEFINE_boolean(
          "prefault", True, "with mapped weights (--load_mode=mmap, or auto when they do not "
          "fit): fault them into the process before the first step (when they fit in the "
          "memory available), so that decode reads resident pages from its first token; says "
          "so on stderr"),
      "kernel_tuning": flags.DEFINE_string(
          "kernel_tuning", "auto", "the C++ kernels' per-machine variant: " + tuning.MODES_HELP),
      "decode_chunk": flags.DEFINE_integer(
          "decode_chunk", 8, "decode steps per device program (text streams once per chunk)",
          lower_bound=1),
      "cache_slots": flags.DEFINE_integer("cache_slots", None, "expert cache slots",
                                          lower_bound=0),
      "cache_fraction": flags.DEFINE_float(
          "cache_fraction", None, "expert cache size as a fraction of all L·E experts",
          lower_bound=0, upper_bound=1),
      "cache_bytes": flags.DEFINE_integer("cache_bytes", None, "expert cache size in bytes",
                                          lower_bound=0),
      "device_budget_bytes": flags.DEFINE_integer(
          "device_budget_bytes", None, "one device budget in bytes for the decode states (KV "
          "cache, recurrent state) and the expert cache, which gets what the states leave and "
          "is re-divided as they grow and shrink (the server: GET/POST /v1/cache)",
          lower_bound=0),
      "policy": flags.DEFINE_enum("policy", "freetoken", list(POLICIES), "expert cache policy"),
      "profile": flags.DEFINE_string("profile", None,
                                     "bandwidth profile JSON (python -m ftjax.profile)"),
      "bandwidths": flags.DEFINE_list("bandwidths", None,
                                      "B_P,B_H in GB/s (instead of --profile)"),
      "calibrate_split": flags.DEFINE_enum(
          "calibrate_split", "auto", ["auto", "on", "off"],
          "q* policies: re-solve the fill/host split from the costs measured while decoding, "
          "and switch to pure fill or pure host when the split measures over 1.1x the best "
          "(auto: on with --profile, off with --bandwidths)"),
      "prefetch": flags.DEFINE_integer(
          "prefetch", 0, "router-ahead prefetch in decode: at most this many experts per MoE "
          "layer-step, named by the layer's router on the residual entering it, are filled "
          "into the cache before the layer's plan (0: none; needs a cache size)", lower_bound=0),
      "pool": flags.DEFINE_enum(
          "pool", "auto", ["auto", "device", "pinned_host", "mapped"],
          "where the host expert pool lives: device (CPU default), pinned_host (fills as "
          "async copies), mapped (GPU, registered by the CUDA module); auto picks per backend"),
      "prefill_chunk": flags.DEFINE_integer(
          "prefill_chunk", 1024, "the most tokens one prefill program reads: a prompt is read "
          "in chunks of this size and its quarters down to 16 (bounded activation memory, "
          "the same programs for every length)", lower_bound=1),
      "kv_growth": flags.DEFINE_enum(
          "kv_growth", "auto", ["auto", "max", "grow"],
          "the KV buffer: max (the whole context from the start: one set of programs), "
          "grow (4096 rows, grown 4x as a context grows), auto (max up to 64 MiB)"),
      "compilation_cache": flags.DEFINE_boolean(
          "compilation_cache", True, "keep compiled programs in $FTJAX_CACHE_DIR/xla (default "
          "~/.cache/ftjax/xla), so that a restart compiles nothing it compiled before"),
      "executable_store": flags.DEFINE_boolean(
          "executable_store", True, "with --compilation_cache, also keep the engine's programs "
          "whole in $FTJAX_CACHE_DIR/executables, so that a restart loads them without tracing "
          "them (--noexecutable_store: JAX's cache alone, each program traced at start-up)"),
      "kv_dtype": flags.DEFINE_enum(
          "kv_dtype", None, ["float32", "bfloat16"],
          "KV cache dtype; default bfloat16 for bfloat16 models, float32 otherwise"),
      "devices": flags.DEFINE_integer(
          "devices", None, "split the expert cache's slots (and large dense weights) over this "
          "many local devices (expert-parallel; needs --pool=device)", lower_bound=1),
  }


def define_sampling_flags(*, max_new_tokens: int, greedy: bool) -> dict[str, flags.FlagHolder]:
  """--max_new_tokens, --temperature, --top_p, --seed, --greedy."""
  return {
      "max_new_tokens": flags.DEFINE_integer("max_new_tokens", max_new_tokens,
                                             "tokens to generate", lower_bound=0),
      "temperature": flags.DEFINE_float("temperature", 0.8, "sampling temperature (> 0)"),
      "top_p": flags.DEFINE_float("top_p", 0.95, "nucleus sampling mass, in (0, 1]"),
      "seed": flags.DEFINE_integer("seed", 0, "sampling seed"),
      "greedy": flags.DEFINE_boolean("greedy", greedy,
                                     "argmax decoding (ignores temperature, top_p)"),
  }


def cache_options(holders: dict[str, flags.FlagHolder]) -> dict:
  """The expert-cache keyword arguments of ``ftjax.Engine`` given on the command line (the
  pool's placement among them, when not ``auto``), and the prefill chunk, KV dtype and kernel
  tuning."""
  cache = {}
  for name in ("cache_slots", "cache_fraction", "cache_bytes", "device_budget_bytes",
               "profile"):
    if holders[name].value is not None:
      cache[name] = holders[name].value
  if holders["bandwidths"].value is not None:
    try:
      cache["bandwidths"] = tuple(float(b) for b in holders["bandwidths"].value)
    except ValueError:
      raise app.UsageError(f"--bandwidths must be two numbers B_P,B_H in GB/s, got "
                           f"{','.join(holders['bandwidths'].value)}") from None
  if cache:
    cache["policy"] = holders["policy"].value
    if holders["calibrate_split"].value != "auto":
      cache["calibrate_split"] = holders["calibrate_split"].value
  if holders["prefetch"].value:
    cache["prefetch"] = holders["prefetch"].value
  if holders["pool"].value != "auto":
    cache["pool"] = holders["pool"].value
  if holders["devices"].value is not None:
    cache["devices"] = holders["devices"].value
  cache["prefill_chunk"] = holders["prefill_chunk"].value
  cache["kernel_tuning"] = holders["kernel_tuning"].value
  cache["kv_growth"] = holders["kv_growth"].value
  if holders["kv_dtype"].value is not None:
    cache["kv_dtype"] = holders["kv_dtype"].value
  return cache


def start_compilation_cache(holders: dict[str, flags.FlagHolder]) -> str:
  """Turns on the persistent compilation cache unless --nocompilation_cache; says which."""
  if not holders["compilation_cache"].value:
    compile_cache.disable_executables()
    return "off (--nocompilation_cache)"
  where = compile_cache.enable(executables=holders["executable_store"].value)
  store = compile_cache.executables_dir() or "off (--noexecutable_store)"
  return f"{where}, executables: {store}"


def define_precompile_flag(default: bool) -> flags.FlagHolder:
  return flags.DEFINE_boolean(
      "precompile", default, "compile every program a request can run before the first one "
      "(a restart reads them from the compilation cache), so that no request waits for a "
      "compile")


def define_unsupported_speculative_flag(name: str) -> flags.FlagHolder:
  """``--speculative`` of a program that decodes on the executor's step (``ftjax.chat``,
  ``ftjax.serve``), which has no verify step: ``mtp`` is refused (``check_speculative``)."""
  return flags.DEFINE_enum(
      "speculative", "none", ["none", "mtp"],
      f"speculative decoding: not in {name} (mtp is refused with the reason); it runs in "
      "python -m ftjax.decode --speculative=mtp")


def check_speculative(holder: flags.FlagHolder, name: str) -> None:
  """Refuses ``--speculative=mtp`` in ``name`` with the reason and what to run instead."""
  if holder.value != "none":
    raise app.UsageError(
        f"--speculative={holder.value}: {name} decodes its sequences on the executor's batched "
        "step (sessions, continuous batching), which has no speculative verify step; "
        "speculative decoding runs one sequence at a time in python -m ftjax.decode "
        "--speculative=mtp (Engine.generate_speculative): drop --speculative here")


def precompile(engine: Engine, anchor_slots: int, name: str) -> None:
  """``engine.precompile`` with its progress on stderr (one line, rewritten)."""
  t0 = time.perf_counter()

  def progress(done: int, total: int, key: tuple) -> None:
    sys.stderr.write(f"\r{name}: compiling programs {done + 1}/{total} ({key[0]}) ...")
    sys.stderr.flush()

  keys = engine.precompile(anchor_slots, progress, workers=PREPARE_WORKERS)
  if keys:
    sys.stderr.write(f"\r{name}: compiled {len(keys)} programs in "
                     f"{time.perf_counter() - t0:.1f} s{' ' * 12}\n")


def build_engine(holders: dict[str, flags.FlagHolder]) -> Engine:
  """The model of ``--model`` (the default model when omitted) in an engine with the
  command line's runtime flags."""
  model = load(holders["model"].value or "default", load_mode=holders["load_mode"].value,
               show_progress=True)
  print(prefault(model) if holders["prefault"].value else residency(model), file=sys.stderr)
  return Engine(model, max_seq_len=holders["max_seq_len"].value,
                kernels=holders["kernels"].value, decode_chunk=holders["decode_chunk"].value,
                **cache_options(holders))
