// AVX-512 tile steps of the CPU paged decode kernel (see cpu_kernel.cpp).
#pragma once
#include "cpu_kernel_common.h"

namespace {

using pagoda::exp16;

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const BF16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Widens one row of D = 16 * NC values to fp32; bf16 with even NC goes in
// even/odd order (a shift and a mask per 32 values, no shuffle).
template <typename C, int NC>
inline void widen_row(const C* row, float* dst) {
  if constexpr (std::is_same_v<C, BF16> && NC % 2 == 0) {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    for (int w = 0; w < NC / 2; ++w) {
      const __m512i pairs = _mm512_loadu_si512(row + 32 * w);
      _mm512_store_ps(dst + 32 * w, _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)));
      _mm512_store_ps(dst + 32 * w + 16, _mm512_castsi512_ps(_mm512_and_si512(pairs, high)));
    }
  } else {
    for (int c = 0; c < NC; ++c) _mm512_store_ps(dst + 16 * c, load16(row + 16 * c));
  }
}


// Returns s with s[i] = sum of all lanes of part[i] (a 16x16 transpose-add).
PAGODA_INLINE __m512 sum_rows16(const __m512* part) {
  __m512 pairs[8], quads[4], octs[2];
  for (int j = 0; j < 8; ++j)  // lanes (0,1) hold row 2j, (2,3) row 2j+1
    pairs[j] = _mm512_add_ps(_mm512_shuffle_f32x4(part[2 * j], part[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(part[2 * j], part[2 * j + 1], 0xEE));
  for (int j = 0; j < 4; ++j)  // lane L holds row 4j+L
    quads[j] = _mm512_add_ps(_mm512_shuffle_f32x4(pairs[2 * j], pairs[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(pairs[2 * j], pairs[2 * j + 1], 0xDD));
  for (int j = 0; j < 2; ++j)  // lane L: rows 8j+L and 8j+4+L, two partials each
    octs[j] = _mm512_add_ps(_mm512_unpacklo_ps(quads[2 * j], quads[2 * j + 1]),
                            _mm512_unpackhi_ps(quads[2 * j], quads[2 * j + 1]));
  const __m512 mixed = _mm512_add_ps(_mm512_shuffle_ps(octs[0], octs[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_ps(octs[0], octs[1], _MM_SHUFFLE(3, 2, 3, 2)));
  // mixed[4L + k] is row 4k + L.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, mixed);
}

// Scores of one fp32 query [D] against the widened key tile [16, D].
template <int NC>
PAGODA_INLINE __m512 scores_fp32(const float* keys, const float* query) {
  constexpr int64_t D = NC * 16;
  __m512 q[NC], part[16];
  for (int c = 0; c < NC; ++c) q[c] = _mm512_loadu_ps(query + 16 * c);
  for (int i = 0; i < 16; ++i) {
    __m512 s = _mm512_mul_ps(q[0], _mm512_load_ps(keys + i * D));
    for (int c = 1; c < NC; ++c) s = _mm512_fmadd_ps(q[c], _mm512_load_ps(keys + i * D + 16 * c), s);
    part[i] = s;
  }
  return sum_rows16(part);
}

// Widens one cache row into NC registers (same lane order as widen_row).
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

// One tile for GB fp32 queries at once (their latency chains overlap): scores,
// online-softmax update, then each V row is widened once and accumulated
// into all GB queries (GB * NC accumulators kept in registers).
template <typename C, int NC, int GB>
PAGODA_INLINE void tile_step_avx512(const Job& job, const C* k_head, const C* v_head, const int64_t* key_rows,
                                    const int64_t* value_rows, int64_t count, const float* keys, const float* query,
                                    float* row_max, float* row_sum, float* acc, float* probs) {
  constexpr int64_t D = NC * 16;
  const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
  __m512 scores[GB];
  for (int g = 0; g < GB; ++g) scores[g] = scores_fp32<NC>(keys, query + g * D);
  __m512 out[GB][NC];
  for (int g = 0; g < GB; ++g) {
    const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(kNegBig), valid, scores[g]);
    const float new_max = std::max(row_max[g], _mm512_reduce_max_ps(s));
    const __m512 rescale = exp16(_mm512_set1_ps(row_max[g] - new_max));
    const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
    row_max[g] = new_max;
    row_sum[g] = row_sum[g] * _mm512_cvtss_f32(rescale) + _mm512_reduce_add_ps(p);
    _mm512_store_ps(probs + g * kTile, p);
    for (int c = 0; c < NC; ++c) out[g][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * D + 16 * c), rescale);
  }
  for (int64_t i = 0; i < count; ++i) {
    __m512 value[NC];
    widen_regs<C, NC>(v_head + value_rows[i], value);
    for (int g = 0; g < GB; ++g) {
      const __m512 weight = _mm512_set1_ps(probs[g * kTile + i]);
      for (int c = 0; c < NC; ++c) out[g][c] = _mm512_fmadd_ps(weight, value[c], out[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, out[g][c]);
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

// All G queries of the item through tile_step_avx512, GB at a time (GB * NC <= 16).
template <typename C, int NC>
inline void tile_all_avx512(const Job& job, const C* k_head, const C* v_head, const int64_t* key_rows,
                            const int64_t* value_rows, int64_t count, const float* keys, const float* query,
                            State state, float* probs) {
  constexpr int64_t D = NC * 16;
  for_query_blocks<NC>(job.group, [&](auto gb, int64_t g) {
    tile_step_avx512<C, NC, decltype(gb)::value>(job, k_head, v_head, key_rows, value_rows, count, keys, query + g * D,
                                                 state.row_max + g, state.row_sum + g, state.acc + g * D,
                                                 probs + g * kTile);
  });
}

// Scores of GB fp32 queries (registers q[GB * NC]) against 16 fp32 rows read
// in place: lane i of out[g] is row i's dot product (a transpose-add tree as
// in sum_rows16, built half a tile at a time to keep fewer vectors live).
template <int NC, int GB>
PAGODA_INLINE void scores_rows_fp32(const float* const* rows, const __m512* q, __m512* out) {
  __m512 quads[GB][4];
  for (int h = 0; h < 2; ++h) {
    __m512 pairs[GB][4];
    for (int j = 0; j < 4; ++j) {
      const float *a = rows[8 * h + 2 * j], *b = rows[8 * h + 2 * j + 1];
      __m512 ka[NC], kb[NC];
      for (int c = 0; c < NC; ++c) ka[c] = _mm512_loadu_ps(a + 16 * c);
      for (int c = 0; c < NC; ++c) kb[c] = _mm512_loadu_ps(b + 16 * c);
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

// GB fp32 queries [GB, D] (scaled, natural order) over positions [lo, hi) of
// an fp32 cache, state kept in registers as in span_bf16: K rows scored in
// place (no widened copy); lane-wise running sums, reduced once at the end;
// the accumulators rescale only when a query's max grows. All in fp32. Walks
// the rows itself (TileWalker's order and prefetch distance, whole rows of
// NC lines per prefetch loop step).
template <int NC, int GB>
void span_fp32(const Job& job, const float* k_head, const float* v_head, const int64_t* table, int64_t lo,
               int64_t hi, const float* query, float* row_max, float* row_sum, float* acc_out) {
  constexpr int64_t D = NC * 16;
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
      for (int l = 0; l < NC; ++l) {  // a row is NC cache lines
        _mm_prefetch(kp + 64 * l, _MM_HINT_T0);
        _mm_prefetch(vp + 64 * l, _MM_HINT_T0);
      }
    }
    for (int64_t i = 0; i < kTile; ++i) {
      offsets[i] = cursor.row() * D;
      if (i + 1 < count) cursor.advance();
    }
    cursor.advance();
    pos += count;
    const float* krows[kTile];
    for (int i = 0; i < kTile; ++i) krows[i] = k_head + offsets[i];
    __m512 scores[GB];
    scores_rows_fp32<NC, GB>(krows, q, scores);
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
    for (int g = 0; g < GB; ++g) {
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
      _mm512_store_ps(probs[g], p);
    }
#pragma GCC unroll 16
    for (int i = 0; i < kTile; ++i) {  // rows past the count repeat the last one, with weight 0
      const float* row = v_head + offsets[i];
      for (int c = 0; c < NC; ++c) {
        const __m512 value = _mm512_loadu_ps(row + 16 * c);
        for (int g = 0; g < GB; ++g) acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(probs[g][i]), value, acc[g][c]);
      }
    }
  }
  for (int g = 0; g < GB; ++g) {
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc_out + g * D + 16 * c, acc[g][c]);
    row_max[g] = _mm512_cvtss_f32(top[g]);
    row_sum[g] = _mm512_reduce_add_ps(sum[g]);
  }
}

// All G queries of the item through span_fp32, GB at a time (GB * NC <= 16).
template <int NC>
inline void span_fp32_all(const Job& job, const float* k_head, const float* v_head, const int64_t* table, int64_t lo,
                          int64_t hi, State state, const float* query) {
  constexpr int64_t D = NC * 16;
  for_query_blocks<NC>(job.group, [&](auto gb, int64_t g) {
    span_fp32<NC, decltype(gb)::value>(job, k_head, v_head, table, lo, hi, query + g * D, state.row_max + g,
                                    state.row_sum + g, state.acc + g * D);
  });
}

#if defined(__AVX512BF16__)
// Tile position held by lane l of span_bf16's score vectors (the order its
// transpose-add leaves them in).
constexpr int kScoreLane[16] = {0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15};

// Scores (unscaled) of GB bf16 queries against 16 bf16 rows. Each K vector
// holds 16 dims of row k in its low half and the same dims of row k + 8 in its
// high half (qx: the query's 16 dims twice), so a tile needs 8 * NC vdpbf16ps
// per query and a three-stage transpose-add of 8 vectors. Lane l ends up
// holding position kScoreLane[l].
template <int NC, int GB>
PAGODA_INLINE void scores_bf16(const BF16* const* rows, const __m512bh* qx, __m512* out) {
  __m512 quad[GB][4];  // 128-bit lane L of quad[m] holds row (2m, 2m + 8, 2m + 1, 2m + 9)[L]
#pragma GCC unroll 4
  for (int m = 0; m < 4; ++m) {  // unrolled: quad stays in registers
    __m512 part[GB][2];
    for (int h = 0; h < 2; ++h) {
      const BF16 *low = rows[2 * m + h], *high = rows[2 * m + h + 8];
      for (int g = 0; g < GB; ++g) part[g][h] = _mm512_setzero_ps();
      for (int c = 0; c < NC; ++c) {
        const __m512i x = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + 16 * c))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(high + 16 * c)), 1);
        for (int g = 0; g < GB; ++g) part[g][h] = _mm512_dpbf16_ps(part[g][h], (__m512bh)x, qx[g * NC + c]);
      }
    }
    for (int g = 0; g < GB; ++g)
      quad[g][m] = _mm512_add_ps(_mm512_shuffle_f32x4(part[g][0], part[g][1], 0x88),
                                 _mm512_shuffle_f32x4(part[g][0], part[g][1], 0xDD));
  }
  for (int g = 0; g < GB; ++g) {
    const __m512 lo = _mm512_add_ps(_mm512_unpacklo_ps(quad[g][0], quad[g][1]), _mm512_unpackhi_ps(quad[g][0], quad[g][1]));
    const __m512 hi = _mm512_add_ps(_mm512_unpacklo_ps(quad[g][2], quad[g][3]), _mm512_unpackhi_ps(quad[g][2], quad[g][3]));
    out[g] = _mm512_add_ps(_mm512_shuffle_ps(lo, hi, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 2, 3, 2)));
  }
}

// GB bf16 queries [GB, D] over positions [lo, hi), state kept in registers:
// scores by scores_bf16; the online softmax keeps lane-wise sums and rescales
// only when a query's max grows; P.V rounds the probabilities to bf16 and
// feeds pairs of V rows, interleaved by unpacklo/hi_epi16, to vdpbf16ps
// (accumulators in kPairs order).
template <int NC, int GB>
void span_bf16(const Job& job, const BF16* k_head, const BF16* v_head, const int64_t* table, int64_t lo, int64_t hi,
               const BF16* query, float* row_max, float* row_sum, float* acc_out) {
  static_assert(NC % 2 == 0, "rows of whole 32-dim pairs");
  constexpr int64_t D = NC * 16;
  __m512bh qx[GB * NC];
  __m512 acc[GB][NC], sum[GB], top[GB];
  for (int g = 0; g < GB; ++g) {
    for (int c = 0; c < NC; ++c) {
      const __m256i dims = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(query + g * D + 16 * c));
      qx[g * NC + c] = (__m512bh)_mm512_broadcast_i64x4(dims);
      acc[g][c] = _mm512_loadu_ps(acc_out + g * D + 16 * c);
    }
    top[g] = _mm512_set1_ps(row_max[g]);
    sum[g] = _mm512_zextps128_ps512(_mm_set_ss(row_sum[g]));
  }
  const __m512 scale = _mm512_set1_ps(job.scale);
  const __m512i lane_pos = _mm512_loadu_si512(kScoreLane);
  alignas(64) uint32_t pairs[GB][8];  // bf16 probabilities, two positions a dword
  TileWalker<BF16> walker(job, k_head, v_head, table, lo, hi);
  int64_t offsets[kTile];
  while (const int64_t count = walker.next(offsets)) {
    const BF16 *krows[kTile], *vrows[kTile];
    for (int i = 0; i < kTile; ++i) krows[i] = k_head + offsets[i];
    for (int i = 0; i < kTile; ++i) vrows[i] = v_head + offsets[kScoreLane[i]];
    __m512 scores[GB];
    scores_bf16<NC, GB>(krows, qx, scores);
    const __mmask16 valid =
        count == kTile ? __mmask16(0xFFFF) : _mm512_cmplt_epi32_mask(lane_pos, _mm512_set1_epi32(int(count)));
    for (int g = 0; g < GB; ++g) {
      const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(kNegBig), valid, _mm512_mul_ps(scores[g], scale));
      if (_mm512_cmp_ps_mask(s, top[g], _CMP_GT_OQ)) {  // the max grows: rescale
        const __m512 new_top = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(s, top[g])));
        const __m512 alpha = exp16(_mm512_sub_ps(top[g], new_top));
        sum[g] = _mm512_mul_ps(sum[g], alpha);
        for (int c = 0; c < NC; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], alpha);
        top[g] = new_top;
      }
      const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, top[g])));
      sum[g] = _mm512_add_ps(sum[g], p);
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[g]), (__m256i)_mm512_cvtneps_pbh(p));
    }
