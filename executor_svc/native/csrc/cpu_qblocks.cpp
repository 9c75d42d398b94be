// Linear layers on GGUF blocks kept as stored (Q8_0, Q4_0, Q4_1): every
// 32-weight block is w = d * u + m with u unsigned (Q8_0: u = q + 128, m =
// -128 d; Q4_0: u = q, m = -8 d; Q4_1: d and m as stored), d and m fp16 as in
// the file, so the repack at load is lossless.
//
// Layout: 16-output panels; per panel and block, the quants (4-bit: 4 rows
// of 16 columns x 4 bytes, byte i of row j holding element 4j + i in its low
// nibble and 16 + 4j + i in its high one, which are the file's bytes
// reordered; 8-bit: 8 rows of 16 columns x 4 elements) and then d and m of
// the 16 columns ([P][B][quant bytes], [P][B][2][16] fp16). One 64-byte row
// is what an AVX512-VNNI dot product takes: 16 outputs x 4 k.
//
// Activations: int8 per row and block of 32 (scale xs, sum of q xsum), so
//   y = sum_b xs[r, b] * (d[c, b] * (xq . u)_b + m[c, b] * xsum[r, b]) (+ bias)
// with the dot product exact in int32 (vpdpbusd: unsigned u x signed xq; on AVX2 alone vpmaddubsw, below).
// Steps of more than widen_above rows dequantize a group of panels at a time
// into bf16 (never the whole weight) for the bf16 AMX blocks, or without AMX
// the AVX512-BF16 dot-product blocks (bf16_dot.h), x rounded to bf16.
#include "bf16_dot.h"
#include "cpu_quant.h"
#include "cpu_layer_ops.h"

#include <cmath>
#include <vector>

namespace pagoda::qblocks {

namespace {

using quant::BF16;
using quant::kCols;
using quant::round_up;
#if defined(__AVX512F__)
using quant::load16;
using quant::store16;
using quant::tail_mask;
#endif
constexpr int64_t kBlock = 32;
constexpr int64_t kPanelGroup = 8;

// GGMLQuantizationType values of the block types kept as stored.
enum QType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

struct Format {
  int64_t bits;        // 4 or 8
  int64_t file_bytes;  // one block in the file
  int64_t quant_bytes() const { return bits * kBlock * kCols / 8; }  // one block of a panel
};

Format format_of(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return {4, 18};
    case kQ4_1: return {4, 20};
    case kQ8_0: return {8, 34};
    default: TORCH_CHECK(false, "GGUF block type ", qtype, " is not kept as stored (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8)");
  }
}

inline uint16_t f16_bits(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }

// -(fp16 d) * 2^e as fp16 bits (e = 3, 7: Q4_0's m = -8 d, Q8_0's -128 d): exact unless it overflows.
uint16_t minus_f16_times_pow2(uint16_t bits, int e) {
  c10::Half d;
  d.x = bits;
  const c10::Half m(-static_cast<float>(d) * static_cast<float>(1 << e));
  TORCH_CHECK(std::isfinite(static_cast<float>(m)), "a GGUF block scale is too large to repack");
  return m.x;
}

// One file block of one column into the panel layout (quants at q + column offset, d / m at scales).
void repack_block(const uint8_t* block, int64_t qtype, int64_t column, uint8_t* q, uint16_t* d, uint16_t* m) {
  const uint16_t scale = f16_bits(block);
  d[column] = scale;
  if (qtype == kQ8_0) {
    m[column] = minus_f16_times_pow2(scale, 7);  // -128 d
    for (int64_t e = 0; e < kBlock; ++e) q[(e / 4) * 64 + column * 4 + e % 4] = uint8_t(int8_t(block[2 + e]) + 128);
    return;
  }
  const uint8_t* nibbles = block + (qtype == kQ4_1 ? 4 : 2);
  m[column] = qtype == kQ4_1 ? f16_bits(block + 2) : minus_f16_times_pow2(scale, 3);  // Q4_0: -8 d
  for (int64_t t = 0; t < 16; ++t) q[(t / 4) * 64 + column * 4 + t % 4] = nibbles[t];
}

#if defined(__AVX512VNNI__)
// acc[r] for ROWS rows of x and one panel, over every block.
template <int ROWS, int BITS>
PAGODA_INLINE void vnni_rows(const int8_t* xq, int64_t kp, const float* xs, const int32_t* xsum, int64_t blocks,
                             int64_t groups, const uint8_t* panel, const uint16_t* scales, __m512* acc) {
  constexpr int64_t kQuantBytes = BITS * kBlock * kCols / 8;
  const __m512i low = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* qb = panel + b * kQuantBytes;
    const int8_t* xb = xq + b * kBlock;
    __m512i dot[ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) dot[r] = _mm512_setzero_si512();
    auto add = [&](__m512i w, int64_t k) {  // 16 columns x 4 k at k
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        int32_t quad;
        std::memcpy(&quad, xb + r * kp + k, 4);
        dot[r] = _mm512_dpbusd_epi32(dot[r], w, _mm512_set1_epi32(quad));
      }
    };
    if constexpr (BITS == 4) {
#pragma GCC unroll 4
      for (int64_t j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(qb + 64 * j);
        add(_mm512_and_si512(v, low), 4 * j);
        add(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), 16 + 4 * j);
      }
    } else {
#pragma GCC unroll 8
      for (int64_t j = 0; j < 8; ++j) add(_mm512_loadu_si512(qb + 64 * j), 4 * j);
    }
    const uint16_t* sb = scales + b * 2 * kCols;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + kCols)));
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const float scale = xs[r * groups + b];
      const __m512 scaled = _mm512_mul_ps(_mm512_cvtepi32_ps(dot[r]), d);
      acc[r] = _mm512_fmadd_ps(scaled, _mm512_set1_ps(scale), acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(scale * float(xsum[r * groups + b])), acc[r]);
    }
  }
}
#endif

