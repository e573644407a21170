// SiLU-and-multiply of one row of bfloat16 gates and ups, rounded where torch's bfloat16 path rounds: silu to
// bfloat16, then the product. One function for silu_and_mul (layers/fused_cpu_ops.cpp) and for the gate/up
// matmul that ends in it (bf16_matmul::linear_silu_and_mul), so that both give the same bits.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "bf16_scalar.h"
#include "cpu_isa.h"

#if defined(PAGODA_ISA_NEON)
#include "silu_and_mul_neon.h"
#endif
#include "avx512_math.h"

namespace pagoda {

// out[i] = bf16(bf16(silu(gate[i])) * up[i]). exp's argument at most 88: past it exp overflows to inf, and
// under -ffast-math g / inf is NaN, not -0 (every gate below -88 came out NaN).
inline void silu_and_mul_row(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* out, int64_t n) {
#if defined(PAGODA_ISA_NEON)  // expf does not vectorise on aarch64 (no libmvec before glibc 2.38)
  neon::silu_and_mul_row(gate, up, out, n);
#else
  int64_t i = 0;
#if defined(PAGODA_ISA_AVX512)  // libmvec's expf is a call (it spilled every register) and / a division
  for (; i + 16 <= n; i += 16) {
    const __m512 silu = avx512::round_to_bf16(avx512::silu16(avx512::load_bf16x16(gate + i)));
    avx512::store_bf16x16(out + i, _mm512_mul_ps(silu, avx512::load_bf16x16(up + i)));
  }
#endif
  for (; i < n; ++i) {
    const float g = bf16_to_float(gate[i]);
    const float silu = bf16_to_float(float_to_bf16(g / (1.f + std::exp(std::min(-g, 88.f)))));
    out[i] = float_to_bf16(silu * bf16_to_float(up[i]));
  }
#endif
}

}  // namespace pagoda
