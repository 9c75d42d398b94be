// Decode attention's tile step on AVX2 + FMA (builds without AVX-512), for
// head dims that are a multiple of 8 up to 256: the portable path's widened
// tiles (cpu_kernel.cpp) scored and accumulated with intrinsics.
//
// Scores: each key's D / 8 partial sums stay in one register, and 8 keys'
// registers reduce to their 8 dot products in one ymm by a transpose-add tree
// (hadd pairs, then the two 128-bit halves), not a horizontal sum per key.
// The softmax runs on the tile's 16 scores as two ymm (exp8), and P.V adds
// each value row into the query's accumulators, 64 features (8 registers) at a
// time. The same online-softmax state as the portable step.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#include <cmath>
#include <limits>

#define PAGODA_AVX2_ATTENTION 1

namespace pagoda_avx2 {

// exp of 8 floats: 2^n * e^r, n = round(x / ln2), |r| <= ln2 / 2; degree-7 Taylor polynomial (truncation
// below 1e-8 relative; degree 6 left ~2e-7, which peaked softmaxes turned into 3.6e-6 on fp32 outputs).
PAGODA_INLINE __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  // 2^n built in the exponent bits: n in [-126, 127] after the clamp above.
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

PAGODA_INLINE float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

PAGODA_INLINE float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The dot products of the query with keys [0, 8) of `keys` ([8, D] fp32, rows D apart), as one ymm.
PAGODA_INLINE __m256 dots8(const float* keys, const float* query, int64_t head_dim) {
  __m256 s[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) s[i] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 8) {
    const __m256 q = _mm256_loadu_ps(query + d);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) s[i] = _mm256_fmadd_ps(q, _mm256_loadu_ps(keys + i * head_dim + d), s[i]);
  }
  // hadd(a, b) = a0+a1, a2+a3, b0+b1, b2+b3 | the same of the high halves: three levels leave, per 128-bit
  // half, the partial dots of keys 0-3 (low half's lanes 0-3 from s[0..3] low, high half's from s[0..3] high).
  const __m256 s01 = _mm256_hadd_ps(s[0], s[1]), s23 = _mm256_hadd_ps(s[2], s[3]);
  const __m256 s45 = _mm256_hadd_ps(s[4], s[5]), s67 = _mm256_hadd_ps(s[6], s[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  // s0123: [k0 k1 k2 k3 (low halves) | k0 k1 k2 k3 (high halves)]; the same for keys 4-7.
  const __m256 lows = _mm256_permute2f128_ps(s0123, s4567, 0x20), highs = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lows, highs);
}

// acc[0, D) = acc * alpha + sum_i probs[i] * values[i] over `count` rows ([count, D] fp32).
PAGODA_INLINE void accumulate(const float* values, const float* probs, int64_t count, int64_t head_dim, float alpha,
                              float* acc) {
  const __m256 scale = _mm256_set1_ps(alpha);
  for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
    const int chunks = static_cast<int>(std::min<int64_t>(64, head_dim - d0) / 8);
    __m256 a[8];
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c)
      if (c < chunks) a[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + d0 + 8 * c), scale);
    for (int64_t i = 0; i < count; ++i) {
      const __m256 p = _mm256_broadcast_ss(probs + i);
      const float* row = values + i * head_dim + d0;
#pragma GCC unroll 8
      for (int c = 0; c < 8; ++c)
        if (c < chunks) a[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(row + 8 * c), a[c]);
    }
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c)
      if (c < chunks) _mm256_storeu_ps(acc + d0 + 8 * c, a[c]);
  }
}

// One tile for one query: keys / values [kTile, D] fp32 (rows past count zero), head_dim % 8 == 0.
inline void tile_step(const float* keys, const float* values, const float* query, int64_t count, int64_t head_dim,
                      float softcap, float* row_max, float* row_sum, float* acc, float* probs) {
  __m256 score[2];
  for (int b = 0; b < 2; ++b)
    score[b] = 8 * b < count ? dots8(keys + 8 * b * head_dim, query, head_dim) : _mm256_setzero_ps();
  if (softcap > 0.f) {
    alignas(32) float s[16];
    _mm256_store_ps(s, score[0]);
    _mm256_store_ps(s + 8, score[1]);
    for (float& value : s) value = softcap * std::tanh(value / softcap);
    score[0] = _mm256_load_ps(s);
    score[1] = _mm256_load_ps(s + 8);
  }
  // Positions past count: -inf, so they count for neither the max nor the sums.
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int b = 0; b < 2; ++b) {
    const __m256 valid = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count - 8 * b)), index));
    score[b] = _mm256_blendv_ps(minus_inf, score[b], valid);
  }
  const float new_max = std::max(*row_max, max8(_mm256_max_ps(score[0], score[1])));
  const float alpha = std::exp(*row_max - new_max);
  const __m256 shift = _mm256_set1_ps(new_max);
  __m256 total = _mm256_setzero_ps();
  for (int b = 0; b < 2; ++b) {
    const __m256 valid = _mm256_cmp_ps(score[b], minus_inf, _CMP_NEQ_OQ);
    const __m256 p = _mm256_and_ps(valid, exp8(_mm256_sub_ps(score[b], shift)));
    _mm256_storeu_ps(probs + 8 * b, p);
    total = _mm256_add_ps(total, p);
  }
  *row_max = new_max;
  *row_sum = *row_sum * alpha + sum8(total);
  accumulate(values, probs, count, head_dim, alpha, acc);
}

}  // namespace pagoda_avx2
#endif
