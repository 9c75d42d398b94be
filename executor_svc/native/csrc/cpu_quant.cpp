// Linear layers with int8 weights (one scale per output channel) times int8
// activations (one scale per row and per 64 input features, quantized here
// on every call): y = sum_g xs[r, g] * (xq[r, g] . wq[c, g]) * ws[c] (+ bias).
//
// Weights are packed once as 16-output panels of k-quads ([ceil(N / 16),
// Kp / 4, 16, 4] int8, K padded to 64): 64 k of a panel are one 1 KB AMX B
// tile, and one 64-byte row of it is 16 outputs x 4 k, what an AVX512-VNNI
// dot product takes. Each 64-k group's dot product is an exact int32 (one AMX
// tile product), scaled by the row's group scale into fp32 accumulators that
// stay in registers for a 16 x 16 block of y; the channel scales multiply
// once at the end, and y is rounded to x's dtype once.
//
// AMX-INT8 (tdpbssd) where the CPU has it; otherwise AVX512-VNNI (vpdpbusd:
// unsigned x signed, so the weights are the unsigned operand, shifted by 128,
// and 128 * each row's group sums of x taken off again once per row). Threads
// split the panels; a group of panels stays in L2 while every row tile of x
// passes over it, so decode batches read each weight once per step.
#include "cpu_quant.h"
#include "cpu_layer_ops.h"

#include <cmath>
#include <type_traits>
#include <vector>

namespace pagoda::quant {

namespace {

constexpr int64_t kPanelGroup = 8;  // panels a thread keeps in L2 while every row tile passes
constexpr int64_t kTileBytes = kDepth * kCols;  // one 64-k group of a panel: 1 KB

struct Int8Problem {
  const int8_t* xq;
  const float* xs;
  int64_t m, mp, kp, groups, n, panels;
  const int8_t* w;
  const float* ws;
  const int32_t* xsum;  // VNNI: the sum of each row's group of xq [mp, groups]
  bool gated = false;  // linear_int8_silu: y [m, n / 2] = silu(gate) * up of the two halves of the outputs
};

#include "cpu_quant_avx2.h"

template <typename T>
void quantize_row(const T* x, int64_t k, int64_t kp, int64_t group, int8_t* q, float* scale, int32_t* sum) {
  for (int64_t g = 0; g * group < kp; ++g) {
    const int64_t k0 = g * group, n = std::min(group, k - k0);
#if defined(PAGODA_AVX2_INT8) && !defined(__AVX512F__)
    if (n == group) {
      int32_t total = 0;
      const float m = avx2_quantize_group(x + k0, group, q + k0, &total);
      scale[g] = m / 127.f;
      if (sum) sum[g] = total;
      continue;
    }
#endif
#if defined(__AVX512F__)
    __m512 v[4];
    __m512 amax = _mm512_setzero_ps();
    for (int64_t j = 0; j < group / 16; ++j) {
      v[j] = n > 16 * j ? load16(x + k0 + 16 * j, tail_mask(n - 16 * j)) : _mm512_setzero_ps();
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v[j]));
    }
    const float m = _mm512_reduce_max_ps(amax);
    const __m512 inv = _mm512_set1_ps(m > 0.f ? 127.f / m : 0.f);
    int32_t total = 0;
    for (int64_t j = 0; j < group / 16; ++j) {
      const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[j], inv));  // nearest even
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + k0 + 16 * j), _mm512_cvtsepi32_epi8(qi));
      total += _mm512_reduce_add_epi32(qi);
    }
#else
    float m = 0.f;
    for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(to_float(x[k0 + i])));
    const float inv = m > 0.f ? 127.f / m : 0.f;
    int32_t total = 0;
    for (int64_t i = 0; i < group; ++i) {
      const float value = i < n ? to_float(x[k0 + i]) * inv : 0.f;
      const int32_t qi = static_cast<int32_t>(std::max(-127.f, std::min(127.f, std::nearbyint(value))));
      q[k0 + i] = static_cast<int8_t>(qi);
      total += qi;
    }
#endif
    scale[g] = m / 127.f;
    if (sum) sum[g] = total;
  }
}

void check_packed(const at::Tensor& packed, const char* what) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kCols && packed.size(3) == 4 &&
                  packed.scalar_type() == at::kChar && packed.is_contiguous(),
              what, " must come from pack_int8");
  TORCH_CHECK(packed.size(1) * 4 % kDepth == 0, what, " has ", packed.size(1) * 4, " features, not a multiple of 64");
}

