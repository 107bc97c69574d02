// Persistent worker pool and XLA intra-op pool adapter (thread_pool.h).

#include "thread_pool.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace ftjax {
namespace {

inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}

// Waits until done() is true: spins (the other workers' last tasks usually end within
// microseconds), then yields the CPU, so that on an oversubscribed machine a preempted worker
// that holds the last task can run on this core.
template <typename Done>
void WaitUntil(Done done) {
  for (int round = 0; !done(); ++round) {
    if (round < 4096) {
      CpuRelax();
    } else {
      std::this_thread::yield();
    }
  }
}

int EnvInt(const char* name, int fallback) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  return (end != text && *end == '\0' && value > 0 && value <= 4096) ? static_cast<int>(value)
                                                                     : fallback;
}

// The CPUs this process may run on, in order (empty where affinity is not supported: no pinning).
std::vector<int> AllowedCpus() {
  std::vector<int> cpus;
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
      if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
    }
  }
#endif
  return cpus;
}

}  // namespace

WorkerPool& WorkerPool::Instance() {
  // Created once per process (and again in a forked child, whose copy has no worker threads).
  // Deliberately leaked: see the class comment.
  static std::mutex creation_mutex;
  static WorkerPool* pool = nullptr;
  static pid_t pool_pid = 0;
  std::lock_guard<std::mutex> lock(creation_mutex);
  if (pool == nullptr || pool_pid != getpid()) {
    const int hardware = static_cast<int>(std::thread::hardware_concurrency());
    const int num_threads = EnvInt("FTJAX_NUM_THREADS", hardware > 0 ? hardware : 1);
    const char* pin = std::getenv("FTJAX_PIN_THREADS");
    pool = new WorkerPool(num_threads, pin != nullptr && std::strcmp(pin, "1") == 0);
    pool_pid = getpid();
  }
  return *pool;
}

WorkerPool::WorkerPool(int num_threads, bool pin) : num_threads_(num_threads) {
  const std::vector<int> cpus = pin ? AllowedCpus() : std::vector<int>();
  threads_.reserve(num_threads - 1);
  for (int worker = 1; worker < num_threads; ++worker) {
    const int cpu = cpus.empty() ? -1 : cpus[worker % cpus.size()];
    threads_.emplace_back([this, worker, cpu] { WorkerLoop(worker, cpu); });
    threads_.back().detach();
  }
}

void WorkerPool::RunTasks(TaskFunction fn, int64_t num_tasks, int worker) {
  for (;;) {
    const int64_t task = next_task_.fetch_add(1, std::memory_order_relaxed);
    if (task >= num_tasks) return;
    fn(task, worker);
    done_tasks_.fetch_add(1, std::memory_order_release);
  }
}

uint64_t WorkerPool::WaitForJob(uint64_t seen_generation) {
  auto is_new_job = [&](uint64_t generation) {
    return generation != seen_generation && generation % 2 == 0;
  };
  const auto spin_until =
      std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicroseconds);
  for (int round = 0;; ++round) {
    const uint64_t generation = generation_.load(std::memory_order_acquire);
    if (is_new_job(generation)) return generation;
    CpuRelax();
    if (round % 64 == 63 && std::chrono::steady_clock::now() > spin_until) break;
  }
  std::unique_lock<std::mutex> lock(sleep_mutex_);
  sleepers_.fetch_add(1, std::memory_order_seq_cst);
  uint64_t generation = 0;
  wake_.wait(lock, [&] {
    generation = generation_.load(std::memory_order_seq_cst);
    return is_new_job(generation);
  });
  sleepers_.fetch_sub(1, std::memory_order_relaxed);
  return generation;
}

void WorkerPool::WorkerLoop(int worker, int cpu) {
#if defined(__linux__)
  if (cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    sched_setaffinity(0, sizeof(set), &set);  // best effort
  }
#else
  (void)cpu;
#endif
  uint64_t seen_generation = 0;
  for (;;) {
    const uint64_t generation = WaitForJob(seen_generation);
    seen_generation = generation;
    in_job_.fetch_add(1, std::memory_order_seq_cst);
    // The publisher makes the generation odd before it waits for in_job_ == 0 and rewrites the
    // job; so either it sees us here, or we see its new generation and leave without reading.
    if (generation_.load(std::memory_order_seq_cst) == generation) {
      RunTasks(job_fn_, job_tasks_, worker);
    }
    in_job_.fetch_sub(1, std::memory_order_release);
  }
}

