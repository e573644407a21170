// bfloat16-weight matmul micro-kernels for aarch64 NEON without bfloat16 instructions (Graviton2, Ampere
// Altra, Apple M1, Cortex-A7x): the AVX2 kernel's method (bf16_matmul_avx2.h) in NEON. The weights stay
// bfloat16 in memory, as packed, and are widened to float32 in registers (`pair << 16`, `pair & 0xFFFF0000`);
// the sums are float32 FMLAs.
//
// - Few rows (decode, < kFloatXRows): each weight pair is widened as it streams by; x is read four pairs at
//   a time and widened the same way, and each FMLA takes its x from a lane (vfmaq_laneq_f32).
// - More rows (prefill): the task's block is widened once into a float32 copy (per thread, in L2) and x is
//   float32 already (linear() widens it once), so the inner loop is a plain float32 6x16 FMLA kernel.
#pragma once

#include <arm_neon.h>

#include <vector>

#include "bf16_matmul_common.h"

namespace pagoda::bf16_matmul::neon {

constexpr int64_t kFloatXRows = 4;  // from this many rows, x is widened once and tasks run the float32 kernel
constexpr bool kWantsFloatX = true;
constexpr int64_t kXPanelRows = 0;  // float32 x as plain rows (bf16_matmul_common.h: x_float_panels)

// four packed pairs (int32 lanes) -> their even and odd elements in float32
inline float32x4_t even_weights(uint32x4_t pairs) { return vreinterpretq_f32_u32(vshlq_n_u32(pairs, 16)); }
inline float32x4_t odd_weights(uint32x4_t pairs) {
  return vreinterpretq_f32_u32(vandq_u32(pairs, vdupq_n_u32(0xFFFF0000u)));
}
inline uint32x4_t load_pairs(const bf16* p) { return vld1q_u32(reinterpret_cast<const uint32_t*>(p)); }

// acc[m][q] += the block's pair k (32 outputs, 8 vectors of 4) times row m's pair in lane L of xe/xo. One row
// keeps the odd inputs' sums apart (16 independent FMLA chains); two rows share them (16 again).
template <int MB, int L>
inline void pair_step(const bf16* w, const float32x4_t* xe, const float32x4_t* xo, float32x4_t (*acc)[8],
                      float32x4_t* acc_odd) {
#pragma GCC unroll 8
  for (int q = 0; q < 8; ++q) {
    const uint32x4_t pairs = load_pairs(w + 8 * q);
    const float32x4_t we = even_weights(pairs), wo = odd_weights(pairs);
    if constexpr (MB == 1) {
      acc[0][q] = vfmaq_laneq_f32(acc[0][q], we, xe[0], L);
      acc_odd[q] = vfmaq_laneq_f32(acc_odd[q], wo, xo[0], L);
    } else {
#pragma GCC unroll 2
      for (int m = 0; m < MB; ++m) {
        acc[m][q] = vfmaq_laneq_f32(acc[m][q], we, xe[m], L);
        acc[m][q] = vfmaq_laneq_f32(acc[m][q], wo, xo[m], L);
      }
    }
  }
}

// MB (1 or 2) rows of x against the block, weights widened on the fly
template <int MB, typename OutT>
inline void decode_rows(const BlockTask& t, const bf16* x, OutT* y) {
  float32x4_t acc[MB][8], acc_odd[8];
#pragma GCC unroll 8
  for (int q = 0; q < 8; ++q) {
    acc_odd[q] = vdupq_n_f32(0.f);
#pragma GCC unroll 2
    for (int m = 0; m < MB; ++m) acc[m][q] = vdupq_n_f32(0.f);
  }
  int64_t k = 0;
  for (; k + 4 <= t.k_pairs; k += 4) {  // x's next four pairs, one per lane
    float32x4_t xe[MB], xo[MB];
#pragma GCC unroll 2
    for (int m = 0; m < MB; ++m) {
      const uint32x4_t pairs = load_pairs(x + m * t.ldx + 2 * k);
      xe[m] = even_weights(pairs);
      xo[m] = odd_weights(pairs);
    }
    const bf16* w = t.block + k * 2 * kBlockN;
    pair_step<MB, 0>(w, xe, xo, acc, acc_odd);
    pair_step<MB, 1>(w + 2 * kBlockN, xe, xo, acc, acc_odd);
    pair_step<MB, 2>(w + 4 * kBlockN, xe, xo, acc, acc_odd);
    pair_step<MB, 3>(w + 6 * kBlockN, xe, xo, acc, acc_odd);
  }
  for (; k < t.k_pairs; ++k) {  // the last pairs of a K that is not a multiple of 8: x's pair in every lane
    float32x4_t xe[MB], xo[MB];
#pragma GCC unroll 2
    for (int m = 0; m < MB; ++m) {
      const uint32x4_t pair = vdupq_n_u32(reinterpret_cast<const uint32_t*>(x + m * t.ldx)[k]);
      xe[m] = even_weights(pair);
      xo[m] = odd_weights(pair);
    }
    pair_step<MB, 0>(t.block + k * 2 * kBlockN, xe, xo, acc, acc_odd);
  }
  for (int m = 0; m < MB; ++m) {
    float sums[kBlockN];
    for (int q = 0; q < 8; ++q) vst1q_f32(sums + 4 * q, MB == 1 ? vaddq_f32(acc[0][q], acc_odd[q]) : acc[m][q]);
    store_row(y + m * t.ldy, sums, t.ncols, t.bias);
  }
}

// sums[m][half*16 .. +16) = x_float rows m (MB <= 6) @ the widened block's 16 columns: 24 accumulators, four
// weight vectors and x's element, of NEON's 32 registers
template <int MB>
inline void float_rows(const float* x, int64_t ldx, const float* wf, int64_t k_len, int half,
                       float (*sums)[kBlockN]) {
  float32x4_t acc[MB][4];
#pragma GCC unroll 6
  for (int m = 0; m < MB; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = vdupq_n_f32(0.f);
  const float* w = wf + 16 * half;
  for (int64_t k = 0; k < k_len; ++k) {
    const float* wk = w + k * kBlockN;
    const float32x4_t w0 = vld1q_f32(wk), w1 = vld1q_f32(wk + 4), w2 = vld1q_f32(wk + 8), w3 = vld1q_f32(wk + 12);
#pragma GCC unroll 6
    for (int m = 0; m < MB; ++m) {
      const float b = x[m * ldx + k];
      acc[m][0] = vfmaq_n_f32(acc[m][0], w0, b);
      acc[m][1] = vfmaq_n_f32(acc[m][1], w1, b);
      acc[m][2] = vfmaq_n_f32(acc[m][2], w2, b);
      acc[m][3] = vfmaq_n_f32(acc[m][3], w3, b);
    }
  }
#pragma GCC unroll 6
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < 4; ++j) vst1q_f32(sums[m] + 16 * half + 4 * j, acc[m][j]);
}

template <int MB, typename OutT>
inline void float_rows_both_halves(const BlockTask& t, const float* x, const float* wf, OutT* y) {
  float sums[MB][kBlockN];
  float_rows<MB>(x, t.ldx_float, wf, 2 * t.k_pairs, 0, sums);
  float_rows<MB>(x, t.ldx_float, wf, 2 * t.k_pairs, 1, sums);
  for (int m = 0; m < MB; ++m) store_row(y + m * t.ldy, sums[m], t.ncols, t.bias);
}

// the block [K/2, 32, 2] as float32 [K, 32]
inline void widen_block(const BlockTask& t, float* wf) {
  for (int64_t k = 0; k < t.k_pairs; ++k)
    for (int q = 0; q < 8; ++q) {
      const uint32x4_t pairs = load_pairs(t.block + k * 2 * kBlockN + 8 * q);
      vst1q_f32(wf + (2 * k) * kBlockN + 4 * q, even_weights(pairs));
      vst1q_f32(wf + (2 * k + 1) * kBlockN + 4 * q, odd_weights(pairs));
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
  int64_t m = 0;
  for (; m + 6 <= t.rows; m += 6) float_rows_both_halves<6>(t, t.x_float + m * t.ldx_float, wf, y + m * t.ldy);
  const float* x = t.x_float + m * t.ldx_float;
  y += m * t.ldy;
  switch (t.rows - m) {
    case 5: float_rows_both_halves<5>(t, x, wf, y); break;
    case 4: float_rows_both_halves<4>(t, x, wf, y); break;
    case 3: float_rows_both_halves<3>(t, x, wf, y); break;
    case 2: float_rows_both_halves<2>(t, x, wf, y); break;
    case 1: float_rows_both_halves<1>(t, x, wf, y); break;
    default: break;
  }
}

}  // namespace pagoda::bf16_matmul::neon
