// FP8 (e4m3fn) weight-only matmul micro-kernels: y = x (W * scales)^T with bfloat16 x, for layers/fp8_matmul_cpu.cpp.
//
// The weight is packed as bf16_matmul's (csrc/bf16_matmul_common.h) but one byte a weight: [ceil(N/32), K/2, 32, 2]
// float8_e4m3fn, so one 64-byte line holds an input pair's weights of a block's 32 outputs. It is widened in
// registers and never written back: with AVX512_BF16 to bfloat16 (exact) and multiplied by `vdpbf16ps` as
// bf16_matmul's kernel does; elsewhere to float32 (upcast_fp8, value / 256) and summed with float32 multiply-adds
// the compiler vectorises. With AVX512_VBMI (Ice Lake, Sapphire Rapids, Zen 4) a line's 64 codes become bfloat16 by
// two 128-entry byte lookups (`vpermi2b`: each value's high and low byte) and two byte interleaves, 6 instructions
// where upcast_fp8_32_bf16 takes 18; the interleaves work within 128-bit lanes, so such builds store each line's
// bytes in the order that puts the values back in place (stored_position; pack() is the kernel's, so the order is
// always the build's). Scales: one per output row and block of block_k inputs ([N, G] float32,
// G = 1: per channel, applied once to the sums); per block the sums of each block are scaled and added up.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <array>
#include <cstdint>

#include "bf16_scalar.h"
#include "cpu_isa.h"
#include "fp8_upcast.h"

#if defined(PAGODA_ISA_AVX512BF16)
#include <immintrin.h>

#include "avx512_math.h"
#endif

#if defined(PAGODA_ISA_AVX512BF16) && defined(__AVX512VBMI__)
#define PAGODA_FP8_MATMUL_VBMI 1
#endif

namespace pagoda::fp8_matmul {

using bf16 = c10::BFloat16;
using fp8 = c10::Float8_e4m3fn;
constexpr int64_t kBlockN = 32;  // output columns per packed block

// Where element i (0..63: output i / 2's weight of the pair's input i % 2) of a line is stored
inline int64_t stored_position(int64_t i) {
#if defined(PAGODA_FP8_MATMUL_VBMI)
  // after the lookups, unpacklo/hi_epi8 make words 8L..8L+7 of 128-bit lane L from bytes 16L..16L+7 / 16L+8..16L+15:
  // the first register must hold elements 0..31, the second 32..63
  return pagoda::unpack_lanes_position(static_cast<int>(i));
#else
  return i;
#endif
}

#if defined(PAGODA_FP8_MATMUL_VBMI)
// one line's 64 stored codes -> elements 0..31 and 32..63 as bfloat16
inline void upcast_line(const uint8_t* line, __m512i& first, __m512i& second) {
  pagoda::upcast_fp8_lanes_bf16<fp8>(_mm512_loadu_si512(line), first, second);
}
#elif defined(PAGODA_ISA_AVX512BF16)
inline void upcast_line(const uint8_t* line, __m512i& first, __m512i& second) {
  first = pagoda::upcast_fp8_32_bf16<fp8>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(line)));
  second = pagoda::upcast_fp8_32_bf16<fp8>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + 32)));
}
#endif

// One task: rows of x against one packed block.
struct BlockTask {
  const bf16* x;  // [rows, K], rows ldx apart
  int64_t ldx, rows;
  const uint8_t* block;  // [K/2, 32, 2] e4m3fn bytes
  int64_t k_pairs;
  const float* scales;  // [ncols, groups], this block's first row (rows `groups` apart)
  int64_t groups, block_pairs;  // scale groups per row; input pairs per group (k_pairs when groups == 1)
  bf16* y;  // [rows, ldy], this block's first column
  int64_t ldy, ncols;  // y's row stride; the block's columns that exist (<= 32)
  const bf16* bias;  // [ncols] or null
};

