// The register-blocked dot-product driver shared by the ISA translation units (cpu_kernels_*.cc).
//
// Each ISA file defines an `Ops` struct (in an anonymous namespace) that says how to load, multiply
// and reduce one step of `Ops::kStep` elements, and instantiates Dot<Ops>. Everything here is a
// template over Ops, so every instantiation has internal linkage and is compiled with the flags of
// the file that instantiates it: nothing here can be merged with another ISA's copy.
//
// An Ops struct provides:
//   using Weight, Activation;                   element types of the two operands
//   using WeightVec, ActivationVec, Acc;        register types
//   static constexpr int64_t kStep;             elements of i consumed by one MulAdd
//   static Acc Zero();
//   static WeightVec LoadWeights(const Weight* p);            kStep elements
//   static WeightVec LoadWeightsTail(const Weight* p, int64_t count);   count < kStep, rest 0
//   static ActivationVec LoadActivations(const Activation* p);
//   static ActivationVec LoadActivationsTail(const Activation* p, int64_t count);
//   static Acc MulAdd(Acc acc, WeightVec w, ActivationVec a);   acc += w * a, lane-wise sums
//   static Acc Add(Acc a, Acc b);                               lane-wise a + b
//   static float Sum(Acc acc);                                  sum of all lanes
//   static void Sum4(Acc a0, Acc a1, Acc a2, Acc a3, float* out);   out[j] = Sum(aj)
//   static constexpr int kVectorRegisters;  the ISA's vector registers (register blocking)

#ifndef FTJAX_XLA_FFI_CPU_KERNELS_IMPL_H_
#define FTJAX_XLA_FFI_CPU_KERNELS_IMPL_H_

#include <cstddef>
#include <cstdint>

#include "cpu_kernels.h"

