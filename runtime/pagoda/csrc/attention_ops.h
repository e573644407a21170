// The C++ signatures of the attention library's ops (torch.ops.pagoda_cpu, attention/paged_attention_cpu.cpp),
// written down once: the library registers functions of these types (it static_asserts so), and callers that
// find the ops through the dispatcher (models/llama_layers_cpu.cpp) type their handles with them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace pagoda::ops {

// query/out [B, Hq, D]; caches [num_blocks, block_size, H_kv, D]; block_tables [B, max_blocks] int32;
// seq_lens [B] int32; scale; out; k_scale, v_scale (fp8 caches); sliding_window (0: none); logit_softcap (0: none)
using PagedDecodeAttention = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                  const at::Tensor&, double, at::Tensor, double, double, int64_t, double);
constexpr const char* kPagedDecodeAttention = "pagoda_cpu::paged_decode_attention";
constexpr const char* kPagedDecodeAttentionSchema =
    "paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
    "Tensor seq_lens, float scale, Tensor(a!) out, float k_scale, float v_scale, int sliding_window, "
    "float logit_softcap) -> ()";

// as PagedDecodeAttention, query/out [T, Hq, D] with query_start_loc [S + 1] int32 after block_tables
using PagedPrefillAttention = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const at::Tensor&, double, at::Tensor, double, double, int64_t,
                                   double);
constexpr const char* kPagedPrefillAttention = "pagoda_cpu::paged_prefill_attention";
constexpr const char* kPagedPrefillAttentionSchema =
    "paged_prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
    "Tensor query_start_loc, Tensor seq_lens, float scale, Tensor(a!) out, float k_scale, float v_scale, "
    "int sliding_window, float logit_softcap) -> ()";

// key/value [T, Hkv, D] into an fp8 kv_cache [2, num_blocks, block_size, Hkv, D] at slot_mapping [T] int64
using WriteKvCacheFp8 = void(const at::Tensor&, const at::Tensor&, at::Tensor, const at::Tensor&, double, double);
constexpr const char* kWriteKvCacheFp8 = "pagoda_cpu::write_kv_cache_fp8";
constexpr const char* kWriteKvCacheFp8Schema =
    "write_kv_cache_fp8(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, float k_scale, "
    "float v_scale) -> ()";

}  // namespace pagoda::ops
