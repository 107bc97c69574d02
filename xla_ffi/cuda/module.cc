// ftjax._ffi_cuda: the CUDA platform's XLA FFI handlers as PyCapsules, the pool registry and the
// counters. Python registers the handlers for platform "CUDA" (ftjax/kernels/cuda.py).

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "handlers.h"
#include "nanobind/nanobind.h"
#include "nanobind/stl/string.h"

namespace nb = nanobind;

NB_MODULE(_ffi_cuda, m) {
  m.def("registrations", []() {
    nb::dict registrations;
    registrations["ftjax_cuda_pool_fill"] =
        nb::capsule(reinterpret_cast<void*>(FtjaxCudaPoolFill));
    registrations["ftjax_cuda_host_experts_start"] =
        nb::capsule(reinterpret_cast<void*>(FtjaxCudaHostExpertsStart));
    registrations["ftjax_cuda_host_experts_done"] =
        nb::capsule(reinterpret_cast<void*>(FtjaxCudaHostExpertsDone));
    registrations["ftjax_cuda_fetch_layer_start"] =
        nb::capsule(reinterpret_cast<void*>(FtjaxCudaFetchLayerStart));
    registrations["ftjax_cuda_fetch_layer_done"] =
        nb::capsule(reinterpret_cast<void*>(FtjaxCudaFetchLayerDone));
    return registrations;
  });
  m.def("register_pool", [](uintptr_t address, int64_t bytes, int64_t layers, int64_t experts,
                            int64_t block, int64_t itemsize) {
    int64_t handle = -1;
    const std::string error = ftjax::cuda::RegisterPool(address, bytes, layers, experts, block,
                                                        itemsize, &handle);
    if (!error.empty()) throw std::runtime_error("ftjax register_pool: " + error);
    return handle;
  });
  m.def("stats", []() {
    std::vector<std::pair<std::string, double>> numbers;
    std::string wait, last_error;
    ftjax::cuda::ModuleStats(&numbers, &wait, &last_error);
    nb::dict out;
    for (const auto& [name, value] : numbers) out[name.c_str()] = value;
    out["wait"] = wait;
    out["last_error"] = last_error;
    return out;
  });
}