#if defined(PAGODA_AMX_INT8)
// Tiles 0-3: C (two pairs of groups), 4-5: A (ROWS rows of x, 64 bytes), 6-7: B (16 k-quads of a panel).
inline void configure_int8_tiles(int rows) {
  pagoda::TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = t < 6 ? rows : 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// Tile C (zeroed) = the x tile of group g . the panel's group g (A and B: the tiles to load them into).
#define PAGODA_INT8_PRODUCT(C, A, B, g)                   \
  do {                                                    \
    _tile_zero(C);                                        \
    _tile_loadd(A, xq + (g) * kDepth, kp);                \
    _tile_loadd(B, panel + (g) * kTileBytes, 64);         \
    _tile_dpbssd(C, A, B);                                \
  } while (0)

// acc[r] = sum_g xs[r * groups + g] * (row r of the x tile . the panel), r < ROWS, 64 k per tile product.
// Groups go in pairs, and the products of the next pair (in the other two C tiles) are issued before this
// pair's sums are stored and scaled, so the tile unit computes while the vector unit scales. The sums are
// added in group order, as one pair at a time would add them.
template <int ROWS>
PAGODA_INLINE void amx_tile_rows(const int8_t* xq, int64_t kp, const float* xs, int64_t groups, const int8_t* panel,
                                 __m512* acc) {
  alignas(64) int32_t c[2][kRows * kCols];
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  auto scale_into = [&](const int32_t* tile, int64_t g) {
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r) {
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(tile + 16 * r));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_set1_ps(xs[r * groups + g]), acc[r]);
    }
  };
  auto prefetch = [&](int64_t g) {  // the panel's lines 4 groups ahead
    const char* ahead = reinterpret_cast<const char*>(panel + (g + 4) * kTileBytes);
#pragma GCC unroll 32
    for (int line = 0; line < 32; ++line) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
  };
  int64_t g = 0;
  if (groups >= 2) {
    prefetch(0);
    PAGODA_INT8_PRODUCT(0, 4, 6, 0);
    PAGODA_INT8_PRODUCT(1, 5, 7, 1);
  }
  for (; g + 1 < groups; g += 2) {
    const bool next = g + 3 < groups;  // another whole pair follows
    if (next) prefetch(g + 2);
    if ((g / 2) % 2 == 0) {  // this pair in C 0-1, the next in C 2-3
      if (next) {
        PAGODA_INT8_PRODUCT(2, 4, 6, g + 2);
        PAGODA_INT8_PRODUCT(3, 5, 7, g + 3);
      }
      _tile_stored(0, c[0], 64);
      _tile_stored(1, c[1], 64);
    } else {
      if (next) {
        PAGODA_INT8_PRODUCT(0, 4, 6, g + 2);
        PAGODA_INT8_PRODUCT(1, 5, 7, g + 3);
      }
      _tile_stored(2, c[0], 64);
      _tile_stored(3, c[1], 64);
    }
    scale_into(c[0], g);
    scale_into(c[1], g + 1);
  }
  if (g < groups) {  // an odd last group
    PAGODA_INT8_PRODUCT(0, 4, 6, g);
    _tile_stored(0, c[0], 64);
    scale_into(c[0], g);
  }
}
#undef PAGODA_INT8_PRODUCT
#endif

#if defined(__AVX512VNNI__)
// dot[r][p] += x . w for one 64-k group of R rows and P panels: vpdpbusd with the weights as its unsigned
// operand (w ^ 0x80 is w + 128 as a byte) and x as the signed one, a dword of x broadcast per row for the P
// panels, so dot = x . w + 128 * sum(x) (below 2^24 in magnitude: exact in fp32). The 128 * sum(x) term does
// not depend on the output column: it is taken off once per row at the end (vnni_row_shift).
template <int R, int P>
PAGODA_INLINE void vnni_block(const int8_t* xq, int64_t kp, const float* xs, int64_t groups, const int8_t* panel,
                              int64_t panel_stride, __m512 (&acc)[R][P]) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[R][P];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) dot[r][p] = _mm512_setzero_si512();
    const int8_t* w = panel + g * kTileBytes;
    const int8_t* xg = xq + g * kDepth;
#pragma GCC unroll 16
    for (int64_t j = 0; j < kDepth / 4; ++j) {
      __m512i wj[P];
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) wj[p] = _mm512_xor_si512(_mm512_load_si512(w + p * panel_stride + 64 * j), flip);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, xg + r * kp + 4 * j, 4);
        const __m512i xj = _mm512_set1_epi32(quad);
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) dot[r][p] = _mm512_dpbusd_epi32(dot[r][p], wj[p], xj);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 scale = _mm512_set1_ps(xs[r * groups + g]);
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][p]), scale, acc[r][p]);
    }
  }
}