#if defined(PAGODA_ISA_AVX512BF16)
namespace avx512bf16 {

inline __mmask16 column_mask(int64_t ncols, int half) {
  const int64_t n = std::clamp<int64_t>(ncols - 16 * half, 0, 16);
  return n == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

// 16 scales of group g: rows 16 * half .. of the block (rows past ncols: 0)
inline __m512 scale_vector(const BlockTask& t, int64_t g, int half) {
  alignas(64) float s[16] = {};
  const int64_t first = 16 * half, n = std::clamp<int64_t>(t.ncols - first, 0, 16);
  for (int64_t j = 0; j < n; ++j) s[j] = t.scales[(first + j) * t.groups + g];
  return _mm512_load_ps(s);
}

// y[0:MB, 0:ncols] = x[0:MB] @ block, scaled (bias added), rounded once to bfloat16. kGroups: several scale groups
// per row (each group's sums scaled into running totals), else one (the sums scaled once at the end)
template <int MB, bool kGroups>
inline void micro_kernel(const BlockTask& t, const bf16* x, bf16* y) {
  const int32_t* x_pairs = reinterpret_cast<const int32_t*>(x);  // two bfloat16 inputs per int32
  const int64_t ldx_pairs = t.ldx / 2;
  __m512 total_low[MB], total_high[MB];  // outputs 0-15 and 16-31 of each row, scaled
  for (int m = 0; m < MB; ++m) total_low[m] = total_high[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < t.groups; ++g) {
    const int64_t k0 = g * t.block_pairs, k1 = std::min(t.k_pairs, k0 + t.block_pairs);
    __m512 low[MB], high[MB];
    for (int m = 0; m < MB; ++m) low[m] = high[m] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; ++k) {
      __m512i first, second;
      upcast_line(t.block + k * 64, first, second);
      const __m512bh w_low = (__m512bh)first, w_high = (__m512bh)second;
      for (int m = 0; m < MB; ++m) {
        const __m512bh xk = (__m512bh)_mm512_set1_epi32(x_pairs[m * ldx_pairs + k]);
        low[m] = _mm512_dpbf16_ps(low[m], xk, w_low);
        high[m] = _mm512_dpbf16_ps(high[m], xk, w_high);
      }
    }
    const __m512 s_low = scale_vector(t, g, 0), s_high = scale_vector(t, g, 1);
    for (int m = 0; m < MB; ++m) {
      if constexpr (kGroups) {
        total_low[m] = _mm512_fmadd_ps(low[m], s_low, total_low[m]);
        total_high[m] = _mm512_fmadd_ps(high[m], s_high, total_high[m]);
      } else {
        total_low[m] = _mm512_mul_ps(low[m], s_low);
        total_high[m] = _mm512_mul_ps(high[m], s_high);
      }
    }
    if constexpr (!kGroups) break;
  }
  const __mmask16 mask_low = column_mask(t.ncols, 0), mask_high = column_mask(t.ncols, 1);
  __m512 bias_low = _mm512_setzero_ps(), bias_high = _mm512_setzero_ps();
  if (t.bias != nullptr) {
    bias_low = avx512::load_bf16x16(t.bias, mask_low);
    bias_high = avx512::load_bf16x16(t.bias + 16, mask_high);
  }
  for (int m = 0; m < MB; ++m) {
    avx512::store_bf16x16(y + m * t.ldy, _mm512_add_ps(total_low[m], bias_low), mask_low);
    avx512::store_bf16x16(y + m * t.ldy + 16, _mm512_add_ps(total_high[m], bias_high), mask_high);
  }
}

// rows of x against one block, kMax at a time: 8 with one scale group (16 sums and the widened weights fit the 32
// registers), 5 with several (sums and scaled totals)
template <bool kGroups>
inline void rows_against_block_of(const BlockTask& t) {
  constexpr int kMax = kGroups ? 5 : 8;
  int64_t m = 0;
  for (; m + kMax <= t.rows; m += kMax) micro_kernel<kMax, kGroups>(t, t.x + m * t.ldx, t.y + m * t.ldy);
  const bf16* x = t.x + m * t.ldx;
  bf16* y = t.y + m * t.ldy;
  switch (t.rows - m) {
    case 7: if constexpr (kMax > 7) micro_kernel<7, kGroups>(t, x, y); break;
    case 6: if constexpr (kMax > 6) micro_kernel<6, kGroups>(t, x, y); break;
    case 5: if constexpr (kMax > 5) micro_kernel<5, kGroups>(t, x, y); break;
    case 4: micro_kernel<4, kGroups>(t, x, y); break;
    case 3: micro_kernel<3, kGroups>(t, x, y); break;
    case 2: micro_kernel<2, kGroups>(t, x, y); break;
    case 1: micro_kernel<1, kGroups>(t, x, y); break;
    default: break;
  }
}

inline void rows_against_block(const BlockTask& t) {
  if (t.groups == 1) {
    rows_against_block_of<false>(t);
  } else {
    rows_against_block_of<true>(t);
  }
}

}  // namespace avx512bf16
#endif

namespace portable {

// rows of x against one block, kRows at a time: each input pair's 64 weights widened once to float32 (value / 256,
// upcast_fp8's), then float32 multiply-adds over the 32 columns
inline void rows_against_block(const BlockTask& t) {
  constexpr int kRows = 4;
  constexpr float kRead = pagoda::kFp8ReadFactor<fp8>;
  const auto* lines = reinterpret_cast<const fp8*>(t.block);
  for (int64_t m0 = 0; m0 < t.rows; m0 += kRows) {
    const int64_t rows = std::min<int64_t>(kRows, t.rows - m0);
    float total[kRows][kBlockN] = {};
    for (int64_t g = 0; g < t.groups; ++g) {
      const int64_t k0 = g * t.block_pairs, k1 = std::min(t.k_pairs, k0 + t.block_pairs);
      float even[kRows][kBlockN] = {}, odd[kRows][kBlockN] = {};
      for (int64_t k = k0; k < k1; ++k) {
        alignas(64) float w[2 * kBlockN];
        pagoda::upcast_fp8(lines + k * 2 * kBlockN, w, 2 * kBlockN);
        for (int64_t m = 0; m < rows; ++m) {
          const bf16* xr = t.x + (m0 + m) * t.ldx;
          const float x0 = bf16_to_float(xr[2 * k]), x1 = bf16_to_float(xr[2 * k + 1]);
          for (int j = 0; j < kBlockN; ++j) {
            even[m][j] += x0 * w[2 * j];
            odd[m][j] += x1 * w[2 * j + 1];
          }
        }
      }
      for (int64_t j = 0; j < t.ncols; ++j) {
        const float s = t.scales[j * t.groups + g] * kRead;
        for (int64_t m = 0; m < rows; ++m) total[m][j] += (even[m][j] + odd[m][j]) * s;
      }
    }
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t j = 0; j < t.ncols; ++j)
        store_float(t.y + (m0 + m) * t.ldy + j, total[m][j] + (t.bias ? bf16_to_float(t.bias[j]) : 0.f));
  }
}

}  // namespace portable

inline void rows_against_block(const BlockTask& t) {
#if defined(PAGODA_ISA_AVX512BF16)
  avx512bf16::rows_against_block(t);
#else
  portable::rows_against_block(t);
#endif
}

}  // namespace pagoda::fp8_matmul
