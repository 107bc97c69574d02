"""gpt-oss with MXFP4 experts, as gpt-oss ships them, equals transformers through the converter.

The checkpoint (``conftest.save_gpt_oss_mxfp4_checkpoint``) holds the experts as uint8
``*_blocks`` and ``*_scales`` with ``quantization_config.quant_method = "mxfp4"``; the
reference is transformers' GptOssForCausalLM holding the experts that transformers' own
``convert_moe_packed_tensors`` dequantises from those tensors. ftjax keeps them in MXFP4 (an FTW
``mxfp4`` bank, never expanded) and dequantises exactly, so the float32 parity tolerance
holds. Prompts are longer than the sliding window (6); the clamps of the SwiGLU are reached.
"""

import io
import json
import os

import numpy as np
import pytest
import torch

import ftjax
from ftjax.decode import run_decode
from ftjax.formats import ftw
from ftjax.formats.hf import ConversionError
from ftjax.utils import quant

import tolerances
from conftest import hf_greedy

PROMPT = 40
NEW = 16


@pytest.fixture(scope="module")
def converted(gpt_oss_mxfp4_checkpoint, tmp_path_factory):
  hf_model, path = gpt_oss_mxfp4_checkpoint
  ftw_dir = ftjax.convert_hf(path, tmp_path_factory.mktemp("mxfp4") / "ftw", dtype="float32",
                             show_progress=False)
  return hf_model, ftjax.load(ftw_dir)


def _prompt(vocab, n, seed=1):
  return np.random.default_rng(seed).integers(0, vocab, n)


@torch.no_grad()
def _hf_logits(model, ids, pre_activations=None):
  """transformers' logits; ``pre_activations`` collects each expert call's gate and up."""
  patched = []
  if pre_activations is not None:
    for layer in model.model.layers:
      experts = layer.mlp.experts

      def record(gate_up, original=experts._apply_gate):
        pre_activations.append((gate_up[..., ::2].numpy(), gate_up[..., 1::2].numpy()))
        return original(gate_up)

      experts._apply_gate = record
      patched.append(experts)
  try:
    return model(torch.tensor(ids[None])).logits[0].numpy()
  finally:
    for experts in patched:
      del experts._apply_gate


def test_experts_stay_mxfp4(converted, gpt_oss_mxfp4_checkpoint):
  """The bank holds the shipped codes and scales byte for byte (gate = even rows of gate_up,
  up = odd rows), at 4.25 bits a weight plus the float32 biases."""
  _, model = converted
  c = model.config
  assert model.expert_format == "mxfp4" and model.bank.dtype == np.uint8
  f, d = c.moe_intermediate_size, c.hidden_size
  assert model.expert_bytes == quant.mxfp4_block_bytes(f, d) < 3 * f * d * 0.54 + 4 * (2 * f + d)
  storage = model.storage
  from safetensors.numpy import load_file
  shipped = load_file(os.path.join(gpt_oss_mxfp4_checkpoint[1], "model.safetensors"))
  blocks = shipped["model.layers.1.mlp.experts.gate_up_proj_blocks"]  # [E, 2F, D/32, 16]
  scales = shipped["model.layers.1.mlp.experts.gate_up_proj_scales"]
  np.testing.assert_array_equal(storage.expert_part(1, 3, "up"), blocks[3, 1::2].reshape(f, -1))
  np.testing.assert_array_equal(storage.expert_scale(1, 3, "gate"), scales[3, 0::2])
  down = shipped["model.layers.2.mlp.experts.down_proj_blocks"]
  np.testing.assert_array_equal(storage.expert_part(2, 5, "down"), down[5].reshape(d, -1))
  with open(os.path.join(model.path, ftw.INDEX_NAME)) as fh:
    assert json.load(fh)["experts"]["format"] == "mxfp4"


@pytest.mark.parametrize("kernels", ["xla", "ffi"])
def test_logits_match_transformers(converted, kernels):
  hf_model, model = converted
  ids = _prompt(model.config.vocab_size, PROMPT)
  pre = []
  ref = _hf_logits(hf_model, ids, pre)
  # The clamps are reached (max g ~9, max |u| ~11), so a wrong clamp changes the logits.
  assert max(g.max() for g, _ in pre) > 7.0 and max(np.abs(u).max() for _, u in pre) > 7.0
  got = ftjax.Engine(model, kernels=kernels).forward_logits(ids)
  assert got.shape == ref.shape == (PROMPT, model.config.vocab_size)
  tolerances.assert_close(got, ref, tolerances.HF_PARITY, floor=1.0, what=kernels)


def test_greedy_tokens_match_transformers(converted):
  hf_model, model = converted
  ids = _prompt(model.config.vocab_size, PROMPT)
  ref = hf_greedy(hf_model, ids, NEW)
  for kernels in ("xla", "ffi"):
    got = ftjax.Engine(model, kernels=kernels).generate(ids.tolist(), NEW, greedy=True)
    assert got == ref, kernels


@pytest.mark.parametrize("policy", ["freetoken", "lru_fill"])
def test_expert_cache_equals_the_dense_path(converted, policy):
  """Slots hold the mxfp4 bytes: none, one and every slot serve the same experts (slot experts
  on the XLA dequantisation, host experts on the mxfp4 kernel)."""
  _, model = converted
  c = model.config
  ids = _prompt(c.vocab_size, 20, seed=7).tolist()
  dense = ftjax.Engine(model, kernels="ffi")
  want_logits = dense.prefill_logits(ids)
  want_tokens = dense.generate(ids, 8, greedy=True)
  every = c.num_moe_layers * c.num_experts
  for slots in (0, 1, every):
    engine = ftjax.Engine(model, kernels="ffi", policy=policy, cache_slots=slots,
                          cache_capacity=every, bandwidths=(10.0, 20.0))
    tolerances.assert_close(engine.prefill_logits(ids), want_logits, tolerances.F32, floor=1.0,
                            what=f"{policy} {slots} slots")
    assert engine.generate(ids, 8, greedy=True) == want_tokens, (policy, slots)


def test_decode_cli_runs_the_converted_model(converted):
  hf_model, model = converted
  result = run_decode(model.path, "gpt-oss in mxfp4", max_new_tokens=6, greedy=True,
                      kernels="ffi", cache_slots=3, policy="freetoken", bandwidths=(10.0, 20.0),
                      prefill_chunk=5, out=io.StringIO(), log=io.StringIO())
  ids = list("gpt-oss in mxfp4".encode())
  assert result.generation.tokens == hf_greedy(hf_model, ids, 6)


def test_expanding_mxfp4_is_refused(gpt_oss_mxfp4_checkpoint, tmp_path):
  with pytest.raises(ConversionError, match="ships MXFP4 experts, which are kept as they are"):
    ftjax.convert_hf(gpt_oss_mxfp4_checkpoint[1], tmp_path / "ftw", expert_dtype="bfloat16",
                     show_progress=False)
  assert not os.path.exists(tmp_path / "ftw")
