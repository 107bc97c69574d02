// ftjax's XLA FFI handlers for the CUDA platform: the host pool registry, the fill from the mapped
// pool, and the host experts of a GPU step (a start/done pair around the device's own work).
//
//   ftjax_cuda_pool_fill           slots[dst[m]] = pool[src[m]]: a copy kernel on the compute
//                                  stream reading the mapped pool (device_kernels.cu), so the plan
//                                  computed on the device is used there, with no host round trip.
//   ftjax_cuda_host_experts_start  copies x, ids, weights to pinned staging (async, on the
//                                  stream), then cudaLaunchHostFunc posts the job to the host
//                                  worker: the host function only enqueues, so the stream moves
//                                  on at once to the device's hit and fill work.
//   ftjax_cuda_fetch_layer_start   a whole layer of the pool (contiguous in FTW) copied into a
//   ftjax_cuda_fetch_layer_done    device buffer on a side stream (the copy engine), so the next
//                                  layer's transfer runs while this layer computes; done makes the
//                                  compute stream wait for it (double buffering of the streamed
//                                  prefill, DESIGN section 4).
//   ftjax_cuda_host_experts_done   the stream waits for the worker's flag in mapped memory
//                                  (cuStreamWaitValue32; a one-thread spin kernel where the driver
//                                  lacks stream memory operations, reported in stats()), then a
//                                  kernel adds the host result to the device partial sum.
//
// The host worker is one thread that runs ftjax's CPU expert kernel (expert_ffn.h), which
// spreads each job over ftjax's own worker pool. Each CUDA stream has kSlots staging slots used
// in turn; a slot is reused only by a job that comes later on that stream than the previous
// job's done, so stream order keeps the slot's data intact. Start and done are paired by the
// address of the ticket buffer that start writes and done reads, per stream, so several
// streams (several GPUs) and any launch order of independent thunks keep their pairs apart.

#include <cuda.h>
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "../expert_ffn.h"
#include "device_kernels.h"
#include "handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace ftjax::cuda {
namespace {

ffi::Error CudaError(const char* op, const char* what, cudaError_t error) {
  return ffi::Error(ffi::ErrorCode::kInternal, std::string(op) + ": " + what + ": " +
                                                   cudaGetErrorString(error));
}

ffi::Error Invalid(const char* op, const std::string& message) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + message);
}

// -- Pool registry ------------------------------------------------------------------------------

struct Pool {
  const char* host = nullptr;
  const char* device = nullptr;
  int64_t bytes = 0, layers = 0, experts = 0, block = 0, itemsize = 0;
  bool registered_here = false;
};

std::mutex pools_mutex;
std::deque<Pool> pools;  // a deque: references stay valid as it grows

const Pool* FindPool(int64_t handle) {
  std::lock_guard<std::mutex> lock(pools_mutex);
  if (handle < 0 || handle >= static_cast<int64_t>(pools.size())) return nullptr;
  return &pools[handle];
}

// Mapped pinned memory that device code reads and the host writes.
template <typename T>
struct Mapped {
  T* host = nullptr;
  T* device = nullptr;
  int64_t count = 0;

  cudaError_t Allocate(int64_t n) {
    void* h = nullptr;
    cudaError_t e = cudaHostAlloc(&h, n * sizeof(T), cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess) return e;
    void* d = nullptr;
    e = cudaHostGetDevicePointer(&d, h, 0);
    if (e != cudaSuccess) return e;
    host = static_cast<T*>(h);
    device = static_cast<T*>(d);
    count = n;
    return cudaSuccess;
  }
};

// -- Host experts -------------------------------------------------------------------------------

constexpr int kSlots = 2;

struct Staging {
  Mapped<float> x, weights, y;
  Mapped<int32_t> ids;
  int64_t elements = 0;  // T * D of the job in flight (read by done)
};

// What one CUDA stream's start/done pairs use. Pairs on one stream are ordered by the stream
// (a slot is reused only after the stream has passed the previous job's done); streams are
// independent of each other (several GPUs, or XLA using more than one stream).
struct StreamState {
  Mapped<unsigned int> flags;  // [kSlots], set by the worker to the job's sequence number
  unsigned int seq[kSlots] = {};
  int next_slot = 0;
  Staging staging[kSlots];
  // Started, not yet done, keyed by the address of the start's ticket buffer, which done
  // receives: pairs match whatever order XLA launches independent thunks in.
  std::map<const void*, std::pair<int, unsigned int>> pending;
};

