"""The FTW int4 expert format and int4 dense weights (docs/ftw.md): the converter (a fused and a
per-expert layout, the CLI) against the quantiser applied to the float conversion's weights, the
layout read by hand, save and load byte for byte, a converted model's logits against the
transformers model, and the refusals."""

import os
import subprocess
import sys

import numpy as np
import pytest

import ftjax
from ftjax.formats import ftw
from ftjax.kernels import dense
from ftjax.runtime import model as model_lib
from ftjax.utils import quant
from ftjax.utils.dense_quant import QuantizedMatrix

import reference
from conftest import HF_FAMILIES, _COMMON, _hf_classes, save_hf_checkpoint

# The experts' width must be a multiple of 32 (the blocks): conftest's models have 16.
WIDER = {"qwen3_moe": dict(moe_intermediate_size=32), "mixtral": dict(intermediate_size=32)}


def build_wider(family, seed=0):
  import torch  # noqa: PLC0415
  torch.manual_seed(seed)
  config_cls, model_cls = _hf_classes(family)
  model = model_cls(config_cls(**_COMMON, **{**HF_FAMILIES[family], **WIDER[family]}))
  model = model.eval().to(torch.float32)
  model.config._attn_implementation = "eager"
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
  return model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """family -> (torch model, int4 FTW path (experts int4, dense mixed_int4), float32 FTW, the
  checkpoint), for a fused (qwen3_moe) and a per-expert (mixtral) layout."""
  out = {}
  for family, layout in (("qwen3_moe", dict(fused=True, shards=2)), ("mixtral", dict())):
    model = build_wider(family)
    tmp = tmp_path_factory.mktemp(family)
    src = save_hf_checkpoint(model, str(tmp / "hf"), **layout)
    int4 = ftjax.convert_hf(src, tmp / "int4", dtype="float32", expert_dtype="int4",
                            dense_dtype="mixed_int4", show_progress=False)
    f32 = ftjax.convert_hf(src, tmp / "f32", dtype="float32", show_progress=False)
    out[family] = (model, int4, f32, src)
  return out


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_converted_experts_are_the_quantisation_of_the_floats(converted, family):
  _, int4_path, f32_path, _ = converted[family]
  q4, f32 = ftw.FTWFile.open(int4_path), ftw.FTWFile.open(f32_path)
  assert q4.expert_format == "int4" and q4.expert_bank().dtype == np.uint16
  c = q4.config
  F, D = c.moe_intermediate_size, c.hidden_size
  bank = q4.expert_bank()
  for layer in range(c.num_moe_layers):
    for expert in range(c.num_experts):
      by_hand = reference.int4_parts(bank[layer, expert], F, D)
      for i, part in enumerate(("gate", "up", "down")):
        codes, params = quant.quantize_int4(f32.expert_part(layer, expert, part))
        np.testing.assert_array_equal(q4.expert_part(layer, expert, part), codes)
        np.testing.assert_array_equal(q4.expert_scale(layer, expert, part), params)
        np.testing.assert_array_equal(by_hand[i], quant.dequantize_int4(codes, params))
  formats = q4.dense_formats()
  assert formats.get("int4", 0) > 0 and formats.get("int8", 0) > 0, formats


def test_int4_model_logits_follow_the_float_model(converted):
  """The converted int4 model (ffi kernels) against the transformers model of the float
  weights: not exact (4 bits), but close, and the same as its own dequantisation."""
  torch_model, int4_path, _, _ = converted["qwen3_moe"]
  model = ftjax.load(int4_path)
  prompt = np.arange(1, 9, dtype=np.int32)[None] % model.config.vocab_size
  got = ftjax.Engine(model, kernels="ffi").forward_logits(prompt)
  deq = model_lib.dequantize_dense(model)
  c = model.config
  bank = np.asarray(model.bank)
  deq_bank = np.stack([np.stack([np.concatenate([p.reshape(-1) for p in reference.split_block(
      block, c.moe_intermediate_size, c.hidden_size)]) for block in layer]) for layer in bank])
  import dataclasses  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  ref = ftjax.Engine(dataclasses.replace(deq, bank=jnp.asarray(deq_bank.astype(np.float32))),
                     kernels="ffi").forward_logits(prompt)
  np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
  import torch  # noqa: PLC0415
  with torch.no_grad():
    hf = torch_model(torch.as_tensor(prompt, dtype=torch.long)).logits.float().numpy()
  error = np.abs(got - hf).max() / np.abs(hf).max()
  assert 1e-5 < error < 0.2, error


