// Attention on CPU straight from the paged KV cache: decode (one query token per sequence) and prefill
// (several: a prompt, a prefill chunk, verified drafts).
//
// Decode reads each sequence's K and V blocks in place through its block table (no gather, no padding to
// the longest context), so every cached byte is read once. Work items are sequences with all their KV heads
// in the bfloat16 path (see decode_bf16), (sequence, KV head) pairs in the generic one; the query heads
// sharing a KV head (GQA) are scored together against each K row.
// Scores and the softmax are float32 whatever the cache dtype.
//
// The cache holds the query's dtype, or fp8 (float8_e4m3fn / float8_e5m2, per-tensor k_scale and v_scale:
// the stored keys times k_scale are the keys): fp8 rows are widened to float32 as they are read
// (csrc/fp8_upcast.h), k_scale folds into the query's scale and v_scale into the output's. A layer may have a
// sliding window (a query at position p sees p - window + 1 .. p: only those rows are read) and soft-capped
// scores (cap * tanh(score / cap), Gemma 2). Both, and fp8, take the generic float32 tiles; the AVX512_BF16
// paths are for plain attention over a bfloat16 cache.

#include <torch/library.h>
#include "cpu_isa.h"

#if defined(PAGODA_ISA_AVX512) || defined(PAGODA_ISA_AVX2)
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

#include "attention_ops.h"
#include "fp8_upcast.h"
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

// cap * tanh(x / cap) with exp_nonpositive: tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|)
inline float softcap_score(float x, float cap) {
  const float y = x / cap;
  const float e = exp_nonpositive(-2.f * std::fabs(y));
  return std::copysign((1.f - e) / (1.f + e), y) * cap;
}

// One row of the cache (head_size elements) as float32: a float cache's values; an fp8 cache's values divided
// by kFp8ReadFactor (the kernels' scales carry the rest)
template <typename cache_t>
inline void load_row(const cache_t* src, float* dst, int64_t n) {
  if constexpr (pagoda::kIsFp8<cache_t>) {
    pagoda::upcast_fp8(src, dst, n);
  } else {
    for (int64_t d = 0; d < n; ++d) dst[d] = to_float(src[d]);
  }
}

// What a layer's attention does besides plain causal softmax(q k^T scale) v, as the kernels receive it
struct Variant {
  float q_scale;   // the softmax scale, times k_scale * kFp8ReadFactor for an fp8 cache
  float out_scale;  // 1, or v_scale * kFp8ReadFactor for an fp8 cache
  int64_t window;  // 0: none; else a query at position p sees p - window + 1 .. p
  float softcap;   // 0: none; else scores = softcap * tanh(scores / softcap)

  bool plain() const { return window == 0 && softcap == 0.f && out_scale == 1.f; }
  // the first position a query at `pos` sees
  int64_t first_visible(int64_t pos) const { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }
};

template <typename cache_t>
Variant make_variant(double scale, double k_scale, double v_scale, int64_t window, double logit_softcap) {
  const bool fp8 = pagoda::kIsFp8<cache_t>;  // a float cache ignores the scales (a checkpoint may carry them)
  return {static_cast<float>(scale * (fp8 ? k_scale * pagoda::kFp8ReadFactor<cache_t> : 1.0)),
          static_cast<float>(fp8 ? v_scale * pagoda::kFp8ReadFactor<cache_t> : 1.0), window,
          static_cast<float>(logit_softcap)};
}

// Calls visit(row, i) for positions first + i < last of a context, row pointing at its entry in one KV
// head's cache, walking the block table one block at a time.
template <typename cache_t, typename Visit>
inline void for_each_row(const cache_t* cache, const int32_t* block_table, int64_t first, int64_t last,
                         int64_t block_size, int64_t block_stride, int64_t pos_stride, Visit&& visit) {
  for (int64_t t = first; t < last;) {
    const int64_t offset = t % block_size, n = std::min(block_size - offset, last - t);
    const cache_t* block = cache + block_table[t / block_size] * block_stride;
    for (int64_t i = 0; i < n; ++i) visit(block + (offset + i) * pos_stride, t - first + i);
    t += n;
  }
}

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

constexpr int64_t kMaxHeadSize = 256;  // MAX_HEAD_SIZE in cpu_kernels.py
constexpr int64_t kPrefetchBlocks = 2;  // how far ahead decode prefetches a block that starts a run
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
    float total = 0.f;
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

