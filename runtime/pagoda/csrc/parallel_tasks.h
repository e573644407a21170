// Work split for the CPU kernels: runs of tasks handed out from a shared counter, shrinking as the work runs out.
//
// at::parallel_for gives each thread an equal share up front. When the OS deschedules one of the threads
// (another process, or the server's own Python thread, on its core), the whole call then waits for that
// thread's share. Here threads claim runs of consecutive tasks as they come for them, so the others take
// over a descheduled thread's work. Runs start long (a quarter of a fair share: decode's matmuls stream
// the weight in long sequential runs the hardware prefetcher follows; single tasks handed out one by one
// were ~10 % slower) and shrink with what is left (guided scheduling), so that at the end the threads
// wait for one task at most, not one run: a fixed quarter-share run left a decode matmul's 18 blocks split
// 10 to 8 between two threads.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace pagoda {

// Calls run(task) for task in [0, num_tasks) on torch's intra-op threads, each task exactly once.
template <typename Run>
void parallel_tasks(int64_t num_tasks, const Run& run) {
  constexpr int64_t kChunksPerThread = 4;  // the first run: this fraction of a fair share
  if (num_tasks <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_tasks);
  if (threads == 1) {
    for (int64_t task = 0; task < num_tasks; ++task) run(task);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t first = next.load(std::memory_order_relaxed);
    while (first < num_tasks) {
      const int64_t chunk = std::max<int64_t>(1, (num_tasks - first) / (threads * kChunksPerThread));
      if (!next.compare_exchange_weak(first, first + chunk, std::memory_order_relaxed)) continue;  // first reloaded
      for (int64_t task = first; task < std::min(first + chunk, num_tasks); ++task) run(task);
      first = next.load(std::memory_order_relaxed);
    }
  });
}

}  // namespace pagoda
