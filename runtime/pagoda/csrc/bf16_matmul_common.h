// What every ISA's bfloat16 matmul micro-kernel shares (bf16_matmul_{avx512bf16,avx2,generic}.h): the packed
// weight layout and the epilogue. Packed layout: [ceil(N/32), K/2, 32, 2]; block b holds output columns
// [32b, 32b+32), and for each pair of input columns the 32 outputs' two weights side by side (rows past N: 0).
// As int32 lanes, lane j of pair k is (w[j][2k] in the low half, w[j][2k+1] in the high half): AVX512_BF16
// multiplies such pairs directly; elsewhere `lane << 16` and `lane & 0xFFFF0000` are the two weights in float32.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>

#include "bf16_scalar.h"

namespace pagoda::bf16_matmul {

using bf16 = c10::BFloat16;
constexpr int64_t kBlockN = 32;  // output columns per packed block

// One task: rows of x against one packed block.
struct BlockTask {
  const bf16* x;         // [rows, K] bfloat16, rows ldx apart
  const float* x_float;  // the same rows widened to float32 (rows ldx_float apart), or null
  int64_t ldx, ldx_float, rows;
  const bf16* block;  // [K/2, 32, 2]
  int64_t k_pairs;
  int64_t ldy, ncols;  // y's row stride; the block's columns that exist (<= 32)
  const bf16* bias;    // [ncols] or null
  // x_float as panels of the ISA's kXPanelRows rows, [K][kXPanelRows] each, one after another (the last one
  // zero-padded; pack_x_panel), instead of rows ldx_float apart: the micro-kernel's broadcasts of a row group
  // read one stream, not one per row
  bool x_float_panels = false;
};

// y[0:ncols] = sums[0:ncols] (+ bias), rounded once to y's type
template <typename OutT>
inline void store_row(OutT* y, const float* sums, int64_t ncols, const bf16* bias) {
  for (int64_t j = 0; j < ncols; ++j) store_float(y + j, sums[j] + (bias ? bf16_to_float(bias[j]) : 0.f));
}

// rows (<= kPanelRows) of x, k_len wide, as one panel [k_len][kPanelRows] of float32 (rows past `rows`: 0)
template <int64_t kPanelRows>
inline void pack_x_panel(const bf16* x, int64_t ldx, int64_t rows, int64_t k_len, float* panel) {
  for (int64_t k = 0; k < k_len; ++k)
    for (int64_t m = 0; m < kPanelRows; ++m)
      panel[k * kPanelRows + m] = m < rows ? bf16_to_float(x[m * ldx + k]) : 0.f;
}

}  // namespace pagoda::bf16_matmul
