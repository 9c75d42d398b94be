// The bf16 prefill kernel's first pass (cpu_prefill.cpp): the spans, and K/V
// of each (span, kv head) repacked from the paged cache into tile layouts
// (an int8 cache as the bf16 of its integers, with its scales beside them),
// which the AMX tiles and the AVX512-BF16 dot products read alike.
#pragma once
#include "amx.h"
#include "bf16_dot.h"
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

// An int8 cache's row scales [NB * BS] of one kv head (both nullptr for a bf16 cache).
struct HeadScales {
  const float* k;
  const float* v;
};

// A repacked (span, kv head): K and V tiles, and for int8 caches their scales per key, [chunks * 32] each
// (K's already times the softmax scale); 0 past the context.
struct Packed {
  BF16* kt;
  BF16* vv;
  float* k_scale;  // nullptr: a bf16 cache
  float* v_scale;
};

#if defined(PAGODA_AMX) || defined(PAGODA_BF16_DOT)
// Elements of one (span, kv head) repack: K then V, each chunks x 32 keys x D, keys [base, context).
int64_t packed_elems(const Span& span, int64_t head_dim) {
  return 2 * ((span.context() - span.base + kKeys - 1) / kKeys) * kKeys * head_dim;
}

// A cache row as bf16 [D]: a bf16 row itself; an int8 row widened into `buffer` (its integers, exact in bf16).
PAGODA_INLINE const BF16* bf16_row(const BF16* row, int64_t, BF16*) { return row; }
PAGODA_INLINE const BF16* bf16_row(const int8_t* row, int64_t head_dim, BF16* buffer) {
  for (int64_t c = 0; c < head_dim; c += 32) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c))));
    const __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c + 16))));
    _mm512_storeu_si512(buffer + c, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
  }
  return buffer;
}

// Chunks of 32 keys of one (span, kv head) repack.
int64_t packed_chunks(const Span& span, int64_t head_dim) { return packed_elems(span, head_dim) / (2 * kKeys * head_dim); }

// K as B tiles of S = Q K^T: [chunk][half][d / 32][16 dim pairs][16 keys][2];
// V as B tiles of P V: [chunk][d / 16][16 key pairs][16 dims][2]; chunk 0
// holds keys from span.base. Zero past the context. An int8 cache's scales go
// to `out`'s scale arrays (K's times `scale`).
template <typename C>
void repack(const C* k_head, const C* v_head, HeadScales scales, const int64_t* table, const Shape& shape,
            const Span& span, float scale, Packed out) {
  const int64_t d = shape.head_dim, chunks = packed_chunks(span, d);
  BF16 *kt = out.kt, *vv = out.vv;
  std::memset(kt, 0, chunks * kKeys * d * sizeof(BF16));
  std::memset(vv, 0, chunks * kKeys * d * sizeof(BF16));
  if (out.k_scale != nullptr) {
    std::memset(out.k_scale, 0, chunks * kKeys * sizeof(float));
    std::memset(out.v_scale, 0, chunks * kKeys * sizeof(float));
  }
  const int64_t dchunks = d / 32;
  for (int64_t pos = span.base; pos < span.context(); ++pos) {
    const int64_t slot = table[pos / shape.block_size] * shape.block_size + pos % shape.block_size;
    alignas(64) BF16 k_buffer[kMaxDim], v_buffer[kMaxDim];
    const BF16* k_row = bf16_row(k_head + slot * d, d, k_buffer);
    const BF16* v_row = bf16_row(v_head + slot * d, d, v_buffer);
    const uint32_t* k_pairs = reinterpret_cast<const uint32_t*>(k_row);
    const int64_t chunk = (pos - span.base) / kKeys, key = pos % kKeys, half = key / 16, col = key % 16;
    uint32_t* kt_chunk = reinterpret_cast<uint32_t*>(kt + chunk * kKeys * d);
    for (int64_t p = 0; p < d / 2; ++p)  // dim pair p of this key
      kt_chunk[((half * dchunks + p / 16) * 16 + p % 16) * 16 + col] = k_pairs[p];
    BF16* vv_chunk = vv + chunk * kKeys * d;
    for (int64_t c = 0; c < d; ++c)
      vv_chunk[((c / 16) * 16 + key / 2) * 32 + (c % 16) * 2 + key % 2] = v_row[c];
    if (out.k_scale != nullptr) {
      out.k_scale[chunk * kKeys + key] = scales.k[slot] * scale;
      out.v_scale[chunk * kKeys + key] = scales.v[slot];
    }
  }
}

