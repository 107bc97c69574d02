"""Threads and environment of the host kernels: both pools, thread counts, concurrent callers."""

import concurrent.futures
import dataclasses
import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.kernels import cpu_info, dense, expert_ffn, tuning

BF16 = np.dtype(jnp.bfloat16)
D, F, E, K = 96, 40, 8, 2


def make_inputs(T, seed, dtype=BF16):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((T, D)).astype(np.float32)
  ids = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
  weights = rng.random((T, K)).astype(np.float32)
  bank = (rng.standard_normal((1, E, 3 * F * D)) / np.sqrt(D)).astype(np.float32).astype(dtype)
  return x, ids, weights, bank


def run_all(T, seed):
  x, ids, weights, bank = make_inputs(T, seed)
  y = expert_ffn(x, ids, weights, bank, 0, ffn_dim=F)
  w = bank[0, :, : 3 * D].reshape(-1, D)  # any [N, D] bf16 matrix
  return np.asarray(y), np.asarray(dense(x, w))


@pytest.mark.parametrize("T", [1, 5, 200], ids=["decode_1", "decode_5", "grouped_200"])
def test_both_pools_give_identical_results(T, isa, monkeypatch):
  """Each output element is summed in a fixed order whatever thread computes it."""
  monkeypatch.setenv("FTJAX_THREAD_POOL", "own")
  own = run_all(T, seed=T)
  monkeypatch.setenv("FTJAX_THREAD_POOL", "xla")
  assert cpu_info()["pool"] == "xla"
  xla = run_all(T, seed=T)
  for a, b in zip(own, xla):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
  "variable, value, message",
  [
    ("FTJAX_ISA", "avx1024", 'FTJAX_ISA = "avx1024" is not one of scalar, avx2, avx512, avx512bf16'),
    ("FTJAX_THREAD_POOL", "openmp", 'FTJAX_THREAD_POOL = "openmp" is not one of xla, own'),
    ("FTJAX_AMX", "off", 'FTJAX_AMX = "off" is not one of 0, 1'),
  ],
)
def test_unknown_environment_values_are_errors(variable, value, message, monkeypatch):
  monkeypatch.setenv(variable, value)
  x, ids, weights, bank = make_inputs(3, seed=0)
  # JAX raises a failed eager call as JaxRuntimeError when it fails after dispatch, and as
  # ValueError when the failure is already known at dispatch: either way, with the message.
  failed = (jax.errors.JaxRuntimeError, ValueError)
  with pytest.raises(failed, match=re.escape("ftjax_expert_ffn: " + message)):
    jax.block_until_ready(expert_ffn(x, ids, weights, bank, 0, ffn_dim=F))
  with pytest.raises(failed, match=re.escape("ftjax_dense: " + message)):
    jax.block_until_ready(dense(x, bank[0, :, :D]))


@pytest.mark.parametrize("pool, threads", [("own", 1), ("own", 3), ("xla", 1)])
def test_thread_count_from_the_environment(pool, threads, tmp_path):
  """FTJAX_NUM_THREADS sizes ftjax's own pool (read once, in a fresh process) and caps the
  threads used of XLA's; results do not change. The fresh process runs the kernel tuning in
  effect here (an engine of an earlier test may have set this machine's), whose accumulators
  change float32 rounding."""
  reference = run_all(200, seed=7) + run_all(1, seed=8)
  fields = dataclasses.asdict(tuning.current())
  np.savez(tmp_path / "reference.npz", *reference)
  script = textwrap.dedent(f"""
    import sys
    import numpy as np
    sys.path.insert(0, {os.path.dirname(__file__)!r})
    from ftjax.kernels import cpu_info, tuning
    import test_threads
    tuning.apply(tuning.Tuning(**{fields!r}))
    assert cpu_info()["threads"] == {threads}, cpu_info()
    got = test_threads.run_all(200, seed=7) + test_threads.run_all(1, seed=8)
    reference = np.load({str(tmp_path / "reference.npz")!r})
    for i, g in enumerate(got):
      np.testing.assert_array_equal(g, reference[f"arr_{{i}}"])
    print("ok")
  """)
  env = dict(os.environ, FTJAX_NUM_THREADS=str(threads), FTJAX_PIN_THREADS="1",
             FTJAX_THREAD_POOL=pool)
  # cwd: not the source checkout, whose ftjax/ has no compiled module.
  result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          cwd=tmp_path,
                          timeout=300)
  assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.mark.parametrize("pool", ["xla", "own"])
def test_concurrent_callers_get_correct_results(pool, monkeypatch):
  monkeypatch.setenv("FTJAX_THREAD_POOL", pool)
  """Calls from several Python threads at once, on both pools (a busy own pool runs the caller's
  tasks on the caller's own thread), each caller with its own reused scratch (packing.h)."""
  step = jax.jit(lambda x, ids, weights, bank: (expert_ffn(x, ids, weights, bank, 0, ffn_dim=F),
                                                dense(x, bank[0, :, : 3 * D].reshape(-1, D))))
  inputs = [make_inputs(T, seed) for seed, T in enumerate([1, 3, 40, 200] * 3)]
  expected = [[np.asarray(y) for y in step(*inp)] for inp in inputs]
  with concurrent.futures.ThreadPoolExecutor(4) as executor:
    for _ in range(3):
      got = list(executor.map(lambda inp: [np.asarray(y) for y in step(*inp)], inputs))
      for g, e in zip(got, expected):
        for g_y, e_y in zip(g, e):
          np.testing.assert_array_equal(g_y, e_y)
