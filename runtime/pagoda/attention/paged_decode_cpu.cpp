// Decode attention on CPU (one query token per sequence) straight from the paged KV cache; see
// paged_attention_cpu.cpp for the library and csrc/paged_attention_common.h for what decode and prefill share.
//
// Decode reads each sequence's K and V blocks in place through its block table (no gather, no padding to
// the longest context), so every cached byte is read once. Work items are sequences with all their KV heads
// in the bfloat16 path (see decode_bf16), (sequence, KV head) pairs in the others; the query heads sharing a
// KV head (GQA) are scored together against each K row. Scores and the softmax are float32 whatever the
// cache dtype.

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx_tiles.h"
#include "paged_attention_common.h"
#include "paged_decode_amx.h"
#include "paged_decode_sweep.h"
#include "parallel_tasks.h"

#if defined(PAGODA_ISA_AVX2)
#include "paged_decode_avx2.h"
namespace decode_isa = pagoda::attention::avx2;
#elif defined(PAGODA_ISA_NEON)
#include "paged_decode_neon.h"
namespace decode_isa = pagoda::attention::neon;
#endif

namespace pagoda::attention {
namespace {

constexpr int64_t kMaxGroup = 16;

// kHeadSize > 0 fixes the head size at compile time (the common sizes), so the per-row loops unroll into
// registers; 0 reads it from head_size. Positions first..seq_len-1 of the context are read (first > 0: a
// sliding window), each K and V row widened to float32 once for the whole group.
template <typename scalar_t, typename cache_t, int kHeadSize>
void decode_one(
    const scalar_t* q,        // [G, D] of this (sequence, KV head), row stride q_head_stride
    int64_t q_head_stride,
    const cache_t* k_cache,   // block b, position t, head h at b*block_stride + t*pos_stride + h*head_stride
    const cache_t* v_cache,
    int64_t block_stride, int64_t pos_stride,
    const int32_t* block_table, int64_t first, int64_t seq_len, int64_t block_size,
    int64_t group, int64_t head_size, const Variant& variant,
    int64_t first_head,                     // the group's first query head (its sinks)
    scalar_t* out, int64_t out_head_stride,  // [G, D]
    std::vector<float>& scores) {           // scratch, grown to [G, seq_len - first]
  if constexpr (kHeadSize > 0) head_size = kHeadSize;
  const int64_t len = seq_len - first;
  float qf[kMaxGroup][kMaxHeadSize];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_size; ++d) qf[g][d] = to_float(q[g * q_head_stride + d]) * variant.q_scale;
  if (static_cast<int64_t>(scores.size()) < group * len) scores.resize(group * len);
  float* s = scores.data();  // [G, len]

  alignas(64) float row[kMaxHeadSize];
  for_each_row(k_cache, block_table, first, seq_len, block_size, block_stride, pos_stride, [&](const cache_t* k, int64_t t) {
    load_row(k, row, head_size);
    for (int64_t g = 0; g < group; ++g) {
      float dot = 0.f;
      for (int64_t d = 0; d < head_size; ++d) dot += qf[g][d] * row[d];
      s[g * len + t] = dot;
    }
  });

  float acc[kMaxGroup][kMaxHeadSize];
  for (int64_t g = 0; g < group; ++g) {
    float* sg = s + g * len;
    if (variant.softcap > 0.f)
      for (int64_t t = 0; t < len; ++t) sg[t] = softcap_score(sg[t], variant.softcap);
    float max_score = std::numeric_limits<float>::lowest();
    for (int64_t t = 0; t < len; ++t) max_score = std::max(max_score, sg[t]);
    float total = variant.sink_weight(first_head + g, max_score);
    for (int64_t t = 0; t < len; ++t) {
      sg[t] = exp_nonpositive(sg[t] - max_score);
      total += sg[t];
    }
    const float inv_total = 1.f / total;
    for (int64_t t = 0; t < len; ++t) sg[t] *= inv_total;
    for (int64_t d = 0; d < head_size; ++d) acc[g][d] = 0.f;
  }

  for_each_row(v_cache, block_table, first, seq_len, block_size, block_stride, pos_stride, [&](const cache_t* v, int64_t t) {
    load_row(v, row, head_size);
    for (int64_t g = 0; g < group; ++g) {
      const float p = s[g * len + t];
      for (int64_t d = 0; d < head_size; ++d) acc[g][d] += p * row[d];
    }
  });
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_size; ++d)
      out[g * out_head_stride + d] = from_float<scalar_t>(acc[g][d] * variant.out_scale);
}

