// ftjax_attention: attention of a few queries against a KV cache, read in place on the host.
//
//   out[b, t, h] = sum_s p[b, t, h, s] * v[b, s, g]        g = h / R, R = H / G
//   p[b, t, h, :] = softmax over the allowed s of (scale * q[b, t, h] . k[b, s, g]) [, sink[h]]
//
// Axis letters follow the ftjax glossary: B batch, T queries, H query heads, G kv heads, S cache
// rows, A head width; R = H / G query heads share one kv head. Query t sits at cache row
// length - T + t (the cache already holds this step's keys) and attends the rows s <= its own
// row, and with a sliding window w > 0 only those with s > row - w. Rows from `length` on are
// never read. With use_sinks, a learned per-head logit sink[h] joins the softmax's denominator
// (it takes probability mass) but contributes no value; without, the sinks buffer is ignored and
// may be empty ([0]) or [H].
//
// Why: in the decode loop (a lax.while_loop) XLA:CPU's einsum attention over the loop-carried
// cache copies and transposes all of K and V at every step. This op reads the cache in its own
// layout, so the updated cache (a dynamic_update_slice of a donated buffer) is used in place.
//
// Work split: one task per (b, tile of query positions, slice of rows). A tile holds all H heads
// of up to kTileQueries / H positions, so each K and V row is read from memory once for all of
// them (decode: T * H queries against S rows, memory-bound). A task walks its rows front to back
// in blocks of kBlockRows, all kv heads of a block in turn: for kv head g it scores the block
// against g's R queries per position with the ISA's dot kernel (KernelTable::dot_f32_f32),
// updates an online softmax per query (running max, sum of exponentials, accumulator; float32),
// and adds the weighted value rows with KernelTable::weighted_row_sum. When there are fewer
// (b, tile) units than kTargetTasks (decode), the rows are split into slices, and the partial
// (max, sum, acc) of the slices are merged exactly afterwards. The split depends on the shapes,
// length and window only, never on the number of threads, so neither do the results. Long query
// chunks (prefill) work but are not what this op is for: each tile reads all of its rows again.
//
// Three layers (STYLE.md section 6): Attention (kernel, no XLA types), AttentionImpl
// (validation), FtjaxAttention (binding).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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

// ---------------------------------------------------------------------------------------------
// Kernel (no XLA types).

constexpr int64_t kBlockRows = 64;      // cache rows scored by one dot call
constexpr int64_t kTileQueries = 256;   // queries (t, h) per task, at least H
constexpr int64_t kTargetTasks = 32;    // split the rows until there are about this many tasks
constexpr int64_t kMinSliceRows = 256;  // but not into slices shorter than this

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

struct AttentionProblem {
  int64_t batch;     // B
  int64_t queries;   // T
  int64_t heads;     // H
  int64_t kv_heads;  // G
  int64_t width;     // A
  int64_t rows;      // S, the cache's rows
  int64_t length;    // valid cache rows, T <= length <= S
  int64_t window;    // 0: no sliding window
  float scale;
  const float* q;      // [B, T, H, A]
  const float* k;      // [B, S, G, A]
  const float* v;      // [B, S, G, A]
  const float* sinks;  // [H], or null for no sinks
  float* out;          // [B, T, H, A]
};

// The cache rows query t may attend: [first, last).
struct RowRange {
  int64_t first, last;
};

RowRange AllowedRows(const AttentionProblem& p, int64_t t) {
  const int64_t row = p.length - p.queries + t;
  const int64_t first = p.window > 0 ? std::max<int64_t>(0, row - p.window + 1) : 0;
  return {first, row + 1};
}

// Online-softmax state of n queries over some rows: max of the scaled scores, sum of
// exp(score - max), and acc [n, A] = sum of exp(score - max) * v.
struct SoftmaxState {
  float* max;
  float* sum;
  float* acc;
};

SoftmaxState StateAt(float* storage, int64_t n) {
  return {storage, storage + n, storage + 2 * n};
}

int64_t StateFloats(int64_t n, int64_t width) { return n * (width + 2); }

