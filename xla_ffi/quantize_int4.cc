// The int4 quantiser (FTW's int4 rows, docs/ftw.md): ftjax.utils.quant.quantize_int4's
// algorithm in C++, for the converter (a Qwen3.6-35B-A3B's routed experts are 8e9 weights: the
// numpy form takes about an hour of one core for them, this one a minute or two). The numpy
// form (quant._int4_fit, _int4_rows) stays the reference: the same search and the same
// roundings, in float32 where it runs in float32 (its sums pairwise, these in order, so a
// near-tie between two candidates can go the other way: tests/formats/test_int4.py bounds how
// often and by how much).
//
// Per block of 32 inputs x, with weights v = rms(x) + |x|: for each of the 9 cuts (0, 5% or
// 10% off either end of [min(x, 0), max(x, 0)]) the codes of d = span / 15 and m = the low end,
// refitted 4 times by weighted least squares of x on those codes; the fit of least weighted
// squared error wins (ties: the earlier cut). Per row: d_row = max d / 255 rounded up to 12
// significant bits, dm_row = max |m| / 127 rounded up to 16 (both at least float32's smallest
// normal times 2^bits; 1 for a zero row), s = clip(rint(d / d_row), 1, 255) (0, with m = 0
// and codes 0, for an all-zero block), mi =
// clip(rint(m / dm_row), -127, 127), q = clip(rint((x - dm_row * mi) / (d_row * s)), 0, 15)
// in float64, rint half to even throughout.

#include "quantize_int4.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

