// bf16 GEMM blocks on AVX512-BF16 dot products (vdpbf16ps), for CPUs that
// have them and no AMX (AMD Zen 4 and later, Intel Cooper Lake): the same
// panels the bf16 AMX blocks read ([K / 2, 16, 2] per 16-output panel: one
// 64-byte row is 16 outputs x one k-pair, what one vdpbf16ps takes), fp32
// sums, so a widened quantized layer gets the same math on either CPU up to
// the order of the sums.
//
// A block keeps ROWS x PANELS accumulators (at most 6 x 4 = 24 of the 32
// vector registers): per k-pair it loads PANELS weight rows and broadcasts
// one k-pair of each row of x, ROWS * PANELS dot products.
#pragma once
#include "cpu_common.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PAGODA_BF16_DOT 1

#include <cstring>

namespace pagoda {

constexpr int kDotRows = 6;    // rows of x per block
constexpr int kDotPanels = 4;  // 16-output panels per block

// acc[r * PANELS + p] = sum over k of x[r, k] * panel p[k, :], r < ROWS; x bf16 rows ldx elements apart,
// panel p at panels + p * panel_stride (elements), k_pairs = K / 2.
template <int ROWS, int PANELS>
PAGODA_INLINE void bf16_dot_block(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* panels,
                                  int64_t panel_stride, int64_t k_pairs, __m512* acc) {
  __m512 sum[ROWS * PANELS];  // in registers: acc may alias what the loop loads, so it is written once at the end
#pragma GCC unroll 24
  for (int i = 0; i < ROWS * PANELS; ++i) sum[i] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k_pairs; ++kk) {
    __m512bh w[PANELS];
#pragma GCC unroll 4
    for (int p = 0; p < PANELS; ++p) w[p] = (__m512bh)_mm512_loadu_si512(panels + p * panel_stride + kk * 32);
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * kk, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int p = 0; p < PANELS; ++p) sum[r * PANELS + p] = _mm512_dpbf16_ps(sum[r * PANELS + p], a, w[p]);
    }
  }
#pragma GCC unroll 24
  for (int i = 0; i < ROWS * PANELS; ++i) acc[i] = sum[i];
}

// bf16_dot_block for `rows` <= kDotRows and `panels` <= kDotPanels known only at run time.
template <int ROWS>
PAGODA_INLINE void bf16_dot_rows(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* panels,
                                 int64_t panel_stride, int64_t k_pairs, int64_t count, __m512* acc) {
  switch (count) {
    case 4: bf16_dot_block<ROWS, 4>(x, ldx, panels, panel_stride, k_pairs, acc); break;
    case 3: bf16_dot_block<ROWS, 3>(x, ldx, panels, panel_stride, k_pairs, acc); break;
    case 2: bf16_dot_block<ROWS, 2>(x, ldx, panels, panel_stride, k_pairs, acc); break;
    default: bf16_dot_block<ROWS, 1>(x, ldx, panels, panel_stride, k_pairs, acc); break;
  }
}

inline void bf16_dot(const c10::BFloat16* x, int64_t ldx, int64_t rows, const c10::BFloat16* panels,
                     int64_t panel_stride, int64_t k_pairs, int64_t count, __m512* acc) {
  switch (rows) {
    case 6: bf16_dot_rows<6>(x, ldx, panels, panel_stride, k_pairs, count, acc); break;
    case 5: bf16_dot_rows<5>(x, ldx, panels, panel_stride, k_pairs, count, acc); break;
    case 4: bf16_dot_rows<4>(x, ldx, panels, panel_stride, k_pairs, count, acc); break;
    case 3: bf16_dot_rows<3>(x, ldx, panels, panel_stride, k_pairs, count, acc); break;
    case 2: bf16_dot_rows<2>(x, ldx, panels, panel_stride, k_pairs, count, acc); break;
    default: bf16_dot_rows<1>(x, ldx, panels, panel_stride, k_pairs, count, acc); break;
  }
}

// Panels a widened GEMM on these blocks keeps in L2 while every block of rows passes over them: ~512 KiB of
// bf16 panels (kp * 32 bytes each; half of Zen 4's L2), a multiple of kDotPanels, 4 to 32.
inline int64_t bf16_dot_panel_group(int64_t kp) {
  const int64_t fit = std::max<int64_t>(kDotPanels, std::min<int64_t>(32, (int64_t(1) << 19) / (kp * 32)));
  return fit / kDotPanels * kDotPanels;
}

}  // namespace pagoda
#endif
