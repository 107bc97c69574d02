// ftjax_expert_ffn: the weighted sum of routed SwiGLU experts, on the host (XLA:CPU).
//
//   y[t] = sum_k w[t, k] * down_e(silu(gate_e . x[t]) * (up_e . x[t])),  e = ids[t, k]
//
// with route id -1 meaning "skip this route". The attributes `activation`, `alpha`, `limit`
// and `biases` choose a variant of the expert (expert_ffn.h: gpt-oss's clamped SwiGLU, and
// gate/up/down biases stored after down in bf16/float32 blocks; int8 blocks have none); the
// default is the plain SwiGLU. Axis letters follow the ftjax glossary:
// T tokens, D model width, F expert hidden width, E experts, K top-k, L layers; P is the
// number of elements in one expert block of the bank (P >= 3 * F * D, the rest is padding).
// Each block holds, row-major and contiguous: gate [F, D] at offset 0, up [F, D] at F*D and
// down [D, F] at 2*F*D.
//
// Bank dtypes: bfloat16, float32, or int8 (docs/ftw.md, expert format "int8": symmetric per
// output channel). An int8 block also holds the float32 scales of its rows, gate [F], up [F] and
// down [D], from byte Int8ScalesOffset(F, D) = 3*F*D rounded up to 64; P must be a multiple of
// 64 bytes and hold them. The dot kernels widen the int8 weights exactly to float32 (the
// products are those of the widened weights, as for float32), and each output row is
// multiplied by its scale once, after its dot product: the result is that of the dequantised
// weights, to float32 rounding.
//
// mxfp4 banks (uint8; docs/ftw.md, expert format "mxfp4", gpt-oss's MXFP4 as shipped): each
// block holds the 4-bit E2M1 codes of gate [F, D/2], up [F, D/2] and down [D, F/2] bytes (from
// byte 0, in that order), then from Mxfp4ScalesOffset(F, D) their E8M0 scales per 32 inputs
// (gate [F, D/32], up [F, D/32], down [D, F/32]), then from Mxfp4BiasesOffset(F, D) the float32
// biases gate [F], up [F], down [D] when the variant has biases (gpt-oss's; every other family's
// blocks end after the scales). F and D are multiples of 32, P of 64. KernelTable::dot_mxfp4_f32 decodes the codes times their scale
// (exact in float32) and multiplies with float32 FMA: the result is that of the dequantised
// weights to float32 rounding, and a decode call reads the 4.25-bit bytes once. Experts that
// take the packed GEMM (below) have each task's rows decoded to bf16 once (exact), then
// multiplied with all their routes by the bf16 packed GEMM.
//
// int4 banks (uint16 words; docs/ftw.md, expert format "int4"): the codes of gate, up and down
// as mxfp4's, then each row's parameters (float32 steps, a uint8 scale and an int8 min per 32
// inputs; Int4ParamsOffset below). KernelTable::dot_int4_f32 multiplies the format's float32
// weights in float32 (one token: fused, the 4.5-bit bytes read once); experts that take the
// packed GEMM have each task's rows decoded to float32 (exact) first. No biases. With
// bf16_activations, the grouped form (prefill) decodes each task's rows to float32 and rounds
// them to bf16 (DecodeInt4RowsBf16) for the bf16-pair GEMM (AMX tiles where enabled); the decode
// form stays exact.
//
// Three layers, as STYLE.md section 6 asks:
//   ExpertFfn        the kernel, no XLA types: plans the work and runs it on the workers with
//                    the SIMD primitives of one ISA (cpu_kernels.h);
//   ExpertFfnImpl    unpacks the FFI buffers and rejects bad input with InvalidArgument;
//   FtjaxExpertFfn   the declarative XLA FFI binding (exported to Python by module.cc).
//
// The two forms, chosen by T:
//   decode  (T <= 8)  the distinct experts of all tokens are found by a linear scan, so an
//                     expert chosen by several tokens is read from memory once for all of
//                     them; each of its routes runs as a one-token dot of its own (the others
//                     re-read its sub-tiles from L2), so that a token's sums do not depend on
//                     the other tokens of the call (RunExperts' part_dot);
//   grouped (T > 8)   routes are bucketed by expert with a counting sort over E; empty experts
//                     are skipped; each expert runs as a blocked GEMM over its routes, in tiles
//                     of kTokenTile routes.
// Both run the same parallel phases, each expert's rows split across the threads:
//   0. (grouped, AVX2 and AVX-512) pack the x rows of every expert with more than
//      KernelTable::packed_min_tokens routes (8 on AVX2, 16 on AVX-512) for the packed-activation
//      GEMM (cpu_kernels.h): broadcast weights times 16 routes per vector, no
//      horizontal sums; experts with fewer routes, and other ISAs, use the dot-product kernels;
//   1. gate/up: task (expert, chunk of kFfnChunk rows of F; kDecodeFfnChunk in the decode form):
//      h[route, f] = silu(g) * u for all
//      of the expert's routes, g and u from one pass over those gate and up rows;
//   2. down:    task (chunk of kModelChunk rows of D; kDecodeModelChunk in the decode form),
//               over all experts: z = down_e . h, and
//               y[token] += weight * z. Each task owns its columns of y, so no two threads ever
//               add into the same element and the sum order does not depend on the threads.
// A T = 1 call reads each weight row once, as one sequential stream (cpu_kernels_impl.h), and
// runs at the host's read bandwidth (benchmarks/README.md).
// All scratch is planned before phase 0 and taken from one grow-only buffer reused across calls
// (packing.h). Accumulation is float32. bf16 weights are
// widened to float32 in registers and multiplied with float32 FMA (exact products: relative error
// ~1e-6). With the attribute bf16_activations and an AVX-512-BF16 CPU, x and h are rounded to
// bf16 instead and multiplied with vdpbf16ps: twice the multiply-add rate, which the compute-bound
// grouped form gains from (the memory-bound decode form runs at read bandwidth either way), at a
// relative error of ~1e-2 of max|y|. With the attribute int8_activations (int8 banks only, and
// an AVX-512-VNNI CPU: the avx512bf16 kernels), x and h are quantised to int8 instead, per
// token (per route for h: the whole of F, between the phases), symmetric with a float32 scale
// (max |row| / 127, rounding half to even), and multiplied with vpdpbusd in exact int32 sums:
// the weights' bytes read at ~a quarter of the widening's instructions, at the error of 8-bit
// activations (as llama.cpp's Q8_0 does). Opt-in only; never the default.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"
#include "expert_ffn.h"
#include "ffi_util.h"
#include "packing.h"
#include "thread_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ftjax {
namespace {

// ---------------------------------------------------------------------------------------------
// Kernel (no XLA types).

struct ExpertFfnDims {
  int64_t tokens;      // T
  int64_t model_dim;   // D
  int64_t top_k;       // K
  int64_t ffn_dim;     // F
  int64_t experts;     // E
  int64_t block_size;  // P: elements from one expert's block to the next
};

// int8 banks: the byte offset of a block's float32 scales (gate [F], up [F], down [D]), right
// after its int8 weights, 64-byte aligned; and the bytes a block needs.
constexpr int64_t kInt8ScalesAlignment = 64;
int64_t Int8ScalesOffset(int64_t F, int64_t D) {
  return CeilDiv(3 * F * D, kInt8ScalesAlignment) * kInt8ScalesAlignment;
}
int64_t Int8BlockBytes(int64_t F, int64_t D) {
  return Int8ScalesOffset(F, D) + static_cast<int64_t>(sizeof(float)) * (2 * F + D);
}

// mxfp4 banks: the byte offsets of a block's scales and biases (each part 64-byte aligned), and
// the bytes a block needs.
constexpr int64_t kMxfp4Block = 32;  // inputs per scale
int64_t Mxfp4ScalesOffset(int64_t F, int64_t D) {
  return CeilDiv(3 * F * D / 2, kInt8ScalesAlignment) * kInt8ScalesAlignment;
}
int64_t Mxfp4BiasesOffset(int64_t F, int64_t D) {
  return Mxfp4ScalesOffset(F, D) +
         CeilDiv(3 * F * D / kMxfp4Block, kInt8ScalesAlignment) * kInt8ScalesAlignment;
}
int64_t Mxfp4BlockBytes(int64_t F, int64_t D, bool biases) {
  return Mxfp4BiasesOffset(F, D) + (biases ? static_cast<int64_t>(sizeof(float)) * (2 * F + D) : 0);
}

// int4 banks (uint16 words, so that the dtype names the format; docs/ftw.md, expert format
// "int4"): each block holds the 4-bit codes of gate [F, D/2], up [F, D/2] and down [D, F/2]
// bytes from byte 0 (as mxfp4), then from Int4ParamsOffset(F, D) the parameters of every row,
// Int4RowParamBytes(n) = 8 + 2 * n / 32 bytes for a row of n inputs (gate and up rows D, down
// rows F): float32 d, dm, then n / 32 uint8 scales and n / 32 int8 mins (Int4DotProblem). No
// biases.
int64_t Int4RowParamBytes(int64_t n) { return 8 + 2 * (n / kMxfp4Block); }
// The element type of an int4 bank in the templates below: a uint16 word of block bytes (its own
// type, as Bf16Bits is a uint16_t too).
struct Int4Word {
  uint16_t bytes;
};
int64_t Int4ParamsOffset(int64_t F, int64_t D) { return Mxfp4ScalesOffset(F, D); }
int64_t Int4BlockBytes(int64_t F, int64_t D) {
  return Int4ParamsOffset(F, D) + 2 * F * Int4RowParamBytes(D) + D * Int4RowParamBytes(F);
}

// The per-output-row scales of int8 weights, applied after the dot products (a no-op for
// float weights): c[t * c_stride + r] *= scale[r] (the dot kernels' layout) or, transposed (the
// packed GEMMs'), c[r * c_stride + t] *= scale[r], for r < rows, t < tokens.
struct RowScales {
  const float* scale = nullptr;  // null: float weights, nothing to scale
  void Apply(int64_t rows, int64_t tokens, float* c, int64_t c_stride) const {
    if (scale == nullptr) return;
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t r = 0; r < rows; ++r) c[t * c_stride + r] *= scale[r];
    }
  }
  void ApplyTransposed(int64_t rows, int64_t tokens, float* ct, int64_t c_stride) const {
    if (scale == nullptr) return;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t t = 0; t < tokens; ++t) ct[r * c_stride + t] *= scale[r];
    }
  }
};

