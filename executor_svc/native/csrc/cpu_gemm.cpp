// Linear layers for the CPU: y = x @ W^T (+ bias) with W packed once.
//
// fp32 (AVX-512 FMAs; AVX2 + FMA the same sums in 8-wide slices):
// W [N, K] is stored as column panels of NR = 64 outputs, each K x 64 and
// contiguous ([ceil(N / 64), K, 64], zero-padded): a panel is read front to
// back once per step, which is what decode needs (the weights are streamed
// from memory for a few rows of x; MKL's sgemm on the plain layout reads
// them at a fraction of the memory bandwidth at these sizes). The
// micro-kernel keeps an MR x 64 block of y in 24 registers and adds one
// rank-1 update per k, so it also runs near the FMA peak for prefill.
//
// Each output is one fp32 sum over k in order (FMA), like any blocked GEMM
// up to the order of the sum.
//
// bf16 (AMX tiles, where the CPU and kernel allow them): W as 16-output
// panels of k-pairs, one 1 KB tile per 32 k. Decode batches (up to 64 rows)
// keep 4 row tiles of y per panel, so each weight tile is read once per step
// and the weights stream at memory speed; prefill blocks 32 rows x 2 panels
// with the panels of a group kept in L2. fp32 accumulation, rounded to bf16
// once (as oneDNN and F.linear do). Without AMX, on AVX512-BF16 CPUs, the
// same panels run on dot-product blocks of 6 rows x 4 panels (bf16_dot.h),
// in panel groups that stay in L2 while the row blocks pass over them.
#include "amx.h"
#include "bf16_dot.h"
#include "cpu_layer_ops.h"

namespace {

using BF16 = c10::BFloat16;

constexpr int64_t NR = 64;  // outputs per panel: 4 vectors of 16
constexpr int64_t MR = 6;   // rows per micro-kernel call: 6 x 4 accumulators
// Rows of x one work item covers: decode batches stay in one item, so a
// panel is streamed from memory once; prefill splits into items of this size.
constexpr int64_t ROWS_PER_ITEM = 96;

void check_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "weight must be [out, in], got ", w.dim(), " dims");
  TORCH_CHECK(w.scalar_type() == at::kFloat, "weight must be float32, got ", w.scalar_type());
  TORCH_CHECK(w.device().is_cpu(), "weight must be on the CPU");
}

#if defined(__AVX512F__)
// y[r, 0:64] (+)= sum_k x[r, k] * panel[k, 0:64] for rows r < ROWS (<= MR).
template <int ROWS>
PAGODA_INLINE void micro_kernel(const float* x, int64_t ldx, const float* panel, int64_t k_size, float* y,
                                int64_t ldy, int64_t columns, const float* bias, bool prefetch,
                                const char* next, int64_t next_lines) {
  __m512 acc[ROWS][4];
#pragma GCC unroll 6
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_size; ++k) {
    const float* b = panel + k * NR;
    if (prefetch) {  // the first row tile streams the panel from memory
      _mm_prefetch(reinterpret_cast<const char*>(b + 16 * NR), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b + 16 * NR + 16), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b + 16 * NR + 32), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b + 16 * NR + 48), _MM_HINT_T0);
    }
    if (k < next_lines) _mm_prefetch(next + k * 64, _MM_HINT_T1);  // the next panel, one line per k
    const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16), b2 = _mm512_loadu_ps(b + 32),
                 b3 = _mm512_loadu_ps(b + 48);
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(a, b2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(a, b3, acc[r][3]);
    }
  }