#if defined(PAGODA_ISA_AVX512)
// Decode over an fp8 cache with AVX-512 (head size 64 or 128): decode_one's work, with the scores of 16 keys
// reduced together (sum_each16, where decode_one sums each (key, head) across its lanes) and the P @ V
// accumulators of up to 4 query heads in registers for the whole context. Each key or value row is widened
// from fp8 once (16 values per instruction) for all the heads that read it.
template <typename cache_t, int kHeadSize, int kN>
void decode_fp8_unit(const float* qf,  // [kN, kHeadSize], scaled
                     const cache_t* k_cache, const cache_t* v_cache, int64_t block_stride, int64_t pos_stride,
                     const int32_t* block_table, int64_t first, int64_t seq_len, int64_t block_size,
                     const Variant& variant, float* s,  // scratch [kN, seq_len - first]
                     float* out) {                      // [kN, kHeadSize], written
  constexpr int kVecs = kHeadSize / 16;
  const int64_t len = seq_len - first;
  // the rows of positions first, first + 1, ... in order, walking the block table (no division per row; the
  // next block's entry is read only when a row of it is asked for)
  struct Rows {
    const cache_t* cache;
    const int32_t* table;
    int64_t block_size, block_stride, pos_stride, b, offset;
    const cache_t* block;
    Rows(const cache_t* c, const int32_t* t, int64_t first, int64_t bs, int64_t block_s, int64_t pos_s)
        : cache(c), table(t), block_size(bs), block_stride(block_s), pos_stride(pos_s), b(first / bs),
          offset(first % bs), block(c + t[first / bs] * block_s) {}
    const uint8_t* next() {
      if (offset == block_size) {
        offset = 0;
        block = cache + table[++b] * block_stride;
      }
      return reinterpret_cast<const uint8_t*>(block + (offset++) * pos_stride);
    }
  };
  __m512 q[kN][kVecs];
  for (int g = 0; g < kN; ++g)
    for (int i = 0; i < kVecs; ++i) q[g][i] = _mm512_loadu_ps(qf + g * kHeadSize + 16 * i);
  alignas(64) float keys[16][kHeadSize];
  Rows key_rows(k_cache, block_table, first, block_size, block_stride, pos_stride);
  for (int64_t c0 = 0; c0 < len; c0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - c0);
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* k = key_rows.next();
      for (int i = 0; i < kVecs; ++i) _mm512_store_ps(keys[j] + 16 * i, pagoda::upcast_fp8_16<cache_t>(k + 16 * i));
    }
    for (int g = 0; g < kN; ++g) {
      __m512 partial[16];
      for (int64_t j = 0; j < 16; ++j) {
        if (j >= n) {
          partial[j] = _mm512_setzero_ps();
          continue;
        }
        __m512 acc = _mm512_mul_ps(q[g][0], _mm512_load_ps(keys[j]));
        for (int i = 1; i < kVecs; ++i) acc = _mm512_fmadd_ps(q[g][i], _mm512_load_ps(keys[j] + 16 * i), acc);
        partial[j] = acc;
      }
      __m512 dots = sum_each16(partial);
      if (variant.softcap > 0.f) dots = softcap16(dots, variant.softcap);
      _mm512_mask_storeu_ps(s + g * len + c0, static_cast<__mmask16>((1u << n) - 1), dots);
    }
  }
  float totals[kN];
  auto mask_at = [&](int64_t t) { return static_cast<__mmask16>(len - t >= 16 ? 0xFFFF : (1u << (len - t)) - 1); };
  for (int g = 0; g < kN; ++g) {  // softmax, unnormalised: 1 / total goes into the output scale
    float* sg = s + g * len;
    __m512 max16 = _mm512_set1_ps(std::numeric_limits<float>::lowest());
    for (int64_t t = 0; t < len; t += 16)
      max16 = _mm512_mask_max_ps(max16, mask_at(t), max16, _mm512_maskz_loadu_ps(mask_at(t), sg + t));
    const __m512 max_score = _mm512_set1_ps(_mm512_reduce_max_ps(max16));
    __m512 total16 = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
      const __m512 e = _mm512_maskz_mov_ps(
          mask_at(t), exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask_at(t), sg + t), max_score)));
      _mm512_mask_storeu_ps(sg + t, mask_at(t), e);
      total16 = _mm512_add_ps(total16, e);
    }
    totals[g] = _mm512_reduce_add_ps(total16);
  }
  __m512 acc[kN][kVecs];
  for (int g = 0; g < kN; ++g)
    for (int i = 0; i < kVecs; ++i) acc[g][i] = _mm512_setzero_ps();
  Rows value_rows(v_cache, block_table, first, block_size, block_stride, pos_stride);
  for (int64_t t = 0; t < len; ++t) {
    const uint8_t* v = value_rows.next();
    __m512 row[kVecs];
    for (int i = 0; i < kVecs; ++i) row[i] = pagoda::upcast_fp8_16<cache_t>(v + 16 * i);
    for (int g = 0; g < kN; ++g) {
      const __m512 p = _mm512_set1_ps(s[g * len + t]);
      for (int i = 0; i < kVecs; ++i) acc[g][i] = _mm512_fmadd_ps(p, row[i], acc[g][i]);
    }
  }
  for (int g = 0; g < kN; ++g) {
    const __m512 factor = _mm512_set1_ps(variant.out_scale / totals[g]);
    for (int i = 0; i < kVecs; ++i) _mm512_storeu_ps(out + g * kHeadSize + 16 * i, _mm512_mul_ps(acc[g][i], factor));
  }
}

