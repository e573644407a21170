// What the paged decode kernels share (attention/paged_decode_cpu.cpp's AVX512_BF16 decode, paged_decode_avx2.h,
// paged_decode_neon.h): the sweep of a sequence's blocks in memory order with a look-ahead prefetch (AheadPrefetch),
// and the dispatch of a unit of query heads to a kernel fixed at compile time. No ATen:
// the NEON kernel also builds into tests/kernels/neon_kernels_harness.cpp.
//
// A decode work item is a sequence and some of its KV heads. Block by block, the item reads the rows of all its
// heads (once for the scores, once for P @ V): in the head-major cache a block's heads are contiguous, and a
// context's blocks mostly follow each other (a prompt's are allocated together), so the item reads long runs
// that the hardware prefetcher follows while the kernel computes. Software prefetch is for a block that does
// not follow its predecessor in memory (a run the hardware prefetcher cannot guess) and, on a CPU with AMX, for
// the page starts of every block, where the hardware's stream stops. Prefetching every block whole, or into L1,
// was slower (AVX512_BF16, Zen 4): 4 blocks of 3 heads overflow L1, and requests the hardware would make anyway
// take the core's miss buffers. What is prefetched is the kernel's to say
// (AheadPrefetch).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace pagoda::attention {

#if defined(__x86_64__) || defined(__i386__)
// prefetcht1 (into L2), after one real load of the block's first line: a prefetch that misses the TLB may be
// dropped
struct PrefetchL2X86 {
  static constexpr bool kTouchFirst = true;
  static void line(const char* p) { _mm_prefetch(p, _MM_HINT_T1); }
};
#endif

// PRFM PLDL2KEEP (a prefetch for a read, into L2)
struct PrefetchL2Arm {
  static constexpr bool kTouchFirst = false;
  static void line(const char* p) { __builtin_prefetch(p, 0, 2); }
};

// What a sweep prefetches, kAheadBlocks ahead:
// - kRunStarts: every line of the item's rows of a block that starts a new run, nothing of the others;
// - kPageStarts: of every block, its first line and the first line of each 4 KB page its rows enter, so that the
//   hardware prefetcher, which follows a stream within a page and stops at its end, starts one in each. A software
//   prefetch holds one of the core's few fill buffers until its line arrives, so a whole block's ~100 lines (3 KV
//   heads of 16 positions) wait on each other; the hardware's stream fills L2 without them. On the Xeon with AMX
//   (decode attention over 64 contexts of 512 positions, 30 layers' caches, blocks at random) 12.2 -> 17-19 GB/s
//   against kRunStarts, no prefetch at all 15.3. Where blocks follow each other (a prompt's), a run's later blocks
//   too: 24 contexts of 1,150 positions 1,210-1,340 -> 1,160-1,260 us a layer, 64 of 330 990-1,060 -> 940-980, 4 of
//   3,000 610-630 -> 550-590 (`python -m pagoda.bench.cpu_attention`, alternating). Zen was not measured this way:
//   its kernels keep kRunStarts.
enum class AheadPrefetch { kRunStarts, kPageStarts };

// One item's pass over its context's blocks: operator()(cache, visit) calls visit(block's first position, its
// number of positions, the block's rows in cache: its first KV head's first position) for each block in
// order. cache_t: the cache's element (bfloat16, or fp8 for the AVX512_BF16 kernel); kHeadSize: the elements
// of a row; Prefetch: PrefetchL2X86 or PrefetchL2Arm.
template <typename cache_t, int kHeadSize, typename Prefetch>
class BlockSweep {
 public:
  static constexpr int64_t kAheadBlocks = 2;  // how far ahead a block is prefetched (4 was no faster)

  BlockSweep(const int32_t* block_table, int64_t seq_len, int64_t block_size, int64_t block_stride,
             int64_t pos_stride, int64_t head_stride, int64_t num_kv_heads,
             AheadPrefetch ahead = AheadPrefetch::kRunStarts)
      : block_table_(block_table), seq_len_(seq_len), block_size_(block_size), block_stride_(block_stride),
        pos_stride_(pos_stride), head_stride_(head_stride), num_kv_heads_(num_kv_heads),
        num_blocks_((seq_len + block_size - 1) / block_size), ahead_(ahead) {}