#pragma GCC unroll 4
  for (int j = 0; j < 4; ++j) {
    const int64_t left = columns - 16 * j;
    if (left <= 0) break;
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const __m512 add = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
#pragma GCC unroll 6
    for (int r = 0; r < ROWS; ++r) _mm512_mask_storeu_ps(y + r * ldy + 16 * j, mask, _mm512_add_ps(acc[r][j], add));
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// The same sums on AVX2 + FMA (16 ymm registers): the panel's 64 columns in
// slices of 8 * VECS, rows x VECS accumulators each (6 x 2, 3 x 4 or 1 x 8,
// so a lone decode row still keeps 8 FMA chains in flight). Each output is
// the same fp32 FMA chain over k in order plus the bias as the AVX-512
// kernel's: the two builds give the same bits.
template <int ROWS, int VECS>
PAGODA_INLINE void micro_slice(const float* x, int64_t ldx, const float* panel, int64_t k_size, float* y,
                               int64_t ldy, int64_t left, const float* bias, bool prefetch, const char* next,
                               int64_t next_lines) {
  __m256 acc[ROWS][VECS];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < VECS; ++j) acc[r][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_size; ++k) {
    const float* b = panel + k * NR;
    if (prefetch)  // the first row tile streams the slice's lines from memory
      for (int j = 0; j < VECS; j += 2) _mm_prefetch(reinterpret_cast<const char*>(b + 16 * NR + 8 * j), _MM_HINT_T0);
    if (k < next_lines) _mm_prefetch(next + k * 64, _MM_HINT_T1);  // the next panel, one line per k
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < VECS; ++j) acc[r][j] = _mm256_fmadd_ps(a, _mm256_loadu_ps(b + 8 * j), acc[r][j]);
    }
  }
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
#pragma GCC unroll 8
  for (int j = 0; j < VECS; ++j) {
    const int64_t n = std::min<int64_t>(left - 8 * j, 8);
    if (n <= 0) break;
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lane);
    const __m256 add = bias ? _mm256_maskload_ps(bias + 8 * j, mask) : _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) _mm256_maskstore_ps(y + r * ldy + 8 * j, mask, _mm256_add_ps(acc[r][j], add));
  }
}

// y[r, 0:columns] (+)= sum_k x[r, k] * panel[k, 0:columns] for rows r < ROWS (<= MR), slice by slice.
template <int ROWS>
PAGODA_INLINE void micro_kernel(const float* x, int64_t ldx, const float* panel, int64_t k_size, float* y,
                                int64_t ldy, int64_t columns, const float* bias, bool prefetch,
                                const char* next, int64_t next_lines) {
  constexpr int VECS = ROWS == 1 ? 8 : (ROWS <= 3 ? 4 : 2);
  for (int64_t c = 0; c < columns; c += 8 * VECS) {
    micro_slice<ROWS, VECS>(x, ldx, panel + c, k_size, y + c, ldy, columns - c, bias ? bias + c : nullptr,
                            prefetch, next, c == 0 ? next_lines : 0);
  }
}
#endif

// Scalar fallback with the same layout (neither AVX-512 nor AVX2 + FMA).
void micro_kernel_scalar(const float* x, int64_t ldx, int64_t rows, const float* panel, int64_t k_size, float* y,
                         int64_t ldy, int64_t columns, const float* bias) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < columns; ++c) {
      float sum = 0.f;
      for (int64_t k = 0; k < k_size; ++k) sum += x[r * ldx + k] * panel[k * NR + c];
      y[r * ldy + c] = sum + (bias ? bias[c] : 0.f);
    }
}