// decode_one's contract, for an fp8 cache: the group's query heads in units of at most 4
template <typename scalar_t, typename cache_t, int kHeadSize>
void decode_fp8(const scalar_t* q, int64_t q_head_stride, const cache_t* k_cache, const cache_t* v_cache,
                int64_t block_stride, int64_t pos_stride, const int32_t* block_table, int64_t first, int64_t seq_len,
                int64_t block_size, int64_t group, const Variant& variant, scalar_t* out, int64_t out_head_stride,
                std::vector<float>& scratch) {
  constexpr int kUnit = 4;
  const int64_t len = seq_len - first;
  if (static_cast<int64_t>(scratch.size()) < kUnit * len) scratch.resize(kUnit * len);
  alignas(64) float qf[kUnit * kHeadSize];
  alignas(64) float o[kUnit * kHeadSize];
  for (int64_t g0 = 0; g0 < group; g0 += kUnit) {
    const int64_t count = std::min<int64_t>(kUnit, group - g0);
    for (int64_t g = 0; g < count; ++g)
      for (int64_t d = 0; d < kHeadSize; ++d)
        qf[g * kHeadSize + d] = to_float(q[(g0 + g) * q_head_stride + d]) * variant.q_scale;
    auto run = [&](auto unit) {
      decode_fp8_unit<cache_t, kHeadSize, decltype(unit)::value>(qf, k_cache, v_cache, block_stride, pos_stride,
                                                                 block_table, first, seq_len, block_size, variant,
                                                                 scratch.data(), o);
    };
    switch (count) {
      case 1: run(std::integral_constant<int, 1>{}); break;
      case 2: run(std::integral_constant<int, 2>{}); break;
      case 3: run(std::integral_constant<int, 3>{}); break;
      default: run(std::integral_constant<int, 4>{}); break;
    }
    for (int64_t g = 0; g < count; ++g)
      for (int64_t d = 0; d < kHeadSize; ++d)
        out[(g0 + g) * out_head_stride + d] = from_float<scalar_t>(o[g * kHeadSize + d]);
  }
}

#endif


#if defined(PAGODA_ISA_AVX512BF16)
// Decode for a bfloat16 or fp8 cache on CPUs with AVX512_BF16: `vdpbf16ps` multiplies bfloat16 pairs straight
// from a bfloat16 cache (no widening pass). An fp8 cache's rows are widened to bfloat16 (exact: byte lookups with
// AVX512_VBMI, upcast_fp8_64_bf16, else upcast_fp8_32_bf16) one block and KV head at a time into a buffer that
// stays in L1, then read as a bfloat16 block's would be; k_scale goes into the softmax scale, v_scale into the
// output. Scores: one instruction per 32 head-dim elements and a horizontal sum
// per (key, head). P @ V: two keys at a time, their value rows interleaved into pairs and the two
// probabilities (rounded to bfloat16, as SDPA's math path does) broadcast as one pair. Needs an even
// block_size, so a pair of keys never straddles two blocks.
//
// A work item is a sequence and a range of its KV heads (all of them when there are sequences enough for
// every thread). Block by block, the K rows of all the item's heads are scored (then their V rows summed)
// in one sweep in memory order (csrc/paged_decode_sweep.h: why, and the prefetch of a block that starts a new
// run). Per query head the P @ V accumulators stay in memory between blocks. Where the CPU has AMX and the item
// fits its tiles (csrc/paged_decode_amx.h), a bfloat16 cache's scores and P @ V are tile products instead: the
// reductions across lanes (score_block) and the broadcast of each probability pair (accumulate_block) kept both
// passes well over what reading the cache takes (24 contexts of 1,152 positions, 30 layers: 36-40 ms against
// 32-35 on AMX).
// (One item per (sequence, KV head), reading 2 KB runs 6 KB apart with prefetches 64 keys ahead into L1,
// took 630-690 us a layer on 40 contexts of 10 MB out of cache; this takes 400-420, ~25 GB/s: what the
// two cores read.)
// softmax of one head's scores sg[0, seq_len), the probabilities rounded to bfloat16 into pg (and a zero
// partner after an odd last key)
inline void softmax_to_bf16(float* sg, uint16_t* pg, int64_t seq_len) {
  auto mask_at = [&](int64_t t) { return static_cast<__mmask16>(seq_len - t >= 16 ? 0xFFFF : (1u << (seq_len - t)) - 1); };
  __m512 max16 = _mm512_set1_ps(std::numeric_limits<float>::lowest());
  for (int64_t t = 0; t < seq_len; t += 16) max16 = _mm512_mask_max_ps(max16, mask_at(t), max16, _mm512_maskz_loadu_ps(mask_at(t), sg + t));
  const __m512 max_score = _mm512_set1_ps(_mm512_reduce_max_ps(max16));
  __m512 total16 = _mm512_setzero_ps();
  for (int64_t t = 0; t < seq_len; t += 16) {
    const __m512 e = _mm512_maskz_mov_ps(mask_at(t), exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask_at(t), sg + t), max_score)));
    _mm512_mask_storeu_ps(sg + t, mask_at(t), e);
    total16 = _mm512_add_ps(total16, e);
  }
  const __m512 inv_total = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total16));
  for (int64_t t = 0; t < seq_len; t += 16)
    avx512::store_bf16x16(pg + t, _mm512_mul_ps(_mm512_maskz_loadu_ps(mask_at(t), sg + t), inv_total), mask_at(t));
  if (seq_len & 1) pg[seq_len] = 0;  // the odd last key's partner weighs nothing
}

