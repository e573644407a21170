// bfloat16 matmul y = x W^T (+ bias) on CPUs with AVX512_BF16, for every batch size, on a weight packed
// once into the layout the `vdpbf16ps` instruction reads.
//
// Why our own: at decode's few rows a step is bound by reading the weights, and oneDNN's packed layout
// streams them at about 10 GB/s per core against the 20 GB/s a plain sequential read gets, so a batch-1
// step spent 90 % of its time in matmuls. Here a thread reads the weight in long sequential runs (2x
// oneDNN at 1-8 rows); at large batches the same micro-kernel is compute bound and on par.
//
// Packed layout (made by bf16_matmul_cpu.py): [ceil(N/32), K/2, 32, 2]. Block b holds output columns
// [32b, 32b+32); within it, for each pair of input columns k, the 32 outputs' two weights side by side:
// exactly one 64-byte vector per 16 outputs per pair, as `vdpbf16ps` multiplies them. Rows past N are 0.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "parallel_tasks.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kBlockN = 32;  // output columns per packed block: two 16-lane fp32 accumulators
constexpr int64_t kRowsPerTask = 64;  // rows of x one task runs against a block (its weights stay in L2)

bool supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)

inline __m512 bias_vector(const bf16* bias, __mmask16 mask) {  // 16 bfloat16 widened to float32
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 float32 sums into y's type: rounded once to bfloat16 (as oneDNN), or kept
inline void store_16(bf16* y, __mmask16 mask, __m512 sums) {
  _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(sums));
}
inline void store_16(float* y, __mmask16 mask, __m512 sums) { _mm512_mask_storeu_ps(y, mask, sums); }

// y[0:MB, 0:ncols] = x[0:MB, :] @ block, summed in float32
template <int MB, typename OutT>
inline void micro_kernel(const bf16* x, int64_t ldx, const bf16* block, int64_t k_pairs, OutT* y, int64_t ldy,
                         int64_t ncols, const bf16* bias) {
  __m512 low[MB], high[MB];  // outputs 0-15 and 16-31 of each row
  for (int m = 0; m < MB; ++m) low[m] = high[m] = _mm512_setzero_ps();
  const int32_t* x_pairs = reinterpret_cast<const int32_t*>(x);  // two bfloat16 inputs per int32
  const int64_t ldx_pairs = ldx / 2;
  for (int64_t k = 0; k < k_pairs; ++k) {
    const __m512bh w_low = (__m512bh)_mm512_loadu_si512(block + k * 64);
    const __m512bh w_high = (__m512bh)_mm512_loadu_si512(block + k * 64 + 32);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xk = (__m512bh)_mm512_set1_epi32(x_pairs[m * ldx_pairs + k]);
      low[m] = _mm512_dpbf16_ps(low[m], xk, w_low);
      high[m] = _mm512_dpbf16_ps(high[m], xk, w_high);
    }
  }
  const __mmask16 mask_low = ncols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1);
  const __mmask16 mask_high =
      ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0 : static_cast<__mmask16>((1u << (ncols - 16)) - 1);
  __m512 bias_low = _mm512_setzero_ps(), bias_high = _mm512_setzero_ps();
  if (bias != nullptr) {
    bias_low = bias_vector(bias, mask_low);
    bias_high = bias_vector(bias + 16, mask_high);
  }
  for (int m = 0; m < MB; ++m) {
    store_16(y + m * ldy, mask_low, _mm512_add_ps(low[m], bias_low));
    store_16(y + m * ldy + 16, mask_high, _mm512_add_ps(high[m], bias_high));
  }
}

