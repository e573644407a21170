// Float32 helpers of 16 AVX-512 lanes that the attention kernels and SiLU-and-multiply share; no ATen, so that they
// also build into standalone harnesses (as avx2_math.h).
#pragma once

#include "cpu_isa.h"

#if defined(PAGODA_ISA_AVX512)

#include <immintrin.h>

namespace pagoda::avx512 {

// 2^t for t <= 0 of 16 lanes, as paged_attention_common.h's exp_nonpositive does it (2^i by scalef): 2^f on
// [0, 1) by the degree-5 fit (relative error under 2e-7), or with kDegree 3 by a least-squares fit in relative
// error (max 7.7e-5) for probabilities rounded to bfloat16 (2^-9) right after. t is clamped at -126 (so -inf gives
// 2^-126, not NaN); kClamp false saves the clamp where every t is finite (scalef takes any exponent: 0 below -149)
template <int kDegree = 5, bool kClamp = true>
inline __m512 exp2_nonpositive16(__m512 t) {
  static_assert(kDegree == 3 || kDegree == 5, "the fits of degree 3 and 5");
  if constexpr (kClamp) t = _mm512_max_ps(t, _mm512_set1_ps(-126.f));
  const __m512 i = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, i);
  __m512 p;
  if constexpr (kDegree == 5) {
    p = _mm512_set1_ps(1.87537657e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.98725919e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.58359654e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40146495e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93154738e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.99999834e-1f));
  } else {
    p = _mm512_set1_ps(0.0779071638f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.226233194f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.695777096f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.999927827f));
  }
  return _mm512_scalef_ps(p, i);
}

// 16 bfloat16 widened to float32 (bfloat16 is a float32's top half)
inline __m512 widen_bf16x16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load_bf16x16(const void* src) {
  return widen_bf16x16(_mm256_loadu_si256(static_cast<const __m256i*>(src)));
}
// the lanes in `mask` only: the others read nothing and are zero (a row's last, partial 16)
inline __m512 load_bf16x16(const void* src, __mmask16 mask) {
  return widen_bf16x16(_mm256_maskz_loadu_epi16(mask, src));
}

// 16 float32 rounded to bfloat16 (to nearest even, as torch and bf16_scalar.h's float_to_bf16), as 16-bit lanes. A
// NaN stays a NaN of its sign, made quiet (its top half with the quiet bit set), as AVX512-BF16's vcvtneps2bf16
// does: rounded as a number, a NaN whose payload is in its low half would become an infinity
inline __m256i to_bf16x16(__m512 x) {
#if defined(PAGODA_ISA_AVX512BF16)
  return (__m256i)_mm512_cvtneps_pbh(x);
#else
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
#endif
}

inline void store_bf16x16(void* dst, __m512 x) { _mm256_storeu_si256(static_cast<__m256i*>(dst), to_bf16x16(x)); }
// the lanes in `mask` only: memory off it is left as it was
inline void store_bf16x16(void* dst, __m512 x, __mmask16 mask) { _mm256_mask_storeu_epi16(dst, mask, to_bf16x16(x)); }

// x rounded to bfloat16, kept as float32
inline __m512 round_to_bf16(__m512 x) { return widen_bf16x16(to_bf16x16(x)); }

// rows[i] <- column i of the 16 x 16 block rows[0..15]
inline void transpose16(__m512* rows) {
  __m512 a[16], b[16];
  for (int i = 0; i < 8; ++i) {  // 2 x 2 blocks of 32-bit elements
    a[2 * i] = _mm512_unpacklo_ps(rows[2 * i], rows[2 * i + 1]);
    a[2 * i + 1] = _mm512_unpackhi_ps(rows[2 * i], rows[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // 4 x 4 blocks
    const __m512d lo0 = _mm512_castps_pd(a[4 * i]), lo1 = _mm512_castps_pd(a[4 * i + 2]);
    const __m512d hi0 = _mm512_castps_pd(a[4 * i + 1]), hi1 = _mm512_castps_pd(a[4 * i + 3]);
    b[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo0, lo1));
    b[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo0, lo1));
    b[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi0, hi1));
    b[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi0, hi1));
  }
  for (int i = 0; i < 2; ++i)  // 8 x 8 blocks: the 128-bit lanes of rows 4 apart
    for (int j = 0; j < 4; ++j) {
      a[8 * i + j] = _mm512_shuffle_f32x4(b[8 * i + j], b[8 * i + 4 + j], 0x88);
      a[8 * i + 4 + j] = _mm512_shuffle_f32x4(b[8 * i + j], b[8 * i + 4 + j], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {  // 16 x 16: the 128-bit lanes of rows 8 apart
    rows[j] = _mm512_shuffle_f32x4(a[j], a[8 + j], 0x88);
    rows[8 + j] = _mm512_shuffle_f32x4(a[j], a[8 + j], 0xDD);
  }
}

// 2^t for t <= 0 of 16 lanes to within ~1.5 ulp: t = i + f with f in [-0.5, 0.5] (the nearest integer, where
// exp2_nonpositive16 takes the floor) and 2^f by a degree-6 fit (relative error 2e-9 before float32's rounding),
// so that 2^t near 1 keeps its last bits. Clamped at 2^-126.
inline __m512 exp2_nonpositive16_precise(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.f));
  const __m512 i = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, i);
  __m512 p = _mm512_set1_ps(1.534538605e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339977141e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618489072e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550329387e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264625e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931471825e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, i);
}

// silu(g) = g sigmoid(g) of 16 lanes, from e = exp(-|g|) <= 1 (so nothing overflows): g / (1 + e) for g >= 0,
// g e / (1 + e) below, to about torch's float32 bits (its rounding to bfloat16 then agrees but for rare ties):
// the exponential exp2_nonpositive16_precise's, the division a true one by its rounding-mode form (-ffast-math
// makes a plain one rcp14 and a Newton step). Below g = -87 e stays at 2^-126: silu a tiny negative, not -0.
inline __m512 silu16(__m512 g) {
  const __m512 e = exp2_nonpositive16_precise(_mm512_mul_ps(_mm512_abs_ps(g), _mm512_set1_ps(-1.44269504f)));
  const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_div_round_ps(_mm512_mask_mul_ps(g, negative, g, e), _mm512_add_ps(_mm512_set1_ps(1.f), e),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

}  // namespace pagoda::avx512

#endif