// Scores of kN query heads (q: the first, rows q_head_stride apart) against one block's n keys into
// s[g * padded_len + 0..n), scaled. kN is fixed at compile time so that the query rows live in registers.
template <int kHeadSize, int kN>
inline void score_block(const c10::BFloat16* q, int64_t q_head_stride, const c10::BFloat16* block,
                        int64_t pos_stride, int64_t n, float scale, float* s, int64_t padded_len) {
  constexpr int kVecs = kHeadSize / 32;  // 512-bit vectors of bfloat16 per row
  __m512bh qv[kN][kVecs];
  for (int g = 0; g < kN; ++g)
    for (int i = 0; i < kVecs; ++i) qv[g][i] = (__m512bh)_mm512_loadu_si512(q + g * q_head_stride + 32 * i);
  for (int64_t c0 = 0; c0 < n; c0 += 16) {  // 16 keys: their 16 partial sums reduce together
    const int64_t keys = std::min<int64_t>(16, n - c0);
    for (int g = 0; g < kN; ++g) {
      __m512 partial[16];
      for (int64_t j = 0; j < 16; ++j) {
        if (j >= keys) {
          partial[j] = _mm512_setzero_ps();
          continue;
        }
        const c10::BFloat16* k = block + (c0 + j) * pos_stride;
        __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], (__m512bh)_mm512_loadu_si512(k));
        for (int i = 1; i < kVecs; ++i) acc = _mm512_dpbf16_ps(acc, qv[g][i], (__m512bh)_mm512_loadu_si512(k + 32 * i));
        partial[j] = acc;
      }
      const __m512 dots = _mm512_mul_ps(sum_each16(partial), _mm512_set1_ps(scale));
      _mm512_mask_storeu_ps(s + g * padded_len + c0, static_cast<__mmask16>((1u << keys) - 1), dots);
    }
  }
}

// kN query heads' accumulators (acc_mem: [kN, 2 kVecs, 16] floats) += their probabilities over one block's
// n keys (p: bfloat16 bits, rows padded_len apart) @ the block's V rows
template <int kHeadSize, int kN>
inline void accumulate_block(const uint16_t* p, int64_t padded_len, const c10::BFloat16* block,
                             int64_t pos_stride, int64_t n, float* acc_mem) {
  constexpr int kVecs = kHeadSize / 32;
  // acc[g][2i] holds, per 128-bit lane L, outputs 32i + 8L + 0..3; acc[g][2i+1] outputs 32i + 8L + 4..7
  // (the unpack instructions interleave within 128-bit lanes); decode_bf16 puts them back in order
  __m512 acc[kN][2 * kVecs];
  for (int g = 0; g < kN; ++g)
    for (int i = 0; i < 2 * kVecs; ++i) acc[g][i] = _mm512_loadu_ps(acc_mem + (g * 2 * kVecs + i) * 16);
  for (int64_t t = 0; t < n; t += 2) {
    const __mmask32 second = t + 1 < n ? 0xFFFFFFFFu : 0u;  // a row past the context may hold any bits
    for (int i = 0; i < kVecs; ++i) {
      const __m512i v0 = _mm512_loadu_si512(block + t * pos_stride + 32 * i);
      const __m512i v1 = _mm512_maskz_loadu_epi16(second, block + (t + 1) * pos_stride + 32 * i);
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(v0, v1), hi = (__m512bh)_mm512_unpackhi_epi16(v0, v1);
      for (int g = 0; g < kN; ++g) {
        int32_t pair;
        std::memcpy(&pair, p + g * padded_len + t, sizeof(pair));
        const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
        acc[g][2 * i] = _mm512_dpbf16_ps(acc[g][2 * i], w, lo);
        acc[g][2 * i + 1] = _mm512_dpbf16_ps(acc[g][2 * i + 1], w, hi);
      }
    }
  }
  for (int g = 0; g < kN; ++g)
    for (int i = 0; i < 2 * kVecs; ++i) _mm512_storeu_ps(acc_mem + (g * 2 * kVecs + i) * 16, acc[g][i]);
}

