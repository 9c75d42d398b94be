// AMX (tile matrix multiply) helpers shared by the C++ extensions: the tile
// configuration and the per-process permission Linux requires.
#pragma once
#include "cpu_common.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGODA_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

namespace pagoda {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Configures all 8 tiles as 16 rows x 64 bytes (bf16 16 x 32, fp32 16 x 16)
// for the calling thread; pair with _tile_release().
inline void configure_square_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// Linux keeps AMX state off until the process asks (ARCH_REQ_XCOMP_PERM for XTILEDATA).
inline bool request_amx() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

}  // namespace pagoda
#endif
