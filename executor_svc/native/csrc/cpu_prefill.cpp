// Paged prefill attention for the CPU with AMX tiles (bf16), or without AMX
// with AVX512-BF16 dot products on the same packed tiles: every query of
// a chunk attends causally to its sequence's cached prefix and the chunk
// itself, K/V read from the block-indexed cache (this step's rows are stored
// there first).
//
// Flash-attention order per (span, query head, block of 16 query positions):
// for each chunk of 32 keys, S = Q K^T (2 tiles), an online softmax in
// AVX-512 (P rounded to bf16, as FlashAttention does), then O += P V with O
// held in 4 tiles across the chunks (64 dims; head_dim 128 and 256 run two and
// four passes). A row's output is rescaled only when its max grows by more
// than kSlack, so O rarely leaves the tiles. K and V are first repacked once
// per (span, kv head) into the tile layouts: K transposed in 32-bit pairs of
// dims, V in pairs of keys; with a sliding window, only from the chunk of the
// first key the span's first query sees. Scores may be soft-capped (Gemma 2)
// before the window and causal masks apply.
//
// An int8 cache (k_scale / v_scale: one fp32 scale per row) is repacked as
// the bf16 of its integers (exact: |q| <= 127), with the chunk's scales beside
// the tiles: each row of S is multiplied by its keys' K scales (times the
// softmax scale) in fp32, and P by the V scales before it is rounded to bf16
// for P V (the softmax sums use the unscaled P). No dequantized copy exists.
//
// Without AMX (AMD Zen 4) the same passes run on `vdpbf16ps` (bf16_dot.h):
// the K tile layout is a 16-key panel of dim pairs and the V layout four
// 16-dim panels of key pairs, so S and P V are dot-product blocks of 6 query
// rows; O stays in memory (L1) instead of tiles.
#include "cpu_prefill_pack.h"
#include <cmath>
#include <vector>

namespace {

#if defined(PAGODA_AMX) || defined(PAGODA_BF16_DOT)
// Rescale a row's output only when its running max grows by more than this
// (natural log units): until then probabilities are taken against the stale
// max and may reach e^8, which fp32 sums and bf16 rounding (relative) take
// without loss; the output is O / l either way.
constexpr float kSlack = 8.f;

// Scores of one row's chunk, s [32] fp32, scaled (keys 0-15 by sc0, 16-31 by
// sc1: the softmax scale, times the K scales for int8 caches) and masked to
// keys [lo, hi] of the chunk (-big elsewhere). OPTIONS: a window (lo) or a
// soft-cap may apply; without, the row runs the code it ran before they existed.
template <bool OPTIONS>
PAGODA_INLINE void row_scores(const float* s, __m512 sc0, __m512 sc1, float softcap, int64_t lo, int64_t hi,
                              __m512& s0, __m512& s1, __mmask16& v0, __mmask16& v1) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i last = _mm512_set1_epi32(int(hi)), upper = _mm512_add_epi32(lane, _mm512_set1_epi32(16));
  const __m512 neg = _mm512_set1_ps(kNegBig);
  v0 = _mm512_cmple_epi32_mask(lane, last);
  v1 = _mm512_cmple_epi32_mask(upper, last);
  if constexpr (!OPTIONS) {
    s0 = _mm512_mask_mul_ps(neg, v0, _mm512_load_ps(s), sc0);
    s1 = _mm512_mask_mul_ps(neg, v1, _mm512_load_ps(s + 16), sc1);
    return;
  }
  const __m512i first = _mm512_set1_epi32(int(std::max<int64_t>(lo, -1)));
  v0 &= _mm512_cmpge_epi32_mask(lane, first);
  v1 &= _mm512_cmpge_epi32_mask(upper, first);
  s0 = _mm512_mul_ps(_mm512_load_ps(s), sc0);
  s1 = _mm512_mul_ps(_mm512_load_ps(s + 16), sc1);
  if (softcap > 0.f) {
    s0 = pagoda::softcap16(s0, softcap);
    s1 = pagoda::softcap16(s1, softcap);
  }
  s0 = _mm512_mask_mov_ps(neg, v0, s0);
  s1 = _mm512_mask_mov_ps(neg, v1, s1);
}

// The key chunks a block of query positions [i0, i0 + rows) of a span visits: from the chunk of the first key
// its first query sees (all of them without a window) to that of the last key its last query sees.
struct ChunkRange {
  int64_t first, last;
};
inline ChunkRange key_chunks(const Span& span, const Shape& shape, int64_t i0, int64_t rows) {
  const int64_t last_key = span.num_cached + i0 + rows - 1;
  const int64_t first_key = shape.window > 0 ? std::max<int64_t>(span.num_cached + i0 - shape.window + 1, 0) : 0;
  return {first_key / kKeys, last_key / kKeys};
}