// What vnni_block's sums of row r hold beyond x . w: 128 * sum_g xs[g] * sum(x of group g).
inline float vnni_row_shift(const float* xs, const int32_t* xsum, int64_t groups) {
  float shift = 0.f;
  for (int64_t g = 0; g < groups; ++g) shift = std::fma(xs[g], 128.f * static_cast<float>(xsum[g]), shift);
  return shift;
}
#endif

#if defined(__AVX512F__)
// y[row0 + r, 16p : 16p + 16] = acc[r] * ws (+ bias), rows < `rows`, columns < n.
template <typename T>
PAGODA_INLINE void store_rows(const __m512* acc, int64_t rows, const float* ws, const T* bias, T* y, int64_t n,
                              int64_t row0, int64_t p) {
  const int64_t col0 = p * kCols;
  const __mmask16 mask = tail_mask(n - col0);
  const __m512 w_scale = _mm512_maskz_loadu_ps(mask, ws + col0);
  const __m512 add = bias ? load16(bias + col0, mask) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) store16(y + (row0 + r) * n + col0, _mm512_fmadd_ps(acc[r], w_scale, add), mask);
}
#endif

#if defined(PAGODA_AMX_INT8)
// Rows [row0, row0 + ROWS) of y for panels [p0, p1).
template <int ROWS, typename T>
PAGODA_INLINE void amx_rows(const Int8Problem& pr, int64_t row0, int64_t p0, int64_t p1, const T* bias, T* y) {
  __m512 acc[ROWS];
  for (int64_t p = p0; p < p1; ++p) {
    amx_tile_rows<ROWS>(pr.xq + row0 * pr.kp, pr.kp, pr.xs + row0 * pr.groups, pr.groups, pr.w + p * pr.kp * kCols,
                        acc);
    store_rows(acc, std::min<int64_t>(ROWS, pr.m - row0), pr.ws, bias, y, pr.n, row0, p);
  }
}
#endif

#if defined(PAGODA_AMX_INT8) && defined(__AVX512BF16__)
// The fused gate/up layer (linear_int8_silu): rows [row0, row0 + ROWS) of y [m, n / 2] for gate panels [p0, p1),
// each with its up panel (half further on): y = silu(gate) * up, the gate and up values rounded to bf16 as the
// layer's own output would be (store_rows without bias), then silu_and_mul's math.
template <int ROWS>
PAGODA_INLINE void amx_rows_gated(const Int8Problem& pr, int64_t row0, int64_t p0, int64_t p1, BF16* y) {
  const int64_t half = pr.panels / 2, width = pr.n / 2, rows = std::min<int64_t>(ROWS, pr.m - row0);
  __m512 acc[ROWS];
  alignas(64) float gate[ROWS][kCols];
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t p = p0; p < p1; ++p) {
    const int8_t* xq = pr.xq + row0 * pr.kp;
    const float* xs = pr.xs + row0 * pr.groups;
    amx_tile_rows<ROWS>(xq, pr.kp, xs, pr.groups, pr.w + p * pr.kp * kCols, acc);
    const __m512 gate_scale = _mm512_loadu_ps(pr.ws + p * kCols);
    for (int64_t r = 0; r < rows; ++r) _mm512_store_ps(gate[r], _mm512_fmadd_ps(acc[r], gate_scale, zero));
    amx_tile_rows<ROWS>(xq, pr.kp, xs, pr.groups, pr.w + (p + half) * pr.kp * kCols, acc);
    const __m512 up_scale = _mm512_loadu_ps(pr.ws + (p + half) * kCols);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 g = pagoda::round_bf16x16(_mm512_load_ps(gate[r]));
      const __m512 u = pagoda::round_bf16x16(_mm512_fmadd_ps(acc[r], up_scale, zero));
      store16(y + (row0 + r) * width + p * kCols, pagoda::silu_mul_bf16x16(g, u), __mmask16(0xFFFF));
    }
  }
}
#endif

