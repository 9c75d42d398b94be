// Paged prefill attention for the CPU with AMX tiles (bf16): every query of
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
#include "amx.h"
#include <cmath>
#include <vector>

namespace {

using BF16 = c10::BFloat16;
constexpr int64_t kQ = 16;      // query positions per block (tile rows)
constexpr int64_t kKeys = 32;   // keys per chunk (the bf16 depth of one tile product)
constexpr int64_t kMaxDim = 256;  // largest head_dim (Gemma's)
using pagoda::kNegBig;

struct Span {
  int64_t query_start, num_query, num_cached, seq;
  int64_t base;  // first key repacked (a multiple of kKeys): 0, or the window's start for the first query
  int64_t context() const { return num_cached + num_query; }
};

struct Shape {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, num_blocks, max_blocks;
  int64_t q_row, q_head;  // q strides (elements)
  int64_t window;  // keys older than this many positions are not seen; 0: none
  float softcap;   // scores become softcap * tanh(score / softcap); 0: not capped
};

#if defined(PAGODA_AMX)
// Elements of one (span, kv head) repack: K then V, each chunks x 32 keys x D, keys [base, context).
int64_t packed_elems(const Span& span, int64_t head_dim) {
  return 2 * ((span.context() - span.base + kKeys - 1) / kKeys) * kKeys * head_dim;
}

// K as B tiles of S = Q K^T: [chunk][half][d / 32][16 dim pairs][16 keys][2];
// V as B tiles of P V: [chunk][d / 16][16 key pairs][16 dims][2]; chunk 0
// holds keys from span.base. Zero past the context.
void repack(const BF16* k_head, const BF16* v_head, const int64_t* table, const Shape& shape, const Span& span,
            BF16* kt, BF16* vv) {
  const int64_t d = shape.head_dim, chunks = packed_elems(span, d) / (2 * kKeys * d);
  std::memset(kt, 0, chunks * kKeys * d * sizeof(BF16));
  std::memset(vv, 0, chunks * kKeys * d * sizeof(BF16));
  const int64_t dchunks = d / 32;
  for (int64_t pos = span.base; pos < span.context(); ++pos) {
    const int64_t row = (table[pos / shape.block_size] * shape.block_size + pos % shape.block_size) * d;
    const uint32_t* k_pairs = reinterpret_cast<const uint32_t*>(k_head + row);
    const BF16* v_row = v_head + row;
    const int64_t chunk = (pos - span.base) / kKeys, key = pos % kKeys, half = key / 16, col = key % 16;
    uint32_t* kt_chunk = reinterpret_cast<uint32_t*>(kt + chunk * kKeys * d);
    for (int64_t p = 0; p < d / 2; ++p)  // dim pair p of this key
      kt_chunk[((half * dchunks + p / 16) * 16 + p % 16) * 16 + col] = k_pairs[p];
    BF16* vv_chunk = vv + chunk * kKeys * d;
    for (int64_t c = 0; c < d; ++c)
      vv_chunk[((c / 16) * 16 + key / 2) * 32 + (c % 16) * 2 + key % 2] = v_row[c];
  }
}

// Rescale a row's output only when its running max grows by more than this
// (natural log units): until then probabilities are taken against the stale
// max and may reach e^8, which fp32 sums and bf16 rounding (relative) take
// without loss; the output is O / l either way.
constexpr float kSlack = 8.f;

// Scores of one row's chunk, s [32] fp32, scaled and masked to keys [lo, hi]
// of the chunk (-big elsewhere). OPTIONS: a window (lo) or a soft-cap may
// apply; without, the row runs the code it ran before they existed.
template <bool OPTIONS>
PAGODA_INLINE void row_scores(const float* s, float scale, float softcap, int64_t lo, int64_t hi, __m512& s0,
                              __m512& s1, __mmask16& v0, __mmask16& v1) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i last = _mm512_set1_epi32(int(hi)), upper = _mm512_add_epi32(lane, _mm512_set1_epi32(16));
  const __m512 neg = _mm512_set1_ps(kNegBig), sc = _mm512_set1_ps(scale);
  v0 = _mm512_cmple_epi32_mask(lane, last);
  v1 = _mm512_cmple_epi32_mask(upper, last);
  if constexpr (!OPTIONS) {
    s0 = _mm512_mask_mul_ps(neg, v0, _mm512_load_ps(s), sc);
    s1 = _mm512_mask_mul_ps(neg, v1, _mm512_load_ps(s + 16), sc);
    return;
  }
  const __m512i first = _mm512_set1_epi32(int(std::max<int64_t>(lo, -1)));
  v0 &= _mm512_cmpge_epi32_mask(lane, first);
  v1 &= _mm512_cmpge_epi32_mask(upper, first);
  s0 = _mm512_mul_ps(_mm512_load_ps(s), sc);
  s1 = _mm512_mul_ps(_mm512_load_ps(s + 16), sc);
  if (softcap > 0.f) {
    s0 = pagoda::softcap16(s0, softcap);
    s1 = pagoda::softcap16(s1, softcap);
  }
  s0 = _mm512_mask_mov_ps(neg, v0, s0);
  s1 = _mm512_mask_mov_ps(neg, v1, s1);
}

