// Fused elementwise ops of the decoder layer for the CPU: RMSNorm (alone and
// with the residual add), SiLU-and-multiply, rotary embeddings in place, and
// the greedy argmax over bf16 logits.
//
// Each is one pass over its rows instead of the 3-10 torch kernels (and fp32
// copies) the unfused code runs; at decode batch sizes those launches cost
// more than the arithmetic. Math is fp32; results are rounded to the tensor's
// dtype at the same points as the Hugging Face modules round them (so bf16
// outputs equal theirs bit for bit up to the order of a sum).
#include "cpu_common.h"
#include "cpu_layer_ops.h"
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using BF16 = c10::BFloat16;
using Half = c10::Half;

using pagoda::to_float;

// Rounds to T's precision (round to nearest even), staying in fp32.
template <typename T>
inline float round_to(float x) {
  if constexpr (std::is_same_v<T, BF16>) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    std::memcpy(&x, &bits, sizeof(x));
    return x;
  } else if constexpr (std::is_same_v<T, Half>) {
    return static_cast<float>(static_cast<Half>(x));
  } else {
    return x;
  }
}

template <typename T>
inline T from_float(float x) {
  if constexpr (std::is_same_v<T, BF16>) {
    BF16 out;
    uint32_t bits;
    x = round_to<BF16>(x);
    std::memcpy(&bits, &x, sizeof(bits));
    out.x = static_cast<uint16_t>(bits >> 16);
    return out;
  } else {
    return static_cast<T>(x);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
inline __m512 load_bf16x16(const BF16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

using pagoda::round_bf16x16;
inline void store_bf16x16(BF16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

// 16 pairs of the rotary update (same rounding as the scalar loop of rotary_).
inline void rotate16(BF16* x1, BF16* x2, const BF16* c, const BF16* s) {
  const __m512 a = load_bf16x16(x1), b = load_bf16x16(x2), cf = load_bf16x16(c), sf = load_bf16x16(s);
  store_bf16x16(x1, _mm512_sub_ps(round_bf16x16(_mm512_mul_ps(a, cf)), round_bf16x16(_mm512_mul_ps(b, sf))));
  store_bf16x16(x2, _mm512_add_ps(round_bf16x16(_mm512_mul_ps(b, cf)), round_bf16x16(_mm512_mul_ps(a, sf))));
}

// 16 outputs of round(round(silu(gate)) * up) in bf16 (vcvtneps2bf16 rounds to nearest even).
inline void silu_mul16(const BF16* gate, const BF16* up, BF16* out) {
  store_bf16x16(out, pagoda::silu_mul_bf16x16(load_bf16x16(gate), load_bf16x16(up)));
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !(defined(__AVX512F__) && defined(__AVX512BF16__))
// The norms and the rotary update 8 values at a time where the build has AVX2 + FMA but no AVX512-BF16 (AMD
// Zen 2 / Zen 3, Intel before Cooper Lake), bf16 only; the compiler does not vectorise their scalar loops
// (rotary 4.4-6x faster, norms 1.1-1.2x, at 64-2,048 rows of SmolLM2's widths). bf16 rounds as round_to does
// (nearest even on the bits): the same outputs as the scalar loops, except where a norm's sum of squares (in 8
// lanes, as the AVX512-BF16 path's 16) moves a value across a rounding point. SiLU stays scalar: the compiler
// vectorises that loop (libmvec's expf), and exp8 was no faster.
#define PAGODA_AVX2_OPS 1
using pagoda::avx2_bf16_bits;
inline __m256 load_bf16x8(const BF16* p) { return pagoda::avx2_load8(p); }

inline __m256 round_bf16x8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(avx2_bf16_bits(v), 16)); }

inline void store_bf16x8(BF16* p, __m256 v) {
  const __m256i bits = avx2_bf16_bits(v);  // 8 x uint16 in int32 lanes
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}

// 8 pairs of the rotary update.
inline void rotate8(BF16* x1, BF16* x2, const BF16* c, const BF16* s) {
  const __m256 a = load_bf16x8(x1), b = load_bf16x8(x2), cf = load_bf16x8(c), sf = load_bf16x8(s);
  store_bf16x8(x1, _mm256_sub_ps(round_bf16x8(_mm256_mul_ps(a, cf)), round_bf16x8(_mm256_mul_ps(b, sf))));
  store_bf16x8(x2, _mm256_add_ps(round_bf16x8(_mm256_mul_ps(b, cf)), round_bf16x8(_mm256_mul_ps(a, sf))));
}

// norm_row of a bf16 row (hidden % 8 == 0); with res: res = round(res + in) first (as norm_row_bf16).
inline void norm_row_bf16x8(const BF16* in, BF16* res, const BF16* weight, BF16* out, int64_t hidden, float eps) {
  __m256 squares = _mm256_setzero_ps();
  for (int64_t i = 0; i < hidden; i += 8) {
    __m256 v = load_bf16x8(in + i);
    if (res) {
      v = round_bf16x8(_mm256_add_ps(load_bf16x8(res + i), v));
      store_bf16x8(res + i, v);
    }
    squares = _mm256_fmadd_ps(v, v, squares);
  }
  const float inv = 1.f / std::sqrt(pagoda::sum8(squares) / static_cast<float>(hidden) + eps);
  const __m256 scale = _mm256_set1_ps(inv);
  const BF16* x = res ? res : in;
  for (int64_t i = 0; i < hidden; i += 8)
    store_bf16x8(out + i, _mm256_mul_ps(load_bf16x8(weight + i), round_bf16x8(_mm256_mul_ps(load_bf16x8(x + i), scale))));
}
#endif

// Rows per parallel chunk: about 4K elements, so that decode batches of a few dozen rows split across threads too.
inline int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, 4096 / std::max<int64_t>(1, row_elements)); }

// One row: out = weight * round(x * rsqrt(mean(x^2) + eps)), x already rounded.
template <typename T>
inline void norm_row(const float* x, const T* weight, T* out, int64_t hidden, float eps) {
  float sum = 0.f;
  for (int64_t i = 0; i < hidden; ++i) sum += x[i] * x[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
  for (int64_t i = 0; i < hidden; ++i) out[i] = from_float<T>(to_float(weight[i]) * round_to<T>(x[i] * inv));
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// norm_row of a bf16 row (hidden % 16 == 0), 16 values at a time: the same roundings, the sum of squares in 16
// lanes (another order of the sum, as torch's own reduction). With res: res = round(res + in) first.
inline void norm_row_bf16(const BF16* in, BF16* res, const BF16* weight, BF16* out, int64_t hidden, float eps) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < hidden; i += 16) {
    __m512 v = load_bf16x16(in + i);
    if (res) {
      v = round_bf16x16(_mm512_add_ps(load_bf16x16(res + i), v));
      store_bf16x16(res + i, v);
    }
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(hidden) + eps);
  const __m512 scale = _mm512_set1_ps(inv);
  const BF16* x = res ? res : in;
  for (int64_t i = 0; i < hidden; i += 16)
    store_bf16x16(out + i, _mm512_mul_ps(load_bf16x16(weight + i), round_bf16x16(_mm512_mul_ps(load_bf16x16(x + i), scale))));
}
#endif

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, double eps,
                   at::Tensor* residual) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const T* src = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  T* res = residual ? residual->data_ptr<T>() : nullptr;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, BF16>) {
    if (hidden % 16 == 0) {
      pagoda::parallel_for(rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
          norm_row_bf16(src + r * hidden, res ? res + r * hidden : nullptr, w, dst + r * hidden, hidden,
                        static_cast<float>(eps));
      });
      return;
    }
  }
