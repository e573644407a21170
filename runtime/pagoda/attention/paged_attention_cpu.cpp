// Attention on CPU straight from the paged KV cache: decode (one query token per sequence) and prefill
// (several: a prompt, a prefill chunk, verified drafts).
//
// Decode reads each sequence's K and V blocks in place through its block table (no gather, no padding to
// the longest context), so every cached byte is read once. Work items are sequences with all their KV heads
// in the bfloat16 path (see decode_bf16), (sequence, KV head) pairs in the generic one; the query heads
// sharing a KV head (GQA) are scored together against each K row.
// Scores and the softmax are float32 whatever the cache dtype.

#include <torch/library.h>
#include "cpu_isa.h"

#if defined(PAGODA_ISA_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "parallel_tasks.h"

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  // bfloat16 is the top half of a float32: a shift the compiler vectorises
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// exp(x) for the softmax's x <= 0, in plain arithmetic that vectorises (std::exp stays a scalar call):
// 2^(x log2 e) = 2^i * 2^f with f in [0, 1) by a degree-5 fit, relative error under 2e-7. The exponent is
// clamped at -126, the smallest normal float's, so 2^i stays a valid float (exp(-87.3) ~ 1e-38: zero weight).
inline float exp_nonpositive(float x) {
  const float t = std::max(x * 1.44269504f, -126.f);
  const float i = std::floor(t), f = t - i;
  float p = 1.87537657e-3f;
  p = p * f + 8.98725919e-3f;
  p = p * f + 5.58359654e-2f;
  p = p * f + 2.40146495e-1f;
  p = p * f + 6.93154738e-1f;
  p = p * f + 9.99999834e-1f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(i) + 127) << 23;
  float two_to_i;
  std::memcpy(&two_to_i, &bits, sizeof(two_to_i));
  return p * two_to_i;
}

// Calls visit(row, t) for each position t < seq_len of a context, row pointing at its entry in one KV
// head's cache, walking the block table one block at a time.
template <typename scalar_t, typename Visit>
inline void for_each_row(const scalar_t* cache, const int32_t* block_table, int64_t seq_len, int64_t block_size,
                         int64_t block_stride, int64_t pos_stride, Visit&& visit) {
  for (int64_t t0 = 0; t0 < seq_len; t0 += block_size) {
    const scalar_t* block = cache + block_table[t0 / block_size] * block_stride;
    const int64_t n = std::min(block_size, seq_len - t0);
    for (int64_t t = 0; t < n; ++t) visit(block + t * pos_stride, t0 + t);
  }
}

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

constexpr int64_t kMaxHeadSize = 256;  // MAX_HEAD_SIZE in cpu_kernels.py
constexpr int64_t kPrefetchBlocks = 2;  // how far ahead decode prefetches a block that starts a run
constexpr int64_t kMaxGroup = 16;

// kHeadSize > 0 fixes the head size at compile time (the common sizes), so the per-row loops unroll into
// registers; 0 reads it from head_size.
template <typename scalar_t, int kHeadSize>
void decode_one(
    const scalar_t* q,        // [G, D] of this (sequence, KV head), row stride q_head_stride
    int64_t q_head_stride,
    const scalar_t* k_cache,  // block b, position t, head h at b*block_stride + t*pos_stride + h*head_stride
    const scalar_t* v_cache,
    int64_t block_stride, int64_t pos_stride, int64_t head_stride,
    const int32_t* block_table, int64_t seq_len, int64_t block_size,
    int64_t group, int64_t head_size, float scale,
    scalar_t* out, int64_t out_head_stride,  // [G, D]
    std::vector<float>& scores) {           // scratch, grown to [G, seq_len]
  if constexpr (kHeadSize > 0) head_size = kHeadSize;
  float qf[kMaxGroup][kMaxHeadSize];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_size; ++d) qf[g][d] = to_float(q[g * q_head_stride + d]) * scale;
  if (static_cast<int64_t>(scores.size()) < group * seq_len) scores.resize(group * seq_len);
  float* s = scores.data();  // [G, seq_len]

  float row[kMaxHeadSize];
  for_each_row(k_cache, block_table, seq_len, block_size, block_stride, pos_stride, [&](const scalar_t* k, int64_t t) {
    for (int64_t d = 0; d < head_size; ++d) row[d] = to_float(k[d]);
    for (int64_t g = 0; g < group; ++g) {
      float dot = 0.f;
      for (int64_t d = 0; d < head_size; ++d) dot += qf[g][d] * row[d];
      s[g * seq_len + t] = dot;
    }
  });

  float acc[kMaxGroup][kMaxHeadSize];
  for (int64_t g = 0; g < group; ++g) {
    float* sg = s + g * seq_len;
    float max_score = std::numeric_limits<float>::lowest();
    for (int64_t t = 0; t < seq_len; ++t) max_score = std::max(max_score, sg[t]);
    float total = 0.f;
    for (int64_t t = 0; t < seq_len; ++t) {
      sg[t] = exp_nonpositive(sg[t] - max_score);
      total += sg[t];
    }
    const float inv_total = 1.f / total;
    for (int64_t t = 0; t < seq_len; ++t) sg[t] *= inv_total;
    for (int64_t d = 0; d < head_size; ++d) acc[g][d] = 0.f;
  }

  for_each_row(v_cache, block_table, seq_len, block_size, block_stride, pos_stride, [&](const scalar_t* v, int64_t t) {
    for (int64_t d = 0; d < head_size; ++d) row[d] = to_float(v[d]);
    for (int64_t g = 0; g < group; ++g) {
      const float p = s[g * seq_len + t];
      for (int64_t d = 0; d < head_size; ++d) acc[g][d] += p * row[d];
    }
  });
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_size; ++d) out[g * out_head_stride + d] = from_float<scalar_t>(acc[g][d]);
}

#if defined(PAGODA_ISA_AVX512)
// exp(x) of 16 lanes, as exp_nonpositive (2^i by scalef)
inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _mm512_set1_ps(-126.f));
  const __m512 i = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, i);
  __m512 p = _mm512_set1_ps(1.87537657e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.98725919e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.58359654e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40146495e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93154738e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.99999834e-1f));
  return _mm512_scalef_ps(p, i);
}

