// ftjax_cpu_info: what the host kernels would run with in this call, for tests and benchmarks:
// [ISA in use, best ISA supported, worker threads, pool (0 own, 1 XLA's), AMX (1 when the packed
// bf16 GEMM runs on AMX tiles)], ISAs numbered as cpu_isa.h's Isa (0 scalar, 1 avx2, 2 avx512,
// 3 avx512bf16). Honours FTJAX_ISA, FTJAX_AMX and FTJAX_THREAD_POOL like the kernels do.
//
// Three layers (STYLE.md section 6), the kernel being trivial: CpuInfoImpl, FtjaxCpuInfo.

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "cpu_isa.h"
#include "ffi_util.h"
#include "thread_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ftjax {
namespace {

// The FFI target name, which prefixes every error message.
constexpr std::string_view kOp = "ftjax_cpu_info";

ffi::Error CpuInfoImpl(ffi::ThreadPool xla_pool, ffi::ResultBuffer<ffi::S32> info) {
  if (info->dimensions().size() != 1 || info->dimensions()[0] != 5) {
    return InvalidArgument(kOp, "result must be [5], got " + ShapeString(info->dimensions()));
  }
  const HostSetup setup = ChooseHostSetup(&xla_pool);
  if (!setup.error.empty()) return InvalidArgument(kOp, setup.error);
  int32_t in_use = 0;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
    if (std::strcmp(setup.kernels->name, IsaName(isa)) == 0) in_use = static_cast<int32_t>(isa);
  }
  int32_t* out = info->typed_data();
  out[0] = in_use;
  out[1] = static_cast<int32_t>(BestSupportedIsa());
  out[2] = setup.workers.num_workers();
  out[3] = setup.workers.kind() == PoolKind::kXla ? 1 : 0;
  out[4] = in_use == static_cast<int32_t>(Isa::kAvx512Bf16) && AmxEnabled() ? 1 : 0;
  return ffi::Error::Success();
}

}  // namespace
}  // namespace ftjax

// Binding: registered by Python as the CPU target "ftjax_cpu_info".
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxCpuInfo, ftjax::CpuInfoImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()        // XLA's intra-op pool
                                  .Ret<ffi::Buffer<ffi::S32>>()  // [isa, best isa, threads, pool, amx]
);
