// fp32 linear layers for the CPU: y = x @ W^T (+ bias) with W packed once.
//
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
#include "cpu_common.h"

namespace {

constexpr int64_t NR = 64;  // outputs per panel: 4 vectors of 16
constexpr int64_t MR = 6;   // rows per micro-kernel call: 6 x 4 accumulators
// Rows of x one work item covers: decode batches stay in one item, so a
// panel is streamed from memory once; prefill splits into items of this size.
constexpr int64_t ROWS_PER_ITEM = 96;

void check_weight(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "weight must be [out, in], got ", w.dim(), " dims");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32, "weight must be float32, got ", w.scalar_type());
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
#endif

// Scalar fallback with the same layout (no AVX-512).
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
#if defined(__AVX512F__)
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
torch::Tensor pack_f32(const torch::Tensor& weight) {
  check_weight(weight);
  const auto w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + NR - 1) / NR;
  auto packed = torch::zeros({panels, k, NR}, w.options());
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
torch::Tensor linear_f32(const torch::Tensor& x, const torch::Tensor& packed, int64_t n,
                         const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu(),
              "x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == NR && packed.scalar_type() == torch::kFloat32,
              "packed weight must come from pack_f32");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == k, "x has ", k, " features, the weight expects ", packed.size(1));
  TORCH_CHECK(n > (panels - 1) * NR && n <= panels * NR, "out_features ", n, " does not match the packed weight");
  const auto xc = x.stride(1) == 1 ? x : x.contiguous();
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == torch::kFloat32 && b.numel() == n, "bias must be float32 [", n, "]");
  }
  auto y = torch::empty({m, n}, x.options());
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

// Whether this build has the AVX-512 kernel (else the scalar loop, which only
// keeps the module importable: callers then use sgemm instead).
bool vectorized() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vectorized", &vectorized);
  m.def("pack_f32", &pack_f32);
  m.def("linear_f32", &linear_f32);
}
