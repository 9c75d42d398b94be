// Paged decode attention for the CPU: one query token per sequence, K/V read
// in place from the block-indexed cache (no gather copy).
//
// One pass per (sequence, kv head) with an online softmax (flash-decoding):
// positions go in tiles of 16; each tile's V rows (and K rows, unless the
// scores come straight from bf16) are widened to fp32 once into an L1
// scratch, then every query of the GQA group is scored against the tile and
// accumulates its V rows. With few items (sequences x kv heads) the context is
// split across threads and the partial softmax states merged (split-K).
//
// On AVX-512, head dims 16/32/64/128 run intrinsics (16 fp32 lanes; 16 row
// dot products reduced by one transpose-add tree). bf16 rows widen without
// shuffles into an even/odd lane order (queries and outputs use the same
// order); with a bf16 query and AVX512-BF16 the scores use vdpbf16ps on the
// cache rows directly. Anything else runs plain loops that the compiler
// vectorises (-O3 -ffast-math), so the build works on any CPU.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__GNUC__)
#define PAGODA_INLINE inline __attribute__((always_inline))
#else
#define PAGODA_INLINE inline
#endif

namespace {

using BF16 = c10::BFloat16;
constexpr int64_t kTile = 16;         // positions per online-softmax step
constexpr int64_t kPrefetchRows = 16;  // how far ahead of the tile rows are prefetched
constexpr float kNegBig = -1e30f;     // "minus infinity" that stays finite under -ffast-math
constexpr int64_t kMinSplit = 256;    // fewest positions worth a split of their own
constexpr int64_t kMaxSplits = 16;

inline float to_float(float x) { return x; }
inline float to_float(BF16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// Shapes and pointers shared by every work item of one call.
struct Job {
  int64_t num_heads, num_kv_heads, head_dim, group, block_size, num_blocks, max_blocks;
  const int64_t* block_tables;  // [S, max_blocks]
  const int64_t* context_lens;  // [S]
  float scale;
  int64_t window;
  bool permuted;   // fp32 rows in even/odd lane order (see widen_row)
  bool bf16_dot;   // scores by vdpbf16ps from a bf16 query
};

// Online-softmax state of one item (or one split of it): [G] max, [G] sum, [G, D] acc.
struct State {
  float* row_max;
  float* row_sum;
  float* acc;
};

// Per-thread scratch, 64-byte aligned: widened K and V tiles [kTile, D] each,
// probabilities [G, kTile], the group's queries [G, D] (fp32, or bf16 for bf16_dot).
struct Scratch {
  Scratch(int64_t group, int64_t head_dim)
      : head_dim(head_dim), buffer(2 * kTile * head_dim + group * kTile + group * head_dim + 16, 0.f) {
    auto address = reinterpret_cast<uintptr_t>(buffer.data());
    base = buffer.data() + ((64 - address % 64) % 64) / sizeof(float);
  }
  float* keys() { return base; }
  float* values() { return base + kTile * head_dim; }
  float* probs() { return base + 2 * kTile * head_dim; }
  float* query(int64_t group) { return probs() + group * kTile; }
  int64_t head_dim;
  std::vector<float> buffer;
  float* base;
};

// Position of dim d in the even/odd order: per 32 dims, the 16 even ones then the 16 odd ones.
inline int64_t lane_of(int64_t d, bool permuted) {
  return permuted ? (d & ~int64_t(31)) + (d & 1) * 16 + (d & 31) / 2 : d;
}

template <typename C>
inline void prefetch_row(const C* row, int64_t head_dim) {
#if defined(__GNUC__)
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < head_dim * int64_t(sizeof(C)); offset += 64) __builtin_prefetch(p + offset);
#endif
}

// Walks positions of one sequence's paged rows (a cursor into its block table).
struct RowCursor {
  const int64_t* table;
  int64_t block_size, block, offset;
  int64_t row() const { return table[block] * block_size + offset; }
  void advance() {
    if (++offset == block_size) { offset = 0; ++block; }
  }
};

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

PAGODA_INLINE __m512 exp16(__m512 x) {
  // exp(x) = 2^n * e^r, n = round(x / ln2), |r| <= ln2 / 2; degree-6 polynomial.
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
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

// Scores of one bf16 query [D] (natural order) against 16 bf16 cache rows.
template <int NC>
PAGODA_INLINE __m512 scores_bf16(const BF16* const* rows, const BF16* query, float scale) {
#if defined(__AVX512BF16__)
  if constexpr (NC % 2 == 0) {
    __m512bh q[NC / 2];
    __m512 part[16];
    for (int w = 0; w < NC / 2; ++w) q[w] = (__m512bh)_mm512_loadu_si512(query + 32 * w);
    for (int i = 0; i < 16; ++i) {
      __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(rows[i]), q[0]);
      for (int w = 1; w < NC / 2; ++w) s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(rows[i] + 32 * w), q[w]);
      part[i] = s;
    }
    return _mm512_mul_ps(sum_rows16(part), _mm512_set1_ps(scale));
  }
#endif
  TORCH_CHECK(false, "bf16 dot path not compiled");
  return _mm512_setzero_ps();
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

// One tile for GB queries at once (their latency chains overlap): scores,
// online-softmax update, then each V row is widened once and accumulated
// into all GB queries (GB * NC accumulators kept in registers).
template <typename C, int NC, int GB>
PAGODA_INLINE void tile_step_avx512(const Job& job, const C* k_head, const C* v_head, const int64_t* key_rows,
                                    const int64_t* value_rows, int64_t count, const float* keys, const void* query,
                                    float* row_max, float* row_sum, float* acc, float* probs) {
  constexpr int64_t D = NC * 16;
  const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
  __m512 scores[GB];
  if constexpr (std::is_same_v<C, BF16>) {
    if (job.bf16_dot) {
      const BF16* rows[kTile];
      for (int64_t i = 0; i < kTile; ++i) rows[i] = k_head + key_rows[i];
      for (int g = 0; g < GB; ++g)
        scores[g] = scores_bf16<NC>(rows, static_cast<const BF16*>(query) + g * D, job.scale);
    } else {
      for (int g = 0; g < GB; ++g) scores[g] = scores_fp32<NC>(keys, static_cast<const float*>(query) + g * D);
    }
  } else {
    for (int g = 0; g < GB; ++g) scores[g] = scores_fp32<NC>(keys, static_cast<const float*>(query) + g * D);
  }
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

// All G queries of the item through tile_step_avx512, GB at a time (GB * NC <= 16).
template <typename C, int NC>
inline void tile_all_avx512(const Job& job, const C* k_head, const C* v_head, const int64_t* key_rows,
                            const int64_t* value_rows, int64_t count, const float* keys, const float* query,
                            State state, float* probs) {
  constexpr int kMaxGB = NC <= 4 ? 4 : 2;
  constexpr int64_t D = NC * 16;
  const size_t query_bytes = job.bf16_dot ? sizeof(BF16) : sizeof(float);
  for (int64_t g = 0; g < job.group;) {
    const int64_t gb = std::min<int64_t>(kMaxGB, job.group - g);
    const void* qg = reinterpret_cast<const char*>(query) + g * D * query_bytes;
    float *m = state.row_max + g, *l = state.row_sum + g, *acc = state.acc + g * D, *p = probs + g * kTile;
    switch (gb) {
      case 1: tile_step_avx512<C, NC, 1>(job, k_head, v_head, key_rows, value_rows, count, keys, qg, m, l, acc, p); break;
      case 2: tile_step_avx512<C, NC, 2>(job, k_head, v_head, key_rows, value_rows, count, keys, qg, m, l, acc, p); break;
      case 3:
        if constexpr (kMaxGB >= 3)
          tile_step_avx512<C, NC, 3>(job, k_head, v_head, key_rows, value_rows, count, keys, qg, m, l, acc, p);
        break;
      default:
        if constexpr (kMaxGB >= 4)
          tile_step_avx512<C, NC, 4>(job, k_head, v_head, key_rows, value_rows, count, keys, qg, m, l, acc, p);
        break;
    }
    g += gb;
  }
}
#endif

// Portable tile step for one query, any head_dim: keys/values [count, D] fp32.
inline void tile_step_generic(const float* keys, const float* values, const float* query, int64_t count,
                              int64_t head_dim, float* row_max, float* row_sum, float* acc, float* probs) {
  float new_max = *row_max;
  for (int64_t i = 0; i < count; ++i) {
    const float* key = keys + i * head_dim;
    float dot = 0.f;
    for (int64_t d = 0; d < head_dim; ++d) dot += query[d] * key[d];
    probs[i] = dot;
    new_max = std::max(new_max, dot);
  }
  const float alpha = std::exp(*row_max - new_max);
  float total = 0.f;
  for (int64_t i = 0; i < count; ++i) {
    probs[i] = std::exp(probs[i] - new_max);
    total += probs[i];
  }
  *row_max = new_max;
  *row_sum = *row_sum * alpha + total;
  for (int64_t d = 0; d < head_dim; ++d) acc[d] *= alpha;
  for (int64_t i = 0; i < count; ++i) {
    const float* value = values + i * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) acc[d] += probs[i] * value[d];
  }
}

// Widens the tile's rows (element offsets into head) into out [count, D].
template <typename C, int NC>
inline void widen_tile(const C* head, const int64_t* rows, int64_t count, int64_t head_dim, float* out) {
  for (int64_t i = 0; i < count; ++i) {
#if defined(__AVX512F__)
    if constexpr (NC > 0) {
      widen_row<C, NC>(head + rows[i], out + i * head_dim);
      continue;
    }
#endif
    for (int64_t d = 0; d < head_dim; ++d) out[i * head_dim + d] = to_float(head[rows[i] + d]);
  }
}

// Attends the group's queries (see Scratch::query) over positions [lo, hi) of
// one sequence and kv head, folding into `state`. NC = D / 16, or 0 for generic.
template <typename C, int NC>
void attend_span(const Job& job, const C* k_head, const C* v_head, const int64_t* table, int64_t lo, int64_t hi,
                 State state, Scratch& scratch) {
  const int64_t head_dim = job.head_dim, group = job.group;
  float *keys = scratch.keys(), *values = scratch.values(), *probs = scratch.probs(), *query = scratch.query(group);
  RowCursor cursor{table, job.block_size, lo / job.block_size, lo % job.block_size};
  const int64_t ahead_start = std::min(hi, lo + kPrefetchRows);
  RowCursor ahead{table, job.block_size, ahead_start / job.block_size, ahead_start % job.block_size};
  int64_t ahead_pos = ahead_start, rows[kTile];  // rows: element offsets of the tile's K (= V) rows
  for (int64_t pos = lo; pos < hi; pos += kTile) {
    const int64_t count = std::min(kTile, hi - pos);
    for (; ahead_pos < std::min(hi, pos + count + kPrefetchRows); ++ahead_pos, ahead.advance()) {
      prefetch_row(k_head + ahead.row() * head_dim, head_dim);
      prefetch_row(v_head + ahead.row() * head_dim, head_dim);
    }
    for (int64_t i = 0; i < kTile; ++i) {  // rows past count repeat the last one (masked out)
      rows[i] = cursor.row() * head_dim;
      if (i + 1 < count) cursor.advance();
    }
    cursor.advance();
    if (!job.bf16_dot) widen_tile<C, NC>(k_head, rows, count, head_dim, keys);
#if defined(__AVX512F__)
    if constexpr (NC > 0) {
      tile_all_avx512<C, NC>(job, k_head, v_head, rows, rows, count, keys, query, state, probs);
      continue;
    }
#endif
    widen_tile<C, NC>(v_head, rows, count, head_dim, values);
    for (int64_t g = 0; g < group; ++g) {
      float* acc = state.acc + g * head_dim;
      tile_step_generic(keys, values, query + g * head_dim, count, head_dim, state.row_max + g, state.row_sum + g,
                        acc, probs + g * kTile);
    }
  }
}

template <typename C>
using SpanFn = void (*)(const Job&, const C*, const C*, const int64_t*, int64_t, int64_t, State, Scratch&);

template <typename C>
SpanFn<C> pick_span_fn(int64_t head_dim) {
#if defined(__AVX512F__)
  switch (head_dim) {
    case 16: return attend_span<C, 1>;
    case 32: return attend_span<C, 2>;
    case 64: return attend_span<C, 4>;
    case 128: return attend_span<C, 8>;
    default: break;
  }
#endif
  return attend_span<C, 0>;
}

// The fp32 lane order and score path the span functions use for these types.
template <typename Q, typename C>
void pick_layout(Job& job) {
  bool fast = false;
#if defined(__AVX512F__)
  fast = job.head_dim == 32 || job.head_dim == 64 || job.head_dim == 128;
#endif
  job.permuted = fast && std::is_same_v<C, BF16>;
  job.bf16_dot = false;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  job.bf16_dot = fast && std::is_same_v<C, BF16> && std::is_same_v<Q, BF16>;
#endif
}

// Splits per item so that the work units keep every thread busy.
int64_t choose_splits(const Job& job, int64_t num_seqs) {
  const int64_t num_items = num_seqs * job.num_kv_heads, num_threads = at::get_num_threads();
  if (num_threads <= 1 || num_items >= 4 * num_threads) return 1;
  int64_t max_len = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = job.context_lens[s];
    max_len = std::max(max_len, job.window > 0 ? std::min(len, job.window) : len);
  }
  const int64_t wanted = (4 * num_threads + num_items - 1) / num_items;
  return std::clamp<int64_t>(std::min(wanted, max_len / kMinSplit), 1, kMaxSplits);
}

