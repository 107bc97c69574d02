// ftjax_delta_rule_step: one decode token of the gated delta rule (the Gated DeltaNet layers'
// recurrence, model/deltanet.py gated_delta_recurrent) for a batch of B sequences and M heads,
// KernelTable::delta_rule_step head by head, the heads spread over the threads.
//
//   S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  out = S^T q
//
// XLA:CPU runs the same step as four passes over the state (decay, S^T k, update, S^T q), each
// a fusion of its own: at 8 sequences of the 35B-shaped model's 32 heads of 128 x 128 it took
// 2.7 ms a layer. Here the state is read once and written once (a head's 64 KiB stays in L2
// between the two passes). The state is updated in place: the result aliases the state
// argument (input_output_aliases in ftjax/kernels/delta_rule.py).
//
// Three layers (STYLE.md section 6): DeltaRuleHeads (kernel, no XLA types), DeltaRuleImpl
// (validation), FtjaxDeltaRuleStep (binding).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "cpu_kernels.h"
#include "ffi_util.h"
#include "thread_pool.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ftjax {
namespace {

// The FFI target name, which prefixes every error message.
constexpr std::string_view kOp = "ftjax_delta_rule_step";

struct DeltaRuleBatch {
  int64_t heads;  // B * M
  int64_t key_dim, value_dim;
  const float* q;     // [heads, key_dim]
  const float* k;     // [heads, key_dim]
  const float* v;     // [heads, value_dim]
  const float* g;     // [heads]
  const float* beta;  // [heads]
  float* state;       // [heads, key_dim, value_dim], in place
  float* out;         // [heads, value_dim]
};

void DeltaRuleHeads(const DeltaRuleBatch& p, const KernelTable& kernels, const Workers& workers) {
  std::vector<float> scratch(static_cast<size_t>(workers.num_workers()) * 2 * p.value_dim);
  workers.ParallelFor(p.heads, [&](int64_t h, int worker) {
    const DeltaRuleHead head{p.state + h * p.key_dim * p.value_dim,
                             p.q + h * p.key_dim,
                             p.k + h * p.key_dim,
                             p.v + h * p.value_dim,
                             std::exp(p.g[h]),
                             p.beta[h],
                             p.key_dim,
                             p.value_dim,
                             p.out + h * p.value_dim,
                             scratch.data() + static_cast<int64_t>(worker) * 2 * p.value_dim};
    kernels.delta_rule_step(head);
  });
}

bool SameDims(ffi::Span<const int64_t> dims, std::initializer_list<int64_t> want) {
  return dims.size() == want.size() && std::equal(dims.begin(), dims.end(), want.begin());
}

ffi::Error DeltaRuleImpl(ffi::ThreadPool xla_pool, ffi::Buffer<ffi::F32> q,
                         ffi::Buffer<ffi::F32> k, ffi::Buffer<ffi::F32> v,
                         ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> beta,
                         ffi::Buffer<ffi::F32> state, ffi::ResultBuffer<ffi::F32> out,
                         ffi::ResultBuffer<ffi::F32> new_state) {
  const auto s_dims = state.dimensions();
  if (s_dims.size() != 4) {
    return InvalidArgument(kOp, "state must be float32 [B, M, U, Y], got shape " +
                                    ShapeString(s_dims));
  }
  const int64_t B = s_dims[0], M = s_dims[1], U = s_dims[2], Y = s_dims[3];
  const std::string bmu = "[" + std::to_string(B) + ", " + std::to_string(M) + ", " +
                          std::to_string(U) + "]";
  const std::string bmy = "[" + std::to_string(B) + ", " + std::to_string(M) + ", " +
                          std::to_string(Y) + "]";
  const std::string bm = "[" + std::to_string(B) + ", " + std::to_string(M) + "]";
  if (!SameDims(q.dimensions(), {B, M, U})) {
    return InvalidArgument(kOp, "q must be float32 " + bmu + " (B, M, U from state), got shape " +
                                    ShapeString(q.dimensions()));
  }
  if (!SameDims(k.dimensions(), {B, M, U})) {
    return InvalidArgument(kOp, "k must be float32 " + bmu + " (B, M, U from state), got shape " +
                                    ShapeString(k.dimensions()));
  }
  if (!SameDims(v.dimensions(), {B, M, Y})) {
    return InvalidArgument(kOp, "v must be float32 " + bmy + " (B, M, Y from state), got shape " +
                                    ShapeString(v.dimensions()));
  }
  if (!SameDims(g.dimensions(), {B, M}) || !SameDims(beta.dimensions(), {B, M})) {
    return InvalidArgument(kOp, "g and beta must be float32 " + bm + " (B, M from state), got " +
                                    ShapeString(g.dimensions()) + " and " +
                                    ShapeString(beta.dimensions()));
  }
  if (!SameDims(out->dimensions(), {B, M, Y}) ||
      !std::equal(new_state->dimensions().begin(), new_state->dimensions().end(), s_dims.begin(),
                  s_dims.end())) {
    return InvalidArgument(kOp, "results must be out " + bmy + " and the state's shape " +
                                    ShapeString(s_dims) + ", got " +
                                    ShapeString(out->dimensions()) + " and " +
                                    ShapeString(new_state->dimensions()));
  }
  if (B * M * U * Y == 0) return ffi::Error::Success();
  const HostSetup setup = ChooseHostSetup(&xla_pool);
  if (!setup.error.empty()) return InvalidArgument(kOp, setup.error);
  float* s = new_state->typed_data();
  if (s != state.typed_data()) {  // XLA did not alias them: start from a copy
    std::memcpy(s, state.typed_data(), static_cast<size_t>(B * M * U * Y) * sizeof(float));
  }
  const DeltaRuleBatch batch{B * M,          U,           Y, q.typed_data(), k.typed_data(),
                             v.typed_data(), g.typed_data(), beta.typed_data(), s,
                             out->typed_data()};
  DeltaRuleHeads(batch, *setup.kernels, setup.workers);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace ftjax

// Binding: registered by Python as the CPU target "ftjax_delta_rule_step".
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxDeltaRuleStep, ftjax::DeltaRuleImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()         // XLA's intra-op pool
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [B, M, U]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // k [B, M, U]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // v [B, M, Y]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // g [B, M], log decay
                                  .Arg<ffi::Buffer<ffi::F32>>()   // beta [B, M]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // state [B, M, U, Y]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // out [B, M, Y]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // state, aliased
);