  template <typename Visit>
  void operator()(const cache_t* cache, Visit&& visit) const {
    for (int64_t b = 0; b < kAheadBlocks; ++b) prefetch(cache, b);
    for (int64_t b = 0; b < num_blocks_; ++b) {
      prefetch(cache, b + kAheadBlocks);
      const int64_t t0 = b * block_size_;
      visit(t0, std::min(block_size_, seq_len_ - t0), cache + block_table_[b] * block_stride_);
    }
  }

 private:
  // block b's rows of every KV head of the item, as ahead_ says
  void prefetch(const cache_t* cache, int64_t b) const {
    if (b >= num_blocks_) return;
    const char* rows = reinterpret_cast<const char*>(cache + block_table_[b] * block_stride_);
    if (ahead_ == AheadPrefetch::kPageStarts) {
      constexpr uintptr_t kPage = 4096;
      const int64_t extent = (num_kv_heads_ - 1) * head_stride_ + (block_size_ - 1) * pos_stride_ + kHeadSize;
      const uintptr_t first = reinterpret_cast<uintptr_t>(rows), end = first + extent * sizeof(cache_t);
      Prefetch::line(rows);
      for (uintptr_t page = (first | (kPage - 1)) + 1; page < end; page += kPage)
        Prefetch::line(reinterpret_cast<const char*>(page));
      return;
    }
    if (b > 0 && block_table_[b] == block_table_[b - 1] + 1) return;  // within a run: the hardware's
    if constexpr (Prefetch::kTouchFirst) {
      const char first_byte = *reinterpret_cast<const volatile char*>(rows);
      asm volatile("" : : "r"(first_byte));
    }
    for (int64_t h = 0; h < num_kv_heads_; ++h)
      for (int64_t t = 0; t < block_size_; ++t)
        for (int64_t byte = 0; byte < kHeadSize * int64_t(sizeof(cache_t)); byte += 64)
          Prefetch::line(rows + (h * head_stride_ + t * pos_stride_) * int64_t(sizeof(cache_t)) + byte);
  }

  const int32_t* block_table_;
  int64_t seq_len_, block_size_, block_stride_, pos_stride_, head_stride_, num_kv_heads_, num_blocks_;
  AheadPrefetch ahead_;
};

// Calls visit(std::integral_constant<int, n>) for n = count in 1..kMax (the query heads a unit of a kernel takes
// at once, fixed at compile time so that their accumulators live in registers); kMax: 2, 3 or 4
template <int kMax, typename Visit>
inline void with_unit_size(int64_t count, Visit&& visit) {
  static_assert(kMax >= 2 && kMax <= 4, "units of 1 to 2, 3 or 4 query heads");
  switch (count) {
    case 1: visit(std::integral_constant<int, 1>{}); break;
    case 2: visit(std::integral_constant<int, 2>{}); break;
    case 3: if constexpr (kMax >= 3) visit(std::integral_constant<int, 3>{}); break;
    default: if constexpr (kMax >= 4) visit(std::integral_constant<int, 4>{}); break;
  }
}

// P @ V of an item: acc [heads, kHeadSize] = p [heads, padded_len] @ the values, block by block through sweep,
// kUnit query heads of a KV head's group at a time. accumulate16(unit, p, p_stride, values, pos_stride, rows, acc,
// acc_stride) is the ISA's kernel for 16 columns of a unit (unit: std::integral_constant of its query heads).
template <int kUnit, int kHeadSize, typename Sweep, typename cache_t, typename Accumulate16>
inline void values_pass(Sweep& sweep, const cache_t* v_cache, int64_t num_kv_heads, int64_t group, const float* s,
                        int64_t padded_len, int64_t head_stride, int64_t pos_stride, float* acc,
                        Accumulate16&& accumulate16) {
  std::memset(acc, 0, num_kv_heads * group * kHeadSize * sizeof(float));
  sweep(v_cache, [&](int64_t t0, int64_t n, const cache_t* block) {
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t g0 = 0; g0 < group; g0 += kUnit) {
        const int64_t first = h * group + g0, count = std::min<int64_t>(kUnit, group - g0);
        const float* p = s + first * padded_len + t0;
        const cache_t* values = block + h * head_stride;
        for (int c = 0; c < kHeadSize; c += 16)
          with_unit_size<kUnit>(count, [&](auto unit) {
            accumulate16(unit, p, padded_len, values + c, pos_stride, n, acc + first * kHeadSize + c, kHeadSize);
          });
      }
  });
}

}  // namespace pagoda::attention
