"""Python side of ftjax's XLA FFI kernels (C++ sources in xla_ffi/).

Importing this package registers the compiled handlers with XLA:CPU.
"""

from ftjax.kernels.expert_ffn import expert_ffn
from ftjax.kernels.slot_fill import slot_fill

__all__ = ["expert_ffn", "slot_fill"]
