// Decode attention on CPU straight from the paged KV cache: one query token per sequence.
//
// Reads each sequence's K and V blocks in place through its block table (no gather, no padding to
// the longest context), so every cached byte is read once. Work items are (sequence, KV head) pairs;
// the query heads sharing a KV head (GQA) are scored together against each K row.
// Scores and the softmax are float32 whatever the cache dtype.

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  // bfloat16 is the top half of a float32: a shift the compiler vectorises
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// exp(x) for the softmax's x <= 0, in plain arithmetic that vectorises (std::exp stays a scalar call):
// 2^(x log2 e) = 2^i * 2^f with f in [0, 1) by a degree-5 fit, relative error under 2e-7. The exponent is
// clamped at -126, the smallest normal float's, so 2^i stays a valid float (exp(-87.3) ~ 1e-38: zero weight).
inline float exp_nonpositive(float x) {
  const float t = std::max(x * 1.44269504f, -126.f);
  const float i = std::floor(t), f = t - i;
  float p = 1.87537657e-3f;
  p = p * f + 8.98725919e-3f;
  p = p * f + 5.58359654e-2f;
  p = p * f + 2.40146495e-1f;
  p = p * f + 6.93154738e-1f;
  p = p * f + 9.99999834e-1f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(i) + 127) << 23;
  float two_to_i;
  std::memcpy(&two_to_i, &bits, sizeof(two_to_i));
  return p * two_to_i;
}

// Calls visit(row, t) for each position t < seq_len of a context, row pointing at its entry in one KV
// head's cache, walking the block table one block at a time.
template <typename scalar_t, typename Visit>
inline void for_each_row(const scalar_t* cache, const int32_t* block_table, int64_t seq_len, int64_t block_size,
                         int64_t block_stride, int64_t pos_stride, Visit&& visit) {
  for (int64_t t0 = 0; t0 < seq_len; t0 += block_size) {
    const scalar_t* block = cache + block_table[t0 / block_size] * block_stride;
    const int64_t n = std::min(block_size, seq_len - t0);
    for (int64_t t = 0; t < n; ++t) visit(block + t * pos_stride, t0 + t);
  }
}

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

constexpr int64_t kMaxHeadSize = 256;  // MAX_HEAD_SIZE in cpu_kernels.py
constexpr int64_t kMaxGroup = 16;

// kHeadSize > 0 fixes the head size at compile time (the common sizes), so the per-row loops unroll into
// registers; 0 reads it from head_size.
template <typename scalar_t, int kHeadSize>
void decode_one(
    const scalar_t* q,        // [G, D] of this (sequence, KV head), row stride q_head_stride
    int64_t q_head_stride,
    const scalar_t* k_cache,  // block b, position t, head h at b*block_stride + t*pos_stride + h*head_stride
    const scalar_t* v_cache,
    int64_t block_stride, int64_t pos_stride, int64_t head_stride,
    const int32_t* block_table, int64_t seq_len, int64_t block_size,
    int64_t group, int64_t head_size, float scale,
    scalar_t* out, int64_t out_head_stride,  // [G, D]
    std::vector<float>& scores) {           // scratch, grown to [G, seq_len]
  if constexpr (kHeadSize > 0) head_size = kHeadSize;
  float qf[kMaxGroup][kMaxHeadSize];
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_size; ++d) qf[g][d] = to_float(q[g * q_head_stride + d]) * scale;
  if (static_cast<int64_t>(scores.size()) < group * seq_len) scores.resize(group * seq_len);
  float* s = scores.data();  // [G, seq_len]

  float row[kMaxHeadSize];
  for_each_row(k_cache, block_table, seq_len, block_size, block_stride, pos_stride, [&](const scalar_t* k, int64_t t) {
    for (int64_t d = 0; d < head_size; ++d) row[d] = to_float(k[d]);
    for (int64_t g = 0; g < group; ++g) {
      float dot = 0.f;
      for (int64_t d = 0; d < head_size; ++d) dot += qf[g][d] * row[d];
      s[g * seq_len + t] = dot;
    }
  });

  float acc[kMaxGroup][kMaxHeadSize];
  for (int64_t g = 0; g < group; ++g) {
    float* sg = s + g * seq_len;
    float max_score = std::numeric_limits<float>::lowest();
    for (int64_t t = 0; t < seq_len; ++t) max_score = std::max(max_score, sg[t]);
    float total = 0.f;
    for (int64_t t = 0; t < seq_len; ++t) {
      sg[t] = exp_nonpositive(sg[t] - max_score);
      total += sg[t];
    }
    const float inv_total = 1.f / total;
    for (int64_t t = 0; t < seq_len; ++t) sg[t] *= inv_total;
    for (int64_t d = 0; d < head_size; ++d) acc[g][d] = 0.f;
  }

  for_each_row(v_cache, block_table, seq_len, block_size, block_stride, pos_stride, [&](const scalar_t* v, int64_t t) {
    for (int64_t d = 0; d < head_size; ++d) row[d] = to_float(v[d]);
    for (int64_t g = 0; g < group; ++g) {
      const float p = s[g * seq_len + t];
      for (int64_t d = 0; d < head_size; ++d) acc[g][d] += p * row[d];
    }
  });
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < head_size; ++d) out[g * out_head_stride + d] = from_float<scalar_t>(acc[g][d]);
}

