// Work split for the CPU kernels: tasks handed out one at a time from a shared counter.
//
// at::parallel_for gives each thread an equal share up front. When the OS deschedules one of the threads
// (another process, or the server's own Python thread, on its core), the whole call then waits for that
// thread's share; with tasks handed out as threads come for them, the others take over its work and the
// call waits for one task at most.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdint>

namespace pagoda {

// Calls run(task) for task in [0, num_tasks) on torch's intra-op threads, each task exactly once.
template <typename Run>
void parallel_tasks(int64_t num_tasks, const Run& run) {
  if (num_tasks <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_tasks);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t task = next.fetch_add(1, std::memory_order_relaxed); task < num_tasks;
         task = next.fetch_add(1, std::memory_order_relaxed))
      run(task);
  });
}

}  // namespace pagoda
