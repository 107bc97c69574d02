// AVX2 + FMA kernels: 8-wide float32 FMA for float32 and bf16 weights (bf16 widened in
// registers). Compiled with -mavx2 -mfma -mf16c by its suffix (CMakeLists.txt); on a compiler
// that does not target them the table is absent. See cpu_kernels.h.

#include "cpu_kernels.h"

#if defined(__AVX2__) && defined(__FMA__)

#include <immintrin.h>
#include <math.h>

#include <cstdint>

#include "cpu_kernels_impl.h"
#include "cpu_kernels_mxfp4_avx2.h"

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
  static constexpr int kVectorRegisters = 16;
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
  static constexpr int kVectorRegisters = 16;
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

// int8 weights widened exactly, then F32F32Ops256: 8 bytes sign-extended to 8 int32 lanes and
// converted to float32. 8 weights (8 bytes) a step, so the one-token row loop keeps 8
// accumulators (kRowPassBytes).
struct I8F32Ops256 : F32F32Ops256 {
  using Weight = int8_t;
  static WeightVec LoadWeights(const Weight* p) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static WeightVec LoadWeightsTail(const Weight* p, int64_t count) {
    int8_t padded[8];
    CopyTail(p, count, padded);
    return LoadWeights(padded);
  }
};

void DotI8F32Avx2(const DotProblem<int8_t, float>& p) { cpu_kernels_impl::Dot<I8F32Ops256>(p); }

