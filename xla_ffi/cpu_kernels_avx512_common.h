// AVX-512 (F, BW, VL, DQ) pieces shared by cpu_kernels_avx512.cc and cpu_kernels_avx512bf16.cc.
//
// Include only from those two files: everything is in an anonymous namespace, so each includes
// its own copy compiled with its own flags (see cpu_kernels.h on why nothing may be shared).

#ifndef FTJAX_XLA_FFI_CPU_KERNELS_AVX512_COMMON_H_
#define FTJAX_XLA_FFI_CPU_KERNELS_AVX512_COMMON_H_

// GCC 12 warns that the "undefined" vectors inside its own AVX-512 intrinsics are used
// uninitialized (GCC bug 105593, fixed in GCC 13). Silenced here, before the intrinsics header,
// and only in the files that include this one.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <immintrin.h>
#include <math.h>

#include <cstdint>

#include "cpu_kernels.h"
#include "cpu_kernels_impl.h"

namespace ftjax {
namespace {

template <int kGroupsValue, bool kHalfValue>
struct GroupsAndHalf {
  static constexpr int kGroups = kGroupsValue;
  static constexpr bool kHalf = kHalfValue;
};

inline __mmask16 FirstLanes16(int64_t count) {
  return static_cast<__mmask16>((1u << count) - 1u);  // count < 16
}

// (Written with shuffles rather than _mm512_reduce_add_ps or _mm512_extractf32x8_ps, whose
// "undefined" upper halves make GCC 12 warn.)
inline __m512 SwapHalves512(__m512 v) {
  return _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2));
}

inline float Sum512(__m512 v) {
  v = _mm512_add_ps(v, SwapHalves512(v));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)));  // 128-bit lanes
  __m128 q = _mm512_castps512_ps128(v);
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

// out[j] = sum of the lanes of a_j: a transpose-and-add tree (13 instructions for 4 sums).
inline void Sum4x512(__m512 a0, __m512 a1, __m512 a2, __m512 a3, float* out) {
  // In every 128-bit lane: [a0_0 + a0_2, a1_0 + a1_2, a0_1 + a0_3, a1_1 + a1_3].
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  // In every 128-bit lane: [a0, a1, a2, a3] partial sums.
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(s01, s23, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 h = _mm512_castps512_ps256(_mm512_add_ps(s, SwapHalves512(s)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// 16 bf16 -> 16 float32: widen to 32 bits and shift into the high half.
inline __m512 WidenBf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

struct Bf16F32Ops512 {
  using Weight = Bf16Bits;
  using Activation = float;
  using WeightVec = __m512;
  using ActivationVec = __m512;
  using Acc = __m512;
  static constexpr int64_t kStep = 16;
  static constexpr int kVectorRegisters = 32;
  static Acc Zero() { return _mm512_setzero_ps(); }
  static WeightVec LoadWeights(const Weight* p) {
    return WidenBf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static WeightVec LoadWeightsTail(const Weight* p, int64_t count) {
    return WidenBf16(_mm256_maskz_loadu_epi16(FirstLanes16(count), p));
  }
  static ActivationVec LoadActivations(const Activation* p) { return _mm512_loadu_ps(p); }
  static ActivationVec LoadActivationsTail(const Activation* p, int64_t count) {
    return _mm512_maskz_loadu_ps(FirstLanes16(count), p);
  }
  static Acc MulAdd(Acc acc, WeightVec w, ActivationVec a) { return _mm512_fmadd_ps(w, a, acc); }
  static Acc Add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static float Sum(Acc acc) { return Sum512(acc); }
  static void Sum4(Acc a0, Acc a1, Acc a2, Acc a3, float* out) { Sum4x512(a0, a1, a2, a3, out); }
};

struct F32F32Ops512 {
  using Weight = float;
  using Activation = float;
  using WeightVec = __m512;
  using ActivationVec = __m512;
  using Acc = __m512;
  static constexpr int64_t kStep = 16;
  static constexpr int kVectorRegisters = 32;
  static Acc Zero() { return _mm512_setzero_ps(); }
  static WeightVec LoadWeights(const Weight* p) { return _mm512_loadu_ps(p); }
  static WeightVec LoadWeightsTail(const Weight* p, int64_t count) {
    return _mm512_maskz_loadu_ps(FirstLanes16(count), p);
  }
  static ActivationVec LoadActivations(const Activation* p) { return _mm512_loadu_ps(p); }
  static ActivationVec LoadActivationsTail(const Activation* p, int64_t count) {
    return _mm512_maskz_loadu_ps(FirstLanes16(count), p);
  }
  static Acc MulAdd(Acc acc, WeightVec w, ActivationVec a) { return _mm512_fmadd_ps(w, a, acc); }
  static Acc Add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static float Sum(Acc acc) { return Sum512(acc); }
  static void Sum4(Acc a0, Acc a1, Acc a2, Acc a3, float* out) { Sum4x512(a0, a1, a2, a3, out); }
};

inline void DotBf16F32Avx512(const DotProblem<Bf16Bits, float>& p) {
  cpu_kernels_impl::Dot<Bf16F32Ops512>(p);
}
inline void DotF32F32Avx512(const DotProblem<float, float>& p) {
  cpu_kernels_impl::Dot<F32F32Ops512>(p);
}

// int8 weights widened exactly, then F32F32Ops512: 16 bytes sign-extended to 16 int32 lanes and
// converted to float32 (vpmovsxbd + vcvtdq2ps). 16 weights a step, so the one-token row loop
// keeps 8 accumulators (cpu_kernels_impl.h: kRowPassBytes).
struct I8F32Ops512 : F32F32Ops512 {
  using Weight = int8_t;
  static WeightVec Widen(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)); }
  static WeightVec LoadWeights(const Weight* p) {
    return Widen(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static WeightVec LoadWeightsTail(const Weight* p, int64_t count) {
    return Widen(_mm_maskz_loadu_epi8(FirstLanes16(count), p));
  }
};

inline void DotI8F32Avx512(const DotProblem<int8_t, float>& p) {
  cpu_kernels_impl::Dot<I8F32Ops512>(p);
}

// mxfp4 decode (cpu_kernels_impl::DecodeMxfp4Loop's result): per block of 32 inputs, the 16
// E2M1 values times the block's scale in one register; the 16 code bytes widened to 32-bit
// lanes index it with vpermps (which reads the low 4 bits: the low nibbles) and again shifted
// right by 4 (the high nibbles); vpermt2ps interleaves the two into input order.
inline void DecodeMxfp4Avx512(const uint8_t* codes, const uint8_t* scales, int64_t n,
                              float* out) {
  const __m512 values = _mm512_loadu_ps(cpu_kernels_impl::kE2M1Values);
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t b = 0; b < n / 32; ++b) {
    const __m512 table =
        _mm512_mul_ps(values, _mm512_set1_ps(cpu_kernels_impl::Mxfp4Scale(scales[b])));
    const __m512i bytes = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * b)));
    const __m512 low = _mm512_permutexvar_ps(bytes, table);                          // 2j
    const __m512 high = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);   // 2j + 1
    _mm512_storeu_ps(out + 32 * b, _mm512_permutex2var_ps(low, first, high));
    _mm512_storeu_ps(out + 32 * b + 16, _mm512_permutex2var_ps(low, second, high));
  }
}
// The 4-bit formats (mxfp4, int4; FewTokens4BitAvx512 below) for one token (the decode GEMV) and
// for up to 4 at a time, fused, with as few shuffles as the lookups need (the shuffle
// port bounds this loop on Zen 5: widening each block's 16 code bytes to 32-bit lanes, two
// vpermps and a scale broadcast per 32 weights ran ~8 weights a cycle, under the read
// bandwidth). Per group of 4 blocks (128 inputs, 64 code bytes): the 64 bytes are loaded as 16
// dwords, and dword k holds the nibbles of inputs 8k .. 8k + 7 (low nibble first); shifted
// right by 4j, its low 4 bits are input 8k + j's code, which vpermps (reading only those 4
// bits) maps to its E2M1 value: 8 shifts and 8 vpermps give all 128 values, each lane k
// multiplied with x[8k + j] from a copy of the activations transposed that way once per chunk
// (the two halves of j summed apart, so the multiply-adds do not wait on each other). Lane k
// belongs to block k / 4, so the group's sum is multiplied by the 4 block scales spread over
// the lanes (powers of two: exact) into one of 2 running sums. Same products as the
// dequantised weights', summed in another order. Blocks past the last whole group (n / 32 not
// a multiple of 4) take the per-block form: each block's 16 bytes widened to lanes, the low
// and high nibbles looked up against the even and odd inputs. The rows are read one after the
// other (one sequential stream of codes, one of scales), the codes `ahead_bytes` ahead
// prefetched (the tuning's, as the one-token row kernels). Inputs past the chunk
// (kFewTokensChunk) are taken in further chunks, each row's partial sums added.
// The fused 4-bit kernels' chunk of inputs, for every token count (below): 4 tokens' transposed
// copies take 32 KiB, in L1 on Zen 5 and Sapphire Rapids (48 KiB), in L2 on Zen 4 (32 KiB).
constexpr int64_t kFewTokensChunk = 2048;

