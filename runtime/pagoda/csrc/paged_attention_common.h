// What the CPU attention kernels share (attention/paged_decode_cpu.cpp, attention/paged_prefill_cpu.cpp and the
// fp8 cache write in attention/paged_attention_cpu.cpp): float conversions, the softmax's exp, soft-capping,
// reading a cache row (fp8 widened in registers), a layer's Variant (scales, window, soft-cap), argument checks and
// the dtype dispatch. Everything here is inline; the ops themselves are declared in ops.h.
#pragma once

// ATen/core/Tensor.h (the Tensor class and its methods), not ATen/ATen.h (every ATen function): half the
// time of compiling a kernel source at -O3 went to parsing ATen/ATen.h, once per source and ISA level
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include "cpu_isa.h"

#if defined(PAGODA_ISA_AVX512) || defined(PAGODA_ISA_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "avx512_math.h"
#include "fp8_upcast.h"
#include "ops.h"

namespace pagoda::attention {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  // bfloat16 is the top half of a float32: a shift the compiler vectorises
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// The bfloat16 prefill tiles' running max (AMX's and vdpbf16ps's; in the AVX2 tile the float32 FMAs leave the
// softmax too small a share to gain, measured) moves only where a chunk's score passes it by more than this, in
// log2 units of the scaled softmax (FlashAttention-4's lazy rescaling): the weights are then at most 2^8, where
// float32 sums and bfloat16 probabilities keep their relative precision, and the output's division by the sum
// cancels whichever max was the reference. Most chunks so take their exponentials against the max as it is,
// checking the bound as they go: no pass or reduction for the max first, no factor for the output sums, no
// scalar exponential.
constexpr float kLazyMaxLog2 = 8.f;
constexpr float kLazyMaxNats = kLazyMaxLog2 * 0.693147181f;

// exp(x) for the softmax's x <= 0, in plain arithmetic that vectorises (std::exp stays a scalar call):
// 2^(x log2 e) = 2^i * 2^f with f in [0, 1) by a degree-5 fit, relative error under 2e-7. The exponent is
// clamped at -126, the smallest normal float's, so 2^i stays a valid float (exp(-87.3) ~ 1e-38: zero weight).
inline float exp_nonpositive(float x) {
  const float t = std::max(x * 1.44269504f, -126.f);
  const float i = std::floor(t), f = t - i;
  float p = 1.87537657e-3f;
  p = p * f + 8.98725919e-3f;
  p = p * f + 5.58359654e-2f;
  p = p * f + 2.40146495e-1f;
  p = p * f + 6.93154738e-1f;
  p = p * f + 9.99999834e-1f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(i) + 127) << 23;
  float two_to_i;
  std::memcpy(&two_to_i, &bits, sizeof(two_to_i));
  return p * two_to_i;
}

// cap * tanh(x / cap) with exp_nonpositive: tanh(y) = sign(y) (1 - e) / (1 + e), e = exp(-2|y|)
inline float softcap_score(float x, float cap) {
  const float y = x / cap;
  const float e = exp_nonpositive(-2.f * std::fabs(y));
  return std::copysign((1.f - e) / (1.f + e), y) * cap;
}

// One row of the cache (head_size elements) as float32: a float cache's values; an fp8 cache's values divided
// by kFp8ReadFactor (the kernels' scales carry the rest)
template <typename cache_t>
inline void load_row(const cache_t* src, float* dst, int64_t n) {
  if constexpr (pagoda::kIsFp8<cache_t>) {
    pagoda::upcast_fp8(src, dst, n);
  } else {
    for (int64_t d = 0; d < n; ++d) dst[d] = to_float(src[d]);
  }
}

// What a layer's attention does besides plain causal softmax(q k^T scale) v, as the kernels receive it
struct Variant {
  float q_scale;   // the softmax scale, times k_scale * kFp8ReadFactor for an fp8 cache
  float out_scale;  // 1, or v_scale * kFp8ReadFactor for an fp8 cache
  int64_t window;  // 0: none; else a query at position p sees p - window + 1 .. p
  float softcap;   // 0: none; else scores = softcap * tanh(scores / softcap)
  const float* sinks = nullptr;  // none, or per query head a logit in the softmax's denominator only (gpt-oss)

  bool plain() const { return window == 0 && softcap == 0.f && out_scale == 1.f && sinks == nullptr; }
  // exp(sink - max) for query head `head`, the sink's share of a softmax whose largest score is `max`; 0: none
  float sink_weight(int64_t head, float max) const { return sinks ? std::exp(sinks[head] - max) : 0.f; }
  // the first position a query at `pos` sees
  int64_t first_visible(int64_t pos) const { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }
};

template <typename cache_t>
Variant make_variant(double scale, double k_scale, double v_scale, int64_t window, double logit_softcap,
                     const std::optional<at::Tensor>& sinks = std::nullopt) {
  const bool fp8 = pagoda::kIsFp8<cache_t>;  // a float cache ignores the scales (a checkpoint may carry them)
  return {static_cast<float>(scale * (fp8 ? k_scale * pagoda::kFp8ReadFactor<cache_t> : 1.0)),
          static_cast<float>(fp8 ? v_scale * pagoda::kFp8ReadFactor<cache_t> : 1.0), window,
          static_cast<float>(logit_softcap), sinks.has_value() ? sinks->data_ptr<float>() : nullptr};
}

