// ftjax_dense: y = x @ w.T for a dense weight w [O, C] ([out, in], bf16 or float32) on the host.
// (O output features, C contracted inputs: the package glossary keeps K for top-k, N for slots;
// the code below names them N and K as a GEMM does.)
//
//   y[t, n] = sum_k x[t, k] * w[n, k]
//
// XLA:CPU reaches only a few GB/s on bf16 matrix-vector products; this op streams the weights at
// memory bandwidth (decode, T = 1: a GEMV) and runs a blocked GEMM for prefill (T up to ~1024).
// Used for the q/k/v/o projections, routers, shared experts and lm_head on the CPU backend.
//
// Three layers (STYLE.md section 6): Dense (kernel, no XLA types), DenseImpl (validation),
// FtjaxDense (binding).
//
// Work split: one task per tile of kRowTile rows of w (N split across the threads); a task runs
// all tokens against its rows in tiles of kTokenTile tokens, so its weight rows (kRowTile * K
// elements, 256 KiB for K = 2048 bf16) stay in L2 while the tokens go past. Each weight element
// is read from memory once. Up to PackedMinTokens (KernelTable::packed_min_tokens, or
// kAmxDensePackedMinTokens for bf16 pairs on AMX tiles) tokens the tiles run the dot
// kernels (4 rows at a time stay in L1; T = 1 is one sequential stream per task, in larger tasks
// of ~2 MiB: GemvRowTile); above it, where the ISA
// has one (AVX2, AVX-512), the packed-activation GEMM (cpu_kernels.h) on x packed once per call
// in groups of 16 tokens. Scratch (packed x, row pointers, bf16-rounded x, output tiles) comes
// from one grow-only buffer reused across calls (packing.h).
// Accumulation is float32. bf16 weights are widened to float32 in registers (float32 FMA, exact
// products). With the attribute bf16_activations and an AVX-512-BF16 CPU, x is rounded to bf16
// once and multiplied with vdpbf16ps instead: twice the multiply-add rate for the compute-bound
// GEMM, relative error ~1e-2 of max|y|.

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "cpu_kernels.h"
#include "ffi_util.h"
#include "packing.h"
#include "thread_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ftjax {
namespace {

// ---------------------------------------------------------------------------------------------
// Kernel (no XLA types).

constexpr int64_t kTokenTile = 64;
constexpr int64_t kGroupsPerTile = kTokenTile / kPackedGroup;

// Rows of w per task: about 256 KiB of weights, a multiple of 8 rows, at least 8.
int64_t RowTile(int64_t k, int64_t weight_bytes) {
  const int64_t rows = (int64_t{256} << 10) / std::max<int64_t>(k * weight_bytes, 1);
  return std::max<int64_t>(8, rows / 8 * 8);
}

// Rows of w per task for one token (a GEMV), where no weight row is reused: about 2 MiB of
// weights, fewer when that would leave under 4 tasks per worker (the threads balance by taking
// tasks), never fewer than RowTile. Each task starts a new stream, whose first lines the hardware
// and software prefetch (cpu_kernels_impl.h) do not cover: on the Zen 5 VM a [65536, 2048] bf16
// GEMV read at 0.90-0.98 of the read probe in 256 KiB tasks against 0.99-1.05 in 2 MiB ones
// (AVX-512; AVX2 0.91-0.97 against 0.99; 2 threads, three runs of 31 paired rounds).
// KernelTuning::gemv_task_kib replaces the 2 MiB.
int64_t GemvRowTile(int64_t n_out, int64_t k, int64_t weight_bytes, int num_workers) {
  const int32_t tuned_kib = CurrentKernelTuning().gemv_task_kib;
  const int64_t task_bytes = tuned_kib > 0 ? int64_t{tuned_kib} << 10 : int64_t{2} << 20;
  const int64_t by_bytes = task_bytes / std::max<int64_t>(k * weight_bytes, 1);
  const int64_t by_tasks = n_out / (4 * std::max(num_workers, 1));
  return std::max(RowTile(k, weight_bytes), std::min(by_bytes, by_tasks) / 8 * 8);
}

// The dot-product kernels (decode, and prefill at or below KernelTable::packed_min_tokens tokens
// or where the ISA has no packed GEMM). x_rows: the scratch for `tokens` row pointers.
template <typename WeightT, typename ActivationT>
void RunDense(int64_t tokens, int64_t n_out, int64_t k, const ActivationT* x_tk,
              const WeightT* w_nk, void (*dot)(const DotProblem<WeightT, ActivationT>&),
              const Workers& workers, const ActivationT** x_rows, float* y_tn) {
  for (int64_t t = 0; t < tokens; ++t) x_rows[t] = x_tk + t * k;
  const int64_t row_tile = tokens == 1
                               ? GemvRowTile(n_out, k, sizeof(WeightT), workers.num_workers())
                               : RowTile(k, sizeof(WeightT));
  workers.ParallelFor(CeilDiv(n_out, row_tile), [&](int64_t task, int /*worker*/) {
    const int64_t n0 = task * row_tile;
    const int64_t rows = std::min(row_tile, n_out - n0);
    for (int64_t t0 = 0; t0 < tokens; t0 += kTokenTile) {
      const int64_t tile = std::min(kTokenTile, tokens - t0);
      dot({w_nk + n0 * k, k, rows, x_rows + t0, tile, k, y_tn + t0 * n_out + n0, n_out});
    }
  });
}

// The scratch regions of the packed path.
struct PackedScratch {
  int64_t x_rows;  // [T] row pointers
  int64_t packed;  // ceil(T / 16) groups of x, packed (cpu_kernels.h)
  int64_t ct;      // per worker: [row tile, kTokenTile], the transposed output of one tile
};

// The packed-activation GEMM (prefill above KernelTable::packed_min_tokens tokens): x is packed once, in groups
// of 16 tokens (split across the workers by group); then each task takes a tile of rows of w, as
// RunDense does, and runs all token tiles against it, so each weight row is read from memory
// once. The packed GEMM writes the tile transposed (ct[row][token]); the task copies it into y.
// Every element of y is computed by one call in one order, whatever the number of threads.
template <typename WeightT, typename PackedT>
void RunDensePacked(int64_t tokens, int64_t n_out, int64_t k, const PackedT* x_tk,
                    const WeightT* w_nk,
                    void (*packed_dot)(const PackedDotProblem<WeightT, PackedT>&),
                    const Workers& workers, unsigned char* scratch, const PackedScratch& at,
                    float* y_tn) {
  const PackedT** x_rows = At<const PackedT*>(scratch, at.x_rows);
  PackedT* packed = At<PackedT>(scratch, at.packed);
  for (int64_t t = 0; t < tokens; ++t) x_rows[t] = x_tk + t * k;
  const int64_t groups = CeilDiv(tokens, kPackedGroup);
  const int64_t group_elements = PackedGroupElements<PackedT>(k);
  workers.ParallelFor(groups, [&](int64_t g, int /*worker*/) {
    PackRows(x_rows + g * kPackedGroup, std::min(kPackedGroup, tokens - g * kPackedGroup), 1, k,
             packed + g * group_elements);
  });
  const int64_t row_tile = RowTile(k, sizeof(WeightT));
  workers.ParallelFor(CeilDiv(n_out, row_tile), [&](int64_t task, int worker) {
    const int64_t n0 = task * row_tile;
    const int64_t rows = std::min(row_tile, n_out - n0);
    float* ct = At<float>(scratch, at.ct) + worker * row_tile * kTokenTile;
    for (int64_t g0 = 0; g0 < groups; g0 += kGroupsPerTile) {
      const int64_t tile_groups = std::min(kGroupsPerTile, groups - g0);
      const int64_t t0 = g0 * kPackedGroup;
      const int64_t tile = std::min(tile_groups * kPackedGroup, tokens - t0);
      const bool half = tile - (tile_groups - 1) * kPackedGroup <= kPackedGroup / 2;
      packed_dot({w_nk + n0 * k, k, rows, packed + g0 * group_elements, tile_groups, half, k, ct,
                  kTokenTile, groups});
      for (int64_t t = 0; t < tile; ++t) {
        float* y = y_tn + (t0 + t) * n_out + n0;
        for (int64_t r = 0; r < rows; ++r) y[r] = ct[r * kTokenTile + t];
      }
    }
  });
}

template <typename WeightT, typename ActivationT>
void DenseWith(int64_t tokens, int64_t n_out, int64_t k, const float* x_tk, const WeightT* w_nk,
               void (*dot)(const DotProblem<WeightT, ActivationT>&), const KernelTable& kernels,
               const Workers& workers, float* y_tn) {
  constexpr bool kRound = std::is_same_v<ActivationT, Bf16Bits>;  // x rounded to bf16 first
  const auto packed_dot = PackedDotFor<WeightT, ActivationT>(kernels);
  // bf16 pairs on AMX tiles (whole tiles of 32 inputs) take the packed GEMM from fewer tokens.
  const bool amx_pairs = kRound && std::is_same_v<WeightT, Bf16Bits> && k % 32 == 0;
  const bool use_packed =
      packed_dot != nullptr && tokens > PackedMinTokens(kernels, amx_pairs, PackedUse::kDense);
  // The plan: every scratch region of this call, from one reused buffer (packing.h).
  ScratchPlan plan;
  const int64_t rounded = kRound ? plan.Add<Bf16Bits>(tokens * k) : 0;
  PackedScratch at{};
  at.x_rows = plan.Add<const ActivationT*>(tokens);
  if (use_packed) {
    at.packed = plan.Add<ActivationT>(CeilDiv(tokens, kPackedGroup) *
                                      PackedGroupElements<ActivationT>(k));
    at.ct = plan.Add<float>(workers.num_workers() * RowTile(k, sizeof(WeightT)) * kTokenTile);
  }
  unsigned char* scratch = Scratch(plan);
  const ActivationT* x;
  if constexpr (kRound) {
    kernels.round_to_bf16(x_tk, At<Bf16Bits>(scratch, rounded), tokens * k);
    x = At<Bf16Bits>(scratch, rounded);
  } else {
    x = x_tk;
  }
  if (use_packed) {
    RunDensePacked(tokens, n_out, k, x, w_nk, packed_dot, workers, scratch, at, y_tn);
  } else {
    RunDense(tokens, n_out, k, x, w_nk, dot, workers, At<const ActivationT*>(scratch, at.x_rows),
             y_tn);
  }
}

template <typename WeightT>
void Dense(int64_t tokens, int64_t n_out, int64_t k, const float* x_tk, const WeightT* w_nk,
           bool bf16_activations, const KernelTable& kernels, const Workers& workers,
           float* y_tn) {
  if (k == 0) {
    std::fill_n(y_tn, tokens * n_out, 0.0f);
    return;
  }
  if constexpr (std::is_same_v<WeightT, Bf16Bits>) {
    if (bf16_activations && kernels.dot_bf16_bf16 != nullptr) {
      DenseWith<Bf16Bits, Bf16Bits>(tokens, n_out, k, x_tk, w_nk, kernels.dot_bf16_bf16, kernels,
                                    workers, y_tn);
    } else {
      DenseWith<Bf16Bits, float>(tokens, n_out, k, x_tk, w_nk, kernels.dot_bf16_f32, kernels,
                                 workers, y_tn);
    }
  } else {
    DenseWith<float, float>(tokens, n_out, k, x_tk, w_nk, kernels.dot_f32_f32, kernels, workers,
                            y_tn);
  }
}

// ---------------------------------------------------------------------------------------------
// Quantised weights (ftjax.utils.dense_quant, docs/ftw.md "Dense formats"): int8 rows with one
// float32 scale per output row, and mxfp4 rows (E2M1 codes with an E8M0 scale per 32 inputs).

// The packed bf16-pair GEMM (KernelTable::packed_dot_bf16: vdpbf16ps, AMX tiles where enabled)
// on quantised rows decoded to bf16 per task, against x rounded to bf16 once: the
// bf16_activations form of prefill for quantised weights, as for bf16 weights. decode_rows(n0,
// rows, out) writes rows [n0, n0 + rows) as bf16 (exactly: mxfp4 values and int8 integers are
// bf16 values); `scales` (int8: float32 per row, applied after the sums; mxfp4: null).
template <typename DecodeRows>
void DenseDecodedBf16(int64_t tokens, int64_t n_out, int64_t k, const float* x_tk,
                      DecodeRows decode_rows, const float* scales, const KernelTable& kernels,
                      const Workers& workers, float* y_tn) {
  const int64_t row_tile = RowTile(k, sizeof(Bf16Bits));
  const int64_t groups = CeilDiv(tokens, kPackedGroup);
  const int64_t group_elements = PackedGroupElements<Bf16Bits>(k);
  ScratchPlan plan;
  const int64_t rounded_at = plan.Add<Bf16Bits>(tokens * k);
  const int64_t rows_at = plan.Add<const Bf16Bits*>(tokens);
  const int64_t packed_at = plan.Add<Bf16Bits>(groups * group_elements);
  const int64_t ct_at = plan.Add<float>(workers.num_workers() * row_tile * kTokenTile);
  const int64_t decoded_at = plan.Add<Bf16Bits>(workers.num_workers() * row_tile * k);
  const int64_t floats_at = plan.Add<float>(workers.num_workers() * k);
  unsigned char* scratch = Scratch(plan);
  Bf16Bits* rounded = At<Bf16Bits>(scratch, rounded_at);
  kernels.round_to_bf16(x_tk, rounded, tokens * k);
  const Bf16Bits** x_rows = At<const Bf16Bits*>(scratch, rows_at);
  for (int64_t t = 0; t < tokens; ++t) x_rows[t] = rounded + t * k;
  Bf16Bits* packed = At<Bf16Bits>(scratch, packed_at);
  workers.ParallelFor(groups, [&](int64_t g, int /*worker*/) {
    PackRows(x_rows + g * kPackedGroup, std::min(kPackedGroup, tokens - g * kPackedGroup), 1, k,
             packed + g * group_elements);
  });
  workers.ParallelFor(CeilDiv(n_out, row_tile), [&](int64_t task, int worker) {
    const int64_t n0 = task * row_tile;
    const int64_t rows = std::min(row_tile, n_out - n0);
    float* ct = At<float>(scratch, ct_at) + worker * row_tile * kTokenTile;
    Bf16Bits* decoded = At<Bf16Bits>(scratch, decoded_at) + worker * row_tile * k;
    decode_rows(n0, rows, decoded, At<float>(scratch, floats_at) + worker * k);
    for (int64_t g0 = 0; g0 < groups; g0 += kGroupsPerTile) {
      const int64_t tile_groups = std::min(kGroupsPerTile, groups - g0);
      const int64_t t0 = g0 * kPackedGroup;
      const int64_t tile = std::min(tile_groups * kPackedGroup, tokens - t0);
      const bool half = tile - (tile_groups - 1) * kPackedGroup <= kPackedGroup / 2;
      kernels.packed_dot_bf16({decoded, k, rows, packed + g0 * group_elements, tile_groups, half,
                               k, ct, kTokenTile, groups});
      for (int64_t t = 0; t < tile; ++t) {
        float* y = y_tn + (t0 + t) * n_out + n0;
        for (int64_t r = 0; r < rows; ++r) {
          y[r] = scales != nullptr ? ct[r * kTokenTile + t] * scales[n0 + r]
                                   : ct[r * kTokenTile + t];
        }
      }
    }
  });
}

// Whether a quantised weight's call takes DenseDecodedBf16: bf16_activations asked, the ISA has
// the bf16-pair GEMM, and enough tokens for it (PackedMinTokens of bf16 pairs).
bool UseDecodedBf16(int64_t tokens, int64_t k, bool bf16_activations, const KernelTable& kernels) {
  return bf16_activations && kernels.packed_dot_bf16 != nullptr &&
         tokens > PackedMinTokens(kernels, k % 32 == 0, PackedUse::kDense);
}

// Weights of an int8 matrix at or under which a few tokens take the dequantised rows (1 MiB).
constexpr int64_t kInt8DecodedMaxWeights = int64_t{1} << 20;

// int8: one token, the dot kernel of int8 weights widened exactly to float32, and above the
// packed GEMM's threshold the packed GEMM (DenseWith<int8_t, float>, the same paths as bf16
// weights), then each output multiplied by its row's scale once; between the two, for a small
// weight, rows dequantised to float32 per task and the float32 dot kernel. The result is that
// of the dequantised weights to float32 rounding.
void DenseInt8(int64_t tokens, int64_t n_out, int64_t k, const float* x_tk, const int8_t* w_nk,
               const float* scales, bool bf16_activations, const KernelTable& kernels,
               const Workers& workers, float* y_tn) {
  if (k == 0) {
    std::fill_n(y_tn, tokens * n_out, 0.0f);
    return;
  }
  if (UseDecodedBf16(tokens, k, bf16_activations, kernels)) {
    auto decode = [&](int64_t n0, int64_t rows, Bf16Bits* out, float* row_f32) {
      for (int64_t r = 0; r < rows; ++r) {
        const int8_t* q = w_nk + (n0 + r) * k;
        for (int64_t i = 0; i < k; ++i) row_f32[i] = static_cast<float>(q[i]);
        kernels.round_to_bf16(row_f32, out + r * k, k);
      }
    };
    DenseDecodedBf16(tokens, n_out, k, x_tk, decode, scales, kernels, workers, y_tn);
    return;
  }
  if (tokens > 1 && n_out * k <= kInt8DecodedMaxWeights &&
      !(kernels.packed_dot_i8_f32 != nullptr &&
        tokens > PackedMinTokens(kernels, false, PackedUse::kDense))) {
    // A few tokens against a small weight (one that stays in the caches, where the work is
    // the multiply-adds, not the reads): each task's rows dequantised to float32 once (scale *
    // q, the dequantised weights exactly), then the float32 dot kernel, so that the products
    // and sums are those of the float32 weights (scaling after the sum rounds differently).
    // A large weight keeps the int8 dot kernel, which reads its bytes once: dequantising the
    // [131072, 2048] rows per task made 4 tokens 3.7x slower (benchmarks/dense_formats.py).
    const int64_t row_tile = RowTile(k, sizeof(float));
    ScratchPlan plan;
    const int64_t rows_at = plan.Add<const float*>(tokens);
    const int64_t decoded_at = plan.Add<float>(workers.num_workers() * row_tile * k);
    unsigned char* scratch = Scratch(plan);
    const float** x_rows = At<const float*>(scratch, rows_at);
    for (int64_t t = 0; t < tokens; ++t) x_rows[t] = x_tk + t * k;
    workers.ParallelFor(CeilDiv(n_out, row_tile), [&](int64_t task, int worker) {
      const int64_t n0 = task * row_tile;
      const int64_t rows = std::min(row_tile, n_out - n0);
      float* decoded = At<float>(scratch, decoded_at) + worker * row_tile * k;
      for (int64_t r = 0; r < rows; ++r) {
        const int8_t* q = w_nk + (n0 + r) * k;
        const float scale = scales[n0 + r];
        for (int64_t i = 0; i < k; ++i) decoded[r * k + i] = static_cast<float>(q[i]) * scale;
      }
      for (int64_t t0 = 0; t0 < tokens; t0 += kTokenTile) {
        const int64_t tile = std::min(kTokenTile, tokens - t0);
        kernels.dot_f32_f32({decoded, k, rows, x_rows + t0, tile, k, y_tn + t0 * n_out + n0,
                             n_out});
      }
    });
    return;
  }
  DenseWith<int8_t, float>(tokens, n_out, k, x_tk, w_nk, kernels.dot_i8_f32, kernels, workers,
                           y_tn);
  workers.ParallelFor(tokens, [&](int64_t t, int /*worker*/) {
    float* y = y_tn + t * n_out;
    for (int64_t n = 0; n < n_out; ++n) y[n] *= scales[n];
  });
}

// mxfp4 rows of k inputs: k / 2 code bytes and k / 32 scale bytes each.
constexpr int64_t kMxfp4Inputs = 32;

// Rows of a 4-bit weight per task: as RowTile and GemvRowTile, by the bytes of a row.
int64_t FourBitRowTile(int64_t tokens, int64_t n_out, int64_t row_bytes_in, int num_workers) {
  const int64_t row_bytes = std::max<int64_t>(row_bytes_in, 1);
  const int64_t l2_rows = std::max<int64_t>(8, (int64_t{256} << 10) / row_bytes / 8 * 8);
  if (tokens != 1) return l2_rows;
  const int32_t tuned_kib = CurrentKernelTuning().gemv_task_kib;
  const int64_t task_bytes = tuned_kib > 0 ? int64_t{tuned_kib} << 10 : int64_t{2} << 20;
  const int64_t by_tasks = n_out / (4 * std::max(num_workers, 1));
  return std::max(l2_rows, std::min(task_bytes / row_bytes, by_tasks) / 8 * 8);
}

// The 4-bit formats (mxfp4, int4): up to PackedMinTokens tokens the fused dot kernel
// (dot(n0, rows, x_rows, tile, y, y_stride): KernelTable::dot_mxfp4_f32 or dot_int4_f32, the
// rows read once as one stream per task); above it the packed GEMM, straight from the codes where
// `packed_direct` is given (mxfp4 on AVX2: KernelTable::packed_dot_mxfp4_f32), else on each
// task's rows decoded to float32 once (decode_row(row, out): KernelTable::decode_mxfp4 or
// decode_int4, exact as the format defines the weights) into a per-worker buffer that stays in
// L2, against x packed once per call. With bf16_activations (DenseDecodedBf16) the rows are
// decoded to float32 and rounded to bf16: exact for mxfp4, whose values are bf16 values; int4
// weights round as the activations do. `row_bytes`: a row's bytes (codes and scales), for the
// row tiles.
template <typename DecodeRow, typename DotRows, typename PackedDirect>
void Dense4Bit(int64_t tokens, int64_t n_out, int64_t k, const float* x_tk, int64_t row_bytes,
               DecodeRow decode_row, DotRows dot, PackedDirect packed_direct, bool has_direct,
               bool bf16_activations, const KernelTable& kernels, const Workers& workers,
               float* y_tn) {
  if (k == 0) {
    std::fill_n(y_tn, tokens * n_out, 0.0f);
    return;
  }
  if (UseDecodedBf16(tokens, k, bf16_activations, kernels)) {
    auto decode = [&](int64_t n0, int64_t rows, Bf16Bits* out, float* row_f32) {
      for (int64_t r = 0; r < rows; ++r) {
        decode_row(n0 + r, row_f32);
        kernels.round_to_bf16(row_f32, out + r * k, k);
      }
    };
    DenseDecodedBf16(tokens, n_out, k, x_tk, decode, nullptr, kernels, workers, y_tn);
    return;
  }
  const auto packed_f32 = kernels.packed_dot_f32;
  const bool use_packed = (packed_f32 != nullptr || has_direct) &&
                          tokens > PackedMinTokens(kernels, false, PackedUse::kDense);
  const int64_t row_tile = FourBitRowTile(tokens, n_out, row_bytes, workers.num_workers());
  const int64_t groups = CeilDiv(tokens, kPackedGroup);
  const int64_t group_elements = PackedGroupElements<float>(k);
  ScratchPlan plan;
  const int64_t rows_at = plan.Add<const float*>(tokens);
  int64_t packed_at = 0, ct_at = 0, decoded_at = 0;
  if (use_packed) {
    packed_at = plan.Add<float>(groups * group_elements);
    ct_at = plan.Add<float>(workers.num_workers() * row_tile * kTokenTile);
    if (!has_direct) decoded_at = plan.Add<float>(workers.num_workers() * row_tile * k);
  }
  unsigned char* scratch = Scratch(plan);
  const float** x_rows = At<const float*>(scratch, rows_at);
  for (int64_t t = 0; t < tokens; ++t) x_rows[t] = x_tk + t * k;
  if (!use_packed) {
    workers.ParallelFor(CeilDiv(n_out, row_tile), [&](int64_t task, int /*worker*/) {
      const int64_t n0 = task * row_tile;
      const int64_t rows = std::min(row_tile, n_out - n0);
      for (int64_t t0 = 0; t0 < tokens; t0 += kTokenTile) {
        const int64_t tile = std::min(kTokenTile, tokens - t0);
        dot(n0, rows, x_rows + t0, tile, y_tn + t0 * n_out + n0, n_out);
      }
    });
    return;
  }
  float* packed = At<float>(scratch, packed_at);
  workers.ParallelFor(groups, [&](int64_t g, int /*worker*/) {
    PackRows(x_rows + g * kPackedGroup, std::min(kPackedGroup, tokens - g * kPackedGroup), 1, k,
             packed + g * group_elements);
  });
  workers.ParallelFor(CeilDiv(n_out, row_tile), [&](int64_t task, int worker) {
    const int64_t n0 = task * row_tile;
    const int64_t rows = std::min(row_tile, n_out - n0);
    float* ct = At<float>(scratch, ct_at) + worker * row_tile * kTokenTile;
    float* decoded = nullptr;
    if (!has_direct) {
      decoded = At<float>(scratch, decoded_at) + worker * row_tile * k;
      for (int64_t r = 0; r < rows; ++r) decode_row(n0 + r, decoded + r * k);
    }
    for (int64_t g0 = 0; g0 < groups; g0 += kGroupsPerTile) {
      const int64_t tile_groups = std::min(kGroupsPerTile, groups - g0);
      const int64_t t0 = g0 * kPackedGroup;
      const int64_t tile = std::min(tile_groups * kPackedGroup, tokens - t0);
      const bool half = tile - (tile_groups - 1) * kPackedGroup <= kPackedGroup / 2;
      if (has_direct) {
        packed_direct(n0, rows, packed + g0 * group_elements, tile_groups, half, ct);
      } else {
        packed_f32({decoded, k, rows, packed + g0 * group_elements, tile_groups, half, k, ct,
                    kTokenTile, groups});
      }
      for (int64_t t = 0; t < tile; ++t) {
        float* y = y_tn + (t0 + t) * n_out + n0;
        for (int64_t r = 0; r < rows; ++r) y[r] = ct[r * kTokenTile + t];
      }
    }
  });
}

// mxfp4 rows: Dense4Bit on the E2M1 codes and E8M0 scales.
void DenseMxfp4(int64_t tokens, int64_t n_out, int64_t k, const float* x_tk,
                const uint8_t* codes, const uint8_t* scales, bool bf16_activations,
                const KernelTable& kernels, const Workers& workers, float* y_tn) {
  const int64_t code_stride = k / 2, scale_stride = k / kMxfp4Inputs;
  const auto packed_mxfp4 = kernels.packed_dot_mxfp4_f32;
  Dense4Bit(
      tokens, n_out, k, x_tk, k / 2 + k / kMxfp4Inputs,
      [&](int64_t row, float* out) {
        kernels.decode_mxfp4(codes + row * code_stride, scales + row * scale_stride, k, out);
      },
      [&](int64_t n0, int64_t rows, const float* const* x_rows, int64_t tile, float* y,
          int64_t y_stride) {
        kernels.dot_mxfp4_f32({codes + n0 * code_stride, code_stride, scales + n0 * scale_stride,
                               scale_stride, rows, x_rows, tile, k, y, y_stride});
      },
      [&](int64_t n0, int64_t rows, const float* packed, int64_t tile_groups, bool half,
          float* ct) {
        packed_mxfp4({codes + n0 * code_stride, code_stride, scales + n0 * scale_stride,
                      scale_stride, rows, packed, tile_groups, half, k, ct, kTokenTile});
      },
      packed_mxfp4 != nullptr, bf16_activations, kernels, workers, y_tn);
}

// int4 rows (ftjax.utils.dense_quant): codes [O, C / 2] and per row the parameters
// Int4ParamBytes(C) = 8 + 2 * C / 32 bytes: the float32 steps d, dm, the uint8 scales [C / 32],
// the int8 mins [C / 32] (Int4DotProblem).
int64_t Int4ParamBytes(int64_t k) { return 8 + 2 * (k / kMxfp4Inputs); }

void DenseInt4(int64_t tokens, int64_t n_out, int64_t k, const float* x_tk, const uint8_t* codes,
               const uint8_t* params, bool bf16_activations, const KernelTable& kernels,
               const Workers& workers, float* y_tn) {
  const int64_t code_stride = k / 2, param_stride = Int4ParamBytes(k), blocks = k / kMxfp4Inputs;
  Dense4Bit(
      tokens, n_out, k, x_tk, code_stride + param_stride,
      [&](int64_t row, float* out) {
        const uint8_t* p = params + row * param_stride;
        float d, dm;
        std::memcpy(&d, p, sizeof(float));
        std::memcpy(&dm, p + sizeof(float), sizeof(float));
        kernels.decode_int4(codes + row * code_stride, p + 8,
                            reinterpret_cast<const int8_t*>(p + 8 + blocks), d, dm, k, out);
      },
      [&](int64_t n0, int64_t rows, const float* const* x_rows, int64_t tile, float* y,
          int64_t y_stride) {
        const uint8_t* p = params + n0 * param_stride;
        kernels.dot_int4_f32({codes + n0 * code_stride, code_stride, p + 8, param_stride,
                              reinterpret_cast<const int8_t*>(p + 8 + blocks), param_stride, p,
                              param_stride, rows, x_rows, tile, k, y, y_stride});
      },
      [](int64_t, int64_t, const float*, int64_t, bool, float*) {}, false, bf16_activations,
      kernels, workers, y_tn);
}

// ---------------------------------------------------------------------------------------------
// FFI implementation.

// The FFI target name, which prefixes every error message.
constexpr std::string_view kOp = "ftjax_dense";

ffi::Error DenseImpl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                     bool bf16_activations, ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) {
    return InvalidArgument(kOp, "x must be 2-D [T, C], got shape " + ShapeString(x_dims));
  }
  const int64_t T = x_dims[0], K = x_dims[1];
  const auto w_dims = w.dimensions();
  if (w_dims.size() != 2 || w_dims[1] != K) {
    return InvalidArgument(kOp, "w must be [O, C] with C = " + std::to_string(K) +
                                " from x, got shape " + ShapeString(w_dims));
  }
  const ffi::DataType w_dtype = w.element_type();
  if (w_dtype != ffi::DataType::BF16 && w_dtype != ffi::DataType::F32) {
    return InvalidArgument(kOp, "w must be bfloat16 or float32");
  }
  const int64_t N = w_dims[0];
  const auto y_dims = y->dimensions();
  if (y_dims.size() != 2 || y_dims[0] != T || y_dims[1] != N) {
    return InvalidArgument(kOp, "result y must be [T, O] = [" + std::to_string(T) + ", " +
                                std::to_string(N) + "], got " + ShapeString(y_dims));
  }

  const HostSetup setup = ChooseHostSetup(&xla_pool);
  if (!setup.error.empty()) return InvalidArgument(kOp, setup.error);

  if (w_dtype == ffi::DataType::BF16) {
    Dense(T, N, K, x.typed_data(), w.reinterpret_data<Bf16Bits>(), bf16_activations,
          *setup.kernels, setup.workers, y->typed_data());
  } else {
    Dense(T, N, K, x.typed_data(), w.typed_data<float>(), bf16_activations, *setup.kernels,
          setup.workers, y->typed_data());
  }
  return ffi::Error::Success();
}

