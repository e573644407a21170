// bfloat16-weight matmul y = x W^T (+ bias) on the CPU, for every batch size, on a weight packed once
// (bf16_matmul_cpu.py) into the layout of csrc/bf16_matmul_common.h. The micro-kernel is the ISA level's:
// AVX512_BF16's `vdpbf16ps` (bf16_matmul_avx512bf16.h), AVX2/AVX-512 FMAs on weights widened to float32 in
// registers (bf16_matmul_avx2.h), their aarch64 counterparts (ARM BF16's BFMMLA/BFDOT in
// bf16_matmul_neonbf16.h, NEON FMLAs on widened weights in bf16_matmul_neon.h), or plain C++
// (bf16_matmul_generic.h); sums are float32 in every one.
//
// Why our own: at decode's few rows a step is bound by reading the weights, and oneDNN's packed layout
// streams them at about 10 GB/s per core against the 20 GB/s a plain sequential read gets, so a batch-1
// step spent 90 % of its time in matmuls. Here a thread reads the weight in long sequential runs (2x
// oneDNN at 1-8 rows); at large batches the same micro-kernel is compute bound and on par. Without bfloat16
// instructions (AVX2) the weights still stream as bfloat16: half the bytes of float32 weights.

#include <ATen/core/Tensor.h>

#include <vector>

#include "bf16_matmul_amx.h"
#include "bf16_matmul_isa.h"
#include "ops.h"
#include "parallel_tasks.h"

namespace pagoda::bf16_matmul {  // the ops are declared in csrc/ops.h

constexpr int64_t kRowsPerTask = 64;  // rows of x one task runs against a block (its weights stay in L2)
// AMX: rows of x one task runs against a block (a panel), the tasks blocks first, so that the panel stays in
// L2 while the weight streams past it once (256 rows of x: 288 KB at K = 576, 768 KB at 1536; L2 is 2 MB on
// Sapphire Rapids). Rows first, every block read all of x again from L3: a 1,500-token prompt's x of 1.7 MB
// 48 times a matmul of 1,536 outputs. Measured on two cores: that prompt's prefill 395 -> 326 ms; panels of 128
// or 512 rows were slower (364, 342 ms). While there are fewer tasks than 4 a thread, 64 rows.
constexpr int64_t kAmxRowsPerTask = 256;

std::string isa_level() { return kIsaLevel; }  // no tensor: one kernel for every backend

bool uses_amx() {
#if defined(PAGODA_HAVE_AMX)
  return amx::usable();
#else
  return false;
#endif
}

#if defined(PAGODA_HAVE_AMX)
// rows of x (>= amx::kMinRows) on AMX tiles, into y (bfloat16 or float32), tasks as linear's below
static void linear_amx(const at::Tensor& x, int64_t rows, const at::Tensor& packed, int64_t out_features,
                       const bf16* bias, at::Tensor& y) {
  const bf16* x_data = x.data_ptr<bf16>();
  const bf16* w_data = packed.data_ptr<bf16>();
  const int64_t ldx = x.stride(0), k_pairs = packed.size(1), blocks = packed.size(0);
  const int64_t threads = at::get_num_threads();
  int64_t rows_per_task = kAmxRowsPerTask;
  if (blocks * ((rows + rows_per_task - 1) / rows_per_task) < 4 * threads) rows_per_task = kRowsPerTask;
  const int64_t row_tasks = (rows + rows_per_task - 1) / rows_per_task;
  auto run = [&](auto* y_data) {
    // blocks vary fastest (kAmxRowsPerTask)
    pagoda::parallel_tasks(blocks * row_tasks, [&](int64_t task) {
      const int64_t b = task % blocks, m0 = (task / blocks) * rows_per_task, n0 = b * kBlockN;
      const BlockTask t{x_data + m0 * ldx, nullptr, ldx, 0, std::min(rows_per_task, rows - m0),
                        w_data + b * k_pairs * 2 * kBlockN, k_pairs, out_features,
                        std::min(kBlockN, out_features - n0), bias ? bias + n0 : nullptr};
      amx::rows_against_block(t, y_data + m0 * out_features + n0);
    });
  };
  if (y.scalar_type() == at::kFloat) {
    run(y.data_ptr<float>());
  } else {
    run(y.data_ptr<bf16>());
  }
}
#endif

// x [..., K] -> [..., out_features], bfloat16, or float32 with float32_out (logits: not rounded to 8 bits)
at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, int64_t out_features,
                  const std::optional<at::Tensor>& bias, bool float32_out) {
  TORCH_CHECK(input.device().is_cpu() && input.scalar_type() == at::kBFloat16 && input.dim() >= 1,
              "bf16_linear: x must be a bfloat16 CPU tensor");
  at::Tensor x = input.reshape({-1, input.size(-1)});
  if (x.stride(1) != 1 || x.stride(0) % 2 != 0) x = x.contiguous();  // rows read as pairs of elements
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(2) == kBlockN && packed.size(3) == 2,
              "bf16_linear: packed must be [N/32, K/2, 32, 2] bfloat16, got ", packed.sizes());
  const int64_t rows = x.size(0), k_pairs = packed.size(1), blocks = packed.size(0);
  TORCH_CHECK(x.size(1) == 2 * k_pairs, "bf16_linear: x has ", x.size(1), " columns, the weight ", 2 * k_pairs);
  TORCH_CHECK(out_features > (blocks - 1) * kBlockN && out_features <= blocks * kBlockN,
              "bf16_linear: out_features ", out_features, " does not match the packed weight ", packed.sizes());
  const bf16* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == out_features,
                "bf16_linear: bias must be [out_features] bfloat16");
    bias_data = bias->data_ptr<bf16>();
  }
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = out_features;
  auto y = x.new_empty(out_shape, x.options().dtype(float32_out ? at::kFloat : at::kBFloat16));