// Rows [row_begin, row_end) of y for one panel. While the row tiles after
// the first compute from cache, they prefetch `next` (the panel the thread
// reads next, or null) into L2, so memory and arithmetic overlap.
void panel_rows(const float* x, int64_t ldx, int64_t row_begin, int64_t row_end, const float* panel, int64_t k_size,
                float* y, int64_t ldy, int64_t columns, const float* bias, const float* next) {
  const int64_t next_lines = next ? k_size * NR * 4 / 64 : 0;
  for (int64_t r = row_begin; r < row_end; r += MR) {
    const int64_t tile = (r - row_begin) / MR;
    const char* pf = reinterpret_cast<const char*>(next) + tile * k_size * 64;
    const int64_t pf_lines = std::max<int64_t>(0, std::min(k_size, next_lines - tile * k_size));
    const int64_t rows = std::min(MR, row_end - r);
    const float* xr = x + r * ldx;
    float* yr = y + r * ldy;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    const bool prefetch = r == row_begin;
    switch (rows) {
      case 6: micro_kernel<6>(xr, ldx, panel, k_size, yr, ldy, columns, bias, prefetch, pf, pf_lines); break;
      case 5: micro_kernel<5>(xr, ldx, panel, k_size, yr, ldy, columns, bias, prefetch, pf, pf_lines); break;
      case 4: micro_kernel<4>(xr, ldx, panel, k_size, yr, ldy, columns, bias, prefetch, pf, pf_lines); break;
      case 3: micro_kernel<3>(xr, ldx, panel, k_size, yr, ldy, columns, bias, prefetch, pf, pf_lines); break;
      case 2: micro_kernel<2>(xr, ldx, panel, k_size, yr, ldy, columns, bias, prefetch, pf, pf_lines); break;
      default: micro_kernel<1>(xr, ldx, panel, k_size, yr, ldy, columns, bias, prefetch, pf, pf_lines); break;
    }
#else
    micro_kernel_scalar(xr, ldx, rows, panel, k_size, yr, ldy, columns, bias);
#endif
  }
}

}  // namespace

// W [N, K] float32 -> panels [ceil(N / 64), K, 64] (zero-padded past N).
at::Tensor pack_f32(const at::Tensor& weight) {
  check_weight(weight);
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + NR - 1) / NR;
  auto packed = at::zeros({panels, k, NR}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  pagoda::parallel_for(panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t columns = std::min(NR, n - p * NR);
      for (int64_t c = 0; c < columns; ++c) {
        const float* row = src + (p * NR + c) * k;
        float* out = dst + p * k * NR + c;
        for (int64_t i = 0; i < k; ++i) out[i * NR] = row[i];
      }
    }
  });
  return packed;
}

// x [M, K] float32 (rows may be strided) @ W^T (+ bias [N]) -> [M, N].
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NR && packed.scalar_type() == at::kFloat,
              "packed weight must come from pack_f32");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, "x has ", k, " features, the weight expects ", packed.size(1));
  TORCH_CHECK(n > (panels - 1) * NR && n <= panels * NR, "out_features ", n, " does not match the packed weight");
  const auto xc = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kFloat && b.numel() == n, "bias must be float32 [", n, "]");
  }
  auto y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t ldx = xc.stride(0), row_items = (m + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
  pagoda::parallel_for(panels * row_items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item / row_items, row_begin = (item % row_items) * ROWS_PER_ITEM;
      const int64_t columns = std::min(NR, n - p * NR), row_end = std::min(m, row_begin + ROWS_PER_ITEM);
      const float* next = row_end == m && p + 1 < panels ? wp + (p + 1) * k * NR : nullptr;
      panel_rows(xp, ldx, row_begin, row_end, wp + p * k * NR, k, yp + p * NR, n, columns, bp ? bp + p * NR : nullptr,
                 next);
    }
  });
  return y;
}


