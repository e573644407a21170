// bfloat16 matmul micro-kernel for CPUs with AVX512_BF16: `vdpbf16ps` multiplies the packed weight pairs
// (one 64-byte vector per 16 outputs per input pair) by a broadcast pair of x, summing in float32.
#pragma once

#include <immintrin.h>

#include "avx512_math.h"
#include "bf16_matmul_common.h"

namespace pagoda::bf16_matmul::avx512bf16 {

constexpr int64_t kFloatXRows = 0;
constexpr bool kWantsFloatX = false;
constexpr int64_t kXPanelRows = 0;  // no float32 x (bf16_matmul_common.h: x_float_panels)

inline __m512 bias_vector(const bf16* bias, __mmask16 mask) { return avx512::load_bf16x16(bias, mask); }

// 16 float32 sums into y's type: rounded once to bfloat16 (as oneDNN), or kept
inline void store_16(bf16* y, __mmask16 mask, __m512 sums) { avx512::store_bf16x16(y, sums, mask); }
inline void store_16(float* y, __mmask16 mask, __m512 sums) { _mm512_mask_storeu_ps(y, mask, sums); }

// A block's 32 columns as two 16-lane halves: which of them exist (ncols <= 32) and their bias, widened once;
// store() writes one row's two halves of float32 sums (+ bias) into y's type
struct BlockColumns {
  __mmask16 mask_low, mask_high;
  __m512 bias_low = _mm512_setzero_ps(), bias_high = _mm512_setzero_ps();
  BlockColumns(int64_t ncols, const bf16* bias)
      : mask_low(ncols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1)),
        mask_high(ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0 : static_cast<__mmask16>((1u << (ncols - 16)) - 1)) {
    if (bias != nullptr) {
      bias_low = bias_vector(bias, mask_low);
      bias_high = bias_vector(bias + 16, mask_high);
    }
  }
  template <typename OutT>
  void store(OutT* y, __m512 low, __m512 high) const {
    store_16(y, mask_low, _mm512_add_ps(low, bias_low));
    store_16(y + 16, mask_high, _mm512_add_ps(high, bias_high));
  }
};

// y[0:MB, 0:ncols] = x[0:MB, :] @ block, summed in float32
template <int MB, typename OutT>
inline void micro_kernel(const bf16* x, int64_t ldx, const bf16* block, int64_t k_pairs, OutT* y, int64_t ldy,
                         int64_t ncols, const bf16* bias) {
  __m512 low[MB], high[MB];  // outputs 0-15 and 16-31 of each row
  for (int m = 0; m < MB; ++m) low[m] = high[m] = _mm512_setzero_ps();
  const int32_t* x_pairs = reinterpret_cast<const int32_t*>(x);  // two bfloat16 inputs per int32
  const int64_t ldx_pairs = ldx / 2;
  for (int64_t k = 0; k < k_pairs; ++k) {
    const __m512bh w_low = (__m512bh)_mm512_loadu_si512(block + k * 64);
    const __m512bh w_high = (__m512bh)_mm512_loadu_si512(block + k * 64 + 32);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xk = (__m512bh)_mm512_set1_epi32(x_pairs[m * ldx_pairs + k]);
      low[m] = _mm512_dpbf16_ps(low[m], xk, w_low);
      high[m] = _mm512_dpbf16_ps(high[m], xk, w_high);
    }
  }
  const BlockColumns columns(ncols, bias);
  for (int m = 0; m < MB; ++m) columns.store(y + m * ldy, low[m], high[m]);
}

// rows of x against one block, 8 at a time (16 accumulators + 2 weight vectors fit the 32 registers)
template <typename OutT>
void rows_against_block(const BlockTask& t, OutT* y) {
  const bf16* x = t.x;
  const int64_t ldx = t.ldx, ldy = t.ldy;
  int64_t m = 0;
  for (; m + 8 <= t.rows; m += 8)
    micro_kernel<8>(x + m * ldx, ldx, t.block, t.k_pairs, y + m * ldy, ldy, t.ncols, t.bias);
  x += m * ldx;
  y += m * ldy;
  switch (t.rows - m) {
    case 7: micro_kernel<7>(x, ldx, t.block, t.k_pairs, y, ldy, t.ncols, t.bias); break;
    case 6: micro_kernel<6>(x, ldx, t.block, t.k_pairs, y, ldy, t.ncols, t.bias); break;
    case 5: micro_kernel<5>(x, ldx, t.block, t.k_pairs, y, ldy, t.ncols, t.bias); break;
    case 4: micro_kernel<4>(x, ldx, t.block, t.k_pairs, y, ldy, t.ncols, t.bias); break;
    case 3: micro_kernel<3>(x, ldx, t.block, t.k_pairs, y, ldy, t.ncols, t.bias); break;
    case 2: micro_kernel<2>(x, ldx, t.block, t.k_pairs, y, ldy, t.ncols, t.bias); break;
    case 1: micro_kernel<1>(x, ldx, t.block, t.k_pairs, y, ldy, t.ncols, t.bias); break;
    default: break;
  }
}

}  // namespace pagoda::bf16_matmul::avx512bf16