struct Problem {
  const int8_t* xq;
  const float* xs;
  const int32_t* xsum;
  int64_t m, kp, groups, blocks, n, panels;
  const uint8_t* quants;
  const uint16_t* scales;
  Format format;
};

#if defined(__AVX512F__)
template <typename T>
PAGODA_INLINE void store_rows(const __m512* acc, int64_t rows, const T* bias, T* y, int64_t n, int64_t row0,
                              int64_t p) {
  const int64_t col0 = p * kCols;
  const __mmask16 mask = tail_mask(n - col0);
  const __m512 add = bias ? load16(bias + col0, mask) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) store16(y + (row0 + r) * n + col0, _mm512_add_ps(acc[r], add), mask);
}
#endif

#if defined(PAGODA_AVX2_INT8)
// The VNNI rows on AVX2 + FMA, ROWS rows and one panel (two 8-column halves). vpmaddubsw takes the unsigned
// quants as the unsigned operand: 4-bit quants as they are, 8-bit ones (u up to 255, whose pair sums would
// saturate) as their two nibbles, the high one's sums times 16 in vpmaddwd. A nibble pair's sum is at most
// 2 * 15 * 127 = 3,810, so a block's 8 such products per column add in int16 (<= 30,480 < 2^15) before one
// vpmaddwd: exact int32 block dots, then VNNI's scaling, float op for float op (the same bits as vnni_rows).
template <int ROWS, int BITS>
PAGODA_INLINE void avx2_rows(const int8_t* xq, int64_t kp, const float* xs, const int32_t* xsum, int64_t blocks,
                             int64_t groups, const uint8_t* panel, const uint16_t* scales, __m256 (&acc)[ROWS][2]) {
  constexpr int64_t kQuantBytes = BITS * kBlock * kCols / 8;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), sixteen = _mm256_set1_epi16(16);
  auto broadcast = [&](int r, int64_t k) {
    int32_t quad;
    std::memcpy(&quad, xq + r * kp + k, 4);
    return _mm256_set1_epi32(quad);
  };
#pragma GCC unroll 4
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* qb = panel + b * kQuantBytes;
    const int64_t k0 = b * kBlock;
    const uint16_t* sb = scales + b * 2 * kCols;
    for (int h = 0; h < 2; ++h) {
      __m256i dot[ROWS];
      if constexpr (BITS == 4) {
        __m256i sum[ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r) sum[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int64_t j = 0; j < 4; ++j) {  // row j: elements 4j.. in the low nibbles, 16 + 4j.. in the high ones
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 64 * j + 32 * h));
          const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#pragma GCC unroll 4
          for (int r = 0; r < ROWS; ++r)
            sum[r] = _mm256_add_epi16(sum[r], _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast(r, k0 + 4 * j)),
                                                               _mm256_maddubs_epi16(hi, broadcast(r, k0 + 16 + 4 * j))));
        }
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r) dot[r] = _mm256_madd_epi16(sum[r], ones);
      } else {
        __m256i sum_lo[ROWS], sum_hi[ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r) sum_lo[r] = sum_hi[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int64_t j = 0; j < 8; ++j) {  // row j: elements 4j .. 4j + 3
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qb + 64 * j + 32 * h));
          const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
