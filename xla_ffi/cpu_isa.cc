// CPU feature detection for the runtime ISA dispatch (cpu_isa.h). Baseline flags only.

#include "cpu_isa.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
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

bool DetectAmx() {
  uint32_t eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !Bit(ecx, 27) /*OSXSAVE*/) return false;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = Bit(edx, 22), amx_tile = Bit(edx, 24);
  const uint64_t tile_state = (uint64_t{1} << 17) | (uint64_t{1} << 18);  // XTILECFG, XTILEDATA
  if (!amx_bf16 || !amx_tile || (ReadXcr0() & tile_state) != tile_state) return false;
  if (!Avx512Bf16HasAmx() || BestSupportedIsa() != Isa::kAvx512Bf16) return false;
#if defined(__linux__) && defined(SYS_arch_prctl)
  // Linux hands out the 8 KiB tile data per process on request (kernel 5.16+); without the
  // grant the first tile instruction faults.
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

bool IsAmd() {
  uint32_t eax, vendor[3];
  if (!__get_cpuid(0, &eax, &vendor[0], &vendor[2], &vendor[1])) return false;  // ebx, edx, ecx
  return std::memcmp(vendor, "AuthenticAMD", 12) == 0;
}

#else

Isa DetectIsa() { return Isa::kScalar; }
bool DetectAmx() { return false; }
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

// The tuning's fields, each its own relaxed atomic: a call that reads while another thread sets
// sees a mix of old and new fields, every mix of which is a valid tuning.
struct AtomicTuning {
  std::atomic<int32_t> prefetch_bytes{-1}, prefetch_hint{0}, row_accumulators{0}, block_rows{0},
      gemv_task_kib{0}, packed_min_tokens{-1};
};
AtomicTuning& TuningStore() {
  static AtomicTuning store;
  return store;
}

KernelTuning CurrentKernelTuning() {
  const AtomicTuning& s = TuningStore();
  constexpr auto kRelaxed = std::memory_order_relaxed;
  KernelTuning t;
  t.prefetch_bytes = s.prefetch_bytes.load(kRelaxed);
  t.prefetch_hint = s.prefetch_hint.load(kRelaxed);
  t.row_accumulators = s.row_accumulators.load(kRelaxed);
  t.block_rows = s.block_rows.load(kRelaxed);
  t.gemv_task_kib = s.gemv_task_kib.load(kRelaxed);
  t.packed_min_tokens = s.packed_min_tokens.load(kRelaxed);
  return t;
}

const char* SetKernelTuning(const KernelTuning& t) {
  if (t.prefetch_bytes < -1 || t.prefetch_bytes > 65536 ||
      (t.prefetch_bytes > 0 && t.prefetch_bytes % 64 != 0)) {
    return "prefetch_bytes must be -1 (default), 0 (none) or a multiple of 64 up to 65536";
  }
  if (t.prefetch_hint < 0 || t.prefetch_hint > 2) {
    return "prefetch_hint must be 0 (default), 1 (nta) or 2 (l2)";
  }
  if (t.row_accumulators != 0 && t.row_accumulators != 4 && t.row_accumulators != 8) {
    return "row_accumulators must be 0 (default), 4 or 8";
  }
  if (t.block_rows < 0 || t.block_rows > 4) {
    return "block_rows must be 0 (default), 1, 2, 3 or 4";
  }
  if (t.gemv_task_kib != 0 && (t.gemv_task_kib < 64 || t.gemv_task_kib > 65536)) {
    return "gemv_task_kib must be 0 (default) or 64 to 65536";
  }
  if (t.packed_min_tokens < -1 || t.packed_min_tokens > 4096) {
    return "packed_min_tokens must be -1 (default) or 0 to 4096";
  }
  AtomicTuning& s = TuningStore();
  constexpr auto kRelaxed = std::memory_order_relaxed;
  s.prefetch_bytes.store(t.prefetch_bytes, kRelaxed);
  s.prefetch_hint.store(t.prefetch_hint, kRelaxed);
  s.row_accumulators.store(t.row_accumulators, kRelaxed);
  s.block_rows.store(t.block_rows, kRelaxed);
  s.gemv_task_kib.store(t.gemv_task_kib, kRelaxed);
  s.packed_min_tokens.store(t.packed_min_tokens, kRelaxed);
  return "";
}

bool TunedPrefetchNonTemporal(const KernelTuning& tuning) {
  return tuning.prefetch_hint == 0 ? PrefetchNonTemporal() : tuning.prefetch_hint == 1;
}

int64_t PackedMinTokens(const KernelTable& kernels, bool bf16_pairs, PackedUse use) {
  const int32_t tuned = TuningStore().packed_min_tokens.load(std::memory_order_relaxed);
  if (tuned >= 0) return tuned;
  if (bf16_pairs && kernels.packed_dot_bf16 != nullptr &&
      std::strcmp(kernels.name, IsaName(Isa::kAvx512Bf16)) == 0 && AmxEnabled()) {
    return use == PackedUse::kDense ? kAmxDensePackedMinTokens : kAmxPackedMinTokens;
  }
  return kernels.packed_min_tokens;
}

Isa BestSupportedIsa() {
  static const Isa best = DetectIsa();  // thread-safe one-time initialisation; never changes
  return best;
}

bool AmxSupported() {
  static const bool supported = DetectAmx();  // one-time: the permission request included
  return supported;
}

bool AmxEnabled() {
  if (!AmxSupported()) return false;
  const char* requested = std::getenv("FTJAX_AMX");  // 0 or 1: ChooseKernels rejects the rest
  return requested == nullptr || std::strcmp(requested, "0") != 0;
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
  if (const char* amx = std::getenv("FTJAX_AMX");
      amx != nullptr && *amx && std::strcmp(amx, "0") != 0 && std::strcmp(amx, "1") != 0) {
    return {nullptr, std::string("FTJAX_AMX = \"") + amx + "\" is not one of 0, 1"};
  }
  return {KernelsFor(isa), ""};
}

}  // namespace ftjax