struct Job {
  unsigned int* flag;  // host address of the job's flag
  unsigned int seq;
  const Pool* pool;
  int64_t layer, tokens, model_dim, top_k, ffn_dim;
  bool bf16_activations;
  ExpertActivation activation;
  float* x;
  int32_t* ids;
  float* weights;
  float* y;
};

using WaitValueFn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

class HostExperts {
 public:
  static HostExperts& Instance() {
    static HostExperts* instance = new HostExperts();  // never destroyed (see thread_pool.h)
    return *instance;
  }

  ffi::Error Start(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                   ffi::Buffer<ffi::F32> weights, int64_t pool_handle, int64_t layer,
                   int64_t ffn_dim, bool bf16_activations, const ExpertActivation& activation,
                   ffi::ResultBuffer<ffi::S32> ticket, ffi::ResultBuffer<ffi::F32> x_out);
  ffi::Error Done(cudaStream_t stream, ffi::Buffer<ffi::S32> ticket, ffi::Buffer<ffi::F32> y,
                  ffi::ResultBuffer<ffi::F32> y_out);

  void Enqueue(Job* job) {
    {
      std::lock_guard<std::mutex> lock(queue_mutex_);
      queue_.push_back(job);
    }
    wake_.notify_one();
  }

  void Stats(std::vector<std::pair<std::string, double>>* out, std::string* wait,
             std::string* last_error) {
    out->push_back({"jobs", static_cast<double>(jobs_.load())});
    out->push_back({"host_seconds", host_ns_.load() * 1e-9});
    out->push_back({"errors", static_cast<double>(errors_.load())});
    out->push_back({"bad_fill_rows", bad_rows_.host ? static_cast<double>(*bad_rows_.host) : 0.0});
    std::lock_guard<std::mutex> lock(mutex_);
    *wait = wait_mode_;
    *last_error = last_error_;
  }

  unsigned int* bad_rows_device() { return bad_rows_.device; }
  cudaError_t EnsureInit() {
    std::lock_guard<std::mutex> lock(mutex_);
    return Init();
  }

 private:
  HostExperts() = default;
  cudaError_t Init();  // with mutex_ held
  void WorkerLoop();

  std::mutex mutex_;  // launch-thread state below
  bool initialized_ = false;
  Mapped<unsigned int> bad_rows_;
  std::map<cudaStream_t, StreamState*> streams_;  // never freed: jobs may still refer to them
  std::vector<void*> retired_;  // outgrown staging, still possibly read by a running job
  WaitValueFn wait_value_ = nullptr;
  std::string wait_mode_ = "not started";
  std::string last_error_;

  std::mutex queue_mutex_;
  std::condition_variable wake_;
  std::deque<Job*> queue_;
  std::thread worker_;

  std::atomic<int64_t> jobs_{0}, host_ns_{0}, errors_{0};
};

void CUDART_CB PostJob(void* job) { HostExperts::Instance().Enqueue(static_cast<Job*>(job)); }

cudaError_t HostExperts::Init() {
  // Called with mutex_ held.
  if (initialized_) return cudaSuccess;
  cudaError_t e = bad_rows_.Allocate(1);
  if (e != cudaSuccess) return e;
  *bad_rows_.host = 0;
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status;
  if (cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &fn, 12000, cudaEnableDefault,
                                       &status) == cudaSuccess &&
      status == cudaDriverEntryPointSuccess && fn != nullptr) {
    wait_value_ = reinterpret_cast<WaitValueFn>(fn);
    wait_mode_ = "cuStreamWaitValue32";
  } else {
    wait_mode_ = "spin kernel (cuStreamWaitValue32 unavailable)";
  }
  worker_ = std::thread([this] { WorkerLoop(); });
  worker_.detach();
  initialized_ = true;
  return cudaSuccess;
}