// Calls visit(row, i) for positions first + i < last of a context, row pointing at its entry in one KV
// head's cache, walking the block table one block at a time.
template <typename cache_t, typename Visit>
inline void for_each_row(const cache_t* cache, const int32_t* block_table, int64_t first, int64_t last,
                         int64_t block_size, int64_t block_stride, int64_t pos_stride, Visit&& visit) {
  for (int64_t t = first; t < last;) {
    const int64_t offset = t % block_size, n = std::min(block_size - offset, last - t);
    const cache_t* block = cache + block_table[t / block_size] * block_stride;
    for (int64_t i = 0; i < n; ++i) visit(block + (offset + i) * pos_stride, t - first + i);
    t += n;
  }
}

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

constexpr int64_t kMaxHeadSize = 256;  // MAX_HEAD_SIZE in cpu_kernels.py

#if defined(PAGODA_ISA_AVX512)
using avx512::exp2_nonpositive16;  // csrc/avx512_math.h

// exp(x) of 16 lanes, as exp_nonpositive
inline __m512 exp_nonpositive16(__m512 x) { return exp2_nonpositive16(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f))); }

// softcap_score of 16 lanes
inline __m512 softcap16(__m512 x, float cap) {
  const __m512 y = _mm512_mul_ps(x, _mm512_set1_ps(1.f / cap));
  const __m512 e = exp_nonpositive16(_mm512_mul_ps(_mm512_abs_ps(y), _mm512_set1_ps(-2.f)));
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign)), _mm512_set1_ps(cap));
}

// lane j of the result = the sum of v[j]'s 16 lanes: a transposing tree of 45 instructions for all 16, where
// 16 separate horizontal sums take ~130
inline __m512 sum_each16(const __m512* v) {
  __m512 pairs[8];  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of v[2i], v[2i+1]
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 quads[4];  // per 128-bit lane L: the lane-L sums of v[4i..4i+3]
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  __m512 halves[2];  // 128-bit lanes: v[8i..8i+3] over lanes 0+1, 2+3, then v[8i+4..8i+7] the same
  for (int i = 0; i < 2; ++i)
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(halves[0], halves[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

inline bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

inline void check_attention_args(const char* op, const at::Tensor& query, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const at::Tensor& out, double k_scale,
                                 double v_scale, int64_t sliding_window, double logit_softcap,
                                 const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.device().is_cpu(), op, " runs on CPU tensors");
  TORCH_CHECK(!sinks.has_value() || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                                     sinks->dim() == 1 && sinks->size(0) == query.size(1)),
              op, ": sinks must be contiguous float32 [Hq], one logit per query head");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4,
              op, ": query must be [tokens, Hq, D] and the caches [num_blocks, block_size, H_kv, D]");
  TORCH_CHECK(key_cache.strides() == value_cache.strides() && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.scalar_type() == value_cache.scalar_type(),
              op, ": key and value caches must have the same shape, strides and dtype");
  TORCH_CHECK(query.stride(2) == 1 && key_cache.stride(3) == 1 && out.stride(2) == 1,
              op, ": the head dimension must be contiguous");
  TORCH_CHECK((query.scalar_type() == key_cache.scalar_type() || is_fp8(key_cache.scalar_type())) &&
                  out.scalar_type() == query.scalar_type(),
              op, ": query, caches and out must share one dtype (or the caches be float8_e4m3fn / float8_e5m2)");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, op, ": query heads must be a multiple of KV heads");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && query.size(2) <= kMaxHeadSize,
              op, ": head size must match the cache and be at most ", kMaxHeadSize);
  TORCH_CHECK(out.sizes() == query.sizes(), op, ": out must have the query's shape");
  TORCH_CHECK(k_scale > 0 && v_scale > 0, op, ": k_scale and v_scale must be positive, got ", k_scale, " and ",
              v_scale);
  TORCH_CHECK(sliding_window >= 0, op, ": sliding_window must be a positive number of positions (0: none), got ",
              sliding_window);
  TORCH_CHECK(logit_softcap >= 0, op, ": logit_softcap must be positive (0: none), got ", logit_softcap);
}

// Calls run(scalar_t{}, cache_t{}) for the query's dtype and the cache's (the same, or an fp8 one)
template <typename Run>
void with_dtypes(const char* op, const at::Tensor& query, const at::Tensor& key_cache, Run&& run) {
  auto with_cache = [&](auto scalar) {
    using scalar_t = decltype(scalar);
    switch (key_cache.scalar_type()) {
      case at::kFloat8_e4m3fn: run(scalar, c10::Float8_e4m3fn()); break;
      case at::kFloat8_e5m2: run(scalar, c10::Float8_e5m2()); break;
      default: run(scalar, scalar_t()); break;
    }
  };
  switch (query.scalar_type()) {
    case at::kFloat: with_cache(float()); break;
    case at::kBFloat16: with_cache(c10::BFloat16()); break;
    case at::kHalf: with_cache(c10::Half()); break;
    default: TORCH_CHECK(false, op, " supports float32, bfloat16 and float16 queries");
  }
}

}  // namespace pagoda::attention
