"""The Hugging Face converter: CLI, layouts, tokenizer copy, safety of --out, clear errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import ftjax
from ftjax.formats import ftw, hf
from ftjax.formats.safetensors import SafetensorsFile


def test_cli_converts_with_progress_and_copies_tokenizer(hf_checkpoints, tmp_path):
  _, src = hf_checkpoints["qwen3_moe"]  # fused experts, three shards
  with open(os.path.join(src, "tokenizer.json"), "w") as f:
    f.write("{}")
  try:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "ftjax.convert", f"--hf_dir={src}",
                           f"--out={out}", "--dtype=float32"], capture_output=True, text=True,
                          cwd=tmp_path, check=False)
  finally:
    os.remove(os.path.join(src, "tokenizer.json"))
  assert proc.returncode == 0, proc.stderr
  assert "convert [" in proc.stderr and "100.0%" in proc.stderr  # the progress bar
  assert os.path.isfile(out / "tokenizer.json")
  f = ftw.FTWFile.open(out)
  assert f.fingerprint == hf.fingerprint(src)
  assert f.index["source"]["hf_config"]["model_type"] == "qwen3_moe"


def test_expert_values_land_in_their_blocks(hf_checkpoints, tmp_path):
  model, src = hf_checkpoints["mixtral"]  # per-expert w1/w2/w3 keys
  out = ftjax.convert_hf(src, tmp_path / "m", dtype="float32", show_progress=False)
  f = ftw.FTWFile.open(out)
  experts = model.model.layers[1].mlp.experts
  f_dim = model.config.intermediate_size
  for e in (0, 5):
    gate_up = experts.gate_up_proj[e].detach().numpy()
    np.testing.assert_array_equal(f.expert_part(1, e, "gate"), gate_up[:f_dim])
    np.testing.assert_array_equal(f.expert_part(1, e, "up"), gate_up[f_dim:])
    np.testing.assert_array_equal(f.expert_part(1, e, "down"),
                                  experts.down_proj[e].detach().numpy())


def test_out_dir_is_never_clobbered(hf_checkpoints, tmp_path):
  _, src = hf_checkpoints["olmoe"]
  user_dir = tmp_path / "precious"
  user_dir.mkdir()
  (user_dir / "notes.txt").write_text("keep me")
  with pytest.raises(FileExistsError, match="not an FTW model"):
    ftjax.convert_hf(src, user_dir, show_progress=False)
  with pytest.raises(FileExistsError, match="not an FTW model"):
    ftjax.convert_hf(src, user_dir, overwrite=True, show_progress=False)
  assert (user_dir / "notes.txt").read_text() == "keep me"
  out = ftjax.convert_hf(src, tmp_path / "m", show_progress=False)
  with pytest.raises(FileExistsError, match="overwrite"):
    ftjax.convert_hf(src, out, show_progress=False)
  ftjax.convert_hf(src, out, overwrite=True, show_progress=False)
  assert [p for p in os.listdir(tmp_path) if "partial" in p] == []


def _clone(src, dst):
  os.makedirs(dst)
  for name in os.listdir(src):
    os.symlink(os.path.join(src, name), os.path.join(dst, name))
  return dst


def test_unexpected_tensor_is_an_error(hf_checkpoints, tmp_path):
  from safetensors.numpy import load_file, save_file  # noqa: PLC0415
  _, src = hf_checkpoints["mixtral"]
  dst = _clone(src, tmp_path / "hf")
  tensors = load_file(os.path.join(src, "model.safetensors"))
  tensors["model.layers.0.mystery.weight"] = np.zeros(3, np.float32)
  os.remove(dst / "model.safetensors")
  save_file(tensors, dst / "model.safetensors")
  with pytest.raises(hf.ConversionError, match="unexpected tensor model.layers.0.mystery"):
    ftjax.convert_hf(dst, tmp_path / "out", show_progress=False)
  assert not os.path.exists(tmp_path / "out")


def test_missing_tensor_is_an_error(hf_checkpoints, tmp_path):
  from safetensors.numpy import load_file, save_file  # noqa: PLC0415
  _, src = hf_checkpoints["mixtral"]
  dst = _clone(src, tmp_path / "hf")
  tensors = load_file(os.path.join(src, "model.safetensors"))
  del tensors["model.layers.1.self_attn.k_proj.weight"]
  del tensors["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
  os.remove(dst / "model.safetensors")
  save_file(tensors, dst / "model.safetensors")
  with pytest.raises(ValueError, match="never written|missing tensors"):
    ftjax.convert_hf(dst, tmp_path / "out", show_progress=False)


def test_no_weights_and_bad_paths(hf_checkpoints, tmp_path):
  with pytest.raises(FileNotFoundError, match="not a directory"):
    ftjax.convert_hf(tmp_path / "nope", tmp_path / "out")
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
  with pytest.raises(ValueError, match="lacks the required key 'num_hidden_layers'"):
    ftjax.convert_hf(tmp_path, tmp_path / "out")
  _, src = hf_checkpoints["mixtral"]
  (tmp_path / "config.json").write_text(open(os.path.join(src, "config.json")).read())
  with pytest.raises(ValueError, match="no safetensors weights"):
    ftjax.convert_hf(tmp_path, tmp_path / "out")


def test_unsupported_architecture(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
  proc = subprocess.run([sys.executable, "-m", "ftjax.convert", f"--hf_dir={tmp_path}",
                         f"--out={tmp_path / 'o'}"], capture_output=True, text=True, check=False)
  assert proc.returncode != 0
  assert "unsupported model_type 'llama'" in proc.stderr and "Traceback" not in proc.stderr


def test_hf_dir_is_converted_once_and_reconverted_when_changed(hf_checkpoints, tmp_path,
                                                               monkeypatch):
  monkeypatch.setenv("FTJAX_CACHE_DIR", str(tmp_path / "cache"))
  _, src = hf_checkpoints["qwen2_moe"]
  dst = tmp_path / "hf"
  _clone(src, dst)
  os.remove(dst / "config.json")
  with open(os.path.join(src, "config.json")) as f:
    cfg = json.load(f)
  (dst / "config.json").write_text(json.dumps(cfg))
  first = ftjax.load(dst)
  again = ftjax.load(dst)
  assert first.path == again.path and first.path.startswith(str(tmp_path / "cache"))
  assert os.listdir(tmp_path / "cache") == [os.path.basename(first.path)]
  cfg["rms_norm_eps"] = 1e-5  # an edited checkpoint must not reuse the stale conversion
  (dst / "config.json").write_text(json.dumps(cfg))
  third = ftjax.load(dst)
  assert third.path != first.path and third.config.rms_norm_eps == 1e-5


def test_truncated_safetensors_is_a_clear_error(hf_checkpoints, tmp_path):
  _, src = hf_checkpoints["mixtral"]
  data = open(os.path.join(src, "model.safetensors"), "rb").read()
  (tmp_path / "bad.safetensors").write_bytes(data[: len(data) - 100])
  with pytest.raises(ValueError, match="truncated"):
    SafetensorsFile(tmp_path / "bad.safetensors")
