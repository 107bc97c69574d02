"""gpt-oss equals transformers' GptOssForCausalLM through the converter, with float experts
and with MXFP4 experts as gpt-oss ships them.

The tiny model (``conftest.GPT_OSS``) has every gpt-oss option on: alternating sliding-window
(6) and full attention with sinks, q/k/v/o biases, YaRN rope, the biased top-k-then-softmax
router, and experts with biases and the clamped SwiGLU, whose pre-activations pass the limit
(checked on the reference). Prompts are longer than the window.

The MXFP4 checkpoint (``conftest.save_gpt_oss_mxfp4_checkpoint``, F = 32) holds the experts as
uint8 ``*_blocks`` and ``*_scales`` with ``quantization_config.quant_method = "mxfp4"``; its
reference is transformers' model holding the experts that transformers' own
``convert_moe_packed_tensors`` dequantises from those tensors. ftjax keeps them in MXFP4 (an FTW
``mxfp4`` bank) and dequantises exactly, so the same float32 parity tolerance holds. The tests
that take ``either`` run on both checkpoints.
"""

import copy
import io

import numpy as np
import pytest
import torch

import ftjax
from ftjax.decode import run_decode

import tolerances
from conftest import build_gpt_oss_model, hf_greedy

PROMPT = 40  # tokens: several times the sliding window of 6
NEW = 16


@pytest.fixture(scope="module")
def converted(gpt_oss_checkpoint, tmp_path_factory):
  hf_model, path = gpt_oss_checkpoint
  ftw_dir = ftjax.convert_hf(path, tmp_path_factory.mktemp("gpt_oss") / "ftw", dtype="float32",
                             show_progress=False)
  return hf_model, ftjax.load(ftw_dir)


@pytest.fixture(scope="module")
def converted_mxfp4(gpt_oss_mxfp4_checkpoint, tmp_path_factory):
  hf_model, path = gpt_oss_mxfp4_checkpoint
  ftw_dir = ftjax.convert_hf(path, tmp_path_factory.mktemp("gpt_oss_mxfp4") / "ftw",
                             dtype="float32", show_progress=False)
  model = ftjax.load(ftw_dir)
  assert model.expert_format == "mxfp4"
  return hf_model, model


@pytest.fixture(params=["float_experts", "mxfp4_experts"])
def either(request):
  """(torch model, ftjax model) with float experts, then with MXFP4 experts."""
  name = "converted" if request.param == "float_experts" else "converted_mxfp4"
  return request.getfixturevalue(name)


def _prompt(vocab, n, seed=1):
  return np.random.default_rng(seed).integers(0, vocab, n)


@torch.no_grad()
def _hf_logits(model, ids, pre_activations=None):
  """transformers' logits; ``pre_activations`` collects each expert call's gate and up
  projections (biases included), as the clamped SwiGLU receives them."""
  patched = []
  if pre_activations is not None:
    for layer in model.model.layers:
      experts = layer.mlp.experts
      original = experts._apply_gate

      def record(gate_up, original=original):
        pre_activations.append((gate_up[..., ::2].numpy(), gate_up[..., 1::2].numpy()))
        return original(gate_up)

      experts._apply_gate = record
      patched.append(experts)
  try:
    return model(torch.tensor(ids[None])).logits[0].numpy()
  finally:
    for experts in patched:
      del experts._apply_gate


def test_config(converted):
  config = converted[1].config
  assert config.model_type == "gpt_oss"
  assert config.layer_types == ("sliding_attention", "full_attention") * 2
  assert config.sliding_window == 6 and config.attn_sinks and config.qkv_bias and config.o_bias
  assert config.router == "topk_softmax" and config.router_bias
  assert config.expert_activation == "clamped_swiglu" and config.expert_bias
  assert config.yarn is not None and config.yarn.factor == 4.0 and not config.yarn.truncate


def test_yarn_frequencies_equal_transformers(converted):
  hf_model, model = converted
  c = model.config
  rotary = hf_model.model.rotary_emb
  np.testing.assert_allclose(c.yarn.inv_freq(c.rope_theta, c.head_dim), rotary.inv_freq.numpy(),
                             rtol=tolerances.F32_ROUNDING)
  assert c.yarn.attention_factor == pytest.approx(rotary.attention_scaling, rel=1e-12)


@pytest.mark.parametrize("kernels", ["xla", "ffi"])
def test_logits_match_transformers(either, kernels):
  hf_model, model = either
  ids = _prompt(model.config.vocab_size, PROMPT)
  pre = []
  ref = _hf_logits(hf_model, ids, pre)
  # The clamps are reached, so a wrong clamp changes the logits.
  assert max(g.max() for g, _ in pre) > 7.0 and max(np.abs(u).max() for _, u in pre) > 7.0
  got = ftjax.Engine(model, kernels=kernels).forward_logits(ids)
  assert got.shape == ref.shape == (PROMPT, model.config.vocab_size)
  tolerances.assert_close(got, ref, tolerances.HF_PARITY, floor=1.0, what=kernels)


