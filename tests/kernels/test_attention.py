"""ftjax_attention (xla_ffi/attention.cc) against the float64 reference, on every ISA, with float32
and bfloat16 KV caches.

A bfloat16 cache is compared with the reference computed from the same bf16-rounded k and v
widened exactly (float32 tolerance: only the kernel's float32 arithmetic differs), and with the
kernel's output for the float32 cache it was rounded from (bf16 tolerance)."""

import dataclasses
import functools
import math
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference
import tolerances
from ftjax.kernels import attention

BF16 = np.dtype(jnp.bfloat16)
KV_DTYPES = {"f32": np.dtype(np.float32), "bf16": BF16}

# Cache rows from `length` on hold this; one of them read would swamp the softmax and the output.
GARBAGE = 1e4


def rng_for(*labels):
  return np.random.default_rng(zlib.crc32(repr(labels).encode()))


@dataclasses.dataclass(frozen=True)
class Case:
  B: int
  T: int
  H: int
  G: int
  A: int
  S: int
  length: int
  window: int | None = None
  sinks: bool = False
  q_scale: float = 1.0  # large: peaked softmax, most weights far below e^-87 of the largest


CASES = {
  "decode": Case(B=1, T=1, H=4, G=4, A=16, S=40, length=23),
  "decode_gqa_r2": Case(B=2, T=1, H=4, G=2, A=32, S=64, length=37),
  "decode_gqa_r4": Case(B=2, T=1, H=8, G=2, A=64, S=96, length=50),
  "queries_5": Case(B=2, T=5, H=4, G=4, A=32, S=64, length=37),
  "queries_5_gqa_r2": Case(B=2, T=5, H=4, G=2, A=32, S=64, length=37),
  "queries_5_gqa_r4": Case(B=1, T=5, H=8, G=2, A=16, S=30, length=12),
  "full_cache": Case(B=2, T=5, H=4, G=2, A=16, S=37, length=37),
  "length_equals_queries": Case(B=2, T=5, H=4, G=2, A=16, S=20, length=5),
  "window": Case(B=2, T=5, H=4, G=2, A=32, S=64, length=37, window=7),
  "window_1": Case(B=1, T=5, H=4, G=2, A=16, S=20, length=9, window=1),
  "window_longer_than_length": Case(B=2, T=5, H=4, G=2, A=16, S=64, length=9, window=50),
  "sinks": Case(B=2, T=1, H=8, G=2, A=32, S=64, length=37, sinks=True),
  "sinks_queries_5": Case(B=2, T=5, H=8, G=2, A=32, S=64, length=37, sinks=True),
  "sinks_window": Case(B=2, T=5, H=8, G=4, A=32, S=64, length=37, window=6, sinks=True),
  "width_not_multiple_of_16": Case(B=2, T=5, H=4, G=2, A=20, S=40, length=30),
  "width_3": Case(B=1, T=2, H=2, G=1, A=3, S=10, length=7),
  # Long caches: the rows are split into slices whose partial softmaxes are merged.
  "long_decode_gqa_r8": Case(B=1, T=1, H=32, G=4, A=128, S=2048, length=1900),
  "long_window_sinks": Case(B=2, T=3, H=8, G=2, A=64, S=2048, length=2000, window=700,
                            sinks=True),
  "peaked_scores": Case(B=2, T=5, H=8, G=2, A=32, S=300, length=280, q_scale=40.0),
  "peaked_scores_sinks": Case(B=1, T=1, H=8, G=2, A=32, S=300, length=280, q_scale=40.0,
                              sinks=True),
  # More query positions than one tile holds (256 queries): several tiles per sequence.
  "prefill_tiles": Case(B=1, T=300, H=2, G=1, A=16, S=400, length=390),
  "prefill_tiles_gqa_r8_window": Case(B=2, T=40, H=16, G=2, A=32, S=64, length=50, window=9),
  # Prefill chunks: T queries at rows [length - T, length), a fresh prefill (length = T) or a
  # later chunk (length > T). T * H > 256 takes the prefill form (one kv head per tile, blocks
  # above the diagonal or before the window skipped), smaller ones the decode form.
  "chunk_1_fresh": Case(B=1, T=1, H=4, G=1, A=16, S=8, length=1),
  "chunk_15_fresh_gqa_r4": Case(B=2, T=15, H=8, G=2, A=32, S=20, length=15),
  "chunk_15_later_gqa_r8": Case(B=1, T=15, H=32, G=4, A=16, S=100, length=80),
  "chunk_16_fresh_gqa_r8": Case(B=1, T=16, H=32, G=4, A=16, S=16, length=16),
  "chunk_16_later_window": Case(B=2, T=16, H=32, G=4, A=24, S=200, length=150, window=20),
  "chunk_17_fresh_sinks": Case(B=1, T=17, H=16, G=16, A=8, S=30, length=17, sinks=True),
  "chunk_17_later_gqa_r4_window_sinks": Case(B=1, T=17, H=16, G=4, A=20, S=200, length=150,
                                             window=40, sinks=True),
  "chunk_511_fresh_gqa_r4": Case(B=1, T=511, H=8, G=2, A=32, S=520, length=511),
  "chunk_511_later_gqa_r8_window_sinks": Case(B=1, T=511, H=8, G=1, A=16, S=1200, length=1100,
                                              window=300, sinks=True),
  "chunk_4097_fresh": Case(B=1, T=4097, H=4, G=1, A=16, S=4097, length=4097),
  "chunk_4097_later_window": Case(B=1, T=4097, H=4, G=4, A=16, S=4600, length=4500,
                                  window=1000),
}


