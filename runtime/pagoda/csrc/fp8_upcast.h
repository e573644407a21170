// fp8 (float8_e4m3fn, float8_e5m2) -> float32 in registers, per ISA level, for kernels that read an fp8 KV cache
// in place (no dequantised copy).
//
// Both formats are read through float16: the byte's bits are moved to where a float16 keeps the same fields and
// one conversion instruction (F16C's vcvtph2ps, which also turns float16 subnormals into normal floats exactly)
// widens them. e5m2 is the high byte of a float16 (same exponent bias): its value comes out as it is. e4m3fn's
// sign goes to bit 15 and its exponent and mantissa to bits 7..13; its exponent bias is 8 smaller than
// float16's, so what comes out is the value / 256 (subnormals included), for every byte but the NaN code,
// which quantization never stores (values are clamped to 448). Kernels fold kFp8ReadFactor into their scales
// instead of multiplying each element. No float subnormal is ever formed, so -ffast-math's flush-to-zero
// cannot touch the small values.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_isa.h"

#if defined(PAGODA_ISA_AVX512) || defined(PAGODA_ISA_AVX2)
#include <immintrin.h>
#endif

namespace pagoda {

template <typename T>
constexpr bool kIsFp8 = std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;

// what a value read by upcast_fp8 must be multiplied by: 1 for a float cache and e5m2, 256 for e4m3fn
template <typename T>
constexpr float kFp8ReadFactor = std::is_same_v<T, c10::Float8_e4m3fn> ? 256.f : 1.f;

template <typename T>
inline uint16_t fp8_to_half_bits(uint8_t b) {
  if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>)
    return static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7));
  else
    return static_cast<uint16_t>(b << 8);
}

// float16 bits -> float32, exactly, without forming a float subnormal (exponent 31, never stored: as 30)
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  float magnitude;
  if (exponent == 0) {
    magnitude = static_cast<float>(mantissa) * (1.f / 16777216.f);  // mantissa * 2^-24: 0 or >= 2^-24
  } else {
    const uint32_t bits = ((exponent + 112u) << 23) | (mantissa << 13);
    std::memcpy(&magnitude, &bits, sizeof(magnitude));
  }
  uint32_t bits;
  std::memcpy(&bits, &magnitude, sizeof(bits));
  bits |= sign;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// the 256 bytes' values as upcast_fp8 reads them (the scalar path and vector tails)
template <typename T>
inline const float* fp8_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = half_bits_to_float(fp8_to_half_bits<T>(static_cast<uint8_t>(b)));
    return t;
  }();
  return table.data();
}

#if defined(PAGODA_ISA_AVX512)
// 16 bytes -> 16 floats
template <typename T>
inline __m512 upcast_fp8_16(const uint8_t* src) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
  __m256i h;
  if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>)
    h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                        _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
  else
    h = _mm256_slli_epi16(b, 8);
  return _mm512_cvtph_ps(h);
}
#endif

#if defined(PAGODA_ISA_AVX2) && defined(__F16C__)
// 8 bytes -> 8 floats
template <typename T>
inline __m256 upcast_fp8_8(const uint8_t* src) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
  __m128i h;
  if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>)
    h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8),
                     _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7));
  else
    h = _mm_slli_epi16(b, 8);
  return _mm256_cvtph_ps(h);
}
#endif

#if defined(PAGODA_ISA_AVX512BF16)
// 32 bytes -> the same 32 values in bfloat16, exactly (no factor: bfloat16 has the range and the mantissa bits
// of both formats), for kernels that multiply with `vdpbf16ps`. A normal code is its magnitude bits moved to
// bfloat16's fields plus the exponent bias gap (120 for e4m3fn, 112 for e5m2); the few subnormal codes (exponent
// 0: 8 in e4m3fn, 4 in e5m2) come from a 32-entry table with one `vpermw`. No bfloat16 subnormal is formed
// (`vdpbf16ps` reads those as zero). Codes with the top exponent (e5m2's inf / NaN, e4m3fn's NaN), which
// quantization never stores, read as finite values.
// bfloat16 bits of the subnormal codes m = 0 .. 2^kMantissaBits - 1 (values m * 2^(1 - bias - kMantissaBits)),
// entries past them 0
template <int kMantissaBits>
constexpr std::array<uint16_t, 32> fp8_subnormals_as_bf16() {
  constexpr int kBias = kMantissaBits == 3 ? 7 : 15;
  std::array<uint16_t, 32> table{};
  for (int m = 1; m < (1 << kMantissaBits); ++m) {
    const int top = m >= 4 ? 2 : m >= 2 ? 1 : 0;  // m = 2^top + rest
    const int exponent = top + 1 - kBias - kMantissaBits + 127;
    table[m] = static_cast<uint16_t>((exponent << 7) | ((m - (1 << top)) << (7 - top)));
  }
  return table;
}

