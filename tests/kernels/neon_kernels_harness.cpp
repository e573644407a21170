// The aarch64 micro-kernels against scalar references, as a standalone program (no torch libraries: only
// c10's header-only BFloat16), cross-compiled and run under qemu-aarch64 by test_neon_kernels_qemu.py.
// Built at each aarch64 level's flags, it runs the bfloat16 matmul kernel that level selects (cpu_isa.h),
// argmax and the NEON SiLU-and-multiply, on odd shapes (tails of rows, columns and K), and prints
// "isa <level>", then one line per check; exit status 1 on any mismatch.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "argmax_row.h"
#include "bf16_scalar.h"
#include "cpu_isa.h"

#if !defined(PAGODA_ISA_NEON)
#error "the harness is for aarch64 NEON builds"
#endif

#include "paged_decode_neon.h"
#include "silu_and_mul_neon.h"
#if defined(PAGODA_ISA_NEONBF16)
#include "bf16_matmul_neonbf16.h"
namespace isa = pagoda::bf16_matmul::neonbf16;
#else
#include "bf16_matmul_neon.h"
namespace isa = pagoda::bf16_matmul::neon;
#endif

namespace {

using bf16 = c10::BFloat16;
using pagoda::bf16_to_float;
using pagoda::float_to_bf16;
using pagoda::bf16_matmul::BlockTask;
using pagoda::bf16_matmul::kBlockN;

std::mt19937 rng(1234);
int failures = 0;

void report(bool ok, const char* what, const char* detail) {
  std::printf("%s %s%s%s\n", ok ? "ok" : "FAIL", what, detail[0] ? ": " : "", detail);
  failures += !ok;
}

std::vector<bf16> random_bf16(int64_t n, float scale) {
  std::normal_distribution<float> normal(0.f, scale);
  std::vector<bf16> out(n);
  for (auto& v : out) v = float_to_bf16(normal(rng));
  return out;
}

// w [N, K] -> [ceil(N/32), K/2, 32, 2], as bf16_matmul_cpu.pack (rows past N: 0)
std::vector<bf16> pack(const std::vector<bf16>& w, int64_t n, int64_t k) {
  const int64_t blocks = (n + kBlockN - 1) / kBlockN;
  std::vector<bf16> packed(blocks * k * kBlockN, float_to_bf16(0.f));
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < k; ++i)
      packed[((j / kBlockN) * (k / 2) + i / 2) * 2 * kBlockN + (j % kBlockN) * 2 + i % 2] = w[j * k + i];
  return packed;
}

// y = x w^T + bias through the level's rows_against_block, tasks of up to 64 rows per block, as linear() does
template <typename OutT>
std::vector<OutT> kernel_linear(const std::vector<bf16>& x, int64_t rows, int64_t ldx, const std::vector<bf16>& packed,
                                int64_t n, int64_t k, const bf16* bias) {
  std::vector<float> x_float;
  if (isa::kWantsFloatX && rows >= isa::kFloatXRows) {
    x_float.resize(rows * k);
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t i = 0; i < k; ++i) x_float[m * k + i] = bf16_to_float(x[m * ldx + i]);
  }
  std::vector<OutT> y(rows * n);
  const int64_t blocks = (n + kBlockN - 1) / kBlockN;
  for (int64_t m0 = 0; m0 < rows; m0 += 64)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t n0 = b * kBlockN;
      const BlockTask t{x.data() + m0 * ldx, x_float.empty() ? nullptr : x_float.data() + m0 * k, ldx, k,
                        std::min<int64_t>(64, rows - m0), packed.data() + b * (k / 2) * 2 * kBlockN, k / 2, n,
                        std::min<int64_t>(kBlockN, n - n0), bias ? bias + n0 : nullptr};
      isa::rows_against_block(t, y.data() + m0 * n + n0);
    }
  return y;
}

inline float as_float(float v) { return v; }
inline float as_float(bf16 v) { return bf16_to_float(v); }