// int8_activations: out = round_half_even(in / scale) with scale = max |in| / 127 (0 for a
// zero row, whose out is 0); returns the scale.
float QuantizeRow(const float* in, int64_t n, int8_t* out) {
  float largest = 0.0f;
  for (int64_t i = 0; i < n; ++i) largest = std::max(largest, std::fabs(in[i]));
  const float scale = largest / 127.0f;
  const float inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    out[i] = static_cast<int8_t>(std::clamp(std::nearbyint(in[i] * inverse), -127.0f, 127.0f));
  }
  return scale;
}

// int8_activations of an mxfp4 bank: QuantizeRow per block of 32 inputs (n a multiple of 32),
// block b's scale in scales[b] (llama.cpp's Q8_0, with a float32 scale).
void QuantizeBlocks(const float* in, int64_t n, int8_t* out, float* scales) {
  for (int64_t b = 0; b < n / 32; ++b) scales[b] = QuantizeRow(in + 32 * b, 32, out + 32 * b);
}

// The scales of rows [row, ...) of part `part` (0 gate, 1 up, 2 down) of an expert block.
template <typename WeightT>
RowScales ScalesOf(const WeightT* block, const ExpertFfnDims& dims, int part, int64_t row) {
  if constexpr (!std::is_same_v<WeightT, int8_t>) {
    return RowScales{};
  } else {
    const float* scales = reinterpret_cast<const float*>(
        block + Int8ScalesOffset(dims.ffn_dim, dims.model_dim));
    return RowScales{scales + part * dims.ffn_dim + row};
  }
}

// The dot kernel of one weight type and activation type: DotProblem's, or for mxfp4 weights
// (uint8_t) the Mxfp4DotProblem's.
template <typename WeightT, typename ActivationT>
struct DotKernelOf {
  using type = void (*)(const DotProblem<WeightT, ActivationT>&);
};
template <>
struct DotKernelOf<uint8_t, float> {
  using type = DotMxfp4F32Fn;
};
template <>
struct DotKernelOf<uint8_t, int8_t> {
  using type = DotMxfp4Q8Fn;
};
// mxfp4 with bf16 activations runs every expert on the packed GEMM (RunExperts): no dot kernel.
template <>
struct DotKernelOf<uint8_t, Bf16Bits> {
  using type = std::nullptr_t;
};
// int4 (Int4Word): the fused dot kernel takes float32 activations; with bf16 activations every
// expert runs on the packed GEMM (RunExperts), as mxfp4's.
template <>
struct DotKernelOf<Int4Word, float> {
  using type = void (*)(const Int4DotProblem&);
};
template <>
struct DotKernelOf<Int4Word, Bf16Bits> {
  using type = std::nullptr_t;
};
template <typename WeightT, typename ActivationT>
using DotKernel = typename DotKernelOf<WeightT, ActivationT>::type;

// Row `row` of part `part` (0 gate, 1 up, 2 down) of an mxfp4 expert block: its codes and its
// scales, for n inputs (D, or F for down).
struct Mxfp4Rows {
  const uint8_t* codes;
  const uint8_t* scales;
  int64_t n;
};
Mxfp4Rows Mxfp4PartRows(const uint8_t* block, const ExpertFfnDims& dims, int part, int64_t row) {
  const int64_t F = dims.ffn_dim, D = dims.model_dim;
  const int64_t n = part == 2 ? F : D;
  return {block + part * (F * D / 2) + row * (n / 2),
          block + Mxfp4ScalesOffset(F, D) + part * (F * D / kMxfp4Block) + row * (n / kMxfp4Block),
          n};
}

// Rows [row, ...) of part `part` (0 gate, 1 up, 2 down) of an int4 expert block: their codes
// and parameters, for n inputs (D, or F for down).
struct Int4Rows {
  const uint8_t* codes;
  const uint8_t* params;  // steps d, dm, then scales, then mins, Int4RowParamBytes(n) a row
  int64_t n;
  int64_t param_stride;
};
Int4Rows Int4PartRows(const Int4Word* block_words, const ExpertFfnDims& dims, int part,
                      int64_t row) {
  const uint8_t* block = reinterpret_cast<const uint8_t*>(block_words);
  const int64_t F = dims.ffn_dim, D = dims.model_dim;
  const int64_t n = part == 2 ? F : D;
  const int64_t stride = Int4RowParamBytes(n);
  return {block + part * (F * D / 2) + row * (n / 2),
          block + Int4ParamsOffset(F, D) + part * F * Int4RowParamBytes(D) + row * stride, n,
          stride};
}

// c[t * c_stride + r] = row (row + r) of part `part` (0 gate, 1 up, 2 down) of an expert block
// . a[t], for r < rows, t < tokens: the dot kernel on the part's rows, then the int8 row scales.
// a_scales: the block scales of int8 activations against an mxfp4 bank (unused otherwise).
template <typename WeightT, typename ActivationT>
void PartDot(DotKernel<WeightT, ActivationT> dot, const WeightT* block, const ExpertFfnDims& dims,
             int part, int64_t row, int64_t rows, const ActivationT* const* a,
             const float* const* a_scales, int64_t tokens, float* c, int64_t c_stride) {
  const int64_t F = dims.ffn_dim, D = dims.model_dim;
  const int64_t n = part == 2 ? F : D;  // inputs of the part's rows
  if constexpr (std::is_same_v<WeightT, Int4Word>) {
    if constexpr (std::is_same_v<ActivationT, Bf16Bits>) {
      std::abort();  // never reached: RunExperts packs every expert of this pairing
    } else {
      const Int4Rows q = Int4PartRows(block, dims, part, row);
      const int64_t blocks = n / kMxfp4Block;
      dot({q.codes, n / 2, q.params + 8, q.param_stride,
           reinterpret_cast<const int8_t*>(q.params + 8 + blocks), q.param_stride, q.params,
           q.param_stride, rows, a, tokens, n, c, c_stride});
    }
  } else if constexpr (std::is_same_v<WeightT, uint8_t>) {
    const Mxfp4Rows m = Mxfp4PartRows(block, dims, part, row);
    if constexpr (std::is_same_v<ActivationT, int8_t>) {
      dot({m.codes, n / 2, m.scales, n / kMxfp4Block, rows, a, a_scales, tokens, n, c, c_stride});
    } else if constexpr (std::is_same_v<ActivationT, Bf16Bits>) {
      std::abort();  // never reached: RunExperts packs every expert of this pairing
    } else {
      dot({m.codes, n / 2, m.scales, n / kMxfp4Block, rows, a, tokens, n, c, c_stride});
    }
  } else {
    dot({block + part * F * D + row * n, n, rows, a, tokens, n, c, c_stride});
    ScalesOf(block, dims, part, row).Apply(rows, tokens, c, c_stride);
  }
}

// The biases of an expert block with biases: gate [F], up [F], down [D] one after the other, in
// the bank's dtype after the weights, or in float32 after an mxfp4 block's scales.
template <typename WeightT>
auto BiasesOf(const WeightT* block, const ExpertFfnDims& dims) {
  const int64_t F = dims.ffn_dim, D = dims.model_dim;
  if constexpr (std::is_same_v<WeightT, uint8_t>) {
    return reinterpret_cast<const float*>(block + Mxfp4BiasesOffset(F, D));
  } else if constexpr (std::is_same_v<WeightT, Int4Word>) {
    return static_cast<const float*>(nullptr);  // int4 blocks have none (the op refuses biases)
  } else {
    return block + 3 * F * D;
  }
}

