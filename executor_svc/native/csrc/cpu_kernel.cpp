// Paged decode attention for the CPU: one query token per sequence, K/V read
// in place from the block-indexed cache (no gather copy).
//
// One pass per (sequence, kv head) with an online softmax (flash-decoding):
// positions go in tiles of 16, every query of the GQA group is scored
// against the tile and accumulates its V rows. With few items (sequences x
// kv heads) the context is split across threads and the partial softmax
// states merged (split-K).
//
// On AVX-512, head dims 16/32/64/128 run intrinsics (span_wide: 16 fp32
// lanes, rows widened to fp32 in registers, 16 row dot products reduced by
// one transpose-add tree, state in registers). bf16 rows widen without
// shuffles into an even/odd lane order (queries and outputs use the same
// order). Anything else runs plain loops that the compiler vectorises (-O3
// -ffast-math), so the build works on any CPU. On AVX2 + FMA without AVX-512,
// head dims that are a multiple of 8 run intrinsics (cpu_kernel_avx2.h): GQA
// groups of up to 4 queries straight from the cache rows, larger ones the
// widened tiles with an AVX2 tile step.
//
// int8 caches (cpu_kernel_common.h) take the same paths: rows widen from
// int8 in registers (natural lane order), each tile's 16 K scales multiply
// its scores and its 16 V scales its probabilities before P.V (the softmax
// sums use the unscaled ones). store_kv quantizes the step's rows.
#include "cpu_kernel_common.h"
#include "cpu_kernel_avx2.h"
#include "cpu_kernel_avx512.h"
#include "cpu_layer_ops.h"