template <typename OutT>
void check_matmul(int64_t rows, int64_t n, int64_t k, bool with_bias) {
  const int64_t ldx = k + 6;  // strided rows, as a slice of a wider tensor
  const auto x = random_bf16(rows * ldx, 1.f), w = random_bf16(n * k, 0.5f), bias = random_bf16(n, 1.f);
  const auto y = kernel_linear<OutT>(x, rows, ldx, pack(w, n, k), n, k, with_bias ? bias.data() : nullptr);
  double worst = 0;
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t j = 0; j < n; ++j) {
      double want = with_bias ? bf16_to_float(bias[j]) : 0.0, magnitude = std::fabs(want);
      for (int64_t i = 0; i < k; ++i) {
        const double term = double(bf16_to_float(x[m * ldx + i])) * bf16_to_float(w[j * k + i]);
        want += term;
        magnitude += std::fabs(term);
      }
      // float32 sums (BFDOT/BFMMLA round their partial sums too), then one rounding to the output type
      double tolerance = 1e-4 * magnitude + 1e-6;
      if (sizeof(OutT) == 2) tolerance += std::ldexp(std::fabs(want), -8);
      worst = std::max(worst, std::fabs(as_float(y[m * n + j]) - want) / tolerance);
    }
  char what[160], detail[128];
  std::snprintf(what, sizeof(what), "matmul rows=%lld n=%lld k=%lld bias=%d out=%s", (long long)rows,
                (long long)n, (long long)k, int(with_bias), sizeof(OutT) == 2 ? "bf16" : "f32");
  std::snprintf(detail, sizeof(detail), "worst error %.3g of the tolerance", worst);
  report(worst <= 1.0, what, worst <= 1.0 ? "" : detail);
}

int64_t first_largest(const std::vector<float>& x) {
  int64_t best = 0;
  for (int64_t i = 1; i < int64_t(x.size()); ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

void check_argmax(int64_t n, int ties) {
  std::normal_distribution<float> normal(0.f, 3.f);
  std::vector<float> x(n);
  for (auto& v : x) v = normal(rng);
  const float top = 100.f;
  for (int t = 0; t < ties; ++t) x[std::uniform_int_distribution<int64_t>(0, n - 1)(rng)] = top;  // equal maxima
  const int64_t got = pagoda::argmax_row(x.data(), n), want = first_largest(x);
  char what[96], detail[128];
  std::snprintf(what, sizeof(what), "argmax n=%lld ties=%d", (long long)n, ties);
  std::snprintf(detail, sizeof(detail), "got %lld, want %lld", (long long)got, (long long)want);
  report(got == want, what, got == want ? "" : detail);
}

void check_silu(int64_t n) {
  std::uniform_real_distribution<float> gates(-20.f, 20.f), ups(-4.f, 4.f);
  std::vector<float> gate(n), up(n), out(n);
  for (int64_t i = 0; i < n; ++i) {
    gate[i] = gates(rng);
    up[i] = ups(rng);
  }
  const float extremes[] = {-120.f, -88.f, -87.5f, 0.f, 1e-7f, 87.5f, 88.f, 120.f};  // past exp's clamp
  for (int64_t i = 0; i < n && i < 8; ++i) gate[n - 1 - i] = extremes[i];
  pagoda::neon::silu_and_mul_row(gate.data(), up.data(), out.data(), n);
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double g = gate[i], want = g / (1.0 + std::exp(-g)) * up[i];
    worst = std::max(worst, std::fabs(out[i] - want) / (4e-6 * std::fabs(want) + 1e-30));
  }
  char what[64], detail[128];
  std::snprintf(what, sizeof(what), "silu_and_mul f32 n=%lld", (long long)n);
  std::snprintf(detail, sizeof(detail), "worst error %.3g of the tolerance", worst);
  report(worst <= 1.0, what, worst <= 1.0 ? "" : detail);

  // bfloat16: the generic loop's rounding points (silu rounded, then the product); at most one unit in the
  // last place apart where exp's last float32 bit moves a rounding, and seldom (far: 1e-30 absolute too)
  std::vector<bf16> gate16(n), up16(n), out16(n);
  for (int64_t i = 0; i < n; ++i) {
    gate16[i] = float_to_bf16(gate[i]);
    up16[i] = float_to_bf16(up[i]);
  }
  pagoda::neon::silu_and_mul_row(gate16.data(), up16.data(), out16.data(), n);
  int64_t apart = 0, far = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double g = bf16_to_float(gate16[i]);
    const float silu = bf16_to_float(float_to_bf16(float(g / (1.0 + std::exp(-g)))));
    const float want = bf16_to_float(float_to_bf16(silu * bf16_to_float(up16[i]))), got = bf16_to_float(out16[i]);
    apart += got != want && g > -87.0;  // below, exp(-g) is clamped: both are below 1e-35, not the same
    far += std::fabs(got - want) > std::ldexp(std::max(std::fabs(got), std::fabs(want)), -7) + 1e-30f;
  }
  std::snprintf(what, sizeof(what), "silu_and_mul bf16 n=%lld", (long long)n);
  std::snprintf(detail, sizeof(detail), "%lld elements differ, %lld by more than one ulp", (long long)apart,
                (long long)far);
  const bool ok = far == 0 && apart <= n / 100;
  report(ok, what, ok ? "" : detail);
}

