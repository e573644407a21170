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

// Where the time goes: a step's four tile products take 64 cycles and read 4 KB of tiles, which L1 serves
// (all eight tiles from L1: ~3 TFLOP/s a core) and L2 does not (~1 TFLOP/s once a block and its rows of x
// outgrow L1's 48 KB). So x, which passes once a block, is loaded with the streaming hint (tileloaddt1) and
// does not evict the block, and a block is run in passes over at most kPassPairs k-pairs (36 KB of weights:
// K = 576 in one pass, 1,536 in three of 256), its float32 sums carried between passes in `carried`.
// 30 layers' matmuls of a 1,500-token prompt (the default model, two cores of a Xeon with AMX, same hour):
// 177-196 -> 153-160 ms, within 10 % of oneDNN's; passes of 192 or 384 pairs were slower.
constexpr int64_t kPassPairs = 288;
constexpr int64_t kMaxCarriedRows = 256;  // rows a task's passes carry: 256 x 32 float32 sums, 32 KB

// One step: x's 32 rows at `x` (16 where !two) against the block's k-pairs [p0, p1), sums in tiles 0-3, zeroed
// on the first pass or loaded from `carried`; stored after to `carried`, or on the last pass to `sums`.
PAGODA_AMX_TARGET inline void step(const BlockTask& t, const bf16* x, bool two, int64_t p0, int64_t p1,
                                   float* carried, bool last_pass, float* sums) {
  const int64_t x_stride = t.ldx * sizeof(bf16), block_stride = 2 * kBlockN * sizeof(bf16);  // bytes
  constexpr int64_t kSumsStride = 32 * sizeof(float);
  if (p0 == 0) {
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
      _tile_zero(2);
      _tile_zero(3);
    }
  } else {
    _tile_loadd(0, carried, kSumsStride);
    _tile_loadd(1, carried + 16, kSumsStride);
    if (two) {
      _tile_loadd(2, carried + kTileRows * 32, kSumsStride);
      _tile_loadd(3, carried + kTileRows * 32 + 16, kSumsStride);
    }
  }
  if (two) {
    // software-pipelined: each input tile is loaded for the next k-pairs as soon as the products that read it are
    // issued, so the loads run under this step's later products. With the four loads before the four products,
    // the products waited on each step's loads: one process alternating the two, the default model's four
    // matmuls at 1,500 rows took 4.56 -> 4.43 ms a layer (median, 8 of 8 pairs faster; two Xeon cores with AMX)
    const bf16* x1 = x + kTileRows * t.ldx;
    const bf16* w = t.block + p0 * 2 * kBlockN;
    _tile_stream_loadd(4, x + 2 * p0, x_stride);
    _tile_loadd(6, w, block_stride);
    _tile_loadd(7, w + 32, block_stride);
    _tile_stream_loadd(5, x1 + 2 * p0, x_stride);
    for (int64_t p = p0; p < p1; p += kTileKPairs) {
      const int64_t q = p + kTileKPairs;
      const bf16* wq = t.block + q * 2 * kBlockN;
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (q < p1) _tile_stream_loadd(4, x + 2 * q, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      if (q < p1) _tile_loadd(6, wq, block_stride);
      _tile_dpbf16ps(3, 5, 7);
      if (q < p1) {
        _tile_loadd(7, wq + 32, block_stride);
        _tile_stream_loadd(5, x1 + 2 * q, x_stride);
      }
    }
  } else {  // a last tile alone: half the work
    for (int64_t p = p0; p < p1; p += kTileKPairs) {
      const bf16* w = t.block + p * 2 * kBlockN;
      _tile_stream_loadd(4, x + 2 * p, x_stride);
      _tile_loadd(6, w, block_stride);
      _tile_loadd(7, w + 32, block_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
    }
  }
  float* out = last_pass ? sums : carried;
  _tile_stored(0, out, kSumsStride);
  _tile_stored(1, out + 16, kSumsStride);
  if (two) {
    _tile_stored(2, out + kTileRows * 32, kSumsStride);
    _tile_stored(3, out + kTileRows * 32 + 16, kSumsStride);
  }
}

// t.rows rows of x against one block; t.k_pairs a multiple of 16. A step takes two tiles of 16 rows and both
// halves of the block (four sum tiles); the last rows (fewer than 16) take tiles of as many rows, under a
// configuration of their own, so that no tile reads past x; the block in passes as above. Releases the tiles
// after.
template <typename OutT>
PAGODA_AMX_TARGET void rows_against_block(const BlockTask& t, OutT* y) {
  alignas(64) float sums[kGroupRows * 32];
  alignas(64) float carried[kMaxCarriedRows * 32];
  const int64_t passes = (t.k_pairs + kPassPairs - 1) / kPassPairs;  // of equal length, in whole tiles
  const int64_t pass_pairs = (t.k_pairs / kTileKPairs + passes - 1) / passes * kTileKPairs;
  for (int64_t r0 = 0; r0 < t.rows; r0 += kMaxCarriedRows) {
    const int64_t rows = std::min(kMaxCarriedRows, t.rows - r0);
    const int64_t whole = rows / kTileRows, last_rows = rows % kTileRows;
    const int64_t tiles = whole + (last_rows > 0 ? 1 : 0);
    for (int64_t p0 = 0; p0 < t.k_pairs; p0 += pass_pairs) {
      const int64_t p1 = std::min(p0 + pass_pairs, t.k_pairs);
      const bool last_pass = p1 == t.k_pairs;
      load_tile_config();
      for (int64_t i = 0; i < tiles; i += 2) {
        const bool two = i + 1 < tiles;
        if (last_rows > 0 && i + (two ? 1 : 0) == whole) {  // this step holds the last rows: their x tile (4
          pagoda::amx::TileConfig config;                  // alone, 5 with another) and its sum tiles have
          const int shorter[3] = {two ? 5 : 4, two ? 2 : 0, two ? 3 : 1};  // as many rows
          for (int tile : shorter) config.rows[tile] = static_cast<uint8_t>(last_rows);
          load_tile_config(config);
        }
        step(t, t.x + (r0 + i * kTileRows) * t.ldx, two, p0, p1, carried + i * kTileRows * 32, last_pass, sums);
        if (last_pass)
          store_group(sums, std::min(kGroupRows, rows - i * kTileRows), y + (r0 + i * kTileRows) * t.ldy, t.ldy,
                      t.ncols, t.bias);
      }
    }
  }
  pagoda::amx::release_tiles();
}

}  // namespace pagoda::bf16_matmul::amx

#endif