#elif defined(PAGODA_AVX2_OPS)
  if constexpr (std::is_same_v<T, BF16>) {
    if (hidden % 8 == 0) {
      pagoda::parallel_for(rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
          norm_row_bf16x8(src + r * hidden, res ? res + r * hidden : nullptr, w, dst + r * hidden, hidden,
                          static_cast<float>(eps));
      });
      return;
    }
  }
#endif
  pagoda::parallel_for(rows, grain_rows(hidden), [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    for (int64_t r = begin; r < end; ++r) {
      const T* in = src + r * hidden;
      if (res) {  // residual = round(residual + x), normed from the rounded sum
        T* acc = res + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) {
          row[i] = round_to<T>(to_float(acc[i]) + to_float(in[i]));
          acc[i] = from_float<T>(row[i]);
        }
      } else {
        for (int64_t i = 0; i < hidden; ++i) row[i] = to_float(in[i]);
      }
      norm_row(row.data(), w, dst + r * hidden, hidden, static_cast<float>(eps));
    }
  });
}

// One row: out = round(round(silu(gate)) * up).
template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t width) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, BF16>) {
    for (; i + 16 <= width; i += 16) silu_mul16(gate + i, up + i, out + i);
  }
#endif
  for (; i < width; ++i) {
    const float g = to_float(gate[i]);
    out[i] = from_float<T>(round_to<T>(g / (1.f + std::exp(-g))) * to_float(up[i]));
  }
}