// n rows of one KV head's block (rows pos_stride apart) as bfloat16 rows: a bfloat16 cache's in place (rows
// pos_stride apart), an fp8 cache's widened into buffer ([n, kHeadSize], rows kHeadSize apart)
template <int kHeadSize, typename cache_t>
inline std::pair<const c10::BFloat16*, int64_t> bf16_rows(const cache_t* rows, int64_t pos_stride, int64_t n,
                                                          c10::BFloat16* buffer) {
  if constexpr (std::is_same_v<cache_t, c10::BFloat16>) {
    return {rows, pos_stride};
  } else {
    for (int64_t t = 0; t < n; ++t) {
      const auto* bytes = reinterpret_cast<const uint8_t*>(rows + t * pos_stride);
      c10::BFloat16* row = buffer + t * kHeadSize;
#if defined(__AVX512VBMI__)
      for (int i = 0; i < kHeadSize / 64; ++i) {  // byte lookups: 7 instructions for 64 codes
        __m512i first, second;
        pagoda::upcast_fp8_64_bf16<cache_t>(bytes + 64 * i, first, second);
        _mm512_store_si512(row + 64 * i, first);
        _mm512_store_si512(row + 64 * i + 32, second);
      }
#else
      for (int i = 0; i < kHeadSize / 32; ++i)
        _mm512_store_si512(row + 32 * i, pagoda::upcast_fp8_32_bf16<cache_t>(
                                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + 32 * i))));
#endif
    }
    return {buffer, kHeadSize};
  }
}

// One sequence, KV heads 0..num_kv_heads of the pointers given (q/out: their first query head's row); scale: the
// softmax scale (times k_scale for fp8), out_scale: 1 (v_scale for fp8)
template <int kHeadSize, typename cache_t>
void decode_bf16(const c10::BFloat16* q, int64_t q_head_stride, const cache_t* k_cache, const cache_t* v_cache,
                 int64_t block_stride, int64_t pos_stride, int64_t head_stride, int64_t num_kv_heads, int64_t group,
                 const int32_t* block_table, int64_t seq_len, int64_t block_size, float scale, float out_scale,
                 c10::BFloat16* out, int64_t out_head_stride, std::vector<float>& scratch,
                 std::vector<c10::BFloat16>& widened) {
  constexpr int kVecs = kHeadSize / 32;
  constexpr int kUnit = 16 / (kHeadSize / 16);  // query heads at once: 16 of the 32 registers for P @ V
  const int64_t heads = num_kv_heads * group;
  const int64_t padded_len = seq_len + (seq_len & 1);
  const int64_t acc_floats = heads * 2 * kVecs * 16;
  if (static_cast<int64_t>(scratch.size()) < 2 * heads * padded_len + acc_floats)
    scratch.resize(2 * heads * padded_len + acc_floats);
  float* s = scratch.data();                                                // [heads, padded_len] scores
  uint16_t* p16 = reinterpret_cast<uint16_t*>(s + heads * padded_len);      // [heads, padded_len] bfloat16
  float* acc = s + 2 * heads * padded_len;                                  // [heads, 2 kVecs, 16]
  c10::BFloat16* buffer = nullptr;  // an fp8 block's rows of one KV head, widened: [block_size, kHeadSize]
  if constexpr (pagoda::kIsFp8<cache_t>) {
    if (static_cast<int64_t>(widened.size()) < block_size * kHeadSize + 32) widened.resize(block_size * kHeadSize + 32);
    const auto address = reinterpret_cast<uintptr_t>(widened.data());
    buffer = reinterpret_cast<c10::BFloat16*>((address + 63) & ~uintptr_t{63});  // whole cache lines
  }

  // a unit: KV head h's n rows of a block as bfloat16 (rows stride apart) and query heads [first, first + count)
  // of its group, count <= kUnit
  auto for_each_unit = [&](const cache_t* block, int64_t n, auto&& visit) {
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const auto [rows, stride] = bf16_rows<kHeadSize>(block + h * head_stride, pos_stride, n, buffer);
      for (int64_t g0 = 0; g0 < group; g0 += kUnit)
        visit(rows, stride, h * group + g0, std::min<int64_t>(kUnit, group - g0));
    }
  };
  // one pass over the context's blocks: visit(block's first position, its size, its rows in cache); on a CPU with
  // AMX every block prefetched by its pages' first lines (csrc/paged_decode_sweep.h: measured there)
