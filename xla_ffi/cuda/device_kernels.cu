// CUDA kernels of the GPU expert path; see device_kernels.h.

#include "device_kernels.h"

namespace ftjax::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerRow = 64;  // enough 16-byte loads in flight to fill the bus

__global__ void PoolFillKernel(uint4* slots, int64_t num_slots, const uint4* pool, int64_t layers,
                               int64_t experts, int64_t block_vectors, const int32_t* src,
                               const int32_t* dst, unsigned int* bad_rows) {
  const int64_t row = blockIdx.y;
  const int32_t slot = dst[row];
  if (slot < 0) return;
  const int32_t layer = src[2 * row], expert = src[2 * row + 1];
  if (slot >= num_slots || layer < 0 || layer >= layers || expert < 0 || expert >= experts) {
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(bad_rows, 1u);
    return;
  }
  const uint4* from = pool + (static_cast<int64_t>(layer) * experts + expert) * block_vectors;
  uint4* to = slots + static_cast<int64_t>(slot) * block_vectors;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < block_vectors;
       i += stride) {
    to[i] = from[i];
  }
}

__global__ void AddHostPartKernel(float* out, const float* device_part, const float* host_part,
                                  int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = device_part[i] + host_part[i];
  }
}

__global__ void SpinWaitKernel(const volatile unsigned int* flag, unsigned int value) {
  while (static_cast<int>(*flag - value) < 0) {
    __nanosleep(200);
  }
}

}  // namespace

cudaError_t LaunchPoolFill(char* slots, int64_t num_slots, const char* pool, int64_t layers,
                           int64_t experts, int64_t block_bytes, const int32_t* src,
                           const int32_t* dst, int64_t rows, unsigned int* bad_rows,
                           cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const dim3 grid(kBlocksPerRow, static_cast<unsigned int>(rows));
  PoolFillKernel<<<grid, kThreads, 0, stream>>>(
      reinterpret_cast<uint4*>(slots), num_slots, reinterpret_cast<const uint4*>(pool), layers,
      experts, block_bytes / 16, src, dst, bad_rows);
  return cudaGetLastError();
}

cudaError_t LaunchAddHostPart(float* out, const float* device_part, const float* host_part,
                              int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  AddHostPartKernel<<<static_cast<unsigned int>(blocks < 1024 ? blocks : 1024), kThreads, 0,
                      stream>>>(out, device_part, host_part, n);
  return cudaGetLastError();
}

cudaError_t LaunchSpinWait(const volatile unsigned int* flag, unsigned int value,
                           cudaStream_t stream) {
  SpinWaitKernel<<<1, 1, 0, stream>>>(flag, value);
  return cudaGetLastError();
}

}  // namespace ftjax::cuda