#pragma GCC unroll 4
          for (int r = 0; r < ROWS; ++r) {
            const __m256i x = broadcast(r, k0 + 4 * j);
            sum_lo[r] = _mm256_add_epi16(sum_lo[r], _mm256_maddubs_epi16(lo, x));
            sum_hi[r] = _mm256_add_epi16(sum_hi[r], _mm256_maddubs_epi16(hi, x));
          }
        }
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; ++r)
          dot[r] = _mm256_add_epi32(_mm256_madd_epi16(sum_lo[r], ones), _mm256_madd_epi16(sum_hi[r], sixteen));
      }
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + 8 * h)));
      const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sb + kCols + 8 * h)));
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) {
        const float scale = xs[r * groups + b];
        const __m256 scaled = _mm256_mul_ps(_mm256_cvtepi32_ps(dot[r]), d);
        acc[r][h] = _mm256_fmadd_ps(scaled, _mm256_set1_ps(scale), acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(scale * float(xsum[r * groups + b])), acc[r][h]);
      }
    }
  }
}

// Rows [row0, row0 + ROWS) of panel p (rows past m not stored): y = acc (+ bias).
template <int ROWS, typename T>
void avx2_pass(const Problem& pr, int64_t row0, int64_t p, const T* bias, T* y) {
  __m256 acc[ROWS][2];
  const int8_t* xq = pr.xq + row0 * pr.kp;
  const float* xs = pr.xs + row0 * pr.groups;
  const int32_t* xsum = pr.xsum + row0 * pr.groups;
  const uint8_t* panel = pr.quants + p * pr.blocks * pr.format.quant_bytes();
  const uint16_t* scales = pr.scales + p * pr.blocks * 2 * kCols;
  if (pr.format.bits == 4) avx2_rows<ROWS, 4>(xq, pr.kp, xs, xsum, pr.blocks, pr.groups, panel, scales, acc);
  else avx2_rows<ROWS, 8>(xq, pr.kp, xs, xsum, pr.blocks, pr.groups, panel, scales, acc);
  const int64_t col0 = p * kCols;
  for (int64_t r = 0; r < std::min<int64_t>(ROWS, pr.m - row0); ++r) {
    T* y_row = y + (row0 + r) * pr.n;
    if (col0 + kCols <= pr.n) {
      __m256 out[2];
      for (int h = 0; h < 2; ++h)
        out[h] = bias ? _mm256_add_ps(acc[r][h], quant::avx2_load8(bias + col0 + 8 * h)) : acc[r][h];
      quant::avx2_store16(y_row + col0, out[0], out[1]);
      continue;
    }
    alignas(32) float lanes[kCols];
    _mm256_store_ps(lanes, acc[r][0]);
    _mm256_store_ps(lanes + 8, acc[r][1]);
    for (int64_t c = 0; c < pr.n - col0; ++c)
      y_row[col0 + c] = T(bias ? lanes[c] + pagoda::to_float(bias[col0 + c]) : lanes[c]);
  }
}

// Threads split the panels; a group of panels stays in L2 while every block of 3 rows passes over it.
template <typename T>
void run_avx2(const Problem& pr, const T* bias, T* y) {
  constexpr int64_t kMr = 3;  // rows per pass: 6 fp32 accumulators and 3 (8-bit: 6) int16 sums in 16 registers
  pagoda::parallel_for(pr.panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p0 = begin; p0 < end; p0 += kPanelGroup) {
      const int64_t p1 = std::min(end, p0 + kPanelGroup);
      for (int64_t row0 = 0; row0 < pr.m; row0 += kMr)
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t rows = std::min(kMr, pr.m - row0);
          if (rows == 3) avx2_pass<3>(pr, row0, p, bias, y);
          else if (rows == 2) avx2_pass<2>(pr, row0, p, bias, y);
          else avx2_pass<1>(pr, row0, p, bias, y);
        }
    }
  });
}
#endif