void HostExperts::WorkerLoop() {
  for (;;) {
    Job* job;
    {
      std::unique_lock<std::mutex> lock(queue_mutex_);
      wake_.wait(lock, [this] { return !queue_.empty(); });
      job = queue_.front();
      queue_.pop_front();
    }
    const auto t0 = std::chrono::steady_clock::now();
    const Pool& pool = *job->pool;
    HostExpertProblem problem{job->tokens, job->model_dim, job->top_k, job->ffn_dim,
                              pool.experts, pool.block, job->x, job->ids, job->weights,
                              pool.host + job->layer * pool.experts * pool.block * pool.itemsize,
                              pool.itemsize == 2, job->bf16_activations, job->y,
                              job->activation};
    const std::string error = HostExpertFfn(problem);
    if (!error.empty()) {
      // The stream must not wait forever: the result is zeros and the error is counted, printed
      // and kept for stats(), which ftjax checks after each program.
      for (int64_t i = 0; i < job->tokens * job->model_dim; ++i) job->y[i] = 0.0f;
      errors_.fetch_add(1);
      std::fprintf(stderr, "ftjax_cuda_host_experts: %s\n", error.c_str());
      std::lock_guard<std::mutex> lock(mutex_);
      last_error_ = error;
    }
    host_ns_.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(
                           std::chrono::steady_clock::now() - t0).count());
    jobs_.fetch_add(1);
    __atomic_store_n(job->flag, job->seq, __ATOMIC_RELEASE);
    delete job;
  }
}

constexpr const char* kStart = "ftjax_cuda_host_experts_start";
constexpr const char* kDone = "ftjax_cuda_host_experts_done";

ffi::Error HostExperts::Start(cudaStream_t stream, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::F32> weights,
                              int64_t pool_handle, int64_t layer, int64_t ffn_dim,
                              bool bf16_activations, const ExpertActivation& activation,
                              ffi::ResultBuffer<ffi::S32> ticket,
                              ffi::ResultBuffer<ffi::F32> x_out) {
  const Pool* pool = FindPool(pool_handle);
  if (pool == nullptr) return Invalid(kStart, "no registered pool " + std::to_string(pool_handle));
  const auto xd = x.dimensions();
  const auto id = ids.dimensions();
  if (xd.size() != 2 || id.size() != 2 || id[0] != xd[0] || weights.dimensions().size() != 2 ||
      weights.dimensions()[0] != id[0] || weights.dimensions()[1] != id[1]) {
    return Invalid(kStart, "x must be [T, D], ids and weights [T, K]");
  }
  const int64_t T = xd[0], D = xd[1], K = id[1];
  if (layer < 0 || layer >= pool->layers) {
    return Invalid(kStart, "layer " + std::to_string(layer) + " is outside the pool's [0, " +
                               std::to_string(pool->layers) + ")");
  }
  if (ffn_dim <= 0 || D <= 0 || 3 * ffn_dim * D > pool->block) {
    return Invalid(kStart, "3 * ffn_dim * D exceeds the pool's block size");
  }
  if (activation.biases && 3 * ffn_dim * D + 2 * ffn_dim + D > pool->block) {
    return Invalid(kStart, "3 * ffn_dim * D + 2 * ffn_dim + D (an expert with biases) exceeds "
                           "the pool's block size");
  }
  int slot;
  unsigned int seq;
  unsigned int* flag;
  Staging* st;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    cudaError_t e = Init();
    if (e != cudaSuccess) return CudaError(kStart, "allocating mapped memory", e);
    StreamState*& state = streams_[stream];
    if (state == nullptr) {
      state = new StreamState();
      if ((e = state->flags.Allocate(kSlots)) != cudaSuccess) {
        return CudaError(kStart, "allocating the stream's flags", e);
      }
      for (int i = 0; i < kSlots; ++i) state->flags.host[i] = 0;
    }
    slot = state->next_slot;
    state->next_slot = (slot + 1) % kSlots;
    seq = ++state->seq[slot];
    flag = state->flags.host + slot;
    st = &state->staging[slot];
    if (st->x.count < T * D || st->ids.count < T * K) {
      for (void* p : {static_cast<void*>(st->x.host), static_cast<void*>(st->weights.host),
                      static_cast<void*>(st->y.host), static_cast<void*>(st->ids.host)}) {
        if (p != nullptr) retired_.push_back(p);
      }
      if ((e = st->x.Allocate(T * D)) != cudaSuccess ||
          (e = st->y.Allocate(T * D)) != cudaSuccess ||
          (e = st->ids.Allocate(T * K)) != cudaSuccess ||
          (e = st->weights.Allocate(T * K)) != cudaSuccess) {
        return CudaError(kStart, "allocating pinned staging", e);
      }
    }
    st->elements = T * D;
    state->pending[ticket->untyped_data()] = {slot, seq};
  }
  cudaError_t e;
  if ((e = cudaMemcpyAsync(st->x.host, x.typed_data(), T * D * sizeof(float),
                           cudaMemcpyDeviceToHost, stream)) != cudaSuccess ||
      (e = cudaMemcpyAsync(st->ids.host, ids.typed_data(), T * K * sizeof(int32_t),
                           cudaMemcpyDeviceToHost, stream)) != cudaSuccess ||
      (e = cudaMemcpyAsync(st->weights.host, weights.typed_data(), T * K * sizeof(float),
                           cudaMemcpyDeviceToHost, stream)) != cudaSuccess) {
    return CudaError(kStart, "copying to staging", e);
  }
  if (x_out->typed_data() != x.typed_data() &&
      (e = cudaMemcpyAsync(x_out->typed_data(), x.typed_data(), T * D * sizeof(float),
                           cudaMemcpyDeviceToDevice, stream)) != cudaSuccess) {
    return CudaError(kStart, "passing x through", e);
  }
  if ((e = cudaMemsetAsync(ticket->typed_data(), 0, 2 * sizeof(int32_t), stream)) !=
      cudaSuccess) {
    return CudaError(kStart, "writing the ticket", e);
  }
  Job* job = new Job{flag, seq, pool, layer, T, D, K, ffn_dim, bf16_activations, activation,
                     st->x.host, st->ids.host, st->weights.host, st->y.host};
  if ((e = cudaLaunchHostFunc(stream, PostJob, job)) != cudaSuccess) {
    delete job;
    return CudaError(kStart, "cudaLaunchHostFunc", e);
  }
  return ffi::Error::Success();
}

