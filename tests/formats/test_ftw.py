"""FTW: byte-exact round trip, zero-copy loading, and each documented load error."""

import filecmp
import json
import os
import shutil

import jax
import numpy as np
import pytest

import ftjax
from ftjax.formats import ftw
from ftjax.runtime import model as model_lib


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def saved(request, tiny_config, tmp_path_factory):
  model = model_lib.random_model(tiny_config, seed=3, dtype=request.param)
  path = model_lib.save(model, tmp_path_factory.mktemp("ftw") / "m",
                        source={"kind": "test", "fingerprint": "sha256:00"})
  return model, path


def test_round_trip_is_byte_exact(saved, tmp_path):
  model, path = saved
  loaded = ftjax.load(path)
  for name, value in model_lib.named_params(model).items():
    got = model_lib.named_params(loaded)[name]
    assert got.dtype == value.dtype and got.tobytes() == value.tobytes(), name
  assert np.asarray(loaded.bank).tobytes() == np.asarray(model.bank).tobytes()
  again = model_lib.save(loaded, tmp_path / "again")
  for name in (ftw.INDEX_NAME, ftw.DENSE_FILE, ftw.EXPERTS_FILE):
    assert filecmp.cmp(os.path.join(path, name), os.path.join(again, name), shallow=False), name


def test_layout_is_aligned_and_experts_contiguous(saved):
  model, path = saved
  f = ftw.FTWFile.open(path)
  for t in f.index["tensors"].values():
    assert t["offset"] % ftw.ALIGNMENT == 0
  ex = f.index["experts"]
  assert ex["block_bytes"] % ftw.ALIGNMENT == 0
  c = model.config
  bank = np.asarray(model.bank)
  fd = c.moe_intermediate_size * c.hidden_size
  np.testing.assert_array_equal(f.expert_part(1, 5, "down").reshape(-1), bank[1, 5, 2 * fd:3 * fd])
  np.testing.assert_array_equal(f.expert_part(0, 2, "up").reshape(-1), bank[0, 2, fd:2 * fd])


@pytest.mark.parametrize("load_mode", ["copy", "mmap"])
def test_cpu_load_is_zero_copy(saved, load_mode):
  _, path = saved
  loaded = ftjax.load(path, load_mode=load_mode)
  assert jax.default_backend() == "cpu"
  assert loaded.storage.residency == {"copy": "copied", "mmap": "mapped"}[load_mode]
  # The arrays view the storage's buffers (the copies, or the mapped files) without a copy.
  assert loaded.bank.unsafe_buffer_pointer() == loaded.storage.expert_bank().ctypes.data
  name = "layers.0.attn.w_q_had"
  assert (model_lib.leaf(loaded, name).unsafe_buffer_pointer()
          == loaded.storage.tensor(name).ctypes.data)
  assert not loaded.storage.expert_bank().flags.writeable


def test_load_modes_read_the_same_bytes(saved, monkeypatch):
  model, path = saved
  copied = ftjax.load(path, load_mode="copy")
  mapped = ftjax.load(path, load_mode="mmap")
  assert copied.storage.copy_s > 0 and mapped.storage.copy_s == 0
  for name, value in model_lib.named_params(mapped).items():
    assert model_lib.named_params(copied)[name].tobytes() == value.tobytes(), name
  assert np.asarray(copied.bank).tobytes() == np.asarray(mapped.bank).tobytes()
  assert model_lib.residency(copied).startswith("ftjax: copied the weights (")
  assert model_lib.residency(mapped).endswith("are mapped from their files")
  # auto copies when the copy and the files' cached pages take at most 80% of the memory
  # available, else maps them.
  assert ftjax.load(path).storage.residency == "copied"
  nbytes = mapped.storage.mapped_bytes()
  monkeypatch.setattr(model_lib, "available_host_bytes", lambda: nbytes)  # a machine that short
  assert not model_lib.fits_in_memory(nbytes) and model_lib.fits_in_memory(nbytes, 1.0)
  assert ftjax.load(path).storage.residency == "mapped"
  # Room for the copy alone, not beside the files' pages: mapped.
  monkeypatch.setattr(model_lib, "available_host_bytes", lambda: int(1.5 * nbytes / 0.8))
  assert model_lib.fits_in_memory(nbytes) and not model_lib.copy_fits(nbytes)
  assert ftjax.load(path).storage.residency == "mapped"
  monkeypatch.setattr(model_lib, "available_host_bytes", lambda: int(2.5 * nbytes / 0.8))
  assert ftjax.load(path).storage.residency == "copied"
  assert ftjax.load(path, load_mode="copy").storage.residency == "copied"
  with pytest.raises(ValueError, match="load_mode must be one of auto, copy, mmap, got 'ram'"):
    ftjax.load(path, load_mode="ram")