#endif

#if defined(PAGODA_ISA_AVX512BF16)
// Decode for a bfloat16 cache on CPUs with AVX512_BF16: `vdpbf16ps` multiplies bfloat16 pairs straight
// from the cache (no widening pass). Scores: one instruction per 32 head-dim elements and a horizontal sum
// per (key, head). P @ V: two keys at a time, their value rows interleaved into pairs and the two
// probabilities (rounded to bfloat16, as SDPA's math path does) broadcast as one pair. Needs an even
// block_size, so a pair of keys never straddles two blocks.
//
// A work item is a sequence and a range of its KV heads (all of them when there are sequences enough for
// every thread). Block by block, the K rows of all the item's heads are scored (then their V rows summed)
// in one sweep in memory order: in the head-major cache a block's heads are contiguous, and a context's
// blocks mostly follow each other (a prompt's are allocated together), so the item reads long runs that the
// hardware prefetcher follows while the kernel computes. Software prefetch is only for a block that starts
// a new run. Per query head the P @ V accumulators stay in memory between blocks.
// (One item per (sequence, KV head), reading 2 KB runs 6 KB apart with prefetches 64 keys ahead into L1,
// took 630-690 us a layer on 40 contexts of 10 MB out of cache; this takes 400-420, ~25 GB/s: what the
// two cores read.)
// lane j of the result = the sum of v[j]'s 16 lanes: a transposing tree of 45 instructions for all 16, where
// 16 separate horizontal sums take ~130
inline __m512 sum_each16(const __m512* v) {
  __m512 pairs[8];  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of v[2i], v[2i+1]
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 quads[4];  // per 128-bit lane L: the lane-L sums of v[4i..4i+3]
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  __m512 halves[2];  // 128-bit lanes: v[8i..8i+3] over lanes 0+1, 2+3, then v[8i+4..8i+7] the same
  for (int i = 0; i < 2; ++i)
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

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
    _mm256_mask_storeu_epi16(pg + t, mask_at(t), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask_at(t), sg + t), inv_total)));
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

// Calls visit(std::integral_constant<int, n>) for n in 1..kMax (the query heads a unit takes at once)
template <int kMax, typename Visit>
inline void with_unit_size(int64_t n, Visit&& visit) {
  switch (n) {
    case 1: visit(std::integral_constant<int, 1>{}); break;
    case 2: visit(std::integral_constant<int, 2>{}); break;
    case 3: if constexpr (kMax >= 3) visit(std::integral_constant<int, 3>{}); break;
    default: if constexpr (kMax >= 4) visit(std::integral_constant<int, 4>{}); break;
  }
}

// One sequence, KV heads 0..num_kv_heads of the pointers given (q/out: their first query head's row)
template <int kHeadSize>
void decode_bf16(const c10::BFloat16* q, int64_t q_head_stride, const c10::BFloat16* k_cache,
                 const c10::BFloat16* v_cache, int64_t block_stride, int64_t pos_stride, int64_t head_stride,
                 int64_t num_kv_heads, int64_t group, const int32_t* block_table, int64_t seq_len,
                 int64_t block_size, float scale, c10::BFloat16* out, int64_t out_head_stride,
                 std::vector<float>& scratch) {
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

  const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
  // a block that does not follow its predecessor in memory starts a run the hardware prefetcher cannot
  // guess: fetch it into L2 ahead (one real load first: a prefetch that misses the TLB may be dropped).
  // Prefetching every block, or into L1, was slower: 4 blocks of 3 heads overflow L1, and requests the
  // hardware would make anyway take the core's miss buffers.
  auto prefetch_run_start = [&](const c10::BFloat16* cache, int64_t b) {
    if (b >= num_blocks || (b > 0 && block_table[b] == block_table[b - 1] + 1)) return;
    const char* rows = reinterpret_cast<const char*>(cache + block_table[b] * block_stride);
    const char first_byte = *reinterpret_cast<const volatile char*>(rows);
    asm volatile("" : : "r"(first_byte));
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t t = 0; t < block_size; ++t)
        for (int64_t byte = 0; byte < kHeadSize * 2; byte += 64)
          _mm_prefetch(rows + (h * head_stride + t * pos_stride) * 2 + byte, _MM_HINT_T1);
  };
  // a unit: KV head h and query heads [first, first + count) of its group, count <= kUnit
  auto for_each_unit = [&](auto&& visit) {
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t g0 = 0; g0 < group; g0 += kUnit) visit(h, h * group + g0, std::min<int64_t>(kUnit, group - g0));
  };
  // one pass over the context's blocks: visit(block's first position, its size, its rows in cache)
  auto sweep = [&](const c10::BFloat16* cache, auto&& visit) {
    for (int64_t b = 0; b < kPrefetchBlocks; ++b) prefetch_run_start(cache, b);
    for (int64_t b = 0; b < num_blocks; ++b) {
      prefetch_run_start(cache, b + kPrefetchBlocks);
      const int64_t t0 = b * block_size;
      visit(t0, std::min(block_size, seq_len - t0), cache + block_table[b] * block_stride);
    }
  };

  sweep(k_cache, [&](int64_t t0, int64_t n, const c10::BFloat16* block) {
    for_each_unit([&](int64_t h, int64_t first, int64_t count) {
      with_unit_size<kUnit>(count, [&](auto size) {
        score_block<kHeadSize, decltype(size)::value>(q + first * q_head_stride, q_head_stride, block + h * head_stride,
                                                      pos_stride, n, scale, s + first * padded_len + t0, padded_len);
      });
    });
  });
  for (int64_t head = 0; head < heads; ++head) softmax_to_bf16(s + head * padded_len, p16 + head * padded_len, seq_len);
  std::memset(acc, 0, acc_floats * sizeof(float));
  sweep(v_cache, [&](int64_t t0, int64_t n, const c10::BFloat16* block) {
    for_each_unit([&](int64_t h, int64_t first, int64_t count) {
      with_unit_size<kUnit>(count, [&](auto size) {
        accumulate_block<kHeadSize, decltype(size)::value>(p16 + first * padded_len + t0, padded_len,
                                                           block + h * head_stride, pos_stride, n,
                                                           acc + first * 2 * kVecs * 16);
      });
    });
  });
  for (int64_t head = 0; head < heads; ++head)
    for (int i = 0; i < kVecs; ++i) {
      const float* lo = acc + (head * 2 * kVecs + 2 * i) * 16;
      const float* hi = lo + 16;
      c10::BFloat16* o = out + head * out_head_stride + 32 * i;
      for (int lane = 0; lane < 4; ++lane)
        for (int j = 0; j < 4; ++j) {
          o[8 * lane + j] = c10::BFloat16(lo[4 * lane + j]);
          o[8 * lane + 4 + j] = c10::BFloat16(hi[4 * lane + j]);
        }
    }
}
#endif

