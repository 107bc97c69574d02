// AVX-512-BF16 kernels: bf16 weights against bf16-rounded activations with vdpbf16ps (32
// multiply-adds of bf16 pairs into 16 float32 lanes per instruction), int8 weights against
// int8 activations with vpdpbusd (AVX-512-VNNI, which every AVX-512-BF16 CPU has; cpu_isa.cc
// checks both), plus the AVX-512 float32 paths. Compiled with the AVX-512, -mavx512bf16 and
// -mavx512vnni flags by its suffix (CMakeLists.txt); on a compiler that does not target them the
// table is absent. See cpu_kernels.h. Where the compiler targets AMX (-mamx-tile -mamx-bf16,
// added when it accepts them), the packed bf16 GEMM runs on AMX tiles on CPUs that have them
// (cpu_isa.h's AmxEnabled()).

#include <algorithm>

#include "cpu_isa.h"
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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
constexpr bool kHasAmx = true;

// The packed bf16 GEMM on AMX tiles. The packed activations are already the layout tdpbf16ps
// takes for its second operand (VNNI: row p holds input pair p of 16 tokens, 64 bytes), and the
// weight rows, read in place, are its first: C[16 rows][16 tokens] += W[16 rows][32 inputs] x
// X[16 pairs][16 tokens x 2], float32 sums of exact bf16 products (denormal inputs read as zero,
// as vdpbf16ps does). A block is up to 2 x 2 tiles of C (32 weight rows x 32 tokens, tmm0-3),
// with 2 weight tiles (tmm4-5) and 2 activation tiles (tmm6-7) loaded per 32 inputs.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Copies the first `columns` of a 16 x 16 float32 tile to ct.
inline void CopyColumns(const float* tile, float* ct, int64_t c_stride, int columns) {
  for (int r = 0; r < 16; ++r) {
    for (int c = 0; c < columns; ++c) ct[r * c_stride + c] = tile[r * 16 + c];
  }
}

// Stores C tile `tile` (a literal: GCC's tile intrinsics name the register by it) at ct, its
// first `columns` (16, or 8 for a half group) of 16.
#define FTJAX_STORE_TILE(tile, ct, c_stride, columns)                        \
  do {                                                                       \
    if ((columns) == 16) {                                                   \
      _tile_stored(tile, (ct), (c_stride) * static_cast<int64_t>(sizeof(float))); \
    } else {                                                                 \
      alignas(64) float stored[16 * 16];                                     \
      _tile_stored(tile, stored, 16 * sizeof(float));                        \
      CopyColumns(stored, (ct), (c_stride), (columns));                      \
    }                                                                        \
  } while (0)

// kRowTiles x kGroupTiles tiles of C over all n inputs (n a multiple of 32). `columns`: of the
// last group (16, or 8 for a half group).
template <int kRowTiles, int kGroupTiles>
inline void AmxBlock(const Bf16Bits* w, int64_t w_stride, const Bf16Bits* packed,
                     int64_t group_stride, int64_t n, float* ct, int64_t c_stride,
                     int last_columns) {
  const int64_t w_bytes = w_stride * static_cast<int64_t>(sizeof(Bf16Bits));
  constexpr int64_t kPairRowBytes = 2 * kPackedGroup * sizeof(Bf16Bits);  // 64
  _tile_zero(0);
  if constexpr (kGroupTiles == 2) _tile_zero(1);
  if constexpr (kRowTiles == 2) _tile_zero(2);
  if constexpr (kRowTiles == 2 && kGroupTiles == 2) _tile_zero(3);
  for (int64_t i = 0; i < n; i += 32) {
    // Inputs i .. i + 31 are pairs i / 2 .. i / 2 + 15: 16 rows of 32 elements from i * 16.
    _tile_loadd(6, packed + i * kPackedGroup, kPairRowBytes);
    if constexpr (kGroupTiles == 2) _tile_loadd(7, packed + group_stride + i * kPackedGroup,
                                                kPairRowBytes);
    _tile_loadd(4, w + i, w_bytes);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kGroupTiles == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (kRowTiles == 2) {
      _tile_loadd(5, w + 16 * w_stride + i, w_bytes);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (kGroupTiles == 2) _tile_dpbf16ps(3, 5, 7);
    }
  }
  const int first_columns = kGroupTiles == 2 ? 16 : last_columns;
  FTJAX_STORE_TILE(0, ct, c_stride, first_columns);
  if constexpr (kGroupTiles == 2) FTJAX_STORE_TILE(1, ct + 16, c_stride, last_columns);
  if constexpr (kRowTiles == 2) {
    FTJAX_STORE_TILE(2, ct + 16 * c_stride, c_stride, first_columns);
    if constexpr (kGroupTiles == 2) {
      FTJAX_STORE_TILE(3, ct + 16 * c_stride + 16, c_stride, last_columns);
    }
  }
}

