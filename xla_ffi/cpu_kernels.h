// The SIMD building blocks of ftjax's host ops, one table per instruction set.
//
// Every op (expert_ffn.cc, dense.cc, attention.cc, read_probe.cc) is written once, in portable
// C++, on top of the few primitives below. Each instruction set has its own translation unit,
// compiled with its own flags chosen by the file-name suffix in CMakeLists.txt (and the Bazel
// BUILD):
//
//   cpu_kernels_scalar.cc       baseline flags (any x86-64 or aarch64)
//   cpu_kernels_avx2.cc         -mavx2 -mfma -mf16c
//   cpu_kernels_avx512.cc       -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c
//   cpu_kernels_avx512bf16.cc   the AVX-512 flags plus -mavx512bf16 -mavx512vnni, and
//                               -mamx-tile -mamx-bf16 where the compiler has them (its packed
//                               bf16 GEMM on AMX tiles, run only where cpu_isa.cc's
//                               AmxEnabled() says the CPU and the OS allow it)
//
// Only the functions in this header cross from a baseline translation unit into an ISA one, and
// only through a KernelTable returned after the CPU was checked (cpu_isa.cc), so no instruction
// the CPU lacks can run. The ISA translation units use no standard-library templates: an inline
// function instantiated there could be merged by the linker with a baseline copy and run AVX-512
// code on a CPU without it.

#ifndef FTJAX_XLA_FFI_CPU_KERNELS_H_
#define FTJAX_XLA_FFI_CPU_KERNELS_H_

#include <cstdint>

