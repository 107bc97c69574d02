// AVX-512-BF16 kernels: bf16 weights against bf16-rounded activations with vdpbf16ps (32
// multiply-adds of bf16 pairs into 16 float32 lanes per instruction), int8 weights against
// int8 activations with vpdpbusd (AVX-512-VNNI, which every AVX-512-BF16 CPU has; cpu_isa.cc
// checks both), plus the AVX-512 float32 paths. Compiled with the AVX-512, -mavx512bf16 and
// -mavx512vnni flags by its suffix (CMakeLists.txt); on a compiler that does not target them the
// table is absent. See cpu_kernels.h.

#include "cpu_kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__) && \
    defined(__FMA__)

#include "cpu_kernels_avx512_common.h"
#include "cpu_kernels_mxfp4_avx2.h"

namespace ftjax {
namespace {

inline __m512bh AsBf16(__m512i bits) { return (__m512bh)bits; }

struct Bf16Bf16Ops512 {
  using Weight = Bf16Bits;
  using Activation = Bf16Bits;
  using WeightVec = __m512bh;
  using ActivationVec = __m512bh;
  using Acc = __m512;
  static constexpr int64_t kStep = 32;
  static constexpr int kVectorRegisters = 32;
  static __mmask32 FirstLanes(int64_t count) {  // count < 32
    return static_cast<__mmask32>((1u << count) - 1u);
  }
  static Acc Zero() { return _mm512_setzero_ps(); }
  static WeightVec LoadWeights(const Weight* p) { return AsBf16(_mm512_loadu_si512(p)); }
  static WeightVec LoadWeightsTail(const Weight* p, int64_t count) {
    return AsBf16(_mm512_maskz_loadu_epi16(FirstLanes(count), p));
  }
  static ActivationVec LoadActivations(const Activation* p) {
    return AsBf16(_mm512_loadu_si512(p));
  }
  static ActivationVec LoadActivationsTail(const Activation* p, int64_t count) {
    return AsBf16(_mm512_maskz_loadu_epi16(FirstLanes(count), p));
  }
  // Lane j += w[2j] * a[2j] + w[2j + 1] * a[2j + 1].
  static Acc MulAdd(Acc acc, WeightVec w, ActivationVec a) { return _mm512_dpbf16_ps(acc, w, a); }
  static Acc Add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static float Sum(Acc acc) { return Sum512(acc); }
  static void Sum4(Acc a0, Acc a1, Acc a2, Acc a3, float* out) { Sum4x512(a0, a1, a2, a3, out); }
};

void DotBf16Bf16Avx512(const DotProblem<Bf16Bits, Bf16Bits>& p) {
  cpu_kernels_impl::Dot<Bf16Bf16Ops512>(p);
}

// int8 weights x int8 activations, 64 a step, exact int32 sums. vpdpbusd multiplies unsigned by
// signed bytes (and adds groups of 4 products into int32 lanes), so each step multiplies |a| by
// the weights negated where a < 0: w * a = (sign(a) w) * |a|, with |-128| = 128 as an unsigned
// byte and sign(a) w in [-127, 127] for weights in [-127, 127]. A lane holds at most
// n / 16 * 4 products of at most 127 * 128, exact in int32 for n below 2^31 / 16256.
struct I8I8Ops512 {
  using Weight = int8_t;
  using Activation = int8_t;
  using WeightVec = __m512i;
  struct ActivationVec {
    __m512i magnitude;  // |a| as unsigned bytes
    __mmask64 negative;  // a < 0
  };
  using Acc = __m512i;
  static constexpr int64_t kStep = 64;
  static constexpr int kVectorRegisters = 32;
  static __mmask64 FirstLanes(int64_t count) {  // count < 64
    return static_cast<__mmask64>((uint64_t{1} << count) - 1u);
  }
  static ActivationVec Split(__m512i a) { return {_mm512_abs_epi8(a), _mm512_movepi8_mask(a)}; }
  static Acc Zero() { return _mm512_setzero_si512(); }
  static WeightVec LoadWeights(const Weight* p) { return _mm512_loadu_si512(p); }
  static WeightVec LoadWeightsTail(const Weight* p, int64_t count) {
    return _mm512_maskz_loadu_epi8(FirstLanes(count), p);
  }
  static ActivationVec LoadActivations(const Activation* p) {
    return Split(_mm512_loadu_si512(p));
  }
  static ActivationVec LoadActivationsTail(const Activation* p, int64_t count) {
    return Split(_mm512_maskz_loadu_epi8(FirstLanes(count), p));
  }
  static Acc MulAdd(Acc acc, WeightVec w, ActivationVec a) {
    const __m512i signed_w = _mm512_mask_sub_epi8(w, a.negative, _mm512_setzero_si512(), w);
    return _mm512_dpbusd_epi32(acc, a.magnitude, signed_w);
  }
  static Acc Add(Acc a, Acc b) { return _mm512_add_epi32(a, b); }
  static float Sum(Acc acc) { return static_cast<float>(_mm512_reduce_add_epi32(acc)); }
  static void Sum4(Acc a0, Acc a1, Acc a2, Acc a3, float* out) {
    out[0] = Sum(a0);
    out[1] = Sum(a1);
    out[2] = Sum(a2);
    out[3] = Sum(a3);
  }
};

void DotI8I8Avx512(const DotProblem<int8_t, int8_t>& p) { cpu_kernels_impl::Dot<I8I8Ops512>(p); }

// The packed-activation GEMM (cpu_kernels.h): kRows weight rows x kGroups groups of 16 tokens
// (plus, with kHalf, the first 8 tokens of one more group in 256-bit vectors) in accumulators;
// per pair of inputs: one vector load of activations per group, one broadcast load of a weight
// pair per row, one vdpbf16ps per accumulator. Measured on one Zen 4 core with the weights
// streamed from memory and 32 tokens: 3.3 vdpbf16ps per ns (about the register-only peak),
// against 2.3 for the dot-product kernel, whose 4 x 4 blocks need horizontal sums and re-read 4
// weight rows per 4 tokens.
template <int kRows, int kGroups, bool kHalf>
inline void PackedMicroKernel(const Bf16Bits* w, int64_t w_stride, const Bf16Bits* packed,
                              int64_t group_stride, int64_t n, float* ct, int64_t c_stride) {
  __m512 acc[kRows][kGroups > 0 ? kGroups : 1];
  __m256 acc_half[kRows];
  for (int r = 0; r < kRows; ++r) {
    for (int g = 0; g < kGroups; ++g) acc[r][g] = _mm512_setzero_ps();
    if constexpr (kHalf) acc_half[r] = _mm256_setzero_ps();
  }
  const Bf16Bits* half = packed + kGroups * group_stride;
  // One pair of inputs: `pair_of_row(r)` gives row r's two weights as one 32-bit word.
  auto step = [&](int64_t p, auto pair_of_row) {
    __m512bh x[kGroups > 0 ? kGroups : 1];
    for (int g = 0; g < kGroups; ++g) {
      x[g] = AsBf16(_mm512_loadu_si512(packed + g * group_stride + p * 32));
    }
    __m256bh x_half;
    if constexpr (kHalf) {
      x_half = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half + p * 32));
    }
    for (int r = 0; r < kRows; ++r) {
      const __m512i w_pair = _mm512_set1_epi32(pair_of_row(r));
      for (int g = 0; g < kGroups; ++g) {
        acc[r][g] = _mm512_dpbf16_ps(acc[r][g], AsBf16(w_pair), x[g]);
      }
      if constexpr (kHalf) {
        acc_half[r] =
            _mm256_dpbf16_ps(acc_half[r], (__m256bh)_mm512_castsi512_si256(w_pair), x_half);
      }
    }
  };
  const int64_t full_pairs = n / 2;
  for (int64_t p = 0; p < full_pairs; ++p) {
    step(p, [&](int r) {
      int32_t pair;
      __builtin_memcpy(&pair, w + r * w_stride + 2 * p, sizeof(pair));
      return pair;
    });
  }
  if (n % 2 == 1) {  // the last input alone; its packed partner is zero
    step(full_pairs, [&](int r) { return static_cast<int32_t>(w[r * w_stride + n - 1]); });
  }
  for (int r = 0; r < kRows; ++r) {
    for (int g = 0; g < kGroups; ++g) _mm512_storeu_ps(ct + r * c_stride + 16 * g, acc[r][g]);
    if constexpr (kHalf) _mm256_storeu_ps(ct + r * c_stride + 16 * kGroups, acc_half[r]);
  }
}

