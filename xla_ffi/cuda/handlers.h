// The CUDA module's entry points besides the FFI handlers (handlers.cc), used by module.cc.

#ifndef FTJAX_XLA_FFI_CUDA_HANDLERS_H_
#define FTJAX_XLA_FFI_CUDA_HANDLERS_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxCudaPoolFill);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxCudaHostExpertsStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxCudaHostExpertsDone);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxCudaFetchLayerStart);
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxCudaFetchLayerDone);

namespace ftjax::cuda {

// Registers the host pool [L, E, P] at `address` (pinned already, as XLA's pinned_host arrays
// are, or pinned and mapped here with cudaHostRegister). Sets *handle; returns "" or the error.
std::string RegisterPool(uintptr_t address, int64_t bytes, int64_t layers, int64_t experts,
                         int64_t block, int64_t itemsize, int64_t* handle);

// Counters (jobs, host seconds, errors, bad fill rows, pools), the stream-wait mechanism in use
// and the last host-job error.
void ModuleStats(std::vector<std::pair<std::string, double>>* numbers, std::string* wait,
                 std::string* last_error);

}  // namespace ftjax::cuda

#endif  // FTJAX_XLA_FFI_CUDA_HANDLERS_H_