def test_int8_activations_of_mxfp4_experts(converted_mxfp4):
  """kernels="ffi_int8" on MXFP4 experts: calls of at most 8 tokens (decode) quantise the
  experts' activations per block of 32, close to transformers' logits by the 8-bit error;
  longer calls (prefill) are the exact kernels', bit for bit."""
  hf_model, model = converted_mxfp4
  exact, int8 = ftjax.Engine(model, kernels="ffi"), ftjax.Engine(model, kernels="ffi_int8")
  assert int8.kernels_path.startswith("ffi_int8")
  short = _prompt(model.config.vocab_size, 6, seed=5)
  got, ref = int8.forward_logits(short), _hf_logits(hf_model, short)
  tolerances.assert_close(got, ref, 3e-2, floor=1.0, what="int8 activations")
  assert np.max(np.abs(got - exact.forward_logits(short))) > 1e-4  # really quantised
  long = _prompt(model.config.vocab_size, PROMPT)
  np.testing.assert_array_equal(int8.forward_logits(long), exact.forward_logits(long))


@pytest.mark.parametrize("kernels", ["xla", "ffi"])
def test_chunked_prefill_matches_transformers(converted, kernels):
  """Chunks of 8 tokens, the last one of 5 (within the window): each chunk's sliding layers
  attend across the chunk boundary."""
  hf_model, model = converted
  ids = _prompt(model.config.vocab_size, 29, seed=3)
  ref = _hf_logits(hf_model, ids)
  engine = ftjax.Engine(model, kernels=kernels, prefill_chunk=8)
  got = engine.prefill_logits(ids)
  tolerances.assert_close(got, ref[-1], tolerances.HF_PARITY, floor=1.0, what=kernels)


def test_greedy_tokens_match_transformers(either):
  hf_model, model = either
  ids = _prompt(model.config.vocab_size, PROMPT)
  ref = hf_greedy(hf_model, ids, NEW)
  for kernels in ("xla", "ffi"):
    got = ftjax.Engine(model, kernels=kernels).generate(ids.tolist(), NEW, greedy=True)
    assert got == ref, kernels


def test_bfloat16_checkpoint(tmp_path):
  """A checkpoint saved in bfloat16 (experts and their biases too) converts to a bfloat16 bank
  and equals transformers run in float32 on the same rounded weights."""
  hf_model = build_gpt_oss_model(seed=1)
  with torch.no_grad():
    for p in hf_model.parameters():
      p.copy_(p.to(torch.bfloat16).to(torch.float32))
  path = str(tmp_path / "hf")
  # A copy: casting the model itself would round its rotary frequencies (buffers) too.
  copy.deepcopy(hf_model).to(torch.bfloat16).save_pretrained(path)
  model = ftjax.load(ftjax.convert_hf(path, tmp_path / "ftw", dtype="bfloat16",
                                      show_progress=False))
  assert model.bank.dtype == np.dtype("bfloat16")
  ids = _prompt(model.config.vocab_size, 24, seed=5)
  got = ftjax.Engine(model, kernels="ffi", kv_dtype="float32").forward_logits(ids)
  tolerances.assert_close(got, _hf_logits(hf_model, ids), tolerances.HF_PARITY, floor=1.0)


@pytest.mark.parametrize("policy", ["freetoken", "lru_fill"])
def test_expert_cache_equals_the_dense_path(either, policy):
  """Every cache size (none, one slot, every expert) serves the same experts: the clamped,
  biased experts run from the slots and from the host pool alike (mxfp4: the slots hold the
  mxfp4 bytes, dequantised on the XLA path; host experts on the mxfp4 kernel)."""
  _, model = either
  c = model.config
  ids = _prompt(c.vocab_size, 20, seed=7).tolist()
  dense = ftjax.Engine(model, kernels="ffi")
  want_logits = dense.prefill_logits(ids)
  want_tokens = dense.generate(ids, 8, greedy=True)
  every = c.num_moe_layers * c.num_experts
  for slots in (0, 1, every):  # one slot buffer of every size: one compiled step
    engine = ftjax.Engine(model, kernels="ffi", policy=policy, cache_slots=slots,
                          cache_capacity=every, bandwidths=(10.0, 20.0))
    tolerances.assert_close(engine.prefill_logits(ids), want_logits, tolerances.F32, floor=1.0,
                            what=f"{policy} {slots} slots")
    assert engine.generate(ids, 8, greedy=True) == want_tokens, (policy, slots)


def test_decode_cli_runs_the_converted_model(converted_mxfp4):
  """``python -m ftjax.decode --model=DIR`` (its library function) with an expert cache and a
  chunked prefill: the greedy tokens are transformers'. On the MXFP4 checkpoint only (as gpt-oss
  ships; the float one takes the same CLI path, and its engine is tested above)."""
  hf_model, model = converted_mxfp4
  result = run_decode(model.path, "gpt-oss in ftjax", max_new_tokens=6, greedy=True,
                      kernels="ffi", cache_slots=3, policy="freetoken", bandwidths=(10.0, 20.0),
                      prefill_chunk=5, out=io.StringIO(), log=io.StringIO())
  ids = list("gpt-oss in ftjax".encode())
  assert result.generation.prompt_tokens == len(ids) > 5
  assert result.generation.tokens == hf_greedy(hf_model, ids, 6)
