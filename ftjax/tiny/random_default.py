"""Writes the embedded default model: a small, deterministic, random-initialised
Qwen3-MoE-style model with a byte-level vocabulary. It is untrained (its output is noise);
it stands in until the trained default model lands, and ``python -m ftjax.decode`` says so.

  python -m ftjax.tiny.random_default --out=ftjax/assets/default_model
"""

from __future__ import annotations

import shutil

from absl import app, flags

from ftjax.model.config import ModelConfig
from ftjax.runtime import model as model_lib

SEED = 0

CONFIG = ModelConfig(
    model_type="qwen3_moe", vocab_size=256, hidden_size=128, num_layers=4, num_heads=4,
    num_kv_heads=2, head_dim=32, num_experts=16, top_k=4, moe_intermediate_size=64,
    rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048,
    layer_types=("full_attention",) * 4, qk_norm="per_head", norm_topk_prob=True,
    source_dtype="bfloat16")

SOURCE = {"kind": "random-init", "trained": False, "seed": SEED,
          "generator": "ftjax.tiny.random_default"}


def build(out_dir: str) -> str:
  model = model_lib.random_model(CONFIG, seed=SEED, dtype="bfloat16")
  return model_lib.save(model, out_dir, dtype="bfloat16", source=SOURCE)


_OUT = flags.DEFINE_string("out", None, "output FTW directory", required=True)


def main(argv):
  del argv
  shutil.rmtree(_OUT.value, ignore_errors=True)
  print(build(_OUT.value))


if __name__ == "__main__":
  app.run(main)
