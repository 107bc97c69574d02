// ftjax_dense: y = x @ w.T for a dense weight w [O, C] ([out, in], bf16 or float32) on the host.
// (O output features, C contracted inputs: the package glossary keeps K for top-k, N for slots;
// the code below names them N and K as a GEMM does.)
//
//   y[t, n] = sum_k x[t, k] * w[n, k]
//
// XLA:CPU reaches only a few GB/s on bf16 matrix-vector products; this op streams the weights at
// memory bandwidth (decode, T = 1: a GEMV) and runs a blocked GEMM for prefill (T up to ~1024).
// Used for the q/k/v/o projections, routers, shared experts and lm_head on the CPU backend.
//
// Three layers (STYLE.md section 6): Dense (kernel, no XLA types), DenseImpl (validation),
// FtjaxDense (binding).
//
// Work split: one task per tile of kRowTile rows of w (N split across the threads); a task runs
// all tokens against its rows in tiles of kTokenTile tokens, so its weight rows (kRowTile * K
// elements, 256 KiB for K = 2048 bf16) stay in L2 while the tokens go past, and inside the dot
// kernel 4 rows at a time stay in L1. Each weight element is read from memory once.
// Accumulation is float32. bf16 weights are widened to float32 in registers (float32 FMA, exact
// products). With the attribute bf16_activations and an AVX-512-BF16 CPU, x is rounded to bf16
// once and multiplied with vdpbf16ps instead: twice the multiply-add rate for the compute-bound
// GEMM, relative error ~1e-2 of max|y|.

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "ffi_util.h"
#include "thread_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ftjax {
namespace {

// ---------------------------------------------------------------------------------------------
// Kernel (no XLA types).

constexpr int64_t kTokenTile = 64;

// Rows of w per task: about 256 KiB of weights, a multiple of 8 rows, at least 8.
int64_t RowTile(int64_t k, int64_t weight_bytes) {
  const int64_t rows = (int64_t{256} << 10) / std::max<int64_t>(k * weight_bytes, 1);
  return std::max<int64_t>(8, rows / 8 * 8);
}

template <typename WeightT, typename ActivationT>
void RunDense(int64_t tokens, int64_t n_out, int64_t k, const ActivationT* x_tk,
              const WeightT* w_nk, void (*dot)(const DotProblem<WeightT, ActivationT>&),
              const Workers& workers, float* y_tn) {
  std::vector<const ActivationT*> x_rows(tokens);
  for (int64_t t = 0; t < tokens; ++t) x_rows[t] = x_tk + t * k;
  const int64_t row_tile = RowTile(k, sizeof(WeightT));
  workers.ParallelFor(CeilDiv(n_out, row_tile), [&](int64_t task, int /*worker*/) {
    const int64_t n0 = task * row_tile;
    const int64_t rows = std::min(row_tile, n_out - n0);
    for (int64_t t0 = 0; t0 < tokens; t0 += kTokenTile) {
      const int64_t tile = std::min(kTokenTile, tokens - t0);
      dot({w_nk + n0 * k, k, rows, x_rows.data() + t0, tile, k, y_tn + t0 * n_out + n0, n_out});
    }
  });
}

template <typename WeightT>
void Dense(int64_t tokens, int64_t n_out, int64_t k, const float* x_tk, const WeightT* w_nk,
           bool bf16_activations, const KernelTable& kernels, const Workers& workers,
           float* y_tn) {
  if (k == 0) {
    std::fill_n(y_tn, tokens * n_out, 0.0f);
    return;
  }
  if constexpr (std::is_same_v<WeightT, Bf16Bits>) {
    if (bf16_activations && kernels.dot_bf16_bf16 != nullptr) {
      std::vector<Bf16Bits> x_bf16(tokens * k);
      kernels.round_to_bf16(x_tk, x_bf16.data(), tokens * k);
      RunDense(tokens, n_out, k, x_bf16.data(), w_nk, kernels.dot_bf16_bf16, workers, y_tn);
    } else {
      RunDense(tokens, n_out, k, x_tk, w_nk, kernels.dot_bf16_f32, workers, y_tn);
    }
  } else {
    RunDense(tokens, n_out, k, x_tk, w_nk, kernels.dot_f32_f32, workers, y_tn);
  }
}

// ---------------------------------------------------------------------------------------------
// FFI implementation.

// The FFI target name, which prefixes every error message.
constexpr std::string_view kOp = "ftjax_dense";

ffi::Error DenseImpl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                     bool bf16_activations, ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) {
    return InvalidArgument(kOp, "x must be 2-D [T, C], got shape " + ShapeString(x_dims));
  }
  const int64_t T = x_dims[0], K = x_dims[1];
  const auto w_dims = w.dimensions();
  if (w_dims.size() != 2 || w_dims[1] != K) {
    return InvalidArgument(kOp, "w must be [O, C] with C = " + std::to_string(K) +
                                " from x, got shape " + ShapeString(w_dims));
  }
  const ffi::DataType w_dtype = w.element_type();
  if (w_dtype != ffi::DataType::BF16 && w_dtype != ffi::DataType::F32) {
    return InvalidArgument(kOp, "w must be bfloat16 or float32");
  }
  const int64_t N = w_dims[0];
  const auto y_dims = y->dimensions();
  if (y_dims.size() != 2 || y_dims[0] != T || y_dims[1] != N) {
    return InvalidArgument(kOp, "result y must be [T, O] = [" + std::to_string(T) + ", " +
                                std::to_string(N) + "], got " + ShapeString(y_dims));
  }

  const HostSetup setup = ChooseHostSetup(&xla_pool);
  if (!setup.error.empty()) return InvalidArgument(kOp, setup.error);

  if (w_dtype == ffi::DataType::BF16) {
    Dense(T, N, K, x.typed_data(), w.reinterpret_data<Bf16Bits>(), bf16_activations,
          *setup.kernels, setup.workers, y->typed_data());
  } else {
    Dense(T, N, K, x.typed_data(), w.typed_data<float>(), bf16_activations, *setup.kernels,
          setup.workers, y->typed_data());
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace ftjax

// Binding: registered by Python as the CPU target "ftjax_dense".
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxDense, ftjax::DenseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()        // XLA's intra-op pool
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, C]
                                  .Arg<ffi::AnyBuffer>()         // w [O, C], bf16 or f32
                                  .Attr<bool>("bf16_activations")  // vdpbf16ps for bf16 w
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, O]
);
