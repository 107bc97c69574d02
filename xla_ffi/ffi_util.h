// Small helpers shared by the FFI handlers (baseline translation units only).

#ifndef FTJAX_XLA_FFI_FFI_UTIL_H_
#define FTJAX_XLA_FFI_FFI_UTIL_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "cpu_isa.h"
#include "thread_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ftjax {

// "[2, 3]": a shape for error messages.
inline std::string ShapeString(xla::ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(dims[i]);
  }
  return text + "]";
}

// The InvalidArgument error of a handler: "<op>: <message>", where `op` is the op's FFI target
// name (each handler's kOp, e.g. "ftjax_dense"). The Python tests match on these texts.
inline xla::ffi::Error InvalidArgument(std::string_view op, std::string_view message) {
  std::string text(op);
  text += ": ";
  text += message;
  return xla::ffi::Error::InvalidArgument(std::move(text));
}

// What one handler call runs with: the ISA's kernels (FTJAX_ISA) and the threads
// (FTJAX_THREAD_POOL). `error` is set when an environment variable names nothing known.
struct HostSetup {
  const KernelTable* kernels = nullptr;
  Workers workers;
  std::string error;
};

inline HostSetup ChooseHostSetup(xla::ffi::ThreadPool* xla_pool) {
  std::string pool_error;
  Workers workers = Workers::ForCall(xla_pool, &pool_error);
  KernelChoice choice = ChooseKernels();
  return {choice.kernels, workers, !choice.error.empty() ? choice.error : pool_error};
}

// ceil(a / b) for a >= 0, b > 0.
inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace ftjax

#endif  // FTJAX_XLA_FFI_FFI_UTIL_H_
