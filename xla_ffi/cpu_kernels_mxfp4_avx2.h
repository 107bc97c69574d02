// The AVX2 parts of the one-token mxfp4 kernels: the row loop over groups of 2 blocks and the
// groups' scales, which the float32 form (cpu_kernels_avx2.cc) and the int8 one share, and
// KernelTable::dot_mxfp4_q8 with AVX2 integer instructions (cpu_kernels.h, Mxfp4Q8DotProblem).
// Included by the AVX2 and the AVX-512 translation units, each compiling its own copy with its
// own flags: everything here has internal linkage (static), so the linker never merges a copy
// built for one ISA into another's table.
//
// dot_mxfp4_q8, one token, per row, per group of 2 blocks (64 inputs, 32 code bytes, one block
// per 128-bit lane):
//   the low and the high nibbles (vpand, vpsrlw) look up 2 * E2M1 + 12, in [0, 24] (vpshufb);
//   vpmaddubsw multiplies those unsigned bytes with the int8 activations (permuted once per call
//   into the same even / odd order) and adds pairs to int16 (at most 2 * 24 * 127: no
//   saturation); the two products are added (at most 12192) and vpmaddwd by 1 sums them to 4
//   int32 per block, to which the block's -12 * (sum of its activations) is added, so each lane
//   half sums to the block's exact integer sum of 2 * E2M1 * a;
//   one conversion to float32 and one FMA with the blocks' scales (2^(e - 127) / 2 times the
//   activation scale, 8 blocks' worth converted at a time before the row's groups).
// 11 vector operations per 64 weights, against 29 for the float32 activations' exact form
// (cpu_kernels_avx2.cc). Same integer block sums as DotMxfp4Q8Loop; the float32 sums in another
// order. An odd last block takes the low lane, the high one reading codes and activations of 0.
// Codes `ahead_bytes` ahead are prefetched, as in the float32 form; inputs past
// kMxfp4OneTokenChunk are taken in further chunks, each row's partial sums added. Several
// tokens: one pass over the rows per token.

#ifndef FTJAX_XLA_FFI_CPU_KERNELS_MXFP4_AVX2_H_
#define FTJAX_XLA_FFI_CPU_KERNELS_MXFP4_AVX2_H_

#include <immintrin.h>

#include <cstdint>

#include "cpu_kernels.h"
#include "cpu_kernels_impl.h"

namespace ftjax {
namespace mxfp4_avx2 {

// The scales of a row's groups: the E8M0 bytes of its `blocks` blocks to float32 (Mxfp4Scale),
// times multiplier[b] when there is one (8 * ceil(blocks / 8) of them), each group's two spread
// over the lanes' halves: scale_of[8 g + 4 l + k] is block 2 g + l's scale (0 past the last).
static void GroupScales(const uint8_t* scales, int64_t blocks, const float* multiplier,
                        float* scale_of) {
  const __m256 subnormal = _mm256_castsi256_ps(_mm256_set1_epi32(0x00400000));
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  for (int64_t q = 0; q < (blocks + 7) / 8; ++q) {
    alignas(8) uint8_t e8[8] = {};
    const uint8_t* from = scales + 8 * q;
    if (8 * q + 8 > blocks) {  // the last, short, run: through a zero-padded copy
      for (int64_t k = 0; 8 * q + k < blocks; ++k) e8[k] = scales[8 * q + k];
      from = e8;
    }
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(from)));
    __m256 f = _mm256_blendv_ps(_mm256_castsi256_ps(_mm256_slli_epi32(e, 23)), subnormal,
                                _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, _mm256_setzero_si256())));
    if (multiplier != nullptr) f = _mm256_mul_ps(f, _mm256_loadu_ps(multiplier + 8 * q));
    for (int k = 0; k < 4; ++k) {
      const __m256i pick = _mm256_add_epi32(spread, _mm256_set1_epi32(2 * k));
      _mm256_store_ps(scale_of + 32 * q + 8 * k, _mm256_permutevar8x32_ps(f, pick));
    }
  }
}