constexpr int64_t kDecodeMaxTokens = 8;  // T at or below: decode form
constexpr int64_t kFfnChunk = 64;        // rows of gate (and of up) per phase-1 task
constexpr int64_t kModelChunk = 128;     // rows of down per phase-2 task
constexpr int64_t kTokenTile = 64;       // tokens per GEMM tile in the grouped form
// The decode form's chunks, larger (when no expert has more than kDecodeMaxTokens routes): no
// L1/L2 reuse to keep, and each task starts new weight streams that the prefetchers take a while to cover
// (cpu_kernels_impl.h, dense.cc). 8 Qwen3-30B-A3B experts at T = 1 on the Zen 5 VM, 2 threads,
// medians of 30 rounds alternating in one process: 0.85-0.98 of the read probe with 64/128-row
// chunks, 0.91-1.00 with 256/256 (AVX-512), AVX2 0.83-0.96 -> 0.90-0.98; 384 or 768 gate/up
// rows and 512 down rows no better (and 512 leaves 4 down tasks for the threads to balance).
constexpr int64_t kDecodeFfnChunk = 256;
constexpr int64_t kDecodeModelChunk = 256;
// The decode form's routes of one expert run one at a time over sub-tiles of this many bytes of
// weights (RunExperts' part_dot): the first route reads a sub-tile from memory, the others from
// L2 (1-2 MiB a core on the machines here).
constexpr int64_t kRouteTileBytes = 256 * 1024;
// They reuse the grouped form's per-worker scratch.
static_assert(kDecodeMaxTokens * kDecodeFfnChunk <= kTokenTile * kFfnChunk);
static_assert(kDecodeMaxTokens * kDecodeModelChunk <= kTokenTile * kModelChunk);

// The routes of one call bucketed by expert: experts[i] (ascending, none empty) has the routes
// [offsets[i], offsets[i + 1]), each with its token and weight, in (t, k) order.
struct ExpertGroups {
  std::vector<int32_t> experts;
  std::vector<int64_t> offsets;
  std::vector<int32_t> route_token;
  std::vector<float> route_weight;
  int64_t num_routes() const { return static_cast<int64_t>(route_token.size()); }
  int64_t largest_group() const {
    int64_t largest = 0;
    for (size_t i = 0; i + 1 < offsets.size(); ++i) {
      largest = std::max(largest, offsets[i + 1] - offsets[i]);
    }
    return largest;
  }
};

// Decode form: at most 8 * K routes, so a linear scan finds the distinct experts.
ExpertGroups GroupDecode(const ExpertFfnDims& dims, const int32_t* ids_tk,
                         const float* weights_tk) {
  const int64_t routes = dims.tokens * dims.top_k;
  ExpertGroups groups;
  for (int64_t r = 0; r < routes; ++r) {
    const int32_t expert = ids_tk[r];
    if (expert >= 0 && std::find(groups.experts.begin(), groups.experts.end(), expert) ==
                           groups.experts.end()) {
      groups.experts.push_back(expert);
    }
  }
  std::sort(groups.experts.begin(), groups.experts.end());
  groups.offsets.push_back(0);
  for (const int32_t expert : groups.experts) {
    for (int64_t r = 0; r < routes; ++r) {
      if (ids_tk[r] != expert) continue;
      groups.route_token.push_back(static_cast<int32_t>(r / dims.top_k));
      groups.route_weight.push_back(weights_tk[r]);
    }
    groups.offsets.push_back(groups.num_routes());
  }
  return groups;
}

// Grouped form: counting sort of the routes by expert, empty experts dropped.
ExpertGroups GroupByCounting(const ExpertFfnDims& dims, const int32_t* ids_tk,
                             const float* weights_tk) {
  const int64_t routes = dims.tokens * dims.top_k;
  std::vector<int64_t> start(dims.experts + 1, 0);
  for (int64_t r = 0; r < routes; ++r) {
    if (ids_tk[r] >= 0) ++start[ids_tk[r] + 1];
  }
  for (int64_t e = 0; e < dims.experts; ++e) start[e + 1] += start[e];
  ExpertGroups groups;
  groups.route_token.resize(start[dims.experts]);
  groups.route_weight.resize(start[dims.experts]);
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t r = 0; r < routes; ++r) {
    const int32_t expert = ids_tk[r];
    if (expert < 0) continue;
    const int64_t slot = next[expert]++;
    groups.route_token[slot] = static_cast<int32_t>(r / dims.top_k);
    groups.route_weight[slot] = weights_tk[r];
  }
  groups.offsets.push_back(0);
  for (int64_t e = 0; e < dims.experts; ++e) {
    if (start[e + 1] == start[e]) continue;  // empty expert: skipped
    groups.experts.push_back(static_cast<int32_t>(e));
    groups.offsets.push_back(start[e + 1]);
  }
  return groups;
}

// Stores rows f0 .. f0 + rows of a transposed tile h_ft[f][t] (t < 16 * tile_groups, row stride
// `stride`) into the packed h of one expert (groups of 16 routes over F inputs), starting at
// group g0. Routes at or past `real` are padding and stored as zero (and so is input F when F
// is odd, bf16 pairs).
template <typename PackedT>
void StorePackedRows(const PackedT* h_ft, int64_t stride, int64_t rows, int64_t f0, int64_t F,
                     int64_t g0, int64_t tile_groups, int64_t real, PackedT* packed) {
  const int64_t group_elements = PackedGroupElements<PackedT>(F);
  for (int64_t t = 0; t < tile_groups * kPackedGroup; ++t) {
    PackedT* group = packed + (g0 + t / kPackedGroup) * group_elements;
    const int64_t j = t % kPackedGroup;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t f = f0 + r;
      const PackedT value = t < real ? h_ft[r * stride + t] : PackedT(0);
      if constexpr (std::is_same_v<PackedT, Bf16Bits>) {
        group[(f / 2) * 2 * kPackedGroup + 2 * j + f % 2] = value;
      } else {
        group[f * kPackedGroup + j] = value;
      }
    }
    if constexpr (std::is_same_v<PackedT, Bf16Bits>) {
      if (f0 + rows == F && F % 2 == 1) group[(F / 2) * 2 * kPackedGroup + 2 * j + 1] = 0;
    }
  }
}

float WidenWeight(float w) { return w; }
float WidenWeight(int8_t w) { return static_cast<float>(w); }  // (int8 blocks have no biases)
float WidenWeight(Bf16Bits w) {
  const uint32_t bits = static_cast<uint32_t>(w) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Phase 1's activation on a tile of g (in `gate`, overwritten by h) and u (in `up`): `rows`
// rows of F starting at row f0, `tokens` routes; element (f, t) at f * row_stride +
// t * token_stride. `biases` points at the expert's gate bias [F] (then the up bias [F]), or
// is null. The plain SwiGLU without biases takes the ISA's vector kernel over the whole tile
// (`contiguous` elements, padding columns included).
template <typename WeightT>
void Activate(const ExpertActivation& act, const KernelTable& kernels, const WeightT* biases,
              int64_t F, int64_t f0, int64_t rows, int64_t tokens, int64_t row_stride,
              int64_t token_stride, int64_t contiguous, float* gate, const float* up) {
  if (act.kind == Activation::kSwiglu && biases == nullptr) {
    kernels.silu_mul(gate, up, gate, contiguous);
    return;
  }
  const bool clamped = act.kind == Activation::kClampedSwiglu;
  for (int64_t f = 0; f < rows; ++f) {
    const float gate_bias = biases != nullptr ? WidenWeight(biases[f0 + f]) : 0.0f;
    const float up_bias = biases != nullptr ? WidenWeight(biases[F + f0 + f]) : 0.0f;
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t i = f * row_stride + t * token_stride;
      float g = gate[i] + gate_bias;
      float u = up[i] + up_bias;
      if (clamped) {
        g = std::min(g, act.limit);
        u = std::min(std::max(u, -act.limit), act.limit);
        gate[i] = (u + 1.0f) * (g / (1.0f + std::exp(-act.alpha * g)));
      } else {
        gate[i] = g / (1.0f + std::exp(-g)) * u;
      }
    }
  }
}

// Per-worker scratch, planned before the phases start (regions of the call's scratch buffer).
struct WorkerScratch {
  float* gate;         // [kTokenTile, kFfnChunk] (or transposed)
  float* up;           // [kTokenTile, kFfnChunk] (or transposed)
  float* down;         // [kTokenTile, kModelChunk] (or transposed)
  Bf16Bits* rounded;   // [kFfnChunk, kTokenTile], packed bf16 experts only
  // Packed mxfp4 experts only: a task's weight rows decoded (DecodeMxfp4Rows), gate and up
  // [2, kFfnChunk, D] or down [kModelChunk, F], and one row in float32 on the way.
  Bf16Bits* decoded;
  float* decoded_row;  // [max(D, F)]
  // Packed int4 experts against float32 activations: the same rows decoded to float32
  // (DecodeInt4Rows); against bf16 activations they are rounded to bf16 into `decoded`.
  float* decoded_f32;
};

