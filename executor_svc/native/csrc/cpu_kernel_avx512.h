// AVX-512 tile steps of the CPU paged decode kernel (see cpu_kernel.cpp).
#pragma once
#include "cpu_kernel_common.h"

namespace {

#if defined(__AVX512F__)
using pagoda::exp16;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const BF16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const int8_t* p) {  // the integers, exactly (the row's scale is applied elsewhere)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// The scales of a tile's rows [16] (int8 caches): one load when the tile lies in one block (then lanes past
// `valid` are 0), else one per row from the rows' element offsets (rows past the count repeat the last one).
template <int64_t D>
PAGODA_INLINE __m512 tile_scales(const float* scales, const RowCursor& start, const int64_t* offsets, int64_t count,
                                 __mmask16 valid) {
  if (start.offset + count <= start.block_size)
    return _mm512_maskz_loadu_ps(valid, scales + start.table[start.block] * start.block_size + start.offset);
  alignas(64) float each[kTile];
  for (int i = 0; i < kTile; ++i) each[i] = scales[offsets[i] / D];
  return _mm512_load_ps(each);
}

// Widens one cache row of D = 16 * NC values into NC fp32 registers; bf16
// with even NC goes in even/odd order (per 32 values: a shift for the even
// ones, a mask for the odd ones, no shuffle).
template <typename C, int NC>
PAGODA_INLINE void widen_regs(const C* row, __m512* out) {
  if constexpr (std::is_same_v<C, BF16> && NC % 2 == 0) {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int w = 0; w < NC / 2; ++w) {
      const __m512i pairs = _mm512_loadu_si512(row + 32 * w);
      out[2 * w] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
      out[2 * w + 1] = _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
    }
  } else {
    for (int c = 0; c < NC; ++c) out[c] = load16(row + 16 * c);
  }
}

// Calls span(std::integral_constant<int, GB>, g) for the group's queries g, GB
// at a time (GB * NC accumulators must fit the 32 registers: GB <= 4, or 2 for NC 8).
template <int NC, typename Span>
inline void for_query_blocks(int64_t group, const Span& span) {
  constexpr int kMaxGB = NC <= 4 ? 4 : 2;
  for (int64_t g = 0; g < group;) {
    const int64_t gb = std::min<int64_t>(kMaxGB, group - g);
    switch (gb) {
      case 1: span(std::integral_constant<int, 1>{}, g); break;
      case 2: span(std::integral_constant<int, 2>{}, g); break;
      case 3:
        if constexpr (kMaxGB >= 3) span(std::integral_constant<int, 3>{}, g);
        break;
      default:
        if constexpr (kMaxGB >= 4) span(std::integral_constant<int, 4>{}, g);
        break;
    }
    g += gb;
  }
}