def make_inputs(case, *labels, garbage=GARBAGE, kv_dtype=np.float32):
  """q, k, v, sinks (or None); rows of k and v from `length` on hold +-garbage; k and v rounded
  to kv_dtype."""
  rng = rng_for(case, *labels)
  q = (case.q_scale * rng.standard_normal((case.B, case.T, case.H, case.A))).astype(np.float32)
  k = rng.standard_normal((case.B, case.S, case.G, case.A)).astype(np.float32)
  v = rng.standard_normal((case.B, case.S, case.G, case.A)).astype(np.float32)
  for cache in (k, v):
    tail = cache[:, case.length:]
    tail[...] = garbage * np.sign(rng.standard_normal(tail.shape))
  sinks = (2 * rng.standard_normal(case.H)).astype(np.float32) if case.sinks else None
  return q, k.astype(kv_dtype), v.astype(kv_dtype), sinks


def run_case(case, q, k, v, sinks, length=None):
  length = case.length if length is None else length
  return attention(q, k, v, np.int32(length), scale=case.A ** -0.5, window=case.window,
                   sinks=sinks)


def reference_case(case, q, k, v, sinks):
  return reference.attention(q, k, v, case.length, scale=case.A ** -0.5, window=case.window,
                             sinks=sinks)


@functools.lru_cache(maxsize=None)
def cached_reference(case_name, kv_name):
  """The float64 reference of a case (computed once for all ISAs: the large ones take a while),
  from k and v as the kernel sees them (a bf16 cache widened exactly)."""
  case = CASES[case_name]
  q, k, v, sinks = make_inputs(case, kv_dtype=KV_DTYPES[kv_name])
  return reference_case(case, q, k, v, sinks)


@pytest.mark.parametrize("kv_name", KV_DTYPES)
@pytest.mark.parametrize("case_name", CASES)
def test_matches_reference(case_name, kv_name, isa):
  case = CASES[case_name]
  q, k, v, sinks = make_inputs(case, kv_dtype=KV_DTYPES[kv_name])
  out = run_case(case, q, k, v, sinks)
  assert out.shape == q.shape and out.dtype == jnp.float32
  tolerances.assert_close(out, cached_reference(case_name, kv_name), tolerances.F32)


@pytest.mark.parametrize("case_name", [name for name, case in CASES.items() if case.q_scale == 1])
def test_bf16_cache_close_to_f32_cache(case_name):
  """Rounding the cache to bf16 moves the output by about bf16's precision, no more. (Not the
  peaked cases: there a score's rounding error, times q_scale, moves the softmax's weights.)"""
  case = CASES[case_name]
  q, k, v, sinks = make_inputs(case)
  out_f32 = run_case(case, q, k, v, sinks)
  out_bf16 = run_case(case, q, k.astype(BF16), v.astype(BF16), sinks)
  tolerances.assert_close(out_bf16, out_f32, tolerances.BF16_KV_CACHE)