// The quantised weights: w is int8 [O, C] with float32 scales [O], uint8 mxfp4 codes
// [O, C / 2] with uint8 E8M0 scales [O, C / 32], or uint8 int4 codes [O, C / 2] with uint8
// parameters [O, 8 + C / 16] (DenseInt4; C a multiple of 32).
constexpr std::string_view kQuantizedOp = "ftjax_dense_quantized";

ffi::Error DenseQuantizedImpl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                              ffi::AnyBuffer scales, bool bf16_activations,
                              ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) {
    return InvalidArgument(kQuantizedOp, "x must be 2-D [T, C], got shape " + ShapeString(x_dims));
  }
  const int64_t T = x_dims[0], K = x_dims[1];
  const auto w_dims = w.dimensions();
  const auto s_dims = scales.dimensions();
  const ffi::DataType w_dtype = w.element_type();
  const bool four_bit = w_dtype == ffi::DataType::U8;
  if (w_dtype != ffi::DataType::S8 && !four_bit) {
    return InvalidArgument(kQuantizedOp,
                           "w must be int8 (int8 rows) or uint8 (mxfp4 or int4 codes)");
  }
  // uint8 codes: int4 when the scales are its per-row parameters, else mxfp4.
  const bool int4 = four_bit && s_dims.size() == 2 && K % kMxfp4Inputs == 0 &&
                    s_dims[1] == Int4ParamBytes(K);
  const bool mxfp4 = four_bit && !int4;
  if (w_dims.size() != 2) {
    return InvalidArgument(kQuantizedOp, "w must be 2-D, got shape " + ShapeString(w_dims));
  }
  const int64_t N = w_dims[0];
  if (int4) {
    if (w_dims[1] != K / 2 || scales.element_type() != ffi::DataType::U8 || s_dims[0] != N) {
      return InvalidArgument(kQuantizedOp, "int4 codes must be [O, C / 2] with C = " +
                                               std::to_string(K) + " from x and uint8 "
                                               "parameters [O, 8 + C / 16], got codes " +
                                               ShapeString(w_dims) + " and parameters " +
                                               ShapeString(s_dims));
    }
  } else if (mxfp4) {
    if (K % kMxfp4Inputs != 0 || w_dims[1] != K / 2) {
      return InvalidArgument(kQuantizedOp, "mxfp4 codes must be [O, C / 2] with C = " +
                                               std::to_string(K) +
                                               " (a multiple of 32) from x, got shape " +
                                               ShapeString(w_dims));
    }
    if (scales.element_type() != ffi::DataType::U8 || s_dims.size() != 2 || s_dims[0] != N ||
        s_dims[1] != K / kMxfp4Inputs) {
      return InvalidArgument(kQuantizedOp, "mxfp4 scales must be uint8 [O, C / 32] = [" +
                                               std::to_string(N) + ", " +
                                               std::to_string(K / kMxfp4Inputs) +
                                               "] (int4 parameters: [O, 8 + C / 16]), got " +
                                               ShapeString(s_dims));
    }
  } else {
    if (w_dims[1] != K) {
      return InvalidArgument(kQuantizedOp, "int8 w must be [O, C] with C = " + std::to_string(K) +
                                               " from x, got shape " + ShapeString(w_dims));
    }
    if (scales.element_type() != ffi::DataType::F32 || s_dims.size() != 1 || s_dims[0] != N) {
      return InvalidArgument(kQuantizedOp, "int8 scales must be float32 [O] = [" +
                                               std::to_string(N) + "], got " +
                                               ShapeString(s_dims));
    }
  }
  const auto y_dims = y->dimensions();
  if (y_dims.size() != 2 || y_dims[0] != T || y_dims[1] != N) {
    return InvalidArgument(kQuantizedOp, "result y must be [T, O] = [" + std::to_string(T) +
                                             ", " + std::to_string(N) + "], got " +
                                             ShapeString(y_dims));
  }
  const HostSetup setup = ChooseHostSetup(&xla_pool);
  if (!setup.error.empty()) return InvalidArgument(kQuantizedOp, setup.error);
  if (int4) {
    DenseInt4(T, N, K, x.typed_data(), w.reinterpret_data<uint8_t>(),
              scales.reinterpret_data<uint8_t>(), bf16_activations, *setup.kernels,
              setup.workers, y->typed_data());
  } else if (mxfp4) {
    DenseMxfp4(T, N, K, x.typed_data(), w.reinterpret_data<uint8_t>(),
               scales.reinterpret_data<uint8_t>(), bf16_activations, *setup.kernels,
               setup.workers, y->typed_data());
  } else {
    DenseInt8(T, N, K, x.typed_data(), w.reinterpret_data<int8_t>(),
              scales.reinterpret_data<float>(), bf16_activations, *setup.kernels, setup.workers,
              y->typed_data());
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace ftjax

// Binding: registered by Python as the CPU target "ftjax_dense_quantized".
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxDenseQuantized, ftjax::DenseQuantizedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()        // XLA's intra-op pool
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, C]
                                  .Arg<ffi::AnyBuffer>()         // w: int8 [O, C] or mxfp4 codes
                                  .Arg<ffi::AnyBuffer>()         // scales
                                  .Attr<bool>("bf16_activations")  // prefill on bf16 pairs
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, O]
);

// Binding: registered by Python as the CPU target "ftjax_dense".
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxDense, ftjax::DenseImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()        // XLA's intra-op pool
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, C]
                                  .Arg<ffi::AnyBuffer>()         // w [O, C], bf16 or f32
                                  .Attr<bool>("bf16_activations")  // vdpbf16ps for bf16 w
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, O]
);
