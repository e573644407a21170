// Random sampling on the CPU: one token per row drawn from softmax(logits / temperature), with min-p, by the
// inverse of the row's cumulative distribution and one uniform number per row (sample/sampler.py owns the
// settings: penalties, top-k and top-p arrive here as -inf logits).
//
// Why: the exponential race the GPU uses (argmax p / E, E ~ Exp(1)) draws a random number and takes a log per
// vocabulary entry. torch's exponential_ is scalar on the CPU (a log1p per element): 34 ms a step for 32 rows of
// a 49152-token vocabulary, on one thread, while the other waited; more than half a decode step of the default
// model at that batch. Here a row is three vectorised passes (max, the weights and their sums, the scan to the
// drawn mass) and one random number.

#include <ATen/core/Tensor.h>

#include <cmath>
#include <limits>
#include <vector>

#include "argmax_row.h"
#include "ops.h"
#include "parallel_tasks.h"

namespace pagoda::sample {
namespace {

constexpr int64_t kChunk = 256;  // elements whose weights are summed together: the scan skips whole chunks
constexpr float kMinExponent = -87.0f;  // exp(-87) ~ 1.6e-38, just above float32's smallest normal
constexpr float kGreedyTemperature = 1e-5f;  // at or below: the row is greedy (SamplingParams' rule)

// The row's token: index i with probability w_i / sum(w), w_i = exp((x_i - max) / t), and w_i = 0 where
// w_i < min_p (p_i < min_p * p_max). `w` is scratch of n floats.
int64_t sample_row(const float* x, int64_t n, float temperature, float min_p, double uniform, float* w) {
  const int64_t best = pagoda::argmax_row(x, n);
  const float max = x[best];
  if (temperature <= kGreedyTemperature || !(max > -std::numeric_limits<float>::max())) return best;
  const float inv_t = 1.0f / temperature;
  const int64_t num_chunks = (n + kChunk - 1) / kChunk;
  std::vector<double> chunk_sums(num_chunks);
  double total = 0.0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t begin = c * kChunk, end = std::min(n, begin + kChunk);
    float sum = 0.0f;
    for (int64_t i = begin; i < end; ++i) {  // vectorised (-ffast-math: libmvec's expf and the sum)
      // (x - max) / t <= 0, -inf for masked tokens; below kMinExponent a weight is < 2^-125 of the largest
      // (0 in a float32 softmax too): the clamp keeps exp's argument finite and its result a normal float
      const float exponent = (x[i] - max) * inv_t;
      const float e = std::exp(std::max(exponent, kMinExponent));
      const float kept = (exponent <= kMinExponent || e < min_p) ? 0.0f : e;
      w[i] = kept;
      sum += kept;
    }
    chunk_sums[c] = sum;
    total += sum;
  }
  const double target = uniform * total;
  double cumulative = 0.0;
  int64_t c = 0;
  for (; c + 1 < num_chunks && cumulative + chunk_sums[c] <= target; ++c) cumulative += chunk_sums[c];
  // within the chunk: the first token whose cumulative mass passes the target (its weight > 0, so a draw never
  // lands on a masked token); the chunk's last token of weight > 0 where rounding left the target unreached
  int64_t last_kept = -1;
  for (int64_t i = c * kChunk, end = std::min(n, (c + 1) * kChunk); i < end; ++i) {
    if (w[i] <= 0.0f) continue;
    cumulative += w[i];
    last_kept = i;
    if (cumulative > target) return i;
  }
  if (last_kept >= 0) return last_kept;
  for (int64_t i = n - 1; i >= 0; --i) {  // an empty last chunk (every weight there 0): the last kept token
    if (w[i] > 0.0f) return i;
  }
  return best;
}

}  // namespace

at::Tensor sample_categorical(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& min_p,
                              const at::Tensor& uniforms) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.dim() == 2 &&
                  logits.stride(1) == 1 && logits.size(1) > 0,
              "sample_categorical: logits must be float32 [rows, n > 0] with contiguous rows");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(temperature.scalar_type() == at::kFloat && temperature.is_contiguous() && temperature.numel() == rows,
              "sample_categorical: temperature must be float32 [rows]");
  TORCH_CHECK(min_p.scalar_type() == at::kFloat && min_p.is_contiguous() && min_p.numel() == rows,
              "sample_categorical: min_p must be float32 [rows]");
  TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous() && uniforms.numel() == rows,
              "sample_categorical: uniforms must be float64 [rows]");
  at::Tensor out = logits.new_empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const float* t = temperature.data_ptr<float>();
  const float* p = min_p.data_ptr<float>();
  const double* u = uniforms.data_ptr<double>();
  int64_t* token = out.data_ptr<int64_t>();
  pagoda::parallel_tasks(rows, [&](int64_t r) {  // rows handed out as threads come (a descheduled one's go on)
    thread_local std::vector<float> w;
    w.resize(n);
    token[r] = sample_row(x + r * stride, n, t[r], p[r], u[r], w.data());
  });
  return out;
}

}  // namespace pagoda::sample
