"""The bandwidth profiler: what it measures, its CLI, and how the engine reads a profile."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import ftjax
from ftjax.research.cost import HardwareProfile
from ftjax.runtime import model as model_lib
from ftjax.research import calibrate
from ftjax.runtime import profile as profile_lib

import tolerances


@pytest.fixture(scope="module")
def small_profile():
  shape = profile_lib.ExpertShape(hidden=64, ffn=32, dtype="bfloat16", top_k=2)
  bank = profile_lib.synthetic_bank(shape, min_bytes=4 << 20)
  return shape, bank, profile_lib.measure(bank, shape, rounds=2, calls=4, show_progress=False)


def test_measure_reports_every_bandwidth(small_profile):
  shape, bank, prof = small_profile
  assert bank.nbytes >= 4 << 20 and bank.shape[1] >= 4 * shape.top_k
  for key in ("read_gb_s", "b_h_gb_s", "b_p_gb_s"):
    assert prof[key] > 0 and len(prof["rounds"]) == 2
  assert prof["concurrent"]["b_h_gb_s"] > 0 and prof["concurrent"]["b_p_gb_s"] > 0
  assert prof["expert_shape"] == {"hidden": 64, "ffn": 32, "dtype": "bfloat16", "top_k": 2}
  assert prof["platform"] == "cpu" and prof["version"] == profile_lib.PROFILE_VERSION


def test_engine_reads_the_concurrent_pair(small_profile, tmp_path, tiny_config):
  shape, _, prof = small_profile
  path = profile_lib.save_profile(prof, str(tmp_path / "p.json"))
  model = model_lib.random_model(tiny_config, seed=0)
  with pytest.raises(ValueError, match="measured for expert_shape"):
    ftjax.Engine(model, cache_slots=2, profile=path)  # tiny_config's experts are 32x16
  c = tiny_config
  matching = dict(prof, expert_shape={"hidden": c.hidden_size, "ffn": c.moe_intermediate_size,
                                      "dtype": "float32", "top_k": c.top_k})
  path = profile_lib.save_profile(matching, str(tmp_path / "q.json"))
  engine = ftjax.Engine(model, cache_slots=2, profile=path)
  conc = prof["concurrent"]
  np.testing.assert_allclose(engine.bandwidths,
                             [conc["b_p_gb_s"], conc["b_p_gb_s"] + conc["b_h_gb_s"]],
                             rtol=tolerances.F32_ROUNDING)
  assert "concurrent" in engine.stats()["bandwidth_source"]
  with pytest.raises(FileNotFoundError, match="python -m ftjax.profile"):
    ftjax.Engine(model, cache_slots=2, profile=str(tmp_path / "missing.json"))


def test_cli_writes_a_profile(tmp_path):
  out = tmp_path / "prof.json"
  env = dict(os.environ, FTJAX_CACHE_DIR=str(tmp_path / "cache"))
  proc = subprocess.run([sys.executable, "-m", "ftjax.profile", "--hidden=64", "--ffn=32",
                         "--top_k=2", "--bank_gb=0.004", "--rounds=1", f"--out={out}",
                         "--tune_rounds=1"],
                        capture_output=True, text=True, check=False, cwd=tmp_path, env=env)
  assert proc.returncode == 0, proc.stderr
  assert "profile [" in proc.stderr and "tuning the kernels" in proc.stderr  # progress
  written = json.loads(out.read_text())
  assert "B_H" in proc.stdout and written["b_h_gb_s"] > 0
  # The kernels were tuned first (the shape raised to 1024 x 256), the file is where
  # --kernel_tuning=auto looks, and the bandwidths were measured with the chosen variant.
  tuned = list((tmp_path / "cache" / "kernel_tuning").glob("*.json"))
  assert len(tuned) == 1 and f"wrote {tuned[0]}" in proc.stdout
  record = json.loads(tuned[0].read_text())
  assert record["shapes"] == {"hidden": 1024, "ffn": 256, "top_k": 2}
  assert written["kernel_tuning"] == record["name"] and "kernel tuning (" in proc.stdout


def test_hardware_profile_takes_the_separate_measurements(small_profile):
  _, _, prof = small_profile
  hw = calibrate.hardware_profile(prof, "here", layer_overhead_s=1e-4, step_overhead_s=2e-4)
  assert (hw.b_p, hw.b_h, hw.device_bw) == (prof["b_p_gb_s"], prof["b_h_gb_s"], prof["read_gb_s"])
  assert (hw.layer_overhead_s, hw.step_overhead_s) == (1e-4, 2e-4) and hw.device_memory_gb > 0
  assert "CPU backend" in hw.source and prof["host"] in hw.source


def test_overheads_are_the_measured_time_the_bytes_do_not_explain(small_profile, tiny_config):
  _, _, prof = small_profile
  model = model_lib.random_model(tiny_config, seed=0)
  # Bandwidths of a real machine, not the ones measured at the 64x32 probe shape above (its
  # per-call overhead can make them so low that the model's bytes "take" longer than the step).
  hw = dataclasses.replace(calibrate.hardware_profile(prof, "here"), b_p=10.0, b_h=10.0,
                           device_bw=10.0)
  over = calibrate.measure_overheads(model, hw, tokens=3)
  assert over["steps"] == 3
  # At 10 GB/s the bytes of a model this small take microseconds; the step takes far longer.
  assert over["modeled_bytes_s"] < over["measured_forward_s"]
  assert over["raw_layer_overhead_s"] == pytest.approx(
      (over["measured_forward_s"] - over["modeled_bytes_s"]) / tiny_config.num_layers)
  assert over["layer_overhead_s"] == max(over["raw_layer_overhead_s"], 0.0)


def test_cli_writes_a_hardware_profile(tmp_path):
  out, hw_out = tmp_path / "prof.json", tmp_path / "hw" / "mine.yaml"
  proc = subprocess.run([sys.executable, "-m", "ftjax.profile", "--hidden=64", "--ffn=32",
                         "--top_k=2", "--bank_gb=0.004", "--rounds=1", f"--out={out}",
                         f"--hardware_out={hw_out}", "--name=mine", "--overhead_tokens=2",
                         "--notune_kernels"],
                        capture_output=True, text=True, check=False, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr
  hw = HardwareProfile.load(hw_out)
  prof = json.loads(out.read_text())
  assert hw.name == "mine" and hw.b_p == prof["b_p_gb_s"] and hw.device_bw == prof["read_gb_s"]
  # The calibrated overhead (clamped at 0): at this tiny shape the device loop's step is
  # within the noise of its modeled bytes, so its sign is not asserted here (the arithmetic
  # is, in test_overheads_are_the_measured_time_the_bytes_do_not_explain).
  assert hw.layer_overhead_s >= 0 and hw.step_overhead_s >= 0
  assert "calibrated from 2 cpu_only decode steps of a random 2-layer model" in hw.source
  assert f"wrote {hw_out}" in proc.stdout


def test_int8_expert_shape_and_synthetic_bank():
  """The profiler knows int8 experts' bytes (weights and float32 row scales) and builds an int8
  bank the host kernel reads: every block's scales are set."""
  from ftjax.kernels import expert_ffn  # noqa: PLC0415
  shape = profile_lib.ExpertShape(hidden=64, ffn=32, dtype="int8", top_k=2)
  assert shape.expert_bytes == 3 * 64 * 32 + 4 * (2 * 32 + 64)
  bank = np.asarray(profile_lib.synthetic_bank(shape, min_bytes=1 << 20))
  assert bank.dtype == np.int8 and bank.shape[2] % 4096 == 0 and bank.nbytes >= 1 << 20
  scales = bank[:, :, 3 * 64 * 32:3 * 64 * 32 + 4 * 128].view(np.float32)
  np.testing.assert_array_equal(scales, np.float32(0.02 / 127))
  x = np.ones((1, 64), np.float32)
  y = expert_ffn(x, np.array([[0, 1]], np.int32), np.full((1, 2), 0.5, np.float32), bank, 0,
                 ffn_dim=32)
  assert np.all(np.isfinite(np.asarray(y))) and np.any(np.asarray(y) != 0)