// One head of one token rotated in place: halves x1, x2 [half] with its cos/sin rows.
template <typename T>
void rotate_row(T* x1, T* x2, const T* c, const T* s, int64_t half) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, BF16>) {
    for (; i + 16 <= half; i += 16) rotate16(x1 + i, x2 + i, c + i, s + i);
  }
#elif defined(PAGODA_AVX2_OPS)
  if constexpr (std::is_same_v<T, BF16>) {
    for (; i + 8 <= half; i += 8) rotate8(x1 + i, x2 + i, c + i, s + i);
  }
#endif
  for (; i < half; ++i) {
    const float a = to_float(x1[i]), b = to_float(x2[i]), cf = to_float(c[i]), sf = to_float(s[i]);
    x1[i] = from_float<T>(round_to<T>(a * cf) - round_to<T>(b * sf));
    x2[i] = from_float<T>(round_to<T>(b * cf) + round_to<T>(a * sf));
  }
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "expected a contiguous [N, H] CPU tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous(),
              "weight must be [H] in the input's dtype");
}

}  // namespace

// x [N, H] -> weight * normalized x (Llama RMSNorm).
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  check_rows(x, weight);
  auto out = at::empty_like(x);
  PAGODA_DISPATCH_FLOATS(x.scalar_type(), "rms_norm", [&] { rms_norm_impl<scalar_t>(x, weight, out, eps, nullptr); });
  return out;
}

// residual += x (in place, rounded to the dtype); returns RMSNorm(residual).
at::Tensor add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.is_contiguous(),
              "residual must match x");
  auto out = at::empty_like(x);
  PAGODA_DISPATCH_FLOATS(x.scalar_type(), "add_rms_norm",
                         [&] { rms_norm_impl<scalar_t>(x, weight, out, eps, &residual); });
  return out;
}

// gate_up [N, 2I] (gate then up) -> round(round(silu(gate)) * up) [N, I].
at::Tensor silu_and_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "expected a contiguous [N, 2I] CPU tensor");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  auto out = at::empty({rows, width}, gate_up.options());
  PAGODA_DISPATCH_FLOATS(gate_up.scalar_type(), "silu_and_mul", [&] {
    using T = scalar_t;
    const T* src = gate_up.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    pagoda::parallel_for(rows, grain_rows(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* gate = src + r * 2 * width;
        silu_mul_row(gate, gate + width, dst + r * width, width);
      }
    });
  });
  return out;
}

// Rotates x [T, N, D] in place (rotate_half convention) with cos/sin tables
// [max_len, D / 2] looked up at positions [T] int64:
// first half = round(round(x1 cos) - round(x2 sin)), second = round(round(x2 cos) + round(x1 sin)).
void rotary_(at::Tensor x, at::Tensor positions, at::Tensor cos_table, at::Tensor sin_table) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "x must be a CPU [T, N, D] tensor with contiguous rows");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 && positions.size(0) == x.size(0),
              "positions must be int64 [T]");
  TORCH_CHECK(cos_table.dim() == 2 && cos_table.size(1) * 2 == x.size(2) && cos_table.sizes() == sin_table.sizes() &&
                  cos_table.is_contiguous() && sin_table.is_contiguous() &&
                  cos_table.scalar_type() == x.scalar_type() && sin_table.scalar_type() == x.scalar_type(),
              "cos/sin tables must be contiguous [max_len, D / 2] in x's dtype");
  positions = positions.contiguous();
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2, max_len = cos_table.size(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_len, "position ", pos[t], " outside the rotary table");
  PAGODA_DISPATCH_FLOATS(x.scalar_type(), "rotary_", [&] {
    using T = scalar_t;
    T* base = x.data_ptr<T>();
    const T* cos_base = cos_table.data_ptr<T>();
    const T* sin_base = sin_table.data_ptr<T>();
    const int64_t stride_t = x.stride(0), stride_n = x.stride(1);
    pagoda::parallel_for(tokens, grain_rows(heads * 2 * half), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T* c = cos_base + pos[t] * half;
        const T* s = sin_base + pos[t] * half;
        for (int64_t n = 0; n < heads; ++n) {
          T* x1 = base + t * stride_t + n * stride_n;
          rotate_row(x1, x1 + half, c, s, half);
        }
      }
    });
  });
}

