"""The packed bf16 GEMM on AMX tiles (xla_ffi/cpu_kernels_avx512bf16.cc, ``PackedDotBf16Amx``),
which runs the bf16-activation GEMMs (dense prefill, grouped expert prefill) on CPUs with
AMX-BF16. The products of bf16 weights and bf16-rounded activations are exact and the sums
float32, so against a float64 reference from the same bf16-rounded activations the result is
held to the float32 limit. Skipped where the CPU has no AMX (``cpu_info()["amx"]``), except the
checks of the switch itself."""

import zlib

import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.kernels import cpu_info, dense, expert_ffn
from ftjax.runtime.engine import resolve_kernels

import reference
import tolerances
from expert_cases import make_routes

BF16 = np.dtype(jnp.bfloat16)


def amx_or_skip(monkeypatch):
  monkeypatch.delenv("FTJAX_AMX", raising=False)
  monkeypatch.delenv("FTJAX_ISA", raising=False)
  if not cpu_info()["amx"]:
    pytest.skip("no AMX on this CPU (or this build): the vdpbf16ps path runs")


def rng_for(*labels):
  return np.random.default_rng(zlib.crc32(repr(labels).encode()))


def rounded(a):
  """a rounded to bf16 (nearest even), as float64."""
  return np.asarray(np.asarray(a, np.float32).astype(BF16), np.float64)


# (tokens, inputs, outputs): inputs a multiple of 32 (the AMX path); tokens across the groups
# of 16 (half groups of at most 8 at the end), the dense op's token tiles of 64, and the few
# tokens of a batch's decode step (above kAmxDensePackedMinTokens = 1 the tiles take them; one
# token stays on the dot kernels); outputs in blocks of 16 rows (up to 8 groups of tokens) or of
# 32 and 16 (more groups: 129 and 300 tokens), with a tail of fewer than 16 on the vdpbf16ps
# kernels.
DENSE_SHAPES = [(1, 64, 32), (2, 64, 32), (3, 2048, 48), (4, 64, 32), (5, 64, 32), (8, 2048, 48),
                (12, 96, 17), (16, 128, 64),
                (17, 32, 16), (24, 64, 48), (32, 96, 37), (40, 2048, 64), (64, 768, 200),
                (100, 128, 31), (300, 256, 77), (129, 512, 1024)]


@pytest.mark.parametrize("tokens,inputs,outputs", DENSE_SHAPES)
def test_dense_matches_the_bf16_rounded_reference(tokens, inputs, outputs, monkeypatch):
  amx_or_skip(monkeypatch)
  rng = rng_for(tokens, inputs, outputs)
  x = rng.standard_normal((tokens, inputs)).astype(np.float32)
  w = (rng.standard_normal((outputs, inputs)) / np.sqrt(inputs)).astype(BF16)
  y = np.asarray(dense(x, w, bf16_activations=True))
  ref = rounded(x) @ np.asarray(w, np.float64).T
  tolerances.assert_close(y, ref, tolerances.F32, what="AMX dense vs float64")
  monkeypatch.setenv("FTJAX_AMX", "0")
  assert not cpu_info()["amx"]
  y_vdpbf16ps = np.asarray(dense(x, w, bf16_activations=True))
  tolerances.assert_close(y_vdpbf16ps, ref, tolerances.F32, what="vdpbf16ps dense vs float64")


def test_non_finite_values_reach_the_output(monkeypatch):
  """An inf in the activations gives inf/nan in its token's outputs and nowhere else."""
  amx_or_skip(monkeypatch)
  rng = rng_for("inf")
  x = rng.standard_normal((48, 64)).astype(np.float32)
  x[5, 3] = np.inf
  w = (rng.standard_normal((32, 64)) / 8).astype(BF16)
  y = np.asarray(dense(x, w, bf16_activations=True))
  assert not np.isfinite(y[5]).any()
  assert np.isfinite(np.delete(y, 5, axis=0)).all()


@pytest.mark.parametrize("T,E,K,D,F", [(64, 8, 2, 64, 32), (200, 16, 4, 256, 96),
                                       (777, 8, 2, 128, 64), (40, 4, 3, 96, 48)])
def test_grouped_experts_match_the_reference(T, E, K, D, F, monkeypatch):
  """The grouped prefill form with bf16 activations (x and the hidden h rounded to bf16): on AMX
  and on vdpbf16ps, within the bf16-activation limit of the float64 reference, and within it of
  each other."""
  amx_or_skip(monkeypatch)
  rng = rng_for(T, E, K, D, F)
  x = rng.standard_normal((T, D)).astype(np.float32)
  ids, weights = make_routes(rng, T=T, E=E, K=K, skip_fraction=0.1, shared=False)
  bank = np.concatenate([rng.standard_normal((1, E, F * D)) / np.sqrt(D),
                         rng.standard_normal((1, E, F * D)) / np.sqrt(D),
                         rng.standard_normal((1, E, D * F)) / np.sqrt(F)], axis=-1)
  bank = bank.astype(np.float32).astype(BF16)
  ref = reference.routed_experts(x, ids, weights, bank, 0, F)
  y = np.asarray(expert_ffn(x, ids, weights, bank, 0, ffn_dim=F, bf16_activations=True))
  tolerances.assert_close(y, ref, tolerances.BF16_ACTIVATIONS, what="AMX experts")
  monkeypatch.setenv("FTJAX_AMX", "0")
  y_off = np.asarray(expert_ffn(x, ids, weights, bank, 0, ffn_dim=F, bf16_activations=True))
  tolerances.assert_close(y_off, ref, tolerances.BF16_ACTIVATIONS, what="vdpbf16ps experts")
  tolerances.assert_close(y, y_off, tolerances.BF16_ACTIVATIONS, what="AMX vs vdpbf16ps")


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_only_the_avx512bf16_kernels_use_amx(isa, monkeypatch):
  monkeypatch.delenv("FTJAX_AMX", raising=False)
  monkeypatch.setenv("FTJAX_ISA", isa)
  assert cpu_info()["amx"] is False


def test_ftjax_amx_0_turns_it_off(monkeypatch):
  monkeypatch.delenv("FTJAX_ISA", raising=False)
  monkeypatch.setenv("FTJAX_AMX", "0")
  assert cpu_info()["amx"] is False


def test_the_summary_line_names_amx(monkeypatch):
  """The engine's kernels path (the summary line of ftjax.decode and ftjax.serve) says "+amx"
  where the bf16-activation GEMMs run on AMX, and only there."""
  monkeypatch.delenv("FTJAX_ISA", raising=False)
  monkeypatch.delenv("FTJAX_AMX", raising=False)
  amx = cpu_info()["amx"]
  assert ("+amx" in resolve_kernels("ffi_bf16", BF16)[1]) == amx
  assert "+amx" not in resolve_kernels("ffi", BF16)[1]  # exact: float32 activations, no AMX
  monkeypatch.setenv("FTJAX_AMX", "0")
  assert "+amx" not in resolve_kernels("ffi_bf16", BF16)[1]


@pytest.mark.parametrize("bank,chosen", [(BF16, "ffi_bf16"), (np.uint8, "ffi_bf16"),
                                         (np.uint16, "ffi_bf16"), (np.int8, "ffi"),
                                         (np.float32, "ffi")])
def test_auto_rounds_activations_where_the_weights_allow(bank, chosen):
  """kernels="auto" on the CPU: bf16 activations in prefill for bf16, mxfp4 (uint8) and int4
  (uint16) experts, whose weights are bf16 values or round to them far inside their own step;
  exact float32 for int8 and float32 experts."""
  assert resolve_kernels("auto", bank)[0] == chosen
