// AVX2 + FMA kernels: 8-wide float32 FMA for float32 and bf16 weights (bf16 widened in
// registers). Compiled with -mavx2 -mfma -mf16c by its suffix (CMakeLists.txt); on a compiler
// that does not target them the table is absent. See cpu_kernels.h.

#include "cpu_kernels.h"

#if defined(__AVX2__) && defined(__FMA__)

#include <immintrin.h>
#include <math.h>

#include <cstdint>

#include "cpu_kernels_impl.h"

namespace ftjax {
namespace {

inline float Sum256(__m256 v) {
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

// out[j] = sum of the lanes of a_j (see Sum4x512 in cpu_kernels_avx512_common.h).
inline void Sum4x256(__m256 a0, __m256 a1, __m256 a2, __m256 a3, float* out) {
  const __m256 s01 = _mm256_add_ps(_mm256_unpacklo_ps(a0, a1), _mm256_unpackhi_ps(a0, a1));
  const __m256 s23 = _mm256_add_ps(_mm256_unpacklo_ps(a2, a3), _mm256_unpackhi_ps(a2, a3));
  const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}

inline __m256 WidenBf16(__m128i bits) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// AVX2 has no masked 16-bit loads: tails go through a zero-padded copy.
template <typename T>
inline void CopyTail(const T* p, int64_t count, T* padded /* 8 elements */) {
  for (int64_t j = 0; j < 8; ++j) padded[j] = j < count ? p[j] : T(0);
}

struct Bf16F32Ops256 {
  using Weight = Bf16Bits;
  using Activation = float;
  using WeightVec = __m256;
  using ActivationVec = __m256;
  using Acc = __m256;
  static constexpr int64_t kStep = 8;
  static Acc Zero() { return _mm256_setzero_ps(); }
  static WeightVec LoadWeights(const Weight* p) {
    return WidenBf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static WeightVec LoadWeightsTail(const Weight* p, int64_t count) {
    Bf16Bits padded[8];
    CopyTail(p, count, padded);
    return LoadWeights(padded);
  }
  static ActivationVec LoadActivations(const Activation* p) { return _mm256_loadu_ps(p); }
  static ActivationVec LoadActivationsTail(const Activation* p, int64_t count) {
    float padded[8];
    CopyTail(p, count, padded);
    return _mm256_loadu_ps(padded);
  }
  static Acc MulAdd(Acc acc, WeightVec w, ActivationVec a) { return _mm256_fmadd_ps(w, a, acc); }
  static Acc Add(Acc a, Acc b) { return _mm256_add_ps(a, b); }
  static float Sum(Acc acc) { return Sum256(acc); }
  static void Sum4(Acc a0, Acc a1, Acc a2, Acc a3, float* out) { Sum4x256(a0, a1, a2, a3, out); }
};

struct F32F32Ops256 {
  using Weight = float;
  using Activation = float;
  using WeightVec = __m256;
  using ActivationVec = __m256;
  using Acc = __m256;
  static constexpr int64_t kStep = 8;
  static Acc Zero() { return _mm256_setzero_ps(); }
  static WeightVec LoadWeights(const Weight* p) { return _mm256_loadu_ps(p); }
  static WeightVec LoadWeightsTail(const Weight* p, int64_t count) {
    float padded[8];
    CopyTail(p, count, padded);
    return _mm256_loadu_ps(padded);
  }
  static ActivationVec LoadActivations(const Activation* p) { return _mm256_loadu_ps(p); }
  static ActivationVec LoadActivationsTail(const Activation* p, int64_t count) {
    return LoadWeightsTail(p, count);
  }
  static Acc MulAdd(Acc acc, WeightVec w, ActivationVec a) { return _mm256_fmadd_ps(w, a, acc); }
  static Acc Add(Acc a, Acc b) { return _mm256_add_ps(a, b); }
  static float Sum(Acc acc) { return Sum256(acc); }
  static void Sum4(Acc a0, Acc a1, Acc a2, Acc a3, float* out) { Sum4x256(a0, a1, a2, a3, out); }
};

void DotBf16F32Avx2(const DotProblem<Bf16Bits, float>& p) {
  cpu_kernels_impl::Dot<Bf16F32Ops256>(p);
}
void DotF32F32Avx2(const DotProblem<float, float>& p) { cpu_kernels_impl::Dot<F32F32Ops256>(p); }

void RoundToBf16Avx2(const float* in, Bf16Bits* out, int64_t n) {
  cpu_kernels_impl::RoundToBf16Loop(in, out, n);
}

// exp(x) for x in [-87, 88] (clamped outside), Cephes' expf: relative error ~2e-7.
inline __m256 Exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i exponent = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

void SiluMulAvx2(const float* gate, const float* up, float* h, int64_t n) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 sigmoid =
        _mm256_div_ps(one, _mm256_add_ps(one, Exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    _mm256_storeu_ps(h + i, _mm256_mul_ps(_mm256_mul_ps(g, sigmoid), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) h[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

void WeightedRowSumAvx2(const RowSumProblem& p) { cpu_kernels_impl::WeightedRowSumLoop(p); }

uint32_t XorWordsAvx2(const void* data, int64_t n_words) {
  const unsigned char* bytes = static_cast<const unsigned char*>(data);
  __m256i x0 = _mm256_setzero_si256(), x1 = x0, x2 = x0, x3 = x0;
  int64_t i = 0;
  for (; i + 32 <= n_words; i += 32) {  // 128 bytes per round, 4 independent chains
    const __m256i* p = reinterpret_cast<const __m256i*>(bytes + 4 * i);
    x0 = _mm256_xor_si256(x0, _mm256_loadu_si256(p));
    x1 = _mm256_xor_si256(x1, _mm256_loadu_si256(p + 1));
    x2 = _mm256_xor_si256(x2, _mm256_loadu_si256(p + 2));
    x3 = _mm256_xor_si256(x3, _mm256_loadu_si256(p + 3));
  }
  const __m256i x = _mm256_xor_si256(_mm256_xor_si256(x0, x1), _mm256_xor_si256(x2, x3));
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), x);
  uint32_t result = cpu_kernels_impl::XorWordsLoop(bytes + 4 * i, n_words - i);
  for (int j = 0; j < 8; ++j) result ^= lanes[j];
  return result;
}

constexpr int kPeakChains = 12;

float PeakLoopFma256(int64_t iterations, float seed) {
  __m256 acc[kPeakChains];
  for (int j = 0; j < kPeakChains; ++j) acc[j] = _mm256_set1_ps(seed * static_cast<float>(j));
  const __m256 scale = _mm256_set1_ps(1.0f - 1e-7f), add = _mm256_set1_ps(1e-7f * seed);
  for (int64_t it = 0; it < iterations; ++it) {
    for (int j = 0; j < kPeakChains; ++j) acc[j] = _mm256_fmadd_ps(acc[j], scale, add);
  }
  __m256 sum = acc[0];
  for (int j = 1; j < kPeakChains; ++j) sum = _mm256_add_ps(sum, acc[j]);
  return Sum256(sum);
}

const KernelTable kAvx2Table = {
    /*name=*/"avx2",
    /*dot_bf16_bf16=*/nullptr,
    /*packed_dot_bf16=*/nullptr,
    /*packed_dot_bf16_f32=*/nullptr,
    /*packed_dot_f32=*/nullptr,
    /*dot_bf16_f32=*/DotBf16F32Avx2,
    /*dot_f32_f32=*/DotF32F32Avx2,
    /*round_to_bf16=*/RoundToBf16Avx2,
    /*silu_mul=*/SiluMulAvx2,
    /*weighted_row_sum=*/WeightedRowSumAvx2,
    /*xor_words=*/XorWordsAvx2,
    /*peak_loop=*/PeakLoopFma256,
    /*peak_flops_per_iteration=*/kPeakChains * 8 * 2,
};

}  // namespace

const KernelTable* Avx2Kernels() { return &kAvx2Table; }

}  // namespace ftjax

#else

namespace ftjax {
const KernelTable* Avx2Kernels() { return nullptr; }
}  // namespace ftjax

#endif