namespace {

// bf16 weights for AMX: panels of 16 outputs, K padded to a multiple of 32
// and stored as k-pairs ([ceil(N / 16), Kp / 2, 16, 2]): one AMX B tile is
// 16 k-pairs of a panel, 1 KB contiguous.
constexpr int64_t kAmxCols = 16, kAmxDepth = 32, kAmxRows = 16;
constexpr int64_t kAmxRowTiles = 4;  // C tiles per pass: 64 rows of x

#if defined(PAGODA_AMX)
using pagoda::request_amx;

// Rows [row0, row0 + 16 * tiles) of x (padded, ldx elements) times one panel
// into out [16 * tiles, 16] fp32. Tiles 0-3: C; 4: A; 5: B.
template <int TILES>
PAGODA_INLINE void amx_panel(const BF16* x, int64_t ldx, const BF16* panel, int64_t k_chunks, float* out) {
  _tile_zero(0);
  if constexpr (TILES > 1) _tile_zero(1);
  if constexpr (TILES > 2) _tile_zero(2);
  if constexpr (TILES > 3) _tile_zero(3);
  const int64_t stride = ldx * int64_t(sizeof(BF16));
  for (int64_t kc = 0; kc < k_chunks; ++kc) {
    const BF16* b = panel + kc * kAmxDepth * kAmxCols;
    const char* next = reinterpret_cast<const char*>(b + 4 * kAmxDepth * kAmxCols);  // four chunks ahead
    for (int l = 0; l < 16; ++l) _mm_prefetch(next + 64 * l, _MM_HINT_T0);
    _tile_loadd(5, b, 64);
    const BF16* a = x + kc * kAmxDepth;
    _tile_loadd(4, a, stride);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (TILES > 1) {
      _tile_loadd(4, a + 16 * ldx, stride);
      _tile_dpbf16ps(1, 4, 5);
    }
    if constexpr (TILES > 2) {
      _tile_loadd(4, a + 32 * ldx, stride);
      _tile_dpbf16ps(2, 4, 5);
    }
    if constexpr (TILES > 3) {
      _tile_loadd(4, a + 48 * ldx, stride);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, out, 64);
  if constexpr (TILES > 1) _tile_stored(1, out + 256, 64);
  if constexpr (TILES > 2) _tile_stored(2, out + 512, 64);
  if constexpr (TILES > 3) _tile_stored(3, out + 768, 64);
}

using pagoda::amx_block;

#endif

// W [N, K] bf16 -> [ceil(N / 16), Kp / 2, 16, 2] (zero-padded).
at::Tensor pack_bf16(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "weight must be a 2-D bfloat16 CPU tensor");
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kAmxCols - 1) / kAmxCols;
  const int64_t kp = (k + kAmxDepth - 1) / kAmxDepth * kAmxDepth;
  auto packed = at::zeros({panels, kp / 2, kAmxCols, 2}, w.options());
  const BF16* src = w.data_ptr<BF16>();
  BF16* dst = packed.data_ptr<BF16>();
  pagoda::parallel_for(panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t c = 0; c < std::min(kAmxCols, n - p * kAmxCols); ++c) {
        const BF16* row = src + (p * kAmxCols + c) * k;
        BF16* out = dst + p * kp * kAmxCols + c * 2;
        for (int64_t i = 0; i < k; ++i) out[(i / 2) * kAmxCols * 2 + (i % 2)] = row[i];
      }
  });
  return packed;
}

#if defined(PAGODA_BF16_DOT)
// linear_bf16 on AVX512-BF16 dot products: x [m, kp] bf16 (rows ldx = kp apart) times the panels.
void dot_linear_bf16(const BF16* xd, int64_t m, int64_t kp, const BF16* wd, int64_t panels, int64_t n,
                     const BF16* bd, BF16* yd) {
  const int64_t group = pagoda::bf16_dot_panel_group(kp), panel_elems = kp * kAmxCols;
  pagoda::parallel_for(panels, 1, [&](int64_t begin, int64_t end) {
    __m512 acc[pagoda::kDotRows * pagoda::kDotPanels];
    for (int64_t g0 = begin; g0 < end; g0 += group) {
      const int64_t g1 = std::min(end, g0 + group);
      for (int64_t row0 = 0; row0 < m; row0 += pagoda::kDotRows) {
        const int64_t rows = std::min<int64_t>(pagoda::kDotRows, m - row0);
        for (int64_t p = g0; p < g1; p += pagoda::kDotPanels) {
          const int64_t count = std::min<int64_t>(pagoda::kDotPanels, g1 - p);
          pagoda::bf16_dot(xd + row0 * kp, kp, rows, wd + p * panel_elems, panel_elems, kp / 2, count, acc);
          for (int64_t j = 0; j < count; ++j) {
            const int64_t col0 = (p + j) * kAmxCols, cols = std::min(kAmxCols, n - col0);
            const __mmask16 mask = cols == 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
            const __m512 add =
                bd ? _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(mask, bd + col0)) : _mm512_setzero_ps();
            for (int64_t r = 0; r < rows; ++r)
              _mm256_mask_storeu_epi16(yd + (row0 + r) * n + col0, mask,
                                       (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r * count + j], add)));
          }
        }
      }
    }
  });
}
#endif

}  // namespace