// mxfp4 decode (cpu_kernels_impl::DecodeMxfp4Loop's result): per block of 32 inputs, the 8
// magnitudes and the 8 negative values times the block's scale in two registers; each code
// picks from both with vpermps on its low 3 bits and vblendvps on its sign bit (bit 3, shifted
// to bit 31); the low and high nibbles' values are then interleaved into input order.
void DecodeMxfp4Avx2(const uint8_t* codes, const uint8_t* scales, int64_t n, float* out) {
  const __m256 positive = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256 negative = _mm256_setr_ps(-0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
  auto lookup = [](__m256 pos, __m256 neg, __m256i index) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(pos, index),
                            _mm256_permutevar8x32_ps(neg, index),
                            _mm256_castsi256_ps(_mm256_slli_epi32(index, 28)));
  };
  for (int64_t b = 0; b < n / 32; ++b) {
    const __m256 scale = _mm256_set1_ps(cpu_kernels_impl::Mxfp4Scale(scales[b]));
    const __m256 pos = _mm256_mul_ps(positive, scale), neg = _mm256_mul_ps(negative, scale);
    for (int half = 0; half < 2; ++half) {
      const __m256i bytes = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 16 * b + 8 * half)));
      const __m256 low = lookup(pos, neg, bytes);                            // inputs 2j
      const __m256 high = lookup(pos, neg, _mm256_srli_epi32(bytes, 4));     // inputs 2j + 1
      const __m256 u0 = _mm256_unpacklo_ps(low, high), u1 = _mm256_unpackhi_ps(low, high);
      float* o = out + 32 * b + 16 * half;
      _mm256_storeu_ps(o, _mm256_permute2f128_ps(u0, u1, 0x20));
      _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(u0, u1, 0x31));
    }
  }
}
// One token (the decode GEMV), fused, with as few vector operations per weight as this ISA
// allows (the loop is bound by them: the earlier form, vpshufb to twice the E2M1 values as int8,
// widened and converted, ran ~42 per 64 weights; a vpermps lookup with a blend for the sign
// ~52). Per group of 2 blocks (64 inputs, 32 code bytes, one block per 128-bit lane): the low
// and high nibbles look up the high and the low bytes of their E2M1 values' bfloat16 bits
// (4 vpshufb: bfloat16 holds E2M1 exactly; the sign is in the high byte); vpunpck{l,h}bw pairs
// them into 4 vectors of 16 bfloat16 values, whose even words shifted left by 16 and odd words
// masked are float32 (8 vectors), multiplied with a copy of the activations permuted to match
// once per call: 29 operations per 64 weights. Each lane half's sum is multiplied by its
// block's scale (a power of two: exact), the scales of a row's blocks converted 8 at a time
// before its groups. Same products as the dequantised weights', summed in another order. An
// odd last block takes the low lane, the high one reading codes and inputs of zero. The codes
// `ahead_bytes` ahead (the tuning's, as the one-token row kernels) are prefetched; inputs past
// kMxfp4OneTokenChunk are taken in further chunks, each row's partial sums added.
// The loop of the 4-bit one-token kernels: codes as mxfp4's (32 bytes per group of 2 blocks),
// each nibble looked up as the high and low bytes of its value's bfloat16 bits (`high_bytes`,
// `low_bytes`, both lanes alike). Per chunk of inputs, prepare(i, blocks, x) runs once, then per
// row scales_of(r, i, blocks, scale_of) fills the 8 lane multipliers of each group and
// finish(r, i, sum) takes the row's sum of the scaled group sums.
template <int kLocality, typename Prepare, typename ScalesOf, typename Finish>
void OneToken4BitAvx2(const uint8_t* codes_base, int64_t code_stride, int64_t rows_total,
                      const float* x_all, int64_t n_total, __m256i high_bytes, __m256i low_bytes,
                      int64_t ahead_bytes, Prepare prepare, ScalesOf scales_of, Finish finish) {
  if (rows_total <= 0) return;
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const __m256i top_half = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  const uintptr_t prefetch_end =
      reinterpret_cast<uintptr_t>(codes_base + (rows_total - 1) * code_stride + n_total / 2);
  constexpr int64_t kChunk = cpu_kernels_impl::kMxfp4OneTokenChunk;
  alignas(32) float x_p[kChunk];  // an odd last block's group ends at kChunk at most
  alignas(32) float scale_of[kChunk / 8];  // 8 per group of 2 blocks
  for (int64_t i = 0; i < n_total; i += kChunk) {
    const int64_t blocks = (n_total - i < kChunk ? n_total - i : kChunk) / 32;
    const int64_t groups = blocks / 2, last = blocks & 1;
    const float* x = x_all + i;
    prepare(i, blocks, x);
    // The activations in the order of the products below: the 8 floats at
    // x_p + 64 g + 8 (2 m + par) are, in lane l (block 2 g + l), the inputs 32 l + 16 (m & 1) +
    // (m >> 1) + 2 par + 4 d of the group, d = 0..3: per lane and half of a block (16 inputs as
    // 4 rows of 4), the columns of a 4 x 4 transpose.
    for (int64_t g = 0; g < groups + last; ++g) {
      const float* xg = x + 64 * g;
      const bool second = g < groups;
      for (int h = 0; h < 2; ++h) {
        __m256 row[4];
        for (int d = 0; d < 4; ++d) {
          const __m128 a = _mm_loadu_ps(xg + 16 * h + 4 * d);
          const __m128 b = second ? _mm_loadu_ps(xg + 32 + 16 * h + 4 * d) : _mm_setzero_ps();
          row[d] = _mm256_insertf128_ps(_mm256_castps128_ps256(a), b, 1);
        }
        const __m256 t0 = _mm256_unpacklo_ps(row[0], row[1]);
        const __m256 t1 = _mm256_unpackhi_ps(row[0], row[1]);
        const __m256 t2 = _mm256_unpacklo_ps(row[2], row[3]);
        const __m256 t3 = _mm256_unpackhi_ps(row[2], row[3]);
        const __m256 column[4] = {_mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2)),
                                  _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2))};
        for (int c = 0; c < 4; ++c) {  // column c: m = h + 2 (c & 1), par = c >> 1
          const int m = h + 2 * (c & 1), par = c >> 1;
          _mm256_store_ps(x_p + 64 * g + 8 * (2 * m + par), column[c]);
        }
      }
    }
    for (int64_t r = 0; r < rows_total; ++r) {
      const uint8_t* codes = codes_base + r * code_stride + i / 2;
      // The unscaled sum of a group's products, its two blocks in the two lane halves.
      auto group = [&](int64_t g, __m256i bytes) -> __m256 {
        const float* xg = x_p + 64 * g;
        const __m256i lo = _mm256_and_si256(bytes, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
        const __m256i words[4] = {
            _mm256_unpacklo_epi8(_mm256_shuffle_epi8(low_bytes, lo),
                                 _mm256_shuffle_epi8(high_bytes, lo)),
            _mm256_unpackhi_epi8(_mm256_shuffle_epi8(low_bytes, lo),
                                 _mm256_shuffle_epi8(high_bytes, lo)),
            _mm256_unpacklo_epi8(_mm256_shuffle_epi8(low_bytes, hi),
                                 _mm256_shuffle_epi8(high_bytes, hi)),
            _mm256_unpackhi_epi8(_mm256_shuffle_epi8(low_bytes, hi),
                                 _mm256_shuffle_epi8(high_bytes, hi))};
        __m256 half[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int m = 0; m < 4; ++m) {
          half[0] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(words[m], 16)),
                                    _mm256_load_ps(xg + 16 * m), half[0]);
          half[1] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(words[m], top_half)),
                                    _mm256_load_ps(xg + 16 * m + 8), half[1]);
        }
        return _mm256_add_ps(half[0], half[1]);
      };
      scales_of(r, i, blocks, scale_of);
      auto add = [&](int64_t g, __m256i bytes, __m256& acc) {
        acc = _mm256_fmadd_ps(group(g, bytes), _mm256_load_ps(scale_of + 8 * g), acc);
      };
      const float sum = mxfp4_avx2::SumGroups<kLocality>(codes, groups, last, ahead_bytes,
                                                         prefetch_end, add);
      finish(r, i, sum);
    }
  }
}

template <int kLocality>
void OneTokenMxfp4Avx2(const Mxfp4DotProblem& p, int64_t ahead_bytes) {
  // bf16 bits of the E2M1 values: high bytes (sign in bit 7) and low bytes, in both lanes.
  const __m256i high_bytes = _mm256_setr_epi8(
      0x00, 0x3f, 0x3f, 0x3f, 0x40, 0x40, 0x40, 0x40, -128, -65, -65, -65, -64, -64, -64, -64,
      0x00, 0x3f, 0x3f, 0x3f, 0x40, 0x40, 0x40, 0x40, -128, -65, -65, -65, -64, -64, -64, -64);
  const __m256i low_bytes = _mm256_setr_epi8(
      0, 0, -128, -64, 0, 0x40, -128, -64, 0, 0, -128, -64, 0, 0x40, -128, -64,
      0, 0, -128, -64, 0, 0x40, -128, -64, 0, 0, -128, -64, 0, 0x40, -128, -64);
  OneToken4BitAvx2<kLocality>(
      p.codes, p.code_stride, p.rows, p.a[0], p.n, high_bytes, low_bytes, ahead_bytes,
      [](int64_t, int64_t, const float*) {},
      [&p](int64_t r, int64_t i, int64_t blocks, float* scale_of) {
        mxfp4_avx2::GroupScales(p.scales + r * p.scale_stride + i / 32, blocks, nullptr,
                                scale_of);
      },
      [&p](int64_t r, int64_t i, float sum) { p.c[r] = i == 0 ? sum : p.c[r] + sum; });
}