// The 4 E8M0 scales at `scales` as float32 (Mxfp4Scale), each in 4 consecutive lanes.
inline __m512 Mxfp4GroupScales(const uint8_t* scales) {
  int32_t four;
  __builtin_memcpy(&four, scales, sizeof(four));
  const __m512i e = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(
      _mm_cvtsi32_si128(four), _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)));
  const __mmask16 zero = _mm512_testn_epi32_mask(e, e);
  return _mm512_castsi512_ps(
      _mm512_mask_mov_epi32(_mm512_slli_epi32(e, 23), zero, _mm512_set1_epi32(0x00400000)));
}

// int4 decode (cpu_kernels_impl::DecodeInt4Loop's result, the same fused multiply-add per
// weight): per block of 32 inputs the 16 values d * s * q + dm * m of the codes q in one register,
// looked up as the mxfp4 decode looks up its E2M1 values.
static constexpr float kInt4Codes[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
// The codes less 8 (one-token kernels: centred, so that the scaled sums and the offsets' sum do
// not cancel each other).
static constexpr float kInt4Centred[16] = {-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7};
inline void DecodeInt4Avx512(const uint8_t* codes, const uint8_t* scales, const int8_t* mins,
                             float d, float dm, int64_t n, float* out) {
  const __m512 iota = _mm512_loadu_ps(kInt4Codes);
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t b = 0; b < n / 32; ++b) {
    const __m512 table =
        _mm512_fmadd_ps(_mm512_set1_ps(d * static_cast<float>(scales[b])), iota,
                        _mm512_set1_ps(dm * static_cast<float>(mins[b])));
    const __m512i bytes = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * b)));
    const __m512 low = _mm512_permutexvar_ps(bytes, table);
    const __m512 high = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
    _mm512_storeu_ps(out + 32 * b, _mm512_permutex2var_ps(low, first, high));
    _mm512_storeu_ps(out + 32 * b + 16, _mm512_permutex2var_ps(low, second, high));
  }
}

