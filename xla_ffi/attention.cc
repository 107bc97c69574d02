// ftjax_attention: attention of T queries (decode, or a prefill chunk) against a KV cache, read in
// place on the host.
//
//   out[b, t, h] = sum_s p[b, t, h, s] * v[b, s, g]        g = h / R, R = H / G
//   p[b, t, h, :] = softmax over the allowed s of (scale * q[b, t, h] . k[b, s, g]) [, sink[h]]
//
// Axis letters follow the ftjax glossary: B batch, T queries, H query heads, G kv heads, S cache
// rows, A head width; R = H / G query heads share one kv head. Query t sits at cache row
// length - T + t (the cache already holds this step's keys) and attends the rows s <= its own
// row, and with a sliding window w > 0 only those with s > row - w. Rows from `length` on are
// never read; `length` is one for the batch, or one per sequence (int32 [B]: a batch whose
// sequences sit at different positions, one kernel call for all of them). With use_sinks, a learned per-head logit sink[h] joins the softmax's denominator
// (it takes probability mass) but contributes no value; without, the sinks buffer is ignored and
// may be empty ([0]) or [H].
//
// k and v are both float32 or both bfloat16 (read as is, widened exactly to float32); q, the
// softmax and the accumulators are float32.
//
// Why: in the decode loop (a lax.while_loop) XLA:CPU's einsum attention over the loop-carried
// cache copies and transposes all of K and V at every step. This op reads the cache in its own
// layout, so the updated cache (a dynamic_update_slice of a donated buffer) is used in place.
// For prefill chunks it is a blocked flash attention that skips the masked blocks, where XLA
// materialises the [T, S] scores of every head.
//
// Work split: one task per (b, tile of queries, slice of rows); a task walks its rows in aligned
// blocks of kBlockRows, for each kv head g of the tile scores the block against g's queries that
// may attend some row of it, updates an online softmax per query (running max, sum of
// exponentials, accumulator; float32), and adds the weighted value rows. Two tile forms:
// - Decode form (T * H <= kTileQueries: decode, short chunks): one tile holds all H heads of all
//   T positions, so each K and V row is read from memory once (memory-bound), in place: scores
//   by KernelTable::score_f32_f32 / score_bf16_f32 (each key row loaded and widened once for
//   the R query heads of its kv head), weights by exp_sub_sum, values by weighted_row_sum(_bf16)
//   (each value row loaded and widened once for up to 8 queries).
// - Prefill form (longer chunks): a tile holds the R query heads of one kv head at
//   kPrefillQueries / R positions. A tile needs the rows from its first query's window start to
//   its last query's row, and within those, per block, only the queries that may attend the
//   block are scored: the causal upper triangle and the rows before a window cost (almost)
//   nothing, so a causal chunk does ~half of T x length, a window ~T x w. Compute-bound: where
//   the ISA has the packed GEMM (AVX-512), the attended rows are first widened and packed once
//   for all tiles (PackedCache), and both the scores and the value sums run on packed_dot_f32;
//   elsewhere on the score and row-sum kernels as in the decode form.
// Tasks are claimed in order of decreasing cost (last positions first), which balances the
// causal tiles. When there are fewer (b, tile) units than kTargetTasks, the rows are split into
// slices whose partial (max, sum, acc) are merged exactly afterwards. The split depends on the
// shapes, length and window only, never on the number of threads, so neither do the results.
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
#include <type_traits>
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

constexpr int64_t kBlockRows = 128;      // cache rows scored by one dot call
constexpr int64_t kTileQueries = 256;    // decode form: queries (t, h) per tile, at least H
constexpr int64_t kPrefillQueries = 64;  // prefill form: queries (t, r) of one kv head per tile
constexpr int64_t kTargetTasks = 32;     // split the rows until there are about this many tasks
constexpr int64_t kMinSliceRows = 256;   // but not into slices shorter than this

constexpr float kNegativeInfinity = -std::numeric_limits<float>::infinity();

