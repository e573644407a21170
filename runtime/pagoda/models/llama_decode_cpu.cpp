// A decode step's pass through a stack of Llama decoder layers, in one call from Python.
//
// A batch-1 decode step of the default model is ~10 ms of kernels and, before this, ~3 ms of Python
// between them: ~10 op calls per layer, each a module call, attribute lookups and a dispatch. This loop
// makes the same calls, to the same kernels (through the dispatcher: each kernel stays in its own
// library), in the order of models/llama.py, so the result is bit for bit the Python path's.
//
// Scope (llama_decode_cpu.py checks it): every row a decode (one query row per sequence), bfloat16
// weights packed for bf16_matmul_cpu, one tensor-parallel rank, the C++ attention and fused kernels.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

namespace {

using OptionalTensor = std::optional<at::Tensor>;

struct Kernels {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptionalTensor&)> linear;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double)> rms_norm;
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                             const at::Tensor&, double)>
      fused_add_rms_norm;
  c10::TypedOperatorHandle<void(const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&, int64_t)>
      apply_rotary_;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_and_mul;
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, at::Tensor, const at::Tensor&)>
      write_kv_cache;
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, double, at::Tensor)>
      paged_decode_attention;
};

template <typename Signature>
c10::TypedOperatorHandle<Signature> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// looked up on first use: the kernels' libraries are loaded by then (llama_decode_cpu.py loads them first)
const Kernels& kernels() {
  static const Kernels k{
      find<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptionalTensor&)>(
          "pagoda_bf16_matmul::linear"),
      find<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("pagoda_cpu_fused::rms_norm"),
      find<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
          "pagoda_cpu_fused::fused_add_rms_norm"),
      find<void(const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&, int64_t)>(
          "pagoda_cpu_fused::apply_rotary_"),
      find<at::Tensor(const at::Tensor&)>("pagoda_cpu_fused::silu_and_mul"),
      find<void(const at::Tensor&, const at::Tensor&, at::Tensor, const at::Tensor&)>(
          "pagoda_cpu_fused::write_kv_cache"),
      find<void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                double, at::Tensor)>("pagoda_cpu::paged_decode_attention"),
  };
  return k;
}

// A layer's tensors in layer_tensors, kSlots per layer (llama_decode_cpu.py's LAYER_SLOTS, same order).
enum Slot {
  kInputNorm, kQKV, kQKVBias, kQNorm, kKNorm, kOut, kOutBias, kPostNorm, kGateUp, kDown, kKVCache, kSlots
};

at::Tensor required(const c10::List<OptionalTensor>& tensors, int64_t layer, Slot slot) {
  OptionalTensor t = tensors.get(layer * kSlots + slot);
  TORCH_CHECK(t.has_value(), "llama_decode_layers: layer ", layer, " has no tensor in slot ", int(slot));
  return *std::move(t);
}