template <typename T>
void run_amx(const Int8Problem& pr, const T* bias, T* y) {
#if defined(PAGODA_AMX_INT8)
  // One row tile (decode batches of up to 16): tiles as tall as the rows, rounded up to 4.
  const int rows = pr.mp > kRows ? int(kRows) : int(round_up(pr.m, 4));
  pagoda::parallel_for(pr.gated ? pr.panels / 2 : pr.panels, 1, [&](int64_t begin, int64_t end) {
    configure_int8_tiles(rows);
    for (int64_t p0 = begin; p0 < end; p0 += kPanelGroup) {
      const int64_t p1 = std::min(end, p0 + kPanelGroup);
      for (int64_t row0 = 0; row0 < pr.mp; row0 += kRows) {
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, BF16>) {
          if (pr.gated) {
            switch (rows) {
              case 4: amx_rows_gated<4>(pr, row0, p0, p1, y); break;
              case 8: amx_rows_gated<8>(pr, row0, p0, p1, y); break;
              case 12: amx_rows_gated<12>(pr, row0, p0, p1, y); break;
              default: amx_rows_gated<16>(pr, row0, p0, p1, y); break;
            }
            continue;
          }
        }
#endif
        switch (rows) {
          case 4: amx_rows<4>(pr, row0, p0, p1, bias, y); break;
          case 8: amx_rows<8>(pr, row0, p0, p1, bias, y); break;
          case 12: amx_rows<12>(pr, row0, p0, p1, bias, y); break;
          default: amx_rows<16>(pr, row0, p0, p1, bias, y); break;
        }
      }
    }
    _tile_release();
  });
#else
  TORCH_CHECK(false, "this build has no AMX-INT8 kernel");
#endif
}

#if defined(PAGODA_AMX_INT8) && defined(PAGODA_AMX)
// One int8 panel ([Kp / 4, 16, 4]) as the bf16 AMX kernel's ([Kp / 2, 16, 2]): the integers, exactly.
void widen_panel(const int8_t* panel, int64_t kp, BF16* out) {
  const __m512i order = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 30, 28, 26, 24,
                                         22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  for (int64_t j = 0; j < kp / 4; ++j) {
    // 16-bit unit 2c + h of a quad row holds k (2h, 2h + 1) of column c: evens are the first pair row.
    const __m512i split = _mm512_permutexvar_epi16(order, _mm512_loadu_si512(panel + 64 * j));
    for (int half = 0; half < 2; ++half) {
      const __m256i bytes = half ? _mm512_extracti64x4_epi64(split, 1) : _mm512_castsi512_si256(split);
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
      BF16* row = out + (2 * j + half) * kCols * 2;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), (__m256i)_mm512_cvtneps_pbh(lo));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 16), (__m256i)_mm512_cvtneps_pbh(hi));
    }
  }
}

#if defined(__AVX512BF16__)
// run_widened of the fused gate/up layer for gate panels [begin, end) (each with its up panel half further
// on), y [m, n / 2]: the sums of a gate and its up panel side by side in one 32 x 32 block, rounded to bf16 as
// the layer's own output would be, then silu_and_mul's math, `pairs` panel pairs widened into `wide` at a time.
inline void gated_widened(const BF16* xd, int64_t mp, const Int8Problem& pr, int64_t begin, int64_t end,
                          int64_t pairs, BF16* wide, float* out, BF16* y) {
  const int64_t kPairs = pairs;
  const int64_t half = pr.panels / 2, width = pr.n / 2, chunks = pr.kp / 32, panel = pr.kp * kCols;
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t g0 = begin; g0 < end; g0 += kPairs) {
    const int64_t g1 = std::min(end, g0 + kPairs);
    for (int64_t p = g0; p < g1; ++p) {
      widen_panel(pr.w + p * panel, pr.kp, wide + 2 * (p - g0) * panel);
      widen_panel(pr.w + (p + half) * panel, pr.kp, wide + (2 * (p - g0) + 1) * panel);
    }
    for (int64_t row0 = 0; row0 < mp; row0 += 2 * kRows) {
      const bool two_rows = row0 + 2 * kRows <= mp;
      const int64_t rows = std::min((two_rows ? 2 : 1) * kRows, pr.m - row0);
      for (int64_t p = g0; p < g1; ++p) {
        const BF16* gate = wide + 2 * (p - g0) * panel;
        if (two_rows) pagoda::amx_block<2, 2>(xd + row0 * pr.kp, pr.kp, gate, gate + panel, chunks, out);
        else pagoda::amx_block<1, 2>(xd + row0 * pr.kp, pr.kp, gate, gate + panel, chunks, out);
        const __m512 gate_scale = _mm512_loadu_ps(pr.ws + p * kCols);
        const __m512 up_scale = _mm512_loadu_ps(pr.ws + (p + half) * kCols);
        for (int64_t r = 0; r < rows; ++r) {
          const __m512 g = pagoda::round_bf16x16(_mm512_fmadd_ps(_mm512_load_ps(out + 32 * r), gate_scale, zero));
          const __m512 u = pagoda::round_bf16x16(_mm512_fmadd_ps(_mm512_load_ps(out + 32 * r + 16), up_scale, zero));
          store16(y + (row0 + r) * width + p * kCols, pagoda::silu_mul_bf16x16(g, u), __mmask16(0xFFFF));
        }
      }
    }
  }
}
#endif

