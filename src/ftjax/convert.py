"""``python -m ftjax.convert --hf_dir=DIR --out=DIR [--dtype=bfloat16|float32]
[--expert_dtype=bfloat16|float32|int8|int4|mxfp4]
[--dense_dtype=int8|int4|mxfp4|mixed4|mixed_int4]``."""

from absl import app, flags

from ftjax.formats.hf import convert_hf

_HF_DIR = flags.DEFINE_string("hf_dir", None, "Hugging Face checkpoint directory", required=True)
_OUT = flags.DEFINE_string("out", None, "output FTW directory (must not exist)", required=True)
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "storage dtype")
_EXPERT_DTYPE = flags.DEFINE_enum(
    "expert_dtype", None, ["bfloat16", "float32", "int8", "int4", "mxfp4"],
    "routed experts' format (default: --dtype, or mxfp4 for a checkpoint with MXFP4 experts); "
    "int8 is symmetric per output channel with float32 scales; int4 has a scale and a min per "
    "32 inputs (4.5 bits, as llama.cpp's Q4_K); mxfp4 keeps gpt-oss's MXFP4 experts as shipped, "
    "or quantises float experts to it (docs/ftw.md)")
_DENSE_DTYPE = flags.DEFINE_enum(
    "dense_dtype", None, ["int8", "int4", "mxfp4", "mixed4", "mixed_int4"],
    "quantise the dense matrices outside the experts (attention and Gated DeltaNet projections, "
    "shared experts, MTP projection, lm_head; routers, norms and convolutions stay --dtype): "
    "int8 (per row, float32 scales), int4 (4.5 bits: unsigned codes with a scale and a min per "
    "32 inputs, as llama.cpp's Q4_K), mxfp4 (4.25 bits: E2M1 with an E8M0 scale per 32 inputs), "
    "or the presets nearest llama.cpp's Q4_K_M: mixed_int4 (int4 input projections; int8 value "
    "and output projections, lm_head and embedding) and mixed4 (the same with mxfp4). An untied "
    "embedding is int8 under the 4-bit ones (docs/ftw.md)")
_OVERWRITE = flags.DEFINE_boolean("overwrite", False, "replace --out if it is an FTW model")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}")
  try:
    print(convert_hf(_HF_DIR.value, _OUT.value, dtype=_DTYPE.value,
                     expert_dtype=_EXPERT_DTYPE.value, dense_dtype=_DENSE_DTYPE.value,
                     overwrite=_OVERWRITE.value))
  except (ValueError, FileNotFoundError, FileExistsError) as e:
    raise SystemExit(f"ftjax.convert: error: {e}") from None


if __name__ == "__main__":
  app.run(main)