void WorkerPool::Run(int64_t num_tasks, TaskFunction fn) {
  std::unique_lock<std::mutex> lock(run_mutex_, std::try_to_lock);
  if (num_threads_ == 1 || num_tasks == 1 || !lock.owns_lock()) {
    for (int64_t task = 0; task < num_tasks; ++task) fn(task, 0);
    return;
  }
  const uint64_t generation = generation_.load(std::memory_order_relaxed);  // even
  generation_.store(generation + 1, std::memory_order_seq_cst);
  WaitUntil([&] { return in_job_.load(std::memory_order_seq_cst) == 0; });  // the last job's stragglers
  job_fn_ = fn;
  job_tasks_ = num_tasks;
  next_task_.store(0, std::memory_order_relaxed);
  done_tasks_.store(0, std::memory_order_relaxed);
  generation_.store(generation + 2, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> sleep_lock(sleep_mutex_);
    wake_.notify_all();
  }
  RunTasks(fn, num_tasks, /*worker=*/0);
  WaitUntil([&] { return done_tasks_.load(std::memory_order_acquire) >= num_tasks; });
}

Workers Workers::ForCall(xla::ffi::ThreadPool* xla_pool, std::string* error) {
  const char* requested = std::getenv("FTJAX_THREAD_POOL");
  const bool use_xla = requested == nullptr || *requested == '\0' ||
                       std::strcmp(requested, "xla") == 0;
  if (use_xla && xla_pool != nullptr) {
    // XLA's pool has its own size; FTJAX_NUM_THREADS can only lower the count used of it.
    const int64_t pool_threads = std::max<int64_t>(xla_pool->num_threads(), 1);
    const int threads = std::min<int64_t>(pool_threads, EnvInt("FTJAX_NUM_THREADS", 4096));
    return Workers(PoolKind::kXla, threads, xla_pool);
  }
  if (use_xla || std::strcmp(requested, "own") == 0) {
    return Workers(PoolKind::kOwn, WorkerPool::Instance().num_threads(), nullptr);
  }
  *error = std::string("FTJAX_THREAD_POOL = \"") + requested + "\" is not one of xla, own";
  return Workers(PoolKind::kOwn, 1, nullptr);
}

void Workers::Run(int64_t num_tasks, TaskFunction fn) const {
  if (kind_ == PoolKind::kXla) {
    RunOnXlaPool(num_tasks, fn);
  } else {
    WorkerPool::Instance().Run(num_tasks, fn);
  }
}

namespace {

// One ParallelFor on XLA's pool. Heap-allocated and shared with the scheduled helpers: a helper
// may start after the caller has returned (XLA does not promise when, or whether in parallel, a
// scheduled task runs), and then finds no task left.
struct XlaJob {
  TaskFunction fn;
  int64_t num_tasks;
  std::atomic<int64_t> next_task{0};
  std::atomic<int64_t> done_tasks{0};
  std::atomic<int> next_worker{1};

  void RunTasks(int worker) {
    for (;;) {
      const int64_t task = next_task.fetch_add(1, std::memory_order_relaxed);
      if (task >= num_tasks) return;
      fn(task, worker);
      done_tasks.fetch_add(1, std::memory_order_release);
    }
  }
};

}  // namespace

void Workers::RunOnXlaPool(int64_t num_tasks, TaskFunction fn) const {
  if (num_workers_ == 1 || num_tasks == 1) {
    for (int64_t task = 0; task < num_tasks; ++task) fn(task, 0);
    return;
  }
  auto job = std::make_shared<XlaJob>();
  job->fn = fn;
  job->num_tasks = num_tasks;
  for (int helper = 1; helper < num_workers_ && helper < num_tasks; ++helper) {
    xla_pool_->Schedule([job] {
      const int worker = job->next_worker.fetch_add(1, std::memory_order_relaxed);
      job->RunTasks(worker);
    });
  }
  job->RunTasks(/*worker=*/0);
  // The caller only waits for the tasks, never for a helper to start: if XLA's threads are all
  // busy (the caller may be one of them), the caller has done every task itself by now.
  WaitUntil([&] { return job->done_tasks.load(std::memory_order_acquire) >= num_tasks; });
}

}  // namespace ftjax