template <int ROWS, typename T>
void vnni_pass(const Problem& pr, int64_t row0, int64_t p, const T* bias, T* y) {
#if defined(__AVX512VNNI__)
  __m512 acc[ROWS];
  const int8_t* xq = pr.xq + row0 * pr.kp;
  const float* xs = pr.xs + row0 * pr.groups;
  const int32_t* xsum = pr.xsum + row0 * pr.groups;
  const uint8_t* panel = pr.quants + p * pr.blocks * pr.format.quant_bytes();
  const uint16_t* scales = pr.scales + p * pr.blocks * 2 * kCols;
  if (pr.format.bits == 4) vnni_rows<ROWS, 4>(xq, pr.kp, xs, xsum, pr.blocks, pr.groups, panel, scales, acc);
  else vnni_rows<ROWS, 8>(xq, pr.kp, xs, xsum, pr.blocks, pr.groups, panel, scales, acc);
  store_rows(acc, std::min<int64_t>(ROWS, pr.m - row0), bias, y, pr.n, row0, p);
#endif
}

template <typename T>
void run_vnni(const Problem& pr, const T* bias, T* y) {
  constexpr int64_t kMr = 8;  // rows per pass: 8 int32 + 8 fp32 accumulators, the unpacked quants shared
  pagoda::parallel_for(pr.panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p0 = begin; p0 < end; p0 += kPanelGroup) {
      const int64_t p1 = std::min(end, p0 + kPanelGroup);
      for (int64_t row0 = 0; row0 < pr.m; row0 += kMr)
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t rows = std::min(kMr, pr.m - row0);
          if (rows > 4) vnni_pass<8>(pr, row0, p, bias, y);
          else if (rows > 2) vnni_pass<4>(pr, row0, p, bias, y);
          else if (rows > 1) vnni_pass<2>(pr, row0, p, bias, y);
          else vnni_pass<1>(pr, row0, p, bias, y);
        }
    }
  });
}

#if defined(PAGODA_BF16_DOT)
// One panel dequantized to the bf16 AMX kernel's layout ([K / 2, 16, 2]): d * u + m rounded to bf16. A
// 64-byte quant row holds, per column, 4 consecutive elements (8-bit) or two such runs (4-bit nibbles): its
// 16-bit units 2c and 2c + 1 are column c's first and second k-pair, so splitting even and odd units gives
// two rows of the bf16 layout.
void widen_panel(const Problem& pr, int64_t p, BF16* out) {
  const int64_t quant_bytes = pr.format.quant_bytes();
  const __m512i split = _mm512_set_epi16(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1, 30, 28, 26, 24,
                                         22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i pair_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);  // columns 0-7, twice
  const __m512i pair_hi = _mm512_add_epi32(pair_lo, _mm512_set1_epi32(8));                  // columns 8-15
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < pr.blocks; ++b) {
    const uint8_t* qb = pr.quants + (p * pr.blocks + b) * quant_bytes;
    const uint16_t* sb = pr.scales + (p * pr.blocks + b) * 2 * kCols;
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sb + kCols)));
    const __m512 d_lo = _mm512_permutexvar_ps(pair_lo, d), d_hi = _mm512_permutexvar_ps(pair_hi, d);
    const __m512 m_lo = _mm512_permutexvar_ps(pair_lo, m), m_hi = _mm512_permutexvar_ps(pair_hi, m);
    // Quant row v holds elements k0 .. k0 + 3 of every column: pair rows k0 / 2 and k0 / 2 + 1 of the block.
    auto emit = [&](__m512i v, int64_t k0) {
      const __m512i halves = _mm512_permutexvar_epi16(split, v);
      for (int64_t h = 0; h < 2; ++h) {
        const __m256i bytes = h ? _mm512_extracti64x4_epi64(halves, 1) : _mm512_castsi512_si256(halves);
        const __m512 u_lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(bytes)));
        const __m512 u_hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(bytes, 1)));
        BF16* row = out + ((b * kBlock + k0) / 2 + h) * kCols * 2;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(u_lo, d_lo, m_lo)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 16),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(u_hi, d_hi, m_hi)));
      }
    };
    if (pr.format.bits == 8) {
      for (int64_t j = 0; j < 8; ++j) emit(_mm512_loadu_si512(qb + 64 * j), 4 * j);
    } else {
      for (int64_t j = 0; j < 4; ++j) {
        const __m512i v = _mm512_loadu_si512(qb + 64 * j);
        emit(_mm512_and_si512(v, low), 4 * j);
        emit(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), 16 + 4 * j);
      }
    }
  }
}

