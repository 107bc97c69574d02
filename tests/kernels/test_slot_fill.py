"""ftjax_slot_fill (xla_ffi/slot_fill.cc) against a numpy loop over the plan.

A fill copies bits, so every comparison here is exact, bit for bit (NaN payloads included);
there is no tolerance to choose.
"""

import dataclasses
import functools
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ftjax.kernels import slot_fill

BF16 = np.dtype(jnp.bfloat16)
F32 = np.dtype(np.float32)
DTYPES = [F32, BF16]
# An int8 expert bank (docs/ftw.md): slots hold its bytes, weights and scales alike.
COPY_DTYPES = [*DTYPES, np.dtype(np.int8)]


def reference_slot_fill(slots, bank, src, dst):
  """Straight from the definition: slots[dst[m]] = bank[src[m]] for rows with dst != -1."""
  new_slots = np.array(slots)
  for m in range(len(dst)):
    if dst[m] != -1:
      new_slots[dst[m]] = np.asarray(bank)[src[m, 0], src[m, 1]]
  return new_slots


def assert_same_bits(actual, expected):
  actual, expected = np.asarray(actual), np.asarray(expected)
  assert actual.dtype == expected.dtype
  assert actual.shape == expected.shape
  bits = np.dtype(f"u{actual.dtype.itemsize}")
  np.testing.assert_array_equal(actual.view(bits), expected.view(bits))


def rng_for(*labels):
  return np.random.default_rng(zlib.crc32(repr(labels).encode()))


@dataclasses.dataclass(frozen=True)
class Case:
  M: int  # plan rows
  fills: int  # rows with a target slot; the other M - fills rows are -1 padding
  N: int = 6
  L: int = 3
  E: int = 5
  P: int = 24


CASES = {
  "one_block": Case(M=1, fills=1),
  "padded_plan": Case(M=8, fills=3),
  "every_slot": Case(M=6, fills=6),
  "only_padding": Case(M=4, fills=0),
  "empty_plan": Case(M=0, fills=0),
  "one_slot_cache": Case(M=2, fills=1, N=1),
  "wide_blocks": Case(M=5, fills=4, N=9, P=4096 + 7),
}


def make_inputs(case, dtype, *labels):
  """Random slots and bank; the plan fills `fills` distinct slots in random order.

  Padding rows carry src values far out of range: the kernel must not read them.
  """
  rng = rng_for(case, dtype.name, *labels)

  def values(shape):
    if dtype == np.int8:  # every byte value
      return rng.integers(-128, 128, shape).astype(np.int8)
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)

  slots, bank = values((case.N, case.P)), values((case.L, case.E, case.P))
  src = np.stack([rng.integers(0, case.L, case.M), rng.integers(0, case.E, case.M)], axis=1)
  dst = np.full(case.M, -1)
  filled_rows = rng.permutation(case.M)[: case.fills]
  dst[filled_rows] = rng.permutation(case.N)[: case.fills]
  src[dst == -1] = [10**6, -(10**6)]
  return slots, bank, src.astype(np.int32).reshape(case.M, 2), dst.astype(np.int32)


