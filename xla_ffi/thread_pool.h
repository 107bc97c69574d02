// Parallel loops for the host kernels: XLA's intra-op pool (ffi::ThreadPool, the default) or a
// persistent worker pool of ftjax's own (FTJAX_THREAD_POOL=own), chosen per call.
//
// Which one, and why. Both were measured on the 2-core Zen 4 development VM in one run of
// benchmarks/expert_kernel.py (medians of 15 alternating rounds; results/expert_kernel.json):
//   - each kernel alone: speed of ftjax's pool over XLA's 1.00 on the batch-1 expert kernel (8
//     Qwen3-30B-A3B experts, ~1.5 ms), 1.01 on the lm_head GEMV (~12.5 ms), 0.98 on the
//     o-projection [2048, 4096] (~190 us), 1.11 on the router [128, 2048] (~15 us): a tie except
//     for the smallest op, where ftjax's spinning workers hand off faster;
//   - the kernels between XLA:CPU ops, as in a decode step (a scan of q-projection GEMV, an XLA
//     matmul and the expert kernel): 0.93, i.e. 2.11 ms per step on XLA's pool against 2.34 on
//     ftjax's (an earlier separate A/B: 2.39 vs 2.65 and 2.75 vs 3.10 ms; 10-16% worse still
//     with a 5 us spin instead of 100 us).
// So XLA's pool is the default. Why it wins where it matters: on XLA:CPU the handler already runs
// on one of XLA's intra-op threads, and XLA's other thread is awake (spinning for work) after the
// previous op; handing it the second half of the work needs no extra thread. A pool of our own
// adds a third runnable thread on two cores, which competes with XLA's threads around every call.
// ftjax's pool stays available for measurements and for callers outside XLA's executor; both
// give bitwise-identical results (each output element is summed in a fixed order).

#ifndef FTJAX_XLA_FFI_THREAD_POOL_H_
#define FTJAX_XLA_FFI_THREAD_POOL_H_

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ftjax {

// A type-erased reference to a callable `void(int64_t task, int worker)`; the callable must
// outlive the ParallelFor call that uses it.
struct TaskFunction {
  void* context;
  void (*call)(void* context, int64_t task, int worker);
  void operator()(int64_t task, int worker) const { call(context, task, worker); }
};

template <typename F>
TaskFunction MakeTaskFunction(F& f) {
  return {&f, [](void* context, int64_t task, int worker) {
            (*static_cast<F*>(context))(task, worker);
          }};
}

// ftjax's persistent pool: num_threads - 1 worker threads plus the calling thread.
//
// Lifetime: created on first use by Instance() and never destroyed (the threads sleep when idle
// and end with the process; joining them during static destruction could race with XLA's own
// teardown). A process that forks gets a new pool in the child on its first use there. The size
// is std::thread::hardware_concurrency(), or FTJAX_NUM_THREADS when set, read once at creation;
// FTJAX_PIN_THREADS=1 pins worker i to the i-th CPU of the process's affinity mask.
//
// Handoff: the caller publishes a job and works on it too; tasks are claimed from an atomic
// counter. Idle workers spin for kSpinMicroseconds after their last job (so the next call of a
// decode step starts within ~1 us) and then sleep on a condition variable (so an idle engine
// costs no CPU). One job runs at a time: a second, concurrent caller runs its tasks on its own
// thread instead of waiting.
class WorkerPool {
 public:
  static WorkerPool& Instance();

  int num_threads() const { return num_threads_; }

  // Calls fn(task, worker) for every task in [0, num_tasks), worker in [0, num_threads()) (0 is
  // the caller), and returns when all calls have returned.
  void Run(int64_t num_tasks, TaskFunction fn);

  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

 private:
  static constexpr int64_t kSpinMicroseconds = 100;

  WorkerPool(int num_threads, bool pin);
  void WorkerLoop(int worker, int cpu);
  uint64_t WaitForJob(uint64_t seen_generation);
  void RunTasks(TaskFunction fn, int64_t num_tasks, int worker);

  const int num_threads_;
  std::mutex run_mutex_;  // held by the caller whose job runs

  // The job. Written by the run_mutex_ holder only while generation_ is odd and no worker is
  // inside a job (in_job_ == 0); read by workers after they see an even generation.
  TaskFunction job_fn_{};
  int64_t job_tasks_ = 0;

  alignas(64) std::atomic<uint64_t> generation_{0};  // even: job published; odd: being written
  alignas(64) std::atomic<int64_t> next_task_{0};
  alignas(64) std::atomic<int64_t> done_tasks_{0};
  alignas(64) std::atomic<int> in_job_{0};  // workers between seeing a job and leaving it
  std::atomic<int> sleepers_{0};
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::vector<std::thread> threads_;
};

enum class PoolKind { kOwn, kXla };

// The threads one FFI call runs on.
class Workers {
 public:
  // FTJAX_THREAD_POOL = "xla" (default: XLA's intra-op pool, from the handler's
  // ffi::Ctx<ffi::ThreadPool>, of which at most FTJAX_NUM_THREADS threads are used) or "own"
  // (WorkerPool); read on every call. Sets `error` for another value.
  static Workers ForCall(xla::ffi::ThreadPool* xla_pool, std::string* error);

  PoolKind kind() const { return kind_; }
  int num_workers() const { return num_workers_; }

  // Calls f(task, worker) for every task in [0, num_tasks), spread over the workers;
  // worker < num_workers() (for per-worker scratch). Returns when all are done.
  template <typename F>
  void ParallelFor(int64_t num_tasks, F&& f) const {
    if (num_tasks <= 0) return;
    Run(num_tasks, MakeTaskFunction(f));
  }

 private:
  Workers(PoolKind kind, int num_workers, xla::ffi::ThreadPool* xla_pool)
      : kind_(kind), num_workers_(num_workers), xla_pool_(xla_pool) {}
  void Run(int64_t num_tasks, TaskFunction fn) const;
  void RunOnXlaPool(int64_t num_tasks, TaskFunction fn) const;

  PoolKind kind_;
  int num_workers_;
  xla::ffi::ThreadPool* xla_pool_;
};

}  // namespace ftjax

#endif  // FTJAX_XLA_FFI_THREAD_POOL_H_
