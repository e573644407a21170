// bfloat16-weight matmul micro-kernels for AVX2 + FMA (no bfloat16 instructions): the weights stay bfloat16
// in memory, as packed, and are widened to float32 in registers (`pair << 16`, `pair & 0xFFFF0000`), the
// sums are float32 FMAs (as llama.cpp's and vLLM's AVX2 paths).
//
// - Fewer rows than kFloatXRows (decode): each weight pair is widened as it streams by. At few rows the step
//   is bound by reading the weights, and they are half the bytes of float32 ones.
// - More rows (prefill): the task's block is widened once into a float32 copy (per thread, in L2) and x is
//   float32 already (linear() widens it once), so the inner loop is the plain float32 6x16 FMA kernel.
#pragma once

#include <immintrin.h>

#include <vector>

#include "bf16_matmul_common.h"

namespace pagoda::bf16_matmul::avx2 {

// from this many rows, x is widened once and tasks run the float32 kernel. Widening a block costs about as
// much as 8-16 rows of FMAs, so below that the streaming kernel wins and above it the float32 one. Measured
// with both threads of a 2-core AVX2 EPYC, the two kernels alternated on the same weights: from 24 rows the
// float32 kernel is 7-28 % faster on SmolLM2's shapes and on 1024-2048-wide ones (a 5632-deep down projection
// breaks even at 24-32), while at 8 rows the streaming kernel is 14-90 % faster; at 16 it is mixed. Offline,
// 32 sequences decode ~15 % faster than with the streaming kernel (the threshold was 48).
constexpr int64_t kFloatXRows = 24;
constexpr bool kWantsFloatX = true;
// bf16_linear hands the float32 kernel x in panels of 6 rows (its row group), [K][6] each: a group's 6 broadcasts
// per k then come from one 24-byte run instead of 6 rows' streams (3-15 % faster at 64-512 rows, both threads)
constexpr int64_t kXPanelRows = 6;

inline __m256 even_weights(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline __m256 odd_weights(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// MB (1 or 2) rows against the block, weights widened on the fly. One row keeps separate even/odd sums (8
// independent FMA chains); two rows share them (8 chains again) within AVX2's 16 registers.
template <int MB, typename OutT>
inline void decode_rows(const BlockTask& t, const bf16* x, OutT* y) {
  const int32_t* x_pairs = reinterpret_cast<const int32_t*>(x);
  const int64_t ldx_pairs = t.ldx / 2;
  __m256 acc[2][4], acc_odd[4];
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {
    acc[0][q] = acc[1][q] = acc_odd[q] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < t.k_pairs; ++k) {
    __m256 xe[MB], xo[MB];
#pragma GCC unroll 2
    for (int m = 0; m < MB; ++m) {
      const __m256i pair = _mm256_set1_epi32(x_pairs[m * ldx_pairs + k]);
      xe[m] = even_weights(pair);  // the same widening: x's two inputs in float32
      xo[m] = odd_weights(pair);
    }
    const bf16* w = t.block + k * 2 * kBlockN;
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * q));
      const __m256 we = even_weights(pairs), wo = odd_weights(pairs);
      if constexpr (MB == 1) {
        acc[0][q] = _mm256_fmadd_ps(xe[0], we, acc[0][q]);
        acc_odd[q] = _mm256_fmadd_ps(xo[0], wo, acc_odd[q]);
      } else {
#pragma GCC unroll 2
        for (int m = 0; m < MB; ++m) {
          acc[m][q] = _mm256_fmadd_ps(xe[m], we, acc[m][q]);
          acc[m][q] = _mm256_fmadd_ps(xo[m], wo, acc[m][q]);
        }
      }
    }
  }
  for (int m = 0; m < MB; ++m) {
    alignas(32) float sums[kBlockN];
    for (int q = 0; q < 4; ++q)
      _mm256_store_ps(sums + 8 * q, MB == 1 ? _mm256_add_ps(acc[0][q], acc_odd[q]) : acc[m][q]);
    store_row(y + m * t.ldy, sums, t.ncols, t.bias);
  }
}