def test_a_copy_of_a_file_cut_short_is_an_error(tmp_path):
  p = tmp_path / "f.bin"
  p.write_bytes(bytes(range(256)) * 4)
  np.testing.assert_array_equal(ftw.read_into_memory(str(p), 1024),
                                np.frombuffer(p.read_bytes(), np.uint8))
  with pytest.raises(ftw.FTWTruncatedError, match="ended at byte 1024 while copying"):
    ftw.read_into_memory(str(p), 2048)


def _copy(path, tmp_path):
  dst = tmp_path / "copy"
  shutil.copytree(path, dst)
  return str(dst)


def _edit_index(path, fn):
  p = os.path.join(path, ftw.INDEX_NAME)
  with open(p) as f:
    index = json.load(f)
  fn(index)
  with open(p, "w") as f:
    json.dump(index, f)


@pytest.mark.parametrize("name", [ftw.DENSE_FILE, ftw.EXPERTS_FILE])
def test_truncated_file(saved, tmp_path, name):
  path = _copy(saved[1], tmp_path)
  with open(os.path.join(path, name), "r+b") as f:
    f.truncate(os.path.getsize(os.path.join(path, name)) - 1)
  with pytest.raises(ftw.FTWTruncatedError, match=f"{name}.*truncated"):
    ftjax.load(path)


def test_missing_file(saved, tmp_path):
  path = _copy(saved[1], tmp_path)
  os.remove(os.path.join(path, ftw.EXPERTS_FILE))
  with pytest.raises(ftw.FTWTruncatedError, match="missing"):
    ftjax.load(path)