// mxfp4 rows for the packed GEMMs: rows [row, row + rows) of part `part` (0 gate, 1 up, 2 down)
// of an expert block, dequantised (KernelTable::decode_mxfp4) and stored as bf16 at out
// [rows, n]: exact, an E2M1 value times a power of two having 2 significant bits. A task's rows
// are decoded once and multiplied with all its routes by packed_dot_bf16_f32 (bf16 weights
// widened against float32 activations: the float32 products of the dequantised weights).
void DecodeMxfp4Rows(const KernelTable& kernels, const uint8_t* block, const ExpertFfnDims& dims,
                     int part, int64_t row, int64_t rows, float* row_f32, Bf16Bits* out) {
  const Mxfp4Rows m = Mxfp4PartRows(block, dims, part, row);
  for (int64_t r = 0; r < rows; ++r) {
    kernels.decode_mxfp4(m.codes + r * (m.n / 2), m.scales + r * (m.n / kMxfp4Block), m.n,
                         row_f32);
    kernels.round_to_bf16(row_f32, out + r * m.n, m.n);
  }
}

// int4 rows for the packed GEMMs: rows [row, row + rows) of part `part` of an int4 block,
// decoded (KernelTable::decode_int4: the format's float32 weights, exact) to float32 at out
// [rows, n], multiplied with all the task's routes by packed_dot_f32.
void DecodeInt4Rows(const KernelTable& kernels, const Int4Word* block, const ExpertFfnDims& dims,
                    int part, int64_t row, int64_t rows, float* out) {
  const Int4Rows q = Int4PartRows(block, dims, part, row);
  const int64_t blocks = q.n / kMxfp4Block;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* p = q.params + r * q.param_stride;
    float d, dm;
    std::memcpy(&d, p, sizeof(float));
    std::memcpy(&dm, p + sizeof(float), sizeof(float));
    kernels.decode_int4(q.codes + r * (q.n / 2), p + 8,
                        reinterpret_cast<const int8_t*>(p + 8 + blocks), d, dm, q.n,
                        out + r * q.n);
  }
}

// The same rows rounded to bf16 at out [rows, n] (row_f32 [n] on the way): the weights of the
// bf16-pair GEMM under bf16 activations. Unlike mxfp4's, int4 values are not all bf16 values:
// each weight rounds to 8 significant bits (relative error <= 2^-9), as the activations do,
// far inside the format's own step (a 16th of a block's range).
void DecodeInt4RowsBf16(const KernelTable& kernels, const Int4Word* block,
                        const ExpertFfnDims& dims, int part, int64_t row, int64_t rows,
                        float* row_f32, Bf16Bits* out) {
  const int64_t n = part == 2 ? dims.ffn_dim : dims.model_dim;
  for (int64_t r = 0; r < rows; ++r) {
    DecodeInt4Rows(kernels, block, dims, part, row + r, 1, row_f32);
    kernels.round_to_bf16(row_f32, out + r * n, n);
  }
}

// Where one active expert's activations live. Experts with more than
// KernelTable::packed_min_tokens routes use the packed-activation GEMM when the ISA has it (AVX2,
// AVX-512): x and h are stored packed (cpu_kernels.h) in groups of 16 routes; the others use the
// dot-product kernels on rows of x and h. (mxfp4 experts: the packed GEMM of bf16 weights, on
// rows decoded per task, or straight from the codes where the ISA has packed_dot_mxfp4_f32.)
struct ExpertStorage {
  bool packed = false;
  int64_t groups = 0;         // ceil(routes / 16) when packed
  int64_t x_offset = 0;       // into the packed x, elements
  int64_t hidden_offset = 0;  // into the packed h, elements
};

