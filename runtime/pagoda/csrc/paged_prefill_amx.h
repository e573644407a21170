// Prefill attention on AMX tiles (csrc/amx_tiles.h) for a bfloat16 cache, head sizes 64 and 128: flash attention
// with the scores transposed, so that the online softmax needs no reduction across lanes.
//
// A chunk is 64 keys of one KV head: the keys as the cache holds them, the values transposed into pairs.
// paged_prefill_cpu.cpp prepares a sequence's chunks once for all its row tiles. Per chunk, each group of 16
// query vectors of a tile (its rows x the heads sharing the KV head) takes
//   S^T = K Q^T      [64 keys x 16 vectors]: 16 key rows x the group's query pairs (transposed once a tile)
//   softmax          S^T's rows are vectors of 16 lanes, one lane per query vector: each vector's running max and
//                    sum are elementwise max and add over the key rows, its causal mask one compare a row
//   O^T += V^T P^T   [D x 16 vectors]: the values' transposed pairs x the probabilities' pairs (bfloat16, as
//                    the other kernels round them), accumulated in the tiles once the sums take the factor
// With the scores as query rows (S = Q K^T), each vector paid two reductions across 16 lanes and a scalar
// exponential every 32 keys, which took more time than the tile products.
#pragma once

#include "amx_tiles.h"

#if defined(PAGODA_HAVE_AMX)

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "paged_attention_common.h"