namespace ftjax {
namespace {

constexpr int kBlock = 32;
constexpr float kCuts[3] = {0.0f, 0.05f, 0.1f};
constexpr int kRefits = 4;

// numpy's np.rint, round half to even, for the values clipped to [0, 15] or [-127, 255] after:
// adding and taking away 1.5 * 2^23 (2^52 for double) rounds to an integer in the default
// rounding mode, exactly as rint does for |v| < 2^22 (2^51); a larger |v| comes out large with
// its sign and is clipped as rint's would be. (std::nearbyint is a libm call per value at the
// baseline ISA; this vectorises.)
inline float RintF(float v) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23
  return (v + kMagic) - kMagic;
}
inline double RintD(double v) {
  constexpr double kMagic = 6755399441055744.0;  // 1.5 * 2^52
  return (v + kMagic) - kMagic;
}

struct Fit {
  float d;
  float m;
};

// The best weighted fit of one block (quant._int4_fit, float32).
Fit FitBlock(const float* x) {
  float sum_sq = 0.0f, lo = 0.0f, hi = 0.0f;
  for (int i = 0; i < kBlock; ++i) {
    sum_sq += x[i] * x[i];
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
  }
  // An all-zero block: scale and min 0 (s = 0, codes 0), exact zeros however the sums group.
  if (hi - lo == 0.0f) return Fit{0.0f, 0.0f};
  const float rms = std::sqrt(sum_sq / kBlock);
  float v[kBlock];
  for (int i = 0; i < kBlock; ++i) v[i] = rms + std::fabs(x[i]);
  Fit best{1.0f, 0.0f};
  float best_err = std::numeric_limits<float>::infinity();
  bool have = false;
  for (const float cut_lo : kCuts) {
    for (const float cut_hi : kCuts) {
      const float span = hi - lo;
      float m = lo + cut_lo * span;
      float d = (hi - cut_hi * span - m) / 15.0f;
      if (!(d > 0.0f)) d = 1.0f;
      for (int r = 0; r < kRefits; ++r) {
        float sw = 0, sq = 0, sqq = 0, sx = 0, sqx = 0;
        for (int i = 0; i < kBlock; ++i) {
          const float q = std::clamp(RintF((x[i] - m) / d), 0.0f, 15.0f);
          sw += v[i];
          sq += v[i] * q;
          sqq += v[i] * q * q;
          sx += v[i] * x[i];
          sqx += v[i] * q * x[i];
        }
        const float det = sw * sqq - sq * sq;
        if (det > 1e-6f * sw * sqq) {
          const float new_d = (sw * sqx - sq * sx) / det;
          const float new_m = (sx - new_d * sq) / sw;
          if (new_d > 0.0f) {
            d = new_d;
            m = new_m;
          }
        }
      }
      float err = 0.0f;
      for (int i = 0; i < kBlock; ++i) {
        const float q = std::clamp(RintF((x[i] - m) / d), 0.0f, 15.0f);
        const float e = d * q + m - x[i];
        err += v[i] * e * e;
      }
      if (!have || err < best_err) {
        best = {d, m};
        best_err = err;
        have = true;
      }
    }
  }
  return best;
}

// Positive x rounded up to `bits` significant bits, as float32 (quant._round_up_bits).
float RoundUpBits(double x, int bits) {
  const double tiny =
      static_cast<double>(std::numeric_limits<float>::min()) * std::ldexp(1.0, bits);
  const double top = static_cast<double>(std::numeric_limits<float>::max()) / 2;
  x = std::clamp(x, tiny, top);
  if (!(x > tiny)) return 1.0f;
  int exponent;
  const double mantissa = std::frexp(x, &exponent);
  return static_cast<float>(std::ldexp(std::ceil(std::ldexp(mantissa, bits)), exponent - bits));
}

void QuantizeRow(const float* w, int64_t cols, uint8_t* codes, uint8_t* params,
                 std::vector<Fit>& fits) {
  const int64_t blocks = cols / kBlock;
  double d_max = 0.0, m_max = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    fits[b] = FitBlock(w + b * kBlock);
    d_max = std::max(d_max, static_cast<double>(fits[b].d));
    m_max = std::max(m_max, std::fabs(static_cast<double>(fits[b].m)));
  }
  const float d_row = RoundUpBits(d_max / 255.0, 12);
  const float dm_row = RoundUpBits(m_max / 127.0, 16);
  std::memcpy(params, &d_row, sizeof(float));
  std::memcpy(params + 4, &dm_row, sizeof(float));
  uint8_t* s_out = params + 8;
  int8_t* m_out = reinterpret_cast<int8_t*>(params + 8 + blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    const double s =
        fits[b].d > 0.0f ? std::clamp(RintD(static_cast<double>(fits[b].d) / d_row), 1.0, 255.0)
                         : 0.0;
    const double mi = std::clamp(RintD(static_cast<double>(fits[b].m) / dm_row), -127.0, 127.0);
    s_out[b] = static_cast<uint8_t>(s);
    m_out[b] = static_cast<int8_t>(mi);
    const double scale = static_cast<double>(d_row * static_cast<float>(s));
    const double offset = static_cast<double>(dm_row * static_cast<float>(mi));
    const float* x = w + b * kBlock;
    for (int j = 0; j < kBlock / 2; ++j) {
      const double q0 =
          scale > 0.0 ? std::clamp(RintD((x[2 * j] - offset) / scale), 0.0, 15.0) : 0.0;
      const double q1 =
          scale > 0.0 ? std::clamp(RintD((x[2 * j + 1] - offset) / scale), 0.0, 15.0) : 0.0;
      codes[b * kBlock / 2 + j] =
          static_cast<uint8_t>(static_cast<int>(q0) | (static_cast<int>(q1) << 4));
    }
  }
}

}  // namespace

void QuantizeInt4Rows(const float* w, int64_t rows, int64_t cols, uint8_t* codes,
                      uint8_t* params, int threads) {
  const int64_t param_bytes = 8 + 2 * (cols / kBlock);
  auto run = [&](int64_t r0, int64_t r1) {
    std::vector<Fit> fits(cols / kBlock);
    for (int64_t r = r0; r < r1; ++r) {
      QuantizeRow(w + r * cols, cols, codes + r * (cols / 2), params + r * param_bytes, fits);
    }
  };
  threads = std::max(1, std::min<int>(threads, static_cast<int>(std::max<int64_t>(rows, 1))));
  if (threads == 1) {
    run(0, rows);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t per = (rows + threads - 1) / threads;
  for (int t = 0; t < threads; ++t) {
    const int64_t r0 = t * per, r1 = std::min(rows, r0 + per);
    if (r0 < r1) pool.emplace_back(run, r0, r1);
  }
  for (auto& th : pool) th.join();
}

}  // namespace ftjax
