// Paged decode attention for the CPU: one query token per sequence, K/V read
// in place from the block-indexed cache (no gather copy). Two passes per
// (sequence, kv head): scores of the GQA group over the context, then softmax
// and the weighted sum of V. Parallel over sequences x kv heads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename Q, typename C>
void decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out,
            double scale, int64_t window) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const Q* q_ptr = q.data_ptr<Q>();
  const C* k_ptr = k_cache.data_ptr<C>();
  const C* v_ptr = v_cache.data_ptr<C>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  Q* out_ptr = out.data_ptr<Q>();
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * head_dim), acc(group * head_dim), row(head_dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t context = lens[seq];
      const int64_t first = window > 0 ? std::max<int64_t>(0, context - window) : 0;
      const int64_t length = context - first;
      scores.assign(group * length, 0.f);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          query[g * head_dim + d] = to_float(q_ptr[(seq * num_heads + kv_head * group + g) * head_dim + d]) * scale;
      const C* k_head = k_ptr + kv_head * num_blocks * block_size * head_dim;
      const C* v_head = v_ptr + kv_head * num_blocks * block_size * head_dim;
      const int64_t* table = tables + seq * max_blocks;
      // Pass 1: scores. Each key row is widened to float once, then dotted
      // with every query of the group (loops the compiler vectorises).
      for (int64_t block = first / block_size; block * block_size < context; ++block) {
        const C* key_block = k_head + table[block] * block_size * head_dim;
        const int64_t lo = std::max(first, block * block_size), hi = std::min(context, (block + 1) * block_size);
        for (int64_t pos = lo; pos < hi; ++pos) {
          const C* key = key_block + (pos - block * block_size) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) row[d] = to_float(key[d]);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = query.data() + g * head_dim;
            float dot = 0.f;
            for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * row[d];
            scores[g * length + pos - first] = dot;
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * length;
        const float max_score = *std::max_element(s, s + length);
        float total = 0.f;
        for (int64_t i = 0; i < length; ++i) { s[i] = std::exp(s[i] - max_score); total += s[i]; }
        const float inv = 1.f / total;
        for (int64_t i = 0; i < length; ++i) s[i] *= inv;
      }
      // Pass 2: probability-weighted sum of the value rows.
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t block = first / block_size; block * block_size < context; ++block) {
        const C* value_block = v_head + table[block] * block_size * head_dim;
        const int64_t lo = std::max(first, block * block_size), hi = std::min(context, (block + 1) * block_size);
        for (int64_t pos = lo; pos < hi; ++pos) {
          const C* value = value_block + (pos - block * block_size) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) row[d] = to_float(value[d]);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * length + pos - first];
            float* a = acc.data() + g * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          out_ptr[(seq * num_heads + kv_head * group + g) * head_dim + d] = static_cast<Q>(acc[g * head_dim + d]);
    }
  });
}

template <typename Q>
void dispatch_cache(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bt,
                    const at::Tensor& lens, at::Tensor& out, double scale, int64_t window) {
  switch (k.scalar_type()) {
    case at::kFloat: return decode<Q, float>(q, k, v, bt, lens, out, scale, window);
    case at::kBFloat16: return decode<Q, c10::BFloat16>(q, k, v, bt, lens, out, scale, window);
    case at::kHalf: return decode<Q, c10::Half>(q, k, v, bt, lens, out, scale, window);
    default: TORCH_CHECK(false, "unsupported KV cache dtype");
  }
}

}  // namespace

// q: [D, H, Dh] contiguous; caches: [KVH, NB, BS, Dh] contiguous;
// block_tables: [D, MB] int64; context_lens: [D] int64. Returns [D, H, Dh].
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                        at::Tensor context_lens, double scale, int64_t window) {
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV cache must be contiguous");
  auto out = at::empty_like(q);
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_cache<float>(q, k_cache, v_cache, block_tables, context_lens, out, scale, window); break;
    case at::kBFloat16: dispatch_cache<c10::BFloat16>(q, k_cache, v_cache, block_tables, context_lens, out, scale, window); break;
    case at::kHalf: dispatch_cache<c10::Half>(q, k_cache, v_cache, block_tables, context_lens, out, scale, window); break;
    default: TORCH_CHECK(false, "unsupported query dtype");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode); }
