// ftjax._ffi: exports every XLA FFI handler of ftjax as a PyCapsule, nothing else.
// Python registers them at import (ftjax/kernels/) with jax.ffi.register_ffi_target.

#include <type_traits>

#include "nanobind/nanobind.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

// Handlers, one per file in xla_ffi/.
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxExpertFfn);  // expert_ffn.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxSlotFill);   // slot_fill.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxDense);      // dense.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxAttention);  // attention.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxReadProbe);  // read_probe.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxPeakProbe);  // peak_probe.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxCpuInfo);    // cpu_info.cc
XLA_FFI_DECLARE_HANDLER_SYMBOL(FtjaxExpSubSum);  // exp_sub_sum.cc

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
    registrations["ftjax_attention"] = EncapsulateHandler(FtjaxAttention);
    registrations["ftjax_read_probe"] = EncapsulateHandler(FtjaxReadProbe);
    registrations["ftjax_peak_probe"] = EncapsulateHandler(FtjaxPeakProbe);
    registrations["ftjax_cpu_info"] = EncapsulateHandler(FtjaxCpuInfo);
    registrations["ftjax_exp_sub_sum"] = EncapsulateHandler(FtjaxExpSubSum);
    return registrations;
  });
}
