// Which instruction set the host kernels use: detected once, lowered by FTJAX_ISA.

#ifndef FTJAX_XLA_FFI_CPU_ISA_H_
#define FTJAX_XLA_FFI_CPU_ISA_H_

#include <string>

#include "cpu_kernels.h"

namespace ftjax {

// Ordered: each level implies the ones below it.
enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

const char* IsaName(Isa isa);

// The best ISA that this CPU and OS support and this build contains:
//   kAvx512Bf16  AVX-512 F/BW/VL/DQ + AVX512_BF16 + FMA + F16C, and the OS saves zmm state;
//   kAvx512      the same without BF16;
//   kAvx2        AVX2 + FMA + F16C, and the OS saves ymm state;
//   kScalar      anything else (including non-x86 CPUs).
// Detected on the first call (cpuid and xgetbv) and constant afterwards.
Isa BestSupportedIsa();

struct KernelChoice {
  const KernelTable* kernels = nullptr;  // null when `error` is set
  std::string error;
};

// The kernels to use for one call: those of BestSupportedIsa(), or of the ISA named by the
// environment variable FTJAX_ISA (scalar, avx2, avx512, avx512bf16) when that is lower. A name
// above what the CPU supports gives the best supported one. FTJAX_ISA is read on every call (a
// getenv), so a process (a test) can switch ISAs between calls.
KernelChoice ChooseKernels();

// Whether the avx512bf16 kernels' packed bf16 GEMM (bf16 weights times bf16-rounded activations:
// prefill and batches with bf16_activations) runs on AMX tiles: the CPU has AMX-TILE and
// AMX-BF16, the OS saves the tile state, Linux granted this process the tile data
// (arch_prctl ARCH_REQ_XCOMP_PERM), and this build has the AMX kernel. Detected once.
bool AmxSupported();
// AmxSupported() unless the environment sets FTJAX_AMX=0 (read on every call, like FTJAX_ISA):
// then the packed GEMM runs on AVX-512-BF16 (vdpbf16ps) as on CPUs without AMX. Values other
// than 0 and 1 make ChooseKernels() an error.
bool AmxEnabled();

}  // namespace ftjax

#endif  // FTJAX_XLA_FFI_CPU_ISA_H_
