// Decode attention on AMX tiles (csrc/amx_tiles.h), for attention/paged_decode_cpu.cpp's bfloat16 kernel. Both of
// its passes over an item's blocks (a sequence and some of its KV heads) as sums of tile products that take every
// KV head of the item at once:
//   scores  S^T = sum over KV heads h of K_h Q_h^T   [16 keys x the item's query heads], K_h the block's rows of h
//           as the cache holds them (16 keys x 32 head dims a tile), Q_h^T the query pairs of h's heads, zero in
//           the other heads' columns (ItemQueries, loaded once an item);
//   P @ V   O += sum over h of P_h V_h   [the item's query heads x 64 head dims], P_h the probabilities of h's
//           heads, zero in the other heads' rows (ItemProbabilities), V_h the block's value rows in pairs of keys.
// The vector kernel spends most of its time on sums across lanes (scores) and on broadcasting each probability
// pair (P @ V); the tiles do neither.
#pragma once

#include "amx_tiles.h"
#include "avx512_math.h"

#if defined(PAGODA_HAVE_AMX)

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace pagoda::attention::amx_decode {

using pagoda::amx::kTileKPairs;
using pagoda::amx::kTileRows;

// Tiles: 0 the sums S^T [rows keys x 16 query heads], 1 the keys [rows x 32 head dims], 2..7 the query tiles
// (ItemQueries), which stay loaded for a whole item
constexpr int kFirstQueryTile = 2;
constexpr int kQueryTiles = 6;

// Whether an item of `heads` KV heads, each with `group` query heads, fits the tiles: a query tile per KV head and
// 32 head dims, a column of S^T per query head
inline bool fits(int64_t heads, int64_t group, int64_t head_size) {
  return heads * (head_size / 32) <= kQueryTiles && heads * group <= kTileRows;
}

// The item's query heads as the right-hand tiles, one per KV head h and slice of 32 head dims: per head-dim pair,
// column c holds query head c's pair when c is one of h's query heads, zero otherwise. So a single sum tile takes
// every KV head's product, each filling its own query heads' columns.
template <int D>
struct ItemQueries {
  static constexpr int kSlices = D / 32;
  alignas(64) uint32_t pairs[kQueryTiles][kTileKPairs][kTileRows];

  // a tile's 16 x 16 pairs at once: row c the pairs of query head c (zero unless one of h's), transposed (as bits:
  // shuffles only). A scalar store for each pair took ~9 % of decode attention's samples at 128 contexts of 16
  // positions (a Xeon with AMX)
  PAGODA_AMX_TARGET void set(const c10::BFloat16* q, int64_t q_head_stride, int64_t heads, int64_t group) {
    for (int64_t h = 0; h < heads; ++h)
      for (int slice = 0; slice < kSlices; ++slice) {
        __m512 block[kTileRows];
        for (int64_t c = 0; c < kTileRows; ++c)
          block[c] = c / group == h && c < heads * group ? _mm512_loadu_ps(q + c * q_head_stride + 32 * slice)
                                                         : _mm512_setzero_ps();
        avx512::transpose16(block);
        for (int p = 0; p < kTileKPairs; ++p)
          _mm512_store_ps(reinterpret_cast<float*>(pairs[h * kSlices + slice][p]), block[p]);
      }
  }
};

// rows: the keys a tile holds, min(16, block_size), so that a tile never reads past a block
PAGODA_AMX_TARGET inline void configure_scores(int64_t rows) {
  pagoda::amx::TileConfig config;
  config.rows[0] = rows;
  config.rows[1] = rows;
  pagoda::amx::load_tile_config(config);
}

// tile index to immediate: the AMX instructions name their tiles in the encoding
PAGODA_AMX_TARGET inline void load_query_tile(int tile, const void* at) {
  constexpr int64_t stride = kTileRows * sizeof(uint32_t);
  switch (tile) {
    case 2: _tile_loadd(2, at, stride); break;
    case 3: _tile_loadd(3, at, stride); break;
    case 4: _tile_loadd(4, at, stride); break;
    case 5: _tile_loadd(5, at, stride); break;
    case 6: _tile_loadd(6, at, stride); break;
    default: _tile_loadd(7, at, stride); break;
  }
}
PAGODA_AMX_TARGET inline void multiply_keys_by(int tile) {
  switch (tile) {
    case 2: _tile_dpbf16ps(0, 1, 2); break;
    case 3: _tile_dpbf16ps(0, 1, 3); break;
    case 4: _tile_dpbf16ps(0, 1, 4); break;
    case 5: _tile_dpbf16ps(0, 1, 5); break;
    case 6: _tile_dpbf16ps(0, 1, 6); break;
    default: _tile_dpbf16ps(0, 1, 7); break;
  }
}

// Needs configure_scores on this thread; loads the item's query tiles
template <int D>
PAGODA_AMX_TARGET inline void load_queries(const ItemQueries<D>& queries, int64_t heads) {
  for (int i = 0; i < heads * ItemQueries<D>::kSlices; ++i) load_query_tile(kFirstQueryTile + i, queries.pairs[i]);
}

// S^T of a block's keys 0..n-1 (KV head h's rows at block + h * head_stride, pos_stride elements apart; whole
// tiles of `rows` keys readable) into scores_t [n rounded up to rows][16] (float32, unscaled): row j, column c the
// score of query head c for key j. Needs load_queries.
template <int D>
PAGODA_AMX_TARGET inline void score_block(const c10::BFloat16* block, int64_t head_stride, int64_t pos_stride,
                                          int64_t heads, int64_t n, int64_t rows, float* scores_t) {
  const int64_t key_stride = pos_stride * static_cast<int64_t>(sizeof(c10::BFloat16));
  for (int64_t c0 = 0; c0 < n; c0 += rows) {
    _tile_zero(0);
    for (int64_t h = 0; h < heads; ++h)
      for (int slice = 0; slice < ItemQueries<D>::kSlices; ++slice) {
        _tile_loadd(1, block + h * head_stride + c0 * pos_stride + 32 * slice, key_stride);
        multiply_keys_by(kFirstQueryTile + h * ItemQueries<D>::kSlices + slice);
      }
    _tile_stored(0, scores_t + c0 * kTileRows, kTileRows * sizeof(float));
  }
}

// P @ V on tiles, head size 64: the sums O [the item's query heads x 64 head dims] in tiles 0-3 (16 head dims
// each) for the whole context, O += P_h V_h per block and KV head h, with
//   P_h   tile 4: the probabilities of every query head of the item, zero in the rows of the heads not h's
//         (ItemProbabilities), so that one set of sum tiles takes every KV head, as the scores do;
//   V_h   tiles 5 and 6: the block's value rows of h in pairs of keys (ValuePairs), two of the four 16-column
//         tiles at a time.
// A pair tile's columns are the head dims in the order vpunpck{l,h}wd leaves them (per 128-bit lane, dims 8L..8L+3
// in the low tile, 8L+4..8L+7 in the high one), which is the order of decode_bf16's P @ V accumulators: the sums
// are stored into them as they are.
constexpr int64_t kValuesHeadSize = 64;
constexpr int64_t kPairTiles = kValuesHeadSize / 16;

inline bool values_fit(int64_t heads, int64_t head_size) { return head_size == kValuesHeadSize && heads <= kTileRows; }

// The item's probabilities as P_h tiles: row c of KV head h's plane is query head c's probabilities when c is one of
// h's query heads, zero otherwise (the zeros stay from the allocation: a plane's other rows are never written)
struct ItemProbabilities {
  std::vector<uint16_t> planes;  // [KV heads][query heads][stride], bfloat16 bits
  int64_t kv_heads = 0, group = 0, stride = 0;

  // room for `positions` keys a row (whole tiles), keeping the zeros where the layout is unchanged
  void reserve(int64_t num_kv_heads, int64_t heads_per_kv, int64_t positions) {
    if (num_kv_heads == kv_heads && heads_per_kv == group && positions <= stride) return;
    kv_heads = num_kv_heads, group = heads_per_kv, stride = std::max(positions, stride);
    planes.assign(kv_heads * kv_heads * group * stride, 0);
  }
  uint16_t* row(int64_t head) { return planes.data() + (head / group * kv_heads * group + head) * stride; }
  const uint16_t* plane(int64_t h) const { return planes.data() + h * kv_heads * group * stride; }
};

// pair_rows: key pairs a tile, min(16, block_size / 2), so that a tile never takes keys past a block
PAGODA_AMX_TARGET inline void configure_values(int64_t heads, int64_t pair_rows) {
  pagoda::amx::TileConfig config;
  for (int i = 0; i < 4; ++i) config.rows[i] = heads;
  config.rows[4] = heads, config.colsb[4] = 4 * pair_rows;
  config.rows[5] = config.rows[6] = pair_rows;
  pagoda::amx::load_tile_config(config);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// Keys 0..2 pair_rows - 1 of one KV head's value rows (rows pos_stride elements apart; keys n and on read as zero,
// whatever the cache holds there) as the four pair tiles
struct ValuePairs {
  alignas(64) uint16_t tiles[kPairTiles][kTileKPairs][32];

  PAGODA_AMX_TARGET void set(const c10::BFloat16* rows, int64_t pos_stride, int64_t n, int64_t pair_rows) {
    for (int64_t j = 0; j < pair_rows; ++j) {
      const __mmask32 first = 2 * j < n ? 0xFFFFFFFFu : 0u, second = 2 * j + 1 < n ? 0xFFFFFFFFu : 0u;
      for (int i = 0; i < 2; ++i) {
        const __m512i v0 = _mm512_maskz_loadu_epi16(first, rows + 2 * j * pos_stride + 32 * i);
        const __m512i v1 = _mm512_maskz_loadu_epi16(second, rows + (2 * j + 1) * pos_stride + 32 * i);
        _mm512_store_si512(tiles[2 * i][j], _mm512_unpacklo_epi16(v0, v1));
        _mm512_store_si512(tiles[2 * i + 1][j], _mm512_unpackhi_epi16(v0, v1));
      }
    }
  }
};

// O += P_h V_h for keys t0 .. t0 + 2 pair_rows - 1 of KV head h (values: their pairs). Needs configure_values.
PAGODA_AMX_TARGET inline void accumulate_values(const ItemProbabilities& probabilities, int64_t h, int64_t t0,
                                                const ValuePairs& values) {
  constexpr int64_t kPairStride = 32 * sizeof(uint16_t);
  _tile_loadd(4, probabilities.plane(h) + t0, probabilities.stride * static_cast<int64_t>(sizeof(uint16_t)));
  _tile_loadd(5, values.tiles[0], kPairStride);
  _tile_dpbf16ps(0, 4, 5);
  _tile_loadd(6, values.tiles[1], kPairStride);
  _tile_dpbf16ps(1, 4, 6);
  _tile_loadd(5, values.tiles[2], kPairStride);
  _tile_dpbf16ps(2, 4, 5);
  _tile_loadd(6, values.tiles[3], kPairStride);
  _tile_dpbf16ps(3, 4, 6);
}

// The sums into acc [heads][kPairTiles][16] (decode_bf16's accumulators), and the tiles released
PAGODA_AMX_TARGET inline void store_values(float* acc) {
  constexpr int64_t kRowStride = kPairTiles * kTileRows * sizeof(float);
  _tile_stored(0, acc, kRowStride);
  _tile_stored(1, acc + kTileRows, kRowStride);
  _tile_stored(2, acc + 2 * kTileRows, kRowStride);
  _tile_stored(3, acc + 3 * kTileRows, kRowStride);
  pagoda::amx::release_tiles();
}

}  // namespace pagoda::attention::amx_decode

#endif
