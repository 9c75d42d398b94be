// Decode attention's tile step on AVX2 + FMA (builds without AVX-512), for
// head dims that are a multiple of 8 up to 256: the portable path's widened
// tiles (cpu_kernel.cpp) scored and accumulated with intrinsics.
//
// Scores: each key's D / 8 partial sums stay in one register, and 8 keys'
// registers reduce to their 8 dot products in one ymm by a transpose-add tree
// (hadd pairs, then the two 128-bit halves), not a horizontal sum per key.
// The softmax runs on the tile's 16 scores as two ymm (exp8), and P.V adds
// each value row into the query's accumulators, 64 features (8 registers) at a
// time. The same online-softmax state as the portable step. The GQA spans ask
// for one row's K and V lines per key they score, 16 rows ahead (a burst of
// 16 rows' lines overfills the line-fill buffers and stalls the core), and
// take an int8 tile's scales in two loads when it lies in one block.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>

#include <cmath>
#include <limits>

#define PAGODA_AVX2_ATTENTION 1

namespace pagoda_avx2 {

using pagoda::exp8;
using pagoda::sum8;

PAGODA_INLINE float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// The 8 sums of s[0..8) (each a key's partial dot products in 8 lanes) as one ymm, by a transpose-add tree.
PAGODA_INLINE __m256 reduce8(const __m256* s) {
  // hadd(a, b) = a0+a1, a2+a3, b0+b1, b2+b3 | the same of the high halves: two levels leave, per 128-bit half,
  // the partial dots of keys 0-3 (and 4-7); the two halves then add.
  const __m256 s01 = _mm256_hadd_ps(s[0], s[1]), s23 = _mm256_hadd_ps(s[2], s[3]);
  const __m256 s45 = _mm256_hadd_ps(s[4], s[5]), s67 = _mm256_hadd_ps(s[6], s[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
  const __m256 lows = _mm256_permute2f128_ps(s0123, s4567, 0x20), highs = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lows, highs);
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
  return reduce8(s);
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

// The online-softmax update of one query by a tile's 16 scores (positions past count ignored): the state's max
// and sum move on, probs[0, 16) get the tile's probabilities (0 past count); returns alpha, the factor the
// query's accumulators take before this tile's P.V.
PAGODA_INLINE float softmax_tile(__m256 score[2], int64_t count, float softcap, float* row_max, float* row_sum,
                                 float* probs) {
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
  __m256 valid[2];
  for (int b = 0; b < 2; ++b) {
    valid[b] = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count - 8 * b)), index));
    score[b] = _mm256_blendv_ps(minus_inf, score[b], valid[b]);
  }
  const float new_max = std::max(*row_max, max8(_mm256_max_ps(score[0], score[1])));
  const float alpha = std::exp(*row_max - new_max);
  const __m256 shift = _mm256_set1_ps(new_max);
  __m256 total = _mm256_setzero_ps();
  for (int b = 0; b < 2; ++b) {
    const __m256 p = _mm256_and_ps(valid[b], exp8(_mm256_sub_ps(score[b], shift)));
    _mm256_storeu_ps(probs + 8 * b, p);
    total = _mm256_add_ps(total, p);
  }
  *row_max = new_max;
  *row_sum = *row_sum * alpha + sum8(total);
  return alpha;
}

// One tile for one query: keys / values [kTile, D] fp32 (rows past count finite), head_dim % 8 == 0.
inline void tile_step(const float* keys, const float* values, const float* query, int64_t count, int64_t head_dim,
                      float softcap, float* row_max, float* row_sum, float* acc, float* probs) {
  __m256 score[2];
  for (int b = 0; b < 2; ++b)
    score[b] = 8 * b < count ? dots8(keys + 8 * b * head_dim, query, head_dim) : _mm256_setzero_ps();
  const float alpha = softmax_tile(score, count, softcap, row_max, row_sum, probs);
  accumulate(values, probs, count, head_dim, alpha, acc);
}