ffi::Error HostExperts::Done(cudaStream_t stream, ffi::Buffer<ffi::S32> ticket,
                             ffi::Buffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> y_out) {
  int slot;
  unsigned int seq;
  int64_t elements;
  const float* host_y;
  WaitValueFn wait;
  const unsigned int* flag_device;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = streams_.find(stream);
    auto job = found == streams_.end() ? decltype(found->second->pending)::iterator()
                                       : found->second->pending.find(ticket.untyped_data());
    if (found == streams_.end() || job == found->second->pending.end()) {
      return Invalid(kDone, "no host experts job was started on this stream with this ticket "
                            "(the ticket must come from host_experts_start unchanged)");
    }
    StreamState& state = *found->second;
    std::tie(slot, seq) = job->second;
    state.pending.erase(job);
    elements = state.staging[slot].elements;
    host_y = state.staging[slot].y.device;
    wait = wait_value_;
    flag_device = state.flags.device + slot;
  }
  if (static_cast<int64_t>(y.element_count()) != elements) {
    return Invalid(kDone, "y has " + std::to_string(y.element_count()) +
                              " elements but its job has " + std::to_string(elements));
  }
  cudaError_t e = cudaSuccess;
  if (wait != nullptr) {
    const CUresult r = wait(reinterpret_cast<CUstream>(stream),
                            reinterpret_cast<CUdeviceptr>(flag_device), seq,
                            CU_STREAM_WAIT_VALUE_GEQ);
    if (r != CUDA_SUCCESS) {
      std::lock_guard<std::mutex> lock(mutex_);
      wait_value_ = nullptr;
      wait_mode_ = "spin kernel (cuStreamWaitValue32 failed with CUresult " +
                   std::to_string(static_cast<int>(r)) + ")";
      wait = nullptr;
    }
  }
  if (wait == nullptr) {
    e = LaunchSpinWait(flag_device, seq, stream);
    if (e != cudaSuccess) return CudaError(kDone, "launching the wait", e);
  }
  e = LaunchAddHostPart(y_out->typed_data(), y.typed_data(), host_y, elements, stream);
  if (e != cudaSuccess) return CudaError(kDone, "adding the host part", e);
  return ffi::Error::Success();
}

