// A forward pass through a stack of Llama decoder layers, in one call from Python.
//
// A batch-1 decode step of the default model is ~10 ms of kernels and, before this, ~3 ms of Python
// between them: ~10 op calls per layer, each a module call, attribute lookups and a dispatch. This loop
// makes the same calls, to the same kernels (the library's own, called directly through csrc/ops.h), in the
// order of models/llama.py and attention/torch_backend.py, so the result is bit for bit the Python path's.
//
// Scope (llama_layers_cpu.py checks it): bfloat16 weights packed for bf16_matmul_cpu or FP8 ones packed for
// fp8_matmul_cpu (with their scales), one tensor-parallel rank, a KV cache in the model's dtype or fp8 (with the
// layer's k_scale and v_scale), the C++ attention and fused kernels.
//
// LoRA (lora/layers.py owns the packing; cpu_loop_args gathers it): after each projection, the adapters' deltas
// through lora/lora_cpu.cpp, the op the Python layers' hook calls (the same calls on the same rows, so the same
// sums), with the rows grouped once per pass.

#include <ATen/ATen.h>

#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "ops.h"

namespace pagoda::llama {  // the ops are declared in csrc/ops.h
namespace {

using OptionalTensor = std::optional<at::Tensor>;

// A layer's tensors in layer_tensors, kSlots per layer, in this order; Python reads the names (op llama_layer_slots)
// and fills the list by name, so the order is written down here only.
// kv_scales: an fp8 cache's [k_scale, v_scale] (float64 [2]), None for a cache in the model's dtype. FP8 weights:
// the four *_scale slots hold their scales ([N, G] float32) and block_k their block sizes (int64 [4], in the order
// qkv, out, gate_up, down); None for bfloat16 weights.
enum Slot {
  kInputNorm, kQKV, kQKVBias, kQNorm, kKNorm, kOut, kOutBias, kPostNorm, kGateUp, kDown, kKVCache, kKVScales,
  kQKVScale, kOutScale, kGateUpScale, kDownScale, kBlockK, kSlots
};
constexpr const char* kSlotNames[] = {"input_norm", "qkv",       "qkv_bias",  "q_norm",    "k_norm",        "out",
                                      "out_bias",   "post_norm", "gate_up",   "down",      "kv_cache",      "kv_scales",
                                      "qkv_scale",  "out_scale", "gate_up_scale", "down_scale", "block_k"};
static_assert(sizeof(kSlotNames) / sizeof(kSlotNames[0]) == kSlots, "one name per Slot");

at::Tensor required(const c10::List<OptionalTensor>& tensors, int64_t layer, Slot slot) {
  OptionalTensor t = tensors.get(layer * kSlots + slot);
  TORCH_CHECK(t.has_value(), "llama_layers: layer ", layer, " has no tensor in slot ", int(slot), " (",
              kSlotNames[slot], ")");
  return *std::move(t);
}

// The batch's attention metadata (attention/metadata.py), with its single-row sequences picked out once per
// pass when prefill chunks sit among them.
struct Batch {
  const at::Tensor& query_start_loc;  // [S + 1] int32
  const at::Tensor& seq_lens;  // [S] int32
  const at::Tensor& block_tables;  // [S, max_blocks] int32
  bool all_decode;  // every sequence has one query row: row i is sequence i
  const OptionalTensor& decode_rows;  // [R] int64: the query rows of single-row sequences, in a mixed batch
  const OptionalTensor& decode_block_tables;  // [R, max_blocks]
  const OptionalTensor& decode_seq_lens;  // [R]
};

// the loop's layers have no window and no soft-cap
constexpr double kNoSoftcap = 0.0;
constexpr int64_t kNoWindow = 0;

// an fp8 cache's scales (stored = fp8(k / k_scale)); 1 and 1 for a cache in the model's dtype (the kernels
// ignore them there)
struct KvScales {
  double k = 1.0, v = 1.0;
};

KvScales kv_scales(const OptionalTensor& t) {
  if (!t.has_value()) return {};
  TORCH_CHECK(t->scalar_type() == at::kDouble && t->numel() == 2 && t->is_contiguous(),
              "llama_layers: kv_scales must be float64 [k_scale, v_scale]");
  const double* s = t->data_ptr<double>();
  return {s[0], s[1]};
}

// attention/torch_backend.py's _paged_attention_cpu: query [T, Hq, D] -> [T, Hq, D]
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& kv_cache, const Batch& b, double scale,
                           KvScales kv) {
  at::Tensor out = at::empty_like(query);
  const at::Tensor key_cache = kv_cache[0], value_cache = kv_cache[1];
  if (b.all_decode) {
    attention::paged_decode_attention(query, key_cache, value_cache, b.block_tables, b.seq_lens, scale, out, kv.k,
                                      kv.v, kNoWindow, kNoSoftcap);
    return out;
  }
  attention::paged_prefill_attention(query, key_cache, value_cache, b.block_tables, b.query_start_loc, b.seq_lens,
                                     scale, out, kv.k, kv.v, kNoWindow, kNoSoftcap);
  if (b.decode_rows.has_value()) {
    at::Tensor decoded = at::empty({b.decode_rows->size(0), query.size(1), query.size(2)}, query.options());
    attention::paged_decode_attention(query.index_select(0, *b.decode_rows), key_cache, value_cache,
                                      *b.decode_block_tables, *b.decode_seq_lens, scale, decoded, kv.k, kv.v,
                                      kNoWindow, kNoSoftcap);
    out.index_copy_(0, *b.decode_rows, decoded);
  }
  return out;
}

// one of a layer's matmuls (kQKV, kOut, kGateUp, kDown; `which` 0..3 in that order): the bfloat16 matmul, or the
// FP8 one where the layer's weights are FP8 (their scale slot is filled)
at::Tensor layer_linear(const c10::List<OptionalTensor>& tensors, int64_t layer, Slot weight, Slot scale, int which,
                        const at::Tensor& x, int64_t out_features, const OptionalTensor& bias) {
  const OptionalTensor scales = tensors.get(layer * kSlots + scale);
  if (!scales.has_value()) return bf16_matmul::linear(x, required(tensors, layer, weight), out_features, bias, false);
  const at::Tensor block_k = required(tensors, layer, kBlockK);
  TORCH_CHECK(block_k.scalar_type() == at::kLong && block_k.numel() == 4, "llama_layers: block_k must be int64 [4]");
  return fp8_matmul::linear(x, required(tensors, layer, weight), *scales, block_k.data_ptr<int64_t>()[which],
                            out_features, bias);
}

// The adapters of a pass (lora/lora_cpu.cpp adds their deltas): each row's slot grouped once per pass, and per
// layer and projection (qkv, out, gate_up, down) A and B packed as lora_add_ takes them, stacked over slots.
constexpr int kLoraProjections = 4;  // in layer_linear's `which` order
constexpr int kLoraTensorsPerLayer = 2 * kLoraProjections;  // (A, B) per projection

struct Lora {
  const c10::List<OptionalTensor>& tensors;  // kLoraTensorsPerLayer per layer: [slots, packed A], [slots, packed B]
  std::vector<std::vector<int64_t>> sub_sizes;  // per projection: its sub-outputs' sizes (q, k, v; gate, up)
  lora::RowGroups all, kept;  // kept: the last layer's rows past attention (keep_rows)