namespace {

// Portable tile step for one query, any head_dim: keys/values [count, D] fp32; softcap 0: not capped.
inline void tile_step_generic(const float* keys, const float* values, const float* query, int64_t count,
                              int64_t head_dim, float softcap, float* row_max, float* row_sum, float* acc,
                              float* probs) {
  float new_max = *row_max;
  for (int64_t i = 0; i < count; ++i) {
    const float* key = keys + i * head_dim;
    float dot = 0.f;
    for (int64_t d = 0; d < head_dim; ++d) dot += query[d] * key[d];
    if (softcap > 0.f) dot = softcap * std::tanh(dot / softcap);
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

// Widens the tile's rows (element offsets into head) into out [count, D], times their scales (int8 caches).
template <typename C>
inline void widen_tile(const C* head, const float* scales, const int64_t* rows, int64_t count, int64_t head_dim,
                       float* out) {
  for (int64_t i = 0; i < count; ++i) {
    if constexpr (kQuantized<C>) {
      const float scale = scales[rows[i] / head_dim];
      for (int64_t d = 0; d < head_dim; ++d) out[i * head_dim + d] = to_float(head[rows[i] + d]) * scale;
    } else {
      for (int64_t d = 0; d < head_dim; ++d) out[i * head_dim + d] = to_float(head[rows[i] + d]);
    }
  }
}

// Attends the group's queries (see Scratch::query) over positions [lo, hi) of
// one sequence and kv head, folding into `state`. NC = D / 16, or 0 for generic.
template <typename C, int NC>
void attend_span(const Job& job, HeadRows<C> head, const int64_t* table, int64_t lo, int64_t hi, State state,
                 Scratch& scratch) {
  const int64_t head_dim = job.head_dim, group = job.group;
  float *keys = scratch.keys(), *values = scratch.values(), *probs = scratch.probs(), *query = scratch.query(group);
#if defined(__AVX512F__)
  if constexpr (NC > 0) return span_wide_all<C, NC>(job, head, table, lo, hi, state, query);
#endif
#if defined(PAGODA_AVX2_ATTENTION)
  if (head_dim % 8 == 0 && head_dim <= 256) {
    switch (group) {
      case 1: return pagoda_avx2::span_rows<1>(job, head, table, lo, hi, state, query);
      case 2: return pagoda_avx2::span_rows<2>(job, head, table, lo, hi, state, query);
      case 3: return pagoda_avx2::span_rows<3>(job, head, table, lo, hi, state, query);
      case 4: return pagoda_avx2::span_rows<4>(job, head, table, lo, hi, state, query);
      default: break;  // larger groups: the widened tiles below, per query
    }
  }
#endif
  TileWalker<C> walker(job, head, table, lo, hi);
  int64_t rows[kTile];  // element offsets of the tile's K (= V) rows
  while (const int64_t count = walker.next(rows)) {
    widen_tile(head.k, head.k_scale, rows, count, head_dim, keys);
    widen_tile(head.v, head.v_scale, rows, count, head_dim, values);
    for (int64_t g = 0; g < group; ++g) {
      float* acc = state.acc + g * head_dim;
#if defined(PAGODA_AVX2_ATTENTION)
      if (head_dim % 8 == 0) {
        pagoda_avx2::tile_step(keys, values, query + g * head_dim, count, head_dim, job.softcap, state.row_max + g,
                               state.row_sum + g, acc, probs + g * kTile);
        continue;
      }
#endif
      tile_step_generic(keys, values, query + g * head_dim, count, head_dim, job.softcap, state.row_max + g,
                        state.row_sum + g, acc, probs + g * kTile);
    }
  }
}

template <typename C>
using SpanFn = void (*)(const Job&, HeadRows<C>, const int64_t*, int64_t, int64_t, State, Scratch&);

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

// The fp32 lane order the span functions use for this cache type.
template <typename C>
void pick_layout(Job& job) {
  bool fast = false;
#if defined(__AVX512F__)
  fast = job.head_dim == 32 || job.head_dim == 64 || job.head_dim == 128;
#endif
  job.lanes = fast && std::is_same_v<C, BF16> ? kEvenOdd : kNatural;
}

// Splits per item so that the work units keep every thread busy.
int64_t choose_splits(const Job& job, int64_t num_seqs) {
  const int64_t num_items = num_seqs * job.num_kv_heads, num_threads = at::get_num_threads();
  if (!job.split_kv || num_threads <= 1 || num_items >= 4 * num_threads) return 1;
  int64_t max_len = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = job.context_lens[s];
    max_len = std::max(max_len, job.window > 0 ? std::min(len, job.window) : len);
  }
  const int64_t wanted = (4 * num_threads + num_items - 1) / num_items;
  return std::clamp<int64_t>(std::min(wanted, max_len / kMinSplit), 1, kMaxSplits);
}

// The group's queries into the scratch: scaled fp32 in lane order.
template <typename Q>
void load_query(const Job& job, const Q* q, int64_t seq, int64_t kv_head, float* query) {
  const Q* src = q + (seq * job.num_heads + kv_head * job.group) * job.head_dim;
  for (int64_t g = 0; g < job.group; ++g)
    for (int64_t d = 0; d < job.head_dim; ++d)
      query[g * job.head_dim + lane_of(d, job.lanes)] = to_float(src[g * job.head_dim + d]) * job.scale;
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
      const int64_t lane = g * head_dim + lane_of(d, job.lanes);
      float value = 0.f;
      for (int64_t s = 0; s < num_splits; ++s) value += weights[s] * states[s].acc[lane];
      out[g * head_dim + d] = static_cast<Q>(value * inv);
    }
  }
}

// Prefetches (to L2) the K and V rows of the first tile of `unit`, the
// thread's next one: its span would otherwise start on a cold tile.
template <typename C, typename F>
void prefetch_first_tile(const Job& job, const C* k_cache, const C* v_cache, int64_t unit, int64_t num_splits,
                         const F& span_of) {
#if defined(__GNUC__)
  int64_t lo, hi;
  span_of(unit, lo, hi);
  const int64_t item = unit / num_splits, seq = item / job.num_kv_heads, kv_head = item % job.num_kv_heads;
  const int64_t head = kv_head * job.num_blocks * job.block_size * job.head_dim;
  const int64_t* table = job.block_tables + seq * job.max_blocks;
  const int64_t bytes = job.head_dim * int64_t(sizeof(C));
  for (int64_t pos = lo; pos < std::min(hi, lo + kTile); ++pos) {
    const int64_t row = head + (table[pos / job.block_size] * job.block_size + pos % job.block_size) * job.head_dim;
    const char *k = reinterpret_cast<const char*>(k_cache + row), *v = reinterpret_cast<const char*>(v_cache + row);
    for (int64_t offset = 0; offset < bytes; offset += 64) {
      __builtin_prefetch(k + offset, 0, 2);
      __builtin_prefetch(v + offset, 0, 2);
    }
  }
#endif
}

