"""The model equals Hugging Face transformers, family by family, through the converter."""

import numpy as np
import pytest
import torch

import ftjax

import tolerances

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
SEQ = 24
NEW = 16


@pytest.fixture(scope="module")
def converted(hf_checkpoints, tmp_path_factory):
  out = {}
  for family, (model, path) in hf_checkpoints.items():
    ftw_dir = ftjax.convert_hf(path, tmp_path_factory.mktemp(family) / "ftw", dtype="float32",
                               show_progress=False)
    out[family] = (model, ftjax.load(ftw_dir))
  return out


def _prompt(vocab):
  return np.random.default_rng(1).integers(0, vocab, SEQ)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kernels", ["xla", "ffi"])
def test_logits_match_transformers(converted, family, kernels):
  hf_model, model = converted[family]
  assert model.config.model_type == family
  ids = _prompt(model.config.vocab_size)
  with torch.no_grad():
    ref = hf_model(torch.tensor(ids[None])).logits[0].numpy()
  got = ftjax.Engine(model, kernels=kernels).forward_logits(ids)
  assert got.shape == ref.shape == (SEQ, model.config.vocab_size)
  tolerances.assert_close(got, ref, tolerances.HF_PARITY, floor=1.0, what=family)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers(converted, family):
  hf_model, model = converted[family]
  ids = _prompt(model.config.vocab_size)
  with torch.no_grad():
    ref = hf_model.generate(torch.tensor(ids[None]), max_new_tokens=NEW, do_sample=False,
                            min_new_tokens=NEW, pad_token_id=0)[0, SEQ:].tolist()
  got = ftjax.Engine(model).generate(ids.tolist(), NEW, greedy=True)
  assert got == ref