// KvT is float or Bf16Bits (bfloat16's raw bits), the element of both caches.
template <typename KvT>
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
  const KvT* k;        // [B, S, G, A]
  const KvT* v;        // [B, S, G, A]
  const float* sinks;  // [H], or null for no sinks
  float* out;          // [B, T, H, A]

  int64_t group() const { return heads / kv_heads; }    // R
  int64_t first_row() const { return length - queries; }  // the cache row of query 0
};

// The cache rows query t may attend: [first, last).
struct RowRange {
  int64_t first, last;
};

template <typename KvT>
RowRange AllowedRows(const AttentionProblem<KvT>& p, int64_t t) {
  const int64_t row = p.first_row() + t;
  const int64_t first = p.window > 0 ? std::max<int64_t>(0, row - p.window + 1) : 0;
  return {first, row + 1};
}

// The queries t in [t0, t1) that may attend some row of [s0, s1): a range, since both ends of
// AllowedRows grow with t.
template <typename KvT>
RowRange QueriesAttending(const AttentionProblem<KvT>& p, int64_t t0, int64_t t1, int64_t s0,
                          int64_t s1) {
  // row(t) >= s0, and with a window first(t) = row(t) - w + 1 < s1.
  const int64_t first = std::max(t0, s0 - p.first_row());
  const int64_t last =
      p.window > 0 ? std::min(t1, s1 + p.window - 1 - p.first_row()) : t1;
  return {first, std::max(first, last)};
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

// The queries of one tile: batch b, positions [t0, t1), kv heads [g0, g1) and their R query heads
// each. They are numbered by kv head first, j = ((g - g0) * positions + t - t0) * R + r for head
// h = g * R + r, so that the queries of kv head g are the `per_head` = positions * R queries from
// j = (g - g0) * per_head on, in order of position.
struct QueryTile {
  int64_t b, t0, t1, g0, g1;

  int64_t positions() const { return t1 - t0; }
};

struct TileQuery {
  int64_t t, h;
};

template <typename KvT>
TileQuery QueryOf(const AttentionProblem<KvT>& p, const QueryTile& tile, int64_t j) {
  const int64_t group = p.group();
  const int64_t per_head = tile.positions() * group;
  const int64_t g = tile.g0 + j / per_head, within = j % per_head;
  return {tile.t0 + within / group, g * group + within % group};
}

// scores[t * kBlockRows + s] = k[s] . q_rows[t] for s < rows, t < tokens; k rows `row_stride`
// elements apart. The score kernels load each key row once for up to 8 queries.
void ScoreRows(const KernelTable& kernels, const float* k, int64_t row_stride, int64_t rows,
               const float* const* q_rows, int64_t tokens, int64_t width, float* scores) {
  kernels.score_f32_f32({k, row_stride, rows, q_rows, tokens, width, scores, kBlockRows});
}

void ScoreRows(const KernelTable& kernels, const Bf16Bits* k, int64_t row_stride, int64_t rows,
               const float* const* q_rows, int64_t tokens, int64_t width, float* scores) {
  kernels.score_bf16_f32({k, row_stride, rows, q_rows, tokens, width, scores, kBlockRows});
}

// acc[j * width + i] += sum_{s < rows} weight[j * kBlockRows + s] * v[s * row_stride + i] for
// j < n, the value rows read in place (bfloat16 widened in registers).
void AddWeightedRows(const KernelTable& kernels, const float* weight, int64_t n, const float* v,
                     int64_t row_stride, int64_t rows, int64_t width, float* acc) {
  kernels.weighted_row_sum({weight, kBlockRows, n, v, row_stride, rows, width, acc, width});
}

void AddWeightedRows(const KernelTable& kernels, const float* weight, int64_t n,
                     const Bf16Bits* v, int64_t row_stride, int64_t rows, int64_t width,
                     float* acc) {
  kernels.weighted_row_sum_bf16({weight, kBlockRows, n, v, row_stride, rows, width, acc, width});
}

// The prefill form's copy of the cache rows it attends, widened to float32 and packed for
// KernelTable::packed_dot_f32 (cpu_kernels.h), per (b, g) and aligned block of kBlockRows rows
// (block i holds rows [i * kBlockRows, (i + 1) * kBlockRows)):
//   k: the block's rows as the tokens: k[row 16 c + j][i] at (c * A + i) * 16 + j
//   v: the block's columns as the tokens: v[row s][16 c + j] at (c * kBlockRows + s) * 16 + j
// Rows from `length` on and columns from A on are zero. Packing costs one pass over the rows;
// every tile then scores with multiply-adds of one broadcast q element and 16 keys (no horizontal
// sums) and sums the values the same way.
struct PackedCache {
  std::vector<float> k, v;
  int64_t first_block = 0, blocks = 0;  // blocks [first_block, first_block + blocks) are packed
  int64_t k_floats = 0, v_floats = 0;   // per block
  int64_t v_groups = 0;                 // ceil(A / 16)

  int64_t Index(int64_t b, int64_t g, int64_t kv_heads, int64_t block) const {
    return (b * kv_heads + g) * blocks + block - first_block;
  }
};

template <typename KvT>
float Widen(KvT x) {
  if constexpr (std::is_same_v<KvT, float>) {
    return x;
  } else {
    const uint32_t bits = static_cast<uint32_t>(x) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
  }
}

// Packs block `block` of kv head g of sequence b (PackedCache).
template <typename KvT>
void PackBlock(const AttentionProblem<KvT>& p, int64_t b, int64_t g, int64_t block,
               PackedCache& packed) {
  const int64_t width = p.width, index = packed.Index(b, g, p.kv_heads, block);
  float* k_out = packed.k.data() + index * packed.k_floats;
  float* v_out = packed.v.data() + index * packed.v_floats;
  std::fill_n(k_out, packed.k_floats, 0.0f);
  std::fill_n(v_out, packed.v_floats, 0.0f);
  const int64_t first = block * kBlockRows;
  const int64_t rows = std::min(kBlockRows, p.length - first);
  for (int64_t s = 0; s < rows; ++s) {
    const int64_t offset = ((b * p.rows + first + s) * p.kv_heads + g) * width;
    const KvT* k_row = p.k + offset;
    const KvT* v_row = p.v + offset;
    float* k_column = k_out + (s / kPackedGroup) * width * kPackedGroup + s % kPackedGroup;
    for (int64_t i = 0; i < width; ++i) k_column[i * kPackedGroup] = Widen(k_row[i]);
    for (int64_t i = 0; i < width; ++i) {
      v_out[((i / kPackedGroup) * kBlockRows + s) * kPackedGroup + i % kPackedGroup] =
          Widen(v_row[i]);
    }
  }
}

// Asks for kv head g's keys and values of cache rows [s0, s1) of sequence b, into L2: the decode
// form calls it for the next block while it works on this one, so that the rows' memory latency
// (kv heads' rows lie G * A elements apart, a stride the hardware prefetcher follows slowly) is
// hidden behind the work.
template <typename KvT>
void PrefetchRows(const AttentionProblem<KvT>& p, int64_t b, int64_t g, int64_t s0, int64_t s1) {
  constexpr int64_t kLine = 64;
  const int64_t bytes = p.width * static_cast<int64_t>(sizeof(KvT));
  for (int64_t s = s0; s < s1; ++s) {
    const int64_t offset = ((b * p.rows + s) * p.kv_heads + g) * p.width;
    const char* k = reinterpret_cast<const char*>(p.k + offset);
    const char* v = reinterpret_cast<const char*>(p.v + offset);
    for (int64_t i = 0; i < bytes; i += kLine) {
      __builtin_prefetch(k + i, 0, 2);
      __builtin_prefetch(v + i, 0, 2);
    }
  }
}

// Per-worker scratch of AttendRows.
struct AttendScratch {
  const float** q_rows;  // [queries of a tile]
  float* scores;         // [queries of one kv head in a tile, kBlockRows]
  float* q_tile;         // packed path: [queries of a tile, A], the tile's queries side by side
  float* sums;           // packed path: [queries of one kv head in a tile, 16 * ceil(A / 16)]
};

// Runs the online softmax of the tile's queries over cache rows [s0, s1) into `state`, in the
// aligned blocks of kBlockRows rows that overlap them, for each the tile's kv heads in turn: for
// kv head g, only the queries that may attend some row of the block are scored
// (QueriesAttending: blocks entirely masked for a query, above the causal diagonal or before its
// window, cost it nothing), their weights exp(score - max) are updated online, and the weighted
// value rows added to their accumulators. The products run on the ISA's dot kernels
// (KernelTable::dot_*, weighted_row_sum), or with `packed` on the packed GEMM.
template <typename KvT>
void AttendRows(const AttentionProblem<KvT>& p, const QueryTile& tile, int64_t s0, int64_t s1,
                const KernelTable& kernels, const PackedCache* packed,
                const AttendScratch& scratch, SoftmaxState state) {
  const int64_t width = p.width, group = p.group();
  const int64_t per_head = tile.positions() * group;
  const int64_t n = per_head * (tile.g1 - tile.g0);
  for (int64_t j = 0; j < n; ++j) {
    const TileQuery query = QueryOf(p, tile, j);
    scratch.q_rows[j] = p.q + ((tile.b * p.queries + query.t) * p.heads + query.h) * width;
    if (packed != nullptr) std::copy_n(scratch.q_rows[j], width, scratch.q_tile + j * width);
    state.max[j] = kNegativeInfinity;
    state.sum[j] = 0.0f;
  }
  std::fill_n(state.acc, n * width, 0.0f);
  const int64_t sums_stride = kPackedGroup * CeilDiv(width, kPackedGroup);

  const int64_t row_stride = p.kv_heads * width;  // from one cache row to the next
  for (int64_t aligned = s0 / kBlockRows * kBlockRows; aligned < s1; aligned += kBlockRows) {
    const int64_t lo = std::max(aligned, s0), hi = std::min(aligned + kBlockRows, s1);
    const RowRange attending = QueriesAttending(p, tile.t0, tile.t1, lo, hi);
    if (attending.first >= attending.last) continue;
    // The tile's queries jj in [jj0, jj1) of each kv head attend rows of [lo, hi).
    const int64_t jj0 = (attending.first - tile.t0) * group;
    const int64_t jj1 = (attending.last - tile.t0) * group;
    // Score column c is row base + c, c < columns: the whole aligned block on the packed path
    // (its value sums take all kBlockRows rows), [lo, hi) on the dot path.
    const int64_t base = packed != nullptr ? aligned : lo;
    const int64_t columns = packed != nullptr ? kBlockRows : hi - lo;
    for (int64_t g = tile.g0; g < tile.g1; ++g) {
      const int64_t offset = ((tile.b * p.rows + lo) * p.kv_heads + g) * width;
      const int64_t j0 = (g - tile.g0) * per_head;
      float* scores = scratch.scores + jj0 * kBlockRows;
      // scores[jj, c] = q_{j0 + jj} . k[base + c, g]
      const float* packed_k = nullptr;
      const float* packed_v = nullptr;
      if (packed != nullptr) {
        const int64_t index = packed->Index(tile.b, g, p.kv_heads, aligned / kBlockRows);
        packed_k = packed->k.data() + index * packed->k_floats;
        packed_v = packed->v.data() + index * packed->v_floats;
        const int64_t key_columns = hi - aligned;
        const int64_t key_groups = CeilDiv(key_columns, kPackedGroup);
        kernels.packed_dot_f32({scratch.q_tile + (j0 + jj0) * width, width, jj1 - jj0, packed_k,
                                key_groups,
                                key_columns - (key_groups - 1) * kPackedGroup <= 8, width,
                                scores, kBlockRows});
      } else {
        PrefetchRows(p, tile.b, g, hi, std::min(hi + kBlockRows, s1));
        ScoreRows(kernels, p.k + offset, row_stride, hi - lo, scratch.q_rows + j0 + jj0,
                  jj1 - jj0, width, scores);
      }
      for (int64_t jj = jj0; jj < jj1; ++jj) {
        // Scores to weights exp(scale * score - max), 0 outside the query's rows in [lo, hi).
        const int64_t j = j0 + jj;
        float* weight = scratch.scores + jj * kBlockRows;
        const RowRange allowed = AllowedRows(p, tile.t0 + jj / group);
        const int64_t first = std::clamp(std::max(allowed.first, lo) - base, int64_t{0}, columns);
        const int64_t last = std::clamp(std::min(allowed.last, hi) - base, int64_t{0}, columns);
        std::fill(weight, weight + first, 0.0f);
        std::fill(weight + std::max(first, last), weight + columns, 0.0f);
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
        state.sum[j] +=
            kernels.exp_sub_sum(weight + first, new_max, weight + first, last - first);
      }
      // acc[j0 + jj] += sum_c weight[jj, c] * v[base + c, g]
      float* acc = state.acc + (j0 + jj0) * width;
      if (packed != nullptr) {
        kernels.packed_dot_f32({scores, kBlockRows, jj1 - jj0, packed_v, packed->v_groups,
                                width - (packed->v_groups - 1) * kPackedGroup <= 8, kBlockRows,
                                scratch.sums, sums_stride});
        for (int64_t jj = 0; jj < jj1 - jj0; ++jj) {
          const float* sum = scratch.sums + jj * sums_stride;
          for (int64_t i = 0; i < width; ++i) acc[jj * width + i] += sum[i];
        }
      } else {
        AddWeightedRows(kernels, scores, jj1 - jj0, p.v + offset, row_stride, hi - lo, width,
                        acc);
      }
    }
  }
}

// Merges the partial states of `slices` row slices of one tile (exactly: each rescaled to the
// common max) with the sinks, and writes the tile's outputs.
template <typename KvT>
void WriteTile(const AttentionProblem<KvT>& p, const QueryTile& tile,
               const SoftmaxState* partials, int64_t slices) {
  const int64_t n = tile.positions() * p.group() * (tile.g1 - tile.g0);
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

template <typename KvT>
void Attention(const AttentionProblem<KvT>& p, const KernelTable& kernels,
               const Workers& workers) {
  const int64_t group = p.group();
  // Decode form when all positions fit in one tile of all heads, else the prefill form.
  const bool decode_form = p.queries * p.heads <= kTileQueries;
  const int64_t tile_positions =
      decode_form ? p.queries : std::min(std::max<int64_t>(1, kPrefillQueries / group), p.queries);
  const int64_t heads_per_tile = decode_form ? p.kv_heads : 1;  // kv heads
  const int64_t head_tiles = p.kv_heads / heads_per_tile;
  const int64_t position_tiles = CeilDiv(p.queries, tile_positions);
  const int64_t units = p.batch * position_tiles * head_tiles;
  const int64_t tile_queries = tile_positions * group * heads_per_tile;
  const int64_t state_floats = StateFloats(tile_queries, p.width);
  const int64_t scores_floats = tile_positions * group * kBlockRows;

  // Units in order of decreasing cost, so that the pool's first-come claiming balances them: the
  // last positions first (causal: they attend the most rows), then batch, then kv head.
  auto tile_of = [&](int64_t unit) {
    const int64_t g = unit % head_tiles * heads_per_tile;
    const int64_t b = unit / head_tiles % p.batch;
    const int64_t t0 = (position_tiles - 1 - unit / (head_tiles * p.batch)) * tile_positions;
    return QueryTile{b, t0, std::min(t0 + tile_positions, p.queries), g, g + heads_per_tile};
  };
  // The rows a tile needs: from its first query's first allowed row to its last query's row.
  auto rows_of = [&](const QueryTile& tile) {
    return RowRange{AllowedRows(p, tile.t0).first, AllowedRows(p, tile.t1 - 1).last};
  };

  // Slices per unit, from the shapes alone (never from the thread count).
  const RowRange all_rows = rows_of({0, 0, p.queries, 0, heads_per_tile});
  const int64_t slices =
      units >= kTargetTasks
          ? 1
          : std::max<int64_t>(1, std::min(CeilDiv(kTargetTasks, units),
                                          (all_rows.last - all_rows.first) / kMinSliceRows));

  // The prefill form packs the rows it attends once for all tiles, where the ISA has the packed
  // GEMM (the decode form, bound by reading the cache once, reads it in place).
  const bool use_packed = !decode_form && kernels.packed_dot_f32 != nullptr;
  PackedCache packed;
  if (use_packed) {
    packed.first_block = all_rows.first / kBlockRows;
    packed.blocks = CeilDiv(p.length, kBlockRows) - packed.first_block;
    packed.k_floats = kBlockRows * p.width;
    packed.v_groups = CeilDiv(p.width, kPackedGroup);
    packed.v_floats = packed.v_groups * kBlockRows * kPackedGroup;
    const int64_t blocks = p.batch * p.kv_heads * packed.blocks;
    packed.k.resize(blocks * packed.k_floats);
    packed.v.resize(blocks * packed.v_floats);
    workers.ParallelFor(blocks, [&](int64_t task, int /*worker*/) {
      const int64_t block = packed.first_block + task % packed.blocks;
      const int64_t g = task / packed.blocks % p.kv_heads;
      PackBlock(p, task / (packed.blocks * p.kv_heads), g, block, packed);
    });
  }

  // Per-worker scratch (AttendScratch) and, with one slice, the softmax state.
  const int64_t q_tile_floats = use_packed ? tile_queries * p.width : 0;
  const int64_t sums_floats =
      use_packed ? tile_positions * group * kPackedGroup * CeilDiv(p.width, kPackedGroup) : 0;
  const int64_t scratch_floats = scores_floats + q_tile_floats + sums_floats +
                                 (slices == 1 ? state_floats : 0);
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
    float* next = scratch.data() + worker * scratch_floats;
    auto take = [&next](int64_t floats) {
      float* taken = next;
      next += floats;
      return taken;
    };
    AttendScratch attend;
    attend.q_rows = q_rows.data() + worker * tile_queries;
    attend.scores = take(scores_floats);
    attend.q_tile = take(q_tile_floats);
    attend.sums = take(sums_floats);
    const int64_t n = tile.positions() * group * heads_per_tile;
    const SoftmaxState state = slices == 1 ? StateAt(take(state_floats), n)
                                           : StateAt(partials.data() + task * state_floats, n);
    AttendRows(p, tile, s0, s1, kernels, use_packed ? &packed : nullptr, attend, state);
    if (slices == 1) WriteTile(p, tile, &state, 1);
  });
  if (slices == 1) return;

  workers.ParallelFor(units, [&](int64_t unit, int /*worker*/) {
    const QueryTile tile = tile_of(unit);
    const int64_t n = tile.positions() * group * heads_per_tile;
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

std::string DtypeName(ffi::DataType dtype) {
  return dtype == ffi::DataType::BF16 ? "bfloat16"
         : dtype == ffi::DataType::U16 ? "uint16 (bfloat16 bits)"
                                        : "float32";
}

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
  // A bfloat16 cache may come as its bits, uint16 (ftjax.model.layers.KV_BITS: XLA:CPU writes
  // rows into a uint16 buffer in place), read exactly as bfloat16.
  const ffi::DataType kv_dtype = k.element_type();
  if ((kv_dtype != ffi::DataType::F32 && kv_dtype != ffi::DataType::BF16 &&
       kv_dtype != ffi::DataType::U16) ||
      k_dims.size() != 4 || k_dims[0] != B || k_dims[3] != A) {
    return InvalidArgument(kOp, "k must be float32, bfloat16 or uint16 (bfloat16 bits) "
                                "[B, S, G, A] with B = " +
                                    std::to_string(B) + " and A = " + std::to_string(A) +
                                    " from q, got shape " + ShapeString(k_dims));
  }
  const int64_t S = k_dims[1], G = k_dims[2];
  if (G == 0 || H % G != 0) {
    return InvalidArgument(kOp, "k's kv heads G = " + std::to_string(G) +
                                    " must divide q's heads H = " + std::to_string(H));
  }
  const auto v_dims = v.dimensions();
  if (v.element_type() != kv_dtype || v_dims.size() != 4 ||
      !std::equal(v_dims.begin(), v_dims.end(), k_dims.begin())) {
    return InvalidArgument(kOp, "v must have k's dtype (" + DtypeName(kv_dtype) +
                                    ") and shape " + ShapeString(k_dims) + ", got shape " +
                                    ShapeString(v_dims));
  }
  // One length for the batch, or one per sequence ([B]: a batch at different lengths, each
  // sequence then its own problem).
  const auto length_dims = length.dimensions();
  const bool per_row = length_dims.size() == 1 && length_dims[0] == B;
  if (length.element_type() != ffi::DataType::S32 || !(length_dims.size() == 0 || per_row)) {
    return InvalidArgument(kOp, "length must be an int32 scalar or [B] with B = " +
                                    std::to_string(B) + ", got shape " +
                                    ShapeString(length_dims));
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
  const int32_t* lengths = length.typed_data<int32_t>();
  for (int64_t b = 0; b < (per_row ? B : 1); ++b) {
    if (lengths[b] < T || lengths[b] > S) {
      return InvalidArgument(kOp, "length must be in [T, S] = [" + std::to_string(T) + ", " +
                                      std::to_string(S) + "], got " +
                                      std::to_string(lengths[b]) +
                                      (per_row ? " for sequence " + std::to_string(b) : ""));
    }
  }

  const HostSetup setup = ChooseHostSetup(&xla_pool);
  if (!setup.error.empty()) return InvalidArgument(kOp, setup.error);

  const float* sinks_h = use_sinks ? sinks.typed_data<float>() : nullptr;
  // Per-row lengths: one problem per sequence, each split across the threads as a whole batch
  // would be (the results do not depend on the split).
  const int64_t problems = per_row ? B : 1, rows_each = per_row ? 1 : B;
  const int64_t q_stride = T * H * A, kv_stride = S * G * A;
  for (int64_t b = 0; b < problems; ++b) {
    const float* q_b = q.typed_data<float>() + b * q_stride;
    float* out_b = out->typed_data() + b * q_stride;
    if (kv_dtype == ffi::DataType::BF16 || kv_dtype == ffi::DataType::U16) {
      const AttentionProblem<Bf16Bits> problem{
          rows_each, T, H, G, A, S, lengths[b], window, scale, q_b,
          k.reinterpret_data<Bf16Bits>() + b * kv_stride,
          v.reinterpret_data<Bf16Bits>() + b * kv_stride, sinks_h, out_b};
      Attention(problem, *setup.kernels, setup.workers);
    } else {
      const AttentionProblem<float> problem{rows_each, T, H, G, A, S, lengths[b], window, scale,
                                            q_b, k.typed_data<float>() + b * kv_stride,
                                            v.typed_data<float>() + b * kv_stride, sinks_h,
                                            out_b};
      Attention(problem, *setup.kernels, setup.workers);
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace ftjax

// Binding: registered by Python as the CPU target "ftjax_attention".
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxAttention, ftjax::AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()   // XLA's intra-op pool
                                  .Arg<ffi::AnyBuffer>()    // q [B, T, H, A] f32, unscaled
                                  .Arg<ffi::AnyBuffer>()    // k [B, S, G, A] f32 or bf16, the cache
                                  .Arg<ffi::AnyBuffer>()    // v [B, S, G, A] k's dtype, the cache
                                  .Arg<ffi::AnyBuffer>()    // length: int32 [] or [B], valid rows
                                  .Arg<ffi::AnyBuffer>()    // sinks [H] f32 (or [0] unused)
                                  .Attr<float>("scale")     // multiplies q . k
                                  .Attr<int64_t>("window")  // sliding window, 0: none
                                  .Attr<bool>("use_sinks")  // softmax over [scores, sink[h]]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out [B, T, H, A]
);
