// Intel AMX (Advanced Matrix Extensions, Sapphire Rapids and later): whether this process may use the tiles,
// and the one tile shape every Pagoda kernel uses, 16 rows of 64 bytes (16 x 32 bfloat16, or 16 x 16 float32
// sums). Kernels are compiled for AMX by target attribute (PAGODA_AMX_TARGET) and called where usable(): so a
// library built for the avx512bf16 level without AMX flags (a prebuilt one) uses AMX too where the CPU has it.
// PAGODA_CPU_AMX=0 (pagoda.platform.isa checks its value) leaves the tiles unused: an AMX host then runs, tests
// and measures the kernels of a CPU without them (Zen 4's vdpbf16ps ones).
#pragma once

#include "cpu_isa.h"

#if defined(PAGODA_ISA_AVX512BF16) && defined(__x86_64__) && defined(__linux__) && \
    (defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 11))
#define PAGODA_HAVE_AMX 1

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#define PAGODA_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

namespace pagoda::amx {

constexpr int64_t kTileRows = 16;    // rows of a tile
constexpr int64_t kTileKPairs = 16;  // bfloat16 pairs in a row: 32 values, 64 bytes (a float32 tile: 16 sums)

// Whether this CPU has AMX-BF16 and this process may use its tiles (asked once: Linux hands the tile state
// out per process on request, ARCH_REQ_XCOMP_PERM for XTILEDATA), and PAGODA_CPU_AMX does not say 0
inline bool usable() {
  static const bool ok = [] {
    const char* setting = std::getenv("PAGODA_CPU_AMX");
    if (setting != nullptr && std::strcmp(setting, "0") == 0) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
    const bool amx_bf16 = edx & (1u << 22), amx_tile = edx & (1u << 24);
    if (!amx_bf16 || !amx_tile) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Tile configuration (palette 1): all 8 tiles 64 bytes wide and 16 rows high, or fewer rows where given
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int i = 0; i < 8; ++i) {
      colsb[i] = 64;
      rows[i] = kTileRows;
    }
  }
};

// Loads the configuration on this thread (a kernel calls it before its tiles, and release_tiles() after);
// the default one: every tile 16 rows
// (the empty asm: GCC does not count ldtilecfg as a read of the configuration, and may drop the stores that fill
// a local one)
PAGODA_AMX_TARGET inline void load_tile_config(const TileConfig& config) {
  asm volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}
PAGODA_AMX_TARGET inline void load_tile_config() {
  static const TileConfig config;
  load_tile_config(config);
}
PAGODA_AMX_TARGET inline void release_tiles() { _tile_release(); }

}  // namespace pagoda::amx

#endif