namespace pagoda::attention::amx_prefill {

using pagoda::amx::kTileKPairs;
using pagoda::amx::kTileRows;
using pagoda::avx512::transpose16;  // csrc/avx512_math.h

constexpr int64_t kChunkKeys = 64;  // keys a chunk: four key tiles of scores, two pair tiles of P^T
constexpr int64_t kTileVectors = 48;  // query vectors a tile, as paged_prefill_cpu.cpp's
constexpr int64_t kGroups = kTileVectors / kTileRows;  // groups of 16 query vectors a tile

template <int D>
struct Chunk {
  alignas(64) c10::BFloat16 keys[kChunkKeys][D];  // as the cache holds them: a tile reads 16 keys x 32 head dims
  alignas(64) uint32_t values_t[D][kChunkKeys / 2];  // per head dim, the keys' values in pairs (2j, 2j + 1)
};

// Keys t0..t0+keys-1 of a context into c; past the end the last key repeats (read, never weighted)
template <int D>
void prepare_chunk(Chunk<D>& c, const c10::BFloat16* k_cache, const c10::BFloat16* v_cache, int64_t block_stride,
                   int64_t pos_stride, const int32_t* block_table, int64_t block_size, int64_t t0, int64_t keys) {
  auto row_at = [&](const c10::BFloat16* cache, int64_t j) {
    const int64_t t = t0 + std::min(j, keys - 1);
    return cache + block_table[t / block_size] * block_stride + (t % block_size) * pos_stride;
  };
  for (int64_t j = 0; j < kChunkKeys; ++j) std::memcpy(c.keys[j], row_at(k_cache, j), D * sizeof(c10::BFloat16));
  for (int64_t j = 0; j < kChunkKeys / 2; ++j) {
    const uint16_t* first = reinterpret_cast<const uint16_t*>(row_at(v_cache, 2 * j));
    const uint16_t* second = reinterpret_cast<const uint16_t*>(row_at(v_cache, 2 * j + 1));
    for (int d = 0; d < D; ++d) c.values_t[d][j] = first[d] | static_cast<uint32_t>(second[d]) << 16;
  }
}

// A tile's running state, per group of 16 query vectors (vector v of the tile: group v / 16, lane v % 16)
template <int D>
struct Tile {
  alignas(64) uint32_t query_t[kGroups][D / 2][kTileRows];  // per head-dim pair, the group's query pairs
  alignas(64) float acc_t[kGroups][D][kTileRows];  // O^T: per head dim, the group's output sums
  alignas(64) float row_max[kGroups][kTileRows];  // in the scores' units (before the softmax scale)
  alignas(64) float row_sum[kGroups][kTileRows];
  alignas(64) int32_t position[kGroups][kTileRows];  // of each vector's row; -1 past the tile's vectors
};

// One group's online-softmax step over a chunk's transposed scores (rows [0, seen) hold keys t0 + row): its
// probabilities into weights_t as bfloat16 pairs per lane (zero past `seen`, up to `pair_rows` pair rows); returns
// the factor the group's output sums take first. kCausal: some lane must not see some of the rows (the lanes
// past the tile's vectors see every row otherwise, and are never read).
template <bool kCausal>
inline __m512 softmax_step(float* row_max, float* row_sum, const int32_t* position, const float (*scores_t)[kTileRows],
                           int64_t t0, int64_t seen, int64_t pair_rows, float scale, uint32_t (*weights_t)[kTileRows]) {
  const __m512i pos = _mm512_load_si512(position);
  auto visible = [&](int64_t j) -> __mmask16 {
    if constexpr (!kCausal) return 0xFFFF;
    return _mm512_cmp_epi32_mask(pos, _mm512_set1_epi32(static_cast<int32_t>(t0 + j)), _MM_CMPINT_NLT);
  };
  // (p[2j], p[2j+1]) of lane v at bfloat16 positions 2v, 2v+1: cvtne2ps_pbh puts p[2j] in 0-15, p[2j+1] in 16-31
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  auto store_pair = [&](int64_t pair, __m512 even, __m512 odd) {
    _mm512_store_si512(weights_t[pair], _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(odd, even)));
  };
  // scores to log2 units of the scaled softmax: the scale and log2(e) in one multiply; the exponential a degree-3
  // fit, as the probabilities are rounded to bfloat16 before P V (the degree-5 one took 10 % more of the time)
  const __m512 c = _mm512_set1_ps(scale * 1.44269504f);
  const __m512 lowest = _mm512_set1_ps(std::numeric_limits<float>::lowest());
  const __m512 old_max = _mm512_load_ps(row_max);
  // every lane with a row (position >= 0) has its max from the first chunk on; before it, the max is found first
  const __mmask16 rows = _mm512_cmp_epi32_mask(pos, _mm512_setzero_si512(), _MM_CMPINT_NLT);
  if (!_mm512_mask_cmp_ps_mask(rows, old_max, lowest, _CMP_EQ_OQ)) {
    const __m512 shift = _mm512_mul_ps(old_max, c);
    const __m512 bound = _mm512_add_ps(old_max, _mm512_set1_ps(kLazyMaxLog2 / (scale * 1.44269504f)));
    __mmask16 over = 0;  // lanes with a visible score past the bound: this chunk then takes the exact step below
    auto lazy_weight = [&](int64_t row) {
      const __m512 s = _mm512_load_ps(scores_t[row]);
      over |= _mm512_mask_cmp_ps_mask(visible(row), s, bound, _CMP_GT_OQ);
      return _mm512_maskz_mov_ps(visible(row), exp2_nonpositive16<3, false>(_mm512_fmsub_ps(s, c, shift)));
    };
    __m512 sum = _mm512_setzero_ps();
    int64_t pair = 0;
    for (; 2 * pair + 2 <= seen; ++pair) {
      const __m512 even = lazy_weight(2 * pair), odd = lazy_weight(2 * pair + 1);
      sum = _mm512_add_ps(sum, _mm512_add_ps(even, odd));
      store_pair(pair, even, odd);
    }
    if (2 * pair < seen) {
      const __m512 even = lazy_weight(2 * pair);
      sum = _mm512_add_ps(sum, even);
      store_pair(pair++, even, _mm512_setzero_ps());
    }
    if (!over) {
      for (; pair < pair_rows; ++pair) _mm512_store_si512(weights_t[pair], _mm512_setzero_si512());
      _mm512_store_ps(row_sum, _mm512_add_ps(_mm512_load_ps(row_sum), sum));
      return _mm512_set1_ps(1.f);
    }
  }
  // four chains in named registers: one alone would wait on vmaxps's latency every row, and an array indexed by
  // j % 4 lived on the stack, a store and a load in every row's chain (the softmax 13.7 % of a 1,500-token
  // prefill's samples on a Xeon with AMX, 9.5 % in registers)
  __m512 m0 = lowest, m1 = lowest, m2 = lowest, m3 = lowest;
  auto row_max_of = [&](__m512 m, int64_t j) {
    return _mm512_mask_max_ps(m, visible(j), m, _mm512_load_ps(scores_t[j]));
  };
  int64_t j = 0;
  for (; j + 4 <= seen; j += 4) {
    m0 = row_max_of(m0, j);
    m1 = row_max_of(m1, j + 1);
    m2 = row_max_of(m2, j + 2);
    m3 = row_max_of(m3, j + 3);
  }
  for (; j < seen; ++j) m0 = row_max_of(m0, j);
  const __m512 chunk_max = _mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3));
  const __m512 new_max = _mm512_max_ps(old_max, chunk_max);
  const __m512 shift = _mm512_mul_ps(new_max, c);
  const __m512 rescale = exp2_nonpositive16<3>(_mm512_mul_ps(_mm512_sub_ps(old_max, new_max), c));
  // no clamp in the exponential below: a visible row's exponent is finite and <= 0 (scalef takes any), and a row
  // a lane must not see (its shift may be lowest * c) is masked to 0 whatever its exponential came to
  auto weight = [&](int64_t row) {
    return _mm512_maskz_mov_ps(visible(row), exp2_nonpositive16<3, false>(
                                                 _mm512_fmsub_ps(_mm512_load_ps(scores_t[row]), c, shift)));
  };
  __m512 sum = _mm512_setzero_ps();  // one chain: a pair's exponentials take longer than its add's latency
  int64_t pair = 0;
  for (; 2 * pair + 2 <= seen; ++pair) {
    const __m512 even = weight(2 * pair), odd = weight(2 * pair + 1);
    sum = _mm512_add_ps(sum, _mm512_add_ps(even, odd));
    store_pair(pair, even, odd);
  }
  if (2 * pair < seen) {  // an odd `seen`: the last pair's second row is one no vector of the group sees
    const __m512 even = weight(2 * pair);
    sum = _mm512_add_ps(sum, even);
    store_pair(pair++, even, _mm512_setzero_ps());
  }
  for (; pair < pair_rows; ++pair) _mm512_store_si512(weights_t[pair], _mm512_setzero_si512());
  _mm512_store_ps(row_max, new_max);
  _mm512_store_ps(row_sum, _mm512_fmadd_ps(_mm512_load_ps(row_sum), rescale, sum));
  return rescale;
}

