// The small per-layer ops of a decoder as single CPU kernels: RMSNorm (with the residual add fused in),
// rotary embedding in place, SiLU-and-multiply, and the paged KV-cache write; and the sampler's argmax.
//
// In torch each of these is 5-15 ops, each a dispatch, an allocation and a pass over memory; at decode's
// few rows the dispatches are most of a layer's time outside the matmuls. Every kernel rounds where the
// torch code in layers/ rounds (to the model dtype after the norm, before the weight multiply; after
// SiLU, before the multiply), so the two paths agree to the float32 summation order.
//
// The loops are plain C++ the compiler vectorises at every ISA level; the ISA-specific parts are in csrc/:
// argmax (argmax_row.h: AVX-512, AVX2, NEON) and SiLU-and-multiply's bfloat16 rows (silu_and_mul_row.h; on
// aarch64 its exp in silu_and_mul_neon.h).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "argmax_row.h"
#include "cpu_isa.h"
#include "ops.h"
#include "silu_and_mul_row.h"

namespace pagoda::fused {  // the ops are declared in csrc/ops.h

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;  // bfloat16 is the top half of a float32
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  // round to nearest even, as torch does; branch-free so the loops vectorise (no NaN reaches here)
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return c10::BFloat16(static_cast<uint16_t>(bits >> 16), c10::BFloat16::from_bits());
}

// rows smaller than this many elements in all run inline: an OpenMP region costs more than the work
constexpr int64_t kParallelElements = 1 << 15;

inline int64_t row_grain(int64_t row_elements) { return std::max<int64_t>(1, kParallelElements / row_elements); }

template <typename scalar_t>
inline float inverse_rms(const scalar_t* x, int64_t n, float eps) {
  float acc[16] = {0.f};  // 16 lanes: the reduction vectorises without reassociating a single sum
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) {
      const float v = to_float(x[i + j]);
      acc[j] += v * v;
    }
  float total = 0.f;
  for (; i < n; ++i) total += to_float(x[i]) * to_float(x[i]);
  for (int j = 0; j < 16; ++j) total += acc[j];
  return 1.f / std::sqrt(total / static_cast<float>(n) + eps);
}

// out = weight * dtype(float(x) * inverse_rms), the rounding of layers/layernorm.py
template <typename scalar_t>
inline void norm_row(const scalar_t* x, const scalar_t* weight, int64_t n, float eps, scalar_t* out) {
  const float r = inverse_rms(x, n, eps);
  for (int64_t i = 0; i < n; ++i) {
    const float normed = to_float(from_float<scalar_t>(to_float(x[i]) * r));
    out[i] = from_float<scalar_t>(to_float(weight[i]) * normed);
  }
}

void check_rows(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu(), op, " runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [rows, hidden] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1), op,
              ": weight must be [hidden], got ", weight.sizes(), " for x ", x.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": weight and x must share one dtype");
}

#define DISPATCH_FLOATING(dtype, op, ...)                                          \
  switch (dtype) {                                                                 \
    case at::kFloat: { using scalar_t = float; __VA_ARGS__(); break; }             \
    case at::kBFloat16: { using scalar_t = c10::BFloat16; __VA_ARGS__(); break; }  \
    case at::kHalf: { using scalar_t = c10::Half; __VA_ARGS__(); break; }          \
    default: TORCH_CHECK(false, op, " supports float32, bfloat16 and float16");    \
  }

// x [rows, hidden] -> [rows, hidden]
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows("rms_norm", x, weight);
  at::Tensor out = x.new_empty(x.sizes());
  const int64_t rows = x.size(0), n = x.size(1), x_stride = x.stride(0);
  DISPATCH_FLOATING(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) norm_row(xp + r * x_stride, w, n, static_cast<float>(eps), o + r * n);
    });
  });
  return out;
}

// residual_out = x + residual (rounded to the dtype), out = rms_norm(residual_out); both [rows, hidden]
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  check_rows("fused_add_rms_norm", x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 && residual.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: residual must match x, got ", residual.sizes(), " for x ", x.sizes());
  at::Tensor out = x.new_empty(x.sizes());
  at::Tensor residual_out = x.new_empty(x.sizes());
  const int64_t rows = x.size(0), n = x.size(1), x_stride = x.stride(0), r_stride = residual.stride(0);
  DISPATCH_FLOATING(x.scalar_type(), "fused_add_rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    scalar_t* ro = residual_out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* sum = ro + r * n;
        for (int64_t i = 0; i < n; ++i)
          sum[i] = from_float<scalar_t>(to_float(xp[r * x_stride + i]) + to_float(rp[r * r_stride + i]));
        norm_row(sum, w, n, static_cast<float>(eps), o + r * n);
      }
    });
  });
  return {out, residual_out};
}