// decode attention over a bfloat16 paged cache [blocks, block_size, kv_heads, D], blocks in shuffled order,
// against softmax(q k^T scale) v in double precision from the same bfloat16 values
template <int kHeadSize>
void check_decode(int64_t seq_len, int64_t block_size, int64_t kv_heads, int64_t group) {
  const int64_t heads = kv_heads * group, num_blocks = (seq_len + block_size - 1) / block_size + 3;
  const float scale = 1.f / std::sqrt(float(kHeadSize));
  const std::vector<bf16> q = random_bf16(heads * kHeadSize, 1.f);
  const std::vector<bf16> k_cache = random_bf16(num_blocks * block_size * kv_heads * kHeadSize, 1.f);
  const std::vector<bf16> v_cache = random_bf16(num_blocks * block_size * kv_heads * kHeadSize, 1.f);
  std::vector<int32_t> table(num_blocks);
  for (int64_t b = 0; b < num_blocks; ++b) table[b] = static_cast<int32_t>(b);
  std::shuffle(table.begin(), table.end(), rng);
  const int64_t pos_stride = kv_heads * kHeadSize, block_stride = block_size * pos_stride;
  std::vector<bf16> out(heads * kHeadSize);
  std::vector<float> scratch;
  pagoda::attention::neon::decode_sequence<kHeadSize>(q.data(), kHeadSize, k_cache.data(), v_cache.data(),
                                                      block_stride, pos_stride, kHeadSize, kv_heads, group,
                                                      table.data(), seq_len, block_size, scale, out.data(),
                                                      kHeadSize, scratch);
  auto at = [&](const std::vector<bf16>& cache, int64_t t, int64_t h, int64_t d) {
    return double(bf16_to_float(cache[table[t / block_size] * block_stride + t % block_size * pos_stride +
                                      h * kHeadSize + d]));
  };
  double worst = 0;
  for (int64_t head = 0; head < heads; ++head) {
    const int64_t h = head / group;
    std::vector<double> p(seq_len);
    double top = -1e300, total = 0;
    for (int64_t t = 0; t < seq_len; ++t) {
      double dot = 0;
      for (int64_t d = 0; d < kHeadSize; ++d) dot += double(bf16_to_float(q[head * kHeadSize + d])) * at(k_cache, t, h, d);
      p[t] = dot * scale;
      top = std::max(top, p[t]);
    }
    for (auto& x : p) total += (x = std::exp(x - top));
    for (int64_t d = 0; d < kHeadSize; ++d) {
      double want = 0;
      for (int64_t t = 0; t < seq_len; ++t) want += p[t] / total * at(v_cache, t, h, d);
      // the output is rounded to bfloat16 (2^-8 relative) after float32 sums
      const double got = bf16_to_float(out[head * kHeadSize + d]);
      worst = std::max(worst, std::fabs(got - want) / (std::ldexp(std::fabs(want), -7) + 1e-3));
    }
  }
  char what[96], detail[128];
  std::snprintf(what, sizeof(what), "decode_attention D=%d len=%lld block=%lld kv_heads=%lld group=%lld", kHeadSize,
                (long long)seq_len, (long long)block_size, (long long)kv_heads, (long long)group);
  std::snprintf(detail, sizeof(detail), "worst error %.3g of the tolerance", worst);
  report(worst <= 1.0, what, worst <= 1.0 ? "" : detail);
}

}  // namespace

int main() {
  std::printf("isa %s\n", pagoda::kIsaLevel);
  for (int64_t rows : {1, 2, 3, 4, 5, 7, 8, 9, 13, 70})
    for (int64_t k : {2, 6, 8, 14, 64, 258})
      for (int64_t n : {5, 32, 75}) {
        check_matmul<float>(rows, n, k, rows % 2 == 1);
        check_matmul<bf16>(rows, n, k, rows % 2 == 0);
      }
  for (int64_t n : {1, 3, 15, 16, 17, 31, 64, 100, 1000, 49157})
    for (int ties : {0, 1, 3}) check_argmax(n, ties);
  for (int64_t n : {1, 3, 4, 7, 8, 33, 1000, 20000}) check_silu(n);
  for (int64_t seq_len : {1, 3, 4, 5, 17, 64, 301})
    for (int64_t block_size : {1, 16})
      for (int64_t group : {1, 3, 6}) {
        check_decode<64>(seq_len, block_size, 2, group);
        if (group == 3) check_decode<128>(seq_len, block_size, 1, group);
      }
  std::printf("%d failed\n", failures);
  return failures ? 1 : 0;
}