// The group's queries into the scratch: raw bf16 for bf16_dot, else scaled fp32 in lane order.
template <typename Q>
void load_query(const Job& job, const Q* q, int64_t seq, int64_t kv_head, float* query) {
  const Q* src = q + (seq * job.num_heads + kv_head * job.group) * job.head_dim;
  if (job.bf16_dot) {
    std::memcpy(query, src, job.group * job.head_dim * sizeof(Q));
    return;
  }
  for (int64_t g = 0; g < job.group; ++g)
    for (int64_t d = 0; d < job.head_dim; ++d)
      query[g * job.head_dim + lane_of(d, job.permuted)] = to_float(src[g * job.head_dim + d]) * job.scale;
}

// Output rows of one item: merges `num_splits` states and writes the group's
// heads [G, D] contiguously, back in natural dim order.
template <typename Q>
void write_output(const Job& job, const State* states, int64_t num_splits, Q* out) {
  const int64_t head_dim = job.head_dim;
  for (int64_t g = 0; g < job.group; ++g) {
    float top = kNegBig, total = 0.f, weights[kMaxSplits];
    for (int64_t s = 0; s < num_splits; ++s) top = std::max(top, states[s].row_max[g]);
    for (int64_t s = 0; s < num_splits; ++s) {
      weights[s] = std::exp(states[s].row_max[g] - top);
      total += weights[s] * states[s].row_sum[g];
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;
    for (int64_t d = 0; d < head_dim; ++d) {
      const int64_t lane = g * head_dim + lane_of(d, job.permuted);
      float value = 0.f;
      for (int64_t s = 0; s < num_splits; ++s) value += weights[s] * states[s].acc[lane];
      out[g * head_dim + d] = static_cast<Q>(value * inv);
    }
  }
}

template <typename Q, typename C>
void decode(Job job, const Q* q, const C* k_cache, const C* v_cache, Q* out, int64_t num_seqs) {
  pick_layout<Q, C>(job);
  const int64_t group = job.group, head_dim = job.head_dim, num_kv_heads = job.num_kv_heads;
  const int64_t num_items = num_seqs * num_kv_heads, num_splits = choose_splits(job, num_seqs);
  const int64_t state_floats = group * (head_dim + 2);
  std::vector<float> states(num_splits > 1 ? num_items * num_splits * state_floats : 0);  // [items, splits]
  const SpanFn<C> span_fn = pick_span_fn<C>(head_dim);
  auto state_at = [&](float* base) { return State{base, base + group, base + 2 * group}; };
  auto out_of = [&](int64_t item) { return out + (item / num_kv_heads * job.num_heads + item % num_kv_heads * group) * head_dim; };
  at::parallel_for(0, num_items * num_splits, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(group, head_dim);
    std::vector<float> own(num_splits == 1 ? state_floats : 0);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t item = unit / num_splits, split = unit % num_splits;
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t context = job.context_lens[seq];
      const int64_t first = job.window > 0 ? std::max<int64_t>(0, context - job.window) : 0;
      const int64_t chunk = ((context - first + num_splits - 1) / num_splits + kTile - 1) / kTile * kTile;
      const int64_t lo = std::min(context, first + split * chunk), hi = std::min(context, lo + chunk);
      State state = state_at(num_splits == 1 ? own.data() : states.data() + unit * state_floats);
      std::fill(state.row_max, state.row_max + group, kNegBig);
      std::fill(state.row_sum, state.row_sum + group + group * head_dim, 0.f);
      if (lo < hi) {
        load_query(job, q, seq, kv_head, scratch.query(group));
        const int64_t kv_offset = kv_head * job.num_blocks * job.block_size * head_dim;
        span_fn(job, k_cache + kv_offset, v_cache + kv_offset, job.block_tables + seq * job.max_blocks, lo, hi,
                state, scratch);
      }
      if (num_splits == 1) write_output(job, &state, 1, out_of(item));
    }
  });
  if (num_splits == 1) return;
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    State parts[kMaxSplits];
    for (int64_t item = begin; item < end; ++item) {
      for (int64_t s = 0; s < num_splits; ++s) parts[s] = state_at(states.data() + (item * num_splits + s) * state_floats);
      write_output(job, parts, num_splits, out_of(item));
    }
  });
}