// Scores of GB fp32 queries (registers q[GB * NC]) against 16 cache rows
// widened in registers: lane i of out[g] is row i's dot product (a 16x16
// transpose-add tree, built half a tile at a time to keep fewer vectors live).
template <typename C, int NC, int GB>
PAGODA_INLINE void scores_rows(const C* const* rows, const __m512* q, __m512* out) {
  __m512 quads[GB][4];
  for (int h = 0; h < 2; ++h) {
    __m512 pairs[GB][4];
    for (int j = 0; j < 4; ++j) {
      __m512 ka[NC], kb[NC];
      widen_regs<C, NC>(rows[8 * h + 2 * j], ka);
      widen_regs<C, NC>(rows[8 * h + 2 * j + 1], kb);
      for (int g = 0; g < GB; ++g) {
        __m512 x = _mm512_mul_ps(q[g * NC], ka[0]), y = _mm512_mul_ps(q[g * NC], kb[0]);
        for (int c = 1; c < NC; ++c) {
          x = _mm512_fmadd_ps(q[g * NC + c], ka[c], x);
          y = _mm512_fmadd_ps(q[g * NC + c], kb[c], y);
        }
        // lanes (0,1): row a, (2,3): row b, per 128-bit pair
        pairs[g][j] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int j = 0; j < 2; ++j)  // lane L holds row 8h + 4j + L (two partial sums)
        quads[g][2 * h + j] = _mm512_add_ps(_mm512_shuffle_f32x4(pairs[g][2 * j], pairs[g][2 * j + 1], 0x88),
                                            _mm512_shuffle_f32x4(pairs[g][2 * j], pairs[g][2 * j + 1], 0xDD));
  }
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int g = 0; g < GB; ++g) {
    __m512 octs[2];
    for (int j = 0; j < 2; ++j)
      octs[j] = _mm512_add_ps(_mm512_unpacklo_ps(quads[g][2 * j], quads[g][2 * j + 1]),
                              _mm512_unpackhi_ps(quads[g][2 * j], quads[g][2 * j + 1]));
    const __m512 mixed = _mm512_add_ps(_mm512_shuffle_ps(octs[0], octs[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                       _mm512_shuffle_ps(octs[0], octs[1], _MM_SHUFFLE(3, 2, 3, 2)));
    out[g] = _mm512_permutexvar_ps(order, mixed);  // mixed[4L + k] is row 4k + L
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// int8 caches: the scores of GB int16 queries (q[GB * NW], 32 dims a register) against 16 int8 rows, exactly in
// int32 (vpdpwssd: two products a lane, no widening to fp32): lane i of out[g] is row i's dot product, summed by
// scores_rows' transpose-add tree in integers. Four ops a row (two widenings, two dot products a query) where
// fp32 takes eight widening ops and four multiply-adds a query.
template <int NW, int GB>
PAGODA_INLINE void scores_rows_i16(const int8_t* const* rows, const __m512i* q, __m512i* out) {
  __m512i quads[GB][4];
  for (int h = 0; h < 2; ++h) {
    __m512i pairs[GB][4];
    for (int j = 0; j < 4; ++j) {
      __m512i ka[NW], kb[NW];
      for (int w = 0; w < NW; ++w) {
        ka[w] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[8 * h + 2 * j] + 32 * w)));
        kb[w] = _mm512_cvtepi8_epi16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[8 * h + 2 * j + 1] + 32 * w)));
      }
      for (int g = 0; g < GB; ++g) {
        __m512i x = _mm512_dpwssd_epi32(_mm512_setzero_si512(), q[g * NW], ka[0]);
        __m512i y = _mm512_dpwssd_epi32(_mm512_setzero_si512(), q[g * NW], kb[0]);
        for (int w = 1; w < NW; ++w) {
          x = _mm512_dpwssd_epi32(x, q[g * NW + w], ka[w]);
          y = _mm512_dpwssd_epi32(y, q[g * NW + w], kb[w]);
        }
        pairs[g][j] = _mm512_add_epi32(_mm512_shuffle_i32x4(x, y, 0x44), _mm512_shuffle_i32x4(x, y, 0xEE));
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int j = 0; j < 2; ++j)
        quads[g][2 * h + j] = _mm512_add_epi32(_mm512_shuffle_i32x4(pairs[g][2 * j], pairs[g][2 * j + 1], 0x88),
                                               _mm512_shuffle_i32x4(pairs[g][2 * j], pairs[g][2 * j + 1], 0xDD));
  }
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int g = 0; g < GB; ++g) {
    __m512i octs[2];
    for (int j = 0; j < 2; ++j)
      octs[j] = _mm512_add_epi32(_mm512_unpacklo_epi32(quads[g][2 * j], quads[g][2 * j + 1]),
                                 _mm512_unpackhi_epi32(quads[g][2 * j], quads[g][2 * j + 1]));
    const __m512 a = _mm512_castsi512_ps(octs[0]), b = _mm512_castsi512_ps(octs[1]);
    const __m512i mixed = _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0))),
                                           _mm512_castps_si512(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2))));
    out[g] = _mm512_permutexvar_epi32(order, mixed);
  }
}