// int4, one token (the decode GEMV), fused: the mxfp4 one-token kernel's loop (the activations
// transposed once per chunk, 4 blocks of codes per 64-byte load, 8 shifts and 8 vpermps to the
// codes as float32 integers) with the blocks' uint8 scales spread over the lanes as integers,
// and, per chunk, the activations' sum per block (16 blocks a vector). The codes are taken less
// 8, and the blocks' offsets are dm * m[b] + 8 * d * s[b]:
//   c = d * sum_b s[b] * ((q - 8) . x)_b + sum_b (dm * m[b] + 8 * d * s[b]) * (sum x)_b,
// the same sum as the dequantised weights', whose two parts stay small where a block's codes
// are centred (with q itself, both would be ~8x the result and cancel, at 8x the rounding).
inline __m512 Int4GroupScales(const uint8_t* scales) {
  int32_t four;
  __builtin_memcpy(&four, scales, sizeof(four));
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_shuffle_epi8(
      _mm_cvtsi32_si128(four), _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3))));
}

// Up to 4 tokens (kTokens; batched decode, speculative verify) run the same loop on each group of
// codes once: the 8 shifts and vpermps of a 64-byte load serve every token's multiply-adds, so
// that a few tokens cost little more than one (decoding rows to float32 and streaming them per
// token, DotDecoded, took ~3.3x one token's time at 4 tokens). Each token's arithmetic is the
// same whatever kTokens is: the same chunk of inputs (kFewTokensChunk) and two running sums a
// token (alternate groups, so that they do not wait on each other), so a token's result does not
// depend on the tokens beside it in a pass (a speculative verify of k + 1 tokens, or a batch,
// gives each token the one-token GEMV's sums). The two formats differ in their values (E2M1; int4's codes less 8), their block
// scales (E8M0 powers of two; uint8 integers, times the row's step d after the sums) and int4's
// block offsets against the activations' block sums.
struct Mxfp4Avx512Format {
  static constexpr bool kOffsets = false;
  static const float* Values() { return cpu_kernels_impl::kE2M1Values; }
  static __m512 GroupScales(const uint8_t* scales) { return Mxfp4GroupScales(scales); }
  static float BlockScale(uint8_t scale) { return cpu_kernels_impl::Mxfp4Scale(scale); }
};
struct Int4Avx512Format {
  static constexpr bool kOffsets = true;
  static const float* Values() { return kInt4Centred; }
  static __m512 GroupScales(const uint8_t* scales) { return Int4GroupScales(scales); }
  static float BlockScale(uint8_t scale) { return static_cast<float>(scale); }
};