// Neox-style rotary in place: each head's first and second halves rotate by the position's angles.
// query [T, Hq*D], key [T, Hkv*D] (rows may be strided); cos_sin_cache [max_pos, D] float32, cos then sin.
void apply_rotary_(const at::Tensor& positions, at::Tensor query, at::Tensor key, const at::Tensor& cos_sin_cache,
                   int64_t head_size) {
  TORCH_CHECK(query.device().is_cpu(), "apply_rotary_ runs on CPU tensors");
  TORCH_CHECK(query.dim() == 2 && key.dim() == 2 && query.stride(1) == 1 && key.stride(1) == 1,
              "apply_rotary_: query and key must be [tokens, heads * head_size] with contiguous rows");
  TORCH_CHECK(head_size % 2 == 0 && query.size(1) % head_size == 0 && key.size(1) % head_size == 0,
              "apply_rotary_: head_size ", head_size, " must be even and divide query and key rows");
  TORCH_CHECK(cos_sin_cache.scalar_type() == at::kFloat && cos_sin_cache.is_contiguous() &&
                  cos_sin_cache.size(1) == head_size,
              "apply_rotary_: cos_sin_cache must be contiguous float32 [max_position, head_size]");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.size(0) == query.size(0) && key.size(0) == query.size(0),
              "apply_rotary_: positions must be int64 [tokens] matching query and key");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "apply_rotary_: query and key must share one dtype");
  const int64_t tokens = query.size(0), half = head_size / 2, max_pos = cos_sin_cache.size(0);
  const int64_t q_heads = query.size(1) / head_size, k_heads = key.size(1) / head_size;
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "apply_rotary_: position ", pos[t], " outside [0, ", max_pos, ")");
  const float* cache = cos_sin_cache.data_ptr<float>();
  DISPATCH_FLOATING(query.scalar_type(), "apply_rotary_", [&] {
    scalar_t* q = query.data_ptr<scalar_t>();
    scalar_t* k = key.data_ptr<scalar_t>();
    const int64_t q_stride = query.stride(0), k_stride = key.stride(0);
    auto rotate = [&](scalar_t* x, const float* cos, const float* sin) {
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
        x[i] = from_float<scalar_t>(x1 * cos[i] - x2 * sin[i]);
        x[i + half] = from_float<scalar_t>(x2 * cos[i] + x1 * sin[i]);
      }
    };
    at::parallel_for(0, tokens, row_grain((q_heads + k_heads) * head_size), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cos = cache + pos[t] * head_size;
        const float* sin = cos + half;
        for (int64_t h = 0; h < q_heads; ++h) rotate(q + t * q_stride + h * head_size, cos, sin);
        for (int64_t h = 0; h < k_heads; ++h) rotate(k + t * k_stride + h * head_size, cos, sin);
      }
    });
  });
}

// out[i] = dtype(dtype(silu(gate[i])) * up[i])
template <typename scalar_t>
inline void silu_and_mul_row(const scalar_t* gate, const scalar_t* up, scalar_t* out, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    pagoda::silu_and_mul_row(gate, up, out, n);  // csrc/silu_and_mul_row.h
    return;
  }
#if defined(PAGODA_ISA_NEON)  // expf does not vectorise on aarch64 (no libmvec before glibc 2.38)
  if constexpr (std::is_same_v<scalar_t, float>) {
    pagoda::neon::silu_and_mul_row(gate, up, out, n);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    const float g = to_float(gate[i]);
    const float silu = to_float(from_float<scalar_t>(g / (1.f + std::exp(std::min(-g, 88.f)))));
    out[i] = from_float<scalar_t>(silu * to_float(up[i]));
  }
}

// x [rows, 2 * inter] (gate then up) -> dtype(silu(gate)) * up, [rows, inter]
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "silu_and_mul runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_and_mul: x must be [rows, 2 * intermediate] with contiguous rows");
  const int64_t rows = x.size(0), inter = x.size(1) / 2, x_stride = x.stride(0);
  at::Tensor out = x.new_empty({rows, inter});
  DISPATCH_FLOATING(x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(inter), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = xp + r * x_stride;
        silu_and_mul_row(gate, gate + inter, o + r * inter, inter);
      }
    });
  });
  return out;
}

// Scatters this step's key/value [T, Hkv, D] (rows may be strided, D contiguous) into their slots of
// kv_cache [2, num_blocks, block_size, Hkv, D] (any strides, D contiguous); slot -1 skips a token.
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache,
                    const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.device().is_cpu() && kv_cache.device().is_cpu(), "write_kv_cache runs on CPU tensors");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && kv_cache.dim() == 5 && kv_cache.size(0) == 2,
              "write_kv_cache: key/value must be [T, Hkv, D] and kv_cache [2, num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(key.size(1) == kv_cache.size(3) && key.size(2) == kv_cache.size(4),
              "write_kv_cache: key ", key.sizes(), " does not match the cache ", kv_cache.sizes());
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && kv_cache.stride(4) == 1,
              "write_kv_cache: the head dimension must be contiguous");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "write_kv_cache: key, value and cache must share one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.size(0) == key.size(0),
              "write_kv_cache: slot_mapping must be int64 [T]");
  const int64_t tokens = key.size(0), heads = key.size(1), head_size = key.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_blocks * block_size, "write_kv_cache: slot ", slots[t],
                " outside the cache of ", num_blocks * block_size, " slots");
  const size_t row_bytes = head_size * key.element_size();
  auto* k = static_cast<const char*>(key.data_ptr());
  auto* v = static_cast<const char*>(value.data_ptr());
  auto* cache = static_cast<char*>(kv_cache.data_ptr());
  const int64_t es = key.element_size();
  at::parallel_for(0, tokens, row_grain(2 * heads * head_size), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t dst = block * kv_cache.stride(1) + offset * kv_cache.stride(2) + h * kv_cache.stride(3);
        std::memcpy(cache + dst * es, k + (t * key.stride(0) + h * key.stride(1)) * es, row_bytes);
        std::memcpy(cache + (kv_cache.stride(0) + dst) * es, v + (t * value.stride(0) + h * value.stride(1)) * es,
                    row_bytes);
      }
    }
  });
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 &&
                  x.size(1) > 0,
              "argmax_rows: x must be float32 [rows, n > 0] with contiguous rows");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = x.new_empty({rows}, x.options().dtype(at::kLong));
  const float* data = x.data_ptr<float>();
  int64_t* index = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) index[r] = pagoda::argmax_row(data + r * stride, n);
  });
  return out;
}

}  // namespace pagoda::fused
