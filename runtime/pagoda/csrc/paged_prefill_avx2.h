// Prefill attention tiles for AVX2 + FMA (no AVX-512), head sizes 64 and 128: float32 flash attention as two small
// matmuls a chunk, register-blocked as bf16_matmul_avx2.h's float32 kernel (6 query vectors x 16 lanes: 12
// accumulators, two loads and a broadcast within AVX2's 16 registers).
//
// A chunk is 32 keys of one KV head widened to float32 once, K transposed ([D][32]: 16 keys' scores are two FMAs
// per head-dim element) and V as rows. paged_prefill_cpu.cpp prepares a sequence's chunks once for all its row
// tiles; widened per tile instead, as the generic tile does, the widening and the transpose cost about as much as
// the tile's FMAs (one chunk: 2 x 32 x D elements moved one at a time, against 48 x 32 x D x 2 FMAs in 8-lane
// vectors).
//
// Per chunk, a tile of query vectors (rows x the heads sharing the KV head, at most kTileVectors): the scores
// S = Q K^T (6 vectors x 16 keys a block), each vector's online-softmax step over the keys it sees, then
// O = O * rescale + P V (6 vectors x 16 head-dim lanes a block).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "avx2_math.h"
#include "paged_attention_common.h"

namespace pagoda::attention::avx2 {

using pagoda::avx2::exp_nonpositive8;
using pagoda::avx2::max_of8;
using pagoda::avx2::sum_of8;

constexpr int64_t kChunkKeys = 32;  // keys a chunk: four 8-lane score vectors a query vector
constexpr int64_t kTileVectors = 48;  // query vectors a tile: its query, output and weights stay in L1 and L2
constexpr int kBlockVectors = 6;  // query vectors a micro-kernel block

template <int D>
struct Chunk {
  alignas(32) float keys_t[D][kChunkKeys];
  alignas(32) float values[kChunkKeys][D];
};

// keys t0 .. t0 + keys - 1 of one KV head's context into c; lanes past `keys` repeat the last key, and keys before
// `lowest` (a sliding window's first visible position: its blocks may be gone) repeat the key at `lowest`: both
// are read but never weighted
template <int D, typename cache_t>
void prepare_chunk(Chunk<D>& c, const cache_t* k_cache, const cache_t* v_cache, int64_t block_stride,
                   int64_t pos_stride, const int32_t* block_table, int64_t block_size, int64_t t0, int64_t keys,
                   int64_t lowest) {
  alignas(32) float row[D];
  for (int64_t j = 0; j < kChunkKeys; ++j) {
    const int64_t t = std::max(lowest, t0 + std::min(j, keys - 1));
    const int64_t offset = block_table[t / block_size] * block_stride + (t % block_size) * pos_stride;
    load_row(k_cache + offset, row, D);
    for (int d = 0; d < D; ++d) c.keys_t[d][j] = row[d];
    load_row(v_cache + offset, c.values[j], D);
  }
}

template <int D>
struct Tile {
  alignas(32) float query[kTileVectors][D];  // times the softmax scale
  alignas(32) float acc[kTileVectors][D];
  alignas(32) float weights[kTileVectors][kChunkKeys];  // the chunk's scores, then their softmax weights
  float row_max[kTileVectors], row_sum[kTileVectors], rescale[kTileVectors];
};

// cap * tanh(x / cap) of 8 lanes, as softcap_score
inline __m256 softcap8(__m256 x, float cap) {
  const __m256 y = _mm256_mul_ps(x, _mm256_set1_ps(1.f / cap));
  const __m256 sign = _mm256_and_ps(y, _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(0x80000000u))));
  const __m256 e = exp_nonpositive8(_mm256_mul_ps(_mm256_andnot_ps(sign, y), _mm256_set1_ps(-2.f)));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  return _mm256_mul_ps(_mm256_or_ps(t, sign), _mm256_set1_ps(cap));
}