// softcap_score of 16 lanes
inline __m512 softcap16(__m512 x, float cap) {
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.f / cap));
  const __m512 e = exp_nonpositive16(_mm512_mul_ps(_mm512_abs_ps(y), _mm512_set1_ps(-2.f)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign)), _mm512_set1_ps(cap));
}

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
  auto row_at = [&](const cache_t* cache, int64_t t) {
    return reinterpret_cast<const uint8_t*>(cache + block_table[t / block_size] * block_stride +
                                            (t % block_size) * pos_stride);
  };
  __m512 q[kN][kVecs];
  for (int g = 0; g < kN; ++g)
    for (int i = 0; i < kVecs; ++i) q[g][i] = _mm512_loadu_ps(qf + g * kHeadSize + 16 * i);
  alignas(64) float keys[16][kHeadSize];
  for (int64_t c0 = 0; c0 < len; c0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - c0);
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* k = row_at(k_cache, first + c0 + j);
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
  for (int g = 0; g < kN; ++g) {  // softmax, unnormalised: 1 / total goes into the output scale
    float* sg = s + g * len;
    float max_score = std::numeric_limits<float>::lowest();
    for (int64_t t = 0; t < len; ++t) max_score = std::max(max_score, sg[t]);
    float total = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      sg[t] = exp_nonpositive(sg[t] - max_score);
      total += sg[t];
    }
    totals[g] = total;
  }
  __m512 acc[kN][kVecs];
  for (int g = 0; g < kN; ++g)
    for (int i = 0; i < kVecs; ++i) acc[g][i] = _mm512_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    const uint8_t* v = row_at(v_cache, first + t);
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
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>) {
    if (variant.plain() && block_size % 2 == 0 && (head_size == 64 || head_size == 128)) {
      auto decode = head_size == 64 ? decode_bf16<64> : decode_bf16<128>;
      // a sequence's KV heads together when every thread gets a sequence; else one item per KV head
      const int64_t heads_per_item = num_seqs >= at::get_num_threads() ? num_kv_heads : 1;
      const int64_t items_per_seq = num_kv_heads / heads_per_item;
      pagoda::parallel_tasks(num_seqs * items_per_seq, [&](int64_t item) {
        thread_local std::vector<float> scratch;
        const int64_t i = item / items_per_seq, h = item % items_per_seq * heads_per_item;
        decode(q + i * q_seq + h * group * q_head, q_head, k + h * head_stride, v + h * head_stride, block_stride,
               pos_stride, head_stride, heads_per_item, group, tables + i * table_stride, lens[i], block_size,
               variant.q_scale, o + i * o_seq + h * group * o_head, o_head, scratch);
      });
      return;
    }
  }