namespace ftjax {

// bfloat16 is stored as its 16 raw bits.
using Bf16Bits = uint16_t;

// A batch of dot products between the rows of a weight matrix and a few activation vectors:
//
//   c[t * c_stride + r] = sum_{i < n} w[r * w_stride + i] * a[t][i]   for r < rows, t < tokens
//
// accumulated in float32. Weights are [out, in] row-major, as everywhere in ftjax, so both
// operands are contiguous along i: this is the "NT" GEMM C = A @ W^T, and with tokens = 1 a
// GEMV. For one token the kernels read the weight rows one after the other (one sequential
// stream: memory-bound, at read bandwidth); with more tokens they block 4 rows x 4 tokens in
// registers and walk the rows in the outer loop, so a block of 4 weight rows stays in L1 while
// all tokens stream past it (compute-bound). Nothing needs to be aligned; tails of n, rows and
// tokens are handled (masked loads on AVX-512).
template <typename WeightT, typename ActivationT>
struct DotProblem {
  const WeightT* w;
  int64_t w_stride;  // elements from one weight row to the next
  int64_t rows;
  const ActivationT* const* a;  // a[t] points at n activations of token t
  int64_t tokens;
  int64_t n;
  float* c;
  int64_t c_stride;  // elements from one token's outputs to the next
};

using DotBf16Bf16Fn = void (*)(const DotProblem<Bf16Bits, Bf16Bits>&);

// Activations packed for the packed-activation GEMMs (KernelTable::packed_dot_*), tokens in groups
// of 16, so that one 64-byte vector holds one input (float) or one pair of inputs (bf16, for
// vdpbf16ps) of 16 tokens:
//   float: packed[(g * n + i) * 16 + j]                 = x_{16 g + j}[i]
//   bf16:  packed[(g * pairs + p) * 32 + 2 * j + h]     = x_{16 g + j}[2 p + h], pairs = ceil(n/2)
// zero for tokens past the last one, and for input n when n is odd (bf16).
constexpr int64_t kPackedGroup = 16;
template <typename PackedT>
static constexpr int64_t PackedGroupElements(int64_t n) {
  return sizeof(PackedT) == 2 ? (n + 1) / 2 * 2 * kPackedGroup : n * kPackedGroup;
}

// A packed-activation GEMM, with transposed output:
//   ct[r * c_stride + t] = sum_{i < n} w[r * w_stride + i] * x_t[i]   r < rows, t < 16 * groups
// Each multiply-add takes one broadcast weight (or pair of weights) and one input (or pair) of 16
// tokens, so no horizontal sums are needed and the weight rows are read straight from the bank.
template <typename WeightT, typename PackedT>
struct PackedDotProblem {
  const WeightT* w;
  int64_t w_stride;
  int64_t rows;
  const PackedT* packed;  // `groups` groups of PackedGroupElements<PackedT>(n) elements
  int64_t groups;
  // The last group holds at most 8 real tokens: only its first 8 columns are computed (with
  // 256-bit vectors) and stored, so a short tail costs half a group.
  bool half_last_group;
  int64_t n;
  float* ct;
  int64_t c_stride;  // >= 16 * groups
  // Groups of tokens the caller runs against these rows over all its calls (its tiles of
  // `groups`; 0: just `groups`): the AMX GEMM's blocks follow it (kAmxOneRowTileMaxGroups), as
  // the rows stay in L2 for the tiles after the first.
  int64_t call_groups = 0;
};

// The packed-activation GEMM of mxfp4 weights (rows as in Mxfp4DotProblem; n a multiple of 32)
// against float32 activations packed as for PackedDotProblem<., float>: the same ct.
struct PackedMxfp4Problem {
  const uint8_t* codes;
  int64_t code_stride;
  const uint8_t* scales;
  int64_t scale_stride;
  int64_t rows;
  const float* packed;
  int64_t groups;
  bool half_last_group;
  int64_t n;
  float* ct;
  int64_t c_stride;
};

// A weighted sum of rows, added to accumulators (attention: probabilities times values):
//
//   acc[j * acc_stride + i] += sum_{s < rows} weight[j * weight_stride + s] * v[s * v_stride + i]
//
// for j < n, i < width, in float32; v is float32 or bfloat16 (widened exactly). Each row of v is
// read once for all n weight vectors (up to 8 at a time on the SIMD ISAs, whose accumulators stay
// in registers for a strip of columns over all rows).
template <typename ValueT>
struct RowSumProblem {
  const float* weight;
  int64_t weight_stride;  // elements from one weight vector to the next
  int64_t n;
  const ValueT* v;
  int64_t v_stride;  // elements from one row of v to the next
  int64_t rows;
  int64_t width;
  float* acc;
  int64_t acc_stride;  // elements from one accumulator vector to the next
};

// One token of the gated delta rule for one head (model/deltanet.py, gated_delta_recurrent):
// with S the head's state [key_dim, value_dim] (row-major, updated in place),
//   S <- decay * S;  delta = beta * (v - S^T k);  S <- S + k delta^T;  out = S^T q.
// In two passes over S: the first reads it for S^T k and S^T q together (the second product
// is taken before the update and corrected by delta * (k . q)), the second writes it back
// (the head's state, 64 KiB for 128 x 128, is still in L2). scratch: 2 * value_dim floats.
struct DeltaRuleHead {
  float* state;
  const float* q;
  const float* k;
  const float* v;
  float decay;  // exp(g)
  float beta;
  int64_t key_dim;
  int64_t value_dim;
  float* out;
  float* scratch;
};

// Where the largest value of a float32 range is (KernelTable::argmax_f32), in jnp.argmax's order:
// a NaN counts as the largest (the first NaN wins), ties keep the first index.
struct ArgmaxResult {
  int64_t index;  // 0 for an empty range or one of -inf only
  float value;    // x[index] (-inf for an empty range)
  bool nan;       // x[index] is a NaN
};

// mxfp4 weights (an FTW mxfp4 bank, docs/ftw.md) against float32 activations: the DotProblem of
// the dequantised weights. Row r of the [rows, n] weight matrix is n / 2 bytes of 4-bit E2M1
// codes at codes + r * code_stride (input 2j in the low nibble of byte j, 2j + 1 in the high
// one) and n / 32 E8M0 scale bytes at scales + r * scale_stride (input i has the scale
// i / 32; byte e stands for 2^(e - 127)); n is a multiple of 32. Weight = E2M1[code] * scale,
// exact in float32; accumulation in float32.
struct Mxfp4DotProblem {
  const uint8_t* codes;
  int64_t code_stride;  // bytes from one row's codes to the next
  const uint8_t* scales;
  int64_t scale_stride;  // bytes from one row's scales to the next
  int64_t rows;
  const float* const* a;  // a[t] points at n activations of token t
  int64_t tokens;
  int64_t n;
  float* c;  // c[t * c_stride + r]
  int64_t c_stride;
};

// mxfp4 weights (as in Mxfp4DotProblem) against int8 activations quantised per block of 32
// inputs, each block with its own float32 scale (llama.cpp's Q8_0, with a float32 scale): the
// opt-in int8_activations form of an mxfp4 bank. Activation i of token t is
// a[t][i] * a_scales[t][i / 32]. Per block the integer sum of 2 * E2M1[code] * a (exact in int32)
// is multiplied by 2^(e - 127) / 2 * a_scales (one float32 product: exact but for the
// activation scale's rounding) and added to the row's float32 sum.
struct Mxfp4Q8DotProblem {
  const uint8_t* codes;
  int64_t code_stride;
  const uint8_t* scales;
  int64_t scale_stride;
  int64_t rows;
  const int8_t* const* a;         // a[t] points at n int8 activations of token t, in [-127, 127]
  const float* const* a_scales;   // a_scales[t] points at n / 32 block scales of token t
  int64_t tokens;
  int64_t n;
  float* c;  // c[t * c_stride + r]
  int64_t c_stride;
};

// int4 weights (FTW's int4 dense and expert format, docs/ftw.md) against float32 activations: the
// DotProblem of the dequantised weights. Row r of the [rows, n] weight matrix: n / 2 bytes of
// unsigned 4-bit codes q at codes + r * code_stride (input 2j in the low nibble of byte j, as
// mxfp4); per block of 32 inputs a uint8 scale s at scales + r * scale_stride and an int8 min m
// at mins + r * min_stride; and the row's two float32 steps (d, dm) at steps + r * step_stride
// (bytes; no alignment needed). Input i of block b = i / 32 weighs
//   w = float32(d * s[b] * q + dm * m[b])
// (ftjax.utils.quant: both products exact in float32 for FTW's int4 rows). The fused kernels
// compute d * (sum_b s[b] * sum_i (q_i - 8) a_i) + sum_b (dm * m[b] + 8 * d * s[b]) * sum_i a_i:
// the same sums in another order, as float32 rounds them, with the codes centred so that the
// two parts do not cancel (an all-zero block stores s = m = 0).
struct Int4DotProblem {
  const uint8_t* codes;
  int64_t code_stride;
  const uint8_t* scales;
  int64_t scale_stride;
  const int8_t* mins;
  int64_t min_stride;
  const uint8_t* steps;  // two float32 per row: d, dm
  int64_t step_stride;
  int64_t rows;
  const float* const* a;  // a[t] points at n activations of token t
  int64_t tokens;
  int64_t n;
  float* c;  // c[t * c_stride + r]
  int64_t c_stride;
};

using DotBf16F32Fn = void (*)(const DotProblem<Bf16Bits, float>&);
using DotMxfp4F32Fn = void (*)(const Mxfp4DotProblem&);
using DotMxfp4Q8Fn = void (*)(const Mxfp4Q8DotProblem&);
using DotF32F32Fn = void (*)(const DotProblem<float, float>&);
using DotI8F32Fn = void (*)(const DotProblem<int8_t, float>&);
using DotI8I8Fn = void (*)(const DotProblem<int8_t, int8_t>&);

struct KernelTable {
  const char* name;  // "scalar", "avx2", "avx512", "avx512bf16" (the FTJAX_ISA spellings)