// all-ones in the lanes first..first+7 that lie in [begin, end)
inline __m256 lanes_between(int64_t begin, int64_t end, int first) {
  const __m256i index = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(first));
  const __m256i below_end = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(end)), index);
  const __m256i below_begin = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(begin)), index);
  return _mm256_castsi256_ps(_mm256_andnot_si256(below_begin, below_end));
}

// weights[v0 + m][16 half ..] = the scores of vectors v0..v0+MB-1 against keys 16 half .. 16 half + 15
template <int D, int MB>
inline void scores(Tile<D>& st, const Chunk<D>& c, int64_t v0, int half) {
  __m256 s[MB][2];
  for (int m = 0; m < MB; ++m) s[m][0] = s[m][1] = _mm256_setzero_ps();
  for (int d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_load_ps(c.keys_t[d] + 16 * half), k1 = _mm256_load_ps(c.keys_t[d] + 16 * half + 8);
    for (int m = 0; m < MB; ++m) {
      const __m256 b = _mm256_broadcast_ss(&st.query[v0 + m][d]);
      s[m][0] = _mm256_fmadd_ps(b, k0, s[m][0]);
      s[m][1] = _mm256_fmadd_ps(b, k1, s[m][1]);
    }
  }
  for (int m = 0; m < MB; ++m) {
    _mm256_store_ps(st.weights[v0 + m] + 16 * half, s[m][0]);
    _mm256_store_ps(st.weights[v0 + m] + 16 * half + 8, s[m][1]);
  }
}

// vector v's online-softmax step over the chunk's keys [begin, end): its scores become weights (0 outside),
// its running max and sum move on, and rescale[v] is what its output so far is multiplied by
template <int D>
inline void softmax_step(Tile<D>& st, int64_t v, int64_t begin, int64_t end, float cap) {
  float* w = st.weights[v];
  if (end <= begin) {  // no key of this chunk is visible: the state stays as it is
    for (int i = 0; i < kChunkKeys; i += 8) _mm256_store_ps(w + i, _mm256_setzero_ps());
    st.rescale[v] = 1.f;
    return;
  }
  const __m256 lowest = _mm256_set1_ps(std::numeric_limits<float>::lowest());
  __m256 a[4], mask[4], top = lowest;
  for (int i = 0; i < 4; ++i) {
    mask[i] = lanes_between(begin, end, 8 * i);
    a[i] = _mm256_load_ps(w + 8 * i);
    if (cap > 0.f) a[i] = softcap8(a[i], cap);
    top = _mm256_max_ps(top, _mm256_blendv_ps(lowest, a[i], mask[i]));
  }
  const float new_max = std::max(st.row_max[v], max_of8(top));
  const float rescale = exp_nonpositive(st.row_max[v] - new_max);  // -inf - x: clamped to ~1e-38, times 0
  const __m256 m = _mm256_set1_ps(new_max);
  __m256 sum = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    const __m256 p = _mm256_and_ps(mask[i], exp_nonpositive8(_mm256_sub_ps(a[i], m)));
    sum = _mm256_add_ps(sum, p);
    _mm256_store_ps(w + 8 * i, p);
  }
  st.row_max[v] = new_max;
  st.row_sum[v] = st.row_sum[v] * rescale + sum_of8(sum);
  st.rescale[v] = rescale;
}

// acc[v0 + m] = acc[v0 + m] * rescale + weights[v0 + m] @ the chunk's first `keys` value rows
template <int D, int MB>
inline void weighted_values(Tile<D>& st, const Chunk<D>& c, int64_t v0, int64_t keys) {
  for (int lane = 0; lane < D; lane += 16) {
    __m256 o[MB][2];
    for (int m = 0; m < MB; ++m) {
      const __m256 r = _mm256_set1_ps(st.rescale[v0 + m]);
      o[m][0] = _mm256_mul_ps(_mm256_load_ps(st.acc[v0 + m] + lane), r);
      o[m][1] = _mm256_mul_ps(_mm256_load_ps(st.acc[v0 + m] + lane + 8), r);
    }
    for (int64_t j = 0; j < keys; ++j) {
      const __m256 w0 = _mm256_load_ps(c.values[j] + lane), w1 = _mm256_load_ps(c.values[j] + lane + 8);
      for (int m = 0; m < MB; ++m) {
        const __m256 b = _mm256_broadcast_ss(&st.weights[v0 + m][j]);
        o[m][0] = _mm256_fmadd_ps(b, w0, o[m][0]);
        o[m][1] = _mm256_fmadd_ps(b, w1, o[m][1]);
      }
    }
    for (int m = 0; m < MB; ++m) {
      _mm256_store_ps(st.acc[v0 + m] + lane, o[m][0]);
      _mm256_store_ps(st.acc[v0 + m] + lane + 8, o[m][1]);
    }
  }
}