// One query head over the query block: O (tiles 0-3, 64 dims) stays in the
// tiles across the key chunks; S in tiles 4-5; 6: Q or P; 7: K or V.
// dgroup selects dims [64 * dgroup, 64 * dgroup + 64) of the output (head_dim
// 128 and 256 run two and four passes).
template <bool OPTIONS>
void head_pass(const Span& span, const Shape& shape, int64_t i0, int64_t rows, const BF16* qb, const BF16* kt,
               const BF16* vv, float scale, int64_t dgroup, float* o, float* l) {
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
  const int64_t last_key = span.num_cached + i0 + rows - 1;  // the block's last query sees keys <= this
  const int64_t window = shape.window;
  // The block's first query sees keys from this one on (all of them without a window).
  const int64_t first_key = window > 0 ? std::max<int64_t>(span.num_cached + i0 - window + 1, 0) : 0;
  for (int64_t chunk = first_key / kKeys; chunk * kKeys <= last_key; ++chunk) {
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
      row_scores<OPTIONS>(&s[r][0], scale, shape.softcap, oldest, std::min<int64_t>(visible, kKeys), s0, s1, v0, v1);
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
      _mm512_store_si512(pb[r], (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
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

// One block of up to 16 query positions [i0, i0 + rows) of a span for query
// head `head` (of kv head h); writes its output rows.
void query_block(const Span& span, const Shape& shape, int64_t h, int64_t head, int64_t i0, const BF16* q,
                 const BF16* kt, const BF16* vv, float scale, BF16* out) {
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
    if (shape.window > 0 || shape.softcap > 0.f)
      head_pass<true>(span, shape, i0, rows, &qb[0][0], kt, vv, scale, dgroup, &o[0][0], l);
    else
      head_pass<false>(span, shape, i0, rows, &qb[0][0], kt, vv, scale, dgroup, &o[0][0], l);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 inv = _mm512_set1_ps(1.f / l[r]);
      BF16* dst = out + ((span.query_start + i0 + r) * shape.num_heads + head) * d + dgroup * 64;
      for (int64_t c = 0; c < 64; c += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(&o[r][c]), inv)));
    }
  }
}
#endif

}  // namespace