#pragma GCC unroll 8
    for (int t = 0; t < 8; ++t) {
      const BF16 *first = vrows[2 * t], *second = vrows[2 * t + 1];
      for (int w = 0; w < NC / 2; ++w) {
        const __m512i a = _mm512_loadu_si512(first + 32 * w), b = _mm512_loadu_si512(second + 32 * w);
        const __m512bh low = (__m512bh)_mm512_unpacklo_epi16(a, b), high = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int g = 0; g < GB; ++g) {
          const __m512bh weight = (__m512bh)_mm512_set1_epi32(int(pairs[g][t]));
          acc[g][2 * w] = _mm512_dpbf16_ps(acc[g][2 * w], low, weight);
          acc[g][2 * w + 1] = _mm512_dpbf16_ps(acc[g][2 * w + 1], high, weight);
        }
      }
    }
  }
  for (int g = 0; g < GB; ++g) {
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc_out + g * D + 16 * c, acc[g][c]);
    row_max[g] = _mm512_cvtss_f32(top[g]);
    row_sum[g] = _mm512_reduce_add_ps(sum[g]);
  }
}

// All G queries of the item through span_bf16, GB at a time (GB * NC <= 16).
template <int NC>
inline void span_bf16_all(const Job& job, const BF16* k_head, const BF16* v_head, const int64_t* table, int64_t lo,
                          int64_t hi, State state, const float* query_scratch) {
  const BF16* query = reinterpret_cast<const BF16*>(query_scratch);
  constexpr int64_t D = NC * 16;
  for_query_blocks<NC>(job.group, [&](auto gb, int64_t g) {
    span_bf16<NC, decltype(gb)::value>(job, k_head, v_head, table, lo, hi, query + g * D, state.row_max + g,
                                    state.row_sum + g, state.acc + g * D);
  });
}
#endif  // __AVX512BF16__
#endif  // __AVX512F__

}  // namespace