template <typename scalar_t>
void decode_all(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* k = key_cache.data_ptr<scalar_t>();
  const scalar_t* v = value_cache.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t q_seq = query.stride(0), q_head = query.stride(1);
  const int64_t o_seq = out.stride(0), o_head = out.stride(1);
  const int64_t table_stride = block_tables.stride(0);
  const int64_t block_stride = key_cache.stride(0), pos_stride = key_cache.stride(1), head_stride = key_cache.stride(2);

#if defined(PAGODA_ISA_AVX512BF16)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (block_size % 2 == 0 && (head_size == 64 || head_size == 128)) {
      auto decode = head_size == 64 ? decode_bf16<64> : decode_bf16<128>;
      // a sequence's KV heads together when every thread gets a sequence; else one item per KV head
      const int64_t heads_per_item = num_seqs >= at::get_num_threads() ? num_kv_heads : 1;
      const int64_t items_per_seq = num_kv_heads / heads_per_item;
      pagoda::parallel_tasks(num_seqs * items_per_seq, [&](int64_t item) {
        thread_local std::vector<float> scratch;
        const int64_t i = item / items_per_seq, h = item % items_per_seq * heads_per_item;
        decode(q + i * q_seq + h * group * q_head, q_head, k + h * head_stride, v + h * head_stride, block_stride,
               pos_stride, head_stride, heads_per_item, group, tables + i * table_stride, lens[i], block_size,
               static_cast<float>(scale), o + i * o_seq + h * group * o_head, o_head, scratch);
      });
      return;
    }
  }
#endif
  auto decode = head_size == 64    ? decode_one<scalar_t, 64>
                : head_size == 128 ? decode_one<scalar_t, 128>
                                   : decode_one<scalar_t, 0>;
  pagoda::parallel_tasks(num_seqs * num_kv_heads, [&](int64_t item) {
    thread_local std::vector<float> scores;
    const int64_t i = item / num_kv_heads, h = item % num_kv_heads;
    // wider groups (multi-query models) in chunks that fit the per-thread accumulators
    for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
      const int64_t first_head = h * group + g0;
      decode(q + i * q_seq + first_head * q_head, q_head, k + h * head_stride, v + h * head_stride, block_stride,
             pos_stride, head_stride, tables + i * table_stride, lens[i], block_size, std::min(kMaxGroup, group - g0),
             head_size, static_cast<float>(scale), o + i * o_seq + first_head * o_head, o_head, scores);
    }
  });
}

// --- prefill: flash attention over KV blocks -------------------------------------------------------------
//
// Work items are (sequence, KV head, tile of query rows). A tile's query vectors (its rows times the G query
// heads sharing the KV head) meet each KV block once: the block is widened to float32 (K transposed, so 16
// keys' scores are one vector op per head-dim element), then every vector updates its running max, sum and
// output (online softmax). Blocks past the tile's last row are never read; the diagonal ones are masked.
// A bfloat16 cache with AVX512_BF16 takes prefill_tile_bf16 instead (no widening).

constexpr int64_t kKeysPerChunk = 16;  // keys scored together: one 16-lane float32 vector
constexpr int64_t kTileVectors = 48;  // query vectors per tile (rows x group): the tile's state stays in L1

// The tile's running state: per query vector (row r, head g at r * group + g) its scaled query, output
// accumulator, running max and sum. kWidth: the scratch rows' length (the head size when fixed).
template <int kWidth>
struct TileState {
  alignas(64) float query[kTileVectors][kWidth];
  alignas(64) float acc[kTileVectors][kWidth];
  float row_max[kTileVectors], row_sum[kTileVectors];
  alignas(64) float keys_t[kWidth][kKeysPerChunk];  // the chunk's keys, transposed
  alignas(64) float values[kKeysPerChunk][kWidth];
};

// Folds one chunk's scores s (already masked to `visible` keys) into vector v's state; p: scratch.
template <int kWidth>
inline void online_softmax_update(TileState<kWidth>& st, int64_t v, const float* s, int64_t visible,
                                  int64_t head_size) {
  float chunk_max = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < visible; ++j) chunk_max = std::max(chunk_max, s[j]);
  const float new_max = std::max(st.row_max[v], chunk_max);
  const float rescale = std::exp(st.row_max[v] - new_max);  // 0 for the first chunk (max was -inf)
  float p[kKeysPerChunk];
  float chunk_sum = 0.f;
  for (int64_t j = 0; j < visible; ++j) {
    p[j] = exp_nonpositive(s[j] - new_max);
    chunk_sum += p[j];
  }
  st.row_max[v] = new_max;
  st.row_sum[v] = st.row_sum[v] * rescale + chunk_sum;
  float* o = st.acc[v];
  for (int64_t d = 0; d < head_size; ++d) o[d] *= rescale;
  for (int64_t j = 0; j < visible; ++j)
    for (int64_t d = 0; d < head_size; ++d) o[d] += p[j] * st.values[j][d];
}

