// The host expert kernel of expert_ffn.cc for callers outside XLA:CPU: the CUDA module's host
// worker (xla_ffi/cuda/host_experts.cc) runs the routed experts a GPU step left on the host.

#ifndef FTJAX_XLA_FFI_EXPERT_FFN_H_
#define FTJAX_XLA_FFI_EXPERT_FFN_H_

#include <cstdint>
#include <string>

namespace ftjax {

// The expert's function between its projections (attributes `activation`, `alpha`, `limit`,
// `biases` of ftjax_expert_ffn), with g = gate . x (+ gate bias), u = up . x (+ up bias):
//   kSwiglu         h = silu(g) * u
//   kClampedSwiglu  g' = min(g, limit), u' = clamp(u, -limit, limit),
//                   h = (u' + 1) * g' * sigmoid(alpha * g')   (gpt-oss)
// With biases, each expert block holds after down [D, F] the gate bias [F], the up bias [F]
// and the down bias [D], in the bank's dtype; the down bias is added to down . h before the
// route's weight scales it.
enum class Activation { kSwiglu, kClampedSwiglu };
struct ExpertActivation {
  Activation kind = Activation::kSwiglu;
  float alpha = 1.702f;
  float limit = 7.0f;
  bool biases = false;
};

struct HostExpertProblem {
  int64_t tokens;      // T
  int64_t model_dim;   // D
  int64_t top_k;       // K
  int64_t ffn_dim;     // F
  int64_t experts;     // E
  int64_t block_size;  // P, elements from one expert block to the next
  const float* x;      // [T, D]
  const int32_t* ids;  // [T, K], -1 = skip
  const float* weights;  // [T, K]
  const void* bank_ep;   // the E blocks of one layer, bf16 bits or float32
  bool bank_bf16;
  bool bf16_activations;
  float* y;  // [T, D], overwritten
  ExpertActivation activation{};
};

// y = the weighted routed experts, on ftjax's own worker pool (FTJAX_NUM_THREADS) with the
// best ISA allowed (FTJAX_ISA). Returns "" or an error message (bad ids, unknown ISA).
std::string HostExpertFfn(const HostExpertProblem& problem);

}  // namespace ftjax

#endif  // FTJAX_XLA_FFI_EXPERT_FFN_H_