#if defined(PAGODA_HAVE_AMX)
  const AheadPrefetch ahead = pagoda::amx::usable() ? AheadPrefetch::kPageStarts : AheadPrefetch::kRunStarts;
#else
  constexpr AheadPrefetch ahead = AheadPrefetch::kRunStarts;
#endif
  const BlockSweep<cache_t, kHeadSize, PrefetchL2X86> sweep(block_table, seq_len, block_size, block_stride,
                                                            pos_stride, head_stride, num_kv_heads, ahead);

#if defined(PAGODA_HAVE_AMX)
  if (std::is_same_v<cache_t, c10::BFloat16> && amx_decode::fits(num_kv_heads, group, kHeadSize) &&
      pagoda::amx::usable()) {
    amx_decode::ItemQueries<kHeadSize> queries;  // on the stack: a thread_local's every use calls __tls_get_addr
    thread_local std::vector<float> scores_t;  // [the context's blocks' positions, 16]
    const int64_t tile_rows = std::min<int64_t>(amx::kTileRows, block_size);
    const int64_t positions = (seq_len + block_size - 1) / block_size * block_size;
    if (static_cast<int64_t>(scores_t.size()) < positions * amx::kTileRows) scores_t.resize(positions * amx::kTileRows);
    queries.set(q, q_head_stride, num_kv_heads, group);
    amx_decode::configure_scores(tile_rows);
    amx_decode::load_queries(queries, num_kv_heads);
    sweep(k_cache, [&](int64_t t0, int64_t n, const cache_t* block) {
      amx_decode::score_block<kHeadSize>(reinterpret_cast<const c10::BFloat16*>(block), head_stride, pos_stride,
                                         num_kv_heads, n, tile_rows, scores_t.data() + t0 * amx::kTileRows);
    });
    amx::release_tiles();
    const __m512 scale16 = _mm512_set1_ps(scale);
    for (int64_t t0 = 0; t0 < seq_len; t0 += 16) {  // [positions][16 columns] -> [heads][positions], 16 x 16 at once
      const int64_t n = std::min<int64_t>(16, seq_len - t0);
      __m512 block[16];
      for (int64_t j = 0; j < 16; ++j)
        block[j] = j < n ? _mm512_loadu_ps(scores_t.data() + (t0 + j) * amx::kTileRows) : _mm512_setzero_ps();
      avx512::transpose16(block);
      const __mmask16 mask = static_cast<__mmask16>(n == 16 ? 0xFFFF : (1u << n) - 1);
      for (int64_t head = 0; head < heads; ++head)
        _mm512_mask_storeu_ps(s + head * padded_len + t0, mask, _mm512_mul_ps(block[head], scale16));
    }
  } else
#endif
  sweep(k_cache, [&](int64_t t0, int64_t n, const cache_t* block) {
    for_each_unit(block, n, [&](const c10::BFloat16* rows, int64_t stride, int64_t first, int64_t count) {
      with_unit_size<kUnit>(count, [&](auto size) {
        score_block<kHeadSize, decltype(size)::value>(q + first * q_head_stride, q_head_stride, rows, stride, n,
                                                      scale, s + first * padded_len + t0, padded_len);
      });
    });
  });
#if defined(PAGODA_HAVE_AMX)
  if (std::is_same_v<cache_t, c10::BFloat16> && amx_decode::values_fit(heads, kHeadSize) && pagoda::amx::usable()) {
    thread_local amx_decode::ItemProbabilities probabilities;
    thread_local amx_decode::ValuePairs values;
    const int64_t pair_rows = std::min<int64_t>(amx::kTileKPairs, block_size / 2);
    probabilities.reserve(num_kv_heads, group, (seq_len + block_size - 1) / block_size * block_size);
    for (int64_t head = 0; head < heads; ++head) softmax_to_bf16(s + head * padded_len, probabilities.row(head), seq_len);
    amx_decode::configure_values(heads, pair_rows);
    sweep(v_cache, [&](int64_t t0, int64_t n, const cache_t* block) {
      for (int64_t h = 0; h < num_kv_heads; ++h)
        for (int64_t c0 = 0; c0 < n; c0 += 2 * pair_rows) {
          values.set(reinterpret_cast<const c10::BFloat16*>(block + h * head_stride) + c0 * pos_stride, pos_stride,
                     n - c0, pair_rows);
          amx_decode::accumulate_values(probabilities, h, t0 + c0, values);
        }
    });
    amx_decode::store_values(acc);
  } else
