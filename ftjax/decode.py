"""``python -m ftjax.decode``: generate a completion and print a one-line summary.

With no flags it runs the embedded default model on a default prompt.
"""

from absl import app, flags, logging

from ftjax.cache import POLICIES
from ftjax.runtime.decode import DEFAULT_PROMPT, run_decode

_MODEL = flags.DEFINE_string(
    "model", None, "FTW directory, or a Hugging Face checkpoint directory (converted once into "
    "$FTJAX_CACHE_DIR, default ~/.cache/ftjax). Default: the embedded default model.")
_PROMPT = flags.DEFINE_string("prompt", DEFAULT_PROMPT, "text to complete")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "tokens to generate", lower_bound=0)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.8, "sampling temperature (> 0)")
_TOP_P = flags.DEFINE_float("top_p", 0.95, "nucleus sampling mass, in (0, 1]")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")
_GREEDY = flags.DEFINE_boolean("greedy", False, "argmax decoding (ignores temperature, top_p)")
_MAX_SEQ = flags.DEFINE_integer("max_seq_len", None, "context limit; default the model's",
                                lower_bound=1)
_CACHE_SLOTS = flags.DEFINE_integer("cache_slots", None, "expert cache slots", lower_bound=0)
_CACHE_FRACTION = flags.DEFINE_float("cache_fraction", None,
                                     "expert cache size as a fraction of all L·E experts",
                                     lower_bound=0, upper_bound=1)
_CACHE_BYTES = flags.DEFINE_integer("cache_bytes", None, "expert cache size in bytes",
                                    lower_bound=0)
_POLICY = flags.DEFINE_enum("policy", "freetoken", list(POLICIES), "expert cache policy")
_PROFILE = flags.DEFINE_string("profile", None, "bandwidth profile JSON (python -m ftjax.profile)")
_BANDWIDTHS = flags.DEFINE_list("bandwidths", None, "B_P,B_H in GB/s (instead of --profile)")
_STATS = flags.DEFINE_boolean("stats", False, "print the expert cache statistics at the end")
_TRACE_OUT = flags.DEFINE_string("trace_out", None, "write the routing trace (.npz) here")
_KERNELS = flags.DEFINE_enum("kernels", "auto", ["auto", "xla", "ffi", "ffi_bf16"],
                              "host kernels: ffi (C++, exact), ffi_bf16 (C++, bf16 activations: "
                              "faster prefill), xla; auto picks ffi_bf16 for bf16 models on CPU")


def main(argv):
  logging.set_verbosity(logging.WARNING)  # keep JAX's backend probing out of the output
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; pass the prompt with --prompt")
  cache = {}
  for name, flag in (("cache_slots", _CACHE_SLOTS), ("cache_fraction", _CACHE_FRACTION),
                     ("cache_bytes", _CACHE_BYTES), ("profile", _PROFILE)):
    if flag.value is not None:
      cache[name] = flag.value
  if _BANDWIDTHS.value is not None:
    try:
      cache["bandwidths"] = tuple(float(b) for b in _BANDWIDTHS.value)
    except ValueError:
      raise app.UsageError(f"--bandwidths must be two numbers B_P,B_H in GB/s, got "
                           f"{','.join(_BANDWIDTHS.value)}") from None
  if cache:
    cache["policy"] = _POLICY.value
  try:
    run_decode(_MODEL.value, _PROMPT.value, max_new_tokens=_MAX_NEW.value, greedy=_GREEDY.value,
               temperature=_TEMPERATURE.value, top_p=_TOP_P.value, seed=_SEED.value,
               max_seq_len=_MAX_SEQ.value, kernels=_KERNELS.value, show_stats=_STATS.value,
               trace_out=_TRACE_OUT.value, **cache)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"ftjax.decode: error: {e}") from None


if __name__ == "__main__":
  app.run(main)
