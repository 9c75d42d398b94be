// The int8 GEMM on AVX2 + FMA, for CPUs without AVX512-VNNI (AMD Zen 2 / Zen 3,
// Intel before Ice Lake): the same math as the VNNI and AMX-INT8 kernels
// (cpu_quant.cpp): int8 weights in pack_int8's panels, int8 activations with a
// scale per row and 64 features, each group's dot product an exact int32.
//
// vpmaddubsw multiplies unsigned by signed bytes, so |x| is its unsigned
// operand and x's sign moves onto w (vpsignb: -w where x < 0, 0 where x = 0).
// With |x| <= 127 and |w| <= 127 a pair's sum stays within 2 * 127 * 127 =
// 32,258 < 2^15, so vpmaddubsw never saturates, and vpmaddwd by ones sums the
// pairs into the exact 4-k dot product of each output. Four instructions per
// 32 multiply-adds, two of them on the multiply pipes: twice the fp32 FMA rate.
//
// Included by cpu_quant.cpp inside its anonymous namespace, after Int8Problem.
#pragma once

#if defined(PAGODA_AVX2_INT8)

// The group scaling adds into fp32 accumulators in group order: y's bits do not depend on the block's shape,
// so a row's output is the same in any batch.
template <int R, int P>
PAGODA_INLINE void avx2_block(const int8_t* xq, int64_t kp, const float* xs, int64_t groups, const int8_t* panel,
                              int64_t panel_stride, float (&acc)[R][P][kCols]) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p)
      for (int64_t c = 0; c < kCols; ++c) acc[r][p][c] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    __m256i dot[R][P][2];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) dot[r][p][0] = dot[r][p][1] = _mm256_setzero_si256();
    const int8_t* w = panel + g * kTileBytes;
    const int8_t* xg = xq + g * kDepth;
#pragma GCC unroll 4
    for (int64_t j = 0; j < kDepth / 4; ++j) {
      __m256i x[R], x_abs[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        int32_t quad;
        std::memcpy(&quad, xg + r * kp + 4 * j, 4);
        x[r] = _mm256_set1_epi32(quad);
        x_abs[r] = _mm256_abs_epi8(x[r]);
      }
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p)
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * panel_stride + 64 * j + 32 * h));
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) {
            const __m256i pairs = _mm256_maddubs_epi16(x_abs[r], _mm256_sign_epi8(wv, x[r]));
            dot[r][p][h] = _mm256_add_epi32(dot[r][p][h], _mm256_madd_epi16(pairs, ones));
          }
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256 scale = _mm256_set1_ps(xs[r * groups + g]);
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p)
        for (int h = 0; h < 2; ++h) {
          float* a = acc[r][p] + 8 * h;
          _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][p][h]), scale, _mm256_loadu_ps(a)));
        }
    }
  }
}

// y_row[col0 : col0 + 16] = acc * ws (+ bias), columns < n (the same fma per output in the tail).
template <typename T>
PAGODA_INLINE void avx2_store_panel(const float* acc, const float* ws, const T* bias, T* y_row, int64_t n,
                                    int64_t col0) {
  if (col0 + kCols <= n) {
    __m256 out[2];
    for (int h = 0; h < 2; ++h) {
      const __m256 add = bias ? avx2_load8(bias + col0 + 8 * h) : _mm256_setzero_ps();
      out[h] = _mm256_fmadd_ps(_mm256_loadu_ps(acc + 8 * h), _mm256_loadu_ps(ws + col0 + 8 * h), add);
    }
    avx2_store16(y_row + col0, out[0], out[1]);
    return;
  }
  for (int64_t c = 0; c < n - col0; ++c)
    y_row[col0 + c] = T(std::fma(acc[c], ws[col0 + c], bias ? to_float(bias[col0 + c]) : 0.f));
}

// Rows [row0, row0 + R) x panels [p, p + P) of y (rows past m not stored). Out of line: each block shape keeps
// its registers to itself (as vnni_rows_panels).
template <int R, int P, typename T>
__attribute__((noinline)) void avx2_rows_panels(const Int8Problem& pr, int64_t row0, int64_t p, const T* bias, T* y) {
  alignas(32) float acc[R][P][kCols];
  const int64_t panel_stride = pr.kp * kCols;
  avx2_block<R, P>(pr.xq + row0 * pr.kp, pr.kp, pr.xs + row0 * pr.groups, pr.groups, pr.w + p * panel_stride,
                   panel_stride, acc);
  for (int64_t r = 0; r < std::min<int64_t>(R, pr.m - row0); ++r)
    for (int q = 0; q < P; ++q) avx2_store_panel(acc[r][q], pr.ws, bias, y + (row0 + r) * pr.n, pr.n, (p + q) * kCols);
}

// Rows [row0, row0 + R) for panels [p0, p1): blocks of P panels, then one panel at a time.
template <int R, int P, typename T>
PAGODA_INLINE void avx2_rows_span(const Int8Problem& pr, int64_t row0, int64_t p0, int64_t p1, const T* bias, T* y) {
  int64_t p = p0;
  for (; p + P <= p1; p += P) avx2_rows_panels<R, P>(pr, row0, p, bias, y);
  for (; p < p1; ++p) avx2_rows_panels<R, 1>(pr, row0, p, bias, y);
}

// Threads split the panels; a group of panels stays in L2 while every pair of rows passes over it (2 rows x 2
// panels: 8 int32 sums, 4 row registers and a weight vector in the 16 ymm registers; a lone row: 4 panels).
template <typename T>
void run_avx2(const Int8Problem& pr, const T* bias, T* y) {
  TORCH_CHECK(!pr.gated, "this build has no fused gate/up int8 kernel (needs AVX-512-BF16)");
  pagoda::parallel_for(pr.panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p0 = begin; p0 < end; p0 += kPanelGroup) {
      const int64_t p1 = std::min(end, p0 + kPanelGroup);
      for (int64_t row0 = 0; row0 < pr.m; row0 += 2) {
        if (pr.m - row0 >= 2)
          avx2_rows_span<2, 2>(pr, row0, p0, p1, bias, y);
        else
          avx2_rows_span<1, 4>(pr, row0, p0, p1, bias, y);
      }
    }
  });
}

// One group of a row quantized (n = group features, no tail): what quantize_row's scalar loop computes.
template <typename T>
PAGODA_INLINE float avx2_quantize_group(const T* x, int64_t group, int8_t* q, int32_t* total) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  for (int64_t i = 0; i < group; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, avx2_load8(x + i)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, amax);
  float m = 0.f;
  for (float lane : lanes) m = std::max(m, lane);
  const __m256 inv = _mm256_set1_ps(m > 0.f ? 127.f / m : 0.f);
  __m256i sum = _mm256_setzero_si256();
  for (int64_t i = 0; i < group; i += 8) {
    const __m256i qi = _mm256_cvtps_epi32(_mm256_mul_ps(avx2_load8(x + i), inv));  // nearest even, |qi| <= 127
    sum = _mm256_add_epi32(sum, qi);
    const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(qi), _mm256_extracti128_si256(qi, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(q16, q16));
  }
  alignas(32) int32_t sums[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(sums), sum);
  *total = 0;
  for (int32_t s : sums) *total += s;
  return m;
}
#endif