// Runs both phases for one weight type and activation type (ActivationT is float, or bf16 bits
// when the ISA multiplies bf16 pairs: then x is rounded to bf16 first).
template <typename WeightT, typename ActivationT>
void RunExperts(const ExpertFfnDims& dims, const ExpertGroups& groups, const float* x_f32,
                const WeightT* bank_ep, const KernelTable& kernels,
                DotKernel<WeightT, ActivationT> dot, const Workers& workers,
                const ExpertActivation& act, float* y_td) {
  const int64_t D = dims.model_dim, F = dims.ffn_dim, routes = groups.num_routes();
  const int64_t num_experts = static_cast<int64_t>(groups.experts.size());
  const int64_t token_tile = std::min(kTokenTile, std::max<int64_t>(groups.largest_group(), 1));
  constexpr int64_t kGroupsPerTile = kTokenTile / kPackedGroup;
  constexpr bool kRound = std::is_same_v<ActivationT, Bf16Bits>;
  constexpr bool kQuantise = std::is_same_v<ActivationT, int8_t>;  // int8_activations
  constexpr bool kMxfp4 = std::is_same_v<WeightT, uint8_t>;
  constexpr bool kInt4 = std::is_same_v<WeightT, Int4Word>;
  // The packed GEMM's weights: the bank's, mxfp4 rows decoded to bf16 (DecodeMxfp4Rows), or
  // int4 rows decoded to float32 (DecodeInt4Rows), or to bf16 against bf16 activations
  // (DecodeInt4RowsBf16).
  constexpr bool kInt4Bf16 = kInt4 && kRound;
  using PackedWeightT = std::conditional_t<kMxfp4 || kInt4Bf16, Bf16Bits,
                                           std::conditional_t<kInt4, float, WeightT>>;
  const auto packed_dot = PackedDotFor<PackedWeightT, ActivationT>(kernels);
  const int num_workers = workers.num_workers();

  // The plan: storage of every expert's activations, all scratch sized up front and taken from
  // one buffer reused across calls (packing.h).
  constexpr bool kBf16Pairs =
      std::is_same_v<PackedWeightT, Bf16Bits> && std::is_same_v<ActivationT, Bf16Bits>;
  // (AMX needs whole tiles of 32 inputs; otherwise the pairs run on vdpbf16ps.)
  // mxfp4 and int4 rows decoded to bf16 against bf16 activations have no dot kernel: every
  // expert with a route takes the packed GEMM.
  const int64_t packed_min_routes =
      (kMxfp4 || kInt4) && kRound
          ? 0
          : PackedMinTokens(kernels, kBf16Pairs && D % 32 == 0 && F % 32 == 0, PackedUse::kExpert);
  // The decode form packs no expert (below: each route runs alone), except the pairings that
  // have no dot kernel (never in the decode form: ExpertFfn's dispatch).
  const bool decode_form = dims.tokens <= kDecodeMaxTokens;
  auto is_packed = [&](int64_t i) {
    const int64_t routes_of_expert = groups.offsets[i + 1] - groups.offsets[i];
    return packed_dot != nullptr && routes_of_expert > packed_min_routes &&
           (!decode_form || packed_min_routes == 0);
  };
  int64_t packed_x_size = 0, packed_hidden_size = 0;
  for (int64_t i = 0; i < num_experts; ++i) {
    if (!is_packed(i)) continue;
    const int64_t n_groups = CeilDiv(groups.offsets[i + 1] - groups.offsets[i], kPackedGroup);
    packed_x_size += n_groups * PackedGroupElements<ActivationT>(D);
    packed_hidden_size += n_groups * PackedGroupElements<ActivationT>(F);
  }
  ScratchPlan plan;
  const int64_t at_rounded_x = kRound ? plan.Add<Bf16Bits>(dims.tokens * D) : 0;
  // int8_activations: x quantised per token, h in float32 until quantised per route; with an
  // mxfp4 bank per block of 32 inputs instead (kBlockScales), the scales applied in the kernel.
  constexpr bool kBlockScales = kQuantise && kMxfp4;
  const int64_t x_scales_per_token = kBlockScales ? D / kMxfp4Block : 1;
  const int64_t hidden_scales_per_route = kBlockScales ? F / kMxfp4Block : 1;
  const int64_t at_quantised_x = plan.Add<int8_t>(kQuantise ? dims.tokens * D : 0);
  const int64_t at_x_scales = plan.Add<float>(kQuantise ? dims.tokens * x_scales_per_token : 0);
  const int64_t at_hidden_f32 = plan.Add<float>(kQuantise ? routes * F : 0);
  const int64_t at_hidden_scales =
      plan.Add<float>(kQuantise ? routes * hidden_scales_per_route : 0);
  const int64_t at_route_x_scales = plan.Add<const float*>(kBlockScales ? routes : 0);
  const int64_t at_route_hidden_scales = plan.Add<const float*>(kBlockScales ? routes : 0);
  const int64_t at_storage = plan.Add<ExpertStorage>(num_experts);
  const int64_t at_packed_x = plan.Add<ActivationT>(packed_x_size);
  const int64_t at_packed_hidden = plan.Add<ActivationT>(packed_hidden_size);
  // h [routes, F] in the activation type for the other experts: phase 1 writes, phase 2 reads.
  const int64_t at_hidden = plan.Add<ActivationT>(routes * F);
  const int64_t at_route_x = plan.Add<const ActivationT*>(routes);
  const int64_t at_route_hidden = plan.Add<const ActivationT*>(routes);
  const int64_t at_workers = plan.Add<WorkerScratch>(num_workers);
  const int64_t worker_floats = 2 * kTokenTile * kFfnChunk + kTokenTile * kModelChunk;
  const int64_t at_worker_floats = plan.Add<float>(num_workers * worker_floats);
  const bool round_hidden = packed_x_size > 0 && kRound;
  const int64_t at_worker_rounded =
      plan.Add<Bf16Bits>(round_hidden ? num_workers * kTokenTile * kFfnChunk : 0);
  // mxfp4 against float32 activations on an ISA with packed_dot_mxfp4_f32: the packed GEMM
  // decodes the codes itself, no rows decoded per task.
  bool direct_mxfp4 = false;
  if constexpr (kMxfp4 && std::is_same_v<ActivationT, float>) {
    direct_mxfp4 = kernels.packed_dot_mxfp4_f32 != nullptr;
  }
  const bool decode_rows = (kMxfp4 || kInt4Bf16) && packed_x_size > 0 && !direct_mxfp4;
  const int64_t decoded_elements = std::max(2 * kFfnChunk * D, kModelChunk * F);
  const int64_t at_worker_decoded =
      plan.Add<Bf16Bits>(decode_rows ? num_workers * decoded_elements : 0);
  const int64_t at_worker_decoded_row =
      plan.Add<float>(decode_rows ? num_workers * std::max(D, F) : 0);
  const bool decode_int4 = kInt4 && !kRound && packed_x_size > 0;
  const int64_t at_worker_decoded_f32 =
      plan.Add<float>(decode_int4 ? num_workers * decoded_elements : 0);
  unsigned char* buffer = Scratch(plan);

  const ActivationT* x_td;
  float* x_scales = At<float>(buffer, at_x_scales);
  float* hidden_f32 = At<float>(buffer, at_hidden_f32);
  float* hidden_scales = At<float>(buffer, at_hidden_scales);
  if constexpr (kRound) {
    kernels.round_to_bf16(x_f32, At<Bf16Bits>(buffer, at_rounded_x), dims.tokens * D);
    x_td = At<Bf16Bits>(buffer, at_rounded_x);
  } else if constexpr (kQuantise) {
    int8_t* x_q = At<int8_t>(buffer, at_quantised_x);
    for (int64_t t = 0; t < dims.tokens; ++t) {
      if constexpr (kBlockScales) {
        QuantizeBlocks(x_f32 + t * D, D, x_q + t * D, x_scales + t * x_scales_per_token);
      } else {
        x_scales[t] = QuantizeRow(x_f32 + t * D, D, x_q + t * D);
      }
    }
    x_td = x_q;
  } else {
    x_td = x_f32;
  }
  ExpertStorage* storage = At<ExpertStorage>(buffer, at_storage);
  for (int64_t i = 0, x_offset = 0, hidden_offset = 0; i < num_experts; ++i) {
    ExpertStorage& e = storage[i];
    e = ExpertStorage{};
    if (!is_packed(i)) continue;
    e.packed = true;
    e.groups = CeilDiv(groups.offsets[i + 1] - groups.offsets[i], kPackedGroup);
    e.x_offset = x_offset;
    e.hidden_offset = hidden_offset;
    x_offset += e.groups * PackedGroupElements<ActivationT>(D);
    hidden_offset += e.groups * PackedGroupElements<ActivationT>(F);
  }
  ActivationT* packed_x = At<ActivationT>(buffer, at_packed_x);
  ActivationT* packed_hidden = At<ActivationT>(buffer, at_packed_hidden);
  ActivationT* hidden_rf = At<ActivationT>(buffer, at_hidden);
  const ActivationT** route_x = At<const ActivationT*>(buffer, at_route_x);
  const ActivationT** route_hidden = At<const ActivationT*>(buffer, at_route_hidden);
  for (int64_t r = 0; r < routes; ++r) {
    route_x[r] = x_td + groups.route_token[r] * D;
    route_hidden[r] = hidden_rf + r * F;
  }
  // The block scales of each route's x and h (kBlockScales), else null.
  const float** route_x_scales =
      kBlockScales ? At<const float*>(buffer, at_route_x_scales) : nullptr;
  const float** route_hidden_scales =
      kBlockScales ? At<const float*>(buffer, at_route_hidden_scales) : nullptr;
  if constexpr (kBlockScales) {
    for (int64_t r = 0; r < routes; ++r) {
      route_x_scales[r] = x_scales + groups.route_token[r] * x_scales_per_token;
      route_hidden_scales[r] = hidden_scales + r * hidden_scales_per_route;
    }
  }
  WorkerScratch* scratch = At<WorkerScratch>(buffer, at_workers);
  for (int w = 0; w < num_workers; ++w) {
    float* floats = At<float>(buffer, at_worker_floats) + w * worker_floats;
    scratch[w].gate = floats;
    scratch[w].up = floats + kTokenTile * kFfnChunk;
    scratch[w].down = floats + 2 * kTokenTile * kFfnChunk;
    scratch[w].rounded = round_hidden
                             ? At<Bf16Bits>(buffer, at_worker_rounded) + w * kTokenTile * kFfnChunk
                             : nullptr;
    scratch[w].decoded =
        decode_rows ? At<Bf16Bits>(buffer, at_worker_decoded) + w * decoded_elements : nullptr;
    scratch[w].decoded_row =
        decode_rows ? At<float>(buffer, at_worker_decoded_row) + w * std::max(D, F) : nullptr;
    scratch[w].decoded_f32 =
        decode_int4 ? At<float>(buffer, at_worker_decoded_f32) + w * decoded_elements : nullptr;
  }

  // The packed GEMM of rows [row, row + rows) of part `part` of an expert block against
  // tile_groups groups of packed activations (of the expert's call_groups), into ct
  // (transposed, kTokenTile a row): the weights are `rows_of` (the bank's rows, or a task's
  // decoded mxfp4 rows), or for direct_mxfp4 the block's codes.
  auto packed_part = [&](const WeightT* block, int part, int64_t row, int64_t rows,
                         const PackedWeightT* rows_of, const ActivationT* act_packed,
                         int64_t tile_groups, int64_t call_groups, bool half, float* ct) {
    const int64_t n = part == 2 ? F : D;
    if constexpr (kMxfp4 && std::is_same_v<ActivationT, float>) {
      if (direct_mxfp4) {
        const Mxfp4Rows m = Mxfp4PartRows(block, dims, part, row);
        kernels.packed_dot_mxfp4_f32({m.codes, n / 2, m.scales, n / kMxfp4Block, rows,
                                      act_packed, tile_groups, half, n, ct, kTokenTile});
        return;
      }
    }
    packed_dot({rows_of, n, rows, act_packed, tile_groups, half, n, ct, kTokenTile, call_groups});
  };

  // Phase 0 (packed experts only): pack each expert's x rows.
  if (packed_x_size > 0) {
    workers.ParallelFor(num_experts, [&](int64_t i, int /*worker*/) {
      if (!storage[i].packed) return;
      const int64_t n = groups.offsets[i + 1] - groups.offsets[i];
      PackRows(route_x + groups.offsets[i], n, storage[i].groups, D,
               packed_x + storage[i].x_offset);
    });
  }

  // The dot products of rows [row, row + rows) of part `part` with `tokens` routes' activations
  // (a, a_scales), token j's into c + j * rows. In the decode form each route runs as a
  // one-token dot of its own, in sub-tiles of kRouteTileBytes of weights (read from memory by
  // the first route, from L2 by the others): a token's sums then never depend on how many other
  // tokens of the call chose the same expert (the one-token and several-token kernels sum in
  // different orders, cpu_kernels_impl.h), so a sequence's tokens are the same whatever else is
  // in its batch (issue 54), on every ISA and for every format (AVX-512's fused 4-bit kernels
  // sum a token alike beside others; AVX2's do not).
  auto part_dot = [&](const WeightT* block, int part, int64_t row, int64_t rows,
                      const ActivationT* const* a, const float* const* a_scales, int64_t tokens,
                      float* c) {
    if (!decode_form || tokens == 1) {
      PartDot<WeightT, ActivationT>(dot, block, dims, part, row, rows, a, a_scales, tokens, c,
                                    rows);
      return;
    }
    const int64_t n = part == 2 ? F : D;
    const int64_t tile = std::max<int64_t>(1, kRouteTileBytes / (n * sizeof(WeightT)));
    for (int64_t r = 0; r < rows; r += tile) {
      const int64_t sub = std::min(tile, rows - r);
      for (int64_t j = 0; j < tokens; ++j) {
        PartDot<WeightT, ActivationT>(dot, block, dims, part, row + r, sub, a + j,
                                      a_scales != nullptr ? a_scales + j : nullptr, 1,
                                      c + j * rows + r, rows);
      }
    }
  };

  // Phase 1: h = silu(gate . x) * (up . x), task = (expert, chunk of F).
  // Decode, with at most kDecodeMaxTokens routes per expert (none packed): larger chunks, whose
  // tiles still fit the per-worker scratch (the static_asserts above).
  const bool decode_chunks = dims.tokens <= kDecodeMaxTokens && packed_x_size == 0 &&
                             groups.largest_group() <= kDecodeMaxTokens;
  const int64_t ffn_chunk = decode_chunks ? kDecodeFfnChunk : kFfnChunk;
  const int64_t model_chunk = decode_chunks ? kDecodeModelChunk : kModelChunk;
  const int64_t ffn_chunks = CeilDiv(F, ffn_chunk);
  workers.ParallelFor(num_experts * ffn_chunks, [&](int64_t task, int worker) {
    const int64_t i = task / ffn_chunks;
    const int64_t f0 = (task % ffn_chunks) * ffn_chunk;
    const int64_t rows = std::min(ffn_chunk, F - f0);
    const WeightT* block = bank_ep + groups.experts[i] * dims.block_size;
    const auto biases = act.biases ? BiasesOf(block, dims) : nullptr;  // gate [F], up [F]
    WorkerScratch& s = scratch[worker];
    if (storage[i].packed) {
      const PackedWeightT* gate_fd = nullptr;
      const PackedWeightT* up_fd = nullptr;
      if constexpr (kMxfp4) {
        if (!direct_mxfp4) {
          DecodeMxfp4Rows(kernels, block, dims, 0, f0, rows, s.decoded_row, s.decoded);
          DecodeMxfp4Rows(kernels, block, dims, 1, f0, rows, s.decoded_row, s.decoded + rows * D);
          gate_fd = s.decoded;
          up_fd = s.decoded + rows * D;
        }
      } else if constexpr (kInt4Bf16) {
        DecodeInt4RowsBf16(kernels, block, dims, 0, f0, rows, s.decoded_row, s.decoded);
        DecodeInt4RowsBf16(kernels, block, dims, 1, f0, rows, s.decoded_row,
                           s.decoded + rows * D);
        gate_fd = s.decoded;
        up_fd = s.decoded + rows * D;
      } else if constexpr (kInt4) {
        DecodeInt4Rows(kernels, block, dims, 0, f0, rows, s.decoded_f32);
        DecodeInt4Rows(kernels, block, dims, 1, f0, rows, s.decoded_f32 + rows * D);
        gate_fd = s.decoded_f32;
        up_fd = s.decoded_f32 + rows * D;
      } else {
        gate_fd = block + f0 * D;
        up_fd = block + F * D + f0 * D;
      }
      const RowScales gate_scales = ScalesOf(block, dims, 0, f0);
      const RowScales up_scales = ScalesOf(block, dims, 1, f0);
      const ExpertStorage& e = storage[i];
      const int64_t n = groups.offsets[i + 1] - groups.offsets[i];
      for (int64_t g0 = 0; g0 < e.groups; g0 += kGroupsPerTile) {
        const int64_t tile_groups = std::min(kGroupsPerTile, e.groups - g0);
        const ActivationT* x =
            packed_x + e.x_offset + g0 * PackedGroupElements<ActivationT>(D);
        const bool half = n - (g0 + tile_groups - 1) * kPackedGroup <= kPackedGroup / 2;
        // Transposed: gate_ft[f][t], t over the tile's 16 * tile_groups routes.
        packed_part(block, 0, f0, rows, gate_fd, x, tile_groups, e.groups, half, s.gate);
        packed_part(block, 1, f0, rows, up_fd, x, tile_groups, e.groups, half, s.up);
        gate_scales.ApplyTransposed(rows, kTokenTile, s.gate, kTokenTile);
        up_scales.ApplyTransposed(rows, kTokenTile, s.up, kTokenTile);
        Activate(act, kernels, biases, F, f0, rows, kTokenTile, kTokenTile, 1,
                 rows * kTokenTile, s.gate, s.up);
        ActivationT* hidden = packed_hidden + e.hidden_offset;
        if constexpr (std::is_same_v<ActivationT, Bf16Bits>) {
          kernels.round_to_bf16(s.gate, s.rounded, rows * kTokenTile);
          StorePackedRows(s.rounded, kTokenTile, rows, f0, F, g0, tile_groups,
                          n - g0 * kPackedGroup, hidden);
        } else if constexpr (std::is_same_v<ActivationT, float>) {
          StorePackedRows(s.gate, kTokenTile, rows, f0, F, g0, tile_groups,
                          n - g0 * kPackedGroup, hidden);
        }  // (int8 activations have no packed GEMM: never packed)
      }
      return;
    }
    for (int64_t r0 = groups.offsets[i]; r0 < groups.offsets[i + 1]; r0 += token_tile) {
      const int64_t tokens = std::min(token_tile, groups.offsets[i + 1] - r0);
      const float* const* x_scales_of = kBlockScales ? route_x_scales + r0 : nullptr;
      part_dot(block, 0, f0, rows, route_x + r0, x_scales_of, tokens, s.gate);
      part_dot(block, 1, f0, rows, route_x + r0, x_scales_of, tokens, s.up);
      if constexpr (kQuantise && !kBlockScales) {  // the tokens' activation scales
        for (int64_t j = 0; j < tokens; ++j) {
          const float x_scale = x_scales[groups.route_token[r0 + j]];
          for (int64_t r = 0; r < rows; ++r) {
            s.gate[j * rows + r] *= x_scale;
            s.up[j * rows + r] *= x_scale;
          }
        }
      }
      Activate(act, kernels, biases, F, f0, rows, tokens, 1, rows, rows * tokens, s.gate, s.up);
      for (int64_t j = 0; j < tokens; ++j) {
        float* h = s.gate + j * rows;
        ActivationT* out = hidden_rf + (r0 + j) * F + f0;
        if constexpr (std::is_same_v<ActivationT, float>) {
          std::memcpy(out, h, rows * sizeof(float));
        } else if constexpr (kQuantise) {  // quantised per route after this phase
          std::memcpy(hidden_f32 + (r0 + j) * F + f0, h, rows * sizeof(float));
        } else {
          kernels.round_to_bf16(h, out, rows);
        }
      }
    }
  });

  if constexpr (kQuantise) {  // each route's h, whole, to int8
    workers.ParallelFor(routes, [&](int64_t r, int /*worker*/) {
      if constexpr (kBlockScales) {
        QuantizeBlocks(hidden_f32 + r * F, F, hidden_rf + r * F,
                       hidden_scales + r * hidden_scales_per_route);
      } else {
        hidden_scales[r] = QuantizeRow(hidden_f32 + r * F, F, hidden_rf + r * F);
      }
    });
  }

  // Phase 2: y[token, d] = sum over routes of weight * (down . h), task = chunk of D.
  workers.ParallelFor(CeilDiv(D, model_chunk), [&](int64_t task, int worker) {
    const int64_t d0 = task * model_chunk;
    const int64_t rows = std::min(model_chunk, D - d0);
    for (int64_t t = 0; t < dims.tokens; ++t) std::fill_n(y_td + t * D + d0, rows, 0.0f);
    float* z = scratch[worker].down;
    float down_bias[std::max(kModelChunk, kDecodeModelChunk)];
    for (int64_t i = 0; i < num_experts; ++i) {
      const WeightT* block = bank_ep + groups.experts[i] * dims.block_size;
      if (act.biases) {  // the down bias [D] follows the gate and up biases
        const auto bias_d = BiasesOf(block, dims) + 2 * F + d0;
        for (int64_t d = 0; d < rows; ++d) down_bias[d] = WidenWeight(bias_d[d]);
      }
      if (storage[i].packed) {
        const PackedWeightT* down_df = nullptr;  // rows d0 .. d0 + rows
        if constexpr (kMxfp4) {
          if (!direct_mxfp4) {
            DecodeMxfp4Rows(kernels, block, dims, 2, d0, rows, scratch[worker].decoded_row,
                            scratch[worker].decoded);
            down_df = scratch[worker].decoded;
          }
        } else if constexpr (kInt4Bf16) {
          DecodeInt4RowsBf16(kernels, block, dims, 2, d0, rows, scratch[worker].decoded_row,
                             scratch[worker].decoded);
          down_df = scratch[worker].decoded;
        } else if constexpr (kInt4) {
          DecodeInt4Rows(kernels, block, dims, 2, d0, rows, scratch[worker].decoded_f32);
          down_df = scratch[worker].decoded_f32;
        } else {
          down_df = block + 2 * F * D + d0 * F;
        }
        const RowScales down_scales = ScalesOf(block, dims, 2, d0);
        const ExpertStorage& e = storage[i];
        for (int64_t g0 = 0; g0 < e.groups; g0 += kGroupsPerTile) {
          const int64_t tile_groups = std::min(kGroupsPerTile, e.groups - g0);
          const ActivationT* h =
              packed_hidden + e.hidden_offset + g0 * PackedGroupElements<ActivationT>(F);
          const int64_t r0 = groups.offsets[i] + g0 * kPackedGroup;
          const int64_t tokens = std::min(tile_groups * kPackedGroup, groups.offsets[i + 1] - r0);
          const bool half = tokens - (tile_groups - 1) * kPackedGroup <= kPackedGroup / 2;
          // Transposed: z_dt[d][t].
          packed_part(block, 2, d0, rows, down_df, h, tile_groups, e.groups, half, z);
          down_scales.ApplyTransposed(rows, tokens, z, kTokenTile);
          for (int64_t j = 0; j < tokens; ++j) {
            const float weight = groups.route_weight[r0 + j];
            float* y = y_td + groups.route_token[r0 + j] * D + d0;
            if (act.biases) {
              for (int64_t d = 0; d < rows; ++d) {
                y[d] += weight * (z[d * kTokenTile + j] + down_bias[d]);
              }
            } else {
              for (int64_t d = 0; d < rows; ++d) y[d] += weight * z[d * kTokenTile + j];
            }
          }
        }
        continue;
      }
      for (int64_t r0 = groups.offsets[i]; r0 < groups.offsets[i + 1]; r0 += token_tile) {
        const int64_t tokens = std::min(token_tile, groups.offsets[i + 1] - r0);
        part_dot(block, 2, d0, rows, route_hidden + r0,
                 kBlockScales ? route_hidden_scales + r0 : nullptr, tokens, z);
        for (int64_t j = 0; j < tokens; ++j) {
          float weight = groups.route_weight[r0 + j];
          if constexpr (kQuantise && !kBlockScales) weight *= hidden_scales[r0 + j];
          float* y = y_td + groups.route_token[r0 + j] * D + d0;
          const float* z_j = z + j * rows;
          if (act.biases) {
            for (int64_t d = 0; d < rows; ++d) y[d] += weight * (z_j[d] + down_bias[d]);
          } else {
            for (int64_t d = 0; d < rows; ++d) y[d] += weight * z_j[d];
          }
        }
      }
    }
  });
}