template <typename Format, int kTokens, int kLocality, typename Problem>
inline void FewTokens4BitAvx512(const Problem& p, const float* const* a, float* c,
                                int64_t ahead_bytes) {
  if (p.rows <= 0) return;
  constexpr int64_t kChunk = kFewTokensChunk;
  const __m512 values = _mm512_loadu_ps(Format::Values());
  const __m512i even =
      _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd =
      _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const uintptr_t prefetch_end =
      reinterpret_cast<uintptr_t>(p.codes + (p.rows - 1) * p.code_stride + p.n / 2);
  // Groups: x[128 g + 8 k + j] at 128 g + 16 j + k; then the blocks past them, even/odd split.
  alignas(64) float x_t[kTokens][kChunk];
  alignas(64) float block_sums[kTokens][Format::kOffsets ? kChunk / 32 : 1];
  for (int64_t i = 0; i < p.n; i += kChunk) {
    const int64_t blocks = (p.n - i < kChunk ? p.n - i : kChunk) / 32;
    const int64_t groups = blocks / 4;
    for (int t = 0; t < kTokens; ++t) {
      const float* x = a[t] + i;
      for (int64_t g = 0; g < groups; ++g) {
        for (int k = 0; k < 16; ++k) {
          for (int j = 0; j < 8; ++j) x_t[t][128 * g + 16 * j + k] = x[128 * g + 8 * k + j];
        }
      }
      for (int64_t b = 4 * groups; b < blocks; ++b) {
        const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
        _mm512_store_ps(x_t[t] + 32 * b, _mm512_permutex2var_ps(x0, even, x1));
        _mm512_store_ps(x_t[t] + 32 * b + 16, _mm512_permutex2var_ps(x0, odd, x1));
      }
      if constexpr (Format::kOffsets) {
        for (int64_t b = 0; b < blocks; ++b) {
          block_sums[t][b] = _mm512_reduce_add_ps(
              _mm512_add_ps(_mm512_loadu_ps(x + 32 * b), _mm512_loadu_ps(x + 32 * b + 16)));
        }
      }
    }
    for (int64_t r = 0; r < p.rows; ++r) {
      const uint8_t* codes = p.codes + r * p.code_stride + i / 2;
      const uint8_t* scales = p.scales + r * p.scale_stride + i / 32;
      // Two running sums a token (alternate groups), for any kTokens: the same sums.
      // Two running sums a token (even groups into acc0, odd into acc1; the tail blocks by
      // their parity), for any kTokens: the same sums. The pairs are unrolled so that both
      // sums stay in registers.
      __m512 acc0[kTokens], acc1[kTokens];
      for (int t = 0; t < kTokens; ++t) acc0[t] = acc1[t] = _mm512_setzero_ps();
      const auto group = [&](int64_t g, __m512* acc) __attribute__((always_inline)) {
        const uintptr_t ahead = reinterpret_cast<uintptr_t>(codes + 64 * g) + ahead_bytes;
        if (ahead_bytes > 0 && ahead + cpu_kernels_impl::kCacheLine <= prefetch_end) {
          __builtin_prefetch(reinterpret_cast<const void*>(ahead), 0, kLocality);
        }
        const __m512i dwords = _mm512_loadu_si512(codes + 64 * g);
        __m512 half[kTokens][2];
        {
          const __m512 v0 = _mm512_permutexvar_ps(dwords, values);
          const __m512 v1 = _mm512_permutexvar_ps(_mm512_srli_epi32(dwords, 4), values);
          for (int t = 0; t < kTokens; ++t) {
            half[t][0] = _mm512_mul_ps(v0, _mm512_load_ps(x_t[t] + 128 * g));
            half[t][1] = _mm512_mul_ps(v1, _mm512_load_ps(x_t[t] + 128 * g + 16));
          }
        }
        for (int j = 2; j < 8; ++j) {
          const __m512 v =
              _mm512_permutexvar_ps(_mm512_srl_epi32(dwords, _mm_cvtsi32_si128(4 * j)), values);
          for (int t = 0; t < kTokens; ++t) {
            half[t][j & 1] =
                _mm512_fmadd_ps(v, _mm512_load_ps(x_t[t] + 128 * g + 16 * j), half[t][j & 1]);
          }
        }
        const __m512 group_scales = Format::GroupScales(scales + 4 * g);
        for (int t = 0; t < kTokens; ++t) {
          acc[t] = _mm512_fmadd_ps(_mm512_add_ps(half[t][0], half[t][1]), group_scales, acc[t]);
        }
      };
      int64_t g = 0;
      for (; g + 1 < groups; g += 2) {
        group(g, acc0);
        group(g + 1, acc1);
      }
      if (g < groups) group(g, acc0);
      const auto block = [&](int64_t b, __m512* acc) __attribute__((always_inline)) {
        const __m512i bytes = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * b)));
        const __m512 low = _mm512_permutexvar_ps(bytes, values);
        const __m512 high = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), values);
        const __m512 scale = _mm512_set1_ps(Format::BlockScale(scales[b]));
        for (int t = 0; t < kTokens; ++t) {
          const __m512 sum =
              _mm512_fmadd_ps(low, _mm512_load_ps(x_t[t] + 32 * b),
                              _mm512_mul_ps(high, _mm512_load_ps(x_t[t] + 32 * b + 16)));
          acc[t] = _mm512_fmadd_ps(sum, scale, acc[t]);
        }
      };
      for (int64_t b = 4 * groups; b < blocks; ++b) block(b, (b & 1) ? acc1 : acc0);
      float sums[kTokens];
      for (int t = 0; t < kTokens; ++t) {
        sums[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[t], acc1[t]));
      }
      if constexpr (Format::kOffsets) {
        const int8_t* mins = p.mins + r * p.min_stride + i / 32;
        float d, dm;
        cpu_kernels_impl::Int4Steps(p.steps + r * p.step_stride, &d, &dm);
        const __m512 dm_v = _mm512_set1_ps(dm), d8 = _mm512_set1_ps(8.0f * d);
        __m512 off[kTokens];
        for (int t = 0; t < kTokens; ++t) off[t] = _mm512_setzero_ps();
        for (int64_t b = 0; b < blocks; b += 16) {
          const __mmask16 mask = blocks - b >= 16 ? 0xFFFF : (1u << (blocks - b)) - 1;
          const __m512 m = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, mins + b)));
          const __m512 sc = _mm512_cvtepi32_ps(
              _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(mask, scales + b)));
          const __m512 offset = _mm512_fmadd_ps(dm_v, m, _mm512_mul_ps(d8, sc));
          for (int t = 0; t < kTokens; ++t) {
            off[t] =
                _mm512_fmadd_ps(offset, _mm512_maskz_load_ps(mask, block_sums[t] + b), off[t]);
          }
        }
        for (int t = 0; t < kTokens; ++t) sums[t] = d * sums[t] + _mm512_reduce_add_ps(off[t]);
      }
      for (int t = 0; t < kTokens; ++t) {
        float& out = c[t * p.c_stride + r];
        out = i == 0 ? sums[t] : out + sums[t];
      }
    }
  }
}

// KernelTable::dot_mxfp4_f32 and dot_int4_f32: up to kFusedTokens tokens the fused kernel above
// in passes of up to 4 tokens over the rows, balanced (5 = 2 + 3, 7 = 3 + 4); more: rows
// decoded to float32 (DotDecoded).
constexpr int64_t kFusedTokens = 8;

template <typename Format, int kLocality, typename Problem>
inline void FewTokens4BitPass(const Problem& p, int64_t t0, int tokens, int64_t ahead) {
  const float* const* a = p.a + t0;
  float* c = p.c + t0 * p.c_stride;
  switch (tokens) {
    case 1: FewTokens4BitAvx512<Format, 1, kLocality>(p, a, c, ahead); break;
    case 2: FewTokens4BitAvx512<Format, 2, kLocality>(p, a, c, ahead); break;
    case 3: FewTokens4BitAvx512<Format, 3, kLocality>(p, a, c, ahead); break;
    default: FewTokens4BitAvx512<Format, 4, kLocality>(p, a, c, ahead); break;
  }
}

template <typename Format, typename Problem>
inline void FewTokens4Bit(const Problem& p) {
  const KernelTuning tuning = CurrentKernelTuning();
  const int64_t ahead =
      tuning.prefetch_bytes < 0 ? cpu_kernels_impl::kPrefetchBytes : tuning.prefetch_bytes;
  const bool non_temporal = TunedPrefetchNonTemporal(tuning);
  const int64_t passes = (p.tokens + 3) / 4;
  for (int64_t pass = 0, t0 = 0; pass < passes; ++pass) {
    const int tokens = static_cast<int>((p.tokens - t0) / (passes - pass));
    if (non_temporal) {
      FewTokens4BitPass<Format, 0>(p, t0, tokens, ahead);
    } else {
      FewTokens4BitPass<Format, 2>(p, t0, tokens, ahead);
    }
    t0 += tokens;
  }
}