// q[GB * NC] fp32 (natural order) as int16 (NC / 2 registers a query, rounded to nearest even) and one scale a
// query: q ~ qi * scale, relative error under 2^-15 (a bf16 query carries 2^-8).
template <int NC, int GB>
PAGODA_INLINE void quantize_queries_i16(const __m512* q, __m512i* qi, float* scale) {
  for (int g = 0; g < GB; ++g) {
    __m512 amax = _mm512_setzero_ps();
    for (int c = 0; c < NC; ++c) amax = _mm512_max_ps(amax, _mm512_abs_ps(q[g * NC + c]));
    const float m = _mm512_reduce_max_ps(amax);
    const __m512 inv = _mm512_set1_ps(m > 0.f ? 32767.f / m : 0.f);
    scale[g] = m / 32767.f;
    for (int w = 0; w < NC / 2; ++w) {
      const __m256i lo = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(q[g * NC + 2 * w], inv)));
      const __m256i hi = _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(q[g * NC + 2 * w + 1], inv)));
      qi[g * (NC / 2) + w] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
    }
  }
}
#define PAGODA_INT16_SCORES 1

// int8 caches: acc[g][c] += sum_i w[g][i] * row_i (16 rows, c < 2 * NW), exactly in int32 for weights rounded
// to int16 (one scale per query and tile: w ~ wi * scale, w = probability * the row's V scale >= 0): rows two at
// a time as int16 pairs (vpdpwssd), then widened to fp32 once per tile, back in natural dim order.
template <int NW, int GB>
PAGODA_INLINE void weighted_rows_i16(const int8_t* const* rows, const float (*w)[kTile], __m512 (*acc)[2 * NW]) {
  alignas(64) int16_t wi[GB][kTile];
  float w_scale[GB];
  for (int g = 0; g < GB; ++g) {
    const __m512 weights = _mm512_load_ps(w[g]);
    const float m = _mm512_reduce_max_ps(weights);
    w_scale[g] = m / 32767.f;
    const __m512 inv = _mm512_set1_ps(m > 0.f ? 32767.f / m : 0.f);
    _mm256_store_si256(reinterpret_cast<__m256i*>(wi[g]), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(weights, inv))));
  }
  __m512i sums[GB][2 * NW];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < 2 * NW; ++c) sums[g][c] = _mm512_setzero_si512();
#pragma GCC unroll 8
  for (int i = 0; i < kTile; i += 2) {
    for (int v = 0; v < NW; ++v) {
      const __m512i a = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[i] + 32 * v)));
      const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[i + 1] + 32 * v)));
      // 32-bit lane 4L + m: (a, b) of dim 32v + 8L + m (lo) and of dim 32v + 8L + 4 + m (hi)
      const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
      for (int g = 0; g < GB; ++g) {
        int32_t pair;
        std::memcpy(&pair, &wi[g][i], sizeof(pair));  // (w_i, w_i+1): low half with a, as in the lanes
        const __m512i weights = _mm512_set1_epi32(pair);
        sums[g][2 * v] = _mm512_dpwssd_epi32(sums[g][2 * v], lo, weights);
        sums[g][2 * v + 1] = _mm512_dpwssd_epi32(sums[g][2 * v + 1], hi, weights);
      }
    }
  }
  // Natural order: dims 16h + k of a 32-dim block come from lo (k % 8 < 4) or hi, lane 4 (2h + k / 8) + k % 4.
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int g = 0; g < GB; ++g) {
    const __m512 scale = _mm512_set1_ps(w_scale[g]);
    for (int v = 0; v < NW; ++v) {
      const __m512 lo = _mm512_cvtepi32_ps(sums[g][2 * v]), hi = _mm512_cvtepi32_ps(sums[g][2 * v + 1]);
      acc[g][2 * v] = _mm512_fmadd_ps(_mm512_permutex2var_ps(lo, first, hi), scale, acc[g][2 * v]);
      acc[g][2 * v + 1] = _mm512_fmadd_ps(_mm512_permutex2var_ps(lo, second, hi), scale, acc[g][2 * v + 1]);
    }
  }
}
#else
#define PAGODA_INT16_SCORES 0
#endif