// The kernel. The caller guarantees every id is in [-1, E) and P holds the block's parts
// (3 * F * D, plus 2 * F + D with biases, or the int8 layout), and that bank_ep points at the
// E blocks of one layer.
template <typename WeightT>
void ExpertFfn(const ExpertFfnDims& dims, const float* x_td, const int32_t* ids_tk,
               const float* weights_tk, const WeightT* bank_ep, bool bf16_activations,
               bool int8_activations, const ExpertActivation& act, const KernelTable& kernels,
               const Workers& workers, float* y_td) {
  const ExpertGroups groups = dims.tokens <= kDecodeMaxTokens
                                  ? GroupDecode(dims, ids_tk, weights_tk)
                                  : GroupByCounting(dims, ids_tk, weights_tk);
  if (groups.experts.empty()) {  // every route skipped
    std::fill_n(y_td, dims.tokens * dims.model_dim, 0.0f);
    return;
  }
  if constexpr (std::is_same_v<WeightT, Bf16Bits>) {
    if (bf16_activations && kernels.dot_bf16_bf16 != nullptr) {
      RunExperts<WeightT, Bf16Bits>(dims, groups, x_td, bank_ep, kernels, kernels.dot_bf16_bf16,
                                    workers, act, y_td);
    } else {
      RunExperts<WeightT, float>(dims, groups, x_td, bank_ep, kernels, kernels.dot_bf16_f32,
                                 workers, act, y_td);
    }
  } else if constexpr (std::is_same_v<WeightT, int8_t>) {
    if (int8_activations) {  // the op checked that the table has it
      RunExperts<WeightT, int8_t>(dims, groups, x_td, bank_ep, kernels, kernels.dot_i8_i8,
                                  workers, act, y_td);
    } else {
      RunExperts<WeightT, float>(dims, groups, x_td, bank_ep, kernels, kernels.dot_i8_f32,
                                 workers, act, y_td);
    }
  } else if constexpr (std::is_same_v<WeightT, Int4Word>) {
    if (bf16_activations && dims.tokens > kDecodeMaxTokens && kernels.packed_dot_bf16 != nullptr) {
      // The grouped form with bf16 activations: rows decoded and rounded to bf16 per task
      // (DecodeInt4RowsBf16), x and h rounded to bf16, the bf16-pair GEMM (vdpbf16ps, AMX tiles
      // where enabled), as an mxfp4 bank's prefill. The decode form stays exact.
      RunExperts<WeightT, Bf16Bits>(dims, groups, x_td, bank_ep, kernels, nullptr, workers, act,
                                    y_td);
    } else {  // exact, float32
      RunExperts<WeightT, float>(dims, groups, x_td, bank_ep, kernels, kernels.dot_int4_f32,
                                 workers, act, y_td);
    }
  } else if constexpr (std::is_same_v<WeightT, uint8_t>) {  // mxfp4
    // int8_activations: the decode form only, where the exact form is bound by its operations
    // (cpu_kernels.h); the grouped form (prefill) stays exact, on the packed GEMM.
    if (int8_activations && dims.tokens <= kDecodeMaxTokens) {
      RunExperts<WeightT, int8_t>(dims, groups, x_td, bank_ep, kernels, kernels.dot_mxfp4_q8,
                                  workers, act, y_td);
    } else if (bf16_activations && dims.tokens > kDecodeMaxTokens &&
               kernels.packed_dot_bf16 != nullptr) {
      // The grouped form with bf16 activations: rows decoded to bf16 (exact) per task, x and h
      // rounded to bf16, the bf16-pair GEMM (vdpbf16ps, AMX tiles where enabled), as a bf16
      // bank's prefill under bf16_activations. The decode form stays exact.
      RunExperts<WeightT, Bf16Bits>(dims, groups, x_td, bank_ep, kernels, nullptr, workers, act,
                                    y_td);
    } else {
      RunExperts<WeightT, float>(dims, groups, x_td, bank_ep, kernels, kernels.dot_mxfp4_f32,
                                 workers, act, y_td);
    }
  } else {
    RunExperts<WeightT, float>(dims, groups, x_td, bank_ep, kernels, kernels.dot_f32_f32,
                               workers, act, y_td);
  }
}

