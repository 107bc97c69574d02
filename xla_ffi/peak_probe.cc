// ftjax_peak_probe: the host's multiply-add peak with the ISA and threads of the other kernels.
//
// Runs `tasks` rounds of a register-only loop of `iterations` iterations (vdpbf16ps on
// AVX-512-BF16, float32 FMA otherwise; cpu_kernels.h, KernelTable::peak_loop) spread over the
// workers, and returns [checksum, flops]: timing the call gives the flop/s ceiling that the
// grouped (prefill) expert kernel and the dense GEMM are compared with. No memory is touched.
//
// Three layers (STYLE.md section 6): PeakProbe (kernel), PeakProbeImpl, FtjaxPeakProbe.

#include <cstdint>
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
constexpr std::string_view kOp = "ftjax_peak_probe";

// Returns the checksum; *flops is the number of multiply-add flops done.
float PeakProbe(int64_t tasks, int64_t iterations, const KernelTable& kernels,
                const Workers& workers, double* flops) {
  std::vector<float> results(tasks);
  workers.ParallelFor(tasks, [&](int64_t task, int /*worker*/) {
    results[task] = kernels.peak_loop(iterations, 1.0f + 1e-3f * static_cast<float>(task));
  });
  float checksum = 0.0f;
  for (float r : results) checksum += r;
  *flops = static_cast<double>(tasks) * static_cast<double>(iterations) *
           static_cast<double>(kernels.peak_flops_per_iteration);
  return checksum;
}

ffi::Error PeakProbeImpl(ffi::ThreadPool xla_pool, int64_t tasks, int64_t iterations,
                         ffi::ResultBuffer<ffi::F32> out) {
  if (tasks < 1 || iterations < 1) {
    return InvalidArgument(kOp, "tasks and iterations must be positive");
  }
  if (out->dimensions().size() != 1 || out->dimensions()[0] != 2) {
    return InvalidArgument(kOp, "result must be [2], got " + ShapeString(out->dimensions()));
  }
  const HostSetup setup = ChooseHostSetup(&xla_pool);
  if (!setup.error.empty()) return InvalidArgument(kOp, setup.error);
  double flops = 0.0;
  out->typed_data()[0] = PeakProbe(tasks, iterations, *setup.kernels, setup.workers, &flops);
  out->typed_data()[1] = static_cast<float>(flops);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace ftjax

// Binding: registered by Python as the CPU target "ftjax_peak_probe".
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxPeakProbe, ftjax::PeakProbeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()        // XLA's intra-op pool
                                  .Attr<int64_t>("tasks")        // rounds, spread over workers
                                  .Attr<int64_t>("iterations")   // loop length of one round
                                  .Ret<ffi::Buffer<ffi::F32>>()  // [checksum, flops]
);
