// Decode attention for a bfloat16 cache with AVX2 + FMA (no bfloat16 instructions), for one sequence; the
// library's decode (attention/paged_decode_cpu.cpp) splits the batch into such items. No ATen: the kernel
// builds into standalone harnesses too.
//
// The cache rows stay bfloat16 and are widened in registers as the matmul's weights are (bf16_matmul_avx2.h):
// 16 values loaded as 8 int32 pairs give the even elements by `pair << 16` and the odd ones by
// `pair & 0xFFFF0000`, one instruction per 8 floats. A dot product does not care about the order of its
// terms, so the query is kept in the same even/odd order, and so are the P @ V sums until they are written.
//
// As the AVX512_BF16 kernel, an item sweeps its context block by block in memory order, every KV head of the
// block in turn, once for the scores and once for P @ V (paged_decode_sweep.h's BlockSweep, which prefetches
// a block that does not follow its predecessor in memory). Scores: 8 keys widened into a small float buffer,
// then each query head of the group dots them and the 8 sums are reduced together (sum_each8). Softmax in
// float32 (unnormalised: 1 / total scales the output). P @ V: per 16 output elements, the group's query heads
// (up to 4 at once) accumulate in registers over the block's keys.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "avx2_math.h"
#include "bf16_scalar.h"
#include "paged_decode_sweep.h"

namespace pagoda::attention::avx2 {

using bf16 = c10::BFloat16;
using pagoda::avx2::exp_nonpositive8;
using pagoda::avx2::first_lanes;
using pagoda::avx2::max_of8;
using pagoda::avx2::sum_each8;
using pagoda::avx2::sum_of8;

constexpr int kUnit = 4;                // query heads whose P @ V sums share one pass over a block's values

// 16 bfloat16 at p -> their even elements and their odd ones, in float32
inline void widen16(const bf16* p, __m256& even, __m256& odd) {
  const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// kN query heads' P @ V sums of 16 output elements (acc: per head an even and an odd vector, heads acc_stride
// floats apart) += the heads' probabilities (rows p_stride apart) over n value rows of one KV head
template <int kN>
inline void accumulate16(const float* p, int64_t p_stride, const bf16* values, int64_t pos_stride, int64_t n,
                         float* acc, int64_t acc_stride) {
  __m256 a[kN][2];
  for (int g = 0; g < kN; ++g) {
    a[g][0] = _mm256_loadu_ps(acc + g * acc_stride);
    a[g][1] = _mm256_loadu_ps(acc + g * acc_stride + 8);
  }
  for (int64_t t = 0; t < n; ++t) {
    __m256 even, odd;
    widen16(values + t * pos_stride, even, odd);
    for (int g = 0; g < kN; ++g) {
      const __m256 w = _mm256_broadcast_ss(p + g * p_stride + t);
      a[g][0] = _mm256_fmadd_ps(w, even, a[g][0]);
      a[g][1] = _mm256_fmadd_ps(w, odd, a[g][1]);
    }
  }
  for (int g = 0; g < kN; ++g) {
    _mm256_storeu_ps(acc + g * acc_stride, a[g][0]);
    _mm256_storeu_ps(acc + g * acc_stride + 8, a[g][1]);
  }
}

// One sequence's decode attention over KV heads 0..num_kv_heads of the pointers given (q/out: their first
// query head's row; k_cache/v_cache: their first KV head). kHeadSize: 64 or 128 (a multiple of 16).
template <int kHeadSize>
void decode_sequence(const bf16* q, int64_t q_head_stride, const bf16* k_cache, const bf16* v_cache,
                     int64_t block_stride, int64_t pos_stride, int64_t head_stride, int64_t num_kv_heads,
                     int64_t group, const int32_t* block_table, int64_t seq_len, int64_t block_size, float scale,
                     bf16* out, int64_t out_head_stride, std::vector<float>& scratch) {
  static_assert(kHeadSize % 16 == 0, "the head size is widened 16 values at a time");
  constexpr int kVecs = kHeadSize / 8;
  const int64_t heads = num_kv_heads * group;
  const int64_t padded_len = seq_len + 8;  // a chunk of 8 scores may run past the context
  const int64_t need = heads * kHeadSize * 2 + heads * padded_len + 8 * kHeadSize + heads;
  if (static_cast<int64_t>(scratch.size()) < need) scratch.resize(need);
  float* qf = scratch.data();                  // [heads, D] scaled, even/odd order per 16
  float* acc = qf + heads * kHeadSize;         // [heads, D] P @ V sums, the same order
  float* s = acc + heads * kHeadSize;          // [heads, padded_len] scores, then exp(score - max)
  float* keys = s + heads * padded_len;        // [8, D] widened key rows
  float* total = keys + 8 * kHeadSize;         // [heads] sums of the exps

  for (int64_t head = 0; head < heads; ++head)
    for (int64_t c = 0; c < kHeadSize; c += 16) {
      __m256 even, odd;
      widen16(q + head * q_head_stride + c, even, odd);
      _mm256_storeu_ps(qf + head * kHeadSize + c, _mm256_mul_ps(even, _mm256_set1_ps(scale)));
      _mm256_storeu_ps(qf + head * kHeadSize + c + 8, _mm256_mul_ps(odd, _mm256_set1_ps(scale)));
    }

  const BlockSweep<bf16, kHeadSize, PrefetchL2X86> sweep(block_table, seq_len, block_size, block_stride,
                                                      pos_stride, head_stride, num_kv_heads);

  // scores: s[head][t] = q . k_t
  sweep(k_cache, [&](int64_t t0, int64_t n, const bf16* block) {
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t c0 = 0; c0 < n; c0 += 8) {
        const int64_t count = std::min<int64_t>(8, n - c0);
        for (int64_t j = 0; j < 8; ++j) {
          float* row = keys + j * kHeadSize;
          if (j >= count) {  // past the block: zeros (their scores land in s's padding or are overwritten)
            for (int i = 0; i < kVecs; ++i) _mm256_storeu_ps(row + 8 * i, _mm256_setzero_ps());
            continue;
          }
          const bf16* k = block + h * head_stride + (c0 + j) * pos_stride;
          for (int c = 0; c < kHeadSize; c += 16) {
            __m256 even, odd;
            widen16(k + c, even, odd);
            _mm256_storeu_ps(row + c, even);
            _mm256_storeu_ps(row + c + 8, odd);
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf + (h * group + g) * kHeadSize;
          __m256 partial[8];
          for (int j = 0; j < 8; ++j) partial[j] = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_loadu_ps(keys + j * kHeadSize));
          for (int i = 1; i < kVecs; ++i) {
            const __m256 qv = _mm256_loadu_ps(qg + 8 * i);
            for (int j = 0; j < 8; ++j)
              partial[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys + j * kHeadSize + 8 * i), partial[j]);
          }
          _mm256_storeu_ps(s + (h * group + g) * padded_len + t0 + c0, sum_each8(partial));
        }
      }
  });

  // softmax, unnormalised: s = exp(s - max); 1 / total scales the output
  for (int64_t head = 0; head < heads; ++head) {
    float* sh = s + head * padded_len;
    const int64_t full = seq_len / 8 * 8;
    __m256 max8 = _mm256_set1_ps(std::numeric_limits<float>::lowest());
    for (int64_t t = 0; t < full; t += 8) max8 = _mm256_max_ps(max8, _mm256_loadu_ps(sh + t));
    float max_score = max_of8(max8);
    for (int64_t t = full; t < seq_len; ++t) max_score = std::max(max_score, sh[t]);
    const __m256 top = _mm256_set1_ps(max_score);
    __m256 sum8 = _mm256_setzero_ps();
    for (int64_t t = 0; t < seq_len; t += 8) {  // the last vector's lanes past the context become 0
      const __m256 e = _mm256_and_ps(first_lanes(seq_len - t), exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(sh + t), top)));
      _mm256_storeu_ps(sh + t, e);
      sum8 = _mm256_add_ps(sum8, e);
    }
    total[head] = sum_of8(sum8);
  }

  // P @ V
  values_pass<kUnit, kHeadSize>(sweep, v_cache, num_kv_heads, group, s, padded_len, head_stride, pos_stride, acc,
                                 [](auto unit, auto... args) { accumulate16<decltype(unit)::value>(args...); });

  // back to element order, normalised and rounded
  for (int64_t head = 0; head < heads; ++head) {
    const float inv_total = 1.f / total[head];
    const float* a = acc + head * kHeadSize;
    bf16* o = out + head * out_head_stride;
    for (int64_t c = 0; c < kHeadSize; c += 16)
      for (int i = 0; i < 8; ++i) {
        o[c + 2 * i] = pagoda::float_to_bf16(a[c + i] * inv_total);
        o[c + 2 * i + 1] = pagoda::float_to_bf16(a[c + 8 + i] * inv_total);
      }
  }
}

}  // namespace pagoda::attention::avx2