struct PackedBf16Kernels {
  using Weight = Bf16Bits;
  using Packed = Bf16Bits;
  template <int kRows, int kGroups, bool kHalf>
  static void Run(const Bf16Bits* w, int64_t w_stride, const Bf16Bits* packed,
                  int64_t group_stride, int64_t n, float* ct, int64_t c_stride) {
    PackedMicroKernel<kRows, kGroups, kHalf>(w, w_stride, packed, group_stride, n, ct, c_stride);
  }
};

void PackedDotBf16(const PackedDotProblem<Bf16Bits, Bf16Bits>& p) {
  PackedPasses<PackedBf16Kernels>(p);
}

// vcvtneps2bf16: round to nearest even, NaN stays NaN.
void RoundToBf16Avx512Bf16(const float* in, Bf16Bits* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_loadu_ps(in + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), (__m256i)rounded);
  }
  if (i < n) {
    const __mmask16 mask = FirstLanes16(n - i);
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, in + i));
    _mm256_mask_storeu_epi16(out + i, mask, (__m256i)rounded);
  }
}

constexpr int kPeakChainsBf16 = 12;

float PeakLoopBf16(int64_t iterations, float seed) {
  __m512 acc[kPeakChainsBf16];
  for (int j = 0; j < kPeakChainsBf16; ++j) acc[j] = _mm512_set1_ps(seed * static_cast<float>(j));
  // Small factors, so that the sums stay finite for any realistic number of iterations.
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f * seed), _mm512_set1_ps(1e-3f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f * seed));
  for (int64_t it = 0; it < iterations; ++it) {
    for (int j = 0; j < kPeakChainsBf16; ++j) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
  }
  __m512 sum = acc[0];
  for (int j = 1; j < kPeakChainsBf16; ++j) sum = _mm512_add_ps(sum, acc[j]);
  return Sum512(sum);
}