def test_cli_and_save_load_byte_exact(converted, tmp_path):
  src = converted["mixtral"][3]
  out = tmp_path / "cli"
  proc = subprocess.run([sys.executable, "-m", "ftjax.convert", f"--hf_dir={src}", f"--out={out}",
                         "--dtype=float32", "--expert_dtype=int4", "--dense_dtype=mixed_int4"],
                        capture_output=True, text=True, cwd=tmp_path, check=False)
  assert proc.returncode == 0, proc.stderr
  with open(out / ftw.EXPERTS_FILE, "rb") as a, open(
      os.path.join(converted["mixtral"][1], ftw.EXPERTS_FILE), "rb") as b:
    assert a.read() == b.read()
  model = ftjax.load(converted["qwen3_moe"][1], verify=True)
  assert model.expert_format == "int4"
  again = model_lib.save(model, tmp_path / "again")
  with open(os.path.join(converted["qwen3_moe"][1], ftw.EXPERTS_FILE), "rb") as a, open(
      os.path.join(again, ftw.EXPERTS_FILE), "rb") as b:
    assert a.read() == b.read()
  reloaded = ftjax.load(again)
  for name, value in model_lib.named_params(model).items():
    other = model_lib.named_params(reloaded)[name]
    if isinstance(value, QuantizedMatrix):
      assert other.format == value.format and other.data.tobytes() == value.data.tobytes()
      assert other.scales.tobytes() == value.scales.tobytes(), name
    else:
      assert other.tobytes() == value.tobytes(), name
  with pytest.raises(ValueError, match="cannot be saved as float32"):
    model_lib.save(model, tmp_path / "back", expert_format="float32")


def test_int4_refusals(tiny_config):
  import dataclasses  # noqa: PLC0415
  with pytest.raises(ValueError, match="multiples of 32"):
    model_lib.quantize_experts(model_lib.random_model(
        dataclasses.replace(tiny_config, moe_intermediate_size=24), seed=0), "int4")
  with pytest.raises(ValueError, match="not finite"):
    quant.quantize_int4(np.full((2, 32), np.inf, np.float32))


def test_native_quantiser_agrees_with_the_numpy_reference():
  """quantize_int4 runs in C++ (xla_ffi/quantize_int4.cc, installed by the kernels layer); the
  numpy form is the reference.
  Their float32 sums differ in order, so a near-tie between two cuts may go the other way: on
  512 x 2048 weights of varied scale, measured 99.997% of the codes and 99.95% of the parameter
  bytes equal, the squared error the same to 1e-5. The result does not depend on the threads."""
  native = quant.native_int4_quantiser()
  assert native is not None, "import ftjax installs the C++ quantiser"
  rng = np.random.default_rng(11)
  w = (rng.standard_normal((256, 1024)) * np.exp(rng.standard_normal((256, 1)))).astype(
      np.float32)
  codes, params = quant.quantize_int4(w)
  ref_codes, ref_params = quant.quantize_int4(w, reference=True)
  assert np.mean(codes == ref_codes) > 0.999
  assert np.mean(params == ref_params) > 0.995
  err = np.mean((quant.dequantize_int4(codes, params) - w) ** 2)
  ref_err = np.mean((quant.dequantize_int4(ref_codes, ref_params) - w) ** 2)
  assert abs(err / ref_err - 1) < 1e-3, (err, ref_err)
  one = (np.empty_like(codes), np.empty_like(params))
  native(w, *one, 1)
  np.testing.assert_array_equal(one[0], codes)
  np.testing.assert_array_equal(one[1], params)


@pytest.mark.parametrize("reference", [False, True], ids=["native", "numpy"])
def test_all_zero_blocks_store_zero_scales(reference):
  """An all-zero block stores s = m = 0 and codes 0 (C++ and numpy alike), so that it decodes
  to exact zeros and the one-token kernels, which centre the codes (q - 8) and add 8·d·s to a
  block's offset, add exactly nothing for it: an all-zero row gives exact zeros on every input
  (with s = 255 its two sums were ~8·d·255·Σx each and left 5e-5 behind)."""
  rng = np.random.default_rng(5)
  w = rng.standard_normal((6, 256)).astype(np.float32)
  w[0] = 0.0
  w[1, 64:96] = 0.0
  codes, params = quant.quantize_int4(w, reference=reference)
  _, _, s, m = quant.int4_parts(params)
  assert np.all(s[0] == 0) and np.all(m[0] == 0) and np.all(codes[0] == 0)
  assert s[1, 2] == 0 and m[1, 2] == 0 and np.all(codes[1, 32:48] == 0)
  assert np.all(s[1:, [0, 1, 3]] >= 1)
  assert np.all(quant.dequantize_int4(codes, params)[[0], :] == 0)
  q = QuantizedMatrix(codes, params, "int4", w.shape, 1)
  x = rng.standard_normal((1, 256)).astype(np.float32) * 100
  assert np.all(np.asarray(dense(x, q))[0, 0] == 0)