// x as bf16 rows: x itself where it is bf16 and contiguous, else a copy rounded to bf16 with `mp` rows
// (the rows past x's zero).
inline at::Tensor bf16_rows(const at::Tensor& x, int64_t mp) {
  if (x.scalar_type() == at::kBFloat16 && mp == x.size(0) && x.is_contiguous()) return x;
  at::Tensor xb = at::zeros({mp, x.size(1)}, x.options().dtype(at::kBFloat16));
  xb.slice(0, 0, x.size(0)).copy_(x);
  return xb;
}

// run_widened without AMX: the same widened panels multiplied on AVX512-BF16 dot-product blocks of 6 rows x 4
// panels, a group of ~512 KiB of panels widened at a time.
template <typename T>
void run_widened_dot(const at::Tensor& x, const Problem& pr, const T* bias, T* y) {
  const int64_t k = x.size(1), group = pagoda::bf16_dot_panel_group(k), panel_elems = k * kCols;
  const at::Tensor xb = bf16_rows(x, pr.m);
  const BF16* xd = xb.data_ptr<BF16>();
  pagoda::parallel_for(pr.panels, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<BF16> wide;  // reused across calls
    wide.resize(std::max<size_t>(wide.size(), group * panel_elems));
    __m512 acc[pagoda::kDotRows * pagoda::kDotPanels];
    for (int64_t g0 = begin; g0 < end; g0 += group) {
      const int64_t g1 = std::min(end, g0 + group);
      for (int64_t p = g0; p < g1; ++p) widen_panel(pr, p, wide.data() + (p - g0) * panel_elems);
      for (int64_t row0 = 0; row0 < pr.m; row0 += pagoda::kDotRows) {
        const int64_t rows = std::min<int64_t>(pagoda::kDotRows, pr.m - row0);
        for (int64_t p = g0; p < g1; p += pagoda::kDotPanels) {
          const int64_t count = std::min<int64_t>(pagoda::kDotPanels, g1 - p);
          pagoda::bf16_dot(xd + row0 * k, k, rows, wide.data() + (p - g0) * panel_elems, panel_elems, k / 2, count,
                           acc);
          for (int64_t j = 0; j < count; ++j) {
            const int64_t col0 = (p + j) * kCols;
            const __mmask16 mask = tail_mask(pr.n - col0);
            const __m512 add = bias ? load16(bias + col0, mask) : _mm512_setzero_ps();
            for (int64_t r = 0; r < rows; ++r)
              store16(y + (row0 + r) * pr.n + col0, _mm512_add_ps(acc[r * count + j], add), mask);
          }
        }
      }
    }
  });
}
#endif

#if defined(PAGODA_AMX)
template <typename T>
void run_widened(const at::Tensor& x, const Problem& pr, const T* bias, T* y) {
  constexpr int64_t kRows = quant::kRows;
  const int64_t k = x.size(1), mp = round_up(pr.m, kRows), chunks = k / 32;
  const int64_t kGroup = pagoda::prefill_panel_group(k);
  const at::Tensor xb = bf16_rows(x, mp);
  const BF16* xd = xb.data_ptr<BF16>();
  pagoda::parallel_for(pr.panels, 1, [&](int64_t begin, int64_t end) {
    pagoda::configure_square_tiles();
    thread_local std::vector<BF16> wide;  // reused across calls
    wide.resize(std::max<size_t>(wide.size(), kGroup * k * kCols));
    alignas(64) float out[32 * 32];
    auto store = [&](const float* tile, int64_t row0, int64_t rows, int64_t p) {
      const int64_t col0 = p * kCols;
      const __mmask16 mask = tail_mask(pr.n - col0);
      const __m512 add = bias ? load16(bias + col0, mask) : _mm512_setzero_ps();
      for (int64_t r = 0; r < std::min(rows, pr.m - row0); ++r)
        store16(y + (row0 + r) * pr.n + col0, _mm512_add_ps(_mm512_load_ps(tile + 32 * r), add), mask);
    };
    for (int64_t g0 = begin; g0 < end; g0 += kGroup) {
      const int64_t g1 = std::min(end, g0 + kGroup);
      for (int64_t p = g0; p < g1; ++p) widen_panel(pr, p, wide.data() + (p - g0) * k * kCols);
      for (int64_t row0 = 0; row0 < mp; row0 += 2 * kRows) {
        const bool two_rows = row0 + 2 * kRows <= mp;
        for (int64_t p = g0; p < g1; p += 2) {
          const BF16* a = wide.data() + (p - g0) * k * kCols;
          const BF16* b = a + k * kCols;
          const bool two_panels = p + 1 < g1;
          const BF16* xr = xd + row0 * k;
          if (two_rows && two_panels) pagoda::amx_block<2, 2>(xr, k, a, b, chunks, out);
          else if (two_rows) pagoda::amx_block<2, 1>(xr, k, a, b, chunks, out);
          else if (two_panels) pagoda::amx_block<1, 2>(xr, k, a, b, chunks, out);
          else pagoda::amx_block<1, 1>(xr, k, a, b, chunks, out);
          const int64_t rows = two_rows ? 2 * kRows : kRows;
          store(out, row0, rows, p);
          if (two_panels) store(out + 16, row0, rows, p + 1);
        }
      }
    }
    _tile_release();
  });
}
#endif