// rows of x against one block, 8 at a time (16 accumulators + 2 weight vectors fit the 32 registers)
template <typename OutT>
void rows_against_block(const bf16* x, int64_t ldx, int64_t rows, const bf16* block, int64_t k_pairs, OutT* y,
                        int64_t ldy, int64_t ncols, const bf16* bias) {
  int64_t m = 0;
  for (; m + 8 <= rows; m += 8) micro_kernel<8>(x + m * ldx, ldx, block, k_pairs, y + m * ldy, ldy, ncols, bias);
  x += m * ldx;
  y += m * ldy;
  switch (rows - m) {
    case 7: micro_kernel<7>(x, ldx, block, k_pairs, y, ldy, ncols, bias); break;
    case 6: micro_kernel<6>(x, ldx, block, k_pairs, y, ldy, ncols, bias); break;
    case 5: micro_kernel<5>(x, ldx, block, k_pairs, y, ldy, ncols, bias); break;
    case 4: micro_kernel<4>(x, ldx, block, k_pairs, y, ldy, ncols, bias); break;
    case 3: micro_kernel<3>(x, ldx, block, k_pairs, y, ldy, ncols, bias); break;
    case 2: micro_kernel<2>(x, ldx, block, k_pairs, y, ldy, ncols, bias); break;
    case 1: micro_kernel<1>(x, ldx, block, k_pairs, y, ldy, ncols, bias); break;
    default: break;
  }
}

#endif  // __AVX512BF16__

// x [..., K] -> [..., out_features], bfloat16, or float32 with float32_out (logits: not rounded to 8 bits)
at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, int64_t out_features,
                  const c10::optional<at::Tensor>& bias, bool float32_out) {
  TORCH_CHECK(supported(), "bf16_matmul_cpu.linear needs a CPU with AVX512_BF16");
  TORCH_CHECK(input.device().is_cpu() && input.scalar_type() == at::kBFloat16 && input.dim() >= 1,
              "linear: x must be a bfloat16 CPU tensor");
  at::Tensor x = input.reshape({-1, input.size(-1)});
  if (x.stride(1) != 1 || x.stride(0) % 2 != 0) x = x.contiguous();  // rows read as pairs of elements
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(2) == kBlockN && packed.size(3) == 2,
              "linear: packed must be [N/32, K/2, 32, 2] bfloat16, got ", packed.sizes());
  const int64_t rows = x.size(0), k_pairs = packed.size(1), blocks = packed.size(0);
  TORCH_CHECK(x.size(1) == 2 * k_pairs, "linear: x has ", x.size(1), " columns, the weight ", 2 * k_pairs);
  TORCH_CHECK(out_features > (blocks - 1) * kBlockN && out_features <= blocks * kBlockN,
              "linear: out_features ", out_features, " does not match the packed weight ", packed.sizes());
  const bf16* bias_data = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == out_features,
                "linear: bias must be [out_features] bfloat16");
    bias_data = bias->data_ptr<bf16>();
  }
  std::vector<int64_t> out_shape(input.sizes().begin(), input.sizes().end());
  out_shape.back() = out_features;
  auto y = at::empty(out_shape, x.options().dtype(float32_out ? at::kFloat : at::kBFloat16));
#if defined(__AVX512BF16__)
  const bf16* x_data = x.data_ptr<bf16>();
  const bf16* w_data = packed.data_ptr<bf16>();
  const int64_t ldx = x.stride(0);
  const int64_t row_tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  auto run = [&](auto* y_data) {
    // blocks vary fastest, so at decode's few rows the threads stream the weight front to back together
    pagoda::parallel_tasks(blocks * row_tasks, [&](int64_t task) {
      const int64_t b = task % blocks, m0 = (task / blocks) * kRowsPerTask;
      const int64_t n0 = b * kBlockN;
      rows_against_block(x_data + m0 * ldx, ldx, std::min(kRowsPerTask, rows - m0), w_data + b * k_pairs * 64,
                         k_pairs, y_data + m0 * out_features + n0, out_features,
                         std::min(kBlockN, out_features - n0), bias_data ? bias_data + n0 : nullptr);
    });
  };
  if (float32_out) {
    run(y.data_ptr<float>());
  } else {
    run(y.data_ptr<bf16>());
  }
#endif
  return y;
}

}  // namespace

TORCH_LIBRARY(pagoda_bf16_matmul, m) {
  m.def("supported() -> bool", &supported);  // no tensor to dispatch on: one kernel for every backend
  m.def("linear(Tensor x, Tensor packed, int out_features, Tensor? bias, bool float32_out=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagoda_bf16_matmul, CPU, m) { m.impl("linear", &linear); }
