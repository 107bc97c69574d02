// ftjax_slot_fill: copies expert blocks from the host bank into device-cache slots, in place.
//
//   slots[dst[m]] = bank[src[m, 0], src[m, 1]]   for every m with dst[m] != -1
//
// Axis letters follow the ftjax glossary: L layers, E experts, N cache slots; M is the number
// of rows of a fill plan (padded with dst = -1 to a static length) and P the number of
// elements of one expert block. Each copy is one memcpy of P elements: an expert block is
// contiguous in the bank, and so is a slot.
//
// The result aliases `slots` (Python passes input_output_aliases={0: 0}), so only the filled
// slots are written. That is in place only if the caller donates `slots` under jit; otherwise
// XLA copies the whole cache into a fresh buffer before this handler runs.
//
// Three layers, as STYLE.md section 6 asks:
//   SlotFill         plain kernel, no XLA types;
//   SlotFillImpl     unpacks the FFI buffers and rejects bad input with InvalidArgument;
//   FtjaxSlotFill    the declarative XLA FFI binding (exported to Python by module.cc).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "ffi_util.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ftjax {
namespace {

// ---------------------------------------------------------------------------------------------
// Kernel (no XLA types).

struct SlotFillDims {
  int64_t rows;         // M
  int64_t experts;      // E
  int64_t block_bytes;  // P * bytes per element
};

// Copies block (layer, expert) = src_m2[m] of `bank` into slot dst_m[m] of `slots` for every
// row m whose dst is not -1. Blocks are `block_bytes` apart in both buffers. The caller
// guarantees that every used (layer, expert) and slot is in range and that no slot is
// written twice, so the copies are independent.
//
// One thread: a fill is bound by memory bandwidth, and splitting the copies over this
// project's 2-core machines made them only 1.15-1.3x faster (memcpy of 8 Qwen3-30B-A3B expert
// blocks, 9.4 MB each: 11.7-12.9 GB/s copied with one thread, 13.5-16.5 GB/s with two). On a
// CPU-only host the best setting has no cache at all (DESIGN section 1), and in the q* policy
// a fill runs next to the host expert kernel, which needs the cores more.
void SlotFill(const SlotFillDims& dims, const std::byte* bank, const int32_t* src_m2,
              const int32_t* dst_m, std::byte* slots) {
  for (int64_t m = 0; m < dims.rows; ++m) {
    const int32_t slot = dst_m[m];
    if (slot == -1) continue;  // padding row of the plan
    const int64_t block = static_cast<int64_t>(src_m2[2 * m]) * dims.experts + src_m2[2 * m + 1];
    std::memcpy(slots + slot * dims.block_bytes, bank + block * dims.block_bytes,
                static_cast<size_t>(dims.block_bytes));
  }
}

// ---------------------------------------------------------------------------------------------
// FFI implementation: unpack, validate, copy.

// The FFI target name, which prefixes every error message.
constexpr std::string_view kOp = "ftjax_slot_fill";

// Sub-byte types may be packed several to a byte, so "P elements" is not a whole number of
// bytes; every other type is copied as raw bytes whatever it holds.
bool HasWholeBytes(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::INVALID:
    case ffi::DataType::TOKEN:
    case ffi::DataType::S1:
    case ffi::DataType::S2:
    case ffi::DataType::S4:
    case ffi::DataType::U1:
    case ffi::DataType::U2:
    case ffi::DataType::U4:
    case ffi::DataType::F4E2M1FN:
      return false;
    default:
      return true;
  }
}

