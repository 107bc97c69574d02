"""4-bit experts (mxfp4, int4) for families without expert biases, and quantised dense weights
(int8, int4, mxfp4, the mixed4 and mixed_int4 presets), through the engine and the expert cache:
every cache size and policy, host
kernels and XLA, give the logits and greedy tokens of the same model with its quantised
weights dequantised to float32 (the dense, uncached reference)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ftjax
from ftjax.cache.state import check_invariants
from ftjax.formats import ftw
from ftjax.runtime import model as model_lib
from ftjax.utils.dense_quant import QuantizedMatrix

import reference
import tolerances
from conftest import greedy_run, scaled_params

STEPS = 6
PROMPT = 5


def _run(engine, prompts):
  """Prefill, then STEPS greedy single-token steps: (logits per step, tokens)."""
  return greedy_run(engine, prompts, STEPS)


def _dequantised_bank(model):
  c = model.config
  bank = np.asarray(model.bank)
  return jnp.asarray(np.stack([np.stack([np.concatenate([p.reshape(-1) for p in reference.split_block(
      block, c.moe_intermediate_size, c.hidden_size)]) for block in layer]) for layer in bank]
  ).astype(np.float32))


@pytest.fixture(scope="module")
def mxfp4_models(tiny_config):
  """(qwen3_moe with mxfp4 experts, no biases; the same with the experts dequantised)."""
  config = dataclasses.replace(tiny_config, moe_intermediate_size=32)
  model = scaled_params(model_lib.random_model(config, seed=5), 8.0)
  q = model_lib.quantize_experts(model, "mxfp4")
  assert q.expert_format == "mxfp4" and not config.expert_bias
  return q, dataclasses.replace(q, bank=_dequantised_bank(q))


@pytest.fixture(scope="module")
def int4_models(tiny_config):
  """(qwen3_moe with int4 experts; the same with the experts dequantised)."""
  config = dataclasses.replace(tiny_config, moe_intermediate_size=32)
  model = scaled_params(model_lib.random_model(config, seed=6), 8.0)
  q = model_lib.quantize_experts(model, "int4")
  assert q.expert_format == "int4" and q.bank.dtype == np.uint16
  return q, dataclasses.replace(q, bank=_dequantised_bank(q))


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
@pytest.mark.parametrize("kernels", ["ffi", "xla"])
def test_4bit_experts_without_biases_through_the_cache(request, fmt, kernels):
  q, deq = request.getfixturevalue(f"{fmt}_models")
  prompts = np.random.default_rng(0).integers(0, q.config.vocab_size, (2, PROMPT))
  ref_logits, ref_tokens = _run(ftjax.Engine(deq, kernels=kernels), prompts)
  c = q.config
  total = c.num_layers * c.num_experts
  for policy in ("freetoken", "lru_fill"):
    for slots in (0, 1, total // 3, total):
      engine = ftjax.Engine(q, kernels=kernels, cache_slots=slots, policy=policy,
                            bandwidths=(12.0, 24.0), cache_capacity=total)
      logits, tokens = _run(engine, prompts)
      np.testing.assert_array_equal(tokens, ref_tokens)
      # The prompt's logits to float32 rounding, the decode steps' to HF_PARITY, as in the
      # dense test below: the 4-bit kernels scale a block after its integer-coded products, the
      # float32 reference's weights are scaled before, and this 8x-scaled model amplifies that
      # rounding step after step. Measured with the host kernels (Zen 5): the prompt 4.6e-6
      # under every kernel tuning; the decode steps 4.3e-6 (AVX-512, 4-row blocks) to 1.3e-5
      # (1-3-row blocks) and 1.9e-5 (AVX2); the float32 model's own ffi and xla paths differ
      # by up to 2.9e-5 the same way.
      tolerances.assert_close(logits[0], ref_logits[0], tolerances.F32, floor=1.0,
                              what=f"{policy} {kernels} {slots} slots, prompt")
      tolerances.assert_close(logits, ref_logits, tolerances.HF_PARITY, floor=1.0,
                              what=f"{policy} {kernels} {slots} slots")
      check_invariants(engine.cache)
      assert engine.cache.slots.dtype == q.bank.dtype
      assert engine.stats()["slot_bytes"] == q.bank.shape[2] * q.bank.dtype.itemsize


@pytest.fixture(scope="module", params=["attention", "hybrid"])
def float_model(request, tiny_config, tiny_hybrid_config):
  config = tiny_config if request.param == "attention" else tiny_hybrid_config
  return scaled_params(model_lib.random_model(config, seed=3), 8.0)


@pytest.mark.parametrize("dense_dtype", ftw.DENSE_DTYPES)
def test_quantised_dense_weights_match_their_dequantisation(float_model, dense_dtype):
  """Every projection, shared expert and lm_head in the format ``ftw.dense_format`` gives it
  (mxfp4 rows whose length is not a multiple of 32 are int8); the engine's logits are those of
  the dequantised float32 weights, with host kernels and XLA, cached and not."""
  q = model_lib.quantize_dense(float_model, dense_dtype)
  formats = q.dense_formats
  four_bit = {"mxfp4": "mxfp4", "mixed4": "mxfp4", "int4": "int4", "mixed_int4": "int4"}
  assert sum(formats.get(f, 0) for f in ("int8", "int4", "mxfp4")) > 0, formats
  if dense_dtype != "int8":
    assert formats.get(four_bit[dense_dtype], 0) > 0, formats
  lm = model_lib.leaf(q, "w_lm_vd")
  assert isinstance(lm, QuantizedMatrix)
  assert lm.format == ("int8" if dense_dtype in ("int8", "mixed4", "mixed_int4")
                       else four_bit[dense_dtype])
  assert not isinstance(model_lib.leaf(q, next(
      n for n in model_lib.named_params(q) if n.endswith("w_router_ed"))), QuantizedMatrix)
  deq = model_lib.dequantize_dense(q)
  prompts = np.random.default_rng(1).integers(0, q.config.vocab_size, (2, PROMPT))
  c = q.config
  total = c.num_layers * c.num_experts
  for kernels in ("ffi", "xla"):
    ref_logits, ref_tokens = _run(ftjax.Engine(deq, kernels=kernels), prompts)
    for slots in (0, total // 2):
      engine = ftjax.Engine(q, kernels=kernels, cache_slots=slots, policy="freetoken",
                            bandwidths=(12.0, 24.0), cache_capacity=total)
      logits, tokens = _run(engine, prompts)
      np.testing.assert_array_equal(tokens, ref_tokens)
      # The prompt's logits to float32 rounding; the decode steps' to HF_PARITY: an int8 row is
      # scaled after its dot product, the reference's weights before, and this model (weights
      # scaled 8x: sharp attention) amplifies that float32 rounding step after step through the
      # KV cache (measured: 5e-6 of the logits at the prompt, up to 7e-5 six steps on; the float
      # model's ffi and xla paths differ by 1e-5 the same way).
      tolerances.assert_close(logits[0], ref_logits[0], tolerances.F32, floor=1.0,
                              what=f"{dense_dtype} {kernels} {slots} slots, prompt")
      tolerances.assert_close(logits, ref_logits, tolerances.HF_PARITY, floor=1.0,
                              what=f"{dense_dtype} {kernels} {slots} slots")
  # quantisation happened: the logits moved from the float model's (how far on trained weights
  # is benchmarks/dense_quality.py's measure, not this random model's)
  float_logits, _ = _run(ftjax.Engine(float_model, kernels="ffi"), prompts)
  error = np.max(np.abs(ref_logits[0] - float_logits[0])) / np.max(np.abs(float_logits[0]))
  assert error > 1e-4, error


@pytest.mark.parametrize("preset", ["mixed4", "mixed_int4"])
def test_dense_formats_save_and_load_exactly(float_model, tmp_path, preset):
  """save(dense_dtype=...) writes what quantize_dense computes; load gives it back bit for bit
  (FTW version 3 tensor entries with their format); a second save writes it as it is."""
  bf16 = dataclasses.replace(float_model)  # float32 weights; written in bfloat16 below
  path = model_lib.save(bf16, tmp_path / "m", dtype="float32", dense_dtype=preset)
  loaded = ftjax.load(path, verify=True)
  want = model_lib.named_params(model_lib.quantize_dense(float_model, preset))
  got = model_lib.named_params(loaded)
  assert set(got) == set(want)
  for name, value in want.items():
    if isinstance(value, QuantizedMatrix):
      assert isinstance(got[name], QuantizedMatrix) and got[name].format == value.format, name
      np.testing.assert_array_equal(got[name].data, value.data)
      np.testing.assert_array_equal(got[name].scales, value.scales)
    else:
      np.testing.assert_array_equal(got[name], value)
  f = ftw.FTWFile.open(path)
  four_bit = "mxfp4" if preset == "mixed4" else "int4"
  assert f.index["format_version"] == 3 and f.dense_formats().get(four_bit, 0) > 0
  again = model_lib.save(loaded, tmp_path / "again")
  assert ftw.FTWFile.open(again).dense_formats() == f.dense_formats()


def test_tied_embedding_is_quantised_with_the_head(tiny_config):
  """With tied embeddings the table is the lm_head: it takes the head's format, and the
  embedding's rows are gathered from it and dequantised.
  The prompt's logits agree with the dequantised model's to float32 rounding as this model
  amplifies it: the mxfp4 projections' kernels sum in another order than the float32 kernels
  of the dequantised weights (each to 1e-7 of float64, tests/kernels/test_dense_quantized.py),
  and this seed's scaled model turns such orders into differences of 1e-5 to 1e-3 of its
  logits. The dequantised model's own ffi and xla paths measure that spread here; the bound is
  F32 plus twice it (two float32 orders each differ from the exact sums by about the spread).
  Measured: 2.8e-5 against a spread of 3.2e-5 on a Xeon (f6m167), 7.9e-4 against 5.7e-4 on a
  Zen 5 (f26m2), where the bound of F32 plus one spread failed; the same with the fused
  kernels of before and after they gave each token its one-token sums."""
  config = dataclasses.replace(tiny_config, tie_word_embeddings=True)
  model = scaled_params(model_lib.random_model(config, seed=4), 8.0)
  q = model_lib.quantize_dense(model, "mixed4")
  table = model_lib.leaf(q, "embed_vd")
  assert isinstance(table, QuantizedMatrix) and table.format == "int8"
  prompts = np.random.default_rng(2).integers(0, config.vocab_size, (1, PROMPT))
  deq = model_lib.dequantize_dense(q)
  ref_logits, ref_tokens = _run(ftjax.Engine(deq, kernels="ffi"), prompts)
  xla_logits, _ = _run(ftjax.Engine(deq, kernels="xla"), prompts)
  logits, tokens = _run(ftjax.Engine(q, kernels="ffi"), prompts)
  np.testing.assert_array_equal(tokens, ref_tokens)
  scale = max(1.0, float(np.max(np.abs(ref_logits[0]))))
  spread = float(np.max(np.abs(xla_logits[0] - ref_logits[0])))
  error = float(np.max(np.abs(logits[0] - ref_logits[0])))
  assert error <= tolerances.F32 * scale + 2 * spread, (error, spread, scale)
  tolerances.assert_close(logits, ref_logits, tolerances.HF_PARITY, floor=1.0)  # as above


def test_quantised_dense_refusals(float_model):
  with pytest.raises(ValueError, match="dense_dtype must be one of"):
    model_lib.quantize_dense(float_model, "int3")
  q = model_lib.quantize_dense(float_model, "int8")
  with pytest.raises(ValueError, match="quantised already"):
    model_lib.quantize_dense(q, "int8")
  assert jax.tree.leaves(q.params)  # a pytree of arrays