#if defined(PAGODA_ISA_AVX512)
// Vectors v..v+kVectors-1 against the chunk: their scores share each key row load (kVectors independent
// FMA chains), then each takes its softmax step and adds its 16 weighted value rows, kHeadSize/16 vectors wide.
template <int kHeadSize, int kVectors>
inline void chunk_step_avx512(TileState<kHeadSize>& st, int64_t v, const int64_t* visible) {
  constexpr int kLanes = kHeadSize / 16;
  __m512 s[kVectors];
  for (int q = 0; q < kVectors; ++q) s[q] = _mm512_setzero_ps();
  for (int d = 0; d < kHeadSize; ++d) {
    const __m512 k = _mm512_load_ps(st.keys_t[d]);
    for (int q = 0; q < kVectors; ++q) s[q] = _mm512_fmadd_ps(_mm512_set1_ps(st.query[v + q][d]), k, s[q]);
  }
  for (int q = 0; q < kVectors; ++q) {
    if (visible[q] <= 0) continue;
    const __mmask16 mask = static_cast<__mmask16>((1u << visible[q]) - 1);
    const float chunk_max = _mm512_mask_reduce_max_ps(mask, s[q]);
    const float new_max = std::max(st.row_max[v + q], chunk_max);
    const float rescale = exp_nonpositive(st.row_max[v + q] - new_max);  // -inf - x: clamped to ~1e-38, times 0
    const __m512 p = _mm512_maskz_mov_ps(mask, exp_nonpositive16(_mm512_sub_ps(s[q], _mm512_set1_ps(new_max))));
    st.row_max[v + q] = new_max;
    st.row_sum[v + q] = st.row_sum[v + q] * rescale + _mm512_reduce_add_ps(p);
    alignas(64) float pj[kKeysPerChunk];
    _mm512_store_ps(pj, p);
    __m512 o[kLanes];
    const __m512 r = _mm512_set1_ps(rescale);
    for (int i = 0; i < kLanes; ++i) o[i] = _mm512_mul_ps(_mm512_load_ps(st.acc[v + q] + 16 * i), r);
    for (int j = 0; j < visible[q]; ++j) {
      const __m512 w = _mm512_set1_ps(pj[j]);
      for (int i = 0; i < kLanes; ++i) o[i] = _mm512_fmadd_ps(w, _mm512_load_ps(st.values[j] + 16 * i), o[i]);
    }
    for (int i = 0; i < kLanes; ++i) _mm512_store_ps(st.acc[v + q] + 16 * i, o[i]);
  }
}
#elif defined(PAGODA_ISA_AVX2)
// exp(x) of 8 lanes, as exp_nonpositive (2^i written into the exponent field)
inline __m256 exp_nonpositive8(__m256 x) {
  const __m256 t = _mm256_max_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _mm256_set1_ps(-126.f));
  const __m256 i = _mm256_floor_ps(t);
  const __m256 f = _mm256_sub_ps(t, i);
  __m256 p = _mm256_set1_ps(1.87537657e-3f);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(8.98725919e-3f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.58359654e-2f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.40146495e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.93154738e-1f));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.99999834e-1f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(i), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

inline float max_of8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline float sum_of8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)));
}

// all-ones in lanes first..first+7 that lie below `visible`
inline __m256 lanes_below(int64_t visible, int first) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int32_t n = static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(visible - first, 0), 8));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), index));
}

// chunk_step_avx512 with 8-lane vectors: the chunk's 16 scores are two vectors per query vector, and P @ V
// runs the head dimension 64 floats (8 accumulators, within AVX2's 16 registers) at a time
template <int kHeadSize, int kVectors>
inline void chunk_step_avx2(TileState<kHeadSize>& st, int64_t v, const int64_t* visible) {
  static_assert(kKeysPerChunk == 16 && kHeadSize % 64 == 0);
  __m256 s[kVectors][2];
  for (int q = 0; q < kVectors; ++q) s[q][0] = s[q][1] = _mm256_setzero_ps();
  for (int d = 0; d < kHeadSize; ++d) {
    const __m256 k0 = _mm256_load_ps(st.keys_t[d]), k1 = _mm256_load_ps(st.keys_t[d] + 8);
    for (int q = 0; q < kVectors; ++q) {
      const __m256 b = _mm256_broadcast_ss(&st.query[v + q][d]);
      s[q][0] = _mm256_fmadd_ps(b, k0, s[q][0]);
      s[q][1] = _mm256_fmadd_ps(b, k1, s[q][1]);
    }
  }
  const __m256 lowest = _mm256_set1_ps(std::numeric_limits<float>::lowest());
  for (int q = 0; q < kVectors; ++q) {
    if (visible[q] <= 0) continue;
    const __m256 m0 = lanes_below(visible[q], 0), m1 = lanes_below(visible[q], 8);
    const float chunk_max = max_of8(_mm256_max_ps(_mm256_blendv_ps(lowest, s[q][0], m0),
                                                  _mm256_blendv_ps(lowest, s[q][1], m1)));
    const float new_max = std::max(st.row_max[v + q], chunk_max);
    const float rescale = exp_nonpositive(st.row_max[v + q] - new_max);  // -inf - x: clamped to ~1e-38, times 0
    const __m256 top = _mm256_set1_ps(new_max);
    const __m256 p0 = _mm256_and_ps(m0, exp_nonpositive8(_mm256_sub_ps(s[q][0], top)));
    const __m256 p1 = _mm256_and_ps(m1, exp_nonpositive8(_mm256_sub_ps(s[q][1], top)));
    st.row_max[v + q] = new_max;
    st.row_sum[v + q] = st.row_sum[v + q] * rescale + sum_of8(_mm256_add_ps(p0, p1));
    alignas(32) float pj[kKeysPerChunk];
    _mm256_store_ps(pj, p0);
    _mm256_store_ps(pj + 8, p1);
    const __m256 r = _mm256_set1_ps(rescale);
    for (int part = 0; part < kHeadSize; part += 64) {
      __m256 o[8];
      for (int i = 0; i < 8; ++i) o[i] = _mm256_mul_ps(_mm256_load_ps(st.acc[v + q] + part + 8 * i), r);
      for (int j = 0; j < visible[q]; ++j) {
        const __m256 w = _mm256_broadcast_ss(pj + j);
        for (int i = 0; i < 8; ++i) o[i] = _mm256_fmadd_ps(w, _mm256_load_ps(st.values[j] + part + 8 * i), o[i]);
      }
      for (int i = 0; i < 8; ++i) _mm256_store_ps(st.acc[v + q] + part + 8 * i, o[i]);
    }
  }
}
#endif

