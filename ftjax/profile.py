"""``python -m ftjax.profile``: measure this machine's bandwidths (B_H, B_P, read ceiling).

  python -m ftjax.profile --out=profile.json                     # Qwen3-30B-A3B expert shape
  python -m ftjax.profile --model=DIR --out=profile.json         # the model's expert shape
  python -m ftjax.profile --hidden=4096 --ffn=14336 --top_k=2    # any shape
"""

from absl import app, flags, logging

from ftjax.runtime import profile as profile_lib

_MODEL = flags.DEFINE_string("model", None, "FTW model directory: profile its own expert bank")
_HIDDEN = flags.DEFINE_integer("hidden", 2048, "expert input width D (without --model)",
                               lower_bound=1)
_FFN = flags.DEFINE_integer("ffn", 768, "expert hidden width F (without --model)", lower_bound=1)
_TOP_K = flags.DEFINE_integer("top_k", 8, "experts per call (without --model)", lower_bound=1)
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "expert storage dtype")
_BANK_GB = flags.DEFINE_float("bank_gb", 1.0, "synthetic bank size (without --model)")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "alternating measurement rounds", lower_bound=1)
_OUT = flags.DEFINE_string("out", "ftjax_profile.json", "where to write the JSON profile")


def main(argv):
  logging.set_verbosity(logging.WARNING)
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  try:
    if _MODEL.value:
      import ftjax  # noqa: PLC0415
      model = ftjax.load(_MODEL.value, verify=False, populate=True)
      c = model.config
      shape = profile_lib.ExpertShape(c.hidden_size, c.moe_intermediate_size, str(model.dtype),
                                      c.top_k)
      bank = model.bank
    else:
      shape = profile_lib.ExpertShape(_HIDDEN.value, _FFN.value, _DTYPE.value, _TOP_K.value)
      bank = profile_lib.synthetic_bank(shape, int(_BANK_GB.value * 1e9))
    result = profile_lib.measure(bank, shape, rounds=_ROUNDS.value)
  except (ValueError, FileNotFoundError) as e:
    raise SystemExit(f"ftjax.profile: error: {e}") from None
  path = profile_lib.save_profile(result, _OUT.value)
  c = result["concurrent"]
  print(f"read {result['read_gb_s']:.1f} GB/s | B_H {result['b_h_gb_s']:.1f} GB/s "
        f"({result['b_h_gb_s'] / result['read_gb_s']:.2f} of read) | B_P "
        f"{result['b_p_gb_s']:.1f} GB/s | concurrent B_H {c['b_h_gb_s']:.1f} + B_P "
        f"{c['b_p_gb_s']:.1f} GB/s")
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