// Whether the bf16 kernels (linear_bf16, paged_prefill) run here: AMX tiles this process may use, or
// AVX512-BF16 dot products.
bool bf16_kernels_ready() {
#if defined(PAGODA_BF16_DOT)
  return true;
#elif defined(PAGODA_AMX)
  return request_amx();
#else
  return false;
#endif
}

// x [M, K] bf16 @ W^T (+ bias [N] bf16) -> [M, N] bf16, W from pack_bf16.
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                          const std::optional<at::Tensor>& bias) {
#if defined(PAGODA_AMX) || defined(PAGODA_BF16_DOT)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(),
              "x must be a 2-D bfloat16 CPU tensor");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kAmxCols && packed.size(3) == 2 &&
                  packed.scalar_type() == at::kBFloat16,
              "packed weight must come from pack_bf16");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0), kp = packed.size(1) * 2;
  TORCH_CHECK(kp == (k + kAmxDepth - 1) / kAmxDepth * kAmxDepth, "x has ", k, " features, the weight does not");
  TORCH_CHECK(n > (panels - 1) * kAmxCols && n <= panels * kAmxCols, "out_features ", n,
              " does not match the packed weight");
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == at::kBFloat16 && b.numel() == n, "bias must be bfloat16 [", n, "]");
  }
  TORCH_CHECK(bf16_kernels_ready(), "the kernel does not allow AMX for this process");
  auto y = at::empty({m, n}, x.options());
  if (m == 0) return y;
#if defined(PAGODA_BF16_DOT)
#if defined(PAGODA_AMX)
  const bool dot = !request_amx();
#else
  constexpr bool dot = true;
#endif
  if (dot) {
    at::Tensor xk = x;
    if (kp != k || x.stride(1) != 1 || x.stride(0) != k) {
      xk = at::zeros({m, kp}, x.options());
      xk.slice(1, 0, k).copy_(x);
    }
    const BF16* bd = b.defined() ? b.data_ptr<BF16>() : nullptr;
    dot_linear_bf16(xk.data_ptr<BF16>(), m, kp, packed.data_ptr<BF16>(), panels, n, bd, y.data_ptr<BF16>());
    return y;
  }