template <typename scalar_t, int kHeadSize>
void prefill_tile(
    const scalar_t* q, int64_t q_row_stride, int64_t q_head_stride,  // first row's first head of the group
    const scalar_t* k_cache, const scalar_t* v_cache,  // at this KV head
    int64_t block_stride, int64_t pos_stride, const int32_t* block_table, int64_t block_size,
    int64_t first_pos, int64_t rows, int64_t group, int64_t head_size, float scale,
    scalar_t* out, int64_t out_row_stride, int64_t out_head_stride) {
  if constexpr (kHeadSize > 0) head_size = kHeadSize;
  constexpr int kWidth = kHeadSize > 0 ? kHeadSize : kMaxHeadSize;
  TileState<kWidth> st;
  const int64_t vectors = rows * group;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t v = r * group + g;
      for (int64_t d = 0; d < head_size; ++d)
        st.query[v][d] = to_float(q[r * q_row_stride + g * q_head_stride + d]) * scale;
      for (int64_t d = 0; d < head_size; ++d) st.acc[v][d] = 0.f;
      st.row_max[v] = -std::numeric_limits<float>::infinity();
      st.row_sum[v] = 0.f;
    }
  const int64_t last_pos = first_pos + rows - 1;
  for (int64_t t0 = 0; t0 <= last_pos; t0 += kKeysPerChunk) {
    const int64_t keys = std::min(kKeysPerChunk, last_pos + 1 - t0);
    for (int64_t j = 0; j < kKeysPerChunk; ++j) {
      const int64_t t = t0 + std::min(j, keys - 1);  // past the end: repeat a valid key (never weighted)
      const int64_t offset = block_table[t / block_size] * block_stride + (t % block_size) * pos_stride;
      for (int64_t d = 0; d < head_size; ++d) st.keys_t[d][j] = to_float(k_cache[offset + d]);
      for (int64_t d = 0; d < head_size; ++d) st.values[j][d] = to_float(v_cache[offset + d]);
    }
    int64_t visible[kTileVectors];  // causal: vector v (row v / group) sees keys t <= its position
    for (int64_t v = 0; v < vectors; ++v) visible[v] = std::min(keys, first_pos + v / group - t0 + 1);
    int64_t v = 0;
#if defined(PAGODA_ISA_AVX512)
    if constexpr (kHeadSize > 0 && kHeadSize % 16 == 0) {
      for (; v + 4 <= vectors; v += 4) chunk_step_avx512<kHeadSize, 4>(st, v, visible + v);
      for (; v < vectors; ++v) chunk_step_avx512<kHeadSize, 1>(st, v, visible + v);
    }
#elif defined(PAGODA_ISA_AVX2)
    if constexpr (kHeadSize > 0 && kHeadSize % 64 == 0) {
      for (; v + 4 <= vectors; v += 4) chunk_step_avx2<kHeadSize, 4>(st, v, visible + v);
      for (; v < vectors; ++v) chunk_step_avx2<kHeadSize, 1>(st, v, visible + v);
    }
#endif
    for (; v < vectors; ++v) {
      if (visible[v] <= 0) continue;
      float s[kKeysPerChunk] = {0.f};
      for (int64_t d = 0; d < head_size; ++d)
        for (int64_t j = 0; j < kKeysPerChunk; ++j) s[j] += st.query[v][d] * st.keys_t[d][j];
      online_softmax_update(st, v, s, visible[v], head_size);
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t v = r * group + g;
      const float inv = 1.f / st.row_sum[v];
      for (int64_t d = 0; d < head_size; ++d)
        out[r * out_row_stride + g * out_head_stride + d] = from_float<scalar_t>(st.acc[v][d] * inv);
    }
}

#if defined(PAGODA_ISA_AVX512BF16)
// prefill_tile for a bfloat16 cache on CPUs with AVX512_BF16: `vdpbf16ps` multiplies bfloat16 pairs as they
// are, where the generic tile widens every key and value to float32 and spends one FMA per element.
// 32 keys a chunk (two score vectors: the softmax's reductions are paid once per 32 keys). Scores: the
// chunk's keys transposed into [D/2][32] pairs of head-dim elements, one instruction per pair and 16 keys, the
// query's pair broadcast. P @ V: the probabilities rounded to bfloat16 (as the decode kernel and SDPA's math
// path do), two keys at a time against their value rows interleaved, one instruction per 16 head-dim
// elements. The output accumulators hold the head dimension in unpack order (as accumulate_block's).
constexpr int64_t kKeysPerChunkBf16 = 32;

template <int kHeadSize>
struct TileStateBf16 {
  static constexpr int kPairs = kHeadSize / 2;  // head-dim pairs per row
  static constexpr int kAcc = kHeadSize / 16;   // float32 accumulator vectors per query vector
  alignas(64) uint32_t query[kTileVectors][kPairs];  // bfloat16 pairs
  alignas(64) float acc[kTileVectors][kHeadSize];
  float row_max[kTileVectors], row_sum[kTileVectors];
};

// One KV head's chunk of 32 keys as the tiles read it (prefill_items_bf16 says who prepares it, and when)
template <int kHeadSize>
struct ChunkBf16 {
  alignas(64) uint32_t keys_t[kHeadSize / 2][kKeysPerChunkBf16];  // [pair][key]: keys 0-15, then 16-31
  alignas(64) __m512i values[kKeysPerChunkBf16 / 2][kHeadSize / 16];  // per key pair: both rows, unpacked into pairs
};

// Keys t0..t0+keys-1 of a context into chunk c; past the end a valid key repeats (never weighted)
template <int kHeadSize>
void prepare_chunk_bf16(ChunkBf16<kHeadSize>& c, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache,
                        int64_t block_stride, int64_t pos_stride, const int32_t* block_table, int64_t block_size,
                        int64_t t0, int64_t keys) {
  constexpr int kPairs = kHeadSize / 2, kVecs = kHeadSize / 32;
  auto row_at = [&](const c10::BFloat16* cache, int64_t t) {
    return cache + block_table[t / block_size] * block_stride + (t % block_size) * pos_stride;
  };
  for (int64_t j = 0; j < kKeysPerChunkBf16; ++j) {
    uint32_t pairs[kPairs];
    std::memcpy(pairs, row_at(k_cache, t0 + std::min(j, keys - 1)), sizeof(pairs));
    for (int p = 0; p < kPairs; ++p) c.keys_t[p][j] = pairs[p];
  }
  for (int64_t j = 0; j < kKeysPerChunkBf16 / 2; ++j) {
    const c10::BFloat16* first = row_at(v_cache, t0 + std::min(2 * j, keys - 1));
    const c10::BFloat16* second = row_at(v_cache, t0 + std::min(2 * j + 1, keys - 1));
    for (int i = 0; i < kVecs; ++i) {
      const __m512i v0 = _mm512_loadu_si512(first + 32 * i), v1 = _mm512_loadu_si512(second + 32 * i);
      c.values[j][2 * i] = _mm512_unpacklo_epi16(v0, v1);
      c.values[j][2 * i + 1] = _mm512_unpackhi_epi16(v0, v1);
    }
  }
}