@pytest.mark.parametrize("case_name", ["decode_gqa_r4", "sinks_window"])
def test_a_bf16_cache_as_its_bits_reads_the_same(case_name, isa):
  """A bfloat16 cache passed as its uint16 bits (how the engine holds it: KV_BITS) gives the
  bfloat16 cache's output bit for bit."""
  case = CASES[case_name]
  q, k, v, sinks = make_inputs(case, kv_dtype=BF16)
  bits = [np.asarray(x).view(np.uint16) for x in (k, v)]
  np.testing.assert_array_equal(run_case(case, q, *bits, sinks), run_case(case, q, k, v, sinks))


@pytest.mark.parametrize("case_name", ["long_window_sinks", "chunk_511_fresh_gqa_r4",
                                       "chunk_511_later_gqa_r8_window_sinks"])
def test_threads_do_not_change_the_result(case_name, monkeypatch):
  """The work split depends on the shapes only: one thread gives the same bits as all."""
  case = CASES[case_name]
  q, k, v, sinks = make_inputs(case, kv_dtype=BF16)
  all_threads = np.asarray(run_case(case, q, k, v, sinks))
  monkeypatch.setenv("FTJAX_NUM_THREADS", "1")
  np.testing.assert_array_equal(np.asarray(run_case(case, q, k, v, sinks)), all_threads)


@pytest.mark.parametrize("kv_name", KV_DTYPES)
@pytest.mark.parametrize("case_name", ["queries_5_gqa_r2", "chunk_15_later_gqa_r8",
                                       "chunk_16_later_window"])
def test_rows_past_length_are_not_read(case_name, kv_name, isa):
  """NaN past `length`: any read of those rows would spread into the output."""
  case = CASES[case_name]
  q, k, v, _ = make_inputs(case, garbage=np.nan, kv_dtype=KV_DTYPES[kv_name])
  out = np.asarray(run_case(case, q, k, v, None))
  assert np.all(np.isfinite(out))
  tolerances.assert_close(out, reference_case(case, q, k, v, None), tolerances.F32)


def test_sinks_take_mass():
  """A very negative sink changes nothing; a large one sends every output towards zero."""
  case = CASES["sinks"]
  q, k, v, _ = make_inputs(case)
  without = np.asarray(run_case(case, q, k, v, None))
  low = np.asarray(run_case(case, q, k, v, np.full(case.H, -1e30, np.float32)))
  high = np.asarray(run_case(case, q, k, v, np.full(case.H, 60.0, np.float32)))
  np.testing.assert_array_equal(low, without)
  assert np.max(np.abs(high)) < 1e-20


def test_traced_length_under_jit_no_retrace():
  case = CASES["queries_5_gqa_r2"]
  traces = 0

  @jax.jit
  def attend(q, k, v, length):
    nonlocal traces
    traces += 1
    return attention(q, k, v, length, scale=case.A ** -0.5)

  for length in (case.length, case.length + 9):
    shifted = dataclasses.replace(case, length=length)
    q, k, v, _ = make_inputs(shifted, "jit")
    tolerances.assert_close(attend(q, k, v, np.int32(length)),
                            reference_case(shifted, q, k, v, None), tolerances.F32)
  assert traces == 1


def test_vmap_runs_each_member():
  case = CASES["queries_5_gqa_r2"]
  members = [make_inputs(case, "vmap", i)[:3] for i in range(3)]
  q, k, v = (np.stack(parts) for parts in zip(*members))
  out = jax.vmap(lambda q, k, v: attention(q, k, v, np.int32(case.length),
                                           scale=case.A ** -0.5))(q, k, v)
  for i, (qi, ki, vi) in enumerate(members):
    tolerances.assert_close(out[i], reference_case(case, qi, ki, vi, None), tolerances.F32)


def test_empty_queries_give_empty_output():
  out = attention(np.zeros((2, 0, 4, 8), np.float32), np.zeros((2, 6, 2, 8), np.float32),
                  np.zeros((2, 6, 2, 8), np.float32), 3, scale=1.0)
  assert out.shape == (2, 0, 4, 8)


# --- in place in a decode loop ----------------------------------------------------------------

LOOP_B, LOOP_S, LOOP_G, LOOP_H, LOOP_A = 1, 512, 2, 4, 64
LOOP_STEPS, LOOP_START = 6, 300


