// CUDA kernels of the GPU expert path (device_kernels.cu), launched by handlers.cc.

#ifndef FTJAX_XLA_FFI_CUDA_DEVICE_KERNELS_H_
#define FTJAX_XLA_FFI_CUDA_DEVICE_KERNELS_H_

#include <cstdint>

#include <cuda_runtime.h>

namespace ftjax::cuda {

// For each row m with dst[m] >= 0: slots[dst[m]] = pool[src[m, 0], src[m, 1]], one block of
// block_bytes. `pool` is the device address of the mapped host pool: the kernel reads it over
// the bus (zero-copy), so the plan (src, dst) never leaves the device. Rows naming a layer,
// expert or slot out of range are skipped and counted in *bad_rows (mapped host memory).
// block_bytes must be a multiple of 16 (FTW blocks are 4096-byte aligned).
cudaError_t LaunchPoolFill(char* slots, int64_t num_slots, const char* pool, int64_t layers,
                           int64_t experts, int64_t block_bytes, const int32_t* src,
                           const int32_t* dst, int64_t rows, unsigned int* bad_rows,
                           cudaStream_t stream);

// out[i] = device_part[i] + host_part[i] for i < n; host_part is mapped pinned memory.
cudaError_t LaunchAddHostPart(float* out, const float* device_part, const float* host_part,
                              int64_t n, cudaStream_t stream);

// Spins until *flag >= value (the flag in mapped host memory, written by the host worker):
// the stream wait used where the driver lacks stream memory operations.
cudaError_t LaunchSpinWait(const volatile unsigned int* flag, unsigned int value,
                           cudaStream_t stream);

}  // namespace ftjax::cuda

#endif  // FTJAX_XLA_FFI_CUDA_DEVICE_KERNELS_H_