def test_truncated_index(saved, tmp_path):
  path = _copy(saved[1], tmp_path)
  p = os.path.join(path, ftw.INDEX_NAME)
  data = open(p).read()
  with open(p, "w") as f:
    f.write(data[: len(data) // 2])
  with pytest.raises(ftw.FTWTruncatedError, match="not valid JSON"):
    ftjax.load(path)


@pytest.mark.parametrize("target", ["dense", "experts"])
def test_flipped_byte_fails_the_checksum(saved, tmp_path, target):
  path = _copy(saved[1], tmp_path)
  f = ftw.FTWFile.open(path)
  if target == "dense":
    t = f.index["tensors"]["layers.1.attn.w_k_gad"]
    offset, file, what = t["offset"] + 5, ftw.DENSE_FILE, "tensor layers.1.attn.w_k_gad"
  else:
    ex = f.index["experts"]
    offset = (1 * ex["num_experts"] + 3) * ex["block_bytes"] + 7
    file, what = ftw.EXPERTS_FILE, "the experts of layer 1"
  del f
  _flip_byte(path, file, offset)
  with pytest.raises(ftw.FTWChecksumError, match=f"checksum mismatch in {what}"):
    ftjax.load(path)
  ftjax.load(path, verify=False)  # opting out of verification still opens it


def _flip_byte(path, file, offset):
  with open(os.path.join(path, file), "r+b") as fh:
    fh.seek(offset)
    b = fh.read(1)
    fh.seek(offset)
    fh.write(bytes([b[0] ^ 0x40]))


def test_verify_once_skips_unchanged_files_and_catches_changed_ones(saved, tmp_path,
                                                                     monkeypatch):
  monkeypatch.setenv("FTJAX_CACHE_DIR", str(tmp_path / "cache"))
  monkeypatch.setattr(ftw, "_RACY_NS", 0)  # the copy is seconds old: stamp it all the same
  path = _copy(saved[1], tmp_path)
  assert ftw.FTWFile.open(path, verify="once").verification == "verified"
  again = ftw.FTWFile.open(path, verify="once")
  assert again.verification.startswith("verified before, unchanged since")
  assert ftw.FTWFile.open(path, verify=True).verification == "verified"
  assert ftw.FTWFile.open(path, verify=False).verification == "not verified"
  # A changed byte changes the file's times, even where its mtime is put back: checked again.
  ex = again.index["experts"]
  st = os.stat(os.path.join(path, ftw.EXPERTS_FILE))
  del again
  _flip_byte(path, ftw.EXPERTS_FILE, ex["num_experts"] * ex["block_bytes"] + 11)
  os.utime(os.path.join(path, ftw.EXPERTS_FILE), ns=(st.st_atime_ns, st.st_mtime_ns))
  with pytest.raises(ftw.FTWChecksumError, match="checksum mismatch in the experts of layer 1"):
    ftjax.load(path)  # verify="once" by default
  with pytest.raises(ValueError, match="verify must be True, False or 'once'"):
    ftw.FTWFile.open(path, verify="sometimes")


def test_files_changed_seconds_ago_get_no_verified_stamp(saved, tmp_path, monkeypatch):
  monkeypatch.setenv("FTJAX_CACHE_DIR", str(tmp_path / "cache"))
  path = _copy(saved[1], tmp_path)  # just written: within the file system's racy window
  assert ftw.FTWFile.open(path, verify="once").verification == "verified"
  assert ftw.FTWFile.open(path, verify="once").verification == "verified"
  assert not os.path.exists(tmp_path / "cache" / "verified")


def test_newer_format_version(saved, tmp_path):
  path = _copy(saved[1], tmp_path)
  _edit_index(path, lambda i: i.update(format_version=ftw.FORMAT_VERSION + 1))
  with pytest.raises(ftw.FTWVersionError, match="newer than"):
    ftjax.load(path)


def test_config_mismatch(saved, tmp_path):
  path = _copy(saved[1], tmp_path)
  _edit_index(path, lambda i: i["model_config"].update(moe_intermediate_size=8))
  with pytest.raises(ftw.FTWConfigMismatchError, match="ffn_dim"):
    ftjax.load(path)


def test_config_mismatch_in_dense_shapes(saved, tmp_path):
  path = _copy(saved[1], tmp_path)
  _edit_index(path, lambda i: i["model_config"].update(num_heads=2, num_kv_heads=1))
  with pytest.raises(ftw.FTWConfigMismatchError, match=r"parameter layers\.0\.attn\.w_[qk]_"):
    ftjax.load(path)


def test_not_an_ftw_directory(tmp_path):
  with pytest.raises(FileNotFoundError, match="neither an FTW directory"):
    ftjax.load(tmp_path)
  with pytest.raises(FileNotFoundError, match="does not exist"):
    ftjax.load(tmp_path / "nope")


def test_bfloat16_storage_rounds_to_nearest_even(tiny_config, tmp_path):
  import ml_dtypes  # noqa: PLC0415
  model = model_lib.random_model(tiny_config, seed=4, dtype="float32")
  path = model_lib.save(model, tmp_path / "bf16", dtype="bfloat16")
  loaded = ftjax.load(path)
  for name, value in model_lib.named_params(model).items():
    assert model_lib.named_params(loaded)[name].tobytes() == value.astype(
        ml_dtypes.bfloat16).tobytes(), name
  assert np.asarray(loaded.bank).tobytes() == np.asarray(model.bank).astype(
      ml_dtypes.bfloat16).tobytes()


def test_populate_touches_every_page(saved):
  _, path = saved
  f = ftw.FTWFile.open(path, verify=False)
  assert f.populate() == sum(f.index["files"].values())
  assert ftjax.load(path, verify=False, populate=True).config == f.config