// The online softmax of one key chunk for the block's rows: s [kQ][kKeys] the raw scores in, pb the
// probabilities out (bf16; times the V scales for an int8 cache), m / l / alpha each row's running max, sum
// and the factor its output must be scaled by. Returns whether any row's output needs rescaling.
template <bool OPTIONS, bool QUANT>
PAGODA_INLINE bool chunk_softmax(const Span& span, const Shape& shape, int64_t i0, int64_t rows, int64_t chunk,
                                 const Packed& packed, int64_t packed_chunk, float scale, float (*s)[kKeys],
                                 BF16 (*pb)[kKeys], float* m, float* l, float* alpha) {
  const int64_t window = shape.window;
  __m512 sc0 = _mm512_set1_ps(scale), sc1 = sc0, vs0 = sc0, vs1 = sc0;
  if constexpr (QUANT) {
    sc0 = _mm512_loadu_ps(packed.k_scale + packed_chunk * kKeys);
    sc1 = _mm512_loadu_ps(packed.k_scale + packed_chunk * kKeys + 16);
    vs0 = _mm512_loadu_ps(packed.v_scale + packed_chunk * kKeys);
    vs1 = _mm512_loadu_ps(packed.v_scale + packed_chunk * kKeys + 16);
  }
  bool rescale = false;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t visible = span.num_cached + i0 + r - chunk * kKeys;  // keys [0, visible] of the chunk
    const int64_t oldest = window > 0 ? visible - window + 1 : -1;   // and keys [oldest, ...] of it
    alpha[r] = 1.f;
    if (visible < 0 || oldest >= kKeys) {
      std::memset(pb[r], 0, sizeof(pb[r]));
      continue;
    }
    __m512 s0, s1;
    __mmask16 v0, v1;
    row_scores<OPTIONS>(&s[r][0], sc0, sc1, shape.softcap, oldest, std::min<int64_t>(visible, kKeys), s0, s1, v0,
                        v1);
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
    if (top > m[r] + kSlack) {
      if (l[r] > 0.f) {
        alpha[r] = std::exp(m[r] - top);
        rescale = true;
      }
      m[r] = top;
    }
    const __m512 mx = _mm512_set1_ps(m[r]);
    const __m512 p0 = _mm512_maskz_mov_ps(v0, pagoda::exp16(_mm512_sub_ps(s0, mx)));
    const __m512 p1 = _mm512_maskz_mov_ps(v1, pagoda::exp16(_mm512_sub_ps(s1, mx)));
    l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
    if constexpr (QUANT)  // P V's weights: each key's probability times its V scale
      _mm512_store_si512(pb[r], (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(p1, vs1), _mm512_mul_ps(p0, vs0)));
    else
      _mm512_store_si512(pb[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
  }
  return rescale;
}

#if defined(PAGODA_AMX)
// One query head over the query block: O (tiles 0-3, 64 dims) stays in the
// tiles across the key chunks; S in tiles 4-5; 6: Q or P; 7: K or V.
// dgroup selects dims [64 * dgroup, 64 * dgroup + 64) of the output (head_dim
// 128 and 256 run two and four passes). QUANT: the packed tiles hold an int8
// cache's integers and `packed` their scales.
template <bool OPTIONS, bool QUANT>
void head_pass(const Span& span, const Shape& shape, int64_t i0, int64_t rows, const BF16* qb, Packed packed,
               float scale, int64_t dgroup, float* o, float* l) {
  const BF16 *kt = packed.kt, *vv = packed.vv;
  const int64_t d = shape.head_dim, dchunks = d / 32;
  alignas(64) float s[kQ][kKeys];
  alignas(64) BF16 pb[kQ][kKeys];
  float m[kQ], alpha[kQ];
  for (int64_t r = 0; r < kQ; ++r) {
    m[r] = kNegBig;
    l[r] = 0.f;
  }
  std::memset(pb, 0, sizeof(pb));
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const ChunkRange range = key_chunks(span, shape, i0, rows);
  for (int64_t chunk = range.first; chunk <= range.last; ++chunk) {
    const int64_t packed_chunk = chunk - span.base / kKeys;
    const BF16* kc = kt + packed_chunk * kKeys * d;
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t dc = 0; dc < dchunks; ++dc) {
      _tile_loadd(6, qb + dc * 32, kMaxDim * int64_t(sizeof(BF16)));  // qb rows hold kMaxDim dims
      _tile_loadd(7, kc + dc * 512, 64);
      _tile_dpbf16ps(4, 6, 7);
      _tile_loadd(7, kc + (dchunks + dc) * 512, 64);
      _tile_dpbf16ps(5, 6, 7);
    }
    _tile_stored(4, &s[0][0], 128);
    _tile_stored(5, &s[0][16], 128);
    const bool rescale = chunk_softmax<OPTIONS, QUANT>(span, shape, i0, rows, chunk, packed, packed_chunk, scale, s,
                                                       pb, m, l, alpha);
    if (rescale) {  // rare: out of the tiles, scale the rows, back in
      _tile_stored(0, o, 256);
      _tile_stored(1, o + 16, 256);
      _tile_stored(2, o + 32, 256);
      _tile_stored(3, o + 48, 256);
      for (int64_t r = 0; r < rows; ++r)
        if (alpha[r] != 1.f)
          for (int64_t c = 0; c < 64; c += 16)
            _mm512_store_ps(o + r * 64 + c, _mm512_mul_ps(_mm512_load_ps(o + r * 64 + c), _mm512_set1_ps(alpha[r])));
      _tile_loadd(0, o, 256);
      _tile_loadd(1, o + 16, 256);
      _tile_loadd(2, o + 32, 256);
      _tile_loadd(3, o + 48, 256);
    }
    const BF16* vc = vv + packed_chunk * kKeys * d + dgroup * 4 * 512;
    _tile_loadd(6, &pb[0][0], 64);
    _tile_loadd(7, vc, 64);
    _tile_dpbf16ps(0, 6, 7);
    _tile_loadd(7, vc + 512, 64);
    _tile_dpbf16ps(1, 6, 7);
    _tile_loadd(7, vc + 1024, 64);
    _tile_dpbf16ps(2, 6, 7);
    _tile_loadd(7, vc + 1536, 64);
    _tile_dpbf16ps(3, 6, 7);
  }
  _tile_stored(0, o, 256);
  _tile_stored(1, o + 16, 256);
  _tile_stored(2, o + 32, 256);
  _tile_stored(3, o + 48, 256);
}
#endif