// int4 decode (cpu_kernels_impl::DecodeInt4Loop's result, the same fused multiply-add per
// weight): per block the 16 values d * s * q + dm * m in two registers, each code picking from
// both with vpermps on its low 3 bits and vblendvps on bit 3; then interleaved as mxfp4's.
void DecodeInt4Avx2(const uint8_t* codes, const uint8_t* scales, const int8_t* mins, float d,
                    float dm, int64_t n, float* out) {
  const __m256 low8 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 high8 = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
  auto lookup = [](__m256 lo, __m256 hi, __m256i index) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, index),
                            _mm256_permutevar8x32_ps(hi, index),
                            _mm256_castsi256_ps(_mm256_slli_epi32(index, 28)));
  };
  for (int64_t b = 0; b < n / 32; ++b) {
    const __m256 scale = _mm256_set1_ps(d * static_cast<float>(scales[b]));
    const __m256 offset = _mm256_set1_ps(dm * static_cast<float>(mins[b]));
    const __m256 lo = _mm256_fmadd_ps(scale, low8, offset);
    const __m256 hi = _mm256_fmadd_ps(scale, high8, offset);
    for (int half = 0; half < 2; ++half) {
      const __m256i bytes = _mm256_cvtepu8_epi32(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 16 * b + 8 * half)));
      const __m256 even = lookup(lo, hi, bytes);
      const __m256 odd = lookup(lo, hi, _mm256_srli_epi32(bytes, 4));
      const __m256 u0 = _mm256_unpacklo_ps(even, odd), u1 = _mm256_unpackhi_ps(even, odd);
      float* o = out + 32 * b + 16 * half;
      _mm256_storeu_ps(o, _mm256_permute2f128_ps(u0, u1, 0x20));
      _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(u0, u1, 0x31));
    }
  }
}

// int4, one token, fused: OneToken4BitAvx2 with the bfloat16 bits of the codes less 8 (exact)
// and the blocks' uint8 scales as float32 lane multipliers; per chunk the activations' sum per
// block, which each row's block offsets multiply (8 blocks a vector):
// c = d * sum_b s[b] * ((q - 8) . x)_b + sum_b (dm * m[b] + 8 * d * s[b]) * (sum x)_b
// (centred codes, as the AVX-512 kernel's: the two sums do not cancel).
template <int kLocality>
void OneTokenInt4Avx2(const Int4DotProblem& p, int64_t ahead_bytes) {
  // bf16 bits of the codes less 8 (-8..7, centred: see below): high and low bytes, both lanes.
  const __m256i high_bytes = _mm256_setr_epi8(
      -63, -64, -64, -64, -64, -64, -64, -65, 0x00, 0x3f, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40,
      -63, -64, -64, -64, -64, -64, -64, -65, 0x00, 0x3f, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40);
  const __m256i low_bytes = _mm256_setr_epi8(
      0, -32, -64, -96, -128, 0x40, 0, -128, 0, -128, 0, 0x40, -128, -96, -64, -32,
      0, -32, -64, -96, -128, 0x40, 0, -128, 0, -128, 0, 0x40, -128, -96, -64, -32);
  constexpr int64_t kChunk = cpu_kernels_impl::kMxfp4OneTokenChunk;
  alignas(32) float block_sums[kChunk / 32 + 8];
  int64_t chunk_blocks = 0;
  OneToken4BitAvx2<kLocality>(
      p.codes, p.code_stride, p.rows, p.a[0], p.n, high_bytes, low_bytes, ahead_bytes,
      [&](int64_t, int64_t blocks, const float* x) {
        chunk_blocks = blocks;
        for (int64_t b = 0; b < blocks; ++b) {
          const __m256 v = _mm256_add_ps(
              _mm256_add_ps(_mm256_loadu_ps(x + 32 * b), _mm256_loadu_ps(x + 32 * b + 8)),
              _mm256_add_ps(_mm256_loadu_ps(x + 32 * b + 16), _mm256_loadu_ps(x + 32 * b + 24)));
          const __m128 q4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
          const __m128 d2 = _mm_add_ps(q4, _mm_movehl_ps(q4, q4));
          block_sums[b] = _mm_cvtss_f32(_mm_add_ss(d2, _mm_movehdup_ps(d2)));
        }
        for (int64_t b = blocks; b < blocks + 8; ++b) block_sums[b] = 0.0f;
      },
      [&p](int64_t r, int64_t i, int64_t blocks, float* scale_of) {
        const uint8_t* scales = p.scales + r * p.scale_stride + i / 32;
        const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
        for (int64_t q = 0; q < (blocks + 7) / 8; ++q) {
          alignas(8) uint8_t s8[8] = {};
          const uint8_t* from = scales + 8 * q;
          if (8 * q + 8 > blocks) {
            for (int64_t k = 0; 8 * q + k < blocks; ++k) s8[k] = scales[8 * q + k];
            from = s8;
          }
          const __m256 f = _mm256_cvtepi32_ps(
              _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(from))));
          for (int k = 0; k < 4; ++k) {
            const __m256i pick = _mm256_add_epi32(spread, _mm256_set1_epi32(2 * k));
            _mm256_store_ps(scale_of + 32 * q + 8 * k, _mm256_permutevar8x32_ps(f, pick));
          }
        }
      },
      [&](int64_t r, int64_t i, float sum) {
        const int8_t* mins = p.mins + r * p.min_stride + i / 32;
        const uint8_t* scales = p.scales + r * p.scale_stride + i / 32;
        float d, dm;
        cpu_kernels_impl::Int4Steps(p.steps + r * p.step_stride, &d, &dm);
        const __m256 dm_v = _mm256_set1_ps(dm), d8 = _mm256_set1_ps(8.0f * d);
        __m256 off = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 8 <= chunk_blocks; b += 8) {
          const __m256 m = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(mins + b))));
          const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(scales + b))));
          off = _mm256_fmadd_ps(_mm256_fmadd_ps(dm_v, m, _mm256_mul_ps(d8, sc)),
                                _mm256_load_ps(block_sums + b), off);
        }
        float offsets = 0.0f;
        for (; b < chunk_blocks; ++b) {
          offsets += (dm * static_cast<float>(mins[b]) + 8.0f * d * static_cast<float>(scales[b])) *
                     block_sums[b];
        }
        const __m128 q4 = _mm_add_ps(_mm256_castps256_ps128(off), _mm256_extractf128_ps(off, 1));
        const __m128 d2 = _mm_add_ps(q4, _mm_movehl_ps(q4, q4));
        offsets += _mm_cvtss_f32(_mm_add_ss(d2, _mm_movehdup_ps(d2)));
        const float value = d * sum + offsets;
        p.c[r] = i == 0 ? value : p.c[r] + value;
      });
}

