// SiLU-and-multiply rows in NEON, for float32 and bfloat16. The generic loop calls expf once an element:
// x86 compilers vectorise it through glibc's libmvec, aarch64 ones only with glibc >= 2.38 (Debian 12 has
// 2.36), so on ARM it stayed scalar. Here exp is a NEON polynomial (2^n * exp(r), |r| <= ln2/2, degree-7
// Taylor: < 0.3 ulp of the polynomial's own error) and the rounding points are the generic loop's: silu
// rounded to the dtype, then the product. Torch-free, so tests/kernels/neon_kernels_harness.cpp runs it
// under qemu-aarch64.
#pragma once

#include <arm_neon.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "bf16_scalar.h"

namespace pagoda::neon {

// e^x for x in [-87, 87] (callers clamp): n = round(x / ln2), r = x - n ln2 (ln2 in two parts), 2^n from the
// exponent bits
inline float32x4_t exp_f32(float32x4_t x) {
  const float32x4_t n = vrndnq_f32(vmulq_n_f32(x, 1.44269504088896341f));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693359375f));
  r = vfmsq_f32(r, n, vdupq_n_f32(-2.12194440e-4f));
  float32x4_t p = vdupq_n_f32(1.f / 5040.f);
  p = vfmaq_f32(vdupq_n_f32(1.f / 720.f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f / 120.f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f / 24.f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f / 6.f), p, r);
  p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.f), p, r);
  const int32x4_t exponent = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vmulq_f32(p, vreinterpretq_f32_s32(exponent));
}

// g / (1 + e^-g); below -87 e^-g is clamped (silu is then -0 to float32 precision anyway), above 87 it is 1
inline float32x4_t silu_f32(float32x4_t g) {
  const float32x4_t minus_g = vmaxq_f32(vminq_f32(vnegq_f32(g), vdupq_n_f32(87.f)), vdupq_n_f32(-87.f));
  return vdivq_f32(g, vaddq_f32(vdupq_n_f32(1.f), exp_f32(minus_g)));
}

// bfloat16 <-> float32, four at a time; to bfloat16 by round to nearest even, as torch (no NaN reaches here)
inline float32x4_t load_bf16x4(const c10::BFloat16* p) {
  return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(&p->x), 16));
}
inline uint32x4_t rounded_bits(float32x4_t v) {
  const uint32x4_t bits = vreinterpretq_u32_f32(v);
  const uint32x4_t odd = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
  return vaddq_u32(bits, vaddq_u32(odd, vdupq_n_u32(0x7FFFu)));
}
inline void store_bf16x4(c10::BFloat16* p, float32x4_t v) { vst1_u16(&p->x, vshrn_n_u32(rounded_bits(v), 16)); }
inline float32x4_t round_to_bf16(float32x4_t v) {  // the float32 value of v rounded to bfloat16
  return vreinterpretq_f32_u32(vandq_u32(rounded_bits(v), vdupq_n_u32(0xFFFF0000u)));
}

// out[i] = dtype(dtype(silu(gate[i])) * up[i])
inline void silu_and_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) vst1q_f32(out + i, vmulq_f32(silu_f32(vld1q_f32(gate + i)), vld1q_f32(up + i)));
  for (; i < n; ++i) out[i] = gate[i] / (1.f + std::exp(std::min(-gate[i], 88.f))) * up[i];
}

inline void silu_and_mul_row(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* out, int64_t n) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const float32x4_t silu = round_to_bf16(silu_f32(load_bf16x4(gate + i)));
    store_bf16x4(out + i, vmulq_f32(silu, load_bf16x4(up + i)));
  }
  for (; i < n; ++i) {
    const float g = bf16_to_float(gate[i]);
    const float silu = bf16_to_float(float_to_bf16(g / (1.f + std::exp(std::min(-g, 88.f)))));
    out[i] = float_to_bf16(silu * bf16_to_float(up[i]));
  }
}

}  // namespace pagoda::neon
