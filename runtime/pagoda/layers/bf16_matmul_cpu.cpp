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
#include "silu_and_mul_row.h"

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

// How a call's tasks run rows of x against blocks: AMX tiles (3 rows and more where the CPU has them) or the
// ISA level's micro-kernel, on x as given or widened to float32 once (AVX2's and NEON's prefill kernels are
// float32 ones: widened here, not in every task, in panels of kXPanelRows rows where the kernel reads them so)
class RowTasks {
 public:
  // x [rows, K] (rows pairs of elements apart); `blocks`: the blocks a row task runs, for the task size
  RowTasks(const at::Tensor& x, int64_t k_pairs, int64_t blocks)
      : x_(x.data_ptr<bf16>()), ldx_(x.stride(0)), rows_(x.size(0)) {
    const int64_t rows = rows_;
#if defined(PAGODA_HAVE_AMX)
    amx_ = rows >= amx::kMinRows && k_pairs % amx::kTileKPairs == 0 && amx::usable();
    if (amx_) {
      rows_per_task_ = kAmxRowsPerTask;
      if (blocks * ((rows + kAmxRowsPerTask - 1) / kAmxRowsPerTask) < 4 * at::get_num_threads())
        rows_per_task_ = kRowsPerTask;
      return;
    }
#endif
    constexpr int64_t kPanelRows = isa::kXPanelRows;
    constexpr int64_t kPanelStep = std::max<int64_t>(kPanelRows, 1);  // no division by 0 where there are none
    const int64_t k = 2 * k_pairs;
    const bool float_x = isa::kWantsFloatX && rows >= isa::kFloatXRows;
    panels_ = kPanelRows > 0 && float_x;
    if (panels_) {
      const int64_t num_panels = (rows + kPanelRows - 1) / kPanelStep;
      x_float_ = x.new_empty({num_panels * kPanelRows * k}, x.options().dtype(at::kFloat));
      float* out = x_float_.data_ptr<float>();
      pagoda::parallel_tasks(num_panels, [&](int64_t p) {
        const int64_t m0 = p * kPanelRows;
        pack_x_panel<kPanelRows>(x_ + m0 * ldx_, ldx_, std::min(kPanelRows, rows - m0), k, out + m0 * k);
      });
    } else if (float_x) {
      x_float_ = x.to(at::kFloat).contiguous();
    }
    // panels: the row group at row m starts m * k floats in, so a task starts on a panel
    ldx_float_ = !x_float_.defined() ? 0 : panels_ ? k : x_float_.stride(0);
    rows_per_task_ = panels_ ? kRowsPerTask / kPanelStep * kPanelStep : kRowsPerTask;
  }

  int64_t row_tasks() const { return (rows_ + rows_per_task_ - 1) / rows_per_task_; }
  int64_t first_row(int64_t row_task) const { return row_task * rows_per_task_; }
  int64_t rows_of(int64_t row_task) const { return std::min(rows_per_task_, rows_ - first_row(row_task)); }

  // row task m's rows against block b of `packed` into y (its first row and the block's first column), rows
  // ldy apart; ncols of the block's columns exist
  template <typename OutT>
  void run(int64_t row_task, const at::Tensor& packed, int64_t b, int64_t ncols, const bf16* bias, OutT* y,
           int64_t ldy) const {
    const int64_t m0 = first_row(row_task), k_pairs = packed.size(1);
    const BlockTask t{x_ + m0 * ldx_, x_float_.defined() ? x_float_.data_ptr<float>() + m0 * ldx_float_ : nullptr,
                      ldx_, ldx_float_, rows_of(row_task),
                      packed.data_ptr<bf16>() + b * k_pairs * 2 * kBlockN, k_pairs, ldy, ncols, bias, panels_};
#if defined(PAGODA_HAVE_AMX)
    if (amx_) return amx::rows_against_block(t, y);
#endif
    isa::rows_against_block(t, y);
  }

 private:
  const bf16* x_;
  int64_t ldx_, rows_, rows_per_task_ = kRowsPerTask, ldx_float_ = 0;
  at::Tensor x_float_;
  bool panels_ = false, amx_ = false;
};

