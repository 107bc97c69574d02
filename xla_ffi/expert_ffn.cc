// ftjax_expert_ffn: the weighted sum of routed SwiGLU experts, on the host (XLA:CPU).
//
//   y[t] = sum_k w[t, k] * down_e(silu(gate_e . x[t]) * (up_e . x[t])),  e = ids[t, k]
//
// with route id -1 meaning "skip this route". Axis letters follow the ftjax glossary:
// T tokens, D model width, F expert hidden width, E experts, K top-k, L layers; P is the
// number of elements in one expert block of the bank (P >= 3 * F * D, the rest is padding).
//
// Three layers, as STYLE.md section 6 asks:
//   ExpertFfn        plain templated kernel, no XLA types;
//   ExpertFfnImpl    unpacks the FFI buffers and rejects bad input with InvalidArgument;
//   FtjaxExpertFfn   the declarative XLA FFI binding (exported to Python by module.cc).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ftjax {
namespace {

// ---------------------------------------------------------------------------------------------
// Kernel (no XLA types).

// Weights are stored as float32 or as bfloat16 bits; both are read as float32.
inline float WeightToFloat(float value) { return value; }

// bfloat16 is the upper 16 bits of an IEEE float32, so widening is a shift.
inline float WeightToFloat(uint16_t bfloat16_bits) {
  const uint32_t float32_bits = static_cast<uint32_t>(bfloat16_bits) << 16;
  float value;
  std::memcpy(&value, &float32_bits, sizeof(value));
  return value;
}

inline float Silu(float a) { return a / (1.0f + std::exp(-a)); }

// sum_i row[i] * v[i], accumulated in float32.
template <typename WeightT>
float Dot(const WeightT* row, const float* v, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    sum += WeightToFloat(row[i]) * v[i];
  }
  return sum;
}

struct ExpertFfnDims {
  int64_t tokens;      // T
  int64_t model_dim;   // D
  int64_t top_k;       // K
  int64_t ffn_dim;     // F
  int64_t block_size;  // P: elements from one expert's block to the next
};