@functools.partial(jax.jit, donate_argnames=("cache_k", "cache_v"))
def decode_loop(cache_k, cache_v, q_steps, k_steps, v_steps):
  """LOOP_STEPS decode steps: write the step's key and value at row LOOP_START + i of the
  donated cache, then attend with the op. Returns (cache_k, cache_v, out [steps, H, A])."""

  def step(i, carry):
    cache_k, cache_v, out = carry
    row = LOOP_START + i
    cache_k = jax.lax.dynamic_update_slice(cache_k, k_steps[i][None, None], (0, row, 0, 0))
    cache_v = jax.lax.dynamic_update_slice(cache_v, v_steps[i][None, None], (0, row, 0, 0))
    out_step = attention(q_steps[i][None, None], cache_k, cache_v, row + 1,
                         scale=LOOP_A ** -0.5)
    return cache_k, cache_v, out.at[i].set(out_step[0, 0])

  out = jnp.zeros((LOOP_STEPS, LOOP_H, LOOP_A), jnp.float32)
  return jax.lax.fori_loop(0, LOOP_STEPS, step, (cache_k, cache_v, out))


def loop_inputs():
  rng = rng_for("decode loop")
  cache_shape = (LOOP_B, LOOP_S, LOOP_G, LOOP_A)
  cache_k = rng.standard_normal(cache_shape).astype(np.float32)
  cache_v = rng.standard_normal(cache_shape).astype(np.float32)
  for cache in (cache_k, cache_v):
    cache[:, LOOP_START:] = GARBAGE
  q_steps = rng.standard_normal((LOOP_STEPS, LOOP_H, LOOP_A)).astype(np.float32)
  k_steps = rng.standard_normal((LOOP_STEPS, LOOP_G, LOOP_A)).astype(np.float32)
  v_steps = rng.standard_normal((LOOP_STEPS, LOOP_G, LOOP_A)).astype(np.float32)
  return cache_k, cache_v, q_steps, k_steps, v_steps


def cache_sized_copies(hlo_text, cache_shape):
  """Copies and transposes (plain, or fusions XLA named after them) with as many float32
  elements as the cache, in any shape: e.g. the [G, S, A] transposed copy that XLA:CPU makes of
  the cache for an einsum over it."""
  found = []
  for match in re.finditer(r"%([\w.-]+) = f32\[([\d,]*)\]\S* ([\w-]+)\(", hlo_text):
    name, dims, opcode = match.groups()
    size = math.prod(int(d) for d in dims.split(",")) if dims else 1
    if size == math.prod(cache_shape) and (opcode in ("copy", "transpose")
                                           or re.match(r"(copy|transpose)", name)):
      found.append(match.group(0))
  return found


def test_decode_loop_reads_the_cache_in_place():
  cache_k, cache_v, q_steps, k_steps, v_steps = loop_inputs()
  compiled = decode_loop.lower(cache_k, cache_v, q_steps, k_steps, v_steps).compile()
  text = compiled.as_text()
  cache_type = f"f32[{LOOP_B},{LOOP_S},{LOOP_G},{LOOP_A}]"
  assert cache_type in text  # the pattern below names the cache's type as XLA prints it
  copies = re.findall(r"%copy[\.\d]* = " + re.escape(cache_type), text)
  assert not copies, copies
  assert not cache_sized_copies(text, cache_k.shape)


def test_decode_loop_matches_reference():
  cache_k, cache_v, q_steps, k_steps, v_steps = loop_inputs()
  expected_k, expected_v = cache_k.copy(), cache_v.copy()
  new_k, new_v, out = decode_loop(jnp.asarray(cache_k), jnp.asarray(cache_v), q_steps, k_steps,
                                  v_steps)
  for i in range(LOOP_STEPS):
    row = LOOP_START + i
    expected_k[0, row], expected_v[0, row] = k_steps[i], v_steps[i]
    ref = reference.attention(q_steps[i][None, None], expected_k, expected_v, row + 1,
                              scale=LOOP_A ** -0.5)
    tolerances.assert_close(out[i], ref[0, 0], tolerances.F32, what=f"step {i}")
  np.testing.assert_array_equal(np.asarray(new_k), expected_k)
  np.testing.assert_array_equal(np.asarray(new_v), expected_v)


# --- bad input --------------------------------------------------------------------------------