void DotInt4F32Avx2(const Int4DotProblem& p) {
  if (p.tokens == 1) {
    const KernelTuning tuning = CurrentKernelTuning();
    const int64_t ahead =
        tuning.prefetch_bytes < 0 ? cpu_kernels_impl::kPrefetchBytes : tuning.prefetch_bytes;
    if (TunedPrefetchNonTemporal(tuning)) {
      OneTokenInt4Avx2<0>(p, ahead);
    } else {
      OneTokenInt4Avx2<2>(p, ahead);
    }
  } else {
    cpu_kernels_impl::DotInt4<F32F32Ops256, DecodeInt4Avx2>(p);
  }
}

void DotMxfp4F32Avx2(const Mxfp4DotProblem& p) {
  if (p.tokens == 1) {
    const KernelTuning tuning = CurrentKernelTuning();
    const int64_t ahead =
        tuning.prefetch_bytes < 0 ? cpu_kernels_impl::kPrefetchBytes : tuning.prefetch_bytes;
    if (TunedPrefetchNonTemporal(tuning)) {
      OneTokenMxfp4Avx2<0>(p, ahead);
    } else {
      OneTokenMxfp4Avx2<2>(p, ahead);
    }
  } else {
    cpu_kernels_impl::DotMxfp4<F32F32Ops256, DecodeMxfp4Avx2>(p);
  }
}

// Weight i of a row, in all 8 lanes as float32. bf16: the 32 bits at p (weights i and i + 1) are
// broadcast and shifted left by 16, which leaves weight i widened; so p[1] must exist (the last
// weight of a row goes through LastWeight256).
inline __m256 Weight256(const float* p) { return _mm256_broadcast_ss(p); }
inline __m256 Weight256(const Bf16Bits* p) {
  int32_t pair;
  __builtin_memcpy(&pair, p, sizeof(pair));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_set1_epi32(pair), 16));
}
inline __m256 Weight256(const int8_t* p) { return _mm256_set1_ps(static_cast<float>(*p)); }
inline __m256 LastWeight256(const float* p) { return _mm256_broadcast_ss(p); }
inline __m256 LastWeight256(const int8_t* p) { return Weight256(p); }
inline __m256 LastWeight256(const Bf16Bits* p) {
  return _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int32_t>(uint32_t{*p} << 16)));
}