#endif
#if defined(PAGODA_ISA_AVX512)
  if constexpr (pagoda::kIsFp8<cache_t>) {
    if (head_size == 64 || head_size == 128) {
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
             head_size, variant, o + i * o_seq + first_head * o_head, o_head, scores);
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

// Folds one chunk's scores s (keys [begin, end) of the chunk visible) into vector v's state.
template <int kWidth>
inline void online_softmax_update(TileState<kWidth>& st, int64_t v, float* s, int64_t begin, int64_t end,
                                  int64_t head_size, float cap) {
  if (cap > 0.f)
    for (int64_t j = begin; j < end; ++j) s[j] = softcap_score(s[j], cap);
  float chunk_max = -std::numeric_limits<float>::infinity();
  for (int64_t j = begin; j < end; ++j) chunk_max = std::max(chunk_max, s[j]);
  const float new_max = std::max(st.row_max[v], chunk_max);
  const float rescale = std::exp(st.row_max[v] - new_max);  // 0 for the first chunk (max was -inf)
  float p[kKeysPerChunk];
  float chunk_sum = 0.f;
  for (int64_t j = begin; j < end; ++j) {
    p[j] = exp_nonpositive(s[j] - new_max);
    chunk_sum += p[j];
  }
  st.row_max[v] = new_max;
  st.row_sum[v] = st.row_sum[v] * rescale + chunk_sum;
  float* o = st.acc[v];
  for (int64_t d = 0; d < head_size; ++d) o[d] *= rescale;
  for (int64_t j = begin; j < end; ++j)
    for (int64_t d = 0; d < head_size; ++d) o[d] += p[j] * st.values[j][d];
}

#if defined(PAGODA_ISA_AVX512)
// Vectors v..v+kVectors-1 against the chunk: their scores share each key row load (kVectors independent
// FMA chains), then each takes its softmax step over its visible keys [begin, end) and adds their weighted
// value rows, kHeadSize/16 vectors wide.
template <int kHeadSize, int kVectors>
inline void chunk_step_avx512(TileState<kHeadSize>& st, int64_t v, const int64_t* begin, const int64_t* end,
                              float cap) {
  constexpr int kLanes = kHeadSize / 16;
  __m512 s[kVectors];
  for (int q = 0; q < kVectors; ++q) s[q] = _mm512_setzero_ps();
  for (int d = 0; d < kHeadSize; ++d) {
    const __m512 k = _mm512_load_ps(st.keys_t[d]);
    for (int q = 0; q < kVectors; ++q) s[q] = _mm512_fmadd_ps(_mm512_set1_ps(st.query[v + q][d]), k, s[q]);
  }
  for (int q = 0; q < kVectors; ++q) {
    if (end[q] <= begin[q]) continue;
    const __mmask16 mask = static_cast<__mmask16>(((1u << end[q]) - 1) & ~((1u << begin[q]) - 1));
    const __m512 scores = cap > 0.f ? softcap16(s[q], cap) : s[q];
    const float chunk_max = _mm512_mask_reduce_max_ps(mask, scores);
    const float new_max = std::max(st.row_max[v + q], chunk_max);
    const float rescale = exp_nonpositive(st.row_max[v + q] - new_max);  // -inf - x: clamped to ~1e-38, times 0
    const __m512 p = _mm512_maskz_mov_ps(mask, exp_nonpositive16(_mm512_sub_ps(scores, _mm512_set1_ps(new_max))));
    st.row_max[v + q] = new_max;
    st.row_sum[v + q] = st.row_sum[v + q] * rescale + _mm512_reduce_add_ps(p);
    alignas(64) float pj[kKeysPerChunk];
    _mm512_store_ps(pj, p);
    __m512 o[kLanes];
    const __m512 r = _mm512_set1_ps(rescale);
    for (int i = 0; i < kLanes; ++i) o[i] = _mm512_mul_ps(_mm512_load_ps(st.acc[v + q] + 16 * i), r);
    for (int j = static_cast<int>(begin[q]); j < end[q]; ++j) {
      const __m512 w = _mm512_set1_ps(pj[j]);
      for (int i = 0; i < kLanes; ++i) o[i] = _mm512_fmadd_ps(w, _mm512_load_ps(st.values[j] + 16 * i), o[i]);
    }
    for (int i = 0; i < kLanes; ++i) _mm512_store_ps(st.acc[v + q] + 16 * i, o[i]);
  }
}
#endif

template <typename scalar_t, typename cache_t, int kHeadSize>
void prefill_tile(
    const scalar_t* q, int64_t q_row_stride, int64_t q_head_stride,  // first row's first head of the group
    const cache_t* k_cache, const cache_t* v_cache,  // at this KV head
    int64_t block_stride, int64_t pos_stride, const int32_t* block_table, int64_t block_size,
    int64_t first_pos, int64_t rows, int64_t group, int64_t head_size, const Variant& variant,
    scalar_t* out, int64_t out_row_stride, int64_t out_head_stride) {
  if constexpr (kHeadSize > 0) head_size = kHeadSize;
  constexpr int kWidth = kHeadSize > 0 ? kHeadSize : kMaxHeadSize;
  TileState<kWidth> st;
  const int64_t vectors = rows * group;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t v = r * group + g;
      for (int64_t d = 0; d < head_size; ++d)
        st.query[v][d] = to_float(q[r * q_row_stride + g * q_head_stride + d]) * variant.q_scale;
      for (int64_t d = 0; d < head_size; ++d) st.acc[v][d] = 0.f;
      st.row_max[v] = -std::numeric_limits<float>::infinity();
      st.row_sum[v] = 0.f;
    }
  const int64_t last_pos = first_pos + rows - 1;
  const int64_t lowest = variant.first_visible(first_pos);  // no row of the tile sees a key before it
  alignas(64) float row[kWidth];
  for (int64_t t0 = lowest / kKeysPerChunk * kKeysPerChunk; t0 <= last_pos; t0 += kKeysPerChunk) {
    const int64_t keys = std::min(kKeysPerChunk, last_pos + 1 - t0);
    for (int64_t j = 0; j < kKeysPerChunk; ++j) {
      // outside [lowest, last_pos]: repeat a key that exists (never weighted)
      const int64_t t = std::max(lowest, t0 + std::min(j, keys - 1));
      const int64_t offset = block_table[t / block_size] * block_stride + (t % block_size) * pos_stride;
      load_row(k_cache + offset, row, head_size);
      for (int64_t d = 0; d < head_size; ++d) st.keys_t[d][j] = row[d];
      load_row(v_cache + offset, st.values[j], head_size);
    }
    // causal: vector v (row v / group, at position first_pos + v / group) sees keys t0 + [begin, end)
    int64_t begin[kTileVectors], end[kTileVectors];
    for (int64_t v = 0; v < vectors; ++v) {
      const int64_t pos = first_pos + v / group;
      end[v] = std::min(keys, pos - t0 + 1);
      begin[v] = std::max<int64_t>(0, variant.first_visible(pos) - t0);
    }
    int64_t v = 0;
#if defined(PAGODA_ISA_AVX512)
    if constexpr (kHeadSize > 0 && kHeadSize % 16 == 0) {
      for (; v + 4 <= vectors; v += 4) chunk_step_avx512<kHeadSize, 4>(st, v, begin + v, end + v, variant.softcap);
      for (; v < vectors; ++v) chunk_step_avx512<kHeadSize, 1>(st, v, begin + v, end + v, variant.softcap);
    }
#endif
    for (; v < vectors; ++v) {
      if (end[v] <= begin[v]) continue;
      float s[kKeysPerChunk] = {0.f};
      for (int64_t d = 0; d < head_size; ++d)
        for (int64_t j = 0; j < kKeysPerChunk; ++j) s[j] += st.query[v][d] * st.keys_t[d][j];
      online_softmax_update(st, v, s, begin[v], end[v], head_size, variant.softcap);
    }
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t v = r * group + g;
      const float inv = variant.out_scale / st.row_sum[v];
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

template <typename scalar_t, typename cache_t>
void prefill_all(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                 const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                 const Variant& variant, at::Tensor& out) {
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
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>) {
    if (variant.plain() && (head_size == 64 || head_size == 128)) {
      (head_size == 64 ? prefill_items_bf16<64> : prefill_items_bf16<128>)(
          items, rows_per_item, query, key_cache, value_cache, block_tables, starts, lens, variant.q_scale, out);
      return;
    }
  }
#endif
  const scalar_t* q = query.data_ptr<scalar_t>();
  const auto* k = static_cast<const cache_t*>(key_cache.data_ptr());
  const auto* v = static_cast<const cache_t*>(value_cache.data_ptr());
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t block_stride = key_cache.stride(0), pos_stride = key_cache.stride(1), head_stride = key_cache.stride(2);
  auto tile = head_size == 64    ? prefill_tile<scalar_t, cache_t, 64>
              : head_size == 128 ? prefill_tile<scalar_t, cache_t, 128>
                                 : prefill_tile<scalar_t, cache_t, 0>;
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
         head_size, variant, o + row * out.stride(0) + first_head * out.stride(1), out.stride(0), out.stride(1));
  });
}

bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

void check_attention_args(const char* op, const at::Tensor& query, const at::Tensor& key_cache,
                          const at::Tensor& value_cache, const at::Tensor& out, double k_scale, double v_scale,
                          int64_t sliding_window, double logit_softcap) {
  TORCH_CHECK(query.device().is_cpu(), op, " runs on CPU tensors");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4,
              op, ": query must be [tokens, Hq, D] and the caches [num_blocks, block_size, H_kv, D]");
  TORCH_CHECK(key_cache.strides() == value_cache.strides() && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.scalar_type() == value_cache.scalar_type(),
              op, ": key and value caches must have the same shape, strides and dtype");
  TORCH_CHECK(query.stride(2) == 1 && key_cache.stride(3) == 1 && out.stride(2) == 1,
              op, ": the head dimension must be contiguous");
  TORCH_CHECK((query.scalar_type() == key_cache.scalar_type() || is_fp8(key_cache.scalar_type())) &&
                  out.scalar_type() == query.scalar_type(),
              op, ": query, caches and out must share one dtype (or the caches be float8_e4m3fn / float8_e5m2)");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, op, ": query heads must be a multiple of KV heads");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && query.size(2) <= kMaxHeadSize,
              op, ": head size must match the cache and be at most ", kMaxHeadSize);
  TORCH_CHECK(out.sizes() == query.sizes(), op, ": out must have the query's shape");
  TORCH_CHECK(k_scale > 0 && v_scale > 0, op, ": k_scale and v_scale must be positive, got ", k_scale, " and ",
              v_scale);
  TORCH_CHECK(sliding_window >= 0, op, ": sliding_window must be a positive number of positions (0: none), got ",
              sliding_window);
  TORCH_CHECK(logit_softcap >= 0, op, ": logit_softcap must be positive (0: none), got ", logit_softcap);
}

