// AMX (tile matrix multiply) helpers shared by the C++ extensions: the tile
// configuration and the per-process permission Linux requires.
#pragma once
#include "cpu_common.h"

#if defined(__AMX_TILE__)
#define PAGODA_AMX_TILE 1
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

// The bf16 tile kernels (panel GEMM, prefill attention) need AMX-BF16 and AVX-512-BF16.
#if defined(PAGODA_AMX_TILE) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define PAGODA_AMX 1

namespace pagoda {

// Panels a prefill GEMM keeps in L2 while every 32-row block of x passes over them: as many as fit ~1.5 MiB of
// bf16 panels (kp * 32 bytes each), 16 to 48. Each group streams all of x once more, so fewer, larger groups
// read x fewer times: a SmolLM2 layer's bf16 matmuls at 2,048 rows took 7.40 ms with 16 panels a group, 6.50
// with 32 (K = 576 reaches 48), and a bf16 2,048-token prefill step 434 -> 416 ms (the int8 widened path:
// 388 -> 386, no change), each measured alternating in one process.
inline int64_t prefill_panel_group(int64_t kp) {
  return std::max<int64_t>(16, std::min<int64_t>(48, (int64_t(3) << 19) / (kp * 32)));
}

// A 16 * RT x 16 * PT block of y (RT, PT <= 2) for prefill-sized x: rows
// from x (ldx elements), panels p0 and p1 (= p0 + 1); out [32, 32] fp32.
// Tiles 0-3: C (row tile r, panel t at 2r + t); 4, 6: A; 5, 7: B.
template <int RT, int PT>
PAGODA_INLINE void amx_block(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* p0, const c10::BFloat16* p1,
                             int64_t k_chunks, float* out) {
  _tile_zero(0);
  if constexpr (PT > 1) _tile_zero(1);
  if constexpr (RT > 1) _tile_zero(2);
  if constexpr (RT > 1 && PT > 1) _tile_zero(3);
  const int64_t stride = ldx * int64_t(sizeof(c10::BFloat16));
  for (int64_t kc = 0; kc < k_chunks; ++kc) {
    const c10::BFloat16* a = x + kc * 32;
    _tile_loadd(4, a, stride);
    _tile_loadd(5, p0 + kc * 512, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (RT > 1) {
      _tile_loadd(6, a + 16 * ldx, stride);
      _tile_dpbf16ps(2, 6, 5);
    }
    if constexpr (PT > 1) {
      _tile_loadd(7, p1 + kc * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
      if constexpr (RT > 1) _tile_dpbf16ps(3, 6, 7);
    }
  }
  _tile_stored(0, out, 128);
  if constexpr (PT > 1) _tile_stored(1, out + 16, 128);
  if constexpr (RT > 1) _tile_stored(2, out + 512, 128);
  if constexpr (RT > 1 && PT > 1) _tile_stored(3, out + 528, 128);
}

}  // namespace pagoda
#endif