#if defined(PAGODA_BF16_DOT)
// head_pass on AVX512-BF16 dot products: S = Q K^T in blocks of 6 query rows x the chunk's two 16-key panels,
// then O (in memory, [kQ][64] fp32) += P V in blocks of 6 rows x four 16-dim panels.
template <bool OPTIONS, bool QUANT>
void head_pass_dot(const Span& span, const Shape& shape, int64_t i0, int64_t rows, const BF16* qb, Packed packed,
                   float scale, int64_t dgroup, float* o, float* l) {
  const BF16 *kt = packed.kt, *vv = packed.vv;
  const int64_t d = shape.head_dim;
  alignas(64) float s[kQ][kKeys];
  alignas(64) BF16 pb[kQ][kKeys];
  float m[kQ], alpha[kQ];
  __m512 acc[pagoda::kDotRows * pagoda::kDotPanels];
  for (int64_t r = 0; r < kQ; ++r) {
    m[r] = kNegBig;
    l[r] = 0.f;
  }
  std::memset(pb, 0, sizeof(pb));
  std::memset(o, 0, kQ * 64 * sizeof(float));
  const ChunkRange range = key_chunks(span, shape, i0, rows);
  for (int64_t chunk = range.first; chunk <= range.last; ++chunk) {
    const int64_t packed_chunk = chunk - span.base / kKeys;
    const BF16* kc = kt + packed_chunk * kKeys * d;  // keys 0-15: d / 2 dim pairs x 16 keys x 2, then keys 16-31
    for (int64_t r0 = 0; r0 < rows; r0 += pagoda::kDotRows) {
      const int64_t n = std::min<int64_t>(pagoda::kDotRows, rows - r0);
      pagoda::bf16_dot(qb + r0 * kMaxDim, kMaxDim, n, kc, d * 16, d / 2, 2, acc);
      for (int64_t r = 0; r < n; ++r) {
        _mm512_store_ps(&s[r0 + r][0], acc[2 * r]);
        _mm512_store_ps(&s[r0 + r][16], acc[2 * r + 1]);
      }
    }
    if (chunk_softmax<OPTIONS, QUANT>(span, shape, i0, rows, chunk, packed, packed_chunk, scale, s, pb, m, l, alpha))
      for (int64_t r = 0; r < rows; ++r)
        if (alpha[r] != 1.f)
          for (int64_t c = 0; c < 64; c += 16)
            _mm512_store_ps(o + r * 64 + c, _mm512_mul_ps(_mm512_load_ps(o + r * 64 + c), _mm512_set1_ps(alpha[r])));
    const BF16* vc = vv + packed_chunk * kKeys * d + dgroup * 4 * 512;  // 4 panels of 16 dims: 16 key pairs each
    for (int64_t r0 = 0; r0 < rows; r0 += pagoda::kDotRows) {
      const int64_t n = std::min<int64_t>(pagoda::kDotRows, rows - r0);
      pagoda::bf16_dot(&pb[r0][0], kKeys, n, vc, 512, kKeys / 2, 4, acc);
      for (int64_t r = 0; r < n; ++r)
        for (int64_t t = 0; t < 4; ++t) {
          float* dst = o + (r0 + r) * 64 + 16 * t;
          _mm512_store_ps(dst, _mm512_add_ps(_mm512_load_ps(dst), acc[r * 4 + t]));
        }
    }
  }
}
#endif

