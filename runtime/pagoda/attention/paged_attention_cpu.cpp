// The fp8 KV-cache write of the CPU attention kernels (torch.ops.pagoda_cpu.write_kv_cache_fp8). Attention straight
// from the paged KV cache is in paged_decode_cpu.cpp (one query token per sequence) and paged_prefill_cpu.cpp
// (several: a prompt, a prefill chunk, verified drafts), sharing csrc/paged_attention_common.h; the ops'
// signatures are csrc/ops.h's.
//
// The cache holds the query's dtype, or fp8 (float8_e4m3fn / float8_e5m2, per-tensor k_scale and v_scale:
// the stored keys times k_scale are the keys): fp8 rows are widened to float32 as they are read
// (csrc/fp8_upcast.h), k_scale folds into the query's scale and v_scale into the output's. A layer may have a
// sliding window (a query at position p sees p - window + 1 .. p: only those rows are read) and soft-capped
// scores (cap * tanh(score / cap), Gemma 2). Both, and fp8, take the float32 kernels; the AVX512_BF16 paths
// are for plain attention over a bfloat16 cache.

#include <algorithm>
#include <limits>

#include "paged_attention_common.h"

namespace pagoda::attention {
namespace {

// The fp8 cache write (vLLM's reshape_and_cache with an fp8 cache): key/value [T, Hkv, D] (float32, bfloat16 or
// float16; D contiguous) into kv_cache [2, num_blocks, block_size, Hkv, D] (float8_e4m3fn / float8_e5m2) at
// slot_mapping [T] int64 (-1 skips) as fp8(x * (1 / scale)) saturated at the format's largest value: the same
// float32 product, clamp and rounding (c10's, to nearest even) as the torch path's kv_scales.quantize.
template <typename scalar_t, typename cache_t>
void write_fp8_rows(const at::Tensor& key, const at::Tensor& value, at::Tensor& kv_cache, const int64_t* slots,
                    float k_inv, float v_inv) {
  const int64_t tokens = key.size(0), heads = key.size(1), head_size = key.size(2);
  const int64_t block_size = kv_cache.size(2);
  const float limit = static_cast<float>(std::numeric_limits<cache_t>::max());
  auto* cache = static_cast<cache_t*>(kv_cache.data_ptr());
  const scalar_t* k = key.data_ptr<scalar_t>();
  const scalar_t* v = value.data_ptr<scalar_t>();
  auto write = [&](const scalar_t* src, cache_t* dst, float inv) {
    for (int64_t d = 0; d < head_size; ++d)
      dst[d] = cache_t(std::min(limit, std::max(-limit, to_float(src[d]) * inv)));
  };
  at::parallel_for(0, tokens, std::max<int64_t>(1, 4096 / (2 * heads * head_size)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t dst = block * kv_cache.stride(1) + offset * kv_cache.stride(2) + h * kv_cache.stride(3);
        write(k + t * key.stride(0) + h * key.stride(1), cache + dst, k_inv);
        write(v + t * value.stride(0) + h * value.stride(1), cache + kv_cache.stride(0) + dst, v_inv);
      }
    }
  });
}

}  // namespace

void write_kv_cache_fp8(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
                        const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  TORCH_CHECK(key.device().is_cpu() && kv_cache.device().is_cpu(), "write_kv_cache_fp8 runs on CPU tensors");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "write_kv_cache_fp8: key/value must be [T, Hkv, D] and kv_cache [2, num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(key.size(1) == kv_cache.size(3) && key.size(2) == kv_cache.size(4),
              "write_kv_cache_fp8: key ", key.sizes(), " does not match the cache ", kv_cache.sizes());
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && kv_cache.stride(4) == 1,
              "write_kv_cache_fp8: the head dimension must be contiguous");
  TORCH_CHECK(is_fp8(kv_cache.scalar_type()), "write_kv_cache_fp8: the cache must be float8_e4m3fn or float8_e5m2");
  TORCH_CHECK(value.scalar_type() == key.scalar_type(), "write_kv_cache_fp8: key and value must share one dtype");
  TORCH_CHECK(k_scale > 0 && v_scale > 0, "write_kv_cache_fp8: k_scale and v_scale must be positive");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0),
              "write_kv_cache_fp8: slot_mapping must be int64 [T]");
  const int64_t slots_in_cache = kv_cache.size(1) * kv_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < key.size(0); ++t)
    TORCH_CHECK(slots[t] >= -1 && slots[t] < slots_in_cache, "write_kv_cache_fp8: slot ", slots[t],
                " outside the cache of ", slots_in_cache, " slots");
  // as torch multiplies a float32 tensor by the Python float 1 / scale: in float32
  const float k_inv = static_cast<float>(1.0 / k_scale), v_inv = static_cast<float>(1.0 / v_scale);
  with_dtypes("write_kv_cache_fp8", key, kv_cache, [&](auto scalar, auto cache) {
    using scalar_t = decltype(scalar);
    using cache_t = decltype(cache);
    if constexpr (pagoda::kIsFp8<cache_t>) write_fp8_rows<scalar_t, cache_t>(key, value, kv_cache, slots, k_inv, v_inv);
  });
}

}  // namespace pagoda::attention