// The packed-activation GEMM (cpu_kernels.h) against float32 activations, float32 FMA, in 256-bit
// vectors: a group of 16 tokens is two vectors, each multiply-add takes one broadcast weight and
// 8 tokens. kRows weight rows x kGroups (0 or 1) groups, plus with kHalf the first 8 tokens of one
// more group: 6 rows x 1 group is 12 accumulators, 2 activation vectors and the broadcast weight,
// 15 of the 16 registers, and 12 independent FMA chains hide the FMA latency (4-5 cycles at 2 per
// cycle). Plain loops over constant bounds (no lambdas), so that the compiler keeps the
// accumulators in registers: with them captured by a lambda, GCC 12 stored all 12 to the stack
// on every input and the kernel ran at 2/3 of this speed.
// With `accumulate` the sums are added to what ct holds (a later block of inputs).
template <typename WeightT, int kRows, int kGroups, bool kHalf>
inline void PackedMicroKernel256(const WeightT* w, int64_t w_stride, const float* packed,
                                 int64_t n, float* ct, int64_t c_stride, bool accumulate) {
  constexpr int kVectors = 2 * kGroups + (kHalf ? 1 : 0);  // 8-token vectors per row
  __m256 acc[kRows][kVectors];
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm256_setzero_ps();
  }
  const int64_t last = n - 1;  // input n - 1 is read by LastWeight256
  for (int64_t i = 0; i < last; ++i) {
    __m256 x[kVectors];
    for (int v = 0; v < kVectors; ++v) x[v] = _mm256_loadu_ps(packed + i * 16 + 8 * v);
    for (int r = 0; r < kRows; ++r) {
      const __m256 w_r = Weight256(w + r * w_stride + i);
      for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm256_fmadd_ps(w_r, x[v], acc[r][v]);
    }
  }
  if (last >= 0) {
    __m256 x[kVectors];
    for (int v = 0; v < kVectors; ++v) x[v] = _mm256_loadu_ps(packed + last * 16 + 8 * v);
    for (int r = 0; r < kRows; ++r) {
      const __m256 w_r = LastWeight256(w + r * w_stride + last);
      for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm256_fmadd_ps(w_r, x[v], acc[r][v]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVectors; ++v) {
      float* c = ct + r * c_stride + 8 * v;
      _mm256_storeu_ps(c, accumulate ? _mm256_add_ps(_mm256_loadu_ps(c), acc[r][v]) : acc[r][v]);
    }
  }
}

// Rows of w per micro-kernel call of the packed GEMM.
constexpr int kPackedRows256 = 6;

// PackedMicroKernel256 for `rows` <= kPackedRows256 rows.
template <typename WeightT, int kGroups, bool kHalf>
inline void PackedRows256(int64_t rows, const WeightT* w, int64_t w_stride, const float* packed,
                          int64_t n, float* ct, int64_t c_stride, bool accumulate = false) {
  switch (rows) {
#define FTJAX_PACKED_ROWS(R)                                                                   \
  case R:                                                                                      \
    PackedMicroKernel256<WeightT, R, kGroups, kHalf>(w, w_stride, packed, n, ct, c_stride,    \
                                                     accumulate);                              \
    break;
    FTJAX_PACKED_ROWS(6)
    FTJAX_PACKED_ROWS(5)
    FTJAX_PACKED_ROWS(4)
    FTJAX_PACKED_ROWS(3)
    FTJAX_PACKED_ROWS(2)
#undef FTJAX_PACKED_ROWS
    default:
      PackedMicroKernel256<WeightT, 1, kGroups, kHalf>(w, w_stride, packed, n, ct, c_stride,
                                                       accumulate);
      break;
  }
}

// Runs the packed GEMM with PackedMicroKernel256: weight rows in blocks of kPackedRows256; for each
// block the groups go past one at a time (the block's rows stay in L1 after the first), then the
// half group, if any, as its own pass.
template <typename WeightT>
void PackedDot256(const PackedDotProblem<WeightT, float>& p) {
  const int64_t group_stride = PackedGroupElements<float>(p.n);
  const int64_t full_groups = p.groups - (p.half_last_group ? 1 : 0);
  for (int64_t r = 0; r < p.rows; r += kPackedRows256) {
    const int64_t rows = p.rows - r < kPackedRows256 ? p.rows - r : kPackedRows256;
    const WeightT* w = p.w + r * p.w_stride;
    float* ct = p.ct + r * p.c_stride;
    for (int64_t g = 0; g < full_groups; ++g) {
      PackedRows256<WeightT, 1, false>(rows, w, p.w_stride, p.packed + g * group_stride, p.n,
                                       ct + 16 * g, p.c_stride);
    }
    if (p.half_last_group) {
      PackedRows256<WeightT, 0, true>(rows, w, p.w_stride, p.packed + full_groups * group_stride,
                                      p.n, ct + 16 * full_groups, p.c_stride);
    }
  }
}