template <typename T>
inline __m512i upcast_fp8_32_bf16(__m256i bytes) {
  constexpr bool kE4m3 = std::is_same_v<T, c10::Float8_e4m3fn>;
  constexpr int kMantissaBits = kE4m3 ? 3 : 2;
  constexpr int kBiasGap = kE4m3 ? 127 - 7 : 127 - 15;
  static constexpr std::array<uint16_t, 32> kSubnormals = fp8_subnormals_as_bf16<kMantissaBits>();
  const __m512i subnormals = _mm512_loadu_si512(kSubnormals.data());
  const __m512i b = _mm512_cvtepu8_epi16(bytes);
  const __m512i magnitude = _mm512_and_si512(b, _mm512_set1_epi16(0x7F));
  __m512i out = _mm512_add_epi16(_mm512_slli_epi16(magnitude, 7 - kMantissaBits), _mm512_set1_epi16(kBiasGap << 7));
  const __mmask32 subnormal = _mm512_testn_epi16_mask(b, _mm512_set1_epi16(0x7F & ~((1 << kMantissaBits) - 1)));
  out = _mm512_mask_permutexvar_epi16(out, subnormal, magnitude, subnormals);
  return _mm512_or_si512(out, _mm512_and_si512(_mm512_slli_epi16(b, 8), _mm512_set1_epi16(static_cast<short>(0x8000))));
}
#endif

#if defined(PAGODA_ISA_AVX512BF16) && defined(__AVX512VBMI__)
// the bfloat16 bits of the 128 magnitudes of format T (exact; the top exponent's codes read as finite values), their
// high and low bytes: each a 128-entry table for `vpermi2b` (two 64-byte halves)
struct Bf16ByteTables {
  alignas(64) uint8_t high[128];
  alignas(64) uint8_t low[128];
};

template <typename T>
constexpr Bf16ByteTables fp8_bf16_byte_tables() {
  constexpr bool kE4m3 = std::is_same_v<T, c10::Float8_e4m3fn>;
  constexpr int kMantissaBits = kE4m3 ? 3 : 2;
  constexpr int kBiasGap = kE4m3 ? 127 - 7 : 127 - 15;
  constexpr std::array<uint16_t, 32> subnormals = fp8_subnormals_as_bf16<kMantissaBits>();
  Bf16ByteTables t{};
  for (int c = 0; c < 128; ++c) {
    const int exponent = c >> kMantissaBits, mantissa = c & ((1 << kMantissaBits) - 1);
    const uint16_t bits = exponent == 0 ? subnormals[c]
                                        : static_cast<uint16_t>(((exponent + kBiasGap) << 7) | (mantissa << (7 - kMantissaBits)));
    t.high[c] = static_cast<uint8_t>(bits >> 8);
    t.low[c] = static_cast<uint8_t>(bits & 0xFF);
  }
  return t;
}

// 64 codes (in the order unpack_lanes_position gives) -> the values of codes 0..31 and 32..63 in bfloat16: each
// code's high and low byte looked up (`vpermi2b`), the sign put back, the bytes interleaved into words. The
// interleave works within 128-bit lanes: word w of lane L of the first result comes from byte 16 L + w % 8, of the
// second from byte 16 L + 8 + w % 8.
template <typename T>
inline void upcast_fp8_lanes_bf16(__m512i codes, __m512i& first, __m512i& second) {
  static constexpr Bf16ByteTables kTables = fp8_bf16_byte_tables<T>();
  __m512i high = _mm512_permutex2var_epi8(_mm512_load_si512(kTables.high), codes, _mm512_load_si512(kTables.high + 64));
  const __m512i low = _mm512_permutex2var_epi8(_mm512_load_si512(kTables.low), codes, _mm512_load_si512(kTables.low + 64));
  high = _mm512_ternarylogic_epi32(high, codes, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // | the sign
  first = _mm512_unpacklo_epi8(low, high);
  second = _mm512_unpackhi_epi8(low, high);
}

// where code i (0..63) must sit for upcast_fp8_lanes_bf16 to return codes 0..31 and 32..63 in order
constexpr int unpack_lanes_position(int i) { return 16 * (i % 32 / 8) + 8 * (i / 32) + i % 8; }

// 64 codes in memory order -> their values in bfloat16 (codes 0..31, 32..63): one `vpermb` into
// upcast_fp8_lanes_bf16's order first
template <typename T>
inline void upcast_fp8_64_bf16(const uint8_t* src, __m512i& first, __m512i& second) {
  static constexpr auto kOrder = [] {
    struct alignas(64) Order { uint8_t at[64]; } order{};
    for (int i = 0; i < 64; ++i) order.at[unpack_lanes_position(i)] = static_cast<uint8_t>(i);
    return order;
  }();
  const __m512i codes = _mm512_permutexvar_epi8(_mm512_load_si512(kOrder.at), _mm512_loadu_si512(src));
  upcast_fp8_lanes_bf16<T>(codes, first, second);
}
#endif

// n fp8 values of type T -> dst, each times 1 / kFp8ReadFactor<T>
template <typename T>
inline void upcast_fp8(const T* src, float* dst, int64_t n) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(src);
  int64_t i = 0;
#if defined(PAGODA_ISA_AVX512)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, upcast_fp8_16<T>(bytes + i));
#elif defined(PAGODA_ISA_AVX2) && defined(__F16C__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, upcast_fp8_8<T>(bytes + i));
#endif
  if (i < n) {
    const float* table = fp8_table<T>();
    for (; i < n; ++i) dst[i] = table[bytes[i]];
  }
}

}  // namespace pagoda
