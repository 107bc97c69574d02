"""Kernel tuning (ftjax.kernels.tuning, KernelTuning in xla_ffi/cpu_kernels.h): every variant a
tuning can choose is exact against float64 on every ISA; the tuning file; the engine's modes."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ftjax
from ftjax.kernels import dense, expert_ffn, tuning
from ftjax.kernels.cpu_info import last_level_cache_bytes
from ftjax.kernels.expert_ffn import ExpertVariant
from ftjax.runtime import model as model_lib

import reference
import tolerances
from expert_cases import make_mxfp4_bank, make_routes, rng_for

BF16 = np.dtype(jnp.bfloat16)
GPT_OSS = ExpertVariant(activation="clamped_swiglu", alpha=1.702, limit=7.0, bias=True)
# (tokens, inputs, rows): one token (a GEMV, rows past a task, inputs past the prefetch
# distance and odd ones), and 2-8 tokens (register blocks of every row count, with tails).
# Compiled once per shape for the module (each variant is a run-time choice of the same program).
dense_jit = jax.jit(dense)
expert_jit = jax.jit(expert_ffn, static_argnames=("ffn_dim", "variant", "int8_activations"))
DENSE_CASES = [(1, 2048, 67), (1, 4160, 9), (1, 67, 37), (2, 130, 70), (3, 33, 19),
               (4, 96, 41), (5, 40, 7), (8, 35, 31)]


@pytest.fixture(scope="module")
def mxfp4_case():
  """One token against an mxfp4 bank (the fused one-token GEMV), its inputs past the kernel's
  first chunk; with its float64 references, exact and with int8 activations (seconds to
  compute: once)."""
  D, F = 4160, 32
  rng = rng_for("mxfp4")
  x = rng.standard_normal((1, D)).astype(np.float32)
  ids, weights = make_routes(rng, T=1, E=3, K=2)
  bank = make_mxfp4_bank(rng, L=1, E=3, F=F, D=D)
  ref = reference.routed_experts(x, ids, weights, bank, 0, F, activation="clamped_swiglu",
                                 alpha=1.702, limit=7.0, bias=True)
  ref_int8 = reference.routed_experts_quantised(x, ids, weights, bank, 0, F,
                                                reference.quantise_blocks,
                                                activation="clamped_swiglu", alpha=1.702,
                                                limit=7.0, bias=True)
  return x, ids, weights, bank, F, ref, ref_int8


@pytest.fixture
def restore_tuning():
  before = tuning.current()
  yield
  tuning.apply(before)


@pytest.mark.parametrize("variant", tuning.candidates(), ids=lambda v: v.name)
def test_every_variant_is_exact(variant, isa, restore_tuning, mxfp4_case):
  tuning.apply(variant)
  assert tuning.current() == variant
  for T, K, N in DENSE_CASES:
    rng = rng_for("dense", T, K, N)
    x = rng.standard_normal((T, K)).astype(np.float32)
    for dtype in (np.dtype(np.float32), BF16):
      w = rng.standard_normal((N, K)).astype(dtype)
      ref = np.asarray(x, np.float64) @ np.asarray(w).astype(np.float64).T
      tolerances.assert_close(np.asarray(dense_jit(x, w)), ref, tolerances.F32)
  # The expert FFN's decode form, bf16 and mxfp4 (the fused one-token GEMV) banks.
  for T in (1, 3):
    rng = rng_for("experts", T)
    D, F, E, K = 96, 64, 6, 2
    x = rng.standard_normal((T, D)).astype(np.float32)
    ids, weights = make_routes(rng, T=T, E=E, K=K)
    bank = (rng.standard_normal((1, E, 3 * F * D)) * 0.2).astype(BF16)
    y = np.asarray(expert_jit(x, ids, weights, bank, 0, ffn_dim=F))
    ref = reference.routed_experts(x, ids, weights, bank, 0, F)
    tolerances.assert_close(y, ref, tolerances.F32)
  x, ids, weights, bank, F, ref, ref_int8 = mxfp4_case
  y = np.asarray(expert_jit(x, ids, weights, bank, 0, ffn_dim=F, variant=GPT_OSS))
  tolerances.assert_close(y, ref, tolerances.F32)
  y = np.asarray(expert_jit(x, ids, weights, bank, 0, ffn_dim=F, variant=GPT_OSS,
                            int8_activations=True))
  tolerances.assert_close(y, ref_int8, tolerances.F32)


@pytest.mark.parametrize("fields, message", [
    (dict(block_rows=5), "block_rows must be 0 \\(default\\), 1, 2, 3 or 4"),
    (dict(prefetch_bytes=100), "prefetch_bytes must be -1"),
    (dict(row_accumulators=6), "row_accumulators must be"),
    (dict(gemv_task_kib=8), "gemv_task_kib must be"),
])
def test_a_bad_variant_is_refused_and_changes_nothing(fields, message, restore_tuning):
  before = tuning.current()
  with pytest.raises(ValueError, match=message):
    tuning.apply(tuning.Tuning(**fields))
  assert tuning.current() == before
  with pytest.raises(ValueError, match="prefetch_hint must be one of auto, nta, l2"):
    tuning.Tuning(prefetch_hint="far")


def small_record():
  """A real tuning run, on 8 MiB weights and one round (the choice is not the point here)."""
  return tuning.measure(tuning.Shapes(64, 32, 2), rounds=1, bytes_each=8 << 20,
                        show_progress=False)


def test_the_tuning_file_is_this_machines(tmp_path, monkeypatch, restore_tuning):
  monkeypatch.setenv("FTJAX_CACHE_DIR", str(tmp_path))
  record = small_record()
  chosen = tuning.Tuning.from_dict(record["chosen"])
  assert tuning.current() == chosen and record["name"] == chosen.name
  assert record["shapes"] == {"hidden": 1024, "ffn": 256, "top_k": 2}  # raised
  stages = record["stages"]
  # Each stage's baseline and its variants; the ISA's own block rows are the baseline's.
  assert [len(stages[s]) for s in ("one_token", "gemv_tasks", "blocks")] == [
      1 + len(tuning.one_token_variants()), 1 + len(tuning.GEMV_TASK_KIB),
      len(tuning.BLOCK_ROWS)]
  assert stages["one_token"][0]["variant"] == "default" and stages["one_token"][0]["score"] == 1
  path = tuning.save(record)
  assert path == tuning.default_path(tuning.Shapes(64, 32, 2), False)
  assert path.startswith(str(tmp_path / "kernel_tuning")) and path.endswith("-h1024f256k2-f32.json")
  assert record["bytes_each"] == 8 << 20 and record["llc_bytes"] == last_level_cache_bytes()
  assert tuning.load(path)[0] == chosen
  # Measured elsewhere, malformed, missing: each refused with the fix.
  other = dict(record, key=dict(record["key"], isa="avx512bf16", cpu="Other CPU"))
  (tmp_path / "other.json").write_text(json.dumps(other))
  with pytest.raises(ValueError, match="measured elsewhere: cpu 'Other CPU'.*--kernel_tuning=auto"):
    tuning.load(str(tmp_path / "other.json"))
  (tmp_path / "bad.json").write_text("{}")
  with pytest.raises(ValueError, match="is not a tuning record"):
    tuning.load(str(tmp_path / "bad.json"))
  with pytest.raises(FileNotFoundError, match="python -m ftjax.profile"):
    tuning.load(str(tmp_path / "missing.json"))


def test_a_tuning_is_kept_per_model_shape_and_read_past_the_caches(tmp_path, monkeypatch):
  monkeypatch.setenv("FTJAX_CACHE_DIR", str(tmp_path))
  paths = {tuning.default_path(tuning.Shapes(h, f, k), bf16)
           for h, f, k in ((2048, 768, 8), (2880, 2880, 4), (2048, 768, 4))
           for bf16 in (False, True)}
  assert len(paths) == 6  # each shape and each activation type has a file of its own
  # Tinier shapes are measured (and kept) as the clamped ones.
  assert (tuning.default_path(tuning.Shapes(64, 32, 1), True)
          == tuning.default_path(tuning.Shapes(1024, 256, 2), True))
  # The weights a run reads: twice the largest cache, within [128 MiB, 1 GiB].
  assert tuning.workload_bytes(0) == 128 << 20
  assert tuning.workload_bytes(32 << 20) == 128 << 20
  assert tuning.workload_bytes(480 << 20) == 960 << 20  # the Xeon's L3
  assert tuning.workload_bytes(4 << 30) == 1 << 30
  llc = last_level_cache_bytes()
  assert llc >= 0 and tuning.workload_bytes() == tuning.workload_bytes(llc)
  if os.path.isdir("/sys/devices/system/cpu/cpu0/cache/index0"):
    assert llc > 0


def test_engine_modes(tmp_path, monkeypatch, tiny_config, restore_tuning):
  monkeypatch.setenv("FTJAX_CACHE_DIR", str(tmp_path))
  model = model_lib.random_model(tiny_config, seed=0)
  engine = ftjax.Engine(model, kernels="ffi", kernel_tuning="off")
  assert engine.kernel_tuning == tuning.DEFAULT == tuning.current()
  assert engine.kernels_path.endswith(", tuning default (--kernel_tuning=off))")
  if tuning.machine_key()["isa"] not in tuning.SIMD_ISAS:
    pytest.skip("the scalar kernels have nothing to tune")
  # auto, first run on this machine: measures and keeps the file; later runs read it.
  engine = ftjax.Engine(model, kernels="ffi", kernel_tuning="auto")
  path = tuning.default_path(tuning.Shapes(tiny_config.hidden_size,
                                           tiny_config.moe_intermediate_size, tiny_config.top_k),
                             False)
  assert os.path.isfile(path) and "(tuned now in " in engine.kernels_path
  assert os.listdir(tmp_path / "kernel_tuning") == [os.path.basename(path)]
  chosen, record = tuning.load(path)
  assert engine.kernel_tuning == chosen == tuning.current()
  assert record["shapes"] == {"hidden": 1024, "ffn": 256, "top_k": tiny_config.top_k}
  tuning.apply(tuning.DEFAULT)
  engine = ftjax.Engine(model, kernels="ffi")
  assert engine.kernel_tuning == chosen == tuning.current()
  assert f"tuning {chosen.name} (tuned {record['created'][:10]}, {path})" in engine.kernels_path
  # A file of one's own.
  own = dataclasses.replace(chosen, block_rows=1, gemv_task_kib=256)
  tuning.save(dict(record, chosen=dataclasses.asdict(own)), str(tmp_path / "mine.json"))
  engine = ftjax.Engine(model, kernels="ffi", kernel_tuning=str(tmp_path / "mine.json"))
  assert engine.kernel_tuning == own == tuning.current()
  with pytest.raises(FileNotFoundError, match="does not exist"):
    ftjax.Engine(model, kernels="ffi", kernel_tuning=str(tmp_path / "nope.json"))