// Large batches (prefill): x rounded to bf16 times the weights widened to bf16 a group of panels at a time
// (never the whole weight), on the bf16 AMX blocks; the channel scales multiply the fp32 sums.
template <typename T>
void run_widened(const at::Tensor& x, const Int8Problem& pr, const T* bias, T* y) {
  const int64_t kGroup = pagoda::prefill_panel_group(pr.kp);
  const int64_t mp = round_up(pr.m, kRows), k = x.size(1), chunks = pr.kp / 32;
  at::Tensor xb = x;  // bf16 rows of kp elements, mp of them (zeros past m)
  if (x.scalar_type() != at::kBFloat16 || mp != pr.m || k != pr.kp || !x.is_contiguous()) {
    xb = at::zeros({mp, pr.kp}, x.options().dtype(at::kBFloat16));
    xb.slice(0, 0, pr.m).slice(1, 0, k).copy_(x);
  }
  const BF16* xd = xb.data_ptr<BF16>();
  pagoda::parallel_for(pr.gated ? pr.panels / 2 : pr.panels, 1, [&](int64_t begin, int64_t end) {
    pagoda::configure_square_tiles();
    thread_local std::vector<BF16> wide;  // reused across calls: a fresh one would be mapped and faulted in each time
    wide.resize(std::max<size_t>(wide.size(), kGroup * pr.kp * kCols));
    alignas(64) float out[32 * 32];
    auto store = [&](const float* tile, int64_t row0, int64_t rows, int64_t p) {
      const int64_t col0 = p * kCols;
      const __mmask16 mask = tail_mask(pr.n - col0);
      const __m512 w_scale = _mm512_maskz_loadu_ps(mask, pr.ws + col0);
      const __m512 add = bias ? load16(bias + col0, mask) : _mm512_setzero_ps();
      for (int64_t r = 0; r < std::min(rows, pr.m - row0); ++r)
        store16(y + (row0 + r) * pr.n + col0, _mm512_fmadd_ps(_mm512_load_ps(tile + 32 * r), w_scale, add), mask);
    };
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, BF16>) {
      if (pr.gated) {  // gate panels [begin, end), each with its up panel: kGroup / 2 pairs widened at a time
        gated_widened(xd, mp, pr, begin, end, kGroup / 2, wide.data(), out, y);
        _tile_release();
        return;
      }
    }
#endif
    for (int64_t g0 = begin; g0 < end; g0 += kGroup) {
      const int64_t g1 = std::min(end, g0 + kGroup);
      for (int64_t p = g0; p < g1; ++p)
        widen_panel(pr.w + p * pr.kp * kCols, pr.kp, wide.data() + (p - g0) * pr.kp * kCols);
      for (int64_t row0 = 0; row0 < mp; row0 += 2 * kRows) {
        const bool two_rows = row0 + 2 * kRows <= mp;
        for (int64_t p = g0; p < g1; p += 2) {
          const BF16* a = wide.data() + (p - g0) * pr.kp * kCols;
          const BF16* b = a + pr.kp * kCols;
          const bool two_panels = p + 1 < g1;
          const BF16* xr = xd + row0 * pr.kp;
          if (two_rows && two_panels) pagoda::amx_block<2, 2>(xr, pr.kp, a, b, chunks, out);
          else if (two_rows) pagoda::amx_block<2, 1>(xr, pr.kp, a, b, chunks, out);
          else if (two_panels) pagoda::amx_block<1, 2>(xr, pr.kp, a, b, chunks, out);
          else pagoda::amx_block<1, 1>(xr, pr.kp, a, b, chunks, out);
          const int64_t rows = two_rows ? 2 * kRows : kRows;
          store(out, row0, rows, p);
          if (two_panels) store(out + 16, row0, rows, p + 1);
        }
      }
    }
    _tile_release();
  });
}
#endif

#if defined(__AVX512VNNI__)
// Rows [row0, row0 + R) x panels [p, p + P) of y (P whole panels; rows past m not stored). Not inlined: one
// function per block shape keeps each one's registers its own. With every shape inlined into run_vnni, GCC
// 12's code for the 2 x 4 block loaded from a garbage address (a pointer kept in a vector register); the same
// block alone, and every shape out of line, run clean. A block is thousands of dot products: the call is free.
template <int R, int P, typename T>
__attribute__((noinline)) void vnni_rows_panels(const Int8Problem& pr, int64_t row0, int64_t p, const float* shift,
                                                const T* bias, T* y) {
  __m512 acc[R][P];
  const int64_t panel_stride = pr.kp * kCols;
  vnni_block<R, P>(pr.xq + row0 * pr.kp, pr.kp, pr.xs + row0 * pr.groups, pr.groups, pr.w + p * panel_stride,
                   panel_stride, acc);
  const int64_t rows = std::min<int64_t>(R, pr.m - row0);
  for (int q = 0; q < P; ++q) {
    __m512 out[R];
    for (int r = 0; r < R; ++r) out[r] = _mm512_sub_ps(acc[r][q], _mm512_set1_ps(shift[row0 + r]));
    store_rows(out, rows, pr.ws, bias, y, pr.n, row0, p + q);
  }
}

