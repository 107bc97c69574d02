"""Python side of ftjax's XLA FFI kernels (C++ sources in xla_ffi/).

Importing this package registers the compiled handlers with XLA:CPU. Without the compiled
module the import still works: ``available()`` is False, ``load_error()`` says why, and every
op raises ``KernelsUnavailable`` with the cause and the fix (``require()``).

Ops:
  expert_ffn(x, ids, weights, bank, layer, *, ffn_dim)  routed SwiGLU experts (decode and
                                                         grouped prefill forms)
  dense(x, w)                                            y = x @ w.T, w [N, K] bf16/f32
  attention(q, k, v, length, *, scale, window, sinks)    decode attention over a KV cache,
                                                         read in place
  read_probe(buf)                                        host read-bandwidth probe
  peak_probe(*, tasks, iterations)                       host multiply-add peak probe
  cpu_info()                                             ISA and threads in use
  exp_sub_sum(x, max)                                    exp(x - max) per row and its sums (the
                                                         softmax primitive of attention)
  slot_fill(slots, bank, src, dst)                       copy experts into cache slots in place
  delta_rule_step(q, k, v, g, beta, state)               one token of the gated delta rule (the
                                                         Gated DeltaNet recurrence), in place
  argmax(x)                                              the first index of each row's largest
                                                         value (greedy sampling)

Kernel tuning (``ftjax.kernels.tuning``): the kernels' per-machine variant (prefetch distance
and hint, accumulators, rows per task and per register block), measured on this CPU and kept in
a tuning file; ``tuning.apply`` sets one for the process, ``Engine(kernel_tuning=...)`` resolves
it.

Environment (read by the C++ kernels):
  FTJAX_ISA=scalar|avx2|avx512|avx512bf16   use at most this instruction set (read every call;
                                            the default is the best the CPU supports)
  FTJAX_AMX=0|1                             0: with avx512bf16 on a CPU with AMX (Intel Xeon 4th
                                            generation on), run the GEMMs of bf16 weights and
                                            bf16-rounded activations (prefill under ffi_bf16) on
                                            vdpbf16ps instead of AMX tiles (read every call;
                                            cpu_info()["amx"] says which runs)
  FTJAX_THREAD_POOL=xla|own                 XLA's intra-op pool (default; measured faster between
                                            XLA ops, see xla_ffi/thread_pool.h) or ftjax's own
                                            persistent pool (read every call)
  FTJAX_NUM_THREADS=n                       threads: the size of ftjax's own pool (read when it is
                                            created, at its first use; default: all CPUs), and at
                                            most this many of XLA's pool (read every call; XLA's
                                            pool has one thread per CPU)
  FTJAX_PIN_THREADS=1                       pin the own pool's workers to CPUs (at creation)
"""

from ftjax.kernels._registration import KernelsUnavailable, available, load_error, require
from ftjax.kernels.argmax import argmax
from ftjax.kernels.attention import attention
from ftjax.kernels.cpu_info import cpu_info
from ftjax.kernels.delta_rule import delta_rule_step
from ftjax.kernels.dense import dense
from ftjax.kernels.exp_sub_sum import exp_sub_sum
from ftjax.kernels.expert_ffn import SWIGLU, ExpertVariant, expert_ffn
from ftjax.kernels.peak_probe import peak_probe
from ftjax.kernels.read_probe import read_probe
from ftjax.kernels.slot_fill import slot_fill

__all__ = ["KernelsUnavailable", "available", "load_error", "require", "argmax", "attention",
           "cpu_info", "delta_rule_step", "dense", "exp_sub_sum", "expert_ffn", "peak_probe",
           "read_probe", "slot_fill", "ExpertVariant", "SWIGLU"]