// Calls run(scalar_t{}, cache_t{}) for the query's dtype and the cache's (the same, or an fp8 one)
template <typename Run>
void with_dtypes(const char* op, const at::Tensor& query, const at::Tensor& key_cache, Run&& run) {
  auto with_cache = [&](auto scalar) {
    using scalar_t = decltype(scalar);
    switch (key_cache.scalar_type()) {
      case at::kFloat8_e4m3fn: run(scalar, c10::Float8_e4m3fn()); break;
      case at::kFloat8_e5m2: run(scalar, c10::Float8_e5m2()); break;
      default: run(scalar, scalar_t()); break;
    }
  };
  switch (query.scalar_type()) {
    case at::kFloat: with_cache(float()); break;
    case at::kBFloat16: with_cache(c10::BFloat16()); break;
    case at::kHalf: with_cache(c10::Half()); break;
    default: TORCH_CHECK(false, op, " supports float32, bfloat16 and float16 queries");
  }
}

// query/out [T, Hq, D], sequence i's rows query_start_loc[i]:query_start_loc[i+1], the last of its seq_lens[i]
// positions; only sequences with two or more rows are computed. Caches and the rest as paged_decode_attention's.
void paged_prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& seq_lens, double scale, at::Tensor out, double k_scale,
                             double v_scale, int64_t sliding_window, double logit_softcap) {
  check_attention_args("paged_prefill_attention", query, key_cache, value_cache, out, k_scale, v_scale,
                       sliding_window, logit_softcap);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt && block_tables.stride(1) == 1 &&
                  seq_lens.is_contiguous() && query_start_loc.is_contiguous(),
              "paged_prefill_attention: block_tables, query_start_loc and seq_lens must be int32, contiguous rows");
  TORCH_CHECK(query_start_loc.size(0) == seq_lens.size(0) + 1 && block_tables.size(0) == seq_lens.size(0),
              "paged_prefill_attention: one block table row and one length per sequence, num_seqs + 1 starts");
  with_dtypes("paged_prefill_attention", query, key_cache, [&](auto scalar, auto cache) {
    using scalar_t = decltype(scalar);
    using cache_t = decltype(cache);
    const Variant variant = make_variant<cache_t>(scale, k_scale, v_scale, sliding_window, logit_softcap);
    prefill_all<scalar_t, cache_t>(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, variant,
                                   out);
  });
}

// query [B, Hq, D]; key_cache/value_cache [num_blocks, block_size, H_kv, D] (any strides, D contiguous) in the
// query's dtype, or fp8 holding keys / k_scale and values / v_scale; block_tables [B, max_blocks] int32; seq_lens
// [B] int32; out [B, Hq, D]. sliding_window: 0 or the positions a query sees, itself included; logit_softcap: 0
// or the cap of the scores.
void paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                            at::Tensor out, double k_scale, double v_scale, int64_t sliding_window,
                            double logit_softcap) {
  check_attention_args("paged_decode_attention", query, key_cache, value_cache, out, k_scale, v_scale,
                       sliding_window, logit_softcap);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.stride(1) == 1 && seq_lens.is_contiguous(),
              "block_tables and seq_lens must be int32 with contiguous rows");
  TORCH_CHECK(block_tables.size(0) == query.size(0) && seq_lens.size(0) == query.size(0),
              "one block table row and one length per query row");
  with_dtypes("paged_decode_attention", query, key_cache, [&](auto scalar, auto cache) {
    using scalar_t = decltype(scalar);
    using cache_t = decltype(cache);
    const Variant variant = make_variant<cache_t>(scale, k_scale, v_scale, sliding_window, logit_softcap);
    decode_all<scalar_t, cache_t>(query, key_cache, value_cache, block_tables, seq_lens, variant, out);
  });
}

// The fp8 cache write (vLLM's reshape_and_cache with an fp8 cache): key/value [T, Hkv, D] (float32, bfloat16 or
// float16; D contiguous) into kv_cache [2, num_blocks, block_size, Hkv, D] (float8_e4m3fn / float8_e5m2) at
// slot_mapping [T] int64 (-1 skips) as fp8(x * (1 / scale)) saturated at the format's largest value: the same
// float32 product, clamp and rounding (c10's, to nearest even) as the torch path's kv_scales.quantize.
template <typename scalar_t, typename cache_t>
void write_fp8_rows(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const int64_t* slots,
                    float k_inv, float v_inv) {
  const int64_t tokens = key.size(0), heads = key.size(1), head_size = key.size(2);
  const int64_t block_size = kv_cache.size(2);
  const float limit = static_cast<float>(std::numeric_limits<cache_t>::max());
  auto* cache = static_cast<cache_t*>(kv_cache.data_ptr());
  const scalar_t* k = key.data_ptr<scalar_t>();
  const scalar_t* v = value.data_ptr<scalar_t>();
  auto write = [&](const scalar_t* src, cache_t* dst, float inv) {
    for (int64_t d = 0; d < head_size; ++d)
      dst[d] = cache_t(std::min(limit, std::max(-limit, to_float(src[d]) * inv)));
  };
  at::parallel_for(0, tokens, std::max<int64_t>(1, 4096 / (2 * heads * head_size)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t dst = block * kv_cache.stride(1) + offset * kv_cache.stride(2) + h * kv_cache.stride(3);
        write(k + t * key.stride(0) + h * key.stride(1), cache + dst, k_inv);
        write(v + t * value.stride(0) + h * value.stride(1), cache + kv_cache.stride(0) + dst, v_inv);
      }
    }
  });
}

void write_kv_cache_fp8(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
                        const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  TORCH_CHECK(key.device().is_cpu() && kv_cache.device().is_cpu(), "write_kv_cache_fp8 runs on CPU tensors");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "write_kv_cache_fp8: key/value must be [T, Hkv, D] and kv_cache [2, num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(key.size(1) == kv_cache.size(3) && key.size(2) == kv_cache.size(4),
              "write_kv_cache_fp8: key ", key.sizes(), " does not match the cache ", kv_cache.sizes());
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && kv_cache.stride(4) == 1,
              "write_kv_cache_fp8: the head dimension must be contiguous");
  TORCH_CHECK(is_fp8(kv_cache.scalar_type()), "write_kv_cache_fp8: the cache must be float8_e4m3fn or float8_e5m2");
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), "write_kv_cache_fp8: key and value must share one dtype");
  TORCH_CHECK(k_scale > 0 && v_scale > 0, "write_kv_cache_fp8: k_scale and v_scale must be positive");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0),
              "write_kv_cache_fp8: slot_mapping must be int64 [T]");
  const int64_t slots_in_cache = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < key.size(0); ++t)
    TORCH_CHECK(slots[t] >= -1 && slots[t] < slots_in_cache, "write_kv_cache_fp8: slot ", slots[t],
                " outside the cache of ", slots_in_cache, " slots");
  // as torch multiplies a float32 tensor by the Python float 1 / scale: in float32
  const float k_inv = static_cast<float>(1.0 / k_scale), v_inv = static_cast<float>(1.0 / v_scale);
  with_dtypes("write_kv_cache_fp8", key, kv_cache, [&](auto scalar, auto cache) {
    using scalar_t = decltype(scalar);
    using cache_t = decltype(cache);
    if constexpr (pagoda::kIsFp8<cache_t>) write_fp8_rows<scalar_t, cache_t>(key, value, kv_cache, slots, k_inv, v_inv);
  });
}

}  // namespace

static_assert(std::is_same_v<decltype(paged_decode_attention), pagoda::ops::PagedDecodeAttention> &&
                  std::is_same_v<decltype(paged_prefill_attention), pagoda::ops::PagedPrefillAttention> &&
                  std::is_same_v<decltype(write_kv_cache_fp8), pagoda::ops::WriteKvCacheFp8>,
              "the ops' signatures are csrc/attention_ops.h's");

TORCH_LIBRARY(pagoda_cpu, m) {
  m.def(pagoda::ops::kPagedDecodeAttentionSchema);
  m.def(pagoda::ops::kPagedPrefillAttentionSchema);
  m.def(pagoda::ops::kWriteKvCacheFp8Schema);
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("write_kv_cache_fp8", &write_kv_cache_fp8);
}