#if defined(__AVX512BF16__)
// The fused gate/up layer on VNNI: rows [row0, row0 + R) of y [m, n / 2] for gate panel p, computed in one
// block with its up panel (half further on), each rounded to bf16 as the layer's own output would be
// (vnni_rows_panels' store without bias), then silu_and_mul's math.
template <int R>
__attribute__((noinline)) void vnni_rows_gated(const Int8Problem& pr, int64_t row0, int64_t p, const float* shift,
                                               BF16* y) {
  __m512 acc[R][2];
  const int64_t panel_stride = pr.kp * kCols, half = pr.panels / 2, width = pr.n / 2;
  vnni_block<R, 2>(pr.xq + row0 * pr.kp, pr.kp, pr.xs + row0 * pr.groups, pr.groups, pr.w + p * panel_stride,
                   half * panel_stride, acc);
  const __m512 gate_scale = _mm512_loadu_ps(pr.ws + p * kCols), up_scale = _mm512_loadu_ps(pr.ws + (p + half) * kCols);
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t r = 0; r < std::min<int64_t>(R, pr.m - row0); ++r) {
    const __m512 off = _mm512_set1_ps(shift[row0 + r]);
    const __m512 g = pagoda::round_bf16x16(_mm512_fmadd_ps(_mm512_sub_ps(acc[r][0], off), gate_scale, zero));
    const __m512 u = pagoda::round_bf16x16(_mm512_fmadd_ps(_mm512_sub_ps(acc[r][1], off), up_scale, zero));
    store16(y + (row0 + r) * width + p * kCols, pagoda::silu_mul_bf16x16(g, u), __mmask16(0xFFFF));
  }
}
#endif

// Rows [row0, row0 + R) for panels [p0, p1): blocks of P panels (R x P sums in registers: 6 x 2 for prefill
// steps, more panels for fewer rows), then one panel at a time for the rest.
template <int R, typename T>
PAGODA_INLINE void vnni_rows_span(const Int8Problem& pr, int64_t row0, int64_t p0, int64_t p1, const float* shift,
                                  const T* bias, T* y) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, BF16>) {
    if (pr.gated) {  // [p0, p1) are gate panels
      for (int64_t p = p0; p < p1; ++p) vnni_rows_gated<R>(pr, row0, p, shift, y);
      return;
    }
  }
#endif
  constexpr int P = R <= 2 ? 4 : R <= 4 ? 3 : 2;
  int64_t p = p0;
  for (; p + P <= p1; p += P) vnni_rows_panels<R, P>(pr, row0, p, shift, bias, y);
  for (; p < p1; ++p) vnni_rows_panels<R, 1>(pr, row0, p, shift, bias, y);
}
#endif

template <typename T>
void run_vnni(const Int8Problem& pr, const T* bias, T* y) {
#if defined(__AVX512VNNI__)
  constexpr int64_t kMr = 6;  // rows per block
  std::vector<float> shift(round_up(pr.m, kMr));  // 0 past m
  for (int64_t r = 0; r < pr.m; ++r) shift[r] = vnni_row_shift(pr.xs + r * pr.groups, pr.xsum + r * pr.groups, pr.groups);
  // The fused gate/up layer splits its gate panels (each with its up panel): half the panels of a group.
  const int64_t group = pr.gated ? kPanelGroup / 2 : kPanelGroup;
  pagoda::parallel_for(pr.gated ? pr.panels / 2 : pr.panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p0 = begin; p0 < end; p0 += group) {
      const int64_t p1 = std::min(end, p0 + group);
      for (int64_t row0 = 0; row0 < pr.m; row0 += kMr) {
        switch (std::min(kMr, pr.m - row0)) {
          case 6: vnni_rows_span<6>(pr, row0, p0, p1, shift.data(), bias, y); break;
          case 5: vnni_rows_span<5>(pr, row0, p0, p1, shift.data(), bias, y); break;
          case 4: vnni_rows_span<4>(pr, row0, p0, p1, shift.data(), bias, y); break;
          case 3: vnni_rows_span<3>(pr, row0, p0, p1, shift.data(), bias, y); break;
          case 2: vnni_rows_span<2>(pr, row0, p0, p1, shift.data(), bias, y); break;
          default: vnni_rows_span<1>(pr, row0, p0, p1, shift.data(), bias, y); break;
        }
      }
    }
  });
