// Decode's scores on AMX tiles (csrc/amx_tiles.h), for attention/paged_decode_cpu.cpp's bfloat16 kernel: a
// block's scores for every query head of an item (a sequence and some of its KV heads) as one sum of tile
// products, transposed,
//   S^T = sum over KV heads h of K_h Q_h^T   [16 keys x the item's query heads]
// with K_h the block's rows of KV head h as the cache holds them (16 keys x 32 head dims a tile) and Q_h^T the
// query pairs of h's heads (ItemQueries: zero in the other heads' columns), loaded once an item.
#pragma once

#include "amx_tiles.h"

#if defined(PAGODA_HAVE_AMX)

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

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

  void set(const c10::BFloat16* q, int64_t q_head_stride, int64_t heads, int64_t group) {
    std::memset(pairs, 0, sizeof(pairs));
    for (int64_t c = 0; c < heads * group; ++c) {
      const auto* row = reinterpret_cast<const uint16_t*>(q + c * q_head_stride);
      for (int p = 0; p < D / 2; ++p)
        pairs[c / group * kSlices + p / kTileKPairs][p % kTileKPairs][c] =
            row[2 * p] | static_cast<uint32_t>(row[2 * p + 1]) << 16;
    }
  }
};

// rows: the keys a tile holds, min(16, block_size), so that a tile never reads past a block
PAGODA_AMX_TARGET inline void configure(int64_t rows) {
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

// Needs configure(rows) on this thread; loads the item's query tiles
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

}  // namespace pagoda::attention::amx_decode

#endif
