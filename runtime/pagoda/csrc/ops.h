// Every op of the C++ CPU kernel library (torch.ops.pagoda_cpu), declared once: its C++ function, defined in its
// kernel's source file, and its schema, registered with it in csrc/register_ops.cpp. The library is one
// extension per ISA level (pagoda/ops/cpu_library.py lists its translation units); the layer loop calls the
// other kernels straight through these declarations. The shared-memory TP collectives, a class rather than
// ops, are declared in csrc/shm_group.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

// c10::List is only named here (the layer loop's argument, by reference): its definition, ATen/core/List.h, is
// as slow to parse as the rest of this header together, so the two sources that use it (register_ops.cpp
// through torch/library.h, models/llama_layers_cpu.cpp) include it themselves.
namespace c10 {
template <class T>
class List;
}  // namespace c10

// attention (attention/paged_decode_cpu.cpp, paged_prefill_cpu.cpp; the fp8 write in paged_attention_cpu.cpp)
namespace pagoda::attention {

// query/out [B, Hq, D]; caches [num_blocks, block_size, H_kv, D]; block_tables [B, max_blocks] int32;
// seq_lens [B] int32; scale; out; k_scale, v_scale (fp8 caches); sliding_window (0: none); logit_softcap (0: none);
// sinks: none, or [Hq] float32 logits that join each head's softmax denominator (gpt-oss)
void paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                            at::Tensor out, double k_scale, double v_scale, int64_t sliding_window,
                            double logit_softcap, const std::optional<at::Tensor>& sinks = std::nullopt);
constexpr const char* kPagedDecodeAttentionSchema =
    "paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
    "Tensor seq_lens, float scale, Tensor(a!) out, float k_scale, float v_scale, int sliding_window, "
    "float logit_softcap, Tensor? sinks=None) -> ()";

// as paged_decode_attention, query/out [T, Hq, D] with query_start_loc [S + 1] int32 after block_tables
void paged_prefill_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& seq_lens, double scale, at::Tensor out, double k_scale,
                             double v_scale, int64_t sliding_window, double logit_softcap,
                             const std::optional<at::Tensor>& sinks = std::nullopt);
constexpr const char* kPagedPrefillAttentionSchema =
    "paged_prefill_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
    "Tensor query_start_loc, Tensor seq_lens, float scale, Tensor(a!) out, float k_scale, float v_scale, "
    "int sliding_window, float logit_softcap, Tensor? sinks=None) -> ()";

// key/value [T, Hkv, D] into an fp8 kv_cache [2, num_blocks, block_size, Hkv, D] at slot_mapping [T] int64
void write_kv_cache_fp8(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
                        const at::Tensor& slot_mapping, double k_scale, double v_scale);
constexpr const char* kWriteKvCacheFp8Schema =
    "write_kv_cache_fp8(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, float k_scale, "
    "float v_scale) -> ()";

}  // namespace pagoda::attention

// the fused per-layer ops and the sampler's argmax (layers/fused_cpu_ops.cpp)
namespace pagoda::fused {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);  // x [rows, hidden]
constexpr const char* kRmsNormSchema = "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor";

// (rms_norm(x + residual), x + residual)
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps);
constexpr const char* kFusedAddRmsNormSchema =
    "fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)";

// query [T, Hq*D] and key [T, Hkv*D] rotated in place (neox style)
void apply_rotary_(const at::Tensor& positions, at::Tensor query, at::Tensor key, const at::Tensor& cos_sin_cache,
                   int64_t head_size);
constexpr const char* kApplyRotarySchema =
    "apply_rotary_(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_sin_cache, int head_size) -> ()";

at::Tensor silu_and_mul(const at::Tensor& x);  // [T, 2I] (gate, up) -> [T, I]
constexpr const char* kSiluAndMulSchema = "silu_and_mul(Tensor x) -> Tensor";

// key/value [T, Hkv, D] into kv_cache [2, num_blocks, block_size, Hkv, D] (the same dtype) at slot_mapping [T]
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
                    const at::Tensor& slot_mapping);
constexpr const char* kWriteKvCacheSchema =
    "write_kv_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()";

at::Tensor argmax_rows(const at::Tensor& x);  // [N, V] float32 -> [N] int64
constexpr const char* kArgmaxRowsSchema = "argmax_rows(Tensor x) -> Tensor";

}  // namespace pagoda::fused

// random sampling (sample/sampler_cpu.cpp)
namespace pagoda::sample {

// logits [N, V] float32 (-inf: masked), temperature [N] float32 (<= 1e-5: greedy), min_p [N] float32, uniforms [N]
// float64 in [0, 1) -> [N] int64: each row's token drawn from softmax(logits / temperature) with min-p
at::Tensor sample_categorical(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& min_p,
                              const at::Tensor& uniforms);
constexpr const char* kSampleCategoricalSchema =
    "sample_categorical(Tensor logits, Tensor temperature, Tensor min_p, Tensor uniforms) -> Tensor";

}  // namespace pagoda::sample

// bfloat16-weight matmuls (layers/bf16_matmul_cpu.cpp)
namespace pagoda::bf16_matmul {

// x [..., K] against a weight packed by bf16_matmul_cpu.pack -> [..., out_features], bfloat16, or float32 with
// float32_out (logits: not rounded to 8 bits)
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                  const std::optional<at::Tensor>& bias, bool float32_out);
constexpr const char* kLinearSchema =
    "bf16_linear(Tensor x, Tensor packed, int out_features, Tensor? bias, bool float32_out=False) -> Tensor";