// x as [rows, K] with rows read as pairs of elements; the packed weight checked against it and out_features
static at::Tensor checked_rows(const at::Tensor& input, const at::Tensor& packed, int64_t out_features,
                               const char* op) {
  TORCH_CHECK(input.device().is_cpu() && input.scalar_type() == at::kBFloat16 && input.dim() >= 1, op,
              ": x must be a bfloat16 CPU tensor");
  at::Tensor x = input.reshape({-1, input.size(-1)});
  if (x.stride(1) != 1 || x.stride(0) % 2 != 0) x = x.contiguous();
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(2) == kBlockN && packed.size(3) == 2,
              op, ": packed must be [N/32, K/2, 32, 2] bfloat16, got ", packed.sizes());
  const int64_t k_pairs = packed.size(1), blocks = packed.size(0);
  TORCH_CHECK(x.size(1) == 2 * k_pairs, op, ": x has ", x.size(1), " columns, the weight ", 2 * k_pairs);
  TORCH_CHECK(out_features > (blocks - 1) * kBlockN && out_features <= blocks * kBlockN, op, ": out_features ",
              out_features, " does not match the packed weight ", packed.sizes());
  return x;
}

// x [..., K] -> [..., out_features], bfloat16, or float32 with float32_out (logits: not rounded to 8 bits)
at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, int64_t out_features,
                  const std::optional<at::Tensor>& bias, bool float32_out) {
  const at::Tensor x = checked_rows(input, packed, out_features, "bf16_linear");
  const bf16* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == out_features,
                "bf16_linear: bias must be [out_features] bfloat16");
    bias_data = bias->data_ptr<bf16>();
  }
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = out_features;
  auto y = x.new_empty(out_shape, x.options().dtype(float32_out ? at::kFloat : at::kBFloat16));
  const int64_t blocks = packed.size(0);
  const RowTasks tasks(x, packed.size(1), blocks);
  auto run = [&](auto* y_data) {
    // blocks vary fastest: at decode's few rows the threads stream the weight front to back together; on
    // AMX a task's rows stay in L2 while the weight streams past them (kAmxRowsPerTask)
    pagoda::parallel_tasks(blocks * tasks.row_tasks(), [&](int64_t task) {
      const int64_t b = task % blocks, m = task / blocks, n0 = b * kBlockN;
      tasks.run(m, packed, b, std::min(kBlockN, out_features - n0), bias_data ? bias_data + n0 : nullptr,
                y_data + tasks.first_row(m) * out_features + n0, out_features);
    });
  };
  if (float32_out) {
    run(y.data_ptr<float>());
  } else {
    run(y.data_ptr<bf16>());
  }
  return y;
}

// x [..., K] against the gate and up projections packed as one weight (gate's `intermediate` outputs, then
// up's) -> bf16(silu(gate)) * up, [..., intermediate], the same bits as linear then silu_and_mul. A task
// runs a gate block and its up block into sums of its own and multiplies them there, so the [rows, 2 x
// intermediate] product never goes to memory: at a 1,500-token prompt it is 9 MB a layer, past L2, and
// silu_and_mul read it back from DRAM (7 % of a prefill). Where intermediate is not a whole number of blocks,
// the two ops as they are.
at::Tensor linear_silu_and_mul(const at::Tensor& input, const at::Tensor& packed, int64_t intermediate) {
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = intermediate;
  if (intermediate % kBlockN != 0) {
    const at::Tensor gate_up = linear(input, packed, 2 * intermediate, std::nullopt, false);
    return fused::silu_and_mul(gate_up.reshape({-1, 2 * intermediate})).view(out_shape);
  }
  const at::Tensor x = checked_rows(input, packed, 2 * intermediate, "bf16_linear_silu_and_mul");
  at::Tensor y = x.new_empty(out_shape);
  const int64_t pairs = intermediate / kBlockN;
  const RowTasks tasks(x, packed.size(1), 2 * pairs);
  bf16* y_data = y.data_ptr<bf16>();
  pagoda::parallel_tasks(pairs * tasks.row_tasks(), [&](int64_t task) {
    const int64_t b = task % pairs, m = task / pairs, rows = tasks.rows_of(m);
    thread_local std::vector<bf16> gate, up;  // [rows, 32] each
    gate.resize(rows * kBlockN);
    up.resize(rows * kBlockN);
    tasks.run(m, packed, b, kBlockN, nullptr, gate.data(), kBlockN);
    tasks.run(m, packed, pairs + b, kBlockN, nullptr, up.data(), kBlockN);
    bf16* y_rows = y_data + tasks.first_row(m) * intermediate + b * kBlockN;
    for (int64_t r = 0; r < rows; ++r)
      silu_and_mul_row(gate.data() + r * kBlockN, up.data() + r * kBlockN, y_rows + r * intermediate, kBlockN);
  });
  return y;
}

}  // namespace pagoda::bf16_matmul
