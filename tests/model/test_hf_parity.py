"""The model equals Hugging Face transformers, family by family, through the converter."""

import numpy as np
import pytest
import torch

import ftjax

import tolerances

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "minimax_m2", "glm4_moe",
            "deepseek_v3", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa"]
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


# The families whose MoE layers are not every decoder layer's (glm4_moe: a dense first layer,
# so bank layer = decoder layer - 1) or whose router is the sigmoid one with its selection bias.
SIGMOID_FAMILIES = ["minimax_m2", "glm4_moe", "deepseek_v3", "glm4_moe_lite"]


@pytest.mark.parametrize("family", SIGMOID_FAMILIES)
@pytest.mark.parametrize("policy", ["lru_fill", "freetoken"])
def test_sigmoid_families_through_the_expert_cache(converted, family, policy):
  """Through the expert cache, with no slot, a few and every expert's, in prefill chunks of 16
  (a 24-token prompt crosses one): the logits after the prompt and the greedy tokens are
  transformers'."""
  hf_model, model = converted[family]
  c = model.config
  ids = _prompt(c.vocab_size)
  with torch.no_grad():
    want_last = hf_model(torch.tensor(ids[None])).logits[0, -1].numpy()
    want = hf_model.generate(torch.tensor(ids[None]), max_new_tokens=NEW, do_sample=False,
                             min_new_tokens=NEW, pad_token_id=0)[0, SEQ:].tolist()
  every = c.num_moe_layers * c.num_experts
  for slots in (0, 5, every):
    engine = ftjax.Engine(model, kernels="ffi", policy=policy, cache_slots=slots,
                          cache_capacity=every, bandwidths=(10.0, 20.0), prefill_chunk=16)
    tolerances.assert_close(engine.prefill_logits(ids), want_last, tolerances.HF_PARITY,
                            floor=1.0, what=f"{family} {policy} {slots} slots")
    assert engine.generate(ids.tolist(), NEW, greedy=True) == want, (family, policy, slots)


def test_latent_attention_on_the_xla_path(converted):
  """deepseek_v3 on the XLA path in prefill chunks of 16: the first chunk attends to its own
  rows, the second to the latent cache in blocks, decode steps to the whole cache; the logits
  after the prompt and the greedy tokens are transformers'. The decode state holds the latent
  (kv_lora_rank + qk_rope_head_dim per token, one row for all heads), no per-head keys."""
  hf_model, model = converted["deepseek_v3"]
  c = model.config
  ids = _prompt(c.vocab_size)
  with torch.no_grad():
    want_last = hf_model(torch.tensor(ids[None])).logits[0, -1].numpy()
    want = hf_model.generate(torch.tensor(ids[None]), max_new_tokens=NEW, do_sample=False,
                             min_new_tokens=NEW, pad_token_id=0)[0, SEQ:].tolist()
  engine = ftjax.Engine(model, kernels="xla", prefill_chunk=16)
  tolerances.assert_close(engine.prefill_logits(ids), want_last, tolerances.HF_PARITY,
                          floor=1.0, what="deepseek_v3 xla")
  assert engine.generate(ids.tolist(), NEW, greedy=True) == want
  assert c.kv_cache_shape == (1, c.kv_lora_rank + c.head_dim, 0) == (1, 16, 0)
  state = engine.new_state(1, 256)
  assert {(layer.k.shape[2:], layer.v.shape[2:]) for layer in state.layers} == {
      ((1, 16), (1, 0))}


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_families_serve_up_to_index_topk(converted, family, capsys):
  """DeepSeek-V3.2 and GLM-5 run as dense latent attention, which their sparse attention is up
  to index_topk tokens of context (the logits and greedy tokens above): an engine serves that
  much by default, says so, and refuses a longer context."""
  _, model = converted[family]
  c = model.config
  assert c.sparse_attention_topk == 64 and c.latent_attention
  engine = ftjax.Engine(model)
  assert engine.max_seq_len == 64 and "context limited to 64 tokens" in capsys.readouterr().err
  assert ftjax.Engine(model, max_seq_len=48).max_seq_len == 48
  with pytest.raises(ValueError, match="max_seq_len=65 exceeds 64: .*index_topk"):
    ftjax.Engine(model, max_seq_len=65)
