// ftjax_read_probe: reads a whole buffer with the threads and ISA of the other host kernels and
// returns the XOR of its little-endian 32-bit words (the last one zero-padded), so that the read
// cannot be optimised away. Timing it gives the host's read-bandwidth ceiling, against which the
// expert kernel and the GEMV are reported (benchmarks/expert_kernel.py, python -m ftjax.profile).
// The ISA's xor_words does the reading: several independent vector loads per round, and on AVX2
// and AVX-512 the same software prefetch as the one-token dot kernels (cpu_kernels_impl.h), so
// that what the kernels get from prefetching the probe gets too and its GB/s is a ceiling for them.
//
// Three layers (STYLE.md section 6): ReadProbe (kernel), ReadProbeImpl, FtjaxReadProbe.

#include <algorithm>
#include <cstdint>
#include <cstring>
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
constexpr std::string_view kOp = "ftjax_read_probe";

// 4 MiB per task: each task starts a new stream (see GemvRowTile in dense.cc); 1, 2 and 4 MiB
// measured within 2% of each other on the Zen 5 VM, the larger ones ahead.
constexpr int64_t kChunkWords = int64_t{1} << 20;

uint32_t ReadProbe(const unsigned char* data, int64_t n_bytes, const KernelTable& kernels,
                   const Workers& workers) {
  const int64_t n_words = n_bytes / 4;
  // One checksum per worker, each on its own cache line.
  struct alignas(64) Partial {
    uint32_t value = 0;
  };
  std::vector<Partial> partial(workers.num_workers());
  workers.ParallelFor(CeilDiv(n_words, kChunkWords), [&](int64_t task, int worker) {
    const int64_t w0 = task * kChunkWords;
    partial[worker].value ^=
        kernels.xor_words(data + 4 * w0, std::min(kChunkWords, n_words - w0));
  });
  uint32_t checksum = 0;
  for (const Partial& p : partial) checksum ^= p.value;
  if (const int64_t rest = n_bytes % 4; rest > 0) {  // the zero-padded last word
    uint32_t last = 0;
    std::memcpy(&last, data + 4 * n_words, rest);
    checksum ^= last;
  }
  return checksum;
}

ffi::Error ReadProbeImpl(ffi::ThreadPool xla_pool, ffi::AnyBuffer buffer,
                         ffi::ResultBuffer<ffi::U32> checksum) {
  if (checksum->dimensions().size() != 0) {
    return InvalidArgument(kOp, "result checksum must be a scalar, got " +
                                ShapeString(checksum->dimensions()));
  }
  const HostSetup setup = ChooseHostSetup(&xla_pool);
  if (!setup.error.empty()) return InvalidArgument(kOp, setup.error);
  *checksum->typed_data() =
      ReadProbe(static_cast<const unsigned char*>(buffer.untyped_data()),
                static_cast<int64_t>(buffer.size_bytes()), *setup.kernels, setup.workers);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace ftjax

// Binding: registered by Python as the CPU target "ftjax_read_probe".
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxReadProbe, ftjax::ReadProbeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()        // XLA's intra-op pool
                                  .Arg<ffi::AnyBuffer>()         // buffer, any shape and dtype
                                  .Ret<ffi::Buffer<ffi::U32>>()  // checksum []
);