// x [..., K] against gate and up packed as one weight [2 I, K] -> bf16(silu(gate)) * up, [..., I]: linear then
// silu_and_mul in one pass (their bits)
at::Tensor linear_silu_and_mul(const at::Tensor& x, const at::Tensor& packed, int64_t intermediate);
constexpr const char* kLinearSiluAndMulSchema =
    "bf16_linear_silu_and_mul(Tensor x, Tensor packed, int intermediate) -> Tensor";

std::string isa_level();  // the ISA level the library was compiled for (csrc/cpu_isa.h)
constexpr const char* kIsaLevelSchema = "isa_level() -> str";
bool uses_amx();  // whether its matmuls of 3 rows and more run on AMX tiles here (csrc/bf16_matmul_amx.h)
constexpr const char* kUsesAmxSchema = "bf16_matmul_uses_amx() -> bool";

}  // namespace pagoda::bf16_matmul

// FP8 (e4m3fn) weight-only matmuls for bfloat16 activations (layers/fp8_matmul_cpu.cpp)
namespace pagoda::fp8_matmul {

// x [..., K] bfloat16 against a weight packed by fp8_pack; scales [N, G] float32, one per output row and block of
// block_k inputs -> [..., out_features] bfloat16
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t block_k,
                  int64_t out_features, const std::optional<at::Tensor>& bias);
constexpr const char* kLinearSchema =
    "fp8_linear(Tensor x, Tensor packed, Tensor scales, int block_k, int out_features, Tensor? bias) -> Tensor";

at::Tensor pack(const at::Tensor& qweight);  // [N, K] float8_e4m3fn -> [ceil(N/32), K/2, 32, 2]
constexpr const char* kPackSchema = "fp8_pack(Tensor qweight) -> Tensor";

at::Tensor unpack(const at::Tensor& packed, int64_t out_features);  // pack's inverse: [N, K]
constexpr const char* kUnpackSchema = "fp8_unpack(Tensor packed, int out_features) -> Tensor";

}  // namespace pagoda::fp8_matmul

// the batched LoRA delta (lora/lora_cpu.cpp)
namespace pagoda::lora {

// y [T, out] += for each row of a slot s >= 0 (row_slots [T] int32, -1: the base model's row): x[row] [K]
// through slot s's A (packed_a [slots, ...]: A [n_sub * R, K] packed by bf16_matmul_cpu.pack) and, per
// sub-output i of sub_sizes (out = their sum), its R columns through its B [size_i, R] (packed_b [slots, ...]:
// each sub-output's B packed, one after the other); bfloat16
void add_(at::Tensor y, const at::Tensor& x, const at::Tensor& row_slots, const at::Tensor& packed_a,
          const at::Tensor& packed_b, at::IntArrayRef sub_sizes);
constexpr const char* kAddSchema =
    "lora_add_(Tensor(a!) y, Tensor x, Tensor row_slots, Tensor packed_a, Tensor packed_b, int[] sub_sizes) -> ()";

// the rows of a pass grouped by slot (slots in the order of their first rows), for the layer loop to group once
struct RowGroups {
  std::vector<int64_t> rows;    // the adapters' rows, group after group
  std::vector<int64_t> starts;  // group g: rows[starts[g], starts[g + 1])
  std::vector<int64_t> slots;   // group g's slot
};
RowGroups group_rows(const at::Tensor& row_slots);
void add_grouped(at::Tensor& y, const at::Tensor& x, const RowGroups& groups, const at::Tensor& packed_a,
                 const at::Tensor& packed_b, at::IntArrayRef sub_sizes);

}  // namespace pagoda::lora

// the Llama decoder layers in one call (models/llama_layers_cpu.cpp)
namespace pagoda::llama {

std::tuple<at::Tensor, at::Tensor> layers(
    const at::Tensor& hidden_in, const std::optional<at::Tensor>& residual_in, const at::Tensor& positions,
    const c10::List<std::optional<at::Tensor>>& layer_tensors, const at::Tensor& cos_sin_cache,
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_tables,
    const at::Tensor& slot_mapping, bool all_decode, const std::optional<at::Tensor>& decode_rows,
    const std::optional<at::Tensor>& decode_block_tables, const std::optional<at::Tensor>& decode_seq_lens,
    const std::optional<at::Tensor>& keep_rows, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
    int64_t intermediate_size, double eps, double scale, const std::optional<at::Tensor>& lora_row_slots,
    const c10::List<std::optional<at::Tensor>>& lora_tensors);
constexpr const char* kLayersSchema =
    "llama_layers(Tensor hidden, Tensor? residual, Tensor positions, Tensor?[] layer_tensors, "
    "Tensor cos_sin_cache, Tensor query_start_loc, Tensor seq_lens, Tensor block_tables, Tensor slot_mapping, "
    "bool all_decode, Tensor? decode_rows, Tensor? decode_block_tables, Tensor? decode_seq_lens, "
    "Tensor? keep_rows, int num_heads, int num_kv_heads, int head_size, int intermediate_size, float eps, "
    "float scale, Tensor? lora_row_slots, Tensor?[] lora_tensors) "
    "-> (Tensor, Tensor)";

std::vector<std::string> layer_slots();  // the names of a layer's tensors in layer_tensors, in order
constexpr const char* kLayerSlotsSchema = "llama_layer_slots() -> str[]";

}  // namespace pagoda::llama