std::tuple<at::Tensor, at::Tensor> llama_decode_layers(
    const at::Tensor& hidden_in,  // [B, hidden]: one row per sequence
    const OptionalTensor& residual_in,  // [B, hidden], None before the first layer of the model
    const at::Tensor& positions,  // [B] int64
    const c10::List<OptionalTensor>& layer_tensors,  // kSlots per layer, None where a layer has no such tensor
    const at::Tensor& cos_sin_cache,  // [max_positions, head_size] float32
    const at::Tensor& block_tables,  // [B, max_blocks] int32
    const at::Tensor& seq_lens,  // [B] int32
    const at::Tensor& slot_mapping,  // [B] int64
    int64_t num_heads, int64_t num_kv_heads, int64_t head_size, int64_t intermediate_size, double eps,
    double scale) {
  TORCH_CHECK(layer_tensors.size() % kSlots == 0, "llama_decode_layers: ", kSlots, " tensors per layer, got ",
              layer_tensors.size(), " in all");
  const Kernels& k = kernels();
  const int64_t num_layers = static_cast<int64_t>(layer_tensors.size()) / kSlots;
  const int64_t rows = hidden_in.size(0), hidden_size = hidden_in.size(1);
  const int64_t q_size = num_heads * head_size, kv_size = num_kv_heads * head_size;
  const auto optional = [&](int64_t layer, Slot slot) { return layer_tensors.get(layer * kSlots + slot); };

  at::Tensor hidden = hidden_in;
  OptionalTensor residual = residual_in;
  for (int64_t i = 0; i < num_layers; ++i) {
    // input norm, with the previous layer's residual add
    if (residual.has_value()) {
      std::tie(hidden, residual) = k.fused_add_rms_norm.call(hidden, *residual, required(layer_tensors, i, kInputNorm), eps);
    } else {
      residual = hidden;
      hidden = k.rms_norm.call(hidden, required(layer_tensors, i, kInputNorm), eps);
    }
    // attention
    const at::Tensor qkv = k.linear.call(hidden, required(layer_tensors, i, kQKV), q_size + 2 * kv_size,
                                         optional(i, kQKVBias));  // [B, q + 2 kv]
    at::Tensor q = qkv.narrow(1, 0, q_size), key = qkv.narrow(1, q_size, kv_size);
    const at::Tensor value = qkv.narrow(1, q_size + kv_size, kv_size).contiguous();
    if (const OptionalTensor q_norm = optional(i, kQNorm); q_norm.has_value()) {  // Qwen3: per-head norms
      q = k.rms_norm.call(q.reshape({-1, head_size}), *q_norm, eps).view({-1, q_size});
      key = k.rms_norm.call(key.reshape({-1, head_size}), required(layer_tensors, i, kKNorm), eps).view({-1, kv_size});
    }
    q = q.contiguous();
    key = key.contiguous();
    k.apply_rotary_.call(positions, q, key, cos_sin_cache, head_size);
    at::Tensor kv_cache = required(layer_tensors, i, kKVCache);  // [2, blocks, block_size, Hkv, D]
    k.write_kv_cache.call(key.view({rows, num_kv_heads, head_size}), value.view({rows, num_kv_heads, head_size}),
                          kv_cache, slot_mapping);
    const at::Tensor query = q.view({rows, num_heads, head_size});
    at::Tensor attended = at::empty_like(query);  // [B, Hq, D]
    k.paged_decode_attention.call(query, kv_cache[0], kv_cache[1], block_tables, seq_lens, scale, attended);
    at::Tensor out = k.linear.call(attended.flatten(1), required(layer_tensors, i, kOut), hidden_size, std::nullopt);
    if (const OptionalTensor bias = optional(i, kOutBias); bias.has_value()) out = out + *bias;
    // MLP, after the post-attention norm with the residual add
    std::tie(hidden, residual) = k.fused_add_rms_norm.call(out, *residual, required(layer_tensors, i, kPostNorm), eps);
    const at::Tensor gate_up = k.linear.call(hidden, required(layer_tensors, i, kGateUp), 2 * intermediate_size,
                                             std::nullopt);  // [B, 2 I]
    hidden = k.linear.call(k.silu_and_mul.call(gate_up), required(layer_tensors, i, kDown), hidden_size, std::nullopt);
  }
  TORCH_CHECK(residual.has_value(), "llama_decode_layers: no layers given");
  return {hidden, *residual};
}

}  // namespace

TORCH_LIBRARY(pagoda_llama_cpu, m) {
  m.def("decode_layers(Tensor hidden, Tensor? residual, Tensor positions, Tensor?[] layer_tensors, "
        "Tensor cos_sin_cache, Tensor block_tables, Tensor seq_lens, Tensor slot_mapping, int num_heads, "
        "int num_kv_heads, int head_size, int intermediate_size, float eps, float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagoda_llama_cpu, CPU, m) { m.impl("decode_layers", &llama_decode_layers); }