// Vectors v..v+kVectors-1 against the chunk, as chunk_step_avx512. P @ V runs kVectors vectors together: each
// value pair is loaded once for all of them, and their kVectors * kAcc accumulator chains keep vdpbf16ps's
// pipeline full (one vector's kAcc chains alone wait on its latency). A vector's sums keep their order.
template <int kHeadSize, int kVectors>
inline void chunk_step_bf16(TileStateBf16<kHeadSize>& st, const ChunkBf16<kHeadSize>& chunk, int64_t v,
                            const int64_t* visible, float scale) {
  constexpr int kPairs = TileStateBf16<kHeadSize>::kPairs, kAcc = TileStateBf16<kHeadSize>::kAcc;
  __m512 s0[kVectors], s1[kVectors];  // keys 0-15 and 16-31
  for (int q = 0; q < kVectors; ++q) s0[q] = s1[q] = _mm512_setzero_ps();
  for (int p = 0; p < kPairs; ++p) {
    const __m512bh k0 = (__m512bh)_mm512_load_si512(chunk.keys_t[p]);
    const __m512bh k1 = (__m512bh)_mm512_load_si512(chunk.keys_t[p] + 16);
    for (int q = 0; q < kVectors; ++q) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(st.query[v + q][p]));
      s0[q] = _mm512_dpbf16_ps(s0[q], w, k0);
      s1[q] = _mm512_dpbf16_ps(s1[q], w, k1);
    }
  }
  const __m512 lowest = _mm512_set1_ps(std::numeric_limits<float>::lowest());
  alignas(64) uint32_t weight_pairs[kVectors][kKeysPerChunkBf16 / 2];  // bfloat16 (p[2j], p[2j+1]); 0: unseen
  float rescale[kVectors];
  int64_t most_seen = 0;
  for (int q = 0; q < kVectors; ++q) {
    const int64_t seen = visible[q];
    most_seen = std::max(most_seen, seen);
    if (seen <= 0) {  // no key of this chunk is visible: the state stays as it is
      rescale[q] = 1.f;
      _mm512_store_si512(weight_pairs[q], _mm512_setzero_si512());
      continue;
    }
    const __mmask16 mask0 = static_cast<__mmask16>(seen >= 16 ? 0xFFFF : (1u << seen) - 1);
    const __mmask16 mask1 = static_cast<__mmask16>(seen >= 32 ? 0xFFFF : seen > 16 ? (1u << (seen - 16)) - 1 : 0);
    const __m512 a0 = _mm512_mul_ps(s0[q], _mm512_set1_ps(scale)), a1 = _mm512_mul_ps(s1[q], _mm512_set1_ps(scale));
    const float chunk_max = _mm512_reduce_max_ps(
        _mm512_max_ps(_mm512_mask_mov_ps(lowest, mask0, a0), _mm512_mask_mov_ps(lowest, mask1, a1)));
    const float new_max = std::max(st.row_max[v + q], chunk_max);
    rescale[q] = exp_nonpositive(st.row_max[v + q] - new_max);  // -inf - x: clamped to ~1e-38, times 0
    const __m512 m = _mm512_set1_ps(new_max);
    const __m512 p0 = _mm512_maskz_mov_ps(mask0, exp_nonpositive16(_mm512_sub_ps(a0, m)));
    const __m512 p1 = _mm512_maskz_mov_ps(mask1, exp_nonpositive16(_mm512_sub_ps(a1, m)));
    st.row_max[v + q] = new_max;
    st.row_sum[v + q] = st.row_sum[v + q] * rescale[q] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
    _mm512_store_si512(weight_pairs[q], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
  }
  // vectors at once in P @ V: their accumulators and one value load per head-dim vector stay in registers
  constexpr int kTogether = std::min(kVectors, std::max(1, 16 / kAcc));
  for (int q0 = 0; q0 < kVectors; q0 += kTogether) {
    __m512 o[kTogether][kAcc];
    for (int q = 0; q < kTogether; ++q) {
      const __m512 r = _mm512_set1_ps(rescale[q0 + q]);
      for (int i = 0; i < kAcc; ++i) o[q][i] = _mm512_mul_ps(_mm512_load_ps(st.acc[v + q0 + q] + 16 * i), r);
    }
    for (int64_t j = 0; j < (most_seen + 1) / 2; ++j) {  // past a vector's `seen` its weights are zero
      for (int i = 0; i < kAcc; ++i) {
        const __m512bh values = (__m512bh)chunk.values[j][i];
        for (int q = 0; q < kTogether; ++q)
          o[q][i] = _mm512_dpbf16_ps(o[q][i], (__m512bh)_mm512_set1_epi32(static_cast<int>(weight_pairs[q0 + q][j])),
                                     values);
      }
    }
    for (int q = 0; q < kTogether; ++q)
      for (int i = 0; i < kAcc; ++i) _mm512_store_ps(st.acc[v + q0 + q] + 16 * i, o[q][i]);
  }
}