// The spans [P, 4], checked against q and the block tables.
std::vector<Span> read_spans(const at::Tensor& spans, const at::Tensor& q, const at::Tensor& block_tables,
                             const Shape& shape) {
  std::vector<Span> list;
  const int64_t* raw = spans.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < spans.size(0); ++i) {
    const int64_t num_cached = raw[4 * i + 2];
    const int64_t base = shape.window > 0 ? std::max<int64_t>(num_cached - shape.window + 1, 0) / kKeys * kKeys : 0;
    const Span span{raw[4 * i], raw[4 * i + 1], num_cached, raw[4 * i + 3], base};
    TORCH_CHECK(span.num_query > 0 && span.num_cached >= 0 && span.query_start >= 0 &&
                    span.query_start + span.num_query <= q.size(0) && span.seq >= 0 &&
                    span.seq < block_tables.size(0),
                "span ", i, " is out of range");
    TORCH_CHECK(span.context() <= shape.max_blocks * shape.block_size,
                "span ", i, " is longer than its block table");
    for (int64_t b = span.base / shape.block_size; b < (span.context() + shape.block_size - 1) / shape.block_size; ++b) {
      const int64_t block = tables[span.seq * shape.max_blocks + b];
      TORCH_CHECK(block >= 0 && block < shape.num_blocks, "block id ", block, " out of range");
    }
    list.push_back(span);
  }
  return list;
}

// Every (span, kv head)'s repack: tiles in `tiles` (bf16), scales in `scales` (fp32, int8 caches), at offsets
// offsets[item] (elements) and offsets[item] / D (scales).
struct Repacked {
  std::vector<int64_t> offsets;
  at::Tensor tiles, scales;
  Packed at(int64_t item, int64_t span_elems, int64_t head_dim) const {
    BF16* kt = tiles.data_ptr<BF16>() + offsets[item];
    if (!scales.defined()) return {kt, kt + span_elems / 2, nullptr, nullptr};
    float* ks = scales.data_ptr<float>() + offsets[item] / head_dim;
    return {kt, kt + span_elems / 2, ks, ks + span_elems / head_dim / 2};
  }
};

// Pass 1: repacks K/V (and scales) per (span, kv head).
template <typename C>
Repacked repack_all(const std::vector<Span>& list, const Shape& shape, const at::Tensor& k_cache,
                    const at::Tensor& v_cache, const float* k_scales, const float* v_scales,
                    const at::Tensor& block_tables, float scale) {
  const int64_t d = shape.head_dim, kvh = shape.num_kv_heads;
  Repacked packed{std::vector<int64_t>(list.size() * kvh + 1, 0), {}, {}};
  for (size_t i = 0; i < list.size(); ++i)
    for (int64_t h = 0; h < kvh; ++h) packed.offsets[i * kvh + h + 1] = packed.offsets[i * kvh + h] + packed_elems(list[i], d);
  packed.tiles = at::empty({packed.offsets.back()}, k_cache.options().dtype(at::kBFloat16));
  if (k_scales != nullptr) packed.scales = at::empty({packed.offsets.back() / d}, k_cache.options().dtype(at::kFloat));
  const C *kd = k_cache.data_ptr<C>(), *vd = v_cache.data_ptr<C>();
  const int64_t head_slots = shape.num_blocks * shape.block_size;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  pagoda::parallel_for(int64_t(list.size()) * kvh, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const Span& span = list[item / kvh];
      const int64_t h = item % kvh;
      const HeadScales scales{k_scales ? k_scales + h * head_slots : nullptr, v_scales ? v_scales + h * head_slots : nullptr};
      repack(kd + h * head_slots * d, vd + h * head_slots * d, scales, tables + span.seq * shape.max_blocks, shape,
             span, scale, packed.at(item, packed_elems(span, d), d));
    }
  });
  return packed;
}

#endif

}  // namespace
