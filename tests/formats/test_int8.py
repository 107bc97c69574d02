"""The FTW expert format int8 (docs/ftw.md): converter round trip against a quantiser written
here from the spec, the CLI flag, the layout, version 1 files, unknown formats, checksums."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import ftjax
from ftjax.formats import ftw
from ftjax.runtime import model as model_lib

from conftest import flip_bit


def spec_quantise(w):
  """Row by row, as docs/ftw.md says: float32 w, s = max|w| / 127 in float32, q = w / s rounded
  half to even (s = 0, q = 0 for a zero row)."""
  w = np.asarray(w, np.float32)
  q = np.zeros(w.shape, np.int8)
  s = np.zeros(w.shape[0], np.float32)
  for r, row in enumerate(w):
    s[r] = np.float32(np.max(np.abs(row))) / np.float32(127)
    if s[r] > 0:
      q[r] = np.round(row / s[r]).astype(np.int8)
  return q, s


@pytest.fixture(scope="module")
def converted(hf_checkpoints, tmp_path_factory):
  """family -> (torch model, int8 FTW path, float32 FTW path) for a fused and a per-expert
  layout."""
  out = {}
  for family in ("qwen3_moe", "mixtral"):
    model, src = hf_checkpoints[family]
    tmp = tmp_path_factory.mktemp(family)
    int8 = ftjax.convert_hf(src, tmp / "int8", dtype="float32", expert_dtype="int8",
                            show_progress=False)
    f32 = ftjax.convert_hf(src, tmp / "f32", dtype="float32", show_progress=False)
    out[family] = (model, int8, f32)
  return out


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_converted_experts_equal_the_spec_quantisation(converted, family):
  torch_model, int8_path, f32_path = converted[family]
  q8, f32 = ftw.FTWFile.open(int8_path), ftw.FTWFile.open(f32_path)
  assert q8.expert_format == "int8" and q8.index["format_version"] == ftw.FORMAT_VERSION
  c = q8.config
  assert q8.expert_bank().dtype == np.int8
  for layer in range(c.num_moe_layers):
    for expert in range(c.num_experts):
      for part in ("gate", "up", "down"):
        q, s = spec_quantise(f32.expert_part(layer, expert, part))
        np.testing.assert_array_equal(q8.expert_part(layer, expert, part), q)
        np.testing.assert_array_equal(q8.expert_scale(layer, expert, part), s)
  # spot-check against the torch tensors themselves (not through the float conversion)
  experts = torch_model.model.layers[1].mlp.experts
  q, s = spec_quantise(experts.down_proj[3].detach().float().numpy())
  np.testing.assert_array_equal(q8.expert_part(1, 3, "down"), q)
  np.testing.assert_array_equal(q8.expert_scale(1, 3, "down"), s)
  # the dense tensors are the float conversion's, byte for byte
  for name in f32.tensor_names():
    assert q8.tensor(name).tobytes() == f32.tensor(name).tobytes(), name


def test_loaded_int8_model_dequantises_to_the_spec(converted):
  _, int8_path, f32_path = converted["qwen3_moe"]
  model, f32 = ftjax.load(int8_path), ftw.FTWFile.open(f32_path)
  c = model.config
  assert model.expert_format == "int8" and model.dtype == np.float32
  F, D = c.moe_intermediate_size, c.hidden_size
  bank = np.asarray(model.bank)
  assert bank.dtype == np.int8 and bank.shape[2] % ftw.ALIGNMENT == 0
  scales_at = -(-3 * F * D // 64) * 64  # the layout of docs/ftw.md, by hand
  for layer, expert in [(0, 0), (1, c.num_experts - 1)]:
    block = bank[layer, expert]
    scales = block[scales_at:scales_at + 4 * (2 * F + D)].view("<f4")
    gate = block[:F * D].reshape(F, D).astype(np.float64) * scales[:F, None]
    down = block[2 * F * D:3 * F * D].reshape(D, F).astype(np.float64) * scales[2 * F:, None]
    for got, part in [(gate, "gate"), (down, "down")]:
      q, s = spec_quantise(f32.expert_part(layer, expert, part))
      np.testing.assert_array_equal(got, q.astype(np.float64) * s[:, None])
    assert not block[scales_at + 4 * (2 * F + D):].any()  # zero padding


def test_cli_expert_dtype_int8(hf_checkpoints, converted, tmp_path):
  _, src = hf_checkpoints["mixtral"]
  out = tmp_path / "cli"
  proc = subprocess.run([sys.executable, "-m", "ftjax.convert", f"--hf_dir={src}", f"--out={out}",
                         "--dtype=float32", "--expert_dtype=int8"], capture_output=True,
                        text=True, cwd=tmp_path, check=False)
  assert proc.returncode == 0, proc.stderr
  with open(out / ftw.EXPERTS_FILE, "rb") as a, open(
      os.path.join(converted["mixtral"][1], ftw.EXPERTS_FILE), "rb") as b:
    assert a.read() == b.read()


def test_int8_model_saves_and_loads_byte_exact(converted, tmp_path):
  model = ftjax.load(converted["qwen3_moe"][1])
  again = model_lib.save(model, tmp_path / "again")
  with open(os.path.join(converted["qwen3_moe"][1], ftw.EXPERTS_FILE), "rb") as a, open(
      os.path.join(again, ftw.EXPERTS_FILE), "rb") as b:
    assert a.read() == b.read()
  reloaded = ftjax.load(again)  # dense tensors in another order, same bytes
  for name, value in model_lib.named_params(model).items():
    assert model_lib.named_params(reloaded)[name].tobytes() == value.tobytes(), name
  with pytest.raises(ValueError, match="cannot be saved as float32"):
    model_lib.save(model, tmp_path / "back", expert_format="float32")


def _copy_and_edit(path, tmp_path, edit):
  dst = tmp_path / "copy"
  shutil.copytree(path, dst)
  p = dst / ftw.INDEX_NAME
  index = json.loads(p.read_text())
  edit(index)
  p.write_text(json.dumps(index))
  return dst


def test_unknown_expert_format_is_a_clear_error(converted, tmp_path):
  path = _copy_and_edit(converted["qwen3_moe"][1], tmp_path,
                        lambda i: i["experts"].update(format="int3"))
  with pytest.raises(ftw.FTWVersionError, match="format 'int3', which this ftjax does not know"):
    ftjax.load(path)


def test_version_1_files_still_load():
  """The embedded default model was written as FTW version 1 (no experts.format)."""
  f = ftw.FTWFile.open(ftjax.runtime.model.EMBEDDED_MODELS["default"], verify=False)
  assert f.index["format_version"] == 1 and "format" not in json.load(
      open(os.path.join(f.path, ftw.INDEX_NAME)))["experts"]
  assert f.expert_format == f.index["dtype"]
  assert ftjax.load("default", verify=False).expert_format == f.expert_format


def test_flipped_scale_byte_fails_the_checksum(converted, tmp_path):
  path = tmp_path / "flip"
  shutil.copytree(converted["qwen3_moe"][1], path)
  f = ftw.FTWFile.open(path)
  ex = f.index["experts"]
  offset = (1 * ex["num_experts"] + 2) * ex["block_bytes"] + ex["scales"][1]["offset"] + 1
  del f
  flip_bit(path / ftw.EXPERTS_FILE, offset)
  with pytest.raises(ftw.FTWChecksumError, match="experts of layer 1"):
    ftjax.load(path)