// -- Fill from the mapped pool -------------------------------------------------------------------

constexpr const char* kFill = "ftjax_cuda_pool_fill";

ffi::Error PoolFillImpl(cudaStream_t stream, ffi::AnyBuffer slots, ffi::Buffer<ffi::S32> src,
                        ffi::Buffer<ffi::S32> dst, int64_t pool_handle,
                        ffi::Result<ffi::AnyBuffer> out) {
  const Pool* pool = FindPool(pool_handle);
  if (pool == nullptr) return Invalid(kFill, "no registered pool " + std::to_string(pool_handle));
  const auto sd = slots.dimensions();
  if (sd.size() != 2 || sd[1] != pool->block) {
    return Invalid(kFill,
                   "slots must be [N, P] with the pool's P = " + std::to_string(pool->block));
  }
  if (static_cast<int64_t>(ffi::ByteWidth(slots.element_type())) != pool->itemsize) {
    return Invalid(kFill, "slots must have the pool's dtype");
  }
  const auto srcd = src.dimensions();
  if (srcd.size() != 2 || srcd[1] != 2 || dst.dimensions().size() != 1 ||
      dst.dimensions()[0] != srcd[0]) {
    return Invalid(kFill, "src must be [M, 2] and dst [M]");
  }
  const int64_t block_bytes = pool->block * pool->itemsize;
  if (block_bytes % 16 != 0) return Invalid(kFill, "a block must be a multiple of 16 bytes");
  cudaError_t e;
  if (out->untyped_data() != slots.untyped_data()) {  // not donated: XLA gave a new buffer
    e = cudaMemcpyAsync(out->untyped_data(), slots.untyped_data(), slots.size_bytes(),
                        cudaMemcpyDeviceToDevice, stream);
    if (e != cudaSuccess) return CudaError(kFill, "copying the slots", e);
  }
  HostExperts& host = HostExperts::Instance();
  if ((e = host.EnsureInit()) != cudaSuccess) {
    return CudaError(kFill, "allocating mapped memory", e);
  }
  e = LaunchPoolFill(static_cast<char*>(out->untyped_data()), sd[0], pool->device, pool->layers,
                     pool->experts, block_bytes, src.typed_data(), dst.typed_data(), srcd[0],
                     host.bad_rows_device(), stream);
  if (e != cudaSuccess) return CudaError(kFill, "launching the copy kernel", e);
  return ffi::Error::Success();
}

// -- Whole layers on a side stream (streamed prefill) -------------------------------------------

constexpr const char* kFetchStart = "ftjax_cuda_fetch_layer_start";
constexpr const char* kFetchDone = "ftjax_cuda_fetch_layer_done";

// Per compute stream: the side stream its layer copies run on, and the copies in flight keyed by
// their destination buffer (which done receives).
struct FetchState {
  cudaStream_t side = nullptr;
  std::map<const void*, cudaEvent_t> in_flight;
};

std::mutex fetch_mutex;
std::map<cudaStream_t, FetchState> fetches;