// ---------------------------------------------------------------------------------------------
// FFI implementation: unpack, validate, dispatch on the bank dtype.

// The FFI target name, which prefixes every error message.
constexpr std::string_view kOp = "ftjax_expert_ffn";

ffi::Error ExpertFfnImpl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> x,
                         ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> weights,
                         ffi::AnyBuffer bank, ffi::Buffer<ffi::S32> layer, int64_t ffn_dim,
                         bool bf16_activations, bool int8_activations,
                         std::string_view activation, float alpha, float limit, bool biases,
                         ffi::ResultBuffer<ffi::F32> y) {
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) {
    return InvalidArgument(kOp, "x must be 2-D [T, D], got shape " + ShapeString(x_dims));
  }
  const int64_t T = x_dims[0], D = x_dims[1];

  const auto ids_dims = ids.dimensions();
  if (ids_dims.size() != 2 || ids_dims[0] != T) {
    return InvalidArgument(kOp, "ids must be [T, K] with T = " + std::to_string(T) +
                                " from x, got shape " + ShapeString(ids_dims));
  }
  const int64_t K = ids_dims[1];

  const auto weights_dims = weights.dimensions();
  if (weights_dims.size() != 2 || weights_dims[0] != T || weights_dims[1] != K) {
    return InvalidArgument(kOp, "weights must be [T, K] = " + ShapeString(ids_dims) +
                                " like ids, got shape " + ShapeString(weights_dims));
  }

  const auto bank_dims = bank.dimensions();
  if (bank_dims.size() != 3) {
    return InvalidArgument(kOp, "bank must be 3-D [L, E, P], got shape " + ShapeString(bank_dims));
  }
  const ffi::DataType bank_dtype = bank.element_type();
  if (bank_dtype != ffi::DataType::BF16 && bank_dtype != ffi::DataType::F32 &&
      bank_dtype != ffi::DataType::S8 && bank_dtype != ffi::DataType::U8 &&
      bank_dtype != ffi::DataType::U16) {
    return InvalidArgument(kOp,
                           "bank must be bfloat16, float32, int8, uint8 (mxfp4) or uint16 (int4)");
  }
  const int64_t L = bank_dims[0], E = bank_dims[1], P = bank_dims[2];

  if (ffn_dim <= 0) {
    return InvalidArgument(kOp, "ffn_dim must be positive, got " + std::to_string(ffn_dim));
  }
  const bool mxfp4 = bank_dtype == ffi::DataType::U8;
  const bool int4 = bank_dtype == ffi::DataType::U16;
  // P >= 3 * F * D, written so that a huge ffn_dim cannot overflow (mxfp4, int4: checked below).
  if (!mxfp4 && !int4 && D > 0 && ffn_dim > P / (3 * D)) {
    return InvalidArgument(kOp, "bank's last dimension P = " + std::to_string(P) +
                                " is smaller than 3 * ffn_dim * D = 3 * " +
                                std::to_string(ffn_dim) + " * " + std::to_string(D));
  }
  ExpertActivation act;
  if (activation == "swiglu") {
    act.kind = Activation::kSwiglu;
  } else if (activation == "clamped_swiglu") {
    act.kind = Activation::kClampedSwiglu;
  } else {
    return InvalidArgument(kOp, "activation must be \"swiglu\" or \"clamped_swiglu\", got \"" +
                                std::string(activation) + "\"");
  }
  act.alpha = alpha;
  act.limit = limit;
  act.biases = biases;
  if (int4) {
    if (ffn_dim % kMxfp4Block != 0 || D % kMxfp4Block != 0) {
      return InvalidArgument(kOp, "int4 needs F and D to be multiples of 32, got F = " +
                                  std::to_string(ffn_dim) + ", D = " + std::to_string(D));
    }
    if (biases) {
      return InvalidArgument(kOp, "int4 expert blocks carry no biases: keep gpt-oss's experts "
                                  "in mxfp4 (as shipped) or bf16");
    }
    if (D > 0 && (ffn_dim > 2 * P / D || 2 * P < Int4BlockBytes(ffn_dim, D))) {
      return InvalidArgument(kOp, "int4 bank's last dimension P = " + std::to_string(P) +
                                  " (uint16 words) is smaller than the " +
                                  std::to_string(Int4BlockBytes(ffn_dim, D)) +
                                  " bytes of an int4 block of F = " + std::to_string(ffn_dim) +
                                  ", D = " + std::to_string(D) + " (codes, row parameters)");
    }
    if ((2 * P) % kInt8ScalesAlignment != 0) {
      return InvalidArgument(kOp, "int4 bank's last dimension P = " + std::to_string(P) +
                                  " words must be a multiple of 64 bytes");
    }
  } else if (mxfp4) {
    if (ffn_dim % kMxfp4Block != 0 || D % kMxfp4Block != 0) {
      return InvalidArgument(kOp, "mxfp4 needs F and D to be multiples of 32, got F = " +
                                  std::to_string(ffn_dim) + ", D = " + std::to_string(D));
    }
    if (D > 0 && (ffn_dim > P / D || P < Mxfp4BlockBytes(ffn_dim, D, biases))) {
      return InvalidArgument(kOp, "mxfp4 bank's last dimension P = " + std::to_string(P) +
                                  " is smaller than the bytes of an mxfp4 block of F = " +
                                  std::to_string(ffn_dim) + ", D = " + std::to_string(D) +
                                  (biases ? " (codes, scales, biases)" : " (codes, scales)"));
    }
    if (P % kInt8ScalesAlignment != 0) {
      return InvalidArgument(kOp, "mxfp4 bank's last dimension P = " + std::to_string(P) +
                                  " must be a multiple of 64 bytes");
    }
  } else if (biases && 3 * ffn_dim * D + 2 * ffn_dim + D > P) {
    return InvalidArgument(kOp, "with biases the expert block needs 3 * F * D + 2 * F + D = " +
                                std::to_string(3 * ffn_dim * D + 2 * ffn_dim + D) +
                                " elements, but the bank's P = " + std::to_string(P));
  }
  if (biases && bank_dtype == ffi::DataType::S8) {
    return InvalidArgument(kOp, "int8 expert blocks carry no biases (their layout ends with the "
                                "float32 row scales): keep a model with expert biases in bf16");
  }
  if (bank_dtype == ffi::DataType::S8) {
    if (P < Int8BlockBytes(ffn_dim, D)) {
      return InvalidArgument(
          kOp, "int8 bank's last dimension P = " + std::to_string(P) +
                   " is smaller than the " + std::to_string(Int8BlockBytes(ffn_dim, D)) +
                   " bytes of an int8 block (weights, then float32 scales from byte " +
                   std::to_string(Int8ScalesOffset(ffn_dim, D)) + ")");
    }
    if (P % kInt8ScalesAlignment != 0) {
      return InvalidArgument(kOp, "int8 bank's last dimension P = " + std::to_string(P) +
                                  " must be a multiple of 64 bytes (the scales are aligned)");
    }
  }

  if (layer.dimensions().size() != 0) {
    return InvalidArgument(kOp, "layer must be an int32 scalar, got shape " +
                                ShapeString(layer.dimensions()));
  }
  // Host platform: operands live in host memory, so the scalar can be read directly.
  const int64_t layer_index = *layer.typed_data();
  if (layer_index < 0 || layer_index >= L) {
    return InvalidArgument(kOp, "layer = " + std::to_string(layer_index) +
                                " is outside [0, L) with L = " + std::to_string(L));
  }

  const auto y_dims = y->dimensions();
  if (y_dims.size() != 2 || y_dims[0] != T || y_dims[1] != D) {
    return InvalidArgument(kOp, "result y must have x's shape " + ShapeString(x_dims) + ", got " +
                                ShapeString(y_dims));
  }

  const int32_t* ids_tk = ids.typed_data();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t k = 0; k < K; ++k) {
      const int32_t expert = ids_tk[t * K + k];
      if (expert < -1 || expert >= E) {
        return InvalidArgument(kOp, "ids[" + std::to_string(t) + ", " + std::to_string(k) +
                                    "] = " + std::to_string(expert) +
                                    " is outside [-1, E) with E = " + std::to_string(E));
      }
    }
  }

  const HostSetup setup = ChooseHostSetup(&xla_pool);
  if (!setup.error.empty()) return InvalidArgument(kOp, setup.error);
  if (int8_activations && bank_dtype != ffi::DataType::S8 && !mxfp4) {
    return InvalidArgument(kOp, "int8_activations applies to int8 and mxfp4 banks only");
  }
  if (int8_activations && !mxfp4 && setup.kernels->dot_i8_i8 == nullptr) {
    return InvalidArgument(kOp, std::string("int8_activations needs AVX-512-VNNI (the avx512bf16 "
                                            "kernels); this call runs the ") +
                                    setup.kernels->name +
                                    " kernels: drop int8_activations for the exact int8 path");
  }

  const ExpertFfnDims dims{T, D, K, ffn_dim, E, P};
  const int64_t layer_offset = layer_index * E * P;
  if (bank_dtype == ffi::DataType::BF16) {
    ExpertFfn(dims, x.typed_data(), ids_tk, weights.typed_data(),
              bank.reinterpret_data<Bf16Bits>() + layer_offset, bf16_activations, false, act,
              *setup.kernels, setup.workers, y->typed_data());
  } else if (mxfp4) {
    ExpertFfn(dims, x.typed_data(), ids_tk, weights.typed_data(),
              bank.reinterpret_data<uint8_t>() + layer_offset, bf16_activations, int8_activations,
              act,
              *setup.kernels, setup.workers, y->typed_data());
  } else if (int4) {
    ExpertFfn(dims, x.typed_data(), ids_tk, weights.typed_data(),
              bank.reinterpret_data<Int4Word>() + layer_offset, bf16_activations, false, act,
              *setup.kernels, setup.workers, y->typed_data());
  } else if (bank_dtype == ffi::DataType::S8) {
    ExpertFfn(dims, x.typed_data(), ids_tk, weights.typed_data(),
              bank.reinterpret_data<int8_t>() + layer_offset, false, int8_activations, act,
              *setup.kernels, setup.workers, y->typed_data());
  } else {
    ExpertFfn(dims, x.typed_data(), ids_tk, weights.typed_data(),
              bank.typed_data<float>() + layer_offset, bf16_activations, false, act, *setup.kernels,
              setup.workers, y->typed_data());
  }
  return ffi::Error::Success();
}

}  // namespace

