// ftjax_argmax: the greedy token of each row of a batch's logits, KernelTable::argmax_f32 over
// parts of the rows spread over the threads, in jnp.argmax's order (the first index of the
// largest value; a NaN counts as the largest, the first NaN wins).
//
//   out[n] = argmax_m x[n, m]
//
// XLA:CPU lowers jnp.argmax to a variadic reduce of (value, index) pairs, one element at a time:
// 2.9 ms for 8 rows of the 35B-shaped model's 248,320 logits on the Xeon VM, where a read of the
// same 7.9 MB takes 0.3 ms. Here each row is read once in blocks that stay in L1.
//
// Three layers (STYLE.md section 6): ArgmaxRows (kernel, no XLA types), ArgmaxImpl
// (validation), FtjaxArgmax (binding).

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "cpu_kernels.h"
#include "ffi_util.h"
#include "thread_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ftjax {
namespace {

// The FFI target name, which prefixes every error message.
constexpr std::string_view kOp = "ftjax_argmax";
// A row is split over the threads only into parts of at least this many values (below it a
// part costs less than handing it to a thread).
constexpr int64_t kMinPart = 16384;

// out[r] for the `rows` rows of `columns` values at x: each row cut into `parts` ranges, one task
// each, and the ranges' results combined in order (the first NaN, else the first largest).
void ArgmaxRows(const float* x, int64_t rows, int64_t columns, const KernelTable& kernels,
                const Workers& workers, int32_t* out) {
  const int64_t want = CeilDiv(workers.num_workers(), rows);
  const int64_t parts = std::max<int64_t>(1, std::min(want, columns / kMinPart));
  std::vector<ArgmaxResult> found(static_cast<size_t>(rows * parts));
  workers.ParallelFor(rows * parts, [&](int64_t task, int) {
    const int64_t r = task / parts, p = task % parts;
    const int64_t begin = columns * p / parts, end = columns * (p + 1) / parts;
    ArgmaxResult part = kernels.argmax_f32(x + r * columns + begin, end - begin);
    part.index += begin;
    found[task] = part;
  });
  for (int64_t r = 0; r < rows; ++r) {
    ArgmaxResult best = found[r * parts];
    for (int64_t p = 1; p < parts && !best.nan; ++p) {
      const ArgmaxResult& next = found[r * parts + p];
      if (next.nan || next.value > best.value) best = next;
    }
    out[r] = static_cast<int32_t>(best.index);
  }
}

ffi::Error ArgmaxImpl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x,
                      ffi::ResultBuffer<ffi::S32> out) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) {
    return InvalidArgument(kOp, "x must be float32 [N, M], got shape " + ShapeString(x_dims));
  }
  const int64_t rows = x_dims[0], columns = x_dims[1];
  if (columns == 0 || columns > std::numeric_limits<int32_t>::max()) {
    return InvalidArgument(kOp, "x must have between 1 and 2**31 - 1 columns (the index is "
                                "int32), got shape " + ShapeString(x_dims));
  }
  if (out->dimensions().size() != 1 || out->dimensions()[0] != rows) {
    return InvalidArgument(kOp, "the result must be int32 [" + std::to_string(rows) +
                                    "] (N from x), got shape " + ShapeString(out->dimensions()));
  }
  if (rows == 0) return ffi::Error::Success();
  const HostSetup setup = ChooseHostSetup(&xla_pool);
  if (!setup.error.empty()) return InvalidArgument(kOp, setup.error);
  ArgmaxRows(x.typed_data(), rows, columns, *setup.kernels, setup.workers, out->typed_data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace ftjax

// Binding: registered by Python as the CPU target "ftjax_argmax".
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxArgmax, ftjax::ArgmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()        // XLA's intra-op pool
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [N, M]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // out [N]
);