ffi::Error FetchStartImpl(cudaStream_t stream, int64_t pool_handle, int64_t layer,
                          ffi::Result<ffi::AnyBuffer> block) {
  const Pool* pool = FindPool(pool_handle);
  if (pool == nullptr) {
    return Invalid(kFetchStart, "no registered pool " + std::to_string(pool_handle));
  }
  if (layer < 0 || layer >= pool->layers) {
    return Invalid(kFetchStart, "layer " + std::to_string(layer) + " is outside the pool");
  }
  const int64_t bytes = pool->experts * pool->block * pool->itemsize;
  if (static_cast<int64_t>(block->size_bytes()) != bytes) {
    return Invalid(kFetchStart, "the block must hold one whole layer of the pool");
  }
  std::lock_guard<std::mutex> lock(fetch_mutex);
  FetchState& state = fetches[stream];
  cudaError_t e;
  if (state.side == nullptr &&
      (e = cudaStreamCreateWithFlags(&state.side, cudaStreamNonBlocking)) != cudaSuccess) {
    return CudaError(kFetchStart, "creating the side stream", e);
  }
  // The copy may start once the compute stream has reached this point (the block's memory is
  // XLA's from here on), and runs beside the compute stream's later work.
  cudaEvent_t ready, copied;
  if ((e = cudaEventCreateWithFlags(&ready, cudaEventDisableTiming)) != cudaSuccess ||
      (e = cudaEventCreateWithFlags(&copied, cudaEventDisableTiming)) != cudaSuccess ||
      (e = cudaEventRecord(ready, stream)) != cudaSuccess ||
      (e = cudaStreamWaitEvent(state.side, ready, 0)) != cudaSuccess ||
      (e = cudaMemcpyAsync(block->untyped_data(), pool->host + layer * bytes, bytes,
                           cudaMemcpyHostToDevice, state.side)) != cudaSuccess ||
      (e = cudaEventRecord(copied, state.side)) != cudaSuccess) {
    return CudaError(kFetchStart, "starting the layer copy", e);
  }
  cudaEventDestroy(ready);  // released once the wait on it has completed
  state.in_flight[block->untyped_data()] = copied;
  return ffi::Error::Success();
}

ffi::Error FetchDoneImpl(cudaStream_t stream, ffi::AnyBuffer block,
                         ffi::Result<ffi::AnyBuffer> out) {
  cudaEvent_t copied;
  {
    std::lock_guard<std::mutex> lock(fetch_mutex);
    auto state = fetches.find(stream);
    auto found = state == fetches.end() ? std::map<const void*, cudaEvent_t>::iterator()
                                        : state->second.in_flight.find(block.untyped_data());
    if (state == fetches.end() || found == state->second.in_flight.end()) {
      return Invalid(kFetchDone, "no layer copy was started on this stream into this block "
                                 "(the block must come from fetch_layer_start unchanged)");
    }
    copied = found->second;
    state->second.in_flight.erase(found);
  }
  cudaError_t e = cudaStreamWaitEvent(stream, copied, 0);
  if (e != cudaSuccess) return CudaError(kFetchDone, "waiting for the layer copy", e);
  cudaEventDestroy(copied);
  if (out->untyped_data() != block.untyped_data() &&
      (e = cudaMemcpyAsync(out->untyped_data(), block.untyped_data(), block.size_bytes(),
                           cudaMemcpyDeviceToDevice, stream)) != cudaSuccess) {
    return CudaError(kFetchDone, "passing the block through", e);
  }
  return ffi::Error::Success();
}

ffi::Error StartImpl(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> ids,
                     ffi::Buffer<ffi::F32> weights, int64_t pool, int64_t layer,
                     int64_t ffn_dim, bool bf16_activations, std::string_view activation,
                     float alpha, float limit, bool biases, ffi::ResultBuffer<ffi::S32> ticket,
                     ffi::ResultBuffer<ffi::F32> x_out) {
  // The expert's variant, as ftjax_expert_ffn's attributes (expert_ffn.h).
  ExpertActivation act{Activation::kSwiglu, alpha, limit, biases};
  if (activation == "clamped_swiglu") {
    act.kind = Activation::kClampedSwiglu;
  } else if (activation != "swiglu") {
    return Invalid(kStart, "activation must be \"swiglu\" or \"clamped_swiglu\", got \"" +
                               std::string(activation) + "\"");
  }
  return HostExperts::Instance().Start(stream, x, ids, weights, pool, layer, ffn_dim,
                                       bf16_activations, act, ticket, x_out);
}

ffi::Error DoneImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> ticket, ffi::Buffer<ffi::F32> y,
                    ffi::ResultBuffer<ffi::F32> y_out) {
  return HostExperts::Instance().Done(stream, ticket, y, y_out);
}

}  // namespace

