"""``python -m ftjax.decode``: generate a completion and print a one-line summary.

With no flags it runs the embedded default model on a default prompt.
"""

from absl import app, flags, logging

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
_KERNELS = flags.DEFINE_enum("kernels", "auto", ["auto", "xla", "ffi"],
                              "routed-expert implementation")


def main(argv):
  logging.set_verbosity(logging.WARNING)  # keep JAX's backend probing out of the output
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; pass the prompt with --prompt")
  try:
    run_decode(_MODEL.value, _PROMPT.value, max_new_tokens=_MAX_NEW.value, greedy=_GREEDY.value,
               temperature=_TEMPERATURE.value, top_p=_TOP_P.value, seed=_SEED.value,
               max_seq_len=_MAX_SEQ.value, kernels=_KERNELS.value)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"ftjax.decode: error: {e}") from None


if __name__ == "__main__":
  app.run(main)