def test_mxfp4_expert_shape_and_synthetic_bank():
  """The profiler knows mxfp4 experts' bytes and builds an mxfp4 bank (finite scales, zero
  biases) that the host kernel runs with the gpt-oss variant it always needs."""
  from ftjax.kernels import ExpertVariant, expert_ffn  # noqa: PLC0415
  shape = profile_lib.ExpertShape(hidden=64, ffn=32, dtype="mxfp4", top_k=2)
  assert shape.expert_bytes == 3 * 64 * 32 // 2 + 3 * 64 + 4 * (2 * 32 + 64)
  bank = np.asarray(profile_lib.synthetic_bank(shape, min_bytes=1 << 20))
  assert bank.dtype == np.uint8 and bank.shape[2] % 4096 == 0 and bank.nbytes >= 1 << 20
  x = np.ones((1, 64), np.float32)
  y = expert_ffn(x, np.array([[0, 1]], np.int32), np.full((1, 2), 0.5, np.float32), bank, 0,
                 ffn_dim=32, variant=ExpertVariant("clamped_swiglu", bias=True))
  assert np.all(np.isfinite(np.asarray(y))) and np.any(np.asarray(y) != 0)


def test_int4_expert_shape_and_synthetic_bank():
  """The profiler knows int4 experts' bytes (codes, then each row's parameters) and builds an
  int4 bank (uint16 words) the host kernel reads: every row's steps finite."""
  from ftjax.kernels import expert_ffn  # noqa: PLC0415
  shape = profile_lib.ExpertShape(hidden=64, ffn=32, dtype="int4", top_k=2)
  assert shape.expert_bytes == 3 * 64 * 32 // 2 + (2 * 32 + 64) * 8 + 6 * 64 * 32 // 32
  bank = np.asarray(profile_lib.synthetic_bank(shape, min_bytes=1 << 20))
  assert bank.dtype == np.uint16 and (2 * bank.shape[2]) % 4096 == 0 and bank.nbytes >= 1 << 20
  x = np.ones((1, 64), np.float32)
  y = expert_ffn(x, np.array([[0, 1]], np.int32), np.full((1, 2), 0.5, np.float32), bank, 0,
                 ffn_dim=32)
  assert np.all(np.isfinite(np.asarray(y))) and np.any(np.asarray(y) != 0)


def test_mxfp4_calibration_model_decodes():
  """The profile CLI's calibration model for --dtype=mxfp4: gpt-oss experts (biases, clamped
  SwiGLU) quantised to mxfp4 in memory, each part the quantiser's, decoding on the host kernel."""
  from ftjax.research.calibrate import calibration_model  # noqa: PLC0415
  import ftjax  # noqa: PLC0415
  shape = profile_lib.ExpertShape(hidden=64, ffn=32, dtype="mxfp4", top_k=2)
  model = calibration_model(shape)
  assert model.expert_format == "mxfp4" and model.config.expert_bias
  assert model.expert_bytes == shape.expert_bytes
  float_model = calibration_model(profile_lib.ExpertShape(64, 32, "bfloat16", top_k=2))
  assert not float_model.config.expert_bias  # (bf16 calibration models keep the plain SwiGLU)
  tokens = ftjax.Engine(model, kernels="ffi", cache_slots=0, policy="cpu_only").generate(
      [1, 2, 3, 4], 3, greedy=True)
  assert len(tokens) == 3
