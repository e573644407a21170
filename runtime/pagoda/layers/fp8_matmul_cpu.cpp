// FP8 weight-only matmul y = x (W * scales)^T (+ bias) on the CPU, for bfloat16 activations, on a weight packed
// once (fp8_matmul_cpu.py) into bf16_matmul's layout at one byte a weight; the micro-kernels are in
// csrc/fp8_matmul.h. The weight is widened in registers, never to a dequantised copy: a decode step reads one
// byte a weight instead of the torch path's upcast, write and re-read of every weight.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <vector>

#include "cpu_isa.h"
#include "fp8_matmul.h"
#include "ops.h"
#include "parallel_tasks.h"

namespace pagoda::fp8_matmul {

using bf16 = c10::BFloat16;
constexpr int64_t kRowsPerTask = 64;  // rows of x one task runs against a block (its weights stay in L2)

// x [..., K] bfloat16; packed [ceil(N/32), K/2, 32, 2] float8_e4m3fn; scales [N, G] float32, one per output row and
// block of block_k inputs (G = ceil(K / block_k)); -> [..., out_features] bfloat16
at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, const at::Tensor& scales, int64_t block_k,
                  int64_t out_features, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.device().is_cpu() && input.scalar_type() == at::kBFloat16 && input.dim() >= 1,
              "fp8_linear: x must be a bfloat16 CPU tensor");
  at::Tensor x = input.reshape({-1, input.size(-1)});
  if (x.stride(1) != 1 || x.stride(0) % 2 != 0) x = x.contiguous();  // rows read as pairs of elements
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kFloat8_e4m3fn &&
                  packed.size(2) == kBlockN && packed.size(3) == 2,
              "fp8_linear: packed must be [N/32, K/2, 32, 2] float8_e4m3fn, got ", packed.sizes(), " ",
              packed.scalar_type());
  const int64_t rows = x.size(0), k_pairs = packed.size(1), blocks = packed.size(0), k = 2 * k_pairs;
  TORCH_CHECK(x.size(1) == k, "fp8_linear: x has ", x.size(1), " columns, the weight ", k);
  TORCH_CHECK(out_features > (blocks - 1) * kBlockN && out_features <= blocks * kBlockN,
              "fp8_linear: out_features ", out_features, " does not match the packed weight ", packed.sizes());
  TORCH_CHECK(block_k > 0 && block_k % 2 == 0, "fp8_linear: block_k must be a positive even number, got ", block_k);
  const int64_t groups = (k + block_k - 1) / block_k;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == out_features && scales.size(1) == groups,
              "fp8_linear: scales must be [", out_features, ", ", groups, "] float32, got ", scales.sizes());
  const bf16* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == out_features,
                "fp8_linear: bias must be [out_features] bfloat16");
    bias_data = bias->data_ptr<bf16>();
  }
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = out_features;
  at::Tensor y = x.new_empty(out_shape);
  const bf16* x_data = x.data_ptr<bf16>();
  const auto* w_data = static_cast<const uint8_t*>(packed.data_ptr());
  const float* s_data = scales.data_ptr<float>();
  bf16* y_data = y.data_ptr<bf16>();
  const int64_t ldx = x.stride(0), row_tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  // blocks vary fastest, so at decode's few rows the threads stream the weight front to back together
  pagoda::parallel_tasks(blocks * row_tasks, [&](int64_t task) {
    const int64_t b = task % blocks, m0 = (task / blocks) * kRowsPerTask, n0 = b * kBlockN;
    const BlockTask t{x_data + m0 * ldx, ldx, std::min(kRowsPerTask, rows - m0), w_data + b * k_pairs * 2 * kBlockN,
                      k_pairs, s_data + n0 * groups, groups, block_k / 2, y_data + m0 * out_features + n0,
                      out_features, std::min(kBlockN, out_features - n0), bias_data ? bias_data + n0 : nullptr};
    rows_against_block(t);
  });
  return y;
}

// [N, K] float8_e4m3fn -> [ceil(N/32), K/2, 32, 2]: per block of 32 outputs and pair of inputs, one 64-byte line
// of the 32 outputs' two weights (rows past N: 0), in the order this build's kernel reads (stored_position)
at::Tensor pack(const at::Tensor& qweight) {
  TORCH_CHECK(qweight.device().is_cpu() && qweight.dim() == 2 && qweight.scalar_type() == at::kFloat8_e4m3fn &&
                  qweight.size(1) % 2 == 0,
              "fp8 pack: the weight must be [N, K] float8_e4m3fn with K even, got ", qweight.sizes(), " ",
              qweight.scalar_type());
  const at::Tensor w = qweight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), blocks = (n + kBlockN - 1) / kBlockN;
  at::Tensor packed = w.new_zeros({blocks, k / 2, kBlockN, 2});
  const auto* src = static_cast<const uint8_t*>(w.data_ptr());
  auto* dst = static_cast<uint8_t*>(packed.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b)
      for (int64_t pair = 0; pair < k / 2; ++pair) {
        uint8_t* line = dst + (b * (k / 2) + pair) * 2 * kBlockN;
        for (int64_t i = 0; i < 2 * kBlockN; ++i) {
          const int64_t row = b * kBlockN + i / 2;
          if (row < n) line[stored_position(i)] = src[row * k + 2 * pair + i % 2];
        }
      }
  });
  return packed;
}

// pack's inverse: [N, K]
at::Tensor unpack(const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kFloat8_e4m3fn &&
                  packed.size(2) == kBlockN && packed.size(3) == 2 && out_features <= packed.size(0) * kBlockN,
              "fp8 unpack: packed must be [N/32, K/2, 32, 2] float8_e4m3fn, got ", packed.sizes());
  const int64_t k_pairs = packed.size(1);
  at::Tensor w = packed.new_empty({out_features, 2 * k_pairs});
  const auto* src = static_cast<const uint8_t*>(packed.data_ptr());
  auto* dst = static_cast<uint8_t*>(w.data_ptr());
  for (int64_t row = 0; row < out_features; ++row)
    for (int64_t pair = 0; pair < k_pairs; ++pair)
      for (int64_t parity = 0; parity < 2; ++parity) {
        const int64_t b = row / kBlockN, i = 2 * (row % kBlockN) + parity;
        dst[row * 2 * k_pairs + 2 * pair + parity] =
            src[(b * k_pairs + pair) * 2 * kBlockN + stored_position(i)];
      }
  return w;
}

}  // namespace pagoda::fp8_matmul