namespace ftjax {
namespace cpu_kernels_impl {

// c[t * c_stride + r] = sum_i w[r * w_stride + i] * a[t][i] for r < kRows, t < kTokens: the
// kRows x kTokens accumulators stay in registers for the whole of n. With `next` (the first of
// the next kRows rows, or nullptr), the next block's rows are prefetched in step with this
// block's reads (__builtin_prefetch locality kLocality), one cache line per row at a time: each
// weight row is its own short stream (4 KiB for 2048 bf16 inputs, one page), which the
// hardware prefetcher does not follow far enough ahead.
template <typename Ops, int kRows, int kTokens, int kLocality>
inline void MicroKernel(const typename Ops::Weight* w, int64_t w_stride,
                        const typename Ops::Activation* const* a, int64_t n, float* c,
                        int64_t c_stride, const typename Ops::Weight* next) {
  constexpr int64_t kLineElements = 64 / sizeof(typename Ops::Weight);
  typename Ops::Acc acc[kTokens][kRows];
  for (int t = 0; t < kTokens; ++t) {
    for (int r = 0; r < kRows; ++r) acc[t][r] = Ops::Zero();
  }
  int64_t i = 0;
  for (; i + Ops::kStep <= n; i += Ops::kStep) {
    if (next != nullptr && i % kLineElements == 0) {
      for (int r = 0; r < kRows; ++r) __builtin_prefetch(next + r * w_stride + i, 0, kLocality);
    }
    typename Ops::WeightVec w_vec[kRows];
    for (int r = 0; r < kRows; ++r) w_vec[r] = Ops::LoadWeights(w + r * w_stride + i);
    for (int t = 0; t < kTokens; ++t) {
      const typename Ops::ActivationVec a_vec = Ops::LoadActivations(a[t] + i);
      for (int r = 0; r < kRows; ++r) acc[t][r] = Ops::MulAdd(acc[t][r], w_vec[r], a_vec);
    }
  }
  if (i < n) {
    const int64_t count = n - i;
    typename Ops::WeightVec w_vec[kRows];
    for (int r = 0; r < kRows; ++r) w_vec[r] = Ops::LoadWeightsTail(w + r * w_stride + i, count);
    for (int t = 0; t < kTokens; ++t) {
      const typename Ops::ActivationVec a_vec = Ops::LoadActivationsTail(a[t] + i, count);
      for (int r = 0; r < kRows; ++r) acc[t][r] = Ops::MulAdd(acc[t][r], w_vec[r], a_vec);
    }
  }
  for (int t = 0; t < kTokens; ++t) {
    float* c_t = c + t * c_stride;
    int r = 0;
    for (; r + 4 <= kRows; r += 4) {
      Ops::Sum4(acc[t][r], acc[t][r + 1], acc[t][r + 2], acc[t][r + 3], c_t + r);
    }
    for (; r < kRows; ++r) c_t[r] = Ops::Sum(acc[t][r]);
  }
}

// All tokens against kRows weight rows starting at row `row`: the rows stay in L1 while the
// tokens go past in blocks of 4. The first block of tokens prefetches the next kRows rows
// (while there are that many).
template <typename Ops, int kRows, int kLocality>
inline void RowBlock(const DotProblem<typename Ops::Weight, typename Ops::Activation>& p,
                     int64_t row) {
  const typename Ops::Weight* w = p.w + row * p.w_stride;
  const typename Ops::Weight* next =
      row + 2 * kRows <= p.rows ? w + kRows * p.w_stride : nullptr;
  int64_t t = 0;
  for (; t + 4 <= p.tokens; t += 4) {
    MicroKernel<Ops, kRows, 4, kLocality>(w, p.w_stride, p.a + t, p.n,
                                          p.c + t * p.c_stride + row, p.c_stride, next);
    next = nullptr;
  }
  float* c = p.c + t * p.c_stride + row;
  switch (p.tokens - t) {
    case 3:
      MicroKernel<Ops, kRows, 3, kLocality>(w, p.w_stride, p.a + t, p.n, c, p.c_stride, next);
      break;
    case 2:
      MicroKernel<Ops, kRows, 2, kLocality>(w, p.w_stride, p.a + t, p.n, c, p.c_stride, next);
      break;
    case 1:
      MicroKernel<Ops, kRows, 1, kLocality>(w, p.w_stride, p.a + t, p.n, c, p.c_stride, next);
      break;
    default: break;
  }
}

// Software prefetch on the one-token path: each pass of RowTimesVector's main loop asks for the
// cache lines kPrefetchBytes ahead of what it reads, non-temporally on AMD and into L2 elsewhere
// (PrefetchNonTemporal, cpu_kernels.h). On the 2-core Xeon (Sapphire Rapids class) VM the
// hardware prefetcher alone ran the row-by-row GEMV at 0.75 of the read probe (lm_head) and the
// decode expert FFN at 0.85; 3 KiB ahead into L2 gave 0.92 and 0.98 (benchmarks/expert_kernel.py;
// 2 and 4 KiB within noise of 3, 1.5 KiB into L1 worse, NTA far worse). With FTJAX_ISA=avx2 on
// that machine: 0.81 -> 1.07 and 0.84 -> 1.04 of the AVX2 read probe.
// On the 2-core AMD EPYC (Zen 5) VM one core streams ~40 GB/s, so ~5 KiB must be in flight at
// ~120 ns latency, more than 3 KiB ahead covers. A [32768, 2048] bf16 GEMV on 64-row tiles, 2
// threads, medians of 31-61 rounds each paired with the read probe:
//   - per-thread CPU time (another process shared the cores), 2 MiB pages: 0.93 -> 0.96-0.99 of
//     the read probe with 6 KiB into L2 (AVX-512; 8 KiB within noise of 6, 1 KiB 0.85, none
//     0.89-0.91, prefetcht0 within noise of prefetcht1), AVX2 0.88 -> 0.96-0.97, 0.98-1.0 with 8
//     accumulators (kRowPassBytes below); 4 KiB pages (jax buffers, mapped files), all lower:
//     AVX-512 0.78 none, 0.87 at 3 KiB, 0.89-0.91 at 6 KiB, 0.90 at 12 KiB;
//   - wall time on the quiet machine, 4 KiB pages, 6 KiB ahead: prefetchnta over prefetcht1
//     1.07 vs 1.03, 1.02 vs 1.02, 0.92 vs 0.87 of the read probe in three runs (AVX2 8
//     accumulators: 1.03-1.07 with NTA); 4, 8 and 12 KiB non-temporal no better than 6, 12 and
//     16 KiB into L2 worse than 6.
// Prefetches stop at the end of the problem's weights, so no line past them is read. This is the
// default; KernelTuning::prefetch_bytes and prefetch_hint choose per machine (0: none).
constexpr int64_t kPrefetchBytes = 6144;
constexpr int64_t kCacheLine = 64;

// RowTimesVector's accumulators: enough for kRowPassBytes of weights per pass of its loop, within
// [4, 8] (at least 4 hide the multiply-add latency). AVX2's 16-byte bf16 steps take 8: 0.96 ->
// 0.98 of the read probe on the Zen 5 VM (the loop and its prefetch cost less per byte); the
// AVX-512 ops, 32- and 64-byte steps, keep 4.
constexpr int64_t kRowPassBytes = 128;
template <typename Ops>
constexpr int RowAccumulators() {
  constexpr int64_t by_bytes = kRowPassBytes / (Ops::kStep * sizeof(typename Ops::Weight));
  return by_bytes < 4 ? 4 : by_bytes > 8 ? 8 : static_cast<int>(by_bytes);
}

// The lane-wise partial sums of row . a (one token) over n: kSplit accumulators along i, so that
// the multiply-add latency is hidden. Ops::Sum of the result is the dot product. Lines
// `ahead` bytes ahead of the reads are prefetched (none when 0), with __builtin_prefetch's
// locality kLocality (0: prefetchnta, 2: prefetcht1), while they lie before `prefetch_end`.
template <typename Ops, int kSplit, int kLocality>
inline typename Ops::Acc RowTimesVector(const typename Ops::Weight* row,
                                        const typename Ops::Activation* a, int64_t n,
                                        uintptr_t prefetch_end, int64_t ahead_bytes) {
  constexpr int64_t kPassBytes = kSplit * Ops::kStep * sizeof(typename Ops::Weight);
  typename Ops::Acc acc[kSplit];
  for (int s = 0; s < kSplit; ++s) acc[s] = Ops::Zero();
  int64_t i = 0;
  for (; i + kSplit * Ops::kStep <= n; i += kSplit * Ops::kStep) {
    if constexpr (kPassBytes >= kCacheLine) {  // not the scalar fallback's short passes
      const uintptr_t ahead = reinterpret_cast<uintptr_t>(row + i) + ahead_bytes;
      if (ahead_bytes > 0 && ahead + kPassBytes <= prefetch_end) {
        for (int64_t b = 0; b < kPassBytes; b += kCacheLine) {
          __builtin_prefetch(reinterpret_cast<const void*>(ahead + b), 0, kLocality);
        }
      }
    }
    for (int s = 0; s < kSplit; ++s) {
      acc[s] = Ops::MulAdd(acc[s], Ops::LoadWeights(row + i + s * Ops::kStep),
                           Ops::LoadActivations(a + i + s * Ops::kStep));
    }
  }
  for (; i + Ops::kStep <= n; i += Ops::kStep) {
    acc[0] = Ops::MulAdd(acc[0], Ops::LoadWeights(row + i), Ops::LoadActivations(a + i));
  }
  if (i < n) {
    acc[0] = Ops::MulAdd(acc[0], Ops::LoadWeightsTail(row + i, n - i),
                         Ops::LoadActivationsTail(a + i, n - i));
  }
  for (int s = 1; s < kSplit; ++s) acc[0] = Ops::Add(acc[0], acc[s]);
  return acc[0];
}

// One token (a GEMV) is bound by reading the weights, so the rows are read one after the other: a
// single sequential stream, which the hardware prefetcher follows (helped by the software prefetch
// above, which the Xeon VMs need to get near the read bandwidth). Blocks of 4 or 8 rows read side
// by side (4-8 interleaved streams) measured 0.75-0.8 of it on the 2-core Zen 4 VM.
//
// Each row's lanes are summed as soon as the row is done. Summing 4 rows at a time with Ops::Sum4
// instead (the 4 rows' loops inlined one after the other) ran the AVX-512 bf16 GEMV at 0.75 of the
// read probe on the Zen 5 VM against 0.91 this way, with the same inner-loop instructions (one
// thread, 4 KiB pages, medians of 21-31 paired rounds); AVX2 0.90 either way.
template <typename Ops, int kSplit, int kLocality>
void OneToken(const DotProblem<typename Ops::Weight, typename Ops::Activation>& p,
              int64_t ahead_bytes) {
  const typename Ops::Activation* a = p.a[0];
  const uintptr_t end = reinterpret_cast<uintptr_t>(p.w + (p.rows - 1) * p.w_stride + p.n);
  for (int64_t row = 0; row < p.rows; ++row) {
    p.c[row] = Ops::Sum(RowTimesVector<Ops, kSplit, kLocality>(p.w + row * p.w_stride, a, p.n,
                                                               end, ahead_bytes));
  }
}

// OneToken with the tuning's accumulators (KernelTuning::row_accumulators; the default by bytes).
template <typename Ops, int kLocality>
void OneTokenTuned(const DotProblem<typename Ops::Weight, typename Ops::Activation>& p,
                   const KernelTuning& tuning) {
  const int64_t ahead = tuning.prefetch_bytes < 0 ? kPrefetchBytes : tuning.prefetch_bytes;
  switch (tuning.row_accumulators) {
    case 4: OneToken<Ops, 4, kLocality>(p, ahead); break;
    case 8: OneToken<Ops, 8, kLocality>(p, ahead); break;
    default: OneToken<Ops, RowAccumulators<Ops>(), kLocality>(p, ahead); break;
  }
}

// Every row of the problem in blocks of kRows rows (the rest in a smaller block).
template <typename Ops, int kRows, int kLocality>
void RowBlocks(const DotProblem<typename Ops::Weight, typename Ops::Activation>& p) {
  int64_t row = 0;
  for (; row + kRows <= p.rows; row += kRows) RowBlock<Ops, kRows, kLocality>(p, row);
  switch (p.rows - row) {
    case 3: RowBlock<Ops, 3, kLocality>(p, row); break;
    case 2: RowBlock<Ops, 2, kLocality>(p, row); break;
    case 1: RowBlock<Ops, 1, kLocality>(p, row); break;
    default: break;
  }
}

// RowBlocks with the tuning's rows per block (KernelTuning::block_rows). By default, kRows rows x
// 4 tokens in registers (the rows stay in L1 while all tokens go past): the accumulators, the
// rows' weight vectors and one activation vector must fit the ISA's vector registers, or the
// compiler spills accumulators to the stack inside the loop: 4 x 4 (21 registers) where there are
// 32 (AVX-512), 2 x 4 (11) where there are 16 (AVX2). On the AVX2-only Zen 3 VM (2 cores, a noisy
// day: medians of 4-5 alternating runs of 15), a [151936, 2048] bf16 GEMM (the lm_head of a
// batch) of 4 tokens took 47.9 ms in 4 x 4 blocks without prefetch, 37.3 ms in 2 x 4 blocks with
// the next block prefetched; 8 tokens 72.6 -> 54.7 ms (the one-token GEMV: 34-38 ms in those runs).
// 3 x 4 also fits AVX2 (15 registers: GCC 12 takes the activations as the FMAs' memory operands),
// and its 12 independent multiply-add chains, against 2 x 4's 8, cover the FMA latency at 2 per
// cycle: one core, weights in L2, 4-8 tokens ran at 0.55-0.8 of the FMA peak against 0.45-0.5.
// With the weights streamed from memory (the lm_head above, 2 threads) the two were within noise
// of each other, so 2 stays the default and the tuner (KernelTuning::block_rows) may choose 3.
template <typename Ops, int kLocality>
void RowBlocksTuned(const DotProblem<typename Ops::Weight, typename Ops::Activation>& p,
                    const KernelTuning& tuning) {
  const int rows = tuning.block_rows != 0 ? tuning.block_rows
                   : Ops::kVectorRegisters >= 32 ? 4 : 2;
  switch (rows) {
    case 1: RowBlocks<Ops, 1, kLocality>(p); break;
    case 3: RowBlocks<Ops, 3, kLocality>(p); break;
    case 4: RowBlocks<Ops, 4, kLocality>(p); break;
    default: RowBlocks<Ops, 2, kLocality>(p); break;
  }
}

// With 2 or more tokens the 4 x 4 register blocks below win: the row kernel needs one activation
// load per multiply-add and runs into the load ports (measured on 16 MiB of bf16 weights, one
// core: 2 tokens 44 vs 34 GB/s, 4 tokens 30 vs 15 GB/s).
template <typename Ops>
void Dot(const DotProblem<typename Ops::Weight, typename Ops::Activation>& p) {
  if (p.rows <= 0) return;
  const KernelTuning tuning = CurrentKernelTuning();
  const bool non_temporal = TunedPrefetchNonTemporal(tuning);
  if (p.tokens == 1) {
    if (non_temporal) {
      OneTokenTuned<Ops, 0>(p, tuning);
    } else {
      OneTokenTuned<Ops, 2>(p, tuning);
    }
    return;
  }
  if (non_temporal) {
    RowBlocksTuned<Ops, 0>(p, tuning);
  } else {
    RowBlocksTuned<Ops, 2>(p, tuning);
  }
}

// mxfp4 (KernelTable::dot_mxfp4_f32): an E8M0 scale byte as float32, 2^(e - 127) (e = 0 is
// the subnormal 2^-127; e = 255, NaN in the OCP format, is refused by the writers and the op).
static inline float Mxfp4Scale(uint8_t e) {
  const uint32_t bits = e == 0 ? 0x00400000u : static_cast<uint32_t>(e) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return scale;
}

// The E2M1 values of the 16 codes (sign in bit 3).
static constexpr float kE2M1Values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// out[i] = E2M1[code i] * scale[i / 32] for i < n (n a multiple of 32): the portable decode.
static inline void DecodeMxfp4Loop(const uint8_t* codes, const uint8_t* scales, int64_t n,
                                   float* out) {
  for (int64_t b = 0; b < n / 32; ++b) {
    const float scale = Mxfp4Scale(scales[b]);
    for (int j = 0; j < 16; ++j) {
      const uint8_t byte = codes[16 * b + j];
      out[32 * b + 2 * j] = kE2M1Values[byte & 15] * scale;
      out[32 * b + 2 * j + 1] = kE2M1Values[byte >> 4] * scale;
    }
  }
}

constexpr int64_t kMxfp4OneTokenChunk = 4096;  // one-token inputs permuted at a time (16 KiB)

// Twice the E2M1 values of the 16 codes: integers in [-12, 12].
static constexpr int32_t kE2M1Twice[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// KernelTable::dot_mxfp4_q8, portable: per token, row and block, the exact integer sum of
// 2 * E2M1[code] * a, times 2^(e - 127) / 2 * the block's activation scale, added in block order.
static inline void DotMxfp4Q8Loop(const Mxfp4Q8DotProblem& p) {
  for (int64_t t = 0; t < p.tokens; ++t) {
    const int8_t* a = p.a[t];
    const float* a_scales = p.a_scales[t];
    for (int64_t r = 0; r < p.rows; ++r) {
      const uint8_t* codes = p.codes + r * p.code_stride;
      const uint8_t* scales = p.scales + r * p.scale_stride;
      float sum = 0.0f;
      for (int64_t b = 0; b < p.n / 32; ++b) {
        int32_t block = 0;
        for (int j = 0; j < 16; ++j) {
          const uint8_t byte = codes[16 * b + j];
          block += kE2M1Twice[byte & 15] * a[32 * b + 2 * j] +
                   kE2M1Twice[byte >> 4] * a[32 * b + 2 * j + 1];
        }
        sum += static_cast<float>(block) * (0.5f * Mxfp4Scale(scales[b]) * a_scales[b]);
      }
      p.c[t * p.c_stride + r] = sum;
    }
  }
}

// The several-token form of the 4-bit dot kernels, on top of an ISA's float32 Ops: kDecodeRows
// rows and kDecodeChunk inputs at a time are decoded (decode(row, i, n, out): n weights of row
// `row` from input i, exact as the format defines them) into a stack buffer (16 KiB, in L1),
// which Dot<F32Ops> multiplies with the tokens (64 at a time); the partial sums of later chunks
// are added to the first's.
constexpr int64_t kDecodeRows = 4;
constexpr int64_t kDecodeChunk = 1024;
constexpr int64_t kDecodeTokens = 64;
template <typename F32Ops, typename DecodeRow>
void DotDecoded(int64_t rows_total, int64_t n_total, const float* const* acts, int64_t tokens_total,
                float* c_out, int64_t c_stride, DecodeRow decode) {
  alignas(64) float w[kDecodeRows * kDecodeChunk];
  float partial[kDecodeTokens * kDecodeRows];
  const float* a[kDecodeTokens];
  for (int64_t row = 0; row < rows_total; row += kDecodeRows) {
    const int64_t rows = rows_total - row < kDecodeRows ? rows_total - row : kDecodeRows;
    for (int64_t i = 0; i < n_total; i += kDecodeChunk) {
      const int64_t n = n_total - i < kDecodeChunk ? n_total - i : kDecodeChunk;
      for (int64_t r = 0; r < rows; ++r) decode(row + r, i, n, w + r * kDecodeChunk);
      for (int64_t t0 = 0; t0 < tokens_total; t0 += kDecodeTokens) {
        const int64_t tokens =
            tokens_total - t0 < kDecodeTokens ? tokens_total - t0 : kDecodeTokens;
        for (int64_t t = 0; t < tokens; ++t) a[t] = acts[t0 + t] + i;
        float* c = c_out + t0 * c_stride + row;
        if (i == 0) {
          Dot<F32Ops>({w, kDecodeChunk, rows, a, tokens, n, c, c_stride});
          continue;
        }
        Dot<F32Ops>({w, kDecodeChunk, rows, a, tokens, n, partial, kDecodeRows});
        for (int64_t t = 0; t < tokens; ++t) {
          for (int64_t r = 0; r < rows; ++r) c[t * c_stride + r] += partial[t * kDecodeRows + r];
        }
      }
    }
  }
}

// KernelTable::dot_mxfp4_f32's several-token form, with the ISA's decode (Decode(codes, scales,
// n, out), as DecodeMxfp4Loop).
template <typename F32Ops, void (*Decode)(const uint8_t*, const uint8_t*, int64_t, float*)>
void DotMxfp4(const Mxfp4DotProblem& p) {
  DotDecoded<F32Ops>(p.rows, p.n, p.a, p.tokens, p.c, p.c_stride,
                     [&p](int64_t row, int64_t i, int64_t n, float* out) {
                       Decode(p.codes + row * p.code_stride + i / 2,
                              p.scales + row * p.scale_stride + i / 32, n, out);
                     });
}

// int4 (KernelTable::dot_int4_f32, decode_int4): a row's two float32 steps (d, dm).
static inline void Int4Steps(const uint8_t* steps, float* d, float* dm) {
  __builtin_memcpy(d, steps, sizeof(float));
  __builtin_memcpy(dm, steps + sizeof(float), sizeof(float));
}

// out[i] = d * s[i / 32] * q_i + dm * m[i / 32]: the portable decode.
static inline void DecodeInt4Loop(const uint8_t* codes, const uint8_t* scales, const int8_t* mins,
                                  float d, float dm, int64_t n, float* out) {
  for (int64_t b = 0; b < n / 32; ++b) {
    const float scale = d * static_cast<float>(scales[b]);
    const float offset = dm * static_cast<float>(mins[b]);
    for (int j = 0; j < 16; ++j) {
      const uint8_t byte = codes[16 * b + j];
      out[32 * b + 2 * j] = __builtin_fmaf(scale, static_cast<float>(byte & 15), offset);
      out[32 * b + 2 * j + 1] = __builtin_fmaf(scale, static_cast<float>(byte >> 4), offset);
    }
  }
}

// KernelTable::dot_int4_f32's several-token form, with the ISA's decode.
template <typename F32Ops, void (*Decode)(const uint8_t*, const uint8_t*, const int8_t*, float,
                                          float, int64_t, float*)>
void DotInt4(const Int4DotProblem& p) {
  DotDecoded<F32Ops>(p.rows, p.n, p.a, p.tokens, p.c, p.c_stride,
                     [&p](int64_t row, int64_t i, int64_t n, float* out) {
                       float d, dm;
                       Int4Steps(p.steps + row * p.step_stride, &d, &dm);
                       Decode(p.codes + row * p.code_stride + i / 2,
                              p.scales + row * p.scale_stride + i / 32,
                              p.mins + row * p.min_stride + i / 32, d, dm, n, out);
                     });
}

// KernelTable::dot_int4_f32 for one token, portable: per row and block the sums of (q_i - 8) * a_i
// and of a_i, then d * sum_b s[b] * qa_b + sum_b (dm * m[b] + 8 * d * s[b]) * a_b (the SIMD
// one-token kernels' order: codes centred, so that the two sums do not cancel).
static inline void OneTokenInt4Loop(const Int4DotProblem& p) {
  const float* x = p.a[0];
  for (int64_t r = 0; r < p.rows; ++r) {
    const uint8_t* codes = p.codes + r * p.code_stride;
    float d, dm;
    Int4Steps(p.steps + r * p.step_stride, &d, &dm);
    float scaled = 0.0f, offsets = 0.0f;
    for (int64_t b = 0; b < p.n / 32; ++b) {
      float qa = 0.0f, sa = 0.0f;
      for (int j = 0; j < 16; ++j) {
        const uint8_t byte = codes[16 * b + j];
        qa += static_cast<float>((byte & 15) - 8) * x[32 * b + 2 * j] +
              static_cast<float>((byte >> 4) - 8) * x[32 * b + 2 * j + 1];
        sa += x[32 * b + 2 * j] + x[32 * b + 2 * j + 1];
      }
      const float s = static_cast<float>(p.scales[r * p.scale_stride + b]);
      scaled += s * qa;
      offsets += (dm * static_cast<float>(p.mins[r * p.min_stride + b]) + 8.0f * d * s) * sa;
    }
    p.c[r] = d * scaled + offsets;
  }
}

// Plain loops that the ISA files share; `static`, so each file keeps its own copy compiled with
// its own flags (and the compiler vectorises them for that ISA).

// out[i] = bf16(in[i]) rounding to nearest even; a NaN stays a (quiet) NaN.
static inline void RoundToBf16Loop(const float* in, Bf16Bits* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    __builtin_memcpy(&bits, &in[i], sizeof(bits));
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t quiet_nan = (bits >> 16) | 0x40u;
    out[i] = static_cast<Bf16Bits>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
  }
}

// A float32 or bfloat16 element as float32 (bfloat16 widened exactly: its bits shifted left 16).
static inline float ToFloat32(float x) { return x; }
static inline float ToFloat32(Bf16Bits x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float out;
  __builtin_memcpy(&out, &bits, sizeof(out));
  return out;
}

// The weighted row sums of RowSumProblem (cpu_kernels.h), 4 rows of v at a time (skipping groups
// of 4 zero weights); the loops over i vectorise to the ISA's width.
template <typename ValueT>
static inline void WeightedRowSumLoop(const RowSumProblem<ValueT>& p) {
  int64_t s = 0;
  for (; s + 4 <= p.rows; s += 4) {
    const ValueT* v0 = p.v + s * p.v_stride;
    const ValueT* v1 = v0 + p.v_stride;
    const ValueT* v2 = v1 + p.v_stride;
    const ValueT* v3 = v2 + p.v_stride;
    for (int64_t j = 0; j < p.n; ++j) {
      const float* w = p.weight + j * p.weight_stride + s;
      const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
      if (w0 == 0.0f && w1 == 0.0f && w2 == 0.0f && w3 == 0.0f) continue;
      float* acc = p.acc + j * p.acc_stride;
      for (int64_t i = 0; i < p.width; ++i) {
        acc[i] += (w0 * ToFloat32(v0[i]) + w1 * ToFloat32(v1[i])) +
                  (w2 * ToFloat32(v2[i]) + w3 * ToFloat32(v3[i]));
      }
    }
  }
  for (; s < p.rows; ++s) {
    const ValueT* v0 = p.v + s * p.v_stride;
    for (int64_t j = 0; j < p.n; ++j) {
      const float w0 = p.weight[j * p.weight_stride + s];
      if (w0 == 0.0f) continue;
      float* acc = p.acc + j * p.acc_stride;
      for (int64_t i = 0; i < p.width; ++i) acc[i] += w0 * ToFloat32(v0[i]);
    }
  }
}

// KernelTable::delta_rule_step (DeltaRuleHead, cpu_kernels.h): two passes over the head's state,
// the loops over the value dimension vectorised at the ISA's width. A head that neither decays
// nor updates (a padded row of a batch: decay 1, beta 0) is read and not written.
static inline void DeltaRuleStepLoop(const DeltaRuleHead& p) {
  const int64_t U = p.key_dim, Y = p.value_dim;
  float* __restrict pred = p.scratch;      // S^T k, before the decay
  float* __restrict read = p.scratch + Y;  // S^T q, before the decay
  for (int64_t y = 0; y < Y; ++y) pred[y] = read[y] = 0.0f;
  float kq = 0.0f;
  for (int64_t u = 0; u < U; ++u) {
    const float* __restrict row = p.state + u * Y;
    const float ku = p.k[u], qu = p.q[u];
    kq += ku * qu;
    for (int64_t y = 0; y < Y; ++y) {
      pred[y] += ku * row[y];
      read[y] += qu * row[y];
    }
  }
  float* __restrict out = p.out;
  const float decay = p.decay, beta = p.beta;
  for (int64_t y = 0; y < Y; ++y) {
    const float delta = beta * (p.v[y] - decay * pred[y]);
    pred[y] = delta;
    out[y] = decay * read[y] + delta * kq;
  }
  if (decay == 1.0f && beta == 0.0f) return;
  for (int64_t u = 0; u < U; ++u) {
    float* __restrict row = p.state + u * Y;
    const float ku = p.k[u];
    for (int64_t y = 0; y < Y; ++y) row[y] = decay * row[y] + ku * pred[y];
  }
}

// KernelTable::argmax_f32 (ArgmaxResult, cpu_kernels.h): per block of kBlock values, the
// maximum in the lanes of one GCC vector of the ISA's width (vmaxps and vcmpneqps on zmm, ymm
// or the scalar build's SSE2 xmm), then the block's first match only where the maximum rose or
// a NaN is in it. A vector wider than the ISA's registers measured 7x slower on AVX2.
static inline ArgmaxResult ArgmaxLoop(const float* __restrict x, int64_t n) {
#if defined(__AVX512F__)
  constexpr int kLanes = 16;
#elif defined(__AVX2__)
  constexpr int kLanes = 8;
#else
  constexpr int kLanes = 4;
#endif
  typedef float Lanes __attribute__((vector_size(4 * kLanes)));
  typedef int32_t Mask __attribute__((vector_size(4 * kLanes)));
  constexpr int64_t kBlock = 2048;  // 8 KiB: the second look at a block reads L1
  constexpr float kMinusInf = -__builtin_inff();
  ArgmaxResult best{0, kMinusInf, false};
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t len = n - start < kBlock ? n - start : kBlock;
    const float* __restrict b = x + start;
    Lanes lane = Lanes{} + kMinusInf;
    Mask unordered = {};
    int64_t i = 0;
    for (; i + kLanes <= len; i += kLanes) {
      Lanes v;
      __builtin_memcpy(&v, b + i, sizeof(v));
      lane = v > lane ? v : lane;
      unordered |= v != v;
    }
    float m = kMinusInf;
    bool any_nan = false;
    for (int l = 0; l < kLanes; ++l) {
      m = lane[l] > m ? lane[l] : m;
      any_nan |= unordered[l] != 0;
    }
    for (; i < len; ++i) {
      m = b[i] > m ? b[i] : m;
      any_nan |= b[i] != b[i];
    }
    if (any_nan) {
      for (int64_t j = 0; j < len; ++j) {
        if (b[j] != b[j]) return {start + j, b[j], true};
      }
    }
    if (m > best.value) {
      for (int64_t j = 0; j < len; ++j) {
        if (b[j] == m) {
          best = {start + j, m, false};
          break;
        }
      }
    }
  }
  return best;
}

// XOR of n_words little-endian 32-bit words, one at a time (for tails).
static inline uint32_t XorWordsLoop(const unsigned char* bytes, int64_t n_words) {
  uint32_t result = 0;
  for (int64_t i = 0; i < n_words; ++i) {
    uint32_t word;
    __builtin_memcpy(&word, bytes + 4 * i, sizeof(word));
    result ^= word;
  }
  return result;
}

}  // namespace cpu_kernels_impl
}  // namespace ftjax

#endif  // FTJAX_XLA_FFI_CPU_KERNELS_IMPL_H_
