// Float32 helpers of 8 AVX2 lanes that the attention kernels share (paged_prefill_cpu.cpp's AVX2 step and
// paged_decode_avx2.h); no ATen, so that they also build into standalone harnesses.
#pragma once

#include <immintrin.h>

namespace pagoda::avx2 {

// exp(x) of 8 lanes for the softmax's x <= 0, as paged_attention_common.h's exp_nonpositive (a degree-5 fit of
// 2^f, 2^i written into the exponent field; clamped at 2^-126)
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

// lane j of the result = the sum of v[j]'s 8 lanes (8 dot products reduced together: 9 instructions where 8
// separate horizontal sums take ~40)
inline __m256 sum_each8(const __m256* v) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // per 128-bit lane L: v0..v3's (then v4..v7's) sums over that lane's 4 floats
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// all-ones in the lanes j < n (n in 0..8)
inline __m256 first_lanes(int64_t n) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)), index));
}

}  // namespace pagoda::avx2