  // bf16 weights x bf16 activations (vdpbf16ps); null unless the ISA has AVX-512-BF16. When it is
  // set, ops round float32 activations to bf16 once and use it for bf16 weights.
  DotBf16Bf16Fn dot_bf16_bf16;
  // Packed-activation GEMMs, faster than the dot kernels above packed_min_tokens tokens per
  // weight row; null where the ISA lacks them. bf16 x bf16 pairs (vdpbf16ps) needs AVX-512-BF16,
  // and runs on AMX tiles (tdpbf16ps) where cpu_isa.h's AmxEnabled() and n % 32 == 0;
  // bf16 weights widened to float32 and float32 weights, both against float32 activations (FMA),
  // AVX2 and AVX-512.
  void (*packed_dot_bf16)(const PackedDotProblem<Bf16Bits, Bf16Bits>&);
  void (*packed_dot_bf16_f32)(const PackedDotProblem<Bf16Bits, float>&);
  void (*packed_dot_f32)(const PackedDotProblem<float, float>&);
  // Ops use the packed GEMMs for a weight multiplied with more than this many tokens (the dot
  // kernels below), measured per ISA on one core of the Zen 4 VM, [1024, 2048] weights, packing
  // included. AVX-512: the packed GEMM wins from 12-16 tokens with float32 weights and from ~24
  // with bf16 weights widened (16 kept). AVX2: bf16 weights 1.2-1.3x faster packed at 8-12
  // tokens, 1.8x at 16; float32 weights lose ~8% at 12 tokens and win from 16 on (8 chosen, bf16
  // being what ftjax serves).
  int64_t packed_min_tokens;
  // bf16 weights widened to float32, float32 activations, float32 FMA.
  DotBf16F32Fn dot_bf16_f32;
  // float32 weights and activations, float32 FMA.
  DotF32F32Fn dot_f32_f32;

  // out[i] = bf16(in[i]), rounding to nearest even (NaN stays NaN).
  void (*round_to_bf16)(const float* in, Bf16Bits* out, int64_t n);
  // h[i] = silu(gate[i]) * up[i] with silu(g) = g / (1 + exp(-g)).
  void (*silu_mul)(const float* gate, const float* up, float* h, int64_t n);
  // Weighted sums of float32 or bfloat16 rows into accumulators (RowSumProblem).
  void (*weighted_row_sum)(const RowSumProblem<float>& p);
  void (*weighted_row_sum_bf16)(const RowSumProblem<Bf16Bits>& p);
  // Attention scores: the DotProblem of a few tokens (query vectors) against many rows (cache
  // rows). The SIMD ISAs load (and widen) each row once for up to 8 tokens, where dot_* above
  // reload it for every 4; same results up to float32 rounding.
  DotF32F32Fn score_f32_f32;
  DotBf16F32Fn score_bf16_f32;
  // out[i] = exp(in[i] - max) for i < n (out may be in), 0 where in[i] - max < -87 (below
  // float32's normal range; -inf included); returns the sum of the out[i]. A polynomial exp with
  // relative error below 1e-6 for in[i] - max in [-87, 88].
  float (*exp_sub_sum)(const float* in, float max, float* out, int64_t n);
  // XOR of the n_words little-endian 32-bit words at `data` (no alignment needed).
  uint32_t (*xor_words)(const void* data, int64_t n_words);
  // Runs `iterations` rounds of a register-only multiply-add loop at the ISA's widest
  // multiply-add (vdpbf16ps for AVX-512-BF16, float32 FMA otherwise) and returns a value that
  // depends on every round. `flops_per_iteration` is how many flops one round does.
  float (*peak_loop)(int64_t iterations, float seed);
  int64_t peak_flops_per_iteration;