const KernelTable kAvx512Bf16Table = {
    /*name=*/"avx512bf16",
    /*dot_bf16_bf16=*/DotBf16Bf16Avx512,
    /*packed_dot_bf16=*/PackedDotBf16,
    /*packed_dot_bf16_f32=*/PackedDotBf16F32Avx512,
    /*packed_dot_f32=*/PackedDotF32Avx512,
    /*packed_min_tokens=*/kPackedGroup,
    /*dot_bf16_f32=*/DotBf16F32Avx512,
    /*dot_f32_f32=*/DotF32F32Avx512,
    /*round_to_bf16=*/RoundToBf16Avx512Bf16,
    /*silu_mul=*/SiluMulAvx512,
    /*weighted_row_sum=*/WeightedRowSumAvx512,
    /*weighted_row_sum_bf16=*/WeightedRowSumBf16Avx512,
    /*score_f32_f32=*/ScoreF32Avx512,
    /*score_bf16_f32=*/ScoreBf16Avx512,
    /*exp_sub_sum=*/ExpSubSumAvx512,
    /*xor_words=*/XorWordsAvx512,
    /*peak_loop=*/PeakLoopBf16,
    /*peak_flops_per_iteration=*/kPeakChainsBf16 * 32 * 2,
    /*dot_i8_f32=*/DotI8F32Avx512,
    /*packed_dot_i8_f32=*/PackedDotI8F32Avx512,
    /*dot_i8_i8=*/DotI8I8Avx512,
    /*dot_mxfp4_f32=*/DotMxfp4F32Avx512,
    /*decode_mxfp4=*/DecodeMxfp4Avx512,
    /*dot_mxfp4_q8=*/mxfp4_avx2::DotQ8,
    /*packed_dot_mxfp4_f32=*/nullptr,
};

}  // namespace

const KernelTable* Avx512Bf16Kernels() { return &kAvx512Bf16Table; }

}  // namespace ftjax

#else

namespace ftjax {
const KernelTable* Avx512Bf16Kernels() { return nullptr; }
}  // namespace ftjax

#endif
