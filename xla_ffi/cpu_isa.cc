// CPU feature detection for the runtime ISA dispatch (cpu_isa.h). Baseline flags only.

#include "cpu_isa.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace ftjax {
namespace {

#if defined(__x86_64__) || defined(__i386__)

bool Bit(uint32_t value, int bit) { return (value >> bit) & 1u; }

// XCR0: which register states the OS saves on a context switch (needs OSXSAVE).
uint64_t ReadXcr0() {
  uint32_t eax, edx;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

Isa DetectIsa() {
  uint32_t eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return Isa::kScalar;
  const bool osxsave = Bit(ecx, 27), avx = Bit(ecx, 28), fma = Bit(ecx, 12), f16c = Bit(ecx, 29);
  if (!osxsave || !avx || !fma || !f16c) return Isa::kScalar;
  const uint64_t xcr0 = ReadXcr0();
  const bool os_saves_ymm = (xcr0 & 0x6) == 0x6;            // SSE and AVX state
  const bool os_saves_zmm = os_saves_ymm && (xcr0 & 0xe0) == 0xe0;  // opmask, ZMM_Hi256, Hi16_ZMM
  if (!os_saves_ymm) return Isa::kScalar;

  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return Isa::kScalar;
  const bool avx2 = Bit(ebx, 5);
  const bool avx512 = Bit(ebx, 16) /*F*/ && Bit(ebx, 17) /*DQ*/ && Bit(ebx, 30) /*BW*/ &&
                      Bit(ebx, 31) /*VL*/;
  const uint32_t max_subleaf = eax;
  const bool avx512_vnni = Bit(ecx, 11);  // every CPU with AVX-512-BF16 has it too
  bool avx512_bf16 = false;
  if (max_subleaf >= 1 && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) {
    avx512_bf16 = Bit(eax, 5);
  }

  if (avx512 && os_saves_zmm) {
    if (avx512_bf16 && avx512_vnni && Avx512Bf16Kernels() != nullptr) return Isa::kAvx512Bf16;
    if (Avx512Kernels() != nullptr) return Isa::kAvx512;
  }
  if (avx2 && Avx2Kernels() != nullptr) return Isa::kAvx2;
  return Isa::kScalar;
}

bool IsAmd() {
  uint32_t eax, vendor[3];
  if (!__get_cpuid(0, &eax, &vendor[0], &vendor[2], &vendor[1])) return false;  // ebx, edx, ecx
  return std::memcmp(vendor, "AuthenticAMD", 12) == 0;
}

#else

Isa DetectIsa() { return Isa::kScalar; }
bool IsAmd() { return false; }

#endif

bool DetectPrefetchNonTemporal() {
  const char* requested = std::getenv("FTJAX_PREFETCH");
  if (requested != nullptr && std::strcmp(requested, "nta") == 0) return true;
  if (requested != nullptr && std::strcmp(requested, "l2") == 0) return false;
  return IsAmd();
}

const KernelTable* KernelsFor(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16: return Avx512Bf16Kernels();
    case Isa::kAvx512: return Avx512Kernels();
    case Isa::kAvx2: return Avx2Kernels();
    case Isa::kScalar: break;
  }
  return ScalarKernels();
}

}  // namespace

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kAvx512Bf16: return "avx512bf16";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    case Isa::kScalar: break;
  }
  return "scalar";
}

bool PrefetchNonTemporal() {
  static const bool non_temporal = DetectPrefetchNonTemporal();  // one-time, thread-safe
  return non_temporal;
}

Isa BestSupportedIsa() {
  static const Isa best = DetectIsa();  // thread-safe one-time initialisation; never changes
  return best;
}

KernelChoice ChooseKernels() {
  const Isa best = BestSupportedIsa();
  Isa isa = best;
  if (const char* requested = std::getenv("FTJAX_ISA"); requested != nullptr && *requested) {
    bool known = false;
    for (Isa candidate : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512, Isa::kAvx512Bf16}) {
      if (std::strcmp(requested, IsaName(candidate)) == 0) {
        known = true;
        if (candidate < best) isa = candidate;
      }
    }
    if (!known) {
      return {nullptr, std::string("FTJAX_ISA = \"") + requested +
                           "\" is not one of scalar, avx2, avx512, avx512bf16"};
    }
  }
  return {KernelsFor(isa), ""};
}

}  // namespace ftjax