// Whether widened steps run on the bf16 AMX blocks (this build has them and Linux lets this process use AMX).
bool amx_widens() {
#if defined(PAGODA_AMX)
  return pagoda::request_amx();
#else
  return false;
#endif
}

bool can_widen() {
#if defined(PAGODA_BF16_DOT)
  return true;
#else
  return amx_widens();
#endif
}

}  // namespace

// GGUF rows [N, K / 32 * block bytes] (uint8, as in the file) -> (quants [P, K / 32, quant bytes] uint8,
// scales [P, K / 32, 2, 16] fp16 as int16: d then m of the 16 columns).
std::tuple<at::Tensor, at::Tensor> pack_qblocks(const at::Tensor& data, int64_t qtype, int64_t in_features) {
  const Format format = format_of(qtype);
  TORCH_CHECK(in_features % kBlock == 0, "in_features ", in_features, " is not a multiple of 32");
  const int64_t blocks = in_features / kBlock;
  TORCH_CHECK(data.dim() == 2 && data.scalar_type() == at::kByte && data.size(1) == blocks * format.file_bytes,
              "data must be uint8 [out, ", blocks * format.file_bytes, "] (GGUF rows of this type)");
  const auto rows = data.contiguous();
  const int64_t n = rows.size(0), panels = (n + kCols - 1) / kCols;
  auto quants = at::zeros({panels, blocks, format.quant_bytes()}, rows.options());
  auto scales = at::zeros({panels, blocks, 2, kCols}, rows.options().dtype(at::kShort));
  const uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* q = quants.data_ptr<uint8_t>();
  uint16_t* s = reinterpret_cast<uint16_t*>(scales.data_ptr<int16_t>());
  pagoda::parallel_for(panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < std::min(kCols, n - p * kCols); ++c)
        for (int64_t b = 0; b < blocks; ++b) {
          const uint8_t* block = src + (p * kCols + c) * blocks * format.file_bytes + b * format.file_bytes;
          uint16_t* sb = s + (p * blocks + b) * 2 * kCols;
          repack_block(block, qtype, c, q + (p * blocks + b) * format.quant_bytes(), sb, sb + kCols);
        }
  });
  return {quants, scales};
}

// Rows (output features) of a packed weight dequantized: [R, K] float32, every row when rows is None (the
// embedding lookups of a tied LM head read its panels: the blocks are held once).
at::Tensor qblocks_rows(const at::Tensor& quants, const at::Tensor& scales, int64_t qtype, int64_t n,
                        const std::optional<at::Tensor>& rows) {
  const Format format = format_of(qtype);
  TORCH_CHECK(quants.dim() == 3 && quants.scalar_type() == at::kByte && quants.size(2) == format.quant_bytes() &&
                  quants.is_contiguous() && scales.scalar_type() == at::kShort && scales.is_contiguous(),
              "quants and scales must come from pack_qblocks for this type");
  const int64_t blocks = quants.size(1), k = blocks * kBlock;
  const at::Tensor ids =
      rows.has_value() ? rows->to(at::kLong).contiguous() : at::arange(n, quants.options().dtype(at::kLong));
  const int64_t count = ids.numel();
  auto out = at::empty({count, k}, quants.options().dtype(at::kFloat));
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < n, "row ", id[i], " is out of range [0, ", n, ")");
  const uint8_t* q = quants.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>());
  float* o = out.data_ptr<float>();
  pagoda::parallel_for(count, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t p = id[i] / kCols, c = id[i] % kCols;
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* qb = q + (p * blocks + b) * format.quant_bytes();
        const uint16_t* sb = s + (p * blocks + b) * 2 * kCols;
        c10::Half d, m;
        d.x = sb[c];
        m.x = sb[kCols + c];
        for (int64_t e = 0; e < kBlock; ++e) {
          const int64_t t = format.bits == 8 ? e : e % 16;
          const uint8_t byte = qb[(t / 4) * 64 + c * 4 + t % 4];
          const int u = format.bits == 8 ? byte : (e < 16 ? byte & 0x0F : byte >> 4);
          o[i * k + b * kBlock + e] = static_cast<float>(d) * static_cast<float>(u) + static_cast<float>(m);
        }
      }
    }
  });
  return out;
}