// sums[m][half*16 .. +16) = x_float rows m (MB <= 6) @ the widened block's 16 columns: 12 accumulators, two
// weight vectors and a broadcast. Row m's k-th input is x[m * ldm + k * ldk]: rows (ldm = ldx_float, ldk = 1) or
// a panel (ldm = 1, ldk = 6). With a prefetch pointer, one cache line of what it points at (the next block:
// k_len lines) is fetched into L2 per step.
template <int MB>
inline void float_rows(const float* x, int64_t ldm, int64_t ldk, const float* wf, int64_t k_len, int half,
                       float (*sums)[kBlockN], const char* prefetch = nullptr) {
  __m256 acc[MB][2];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  const float* w = wf + 16 * half;
#pragma GCC unroll 4
  for (int64_t k = 0; k < k_len; ++k) {
    if (prefetch != nullptr) _mm_prefetch(prefetch + 64 * k, _MM_HINT_T1);
    const __m256 w0 = _mm256_loadu_ps(w + k * kBlockN), w1 = _mm256_loadu_ps(w + k * kBlockN + 8);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      const __m256 b = _mm256_broadcast_ss(x + m * ldm + k * ldk);
      acc[m][0] = _mm256_fmadd_ps(b, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(b, w1, acc[m][1]);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) {
    _mm256_storeu_ps(sums[m] + 16 * half, acc[m][0]);
    _mm256_storeu_ps(sums[m] + 16 * half + 8, acc[m][1]);
  }
}

// MB rows from x (a group's first row, or its panel) against both halves of the widened block
template <int MB, typename OutT>
inline void float_rows_both_halves(const BlockTask& t, const float* x, const float* wf, OutT* y,
                                   const char* prefetch = nullptr) {
  float sums[MB][kBlockN];
  const int64_t k_len = 2 * t.k_pairs;
  if (t.x_float_panels) {  // the constant strides let the compiler address the panel directly
    float_rows<MB>(x, 1, kXPanelRows, wf, k_len, 0, sums, prefetch);
    float_rows<MB>(x, 1, kXPanelRows, wf, k_len, 1, sums);
  } else {
    float_rows<MB>(x, t.ldx_float, 1, wf, k_len, 0, sums, prefetch);
    float_rows<MB>(x, t.ldx_float, 1, wf, k_len, 1, sums);
  }
  for (int m = 0; m < MB; ++m) store_row(y + m * t.ldy, sums[m], t.ncols, t.bias);
}

// the block [K/2, 32, 2] as float32 [K, 32]
inline void widen_block(const BlockTask& t, float* wf) {
  for (int64_t k = 0; k < t.k_pairs; ++k)
    for (int q = 0; q < 4; ++q) {
      const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t.block + k * 2 * kBlockN + 16 * q));
      _mm256_storeu_ps(wf + (2 * k) * kBlockN + 8 * q, even_weights(pairs));
      _mm256_storeu_ps(wf + (2 * k + 1) * kBlockN + 8 * q, odd_weights(pairs));
    }
}

template <typename OutT>
void rows_against_block(const BlockTask& t, OutT* y) {
  if (t.x_float == nullptr) {  // decode's few rows
    int64_t m = 0;
    for (; m + 2 <= t.rows; m += 2) decode_rows<2>(t, t.x + m * t.ldx, y + m * t.ldy);
    if (m < t.rows) decode_rows<1>(t, t.x + m * t.ldx, y + m * t.ldy);
    return;
  }
  thread_local std::vector<float> widened;
  widened.resize(2 * t.k_pairs * kBlockN);
  float* wf = widened.data();
  widen_block(t, wf);
  // the thread's next task is mostly the next block, which follows this one in memory (its k_pairs * 2 lines
  // of 64 bytes): fetched into L2 during the first pass over this one, so that widening it does not wait on
  // memory (a prefetch past the weight's end is harmless: prefetches never fault)
  const char* next_block = reinterpret_cast<const char*>(t.block + t.k_pairs * 2 * kBlockN);
  // groups of 6 rows (a panel each, or 6 rows ldx_float apart)
  static_assert(kXPanelRows == 6, "a panel is the float32 kernel's row group");
  const int64_t group_stride = t.x_float_panels ? kXPanelRows * 2 * t.k_pairs : 6 * t.ldx_float;
  int64_t m = 0;
  for (; m + 6 <= t.rows; m += 6)
    float_rows_both_halves<6>(t, t.x_float + m / 6 * group_stride, wf, y + m * t.ldy, m == 0 ? next_block : nullptr);
  const float* x = t.x_float + m / 6 * group_stride;
  const char* prefetch = m == 0 ? next_block : nullptr;
  y += m * t.ldy;
  switch (t.rows - m) {
    case 5: float_rows_both_halves<5>(t, x, wf, y, prefetch); break;
    case 4: float_rows_both_halves<4>(t, x, wf, y, prefetch); break;
    case 3: float_rows_both_halves<3>(t, x, wf, y, prefetch); break;
    case 2: float_rows_both_halves<2>(t, x, wf, y, prefetch); break;
    case 1: float_rows_both_halves<1>(t, x, wf, y, prefetch); break;
    default: break;
  }
}

}  // namespace pagoda::bf16_matmul::avx2