// bf16 weights: inputs in blocks of kPanelInputs, the outer loop, so that the groups' activations
// of one block stay in L2 (64 tokens: 128 KiB) while every row goes past; each block of
// kPackedRows256 rows is widened to float32 into a panel that stays in L1 (12 KiB), which every
// group then multiplies from with plain broadcast loads. Widening in the micro-kernel instead
// costs a shift per weight and group, on the ports the FMAs need; the whole rows widened do not
// stay in L1 (the 6-row panel of 2880 inputs is 69 KiB). Each output's sum is taken per block of
// inputs, the blocks' sums added in order.
constexpr int64_t kPanelInputs = 512;
// fill(k, i0, n, out): row k of the block from row `r` of the problem, inputs [i0, i0 + n), as
// float32 at out.
template <typename Fill>
void PanelPackedDot256(int64_t rows_total, int64_t n_total, const float* packed_all,
                       int64_t groups, bool half_last_group, float* ct_all, int64_t c_stride,
                       Fill fill) {
  const int64_t group_stride = PackedGroupElements<float>(n_total);
  const int64_t full_groups = groups - (half_last_group ? 1 : 0);
  alignas(32) float panel[kPackedRows256 * kPanelInputs];
  for (int64_t i0 = 0; i0 < n_total; i0 += kPanelInputs) {
    const int64_t n = n_total - i0 < kPanelInputs ? n_total - i0 : kPanelInputs;
    for (int64_t r = 0; r < rows_total; r += kPackedRows256) {
      const int64_t rows = rows_total - r < kPackedRows256 ? rows_total - r : kPackedRows256;
      float* ct = ct_all + r * c_stride;
      for (int64_t k = 0; k < rows; ++k) fill(r + k, i0, n, panel + k * kPanelInputs);
      const bool accumulate = i0 > 0;
      const float* packed = packed_all + i0 * kPackedGroup;
      for (int64_t g = 0; g < full_groups; ++g) {
        PackedRows256<float, 1, false>(rows, panel, kPanelInputs, packed + g * group_stride, n,
                                       ct + 16 * g, c_stride, accumulate);
      }
      if (half_last_group) {
        PackedRows256<float, 0, true>(rows, panel, kPanelInputs,
                                      packed + full_groups * group_stride, n,
                                      ct + 16 * full_groups, c_stride, accumulate);
      }
    }
  }
}

void PackedDotBf16F32Avx2(const PackedDotProblem<Bf16Bits, float>& p) {
  PanelPackedDot256(p.rows, p.n, p.packed, p.groups, p.half_last_group, p.ct, p.c_stride,
                    [&](int64_t row, int64_t i0, int64_t n, float* out) {
                      const Bf16Bits* w = p.w + row * p.w_stride + i0;
                      int64_t i = 0;
                      for (; i + 8 <= n; i += 8) {
                        const __m128i bits =
                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i));
                        _mm256_store_ps(out + i, WidenBf16(bits));
                      }
                      for (; i < n; ++i) {
                        const uint32_t bits = uint32_t{w[i]} << 16;
                        __builtin_memcpy(out + i, &bits, sizeof(bits));
                      }
                    });
}

// mxfp4 weights: the codes decoded (DecodeMxfp4Avx2, exact) straight into the panel.
void PackedDotMxfp4F32Avx2(const PackedMxfp4Problem& p) {
  PanelPackedDot256(p.rows, p.n, p.packed, p.groups, p.half_last_group, p.ct, p.c_stride,
                    [&](int64_t row, int64_t i0, int64_t n, float* out) {
                      DecodeMxfp4Avx2(p.codes + row * p.code_stride + i0 / 2,
                                      p.scales + row * p.scale_stride + i0 / 32, n, out);
                    });
}
void PackedDotF32Avx2(const PackedDotProblem<float, float>& p) { PackedDot256(p); }
void PackedDotI8F32Avx2(const PackedDotProblem<int8_t, float>& p) { PackedDot256(p); }

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