std::string RegisterPool(uintptr_t address, int64_t bytes, int64_t layers, int64_t experts,
                         int64_t block, int64_t itemsize, int64_t* handle) {
  std::lock_guard<std::mutex> lock(pools_mutex);
  for (size_t i = 0; i < pools.size(); ++i) {
    if (reinterpret_cast<uintptr_t>(pools[i].host) == address && pools[i].bytes == bytes &&
        pools[i].block == block && pools[i].experts == experts) {
      *handle = static_cast<int64_t>(i);
      return "";
    }
  }
  if (bytes != layers * experts * block * itemsize) return "bytes != L * E * P * itemsize";
  // The mapped flags and the fill kernel's bad-row counter: set up before any program runs.
  cudaError_t e = HostExperts::Instance().EnsureInit();
  if (e != cudaSuccess) return std::string("allocating mapped memory: ") + cudaGetErrorString(e);
  Pool pool;
  pool.host = reinterpret_cast<const char*>(address);
  pool.bytes = bytes;
  pool.layers = layers;
  pool.experts = experts;
  pool.block = block;
  pool.itemsize = itemsize;
  void* host = reinterpret_cast<void*>(address);
  cudaPointerAttributes attributes{};
  e = cudaPointerGetAttributes(&attributes, host);
  if (e == cudaSuccess && attributes.type == cudaMemoryTypeHost) {
    // Pinned already (XLA's pinned_host memory): map it, or learn where it is mapped.
    void* device = attributes.devicePointer;
    if (device == nullptr && (e = cudaHostGetDevicePointer(&device, host, 0)) != cudaSuccess) {
      return std::string("pinned memory not mapped for the device: ") + cudaGetErrorString(e);
    }
    pool.device = static_cast<const char*>(device);
  } else {
    cudaGetLastError();  // clear a sticky "invalid value" from the query of pageable memory
    e = cudaHostRegister(host, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable |
                                             cudaHostRegisterReadOnly);
    if (e != cudaSuccess) {
      cudaGetLastError();
      e = cudaHostRegister(host, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
    }
    if (e != cudaSuccess) return std::string("cudaHostRegister: ") + cudaGetErrorString(e);
    void* device = nullptr;
    e = cudaHostGetDevicePointer(&device, host, 0);
    if (e != cudaSuccess) return std::string("cudaHostGetDevicePointer: ") + cudaGetErrorString(e);
    pool.device = static_cast<const char*>(device);
    pool.registered_here = true;
  }
  pools.push_back(pool);
  *handle = static_cast<int64_t>(pools.size() - 1);
  return "";
}

void ModuleStats(std::vector<std::pair<std::string, double>>* numbers, std::string* wait,
                 std::string* last_error) {
  HostExperts::Instance().Stats(numbers, wait, last_error);
  std::lock_guard<std::mutex> lock(pools_mutex);
  numbers->push_back({"pools", static_cast<double>(pools.size())});
}

}  // namespace ftjax::cuda

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxCudaPoolFill, ftjax::cuda::PoolFillImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()         // slots [N, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // src [M, 2]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // dst [M]
                                  .Attr<int64_t>("pool")
                                  .Ret<ffi::AnyBuffer>());       // slots (aliased)

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxCudaHostExpertsStart, ftjax::cuda::StartImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, D]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids [T, K]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights [T, K]
                                  .Attr<int64_t>("pool")
                                  .Attr<int64_t>("layer")
                                  .Attr<int64_t>("ffn_dim")
                                  .Attr<bool>("bf16_activations")
                                  .Attr<std::string_view>("activation")  // expert_ffn.h
                                  .Attr<float>("alpha")
                                  .Attr<float>("limit")
                                  .Attr<bool>("biases")
                                  .Ret<ffi::Buffer<ffi::S32>>()   // ticket [2]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // x (aliased)

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxCudaHostExpertsDone, ftjax::cuda::DoneImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // ticket [2]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // y, the device part [T, D]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y + host part (aliased)

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxCudaFetchLayerStart, ftjax::cuda::FetchStartImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("pool")
                                  .Attr<int64_t>("layer")
                                  .Ret<ffi::AnyBuffer>());  // the layer [E, P], being copied

XLA_FFI_DEFINE_HANDLER_SYMBOL(FtjaxCudaFetchLayerDone, ftjax::cuda::FetchDoneImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()    // the block from start
                                  .Ret<ffi::AnyBuffer>());  // the same, copied (aliased)
