// cadence's CPU kernels: the parallel loop over their own spinning workers.
// A part of cpu_kernels.cc's one translation unit (see there), included by it alone.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// ---------------------------------------------------------------------------------------------
// Parallel loop over [0, items): the calling thread and cadence's own workers.
//
// A decode step calls the kernels ~150 times, 15-80 us each for a small model. Handing each
// call's work to the XLA:CPU thread pool wakes a sleeping thread every time, and the wake-up
// takes as long as the work: the calling thread did most of it alone. So the kernels keep
// their own workers (as many as the FFI pool has threads, less the caller): after a job each
// spins for a while (kSpin) waiting for the next one, which in a decode step comes within
// microseconds, then sleeps until one comes. A caller that finds the workers busy with
// another caller's job (two engines in one process) runs its own job alone.

constexpr auto kSpin = std::chrono::microseconds(200);

class Workers {
 public:
  static Workers& get(int threads) {
    static Workers* workers = new Workers(threads - 1);  // lives as long as the process
    return *workers;
  }

  // body(first, last) over chunks of `grain` items, on this thread and the workers.
  template <typename Body>
  void run(int64_t items, int64_t grain, const Body& body) {
    const int64_t chunks = (items + grain - 1) / grain;
    std::unique_lock<std::mutex> busy(submit_, std::try_to_lock);
    if (chunks <= 1 || threads_.empty() || !busy.owns_lock()) {
      body(0, items);
      return;
    }
    Job job;
    job.chunks = chunks;
    job.run_chunk = [&](int64_t c) { body(c * grain, std::min(items, (c + 1) * grain)); };
    job.id = ++last_id_;
    current_.store(&job);
    current_id_.store(job.id);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_);
      wake_.notify_all();
    }
    work_on(job);
    while (job.done.load(std::memory_order_acquire) < chunks) _mm_pause();
    current_.store(nullptr);
    while (active_.load() > 0) _mm_pause();  // no worker still holds `job`
  }

 private:
  struct Job {
    uint64_t id = 0;
    int64_t chunks = 0;
    std::function<void(int64_t)> run_chunk;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };

  explicit Workers(int count) {
    for (int i = 0; i < count; ++i) threads_.emplace_back([this] { loop(); }).detach();
  }

  static void work_on(Job& job) {
    for (int64_t c; (c = job.next.fetch_add(1)) < job.chunks;) {
      job.run_chunk(c);
      job.done.fetch_add(1, std::memory_order_release);
    }
  }

  void loop() {
    uint64_t seen = 0;
    for (;;) {
      auto since = std::chrono::steady_clock::now();
      for (int spins = 0; current_id_.load(std::memory_order_relaxed) == seen; ++spins) {
        _mm_pause();
        if ((spins & 63) != 63) continue;
        std::this_thread::yield();  // a thread waiting for this core (the host's) runs first
        if (std::chrono::steady_clock::now() - since > kSpin) {
          std::unique_lock<std::mutex> lock(sleep_);
          sleepers_.fetch_add(1);
          wake_.wait(lock, [&] { return current_id_.load() != seen; });
          sleepers_.fetch_sub(1);
          since = std::chrono::steady_clock::now();
        }
      }
      // Announce this thread before looking at the job: its submitter waits for active_ to
      // drop to 0 after unpublishing it, so a job seen here outlives its use.
      active_.fetch_add(1);
      Job* job = current_.load();
      if (job != nullptr) {
        seen = job->id;
        work_on(*job);
      } else {
        seen = current_id_.load();  // that job is over; wait for the next
      }
      active_.fetch_sub(1);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex submit_;  // one job at a time
  uint64_t last_id_ = 0;
  std::atomic<Job*> current_{nullptr};
  std::atomic<uint64_t> current_id_{0};
  std::atomic<int> active_{0};
  std::atomic<int> sleepers_{0};
  std::mutex sleep_;
  std::condition_variable wake_;
};

template <typename Body>
void parallel_for(ffi::ThreadPool& pool, int64_t items, int64_t grain, Body body) {
  Workers::get(static_cast<int>(pool.num_threads())).run(items, grain, body);
}

}  // namespace
