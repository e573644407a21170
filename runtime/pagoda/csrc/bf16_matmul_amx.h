// bfloat16 matmul on Intel AMX (Sapphire Rapids and later), for rows of x against the packed blocks of
// bf16_matmul_common.h, at the avx512bf16 level. One `tdpbf16ps` multiplies a 16-row tile of x by a tile of
// 16 k-pairs x 16 outputs: 8192 multiply-adds, where `vdpbf16ps` does 32. So from a few rows on, a prompt's
// matmuls run ~10x faster than the vdpbf16ps kernel (which keeps decode's few rows: there both read the weight
// at memory speed, and a tile's 16 rows would be mostly padding).
//
// The packed layout is already a tile's: a block's k-pair p holds its 32 outputs' weight pairs in 128 bytes,
// so the B tile of outputs 0-15 is 16 such rows, 64 bytes each, 128 bytes apart (outputs 16-31: 64 bytes
// further). Where it runs: csrc/amx_tiles.h.
#pragma once

#include "amx_tiles.h"

#if defined(PAGODA_HAVE_AMX)

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "bf16_matmul_avx512bf16.h"
#include "bf16_matmul_common.h"

namespace pagoda::bf16_matmul::amx {

using pagoda::amx::kTileKPairs;
using pagoda::amx::kTileRows;
using pagoda::amx::load_tile_config;
using pagoda::amx::usable;

constexpr int64_t kGroupRows = 2 * kTileRows;  // one step: 32 rows x 32 outputs, four output tiles
// From this many rows AMX runs a call. A tile costs the same for 1 to 16 rows, while the vdpbf16ps kernel's
// time grows with its rows past two (3 rows: ~1.2x one's); at 1-2 rows both are bound by reading the weight,
// which the streaming kernel does 10-20 % faster (the default model's shapes, two cores of a Xeon with AMX).
constexpr int64_t kMinRows = 3;

// y[0:rows, 0:ncols] (+ bias) from a 32 x 32 float32 group of sums
template <typename OutT>
inline void store_group(const float* sums, int64_t rows, OutT* y, int64_t ldy, int64_t ncols, const bf16* bias) {
  const avx512bf16::BlockColumns columns(ncols, bias);
  for (int64_t m = 0; m < rows; ++m)
    columns.store(y + m * ldy, _mm512_loadu_ps(sums + m * 32), _mm512_loadu_ps(sums + m * 32 + 16));
}

// t.rows rows of x against one block; t.k_pairs a multiple of 16. A step takes two tiles of 16 rows and both
// halves of the block (four sum tiles); the last rows (fewer than 16) take tiles of as many rows, under a
// configuration of their own, so that no tile reads past x. Releases the tiles after.
template <typename OutT>
PAGODA_AMX_TARGET void rows_against_block(const BlockTask& t, OutT* y) {
  const int64_t whole = t.rows / kTileRows, last_rows = t.rows % kTileRows;
  const int64_t tiles = whole + (last_rows > 0 ? 1 : 0);
  const int64_t x_stride = t.ldx * sizeof(bf16), block_stride = 2 * kBlockN * sizeof(bf16);  // bytes
  constexpr int64_t kSumsStride = 32 * sizeof(float);
  alignas(64) float sums[kGroupRows * 32];
  load_tile_config();
  for (int64_t i = 0; i < tiles; i += 2) {
    const bf16* x = t.x + i * kTileRows * t.ldx;
    const bool two = i + 1 < tiles;
    if (last_rows > 0 && i + (two ? 1 : 0) == whole) {  // this step holds the last rows: their x tile (4 alone,
      pagoda::amx::TileConfig config;                  // 5 with another) and its sum tiles have as many rows
      const int shorter[3] = {two ? 5 : 4, two ? 2 : 0, two ? 3 : 1};
      for (int tile : shorter) config.rows[tile] = static_cast<uint8_t>(last_rows);
      load_tile_config(config);
    }
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t p = 0; p < t.k_pairs; p += kTileKPairs) {
        const bf16* w = t.block + p * 2 * kBlockN;
        _tile_loadd(4, x + 2 * p, x_stride);
        _tile_loadd(5, x + kTileRows * t.ldx + 2 * p, x_stride);
        _tile_loadd(6, w, block_stride);
        _tile_loadd(7, w + 32, block_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(2, sums + kTileRows * 32, kSumsStride);
      _tile_stored(3, sums + kTileRows * 32 + 16, kSumsStride);
    } else {  // a last tile alone: half the work
      for (int64_t p = 0; p < t.k_pairs; p += kTileKPairs) {
        const bf16* w = t.block + p * 2 * kBlockN;
        _tile_loadd(4, x + 2 * p, x_stride);
        _tile_loadd(6, w, block_stride);
        _tile_loadd(7, w + 32, block_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
      }
    }
    _tile_stored(0, sums, kSumsStride);
    _tile_stored(1, sums + 16, kSumsStride);
    store_group(sums, std::min(kGroupRows, t.rows - i * kTileRows), y + i * kTileRows * t.ldy, t.ldy, t.ncols,
                t.bias);
  }
  pagoda::amx::release_tiles();
}

}  // namespace pagoda::bf16_matmul::amx

#endif
