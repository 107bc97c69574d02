// What the ops that run the packed-activation GEMMs (cpu_kernels.h) share: packing activation
// rows into groups of 16 tokens, and the scratch memory the ops plan up front and
// reuse across calls. Baseline flags; included by dense.cc and expert_ffn.cc.

#ifndef FTJAX_XLA_FFI_PACKING_H_
#define FTJAX_XLA_FFI_PACKING_H_

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <type_traits>

#include "cpu_kernels.h"

namespace ftjax {

// Packs `count` rows of n activations into `groups` groups of 16 (layouts in cpu_kernels.h),
// zero past the last row (and past n, bf16 pairs).
template <typename PackedT>
void PackRows(const PackedT* const* rows, int64_t count, int64_t groups, int64_t n,
              PackedT* packed) {
  for (int64_t g = 0; g < groups; ++g) {
    PackedT* out = packed + g * PackedGroupElements<PackedT>(n);
    for (int64_t j = 0; j < kPackedGroup; ++j) {
      const int64_t row = g * kPackedGroup + j;
      const PackedT* x = row < count ? rows[row] : nullptr;
      if constexpr (std::is_same_v<PackedT, Bf16Bits>) {
        for (int64_t p = 0; p < (n + 1) / 2; ++p) {
          out[p * 2 * kPackedGroup + 2 * j] = x != nullptr ? x[2 * p] : 0;
          out[p * 2 * kPackedGroup + 2 * j + 1] = x != nullptr && 2 * p + 1 < n ? x[2 * p + 1] : 0;
        }
      } else {
        for (int64_t i = 0; i < n; ++i) out[i * kPackedGroup + j] = x != nullptr ? x[i] : 0.0f;
      }
    }
  }
}

// The packed-activation GEMM for a weight and activation type, or null when the ISA lacks it.
template <typename WeightT, typename ActivationT>
auto PackedDotFor(const KernelTable& kernels) {
  if constexpr (std::is_same_v<ActivationT, int8_t>) {  // no packed int8 x int8 GEMM
    return static_cast<void (*)(const PackedDotProblem<WeightT, int8_t>&)>(nullptr);
  } else if constexpr (std::is_same_v<WeightT, Bf16Bits> && std::is_same_v<ActivationT, Bf16Bits>) {
    return kernels.packed_dot_bf16;
  } else if constexpr (std::is_same_v<WeightT, Bf16Bits>) {
    return kernels.packed_dot_bf16_f32;
  } else if constexpr (std::is_same_v<WeightT, int8_t>) {
    return kernels.packed_dot_i8_f32;
  } else {
    return kernels.packed_dot_f32;
  }
}

// The scratch of one op call, planned before anything runs: regions of typed elements, each
// 64-byte aligned, laid out one after the other. Then Scratch(plan) gives the memory and At()
// each region.
class ScratchPlan {
 public:
  // Adds a region of `count` elements of T and returns its offset in bytes.
  template <typename T>
  int64_t Add(int64_t count) {
    static_assert(std::is_trivially_copyable_v<T>, "scratch holds plain data only");
    const int64_t offset = (bytes_ + kAlign - 1) / kAlign * kAlign;
    bytes_ = offset + count * static_cast<int64_t>(sizeof(T));
    return offset;
  }
  int64_t bytes() const { return bytes_; }
  static constexpr int64_t kAlign = 64;

 private:
  int64_t bytes_ = 0;
};

// The calling thread's scratch buffer, at least plan.bytes() bytes, 64-byte aligned. It is
// grow-only and reused by the thread's next op call (its contents are left over from that call),
// so prefill calls do not allocate and fault in fresh pages every time: XLA runs host custom
// calls on a few threads, each of which keeps the largest scratch it has needed. An op calls this
// once per call, after planning everything (a second call may move the buffer), and must not
// keep pointers into it after it returns.
inline unsigned char* Scratch(const ScratchPlan& plan) {
  struct Buffer {
    struct Free {
      void operator()(unsigned char* p) const { std::free(p); }
    };
    std::unique_ptr<unsigned char[], Free> data;
    int64_t size = 0;
  };
  thread_local Buffer buffer;
  if (buffer.size < plan.bytes() || buffer.data == nullptr) {
    const int64_t size = (std::max<int64_t>(plan.bytes(), 1) + (int64_t{1} << 16) - 1) >> 16 << 16;
    buffer.data.reset();  // free the old buffer first: the peak is the new size alone
    void* p = std::aligned_alloc(ScratchPlan::kAlign, static_cast<size_t>(size));
    if (p == nullptr) throw std::bad_alloc();
    buffer.data.reset(static_cast<unsigned char*>(p));
    buffer.size = size;
  }
  return buffer.data.get();
}

// The region at `offset` (from ScratchPlan::Add<T>) of the buffer from Scratch().
template <typename T>
T* At(unsigned char* scratch, int64_t offset) {
  return reinterpret_cast<T*>(scratch + offset);
}

}  // namespace ftjax

#endif  // FTJAX_XLA_FFI_PACKING_H_