template <typename scalar_t>
void decode_all(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* k = key_cache.data_ptr<scalar_t>();
  const scalar_t* v = value_cache.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const int64_t q_seq = query.stride(0), q_head = query.stride(1);
  const int64_t o_seq = out.stride(0), o_head = out.stride(1);
  const int64_t table_stride = block_tables.stride(0);
  const int64_t block_stride = key_cache.stride(0), pos_stride = key_cache.stride(1), head_stride = key_cache.stride(2);

  auto decode = head_size == 64    ? decode_one<scalar_t, 64>
                : head_size == 128 ? decode_one<scalar_t, 128>
                                   : decode_one<scalar_t, 0>;
  // grain 1: the items differ a lot in cost (context lengths), so let OpenMP split them evenly by count
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / num_kv_heads, h = item % num_kv_heads;
      // wider groups (multi-query models) in chunks that fit the per-thread accumulators
      for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
        const int64_t first_head = h * group + g0;
        decode(q + i * q_seq + first_head * q_head, q_head, k + h * head_stride, v + h * head_stride,
               block_stride, pos_stride, head_stride, tables + i * table_stride, lens[i], block_size,
               std::min(kMaxGroup, group - g0), head_size, static_cast<float>(scale),
               o + i * o_seq + first_head * o_head, o_head, scores);
      }
    }
  });
}

// query [B, Hq, D]; key_cache/value_cache [num_blocks, block_size, H_kv, D] (any strides, D contiguous);
// block_tables [B, max_blocks] int32; seq_lens [B] int32; out [B, Hq, D].
void paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                            at::Tensor out) {
  TORCH_CHECK(query.device().is_cpu(), "paged_decode_attention runs on CPU tensors");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4,
              "query must be [B, Hq, D] and the caches [num_blocks, block_size, H_kv, D]");
  TORCH_CHECK(key_cache.strides() == value_cache.strides() && key_cache.sizes() == value_cache.sizes(),
              "key and value caches must have the same shape and strides");
  TORCH_CHECK(query.stride(2) == 1 && key_cache.stride(3) == 1 && out.stride(2) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "query, caches and out must share one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.stride(1) == 1 && seq_lens.is_contiguous(),
              "block_tables and seq_lens must be int32 with contiguous rows");
  const int64_t num_heads = query.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && query.size(2) <= kMaxHeadSize,
              "head size must match the cache and be at most ", kMaxHeadSize);
  TORCH_CHECK(out.sizes() == query.sizes(), "out must have the query's shape");
  TORCH_CHECK(block_tables.size(0) == query.size(0) && seq_lens.size(0) == query.size(0),
              "one block table row and one length per query row");
  switch (query.scalar_type()) {
    case at::kFloat: decode_all<float>(query, key_cache, value_cache, block_tables, seq_lens, scale, out); break;
    case at::kBFloat16:
      decode_all<c10::BFloat16>(query, key_cache, value_cache, block_tables, seq_lens, scale, out);
      break;
    case at::kHalf: decode_all<c10::Half>(query, key_cache, value_cache, block_tables, seq_lens, scale, out); break;
    default: TORCH_CHECK(false, "paged_decode_attention supports float32, bfloat16 and float16");
  }
}

}  // namespace

TORCH_LIBRARY(pagoda_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pagoda_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