@pytest.mark.parametrize("dtype", COPY_DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("case_name", CASES)
def test_matches_reference(case_name, dtype):
  slots, bank, src, dst = make_inputs(CASES[case_name], dtype)
  new_slots = slot_fill(jnp.asarray(slots), jnp.asarray(bank), src, dst)
  assert_same_bits(new_slots, reference_slot_fill(slots, bank, src, dst))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_padding_rows_are_skipped_and_other_slots_untouched(dtype):
  slots = np.full((4, 8), np.nan, np.float32).astype(dtype)  # NaN: compared bit for bit
  bank = np.arange(2 * 3 * 8, dtype=np.float32).reshape(2, 3, 8).astype(dtype)
  src = np.array([[-1, -1], [1, 2], [0, 7], [0, 1]], np.int32)
  dst = np.array([-1, 3, -1, 0], np.int32)
  new_slots = np.asarray(slot_fill(jnp.asarray(slots), jnp.asarray(bank), src, dst))
  assert_same_bits(new_slots[3], bank[1, 2])
  assert_same_bits(new_slots[0], bank[0, 1])
  assert_same_bits(new_slots[1:3], slots[1:3])


@functools.partial(jax.jit, donate_argnames="slots")
def fill_donated(slots, bank, src, dst):
  return slot_fill(slots, bank, src, dst)


@functools.partial(jax.jit)
def fill_not_donated(slots, bank, src, dst):
  return slot_fill(slots, bank, src, dst)


@pytest.mark.parametrize("dtype", COPY_DTYPES, ids=lambda d: d.name)
def test_under_jit_with_donation(dtype):
  slots, bank, src, dst = make_inputs(CASES["padded_plan"], dtype, "jit")
  slots_device = jnp.asarray(slots)
  new_slots = fill_donated(slots_device, jnp.asarray(bank), jnp.asarray(src), jnp.asarray(dst))
  assert slots_device.is_deleted()
  assert_same_bits(new_slots, reference_slot_fill(slots, bank, src, dst))


@pytest.mark.skipif(
  jax.default_backend() != "cpu", reason="compares addresses of XLA:CPU buffers"
)
def test_donated_cache_is_filled_in_its_own_buffer():
  """The op writes into the donated cache buffer: no new buffer, no copy of the cache."""
  slots, bank, src, dst = make_inputs(CASES["wide_blocks"], BF16, "in place")
  bank, src, dst = jnp.asarray(bank), jnp.asarray(src), jnp.asarray(dst)

  slots_device = jnp.asarray(slots)
  cache_address = slots_device.unsafe_buffer_pointer()
  new_slots = fill_donated(slots_device, bank, src, dst)
  assert new_slots.unsafe_buffer_pointer() == cache_address
  assert_same_bits(new_slots, reference_slot_fill(slots, bank, src, dst))

  # Contrast: without donation the result must be a new buffer, the input survives.
  kept = jnp.asarray(slots)
  copied = fill_not_donated(kept, bank, src, dst)
  assert copied.unsafe_buffer_pointer() != kept.unsafe_buffer_pointer()
  assert_same_bits(kept, slots)


def compiled_hlo(jitted, *arguments):
  return jitted.lower(*arguments).compile().as_text()


def slot_fill_operand(hlo):
  """The name of the instruction that the slot-fill custom call reads as `slots`."""
  call = re.search(r'custom-call\(%?([\w.\-]+),.*custom_call_target="ftjax_slot_fill"', hlo)
  assert call, hlo
  return call.group(1)


def test_compiled_program_does_not_copy_a_donated_cache():
  case = CASES["wide_blocks"]
  arguments = [jnp.asarray(a) for a in make_inputs(case, BF16, "hlo")]

  hlo = compiled_hlo(fill_donated, *arguments)
  # The custom call reads parameter 0 itself, the output is that parameter's buffer, and the
  # program has no copy instruction at all.
  operand = slot_fill_operand(hlo)
  assert re.search(rf"%?{re.escape(operand)} = bf16\[{case.N},{case.P}\]\S* parameter\(0\)", hlo)
  assert "input_output_alias={ {}: (0, {}" in hlo
  assert not re.search(r"\bcopy\(", hlo), hlo

  # Contrast: without donation XLA copies the whole cache and fills the copy.
  hlo = compiled_hlo(fill_not_donated, *arguments)
  operand = slot_fill_operand(hlo)
  assert re.search(
    rf"%?{re.escape(operand)} = bf16\[{case.N},{case.P}\]\S* copy\(%?[\w.\-]+\)", hlo
  ), hlo


def test_second_jitted_call_with_new_data_does_not_retrace():
  case = CASES["padded_plan"]
  traces = 0

  @functools.partial(jax.jit, donate_argnames="slots")
  def fill(slots, bank, src, dst):
    nonlocal traces
    traces += 1
    return slot_fill(slots, bank, src, dst)

  for call in range(2):
    slots, bank, src, dst = make_inputs(case, BF16, "retrace", call)
    new_slots = fill(jnp.asarray(slots), jnp.asarray(bank), jnp.asarray(src), jnp.asarray(dst))
    assert_same_bits(new_slots, reference_slot_fill(slots, bank, src, dst))
  assert traces == 1


def test_vmap_fills_each_cache_with_its_own_plan():
  case = CASES["padded_plan"]
  B = 3
  inputs = [make_inputs(case, F32, "vmap", b) for b in range(B)]
  slots_bnp, src_bm2, dst_bm = (np.stack([inp[i] for inp in inputs]) for i in (0, 2, 3))
  bank = inputs[0][1]
  new_slots_bnp = jax.jit(jax.vmap(slot_fill, in_axes=(0, None, 0, 0)))(
    slots_bnp, bank, src_bm2, dst_bm
  )
  for b in range(B):
    expected = reference_slot_fill(slots_bnp[b], bank, src_bm2[b], dst_bm[b])
    assert_same_bits(new_slots_bnp[b], expected)


def test_unaliased_binding_still_keeps_unfilled_slots():
  """Bound without input_output_aliases, the handler gets a fresh result buffer and must copy
  the cache into it before filling."""
  slots, bank, src, dst = make_inputs(CASES["padded_plan"], F32, "unaliased")
  call = jax.ffi.ffi_call(
    "ftjax_slot_fill", jax.ShapeDtypeStruct(slots.shape, slots.dtype), vmap_method="sequential"
  )
  assert_same_bits(call(slots, bank, src, dst), reference_slot_fill(slots, bank, src, dst))


# --- bad input --------------------------------------------------------------------------------

N, P, L, E, M = 4, 16, 2, 3, 3


def good_arguments():
  rng = rng_for("good arguments")
  return dict(
    slots=rng.standard_normal((N, P)).astype(np.float32),
    bank=rng.standard_normal((L, E, P)).astype(np.float32),
    src=np.array([[0, 1], [1, 2], [-1, -1]], np.int32),
    dst=np.array([2, 0, -1], np.int32),
  )


PYTHON_ERRORS = {
  "slots_not_2d": (dict(slots=np.zeros((N, P, 1), np.float32)), "slots must be 2-D [N, P]"),
  "slots_sub_byte": (
    dict(slots=np.zeros((N, P), jnp.int4), bank=np.zeros((L, E, P), jnp.int4)),
    "slots must have a dtype of one or more whole bytes, got int4",
  ),
  "bank_not_3d": (
    dict(bank=np.zeros((E, P), np.float32)),
    "bank must be [L, E, P] with P = 16 from slots, got shape (3, 16)",
  ),
  "bank_other_p": (
    dict(bank=np.zeros((L, E, P + 1), np.float32)),
    "bank must be [L, E, P] with P = 16 from slots, got shape (2, 3, 17)",
  ),
  "bank_other_dtype": (
    dict(bank=np.zeros((L, E, P), BF16)),
    "bank must have the dtype of slots (float32), got bfloat16",
  ),
  "src_not_pairs": (dict(src=np.zeros((M, 3), np.int32)), "src must be [M, 2] (layer, expert)"),
  "src_1d": (dict(src=np.zeros((M,), np.int32)), "src must be [M, 2] (layer, expert)"),
  "src_not_int32": (dict(src=np.zeros((M, 2), np.int64)), "src must be int32, got int64"),
  "dst_wrong_length": (
    dict(dst=np.zeros((M + 1,), np.int32)),
    "dst must be [M] with M = 3 from src, got shape (4,)",
  ),
  "dst_2d": (dict(dst=np.zeros((M, 1), np.int32)), "dst must be [M] with M = 3 from src"),
  "dst_not_int32": (dict(dst=np.zeros((M,), np.uint32)), "dst must be int32, got uint32"),
  "dst_not_array": (dict(dst=[2, 0, -1]), "dst must be an array, got list"),
}


@pytest.mark.parametrize("error_name", PYTHON_ERRORS)
def test_python_side_rejects_bad_input(error_name):
  changes, message = PYTHON_ERRORS[error_name]
  with pytest.raises(ValueError, match=re.escape(message)):
    slot_fill(**(good_arguments() | changes))


def call_kernel_directly(slots, bank, src, dst, result_shape=None):
  """Bypasses the Python checks, so that the C++ ones are the ones that fire."""
  call = jax.ffi.ffi_call(
    "ftjax_slot_fill",
    jax.ShapeDtypeStruct(result_shape or slots.shape, slots.dtype),
    input_output_aliases={0: 0} if result_shape is None else {},
    vmap_method="sequential",
  )
  return jax.block_until_ready(call(slots, bank, src, dst))


KERNEL_ERRORS = {
  "slots_not_2d": (
    dict(slots=np.zeros((N, P, 1), np.float32)),
    "slots must be 2-D [N, P], got shape [4, 16, 1]",
  ),
  "bank_not_3d": (
    dict(bank=np.zeros((E, P), np.float32)),
    "bank must be 3-D [L, E, P], got shape [3, 16]",
  ),
  "bank_other_p": (
    dict(bank=np.zeros((L, E, P + 1), np.float32)),
    "bank must be [L, E, P] with P = 16 from slots, got shape [2, 3, 17]",
  ),
  "bank_other_dtype": (dict(bank=np.zeros((L, E, P), BF16)), "bank must have the dtype of slots"),
  "src_not_pairs": (
    dict(src=np.zeros((M, 3), np.int32)),
    "src must be [M, 2] (layer, expert) pairs, got shape [3, 3]",
  ),
  "dst_wrong_length": (
    dict(dst=np.zeros((M + 1,), np.int32)),
    "dst must be [M] with M = 3 from src, got shape [4]",
  ),
  "result_shape": (
    dict(result_shape=(N + 1, P)),
    "result must have the shape and dtype of slots [4, 16], got shape [5, 16]",
  ),
  "dst_too_large": (
    dict(dst=np.array([2, N, -1], np.int32)),
    "dst[1] = 4 is outside [-1, N) with N = 4",
  ),
  "dst_below_minus_one": (
    dict(dst=np.array([2, 0, -2], np.int32)),
    "dst[2] = -2 is outside [-1, N) with N = 4",
  ),
  "slot_written_twice": (
    dict(src=np.array([[0, 1], [1, 2], [1, 1]], np.int32), dst=np.array([2, 0, 2], np.int32)),
    "dst[2] = 2 repeats dst[0]: a plan writes each slot at most once",
  ),
  "layer_too_large": (
    dict(src=np.array([[0, 1], [L, 2], [-1, -1]], np.int32)),
    "src[1, 0] = 2 is outside [0, L) with L = 2",
  ),
  "layer_negative": (
    dict(src=np.array([[-1, 1], [1, 2], [-1, -1]], np.int32)),
    "src[0, 0] = -1 is outside [0, L) with L = 2",
  ),
  "expert_too_large": (
    dict(src=np.array([[0, 1], [1, E], [-1, -1]], np.int32)),
    "src[1, 1] = 3 is outside [0, E) with E = 3",
  ),
  "expert_negative": (
    dict(src=np.array([[0, -1], [1, 2], [-1, -1]], np.int32)),
    "src[0, 1] = -1 is outside [0, E) with E = 3",
  ),
}


@pytest.mark.parametrize("error_name", KERNEL_ERRORS)
def test_kernel_rejects_bad_input(error_name):
  changes, message = KERNEL_ERRORS[error_name]
  with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape("ftjax_slot_fill: " + message)):
    call_kernel_directly(**(good_arguments() | changes))


def test_kernel_rejects_sub_byte_dtypes():
  int4 = np.dtype(jnp.int4)
  arguments = good_arguments() | dict(
    slots=np.zeros((N, P), int4), bank=np.zeros((L, E, P), int4)
  )
  with pytest.raises(
    jax.errors.JaxRuntimeError,
    match=re.escape("ftjax_slot_fill: slots and bank must have a dtype of one or more whole bytes"),
  ):
    call_kernel_directly(**arguments)


def test_traced_bad_plan_is_caught_by_the_kernel():
  """Python cannot see a traced plan; the kernel's check reaches the caller through jit."""
  arguments = {name: jnp.asarray(value) for name, value in good_arguments().items()}
  arguments["dst"] = jnp.array([1, 1, -1], jnp.int32)
  with pytest.raises(
    jax.errors.JaxRuntimeError, match=re.escape("dst[1] = 1 repeats dst[0]")
  ):
    jax.block_until_ready(fill_donated(**arguments))
