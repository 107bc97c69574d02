// ftjax._ffi: exports every XLA FFI handler of ftjax as a PyCapsule, which Python registers at
// import (ftjax/kernels/) with jax.ffi.register_ffi_target; and the process's kernel tuning
// (cpu_kernels.h: KernelTuning), which ftjax/kernels/tuning.py sets and reads.

#include <stdexcept>
#include <string>
#include <type_traits>

#include "cpu_kernels.h"
#include "quantize_int4.h"

#include "nanobind/nanobind.h"
#include "nanobind/ndarray.h"
#include "nanobind/stl/string.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

// Handlers, one per file in xla_ffi/.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxExpertFfn);  // expert_ffn.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxSlotFill);   // slot_fill.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxDense);      // dense.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxDenseQuantized);  // dense.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxAttention);  // attention.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxReadProbe);  // read_probe.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxPeakProbe);  // peak_probe.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxCpuInfo);    // cpu_info.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxExpSubSum);  // exp_sub_sum.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxDeltaRuleStep);  // delta_rule.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxArgmax);  // argmax.cc

namespace {

template <typename Handler>
nb::capsule EncapsulateHandler(Handler* handler) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, Handler, XLA_FFI_CallFrame*>,
                "an XLA FFI handler takes XLA_FFI_CallFrame* and returns XLA_FFI_Error*");
  return nb::capsule(reinterpret_cast<void*>(handler));
}

}  // namespace

NB_MODULE(_ffi, m) {
  m.def("registrations", []() {
    nb::dict registrations;
    registrations["ftjax_expert_ffn"] = EncapsulateHandler(FtjaxExpertFfn);
    registrations["ftjax_slot_fill"] = EncapsulateHandler(FtjaxSlotFill);
    registrations["ftjax_dense"] = EncapsulateHandler(FtjaxDense);
    registrations["ftjax_dense_quantized"] = EncapsulateHandler(FtjaxDenseQuantized);
    registrations["ftjax_attention"] = EncapsulateHandler(FtjaxAttention);
    registrations["ftjax_read_probe"] = EncapsulateHandler(FtjaxReadProbe);
    registrations["ftjax_peak_probe"] = EncapsulateHandler(FtjaxPeakProbe);
    registrations["ftjax_cpu_info"] = EncapsulateHandler(FtjaxCpuInfo);
    registrations["ftjax_exp_sub_sum"] = EncapsulateHandler(FtjaxExpSubSum);
    registrations["ftjax_delta_rule_step"] = EncapsulateHandler(FtjaxDeltaRuleStep);
    registrations["ftjax_argmax"] = EncapsulateHandler(FtjaxArgmax);
    return registrations;
  });
  // The tuning's fields by name (KernelTuning); what set_kernel_tuning leaves out keeps its
  // default. A bad value raises ValueError with the field's rule, and nothing changes.
  m.def(
      "set_kernel_tuning",
      [](int prefetch_bytes, int prefetch_hint, int row_accumulators, int block_rows,
         int gemv_task_kib, int packed_min_tokens) {
        ftjax::KernelTuning t;
        t.prefetch_bytes = prefetch_bytes;
        t.prefetch_hint = prefetch_hint;
        t.row_accumulators = row_accumulators;
        t.block_rows = block_rows;
        t.gemv_task_kib = gemv_task_kib;
        t.packed_min_tokens = packed_min_tokens;
        const std::string error = ftjax::SetKernelTuning(t);
        if (!error.empty()) throw std::invalid_argument("kernel tuning: " + error);
      },
      nb::kw_only(), nb::arg("prefetch_bytes") = -1, nb::arg("prefetch_hint") = 0,
      nb::arg("row_accumulators") = 0, nb::arg("block_rows") = 0, nb::arg("gemv_task_kib") = 0,
      nb::arg("packed_min_tokens") = -1);
  // ftjax.utils.quant.quantize_int4's algorithm (quantize_int4.cc) into preallocated arrays;
  // the GIL is released while it runs.
  m.def(
      "quantize_int4",
      [](nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> w,
         nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> codes,
         nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> params, int threads) {
        const int64_t rows = static_cast<int64_t>(w.shape(0));
        const int64_t cols = static_cast<int64_t>(w.shape(1));
        if (cols % 32 != 0) {
          throw std::invalid_argument("quantize_int4: cols must be a multiple of 32");
        }
        if (static_cast<int64_t>(codes.shape(0)) != rows ||
            static_cast<int64_t>(codes.shape(1)) != cols / 2 ||
            static_cast<int64_t>(params.shape(0)) != rows ||
            static_cast<int64_t>(params.shape(1)) != 8 + cols / 16) {
          throw std::invalid_argument("quantize_int4: codes must be [rows, cols / 2] and params "
                                      "[rows, 8 + cols / 16]");
        }
        const float* w_data = w.data();
        uint8_t* codes_data = codes.data();
        uint8_t* params_data = params.data();
        nb::gil_scoped_release release;
        ftjax::QuantizeInt4Rows(w_data, rows, cols, codes_data, params_data, threads);
      },
      nb::arg("w"), nb::arg("codes"), nb::arg("params"), nb::arg("threads"));
  m.def("kernel_tuning", []() {
    const ftjax::KernelTuning t = ftjax::CurrentKernelTuning();
    nb::dict d;
    d["prefetch_bytes"] = t.prefetch_bytes;
    d["prefetch_hint"] = t.prefetch_hint;
    d["row_accumulators"] = t.row_accumulators;
    d["block_rows"] = t.block_rows;
    d["gemv_task_kib"] = t.gemv_task_kib;
    d["packed_min_tokens"] = t.packed_min_tokens;
    return d;
  });
}