// head_pass on the AMX tiles (tiles: this thread configured them) or on AVX512-BF16 dot products.
template <bool OPTIONS, bool QUANT>
void any_head_pass(bool tiles, const Span& span, const Shape& shape, int64_t i0, int64_t rows, const BF16* qb,
                   Packed packed, float scale, int64_t dgroup, float* o, float* l) {
#if defined(PAGODA_AMX)
  if (tiles) {
    head_pass<OPTIONS, QUANT>(span, shape, i0, rows, qb, packed, scale, dgroup, o, l);
    return;
  }
#endif
#if defined(PAGODA_BF16_DOT)
  head_pass_dot<OPTIONS, QUANT>(span, shape, i0, rows, qb, packed, scale, dgroup, o, l);
#endif
}

// One block of up to 16 query positions [i0, i0 + rows) of a span for query
// head `head` (of kv head h); writes its output rows.
void query_block(bool tiles, const Span& span, const Shape& shape, int64_t h, int64_t head, int64_t i0,
                 const BF16* q, Packed packed, float scale, BF16* out) {
  const int64_t d = shape.head_dim;
  const int64_t rows = std::min(kQ, span.num_query - i0);
  alignas(64) BF16 qb[kQ][kMaxDim];
  alignas(64) float o[kQ][64];
  float l[kQ];
  for (int64_t r = 0; r < kQ; ++r) {
    if (r < rows)
      std::memcpy(qb[r], q + (span.query_start + i0 + r) * shape.q_row + head * shape.q_head, d * sizeof(BF16));
    else
      std::memset(qb[r], 0, d * sizeof(BF16));
  }
  for (int64_t dgroup = 0; dgroup < d / 64; ++dgroup) {
    const bool options = shape.window > 0 || shape.softcap > 0.f, quant = packed.k_scale != nullptr;
    if (options && quant)
      any_head_pass<true, true>(tiles, span, shape, i0, rows, &qb[0][0], packed, scale, dgroup, &o[0][0], l);
    else if (options)
      any_head_pass<true, false>(tiles, span, shape, i0, rows, &qb[0][0], packed, scale, dgroup, &o[0][0], l);
    else if (quant)
      any_head_pass<false, true>(tiles, span, shape, i0, rows, &qb[0][0], packed, scale, dgroup, &o[0][0], l);
    else
      any_head_pass<false, false>(tiles, span, shape, i0, rows, &qb[0][0], packed, scale, dgroup, &o[0][0], l);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 inv = _mm512_set1_ps(1.f / l[r]);
      BF16* dst = out + ((span.query_start + i0 + r) * shape.num_heads + head) * d + dgroup * 64;
      for (int64_t c = 0; c < 64; c += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(&o[r][c]), inv)));
    }
  }
}