  // int8 weights (an int8 expert bank, docs/ftw.md) widened exactly to float32, float32
  // activations, float32 FMA: the same problem as dot_f32_f32 on the widened weights. The
  // per-output-channel scales are the caller's, applied once per output row after the dot
  // product. One token reads the int8 rows as one sequential stream (a quarter of float32's
  // bytes). Never null.
  DotI8F32Fn dot_i8_f32;
  // The packed-activation GEMM with int8 weights widened to float32 (float32 FMA); null where
  // the ISA lacks packed GEMMs.
  void (*packed_dot_i8_f32)(const PackedDotProblem<int8_t, float>&);
  // int8 weights x int8 activations (vpdpbusd), the opt-in int8_activations form of an int8
  // bank: c = the exact integer dot product (int32 sums, as float). Weights must lie in
  // [-127, 127] (an FTW int8 bank's do). Null unless the ISA has AVX-512-VNNI
  // (the avx512bf16 table).
  DotI8I8Fn dot_i8_i8;
  // mxfp4 weights against float32 activations (Mxfp4DotProblem). One token (AVX-512, AVX2), and
  // up to 8 tokens on AVX-512 (passes of up to 4): fused, the activations permuted once and each
  // row's codes looked up in registers (AVX-512: vpermps on the nibbles, each lookup serving
  // every token of the pass; AVX2: vpshufb to the bytes of the values' bfloat16 bits), block
  // sums scaled, the 4.25-bit weights read once a pass as one stream. More tokens (AVX2: more
  // than one): the codes are decoded with a 16-entry table (the E2M1 values times the block's
  // scale: an exact float32 product) 4 rows and up to 1024 inputs at a time into a buffer that
  // stays in L1, then multiplied by dot_f32_f32's code (AVX-512: vpermps on the nibbles; AVX2:
  // two vpermps and a blend; scalar: a table lookup). Never null.
  DotMxfp4F32Fn dot_mxfp4_f32;
  // out[i] = E2M1[code i] * scale[i / 32] for i < n (n a multiple of 32; codes and scales as a
  // Mxfp4DotProblem's row): the dequantised weights, exact in float32; dot_mxfp4_f32's decode.
  // The grouped expert FFN decodes rows with it for the packed GEMMs. Never null.
  void (*decode_mxfp4)(const uint8_t* codes, const uint8_t* scales, int64_t n, float* out);
  // mxfp4 weights against int8 activations (Mxfp4Q8DotProblem), the opt-in int8_activations
  // form of an mxfp4 bank's decode. AVX2 and AVX-512 (cpu_kernels_mxfp4_avx2.h): per 64 weights
  // one vpshufb per 32 codes to the bytes 2 * E2M1 + 12, vpmaddubsw with the activations and
  // vpmaddwd to int32 block sums (the +12 taken off with the blocks' activation sums), one
  // conversion and one FMA with the block scales: 11 vector operations where the float32 form
  // needs 29, so one token reads at the memory's rate on AVX2. Scalar: the same sums in a loop.
  // Several tokens: the one-token loop per token. Never null.
  DotMxfp4Q8Fn dot_mxfp4_q8;
  // mxfp4 weights in the packed GEMM (PackedMxfp4Problem), the codes decoded straight into the
  // kernel's float32 weight panel (AVX2); null elsewhere, where the expert FFN decodes a task's
  // rows to bf16 for packed_dot_bf16_f32 (the same products and sums).
  void (*packed_dot_mxfp4_f32)(const PackedMxfp4Problem&);
  // int4 weights against float32 activations (Int4DotProblem). One token (AVX-512, AVX2), and up
  // to 8 tokens on AVX-512 (passes of up to 4, as mxfp4's): fused, the activations permuted once
  // per chunk (as the mxfp4 kernels), each row's codes read once a pass as one stream with its
  // scales and mins, the nibbles widened to float32 integers in registers. More tokens: 4 rows
  // and up to 1024 inputs decoded (decode_int4) into a buffer in L1, then dot_f32_f32's code.
  // Never null.
  void (*dot_int4_f32)(const Int4DotProblem&);
  // out[i] = d * s[i / 32] * q_i + dm * m[i / 32] for i < n (n a multiple of 32; codes, scales,
  // mins as one Int4DotProblem row from input 0, d and dm its steps): d * s and dm * m in
  // float32, then a fused multiply-add (FTW's int4 rows keep d * s * q and dm * m exact, so this
  // is the one rounding of the format's definition). The dense GEMM decodes rows with it. Never
  // null.
  void (*decode_int4)(const uint8_t* codes, const uint8_t* scales, const int8_t* mins, float d,
                      float dm, int64_t n, float* out);
  // One token of the gated delta rule for one head (DeltaRuleHead): the loops of
  // cpu_kernels_impl.h's DeltaRuleStepLoop, vectorised at the ISA's width. Never null.
  void (*delta_rule_step)(const DeltaRuleHead&);
  // The first index of the largest of x[0, n) (ArgmaxResult): blocks that stay in L1, each read
  // once for its maximum (lanes of the ISA's width) and once more only where the maximum rose
  // (or a NaN is in it). Never null.
  ArgmaxResult (*argmax_f32)(const float* x, int64_t n);
};

// The cache hint of the one-token software prefetch (cpu_kernels_impl.h; also the AVX2 read
// probe's): true for prefetchnta, false for prefetcht1 (into L2). Chosen once per process from the
// CPU vendor (cpu_isa.cc): non-temporal on AMD, where it measured 2-7% faster than into L2, into
// L2 elsewhere (on the Xeon VM prefetchnta was far worse). FTJAX_PREFETCH=nta or l2, read on the
// first call, overrides the choice (for measurements).
bool PrefetchNonTemporal();

// The per-machine choices of the kernels, which ftjax.kernels.tuning measures on the machine and
// sets for the process (Python: ftjax._ffi.set_kernel_tuning). Each field's 0 (-1 where 0 is a
// choice) keeps the built-in default, which the comments at its use give the measurements of.
// Every choice computes the same sums in the same order per output (the accumulators' split along
// i aside, which changes the float32 rounding only): tests run each one against float64.
struct KernelTuning {
  // One token: bytes ahead of the reads that the software prefetch asks for (cpu_kernels_impl.h,
  // the mxfp4 one-token kernels); 0 for none; -1: kPrefetchBytes.
  int32_t prefetch_bytes = -1;
  // Its hint: 0 PrefetchNonTemporal()'s choice, 1 prefetchnta, 2 prefetcht1 (into L2).
  int32_t prefetch_hint = 0;
  // One token: accumulators along i per row, 4 or 8; 0: RowAccumulators<Ops>() (by bytes).
  int32_t row_accumulators = 0;
  // 2 to 64 tokens (dot kernels): weight rows per register block, 1 to 4; 0: by the ISA's
  // vector registers (4 with 32, 2 with 16).
  int32_t block_rows = 0;
  // One token (ftjax_dense's GEMV): KiB of weights per task, 64 to 65536; 0: 2048.
  int32_t gemv_task_kib = 0;
  // The packed-activation GEMMs run above this many tokens per weight; -1: the KernelTable's.
  int32_t packed_min_tokens = -1;
};

// The tuning in effect: what SetKernelTuning last set (all defaults before). Cheap (relaxed atomic
// loads); read once per kernel call.
KernelTuning CurrentKernelTuning();
// Sets the tuning for every later kernel call of the process. Returns an empty string, or what is
// wrong with `tuning` (then nothing changes).
const char* SetKernelTuning(const KernelTuning& tuning);
// Whether the one-token prefetch is non-temporal under `tuning` (its hint, or the CPU's default).
bool TunedPrefetchNonTemporal(const KernelTuning& tuning);
// Whose weights a GEMM reads: a dense layer's (ftjax_dense) or an expert's (ftjax_expert_ffn).
enum class PackedUse { kDense, kExpert };
// The packed GEMMs run above this many tokens (routes) per weight: the tuning's override, else
// KernelTable::packed_min_tokens; for bf16 x bf16 pairs (`bf16_pairs`) on AMX tiles,
// kAmxDensePackedMinTokens or kAmxPackedMinTokens.
int64_t PackedMinTokens(const KernelTable& kernels, bool bf16_pairs, PackedUse use);
// AMX tiles read the weights at the memory rate from a few tokens on, where the vdpbf16ps dot
// kernels turn compute-bound (a batch's decode step). Measured on a Xeon (2 cores, an lm_head of
// [151936, 2048] bf16, alternating): tiles / dot kernels 26.2 / 18.3 GB/s at 8 tokens, 27.5 /
// 13.9 at 12, 23.6 / 10.6 at 16; level (0.99-1.01) at 1, 2 and 4, 1.10 at 5 (32-row blocks).
// With 16-row blocks (PackedDotBf16Amx) the dense GEMM's tiles win from 2 tokens ([248320, 2048]:
// 29.4 / 28.5 GB/s at 2 tokens, 29.3 / 27.2 at 3, 28.7 / 26.4 at 4); an expert's ([512, 2048]
// gate and up, [2048, 512] down) lose 4-8% at 4 to 8 routes on tiles, so they keep 4.
constexpr int64_t kAmxPackedMinTokens = 4;
constexpr int64_t kAmxDensePackedMinTokens = 1;

// Each returns the table of its translation unit, or null when the compiler did not build that
// ISA (a non-x86 target). Callers must check the CPU first: see cpu_isa.h.
const KernelTable* ScalarKernels();
const KernelTable* Avx2Kernels();
const KernelTable* Avx512Kernels();
const KernelTable* Avx512Bf16Kernels();
// Whether cpu_kernels_avx512bf16.cc was compiled with its AMX packed GEMM (-mamx-tile
// -mamx-bf16; cpu_isa.h's AmxSupported() checks the CPU and the OS too).
bool Avx512Bf16HasAmx();

}  // namespace ftjax

#endif  // FTJAX_XLA_FFI_CPU_KERNELS_H_