// fn(std::integral_constant<int, MB>, v0) over the vectors [0, vectors) in blocks of kBlockVectors, then the rest
template <typename Fn>
inline void in_blocks(int64_t vectors, Fn&& fn) {
  int64_t v = 0;
  for (; v + kBlockVectors <= vectors; v += kBlockVectors) fn(std::integral_constant<int, kBlockVectors>{}, v);
  switch (vectors - v) {
    case 5: fn(std::integral_constant<int, 5>{}, v); break;
    case 4: fn(std::integral_constant<int, 4>{}, v); break;
    case 3: fn(std::integral_constant<int, 3>{}, v); break;
    case 2: fn(std::integral_constant<int, 2>{}, v); break;
    case 1: fn(std::integral_constant<int, 1>{}, v); break;
    default: break;
  }
}

// A tile of `rows` query rows (positions first_pos ..) x `group` heads sharing one KV head against the chunks
// chunk_at(c) of its context, as prefill_tile: out[r, g] = softmax(q k^T) v with the layer's variant.
template <int D, typename scalar_t, typename ChunkAt>
void prefill_tile(const scalar_t* q, int64_t q_row_stride, int64_t q_head_stride, ChunkAt&& chunk_at,
                  int64_t first_pos, int64_t rows, int64_t group, const Variant& variant, int64_t first_head,
                  scalar_t* out, int64_t out_row_stride, int64_t out_head_stride) {
  Tile<D> st;
  const int64_t vectors = rows * group;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t v = r * group + g;
      for (int d = 0; d < D; ++d) st.query[v][d] = to_float(q[r * q_row_stride + g * q_head_stride + d]) * variant.q_scale;
      for (int d = 0; d < D; ++d) st.acc[v][d] = 0.f;
      st.row_max[v] = -std::numeric_limits<float>::infinity();
      st.row_sum[v] = 0.f;
    }
  const int64_t last_pos = first_pos + rows - 1;
  for (int64_t c = variant.first_visible(first_pos) / kChunkKeys; c * kChunkKeys <= last_pos; ++c) {
    const Chunk<D>& chunk = chunk_at(c);
    const int64_t t0 = c * kChunkKeys, keys = std::min(kChunkKeys, last_pos + 1 - t0);
    in_blocks(vectors, [&](auto mb, int64_t v0) {
      scores<D, decltype(mb)::value>(st, chunk, v0, 0);
      if (keys > 16) scores<D, decltype(mb)::value>(st, chunk, v0, 1);
    });
    for (int64_t v = 0; v < vectors; ++v) {  // causal: vector v (row v / group) sees keys up to its position
      const int64_t pos = first_pos + v / group;
      softmax_step(st, v, std::max<int64_t>(0, variant.first_visible(pos) - t0), std::min(keys, pos - t0 + 1),
                   variant.softcap);
    }
    in_blocks(vectors, [&](auto mb, int64_t v0) { weighted_values<D, decltype(mb)::value>(st, chunk, v0, keys); });
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t v = r * group + g;
      const float inv = variant.out_scale / (st.row_sum[v] + variant.sink_weight(first_head + g, st.row_max[v]));
      for (int d = 0; d < D; ++d)
        out[r * out_row_stride + g * out_head_stride + d] = from_float<scalar_t>(st.acc[v][d] * inv);
    }
}

}  // namespace pagoda::attention::avx2