template <typename Q, typename C>
void decode(Job job, const Q* q, const C* k_cache, const C* v_cache, Q* out, int64_t num_seqs) {
  pick_layout<C>(job);
  const int64_t group = job.group, head_dim = job.head_dim, num_kv_heads = job.num_kv_heads;
  const int64_t num_items = num_seqs * num_kv_heads, num_splits = choose_splits(job, num_seqs);
  const int64_t state_floats = group * (head_dim + 2);
  std::vector<float> states(num_splits > 1 ? num_items * num_splits * state_floats : 0);  // [items, splits]
  const SpanFn<C> span_fn = pick_span_fn<C>(head_dim);
  auto state_at = [&](float* base) { return State{base, base + group, base + 2 * group}; };
  auto out_of = [&](int64_t item) { return out + (item / num_kv_heads * job.num_heads + item % num_kv_heads * group) * head_dim; };
  // Positions [lo, hi) of one unit (an item's split).
  auto span_of = [&](int64_t unit, int64_t& lo, int64_t& hi) {
    const int64_t split = unit % num_splits, context = job.context_lens[unit / num_splits / num_kv_heads];
    const int64_t first = job.window > 0 ? std::max<int64_t>(0, context - job.window) : 0;
    const int64_t chunk = ((context - first + num_splits - 1) / num_splits + kTile - 1) / kTile * kTile;
    lo = std::min(context, first + split * chunk);
    hi = std::min(context, lo + chunk);
  };
  const int64_t head_slots = job.num_blocks * job.block_size, head_elems = head_slots * head_dim;
  // Threads split the units by positions to read (plus a fixed cost for the query and the output), not by count.
  auto unit_cost = [&](int64_t unit) {
    int64_t lo, hi;
    span_of(unit, lo, hi);
    return hi - lo + kTile;
  };
  pagoda::parallel_for_balanced(num_items * num_splits, unit_cost, [&](int64_t begin, int64_t end) {
    Scratch scratch(group, head_dim);
    std::vector<float> own(num_splits == 1 ? state_floats : 0);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t item = unit / num_splits;
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      int64_t lo, hi;
      span_of(unit, lo, hi);
      if (unit + 1 < end) prefetch_first_tile(job, k_cache, v_cache, unit + 1, num_splits, span_of);
      State state = state_at(num_splits == 1 ? own.data() : states.data() + unit * state_floats);
      std::fill(state.row_max, state.row_max + group, kNegBig);
      std::fill(state.row_sum, state.row_sum + group + group * head_dim, 0.f);
      if (lo < hi) {
        load_query(job, q, seq, kv_head, scratch.query(group));
        const int64_t kv_offset = kv_head * head_elems, scale_offset = kv_head * head_slots;
        const HeadRows<C> head{k_cache + kv_offset, v_cache + kv_offset,
                               job.k_scales ? job.k_scales + scale_offset : nullptr,
                               job.v_scales ? job.v_scales + scale_offset : nullptr};
        span_fn(job, head, job.block_tables + seq * job.max_blocks, lo, hi, state, scratch);
      }
      if (num_splits == 1) write_output(job, &state, 1, out_of(item));
    }
  });
  if (num_splits == 1) return;
  parallel_for(num_items, 1, [&](int64_t begin, int64_t end) {
    State parts[kMaxSplits];
    for (int64_t item = begin; item < end; ++item) {
      for (int64_t s = 0; s < num_splits; ++s) parts[s] = state_at(states.data() + (item * num_splits + s) * state_floats);
      write_output(job, parts, num_splits, out_of(item));
    }
  });
}

