// ftjax_exp_sub_sum: KernelTable::exp_sub_sum (cpu_kernels.h) row by row, the vectorised exp of
// the online softmax (attention.cc), as an op of its own so that every ISA's version can be
// compared with numpy.
//
//   out[n, m] = exp(x[n, m] - max[n])   (0 where x[n, m] - max[n] < -87)
//   sums[n] = sum_m out[n, m]
//
// Three layers (STYLE.md section 6): ExpSubSumRows (kernel, no XLA types), ExpSubSumImpl
// (validation), FtjaxExpSubSum (binding).

#include <cstdint>
#include <string>
#include <string_view>

#include "cpu_kernels.h"
#include "ffi_util.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ftjax {
namespace {

// The FFI target name, which prefixes every error message.
constexpr std::string_view kOp = "ftjax_exp_sub_sum";

void ExpSubSumRows(const float* x, const float* max, int64_t rows, int64_t columns,
                   const KernelTable& kernels, float* out, float* sums) {
  for (int64_t n = 0; n < rows; ++n) {
    sums[n] = kernels.exp_sub_sum(x + n * columns, max[n], out + n * columns, columns);
  }
}

ffi::Error ExpSubSumImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> max,
                         ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> sums) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) {
    return InvalidArgument(kOp, "x must be float32 [N, M], got shape " + ShapeString(x_dims));
  }
  const int64_t rows = x_dims[0], columns = x_dims[1];
  if (max.dimensions().size() != 1 || max.dimensions()[0] != rows) {
    return InvalidArgument(kOp, "max must be float32 [N] with N = " + std::to_string(rows) +
                                    " from x, got shape " + ShapeString(max.dimensions()));
  }
  const auto out_dims = out->dimensions();
  const auto sums_dims = sums->dimensions();
  if (out_dims.size() != 2 || out_dims[0] != rows || out_dims[1] != columns ||
      sums_dims.size() != 1 || sums_dims[0] != rows) {
    return InvalidArgument(kOp, "results must be out " + ShapeString(x_dims) + " and sums [" +
                                    std::to_string(rows) + "], got " + ShapeString(out_dims) +
                                    " and " + ShapeString(sums_dims));
  }
  const KernelChoice choice = ChooseKernels();
  if (!choice.error.empty()) return InvalidArgument(kOp, choice.error);
  ExpSubSumRows(x.typed_data(), max.typed_data(), rows, columns, *choice.kernels,
                out->typed_data(), sums->typed_data());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace ftjax

// Binding: registered by Python as the CPU target "ftjax_exp_sub_sum".
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxExpSubSum, ftjax::ExpSubSumImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [N, M]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // max [N], subtracted per row
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [N, M]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // sums [N]
);