namespace {

// First index of the largest value of a row (bf16 or fp32); a NaN counts as
// largest (as torch.argmax). NaNs are found from the bits (-ffast-math assumes none).
inline bool is_nan(BF16 x) { return (x.x & 0x7FFFu) > 0x7F80u; }
inline bool is_nan(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return (bits & 0x7FFFFFFFu) > 0x7F800000u;
}

template <typename T>
int64_t argmax_scalar(const T* row, int64_t begin, int64_t n, int64_t best, float best_value) {
  for (int64_t i = begin; i < n; ++i) {
    if (is_nan(row[i])) return i;
    const float v = to_float(row[i]);
    if (v > best_value) best = i, best_value = v;
  }
  return best;
}

#if defined(__AVX512F__)
// 16 values as fp32 lanes plus a mask of the NaN lanes.
inline __m512 load16_checked(const BF16* p, __mmask16* nan) {
  const __m512i raw = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  *nan |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(raw, _mm512_set1_epi32(0x7FFF)), _mm512_set1_epi32(0x7F80));
  return _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
}
inline __m512 load16_checked(const float* p, __mmask16* nan) {
  const __m512i raw = _mm512_loadu_si512(p);
  *nan |= _mm512_cmpgt_epi32_mask(_mm512_and_si512(raw, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
  return _mm512_castsi512_ps(raw);
}
#endif

template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
#if defined(__AVX512F__)
  if (n >= 16) {
    const __m512i step = _mm512_set1_epi32(16);
    __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), max_i = index;
    __mmask16 nan = 0;
    __m512 max_v = load16_checked(row, &nan);
    int64_t start = 16;
    for (; start + 16 <= n; start += 16) {
      index = _mm512_add_epi32(index, step);
      const __m512 v = load16_checked(row + start, &nan);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, max_v, _CMP_GT_OQ);  // strict: a lane keeps its first max
      max_v = _mm512_mask_mov_ps(max_v, greater, v);
      max_i = _mm512_mask_mov_epi32(max_i, greater, index);
    }
    if (nan) return argmax_scalar(row, 0, n, 0, to_float(row[0]));  // finds the first NaN in order
    alignas(64) float values[16];
    alignas(64) int32_t indices[16];
    _mm512_store_ps(values, max_v);
    _mm512_store_si512(indices, max_i);
    int64_t best = indices[0];
    float best_value = values[0];
    for (int lane = 1; lane < 16; ++lane)
      if (values[lane] > best_value || (values[lane] == best_value && indices[lane] < best))
        best = indices[lane], best_value = values[lane];
    return argmax_scalar(row, start, n, best, best_value);
  }
#endif
  if (is_nan(row[0])) return 0;
  return argmax_scalar(row, 1, n, 0, to_float(row[0]));
}

}  // namespace

// Row-wise argmax of bf16 or fp32 logits [B, V] -> int64 [B] (torch.argmax is
// not vectorised for bf16 and slow for fp32 rows this long).
at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0 &&
                  (logits.scalar_type() == at::kBFloat16 || logits.scalar_type() == at::kFloat),
              "expected bf16 or fp32 [B, V] CPU logits with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* dst = out.data_ptr<int64_t>();
  AT_DISPATCH_V2(logits.scalar_type(), "argmax_rows", AT_WRAP([&] {
    const scalar_t* base = logits.data_ptr<scalar_t>();
    pagoda::parallel_for(rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) dst[r] = argmax_row(base + r * stride, vocab);
    });
  }), at::kFloat, at::kBFloat16);
  return out;
}

TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_", &rotary_);
  m.impl("argmax_rows", &argmax_rows);
}
