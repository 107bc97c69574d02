// AVX-512 (F, BW, VL, DQ) kernels: float32 FMA for float32 and bf16 weights (bf16 widened in
// registers). Compiled with the AVX-512 flags by its suffix (CMakeLists.txt); on a compiler that
// does not target them the table is absent. See cpu_kernels.h.

#include "cpu_kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__) && defined(__FMA__)

#include "cpu_kernels_avx512_common.h"
#include "cpu_kernels_mxfp4_avx2.h"

namespace ftjax {
namespace {

void RoundToBf16Avx512(const float* in, Bf16Bits* out, int64_t n) {
  cpu_kernels_impl::RoundToBf16Loop(in, out, n);
}

const KernelTable kAvx512Table = {
    /*name=*/"avx512",
    /*dot_bf16_bf16=*/nullptr,
    /*packed_dot_bf16=*/nullptr,
    /*packed_dot_bf16_f32=*/PackedDotBf16F32Avx512,
    /*packed_dot_f32=*/PackedDotF32Avx512,
    /*packed_min_tokens=*/kPackedGroup,
    /*dot_bf16_f32=*/DotBf16F32Avx512,
    /*dot_f32_f32=*/DotF32F32Avx512,
    /*round_to_bf16=*/RoundToBf16Avx512,
    /*silu_mul=*/SiluMulAvx512,
    /*weighted_row_sum=*/WeightedRowSumAvx512,
    /*weighted_row_sum_bf16=*/WeightedRowSumBf16Avx512,
    /*score_f32_f32=*/ScoreF32Avx512,
    /*score_bf16_f32=*/ScoreBf16Avx512,
    /*exp_sub_sum=*/ExpSubSumAvx512,
    /*xor_words=*/XorWordsAvx512,
    /*peak_loop=*/PeakLoopFma512,
    /*peak_flops_per_iteration=*/kPeakChains512 * 16 * 2,
    /*dot_i8_f32=*/DotI8F32Avx512,
    /*packed_dot_i8_f32=*/PackedDotI8F32Avx512,
    /*dot_i8_i8=*/nullptr,
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

const KernelTable* Avx512Kernels() { return &kAvx512Table; }

}  // namespace ftjax

#else

namespace ftjax {
const KernelTable* Avx512Kernels() { return nullptr; }
}  // namespace ftjax

#endif