// A tile of rows x group query vectors against the chunks of its sequence's KV head: chunk_at(c) is chunk c
template <int kHeadSize, typename ChunkAt>
void prefill_tile_bf16(const c10::BFloat16* q, int64_t q_row_stride, int64_t q_head_stride, ChunkAt&& chunk_at,
                       int64_t first_pos, int64_t rows, int64_t group, float scale, c10::BFloat16* out,
                       int64_t out_row_stride, int64_t out_head_stride) {
  using State = TileStateBf16<kHeadSize>;
  constexpr int kVecs = kHeadSize / 32;
  State st;
  const int64_t vectors = rows * group;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t v = r * group + g;
      std::memcpy(st.query[v], q + r * q_row_stride + g * q_head_stride, kHeadSize * sizeof(c10::BFloat16));
      for (int64_t d = 0; d < kHeadSize; ++d) st.acc[v][d] = 0.f;
      st.row_max[v] = -std::numeric_limits<float>::infinity();
      st.row_sum[v] = 0.f;
    }
  const int64_t last_pos = first_pos + rows - 1;
  for (int64_t t0 = 0; t0 <= last_pos; t0 += kKeysPerChunkBf16) {
    const ChunkBf16<kHeadSize>& chunk = chunk_at(t0 / kKeysPerChunkBf16);
    const int64_t keys = std::min(kKeysPerChunkBf16, last_pos + 1 - t0);
    int64_t visible[kTileVectors];  // causal: vector v (row v / group) sees keys t <= its position
    for (int64_t v = 0; v < vectors; ++v) visible[v] = std::min(keys, first_pos + v / group - t0 + 1);
    int64_t v = 0;
    for (; v + 4 <= vectors; v += 4) chunk_step_bf16<kHeadSize, 4>(st, chunk, v, visible + v, scale);
    for (; v < vectors; ++v) chunk_step_bf16<kHeadSize, 1>(st, chunk, v, visible + v, scale);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t v = r * group + g;
      const float inv = 1.f / st.row_sum[v];
      c10::BFloat16* o = out + r * out_row_stride + g * out_head_stride;
      for (int i = 0; i < kVecs; ++i)  // accumulators 2i, 2i+1: per 128-bit lane L, outputs 32i + 8L + 0..3, 4..7
        for (int lane = 0; lane < 4; ++lane)
          for (int j = 0; j < 4; ++j) {
            o[32 * i + 8 * lane + j] = c10::BFloat16(st.acc[v][32 * i + 4 * lane + j] * inv);
            o[32 * i + 8 * lane + 4 + j] = c10::BFloat16(st.acc[v][32 * i + 16 + 4 * lane + j] * inv);
          }
    }
}
#endif

struct PrefillItem {
  int64_t seq, kv_head, first_row, rows, g0, heads;  // rows relative to the sequence's first query row
};

#if defined(PAGODA_ISA_AVX512BF16)
// prefill_all's items on a bfloat16 cache. A sequence with several row tiles has each chunk they share
// prepared once, for all KV heads in parallel, before the items run (it takes as much memory as the context's
// K and V); a sequence with one tile (a verification, a short chunk) prepares its chunks as it reads them, where
// they stay in L1.
template <int kHeadSize>
void prefill_items_bf16(const std::vector<PrefillItem>& items, int64_t rows_per_item, const at::Tensor& query,
                        const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_tables,
                        const int32_t* starts, const int32_t* lens, float scale, at::Tensor& out) {
  using Chunk = ChunkBf16<kHeadSize>;
  const int64_t num_seqs = block_tables.size(0), block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = query.size(1) / num_kv_heads;
  // sequence i's chunk c for KV head h: chunks[first_chunk[i * num_kv_heads + h] + c]; -1: not prepared
  std::vector<int64_t> first_chunk(num_seqs * num_kv_heads, -1);
  std::vector<std::array<int64_t, 3>> to_prepare;  // (sequence, KV head, chunk)
  int64_t total = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    if (starts[i + 1] - starts[i] <= rows_per_item) continue;  // no items, or one tile per KV head
    const int64_t n = (lens[i] + kKeysPerChunkBf16 - 1) / kKeysPerChunkBf16;
    for (int64_t h = 0; h < num_kv_heads; ++h, total += n) {
      first_chunk[i * num_kv_heads + h] = total;
      for (int64_t c = 0; c < n; ++c) to_prepare.push_back({i, h, c});
    }
  }
  const std::unique_ptr<Chunk[]> owned(new Chunk[total]);  // aligned new; left uninitialised
  Chunk* chunks = owned.get();
  const auto* q = query.data_ptr<c10::BFloat16>();
  const auto* k = key_cache.data_ptr<c10::BFloat16>();
  const auto* v = value_cache.data_ptr<c10::BFloat16>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  auto* o = out.data_ptr<c10::BFloat16>();
  const int64_t block_stride = key_cache.stride(0), pos_stride = key_cache.stride(1), head_stride = key_cache.stride(2);
  auto prepare = [&](Chunk& chunk, int64_t i, int64_t h, int64_t c) {
    const int64_t t0 = c * kKeysPerChunkBf16;
    prepare_chunk_bf16<kHeadSize>(chunk, k + h * head_stride, v + h * head_stride, block_stride, pos_stride,
                                  tables + i * block_tables.stride(0), block_size, t0,
                                  std::min<int64_t>(kKeysPerChunkBf16, lens[i] - t0));
  };
  pagoda::parallel_tasks(static_cast<int64_t>(to_prepare.size()), [&](int64_t task) {
    const auto [i, h, c] = to_prepare[task];
    prepare(chunks[first_chunk[i * num_kv_heads + h] + c], i, h, c);
  });
  const int64_t num_items = static_cast<int64_t>(items.size());
  pagoda::parallel_tasks(num_items, [&](int64_t task) {  // last items first, as prefill_all's
    const PrefillItem& it = items[num_items - 1 - task];
    const int64_t row = starts[it.seq] + it.first_row;
    const int64_t q_len = starts[it.seq + 1] - starts[it.seq];
    const int64_t first_head = it.kv_head * group + it.g0;
    const int64_t base = first_chunk[it.seq * num_kv_heads + it.kv_head];
    Chunk scratch;
    auto chunk_at = [&](int64_t c) -> const Chunk& {
      if (base >= 0) return chunks[base + c];
      prepare(scratch, it.seq, it.kv_head, c);
      return scratch;
    };
    prefill_tile_bf16<kHeadSize>(q + row * query.stride(0) + first_head * query.stride(1), query.stride(0),
                                 query.stride(1), chunk_at, lens[it.seq] - q_len + it.first_row, it.rows, it.heads,
                                 scale, o + row * out.stride(0) + first_head * out.stride(1), out.stride(0),
                                 out.stride(1));
  });
}
#endif

