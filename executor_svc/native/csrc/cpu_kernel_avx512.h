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
    scores_rows<C, NC, GB>(krows, q, scores);
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
    __m512 v_scales = _mm512_setzero_ps();
    if constexpr (kQuantized<C>) {
      const __m512 k_scales = tile_scales<D>(head.k_scale, tile_start, offsets, count, valid);
      v_scales = tile_scales<D>(head.v_scale, tile_start, offsets, count, valid);
      for (int g = 0; g < GB; ++g) scores[g] = _mm512_mul_ps(scores[g], k_scales);
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
#pragma GCC unroll 16
    for (int i = 0; i < kTile; ++i) {  // rows past the count repeat the last one, with weight 0
      __m512 value[NC];
      widen_regs<C, NC>(v_head + offsets[i], value);
      for (int c = 0; c < NC; ++c)
        for (int g = 0; g < GB; ++g) acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(probs[g][i]), value[c], acc[g][c]);
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