template <typename Q>
void dispatch_cache(const Job& job, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out) {
  const Q* q_ptr = q.data_ptr<Q>();
  Q* out_ptr = out.data_ptr<Q>();
  const int64_t num_seqs = q.size(0);
  switch (k.scalar_type()) {
    case at::kFloat: return decode(job, q_ptr, k.data_ptr<float>(), v.data_ptr<float>(), out_ptr, num_seqs);
    case at::kBFloat16: return decode(job, q_ptr, k.data_ptr<BF16>(), v.data_ptr<BF16>(), out_ptr, num_seqs);
    case at::kHalf: return decode(job, q_ptr, k.data_ptr<c10::Half>(), v.data_ptr<c10::Half>(), out_ptr, num_seqs);
    default: TORCH_CHECK(false, "unsupported KV cache dtype ", k.scalar_type());
  }
}

}  // namespace

// q: [S, H, D]; caches: [KVH, NB, BS, D] contiguous; block_tables: [S, MB]
// int64; context_lens: [S] int64 (positions 0..len-1 visible; with window > 0
// only the last `window`). Returns [S, H, D] in q's dtype.
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                        at::Tensor context_lens, double scale, int64_t window) {
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad q / KV cache shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV cache must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches differ in dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_tables and context_lens must be int64");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0), "batch sizes differ");
  TORCH_CHECK(k_cache.size(3) == q.size(2) && q.size(1) % k_cache.size(0) == 0, "head shapes do not match");
  Job job{q.size(1), k_cache.size(0), q.size(2), q.size(1) / k_cache.size(0), k_cache.size(2), k_cache.size(1),
          block_tables.size(1), block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
          static_cast<float>(scale), window, false, false};
  auto out = at::empty_like(q);
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_cache<float>(job, q, k_cache, v_cache, out); break;
    case at::kBFloat16: dispatch_cache<BF16>(job, q, k_cache, v_cache, out); break;
    case at::kHalf: dispatch_cache<c10::Half>(job, q, k_cache, v_cache, out); break;
    default: TORCH_CHECK(false, "unsupported query dtype ", q.scalar_type());
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }
