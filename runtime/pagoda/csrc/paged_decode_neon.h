// Decode attention for a bfloat16 cache with NEON (every aarch64 CPU; no BF16 instructions needed), for one
// sequence: csrc/paged_decode_avx2.h's method with 4-lane vectors (see there). No ATen: the kernel also
// builds into tests/kernels/neon_kernels_harness.cpp, which runs it under qemu-aarch64.
//
// A bfloat16 row widens in order with `vshll` (each value shifted into the top half of a 32-bit lane), so the
// query and the P @ V sums keep the element order. Scores: 4 keys widened into a small float buffer, dotted
// by each query head of the group and reduced together by pairwise adds. P @ V: per 16 output elements, up
// to 4 query heads accumulate in registers (16 of NEON's 32) over a block's keys.
#pragma once

#include <arm_neon.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "bf16_scalar.h"
#include "paged_decode_sweep.h"

namespace pagoda::attention::neon {

using bf16 = c10::BFloat16;

constexpr int kUnit = 4;                // query heads whose P @ V sums share one pass over a block's values

// 8 bfloat16 at p -> float32, in order
inline void widen8(const bf16* p, float32x4_t& lo, float32x4_t& hi) {
  const uint16x8_t v = vld1q_u16(reinterpret_cast<const uint16_t*>(p));
  lo = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(v), 16));
  hi = vreinterpretq_f32_u32(vshll_high_n_u16(v, 16));
}

// exp(x) of 4 lanes for x <= 0, as paged_attention_common.h's exp_nonpositive
inline float32x4_t exp_nonpositive4(float32x4_t x) {
  const float32x4_t t = vmaxq_f32(vmulq_n_f32(x, 1.44269504f), vdupq_n_f32(-126.f));
  const float32x4_t i = vrndmq_f32(t);
  const float32x4_t f = vsubq_f32(t, i);
  float32x4_t p = vdupq_n_f32(1.87537657e-3f);
  p = vfmaq_f32(vdupq_n_f32(8.98725919e-3f), p, f);
  p = vfmaq_f32(vdupq_n_f32(5.58359654e-2f), p, f);
  p = vfmaq_f32(vdupq_n_f32(2.40146495e-1f), p, f);
  p = vfmaq_f32(vdupq_n_f32(6.93154738e-1f), p, f);
  p = vfmaq_f32(vdupq_n_f32(9.99999834e-1f), p, f);
  const int32x4_t bits = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(i), vdupq_n_s32(127)), 23);
  return vmulq_f32(p, vreinterpretq_f32_s32(bits));
}

// all-ones in the lanes j < n
inline uint32x4_t first_lanes(int64_t n) {
  const uint32_t index[4] = {0, 1, 2, 3};
  return vcltq_u32(vld1q_u32(index), vdupq_n_u32(static_cast<uint32_t>(std::min<int64_t>(n, 4))));
}

// kN query heads' P @ V sums of 16 output elements (heads acc_stride floats apart) += their probabilities
// (rows p_stride apart) over n value rows of one KV head
template <int kN>
inline void accumulate16(const float* p, int64_t p_stride, const bf16* values, int64_t pos_stride, int64_t n,
                         float* acc, int64_t acc_stride) {
  float32x4_t a[kN][4];
  for (int g = 0; g < kN; ++g)
    for (int i = 0; i < 4; ++i) a[g][i] = vld1q_f32(acc + g * acc_stride + 4 * i);
  for (int64_t t = 0; t < n; ++t) {
    float32x4_t v[4];
    widen8(values + t * pos_stride, v[0], v[1]);
    widen8(values + t * pos_stride + 8, v[2], v[3]);
    for (int g = 0; g < kN; ++g) {
      const float32x4_t w = vdupq_n_f32(p[g * p_stride + t]);
      for (int i = 0; i < 4; ++i) a[g][i] = vfmaq_f32(a[g][i], w, v[i]);
    }
  }
  for (int g = 0; g < kN; ++g)
    for (int i = 0; i < 4; ++i) vst1q_f32(acc + g * acc_stride + 4 * i, a[g][i]);
}

// One sequence's decode attention over KV heads 0..num_kv_heads of the pointers given (q/out: their first
// query head's row; k_cache/v_cache: their first KV head). kHeadSize: 64 or 128 (a multiple of 16).
template <int kHeadSize>
void decode_sequence(const bf16* q, int64_t q_head_stride, const bf16* k_cache, const bf16* v_cache,
                     int64_t block_stride, int64_t pos_stride, int64_t head_stride, int64_t num_kv_heads,
                     int64_t group, const int32_t* block_table, int64_t seq_len, int64_t block_size, float scale,
                     bf16* out, int64_t out_head_stride, std::vector<float>& scratch) {
  static_assert(kHeadSize % 16 == 0, "the head size is read 16 values at a time");
  constexpr int kVecs = kHeadSize / 4;
  const int64_t heads = num_kv_heads * group;
  const int64_t padded_len = seq_len + 4;  // a chunk of 4 scores may run past the context
  const int64_t need = heads * kHeadSize * 2 + heads * padded_len + 4 * kHeadSize + heads;
  if (static_cast<int64_t>(scratch.size()) < need) scratch.resize(need);
  float* qf = scratch.data();           // [heads, D] scaled
  float* acc = qf + heads * kHeadSize;  // [heads, D] P @ V sums
  float* s = acc + heads * kHeadSize;   // [heads, padded_len] scores, then exp(score - max)
  float* keys = s + heads * padded_len;  // [4, D] widened key rows
  float* total = keys + 4 * kHeadSize;   // [heads] sums of the exps

  for (int64_t head = 0; head < heads; ++head)
    for (int64_t c = 0; c < kHeadSize; c += 8) {
      float32x4_t lo, hi;
      widen8(q + head * q_head_stride + c, lo, hi);
      vst1q_f32(qf + head * kHeadSize + c, vmulq_n_f32(lo, scale));
      vst1q_f32(qf + head * kHeadSize + c + 4, vmulq_n_f32(hi, scale));
    }

  const BlockSweep<bf16, kHeadSize, PrefetchL2Arm> sweep(block_table, seq_len, block_size, block_stride,
                                                      pos_stride, head_stride, num_kv_heads);

  // scores: s[head][t] = q . k_t
  sweep(k_cache, [&](int64_t t0, int64_t n, const bf16* block) {
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t c0 = 0; c0 < n; c0 += 4) {
        const int64_t count = std::min<int64_t>(4, n - c0);
        for (int64_t j = 0; j < 4; ++j) {
          float* row = keys + j * kHeadSize;
          if (j >= count) {  // past the block: zeros (their scores land in s's padding or are overwritten)
            for (int i = 0; i < kVecs; ++i) vst1q_f32(row + 4 * i, vdupq_n_f32(0.f));
            continue;
          }
          const bf16* k = block + h * head_stride + (c0 + j) * pos_stride;
          for (int c = 0; c < kHeadSize; c += 8) {
            float32x4_t lo, hi;
            widen8(k + c, lo, hi);
            vst1q_f32(row + c, lo);
            vst1q_f32(row + c + 4, hi);
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf + (h * group + g) * kHeadSize;
          float32x4_t partial[4][2];  // two chains per key
          for (int j = 0; j < 4; ++j) {
            partial[j][0] = vmulq_f32(vld1q_f32(qg), vld1q_f32(keys + j * kHeadSize));
            partial[j][1] = vmulq_f32(vld1q_f32(qg + 4), vld1q_f32(keys + j * kHeadSize + 4));
          }
          for (int i = 2; i < kVecs; i += 2) {
            const float32x4_t q0 = vld1q_f32(qg + 4 * i), q1 = vld1q_f32(qg + 4 * i + 4);
            for (int j = 0; j < 4; ++j) {
              partial[j][0] = vfmaq_f32(partial[j][0], q0, vld1q_f32(keys + j * kHeadSize + 4 * i));
              partial[j][1] = vfmaq_f32(partial[j][1], q1, vld1q_f32(keys + j * kHeadSize + 4 * i + 4));
            }
          }
          const float32x4_t p0 = vaddq_f32(partial[0][0], partial[0][1]), p1 = vaddq_f32(partial[1][0], partial[1][1]);
          const float32x4_t p2 = vaddq_f32(partial[2][0], partial[2][1]), p3 = vaddq_f32(partial[3][0], partial[3][1]);
          vst1q_f32(s + (h * group + g) * padded_len + t0 + c0, vpaddq_f32(vpaddq_f32(p0, p1), vpaddq_f32(p2, p3)));
        }
      }
  });

  // softmax, unnormalised: s = exp(s - max); 1 / total scales the output
  for (int64_t head = 0; head < heads; ++head) {
    float* sh = s + head * padded_len;
    const int64_t full = seq_len / 4 * 4;
    float32x4_t max4 = vdupq_n_f32(std::numeric_limits<float>::lowest());
    for (int64_t t = 0; t < full; t += 4) max4 = vmaxq_f32(max4, vld1q_f32(sh + t));
    float max_score = vmaxvq_f32(max4);
    for (int64_t t = full; t < seq_len; ++t) max_score = std::max(max_score, sh[t]);
    const float32x4_t top = vdupq_n_f32(max_score);
    float32x4_t sum4 = vdupq_n_f32(0.f);
    for (int64_t t = 0; t < seq_len; t += 4) {  // the last vector's lanes past the context become 0
      const float32x4_t e = vreinterpretq_f32_u32(vandq_u32(
          first_lanes(seq_len - t), vreinterpretq_u32_f32(exp_nonpositive4(vsubq_f32(vld1q_f32(sh + t), top)))));
      vst1q_f32(sh + t, e);
      sum4 = vaddq_f32(sum4, e);
    }
    total[head] = vaddvq_f32(sum4);
  }

  // P @ V
  values_pass<kUnit, kHeadSize>(sweep, v_cache, num_kv_heads, group, s, padded_len, head_stride, pos_stride, acc,
                                 [](auto unit, auto... args) { accumulate16<decltype(unit)::value>(args...); });

  for (int64_t head = 0; head < heads; ++head) {
    const float inv_total = 1.f / total[head];
    for (int64_t d = 0; d < kHeadSize; ++d)
      out[head * out_head_stride + d] = pagoda::float_to_bf16(acc[head * kHeadSize + d] * inv_total);
  }
}

}  // namespace pagoda::attention::neon