// Checks an int8 cache's scales: both given, fp32, contiguous, one per row of the cache [KVH, NB, BS].
// Returns false when the cache is not int8 (then no scales may be given).
bool check_scales(const at::Tensor& k_cache, const std::optional<at::Tensor>& k_scale,
                  const std::optional<at::Tensor>& v_scale) {
  if (k_cache.scalar_type() != at::kChar) {
    TORCH_CHECK(!k_scale.has_value() && !v_scale.has_value(), "scales are only for an int8 KV cache");
    return false;
  }
  TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "an int8 KV cache needs k_scale and v_scale");
  for (const at::Tensor* scale : {&*k_scale, &*v_scale})
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->is_contiguous() &&
                    scale->sizes() == k_cache.sizes().slice(0, 3),
                "KV scales must be contiguous fp32 [KVH, NB, BS] like the cache's rows");
  return true;
}

}  // namespace

// q: [S, H, D]; caches: [KVH, NB, BS, D] contiguous (fp32, bf16, fp16, or
// int8 with k_scale / v_scale [KVH, NB, BS] fp32); block_tables: [S, MB]
// int64; context_lens: [S] int64 (positions 0..len-1 visible; with window > 0
// only the last `window`); softcap > 0: scores (already scaled) become
// softcap * tanh(score / softcap); split_kv false: never split a row's keys
// (Job::split_kv). Returns [S, H, D] in q's dtype.
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                        at::Tensor context_lens, double scale, int64_t window, double softcap,
                        const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                        bool split_kv) {
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
  TORCH_CHECK(softcap >= 0, "softcap must be >= 0 (0: not capped)");
  const bool quantized = check_scales(k_cache, k_scale, v_scale);
  Job job{q.size(1), k_cache.size(0), q.size(2), q.size(1) / k_cache.size(0), k_cache.size(2), k_cache.size(1),
          block_tables.size(1), block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
          static_cast<float>(scale), window, static_cast<float>(softcap), kNatural};
  job.split_kv = split_kv;
  auto out = at::empty_like(q);
  PAGODA_DISPATCH_FLOATS(q.scalar_type(), "paged_decode (query)", [&] {
    using Q = scalar_t;
    if (quantized) {
      job.k_scales = k_scale->data_ptr<float>();
      job.v_scales = v_scale->data_ptr<float>();
      decode(job, q.data_ptr<Q>(), k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(), out.data_ptr<Q>(),
             q.size(0));
      return;
    }
    PAGODA_DISPATCH_FLOATS(k_cache.scalar_type(), "paged_decode (KV cache)", [&] {
      decode(job, q.data_ptr<Q>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), out.data_ptr<Q>(),
             q.size(0));
    });
  });
  return out;
}

namespace {

constexpr float kInvInt8Max = 1.f / 127.f;

// Hides a value from the optimiser: -ffast-math may not fold the arithmetic around it (it would turn
// 1 / (top * (1 / 127)) into 127 / top, which rounds differently).
inline float opaque(float x) {
#if defined(__GNUC__)
  asm("" : "+x"(x));
#endif
  return x;
}

// One row into int8 with its scale: scale = max|x| * (1 / 127), q = round-half-even(x * (1 / scale)) in
// fp32, the same bits as kv_cache.quantize_rows.
template <typename S>
void quantize_row(const S* row, int64_t head_dim, int8_t* dst, float* scale) {
#if defined(__AVX512F__)
  if (head_dim % 16 == 0) {  // the same bits, 16 values at a time (max, products and rounding are exact per lane)
    __m512 amax = _mm512_setzero_ps();
    for (int64_t d = 0; d < head_dim; d += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(row + d)));
    const float top = _mm512_reduce_max_ps(amax);
    const float s = opaque(top * kInvInt8Max), inverse = opaque(s > 0.f ? 1.f / s : 0.f);
    const __m512i low = _mm512_set1_epi32(-127), high = _mm512_set1_epi32(127);
    for (int64_t d = 0; d < head_dim; d += 16) {
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(row + d), _mm512_set1_ps(inverse)));  // nearest even
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + d), _mm512_cvtepi32_epi8(_mm512_min_epi32(_mm512_max_epi32(q, low), high)));
    }
    *scale = s;
    return;
  }
