// Work split for the CPU kernels: tasks handed out one at a time from a shared counter.
//
// at::parallel_for gives each thread an equal share up front. When the OS deschedules one of the threads
// (another process, or the server's own Python thread, on its core), the whole call then waits for that
// thread's share; with runs of tasks handed out as threads come for them, the others take over its work
// and the call waits for one run at most (a quarter of a share). On a quiet machine this is as fast as the
// equal split; single tasks handed out one by one were ~10 % slower at decode's matmuls, whose threads then
// hop across the weight instead of streaming it.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>

namespace pagoda {

// Calls run(task) for task in [0, num_tasks) on torch's intra-op threads, each task exactly once. A thread
// claims kChunksPerThread-th of its fair share at a time, a run of consecutive tasks, so that memory it
// streams (a matmul's weight) is read in long sequential runs the hardware prefetcher follows.
template <typename Run>
void parallel_tasks(int64_t num_tasks, const Run& run) {
  constexpr int64_t kChunksPerThread = 4;
  if (num_tasks <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_tasks);
  const int64_t chunk = std::max<int64_t>(1, num_tasks / (threads * kChunksPerThread));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t first = next.fetch_add(chunk, std::memory_order_relaxed); first < num_tasks;
         first = next.fetch_add(chunk, std::memory_order_relaxed))
      for (int64_t task = first; task < std::min(first + chunk, num_tasks); ++task) run(task);
  });
}

}  // namespace pagoda