PAGODA_INLINE __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
PAGODA_INLINE __m256 widen8(const BF16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
PAGODA_INLINE __m256 widen8(const c10::Half* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float wide[8];
  for (int i = 0; i < 8; ++i) wide[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(wide);
#endif
}
PAGODA_INLINE __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Registers of accumulators per query in P.V (8, 4, 2 or 1): G x CH of them at most 12, CH dividing the head's
// 8-wide chunks.
template <int G>
inline int pv_chunks(int64_t chunks) {
  for (int ch = 8; ch > 1; ch /= 2)
    if (G * ch <= 12 && chunks % ch == 0) return ch;
  return 1;
}

template <int G, int CH, typename C>
PAGODA_INLINE void pv_block(const C* v_head, const int64_t* rows, int64_t count, int64_t d0, const float (*probs)[kTile],
                            const float* alpha, int64_t head_dim, float* acc) {
  __m256 a[G][CH];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    const __m256 scale = _mm256_set1_ps(alpha[g]);
#pragma GCC unroll 8
    for (int c = 0; c < CH; ++c) a[g][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + g * head_dim + d0 + 8 * c), scale);
  }
  for (int64_t i = 0; i < count; ++i) {
    const C* row = v_head + rows[i] + d0;
    __m256 p[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) p[g] = _mm256_broadcast_ss(&probs[g][i]);
#pragma GCC unroll 8
    for (int c = 0; c < CH; ++c) {
      const __m256 v = widen8(row + 8 * c);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) a[g][c] = _mm256_fmadd_ps(p[g], v, a[g][c]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int c = 0; c < CH; ++c) _mm256_storeu_ps(acc + g * head_dim + d0 + 8 * c, a[g][c]);
}

template <int G, int CH, typename C>
PAGODA_INLINE void pv_all(const C* v_head, const int64_t* rows, int64_t count, const float (*probs)[kTile],
                          const float* alpha, int64_t head_dim, float* acc) {
  for (int64_t d0 = 0; d0 < head_dim; d0 += 8 * CH) pv_block<G, CH>(v_head, rows, count, d0, probs, alpha, head_dim, acc);
}

// The scales of the walker's last tile [16] as two ymm (int8 caches): two loads when the tile lies in one block
// (lanes past count 0), else one per row from the rows' element offsets (rows past count repeat the last one).
PAGODA_INLINE void tile_scales(const float* scales, const TileWalker<int8_t>& walker, const int64_t* rows,
                               int64_t count, int64_t head_dim, __m256 out[2]) {
  if (walker.in_one_block(count)) {
    const float* first = scales + walker.first_slot();
    const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int b = 0; b < 2; ++b)
      out[b] = _mm256_maskload_ps(first + 8 * b,
                                  _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count - 8 * b)), index));
    return;
  }
  alignas(32) float each[kTile];
  for (int64_t i = 0; i < kTile; ++i) each[i] = scales[rows[i] / head_dim];
  for (int b = 0; b < 2; ++b) out[b] = _mm256_load_ps(each + 8 * b);
}

// Attends a GQA group of G queries over positions [lo, hi) of one sequence and kv head, straight from the
// cache's rows: each key row is widened once, in registers, for all G queries (the partial dots parked in a
// small scratch and reduced 8 keys at a time); each value row once per block of accumulators. int8 caches: a
// tile's K scales multiply its scores, its V scales the probabilities P.V takes (the sums use the unscaled ones).
// head_dim % 8 == 0, at most 256.
template <int G, typename C>
void span_rows(const Job& job, HeadRows<C> head, const int64_t* table, int64_t lo, int64_t hi, State state,
               const float* query) {
  const int64_t head_dim = job.head_dim, chunks = head_dim / 8;
  TileWalker<C> walker(job, head, table, lo, hi, 0);  // prefetches one row per key scored
  int64_t rows[kTile];
  alignas(32) float part[G][kTile][8];
  alignas(32) float probs[G][kTile];
  float alpha[G];
  while (const int64_t count = walker.next(rows)) {
    for (int64_t i = 0; i < kTile; ++i) {  // rows past count repeat the last one: finite, masked below
      const C* key = head.k + rows[i];
      walker.prefetch_one();
      __m256 s[G];
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) s[g] = _mm256_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c) {
        const __m256 k = widen8(key + 8 * c);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) s[g] = _mm256_fmadd_ps(_mm256_loadu_ps(query + g * head_dim + 8 * c), k, s[g]);
      }
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) _mm256_store_ps(part[g][i], s[g]);
    }
    __m256 k_scale[2], v_scale[2];
    if constexpr (kQuantized<C>) {
      tile_scales(head.k_scale, walker, rows, count, head_dim, k_scale);
      tile_scales(head.v_scale, walker, rows, count, head_dim, v_scale);
    }
    for (int g = 0; g < G; ++g) {
      __m256 score[2];
      for (int b = 0; b < 2; ++b) {
        __m256 s[8];
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) s[i] = _mm256_load_ps(part[g][8 * b + i]);
        score[b] = reduce8(s);
        if constexpr (kQuantized<C>) score[b] = _mm256_mul_ps(score[b], k_scale[b]);
      }
      alpha[g] = softmax_tile(score, count, job.softcap, state.row_max + g, state.row_sum + g, probs[g]);
      if constexpr (kQuantized<C>)
        for (int b = 0; b < 2; ++b)
          _mm256_store_ps(probs[g] + 8 * b, _mm256_mul_ps(_mm256_load_ps(probs[g] + 8 * b), v_scale[b]));
    }
    switch (pv_chunks<G>(chunks)) {
      case 8: pv_all<G, 8 <= 12 / G ? 8 : 1>(head.v, rows, count, probs, alpha, head_dim, state.acc); break;
      case 4: pv_all<G, 4 <= 12 / G ? 4 : 1>(head.v, rows, count, probs, alpha, head_dim, state.acc); break;
      case 2: pv_all<G, 2>(head.v, rows, count, probs, alpha, head_dim, state.acc); break;
      default: pv_all<G, 1>(head.v, rows, count, probs, alpha, head_dim, state.acc); break;
    }
  }
}

}  // namespace pagoda_avx2
#endif