// Computes y_td for one layer's expert blocks `bank_ep` (E blocks of P elements each). Each
// block holds, row-major and contiguous: gate [F, D] at offset 0, up [F, D] at offset F*D and
// down [D, F] at offset 2*F*D. The caller guarantees every id is in [-1, E) and P >= 3*F*D.
//
// Deliberately plain: one thread, scalar loops, every route computed on its own (tokens that
// share an expert read its weights again). A later issue optimises it: group tokens by expert
// and skip empty experts, SIMD with runtime ISA dispatch (AVX-512-BF16 / AVX-512 / AVX2+FMA),
// and threads. This version stays as the readable definition the fast one is tested against.
template <typename WeightT>
void ExpertFfn(const ExpertFfnDims& dims, const float* x_td, const int32_t* ids_tk,
               const float* weights_tk, const WeightT* bank_ep, float* y_td) {
  const int64_t T = dims.tokens, D = dims.model_dim, K = dims.top_k, F = dims.ffn_dim;
  std::vector<float> hidden_f(static_cast<size_t>(F));
  for (int64_t t = 0; t < T; ++t) {
    const float* x_d = x_td + t * D;
    float* y_d = y_td + t * D;
    std::fill(y_d, y_d + D, 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const int32_t expert = ids_tk[t * K + k];
      if (expert < 0) continue;  // -1: route skipped
      const WeightT* block = bank_ep + expert * dims.block_size;
      const WeightT* gate_fd = block;
      const WeightT* up_fd = block + F * D;
      const WeightT* down_df = block + 2 * F * D;
      for (int64_t f = 0; f < F; ++f) {
        hidden_f[f] = Silu(Dot(gate_fd + f * D, x_d, D)) * Dot(up_fd + f * D, x_d, D);
      }
      const float route_weight = weights_tk[t * K + k];
      for (int64_t d = 0; d < D; ++d) {
        y_d[d] += route_weight * Dot(down_df + d * F, hidden_f.data(), F);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// FFI implementation: unpack, validate, dispatch on the bank dtype.

std::string ShapeString(ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(dims[i]);
  }
  return text + "]";
}

ffi::Error InvalidArgument(const std::string& message) {
  return ffi::Error::InvalidArgument("ftjax_expert_ffn: " + message);
}

ffi::Error ExpertFfnImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                         ffi::Buffer<ffi::F32> weights, ffi::AnyBuffer bank,
                         ffi::Buffer<ffi::S32> layer, int64_t ffn_dim,
                         ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) {
    return InvalidArgument("x must be 2-D [T, D], got shape " + ShapeString(x_dims));
  }
  const int64_t T = x_dims[0], D = x_dims[1];

  const auto ids_dims = ids.dimensions();
  if (ids_dims.size() != 2 || ids_dims[0] != T) {
    return InvalidArgument("ids must be [T, K] with T = " + std::to_string(T) +
                           " from x, got shape " + ShapeString(ids_dims));
  }
  const int64_t K = ids_dims[1];

  const auto weights_dims = weights.dimensions();
  if (weights_dims.size() != 2 || weights_dims[0] != T || weights_dims[1] != K) {
    return InvalidArgument("weights must be [T, K] = " + ShapeString(ids_dims) +
                           " like ids, got shape " + ShapeString(weights_dims));
  }

  const auto bank_dims = bank.dimensions();
  if (bank_dims.size() != 3) {
    return InvalidArgument("bank must be 3-D [L, E, P], got shape " + ShapeString(bank_dims));
  }
  const ffi::DataType bank_dtype = bank.element_type();
  if (bank_dtype != ffi::DataType::BF16 && bank_dtype != ffi::DataType::F32) {
    return InvalidArgument("bank must be bfloat16 or float32");
  }
  const int64_t L = bank_dims[0], E = bank_dims[1], P = bank_dims[2];

  if (ffn_dim <= 0) {
    return InvalidArgument("ffn_dim must be positive, got " + std::to_string(ffn_dim));
  }
  // P >= 3 * F * D, written so that a huge ffn_dim cannot overflow.
  if (D > 0 && ffn_dim > P / (3 * D)) {
    return InvalidArgument("bank's last dimension P = " + std::to_string(P) +
                           " is smaller than 3 * ffn_dim * D = 3 * " + std::to_string(ffn_dim) +
                           " * " + std::to_string(D));
  }

  if (layer.dimensions().size() != 0) {
    return InvalidArgument("layer must be an int32 scalar, got shape " +
                           ShapeString(layer.dimensions()));
  }
  // Host platform: operands live in host memory, so the scalar can be read directly.
  const int64_t layer_index = *layer.typed_data();
  if (layer_index < 0 || layer_index >= L) {
    return InvalidArgument("layer = " + std::to_string(layer_index) +
                           " is outside [0, L) with L = " + std::to_string(L));
  }

  const auto y_dims = y->dimensions();
  if (y_dims.size() != 2 || y_dims[0] != T || y_dims[1] != D) {
    return InvalidArgument("result y must have x's shape " + ShapeString(x_dims) + ", got " +
                           ShapeString(y_dims));
  }

  const int32_t* ids_tk = ids.typed_data();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t expert = ids_tk[t * K + k];
      if (expert < -1 || expert >= E) {
        return InvalidArgument("ids[" + std::to_string(t) + ", " + std::to_string(k) + "] = " +
                               std::to_string(expert) + " is outside [-1, E) with E = " +
                               std::to_string(E));
      }
    }
  }

  const ExpertFfnDims dims{T, D, K, ffn_dim, P};
  const int64_t layer_offset = layer_index * E * P;
  if (bank_dtype == ffi::DataType::BF16) {
    ExpertFfn(dims, x.typed_data(), ids_tk, weights.typed_data(),
              bank.reinterpret_data<uint16_t>() + layer_offset, y->typed_data());
  } else {
    ExpertFfn(dims, x.typed_data(), ids_tk, weights.typed_data(),
              bank.typed_data<float>() + layer_offset, y->typed_data());
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace ftjax

// ---------------------------------------------------------------------------------------------
// Binding: registered by Python as the CPU target "ftjax_expert_ffn".

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxExpertFfn, ftjax::ExpertFfnImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [T, K], -1 = skip
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights [T, K]
                                  .Arg<ffi::AnyBuffer>()         // bank [L, E, P], bf16 or f32
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [], index into L
                                  .Attr<int64_t>("ffn_dim")      // F
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, D]
);