#elif defined(PAGODA_AVX2_INT8)
  run_avx2(pr, bias, y);  // exact int8 dot products: no shift to take off
#else
  TORCH_CHECK(false, "this build has no AVX512-VNNI or AVX2 int8 kernel");
#endif
}

constexpr bool pagoda_amx_bf16() {
#if defined(PAGODA_AMX)
  return true;
#else
  return false;
#endif
}

}  // namespace

bool amx_int8_ready() {
#if defined(PAGODA_AMX_INT8)
  return pagoda::request_amx();
#else
  return false;
#endif
}

QuantizedRows quantize_rows(const at::Tensor& x, int64_t group, bool with_sums) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a 2-D float32 or bfloat16 CPU tensor");
  TORCH_CHECK(group == 32 || group == 64, "the quantization group must be 32 or 64, got ", group);
  const auto xc = x.stride(1) == 1 ? x : x.contiguous();
  const int64_t m = xc.size(0), k = xc.size(1), mp = round_up(std::max<int64_t>(m, 1), kRows);
  const int64_t kp = round_up(k, kDepth), groups = kp / group;
  QuantizedRows out{at::zeros({mp, kp}, x.options().dtype(at::kChar)),
                    at::zeros({mp, groups}, x.options().dtype(at::kFloat)),
                    with_sums ? at::zeros({mp, groups}, x.options().dtype(at::kInt)) : at::Tensor(),
                    m, mp, kp, groups};
  int8_t* q = out.q.data_ptr<int8_t>();
  float* scale = out.scale.data_ptr<float>();
  int32_t* sum = with_sums ? out.sum.data_ptr<int32_t>() : nullptr;
  const int64_t ldx = xc.stride(0);
  AT_DISPATCH_V2(xc.scalar_type(), "quantize_rows", AT_WRAP([&] {
    const scalar_t* xd = xc.data_ptr<scalar_t>();
    pagoda::parallel_for(m, 8, [&](int64_t begin, int64_t end) {  // a decode batch's rows split too
      for (int64_t r = begin; r < end; ++r)
        quantize_row(xd + r * ldx, k, kp, group, q + r * kp, scale + r * groups, sum ? sum + r * groups : nullptr);
    });
  }), at::kFloat, at::kBFloat16);
  return out;
}

// x [M, K] -> (q [Mp, Kp] int8, scales [Mp, Kp / group] fp32, sums [Mp, Kp / group] int32): what the
// quantized GEMMs compute with (exposed for tests and references).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows_int8(const at::Tensor& x, int64_t group) {
  auto rows = quantize_rows(x, group, true);
  return {rows.q, rows.scale, rows.sum};
}

// q [N, K] int8 -> [ceil(N / 16), Kp / 4, 16, 4] (zero-padded past N and K).
at::Tensor pack_int8(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.device().is_cpu(),
              "weight must be a 2-D int8 CPU tensor");
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kCols - 1) / kCols, kp = round_up(k, kDepth);
  auto packed = at::zeros({panels, kp / 4, kCols, 4}, w.options());
  const int8_t* src = w.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  pagoda::parallel_for(panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < std::min(kCols, n - p * kCols); ++c) {
        const int8_t* row = src + (p * kCols + c) * k;
        int8_t* out = dst + p * kp * kCols + c * 4;
        for (int64_t i = 0; i < k; ++i) out[(i / 4) * kCols * 4 + i % 4] = row[i];
      }
  });
  return packed;
}

// x [M, K] fp32 / bf16 @ (packed * scales)^T (+ bias [N], x's dtype) -> [M, N] in x's dtype. With vnni the
// AVX512-VNNI kernel runs (int8 activations at any M), else AMX-INT8 up to widen_above rows and the widened
// bf16 path past them.
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t n,
                       const std::optional<at::Tensor>& bias, bool vnni, int64_t widen_above) {
  check_packed(packed, "packed weight");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a 2-D float32 or bfloat16 CPU tensor");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0), kp = packed.size(1) * 4;
  TORCH_CHECK(kp == round_up(k, kDepth), "x has ", k, " features, the weight expects ", kp, " (padded)");
  TORCH_CHECK(n > (panels - 1) * kCols && n <= panels * kCols, "out_features ", n, " does not match the packed weight");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == n && scales.is_contiguous(),
              "scales must be float32 [", n, "]");
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == x.scalar_type() && b.numel() == n, "bias must be ", x.scalar_type(), " [", n, "]");
  }
  TORCH_CHECK(vnni || amx_int8_ready(), "the AMX-INT8 path needs AMX-INT8 (vnni=True for the VNNI path)");
  auto y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const bool widen = !vnni && m > widen_above;
  TORCH_CHECK(!widen || pagoda_amx_bf16(), "this build cannot widen int8 weights to bf16 (no AMX-BF16)");
  const QuantizedRows rows = widen ? QuantizedRows{} : quantize_rows(x, kDepth, vnni);
  Int8Problem problem{widen ? nullptr : rows.q.data_ptr<int8_t>(), widen ? nullptr : rows.scale.data_ptr<float>(),
                      m, widen ? 0 : rows.mp, kp, kp / kDepth, n, panels, packed.data_ptr<int8_t>(),
                      scales.data_ptr<float>(), vnni ? rows.sum.data_ptr<int32_t>() : nullptr};