#endif
  float top = 0.f;
  for (int64_t d = 0; d < head_dim; ++d) top = std::max(top, std::fabs(to_float(row[d])));
  const float s = opaque(top * kInvInt8Max), inverse = opaque(s > 0.f ? 1.f / s : 0.f);
  for (int64_t d = 0; d < head_dim; ++d) {
    const float q = std::nearbyint(to_float(row[d]) * inverse);
    dst[d] = static_cast<int8_t>(std::clamp(q, -127.f, 127.f));
  }
  *scale = s;
}

// Rows src [T, KVH, D] into the cache [KVH, NB, BS, D] at slots [T]; scales [KVH, NB * BS] for int8 caches.
template <typename S, typename C>
void store_rows(const at::Tensor& src, at::Tensor& cache, float* scales, const int64_t* slots) {
  const int64_t num_tokens = src.size(0), num_kv_heads = src.size(1), head_dim = src.size(2);
  const int64_t num_slots = cache.size(1) * cache.size(2);
  const S* from = src.data_ptr<S>();
  C* to = cache.data_ptr<C>();
  for (int64_t t = 0; t < num_tokens; ++t)  // every slot checked before any row is written
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " out of range");
  const int64_t stride_t = src.stride(0), stride_h = src.stride(1);
  parallel_for(num_tokens, std::max<int64_t>(1, 4096 / (num_kv_heads * head_dim)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const S* row = from + t * stride_t + h * stride_h;
        C* dst = to + (h * num_slots + slots[t]) * head_dim;
        if constexpr (kQuantized<C>) {
          quantize_row(row, head_dim, dst, scales + h * num_slots + slots[t]);
        } else if constexpr (std::is_same_v<S, C>) {
          std::memcpy(dst, row, head_dim * sizeof(C));
        } else {
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<C>(to_float(row[d]));
        }
      }
  });
}

void store_one(const at::Tensor& src, at::Tensor& cache, const std::optional<at::Tensor>& scale,
               const int64_t* slots) {
  TORCH_CHECK(src.dim() == 3 && src.stride(2) == 1, "K/V rows must be [T, KVH, D] with contiguous rows");
  TORCH_CHECK(cache.is_contiguous() && src.size(1) == cache.size(0) && src.size(2) == cache.size(3),
              "K/V rows do not match the cache");
  PAGODA_DISPATCH_FLOATS(src.scalar_type(), "store_kv (K/V)", [&] {
    using S = scalar_t;
    if (cache.scalar_type() == at::kChar) return store_rows<S, int8_t>(src, cache, scale->data_ptr<float>(), slots);
    PAGODA_DISPATCH_FLOATS(cache.scalar_type(), "store_kv (KV cache)", [&] {
      store_rows<S, scalar_t>(src, cache, nullptr, slots);
    });
  });
}

}  // namespace

// Writes the step's K/V rows k, v [T, KVH, D] (rows contiguous, any other
// strides) into the caches [KVH, NB, BS, D] at slot_mapping [T] int64
// (slot = block * BS + offset), converting to the cache dtype; an int8 cache
// gets each row quantized and its scale written to k_scale / v_scale
// [KVH, NB, BS] fp32.
void store_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slot_mapping,
              const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale) {
  slot_mapping = slot_mapping.contiguous();
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.size(0) == k.size(0), "bad slot_mapping");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.sizes() == v_cache.sizes(),
              "K and V caches differ");
  check_scales(k_cache, k_scale, v_scale);
  store_one(k, k_cache, k_scale, slot_mapping.data_ptr<int64_t>());
  store_one(v, v_cache, v_scale, slot_mapping.data_ptr<int64_t>());
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("store_kv", &store_kv);
}