// x [M, K] fp32 / bf16 @ W^T (+ bias [N], x's dtype) -> [M, N], W from pack_qblocks.
at::Tensor linear_qblocks(const at::Tensor& x, const at::Tensor& quants, const at::Tensor& scales, int64_t qtype,
                          int64_t n, const std::optional<at::Tensor>& bias, int64_t widen_above) {
  const Format format = format_of(qtype);
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a 2-D float32 or bfloat16 CPU tensor");
  TORCH_CHECK(quants.dim() == 3 && quants.scalar_type() == at::kByte && quants.size(2) == format.quant_bytes() &&
                  quants.is_contiguous(),
              "quants must come from pack_qblocks for this type");
  const int64_t m = x.size(0), k = x.size(1), panels = quants.size(0), blocks = quants.size(1);
  TORCH_CHECK(k == blocks * kBlock, "x has ", k, " features, the weight expects ", blocks * kBlock);
  TORCH_CHECK(n > (panels - 1) * kCols && n <= panels * kCols, "out_features ", n,
              " does not match the packed weight");
  TORCH_CHECK(scales.scalar_type() == at::kShort && scales.is_contiguous() &&
                  scales.numel() == panels * blocks * 2 * kCols,
              "scales must come from pack_qblocks of this weight");
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == x.scalar_type() && b.numel() == n, "bias must be ", x.scalar_type(), " [", n, "]");
  }
  const bool widen = m > widen_above;
  TORCH_CHECK(!widen || can_widen(), "this build or process cannot widen GGUF blocks to bf16 (needs AVX512-BF16 or AMX-BF16)");
  auto y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const quant::QuantizedRows rows = widen ? quant::QuantizedRows{} : quant::quantize_rows(x, kBlock, true);
  const Problem problem{widen ? nullptr : rows.q.data_ptr<int8_t>(),
                        widen ? nullptr : rows.scale.data_ptr<float>(),
                        widen ? nullptr : rows.sum.data_ptr<int32_t>(),
                        m, widen ? 0 : rows.kp, widen ? 0 : rows.groups, blocks, n, panels,
                        quants.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>()),
                        format};
#if defined(__AVX512VNNI__) || defined(PAGODA_AVX2_INT8)
  AT_DISPATCH_V2(x.scalar_type(), "linear_qblocks", AT_WRAP([&] {
    const scalar_t* bd = b.defined() ? b.data_ptr<scalar_t>() : nullptr;
    scalar_t* yd = y.data_ptr<scalar_t>();
#if defined(PAGODA_AMX)
    if (widen && amx_widens()) {
      run_widened<scalar_t>(x, problem, bd, yd);
      return;
    }
#endif
#if defined(PAGODA_BF16_DOT)
    if (widen) {
      run_widened_dot<scalar_t>(x, problem, bd, yd);
      return;
    }
#endif
#if defined(__AVX512VNNI__)
    run_vnni<scalar_t>(problem, bd, yd);
#else
    run_avx2<scalar_t>(problem, bd, yd);
#endif
  }), at::kFloat, at::kBFloat16);
#else
  TORCH_CHECK(false, "this build has no GGUF block kernel (needs AVX512-VNNI, or AVX2 + FMA)");
#endif
  return y;
}

}  // namespace pagoda::qblocks

// linear_qblocks needs "avx512_vnni" or "avx2_int8" in cpu_features() (and "avx512_bf16" or "amx" to widen large
// steps).
TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("pack_qblocks", &pagoda::qblocks::pack_qblocks);
  m.impl("linear_qblocks", &pagoda::qblocks::linear_qblocks);
  m.impl("qblocks_rows", &pagoda::qblocks::qblocks_rows);
}