  bool targets(int64_t layer, int which) const {  // whether an adapter has deltas for this projection
    return tensors.get(layer * kLoraTensorsPerLayer + 2 * which).has_value() &&
           tensors.get(layer * kLoraTensorsPerLayer + 2 * which + 1).has_value();
  }
};

// y [n, out] += each group's delta, in place; x [n, in]
void add_lora(at::Tensor& y, const at::Tensor& x, const Lora& lora, const lora::RowGroups& groups, int64_t layer,
              int which) {
  if (!lora.targets(layer, which)) return;
  lora::add_grouped(y, x, groups, *lora.tensors.get(layer * kLoraTensorsPerLayer + 2 * which),
                    *lora.tensors.get(layer * kLoraTensorsPerLayer + 2 * which + 1), lora.sub_sizes[which]);
}

}  // namespace

std::vector<std::string> layer_slots() { return {std::begin(kSlotNames), std::end(kSlotNames)}; }

std::tuple<at::Tensor, at::Tensor> layers(
    const at::Tensor& hidden_in,  // [T, hidden]
    const OptionalTensor& residual_in,  // [T, hidden], None before the first layer of the model
    const at::Tensor& positions,  // [T] int64
    const c10::List<OptionalTensor>& layer_tensors,  // kSlots per layer, None where a layer has no such tensor
    const at::Tensor& cos_sin_cache,  // [max_positions, head_size] float32
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_tables,
    const at::Tensor& slot_mapping, bool all_decode, const OptionalTensor& decode_rows,
    const OptionalTensor& decode_block_tables, const OptionalTensor& decode_seq_lens,
    const OptionalTensor& keep_rows,  // [K] int64: the rows the last layer outputs (None: all)
    int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t intermediate_size, double eps,
    double scale,
    const OptionalTensor& lora_row_slots,  // [T] int32: each row's adapter slot, -1 for none (None: no adapters)
    const c10::List<OptionalTensor>& lora_tensors) {  // per layer, per projection: A and B, each [slots, packed]
  const Batch batch{query_start_loc, seq_lens, block_tables, all_decode, decode_rows,
                    decode_block_tables, decode_seq_lens};
  TORCH_CHECK(layer_tensors.size() % kSlots == 0, "llama_layers: ", kSlots, " tensors per layer, got ",
              layer_tensors.size(), " in all");
  const int64_t num_layers = static_cast<int64_t>(layer_tensors.size()) / kSlots;
  const int64_t rows = hidden_in.size(0), hidden_size = hidden_in.size(1);
  const int64_t q_size = num_heads * head_size, kv_size = num_kv_heads * head_size;
  const auto optional = [&](int64_t layer, Slot slot) { return layer_tensors.get(layer * kSlots + slot); };
  std::optional<Lora> lora;
  if (lora_row_slots.has_value()) {
    TORCH_CHECK(lora_row_slots->numel() == rows, "llama_layers: lora_row_slots has ", lora_row_slots->numel(),
                " rows, hidden ", rows);
    TORCH_CHECK(static_cast<int64_t>(lora_tensors.size()) == num_layers * kLoraTensorsPerLayer,
                "llama_layers: ", kLoraTensorsPerLayer, " LoRA tensors per layer, got ", lora_tensors.size());
    // each projection's sub-outputs: q, k, v; o; gate, up; down
    const std::vector<std::vector<int64_t>> sub_sizes = {
        {q_size, kv_size, kv_size}, {hidden_size}, {intermediate_size, intermediate_size}, {hidden_size}};
    lora.emplace(Lora{lora_tensors, sub_sizes, lora::group_rows(*lora_row_slots), {}});
    if (keep_rows.has_value()) lora->kept = lora::group_rows(lora_row_slots->index_select(0, *keep_rows));
  }
  // the projection's output plus the adapters' deltas for its rows (the kept ones past the last attention)
  const auto add_deltas = [&](at::Tensor& y, const at::Tensor& x, int64_t layer, int which, bool kept) {
    if (lora.has_value()) add_lora(y, x, *lora, kept ? lora->kept : lora->all, layer, which);
  };

  at::Tensor hidden = hidden_in;
  OptionalTensor residual = residual_in;
  for (int64_t i = 0; i < num_layers; ++i) {
    // input norm, with the previous layer's residual add
    if (residual.has_value()) {
      std::tie(hidden, residual) =
          fused::fused_add_rms_norm(hidden, *residual, required(layer_tensors, i, kInputNorm), eps);
    } else {
      residual = hidden;
      hidden = fused::rms_norm(hidden, required(layer_tensors, i, kInputNorm), eps);
    }
    // attention
    at::Tensor qkv = layer_linear(layer_tensors, i, kQKV, kQKVScale, 0, hidden, q_size + 2 * kv_size,
                                  optional(i, kQKVBias));  // [T, q + 2 kv]
    add_deltas(qkv, hidden, i, 0, false);
    // views into qkv: the kernels take rows at any stride (the Python layers copy them: torch's rotary
    // needs contiguous rows; the values are the same)
    at::Tensor q = qkv.narrow(1, 0, q_size), key = qkv.narrow(1, q_size, kv_size);
    const at::Tensor value = qkv.narrow(1, q_size + kv_size, kv_size);
    if (const OptionalTensor q_norm = optional(i, kQNorm); q_norm.has_value()) {  // Qwen3: per-head norms
      q = fused::rms_norm(q.reshape({-1, head_size}), *q_norm, eps).view({-1, q_size});
      key = fused::rms_norm(key.reshape({-1, head_size}), required(layer_tensors, i, kKNorm), eps).view({-1, kv_size});
    }
    fused::apply_rotary_(positions, q, key, cos_sin_cache, head_size);  // in place
    at::Tensor kv_cache = required(layer_tensors, i, kKVCache);  // [2, blocks, block_size, Hkv, D]
    const OptionalTensor scales = optional(i, kKVScales);
    const KvScales kv = kv_scales(scales);
    const at::Tensor key_rows = key.view({rows, num_kv_heads, head_size});
    const at::Tensor value_rows = value.view({rows, num_kv_heads, head_size});
    if (scales.has_value()) {
      attention::write_kv_cache_fp8(key_rows, value_rows, kv_cache, slot_mapping, kv.k, kv.v);
    } else {
      fused::write_kv_cache(key_rows, value_rows, kv_cache, slot_mapping);
    }
    at::Tensor attended = paged_attention(q.view({rows, num_heads, head_size}), kv_cache, batch, scale, kv).flatten(1);
    const bool kept = i == num_layers - 1 && keep_rows.has_value();
    if (kept) {  // past attention, rows nobody reads are dropped
      attended = attended.index_select(0, *keep_rows);
      residual = residual->index_select(0, *keep_rows);
    }
    at::Tensor out = layer_linear(layer_tensors, i, kOut, kOutScale, 1, attended, hidden_size, std::nullopt);
    add_deltas(out, attended, i, 1, kept);  // before the bias, as RowParallelLinear adds them
    if (const OptionalTensor bias = optional(i, kOutBias); bias.has_value()) out = out + *bias;
    // MLP, after the post-attention norm with the residual add
    std::tie(hidden, residual) =
        fused::fused_add_rms_norm(out, *residual, required(layer_tensors, i, kPostNorm), eps);
    at::Tensor activated;  // [T, I]
    if (!optional(i, kGateUpScale).has_value() && !(lora.has_value() && lora->targets(i, 2))) {
      activated = bf16_matmul::linear_silu_and_mul(hidden, required(layer_tensors, i, kGateUp), intermediate_size);
    } else {  // FP8 weights or an adapter's deltas: the gate/up product first
      at::Tensor gate_up = layer_linear(layer_tensors, i, kGateUp, kGateUpScale, 2, hidden,
                                        2 * intermediate_size, std::nullopt);  // [T, 2 I]
      add_deltas(gate_up, hidden, i, 2, kept);
      activated = fused::silu_and_mul(gate_up);
    }
    hidden = layer_linear(layer_tensors, i, kDown, kDownScale, 3, activated, hidden_size, std::nullopt);
    add_deltas(hidden, activated, i, 3, kept);
  }
  TORCH_CHECK(residual.has_value(), "llama_layers: no layers given");
  return {hidden, *residual};
}

}  // namespace pagoda::llama