// Group g of the tile against chunk c, whose keys t0 .. t0 + keys - 1 exist; the group's rows are at positions
// first_pos .. last_pos
template <int D>
PAGODA_AMX_TARGET void chunk_step(Tile<D>& st, int64_t g, const Chunk<D>& c, int64_t t0, int64_t keys,
                                  int64_t first_pos, int64_t last_pos, float scale) {
  constexpr int64_t kKeysStride = D * sizeof(c10::BFloat16), kPairsStride = kTileRows * sizeof(uint32_t);
  constexpr int64_t kValuesStride = kChunkKeys / 2 * sizeof(uint32_t), kSumsStride = kTileRows * sizeof(float);
  const int64_t seen = std::min(keys, last_pos - t0 + 1);  // rows of S^T any vector of the group sees
  const int64_t key_tiles = (seen + kTileRows - 1) / kTileRows, pair_tiles = (seen + 31) / 32;
  alignas(64) float scores_t[kChunkKeys][kTileRows];
  alignas(64) uint32_t weights_t[kChunkKeys / 2][kTileRows];
  // S^T, four key tiles a pass in tiles 0-3; per step of 16 head-dim pairs, the group's query pairs in tile 6
  for (int64_t kt = 0; kt < key_tiles; kt += 4) {
    const int64_t n = std::min<int64_t>(4, key_tiles - kt);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int p = 0; p < D / 2; p += kTileKPairs) {
      _tile_loadd(6, &st.query_t[g][p][0], kPairsStride);
      _tile_loadd(4, &c.keys[16 * kt][2 * p], kKeysStride);
      _tile_dpbf16ps(0, 4, 6);
      if (n > 1) {
        _tile_loadd(5, &c.keys[16 * kt + 16][2 * p], kKeysStride);
        _tile_dpbf16ps(1, 5, 6);
      }
      if (n > 2) {
        _tile_loadd(7, &c.keys[16 * kt + 32][2 * p], kKeysStride);
        _tile_dpbf16ps(2, 7, 6);
      }
      if (n > 3) {
        _tile_loadd(4, &c.keys[16 * kt + 48][2 * p], kKeysStride);
        _tile_dpbf16ps(3, 4, 6);
      }
    }
    _tile_stored(0, scores_t[16 * kt], kSumsStride);
    if (n > 1) _tile_stored(1, scores_t[16 * kt + 16], kSumsStride);
    if (n > 2) _tile_stored(2, scores_t[16 * kt + 32], kSumsStride);
    if (n > 3) _tile_stored(3, scores_t[16 * kt + 48], kSumsStride);
  }
  const auto softmax = t0 + seen - 1 <= first_pos ? softmax_step<false> : softmax_step<true>;
  const __m512 rescale = softmax(st.row_max[g], st.row_sum[g], st.position[g], scores_t, t0, seen,
                                 pair_tiles * kTileKPairs, scale, weights_t);
  // the sums take the factor (unless no lane's max moved), then P V's tiles add to them: four head-dim tiles a pass
  if (_mm512_cmp_ps_mask(rescale, _mm512_set1_ps(1.f), _CMP_NEQ_UQ))
    for (int d = 0; d < D; ++d) _mm512_store_ps(st.acc_t[g][d], _mm512_mul_ps(_mm512_load_ps(st.acc_t[g][d]), rescale));
  for (int d0 = 0; d0 < D; d0 += 4 * kTileRows) {
    _tile_loadd(0, st.acc_t[g][d0], kSumsStride);
    _tile_loadd(1, st.acc_t[g][d0 + 16], kSumsStride);
    _tile_loadd(2, st.acc_t[g][d0 + 32], kSumsStride);
    _tile_loadd(3, st.acc_t[g][d0 + 48], kSumsStride);
    for (int64_t kp = 0; kp < pair_tiles; ++kp) {
      const int64_t pair = kp * kTileKPairs;
      _tile_loadd(4, weights_t[pair], kPairsStride);
      _tile_loadd(5, &c.values_t[d0][pair], kValuesStride);
      _tile_loadd(6, &c.values_t[d0 + 16][pair], kValuesStride);
      _tile_loadd(7, &c.values_t[d0 + 32][pair], kValuesStride);
      _tile_dpbf16ps(0, 5, 4);
      _tile_dpbf16ps(1, 6, 4);
      _tile_dpbf16ps(2, 7, 4);
      _tile_loadd(5, &c.values_t[d0 + 48][pair], kValuesStride);
      _tile_dpbf16ps(3, 5, 4);
    }
    _tile_stored(0, st.acc_t[g][d0], kSumsStride);
    _tile_stored(1, st.acc_t[g][d0 + 16], kSumsStride);
    _tile_stored(2, st.acc_t[g][d0 + 32], kSumsStride);
    _tile_stored(3, st.acc_t[g][d0 + 48], kSumsStride);
  }
}

