// What every kernel source shares: threads through torch's OpenMP pool, and
// AVX-512 and AVX2 helpers. Only ATen and the op registration API are included (no
// Python, no pybind11): the library is loaded by torch.ops.load_library.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

// Runs the body (a lambda using scalar_t) for fp32, bf16 or fp16; other
// dtypes are refused with the op's name.
#define PAGODA_DISPATCH_FLOATS(TYPE, NAME, ...) \
  AT_DISPATCH_V2(TYPE, NAME, AT_WRAP(__VA_ARGS__), at::kFloat, at::kBFloat16, at::kHalf)

#if defined(__GNUC__)
#define PAGODA_INLINE inline __attribute__((always_inline))
#else
#define PAGODA_INLINE inline
#endif

#if !defined(_OPENMP) && defined(__GNUC__)
// libgomp's entry point for `#pragma omp parallel` (torch's CPU build ships and
// loads libgomp); weak, so a process without it runs the body inline.
extern "C" void GOMP_parallel(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags)
    __attribute__((weak));
#endif

namespace pagoda {

constexpr float kNegBig = -1e30f;  // "minus infinity" that stays finite under -ffast-math

// Widening to fp32 (bf16 by a shift: exact, and cheaper than c10's conversion).
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }


// at::parallel_for(0, count, grain, body), which runs `body` inline unless
// this file is compiled with OpenMP: without -fopenmp, the same split (one
// contiguous chunk per thread, at least `grain` items each) runs on torch's
// OpenMP threads through libgomp.
template <typename F>
void parallel_for(int64_t count, int64_t grain, const F& body) {
  if (count <= 0) return;
#if !defined(_OPENMP) && defined(__GNUC__)
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (count + grain - 1) / std::max<int64_t>(1, grain));
  if (GOMP_parallel != nullptr && threads > 1 && !at::in_parallel_region()) {
    struct Shared {
      const F* body;
      int64_t count, threads;
      std::atomic<int64_t> next_thread{0};
      std::atomic<bool> failed{false};
      std::exception_ptr error;
    } shared{&body, count, threads};
    auto run = [](void* data) {
      auto& s = *static_cast<Shared*>(data);
      const int64_t t = s.next_thread.fetch_add(1), chunk = (s.count + s.threads - 1) / s.threads;
      if (t >= s.threads || t * chunk >= s.count) return;  // more OpenMP threads than chunks
      try {
        (*s.body)(t * chunk, std::min(s.count, (t + 1) * chunk));
      } catch (...) {
        if (!s.failed.exchange(true)) s.error = std::current_exception();
      }
    };
    GOMP_parallel(run, &shared, 0, 0);  // 0: torch's thread count (no num_threads clause, as in ATen)
    if (shared.error) std::rethrow_exception(shared.error);
    return;
  }
#endif
  at::parallel_for(0, count, grain, body);
}

// parallel_for over [0, count) with one contiguous range per thread of about equal total cost (cost(i) >= 0,
// int64): an even split by count leaves a thread waiting when items differ (decode attention's sequences differ
// in context length by 30x in one batch).
template <typename Cost, typename F>
void parallel_for_balanced(int64_t count, const Cost& cost, const F& body) {
  if (count <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), count);
  if (threads <= 1 || at::in_parallel_region()) {
    body(int64_t(0), count);
    return;
  }
  std::vector<int64_t> start(count + 1, 0);  // start[i]: the cost of the items before i
  for (int64_t i = 0; i < count; ++i) start[i + 1] = start[i] + cost(i);
  std::vector<int64_t> bounds(threads + 1, count);
  bounds[0] = 0;
  for (int64_t t = 1; t < threads; ++t)  // thread t starts at the first item whose start reaches t / threads
    bounds[t] = std::lower_bound(start.begin(), start.end(), (start[count] * t + threads / 2) / threads) - start.begin();
  parallel_for(threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      if (bounds[t] < bounds[t + 1]) body(bounds[t], bounds[t + 1]);
  });
}

#if defined(__AVX512F__)
// exp of 16 floats: 2^n * e^r, n = round(x / ln2), |r| <= ln2 / 2; degree-6 polynomial.
PAGODA_INLINE __m512 exp16(__m512 x) {
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

#if defined(__AVX512BF16__)
// 16 fp32 values rounded to bf16 (nearest even) and widened back.
PAGODA_INLINE __m512 round_bf16x16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// SiLU-and-multiply of 16 bf16 gate and up values (widened): round(silu(gate)) * up, to be rounded by the store.
// The one definition silu_and_mul and the fused int8 gate/up kernel share.
PAGODA_INLINE __m512 silu_mul_bf16x16(__m512 gate, __m512 up) {
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate));
  const __m512 silu = _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  return _mm512_mul_ps(round_bf16x16(silu), up);
}
#endif

// Attention soft-cap of 16 scores: cap * tanh(x / cap), tanh as 1 - 2 / (e^(2x / cap) + 1) (exp16
// saturates, so it stays in [-1, 1]; absolute error ~cap * 1e-7).
PAGODA_INLINE __m512 softcap16(__m512 x, float cap) {
  const __m512 e = exp16(_mm512_mul_ps(x, _mm512_set1_ps(2.f / cap)));
  const __m512 ratio = _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(e, _mm512_set1_ps(1.f)));
  return _mm512_mul_ps(_mm512_sub_ps(_mm512_set1_ps(1.f), ratio), _mm512_set1_ps(cap));
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp of 8 floats: 2^n * e^r, n = round(x / ln2), |r| <= ln2 / 2; degree-7 Taylor polynomial (truncation
// below 1e-8 relative; degree 6 left ~2e-7, which peaked softmaxes turned into 3.6e-6 on fp32 outputs).
PAGODA_INLINE __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), _mm256_set1_ps(-87.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  // 2^n built in the exponent bits: n in [-126, 127] after the clamp above.
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// 8 fp32 / bf16 values widened to fp32.
PAGODA_INLINE __m256 avx2_load8(const float* p) { return _mm256_loadu_ps(p); }
PAGODA_INLINE __m256 avx2_load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// 8 floats rounded to bf16 (nearest even on the bits, as c10::BFloat16 rounds finite values), as 8 int32 lanes.
PAGODA_INLINE __m256i avx2_bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
}

PAGODA_INLINE float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

}  // namespace pagoda