#endif
  {
    for (int64_t head = 0; head < heads; ++head)
      softmax_to_bf16(s + head * padded_len, p16 + head * padded_len, seq_len);
    std::memset(acc, 0, acc_floats * sizeof(float));
    sweep(v_cache, [&](int64_t t0, int64_t n, const cache_t* block) {
      for_each_unit(block, n, [&](const c10::BFloat16* rows, int64_t stride, int64_t first, int64_t count) {
        with_unit_size<kUnit>(count, [&](auto size) {
          accumulate_block<kHeadSize, decltype(size)::value>(p16 + first * padded_len + t0, padded_len, rows,
                                                             stride, n, acc + first * 2 * kVecs * 16);
        });
      });
    });
  }
  // the accumulators' 128-bit lanes interleaved back into head-dim order: outputs 32i + 8L + 0..3 from lo's lane L,
  // 8L + 4..7 from hi's
  const __m512i first_half = _mm512_set_epi32(23, 22, 21, 20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i second_half = _mm512_set_epi32(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8);
  const __m512 factor = _mm512_set1_ps(out_scale);
  for (int64_t head = 0; head < heads; ++head)
    for (int i = 0; i < kVecs; ++i) {
      const __m512 lo = _mm512_loadu_ps(acc + (head * 2 * kVecs + 2 * i) * 16);
      const __m512 hi = _mm512_loadu_ps(acc + (head * 2 * kVecs + 2 * i + 1) * 16);
      c10::BFloat16* o = out + head * out_head_stride + 32 * i;
      avx512::store_bf16x16(o, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first_half, hi), factor));
      avx512::store_bf16x16(o + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second_half, hi), factor));
    }
}
#endif

// The work items of the kernels that take a sequence and a range of its KV heads (decode_bf16, decode_isa's
// decode_sequence): all of a sequence's KV heads together when every thread gets a sequence, else one item per
// KV head. Calls run(sequence, its first KV head, the number of KV heads) once per item, in parallel.
template <typename Run>
void for_each_sequence_item(int64_t num_seqs, int64_t num_kv_heads, const Run& run) {
  const int64_t heads_per_item = num_seqs >= at::get_num_threads() ? num_kv_heads : 1;
  const int64_t items_per_seq = num_kv_heads / heads_per_item;
  pagoda::parallel_tasks(num_seqs * items_per_seq, [&](int64_t item) {
    run(item / items_per_seq, item % items_per_seq * heads_per_item, heads_per_item);
  });
}

template <typename scalar_t, typename cache_t>
void decode_all(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                const at::Tensor& block_tables, const at::Tensor& seq_lens, const Variant& variant, at::Tensor& out) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const scalar_t* q = query.data_ptr<scalar_t>();
  const auto* k = static_cast<const cache_t*>(key_cache.data_ptr());
  const auto* v = static_cast<const cache_t*>(value_cache.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t q_seq = query.stride(0), q_head = query.stride(1);
  const int64_t o_seq = out.stride(0), o_head = out.stride(1);
  const int64_t table_stride = block_tables.stride(0);
  const int64_t block_stride = key_cache.stride(0), pos_stride = key_cache.stride(1), head_stride = key_cache.stride(2);

#if defined(PAGODA_ISA_AVX512BF16)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> &&
                (std::is_same_v<cache_t, c10::BFloat16> || pagoda::kIsFp8<cache_t>)) {
    if (variant.window == 0 && variant.softcap == 0.f && variant.sinks == nullptr && block_size % 2 == 0 &&
        (head_size == 64 || head_size == 128)) {
      auto decode = head_size == 64 ? decode_bf16<64, cache_t> : decode_bf16<128, cache_t>;
      // the fp8 rows are widened exactly, without upcast_fp8's 1 / kFp8ReadFactor
      const float score_scale = variant.q_scale / pagoda::kFp8ReadFactor<cache_t>;
      const float out_scale = variant.out_scale / pagoda::kFp8ReadFactor<cache_t>;
      for_each_sequence_item(num_seqs, num_kv_heads, [&](int64_t i, int64_t h, int64_t heads) {
        thread_local std::vector<float> scratch;
        thread_local std::vector<c10::BFloat16> widened;
        decode(q + i * q_seq + h * group * q_head, q_head, k + h * head_stride, v + h * head_stride, block_stride,
               pos_stride, head_stride, heads, group, tables + i * table_stride, lens[i], block_size,
               score_scale, out_scale, o + i * o_seq + h * group * o_head, o_head, scratch, widened);
      });
      return;
    }
  }