// Pass 2: (span, query head, query block) items, longest first, spread over the threads.
void attend_all(bool tiles, const std::vector<Span>& list, const Shape& shape, const Repacked& packed, const BF16* q,
                float scale, BF16* out) {
  struct Item {
    int64_t span, head, i0;
  };
  std::vector<Item> items;
  for (size_t i = 0; i < list.size(); ++i)
    for (int64_t head = 0; head < shape.num_heads; ++head)
      for (int64_t i0 = 0; i0 < list[i].num_query; i0 += kQ) items.push_back({int64_t(i), head, i0});
  // Longest blocks (latest positions) first, so the threads finish together.
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return list[a.span].num_cached + a.i0 > list[b.span].num_cached + b.i0;
  });
  // Interleaved split: thread t takes items t, t + n, ... (balanced after the sort).
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  pagoda::parallel_for(threads, 1, [&](int64_t begin, int64_t end) {
#if defined(PAGODA_AMX)
    if (tiles) pagoda::configure_square_tiles();
#endif
    for (int64_t t = begin; t < end; ++t)
      for (size_t j = t; j < items.size(); j += threads) {
        const Item& it = items[j];
        const Span& span = list[it.span];
        const int64_t h = it.head / shape.group;
        const Packed rows = packed.at(it.span * shape.num_kv_heads + h, packed_elems(span, shape.head_dim), shape.head_dim);
        query_block(tiles, span, shape, h, it.head, it.i0, q, rows, scale, out);
      }
#if defined(PAGODA_AMX)
    if (tiles) _tile_release();
#endif
  });
}

#endif

}  // namespace

// q [T, H, D] bf16 (rows and heads may be strided; dims contiguous); caches
// [KVH, NB, BS, D] bf16, or int8 with k_scale / v_scale [KVH, NB, BS] fp32,
// with this step's K/V already stored; block_tables [S, MB] int64; spans
// [P, 4] int64: query_start, num_query, num_cached, row of block_tables.
// window > 0: a query sees only the last `window` keys; softcap > 0: scores
// (scaled) become softcap * tanh(score / softcap). Writes out [T, H, D] bf16
// (contiguous) at the spans' rows; other rows are left as they are.
void paged_prefill(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables, at::Tensor spans,
                   double scale, at::Tensor out, int64_t window, double softcap,
                   const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
#if defined(PAGODA_AMX) || defined(PAGODA_BF16_DOT)
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.stride(2) == 1, "q must be [T, H, D] bf16");
  const bool quantized = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  (quantized || k_cache.scalar_type() == at::kBFloat16),
              "caches must be contiguous [KVH, NB, BS, D] bf16 or int8");
  TORCH_CHECK(quantized == (k_scale.has_value() && v_scale.has_value()) && k_scale.has_value() == v_scale.has_value(),
              "an int8 cache needs k_scale and v_scale, a bf16 cache none");
  if (quantized)
    for (const at::Tensor* s : {&*k_scale, &*v_scale})
      TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() && s->sizes() == k_cache.sizes().slice(0, 3),
                  "KV scales must be contiguous fp32 [KVH, NB, BS] like the cache's rows");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == at::kBFloat16,
              "out must be a contiguous bf16 tensor shaped like q");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && spans.scalar_type() == at::kLong && spans.dim() == 2 &&
                  spans.size(1) == 4,
              "block_tables and spans must be int64, spans [P, 4]");
  const int64_t d = q.size(2);
  TORCH_CHECK(d == 64 || d == 128 || d == kMaxDim, "head_dim must be 64, 128 or 256, got ", d);
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(k_cache.size(3) == d && q.size(1) % k_cache.size(0) == 0, "head shapes do not match");
#if defined(PAGODA_AMX)
  const bool tiles = pagoda::request_amx();
#else
  constexpr bool tiles = false;
#endif
#if !defined(PAGODA_BF16_DOT)
  TORCH_CHECK(tiles, "the kernel does not allow AMX for this process");
#endif
  block_tables = block_tables.contiguous();
  spans = spans.contiguous();
  const Shape shape{q.size(1), k_cache.size(0), q.size(1) / k_cache.size(0), d, k_cache.size(2), k_cache.size(1),
                    block_tables.size(1), q.stride(0), q.stride(1), window, static_cast<float>(softcap)};
  const std::vector<Span> list = read_spans(spans, q, block_tables, shape);
  const float fscale = static_cast<float>(scale);
  const Repacked packed =
      quantized ? repack_all<int8_t>(list, shape, k_cache, v_cache, k_scale->data_ptr<float>(),
                                     v_scale->data_ptr<float>(), block_tables, fscale)
                : repack_all<BF16>(list, shape, k_cache, v_cache, nullptr, nullptr, block_tables, fscale);
  attend_all(tiles, list, shape, packed, q.data_ptr<BF16>(), fscale, out.data_ptr<BF16>());
#else
  TORCH_CHECK(false, "this build has no bf16 prefill kernel (needs AMX-BF16 or AVX512-BF16)");
#endif
}

// Runs where bf16_kernels_ready() (cpu_gemm.cpp) is true.
TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("paged_prefill", &paged_prefill); }