// Up to this many groups of 16 tokens over the caller's tiles (PackedDotProblem::call_groups),
// the rows go in blocks of 16 (one weight tile): the GEMM reads its weights at the memory's
// rate, and 16 rows are 16 streams of reads, which the L2 prefetcher follows better than 32. On the Xeon VM (lm_head [248320, 2048] bf16, 2 threads)
// 16-row blocks read 29.5 GB/s at 8 tokens against 27.2 for 32 rows, 27.1 against 23.7 at 16
// tokens, 24.1 against 20.0 at 32, 18.9 against 17.5 at 64, and the two tied at 128; past that
// the GEMM is bound by the tiles' products, and 32-row blocks, whose activation tiles each
// serve two products, won (512 tokens: 6% faster).
constexpr int64_t kAmxOneRowTileMaxGroups = 8;

// Rows in blocks of 32 (then 16), or of 16 for few tokens (kAmxOneRowTileMaxGroups), on the
// tiles; the last rows % 16 on the vdpbf16ps kernels. Needs n % 32 == 0 (PackedDotBf16 checks).
void PackedDotBf16Amx(const PackedDotProblem<Bf16Bits, Bf16Bits>& p) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
  const int64_t group_stride = PackedGroupElements<Bf16Bits>(p.n);
  const int64_t tile_rows = p.rows / 16 * 16;
  const bool memory_bound = std::max(p.groups, p.call_groups) <= kAmxOneRowTileMaxGroups;
  for (int64_t r = 0; r < tile_rows;) {
    const bool two_rows = !memory_bound && tile_rows - r >= 32;
    const Bf16Bits* w = p.w + r * p.w_stride;
    for (int64_t g = 0; g < p.groups;) {
      const bool two_groups = p.groups - g >= 2;
      const bool last = g + (two_groups ? 2 : 1) == p.groups;
      const int last_columns = last && p.half_last_group ? 8 : 16;
      const Bf16Bits* packed = p.packed + g * group_stride;
      float* ct = p.ct + r * p.c_stride + 16 * g;
      if (two_rows && two_groups) {
        AmxBlock<2, 2>(w, p.w_stride, packed, group_stride, p.n, ct, p.c_stride, last_columns);
      } else if (two_rows) {
        AmxBlock<2, 1>(w, p.w_stride, packed, group_stride, p.n, ct, p.c_stride, last_columns);
      } else if (two_groups) {
        AmxBlock<1, 2>(w, p.w_stride, packed, group_stride, p.n, ct, p.c_stride, last_columns);
      } else {
        AmxBlock<1, 1>(w, p.w_stride, packed, group_stride, p.n, ct, p.c_stride, last_columns);
      }
      g += two_groups ? 2 : 1;
    }
    r += two_rows ? 32 : 16;
  }
  _tile_release();  // the 8 KiB of tile state is not kept (nor saved at context switches)
  if (tile_rows < p.rows) {
    PackedDotProblem<Bf16Bits, Bf16Bits> rest = p;
    rest.w = p.w + tile_rows * p.w_stride;
    rest.rows = p.rows - tile_rows;
    rest.ct = p.ct + tile_rows * p.c_stride;
    PackedPasses<PackedBf16Kernels>(rest);
  }
}
#undef FTJAX_STORE_TILE
#else
constexpr bool kHasAmx = false;
void PackedDotBf16Amx(const PackedDotProblem<Bf16Bits, Bf16Bits>& p) {
  PackedPasses<PackedBf16Kernels>(p);
}
#endif

void PackedDotBf16(const PackedDotProblem<Bf16Bits, Bf16Bits>& p) {
  if (p.n % 32 == 0 && p.rows >= 16 && AmxEnabled()) {
    PackedDotBf16Amx(p);
  } else {
    PackedPasses<PackedBf16Kernels>(p);
  }
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
    /*dot_int4_f32=*/DotInt4F32Avx512,
    /*decode_int4=*/DecodeInt4Avx512,
    /*delta_rule_step=*/cpu_kernels_impl::DeltaRuleStepLoop,
    /*argmax_f32=*/cpu_kernels_impl::ArgmaxLoop,
};

}  // namespace

const KernelTable* Avx512Bf16Kernels() { return &kAvx512Bf16Table; }
bool Avx512Bf16HasAmx() { return kHasAmx; }

}  // namespace ftjax

#else

namespace ftjax {
const KernelTable* Avx512Bf16Kernels() { return nullptr; }
bool Avx512Bf16HasAmx() { return false; }
}  // namespace ftjax

#endif