def good_arguments():
  return dict(q=np.zeros((2, 3, 4, 8), np.float32), k=np.zeros((2, 10, 2, 8), np.float32),
              v=np.zeros((2, 10, 2, 8), np.float32), length=np.int32(6))


PYTHON_ERRORS = {
  "q_not_array": (dict(q=[1.0]), "q must be an array"),
  "q_not_4d": (dict(q=np.zeros((3, 4, 8), np.float32)), "q must be float32 [B, T, H, A]"),
  "q_dtype": (dict(q=np.zeros((2, 3, 4, 8), np.float64)), "q must be float32 [B, T, H, A]"),
  "k_wrong_width": (dict(k=np.zeros((2, 10, 2, 9), np.float32)),
                    "k must be float32, bfloat16 or uint16 (bfloat16 bits) [B, S, G, A] with B = 2 and A = 8 from q"),
  "k_wrong_batch": (dict(k=np.zeros((1, 10, 2, 8), np.float32)),
                    "k must be float32, bfloat16 or uint16 (bfloat16 bits) [B, S, G, A] with B = 2 and A = 8 from q"),
  "k_dtype": (dict(k=np.zeros((2, 10, 2, 8), np.float16)),
              "k must be float32, bfloat16 or uint16 (bfloat16 bits) [B, S, G, A]"),
  "kv_heads_do_not_divide": (dict(k=np.zeros((2, 10, 3, 8), np.float32)),
                             "k's kv heads G = 3 must divide q's heads H = 4"),
  "v_shape": (dict(v=np.zeros((2, 9, 2, 8), np.float32)), "v must have k's shape (2, 10, 2, 8)"),
  "v_dtype": (dict(v=np.zeros((2, 10, 2, 8), np.float16)), "v must have k's dtype float32"),
  "v_bf16_k_f32": (dict(v=np.zeros((2, 10, 2, 8), jnp.bfloat16)),
                   "v must have k's dtype float32 (one cache dtype for both"),
  "k_bf16_v_f32": (dict(k=np.zeros((2, 10, 2, 8), jnp.bfloat16)),
                   "v must have k's dtype bfloat16 (one cache dtype for both"),
  "length_below_queries": (dict(length=np.int32(2)), "length must be in [T, S] = [3, 10], got 2"),
  "length_above_rows": (dict(length=11), "length must be in [T, S] = [3, 10], got 11"),
  "length_dtype": (dict(length=np.zeros((), np.int64)), "length must be an int32 scalar"),
  "length_not_scalar": (dict(length=np.zeros((1,), np.int32)),
                        "length must be an int32 scalar or [B] with B = 2"),
  "length_per_row_above_rows": (dict(length=np.array([6, 11], np.int32)),
                                "length must be in [T, S] = [3, 10], got 11"),
  "scale_array": (dict(scale=np.ones(1, np.float32)), "scale must be a Python or numpy number"),
  "window_zero": (dict(window=0), "window must be None or a positive int"),
  "window_float": (dict(window=2.5), "window must be None or a positive int"),
  "sinks_shape": (dict(sinks=np.zeros(2, np.float32)), "sinks must be float32 [H] with H = 4"),
  "sinks_dtype": (dict(sinks=np.zeros(4, np.float64)), "sinks must be float32 [H] with H = 4"),
}


@pytest.mark.parametrize("error_name", PYTHON_ERRORS)
def test_python_side_rejects_bad_input(error_name):
  changes, message = PYTHON_ERRORS[error_name]
  arguments = good_arguments() | dict(scale=1.0) | changes
  with pytest.raises(ValueError, match=re.escape(message)):
    attention(**arguments)


@pytest.mark.parametrize("kv_name", KV_DTYPES)
@pytest.mark.parametrize("case_name", ["decode_gqa_r2", "queries_5", "window", "sinks"])
def test_per_sequence_lengths_equal_each_sequence_alone(case_name, kv_name):
  """length [B] (a batch at different positions): each sequence's output is exactly what the
  kernel gives that sequence alone at its length, in one call (traced and concrete lengths)."""
  case = CASES[case_name]
  q, k, v, sinks = make_inputs(case, "per_row", kv_dtype=KV_DTYPES[kv_name])
  lengths = np.array([case.length - 3 * b for b in range(case.B)], np.int32)
  kwargs = dict(scale=case.A ** -0.5, window=case.window, sinks=sinks)
  together = np.asarray(attention(q, k, v, lengths, **kwargs))
  traced = np.asarray(jax.jit(lambda n: attention(q, k, v, n, **kwargs))(lengths))
  for b in range(case.B):
    alone = np.asarray(attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], int(lengths[b]), **kwargs))
    np.testing.assert_array_equal(together[b:b + 1], alone)
    np.testing.assert_array_equal(traced[b:b + 1], alone)