// q [T, H, D] bf16 (rows and heads may be strided; dims contiguous); caches
// [KVH, NB, BS, D] bf16 with this step's K/V already stored; block_tables
// [S, MB] int64; spans [P, 4] int64: query_start, num_query, num_cached,
// row of block_tables. window > 0: a query sees only the last `window` keys;
// softcap > 0: scores (scaled) become softcap * tanh(score / softcap). Writes
// out [T, H, D] bf16 (contiguous) at the spans' rows; other rows are left as
// they are.
void paged_prefill(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables, at::Tensor spans,
                   double scale, at::Tensor out, int64_t window, double softcap) {
#if defined(PAGODA_AMX)
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.stride(2) == 1, "q must be [T, H, D] bf16");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              "caches must be contiguous [KVH, NB, BS, D] bf16");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == at::kBFloat16,
              "out must be a contiguous bf16 tensor shaped like q");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && spans.scalar_type() == at::kLong && spans.dim() == 2 &&
                  spans.size(1) == 4,
              "block_tables and spans must be int64, spans [P, 4]");
  const int64_t d = q.size(2);
  TORCH_CHECK(d == 64 || d == 128 || d == kMaxDim, "head_dim must be 64, 128 or 256, got ", d);
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(k_cache.size(3) == d && q.size(1) % k_cache.size(0) == 0, "head shapes do not match");
  TORCH_CHECK(pagoda::request_amx(), "the kernel does not allow AMX for this process");
  block_tables = block_tables.contiguous();
  spans = spans.contiguous();
  const Shape shape{q.size(1), k_cache.size(0), q.size(1) / k_cache.size(0), d, k_cache.size(2), k_cache.size(1),
                    block_tables.size(1), q.stride(0), q.stride(1), window, static_cast<float>(softcap)};
  std::vector<Span> list;
  const int64_t* raw = spans.data_ptr<int64_t>();
  for (int64_t i = 0; i < spans.size(0); ++i) {
    const int64_t num_cached = raw[4 * i + 2];
    const int64_t base = window > 0 ? std::max<int64_t>(num_cached - window + 1, 0) / kKeys * kKeys : 0;
    const Span span{raw[4 * i], raw[4 * i + 1], num_cached, raw[4 * i + 3], base};
    TORCH_CHECK(span.num_query > 0 && span.num_cached >= 0 && span.query_start >= 0 &&
                    span.query_start + span.num_query <= q.size(0) && span.seq >= 0 &&
                    span.seq < block_tables.size(0),
                "span ", i, " is out of range");
    TORCH_CHECK(span.context() <= shape.max_blocks * shape.block_size,
                "span ", i, " is longer than its block table");
    list.push_back(span);
  }
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (const Span& span : list)
    for (int64_t b = span.base / shape.block_size; b < (span.context() + shape.block_size - 1) / shape.block_size; ++b) {
      const int64_t block = tables[span.seq * shape.max_blocks + b];
      TORCH_CHECK(block >= 0 && block < shape.num_blocks, "block id ", block, " out of range");
    }
  // Pass 1: repack K/V per (span, kv head).
  std::vector<int64_t> offsets(list.size() * shape.num_kv_heads + 1, 0);
  for (size_t i = 0; i < list.size(); ++i)
    for (int64_t h = 0; h < shape.num_kv_heads; ++h)
      offsets[i * shape.num_kv_heads + h + 1] = offsets[i * shape.num_kv_heads + h] + packed_elems(list[i], d);
  auto packed = at::empty({offsets.back()}, q.options());
  BF16* pk = packed.data_ptr<BF16>();
  const BF16* kd = k_cache.data_ptr<BF16>();
  const BF16* vd = v_cache.data_ptr<BF16>();
  const int64_t head_elems = shape.num_blocks * shape.block_size * d;
  pagoda::parallel_for(int64_t(list.size()) * shape.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const Span& span = list[item / shape.num_kv_heads];
      const int64_t h = item % shape.num_kv_heads;
      BF16* kt = pk + offsets[item];
      repack(kd + h * head_elems, vd + h * head_elems, tables + span.seq * shape.max_blocks, shape, span, kt,
             kt + packed_elems(span, d) / 2);
    }
  });
  // Pass 2: (span, kv head, head group, query block) items.
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
  const BF16* qd = q.data_ptr<BF16>();
  BF16* od = out.data_ptr<BF16>();
  const float fscale = static_cast<float>(scale);
  // Interleaved split: thread t takes items t, t + n, ... (balanced after the sort).
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));
  pagoda::parallel_for(threads, 1, [&](int64_t begin, int64_t end) {
    pagoda::configure_square_tiles();
    for (int64_t t = begin; t < end; ++t)
      for (size_t j = t; j < items.size(); j += threads) {
        const Item& it = items[j];
        const Span& span = list[it.span];
        const int64_t h = it.head / shape.group;
        const BF16* kt = pk + offsets[it.span * shape.num_kv_heads + h];
        const BF16* vv = kt + packed_elems(span, d) / 2;
        query_block(span, shape, h, it.head, it.i0, qd, kt, vv, fscale, od);
      }
    _tile_release();
  });
#else
  TORCH_CHECK(false, "this build has no AMX prefill kernel");
#endif
}

// Runs where amx_ready() (library.cpp) is true.
TORCH_LIBRARY_IMPL(pagoda, CPU, m) { m.impl("paged_prefill", &paged_prefill); }