inline void DotMxfp4F32Avx512(const Mxfp4DotProblem& p) {
  if (p.tokens <= kFusedTokens) {
    FewTokens4Bit<Mxfp4Avx512Format>(p);
  } else {
    cpu_kernels_impl::DotMxfp4<F32F32Ops512, DecodeMxfp4Avx512>(p);
  }
}

inline void DotInt4F32Avx512(const Int4DotProblem& p) {
  if (p.tokens <= kFusedTokens) {
    FewTokens4Bit<Int4Avx512Format>(p);
  } else {
    cpu_kernels_impl::DotInt4<F32F32Ops512, DecodeInt4Avx512>(p);
  }
}

// Runs a packed-activation GEMM (cpu_kernels.h) with the micro-kernels of `Kernels`
// (Kernels::Run<kRows, kGroups, kHalf>): weight rows in blocks of 8, groups of 16 tokens in
// passes of up to 3 over the same rows (in L1 after the first pass); the half group joins the
// last pass when that has at most 2 full groups.
template <typename Kernels>
inline void PackedPasses(const PackedDotProblem<typename Kernels::Weight, typename Kernels::Packed>& p) {
  using Weight = typename Kernels::Weight;
  using Packed = typename Kernels::Packed;
  const int64_t group_stride = PackedGroupElements<Packed>(p.n);
  const int64_t full_groups = p.groups - (p.half_last_group ? 1 : 0);
  for (int64_t r = 0; r < p.rows; r += 8) {
    const int rows = p.rows - r < 8 ? static_cast<int>(p.rows - r) : 8;
    const Weight* w = p.w + r * p.w_stride;
    auto pass = [&](int64_t g, auto groups_and_half) {
      constexpr int kGroups = decltype(groups_and_half)::kGroups;
      constexpr bool kHalf = decltype(groups_and_half)::kHalf;
      const Packed* packed = p.packed + g * group_stride;
      float* ct = p.ct + r * p.c_stride + 16 * g;
      switch (rows) {
        case 8: Kernels::template Run<8, kGroups, kHalf>(w, p.w_stride, packed, group_stride, p.n, ct, p.c_stride); break;
        case 7: Kernels::template Run<7, kGroups, kHalf>(w, p.w_stride, packed, group_stride, p.n, ct, p.c_stride); break;
        case 6: Kernels::template Run<6, kGroups, kHalf>(w, p.w_stride, packed, group_stride, p.n, ct, p.c_stride); break;
        case 5: Kernels::template Run<5, kGroups, kHalf>(w, p.w_stride, packed, group_stride, p.n, ct, p.c_stride); break;
        case 4: Kernels::template Run<4, kGroups, kHalf>(w, p.w_stride, packed, group_stride, p.n, ct, p.c_stride); break;
        case 3: Kernels::template Run<3, kGroups, kHalf>(w, p.w_stride, packed, group_stride, p.n, ct, p.c_stride); break;
        case 2: Kernels::template Run<2, kGroups, kHalf>(w, p.w_stride, packed, group_stride, p.n, ct, p.c_stride); break;
        default: Kernels::template Run<1, kGroups, kHalf>(w, p.w_stride, packed, group_stride, p.n, ct, p.c_stride); break;
      }
    };
    bool half_done = !p.half_last_group;
    for (int64_t g = 0; g < full_groups;) {
      const int64_t left = full_groups - g;
      if (!half_done && left <= 2) {
        if (left == 2) pass(g, GroupsAndHalf<2, true>());
        else pass(g, GroupsAndHalf<1, true>());
        half_done = true;
        g = full_groups;
      } else if (left == 3 && half_done) {
        pass(g, GroupsAndHalf<3, false>());
        g += 3;
      } else if (left >= 2) {
        pass(g, GroupsAndHalf<2, false>());
        g += 2;
      } else {
        pass(g, GroupsAndHalf<1, false>());
        g += 1;
      }
    }
    if (!half_done) pass(full_groups, GroupsAndHalf<0, true>());
  }
}

// The packed-activation GEMM against float32 activations (cpu_kernels.h), float32 FMA: kRows
// weight rows x kGroups groups of 16 tokens (plus, with kHalf, 8 tokens of one more group in
// 256-bit vectors). bf16 weights are read as pairs (one broadcast 32-bit load) and widened in
// registers: the even weight by a shift, the odd one by masking the low half.
template <typename WeightT, int kRows, int kGroups, bool kHalf>
inline void PackedMicroKernelF32(const WeightT* w, int64_t w_stride, const float* packed,
                                 int64_t group_stride, int64_t n, float* ct, int64_t c_stride) {
  __m512 acc[kRows][kGroups > 0 ? kGroups : 1];
  __m256 acc_half[kRows];
  for (int r = 0; r < kRows; ++r) {
    for (int g = 0; g < kGroups; ++g) acc[r][g] = _mm512_setzero_ps();
    if constexpr (kHalf) acc_half[r] = _mm256_setzero_ps();
  }
  const float* half = packed + kGroups * group_stride;
  // Input i of all tokens times the broadcast weights w_r (one per row).
  auto input = [&](int64_t i, auto weight_of_row) {
    __m512 x[kGroups > 0 ? kGroups : 1];
    for (int g = 0; g < kGroups; ++g) x[g] = _mm512_loadu_ps(packed + g * group_stride + i * 16);
    __m256 x_half;
    if constexpr (kHalf) x_half = _mm256_loadu_ps(half + i * 16);
    for (int r = 0; r < kRows; ++r) {
      const __m512 w_r = weight_of_row(r);
      for (int g = 0; g < kGroups; ++g) acc[r][g] = _mm512_fmadd_ps(w_r, x[g], acc[r][g]);
      if constexpr (kHalf) {
        acc_half[r] = _mm256_fmadd_ps(_mm512_castps512_ps256(w_r), x_half, acc_half[r]);
      }
    }
  };
  if constexpr (sizeof(WeightT) == 2) {  // bf16 pairs
    const __m512i high_half = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
    int64_t i = 0;
    for (; i + 2 <= n; i += 2) {
      __m512i pairs[kRows];
      for (int r = 0; r < kRows; ++r) {
        int32_t pair;
        __builtin_memcpy(&pair, w + r * w_stride + i, sizeof(pair));
        pairs[r] = _mm512_set1_epi32(pair);
      }
      input(i, [&](int r) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs[r], 16)); });
      input(i + 1, [&](int r) { return _mm512_castsi512_ps(_mm512_and_si512(pairs[r], high_half)); });
    }
    if (i < n) {
      input(i, [&](int r) {
        return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int32_t>(w[r * w_stride + i]) << 16));
      });
    }
  } else {  // float32, or int8 widened exactly
    for (int64_t i = 0; i < n; ++i) {
      input(i, [&](int r) { return _mm512_set1_ps(static_cast<float>(w[r * w_stride + i])); });
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int g = 0; g < kGroups; ++g) _mm512_storeu_ps(ct + r * c_stride + 16 * g, acc[r][g]);
    if constexpr (kHalf) _mm256_storeu_ps(ct + r * c_stride + 16 * kGroups, acc_half[r]);
  }
}

template <typename WeightT>
struct PackedF32Kernels {
  using Weight = WeightT;
  using Packed = float;
  template <int kRows, int kGroups, bool kHalf>
  static void Run(const WeightT* w, int64_t w_stride, const float* packed, int64_t group_stride,
                  int64_t n, float* ct, int64_t c_stride) {
    PackedMicroKernelF32<WeightT, kRows, kGroups, kHalf>(w, w_stride, packed, group_stride, n, ct,
                                                         c_stride);
  }
};

inline void PackedDotBf16F32Avx512(const PackedDotProblem<Bf16Bits, float>& p) {
  PackedPasses<PackedF32Kernels<Bf16Bits>>(p);
}
inline void PackedDotF32Avx512(const PackedDotProblem<float, float>& p) {
  PackedPasses<PackedF32Kernels<float>>(p);
}
inline void PackedDotI8F32Avx512(const PackedDotProblem<int8_t, float>& p) {
  PackedPasses<PackedF32Kernels<int8_t>>(p);
}

// exp(x) for x in [-87, 88] (clamped outside), Cephes' expf: relative error ~2e-7.
inline __m512 Exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i exponent = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(exponent));
}

inline __m512 SiluMul512(__m512 g, __m512 u) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 sigmoid = _mm512_div_ps(one, _mm512_add_ps(one, Exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  return _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), u);
}

inline void SiluMulAvx512(const float* gate, const float* up, float* h, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(h + i, SiluMul512(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i)));
  }
  if (i < n) {
    const __mmask16 mask = FirstLanes16(n - i);
    _mm512_mask_storeu_ps(h + i, mask, SiluMul512(_mm512_maskz_loadu_ps(mask, gate + i),
                                                  _mm512_maskz_loadu_ps(mask, up + i)));
  }
}

// 16 elements of a float32 or bfloat16 row as float32, the lanes outside `mask` 0 (not read).
inline __m512 LoadFloats512(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 LoadFloats512(const Bf16Bits* p) {
  return WidenBf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 LoadFloats512(const float* p, __mmask16 mask) {
  return _mm512_maskz_loadu_ps(mask, p);
}
inline __m512 LoadFloats512(const Bf16Bits* p, __mmask16 mask) {
  return WidenBf16(_mm256_maskz_loadu_epi16(mask, p));
}

// The weighted row sums (RowSumProblem) of kQueries weight vectors over the kVecs x 16 columns
// from `v` (the last vector's lanes in `last`): the kQueries x kVecs accumulators stay in
// registers over all rows; per row, kVecs loads of v and kQueries broadcast weights.
template <typename ValueT, int kQueries, int kVecs, bool kMasked>
inline void RowSumStrip512(const float* weight, int64_t weight_stride, const ValueT* v,
                           int64_t v_stride, int64_t rows, __mmask16 last, float* acc,
                           int64_t acc_stride) {
  __m512 sum[kQueries][kVecs];
  for (int j = 0; j < kQueries; ++j) {
    for (int c = 0; c < kVecs; ++c) {
      sum[j][c] = _mm512_maskz_loadu_ps(kMasked && c == kVecs - 1 ? last : 0xffff,
                                        acc + j * acc_stride + 16 * c);
    }
  }
  for (int64_t s = 0; s < rows; ++s) {
    __m512 x[kVecs];
    for (int c = 0; c < kVecs; ++c) {
      x[c] = kMasked && c == kVecs - 1 ? LoadFloats512(v + s * v_stride + 16 * c, last)
                                       : LoadFloats512(v + s * v_stride + 16 * c);
    }
    for (int j = 0; j < kQueries; ++j) {
      const __m512 w = _mm512_set1_ps(weight[j * weight_stride + s]);
      for (int c = 0; c < kVecs; ++c) sum[j][c] = _mm512_fmadd_ps(w, x[c], sum[j][c]);
    }
  }
  for (int j = 0; j < kQueries; ++j) {
    for (int c = 0; c < kVecs; ++c) {
      _mm512_mask_storeu_ps(acc + j * acc_stride + 16 * c,
                            kMasked && c == kVecs - 1 ? last : 0xffff, sum[j][c]);
    }
  }
}

template <typename ValueT, int kVecs, bool kMasked>
inline void RowSumStrips512(int queries, const float* weight, int64_t weight_stride,
                            const ValueT* v, int64_t v_stride, int64_t rows, __mmask16 last,
                            float* acc, int64_t acc_stride) {
  switch (queries) {
    case 8: RowSumStrip512<ValueT, 8, kVecs, kMasked>(weight, weight_stride, v, v_stride, rows, last, acc, acc_stride); break;
    case 7: RowSumStrip512<ValueT, 7, kVecs, kMasked>(weight, weight_stride, v, v_stride, rows, last, acc, acc_stride); break;
    case 6: RowSumStrip512<ValueT, 6, kVecs, kMasked>(weight, weight_stride, v, v_stride, rows, last, acc, acc_stride); break;
    case 5: RowSumStrip512<ValueT, 5, kVecs, kMasked>(weight, weight_stride, v, v_stride, rows, last, acc, acc_stride); break;
    case 4: RowSumStrip512<ValueT, 4, kVecs, kMasked>(weight, weight_stride, v, v_stride, rows, last, acc, acc_stride); break;
    case 3: RowSumStrip512<ValueT, 3, kVecs, kMasked>(weight, weight_stride, v, v_stride, rows, last, acc, acc_stride); break;
    case 2: RowSumStrip512<ValueT, 2, kVecs, kMasked>(weight, weight_stride, v, v_stride, rows, last, acc, acc_stride); break;
    default: RowSumStrip512<ValueT, 1, kVecs, kMasked>(weight, weight_stride, v, v_stride, rows, last, acc, acc_stride); break;
  }
}

// RowSumProblem in strips of 8 weight vectors x 32 columns (16 accumulators).
template <typename ValueT>
inline void WeightedRowSum512(const RowSumProblem<ValueT>& p) {
  for (int64_t j = 0; j < p.n; j += 8) {
    const int queries = p.n - j < 8 ? static_cast<int>(p.n - j) : 8;
    const float* weight = p.weight + j * p.weight_stride;
    float* acc = p.acc + j * p.acc_stride;
    for (int64_t i = 0; i < p.width; i += 32) {
      const int64_t columns = p.width - i < 32 ? p.width - i : 32;
      const __mmask16 last = columns % 16 == 0 ? 0xffff : FirstLanes16(columns % 16);
      const ValueT* v = p.v + i;
      if (columns == 32) {
        RowSumStrips512<ValueT, 2, false>(queries, weight, p.weight_stride, v, p.v_stride, p.rows,
                                          last, acc + i, p.acc_stride);
      } else if (columns > 16) {
        RowSumStrips512<ValueT, 2, true>(queries, weight, p.weight_stride, v, p.v_stride, p.rows,
                                         last, acc + i, p.acc_stride);
      } else {
        RowSumStrips512<ValueT, 1, true>(queries, weight, p.weight_stride, v, p.v_stride, p.rows,
                                         last, acc + i, p.acc_stride);
      }
    }
  }
}

inline void WeightedRowSumAvx512(const RowSumProblem<float>& p) { WeightedRowSum512(p); }
inline void WeightedRowSumBf16Avx512(const RowSumProblem<Bf16Bits>& p) { WeightedRowSum512(p); }

// Attention scores (KernelTable::score_*): c[t * c_stride + r] = row r . a[t] for kRows rows x
// kTokens tokens, each row's 16 elements loaded (and widened) once for all kTokens tokens.
template <typename RowT, int kRows, int kTokens>
inline void ScoreMicroKernel512(const RowT* w, int64_t w_stride, const float* const* a, int64_t n,
                                float* c, int64_t c_stride) {
  __m512 acc[kRows][kTokens];
  for (int r = 0; r < kRows; ++r) {
    for (int t = 0; t < kTokens; ++t) acc[r][t] = _mm512_setzero_ps();
  }
  const float* q[kTokens];
  for (int t = 0; t < kTokens; ++t) q[t] = a[t];
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 row[kRows];
    for (int r = 0; r < kRows; ++r) row[r] = LoadFloats512(w + r * w_stride + i);
    for (int t = 0; t < kTokens; ++t) {
      const __m512 q_t = _mm512_loadu_ps(q[t] + i);
      for (int r = 0; r < kRows; ++r) acc[r][t] = _mm512_fmadd_ps(row[r], q_t, acc[r][t]);
    }
  }
  if (i < n) {
    const __mmask16 mask = FirstLanes16(n - i);
    __m512 row[kRows];
    for (int r = 0; r < kRows; ++r) row[r] = LoadFloats512(w + r * w_stride + i, mask);
    for (int t = 0; t < kTokens; ++t) {
      const __m512 q_t = _mm512_maskz_loadu_ps(mask, q[t] + i);
      for (int r = 0; r < kRows; ++r) acc[r][t] = _mm512_fmadd_ps(row[r], q_t, acc[r][t]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    float sums[kTokens];
    int t = 0;
    for (; t + 4 <= kTokens; t += 4) {
      Sum4x512(acc[r][t], acc[r][t + 1], acc[r][t + 2], acc[r][t + 3], sums + t);
    }
    for (; t < kTokens; ++t) sums[t] = Sum512(acc[r][t]);
    for (t = 0; t < kTokens; ++t) c[t * c_stride + r] = sums[t];
  }
}

template <typename RowT, int kRows>
inline void ScoreRowBlock512(int tokens, const RowT* w, int64_t w_stride, const float* const* a,
                             int64_t n, float* c, int64_t c_stride) {
  switch (tokens) {
    case 8: ScoreMicroKernel512<RowT, kRows, 8>(w, w_stride, a, n, c, c_stride); break;
    case 7: ScoreMicroKernel512<RowT, kRows, 7>(w, w_stride, a, n, c, c_stride); break;
    case 6: ScoreMicroKernel512<RowT, kRows, 6>(w, w_stride, a, n, c, c_stride); break;
    case 5: ScoreMicroKernel512<RowT, kRows, 5>(w, w_stride, a, n, c, c_stride); break;
    case 4: ScoreMicroKernel512<RowT, kRows, 4>(w, w_stride, a, n, c, c_stride); break;
    case 3: ScoreMicroKernel512<RowT, kRows, 3>(w, w_stride, a, n, c, c_stride); break;
    case 2: ScoreMicroKernel512<RowT, kRows, 2>(w, w_stride, a, n, c, c_stride); break;
    default: ScoreMicroKernel512<RowT, kRows, 1>(w, w_stride, a, n, c, c_stride); break;
  }
}

// Tokens in groups of 8, rows in pairs (16 accumulators).
template <typename RowT>
inline void ScoreRows512(const DotProblem<RowT, float>& p) {
  for (int64_t t = 0; t < p.tokens; t += 8) {
    const int tokens = p.tokens - t < 8 ? static_cast<int>(p.tokens - t) : 8;
    float* c = p.c + t * p.c_stride;
    int64_t r = 0;
    for (; r + 2 <= p.rows; r += 2) {
      ScoreRowBlock512<RowT, 2>(tokens, p.w + r * p.w_stride, p.w_stride, p.a + t, p.n, c + r,
                                p.c_stride);
    }
    if (r < p.rows) {
      ScoreRowBlock512<RowT, 1>(tokens, p.w + r * p.w_stride, p.w_stride, p.a + t, p.n, c + r,
                                p.c_stride);
    }
  }
}

inline void ScoreF32Avx512(const DotProblem<float, float>& p) { ScoreRows512(p); }
inline void ScoreBf16Avx512(const DotProblem<Bf16Bits, float>& p) { ScoreRows512(p); }

// KernelTable::exp_sub_sum with Exp512, 16 lanes at a time (the tail masked).
inline float ExpSubSumAvx512(const float* in, float max, float* out, int64_t n) {
  const __m512 shift = _mm512_set1_ps(max), lowest = _mm512_set1_ps(-87.0f);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? 0xffff : FirstLanes16(n - i);
    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(mask, in + i), shift);
    const __m512 e =
        _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lowest, _CMP_GE_OQ) & mask, Exp512(x));
    _mm512_mask_storeu_ps(out + i, mask, e);
    sum = _mm512_add_ps(sum, e);
  }
  return Sum512(sum);
}

// The read probe's loop (read_probe.cc): 4 independent 64-byte loads per round and the same
// software prefetch as the one-token dot kernels (cpu_kernels_impl.h), so that its GB/s stays a
// ceiling for them. Without the prefetch, on the Zen 5 VM with the kernels prefetching
// non-temporally, the lm_head GEMV measured 1.08-1.16 of this probe; with it the probe read
// 1.035-1.065 of its old speed (2 threads, 4 KiB pages, three runs of 31 paired rounds).
inline uint32_t XorWordsAvx512(const void* data, int64_t n_words) {
  const unsigned char* bytes = static_cast<const unsigned char*>(data);
  const uintptr_t end = reinterpret_cast<uintptr_t>(bytes + 4 * n_words);
  const bool non_temporal = PrefetchNonTemporal();
  __m512i x0 = _mm512_setzero_si512(), x1 = x0, x2 = x0, x3 = x0;
  int64_t i = 0;
  for (; i + 64 <= n_words; i += 64) {  // 256 bytes per round, 4 independent chains
    const unsigned char* p = bytes + 4 * i;
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(p) + cpu_kernels_impl::kPrefetchBytes;
    if (ahead + 256 <= end) {
      for (int64_t b = 0; b < 256; b += cpu_kernels_impl::kCacheLine) {
        if (non_temporal) {
          __builtin_prefetch(reinterpret_cast<const void*>(ahead + b), 0, 0);
        } else {
          __builtin_prefetch(reinterpret_cast<const void*>(ahead + b), 0, 2);
        }
      }
    }
    x0 = _mm512_xor_si512(x0, _mm512_loadu_si512(p));
    x1 = _mm512_xor_si512(x1, _mm512_loadu_si512(p + 64));
    x2 = _mm512_xor_si512(x2, _mm512_loadu_si512(p + 128));
    x3 = _mm512_xor_si512(x3, _mm512_loadu_si512(p + 192));
  }
  const __m512i x = _mm512_xor_si512(_mm512_xor_si512(x0, x1), _mm512_xor_si512(x2, x3));
  alignas(64) uint32_t lanes[16];
  _mm512_store_si512(lanes, x);
  uint32_t result = cpu_kernels_impl::XorWordsLoop(bytes + 4 * i, n_words - i);
  for (int j = 0; j < 16; ++j) result ^= lanes[j];
  return result;
}

constexpr int kPeakChains512 = 12;  // > FMA latency x throughput, so the loop is throughput-bound

inline float PeakLoopFma512(int64_t iterations, float seed) {
  __m512 acc[kPeakChains512];
  for (int j = 0; j < kPeakChains512; ++j) acc[j] = _mm512_set1_ps(seed * static_cast<float>(j));
  const __m512 scale = _mm512_set1_ps(1.0f - 1e-7f), add = _mm512_set1_ps(1e-7f * seed);
  for (int64_t it = 0; it < iterations; ++it) {
    for (int j = 0; j < kPeakChains512; ++j) acc[j] = _mm512_fmadd_ps(acc[j], scale, add);
  }
  __m512 sum = acc[0];
  for (int j = 1; j < kPeakChains512; ++j) sum = _mm512_add_ps(sum, acc[j]);
  return Sum512(sum);
}

}  // namespace
}  // namespace ftjax

#endif  // FTJAX_XLA_FFI_CPU_KERNELS_AVX512_COMMON_H_
