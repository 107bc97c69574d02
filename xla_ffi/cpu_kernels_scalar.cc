// Portable kernels: baseline compiler flags, no intrinsics. The reference for the SIMD files and
// the fallback on any CPU (FTJAX_ISA=scalar forces it). See cpu_kernels.h.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"
#include "cpu_kernels_impl.h"

namespace ftjax {
namespace {

inline float Bf16ToFloat(Bf16Bits bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

inline float ToFloat(float value) { return value; }
inline float ToFloat(Bf16Bits bits) { return Bf16ToFloat(bits); }
inline float ToFloat(int8_t value) { return static_cast<float>(value); }

// One element per step: the accumulator is a plain float.
template <typename WeightT, typename ActivationT>
struct ScalarOps {
  using Weight = WeightT;
  using Activation = ActivationT;
  using WeightVec = float;
  using ActivationVec = float;
  using Acc = float;
  static constexpr int64_t kStep = 1;
  static constexpr int kVectorRegisters = 32;
  static Acc Zero() { return 0.0f; }
  static WeightVec LoadWeights(const Weight* p) { return ToFloat(*p); }
  static WeightVec LoadWeightsTail(const Weight*, int64_t) { return 0.0f; }  // never: kStep 1
  static ActivationVec LoadActivations(const Activation* p) { return ToFloat(*p); }
  static ActivationVec LoadActivationsTail(const Activation*, int64_t) { return 0.0f; }
  static Acc MulAdd(Acc acc, WeightVec w, ActivationVec a) { return acc + w * a; }
  static Acc Add(Acc a, Acc b) { return a + b; }
  static float Sum(Acc acc) { return acc; }
  static void Sum4(Acc a0, Acc a1, Acc a2, Acc a3, float* out) {
    out[0] = a0;
    out[1] = a1;
    out[2] = a2;
    out[3] = a3;
  }
};

void DotBf16F32(const DotProblem<Bf16Bits, float>& p) {
  cpu_kernels_impl::Dot<ScalarOps<Bf16Bits, float>>(p);
}
void DotF32F32(const DotProblem<float, float>& p) {
  cpu_kernels_impl::Dot<ScalarOps<float, float>>(p);
}
void DotI8F32(const DotProblem<int8_t, float>& p) {
  cpu_kernels_impl::Dot<ScalarOps<int8_t, float>>(p);
}

void DotMxfp4F32(const Mxfp4DotProblem& p) {
  cpu_kernels_impl::DotMxfp4<ScalarOps<float, float>, cpu_kernels_impl::DecodeMxfp4Loop>(p);
}
void DotInt4F32(const Int4DotProblem& p) {
  if (p.tokens == 1) {
    cpu_kernels_impl::OneTokenInt4Loop(p);
  } else {
    cpu_kernels_impl::DotInt4<ScalarOps<float, float>, cpu_kernels_impl::DecodeInt4Loop>(p);
  }
}

void RoundToBf16(const float* in, Bf16Bits* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &in[i], sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
      out[i] = static_cast<Bf16Bits>((bits >> 16) | 0x40u);  // NaN: keep it a (quiet) NaN
    } else {
      out[i] = static_cast<Bf16Bits>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
  }
}

void SiluMul(const float* gate, const float* up, float* h, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void WeightedRowSum(const RowSumProblem<float>& p) { cpu_kernels_impl::WeightedRowSumLoop(p); }
void WeightedRowSumBf16(const RowSumProblem<Bf16Bits>& p) {
  cpu_kernels_impl::WeightedRowSumLoop(p);
}

// exp(in[i] - max): Cephes' single-precision exp (relative error below 2e-7) in plain float
// arithmetic, so that the loops vectorise (to SSE2 here), unlike calls of std::exp.
float ExpSubSum(const float* in, float max, float* out, int64_t n) {
  constexpr float kLowest = -87.0f;      // below: 0
  constexpr float kHighest = 88.0f;      // above: clamped (e^88 < float32's largest)
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: (y + kRound) - kRound rounds y
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2High = 0.693359375f;  // ln 2 = kLn2High + kLn2Low
  constexpr float kLn2Low = -2.12194440e-4f;
  float lanes[8] = {};
  for (int64_t s0 = 0; s0 < n; s0 += 8) {
    const int64_t count = n - s0 < 8 ? n - s0 : 8;
    for (int64_t i = 0; i < count; ++i) {
      const float x = in[s0 + i] - max;
      const float y = x < kLowest ? kLowest : (x > kHighest ? kHighest : x);
      const float k = (y * kLog2e + kRound) - kRound;  // exp(y) = 2^k exp(r), |r| <= ln2 / 2
      const float r = (y - k * kLn2High) - k * kLn2Low;
      float poly = 1.9875691500e-4f;
      poly = poly * r + 1.3981999507e-3f;
      poly = poly * r + 8.3334519073e-3f;
      poly = poly * r + 4.1665795894e-2f;
      poly = poly * r + 1.6666665459e-1f;
      poly = poly * r + 5.0000001201e-1f;
      const float exp_r = poly * r * r + r + 1.0f;
      const int32_t exponent_bits = (static_cast<int32_t>(k) + 127) * (1 << 23);  // 2^k
      float two_to_k;
      std::memcpy(&two_to_k, &exponent_bits, sizeof(two_to_k));
      const float e = x >= kLowest ? exp_r * two_to_k : 0.0f;
      out[s0 + i] = e;
      lanes[i] += e;
    }
  }
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
         ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

uint32_t XorWords(const void* data, int64_t n_words) {
  const unsigned char* bytes = static_cast<const unsigned char*>(data);
  uint64_t wide = 0;  // two words at a time
  int64_t i = 0;
  for (; i + 2 <= n_words; i += 2) {
    uint64_t pair;
    std::memcpy(&pair, bytes + 4 * i, sizeof(pair));
    wide ^= pair;
  }
  uint32_t result = static_cast<uint32_t>(wide) ^ static_cast<uint32_t>(wide >> 32);
  if (i < n_words) {
    uint32_t word;
    std::memcpy(&word, bytes + 4 * i, sizeof(word));
    result ^= word;
  }
  return result;
}

constexpr int kPeakChains = 8;

float PeakLoop(int64_t iterations, float seed) {
  float acc[kPeakChains];
  for (int j = 0; j < kPeakChains; ++j) acc[j] = seed * static_cast<float>(j + 1);
  const float scale = 1.0f - 1e-7f, add = 1e-7f * seed;
  for (int64_t it = 0; it < iterations; ++it) {
    for (int j = 0; j < kPeakChains; ++j) acc[j] = acc[j] * scale + add;
  }
  float sum = 0.0f;
  for (int j = 0; j < kPeakChains; ++j) sum += acc[j];
  return sum;
}

const KernelTable kScalarTable = {
    /*name=*/"scalar",
    /*dot_bf16_bf16=*/nullptr,
    /*packed_dot_bf16=*/nullptr,
    /*packed_dot_bf16_f32=*/nullptr,
    /*packed_dot_f32=*/nullptr,
    /*packed_min_tokens=*/0,
    /*dot_bf16_f32=*/DotBf16F32,
    /*dot_f32_f32=*/DotF32F32,
    /*round_to_bf16=*/RoundToBf16,
    /*silu_mul=*/SiluMul,
    /*weighted_row_sum=*/WeightedRowSum,
    /*weighted_row_sum_bf16=*/WeightedRowSumBf16,
    /*score_f32_f32=*/DotF32F32,
    /*score_bf16_f32=*/DotBf16F32,
    /*exp_sub_sum=*/ExpSubSum,
    /*xor_words=*/XorWords,
    /*peak_loop=*/PeakLoop,
    /*peak_flops_per_iteration=*/2 * kPeakChains,
    /*dot_i8_f32=*/DotI8F32,
    /*packed_dot_i8_f32=*/nullptr,
    /*dot_i8_i8=*/nullptr,
    /*dot_mxfp4_f32=*/DotMxfp4F32,
    /*decode_mxfp4=*/cpu_kernels_impl::DecodeMxfp4Loop,
    /*dot_mxfp4_q8=*/cpu_kernels_impl::DotMxfp4Q8Loop,
    /*packed_dot_mxfp4_f32=*/nullptr,
    /*dot_int4_f32=*/DotInt4F32,
    /*decode_int4=*/cpu_kernels_impl::DecodeInt4Loop,
    /*delta_rule_step=*/cpu_kernels_impl::DeltaRuleStepLoop,
    /*argmax_f32=*/cpu_kernels_impl::ArgmaxLoop,
};

}  // namespace

const KernelTable* ScalarKernels() { return &kScalarTable; }

}  // namespace ftjax