std::string HostExpertFfn(const HostExpertProblem& p) {
  const HostSetup setup = ChooseHostSetup(nullptr);  // ftjax's own worker pool
  if (!setup.error.empty()) return setup.error;
  for (int64_t r = 0; r < p.tokens * p.top_k; ++r) {
    if (p.ids[r] < -1 || p.ids[r] >= p.experts) {
      return "route " + std::to_string(r) + " names expert " + std::to_string(p.ids[r]) +
             ", outside [-1, E) with E = " + std::to_string(p.experts);
    }
  }
  const ExpertFfnDims dims{p.tokens, p.model_dim, p.top_k, p.ffn_dim, p.experts, p.block_size};
  if (p.bank_bf16) {
    ExpertFfn(dims, p.x, p.ids, p.weights, static_cast<const Bf16Bits*>(p.bank_ep),
              p.bf16_activations, false, p.activation, *setup.kernels, setup.workers, p.y);
  } else {
    ExpertFfn(dims, p.x, p.ids, p.weights, static_cast<const float*>(p.bank_ep),
              p.bf16_activations, false, p.activation, *setup.kernels, setup.workers, p.y);
  }
  return "";
}

}  // namespace ftjax

// ---------------------------------------------------------------------------------------------
// Binding: registered by Python as the CPU target "ftjax_expert_ffn".

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxExpertFfn, ftjax::ExpertFfnImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()        // XLA's intra-op pool
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [T, K], -1 = skip
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights [T, K]
                                  .Arg<ffi::AnyBuffer>()         // bank [L, E, P], bf16, f32, s8, u8
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer [], index into L
                                  .Attr<int64_t>("ffn_dim")      // F
                                  .Attr<bool>("bf16_activations")  // bf16, mxfp4, int4 prefill
                                  .Attr<bool>("int8_activations")  // int8 and mxfp4 banks
                                  .Attr<std::string_view>("activation")  // "swiglu", "clamped_swiglu"
                                  .Attr<float>("alpha")          // clamped_swiglu: sigmoid gain
                                  .Attr<float>("limit")          // clamped_swiglu: clamp bound
                                  .Attr<bool>("biases")          // gate, up, down biases in blocks
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, D]
);