#endif
#if defined(PAGODA_AMX)
  // x padded to whole tiles: rows to 16, columns to Kp (zeros contribute nothing).
  const int64_t mp = (m + kAmxRows - 1) / kAmxRows * kAmxRows;
  at::Tensor xp = x;
  if (mp != m || kp != k || x.stride(1) != 1 || x.stride(0) != k) {
    xp = at::zeros({mp, kp}, x.options());
    xp.slice(0, 0, m).slice(1, 0, k).copy_(x);
  }
  const BF16* xd = xp.data_ptr<BF16>();
  const BF16* wd = packed.data_ptr<BF16>();
  const BF16* bd = b.defined() ? b.data_ptr<BF16>() : nullptr;
  BF16* yd = y.data_ptr<BF16>();
  const int64_t k_chunks = kp / kAmxDepth;
  auto store = [&](const float* out, int64_t ld, int64_t row0, int64_t rows, int64_t p) {
    const int64_t col0 = p * kAmxCols, cols = std::min(kAmxCols, n - col0);
    const __mmask16 mask = cols == 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
    const __m512 add =
        bd ? _mm512_cvtpbh_ps((__m256bh)_mm256_maskz_loadu_epi16(mask, bd + col0)) : _mm512_setzero_ps();
    for (int64_t r = 0; r < std::min(rows, m - row0); ++r) {
      const __m512 v = _mm512_add_ps(_mm512_load_ps(out + r * ld), add);
      _mm256_mask_storeu_epi16(yd + (row0 + r) * n + col0, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  };
  pagoda::parallel_for(panels, 1, [&](int64_t begin, int64_t end) {
    pagoda::configure_square_tiles();
    alignas(64) float out[kAmxRowTiles * kAmxRows * kAmxCols];
    if (mp > kAmxRowTiles * kAmxRows) {
      // Prefill: panel groups that stay in L2, 32-row blocks of x that stay
      // in L1 across the group's panel pairs.
      const int64_t kGroup = pagoda::prefill_panel_group(kp);
      for (int64_t g0 = begin; g0 < end; g0 += kGroup) {
        const int64_t g1 = std::min(end, g0 + kGroup);
        for (int64_t row0 = 0; row0 < mp; row0 += 2 * kAmxRows) {
          const bool two_rows = row0 + 2 * kAmxRows <= mp;
          const BF16* xr = xd + row0 * kp;
          for (int64_t p = g0; p < g1; p += 2) {
            const BF16* a = wd + p * kp * kAmxCols;
            const BF16* b = a + kp * kAmxCols;
            const bool two_panels = p + 1 < g1;
            if (two_rows && two_panels) amx_block<2, 2>(xr, kp, a, b, k_chunks, out);
            else if (two_rows) amx_block<2, 1>(xr, kp, a, b, k_chunks, out);
            else if (two_panels) amx_block<1, 2>(xr, kp, a, b, k_chunks, out);
            else amx_block<1, 1>(xr, kp, a, b, k_chunks, out);
            const int64_t rows = two_rows ? 2 * kAmxRows : kAmxRows;
            store(out, 32, row0, rows, p);
            if (two_panels) store(out + 16, 32, row0, rows, p + 1);
          }
        }
      }
      _tile_release();
      return;
    }
    for (int64_t p = begin; p < end; ++p) {
      const BF16* panel = wd + p * kp * kAmxCols;
      for (int64_t row0 = 0; row0 < mp; row0 += kAmxRowTiles * kAmxRows) {
        const int64_t tiles = std::min(kAmxRowTiles, (mp - row0) / kAmxRows);
        const BF16* xr = xd + row0 * kp;
        switch (tiles) {
          case 4: amx_panel<4>(xr, kp, panel, k_chunks, out); break;
          case 3: amx_panel<3>(xr, kp, panel, k_chunks, out); break;
          case 2: amx_panel<2>(xr, kp, panel, k_chunks, out); break;
          default: amx_panel<1>(xr, kp, panel, k_chunks, out); break;
        }
        store(out, kAmxCols, row0, tiles * kAmxRows, p);
      }
    }
    _tile_release();
  });
#endif
  return y;
#else
  TORCH_CHECK(false, "this build has no bf16 panel kernel (needs AMX-BF16 or AVX512-BF16)");
#endif
}

// Without AVX-512 or AVX2 + FMA (cpu_features() lacks "f32_panels")
// linear_f32 runs a scalar loop that only keeps the op defined: callers then
// use sgemm instead.
// linear_bf16 needs bf16_kernels_ready().
TORCH_LIBRARY_IMPL(pagoda, CPU, m) {
  m.impl("pack_f32", &pack_f32);
  m.impl("linear_f32", &linear_f32);
  m.impl("pack_bf16", &pack_bf16);
  m.impl("linear_bf16", &linear_bf16);
}