ffi::Error SlotFillImpl(ffi::AnyBuffer slots, ffi::AnyBuffer bank, ffi::Buffer<ffi::S32> src,
                        ffi::Buffer<ffi::S32> dst, ffi::Result<ffi::AnyBuffer> slots_out) {
  const auto slots_dims = slots.dimensions();
  if (slots_dims.size() != 2) {
    return InvalidArgument(kOp, "slots must be 2-D [N, P], got shape " + ShapeString(slots_dims));
  }
  const int64_t N = slots_dims[0], P = slots_dims[1];

  const auto bank_dims = bank.dimensions();
  if (bank_dims.size() != 3) {
    return InvalidArgument(kOp, "bank must be 3-D [L, E, P], got shape " + ShapeString(bank_dims));
  }
  const int64_t L = bank_dims[0], E = bank_dims[1];
  if (bank_dims[2] != P) {
    return InvalidArgument(kOp, "bank must be [L, E, P] with P = " + std::to_string(P) +
                                " from slots, got shape " + ShapeString(bank_dims));
  }
  const ffi::DataType dtype = slots.element_type();
  if (bank.element_type() != dtype) {
    return InvalidArgument(kOp, "bank must have the dtype of slots");
  }
  if (!HasWholeBytes(dtype)) {
    return InvalidArgument(kOp, "slots and bank must have a dtype of one or more whole bytes");
  }

  const auto src_dims = src.dimensions();
  if (src_dims.size() != 2 || src_dims[1] != 2) {
    return InvalidArgument(kOp, "src must be [M, 2] (layer, expert) pairs, got shape " +
                                ShapeString(src_dims));
  }
  const int64_t M = src_dims[0];
  const auto dst_dims = dst.dimensions();
  if (dst_dims.size() != 1 || dst_dims[0] != M) {
    return InvalidArgument(kOp, "dst must be [M] with M = " + std::to_string(M) +
                                " from src, got shape " + ShapeString(dst_dims));
  }

  const auto out_dims = slots_out->dimensions();
  if (slots_out->element_type() != dtype || out_dims.size() != 2 || out_dims[0] != N ||
      out_dims[1] != P) {
    return InvalidArgument(kOp, "result must have the shape and dtype of slots " +
                                ShapeString(slots_dims) + ", got shape " + ShapeString(out_dims));
  }

  // Host platform: the plan lives in host memory and can be read directly. Every row is
  // checked before anything is written, so a bad plan leaves the cache as it was.
  const int32_t* src_m2 = src.typed_data();
  const int32_t* dst_m = dst.typed_data();
  std::vector<int64_t> writer_of_slot(static_cast<size_t>(N), -1);  // row that fills each slot
  for (int64_t m = 0; m < M; ++m) {
    const int32_t slot = dst_m[m];
    if (slot == -1) continue;  // padding: its src is not read and may hold anything
    if (slot < -1 || slot >= N) {
      return InvalidArgument(kOp, "dst[" + std::to_string(m) + "] = " + std::to_string(slot) +
                                  " is outside [-1, N) with N = " + std::to_string(N));
    }
    int64_t& writer = writer_of_slot[static_cast<size_t>(slot)];
    if (writer != -1) {
      return InvalidArgument(kOp, "dst[" + std::to_string(m) + "] = " + std::to_string(slot) +
                                  " repeats dst[" + std::to_string(writer) +
                                  "]: a plan writes each slot at most once");
    }
    writer = m;
    const int32_t layer = src_m2[2 * m], expert = src_m2[2 * m + 1];
    if (layer < 0 || layer >= L) {
      return InvalidArgument(kOp, "src[" + std::to_string(m) + ", 0] = " + std::to_string(layer) +
                                  " is outside [0, L) with L = " + std::to_string(L));
    }
    if (expert < 0 || expert >= E) {
      return InvalidArgument(kOp, "src[" + std::to_string(m) + ", 1] = " + std::to_string(expert) +
                                  " is outside [0, E) with E = " + std::to_string(E));
    }
  }

  std::byte* slots_data = static_cast<std::byte*>(slots_out->untyped_data());
  // With input_output_aliases={0: 0} XLA hands over one buffer for both. A caller that binds
  // the op without the alias gets a fresh result buffer, which must start as a copy of slots.
  if (slots_data != slots.untyped_data()) {
    std::memcpy(slots_data, slots.untyped_data(), slots.size_bytes());
  }
  const SlotFillDims dims{M, E, P * static_cast<int64_t>(ffi::ByteWidth(dtype))};
  SlotFill(dims, static_cast<const std::byte*>(bank.untyped_data()), src_m2, dst_m, slots_data);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace ftjax

// ---------------------------------------------------------------------------------------------
// Binding: registered by Python as the CPU target "ftjax_slot_fill".

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxSlotFill, ftjax::SlotFillImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()         // slots [N, P], aliased by result
                                  .Arg<ffi::AnyBuffer>()         // bank [L, E, P], slots' dtype
                                  .Arg<ffi::Buffer<ffi::S32>>()  // src [M, 2] (layer, expert)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // dst [M] slot, -1 = skip row
                                  .Ret<ffi::AnyBuffer>()         // slots [N, P] after the fill
);
