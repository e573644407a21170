// The library's registration: every op of csrc/ops.h as torch.ops.pagoda_cpu.<name>, in one namespace. An op
// with a tensor argument is the CPU backend's; one without (isa_level, llama_layer_slots, shm_unlink) is a
// catch-all. The shared-memory TP collectives (csrc/shm_group.h) are a class, torch.classes.pagoda_cpu.ShmGroup.

#include <torch/library.h>

#include "ops.h"
#include "shm_group.h"

TORCH_LIBRARY(pagoda_cpu, m) {
  using namespace pagoda;
  m.def(attention::kPagedDecodeAttentionSchema);
  m.def(attention::kPagedPrefillAttentionSchema);
  m.def(attention::kWriteKvCacheFp8Schema);
  m.def(fused::kRmsNormSchema);
  m.def(fused::kFusedAddRmsNormSchema);
  m.def(fused::kApplyRotarySchema);
  m.def(fused::kSiluAndMulSchema);
  m.def(fused::kWriteKvCacheSchema);
  m.def(fused::kArgmaxRowsSchema);
  m.def(sample::kSampleCategoricalSchema);
  m.def(bf16_matmul::kLinearSchema);
  m.def(bf16_matmul::kLinearSiluAndMulSchema);
  m.def(bf16_matmul::kIsaLevelSchema, &bf16_matmul::isa_level);
  m.def(bf16_matmul::kUsesAmxSchema, &bf16_matmul::uses_amx);
  m.def(fp8_matmul::kLinearSchema);
  m.def(fp8_matmul::kPackSchema);
  m.def(fp8_matmul::kUnpackSchema);
  m.def(lora::kAddSchema);
  m.def(llama::kLayersSchema);
  m.def(llama::kLayerSlotsSchema, &llama::layer_slots);
  m.def(shm::kUnlinkSchema, &shm::unlink);
  m.class_<shm::ShmGroup>("ShmGroup")
      .def(torch::init<std::string, int64_t, int64_t, int64_t, bool, std::vector<int64_t>, double>())
      .def("all_reduce", &shm::ShmGroup::all_reduce)
      .def("all_gather", &shm::ShmGroup::all_gather)
      .def("abort", &shm::ShmGroup::abort)
      .def("close", &shm::ShmGroup::close)
      .def_property("slot_bytes", &shm::ShmGroup::slot_bytes)
      .def_property("name", &shm::ShmGroup::name);
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) {
  using namespace pagoda;
  m.impl("paged_decode_attention", &attention::paged_decode_attention);
  m.impl("paged_prefill_attention", &attention::paged_prefill_attention);
  m.impl("write_kv_cache_fp8", &attention::write_kv_cache_fp8);
  m.impl("rms_norm", &fused::rms_norm);
  m.impl("fused_add_rms_norm", &fused::fused_add_rms_norm);
  m.impl("apply_rotary_", &fused::apply_rotary_);
  m.impl("silu_and_mul", &fused::silu_and_mul);
  m.impl("write_kv_cache", &fused::write_kv_cache);
  m.impl("argmax_rows", &fused::argmax_rows);
  m.impl("sample_categorical", &sample::sample_categorical);
  m.impl("bf16_linear", &bf16_matmul::linear);
  m.impl("bf16_linear_silu_and_mul", &bf16_matmul::linear_silu_and_mul);
  m.impl("fp8_linear", &fp8_matmul::linear);
  m.impl("fp8_pack", &fp8_matmul::pack);
  m.impl("fp8_unpack", &fp8_matmul::unpack);
  m.impl("lora_add_", &lora::add_);
  m.impl("llama_layers", &llama::layers);
}