#if defined(__AVX512F__) || defined(PAGODA_AVX2_INT8)
  AT_DISPATCH_V2(x.scalar_type(), "linear_int8", AT_WRAP([&] {
    const scalar_t* bd = b.defined() ? b.data_ptr<scalar_t>() : nullptr;
    scalar_t* yd = y.data_ptr<scalar_t>();
    if (vnni) run_vnni<scalar_t>(problem, bd, yd);
#if defined(PAGODA_AMX_INT8) && defined(PAGODA_AMX)
    else if (widen) run_widened<scalar_t>(x, problem, bd, yd);
#endif
    else run_amx<scalar_t>(problem, bd, yd);
  }), at::kFloat, at::kBFloat16);
#else
  TORCH_CHECK(false, "this build has no int8 kernel (needs AVX-512, or AVX2 + FMA)");
#endif
  return y;
}

// The fused gate/up layer of a SwiGLU block: silu_and_mul(linear_int8(x, packed, scales, n, None, vnni,
// widen_above)) in one pass, the same bits. packed holds the gate rows then the up rows (n / 2 each, a whole
// number of 16-output panels); x bf16 [M, K] -> [M, n / 2] bf16. AMX-INT8 (vnni false) or AVX512-VNNI, with
// AVX-512-BF16.
at::Tensor linear_int8_silu(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t n,
                            bool vnni, int64_t widen_above) {
  check_packed(packed, "packed weight");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be a 2-D bfloat16 CPU tensor");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0), kp = packed.size(1) * 4;
  TORCH_CHECK(kp == round_up(k, kDepth), "x has ", k, " features, the weight expects ", kp, " (padded)");
  TORCH_CHECK(n == panels * kCols && panels % 2 == 0,
              "out_features ", n, " must be gate and up halves of whole 16-output panels");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == n && scales.is_contiguous(),
              "scales must be float32 [", n, "]");
  TORCH_CHECK(vnni || amx_int8_ready(), "the fused gate/up layer needs AMX-INT8 (vnni=True for the VNNI path)");
  auto y = at::empty({m, n / 2}, x.options());
  if (m == 0) return y;
#if defined(__AVX512BF16__) && (defined(__AVX512VNNI__) || (defined(PAGODA_AMX_INT8) && defined(PAGODA_AMX)))
  const bool widen = !vnni && m > widen_above;
  const QuantizedRows rows = widen ? QuantizedRows{} : quantize_rows(x, kDepth, vnni);
  Int8Problem problem{widen ? nullptr : rows.q.data_ptr<int8_t>(), widen ? nullptr : rows.scale.data_ptr<float>(),
                      m, widen ? 0 : rows.mp, kp, kp / kDepth, n, panels, packed.data_ptr<int8_t>(),
                      scales.data_ptr<float>(), vnni ? rows.sum.data_ptr<int32_t>() : nullptr};
  problem.gated = true;
  BF16* yd = y.data_ptr<BF16>();
  if (vnni) run_vnni<BF16>(problem, nullptr, yd);
#if defined(PAGODA_AMX_INT8) && defined(PAGODA_AMX)
  else if (widen) run_widened<BF16>(x, problem, nullptr, yd);
  else run_amx<BF16>(problem, nullptr, yd);
#endif
#else
  TORCH_CHECK(false, "this build has no fused gate/up kernel (needs AVX-512-BF16 with AVX512-VNNI or AMX)");
#endif
  return y;
}

}  // namespace pagoda::quant

// linear_int8 needs amx_int8_ready() (AMX path) or "avx512_vnni" in cpu_features() (VNNI path).
TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("quantize_rows_int8", &pagoda::quant::quantize_rows_int8);
  m.impl("pack_int8", &pagoda::quant::pack_int8);
  m.impl("linear_int8", &pagoda::quant::linear_int8);
  m.impl("linear_int8_silu", &pagoda::quant::linear_int8_silu);
}
