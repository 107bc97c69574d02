// The int4 quantiser for the converter (quantize_int4.cc; docs/ftw.md, the int4 rows).
#ifndef FTJAX_XLA_FFI_QUANTIZE_INT4_H_
#define FTJAX_XLA_FFI_QUANTIZE_INT4_H_

#include <cstdint>

namespace ftjax {

// Quantises w [rows, cols] (float32, C order, cols a multiple of 32, finite) to int4 rows:
// codes [rows, cols / 2] and params [rows, 8 + cols / 16] (both C order), on `threads` threads
// (rows split between them; the result does not depend on the split).
void QuantizeInt4Rows(const float* w, int64_t rows, int64_t cols, uint8_t* codes,
                      uint8_t* params, int threads);

}  // namespace ftjax

#endif  // FTJAX_XLA_FFI_QUANTIZE_INT4_H_