// A tile of rows x group query vectors (at most kTileVectors) against the chunks of its sequence's KV head:
// chunk_at(c) is chunk c (keys c * kChunkKeys ..). The same signature as paged_prefill_cpu.cpp's other tiles.
template <int D, typename ChunkAt>
PAGODA_AMX_TARGET void prefill_tile(const c10::BFloat16* q, int64_t q_row_stride, int64_t q_head_stride,
                                    ChunkAt&& chunk_at, int64_t first_pos, int64_t rows, int64_t group, float scale,
                                    c10::BFloat16* out, int64_t out_row_stride, int64_t out_head_stride) {
  Tile<D> st;
  const int64_t vectors = rows * group, groups = (vectors + kTileRows - 1) / kTileRows;
  std::memset(st.acc_t, 0, sizeof(st.acc_t));
  std::memset(st.row_sum, 0, sizeof(st.row_sum));
  std::fill(&st.row_max[0][0], &st.row_max[0][0] + kTileVectors, std::numeric_limits<float>::lowest());
  std::fill(&st.position[0][0], &st.position[0][0] + kTileVectors, -1);
  for (int64_t v = 0; v < vectors; ++v)
    st.position[v / kTileRows][v % kTileRows] = static_cast<int32_t>(first_pos + v / group);
  // each group's query pairs transposed 16 x 16 a block (as bits: shuffles only); lanes past the tile's vectors
  // zero (zero scores, never read). With a scalar store for each pair, the tiles' setup and output took 3.5 % of a
  // 1,500-token prefill's `perf` samples on a Xeon with AMX; so, 2.6 %
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t n = std::min(kTileRows, vectors - g * kTileRows);
    for (int p0 = 0; p0 < D / 2; p0 += kTileRows) {
      __m512 block[kTileRows];
      for (int64_t lane = 0; lane < kTileRows; ++lane) {
        const int64_t v = g * kTileRows + lane;
        block[lane] = lane < n ? _mm512_loadu_ps(q + v / group * q_row_stride + v % group * q_head_stride + 2 * p0)
                               : _mm512_setzero_ps();
      }
      transpose16(block);
      for (int j = 0; j < kTileRows; ++j) _mm512_store_ps(reinterpret_cast<float*>(st.query_t[g][p0 + j]), block[j]);
    }
  }
  const int64_t last_pos = first_pos + rows - 1;
  amx::load_tile_config();
  for (int64_t t0 = 0; t0 <= last_pos; t0 += kChunkKeys) {
    const Chunk<D>& chunk = chunk_at(t0 / kChunkKeys);
    const int64_t keys = std::min(kChunkKeys, last_pos + 1 - t0);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t group_first = first_pos + g * kTileRows / group;
      const int64_t group_last = first_pos + (std::min(vectors, (g + 1) * kTileRows) - 1) / group;
      if (group_last >= t0) chunk_step<D>(st, g, chunk, t0, keys, group_first, group_last, scale);
    }
  }
  amx::release_tiles();
  for (int64_t g = 0; g < groups; ++g) {  // O = (O^T)^T / sum, 16 head dims x 16 vectors a block
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_load_ps(st.row_sum[g]));
    const int64_t n = std::min(kTileRows, vectors - g * kTileRows);
    for (int d0 = 0; d0 < D; d0 += 16) {
      __m512 block[16];
      for (int i = 0; i < 16; ++i) block[i] = _mm512_mul_ps(_mm512_load_ps(st.acc_t[g][d0 + i]), inv);
      transpose16(block);
      for (int64_t lane = 0; lane < n; ++lane) {
        const int64_t v = g * kTileRows + lane;
        c10::BFloat16* o = out + v / group * out_row_stride + v % group * out_head_stride + d0;
        avx512::store_bf16x16(o, block[lane]);
      }
    }
  }
}

}  // namespace pagoda::attention::amx_prefill

#endif