#if defined(PAGODA_HAVE_AMX)
  if (rows >= amx::kMinRows && k_pairs % amx::kTileKPairs == 0 && amx::usable()) {
    linear_amx(x, rows, packed, out_features, bias_data, y);
    return y;
  }
#endif
  // AVX2's and NEON's prefill kernels are float32 ones: x widened once here, not in every task (in panels of
  // kXPanelRows rows where the ISA's kernel reads them so)
  const bf16* x_data = x.data_ptr<bf16>();
  const int64_t ldx = x.stride(0), k = x.size(1);
  constexpr int64_t kPanelRows = isa::kXPanelRows;
  constexpr int64_t kPanelStep = std::max<int64_t>(kPanelRows, 1);  // no division by 0 where there are no panels
  const bool float_x = isa::kWantsFloatX && rows >= isa::kFloatXRows;
  const bool panels = kPanelRows > 0 && float_x;
  at::Tensor x_float;
  if (panels) {
    const int64_t num_panels = (rows + kPanelRows - 1) / kPanelStep;
    x_float = x.new_empty({num_panels * kPanelRows * k}, x.options().dtype(at::kFloat));
    float* out = x_float.data_ptr<float>();
    pagoda::parallel_tasks(num_panels, [&](int64_t p) {
      const int64_t m0 = p * kPanelRows;
      pack_x_panel<kPanelRows>(x_data + m0 * ldx, ldx, std::min(kPanelRows, rows - m0), k, out + m0 * k);
    });
  } else if (float_x) {
    x_float = x.to(at::kFloat).contiguous();
  }
  const float* xf_data = x_float.defined() ? x_float.data_ptr<float>() : nullptr;
  const bf16* w_data = packed.data_ptr<bf16>();
  // panels: the row group at row m starts m * k floats in, so a task starts on a panel
  const int64_t ldx_float = !x_float.defined() ? 0 : panels ? k : x_float.stride(0);
  const int64_t rows_per_task = panels ? kRowsPerTask / kPanelStep * kPanelStep : kRowsPerTask;
  const int64_t row_tasks = (rows + rows_per_task - 1) / rows_per_task;
  auto run = [&](auto* y_data) {
    // blocks vary fastest, so at decode's few rows the threads stream the weight front to back together
    pagoda::parallel_tasks(blocks * row_tasks, [&](int64_t task) {
      const int64_t b = task % blocks, m0 = (task / blocks) * rows_per_task;
      const int64_t n0 = b * kBlockN;
      const BlockTask t{x_data + m0 * ldx, xf_data ? xf_data + m0 * ldx_float : nullptr, ldx, ldx_float,
                        std::min(rows_per_task, rows - m0), w_data + b * k_pairs * 2 * kBlockN, k_pairs,
                        out_features, std::min(kBlockN, out_features - n0), bias_data ? bias_data + n0 : nullptr,
                        panels};
      isa::rows_against_block(t, y_data + m0 * out_features + n0);
    });
  };
  if (float32_out) {
    run(y.data_ptr<float>());
  } else {
    run(y.data_ptr<bf16>());
  }
  return y;
}

}  // namespace pagoda::bf16_matmul