def call_kernel_directly(q, k, v, length, sinks=np.zeros(0, np.float32), result_shape=None,
                         window=0, use_sinks=False):
  call = jax.ffi.ffi_call(
    "ftjax_attention",
    jax.ShapeDtypeStruct(q.shape if result_shape is None else result_shape, jnp.float32),
    vmap_method="sequential",
  )
  return jax.block_until_ready(call(q, k, v, length, sinks, scale=np.float32(1.0),
                                    window=np.int64(window), use_sinks=use_sinks))


KERNEL_ERRORS = {
  "q_not_4d": (dict(q=np.zeros((3, 4, 8), np.float32)),
               "q must be float32 [B, T, H, A], got shape [3, 4, 8]"),
  "q_dtype": (dict(q=np.zeros((2, 3, 4, 8), np.int32)), "q must be float32 [B, T, H, A]"),
  "k_wrong_width": (dict(k=np.zeros((2, 10, 2, 9), np.float32)),
                    "k must be float32, bfloat16 or uint16 (bfloat16 bits) [B, S, G, A] with B = 2 and A = 8 from q, got "
                    "shape [2, 10, 2, 9]"),
  "k_dtype": (dict(k=np.zeros((2, 10, 2, 8), np.float16)),
              "k must be float32, bfloat16 or uint16 (bfloat16 bits) [B, S, G, A]"),
  "kv_heads_do_not_divide": (dict(k=np.zeros((2, 10, 3, 8), np.float32)),
                             "k's kv heads G = 3 must divide q's heads H = 4"),
  "v_shape": (dict(v=np.zeros((2, 9, 2, 8), np.float32)),
              "v must have k's dtype (float32) and shape [2, 10, 2, 8], got shape [2, 9, 2, 8]"),
  "v_dtype_mixed": (dict(v=np.zeros((2, 10, 2, 8), jnp.bfloat16)),
                    "v must have k's dtype (float32) and shape [2, 10, 2, 8]"),
  "length_dtype": (dict(length=np.float32(6)), "length must be an int32 scalar"),
  "length_below_queries": (dict(length=np.int32(2)),
                           "length must be in [T, S] = [3, 10], got 2"),
  "length_above_rows": (dict(length=np.int32(11)), "length must be in [T, S] = [3, 10], got 11"),
  "length_wrong_rows": (dict(length=np.zeros((3,), np.int32)),
                        "length must be an int32 scalar or [B] with B = 2, got shape [3]"),
  "length_per_row_above_rows": (dict(length=np.array([6, 11], np.int32)),
                                "length must be in [T, S] = [3, 10], got 11 for sequence 1"),
  "sinks_missing": (dict(use_sinks=True),
                    "sinks must be float32 [H] with H = 4, got shape [0]"),
  "sinks_shape": (dict(sinks=np.zeros(3, np.float32)),
                  "sinks must be float32 [H] with H = 4 (or [0], since use_sinks is false)"),
  "window_negative": (dict(window=-1), "window must be >= 0 (0: none), got -1"),
  "result_shape": (dict(result_shape=(2, 3, 4, 9)),
                   "result out must have q's shape [2, 3, 4, 8], got [2, 3, 4, 9]"),
}


@pytest.mark.parametrize("error_name", KERNEL_ERRORS)
def test_kernel_rejects_bad_input(error_name):
  changes, message = KERNEL_ERRORS[error_name]
  arguments = good_arguments() | changes
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=re.escape("ftjax_attention: " + message)):
    call_kernel_directly(**arguments)


def test_kernel_rejects_traced_length_out_of_range():
  case = CASES["queries_5"]
  q, k, v, _ = make_inputs(case)
  attend = jax.jit(lambda length: attention(q, k, v, length, scale=1.0))
  with pytest.raises(jax.errors.JaxRuntimeError,
                     match=re.escape("ftjax_attention: length must be in [T, S] = [5, 64], "
                                     "got 65")):
    jax.block_until_ready(attend(np.int32(65)))