template <typename scalar_t>
void prefill_all(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                 const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                 double scale, at::Tensor& out) {
  const int64_t num_seqs = seq_lens.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t heads_per_item = std::min(group, kTileVectors);
  const int64_t rows_per_item = std::max<int64_t>(1, kTileVectors / heads_per_item);
  std::vector<PrefillItem> items;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q_len = starts[i + 1] - starts[i];
    TORCH_CHECK(0 <= q_len && q_len <= lens[i], "paged_prefill_attention: sequence ", i, " has ", q_len,
                " query rows but a context of ", lens[i]);
    if (q_len < 2) continue;  // decode rows: paged_decode_attention
    for (int64_t r0 = 0; r0 < q_len; r0 += rows_per_item)
      for (int64_t h = 0; h < num_kv_heads; ++h)
        for (int64_t g0 = 0; g0 < group; g0 += heads_per_item)
          items.push_back({i, h, r0, std::min(rows_per_item, q_len - r0), g0, std::min(heads_per_item, group - g0)});
  }
#if defined(PAGODA_ISA_AVX512BF16)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (head_size == 64 || head_size == 128) {
      (head_size == 64 ? prefill_items_bf16<64> : prefill_items_bf16<128>)(
          items, rows_per_item, query, key_cache, value_cache, block_tables, starts, lens, static_cast<float>(scale),
          out);
      return;
    }
  }
#endif
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* k = key_cache.data_ptr<scalar_t>();
  const scalar_t* v = value_cache.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t block_stride = key_cache.stride(0), pos_stride = key_cache.stride(1), head_stride = key_cache.stride(2);
  auto tile = head_size == 64    ? prefill_tile<scalar_t, 64>
              : head_size == 128 ? prefill_tile<scalar_t, 128>
                                 : prefill_tile<scalar_t, 0>;
  const int64_t num_items = static_cast<int64_t>(items.size());
  // last items first: a sequence's last tiles see the most keys (causal), and the cheap ones fill in at the end
  pagoda::parallel_tasks(num_items, [&](int64_t task) {
    const PrefillItem& it = items[num_items - 1 - task];
    const int64_t row = starts[it.seq] + it.first_row;  // row in the batch
    const int64_t q_len = starts[it.seq + 1] - starts[it.seq];
    const int64_t first_head = it.kv_head * group + it.g0;
    tile(q + row * query.stride(0) + first_head * query.stride(1), query.stride(0), query.stride(1),
         k + it.kv_head * head_stride, v + it.kv_head * head_stride, block_stride, pos_stride,
         tables + it.seq * block_tables.stride(0), block_size, lens[it.seq] - q_len + it.first_row, it.rows, it.heads,
         head_size, static_cast<float>(scale), o + row * out.stride(0) + first_head * out.stride(1), out.stride(0),
         out.stride(1));
  });
}

void check_attention_args(const char* op, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& out) {
  TORCH_CHECK(query.device().is_cpu(), op, " runs on CPU tensors");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4,
              op, ": query must be [tokens, Hq, D] and the caches [num_blocks, block_size, H_kv, D]");
  TORCH_CHECK(key_cache.strides() == value_cache.strides() && key_cache.sizes() == value_cache.sizes(),
              op, ": key and value caches must have the same shape and strides");
  TORCH_CHECK(query.stride(2) == 1 && key_cache.stride(3) == 1 && out.stride(2) == 1,
              op, ": the head dimension must be contiguous");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              op, ": query, caches and out must share one dtype");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, op, ": query heads must be a multiple of KV heads");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && query.size(2) <= kMaxHeadSize,
              op, ": head size must match the cache and be at most ", kMaxHeadSize);
  TORCH_CHECK(out.sizes() == query.sizes(), op, ": out must have the query's shape");
}

// query/out [T, Hq, D], sequence i's rows query_start_loc[i]:query_start_loc[i+1], the last of its seq_lens[i]
// positions; only sequences with two or more rows are computed. Caches as paged_decode_attention's.
void paged_prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& seq_lens, double scale, at::Tensor out) {
  check_attention_args("paged_prefill_attention", query, key_cache, value_cache, out);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt && block_tables.stride(1) == 1 &&
                  seq_lens.is_contiguous() && query_start_loc.is_contiguous(),
              "paged_prefill_attention: block_tables, query_start_loc and seq_lens must be int32, contiguous rows");
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1 && block_tables.size(0) == seq_lens.size(0),
              "paged_prefill_attention: one block table row and one length per sequence, num_seqs + 1 starts");
  switch (query.scalar_type()) {
    case at::kFloat:
      prefill_all<float>(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, out);
      break;
    case at::kBFloat16:
      prefill_all<c10::BFloat16>(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, out);
      break;
    case at::kHalf:
      prefill_all<c10::Half>(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, out);
      break;
    default: TORCH_CHECK(false, "paged_prefill_attention supports float32, bfloat16 and float16");
  }
}

// query [B, Hq, D]; key_cache/value_cache [num_blocks, block_size, H_kv, D] (any strides, D contiguous);
// block_tables [B, max_blocks] int32; seq_lens [B] int32; out [B, Hq, D].
void paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                            at::Tensor out) {
  check_attention_args("paged_decode_attention", query, key_cache, value_cache, out);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.stride(1) == 1 && seq_lens.is_contiguous(),
              "block_tables and seq_lens must be int32 with contiguous rows");
  TORCH_CHECK(block_tables.size(0) == query.size(0) && seq_lens.size(0) == query.size(0),
              "one block table row and one length per query row");
  switch (query.scalar_type()) {
    case at::kFloat: decode_all<float>(query, key_cache, value_cache, block_tables, seq_lens, scale, out); break;
    case at::kBFloat16:
      decode_all<c10::BFloat16>(query, key_cache, value_cache, block_tables, seq_lens, scale, out);
      break;
    case at::kHalf: decode_all<c10::Half>(query, key_cache, value_cache, block_tables, seq_lens, scale, out); break;
    default: TORCH_CHECK(false, "paged_decode_attention supports float32, bfloat16 and float16");
  }
}

}  // namespace

TORCH_LIBRARY(pagoda_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
  m.def("paged_prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