// Scales x[0, n) by `scale` in place and returns the largest (8 partial maxima, so the loop
// vectorises).
float ScaleAndMax(float* x, int64_t n, float scale) {
  float lanes[8];
  std::fill_n(lanes, 8, kNegativeInfinity);
  int64_t s = 0;
  for (; s + 8 <= n; s += 8) {
    for (int i = 0; i < 8; ++i) {
      x[s + i] *= scale;
      lanes[i] = std::max(lanes[i], x[s + i]);
    }
  }
  for (; s < n; ++s) {
    x[s] *= scale;
    lanes[0] = std::max(lanes[0], x[s]);
  }
  return *std::max_element(lanes, lanes + 8);
}

// x[s] = exp(x[s] - shift) for s < n, where every x[s] <= shift; returns their sum. Cephes'
// single-precision exp (relative error below 2e-7) in plain float arithmetic, so that the loop
// vectorises, unlike calls of std::exp. Arguments below -87 count as -87: e^-87 ~ 1.6e-38 (the
// smallest normal float) instead of a smaller number or 0, next to the largest weight, 1.
float ExpShiftedSum(float* x, int64_t n, float shift) {
  constexpr float kLowest = -87.0f;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: (y + kRound) - kRound rounds y
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2High = 0.693359375f;  // ln 2 = kLn2High + kLn2Low
  constexpr float kLn2Low = -2.12194440e-4f;
  // (Two loops: GCC 12 vectorises neither with the clamp inside the second.)
  for (int64_t s = 0; s < n; ++s) x[s] = std::max(x[s] - shift, kLowest);
  for (int64_t s = 0; s < n; ++s) {
    const float y = x[s];
    const float k = (y * kLog2e + kRound) - kRound;  // exp(y) = 2^k exp(r), |r| <= ln2 / 2
    const float r = (y - k * kLn2High) - k * kLn2Low;
    float poly = 1.9875691500e-4f;
    poly = poly * r + 1.3981999507e-3f;
    poly = poly * r + 8.3334519073e-3f;
    poly = poly * r + 4.1665795894e-2f;
    poly = poly * r + 1.6666665459e-1f;
    poly = poly * r + 5.0000001201e-1f;
    const float exp_r = poly * r * r + r + 1.0f;
    const int32_t exponent_bits = (static_cast<int32_t>(k) + 127) * (1 << 23);  // 2^k, k >= -126
    float two_to_k;
    std::memcpy(&two_to_k, &exponent_bits, sizeof(two_to_k));
    x[s] = exp_r * two_to_k;
  }
  float lanes[8] = {};
  int64_t s = 0;
  for (; s + 8 <= n; s += 8) {
    for (int i = 0; i < 8; ++i) lanes[i] += x[s + i];
  }
  for (; s < n; ++s) lanes[0] += x[s];
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
         ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// The queries of one task: batch b, positions [t0, t1), all H heads. They are numbered by kv
// head first, j = (g * positions + t - t0) * R + r for head h = g * R + r, so that the queries
// of kv head g are the `per_head` = positions * R queries from j = g * per_head on.
struct QueryTile {
  int64_t b, t0, t1;
};

struct TileQuery {
  int64_t t, h;
};

TileQuery QueryOf(const AttentionProblem& p, const QueryTile& tile, int64_t j) {
  const int64_t group = p.heads / p.kv_heads;  // R
  const int64_t per_head = (tile.t1 - tile.t0) * group;
  const int64_t g = j / per_head, within = j % per_head;
  return {tile.t0 + within / group, g * group + within % group};
}

// Runs the online softmax of the tile's queries over cache rows [s0, s1) into `state`.
// `q_rows` [n] and `scores` [per_head, kBlockRows] are scratch. Block by block, all kv heads:
// the task reads its rows of k and v front to back, which the hardware prefetchers follow.
void AttendRows(const AttentionProblem& p, const QueryTile& tile, int64_t s0, int64_t s1,
                const KernelTable& kernels, const float** q_rows, float* scores,
                SoftmaxState state) {
  const int64_t width = p.width;
  const int64_t per_head = (tile.t1 - tile.t0) * (p.heads / p.kv_heads);
  const int64_t n = per_head * p.kv_heads;
  for (int64_t j = 0; j < n; ++j) {
    const TileQuery query = QueryOf(p, tile, j);
    q_rows[j] = p.q + ((tile.b * p.queries + query.t) * p.heads + query.h) * width;
    state.max[j] = kNegativeInfinity;
    state.sum[j] = 0.0f;
  }
  std::fill_n(state.acc, n * width, 0.0f);

  const int64_t row_stride = p.kv_heads * width;  // from one cache row to the next
  for (int64_t block = s0; block < s1; block += kBlockRows) {
    const int64_t block_rows = std::min(kBlockRows, s1 - block);
    for (int64_t g = 0; g < p.kv_heads; ++g) {
      const int64_t offset = ((tile.b * p.rows + block) * p.kv_heads + g) * width;
      const int64_t j0 = g * per_head;
      // scores[jj, s] = q_{j0 + jj} . k[block + s, g]
      kernels.dot_f32_f32({p.k + offset, row_stride, block_rows, q_rows + j0, per_head, width,
                           scores, kBlockRows});
      for (int64_t jj = 0; jj < per_head; ++jj) {
        // Scores to weights exp(scale * score - max), 0 outside the query's rows.
        const int64_t j = j0 + jj;
        float* weight = scores + jj * kBlockRows;
        const RowRange allowed = AllowedRows(p, QueryOf(p, tile, j).t);
        const int64_t first = std::clamp(allowed.first - block, int64_t{0}, block_rows);
        const int64_t last = std::clamp(allowed.last - block, int64_t{0}, block_rows);
        std::fill(weight, weight + first, 0.0f);
        std::fill(weight + std::max(first, last), weight + block_rows, 0.0f);
        if (first >= last) continue;
        const float block_max = ScaleAndMax(weight + first, last - first, p.scale);
        const float new_max = std::max(state.max[j], block_max);
        if (new_max > state.max[j]) {
          const float correction = std::exp(state.max[j] - new_max);  // 0 for the first rows
          state.sum[j] *= correction;
          float* acc = state.acc + j * width;
          for (int64_t i = 0; i < width; ++i) acc[i] *= correction;
          state.max[j] = new_max;
        }
        state.sum[j] += ExpShiftedSum(weight + first, last - first, new_max);
      }
      // acc[j0 + jj] += sum_s weight[jj, s] * v[block + s, g]
      kernels.weighted_row_sum({scores, kBlockRows, per_head, p.v + offset, row_stride,
                                block_rows, width, state.acc + j0 * width, width});
    }
  }
}

// Merges the partial states of `slices` row slices of one tile (exactly: each rescaled to the
// common max) with the sinks, and writes the tile's outputs.
void WriteTile(const AttentionProblem& p, const QueryTile& tile, const SoftmaxState* partials,
               int64_t slices) {
  const int64_t n = (tile.t1 - tile.t0) * p.heads;
  const int64_t width = p.width;
  for (int64_t j = 0; j < n; ++j) {
    const TileQuery query = QueryOf(p, tile, j);
    float* out = p.out + ((tile.b * p.queries + query.t) * p.heads + query.h) * width;
    const float sink = p.sinks != nullptr ? p.sinks[query.h] : kNegativeInfinity;
    float max = sink;
    for (int64_t c = 0; c < slices; ++c) max = std::max(max, partials[c].max[j]);
    float sum = p.sinks != nullptr ? std::exp(sink - max) : 0.0f;
    std::fill_n(out, width, 0.0f);
    for (int64_t c = 0; c < slices; ++c) {
      if (partials[c].max[j] == kNegativeInfinity) continue;  // no allowed row in this slice
      const float factor = std::exp(partials[c].max[j] - max);
      sum += partials[c].sum[j] * factor;
      const float* acc = partials[c].acc + j * width;
      for (int64_t i = 0; i < width; ++i) out[i] += factor * acc[i];
    }
    // Every query attends at least its own row, so sum > 0 (sum >= 1 after the rescaling).
    const float inverse = 1.0f / sum;
    for (int64_t i = 0; i < width; ++i) out[i] *= inverse;
  }
}

void Attention(const AttentionProblem& p, const KernelTable& kernels, const Workers& workers) {
  const int64_t group = p.heads / p.kv_heads;
  const int64_t tile_positions =
      std::min(std::max<int64_t>(1, kTileQueries / p.heads), p.queries);
  const int64_t tiles_per_batch = CeilDiv(p.queries, tile_positions);
  const int64_t units = p.batch * tiles_per_batch;
  const int64_t tile_queries = tile_positions * p.heads;
  const int64_t state_floats = StateFloats(tile_queries, p.width);
  const int64_t scores_floats = tile_positions * group * kBlockRows;

  auto tile_of = [&](int64_t unit) {
    const int64_t t0 = unit % tiles_per_batch * tile_positions;
    return QueryTile{unit / tiles_per_batch, t0, std::min(t0 + tile_positions, p.queries)};
  };
  // The rows a tile needs: from its first query's first allowed row to its last query's row.
  auto rows_of = [&](const QueryTile& tile) {
    return RowRange{AllowedRows(p, tile.t0).first, AllowedRows(p, tile.t1 - 1).last};
  };

  // Slices per unit, from the shapes alone (never from the thread count).
  const RowRange all_rows = rows_of({0, 0, p.queries});
  const int64_t slices =
      units >= kTargetTasks
          ? 1
          : std::max<int64_t>(1, std::min(CeilDiv(kTargetTasks, units),
                                          (all_rows.last - all_rows.first) / kMinSliceRows));

  // Per-worker scratch: query pointers, scores and (with one slice) the softmax state.
  const int64_t scratch_floats = scores_floats + (slices == 1 ? state_floats : 0);
  std::vector<float> scratch(workers.num_workers() * scratch_floats);
  std::vector<const float*> q_rows(workers.num_workers() * tile_queries);
  // With several slices: the partial state of every task, merged afterwards.
  std::vector<float> partials(slices > 1 ? units * slices * state_floats : 0);

  workers.ParallelFor(units * slices, [&](int64_t task, int worker) {
    const int64_t unit = task / slices, slice = task % slices;
    const QueryTile tile = tile_of(unit);
    const RowRange rows = rows_of(tile);
    const int64_t slice_rows =
        CeilDiv(CeilDiv(rows.last - rows.first, slices), kBlockRows) * kBlockRows;
    const int64_t s0 = std::min(rows.last, rows.first + slice * slice_rows);
    const int64_t s1 = std::min(rows.last, s0 + slice_rows);
    float* scores = scratch.data() + worker * scratch_floats;
    const int64_t n = (tile.t1 - tile.t0) * p.heads;
    const SoftmaxState state =
        slices == 1 ? StateAt(scores + scores_floats, n)
                    : StateAt(partials.data() + task * state_floats, n);
    AttendRows(p, tile, s0, s1, kernels, q_rows.data() + worker * tile_queries, scores, state);
    if (slices == 1) WriteTile(p, tile, &state, 1);
  });
  if (slices == 1) return;

  workers.ParallelFor(units, [&](int64_t unit, int /*worker*/) {
    const QueryTile tile = tile_of(unit);
    const int64_t n = (tile.t1 - tile.t0) * p.heads;
    std::vector<SoftmaxState> states(slices);
    for (int64_t c = 0; c < slices; ++c) {
      states[c] = StateAt(partials.data() + (unit * slices + c) * state_floats, n);
    }
    WriteTile(p, tile, states.data(), slices);
  });
}

// ---------------------------------------------------------------------------------------------
// FFI implementation.

// The FFI target name, which prefixes every error message.
constexpr std::string_view kOp = "ftjax_attention";

ffi::Error AttentionImpl(ffi::ThreadPool xla_pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                         ffi::AnyBuffer v, ffi::AnyBuffer length, ffi::AnyBuffer sinks,
                         float scale, int64_t window, bool use_sinks,
                         ffi::ResultBuffer<ffi::F32> out) {
  const auto q_dims = q.dimensions();
  if (q.element_type() != ffi::DataType::F32 || q_dims.size() != 4) {
    return InvalidArgument(kOp, "q must be float32 [B, T, H, A], got shape " +
                                    ShapeString(q_dims));
  }
  const int64_t B = q_dims[0], T = q_dims[1], H = q_dims[2], A = q_dims[3];
  const auto k_dims = k.dimensions();
  if (k.element_type() != ffi::DataType::F32 || k_dims.size() != 4 || k_dims[0] != B ||
      k_dims[3] != A) {
    return InvalidArgument(kOp, "k must be float32 [B, S, G, A] with B = " + std::to_string(B) +
                                    " and A = " + std::to_string(A) + " from q, got shape " +
                                    ShapeString(k_dims));
  }
  const int64_t S = k_dims[1], G = k_dims[2];
  if (G == 0 || H % G != 0) {
    return InvalidArgument(kOp, "k's kv heads G = " + std::to_string(G) +
                                    " must divide q's heads H = " + std::to_string(H));
  }
  const auto v_dims = v.dimensions();
  if (v.element_type() != ffi::DataType::F32 || v_dims.size() != 4 ||
      !std::equal(v_dims.begin(), v_dims.end(), k_dims.begin())) {
    return InvalidArgument(kOp, "v must be float32 with k's shape " + ShapeString(k_dims) +
                                    ", got shape " + ShapeString(v_dims));
  }
  if (length.element_type() != ffi::DataType::S32 || length.dimensions().size() != 0) {
    return InvalidArgument(kOp, "length must be an int32 scalar, got shape " +
                                    ShapeString(length.dimensions()));
  }
  const auto sinks_dims = sinks.dimensions();
  const bool sinks_are_h = sinks_dims.size() == 1 && sinks_dims[0] == H;
  const bool sinks_are_empty = sinks_dims.size() == 1 && sinks_dims[0] == 0;
  if (sinks.element_type() != ffi::DataType::F32 ||
      !(sinks_are_h || (!use_sinks && sinks_are_empty))) {
    return InvalidArgument(kOp, std::string("sinks must be float32 [H] with H = ") +
                                    std::to_string(H) +
                                    (use_sinks ? "" : " (or [0], since use_sinks is false)") +
                                    ", got shape " + ShapeString(sinks_dims));
  }
  if (window < 0) {
    return InvalidArgument(kOp, "window must be >= 0 (0: none), got " + std::to_string(window));
  }
  const auto out_dims = out->dimensions();
  if (!std::equal(out_dims.begin(), out_dims.end(), q_dims.begin(), q_dims.end())) {
    return InvalidArgument(kOp, "result out must have q's shape " + ShapeString(q_dims) +
                                    ", got " + ShapeString(out_dims));
  }
  if (B == 0 || T == 0 || H == 0 || A == 0) return ffi::Error::Success();  // nothing to compute
  const int64_t valid_rows = *length.typed_data<int32_t>();
  if (valid_rows < T || valid_rows > S) {
    return InvalidArgument(kOp, "length must be in [T, S] = [" + std::to_string(T) + ", " +
                                    std::to_string(S) + "], got " + std::to_string(valid_rows));
  }

  const HostSetup setup = ChooseHostSetup(&xla_pool);
  if (!setup.error.empty()) return InvalidArgument(kOp, setup.error);

  const AttentionProblem problem{B, T, H, G, A, S, valid_rows, window, scale,
                                 q.typed_data<float>(), k.typed_data<float>(),
                                 v.typed_data<float>(),
                                 use_sinks ? sinks.typed_data<float>() : nullptr,
                                 out->typed_data()};
  Attention(problem, *setup.kernels, setup.workers);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace ftjax

// Binding: registered by Python as the CPU target "ftjax_attention".
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxAttention, ftjax::AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()   // XLA's intra-op pool
                                  .Arg<ffi::AnyBuffer>()    // q [B, T, H, A] f32, unscaled
                                  .Arg<ffi::AnyBuffer>()    // k [B, S, G, A] f32, the cache
                                  .Arg<ffi::AnyBuffer>()    // v [B, S, G, A] f32, the cache
                                  .Arg<ffi::AnyBuffer>()    // length: int32 scalar, valid rows
                                  .Arg<ffi::AnyBuffer>()    // sinks [H] f32 (or [0] unused)
                                  .Attr<float>("scale")     // multiplies q . k
                                  .Attr<int64_t>("window")  // sliding window, 0: none
                                  .Attr<bool>("use_sinks")  // softmax over [scores, sink[h]]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [B, T, H, A]
);
