// bfloat16 <-> float32 in plain C++ that compilers vectorise (a shift; round to nearest even by integer adds),
// for every ISA's scalar and tail code.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

namespace pagoda {

inline float bf16_bits_to_float(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;  // bfloat16 is the top half of a float32
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float bf16_to_float(c10::BFloat16 x) { return bf16_bits_to_float(x.x); }

// round to nearest even, as torch does (no NaN reaches the kernels)
inline c10::BFloat16 float_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
}

inline void store_float(float* y, float v) { *y = v; }
inline void store_float(c10::BFloat16* y, float v) { *y = float_to_bf16(v); }

}  // namespace pagoda