#endif
#if defined(PAGODA_ISA_AVX2) || defined(PAGODA_ISA_NEON)
  // a bfloat16 cache without AVX512_BF16 (or with an odd block size): csrc/paged_decode_avx2.h or
  // csrc/paged_decode_neon.h
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>) {
    if (variant.plain() && (head_size == 64 || head_size == 128)) {
      auto decode = head_size == 64 ? decode_isa::decode_sequence<64> : decode_isa::decode_sequence<128>;
      for_each_sequence_item(num_seqs, num_kv_heads, [&](int64_t i, int64_t h, int64_t heads) {
        thread_local std::vector<float> scratch;
        decode(q + i * q_seq + h * group * q_head, q_head, k + h * head_stride, v + h * head_stride, block_stride,
               pos_stride, head_stride, heads, group, tables + i * table_stride, lens[i], block_size,
               variant.q_scale, o + i * o_seq + h * group * o_head, o_head, scratch);
      });
      return;
    }
  }
#endif
#if defined(PAGODA_ISA_AVX512)
  if constexpr (pagoda::kIsFp8<cache_t>) {
    if ((head_size == 64 || head_size == 128) && variant.sinks == nullptr) {
      auto decode = head_size == 64 ? decode_fp8<scalar_t, cache_t, 64> : decode_fp8<scalar_t, cache_t, 128>;
      pagoda::parallel_tasks(num_seqs * num_kv_heads, [&](int64_t item) {
        thread_local std::vector<float> scratch;
        const int64_t i = item / num_kv_heads, h = item % num_kv_heads;
        decode(q + i * q_seq + h * group * q_head, q_head, k + h * head_stride, v + h * head_stride, block_stride,
               pos_stride, tables + i * table_stride, variant.first_visible(lens[i] - 1), lens[i], block_size, group,
               variant, o + i * o_seq + h * group * o_head, o_head, scratch);
      });
      return;
    }
  }
#endif
  auto decode = head_size == 64    ? decode_one<scalar_t, cache_t, 64>
                : head_size == 128 ? decode_one<scalar_t, cache_t, 128>
                                   : decode_one<scalar_t, cache_t, 0>;
  pagoda::parallel_tasks(num_seqs * num_kv_heads, [&](int64_t item) {
    thread_local std::vector<float> scores;
    const int64_t i = item / num_kv_heads, h = item % num_kv_heads;
    const int64_t first = variant.first_visible(lens[i] - 1);
    // wider groups (multi-query models) in chunks that fit the per-thread accumulators
    for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
      const int64_t first_head = h * group + g0;
      decode(q + i * q_seq + first_head * q_head, q_head, k + h * head_stride, v + h * head_stride, block_stride,
             pos_stride, tables + i * table_stride, first, lens[i], block_size, std::min(kMaxGroup, group - g0),
             head_size, variant, first_head, o + i * o_seq + first_head * o_head, o_head, scores);
    }
  });
}

}  // namespace

// query [B, Hq, D]; key_cache/value_cache [num_blocks, block_size, H_kv, D] (any strides, D contiguous) in the
// query's dtype, or fp8 holding keys / k_scale and values / v_scale; block_tables [B, max_blocks] int32; seq_lens
// [B] int32; out [B, Hq, D]. sliding_window: 0 or the positions a query sees, itself included; logit_softcap: 0
// or the cap of the scores.
void paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                            at::Tensor out, double k_scale, double v_scale, int64_t sliding_window,
                            double logit_softcap, const std::optional<at::Tensor>& sinks) {
  check_attention_args("paged_decode_attention", query, key_cache, value_cache, out, k_scale, v_scale,
                       sliding_window, logit_softcap, sinks);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.stride(1) == 1 && seq_lens.is_contiguous(),
              "block_tables and seq_lens must be int32 with contiguous rows");
  TORCH_CHECK(block_tables.size(0) == query.size(0) && seq_lens.size(0) == query.size(0),
              "one block table row and one length per query row");
  with_dtypes("paged_decode_attention", query, key_cache, [&](auto scalar, auto cache) {
    using scalar_t = decltype(scalar);
    using cache_t = decltype(cache);
    const Variant variant = make_variant<cache_t>(scale, k_scale, v_scale, sliding_window, logit_softcap, sinks);
    decode_all<scalar_t, cache_t>(query, key_cache, value_cache, block_tables, seq_lens, variant, out);
  });
}

}  // namespace pagoda::attention