// One row's groups (`groups` whole ones, then a last single block when `last`), 32 code bytes
// each: add(g, bytes, acc) adds group g's scaled sum into one of two accumulators, alternately,
// with the codes `ahead_bytes` ahead prefetched (not past prefetch_end); returns the sum of all
// lanes. The last block's group has its high 16 bytes zero.
template <int kLocality, typename Add>
static float SumGroups(const uint8_t* codes, int64_t groups, bool last, int64_t ahead_bytes,
                       uintptr_t prefetch_end, Add add) {
  auto whole = [&](int64_t g) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 32 * g));
  };
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {  // 64 bytes of codes: one cache line
    const uintptr_t ahead = reinterpret_cast<uintptr_t>(codes + 32 * g) + ahead_bytes;
    if (ahead_bytes > 0 && ahead + cpu_kernels_impl::kCacheLine <= prefetch_end) {
      __builtin_prefetch(reinterpret_cast<const void*>(ahead), 0, kLocality);
    }
    add(g, whole(g), acc0);
    add(g + 1, whole(g + 1), acc1);
  }
  if (g < groups) {
    add(g, whole(g), acc0);
    ++g;
  }
  if (last) {
    const __m128i tail = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 32 * g));
    add(g, _mm256_zextsi128_si256(tail), acc1);
  }
  const __m256 v = _mm256_add_ps(acc0, acc1);
  const __m128 q4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 d2 = _mm_add_ps(q4, _mm_movehl_ps(q4, q4));
  return _mm_cvtss_f32(_mm_add_ss(d2, _mm_movehdup_ps(d2)));
}

template <int kLocality>
static void OneTokenQ8(const Mxfp4Q8DotProblem& p, int64_t t, int64_t ahead_bytes) {
  // 2 * E2M1 + 12 for the 16 codes, in both lanes.
  const __m256i offset_values = _mm256_setr_epi8(
      12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,
      12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  const uintptr_t prefetch_end =
      reinterpret_cast<uintptr_t>(p.codes + (p.rows - 1) * p.code_stride + p.n / 2);
  constexpr int64_t kChunk = cpu_kernels_impl::kMxfp4OneTokenChunk;
  alignas(32) int8_t a_p[kChunk];          // per group: 32 even inputs, then 32 odd ones
  alignas(32) int32_t offset_of[kChunk / 8];  // per group: -12 * block sums in lanes 0 and 4
  alignas(32) float half_scale[kChunk / 32 + 8];  // per block: a_scale / 2 (0 past the end)
  alignas(32) float scale_of[kChunk / 8];  // per group: its 2 block scales, 4 lanes each
  for (int64_t i = 0; i < p.n; i += kChunk) {
    const int64_t blocks = (p.n - i < kChunk ? p.n - i : kChunk) / 32;
    const int64_t groups = blocks / 2, last = blocks & 1;
    const int8_t* a = p.a[t] + i;
    const float* a_scales = p.a_scales[t] + i / 32;
    // Each block's 32 activations to 16 even and 16 odd ones (vpshufb in the lanes, vpermq
    // across), the two blocks of a group in the lanes of a_p's even and odd vectors; the block
    // sums by vpmaddubsw and vpmaddwd with ones.
    const __m256i deinterleave = _mm256_setr_epi8(
        0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
        0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m256i ones8 = _mm256_set1_epi8(1);
    auto split = [&](const int8_t* block) {  // 128-bit lanes: the evens, the odds
      return _mm256_permute4x64_epi64(
          _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)),
                              deinterleave),
          _MM_SHUFFLE(3, 1, 2, 0));
    };
    for (int64_t g = 0; g < groups + last; ++g) {
      const __m256i first = split(a + 64 * g);
      const __m256i second = g < groups ? split(a + 64 * g + 32) : _mm256_setzero_si256();
      _mm256_store_si256(reinterpret_cast<__m256i*>(a_p + 64 * g),
                         _mm256_permute2x128_si256(first, second, 0x20));
      _mm256_store_si256(reinterpret_cast<__m256i*>(a_p + 64 * g + 32),
                         _mm256_permute2x128_si256(first, second, 0x31));
      // Block sums: lanes 0-3 of each 128-bit half hold first's, then second's, partial sums.
      const __m256i partial = _mm256_madd_epi16(
          _mm256_maddubs_epi16(ones8, _mm256_permute2x128_si256(first, second, 0x20)),
          _mm256_set1_epi16(1));
      const __m256i partial_odd = _mm256_madd_epi16(
          _mm256_maddubs_epi16(ones8, _mm256_permute2x128_si256(first, second, 0x31)),
          _mm256_set1_epi16(1));
      alignas(32) int32_t sums[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums), _mm256_add_epi32(partial, partial_odd));
      const int32_t sum_first = sums[0] + sums[1] + sums[2] + sums[3];
      const int32_t sum_second = sums[4] + sums[5] + sums[6] + sums[7];
      for (int k = 0; k < 8; ++k) offset_of[8 * g + k] = 0;
      offset_of[8 * g] = -12 * sum_first;
      offset_of[8 * g + 4] = -12 * sum_second;
    }
    for (int64_t b = 0; b < (blocks + 7) / 8 * 8; ++b) {
      half_scale[b] = b < blocks ? 0.5f * a_scales[b] : 0.0f;
    }
    for (int64_t r = 0; r < p.rows; ++r) {
      const uint8_t* codes = p.codes + r * p.code_stride + i / 2;
      const uint8_t* scales = p.scales + r * p.scale_stride + i / 32;
      // The block scales: the weights' times the activations' half scales.
      GroupScales(scales, blocks, half_scale, scale_of);
      auto add = [&](int64_t g, __m256i bytes, __m256& acc) {
        const __m256i lo = _mm256_and_si256(bytes, nibble);
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
        const __m256i pairs = _mm256_add_epi16(
            _mm256_maddubs_epi16(_mm256_shuffle_epi8(offset_values, lo),
                                 _mm256_load_si256(reinterpret_cast<const __m256i*>(a_p + 64 * g))),
            _mm256_maddubs_epi16(
                _mm256_shuffle_epi8(offset_values, hi),
                _mm256_load_si256(reinterpret_cast<const __m256i*>(a_p + 64 * g + 32))));
        const __m256i sums = _mm256_add_epi32(
            _mm256_madd_epi16(pairs, ones),
            _mm256_load_si256(reinterpret_cast<const __m256i*>(offset_of + 8 * g)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_load_ps(scale_of + 8 * g), acc);
      };
      const float sum = SumGroups<kLocality>(codes, groups, last, ahead_bytes, prefetch_end, add);
      float* c = p.c + t * p.c_stride + r;
      *c = i == 0 ? sum : *c + sum;
    }
  }
}

static void DotQ8(const Mxfp4Q8DotProblem& p) {
  if (p.rows <= 0) return;
  const KernelTuning tuning = CurrentKernelTuning();
  const int64_t ahead =
      tuning.prefetch_bytes < 0 ? cpu_kernels_impl::kPrefetchBytes : tuning.prefetch_bytes;
  const bool nta = TunedPrefetchNonTemporal(tuning);
  for (int64_t t = 0; t < p.tokens; ++t) {
    if (nta) {
      OneTokenQ8<0>(p, t, ahead);
    } else {
      OneTokenQ8<2>(p, t, ahead);
    }
  }
}

}  // namespace mxfp4_avx2
}  // namespace ftjax

#endif  // FTJAX_XLA_FFI_CPU_KERNELS_MXFP4_AVX2_H_