// 8 elements of a float32 or bfloat16 row as float32: all 8, or the first `count` < 8 (the rest 0,
// not read).
inline __m256 LoadFloats256(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 LoadFloats256(const Bf16Bits* p) {
  return WidenBf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
template <typename T>
inline __m256 LoadFloats256(const T* p, int64_t count) {
  if (count >= 8) return LoadFloats256(p);
  T padded[8];
  CopyTail(p, count, padded);
  return LoadFloats256(padded);
}

// The weighted row sums (RowSumProblem) of kQueries weight vectors over kVecs x 8 columns from
// `v` (the last vector's first `last` columns): the kQueries x kVecs accumulators stay in
// registers over all rows; per row, kVecs loads of v and kQueries broadcast weights.
template <typename ValueT, int kQueries, int kVecs>
inline void RowSumStrip256(const float* weight, int64_t weight_stride, const ValueT* v,
                           int64_t v_stride, int64_t rows, int64_t last, float* acc,
                           int64_t acc_stride) {
  __m256 sum[kQueries][kVecs];
  for (int j = 0; j < kQueries; ++j) {
    for (int c = 0; c < kVecs; ++c) {
      sum[j][c] = LoadFloats256(acc + j * acc_stride + 8 * c, c == kVecs - 1 ? last : 8);
    }
  }
  for (int64_t s = 0; s < rows; ++s) {
    __m256 x[kVecs];
    for (int c = 0; c < kVecs; ++c) {
      x[c] = LoadFloats256(v + s * v_stride + 8 * c, c == kVecs - 1 ? last : 8);
    }
    for (int j = 0; j < kQueries; ++j) {
      const __m256 w = _mm256_broadcast_ss(weight + j * weight_stride + s);
      for (int c = 0; c < kVecs; ++c) sum[j][c] = _mm256_fmadd_ps(w, x[c], sum[j][c]);
    }
  }
  for (int j = 0; j < kQueries; ++j) {
    for (int c = 0; c < kVecs; ++c) {
      float* out = acc + j * acc_stride + 8 * c;
      if (c < kVecs - 1 || last == 8) {
        _mm256_storeu_ps(out, sum[j][c]);
      } else {
        float lanes[8];
        _mm256_storeu_ps(lanes, sum[j][c]);
        for (int64_t i = 0; i < last; ++i) out[i] = lanes[i];
      }
    }
  }
}

template <typename ValueT, int kVecs>
inline void RowSumStrips256(int queries, const float* weight, int64_t weight_stride,
                            const ValueT* v, int64_t v_stride, int64_t rows, int64_t last,
                            float* acc, int64_t acc_stride) {
  switch (queries) {
    case 4: RowSumStrip256<ValueT, 4, kVecs>(weight, weight_stride, v, v_stride, rows, last, acc, acc_stride); break;
    case 3: RowSumStrip256<ValueT, 3, kVecs>(weight, weight_stride, v, v_stride, rows, last, acc, acc_stride); break;
    case 2: RowSumStrip256<ValueT, 2, kVecs>(weight, weight_stride, v, v_stride, rows, last, acc, acc_stride); break;
    default: RowSumStrip256<ValueT, 1, kVecs>(weight, weight_stride, v, v_stride, rows, last, acc, acc_stride); break;
  }
}

// RowSumProblem in strips of 4 weight vectors x 16 columns (8 of the 16 registers accumulate).
template <typename ValueT>
void WeightedRowSum256(const RowSumProblem<ValueT>& p) {
  for (int64_t j = 0; j < p.n; j += 4) {
    const int queries = p.n - j < 4 ? static_cast<int>(p.n - j) : 4;
    const float* weight = p.weight + j * p.weight_stride;
    float* acc = p.acc + j * p.acc_stride;
    for (int64_t i = 0; i < p.width; i += 16) {
      const int64_t columns = p.width - i < 16 ? p.width - i : 16;
      const int64_t last = columns % 8 == 0 ? 8 : columns % 8;
      if (columns > 8) {
        RowSumStrips256<ValueT, 2>(queries, weight, p.weight_stride, p.v + i, p.v_stride, p.rows,
                                   last, acc + i, p.acc_stride);
      } else {
        RowSumStrips256<ValueT, 1>(queries, weight, p.weight_stride, p.v + i, p.v_stride, p.rows,
                                   last, acc + i, p.acc_stride);
      }
    }
  }
}

void WeightedRowSumAvx2(const RowSumProblem<float>& p) { WeightedRowSum256(p); }
void WeightedRowSumBf16Avx2(const RowSumProblem<Bf16Bits>& p) { WeightedRowSum256(p); }

// Attention scores (KernelTable::score_*): c[t * c_stride] = row . a[t] for one row x kTokens
// tokens, each 8 elements of the row loaded (and widened) once for all kTokens tokens.
template <typename RowT, int kTokens>
inline void ScoreMicroKernel256(const RowT* w, const float* const* a, int64_t n, float* c,
                                int64_t c_stride) {
  __m256 acc[kTokens];
  for (int t = 0; t < kTokens; ++t) acc[t] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 row = LoadFloats256(w + i);
    for (int t = 0; t < kTokens; ++t) acc[t] = _mm256_fmadd_ps(row, _mm256_loadu_ps(a[t] + i), acc[t]);
  }
  if (i < n) {
    const __m256 row = LoadFloats256(w + i, n - i);
    for (int t = 0; t < kTokens; ++t) {
      acc[t] = _mm256_fmadd_ps(row, LoadFloats256(a[t] + i, n - i), acc[t]);
    }
  }
  float sums[kTokens];
  int t = 0;
  for (; t + 4 <= kTokens; t += 4) Sum4x256(acc[t], acc[t + 1], acc[t + 2], acc[t + 3], sums + t);
  for (; t < kTokens; ++t) sums[t] = Sum256(acc[t]);
  for (t = 0; t < kTokens; ++t) c[t * c_stride] = sums[t];
}

// Tokens in groups of 8, rows one at a time (8 accumulators).
template <typename RowT>
void ScoreRows256(const DotProblem<RowT, float>& p) {
  for (int64_t t = 0; t < p.tokens; t += 8) {
    const int tokens = p.tokens - t < 8 ? static_cast<int>(p.tokens - t) : 8;
    const float* const* a = p.a + t;
    float* c = p.c + t * p.c_stride;
    for (int64_t r = 0; r < p.rows; ++r) {
      const RowT* w = p.w + r * p.w_stride;
      switch (tokens) {
        case 8: ScoreMicroKernel256<RowT, 8>(w, a, p.n, c + r, p.c_stride); break;
        case 7: ScoreMicroKernel256<RowT, 7>(w, a, p.n, c + r, p.c_stride); break;
        case 6: ScoreMicroKernel256<RowT, 6>(w, a, p.n, c + r, p.c_stride); break;
        case 5: ScoreMicroKernel256<RowT, 5>(w, a, p.n, c + r, p.c_stride); break;
        case 4: ScoreMicroKernel256<RowT, 4>(w, a, p.n, c + r, p.c_stride); break;
        case 3: ScoreMicroKernel256<RowT, 3>(w, a, p.n, c + r, p.c_stride); break;
        case 2: ScoreMicroKernel256<RowT, 2>(w, a, p.n, c + r, p.c_stride); break;
        default: ScoreMicroKernel256<RowT, 1>(w, a, p.n, c + r, p.c_stride); break;
      }
    }
  }
}

void ScoreF32Avx2(const DotProblem<float, float>& p) { ScoreRows256(p); }
void ScoreBf16Avx2(const DotProblem<Bf16Bits, float>& p) { ScoreRows256(p); }

// KernelTable::exp_sub_sum with Exp256, 8 lanes at a time (the tail through a padded copy).
float ExpSubSumAvx2(const float* in, float max, float* out, int64_t n) {
  const __m256 shift = _mm256_set1_ps(max), lowest = _mm256_set1_ps(-87.0f);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const int64_t count = n - i < 8 ? n - i : 8;
    const __m256 x = _mm256_sub_ps(LoadFloats256(in + i, count), shift);
    __m256 e = _mm256_and_ps(_mm256_cmp_ps(x, lowest, _CMP_GE_OQ), Exp256(x));
    if (count == 8) {
      _mm256_storeu_ps(out + i, e);
    } else {
      float lanes[8];
      _mm256_storeu_ps(lanes, e);
      for (int64_t j = 0; j < count; ++j) out[i + j] = lanes[j];
      for (int64_t j = count; j < 8; ++j) lanes[j] = 0.0f;
      e = _mm256_loadu_ps(lanes);
    }
    sum = _mm256_add_ps(sum, e);
  }
  return Sum256(sum);
}

