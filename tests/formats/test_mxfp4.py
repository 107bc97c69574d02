"""The FTW expert format mxfp4 (docs/ftw.md): the converted layout read back against the
checkpoint's tensors (codes, scales, biases at the documented offsets), save/load byte exact,
the checksums covering scales and biases, the writer's and converter's errors."""

import dataclasses
import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

import ftjax
from ftjax.formats import ftw
from ftjax.formats.hf import ConversionError
from ftjax.runtime import model as model_lib
from ftjax.utils import quant

from conftest import build_gpt_oss_model, flip_bit, save_hf_checkpoint


@pytest.fixture(scope="module")
def converted(gpt_oss_mxfp4_checkpoint, tmp_path_factory):
  """(checkpoint tensors, mxfp4 FTW path) of the tiny gpt-oss MXFP4 checkpoint."""
  path = gpt_oss_mxfp4_checkpoint[1]
  out = ftjax.convert_hf(path, tmp_path_factory.mktemp("mxfp4") / "ftw", dtype="bfloat16",
                         show_progress=False)
  return load_file(os.path.join(path, "model.safetensors")), out


def align64(n):
  return -(-n // 64) * 64


def test_block_layout_is_the_documented_one(converted):
  """Bytes at the offsets docs/ftw.md gives, computed here: codes (gate = even rows of
  gate_up, up = odd rows), scales, float32 biases, zero padding; every (layer, expert)."""
  tensors, path = converted
  f = ftw.FTWFile.open(path)
  c = f.config
  F, D = c.moe_intermediate_size, c.hidden_size
  ex = f.index["experts"]
  assert f.expert_format == "mxfp4" and ex["dtype"] == "uint8" and f.index["format_version"] == ftw.FORMAT_VERSION
  S = align64(3 * F * D // 2)
  B = S + align64(3 * F * D // 32)
  assert ex["block_bytes"] == ftw.align(B + 4 * (2 * F + D))
  bank = f.expert_bank()
  assert bank.dtype == np.uint8
  for layer in range(c.num_moe_layers):
    prefix = f"model.layers.{layer}.mlp.experts."
    gate_up = tensors[prefix + "gate_up_proj_blocks"].reshape(c.num_experts, 2 * F, D // 2)
    gate_up_scales = tensors[prefix + "gate_up_proj_scales"]
    down = tensors[prefix + "down_proj_blocks"].reshape(c.num_experts, D, F // 2)
    down_scales = tensors[prefix + "down_proj_scales"]
    gate_up_bias = tensors[prefix + "gate_up_proj_bias"].astype(np.float32)
    down_bias = tensors[prefix + "down_proj_bias"].astype(np.float32)
    for e in range(c.num_experts):
      block = bank[layer, e]
      want = np.concatenate([
          gate_up[e, 0::2].ravel(), gate_up[e, 1::2].ravel(), down[e].ravel(),
          np.zeros(S - 3 * F * D // 2, np.uint8),
          gate_up_scales[e, 0::2].ravel(), gate_up_scales[e, 1::2].ravel(), down_scales[e].ravel(),
          np.zeros(B - S - 3 * F * D // 32, np.uint8),
          np.ascontiguousarray(gate_up_bias[e, 0::2]).view(np.uint8),
          np.ascontiguousarray(gate_up_bias[e, 1::2]).view(np.uint8),
          down_bias[e].view(np.uint8)])
      np.testing.assert_array_equal(block[:len(want)], want)
      assert not block[len(want):].any()


def test_saves_and_loads_byte_exact(converted, tmp_path):
  _, path = converted
  model = ftjax.load(path)
  out = model_lib.save(model, tmp_path / "again")
  again = ftjax.load(out)
  assert again.expert_format == "mxfp4" and again.dtype == np.dtype("bfloat16")
  np.testing.assert_array_equal(np.asarray(again.bank), np.asarray(model.bank))
  with pytest.raises(ValueError, match="cannot be saved as int8"):
    model_lib.save(model, tmp_path / "int8", expert_format="int8")


@pytest.mark.parametrize("part", ["scales", "biases"])
def test_flipped_scale_or_bias_byte_fails_the_checksum(converted, tmp_path, part):
  path = tmp_path / "flip"
  shutil.copytree(converted[1], path)
  with open(path / ftw.INDEX_NAME) as fh:
    ex = json.load(fh)["experts"]
  inside = (ex["scales"][2]["offset"] if part == "scales"
            else next(p for p in ex["parts"] if p["name"] == "up_bias")["offset"])
  offset = (1 * ex["num_experts"] + 2) * ex["block_bytes"] + inside + 1
  flip_bit(path / ftw.EXPERTS_FILE, offset)
  with pytest.raises(ftw.FTWChecksumError, match="experts of layer 1"):
    ftjax.load(path)


def test_writer_errors(converted, tmp_path):
  _, path = converted
  config = ftw.FTWFile.open(path).config
  F, D = config.moe_intermediate_size, config.hidden_size
  writer = ftw.FTWWriter(tmp_path / "w", config, "float32", {}, expert_format="mxfp4")
  codes = np.zeros((F, D // 2), np.uint8)
  with pytest.raises(ftw.FTWError, match="takes each weight as uint8 E2M1 codes"):
    writer.add_expert_part(0, 0, "gate", codes)  # codes without their scales
  with pytest.raises(ftw.FTWError, match="got float32 .* with scales"):
    writer.add_expert_part(0, 0, "gate", np.zeros((F, D), np.float32),
                           np.zeros((F, D // 32), np.uint8))
  with pytest.raises(ftw.FTWConfigMismatchError, match="do not match the config's"):
    writer.add_expert_part(0, 0, "gate", codes, np.zeros((F, D // 16), np.uint8))
  with pytest.raises(ftw.FTWError, match="E8M0 scale of 255"):
    writer.add_expert_part(0, 0, "gate", codes, np.full((F, D // 32), 255, np.uint8))
  # a family without expert biases: blocks end after the scales (FTW version 3)
  plain = ftw.FTWWriter(tmp_path / "q", dataclasses.replace(config, expert_bias=False),
                        "float32", {}, expert_format="mxfp4")
  assert plain.block_bytes == ftw.align(quant.mxfp4_block_bytes(F, D, bias=False))
  assert plain.parts == ftw.EXPERT_PARTS


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def spec_quantise(w):
  """Block by block and element by element, as docs/ftw.md says: k the smallest integer with
  max|w| / 2^k <= 6 (0 for a zero block), each w / 2^k to the nearest E2M1 magnitude, a tie to
  the even code; the sign in bit 3 (none for a zero). Returns codes [R, C/2], scales [R, C/32]."""
  w = np.asarray(w, np.float64)
  rows, cols = w.shape
  codes = np.zeros((rows, cols), np.uint8)
  scales = np.zeros((rows, cols // 32), np.uint8)
  for r in range(rows):
    for b in range(cols // 32):
      block = w[r, 32 * b:32 * b + 32]
      largest = np.max(np.abs(block))
      k = 0
      if largest > 0:
        k = -127
        while largest / 2.0 ** k > 6:
          k += 1
      scales[r, b] = k + 127
      for j, v in enumerate(block):
        m = abs(v) / 2.0 ** k
        best = min(range(8), key=lambda c: (abs(E2M1[c] - m), c % 2))
        codes[r, 32 * b + j] = best + (8 if v < 0 and best > 0 else 0)
  return codes[:, 0::2] | (codes[:, 1::2] << 4), scales


def test_quantisation_equals_the_spec():
  """quant.quantize_mxfp4 on normal weights, exact ties (each midpoint, both signs), a zero
  block and a block whose maximum is exactly 6 · 2^k."""
  rng = np.random.default_rng(0)
  w = (0.02 * rng.standard_normal((6, 96))).astype(np.float32)
  w[0, :32] = 0
  w[1, :32] = 0.75 * 2.0 ** -3  # all ties between 0.5 and 1 once scaled (max 0.75 -> k = -3)
  w[1, 0] = 6 * 2.0 ** -3
  mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]) * 2.0 ** -4
  w[2, 32:48] = np.concatenate([mids, -mids])
  w[2, 48:64] = 0
  codes, scales = quant.quantize_mxfp4(w)
  want_codes, want_scales = spec_quantise(w)
  np.testing.assert_array_equal(scales, want_scales)
  np.testing.assert_array_equal(codes, want_codes)
  assert scales[0, 0] == 127 and scales[1, 0] == 124


def test_bank_quantisation_equals_the_spec():
  """quant.quantize_mxfp4_bank (Model quantisation, the profiler's calibration model): each
  block's parts are the spec's codes and scales at the documented offsets, biases float32."""
  F, D = 32, 64
  rng = np.random.default_rng(1)
  bank = (0.05 * rng.standard_normal((2, 3, 3 * F * D + 2 * F + D + 7))).astype(np.float32)
  out = quant.quantize_mxfp4_bank(bank, F, D)
  assert out.dtype == np.uint8 and out.shape[-1] % 64 == 0
  S = align64(3 * F * D // 2)
  B = S + align64(3 * F * D // 32)
  block, got = bank[1, 2], out[1, 2]
  for part, (start, rows, cols) in enumerate(((0, F, D), (F * D, F, D), (2 * F * D, D, F))):
    codes, scales = spec_quantise(block[start:start + F * D].reshape(rows, cols))
    np.testing.assert_array_equal(got[part * F * D // 2:(part + 1) * F * D // 2], codes.ravel())
    np.testing.assert_array_equal(got[S + part * F * D // 32:S + (part + 1) * F * D // 32],
                                  scales.ravel())
  np.testing.assert_array_equal(got[B:B + 4 * (2 * F + D)].view(np.float32),
                                block[3 * F * D:3 * F * D + 2 * F + D])


def test_float_experts_quantised_to_mxfp4(tmp_path):
  """--expert_dtype=mxfp4 from a float gpt-oss checkpoint (F = 32): every weight part is the
  spec quantisation of the checkpoint's, biases float32; the F = 24 model is refused clearly."""
  hf_model = build_gpt_oss_model(seed=2, intermediate_size=32)
  path = save_hf_checkpoint(hf_model, str(tmp_path / "hf"))
  out = ftjax.convert_hf(path, tmp_path / "ftw", dtype="float32", expert_dtype="mxfp4",
                         show_progress=False)
  f = ftw.FTWFile.open(out)
  assert f.expert_format == "mxfp4"
  experts = hf_model.model.layers[1].mlp.experts
  gate_up = experts.gate_up_proj.detach().numpy()[4]  # [D, 2F], gate in the even columns
  down = experts.down_proj.detach().numpy()[4]  # [F, D]
  for part, weight in (("gate", gate_up[:, 0::2].T), ("up", gate_up[:, 1::2].T),
                       ("down", down.T)):
    codes, scales = spec_quantise(weight)
    np.testing.assert_array_equal(f.expert_part(1, 4, part), codes)
    np.testing.assert_array_equal(f.expert_scale(1, 4, part), scales)
  np.testing.assert_array_equal(f.expert_part(1, 4, "up_bias"),
                                experts.gate_up_proj_bias.detach().numpy()[4, 1::2])
  with pytest.raises(ValueError, match="multiples of 32"):
    small = save_hf_checkpoint(build_gpt_oss_model(), str(tmp_path / "hf24"))
    ftjax.convert_hf(small, tmp_path / "ftw24", expert_dtype="mxfp4", show_progress=False)
  assert not os.path.exists(tmp_path / "ftw24")


def test_expanding_mxfp4_is_refused(gpt_oss_mxfp4_checkpoint, tmp_path):
  """An MXFP4 checkpoint is kept as shipped: asking for float experts names the way to get them."""
  with pytest.raises(ConversionError, match="ships MXFP4 experts, which are kept as they are"):
    ftjax.convert_hf(gpt_oss_mxfp4_checkpoint[1], tmp_path / "ftw", expert_dtype="bfloat16",
                     show_progress=False)
  assert not os.path.exists(tmp_path / "ftw")
