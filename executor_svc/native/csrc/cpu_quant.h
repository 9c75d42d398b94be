// What the quantized linear layers share (cpu_quant.cpp: int8 weights,
// cpu_qblocks.cpp: GGUF blocks): the dynamic int8 quantization of the
// activations, 16-wide loads and stores of fp32 / bf16 rows, and the shapes of
// the packed weights.
//
// Activations are quantized per row and per group of `group` input features
// (64 for int8 weights: one AMX tile's depth; 32 for GGUF blocks: one block):
// scale = max|x| / 127, q = round(x * (127 / max|x|)) (nearest even), so a
// group's dot product is an exact int32 sum and only the scales are floats.
#pragma once
#include "amx.h"

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#define PAGODA_AMX_INT8 1
#endif
// The int8 GEMM on AVX2 (vpmaddubsw) where the build has no AVX512-VNNI: cpu_quant_avx2.h.
#if !defined(__AVX512VNNI__) && defined(__AVX2__) && defined(__FMA__)
#define PAGODA_AVX2_INT8 1
#include <immintrin.h>
#endif

namespace pagoda::quant {

using BF16 = c10::BFloat16;
constexpr int64_t kCols = 16;   // outputs per weight panel (one AMX tile's columns)
constexpr int64_t kDepth = 64;  // int8 k per AMX tile row; K is padded to a multiple of it
constexpr int64_t kRows = 16;   // rows of x per tile

inline int64_t round_up(int64_t value, int64_t unit) { return (value + unit - 1) / unit * unit; }

// x [M, K] quantized: q [Mp, Kp] int8 (rows padded to 16, K to 64, zeros),
// scale [Mp, G] fp32 (0 for padding) and sum [Mp, G] int32 (sum of q over the
// group; only when asked for), G = Kp / group.
struct QuantizedRows {
  at::Tensor q, scale, sum;
  int64_t rows, mp, kp, groups;
};

QuantizedRows quantize_rows(const at::Tensor& x, int64_t group, bool with_sums);

// Whether this build has the AMX-INT8 kernels and Linux lets this process use AMX.
bool amx_int8_ready();

#if defined(PAGODA_AVX2_INT8)
// 16-wide stores of fp32 / bf16 rows for the AVX2 int8 kernels (cpu_quant_avx2.h, and the GGUF blocks' in
// cpu_qblocks.cpp); the 8-wide loads and the bf16 rounding are cpu_common.h's.
using pagoda::avx2_bf16_bits;
using pagoda::avx2_load8;
PAGODA_INLINE void avx2_store16(float* y, __m256 lo, __m256 hi) {
  _mm256_storeu_ps(y, lo);
  _mm256_storeu_ps(y + 8, hi);
}
PAGODA_INLINE void avx2_store16(BF16* y, __m256 lo, __m256 hi) {
  // packus interleaves the 128-bit lanes (lo 0-3, hi 0-3, lo 4-7, hi 4-7); the permute puts them in order.
  const __m256i packed = _mm256_packus_epi32(avx2_bf16_bits(lo), avx2_bf16_bits(hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm256_permute4x64_epi64(packed, 0xD8));
}

#endif

#if defined(__AVX512F__)
PAGODA_INLINE __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << std::max<int64_t>(left, 0)) - 1);
}

PAGODA_INLINE __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
PAGODA_INLINE __m512 load16(const BF16* p, __mmask16 mask) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

PAGODA_INLINE void store16(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }
PAGODA_INLINE void store16(BF16* p, __m512 v, __mmask16 mask) {
#if defined(__AVX512BF16__)
  _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
#else  // round to nearest even by hand (what vcvtneps2bf16 does for finite values)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
#endif
}
#endif

}  // namespace pagoda::quant
