// bfloat16 matmul micro-kernel in plain C++ (any CPU; the compiler vectorises the 32 columns): each weight
// pair widened to float32 and summed in float32, the same arithmetic as the AVX2 kernel.
#pragma once

#include "bf16_matmul_common.h"

namespace pagoda::bf16_matmul::generic {

constexpr int64_t kFloatXRows = 0;
constexpr bool kWantsFloatX = false;
constexpr int64_t kXPanelRows = 0;  // no float32 x (bf16_matmul_common.h: x_float_panels)

template <typename OutT>
void rows_against_block(const BlockTask& t, OutT* y) {
  const uint32_t* block = reinterpret_cast<const uint32_t*>(t.block);
  for (int64_t m = 0; m < t.rows; ++m) {
    const uint16_t* x = reinterpret_cast<const uint16_t*>(t.x + m * t.ldx);
    float even[kBlockN] = {0.f}, odd[kBlockN] = {0.f};
    for (int64_t k = 0; k < t.k_pairs; ++k) {
      const float x0 = bf16_bits_to_float(x[2 * k]), x1 = bf16_bits_to_float(x[2 * k + 1]);
      const uint32_t* w = block + k * kBlockN;
      for (int j = 0; j < kBlockN; ++j) {
        const uint32_t lo = w[j] << 16, hi = w[j] & 0xFFFF0000u;
        float w0, w1;
        std::memcpy(&w0, &lo, 4);
        std::memcpy(&w1, &hi, 4);
        even[j] += x0 * w0;
        odd[j] += x1 * w1;
      }
    }
    for (int j = 0; j < kBlockN; ++j) even[j] += odd[j];
    store_row(y + m * t.ldy, even, t.ncols, t.bias);
  }
}

}  // namespace pagoda::bf16_matmul::generic