// The read probe's loop (read_probe.cc), written to read as fast as the kernels can: 8 independent
// 32-byte loads per round (256 bytes, as many as the AVX-512 form's 4 x 64), and the same software
// prefetch as the one-token dot kernels (cpu_kernels_impl.h: kPrefetchBytes ahead with the hint
// of PrefetchNonTemporal, never past the end). Earlier, with 4 loads per round and no prefetch, the AVX2 kernels measured
// 1.04-1.07 of this probe on a Xeon VM (whose hardware prefetcher alone does not reach the read
// bandwidth), so it was no ceiling. On the 2-core Zen 4 VM, 4 or 8 loads, with or without the
// prefetch, measured within the noise of each other (2 threads, 512 MiB, 40 alternating rounds).
uint32_t XorWordsAvx2(const void* data, int64_t n_words) {
  const unsigned char* bytes = static_cast<const unsigned char*>(data);
  constexpr int kChains = 8;
  constexpr int64_t kRoundBytes = kChains * 32;
  const uintptr_t end = reinterpret_cast<uintptr_t>(bytes + 4 * n_words);
  const bool non_temporal = PrefetchNonTemporal();
  __m256i x[kChains];
  for (int j = 0; j < kChains; ++j) x[j] = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + kRoundBytes / 4 <= n_words; i += kRoundBytes / 4) {
    const unsigned char* p = bytes + 4 * i;
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(p) + cpu_kernels_impl::kPrefetchBytes;
    if (ahead + kRoundBytes <= end) {
      for (int64_t b = 0; b < kRoundBytes; b += cpu_kernels_impl::kCacheLine) {
        if (non_temporal) {
          __builtin_prefetch(reinterpret_cast<const void*>(ahead + b), 0, 0);
        } else {
          __builtin_prefetch(reinterpret_cast<const void*>(ahead + b), 0, 2);
        }
      }
    }
    for (int j = 0; j < kChains; ++j) {
      x[j] = _mm256_xor_si256(x[j], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p) + j));
    }
  }
  for (int j = 1; j < kChains; ++j) x[0] = _mm256_xor_si256(x[0], x[j]);
  alignas(32) uint32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), x[0]);
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
    /*packed_dot_bf16_f32=*/PackedDotBf16F32Avx2,
    /*packed_dot_f32=*/PackedDotF32Avx2,
    /*packed_min_tokens=*/8,
    /*dot_bf16_f32=*/DotBf16F32Avx2,
    /*dot_f32_f32=*/DotF32F32Avx2,
    /*round_to_bf16=*/RoundToBf16Avx2,
    /*silu_mul=*/SiluMulAvx2,
    /*weighted_row_sum=*/WeightedRowSumAvx2,
    /*weighted_row_sum_bf16=*/WeightedRowSumBf16Avx2,
    /*score_f32_f32=*/ScoreF32Avx2,
    /*score_bf16_f32=*/ScoreBf16Avx2,
    /*exp_sub_sum=*/ExpSubSumAvx2,
    /*xor_words=*/XorWordsAvx2,
    /*peak_loop=*/PeakLoopFma256,
    /*peak_flops_per_iteration=*/kPeakChains * 8 * 2,
    /*dot_i8_f32=*/DotI8F32Avx2,
    /*packed_dot_i8_f32=*/PackedDotI8F32Avx2,
    /*dot_i8_i8=*/nullptr,
    /*dot_mxfp4_f32=*/DotMxfp4F32Avx2,
    /*decode_mxfp4=*/DecodeMxfp4Avx2,
    /*dot_mxfp4_q8=*/mxfp4_avx2::DotQ8,
    /*packed_dot_mxfp4_f32=*/PackedDotMxfp4F32Avx2,
    /*dot_int4_f32=*/DotInt4F32Avx2,
    /*decode_int4=*/DecodeInt4Avx2,
    /*delta_rule_step=*/cpu_kernels_impl::DeltaRuleStepLoop,
    /*argmax_f32=*/cpu_kernels_impl::ArgmaxLoop,
};

}  // namespace

const KernelTable* Avx2Kernels() { return &kAvx2Table; }

}  // namespace ftjax

#else

namespace ftjax {
const KernelTable* Avx2Kernels() { return nullptr; }
}  // namespace ftjax

#endif
