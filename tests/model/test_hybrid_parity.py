"""The hybrid families (Qwen3-Next, Qwen3.5-MoE) equal transformers through the converter."""

import numpy as np
import pytest
import torch

import ftjax

import tolerances

NAMES = ["qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"]
LENGTHS = [1, 63, 64, 65, 300]  # across the chunked form's 64-token chunk boundaries
NEW = 32


@pytest.fixture(scope="module")
def converted(hybrid_checkpoints, tmp_path_factory):
  out = {}
  for name, (model, path) in hybrid_checkpoints.items():
    ftw_dir = ftjax.convert_hf(path, tmp_path_factory.mktemp(name) / "ftw", dtype="float32",
                               show_progress=False)
    out[name] = (model, ftjax.load(ftw_dir))
  return out


def _prompt(vocab, n, seed=1):
  return np.random.default_rng(seed).integers(0, vocab, n)


@torch.no_grad()
def _hf_logits(model, ids):
  return model(torch.tensor(ids[None])).logits[0].numpy()


def test_configs(converted):
  for name in NAMES:
    config = converted[name][1].config
    assert config.model_type == ("qwen3_next" if name == "qwen3_next" else "qwen3_5_moe")
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert config.rotary_dim == 4 and config.attn_output_gate and config.norm_zero_centred
    assert config.shared_expert_gate and config.norm_topk_prob


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kernels", ["xla", "ffi"])
def test_logits_match_transformers(converted, name, kernels):
  hf_model, model = converted[name]
  engine = ftjax.Engine(model, kernels=kernels)
  for n in LENGTHS:
    ids = _prompt(model.config.vocab_size, n)
    ref = _hf_logits(hf_model, ids)
    got = engine.forward_logits(ids)
    assert got.shape == ref.shape == (n, model.config.vocab_size)
    tolerances.assert_close(got, ref, tolerances.HF_PARITY, floor=1.0, what=f"{name} T={n}")


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_match_transformers(converted, name):
  hf_model, model = converted[name]
  ids = _prompt(model.config.vocab_size, 65)
  with torch.no_grad():
    ref = hf_model.generate(torch.tensor(ids[None]), max_new_tokens=NEW, do_sample=False,
                            min_new_tokens=NEW, pad_token_id=0)[0, len(ids):].tolist()
  for kernels in ("xla", "ffi"):
    got = ftjax.Engine(model, kernels=kernels).generate(ids.tolist(), NEW, greedy=True)
    assert got == ref, kernels