// GB fp32 queries [GB, D] (scaled, in the cache type's lane order) over
// positions [lo, hi), state kept in registers: K rows widened to fp32 in
// registers and scored in place (no scratch copy); lane-wise running sums,
// reduced once at the end; the accumulators rescale only when a query's max
// grows. All arithmetic in fp32 FMAs: on AVX512-BF16 Xeons vdpbf16ps does
// half as many multiply-adds per cycle as fp32 FMAs, so bf16 rows are
// widened (one shift or mask per 16 values) instead. Walks the
// rows itself (TileWalker's order and prefetch distance, whole rows per
// prefetch loop step). CAP: scores are soft-capped (job.softcap), a template
// argument so that uncapped models run exactly the code they ran before.
template <typename C, int NC, int GB, bool CAP>
void span_wide(const Job& job, HeadRows<C> head, const int64_t* table, int64_t lo, int64_t hi, const float* query,
               float* row_max, float* row_sum, float* acc_out) {
  constexpr int64_t D = NC * 16;
  const C *k_head = head.k, *v_head = head.v;
  constexpr int kLines = int(D * sizeof(C) + 63) / 64;  // cache lines per row
  __m512 q[GB * NC], acc[GB][NC], sum[GB], top[GB];
  for (int g = 0; g < GB; ++g) {
    for (int c = 0; c < NC; ++c) {
      q[g * NC + c] = _mm512_loadu_ps(query + g * D + 16 * c);
      acc[g][c] = _mm512_loadu_ps(acc_out + g * D + 16 * c);
    }
    top[g] = _mm512_set1_ps(row_max[g]);
    sum[g] = _mm512_zextps128_ps512(_mm_set_ss(row_sum[g]));
  }
  alignas(64) float probs[GB][kTile];
  // int8 rows of even NC score against int16 queries in integers (see scores_rows_i16).
  constexpr bool kIntScores = PAGODA_INT16_SCORES && kQuantized<C> && NC % 2 == 0;
  constexpr int NW = kIntScores ? NC / 2 : 1;
  __m512i qi[GB * NW];
  float q_scale[GB] = {};
  if constexpr (kIntScores) quantize_queries_i16<NC, GB>(q, qi, q_scale);
  const int64_t bs = job.block_size;
  RowCursor cursor{table, bs, lo / bs, lo % bs};
  int64_t ahead_pos = std::min(hi, lo + kPrefetchRows);  // rows prefetched so far (as TileWalker)
  RowCursor ahead{table, bs, ahead_pos / bs, ahead_pos % bs};
  int64_t offsets[kTile];
  for (int64_t pos = lo; pos < hi;) {
    const int64_t count = std::min(kTile, hi - pos);
    for (const int64_t stop = std::min(hi, pos + count + kPrefetchRows); ahead_pos < stop; ++ahead_pos, ahead.advance()) {
      const char* kp = reinterpret_cast<const char*>(k_head + ahead.row() * D);
      const char* vp = reinterpret_cast<const char*>(v_head + ahead.row() * D);
      for (int l = 0; l < kLines; ++l) {
        _mm_prefetch(kp + 64 * l, _MM_HINT_T0);
        _mm_prefetch(vp + 64 * l, _MM_HINT_T0);
      }
      if constexpr (kQuantized<C>) {
        if (ahead.offset % 16 == 0) {  // a new 64-byte line of scales
          _mm_prefetch(reinterpret_cast<const char*>(head.k_scale + ahead.row()), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(head.v_scale + ahead.row()), _MM_HINT_T0);
        }
      }
    }
    const RowCursor tile_start = cursor;
    for (int64_t i = 0; i < kTile; ++i) {
      offsets[i] = cursor.row() * D;
      if (i + 1 < count) cursor.advance();
    }
    cursor.advance();
    pos += count;
    const C* krows[kTile];
    for (int i = 0; i < kTile; ++i) krows[i] = k_head + offsets[i];
    __m512 scores[GB];
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
    __m512 v_scales = _mm512_setzero_ps();
    if constexpr (kIntScores) {
#if PAGODA_INT16_SCORES
      __m512i dots[GB];
      scores_rows_i16<NW, GB>(krows, qi, dots);
      const __m512 k_scales = tile_scales<D>(head.k_scale, tile_start, offsets, count, valid);
      v_scales = tile_scales<D>(head.v_scale, tile_start, offsets, count, valid);
      for (int g = 0; g < GB; ++g)
        scores[g] = _mm512_mul_ps(_mm512_cvtepi32_ps(dots[g]), _mm512_mul_ps(k_scales, _mm512_set1_ps(q_scale[g])));
#endif
    } else {
      scores_rows<C, NC, GB>(krows, q, scores);
      if constexpr (kQuantized<C>) {
        const __m512 k_scales = tile_scales<D>(head.k_scale, tile_start, offsets, count, valid);
        v_scales = tile_scales<D>(head.v_scale, tile_start, offsets, count, valid);
        for (int g = 0; g < GB; ++g) scores[g] = _mm512_mul_ps(scores[g], k_scales);
      }
    }
    for (int g = 0; g < GB; ++g) {
      if constexpr (CAP) scores[g] = pagoda::softcap16(scores[g], job.softcap);
      const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(kNegBig), valid, scores[g]);
      if (_mm512_cmp_ps_mask(s, top[g], _CMP_GT_OQ)) {  // the max grows: rescale
        const __m512 new_top = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(s, top[g])));
        const __m512 alpha = exp16(_mm512_sub_ps(top[g], new_top));
        sum[g] = _mm512_mul_ps(sum[g], alpha);
        for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], alpha);
        top[g] = new_top;
      }
      const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, top[g])));
      sum[g] = _mm512_add_ps(sum[g], p);
      _mm512_store_ps(probs[g], kQuantized<C> ? _mm512_mul_ps(p, v_scales) : p);  // P.V weights
    }
    if constexpr (kIntScores) {  // rows past the count repeat the last one, with weight 0
#if PAGODA_INT16_SCORES
      const C* vrows[kTile];
      for (int i = 0; i < kTile; ++i) vrows[i] = v_head + offsets[i];
      weighted_rows_i16<NW, GB>(vrows, probs, acc);
#endif
    } else {
#pragma GCC unroll 16
      for (int i = 0; i < kTile; ++i) {
        __m512 value[NC];
        widen_regs<C, NC>(v_head + offsets[i], value);
        for (int c = 0; c < NC; ++c)
          for (int g = 0; g < GB; ++g) acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(probs[g][i]), value[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < GB; ++g) {
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc_out + g * D + 16 * c, acc[g][c]);
    row_max[g] = _mm512_cvtss_f32(top[g]);
    row_sum[g] = _mm512_reduce_add_ps(sum[g]);
  }
}

// All G queries of the item through span_wide, GB at a time (GB * NC <= 16).
template <typename C, int NC>
inline void span_wide_all(const Job& job, HeadRows<C> head, const int64_t* table, int64_t lo, int64_t hi,
                          State state, const float* query) {
  constexpr int64_t D = NC * 16;
  for_query_blocks<NC>(job.group, [&](auto gb, int64_t g) {
    constexpr int GB = decltype(gb)::value;
    float *row_max = state.row_max + g, *row_sum = state.row_sum + g, *acc = state.acc + g * D;
    if (job.softcap > 0.f)
      span_wide<C, NC, GB, true>(job, head, table, lo, hi, query + g * D, row_max, row_sum, acc);
    else
      span_wide<C, NC, GB, false>(job, head, table, lo, hi, query + g * D, row_max, row_sum, acc);
  });
}

#endif  // __AVX512F__

}  // namespace
