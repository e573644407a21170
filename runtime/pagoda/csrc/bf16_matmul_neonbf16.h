// bfloat16 matmul micro-kernels for aarch64 CPUs with the BF16 extension (Graviton3/4, Neoverse V1/V2/N2,
// Apple M2 and later): bfloat16 products summed in float32 by the hardware, on the packed layout as it is.
//
// - BFDOT (`vbfdotq_laneq_f32`): four outputs' weight pairs times one of x's pairs (a lane), as AVX512_BF16's
//   `vdpbf16ps` with a broadcast: one instruction per 4 outputs per input pair. Used for a single row (decode).
// - BFMMLA (`vbfmmlaq_f32`): a 2x4 by 4x2 matrix product, two rows of x against two outputs over four inputs,
//   twice BFDOT's work per instruction. Its right operand is two outputs' four consecutive weights, which is
//   `zip1`/`zip2` of two consecutive packed pairs as 32-bit lanes: the packed layout serves both. Used for
//   row pairs: prefill, and decode batches of two and more.
#pragma once

#include <arm_neon.h>

#include "bf16_matmul_common.h"

namespace pagoda::bf16_matmul::neonbf16 {

constexpr int64_t kFloatXRows = 0;
constexpr bool kWantsFloatX = false;
constexpr int64_t kXPanelRows = 0;  // no float32 x (bf16_matmul_common.h: x_float_panels)

inline bfloat16x8_t load_bf16x8(const bf16* p) { return vreinterpretq_bf16_u16(vld1q_u16(&p->x)); }

// the block's pair k, 32 outputs in 8 vectors (4 outputs x 2 inputs each), times x's pair in lane L
template <int L>
inline void dot_pair(const bf16* w, bfloat16x8_t xk, float32x4_t* acc) {
#pragma GCC unroll 8
  for (int q = 0; q < 8; ++q) acc[q] = vbfdotq_laneq_f32(acc[q], load_bf16x8(w + 8 * q), xk, L);
}

// one row of x against the block (decode): two sets of 8 accumulators, alternate pairs, for independent chains
template <typename OutT>
inline void dot_row(const BlockTask& t, const bf16* x, OutT* y) {
  float32x4_t acc[2][8];
#pragma GCC unroll 8
  for (int q = 0; q < 8; ++q) acc[0][q] = acc[1][q] = vdupq_n_f32(0.f);
  int64_t k = 0;
  for (; k + 4 <= t.k_pairs; k += 4) {
    const bfloat16x8_t xk = load_bf16x8(x + 2 * k);  // pairs k..k+3, one per lane
    const bf16* w = t.block + k * 2 * kBlockN;
    dot_pair<0>(w, xk, acc[0]);
    dot_pair<1>(w + 2 * kBlockN, xk, acc[1]);
    dot_pair<2>(w + 4 * kBlockN, xk, acc[0]);
    dot_pair<3>(w + 6 * kBlockN, xk, acc[1]);
  }
  for (; k < t.k_pairs; ++k) {
    const bfloat16x8_t xk = vreinterpretq_bf16_u32(vdupq_n_u32(reinterpret_cast<const uint32_t*>(x)[k]));
    dot_pair<0>(t.block + k * 2 * kBlockN, xk, acc[0]);
  }
  float sums[kBlockN];
  for (int q = 0; q < 8; ++q) vst1q_f32(sums + 4 * q, vaddq_f32(acc[0][q], acc[1][q]));
  store_row(y, sums, t.ncols, t.bias);
}

// BFMMLA's right operands for outputs [c, c+4) over the inputs of pairs k and k+1 (`next`: pair k+1's row):
// zip of the two pairs as 32-bit lanes gives each output's four consecutive weights
inline void mmla_weights(const bf16* pair_k, const bf16* next, bfloat16x8_t* cols01, bfloat16x8_t* cols23) {
  const uint32x4_t a = vld1q_u32(reinterpret_cast<const uint32_t*>(pair_k));
  const uint32x4_t b = vld1q_u32(reinterpret_cast<const uint32_t*>(next));
  *cols01 = vreinterpretq_bf16_u32(vzip1q_u32(a, b));
  *cols23 = vreinterpretq_bf16_u32(vzip2q_u32(a, b));
}

// MP row pairs of x (rows 2p, 2p+1 at x + 2p*ldx...) against NCP output pairs starting at column c0 (NCP
// divides 16, MP * NCP <= 16 accumulators). sums: [2 * MP][kBlockN]
template <int MP, int NCP>
inline void mmla_tile(const BlockTask& t, const bf16* x, int c0, float (*sums)[kBlockN]) {
  float32x4_t acc[MP][NCP];  // lanes: (row 2p, col 2c), (2p, 2c+1), (2p+1, 2c), (2p+1, 2c+1)
#pragma GCC unroll 16
  for (int p = 0; p < MP; ++p)
#pragma GCC unroll 16
    for (int c = 0; c < NCP; ++c) acc[p][c] = vdupq_n_f32(0.f);
  const int64_t ldx = t.ldx;
  int64_t k = 0;
  for (; k + 2 <= t.k_pairs; k += 2) {  // four inputs at a time
    bfloat16x8_t a[MP];
#pragma GCC unroll 4
    for (int p = 0; p < MP; ++p) {
      const bf16* row = x + 2 * p * ldx + 2 * k;
      a[p] = vcombine_bf16(vreinterpret_bf16_u16(vld1_u16(&row->x)), vreinterpret_bf16_u16(vld1_u16(&row[ldx].x)));
    }
    const bf16* w = t.block + k * 2 * kBlockN + 2 * c0;
#pragma GCC unroll 8
    for (int c = 0; c < NCP; c += 2) {
      bfloat16x8_t b0, b1;
      mmla_weights(w + 4 * c, w + 2 * kBlockN + 4 * c, &b0, &b1);
#pragma GCC unroll 4
      for (int p = 0; p < MP; ++p) {
        acc[p][c] = vbfmmlaq_f32(acc[p][c], a[p], b0);
        acc[p][c + 1] = vbfmmlaq_f32(acc[p][c + 1], a[p], b1);
      }
    }
  }
  if (k < t.k_pairs) {  // an odd number of pairs: the last one against zeros in the second pair's place
    bfloat16x8_t a[MP];
#pragma GCC unroll 4
    for (int p = 0; p < MP; ++p) {
      const uint32_t* row = reinterpret_cast<const uint32_t*>(x + 2 * p * ldx) + k;
      const uint32x2_t first = vdup_n_u32(row[0]), second = vdup_n_u32(row[ldx / 2]);
      // (x[2k], x[2k+1], 0, 0) for each row: zeros where the weights are zero anyway
      a[p] = vreinterpretq_bf16_u32(vcombine_u32(vset_lane_u32(0, first, 1), vset_lane_u32(0, second, 1)));
    }
    const bf16* w = t.block + k * 2 * kBlockN + 2 * c0;
    const uint32x4_t zeros = vdupq_n_u32(0);
#pragma GCC unroll 8
    for (int c = 0; c < NCP; c += 2) {
      const uint32x4_t pairs = vld1q_u32(reinterpret_cast<const uint32_t*>(w + 4 * c));
      const bfloat16x8_t b0 = vreinterpretq_bf16_u32(vzip1q_u32(pairs, zeros));
      const bfloat16x8_t b1 = vreinterpretq_bf16_u32(vzip2q_u32(pairs, zeros));
#pragma GCC unroll 4
      for (int p = 0; p < MP; ++p) {
        acc[p][c] = vbfmmlaq_f32(acc[p][c], a[p], b0);
        acc[p][c + 1] = vbfmmlaq_f32(acc[p][c + 1], a[p], b1);
      }
    }
  }
  // two output pairs' 2x2 results -> four columns of each of the two rows
#pragma GCC unroll 4
  for (int p = 0; p < MP; ++p)
#pragma GCC unroll 8
    for (int c = 0; c < NCP; c += 2) {
      const uint64x2_t left = vreinterpretq_u64_f32(acc[p][c]), right = vreinterpretq_u64_f32(acc[p][c + 1]);
      vst1q_f32(sums[2 * p] + c0 + 2 * c, vreinterpretq_f32_u64(vzip1q_u64(left, right)));
      vst1q_f32(sums[2 * p + 1] + c0 + 2 * c, vreinterpretq_f32_u64(vzip2q_u64(left, right)));
    }
}

// 2 * MP rows against the whole block: 16 / NCP column passes of MP x NCP accumulators
template <int MP, typename OutT>
inline void mmla_rows(const BlockTask& t, const bf16* x, OutT* y) {
  constexpr int NCP = MP == 1 ? 16 : MP == 2 ? 8 : 4;
  float sums[2 * MP][kBlockN];
  for (int c0 = 0; c0 < kBlockN; c0 += 2 * NCP) mmla_tile<MP, NCP>(t, x, c0, sums);
  for (int m = 0; m < 2 * MP; ++m) store_row(y + m * t.ldy, sums[m], t.ncols, t.bias);
}

template <typename OutT>
void rows_against_block(const BlockTask& t, OutT* y) {
  const bf16* x = t.x;
  const int64_t ldx = t.ldx, ldy = t.ldy;
  int64_t m = 0;
  for (; m + 8 <= t.rows; m += 8) mmla_rows<4>(t, x + m * ldx, y + m * ldy);
  switch ((t.rows - m) / 2) {
    case 3: mmla_rows<3>(t, x + m * ldx, y + m * ldy); m += 6; break;
    case 2: mmla_rows<2>(t, x + m * ldx, y + m * ldy); m += 4; break;
    case 1: mmla_rows<1>(t, x + m * ldx, y + m * ldy); m += 2; break;
    default: break;
  }
  if (m < t.rows) dot_row(t, x + m * ldx, y + m * ldy);
}

}  // namespace pagoda::bf16_matmul::neonbf16
